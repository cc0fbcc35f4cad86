"""Injection webhook: a mutating admission webhook that adds the capture sidecar to harness pods.

In: AdmissionReview v1 requests (at most 3 MiB) for pods labelled `harnessrl.io/inject: "true"`.
Out: a response whose JSON patch (`jsonpatch.make_patch`, from the pod to the pod as it must run)
adds the native sidecar (an init container with `restartPolicy: Always`) and env.
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
from dataclasses import dataclass
from typing import Any

import jsonpatch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from proxy_sidecar.control import rollout_url

INJECT_LABEL = "harnessrl.io/inject"
ROLLOUT_ANNOTATION = "harnessrl.io/rollout-id"
INJECTED_ANNOTATION = "harnessrl.io/injected"
SIDECAR_NAME = "harnessrl-sidecar"
# Every pod with a capture sidecar: the NetworkPolicies of k8s/base admit these to vLLM and the
# store, and only the train run to their sidecar's port.
SIDECAR_LABEL = "harnessrl.io/sidecar"
SHARED_VOLUME = "harnessrl-sidecar-shared"
UPSTREAM_KEY_ENV = "HARNESSRL_UPSTREAM_API_KEY"
DEFAULT_IMAGE = "ghcr.io/harnessrl/harnessrl:0.1.0"
# The API server caps request bodies at 3 MiB, so no real review is larger; past it, 413.
MAX_REVIEW_BYTES = 3 * 1024 * 1024


@dataclass(frozen=True)
class SidecarSpec:
    """The capture sidecar that runs beside each harness; shared by the webhook and the launcher."""

    image: str = DEFAULT_IMAGE  # the capture sidecar image
    upstream: str = "http://vllm.harnessrl.svc.cluster.local:8000"  # comma-separated for several
    port: int = 8080  # the sidecar's port inside each harness pod
    store_secret: str = "harnessrl-store"  # Secret whose key `url` holds the trace store DSN
    control_secret: str = "harnessrl-control"  # Secret whose key `token` guards the control API
    api_key: str = "harnessrl"  # what the harness sends; the sidecar does not check it
    cpu: str = "250m"  # sidecar CPU request
    # sidecar memory request and limit: its peak at the default body limits, under the heaviest
    # bodies, was 554 MiB (docs/sidecar.md, "Bounded memory"); more with a tokenizer
    memory: str = "768Mi"
    # The harness's model name is rewritten to this, whatever it asks for: vLLM 404s any name
    # but its --served-model-name
    model: str = ""  # model name every call is sent upstream with; "": the harness's own
    # Secret whose key `api-key` the sidecar sends upstream (vLLM's --api-key); mounted into the
    # sidecar only, so the harness beside it cannot call the server uncaptured. "": none
    upstream_key_secret: str = ""
    # token-in mode's tokenizer (/v1/responses, /v1/messages): tiny, smollm2, or an HF folder
    # under shared_path on shared_claim; "": token-in off
    tokenizer: str = ""
    shared_claim: str = ""  # PVC mounted read-only at shared_path into the sidecar; "": none
    shared_path: str = "/shared"  # where the sidecar sees shared_claim

    def __post_init__(self) -> None:
        if not isinstance(self.image, str) or not self.image:
            raise ValueError(f"SidecarSpec.image must be a container image, got {self.image!r}")
        if not isinstance(self.upstream, str) or not self.upstream.startswith(
            ("http://", "https://", "k8s://")
        ):
            raise ValueError(
                f"SidecarSpec.upstream must be http(s) URL(s) or k8s://NAMESPACE/SERVICE:PORT "
                f"(every replica of a Service), got {self.upstream!r}; e.g. k8s://harnessrl/vllm:8000"
            )
        if not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise ValueError(f"SidecarSpec.port must be an int in 1..65535, got {self.port!r}")
        for name in ("store_secret", "control_secret"):
            if not getattr(self, name):
                raise ValueError(
                    f"SidecarSpec.{name} must name a Secret, got {getattr(self, name)!r}"
                )
        if not self.sees(self.tokenizer):
            raise ValueError(
                f"SidecarSpec.tokenizer {self.tokenizer!r} is a folder the sidecar can read only "
                f"from the shared volume: put it under shared_path ({self.shared_path!r}) and set "
                f"shared_claim to the PVC that holds it (got {self.shared_claim!r})"
            )

    def sees(self, tokenizer: str) -> bool:
        """Whether the sidecar can load `tokenizer`: a name, or a folder on its shared claim."""
        under = tokenizer.startswith(self.shared_path.rstrip("/") + "/")
        return not tokenizer.startswith("/") or bool(under and self.shared_claim)

    @property
    def url(self) -> str:
        """The sidecar as the harness beside it reaches it: localhost inside the pod."""
        return f"http://127.0.0.1:{self.port}"


ROLLOUT_FROM_ANNOTATION = f"metadata.annotations['{ROLLOUT_ANNOTATION}']"


def sidecar_container(
    spec: SidecarSpec, rollout_field: str = ROLLOUT_FROM_ANNOTATION
) -> dict[str, Any]:
    """The native sidecar: kubelet starts it before the harness and stops it after the harness exits.

    `rollout_field` is the pod field (downward API) that names the rollout of plain /v1 calls.
    """
    env = [
        _secret_env("HARNESSRL_STORE_URL", spec.store_secret, "url"),
        _secret_env("HARNESSRL_CONTROL_TOKEN", spec.control_secret, "token"),
        # The default rollout for plain /v1 calls: one harness per pod.
        {"name": "HARNESSRL_ROLLOUT_ID", "valueFrom": {"fieldRef": {"fieldPath": rollout_field}}},
    ]
    if spec.upstream_key_secret:
        env.append(_secret_env(UPSTREAM_KEY_ENV, spec.upstream_key_secret, "api-key"))
    mounts = [{"name": SHARED_VOLUME, "mountPath": spec.shared_path, "readOnly": True}]
    return {
        "name": SIDECAR_NAME,
        "image": spec.image,
        "restartPolicy": "Always",
        "command": ["python", "-m", "proxy_sidecar"],
        # $(VAR) is expanded by the kubelet from the env below, so no secret sits in the pod spec.
        "args": [
            *("--upstream", spec.upstream, "--store", "$(HARNESSRL_STORE_URL)"),
            *("--host", "0.0.0.0", "--port", str(spec.port)),
            *(("--model", spec.model) if spec.model else ()),
            *(("--tokenizer", spec.tokenizer) if spec.tokenizer else ()),
        ],
        "env": env,
        **({"volumeMounts": mounts} if spec.shared_claim else {}),
        "ports": [{"name": "sidecar", "containerPort": spec.port, "protocol": "TCP"}],
        # The harness starts only once this probe passes, so its first call finds the proxy up.
        "startupProbe": {
            "tcpSocket": {"port": spec.port},
            "periodSeconds": 1,
            "failureThreshold": 60,
        },
        "resources": {
            "requests": {"cpu": spec.cpu, "memory": spec.memory},
            "limits": {"memory": spec.memory},
        },
        "securityContext": {"allowPrivilegeEscalation": False},
    }


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def sidecar_volumes(spec: SidecarSpec) -> list[dict[str, Any]]:
    """The pod volumes the sidecar mounts: the shared claim (read-only), where its tokenizer is."""
    if not spec.shared_claim:
        return []
    claim = {"claimName": spec.shared_claim, "readOnly": True}
    return [{"name": SHARED_VOLUME, "persistentVolumeClaim": claim}]


def _obj(value: Any) -> dict[str, Any]:
    """`value` if it is a JSON object, else an empty one: reviews are read, never trusted."""
    return value if isinstance(value, dict) else {}


def _objects(items: Any) -> list[dict[str, Any]]:
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def secret_readers(pod_spec: dict[str, Any], secret: str) -> list[str]:
    """Containers other than the sidecar that could read `secret`: through env, envFrom or a
    volume (secret or projected) they mount. The harness must never hold the upstream key."""
    volumes = {
        v.get("name")
        for v in _objects(pod_spec.get("volumes"))
        if _obj(v.get("secret")).get("secretName") == secret
        or any(
            _obj(s.get("secret")).get("name") == secret
            for s in _objects(_obj(v.get("projected")).get("sources"))
        )
    }
    out = []
    for c in _objects(pod_spec.get("initContainers")) + _objects(pod_spec.get("containers")):
        if c.get("name") == SIDECAR_NAME:
            continue
        refs = [_obj(_obj(e.get("valueFrom")).get("secretKeyRef")) for e in _objects(c.get("env"))]
        refs += [_obj(e.get("secretRef")) for e in _objects(c.get("envFrom"))]
        mounts = {m.get("name") for m in _objects(c.get("volumeMounts"))}
        if any(r.get("name") == secret for r in refs) or mounts & volumes:
            out.append(str(c.get("name")))
    return out


def harness_env(spec: SidecarSpec, rollout_id: str | None = None) -> list[dict[str, str]]:
    """Env that points an unchanged harness at the sidecar on localhost."""
    base_url = rollout_url(spec.url, rollout_id) if rollout_id else f"{spec.url}/v1"
    return [
        {"name": "OPENAI_BASE_URL", "value": base_url},
        {"name": "OPENAI_API_KEY", "value": spec.api_key},
    ]


def owns(pod: Any) -> bool:
    """Only pods that opted in through the label are ever touched."""
    labels = _obj(_obj(pod).get("metadata")).get("labels")
    return _obj(labels).get(INJECT_LABEL) == "true"


def injected(pod: dict[str, Any], spec: SidecarSpec) -> dict[str, Any]:
    """The pod as it must run (`pod` itself is left as it is): the sidecar first among its init
    containers, every container pointed at it, no API token; a ValueError says why not."""
    out = copy.deepcopy(pod)
    pod_spec = out.get("spec")
    if not isinstance(pod_spec, dict) or not isinstance(pod_spec.get("containers"), list):
        raise ValueError("pod has no spec.containers list")
    if pod_spec.get("shareProcessNamespace"):
        raise ValueError(
            "shareProcessNamespace would let the harness read the sidecar's secrets from /proc; "
            "remove it from the pod"
        )
    inits = pod_spec.setdefault("initContainers", [])
    if not isinstance(inits, list):
        raise ValueError("pod spec.initContainers is not a list")
    for i, container in enumerate(pod_spec["containers"]):
        if not isinstance(container, dict):
            raise ValueError(f"pod spec.containers[{i}] is not an object")
        _point_at_sidecar(container, f"/spec/containers/{i}", spec)
    secrets = (spec.store_secret, spec.control_secret, spec.upstream_key_secret)
    for secret in filter(None, secrets):  # checked once the containers are known to be objects
        if readers := secret_readers(pod_spec, secret):
            raise ValueError(
                f"containers {readers} read Secret {secret!r}, which only the capture sidecar "
                "may hold (a harness with it could bypass or forge the capture); remove that"
            )
    _drop_api_token(pod_spec)
    meta = out["metadata"]  # owns(): a mapping, with a labels mapping
    if not any(c.get("name") == SIDECAR_NAME for c in _objects(inits)):
        # Without an explicit rollout id each pod is its own rollout, named after the pod
        # (unique in its namespace; known only at run time for generateName pods, hence the
        # downward API). First, so that the harness's own init containers reach the model.
        named = ROLLOUT_ANNOTATION in _obj(meta.get("annotations"))
        inits.insert(
            0, sidecar_container(spec, ROLLOUT_FROM_ANNOTATION if named else "metadata.name")
        )
    names = {v.get("name") for v in _objects(pod_spec.get("volumes"))}
    if extra := [v for v in sidecar_volumes(spec) if v["name"] not in names]:
        volumes = pod_spec.setdefault("volumes", [])
        if not isinstance(volumes, list):
            raise ValueError("pod spec.volumes is not a list")
        volumes += extra
    # The NetworkPolicies of k8s/base select the label; the harness must not read the sidecar's
    # Secrets through the API server.
    pod_spec["automountServiceAccountToken"] = False
    meta["labels"][SIDECAR_LABEL] = "true"
    if out != pod:
        if not isinstance(meta.get("annotations"), dict):
            meta["annotations"] = {}
        meta["annotations"][INJECTED_ANNOTATION] = SIDECAR_NAME
    return out


def build_patch(pod: dict[str, Any], spec: SidecarSpec) -> list[dict[str, Any]]:
    """The RFC 6902 patch from `pod` to `injected(pod)`; empty when the pod has everything."""
    ops: list[dict[str, Any]] = jsonpatch.make_patch(pod, injected(pod, spec)).patch
    return ops


def _point_at_sidecar(container: dict[str, Any], path: str, spec: SidecarSpec) -> None:
    env = container.get("env")
    if env is None:
        env = container["env"] = []
    if not isinstance(env, list):
        raise ValueError(f"{path}/env is not a list")
    index = {e.get("name"): j for j, e in enumerate(env) if isinstance(e, dict)}
    for var in harness_env(spec):
        j = index.get(var["name"])
        if j is None:
            env.append(var)
        elif var["name"] == "OPENAI_BASE_URL":
            # Capture is the point of the label: the base URL must go through the sidecar.
            env[j] = var
        # A harness's own OPENAI_API_KEY is kept: the sidecar ignores it, some SDKs insist on one.


def _drop_api_token(pod_spec: dict[str, Any]) -> None:
    """Remove the API token the ServiceAccount admission plugin mounted before this webhook ran
    (automountServiceAccountToken: false comes too late to stop it)."""
    tokens = {
        v.get("name")
        for v in _objects(pod_spec.get("volumes"))
        if any(
            "serviceAccountToken" in s for s in _objects(_obj(v.get("projected")).get("sources"))
        )
    }
    if not tokens:
        return
    pod_spec["volumes"] = [v for v in pod_spec["volumes"] if _obj(v).get("name") not in tokens]
    for c in _objects(pod_spec.get("initContainers")) + _objects(pod_spec.get("containers")):
        if isinstance(c.get("volumeMounts"), list):
            c["volumeMounts"] = [m for m in c["volumeMounts"] if _obj(m).get("name") not in tokens]


def review_response(review: Any, spec: SidecarSpec) -> dict[str, Any]:
    """AdmissionReview in → AdmissionReview out. Pods we do not own are always allowed unchanged."""
    if not isinstance(review, dict) or review.get("kind") != "AdmissionReview":
        raise ValueError("body is not an AdmissionReview object")
    if review.get("apiVersion") != "admission.k8s.io/v1":
        raise ValueError(
            f"AdmissionReview apiVersion must be admission.k8s.io/v1, got {review.get('apiVersion')!r}"
        )
    request = review.get("request")
    if not isinstance(request, dict) or not isinstance(request.get("uid"), str):
        raise ValueError("AdmissionReview.request.uid is missing")
    response: dict[str, Any] = {"uid": request["uid"], "allowed": True}
    pod = request.get("object")
    is_pod = _obj(request.get("kind")).get("kind") == "Pod" and not request.get("subResource")
    if is_pod and request.get("operation") == "CREATE" and isinstance(pod, dict) and owns(pod):
        try:
            try:
                ops = build_patch(pod, spec)
                patch = json.dumps(ops).encode()
            except RecursionError as err:  # parsed by the C decoder, too deep to copy here
                raise ValueError("the pod is nested too deeply to be patched") from err
        except ValueError as err:
            # An opted-in pod that cannot get its sidecar would run unrecorded: refuse it loudly.
            response["allowed"] = False
            response["status"] = {"code": 400, "message": f"harnessrl injection: {err}"}
            ops = []
        if ops:
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(patch).decode()
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


async def mutate(request: Request) -> Response:
    """Bad reviews get a 400 (413 past `MAX_REVIEW_BYTES`) whose JSON says why, never a 500."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_REVIEW_BYTES:
        return _refused(413, f"AdmissionReview over {MAX_REVIEW_BYTES} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_REVIEW_BYTES:  # sent without a length: stop reading it here
            return _refused(413, f"AdmissionReview over {MAX_REVIEW_BYTES} bytes")
    try:
        review = json.loads(body)
    except RecursionError:
        return _refused(400, "body is nested too deeply to be an AdmissionReview")
    except ValueError as err:  # UnicodeDecodeError included
        return _refused(400, f"body is not JSON: {err}")
    try:
        return JSONResponse(review_response(review, request.app.state.spec))
    except ValueError as err:
        return _refused(400, str(err))


def _refused(status: int, message: str) -> Response:
    # Connection closed: after a 413 the rest of the body is left unread.
    headers = {"connection": "close"} if status == 413 else None
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def healthz(request: Request) -> Response:
    return PlainTextResponse("ok")


def create_app(spec: SidecarSpec) -> Starlette:
    app = Starlette(
        routes=[
            Route("/mutate", mutate, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
        ]
    )
    app.state.spec = spec
    return app


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, SidecarSpec]:
    """The webhook's flags, and the sidecar they inject."""
    ap = argparse.ArgumentParser(
        prog="python -m proxy_sidecar.inject.webhook",
        description="harnessrl sidecar injection webhook",
    )
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=8443)
    ap.add_argument("--tls-cert", required=True, help="PEM serving certificate")
    ap.add_argument("--tls-key", required=True, help="PEM private key")
    ap.add_argument("--sidecar-image", default=DEFAULT_IMAGE)
    ap.add_argument("--upstream", default=SidecarSpec.upstream)
    ap.add_argument("--sidecar-port", type=int, default=SidecarSpec.port)
    ap.add_argument("--store-secret", default=SidecarSpec.store_secret)
    ap.add_argument("--control-secret", default=SidecarSpec.control_secret)
    ap.add_argument("--model", default="", help="model name the sidecar sends upstream")
    ap.add_argument("--upstream-key-secret", default="", help="Secret with the upstream's api-key")
    ap.add_argument("--tokenizer", default="", help="token-in mode's tokenizer (or HF folder)")
    ap.add_argument("--shared-claim", default="", help="PVC mounted read-only into the sidecar")
    ap.add_argument("--shared-path", default=SidecarSpec.shared_path, help="where it is mounted")
    ap.add_argument("--sidecar-memory", default=SidecarSpec.memory, help="request and limit")
    args = ap.parse_args(argv)
    spec = SidecarSpec(
        image=args.sidecar_image,
        upstream=args.upstream,
        port=args.sidecar_port,
        store_secret=args.store_secret,
        control_secret=args.control_secret,
        model=args.model,
        upstream_key_secret=args.upstream_key_secret,
        tokenizer=args.tokenizer,
        shared_claim=args.shared_claim,
        shared_path=args.shared_path,
        memory=args.sidecar_memory,
    )
    return args, spec


def main(argv: list[str] | None = None) -> None:
    args, spec = parse_args(argv)
    import uvicorn

    from harnessrl.http.listener import HttpLimits, server_config

    # The API server is its only client, but the port is reachable in-cluster: bounded heads.
    listener = server_config(
        create_app(spec),
        host=args.host,
        port=args.port,
        limits=HttpLimits(),
        ssl_certfile=args.tls_cert,
        ssl_keyfile=args.tls_key,
        log_level="info",
    )
    uvicorn.Server(listener).run()


if __name__ == "__main__":
    main()
