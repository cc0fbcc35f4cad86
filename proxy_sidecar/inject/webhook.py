"""Injection webhook: a mutating admission webhook that adds the capture sidecar to harness pods.

In: AdmissionReview v1 requests for pods labelled `harnessrl.io/inject: "true"`. Out: a response
whose JSON patch adds the native sidecar (an init container with `restartPolicy: Always`) and env.
"""

from __future__ import annotations

import argparse
import base64
import json
from dataclasses import dataclass
from typing import Any

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
    memory: str = "256Mi"  # sidecar memory request and limit
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


def _list(items: Any) -> list[Any]:
    return items if isinstance(items, list) else []


def _objects(items: Any) -> list[dict[str, Any]]:
    return [i for i in _list(items) if isinstance(i, dict)]


def secret_readers(pod_spec: dict[str, Any], secret: str) -> list[str]:
    """Containers other than the sidecar that could read `secret`: through env, envFrom or a
    volume (secret or projected) they mount. The harness must never hold the upstream key."""
    volumes = {
        v.get("name")
        for v in _objects(pod_spec.get("volumes"))
        if (v.get("secret") or {}).get("secretName") == secret
        or any(
            (s.get("secret") or {}).get("name") == secret
            for s in (v.get("projected") or {}).get("sources") or []
        )
    }
    out = []
    for c in _objects(pod_spec.get("initContainers")) + _objects(pod_spec.get("containers")):
        if c.get("name") == SIDECAR_NAME:
            continue
        refs = [
            (e.get("valueFrom") or {}).get("secretKeyRef") or {} for e in _objects(c.get("env"))
        ]
        refs += [e.get("secretRef") or {} for e in _objects(c.get("envFrom"))]
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
    if not isinstance(pod, dict):
        return False
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return isinstance(labels, dict) and labels.get(INJECT_LABEL) == "true"


def build_patch(pod: dict[str, Any], spec: SidecarSpec) -> list[dict[str, Any]]:
    """RFC 6902 operations that inject the sidecar; empty when the pod already has everything."""
    pod_spec = pod.get("spec")
    if not isinstance(pod_spec, dict) or not isinstance(pod_spec.get("containers"), list):
        raise ValueError("pod has no spec.containers list")
    if pod_spec.get("shareProcessNamespace"):
        raise ValueError(
            "shareProcessNamespace would let the harness read the sidecar's secrets from /proc; "
            "remove it from the pod"
        )
    ops = _token_ops(pod_spec)  # first: removals by index, before anything shifts them
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    # Without an explicit rollout id each pod is its own rollout, named after the pod (unique in
    # its namespace; known only at run time for generateName pods, hence the downward API).
    field = ROLLOUT_FROM_ANNOTATION if ROLLOUT_ANNOTATION in annotations else "metadata.name"
    sidecar = sidecar_container(spec, field)
    inits = pod_spec.get("initContainers")
    if inits is None:
        ops.append({"op": "add", "path": "/spec/initContainers", "value": [sidecar]})
    elif not isinstance(inits, list):
        raise ValueError("pod spec.initContainers is not a list")
    elif not any(isinstance(c, dict) and c.get("name") == SIDECAR_NAME for c in inits):
        # First, so that the harness's own init containers can already reach the model.
        ops.append({"op": "add", "path": "/spec/initContainers/0", "value": sidecar})
    for i, container in enumerate(pod_spec["containers"]):
        if not isinstance(container, dict):
            raise ValueError(f"pod spec.containers[{i}] is not an object")
        ops.extend(_env_ops(f"/spec/containers/{i}", container.get("env"), spec))
    secrets = (spec.store_secret, spec.control_secret, spec.upstream_key_secret)
    for secret in filter(None, secrets):  # checked once the containers are known to be objects
        if readers := secret_readers(pod_spec, secret):
            raise ValueError(
                f"containers {readers} read Secret {secret!r}, which only the capture sidecar "
                "may hold (a harness with it could bypass or forge the capture); remove that"
            )
    ops.extend(_pod_ops(pod, spec))
    if ops:
        ops.extend(_annotation_ops(pod))
    return ops


def _env_ops(path: str, env: Any, spec: SidecarSpec) -> list[dict[str, Any]]:
    wanted = harness_env(spec)
    if env is None:
        return [{"op": "add", "path": f"{path}/env", "value": wanted}]
    if not isinstance(env, list):
        raise ValueError(f"{path}/env is not a list")
    index = {e.get("name"): j for j, e in enumerate(env) if isinstance(e, dict)}
    ops: list[dict[str, Any]] = []
    for var in wanted:
        j = index.get(var["name"])
        if j is None:
            ops.append({"op": "add", "path": f"{path}/env/-", "value": var})
        elif var["name"] == "OPENAI_BASE_URL" and env[j] != var:
            # Capture is the point of the label: the base URL must go through the sidecar.
            ops.append({"op": "replace", "path": f"{path}/env/{j}", "value": var})
        # A harness's own OPENAI_API_KEY is kept: the sidecar ignores it, some SDKs insist on one.
    return ops


def _token_ops(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Remove the API token the ServiceAccount admission plugin mounted before this webhook ran
    (automountServiceAccountToken: false comes too late to stop it)."""
    volumes = pod_spec.get("volumes")
    if not isinstance(volumes, list):
        return []
    tokens = {
        v.get("name"): i
        for i, v in enumerate(volumes)
        if isinstance(v, dict)
        and any(
            "serviceAccountToken" in s for s in _objects((v.get("projected") or {}).get("sources"))
        )
    }
    ops: list[dict[str, Any]] = []
    for kind in ("initContainers", "containers"):
        containers = pod_spec.get(kind)
        for i, c in enumerate(containers if isinstance(containers, list) else []):
            mounts = c.get("volumeMounts") if isinstance(c, dict) else None
            named = [isinstance(m, dict) and m.get("name") in tokens for m in _list(mounts)]
            for j in reversed([j for j, hit in enumerate(named) if hit]):
                ops.append({"op": "remove", "path": f"/spec/{kind}/{i}/volumeMounts/{j}"})
    for i in sorted(tokens.values(), reverse=True):
        ops.append({"op": "remove", "path": f"/spec/volumes/{i}"})
    return ops


def _pod_ops(pod: dict[str, Any], spec: SidecarSpec) -> list[dict[str, Any]]:
    """The sidecar's volumes, the label the NetworkPolicies select, and no API token: the harness
    must not read the sidecar's Secrets through the API server."""
    pod_spec, ops = pod["spec"], list[dict[str, Any]]()
    volumes = pod_spec.get("volumes")
    names = {v.get("name") for v in _objects(volumes)}
    for volume in sidecar_volumes(spec):
        if volumes is None:
            ops.append({"op": "add", "path": "/spec/volumes", "value": [volume]})
            volumes = [volume]
        elif volume["name"] not in names:
            ops.append({"op": "add", "path": "/spec/volumes/-", "value": volume})
    if pod_spec.get("automountServiceAccountToken") is not False:
        ops.append({"op": "add", "path": "/spec/automountServiceAccountToken", "value": False})
    labels = pod.get("metadata", {}).get("labels")  # owns(): the inject label is there
    if labels.get(SIDECAR_LABEL) != "true":
        ops.append(
            {"op": "add", "path": f"/metadata/labels/{_escape(SIDECAR_LABEL)}", "value": "true"}
        )
    return ops


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")  # RFC 6901


def _annotation_ops(pod: dict[str, Any]) -> list[dict[str, Any]]:
    meta = pod.get("metadata") or {}
    note = {INJECTED_ANNOTATION: SIDECAR_NAME}
    if not isinstance(meta.get("annotations"), dict):
        return [{"op": "add", "path": "/metadata/annotations", "value": note}]
    path = f"/metadata/annotations/{_escape(INJECTED_ANNOTATION)}"
    return [{"op": "add", "path": path, "value": SIDECAR_NAME}]


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
    is_pod = (request.get("kind") or {}).get("kind") == "Pod" and not request.get("subResource")
    if is_pod and request.get("operation") == "CREATE" and isinstance(pod, dict) and owns(pod):
        try:
            ops = build_patch(pod, spec)
        except ValueError as err:
            # An opted-in pod that cannot get its sidecar would run unrecorded: refuse it loudly.
            response["allowed"] = False
            response["status"] = {"code": 400, "message": f"harnessrl injection: {err}"}
            ops = []
        if ops:
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(json.dumps(ops).encode()).decode()
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


async def mutate(request: Request) -> Response:
    try:
        review = json.loads(await request.body())
        return JSONResponse(review_response(review, request.app.state.spec))
    except (ValueError, UnicodeDecodeError) as err:
        return JSONResponse({"error": str(err)}, status_code=400)


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

    from harnessrl.listener import HttpLimits, server_config

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
