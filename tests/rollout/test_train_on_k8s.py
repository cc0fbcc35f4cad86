"""The train loop in cluster mode: harness Jobs, remote servers, PostgreSQL, a 2-process learner.

Everything but the cluster is real: the loop runs as `python -m harnessrl.train --smoke` in two
`jax.distributed` CPU processes (one device each, one global mesh; process 0 drives), its Jobs
go through the official client to the FAKE API server (tests/k8s/fake_apiserver.py), which plays
kubelet: each Job's own sidecar runs from its init container exactly as the launcher configured it
(argv, env from the Secrets and the pod's fields, on the pod's own loopback address), then the
harness command. The harness asks for model "default"; the real embedded server (standing in for
vLLM) serves only "policy", as the shipped vLLM does; calls are recorded into a throwaway
PostgreSQL; weights travel as HF exports through `/admin/load_weights`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from harnessrl.fleet.sidecar import free_port
from harnessrl.model.formats.load import load_policy
from harnessrl.serve.app import start_server
from harnessrl.serve.config import ServeConfig
from harnessrl.traces import open_store

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


fake = _load("fake_apiserver", "tests/k8s/fake_apiserver.py")
pg = _load("pg_cluster", "tests/traces/pg_cluster.py")
pg_server, pg_dsn = pg.pg_server, pg.pg_dsn  # fixtures

HARNESS = (
    "{python} {examples}/answer_agent.py --question $(HARNESSRL_TASK_PROMPT) "
    "--max-tokens 8 --max-attempts 2 --feedback"
)


def _kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": server}}],
                "users": [{"name": "fake", "user": {"token": "fake"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                "current-context": "fake",
            }
        )
    )
    return path


def test_train_loop_runs_harness_jobs_and_pushes_weights_to_remote_servers(
    tmp_path: Path, pg_dsn: str, xla_cache_env: dict[str, str]
) -> None:
    model, tokenizer = load_policy("tiny", seed=0)  # what `--smoke` trains: the same weights
    serve = ServeConfig(
        port=0, num_slots=4, max_model_len=256, prefill_buckets=(64, 128),
        served_model_name="policy",
    )  # fmt: skip
    server = start_server(model, tokenizer, serve)
    token = "control-token-of-the-test"
    secrets = {"harnessrl-store": {"url": pg_dsn}, "harnessrl-control": {"token": token}}
    out = tmp_path / "run"
    try:
        run = lambda job: fake.Outcome("run", 0.0)  # noqa: E731
        with fake.FakeKube(run, secrets=secrets) as kube:
            env = dict(
                os.environ,
                **xla_cache_env,
                XLA_FLAGS="--xla_force_host_platform_device_count=1",
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}",
                JAX_NUM_PROCESSES="2",
                KUBECONFIG=str(_kubeconfig(tmp_path / "kubeconfig", kube.url)),
                HARNESSRL_CONTROL_TOKEN=token,
            )
            argv = [
                sys.executable, "-m", "harnessrl.train", "--smoke", f"run.out_dir={out}",
                "rollout.launcher=kubernetes", "rollout.kubernetes.image=registry.example.com/harness:1",
                f"rollout.store={pg_dsn}", f"rollout.servers={server.url}",
                "rollout.weight_sync=embedded", "serve.served_model_name=policy",
                f"serve.admin_token={server.admin_token}",  # the one the server made
                f"rollout.harness={HARNESS}",
            ]  # fmt: skip
            procs = [
                subprocess.Popen(
                    argv, cwd=ROOT, env=dict(env, JAX_PROCESS_ID=str(pid)),
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                )
                for pid in (0, 1)
            ]  # fmt: skip
            try:
                outputs = [p.communicate(timeout=900)[0] for p in procs]
            finally:
                for p in procs:
                    p.kill()
            for p, output in zip(procs, outputs, strict=True):
                assert p.returncode == 0, output[-4000:]
            assert outputs[0].strip().splitlines()[-1].startswith("train: eval_reward_start=")
            assert "process 1: done at learner step 2" in outputs[1], list(kube.logs.values())[:2]
            created = [body for _, body in kube.created]
        # 3 evals of 4 tasks and 2 steps of 2 tasks × 2 runs, one Job each, all cleaned up.
        assert len(created) == 20 and set(kube.deleted) == {b["metadata"]["name"] for b in created}
        # Jobs created after a push start their sidecar at the pushed version.
        versions = []
        for body in created:
            args = body["spec"]["template"]["spec"]["initContainers"][0]["args"]
            versions.append(
                int(args[args.index("--policy-version") + 1]) if "--policy-version" in args else 0
            )
        assert versions == sorted(versions) and set(versions) == {0, 1, 2}
        # The remote server loaded the last export, and the loop kept only the latest two.
        assert server.engine.version == 2
        assert sorted(p.name for p in (out / "weights").iterdir()) == ["v000001", "v000002"]
        # Every run's calls went through the sidecar into PostgreSQL, tagged with the version.
        store = open_store(pg_dsn)
        try:
            records = store.rollouts()
            assert len(records) == 20
            calls = [c for r in records for c in store.calls(r.rollout_id)]
            assert calls and {1, 2} <= {c.policy_version for c in calls}
            # The harness's "default" reached a server serving only "policy": the pods' sidecars
            # rewrote the name, as the train config told the launcher (else every call is a 404).
            assert {c.status for c in calls} == {200}
        finally:
            store.close()
    finally:
        server.stop()


def test_kubernetes_launcher_needs_a_shared_store_and_servers() -> None:
    from harnessrl.config import load_config

    base = [
        "rollout.launcher=kubernetes",
        "rollout.kubernetes.image=registry.example.com/harness:1",
    ]
    with pytest.raises(ValueError, match=r"rollout.store=postgresql://"):
        load_config(None, base)
    with pytest.raises(ValueError, match=r"needs rollout.servers"):
        load_config(None, [*base, "rollout.store=postgresql://u@db/traces"])
    with pytest.raises(ValueError, match=r"needs rollout.kubernetes.image"):
        load_config(None, ["rollout.launcher=kubernetes"])
