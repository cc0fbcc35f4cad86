"""The train run may read the inference Service's EndpointSlices, which every weight push of
`rollout.servers=k8s://NAMESPACE/SERVICE:PORT` lists (harnessrl/fleet/replicas.py)."""

from __future__ import annotations

from pathlib import Path

import yaml

from harnessrl.fleet.replicas import SERVICE_LABEL

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
