"""The Kubernetes coding launcher: one Job per run, its pod holding the task's checkout and harness.

In: coding run specs (their tasks), the Kubernetes launcher config and the coding config. Out:
`RunResult`s whose `output` is the diff our runner took of the pod's work tree, read back from the
end of the harness container's log; grading stays with the trainer (`CodingEvaluator`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harnessrl.coding.rollouts import CodingConfig, mini_config_file
from harnessrl.coding.tasks import CodingTask
from harnessrl.pods.k8s import HARNESS_CONTAINER, KubernetesLauncher, KubernetesLauncherConfig
from harnessrl.pods.k8s import job_manifest as plain_manifest
from harnessrl.pods.runner import checkout_row, unframe
from harnessrl.rollout.tasks import RunResult, RunSpec
from harnessrl.traces.schema import RolloutState
from proxy_sidecar.control import rollout_url
from proxy_sidecar.inject.webhook import sidecar_volumes

SANDBOX_LABEL = "harnessrl.io/sandbox"  # the shipped NetworkPolicy selects pods by it
CHECKOUT_ANNOTATION = "harnessrl.io/checkout"
PROMPT_ANNOTATION = "harnessrl.io/prompt"
MINI_ANNOTATION = "harnessrl.io/mini-config"
WORK, REPO, OUT = "/sandbox", "/sandbox/repo", "/sandbox/out"
BASE = "/var/lib/harnessrl/base"  # the kept git dir: read-only to the harness
SPEC_DIR, CHECKOUT_DIR, MIRRORS = "/var/run/harnessrl", "/var/run/harnessrl-checkout", "/mirrors"
POD_EXAMPLES = "/opt/harnessrl/examples"  # where k8s/Dockerfile installs the examples
MAX_ANNOTATIONS = 200_000  # the API server refuses more than 256 KiB of annotations per object
RUNNER = ("python", "-m", "harnessrl.pods.runner")
CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "privileged": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}


def _downward(name: str, items: dict[str, str]) -> dict[str, Any]:
    """A volume of files, each the value of one of the pod's annotations."""
    return {"name": name, "downwardAPI": {"items": [
        {"path": path, "fieldRef": {"fieldPath": f"metadata.annotations['{key}']"}}
        for path, key in items.items()
    ]}}  # fmt: skip


class KubernetesCodingLauncher(KubernetesLauncher):
    """Runs each coding spec as a Job: checkout (init), sidecar, harness under our runner."""

    builds_command = True

    def __init__(
        self,
        config: KubernetesLauncherConfig,
        coding: CodingConfig,
        tasks: Mapping[str, CodingTask],
        *,
        model: str,
        api_client: Any = None,
    ) -> None:
        needs_mirror = [t.instance_id for t in tasks.values() if not t.files]
        if needs_mirror and not config.coding.mirrors_claim:
            raise ValueError(
                f"coding task(s) {needs_mirror[:3]} name a repository: set "
                "rollout.kubernetes.coding.mirrors_claim to a PVC of clones named owner__name "
                "(and mirrors_sub_path to their folder in it); on Kubernetes the checkout is "
                "made from that volume, never from the network"
            )
        super().__init__(config, api_client)
        self.coding, self.tasks, self.model = coding, tasks, model
        self.mini_yaml = self.mini_name = ""  # a config file's text, or one mini-swe-agent ships
        if not coding.command:
            found = mini_config_file(coding.mini_config)
            self.mini_yaml = found.read_text() if isinstance(found, Path) else ""
            self.mini_name = "" if isinstance(found, Path) else found

    def run(self, specs: list[RunSpec]) -> list[RunResult]:
        unknown = [s.task.task_id for s in specs if s.task.task_id not in self.tasks]
        if unknown:
            raise ValueError(f"no coding task behind task id(s) {unknown[:3]}")
        return super().run(specs)

    def manifest(self, spec: RunSpec, batch: str) -> dict[str, Any]:
        return coding_job(spec, self.tasks[spec.task.task_id], self, batch)

    def harness_argv(self, spec: RunSpec) -> list[str]:
        """The harness's own argv in the pod: rollout.coding.command, else mini-swe-agent."""
        url = rollout_url(self.config.sidecar.url, spec.rollout_id)
        if self.coding.command:
            values = {"{task_file}": f"{SPEC_DIR}/task.md", "{out_dir}": OUT, "{base_url}": url,
                      "{rollout_id}": spec.rollout_id, "{python}": "python",
                      "{examples}": POD_EXAMPLES}  # fmt: skip
            argv = []
            for arg in self.coding.command:
                for key, value in values.items():
                    arg = arg.replace(key, value)
                argv.append(arg)
            return argv
        c, key = self.coding, self.config.sidecar.api_key
        config = f"{SPEC_DIR}/mini.yaml" if self.mini_yaml else self.mini_name
        settings = [
            config, f"agent.step_limit={c.step_limit}", f"model.model_class={c.model_class}",
            f"model.model_kwargs.api_base={url}", f"model.model_kwargs.api_key={key}",
            f"model.model_kwargs.max_tokens={c.max_tokens}",
            f"model.model_kwargs.temperature={c.temperature}", *c.mini_settings,
        ]  # fmt: skip
        return [
            "mini", "--yolo", "--exit-immediately", "--cost-limit=0",
            *(f"--config={s}" for s in settings), f"--model=hosted_vllm/{self.model}",
            f"--task={spec.task.prompt}", f"--output={OUT}/traj.json",
        ]  # fmt: skip

    def result(
        self, spec: RunSpec, state: RolloutState, started: float, exit_code: int | None,
        log: str, stderr: str,
    ) -> RunResult:  # fmt: skip
        """The diff from the frame at the log's end; without one the run failed (never graded)."""
        plain = super().result(spec, state, started, exit_code, log, stderr)
        try:
            framed = unframe(log)
        except ValueError as err:
            if state is RolloutState.SUCCEEDED:
                state = RolloutState.FAILED
            note = f"[harnessrl] no diff: {err}"
            if len(log.encode()) >= self.config.max_log_bytes:
                note += " (the log was cut at rollout.kubernetes.max_log_bytes: raise it)"
            return dataclasses.replace(
                plain, state=state, output="", stderr="\n".join(filter(None, [stderr, note]))
            )
        if framed.info.get("timed_out") and state is RolloutState.SUCCEEDED:
            state = RolloutState.TIMED_OUT
        info = {"exit_status": framed.info.get("exit_status", ""),
                "harness_exit_code": framed.info.get("exit_code"),
                "isolation": "kubernetes", "diff_lines": framed.diff.count("\n")}  # fmt: skip
        return dataclasses.replace(
            plain, state=state, stdout=framed.before, output=framed.diff, info=info
        )


def coding_job(
    spec: RunSpec, task: CodingTask, launcher: KubernetesCodingLauncher, batch: str = "dry-run"
) -> dict[str, Any]:
    """The plain harness Job reshaped for a coding run (see docs/coding.md, Kubernetes)."""
    cfg, code = launcher.config, launcher.config.coding
    job = plain_manifest(spec, cfg, batch, launcher.policy_version, launcher.sidecar_mode)
    template = job["spec"]["template"]
    for meta in (job["metadata"], template["metadata"]):
        meta["labels"][SANDBOX_LABEL] = "coding"
    annotations = template["metadata"]["annotations"]
    del annotations["harnessrl.io/task"]  # the plain task file is not mounted here
    annotations[CHECKOUT_ANNOTATION] = json.dumps(checkout_row(task), sort_keys=True)
    annotations[PROMPT_ANNOTATION] = spec.task.prompt
    spec_files = {"task.md": PROMPT_ANNOTATION}
    if launcher.mini_yaml:
        annotations[MINI_ANNOTATION] = launcher.mini_yaml
        spec_files["mini.yaml"] = MINI_ANNOTATION
    size = sum(len(k) + len(v.encode()) for k, v in annotations.items())
    if size > MAX_ANNOTATIONS:
        raise ValueError(
            f"task {task.instance_id!r} is too large to travel in its pod's annotations "
            f"({size} bytes > {MAX_ANNOTATIONS}): serve its repository from "
            "rollout.kubernetes.coding.mirrors_claim instead of inline files"
        )
    job["spec"]["activeDeadlineSeconds"] = math.ceil(spec.timeout_s) + code.setup_s
    pod = template["spec"]
    pod.update(
        enableServiceLinks=False,  # no env of the namespace's services in the harness
        terminationGracePeriodSeconds=5,
        securityContext={"runAsNonRoot": True, "runAsUser": code.uid, "runAsGroup": code.uid,
                         "fsGroup": code.uid, "seccompProfile": {"type": "RuntimeDefault"}},
    )  # fmt: skip
    volumes = [
        _downward("checkout", {"checkout.json": CHECKOUT_ANNOTATION}),
        _downward("spec", spec_files),
        {"name": "work", "emptyDir": {"sizeLimit": code.workspace}},
        {"name": "base", "emptyDir": {"sizeLimit": code.workspace}},
    ]
    checkout_args = ["prepare", "--task", f"{CHECKOUT_DIR}/checkout.json", "--repo", REPO,
                     "--base", BASE, "--history", launcher.coding.sandbox.history]  # fmt: skip
    mounts: list[dict[str, Any]] = [{"name": "checkout", "mountPath": CHECKOUT_DIR, "readOnly": True},
              {"name": "work", "mountPath": WORK}, {"name": "base", "mountPath": BASE}]  # fmt: skip
    if code.mirrors_claim:
        volumes.append({"name": "mirrors", "persistentVolumeClaim": {
            "claimName": code.mirrors_claim, "readOnly": True}})  # fmt: skip
        mount = {"name": "mirrors", "mountPath": MIRRORS, "readOnly": True}
        if code.mirrors_sub_path:
            mount["subPath"] = code.mirrors_sub_path
        mounts.append(mount)
        checkout_args += ["--mirrors", MIRRORS]
    pod["volumes"] = [*volumes, *sidecar_volumes(cfg.sidecar)]  # the sidecar's tokenizer folder
    pod["initContainers"] = [
        _checkout_container(cfg, checkout_args, mounts),
        *pod["initContainers"],
    ]
    (harness,) = pod["containers"]
    _shape_harness(harness, spec, launcher)
    return job


def _checkout_container(
    cfg: KubernetesLauncherConfig, args: list[str], mounts: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "name": "checkout",
        "image": cfg.image,
        "command": [*RUNNER, *args],
        "env": [{"name": "HOME", "value": WORK}, {"name": "TMPDIR", "value": WORK}],
        "volumeMounts": mounts,
        "resources": {
            "requests": {"cpu": cfg.cpu, "memory": cfg.memory},
            "limits": {"cpu": cfg.cpu, "memory": cfg.memory},
        },
        "securityContext": CONTAINER_SECURITY,
    }


def _shape_harness(
    harness: dict[str, Any], spec: RunSpec, launcher: KubernetesCodingLauncher
) -> None:
    """The harness container: our runner around the harness, limits of the local sandbox."""
    cfg, coding = launcher.config, launcher.coding
    graded = ",".join(coding.graded_exits)
    harness["command"] = [
        *RUNNER, "harness", "--repo", REPO, "--base", BASE, "--out", OUT,
        "--timeout-s", f"{spec.timeout_s:g}", "--graded-exits", graded, "--",
        *launcher.harness_argv(spec),
    ]  # fmt: skip
    harness["workingDir"] = REPO
    # No reward credential: a coding run's reward is our grade of its diff, never one it posts.
    dropped = {"HARNESSRL_TASK_FILE", "HARNESSRL_REWARD_URL", "HARNESSRL_REWARD_TOKEN"}
    harness["env"] = [e for e in harness["env"] if e["name"] not in dropped] + [
        {"name": name, "value": value}
        for name, value in {
            "HARNESSRL_TASK_FILE": f"{SPEC_DIR}/task.md",
            "HOME": f"{WORK}/home",
            "TMPDIR": f"{WORK}/tmp",
            # mini-swe-agent unattended, as the local coding launcher runs it
            "MSWEA_CONFIGURED": "1",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": str(coding.model_attempts),
            "MSWEA_GLOBAL_CONFIG_DIR": f"{OUT}/mini-config",
        }.items()
    ]
    harness["volumeMounts"] = [
        {"name": "work", "mountPath": WORK},
        {"name": "base", "mountPath": BASE, "readOnly": True},
        {"name": "spec", "mountPath": SPEC_DIR, "readOnly": True},
    ]
    memory = f"{coding.sandbox.memory_mb}Mi" if coding.sandbox.memory_mb else cfg.memory
    harness["resources"] = {
        "requests": {"cpu": cfg.cpu, "memory": memory},
        "limits": {"cpu": cfg.cpu, "memory": memory},
    }
    harness["securityContext"] = CONTAINER_SECURITY
    assert harness["name"] == HARNESS_CONTAINER
