"""A run's parts, assembled once from its config: the launcher, the evaluator, the trace store,
the serving and the capture, started in order and stopped in reverse.

In: a `TrainConfig`, the coding tasks by id (empty for other tasks), an output folder, then the
policy and its tokenizer. Out: `Stack`, which the train loop (`harnessrl.train`) and the pass@k
probe (`harnessrl.curate.probe`) both run their rounds through.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from harnessrl.coding.rollouts import CodingEvaluator, CodingLauncher
from harnessrl.coding.tasks import CodingTask
from harnessrl.config import TrainConfig
from harnessrl.fleet import (
    Capture,
    EmbeddedServing,
    LocalCapture,
    PodCapture,
    Serving,
    SidecarProcess,
    copy_model,
    remote_serving,
    served_tokenizer,
)
from harnessrl.rollout import Evaluate, Launcher, LocalLauncher, get_evaluator, parse_command
from harnessrl.serve.app import start_server
from harnessrl.traces import TraceStore, open_store
from proxy_sidecar.inject.webhook import SidecarSpec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
Coding = dict[str, CodingTask]  # the coding task behind each task id; empty for other tasks


class Stack:
    """The launcher and evaluator (made at once, so a bad name fails before any device is
    touched), then `start`: the store, the serving and the capture; `stop` closes all of them."""

    def __init__(self, cfg: TrainConfig, coding: Coding, out: Path) -> None:
        self.cfg, self.out = cfg, out
        self.evaluate = make_evaluator(cfg, coding)
        self.launcher = make_launcher(cfg, coding)
        self.store_url = cfg.rollout.store or f"sqlite:///{(out / 'traces.db').absolute()}"
        self._store: TraceStore | None = None
        self._serving: Serving | None = None
        self._capture: Capture | None = None

    def start(self, model: Any, tokenizer: Any) -> Stack:
        """Serve `model` and capture through its sidecar(s); nothing outlives a failed start."""
        self._store = open_store(self.store_url)
        try:
            self._serving = start_serving(self.cfg, model, tokenizer, self.out)
            self._capture = start_capture(
                self.cfg, self.launcher, self._serving.url, self.store_url, self.out
            )
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def store(self) -> TraceStore:
        assert self._store is not None, "Stack.start() first"
        return self._store

    @property
    def serving(self) -> Serving:
        assert self._serving is not None, "Stack.start() first"
        return self._serving

    @property
    def capture(self) -> Capture:
        assert self._capture is not None, "Stack.start() first"
        return self._capture

    def stop_runs(self) -> None:
        """Abandon the harness runs in flight (local processes; pods end with their Jobs)."""
        if isinstance(self.launcher, LocalLauncher | CodingLauncher):
            self.launcher.stop()

    def stop(self) -> None:
        self.stop_runs()
        if self._capture is not None:
            self._capture.stop()
        if self._serving is not None:
            self._serving.stop()
        if self._store is not None:
            self._store.close()


def harness_command(cfg: TrainConfig, own: tuple[str, ...] = ()) -> tuple[str, ...]:
    """A launcher's own argv, else rollout.harness; {python} and {examples} expanded."""
    argv = own or parse_command(cfg.rollout.harness)
    return tuple(
        a.replace("{python}", sys.executable).replace("{examples}", str(EXAMPLES)) for a in argv
    )


def make_launcher(cfg: TrainConfig, coding: Coding) -> Launcher:
    """The launcher that rollout.launcher names; coding tasks: a sandbox per run, here."""
    r = cfg.rollout
    if coding:
        code = r.coding
        mini_config = harness_command(cfg, (code.mini_config,))[0]
        if r.launcher == "kubernetes":  # a Job per run; {python}, {examples} expand in the pod
            from harnessrl.pods.coding import KubernetesCodingLauncher

            k8s = dataclasses.replace(r.kubernetes, sidecar=pod_sidecar(cfg))
            code = dataclasses.replace(code, mini_config=mini_config)
            model = cfg.sidecar.model or cfg.serve.model_name
            return KubernetesCodingLauncher(k8s, code, coding, model=model)
        command = harness_command(cfg, code.command) if code.command else ()
        return CodingLauncher(
            dataclasses.replace(code, command=command, mini_config=mini_config),
            coding,
            local=r.local,
            model=cfg.sidecar.model or cfg.serve.model_name,
        )
    if r.launcher == "kubernetes":
        from harnessrl.pods.k8s import KubernetesLauncher

        k8s = r.kubernetes
        command = harness_command(cfg, k8s.command)
        return KubernetesLauncher(
            dataclasses.replace(k8s, command=command, sidecar=pod_sidecar(cfg))
        )
    command = harness_command(cfg, r.local.command)
    return LocalLauncher(dataclasses.replace(r.local, command=command))


def pod_sidecar(cfg: TrainConfig) -> SidecarSpec:
    """The harness pods' sidecar: it forwards to rollout.servers and rewrites each call's model
    to the name they serve, as the local sidecar does (a harness asking for "default" of a vLLM
    serving "policy" would get 404 on every call)."""
    spec = cfg.rollout.kubernetes.sidecar
    model = spec.model or cfg.sidecar.model or cfg.serve.model_name
    # Token-in mode with serve.model's tokenizer folder where the pods see it (on the shared
    # claim); a named one (tiny, smollm2) only when set, as each pod would load it at start.
    found = served_tokenizer(cfg.serve.model) or ""
    tokenizer = spec.tokenizer or (found if found.startswith("/") and spec.sees(found) else "")
    return dataclasses.replace(spec, upstream=cfg.rollout.servers, model=model, tokenizer=tokenizer)


def make_evaluator(cfg: TrainConfig, coding: Coding) -> Evaluate:
    if cfg.rollout.evaluator == "coding":
        return CodingEvaluator(coding, cfg.rollout.coding.grade)
    return get_evaluator(cfg.rollout.evaluator)


def start_serving(cfg: TrainConfig, model: Any, tokenizer: Any, out: Path) -> Serving:
    r = cfg.rollout
    if r.servers:
        export_root = (out / "weights").absolute()
        return remote_serving(
            r.servers, r.weight_sync, export_root, tokenizer, cfg.serve.admin_token,
            r.weight_push, r.weight_push_address,
        )  # fmt: skip
    return EmbeddedServing(start_server(copy_model(model), tokenizer, cfg.serve))


def start_capture(
    cfg: TrainConfig, launcher: Launcher, upstream: str, store_url: str, out: Path
) -> Capture:
    if cfg.rollout.launcher == "kubernetes":  # each harness pod brings its own sidecar
        return PodCapture(launcher, os.environ.get("HARNESSRL_CONTROL_TOKEN", ""))
    wired = dataclasses.replace(
        cfg.sidecar,
        upstreams=tuple(upstream.split(",")),
        store=store_url,
        model=cfg.sidecar.model or cfg.serve.model_name,
        # Token-in mode (/v1/responses, /v1/messages) with the policy's own tokenizer.
        tokenizer=cfg.sidecar.tokenizer or served_tokenizer(cfg.serve.model),
    )
    return LocalCapture(SidecarProcess(wired, out / "sidecar.log", cfg.run.sidecar_startup_s))
