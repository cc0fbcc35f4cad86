"""A FAKE Kubernetes API server for tests: no real cluster exists on the test machines.

It speaks just the batch/v1 Jobs endpoints (create, list, watch, delete) and the core/v1 Pods
endpoints (list, log) that `KubernetesLauncher` calls through the official client, over real HTTP.
It plays the Job controller and kubelet too: each created Job gets an outcome chosen by the test
(`complete`, `fail`, `deadline`, `evict`, `hang`, or an HTTP error on create), applied after a delay,
or `run`: the harness container's command really runs, as a local process (`run_locally`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse


@dataclass(frozen=True)
class Outcome:
    kind: str  # complete | fail | deadline | evict | hang | reject
    after_s: float = 0.05
    exit_code: int = 0
    log: str = ""
    status: int = 422  # for `reject`: the HTTP status the create gets
    timeout_s: float = 300.0  # for `run`: the local process is killed after this long


def run_locally(job: dict[str, Any], timeout_s: float = 300.0) -> tuple[int, str]:
    """Play kubelet for the Job's harness container: its command, with `$(VAR)` expanded from the
    container's env as Kubernetes does, runs as a local process; returns (exit code, stdout)."""
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), a) for a in container["command"]]
    proc = subprocess.run(
        argv,
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return proc.returncode, proc.stdout + proc.stderr


class FakeKube:
    """State of the fake cluster; `decide(job) -> Outcome` picks each Job's fate."""

    def __init__(
        self, decide: Callable[[dict[str, Any]], Outcome], pod_ip: str | None = None
    ) -> None:
        self.decide = decide
        self.pod_ip = pod_ip  # every pod's IP; None: a distinct loopback address per pod
        self.jobs: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.logs: dict[str, str] = {}
        self.events: list[tuple[int, str, dict[str, Any]]] = []  # (resourceVersion, type, job)
        self.created: list[tuple[float, dict[str, Any]]] = []  # (time, body) of every accepted Job
        self.deleted: list[str] = []
        self.max_alive = 0
        self.fail_next_creates = 0  # answer this many creates with 503 first
        self.cond = threading.Condition()
        self.rv = 100
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeKube:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- cluster behaviour ------------------------------------------------------------------
    def _emit(self, kind: str, job: dict[str, Any]) -> None:
        self.rv += 1
        job["metadata"]["resourceVersion"] = str(self.rv)
        self.events.append((self.rv, kind, json.loads(json.dumps(job))))
        self.cond.notify_all()

    def create_job(self, ns: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        name = body["metadata"]["name"]
        outcome = self.decide(body)
        with self.cond:
            if self.fail_next_creates > 0:
                self.fail_next_creates -= 1
                return 503, _status(503, "ServiceUnavailable", "etcd is busy")
            if outcome.kind == "reject":
                return outcome.status, _status(
                    outcome.status, "Invalid", f"Job {name!r} is invalid"
                )
            if name in self.jobs:
                return 409, _status(409, "AlreadyExists", f'jobs.batch "{name}" already exists')
            job = json.loads(json.dumps(body))
            job["metadata"].update(uid=str(uuid.uuid4()), namespace=ns, creationTimestamp=_now())
            job["status"] = {"active": 1, "startTime": _now()}
            self.jobs[name] = job
            self._start_pod(name, job)
            self.created.append((time.monotonic(), body))
            self.max_alive = max(self.max_alive, sum(1 for j in self.jobs.values() if _alive(j)))
            self._emit("ADDED", job)
        if outcome.kind != "hang":
            threading.Timer(outcome.after_s, self._settle, (name, outcome)).start()
        return 201, job

    def _start_pod(self, name: str, job: dict[str, Any]) -> None:
        """The pod the Job controller would create, already Running (scheduling is instant)."""
        pod_name = f"{name}-{uuid.uuid4().hex[:5]}"
        self.pods[pod_name] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name,
                "namespace": job["metadata"]["namespace"],
                "creationTimestamp": _now(),
                "labels": {**job["spec"]["template"]["metadata"]["labels"],
                           "batch.kubernetes.io/job-name": name, "job-name": name},
            },
            "status": {
                "phase": "Running",
                "podIP": self.pod_ip or f"127.0.0.{len(self.pods) % 250 + 2}",
            },
        }  # fmt: skip

    def _settle(self, name: str, outcome: Outcome) -> None:
        if outcome.kind == "run":
            job = self.jobs.get(name)
            if job is None:  # deleted before it started
                return
            exit_code, log = run_locally(job, outcome.timeout_s)
            outcome = Outcome("complete" if exit_code == 0 else "fail", 0, exit_code, log)
        with self.cond:
            job = self.jobs.get(name)
            if job is None:  # deleted meanwhile
                return
            (pod_name,) = [
                p for p, pod in self.pods.items() if pod["metadata"]["labels"]["job-name"] == name
            ]
            term: dict[str, Any] = {"exitCode": outcome.exit_code, "reason": "Completed"}
            pod_status: dict[str, Any] = {"phase": "Succeeded"}
            cond = {"type": "Complete", "status": "True"}
            if outcome.kind == "fail":
                term = {"exitCode": outcome.exit_code, "reason": "Error"}
                pod_status = {"phase": "Failed"}
                cond = {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                        "message": "Job has reached the specified backoff limit"}  # fmt: skip
            elif outcome.kind == "deadline":
                term = {"exitCode": 137, "reason": "Error"}
                pod_status = {"phase": "Failed"}
                cond = {"type": "Failed", "status": "True", "reason": "DeadlineExceeded",
                        "message": "Job was active longer than specified deadline"}  # fmt: skip
            elif outcome.kind == "evict":
                term = {"exitCode": 137, "reason": "Error"}
                pod_status = {"phase": "Failed", "reason": "Evicted",
                              "message": "The node was low on resource: memory."}  # fmt: skip
                cond = {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                        "message": "Job has reached the specified backoff limit"}  # fmt: skip
            pod_status["containerStatuses"] = [
                {
                    "name": "harness",
                    "state": {"terminated": term},
                    "ready": False,
                    "restartCount": 0,
                }
            ]
            self.pods[pod_name]["status"] = pod_status
            self.logs[pod_name] = outcome.log
            job["status"] = {"conditions": [cond], "startTime": job["status"]["startTime"]}
            job["status"]["succeeded" if cond["type"] == "Complete" else "failed"] = 1
            self._emit("MODIFIED", job)

    def delete_job(self, name: str) -> tuple[int, dict[str, Any]]:
        with self.cond:
            job = self.jobs.pop(name, None)
            if job is None:
                return 404, _status(404, "NotFound", f'jobs.batch "{name}" not found')
            self.deleted.append(name)
            for pod_name in [
                p for p, pod in self.pods.items() if pod["metadata"]["labels"]["job-name"] == name
            ]:
                self.pods.pop(pod_name)
            self._emit("DELETED", job)
        return 200, _status(200, "", "", status="Success")


def _alive(job: dict[str, Any]) -> bool:
    return not (job.get("status") or {}).get("conditions")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _status(code: int, reason: str, message: str, status: str = "Failure") -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": status,
            "message": message, "reason": reason, "code": code}  # fmt: skip


def _matches(obj: dict[str, Any], selector: str | None) -> bool:
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, (selector or "").split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


def _handler(kube: FakeKube) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # keep test output quiet
            pass

        def _send(self, code: int, body: Any, ctype: str = "application/json") -> None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _parts(self) -> tuple[list[str], dict[str, str]]:
            url = urlparse(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            return url.path.strip("/").split("/"), query

        def do_POST(self) -> None:
            parts, _ = self._parts()
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if parts[:3] == ["apis", "batch", "v1"] and parts[5:] == ["jobs"]:
                self._send(*kube.create_job(parts[4], body))
            else:
                self._send(404, _status(404, "NotFound", self.path))

        def do_DELETE(self) -> None:
            parts, _ = self._parts()
            if self.headers.get("Content-Length"):
                self.rfile.read(int(self.headers["Content-Length"]))
            if parts[:3] == ["apis", "batch", "v1"] and parts[5] == "jobs" and len(parts) == 7:
                self._send(*kube.delete_job(parts[6]))
            else:
                self._send(404, _status(404, "NotFound", self.path))

        def do_GET(self) -> None:
            parts, q = self._parts()
            if parts[:3] == ["apis", "batch", "v1"] and parts[5:] == ["jobs"]:
                if q.get("watch") in ("true", "1", "True"):
                    return self._watch(q)
                with kube.cond:
                    items = [j for j in kube.jobs.values() if _matches(j, q.get("labelSelector"))]
                    rv = str(kube.rv)
                return self._send(200, {"kind": "JobList", "apiVersion": "batch/v1",
                                        "metadata": {"resourceVersion": rv}, "items": items})  # fmt: skip
            if parts[:2] == ["api", "v1"] and parts[4:] == ["pods"]:
                with kube.cond:
                    items = [p for p in kube.pods.values() if _matches(p, q.get("labelSelector"))]
                return self._send(200, {"kind": "PodList", "apiVersion": "v1",
                                        "metadata": {"resourceVersion": str(kube.rv)}, "items": items})  # fmt: skip
            if parts[:2] == ["api", "v1"] and parts[4] == "pods" and parts[6:] == ["log"]:
                log = kube.logs.get(parts[5])
                if log is None:
                    return self._send(404, _status(404, "NotFound", f'pods "{parts[5]}" not found'))
                return self._send(200, log, "text/plain")
            self._send(404, _status(404, "NotFound", self.path))

        def _watch(self, q: dict[str, str]) -> None:
            """Chunked stream of events newer than resourceVersion, until timeoutSeconds."""
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            since = int(q.get("resourceVersion") or 0)
            deadline = time.monotonic() + float(q.get("timeoutSeconds") or 30)
            try:
                while time.monotonic() < deadline:
                    with kube.cond:
                        fresh = [
                            e
                            for e in kube.events
                            if e[0] > since and _matches(e[2], q.get("labelSelector"))
                        ]
                        if not fresh:
                            kube.cond.wait(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
                            continue
                    for rv, kind, obj in fresh:
                        line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                        self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                        self.wfile.flush()
                        since = rv
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):  # the client stopped watching
                pass
            self.close_connection = True

    return Handler
