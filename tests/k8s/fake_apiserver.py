"""A FAKE Kubernetes API server for tests: no real cluster exists on the test machines.

It speaks just the batch/v1 Jobs endpoints (create, get, list, watch, delete) and the core/v1 Pods
endpoints (list, log) that `KubernetesLauncher` calls through the official client, over real HTTP,
and lists the discovery.k8s.io/v1 EndpointSlices a test adds (`add_endpoint_slice`): a Service's
replicas, which weight sync reads.
Like a real API server it refuses a body that does not match the Kubernetes 1.33 OpenAPI schema
(strict: an unknown field such as `containerz` too) with 422 Invalid. It plays the Job controller
and kubelet too: each created Job gets an outcome chosen by the test (`complete`, `fail`,
`deadline`, `evict`, `hang`, or an HTTP error on create), applied after a delay, or `run`: the
harness container's command really runs, as a local process (`run_locally`). `inject` queues
faults of the API server itself: error statuses (with `Retry-After`), answers lost after the work
was done, answers later than the client waits, watch streams cut mid-chunk, refused connections.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import jsonschema
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

K8S_VERSION = "1.33"
ROUTES = ("create", "get", "list", "watch", "delete", "pods", "log", "endpointslices")


@dataclass(frozen=True)
class Outcome:
    kind: str  # complete | fail | deadline | evict | hang | reject
    after_s: float = 0.05
    exit_code: int = 0
    log: str = ""
    status: int = 422  # for `reject`: the HTTP status the create gets
    timeout_s: float = 300.0  # for `run`: the local process is killed after this long


@dataclass(frozen=True)
class Fault:
    """What the API server does to the next request of a route, instead of answering it.

    status: answers `status` (Retry-After: `retry_after` when set), doing nothing.
    lost: does the work (a create stores the Job), then drops the connection without an answer.
    late: does the work, answers after `seconds` (past the client's timeout: it gave up).
    cut: a watch sends half a chunk of its first event and drops the connection.
    refuse: drops this connection and listens on nothing for `seconds` (connections refused).
    """

    kind: str
    status: int = 500
    retry_after: str = ""
    seconds: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("status", "lost", "late", "cut", "refuse"):
            raise ValueError(f"Fault.kind must be status|lost|late|cut|refuse, got {self.kind!r}")


def schema_error(body: Any, definition: str) -> str | None:
    """Every way `body` breaks the Kubernetes 1.33 schema `definition` (strict: unknown fields
    too), as one line; None when it is valid."""
    errors = sorted(
        _definition_validator(definition).iter_errors(body), key=lambda e: list(e.absolute_path)
    )
    if not errors:
        return None
    return "; ".join(
        f"{'.'.join(str(p) for p in e.absolute_path) or '<body>'}: {e.message}" for e in errors
    )


@functools.cache
def _definition_validator(name: str) -> jsonschema.Draft202012Validator:
    defs = schema_contents(
        f"kubernetes-json-schema/v{K8S_VERSION}.0-local-strict/_definitions.json", K8S_VERSION
    )
    registry = Registry().with_resource(defs["$id"], Resource.from_contents(defs))
    ref = {"$ref": f"{defs['$id']}#/$defs/{name}"}
    return jsonschema.Draft202012Validator(ref, registry=registry)


def run_locally(
    job: dict[str, Any],
    timeout_s: float = 300.0,
    secrets: dict[str, dict[str, str]] | None = None,
    pod_ip: str = "127.0.0.1",
) -> tuple[int, str]:
    """Play kubelet for the Job's pod: its native sidecars (init containers that restart Always)
    start first and must open their probed port, then the harness container's command runs; each
    as a local process, `$(VAR)` expanded from the container's env as Kubernetes does, env taken
    from `secrets` and the pod's own fields. The pod's network is `pod_ip`: what binds 0.0.0.0 or
    talks to 127.0.0.1 inside the pod uses that loopback address. Sidecars run only when
    `secrets` is given. Returns (harness exit code, harness stdout and stderr)."""
    pod = job["spec"]["template"]
    inits = pod["spec"].get("initContainers", []) if secrets is not None else []
    sidecars = [c for c in inits if c.get("restartPolicy") == "Always"]
    procs = []
    try:
        for c in sidecars:
            procs.append(_start_sidecar(c, pod, secrets or {}, pod_ip))
        (container,) = pod["spec"]["containers"]
        env, argv = _resolve(container, pod, secrets or {}, pod_ip)
        proc = subprocess.run(
            argv, env={**os.environ, **env}, stdin=subprocess.DEVNULL, capture_output=True,
            text=True, timeout=timeout_s,
        )  # fmt: skip
        return proc.returncode, proc.stdout + proc.stderr
    finally:
        for sidecar in procs:
            sidecar.terminate()
            sidecar.wait(timeout=30)


def _resolve(
    container: dict[str, Any], pod: dict[str, Any], secrets: dict[str, dict[str, str]], pod_ip: str
) -> tuple[dict[str, str], list[str]]:
    fields = {"status.podIP": pod_ip, "metadata.name": pod["metadata"].get("name", "pod")}
    fields |= {
        f"metadata.annotations['{k}']": v
        for k, v in (pod["metadata"].get("annotations") or {}).items()
    }
    env: dict[str, str] = {}
    for e in container.get("env", []):
        ref = e.get("valueFrom") or {}
        if "secretKeyRef" in ref:
            env[e["name"]] = secrets[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
        elif "fieldRef" in ref:
            env[e["name"]] = fields[ref["fieldRef"]["fieldPath"]]
        else:  # inside the pod 127.0.0.1 is the pod's own address
            env[e["name"]] = e["value"].replace("//127.0.0.1:", f"//{pod_ip}:")
    argv = [
        re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), a).replace("0.0.0.0", pod_ip)
        for a in [*container["command"], *container.get("args", [])]
    ]
    if argv[0] == "python":  # the image's interpreter: this one, with the same packages
        argv[0] = sys.executable
    return env, argv


def _start_sidecar(
    container: dict[str, Any], pod: dict[str, Any], secrets: dict[str, dict[str, str]], pod_ip: str
) -> subprocess.Popen[bytes]:
    env, argv = _resolve(container, pod, secrets, pod_ip)
    proc = subprocess.Popen(
        argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    port = container["startupProbe"]["tcpSocket"]["port"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the startup probe: the harness starts once it passes
        try:
            socket.create_connection((pod_ip, port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"sidecar {argv} exited with {proc.returncode}") from None
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"sidecar {argv} never opened {pod_ip}:{port}")


class FakeKube:
    """State of the fake cluster; `decide(job) -> Outcome` picks each Job's fate."""

    def __init__(
        self,
        decide: Callable[[dict[str, Any]], Outcome],
        pod_ip: str | None = None,
        secrets: dict[str, dict[str, str]] | None = None,
    ) -> None:
        self.decide = decide
        self.pod_ip = pod_ip  # every pod's IP; None: a distinct loopback address per pod
        # Secret name -> data: with it, `run` Jobs start their native sidecars too (run_locally)
        self.secrets = secrets
        self._pods_made = 0
        self.jobs: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.logs: dict[str, str] = {}
        self.events: list[tuple[int, str, dict[str, Any]]] = []  # (resourceVersion, type, job)
        self.created: list[tuple[float, dict[str, Any]]] = []  # (time, body) of every accepted Job
        self.deleted: list[str] = []
        self.endpoint_slices: list[dict[str, Any]] = []  # as add_endpoint_slice made them
        self.max_alive = 0
        self.fail_next_creates = 0  # answer this many creates with 503 first
        self.faults: dict[str, list[Fault]] = {route: [] for route in ROUTES}
        self.requests: list[tuple[float, str, str]] = []  # (time, route, path?query) of each
        self.refused_until = 0.0  # monotonic time an outage ends
        self.cond = threading.Condition()
        self.rv = 100
        self._conns: set[socket.socket] = set()  # open client connections, cut by an outage
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._port = self._server.server_address[1]
        self._closed = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def __enter__(self) -> FakeKube:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.cond:
            self._closed = True
            server = self._server
        server.shutdown()
        server.server_close()

    def inject(self, route: str, *faults: Fault) -> None:
        """Queue faults for the next requests of `route` (one of ROUTES), in order."""
        if route not in self.faults:
            raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
        with self.cond:
            self.faults[route].extend(faults)

    def next_fault(self, route: str) -> Fault | None:
        with self.cond:
            return self.faults[route].pop(0) if self.faults[route] else None

    def refuse(self, seconds: float) -> None:
        """An outage (a control-plane upgrade): nothing listens on the port for `seconds`, and
        every open connection, watches included, is cut."""
        with self.cond:
            server, self.refused_until = self._server, time.monotonic() + seconds
            conns = list(self._conns)
        server.shutdown()
        server.socket.close()
        for conn in conns:
            with contextlib.suppress(OSError):  # already closed by its client
                conn.shutdown(socket.SHUT_RDWR)
        threading.Timer(seconds, self._listen_again).start()

    def _listen_again(self) -> None:
        with self.cond:
            if self._closed:
                return
            self._server = ThreadingHTTPServer(("127.0.0.1", self._port), _handler(self))
            threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def add_endpoint_slice(
        self, namespace: str, service: str, endpoints: list[tuple[str, bool | None]], port: int
    ) -> dict[str, Any]:
        """A schema-checked EndpointSlice of `service`: (address, ready or None: unknown) each."""
        labels = {"kubernetes.io/service-name": service}
        piece: dict[str, Any] = {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": f"{service}-{uuid.uuid4().hex[:5]}", "namespace": namespace, "labels": labels},
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {} if ready is None else {"ready": ready}}
                          for ip, ready in endpoints],
        }  # fmt: skip
        if invalid := schema_error(piece, "io.k8s.api.discovery.v1.EndpointSlice"):
            raise ValueError(f"EndpointSlice is invalid: {invalid}")
        with self.cond:
            self.rv += 1
            piece["metadata"]["resourceVersion"] = str(self.rv)
            self.endpoint_slices.append(piece)
        return piece

    # -- cluster behaviour ------------------------------------------------------------------
    def _emit(self, kind: str, job: dict[str, Any]) -> None:
        self.rv += 1
        job["metadata"]["resourceVersion"] = str(self.rv)
        self.events.append((self.rv, kind, json.loads(json.dumps(job))))
        self.cond.notify_all()

    def create_job(self, ns: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        invalid = schema_error(body, "io.k8s.api.batch.v1.Job")
        if isinstance(body, dict) and (body.get("apiVersion"), body.get("kind")) != (
            "batch/v1",
            "Job",
        ):
            invalid = f"apiVersion/kind must be batch/v1 Job; {invalid or ''}"
        if invalid is not None:  # as the API server does, before anything else
            name = (body.get("metadata") or {}).get("name") if isinstance(body, dict) else None
            return 422, _status(422, "Invalid", f'Job.batch "{name}" is invalid: {invalid}')
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
        self._pods_made += 1  # live pods never share an address
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
                "podIP": self.pod_ip or f"127.0.0.{self._pods_made % 250 + 2}",
            },
        }  # fmt: skip

    def _settle(self, name: str, outcome: Outcome) -> None:
        if outcome.kind == "run":
            job = self.jobs.get(name)
            if job is None:  # deleted before it started
                return
            with self.cond:
                ips = [p["status"]["podIP"] for p in self.pods.values()
                       if p["metadata"]["labels"]["job-name"] == name]  # fmt: skip
            if not ips:  # deleted meanwhile
                return
            exit_code, log = run_locally(job, outcome.timeout_s, self.secrets, ips[0])
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

    def get_job(self, name: str) -> tuple[int, dict[str, Any]]:
        with self.cond:
            job = self.jobs.get(name)
            if job is None:
                return 404, _status(404, "NotFound", f'jobs.batch "{name}" not found')
            return 200, json.loads(json.dumps(job))

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


def _route(method: str, parts: list[str], query: dict[str, str]) -> str | None:
    """Which of ROUTES a request is; None: an endpoint the fake does not serve."""
    if parts[:3] == ["apis", "batch", "v1"] and len(parts) >= 6 and parts[5] == "jobs":
        if len(parts) == 6:
            watch = query.get("watch") in ("true", "1", "True")
            return {"POST": "create", "GET": "watch" if watch else "list"}.get(method)
        if len(parts) == 7:
            return {"GET": "get", "DELETE": "delete"}.get(method)
    if parts[:3] == ["apis", "discovery.k8s.io", "v1"] and parts[5:] == ["endpointslices"]:
        return "endpointslices" if method == "GET" else None
    if parts[:2] == ["api", "v1"] and len(parts) >= 5 and parts[4] == "pods" and method == "GET":
        if len(parts) == 5:
            return "pods"
        if parts[6:] == ["log"]:
            return "log"
    return None


def _handler(kube: FakeKube) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # keep test output quiet
            pass

        def setup(self) -> None:
            super().setup()
            with kube.cond:
                kube._conns.add(self.connection)

        def finish(self) -> None:
            with kube.cond:
                kube._conns.discard(self.connection)
            with contextlib.suppress(OSError):  # cut by an outage
                super().finish()

        def _send(
            self, code: int, body: Any, ctype: str = "application/json", retry_after: str = ""
        ) -> None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            if retry_after:
                self.send_header("Retry-After", retry_after)
            self.end_headers()
            self.wfile.write(data)

        def _parts(self) -> tuple[list[str], dict[str, str]]:
            url = urlparse(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            return url.path.strip("/").split("/"), query

        def do_POST(self) -> None:
            self._handle()

        def do_DELETE(self) -> None:
            self._handle()

        def do_GET(self) -> None:
            self._handle()

        def _handle(self) -> None:
            parts, q = self._parts()
            route = _route(self.command, parts, q)
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            with kube.cond:
                kube.requests.append((time.monotonic(), route or "?", self.path))
            fault = kube.next_fault(route) if route else None
            if fault is not None and fault.kind == "status":
                why = _status(fault.status, "InjectedFault", f"injected {fault.status}")
                return self._send(fault.status, why, retry_after=fault.retry_after)
            if fault is not None and fault.kind == "refuse":
                self.close_connection = True  # no answer: the outage cuts this connection too
                return kube.refuse(fault.seconds)
            if route == "watch":
                return self._watch(q, cut=fault is not None and fault.kind == "cut")
            code, answer, ctype = self._answer(route, parts, q, body)
            if fault is not None and fault.kind in ("lost", "cut"):
                self.close_connection = True  # done, but the answer never reaches the client
                return
            if fault is not None and fault.kind == "late":
                time.sleep(fault.seconds)
            try:
                self._send(code, answer, ctype)
            except OSError:  # the client gave up waiting
                self.close_connection = True

        def _answer(
            self, route: str | None, parts: list[str], q: dict[str, str], body: Any
        ) -> tuple[int, Any, str]:
            if route == "create":
                return (*kube.create_job(parts[4], body), "application/json")
            if route == "delete":
                invalid = body and schema_error(
                    body, "io.k8s.apimachinery.pkg.apis.meta.v1.DeleteOptions"
                )
                if invalid:
                    return (
                        422,
                        _status(422, "Invalid", f"DeleteOptions is invalid: {invalid}"),
                        "application/json",
                    )
                return (*kube.delete_job(parts[6]), "application/json")
            if route == "get":
                return (*kube.get_job(parts[6]), "application/json")
            if route == "list":
                with kube.cond:
                    items = [j for j in kube.jobs.values() if _matches(j, q.get("labelSelector"))]
                    rv = str(kube.rv)
                return 200, {"kind": "JobList", "apiVersion": "batch/v1",
                             "metadata": {"resourceVersion": rv}, "items": items}, "application/json"  # fmt: skip
            if route == "pods":
                with kube.cond:
                    items = [p for p in kube.pods.values() if _matches(p, q.get("labelSelector"))]
                return 200, {"kind": "PodList", "apiVersion": "v1",
                             "metadata": {"resourceVersion": str(kube.rv)}, "items": items}, "application/json"  # fmt: skip
            if route == "endpointslices":
                with kube.cond:
                    items = [e for e in kube.endpoint_slices if e["metadata"]["namespace"] == parts[4] and _matches(e, q.get("labelSelector"))]  # fmt: skip
                return 200, {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                             "metadata": {"resourceVersion": str(kube.rv)}, "items": items}, "application/json"  # fmt: skip
            if route == "log":
                log = kube.logs.get(parts[5])
                if log is None:
                    return (
                        404,
                        _status(404, "NotFound", f'pods "{parts[5]}" not found'),
                        "application/json",
                    )
                return 200, log, "text/plain"
            return 404, _status(404, "NotFound", self.path), "application/json"

        def _watch(self, q: dict[str, str], cut: bool = False) -> None:
            """Chunked stream of events newer than resourceVersion, until timeoutSeconds; `cut`:
            the first event's chunk is sent half and the connection dropped."""
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            since = int(q.get("resourceVersion") or 0)
            deadline = time.monotonic() + float(q.get("timeoutSeconds") or 30)
            self.close_connection = True
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
                        if cut:
                            self.wfile.write(f"{len(line):x}\r\n".encode() + line[: len(line) // 2])
                            self.wfile.flush()
                            self.connection.shutdown(socket.SHUT_RDWR)
                            return
                        self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                        self.wfile.flush()
                        since = rv
                self.wfile.write(b"0\r\n\r\n")
            except OSError:  # the client stopped watching, or an outage cut the stream
                pass

    return Handler
