"""Every manifest in k8s/ validates against Kubernetes 1.33 (strict) and the JobSet CRD schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubectl_needed import needs_kubectl
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

from harnessrl.config import load_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = ["base", "controller", "gpu", "gke-tpu"]
JOBSET_SCHEMA = ROOT / "tests" / "fixtures" / "jobset" / "jobset-v1alpha2.schema.json"
K8S_VERSION = "1.33"


def manifest_files() -> list[Path]:
    files = sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")
    assert len(files) >= 10, files
    return files


def docs_of(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def jobset_validator() -> jsonschema.Draft202012Validator:
    defs = schema_contents(
        f"kubernetes-json-schema/v{K8S_VERSION}.0-local-strict/_definitions.json", K8S_VERSION
    )
    registry = Registry().with_resource("/api/_definitions.json", Resource.from_contents(defs))
    schema = json.loads(JOBSET_SCHEMA.read_text())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate(doc: dict[str, Any]) -> None:
    if doc.get("kind") == "JobSet":
        jobset_validator().validate(doc)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_each_manifest_file_validates_strictly(path: Path) -> None:
    docs = docs_of(path.read_text())
    assert docs, f"{path} holds no objects"
    for doc in docs:
        validate(doc)


def test_kustomizations_reference_existing_files() -> None:
    for kfile in K8S.rglob("kustomization.yaml"):
        doc = yaml.safe_load(kfile.read_text())
        for res in [*doc.get("resources", []), *doc.get("components", [])]:
            assert (kfile.parent / res).exists(), f"{kfile}: missing resource {res}"


def render(overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / overlay)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return docs_of(out.stdout)


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_overlay_validates_and_is_consistent(overlay: str) -> None:
    docs = render(overlay)
    for doc in docs:
        validate(doc)
        if doc["kind"] not in ("Namespace", "MutatingWebhookConfiguration"):
            assert doc["metadata"]["namespace"] == "harnessrl", doc["metadata"]["name"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "harnessrl"
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
    }
    for svc in (d for d in docs if d["kind"] == "Service"):
        sel = svc["spec"]["selector"].items()
        assert any(sel <= (t["metadata"]["labels"]).items() for t in pods.values()), svc[
            "metadata"
        ]["name"]


def by_kind(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def base_docs() -> list[dict[str, Any]]:
    return [
        d
        for p in sorted((K8S / "base").glob("*.yaml"))
        if p.name != "kustomization.yaml"
        for d in docs_of(p.read_text())
    ]


def test_webhook_only_sees_opted_in_pods_and_serves_tls() -> None:
    docs = base_docs()
    (hook,) = by_kind(docs, "MutatingWebhookConfiguration", "harnessrl-sidecar-injector")[
        "webhooks"
    ]
    assert hook["objectSelector"] == {"matchLabels": {"harnessrl.io/inject": "true"}}
    assert hook["sideEffects"] == "None" and hook["reinvocationPolicy"] == "IfNeeded"
    assert hook["rules"][0]["resources"] == ["pods"] and hook["rules"][0]["operations"] == [
        "CREATE"
    ]
    svc = by_kind(docs, "Service", hook["clientConfig"]["service"]["name"])
    assert svc["spec"]["ports"][0]["port"] == hook["clientConfig"]["service"]["port"]
    pod = by_kind(docs, "Deployment", "harnessrl-webhook")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"] == ["python", "-m", "proxy_sidecar.inject.webhook"]
    assert (
        "--tls-cert=/tls/tls.crt" in c["args"]
        and c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    )


def test_vllm_has_the_flags_weight_sync_needs() -> None:
    sts = by_kind(base_docs(), "StatefulSet", "vllm")
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in c["env"]
    for flag in ("--dtype=bfloat16", "--enable-auto-tool-choice", "--tool-call-parser=hermes"):
        assert flag in c["args"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert by_kind(base_docs(), "Service", "vllm")["spec"]["clusterIP"] == "None"  # per-replica DNS


def recipe(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "tpu_configs" / f"{name}.yaml").read_text())


def mesh_arg(args: list[str]) -> str:
    return next(a for a in args if a.startswith("learner.mesh=")).removeprefix("learner.mesh=")


def test_learners_match_their_tpu_configs_recipes() -> None:
    (jobset,) = docs_of((K8S / "gke-tpu" / "learner-jobset.yaml").read_text())
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod = job["template"]["spec"]
    mesh = mesh_arg(pod["containers"][0]["args"])
    r = recipe(mesh)
    assert job["parallelism"] == job["completions"] == r["hosts"]
    assert pod["containers"][0]["resources"]["limits"]["google.com/tpu"] == str(r["chips_per_host"])
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == r["accelerator"]
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == r["topology"]
    (gpu_job,) = docs_of((K8S / "gpu" / "learner-job.yaml").read_text())
    gpod = gpu_job["spec"]["template"]["spec"]
    g = recipe(mesh_arg(gpod["containers"][0]["args"]))
    assert gpod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == str(
        g["chips_per_host"]
    )
    assert gpod["nodeSelector"]["cloud.google.com/gke-accelerator"] == g["accelerator"]


def test_train_config_map_loads_with_the_config_loader(tmp_path: Path) -> None:
    cm = by_kind(base_docs(), "ConfigMap", "harnessrl-train")
    f = tmp_path / "train.yaml"
    f.write_text(cm["data"]["train.yaml"])
    for path in (
        "controller/train-job.yaml",
        "gpu/learner-job.yaml",
        "gke-tpu/learner-jobset.yaml",
    ):
        (doc,) = docs_of((K8S / path).read_text())
        (train,) = _pod_specs(doc)[0]["containers"]
        # What Kubernetes hands the process: $(VAR) in args expanded from the container's env.
        dsn = "postgresql://harnessrl:secret@postgres.harnessrl.svc:5432/traces"
        image = "registry.example.com/harnessrl:1"
        args = [
            a.replace("$(HARNESSRL_STORE_URL)", dsn)
            .replace("$(HARNESSRL_IMAGE)", image)
            .replace("/etc/harnessrl/train.yaml", str(f))
            for a in train["args"]
        ]
        env = {e["name"]: e.get("valueFrom", {}) for e in train["env"]}
        assert env["HARNESSRL_STORE_URL"]["secretKeyRef"]["name"] == "harnessrl-store"
        assert env["HARNESSRL_CONTROL_TOKEN"]["secretKeyRef"]["name"] == "harnessrl-control"
        cfg = load_config(None, args)
        assert cfg.rollout.launcher == "kubernetes" and cfg.rollout.store == dsn
        assert cfg.rollout.kubernetes.image == cfg.rollout.kubernetes.sidecar.image == image
        assert cfg.rollout.servers and cfg.run.out_dir.startswith("/shared/")


def _pod_specs(doc: dict) -> list[dict]:
    if doc["kind"] == "JobSet":
        return [j["template"]["spec"]["template"]["spec"] for j in doc["spec"]["replicatedJobs"]]
    return [doc["spec"]["template"]["spec"]]


def test_jobset_schema_is_strict() -> None:
    (good,) = docs_of((K8S / "gke-tpu" / "learner-jobset.yaml").read_text())
    validate(good)
    unknown = json.loads(json.dumps(good))
    unknown["spec"]["replicatedJobs"][0]["replicaz"] = 2
    with pytest.raises(jsonschema.ValidationError, match="replicaz"):
        validate(unknown)
    bad_inner = json.loads(json.dumps(good))
    bad_inner["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
        "imagee"
    ] = "x"
    with pytest.raises(jsonschema.ValidationError, match="imagee"):
        validate(bad_inner)


def test_kubernetes_validate_cli_strict_passes_on_all_files() -> None:
    """The same check a user runs: only JobSet is unknown to it (checked against its CRD above)."""
    cli = Path(sys.executable).parent / "kubernetes-validate"
    files = [str(p) for p in manifest_files()]
    out = subprocess.run(
        [str(cli), "--strict", "-k", K8S_VERSION, "--quiet", *files],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    problems = [line for line in out.stdout.splitlines() if line.strip()]
    assert problems and all(line.startswith("WARN") and "JobSet" in line for line in problems), (
        problems
    )


def test_every_train_pod_can_launch_harness_jobs() -> None:
    """The train loop's KubernetesLauncher needs the launcher RBAC and the sidecars' token."""
    docs = base_docs()
    role = by_kind(docs, "Role", "harnessrl-launcher")
    jobs_rule = next(r for r in role["rules"] if r["resources"] == ["jobs"])
    assert {"create", "watch", "delete"} <= set(jobs_rule["verbs"])
    assert any(r["resources"] == ["pods/log"] for r in role["rules"])
    binding = by_kind(docs, "RoleBinding", "harnessrl-launcher")
    assert binding["subjects"][0]["name"] == "harnessrl-train"
    pods = [
        docs_of((K8S / "controller" / "train-job.yaml").read_text())[0]["spec"]["template"],
        docs_of((K8S / "gpu" / "learner-job.yaml").read_text())[0]["spec"]["template"],
        docs_of((K8S / "gke-tpu" / "learner-jobset.yaml").read_text())[0]["spec"]["replicatedJobs"][
            0
        ]["template"]["spec"]["template"],
    ]
    for pod in pods:
        assert pod["spec"]["serviceAccountName"] == "harnessrl-train"
        assert (
            pod["metadata"]["labels"]["app.kubernetes.io/name"] == "harnessrl-train"
        )  # vLLM admits it
        (c,) = pod["spec"]["containers"]
        assert c["command"][:3] == ["python", "-m", "harnessrl.train"]
        # It pauses the harness pods' sidecars around a push: it needs their control token.
        assert any(e["name"] == "HARNESSRL_CONTROL_TOKEN" for e in c["env"])
