"""KubernetesLauncher against an in-process FAKE API server (tests/k8s/fake_apiserver.py).

The official client talks real HTTP to the fake; the fake plays Job controller and kubelet.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes import client

from harnessrl.data.advantages import compute_advantages
from harnessrl.pods.k8s import (
    KubernetesLauncher,
    KubernetesLauncherConfig,
    job_manifest,
    job_name,
    label_value,
)
from harnessrl.rollout.tasks import RunSpec, Task
from harnessrl.traces.schema import RolloutRecord, RolloutState
from proxy_sidecar.inject.webhook import SIDECAR_NAME, SidecarSpec

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "fake_apiserver", ROOT / "tests/k8s/fake_apiserver.py"
)
assert _spec and _spec.loader
fake = importlib.util.module_from_spec(_spec)
sys.modules["fake_apiserver"] = fake
_spec.loader.exec_module(fake)

CFG = KubernetesLauncherConfig(
    image="registry.example.com/harness:1.0",
    command=("python", "-m", "harness", "--task", "{task_file}"),
    sidecar=SidecarSpec(image="registry.example.com/harnessrl:0.1.0", upstream="http://vllm:8000"),
    creates_per_s=200.0,
    watch_timeout_s=2,
    deadline_grace_s=0.5,
)


def spec(i: int, task: str = "sum-3", timeout_s: float = 30.0) -> RunSpec:
    t = Task(task, "What is 1+2? Answer with just the number.", "3")
    return RunSpec(
        f"step0-{task}-{i}", t, f"g-{task}", i, "http://sidecar/rollouts/x/v1", timeout_s
    )


def launcher(kube: Any, **overrides: Any) -> KubernetesLauncher:
    cfg = KubernetesLauncherConfig(**{**CFG.__dict__, **overrides})
    api = client.ApiClient(client.Configuration(host=kube.url))
    return KubernetesLauncher(cfg, api_client=api)


def by_rollout(outcomes: dict[str, Any]) -> Any:
    def decide(job: dict[str, Any]) -> Any:
        return outcomes[job["metadata"]["annotations"]["harnessrl.io/rollout-id"]]

    return decide


def test_create_watch_complete_and_delete() -> None:
    specs = [spec(i) for i in range(3)]
    outcomes = {
        s.rollout_id: fake.Outcome("complete", 0.05 * i, log="3\n") for i, s in enumerate(specs)
    }
    with fake.FakeKube(by_rollout(outcomes)) as kube:
        lz = launcher(kube)
        lz.policy_version = 4  # set by the train loop after a weight push
        results = lz.run(specs)
        assert [r.rollout_id for r in results] == [s.rollout_id for s in specs]
        assert all(r.state is RolloutState.SUCCEEDED for r in results)
        assert [(r.exit_code, r.output, r.stdout) for r in results] == [(0, "3", "3\n")] * 3
        assert sorted(kube.deleted) == sorted(job_name(s.rollout_id) for s in specs)  # cleaned up
        assert kube.jobs == {}
        body = kube.created[0][1]
    kubernetes_validate.validate(body, "1.33", strict=True)
    assert body["metadata"]["labels"]["harnessrl.io/group"] == "g-sum-3"
    assert body["metadata"]["labels"]["harnessrl.io/task"] == "sum-3"
    assert body["spec"]["template"]["spec"]["initContainers"][0]["args"][-2:] == [
        "--policy-version",
        "4",
    ]


def test_job_manifest_wires_sidecar_env_task_and_limits() -> None:
    job = job_manifest(spec(7, timeout_s=90.5), CFG, batch="b1")
    kubernetes_validate.validate(job, "1.33", strict=True)
    js = job["spec"]
    assert js["backoffLimit"] == 0 and js["activeDeadlineSeconds"] == 91
    assert js["ttlSecondsAfterFinished"] == CFG.ttl_s
    pod = js["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (sidecar,) = pod["initContainers"]
    assert sidecar["name"] == SIDECAR_NAME and sidecar["restartPolicy"] == "Always"
    (harness,) = pod["containers"]
    env = {e["name"]: e["value"] for e in harness["env"]}
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:8080/rollouts/step0-sum-3-7/v1"
    assert env["HARNESSRL_ROLLOUT_ID"] == "step0-sum-3-7"
    assert env["HARNESSRL_TASK_PROMPT"].startswith("What is 1+2?")
    assert harness["command"][-1] == env["HARNESSRL_TASK_FILE"] == "/var/run/harnessrl/task.json"
    labels = job["metadata"]["labels"]
    assert (
        labels["harnessrl.io/rollout"] == "step0-sum-3-7" and labels["harnessrl.io/batch"] == "b1"
    )
    assert '"answer": "3"' in js["template"]["metadata"]["annotations"]["harnessrl.io/task"]


def test_failed_and_evicted_jobs_are_failed_runs_never_trained() -> None:
    specs = [spec(i) for i in range(4)]
    outcomes = {
        specs[0].rollout_id: fake.Outcome("complete", log="3\n"),
        specs[1].rollout_id: fake.Outcome("complete", log="4\n"),
        specs[2].rollout_id: fake.Outcome("fail", exit_code=2, log="3\nTraceback: boom\n"),
        specs[3].rollout_id: fake.Outcome("evict", log="3\n"),
    }
    with fake.FakeKube(by_rollout(outcomes)) as kube:
        results = launcher(kube).run(specs)
    right, wrong, failed, evicted = results
    assert right.state is wrong.state is RolloutState.SUCCEEDED
    assert failed.state is RolloutState.FAILED and failed.exit_code == 2
    assert "BackoffLimitExceeded" in failed.stderr and failed.stdout == "3\nTraceback: boom\n"
    assert evicted.state is RolloutState.FAILED and "pod evicted" in evicted.stderr
    # Into the data layer as the train loop hands them over: the evicted run even printed the
    # right answer, yet a failed Job never reaches training.
    records = [
        RolloutRecord(
            r.rollout_id, "sum-3", "g-sum-3", state=r.state, reward=float(r.output.startswith("3"))
        )
        for r in results
    ]
    adv = compute_advantages(records)
    assert set(adv.advantages) == {right.rollout_id, wrong.rollout_id}
    assert adv.excluded == {failed.rollout_id: "failed", evicted.rollout_id: "failed"}


def test_deadline_exceeded_and_silent_cluster_both_time_out() -> None:
    specs = [spec(0, timeout_s=5), spec(1, timeout_s=0.5)]
    outcomes = {
        specs[0].rollout_id: fake.Outcome("deadline"),
        specs[1].rollout_id: fake.Outcome("hang"),
    }
    with fake.FakeKube(by_rollout(outcomes)) as kube:
        t0 = time.monotonic()
        by_cluster, by_us = launcher(kube).run(specs)
        assert time.monotonic() - t0 < 10
        assert job_name(specs[1].rollout_id) in kube.deleted  # the silent Job was deleted by us
    assert by_cluster.state is RolloutState.TIMED_OUT and "DeadlineExceeded" in by_cluster.stderr
    assert by_us.state is RolloutState.TIMED_OUT and "no terminal Job status" in by_us.stderr


def test_concurrency_limit_and_creation_rate_limit() -> None:
    specs = [spec(i) for i in range(6)]
    with fake.FakeKube(lambda job: fake.Outcome("complete", 0.15, log="3")) as kube:
        results = launcher(kube, concurrency=2).run(specs)
        assert all(r.state is RolloutState.SUCCEEDED for r in results)
        assert kube.max_alive <= 2
    with fake.FakeKube(lambda job: fake.Outcome("complete", 0.05, log="3")) as kube:
        results = launcher(kube, concurrency=10, creates_per_s=4.0).run(specs)
        assert all(r.state is RolloutState.SUCCEEDED for r in results)
        times = [t for t, _ in kube.created]
    # Measured where the API server sees them, so request latency on a loaded machine shifts
    # single arrivals: 6 creates at 4/s span 1.25 s nominally (an unthrottled launcher needs a
    # few ms), and no window of one interval holds three of them.
    assert len(times) == 6 and times[-1] - times[0] >= 1.0
    assert all(c - a >= 0.25 for a, c in zip(times, times[2:], strict=False))


def test_api_errors_fail_the_run_or_are_retried() -> None:
    specs = [spec(0), spec(1)]
    outcomes = {
        specs[0].rollout_id: fake.Outcome("reject", status=422),
        specs[1].rollout_id: fake.Outcome("complete", log="3"),
    }
    with fake.FakeKube(by_rollout(outcomes)) as kube:
        kube.fail_next_creates = 1  # the first create gets a 503 and is retried
        rejected, ok = launcher(kube).run(specs)
    assert (
        rejected.state is RolloutState.FAILED
        and "422" in rejected.stderr
        and "invalid" in rejected.stderr
    )
    assert ok.state is RolloutState.SUCCEEDED


def test_interrupted_run_deletes_its_live_jobs() -> None:
    specs = [spec(0), spec(1)]
    with fake.FakeKube(lambda job: fake.Outcome("hang")) as kube:
        lz = launcher(kube)
        calls = {"n": 0}
        original = lz._batch.list_namespaced_job

        def interrupt(*a: Any, **kw: Any) -> Any:
            calls["n"] += 1
            if calls["n"] > 1:
                raise KeyboardInterrupt
            return original(*a, **kw)

        lz._batch.list_namespaced_job = interrupt
        with pytest.raises(KeyboardInterrupt):
            lz.run(specs)
        assert sorted(kube.deleted) == sorted(job_name(s.rollout_id) for s in specs)


def test_sidecar_urls_of_runs_in_flight() -> None:
    specs = [spec(0, timeout_s=3), spec(1, timeout_s=3)]
    with fake.FakeKube(lambda job: fake.Outcome("hang")) as kube:
        lz = launcher(kube)
        worker = threading.Thread(target=lz.run, args=(specs,))
        worker.start()
        deadline = time.monotonic() + 10
        while len(urls := lz.sidecar_urls()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        worker.join(timeout=30)
        assert not worker.is_alive()
        assert len(urls) == 2 and all(
            u.startswith("http://127.0.0.") and u.endswith(":8080") for u in urls
        )
        assert lz.sidecar_urls() == []  # the timed-out Jobs and their pods are gone


def test_names_and_labels_are_valid_for_any_id() -> None:
    ugly = "Step 3/Task:ÜBER_long_" + "x" * 80
    name, value = job_name(ugly), label_value(ugly)
    assert len(name) <= 63 and name.startswith("hrl-") and name == name.lower()
    assert job_name(ugly) != job_name(ugly + "y")
    assert len(value) <= 63 and value[0].isalnum() and value[-1].isalnum()


def test_bad_config_is_rejected_with_the_field_name() -> None:
    with pytest.raises(ValueError, match="image"):
        KubernetesLauncher(KubernetesLauncherConfig(image="", command=("h",)), api_client=object())
    with pytest.raises(ValueError, match="command"):
        KubernetesLauncher(KubernetesLauncherConfig(image="i"), api_client=object())
    with pytest.raises(ValueError, match="command must be a list of strings"):
        KubernetesLauncherConfig(image="i", command=("h", 3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="namespace"):
        KubernetesLauncherConfig(image="i", command=("h",), namespace="Bad_NS")
    with pytest.raises(ValueError, match="concurrency"):
        KubernetesLauncherConfig(image="i", command=("h",), concurrency=0)
    with pytest.raises(ValueError, match="creates_per_s"):
        KubernetesLauncherConfig(image="i", command=("h",), creates_per_s=0)


def test_cli_flags_are_the_launcher_config(capsys: pytest.CaptureFixture[str]) -> None:
    from harnessrl.pods.k8s import main

    with pytest.raises(SystemExit) as exc:
        main(["--dry-run", "--command", "h {task_file}"])
    assert exc.value.code == 2 and "--image is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--dry-run", "--image", "reg/h:1", "--ttl-s", "soon", "--command", "h"])
    assert "--ttl-s must be int, got 'soon'" in capsys.readouterr().err
    argv = ["--dry-run", "--image=reg/h:1", "--command", "h --task {task_file}", "--ttl-s", "60",
            "--namespace", "team-a", "--sidecar.image", "reg/sc:2", "--upstream", "http://v:8000",
            "--memory", "3Gi", "--timeout-s", "90"]  # fmt: skip
    assert main(argv) == 0
    job = yaml.safe_load(capsys.readouterr().out)
    pod = job["spec"]["template"]["spec"]
    (harness,) = pod["containers"]
    assert harness["command"] == ["h", "--task", "/var/run/harnessrl/task.json"]
    assert harness["resources"]["limits"]["memory"] == "3Gi"
    assert (job["metadata"]["namespace"], job["spec"]["ttlSecondsAfterFinished"]) == ("team-a", 60)
    assert job["spec"]["activeDeadlineSeconds"] == 90
    (sidecar,) = pod["initContainers"]
    assert sidecar["image"] == "reg/sc:2" and "http://v:8000" in sidecar["args"]


def test_dry_run_prints_a_valid_job() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "harnessrl.pods.k8s", "--dry-run", "--image", "reg/harness:1",
         "--command", "python -m harness --task {task_file}", "--prompt", "What is 4+4?"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    job = yaml.safe_load(out)
    kubernetes_validate.validate(job, "1.33", strict=True)
    assert "&id" not in out  # plain YAML, no anchors
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == "reg/harness:1"
