"""The train run may read the inference Service's EndpointSlices, which every weight push of
`rollout.servers=k8s://NAMESPACE/SERVICE:PORT` lists (harnessrl/fleet/replicas.py)."""

from __future__ import annotations

from pathlib import Path

import yaml

from harnessrl.fleet.replicas import SERVICE_LABEL
from proxy_sidecar.inject.webhook import SidecarSpec, sidecar_container

K8S = Path(__file__).resolve().parents[2] / "k8s"


def test_the_train_role_lists_endpointslices() -> None:
    docs = list(yaml.safe_load_all((K8S / "base" / "rbac.yaml").read_text()))
    role = next(
        d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "harnessrl-launcher"
    )
    rule = next(r for r in role["rules"] if r["resources"] == ["endpointslices"])
    assert rule["apiGroups"] == ["discovery.k8s.io"] and "list" in rule["verbs"]
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert binding["roleRef"]["name"] == "harnessrl-launcher"
    assert binding["subjects"][0]["name"] == "harnessrl-train"
    # The label Kubernetes puts on a Service's slices, which the lookup selects by.
    assert SERVICE_LABEL == "kubernetes.io/service-name"


def test_the_shipped_train_run_and_webhook_name_every_replica(tmp_path: Path) -> None:
    """A Service's DNS name picks one replica per lookup: pushes and calls name the Service as
    k8s:// so every replica is pushed and each call knows which replica served it."""
    config = yaml.safe_load((K8S / "base" / "train-config.yaml").read_text())
    train = yaml.safe_load(config["data"]["train.yaml"])
    assert train["rollout"]["servers"] == "k8s://harnessrl/vllm:8000"
    webhook = [d for d in yaml.safe_load_all((K8S / "base" / "webhook.yaml").read_text()) if d]
    args = [
        a
        for d in webhook
        if d["kind"] == "Deployment"
        for c in d["spec"]["template"]["spec"]["containers"]
        for a in c.get("args", [])
    ]
    assert "--upstream=k8s://harnessrl/vllm:8000" in args
    # The spec the loop and the webhook build takes it (the sidecar resolves it itself).
    spec = SidecarSpec(image="harnessrl:test", upstream="k8s://harnessrl/vllm:8000")
    assert "k8s://harnessrl/vllm:8000" in sidecar_container(spec)["args"]
