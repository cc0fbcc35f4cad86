"""Kubernetes launcher: one batch/v1 Job per harness run, with the capture sidecar beside it.

In: `RunSpec`s. Out: `RunResult`s read from the Job's conditions and its pod (exit code, log);
failure, eviction and deadline become FAILED / TIMED_OUT, so such runs are never trained.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import yaml

from harnessrl.cli import command_line
from harnessrl.pods.k8s_api import (
    TRANSIENT_STATUS,
    default_api_client,
    describe,
    retry_delay,
    transport_errors,
    with_retries,
)
from harnessrl.rollout.tasks import RunResult, RunSpec, Task, load_tasks
from harnessrl.traces.schema import RolloutState
from proxy_sidecar.control import rollout_url
from proxy_sidecar.inject.webhook import (
    ROLLOUT_ANNOTATION,
    SIDECAR_LABEL,
    SidecarSpec,
    sidecar_container,
    sidecar_volumes,
)

TASK_ANNOTATION = "harnessrl.io/task"
BATCH_LABEL = "harnessrl.io/batch"
TASK_DIR = "/var/run/harnessrl"
HARNESS_CONTAINER = "harness"
UNREAD = "could not read the pod"
CREATE_TRIES = 6  # of one Job; Retry-After and backoff spread them over a few seconds


@dataclass(frozen=True)
class KubernetesCodingConfig:
    """Coding tasks as Jobs (harnessrl.pods): where repositories come from, the pod's workspace."""

    # PVC of clones named owner__name, mounted read-only into the checkout step only; needed by
    # tasks that name a repository (inline tasks carry their files)
    mirrors_claim: str = ""
    mirrors_sub_path: str = ""  # the clones' folder inside that claim ("" = its root)
    workspace: str = "8Gi"  # size limit of the pod's checkout and harness files (emptyDir)
    setup_s: int = 600  # Job deadline beyond rollout.timeout_s: the checkout and the diff
    uid: int = 10001  # the pods' user (non-root), as in k8s/Dockerfile

    def __post_init__(self) -> None:
        for name in ("setup_s", "uid"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"rollout.kubernetes.coding.{name} must be an int >= 1, got {value!r}"
                )
        if self.mirrors_sub_path.startswith("/") or ".." in self.mirrors_sub_path.split("/"):
            raise ValueError(
                "rollout.kubernetes.coding.mirrors_sub_path must be a relative path inside the "
                f"claim, got {self.mirrors_sub_path!r}"
            )


@dataclass(frozen=True)
class KubernetesLauncherConfig:
    """How harness Jobs look and how fast they are created."""

    image: str = ""  # the harness image (unchanged harness); required by the launcher
    # Its argv; `{task_file}` and `{rollout_id}` expand. Required by the launcher (the train loop
    # fills an empty one from rollout.harness).
    command: tuple[str, ...] = ()
    namespace: str = "harnessrl"  # namespace of the harness Jobs
    sidecar: SidecarSpec = field(default_factory=SidecarSpec)
    concurrency: int = 64  # Jobs alive at once
    creates_per_s: float = 10.0  # creation rate limit, to spare the API server and the scheduler
    ttl_s: int = 600  # ttlSecondsAfterFinished: the cluster's own cleanup if ours never runs
    deadline_grace_s: float = 120.0  # after activeDeadlineSeconds, when we stop waiting ourselves
    keep_jobs: bool = False  # leave finished Jobs for inspection (the TTL still removes them)
    service_account: str = "harnessrl-harness"  # of the harness pods (no API token is mounted)
    cpu: str = "1"  # harness container CPU request
    memory: str = "2Gi"  # harness container memory request and limit
    watch_timeout_s: int = 30  # longest single watch of the Jobs before listing again
    request_timeout_s: float = 30.0  # longest wait for one API answer (a watch: beyond its own)
    max_log_bytes: int = 1_000_000  # of each harness log read back as the run's output
    coding: KubernetesCodingConfig = field(default_factory=KubernetesCodingConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.command, tuple) or not all(isinstance(c, str) for c in self.command):
            raise ValueError(
                f"KubernetesLauncherConfig.command must be a list of strings, got {self.command!r}"
            )
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", self.namespace):
            raise ValueError(
                f"KubernetesLauncherConfig.namespace is not a DNS label: {self.namespace!r}"
            )
        for name in ("concurrency", "ttl_s", "watch_timeout_s", "max_log_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(
                    f"KubernetesLauncherConfig.{name} must be an int >= 1, got {getattr(self, name)!r}"
                )
        if not self.request_timeout_s > 0:
            raise ValueError(
                "KubernetesLauncherConfig.request_timeout_s must be > 0, got "
                f"{self.request_timeout_s!r}"
            )
        if not self.creates_per_s > 0:
            raise ValueError(
                f"KubernetesLauncherConfig.creates_per_s must be > 0, got {self.creates_per_s!r}"
            )


def label_value(text: str) -> str:
    """A string squeezed into a valid label value (<= 63 chars, alnum at both ends)."""
    v = re.sub(r"[^A-Za-z0-9._-]", "-", text)[:63].strip("-_.")
    return v or "x"


def job_name(rollout_id: str) -> str:
    """DNS-1123 name, unique per rollout id (the hash keeps sanitized look-alikes apart)."""
    slug = re.sub(r"[^a-z0-9-]", "-", rollout_id.lower()).strip("-")[:40].strip("-")
    digest = hashlib.sha1(rollout_id.encode()).hexdigest()[:8]
    return f"hrl-{slug}-{digest}" if slug else f"hrl-{digest}"


def _harness_container(spec: RunSpec, cfg: KubernetesLauncherConfig) -> dict[str, Any]:
    task_file = f"{TASK_DIR}/task.json"
    argv = [
        c.replace("{task_file}", task_file).replace("{rollout_id}", spec.rollout_id)
        for c in cfg.command
    ]
    env = {
        "OPENAI_BASE_URL": rollout_url(cfg.sidecar.url, spec.rollout_id),
        "OPENAI_API_KEY": cfg.sidecar.api_key,
        "HARNESSRL_ROLLOUT_ID": spec.rollout_id,
        "HARNESSRL_TASK_FILE": task_file,
        "HARNESSRL_TASK_PROMPT": spec.task.prompt,
    }
    if spec.reward_url:  # good for this rollout's reward only, never the sidecar's control token
        env.update(HARNESSRL_REWARD_URL=spec.reward_url, HARNESSRL_REWARD_TOKEN=spec.reward_token)
    return {
        "name": HARNESS_CONTAINER,
        "image": cfg.image,
        "command": argv,
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "volumeMounts": [{"name": "task", "mountPath": TASK_DIR, "readOnly": True}],
        "resources": {
            "requests": {"cpu": cfg.cpu, "memory": cfg.memory},
            "limits": {"memory": cfg.memory},
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def job_manifest(
    spec: RunSpec,
    cfg: KubernetesLauncherConfig,
    batch: str = "dry-run",
    policy_version: int | None = None,
    mode: str = "train",
) -> dict[str, Any]:
    """The Job for one run: harness container + native sidecar, task mounted from an annotation.
    `mode`: which of its sidecar's sampling overrides apply (eval: a held-out eval's run)."""
    labels = {
        "app.kubernetes.io/name": "harnessrl-harness",
        "app.kubernetes.io/managed-by": "harnessrl",
        "harnessrl.io/rollout": label_value(spec.rollout_id),
        "harnessrl.io/task": label_value(spec.task.task_id),
        "harnessrl.io/group": label_value(spec.group_id),
        BATCH_LABEL: label_value(batch),
        SIDECAR_LABEL: "true",  # the NetworkPolicies of k8s/base admit it to vLLM and the store
    }
    annotations = {
        ROLLOUT_ANNOTATION: spec.rollout_id,
        "harnessrl.io/task-id": spec.task.task_id,
        "harnessrl.io/group-id": spec.group_id,
        "harnessrl.io/attempt": str(spec.attempt),
    }
    sidecar = sidecar_container(cfg.sidecar)
    if policy_version is not None:  # every call of the run is recorded with the serving version
        sidecar["args"] += ["--policy-version", str(policy_version)]
    if mode != "train":
        sidecar["args"] += ["--mode", mode]
    # The task travels in the pod's own annotation (downward API file): no ConfigMap per run.
    task_ref = {"fieldPath": f"metadata.annotations['{TASK_ANNOTATION}']"}
    pod_spec = {
        "restartPolicy": "Never",
        "serviceAccountName": cfg.service_account,
        "automountServiceAccountToken": False,  # the harness never talks to the API server
        "initContainers": [sidecar],
        "containers": [_harness_container(spec, cfg)],
        "volumes": [
            {
                "name": "task",
                "downwardAPI": {"items": [{"path": "task.json", "fieldRef": task_ref}]},
            },
            *sidecar_volumes(cfg.sidecar),  # the sidecar's tokenizer folder, read-only
        ],
    }
    pod_annotations = {**annotations, TASK_ANNOTATION: json.dumps(spec.task.to_json())}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": job_name(spec.rollout_id),
            "namespace": cfg.namespace,
            "labels": labels,
            "annotations": annotations,
        },
        "spec": {
            "backoffLimit": 0,  # a failed run is a data point (FAILED), never silently retried
            "activeDeadlineSeconds": max(1, math.ceil(spec.timeout_s)),
            "ttlSecondsAfterFinished": cfg.ttl_s,
            "template": {
                # A copy of the labels: YAML output without anchors.
                "metadata": {"labels": dict(labels), "annotations": pod_annotations},
                "spec": pod_spec,
            },
        },
    }


def job_yaml(spec: RunSpec, cfg: KubernetesLauncherConfig) -> str:
    return yaml.safe_dump(job_manifest(spec, cfg), sort_keys=False)


def job_outcome(job: dict[str, Any]) -> tuple[RolloutState, str] | None:
    """Terminal state of a Job from its conditions; None while it still runs."""
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("status") != "True":
            continue
        if cond.get("type") == "Complete":
            return RolloutState.SUCCEEDED, ""
        if cond.get("type") == "Failed":
            reason = cond.get("reason") or "Failed"
            note = f"job failed: {reason}: {cond.get('message') or ''}".rstrip(": ")
            if reason == "DeadlineExceeded":
                return RolloutState.TIMED_OUT, note
            return RolloutState.FAILED, note
    return None


def pod_outcome(pod: dict[str, Any]) -> tuple[int | None, str]:
    """Exit code of the harness container and a note on eviction or OOM, from a pod's status."""
    status = pod.get("status") or {}
    notes = []
    if status.get("reason") == "Evicted":
        notes.append(f"pod evicted: {status.get('message') or ''}".rstrip(": "))
    for cond in status.get("conditions") or []:
        if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
            notes.append(
                f"pod disrupted: {cond.get('reason')}: {cond.get('message') or ''}".rstrip(": ")
            )
    exit_code = None
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if cs.get("name") == HARNESS_CONTAINER and term:
            exit_code = term.get("exitCode")
            if term.get("reason") not in (None, "Completed", "Error"):
                notes.append(f"harness container {term['reason']}")
            if term.get("message") and exit_code:
                notes.append(f"termination message: {term['message'].strip()[-2000:]}")
    return exit_code, "\n".join(notes)


@dataclass
class _Live:
    spec: RunSpec
    started: float  # monotonic


class KubernetesLauncher:
    """Runs each spec as a Job; at most `concurrency` Jobs alive, created at most `creates_per_s`."""

    builds_command = False  # True: a subclass makes each Job's argv itself (config.command unused)

    def __init__(self, config: KubernetesLauncherConfig, api_client: Any = None) -> None:
        from kubernetes import client

        if not config.image or not (config.command or self.builds_command):
            raise ValueError(
                "KubernetesLauncherConfig needs the harness image and command, got "
                f"image={config.image!r}, command={config.command!r}"
            )
        self.config = config
        self._api = api_client if api_client is not None else default_api_client()
        # Any: with _preload_content=False the client answers raw urllib3 responses, which its
        # type hints call models.
        self._batch: Any = client.BatchV1Api(self._api)
        self._core: Any = client.CoreV1Api(self._api)
        self._next_create = 0.0
        # The train loop sets this after each weight push; new Jobs' sidecars start with it.
        self.policy_version: int | None = None
        self.sidecar_mode = "train"  # "eval" while the train loop runs a held-out eval

    def run(self, specs: list[RunSpec]) -> list[RunResult]:
        if not specs:
            return []
        batch = uuid.uuid4().hex[:12]  # one label value per call: the watch sees only our Jobs
        pending, live = deque(specs), dict[str, _Live]()
        results: dict[str, RunResult] = {}
        try:
            while pending or live:
                while pending and len(live) < self.config.concurrency:
                    spec = pending.popleft()
                    started = time.monotonic()
                    err = self._create(spec, batch)
                    if err is None:
                        live[job_name(spec.rollout_id)] = _Live(spec, started)
                    else:
                        results[spec.rollout_id] = _result(
                            spec, RolloutState.FAILED, started, stderr=err
                        )
                if live:
                    self._wait(live, results, batch)
        finally:
            for name in live:  # interrupted (Ctrl-C, a bug): leave nothing running behind us
                self._delete(name)
        return [results[s.rollout_id] for s in specs]

    def sidecar_urls(self) -> list[str]:
        """Sidecars of the runs in flight (`http://POD_IP:PORT`): their control API pauses calls
        and sets the policy version around a weight push while runs continue (async loop)."""
        resp = self._core.list_namespaced_pod(
            self.config.namespace,
            label_selector="app.kubernetes.io/managed-by=harnessrl",
            _preload_content=False,
            _request_timeout=self.config.request_timeout_s,
        )
        pods = json.loads(resp.data).get("items") or []
        port = self.config.sidecar.port
        return sorted(
            f"http://{p['status']['podIP']}:{port}"
            for p in pods
            if (p.get("status") or {}).get("phase") == "Running" and p["status"].get("podIP")
        )

    def _create(self, spec: RunSpec, batch: str) -> str | None:
        """None once the run's Job exists; else why it could not be created.

        A try whose answer was lost (timeout, cut connection) may still have created the Job:
        the next try's 409 then adopts it (the name is the rollout id's), and a create given up
        after such a try deletes the name, so no Job runs on unwatched."""
        from kubernetes.client.exceptions import ApiException

        body = self.manifest(spec, batch)
        name, ns = body["metadata"]["name"], self.config.namespace
        maybe_created = False
        for attempt in range(CREATE_TRIES):
            now = time.monotonic()
            time.sleep(max(0.0, self._next_create - now))
            self._next_create = max(now, self._next_create) + 1.0 / self.config.creates_per_s
            try:
                self._batch.create_namespaced_job(
                    ns, body, field_validation="Strict",
                    _request_timeout=self.config.request_timeout_s,
                )  # fmt: skip
                return None
            except ApiException as err:
                why = f"could not create Job {name}: {describe(err)}"
                if err.status == 409:
                    return self._adopt(name, spec, batch)
                if err.status not in TRANSIENT_STATUS:
                    return why
                delay = retry_delay(err, attempt)
            except transport_errors() as err:
                why = f"could not reach the API server to create Job {name}: {err}"
                maybe_created, delay = True, retry_delay(None, attempt)
            time.sleep(delay)
        if maybe_created:
            self._delete(name)
        return why

    def _adopt(self, name: str, spec: RunSpec, batch: str) -> str | None:
        """The Job of that name was created by an earlier try of this very call (same batch):
        it is this run's. One left by another launch is not (its run may be another's)."""
        from kubernetes.client.exceptions import ApiException

        try:
            resp = with_retries(lambda: self._batch.read_namespaced_job(
                name, self.config.namespace, _preload_content=False,
                _request_timeout=self.config.request_timeout_s,
            ))  # fmt: skip
            labels = json.loads(resp.data)["metadata"].get("labels") or {}
        except transport_errors(ApiException, ValueError, KeyError) as err:
            return f"Job {name} exists but could not be read: {err}"
        if labels.get(BATCH_LABEL) == label_value(batch):
            return None
        return (
            f"Job {name} of rollout {spec.rollout_id!r} already exists from another launch "
            f"({BATCH_LABEL}={labels.get(BATCH_LABEL)!r}); each rollout id runs once: delete "
            f"it (kubectl delete job -n {self.config.namespace} {name}) or use fresh ids"
        )

    def manifest(self, spec: RunSpec, batch: str) -> dict[str, Any]:
        """The Job of one run (a subclass may shape its own)."""
        return job_manifest(spec, self.config, batch, self.policy_version, self.sidecar_mode)

    def result(
        self, spec: RunSpec, state: RolloutState, started: float, exit_code: int | None,
        log: str, stderr: str,
    ) -> RunResult:  # fmt: skip
        """The run's result from its Job's outcome and its harness log (the log is the output)."""
        return _result(spec, state, started, exit_code, log, stderr)

    def _wait(self, live: dict[str, _Live], results: dict[str, RunResult], batch: str) -> None:
        """Settle what already finished; otherwise watch until one Job ends or a deadline nears."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        selector = f"{BATCH_LABEL}={batch}"
        try:
            resp = self._batch.list_namespaced_job(
                self.config.namespace,
                label_selector=selector,
                _preload_content=False,
                _request_timeout=self.config.request_timeout_s,
            )
            listing = json.loads(resp.data)
            jobs = {j["metadata"]["name"]: j for j in listing.get("items") or []}
            settled = 0
            for name in list(live):
                job = jobs.get(name)
                outcome = (
                    job_outcome(job)
                    if job
                    else (RolloutState.FAILED, "job was deleted before it finished")
                )
                if outcome:
                    self._finish(name, live, results, outcome)
                    settled += 1
            self._expire(live, results)
            if settled or not live:
                return
            timeout = max(1, min(self.config.watch_timeout_s, math.ceil(self._next_deadline(live))))
            w = watch.Watch()
            for event in w.stream(
                self._batch.list_namespaced_job, self.config.namespace, label_selector=selector,
                resource_version=listing["metadata"]["resourceVersion"], timeout_seconds=timeout,
                deserialize=False, _request_timeout=timeout + self.config.request_timeout_s,
            ):  # fmt: skip
                name = event["object"].get("metadata", {}).get("name")
                if name in live and (event["type"] == "DELETED" or job_outcome(event["object"])):
                    w.stop()
                    break
        except ApiException as err:  # 410 Gone and friends: re-list on the next round
            if err.status != 410:
                time.sleep(retry_delay(err, 0, base_s=1.0))
        # Refused, reset, timed out, a watch cut mid-chunk, a garbled answer: the Jobs run on
        # regardless, so list again (a control-plane upgrade must not end the round).
        except transport_errors(ValueError, KeyError):
            time.sleep(1.0)
        self._expire(live, results)

    def _next_deadline(self, live: dict[str, _Live]) -> float:
        now = time.monotonic()
        return min(
            lv.started + lv.spec.timeout_s + self.config.deadline_grace_s - now
            for lv in live.values()
        )

    def _expire(self, live: dict[str, _Live], results: dict[str, RunResult]) -> None:
        """Our own deadline, for Jobs the cluster never reports on (API trouble, stuck controller)."""
        now = time.monotonic()
        for name, lv in list(live.items()):
            if now > lv.started + lv.spec.timeout_s + self.config.deadline_grace_s:
                note = (
                    f"no terminal Job status within {lv.spec.timeout_s:g}s + "
                    f"{self.config.deadline_grace_s:g}s grace; Job deleted"
                )
                self._finish(name, live, results, (RolloutState.TIMED_OUT, note))

    def _finish(
        self,
        name: str,
        live: dict[str, _Live],
        results: dict[str, RunResult],
        outcome: tuple[RolloutState, str],
    ) -> None:
        lv = live.pop(name)
        exit_code, log, pod_note = self._collect(name)
        state, note = outcome
        if state is RolloutState.SUCCEEDED and pod_note.startswith(UNREAD):
            state = RolloutState.FAILED  # its output is unknown: never train on an empty one
        stderr = "\n".join(f"[harnessrl] {n}" for n in (note, pod_note) if n)
        results[lv.spec.rollout_id] = self.result(
            lv.spec, state, lv.started, exit_code, log, stderr
        )
        if not self.config.keep_jobs or state is RolloutState.TIMED_OUT:
            self._delete(name)

    def _collect(self, name: str) -> tuple[int | None, str, str]:
        """Exit code, log and notes of the Job's pod (one pod: backoffLimit is 0)."""
        from kubernetes.client.exceptions import ApiException

        ns = self.config.namespace
        try:
            resp = with_retries(lambda: self._core.list_namespaced_pod(
                ns, label_selector=f"batch.kubernetes.io/job-name={name}",
                _preload_content=False, _request_timeout=self.config.request_timeout_s,
            ))  # fmt: skip
            pods = json.loads(resp.data).get("items") or []
            if not pods:
                return None, "", "no pod was ever created for the Job"
            pod = max(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "")
            exit_code, note = pod_outcome(pod)
            log = with_retries(lambda: self._core.read_namespaced_pod_log(
                pod["metadata"]["name"], ns, container=HARNESS_CONTAINER,
                limit_bytes=self.config.max_log_bytes, _preload_content=False,
                _request_timeout=self.config.request_timeout_s,
            )).data.decode("utf-8", errors="replace")  # fmt: skip
            return exit_code, log, note
        except transport_errors(ApiException, ValueError, KeyError) as err:
            return None, "", f"{UNREAD} of Job {name}: {err}"

    def _delete(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            with_retries(lambda: self._batch.delete_namespaced_job(
                name, self.config.namespace, propagation_policy="Background",
                _request_timeout=self.config.request_timeout_s,
            ))  # fmt: skip
        except ApiException as err:
            if err.status != 404:
                print(
                    f"[harnessrl] could not delete Job {name}: {err.status} {err.reason}",
                    file=sys.stderr,
                )
        except transport_errors() as err:  # the TTL removes it later
            print(f"[harnessrl] could not delete Job {name}: {err}", file=sys.stderr)


def _result(
    spec: RunSpec,
    state: RolloutState,
    started: float,
    exit_code: int | None = None,
    stdout: str = "",
    stderr: str = "",
) -> RunResult:
    return RunResult(
        rollout_id=spec.rollout_id,
        state=state,
        exit_code=exit_code,
        stdout=stdout,
        stderr=stderr,
        duration_s=time.monotonic() - started,
        output=stdout.strip(),
    )


@dataclass(frozen=True)
class JobsCommand:
    """`python -m harnessrl.pods.k8s`: run tasks as Jobs and print each result as JSON."""

    jobs: KubernetesLauncherConfig = field(default_factory=KubernetesLauncherConfig)
    tasks: str = ""  # JSONL task file; "": one task from --prompt
    prompt: str = "What is 2+3? Answer with just the number."  # the one task when --tasks is ""
    timeout_s: float = 600.0  # per run (the Job's activeDeadlineSeconds)
    dry_run: bool = False  # print the Job YAML of the first run and exit


def main(argv: list[str] | None = None) -> int:
    args: JobsCommand = command_line(
        JobsCommand(),
        sys.argv[1:] if argv is None else argv,
        prog="python -m harnessrl.pods.k8s",
        doc=JobsCommand.__doc__ or "",
        required=("jobs.image", "jobs.command"),
    )
    tasks = load_tasks(args.tasks) if args.tasks else [Task("cli-0", args.prompt)]
    specs = [
        RunSpec(f"{t.task_id}-{uuid.uuid4().hex[:8]}", t, t.task_id, 0, "", args.timeout_s)
        for t in tasks
    ]
    if args.dry_run:
        sys.stdout.write(job_yaml(specs[0], args.jobs))
        return 0
    for r in KubernetesLauncher(args.jobs).run(specs):
        fields = {"rollout_id": r.rollout_id, "state": str(r.state), "exit_code": r.exit_code}
        print(json.dumps({**fields, "output": r.output}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
