"""Coding runs on Kubernetes: the Job of a run, the in-pod runner for real, the launcher end to end
against the FAKE API server (tests/k8s/fake_apiserver.py), and the shipped NetworkPolicy."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubectl_needed import needs_kubectl
from kubernetes import client
from kubernetes.config import kube_config

from harnessrl.coding.rollouts import CodingConfig, CodingEvaluator, as_task
from harnessrl.coding.tasks import CodingTask
from harnessrl.coding.taskset import load_shipped
from harnessrl.pods.coding import SANDBOX_LABEL, KubernetesCodingLauncher, coding_job
from harnessrl.pods.k8s import KubernetesCodingConfig, KubernetesLauncherConfig
from harnessrl.pods.runner import BEGIN, END, checkout_row, frame, unframe
from harnessrl.rollout.tasks import RunSpec
from harnessrl.traces.schema import RolloutState
from proxy_sidecar.inject.webhook import SIDECAR_NAME, SidecarSpec

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
_spec = importlib.util.spec_from_file_location(
    "fake_apiserver", ROOT / "tests/k8s/fake_apiserver.py"
)
assert _spec and _spec.loader
fake = importlib.util.module_from_spec(_spec)
sys.modules["fake_apiserver"] = fake
_spec.loader.exec_module(fake)

TASK = load_shipped()[0]
CFG = KubernetesLauncherConfig(
    image="registry.example.com/harnessrl:0.1.0",
    sidecar=SidecarSpec(image="registry.example.com/harnessrl:0.1.0", upstream="http://vllm:8000"),
    creates_per_s=200.0,
    watch_timeout_s=2,
    deadline_grace_s=5.0,
)
CODING = CodingConfig(mini_config=str(ROOT / "examples" / "mini.yaml"))
RUNNER = [sys.executable, "-m", "harnessrl.pods.runner"]


def launcher(kube_url: str = "http://127.0.0.1:1", **coding: Any) -> KubernetesCodingLauncher:
    cfg = KubernetesLauncherConfig(**{**CFG.__dict__, "coding": KubernetesCodingConfig(**coding)})
    api = client.ApiClient(client.Configuration(host=kube_url))
    return KubernetesCodingLauncher(
        cfg, CODING, {TASK.instance_id: TASK}, model="policy", api_client=api
    )


def run_spec(i: int = 0, timeout_s: float = 120.0) -> RunSpec:
    return RunSpec(
        f"s0-{TASK.instance_id}-{i}", as_task(TASK), "g0", i, "http://x", timeout_s,
        reward_url="http://train:9000/rollouts/r/reward", reward_token="secret",
    )  # fmt: skip


def by_name(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {i["name"]: i for i in items}


# ---- the Job --------------------------------------------------------------------------------------


def test_coding_job_validates_and_isolates_the_checkout() -> None:
    job = coding_job(run_spec(), TASK, launcher(mirrors_claim="mirrors", mirrors_sub_path="git"))
    kubernetes_validate.validate(job, "1.33", strict=True)
    pod = job["spec"]["template"]["spec"]
    assert job["spec"]["activeDeadlineSeconds"] == 120 + KubernetesCodingConfig().setup_s
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"]
    # The checkout comes first; the native sidecar starts after it, before the harness.
    checkout, sidecar = pod["initContainers"]
    assert sidecar["name"] == SIDECAR_NAME and sidecar["restartPolicy"] == "Always"
    assert checkout["command"][:4] == ["python", "-m", "harnessrl.pods.runner", "prepare"]
    assert "--mirrors" in checkout["command"]
    (harness,) = pod["containers"]
    assert harness["command"][:4] == ["python", "-m", "harnessrl.pods.runner", "harness"]
    argv = harness["command"][harness["command"].index("--") + 1 :]
    assert argv[0] == "mini" and f"--task={TASK.problem_statement}" in argv
    assert any(a.startswith("--config=") and "api_base=http://127.0.0.1:8080/" in a for a in argv)
    for c in (checkout, harness):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True
    env = {e["name"]: e["value"] for e in harness["env"]}
    assert not {"HARNESSRL_REWARD_URL", "HARNESSRL_REWARD_TOKEN"} & set(env)  # the grade is ours
    assert env["OPENAI_BASE_URL"].startswith("http://127.0.0.1:8080/")
    mounts = by_name(harness["volumeMounts"])
    assert set(mounts) == {"work", "base", "spec"}  # neither the mirrors nor the checkout row
    assert mounts["base"]["readOnly"] is True and mounts["spec"]["readOnly"] is True
    assert by_name(checkout["volumeMounts"])["mirrors"] == {
        "name": "mirrors", "mountPath": "/mirrors", "readOnly": True, "subPath": "git"
    }  # fmt: skip
    volumes = by_name(pod["volumes"])
    assert volumes["mirrors"]["persistentVolumeClaim"] == {"claimName": "mirrors", "readOnly": True}
    memory = f"{CODING.sandbox.memory_mb}Mi"
    assert harness["resources"]["limits"] == {"cpu": CFG.cpu, "memory": memory}
    # The gold fix and the tests never reach the pod: the checkout row is the base alone.
    text = json.dumps(job)
    assert json.dumps(TASK.patch)[1:-1] not in text
    assert json.dumps(TASK.test_patch)[1:-1] not in text
    row = json.loads(job["spec"]["template"]["metadata"]["annotations"]["harnessrl.io/checkout"])
    assert row == checkout_row(TASK) and row["files"] == dict(TASK.files)
    assert job["spec"]["template"]["metadata"]["labels"][SANDBOX_LABEL] == "coding"


def test_own_harness_command_expands_to_the_pods_paths() -> None:
    own = dataclasses.replace(CODING, command=("{python}", "{examples}/agent.py", "{task_file}",
                                               "{out_dir}", "{base_url}"))  # fmt: skip
    api = client.ApiClient(client.Configuration(host="http://127.0.0.1:1"))
    pods = KubernetesCodingLauncher(CFG, own, {TASK.instance_id: TASK}, model="m", api_client=api)
    spec = run_spec()
    (harness,) = coding_job(spec, TASK, pods)["spec"]["template"]["spec"]["containers"]
    argv = harness["command"][harness["command"].index("--") + 1 :]
    assert argv == ["python", "/opt/harnessrl/examples/agent.py", "/var/run/harnessrl/task.md",
                    "/sandbox/out", f"http://127.0.0.1:8080/rollouts/{spec.rollout_id}/v1"]  # fmt: skip


def test_a_log_cut_short_says_which_limit_cut_it() -> None:
    log = "x" * 100 + "\n" + frame(TASK.patch, {"exit_code": 0})
    api = client.ApiClient(client.Configuration(host="http://127.0.0.1:1"))
    cfg = dataclasses.replace(CFG, max_log_bytes=100)
    small = KubernetesCodingLauncher(
        cfg, CODING, {TASK.instance_id: TASK}, model="m", api_client=api
    )
    got = small.result(run_spec(), RolloutState.SUCCEEDED, 0.0, 0, log[:100], "")
    assert got.state is RolloutState.FAILED and "max_log_bytes" in got.stderr


def test_repo_tasks_need_the_mirror_volume() -> None:
    repo_task = CodingTask("o__r-1", "fix it", "", repo="o/r", base_commit="a" * 40)
    api = client.ApiClient(client.Configuration(host="http://127.0.0.1:1"))
    with pytest.raises(ValueError, match="mirrors_claim"):
        KubernetesCodingLauncher(CFG, CODING, {"o__r-1": repo_task}, model="m", api_client=api)
    with pytest.raises(ValueError, match="mirrors_sub_path"):
        KubernetesCodingConfig(mirrors_sub_path="../other")


def test_shipped_network_policy_selects_coding_pods_and_allows_only_the_sidecars_needs() -> None:
    (policy,) = [d for d in yaml.safe_load_all((K8S / "base" / "coding-sandbox.yaml").read_text())]
    kubernetes_validate.validate(policy, "1.33", strict=True)
    labels = coding_job(run_spec(), TASK, launcher())["spec"]["template"]["metadata"]["labels"]
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"].items() <= labels.items()
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    (ingress,) = spec["ingress"]
    assert ingress["ports"] == [{"port": SidecarSpec().port}]
    assert ingress["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "harnessrl-train"}}}
    ]
    ports = sorted(p["port"] for rule in spec["egress"] for p in rule["ports"])
    assert ports == [53, 53, 5432, 8000]  # DNS, the trace store, vLLM: no ipBlock, no internet
    assert not any("ipBlock" in peer for rule in spec["egress"] for peer in rule["to"])
    base = [
        d
        for p in sorted((K8S / "base").glob("*.yaml"))
        if p.name != "kustomization.yaml"
        for d in yaml.safe_load_all(p.read_text())
        if d
    ]
    servers = {d["metadata"]["name"]: d for d in base if d["kind"] == "StatefulSet"}
    for rule, name in zip(spec["egress"][1:], ("vllm", "postgres"), strict=True):
        selected = rule["to"][0]["podSelector"]["matchLabels"].items()
        assert selected <= servers[name]["spec"]["template"]["metadata"]["labels"].items()


@needs_kubectl
def test_network_policy_is_in_the_rendered_overlays() -> None:
    for overlay in ("base", "controller"):
        out = subprocess.run(
            ["kubectl", "kustomize", str(K8S / overlay)], capture_output=True, text=True,
            check=True, timeout=120,
        )  # fmt: skip
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
        (policy,) = [d for d in docs if d["metadata"]["name"] == "harnessrl-coding-sandbox"]
        kubernetes_validate.validate(policy, "1.33", strict=True)
        assert policy["metadata"]["namespace"] == "harnessrl"


# ---- the runner, for real in a temp checkout -------------------------------------------------------


def prepared(tmp_path: Path) -> tuple[Path, Path]:
    """What the init container leaves: the checkout and the kept git dir (then read-only)."""
    row = tmp_path / "checkout.json"
    row.write_text(json.dumps(checkout_row(TASK)))
    repo, base = tmp_path / "sandbox" / "repo", tmp_path / "base"
    base.mkdir()
    done = subprocess.run(
        [*RUNNER, "prepare", "--task", str(row), "--repo", str(repo), "--base", str(base)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for path in [base, *base.rglob("*")]:  # as mounted read-only into the harness container
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    return repo, base


def harness(
    tmp_path: Path, script: str, timeout_s: float = 60.0, graded: str = ""
) -> subprocess.CompletedProcess[str]:
    repo, base = tmp_path / "sandbox" / "repo", tmp_path / "base"
    return subprocess.run(
        [*RUNNER, "harness", "--repo", str(repo), "--base", str(base),
         "--out", str(tmp_path / "sandbox" / "out"), "--timeout-s", str(timeout_s),
         "--graded-exits", graded, "--", "sh", "-c", script],
        capture_output=True, text=True, timeout=timeout_s + 60,
    )  # fmt: skip


def test_runner_takes_the_diff_that_grades(tmp_path: Path) -> None:
    prepared(tmp_path)
    (tmp_path / "gold.patch").write_text(TASK.patch)
    # The harness prints a forged frame and leaves a process behind that would edit later.
    forged = frame("diff --git a/x b/x\n", {"exit_code": 0})
    script = (  # and tries to read its runner's environment (the runner is not dumpable)
        "cat /proc/$PPID/environ >/dev/null 2>&1 && echo RUNNER-READABLE || echo RUNNER-DENIED; "
        f"printf '%s' '{forged}'; git apply {tmp_path}/gold.patch; git add -A; "
        "git commit -qm done; (sleep 2; echo late >> has_close_elements.py) &"
    )
    done = harness(tmp_path, script)
    assert done.returncode == 0, done.stderr
    got = unframe(done.stdout)
    assert got.diff == TASK.patch and got.info["exit_code"] == 0
    assert got.info["undumpable"] is True
    if os.geteuid() != 0:  # root may read any process's files, dumpable or not
        assert "RUNNER-DENIED" in got.before
    assert BEGIN in got.before  # the forgery is only the harness's output, shown before ours
    time.sleep(2.5)  # what the harness left running was ended with it
    assert "late" not in (tmp_path / "sandbox" / "repo" / "has_close_elements.py").read_text()
    verdict = CodingEvaluator({TASK.instance_id: TASK}, CODING.grade)
    result = launcher().result(run_spec(), RolloutState.SUCCEEDED, 0.0, 0, done.stdout, "")
    assert result.output == TASK.patch
    assert verdict(as_task(TASK), result).reward == 1.0


def test_runner_diff_of_edited_tests_is_dropped_by_the_guards(tmp_path: Path) -> None:
    prepared(tmp_path)
    test_file = next(p for p, _ in TASK.files if p.startswith("test_"))
    done = harness(tmp_path, f"echo 'def test_ok(): pass' > {test_file}; echo x > conftest.py")
    assert done.returncode == 0, done.stderr
    diff = unframe(done.stdout).diff
    assert test_file in diff and "conftest.py" in diff
    result = launcher().result(run_spec(), RolloutState.SUCCEEDED, 0.0, 0, done.stdout, "")
    ev = CodingEvaluator({TASK.instance_id: TASK}, CODING.grade)(as_task(TASK), result)
    assert ev.reward == 0.0 and "edited_tests" in ev.info["guards"]
    assert test_file in ev.info["dropped"]


def test_runner_exit_is_0_for_a_graded_exit_status(tmp_path: Path) -> None:
    prepared(tmp_path)
    out = tmp_path / "sandbox" / "out"
    script = f"""echo '{{"info": {{"exit_status": "Submitted"}}}}' > {out}/traj.json; exit 1"""
    graded = harness(tmp_path, script, graded="LimitsExceeded,Submitted")
    assert graded.returncode == 0 and unframe(graded.stdout).info["exit_status"] == "Submitted"
    crashed = harness(tmp_path, script, graded="LimitsExceeded")
    assert crashed.returncode == 1 and unframe(crashed.stdout).info["exit_code"] == 1


def test_runner_keeps_its_scratch_out_of_the_checkout(tmp_path: Path) -> None:
    repo, _ = prepared(tmp_path)
    inside = repo / "scratch"
    inside.mkdir()
    env = {**os.environ, "TMPDIR": str(inside)}  # as if the harness had linked TMPDIR into it
    done = subprocess.run(
        [*RUNNER, "harness", "--repo", str(repo), "--base", str(tmp_path / "base"),
         "--out", str(tmp_path / "sandbox" / "out"), "--timeout-s", "30", "--", "true"],
        capture_output=True, text=True, timeout=90, env=env,
    )  # fmt: skip
    assert done.returncode == 3 and "lies inside the checkout" in done.stderr
    with pytest.raises(ValueError, match="does not end with a diff frame"):
        unframe(done.stdout)


def test_runner_stops_a_harness_at_its_time_limit(tmp_path: Path) -> None:
    prepared(tmp_path)
    done = harness(tmp_path, "echo started; sleep 60", timeout_s=1.0)
    assert done.returncode == 124
    got = unframe(done.stdout)
    assert got.info["timed_out"] is True and got.diff == "" and "started" in got.before
    result = launcher().result(run_spec(), RolloutState.SUCCEEDED, 0.0, 0, done.stdout, "")
    assert result.state is RolloutState.TIMED_OUT


def test_unframe_rejects_what_is_not_our_frame() -> None:
    good = frame("diff --git a/f b/f\n", {"exit_code": 0})
    assert unframe("noise\n" + good).diff == "diff --git a/f b/f\n"
    with pytest.raises(ValueError, match="does not end with"):
        unframe(good + "more output\n")
    lines = good.splitlines()
    lines[1] = lines[1][:-4] + "AAAA"
    with pytest.raises(ValueError, match="digest does not match"):
        unframe("\n".join(lines))
    end = json.loads(lines[-1][len(END) :])
    with pytest.raises(ValueError, match="begin marker"):
        unframe("\n".join([*lines[2:-1], END + json.dumps({**end, "lines": end["lines"] + 5})]))


# ---- the launcher against the fake API server -------------------------------------------------------


def test_launcher_end_to_end_reads_the_diff_and_grades_it(tmp_path: Path) -> None:
    prepared(tmp_path)
    (tmp_path / "gold.patch").write_text(TASK.patch)
    gold_log = harness(tmp_path, f"git apply {tmp_path}/gold.patch").stdout
    empty_log = frame("", {"exit_code": 0, "timed_out": False, "exit_status": "Submitted"})
    specs = [run_spec(i) for i in range(3)]
    logs = {specs[0].rollout_id: gold_log, specs[1].rollout_id: empty_log,
            specs[2].rollout_id: "the pod died before the diff\n"}  # fmt: skip
    invalid: list[str] = []

    def decide(job: dict[str, Any]) -> Any:
        try:  # every body the launcher sends must be a valid Job
            kubernetes_validate.validate(job, "1.33", strict=True)
        except Exception as err:
            invalid.append(str(err))
        return fake.Outcome(
            "complete", 0.05, log=logs[job["metadata"]["annotations"]["harnessrl.io/rollout-id"]]
        )

    with fake.FakeKube(decide) as kube:
        results = launcher(kube.url).run(specs)
        created = [body for _, body in kube.created]
    assert not invalid
    assert all(
        b["spec"]["template"]["metadata"]["labels"][SANDBOX_LABEL] == "coding" for b in created
    )
    gold, empty, broken = results
    assert gold.state is RolloutState.SUCCEEDED and gold.output == TASK.patch
    assert empty.state is RolloutState.SUCCEEDED and empty.output == ""
    assert empty.info["exit_status"] == "Submitted"
    assert broken.state is RolloutState.FAILED and broken.output == ""
    assert "no diff" in broken.stderr
    evaluate = CodingEvaluator({TASK.instance_id: TASK}, CODING.grade)
    assert evaluate(as_task(TASK), gold).reward == 1.0
    assert evaluate(as_task(TASK), empty).reward == 0.0


@pytest.fixture(autouse=True)
def _restore_modes(tmp_path: Path) -> Any:
    """pytest removes tmp_path later: give back the write bits the read-only base lost."""
    yield
    for path in tmp_path.rglob("*"):
        if not path.is_symlink():
            os.chmod(path, path.stat().st_mode | stat.S_IWUSR)


def test_train_config_runs_coding_tasks_as_jobs(tmp_path: Path, monkeypatch: Any) -> None:
    from harnessrl.config import load_config
    from harnessrl.stack import make_launcher
    from harnessrl.train import load_task_sets

    keys = [
        "rollout.launcher=kubernetes", "rollout.tasks=coding:shipped", "rollout.evaluator=coding",
        "rollout.kubernetes.image=registry.example.com/harnessrl:0.1.0",
        "rollout.servers=http://vllm.harnessrl.svc:8000", "rollout.num_eval_tasks=4",
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"rollout\.store=postgresql"):
        load_config(None, keys)
    cfg = load_config(None, [*keys, "rollout.store=postgresql://u@postgres/traces"])
    train, _, coding = load_task_sets(cfg)
    with fake.FakeKube(lambda job: fake.Outcome("complete", 0.05, log=frame("", {}))) as kube:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": kube.url}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        }))  # fmt: skip
        # What KUBECONFIG names (the client reads the variable once, when it is imported).
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
        pods = make_launcher(cfg, coding)
        assert isinstance(pods, KubernetesCodingLauncher)
        spec = RunSpec("s0-wired-0", train[0], "g", 0, "http://x", cfg.rollout.timeout_s)
        (result,) = pods.run([spec])
        (body,) = [b for _, b in kube.created]
    assert result.state is RolloutState.SUCCEEDED and result.output == ""
    pod = body["spec"]["template"]["spec"]
    assert pod["initContainers"][1]["args"][:2] == ["--upstream", "http://vllm.harnessrl.svc:8000"]
    mini = body["spec"]["template"]["metadata"]["annotations"]["harnessrl.io/mini-config"]
    assert mini == (ROOT / "examples" / "mini.yaml").read_text()  # the config travels with the Job
