"""The manifests as the guides use them, step by step: the shared claim gets its RWX class from the
first thing applied, vLLM fits the guide's GPU nodes, and the pods on the share can write to it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubectl_needed import needs_kubectl

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
GUIDES = {
    "gke-tpu": ROOT / "docs" / "howto-gke-tpu.md",
    "gpu": ROOT / "docs" / "howto-gpu-cluster.md",
}
# Memory (GB, as Google states it) of the machine types the guides create node pools of.
MACHINE_MEMORY_GIB = {"g2-standard-8": 32, "g2-standard-12": 48, "g2-standard-16": 64,
                      "g2-standard-24": 96, "g2-standard-32": 128}  # fmt: skip
DAEMONSETS_GIB = 2.0  # what GKE's own DaemonSets (GPU plugin, logging, metadata) request per node


def render(overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / overlay)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def shell_lines(guide: Path) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", guide.read_text(), flags=re.S)
    return [line.strip() for block in blocks for line in block.replace("\\\n", " ").splitlines()]


def claim_class(docs: list[dict[str, Any]]) -> str | None:
    (claim,) = [
        d for d in docs
        if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == "harnessrl-shared"
    ]  # fmt: skip
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    return claim["spec"].get("storageClassName")


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(GUIDES))
def test_the_first_apply_of_each_guide_gives_the_claim_its_rwx_class(overlay: str) -> None:
    applied = [
        m[1] for line in shell_lines(GUIDES[overlay])
        if (m := re.match(r"kubectl apply -k (\S+)", line))
    ]  # fmt: skip
    assert applied[-1] == f"k8s/{overlay}", applied  # the learner comes last
    first = render(applied[0].removeprefix("k8s/"))
    wanted = claim_class(render(overlay))
    assert wanted, f"k8s/{overlay} leaves the shared claim without a storage class"
    assert claim_class(first) == wanted, f"{applied[0]} creates the claim with another class"
    assert "k8s/base" not in applied
    # The base alone never falls back to the cluster's default class (a disk, not shareable).
    assert claim_class(render("base")) == ""


def gke_allocatable_gib(memory_gib: float) -> float:
    """GKE's allocatable memory: minus its tiered reservation and the 100 MiB eviction threshold."""
    tiers = [(4, 0.25), (4, 0.20), (8, 0.10), (112, 0.06), (float("inf"), 0.02)]
    reserved, left = 0.0, memory_gib
    for size, share in tiers:
        part = min(left, size)
        reserved, left = reserved + part * share, left - part
    return memory_gib - reserved - 100 / 1024


def quantity_gib(text: str) -> float:
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)(Gi|Mi)", text).groups()  # type: ignore[union-attr]
    return float(number) / (1024 if unit == "Mi" else 1)


def test_vllm_fits_the_guides_gpu_nodes() -> None:
    line = next(ln for ln in shell_lines(GUIDES["gke-tpu"]) if "node-pools create vllm-gpu" in ln)
    machine = re.search(r"--machine-type=(\S+)", line)[1]  # type: ignore[index]
    room = gke_allocatable_gib(MACHINE_MEMORY_GIB[machine]) - DAEMONSETS_GIB
    assert 55 < gke_allocatable_gib(64) < 60  # about 58 GiB on a g2-standard-16
    (sts,) = [
        d for d in yaml.safe_load_all((K8S / "base" / "vllm.yaml").read_text())
        if d and d["kind"] == "StatefulSet"
    ]  # fmt: skip
    res = sts["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert quantity_gib(res["requests"]["memory"]) <= room, (machine, room, res)
    assert quantity_gib(res["limits"]["memory"]) <= room, (machine, room, res)
    vcpus = int(machine.rsplit("-", 1)[1])
    assert float(res["requests"]["cpu"]) <= vcpus - 1


def image_uid() -> int:
    return int(re.search(r"^USER (\d+)$", (K8S / "Dockerfile").read_text(), re.M)[1])  # type: ignore[index]


def pod_templates(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec") or {}
    if doc["kind"] == "JobSet":
        return [j["template"]["spec"]["template"]["spec"] for j in spec["replicatedJobs"]]
    if doc["kind"] in ("Job", "Deployment", "StatefulSet"):
        return [spec["template"]["spec"]]
    return []


@needs_kubectl
@pytest.mark.parametrize("overlay", ["gke-tpu", "gpu", "controller"])
def test_pods_writing_the_share_run_as_the_image_user_with_its_fs_group(overlay: str) -> None:
    uid, checked = image_uid(), 0
    for doc in render(overlay):
        for pod in pod_templates(doc):
            claims = {
                v.get("persistentVolumeClaim", {}).get("claimName") for v in pod.get("volumes", [])
            }
            ours = any("harnessrl/harnessrl" in c["image"] for c in pod["containers"])
            if "harnessrl-shared" in claims and ours:
                sc = pod.get("securityContext") or {}
                assert (sc.get("runAsUser"), sc.get("fsGroup")) == (uid, uid), doc["metadata"]
                checked += 1
    assert checked >= 1


def test_the_loader_hands_the_share_to_the_image_user() -> None:
    """NFS (Filestore) ignores fsGroup and a fresh share is root's: the loader step chowns it."""
    lines = shell_lines(GUIDES["gke-tpu"])
    uid = image_uid()
    chown = [i for i, ln in enumerate(lines) if f"chown -R {uid}:{uid} /shared" in ln]
    copies = [i for i, ln in enumerate(lines) if "harnessrl/loader:/shared" in ln]
    assert chown and copies and chown[0] > max(copies), "chown after every copy into the share"
    assert "uid 10001" in GUIDES["gpu"].read_text()  # the GPU guide points at the same step


@needs_kubectl
@pytest.mark.parametrize("overlay", ["gke-tpu", "gke-tpu/services", "gpu", "controller"])
def test_one_images_entry_names_every_harnessrl_image(overlay: str, tmp_path: Path) -> None:
    """What the guides' `kustomize edit set image` in k8s/image does, by hand: every container,
    the injected sidecar and the harness Jobs' sidecar and harness follow it."""
    import shutil as sh

    from harnessrl.config import load_config

    copy = tmp_path / "k8s"
    sh.copytree(K8S, copy)
    component = copy / "image" / "kustomization.yaml"
    doc = yaml.safe_load(component.read_text())
    (entry,) = doc["images"]
    assert entry["name"] == "ghcr.io/harnessrl/harnessrl"
    entry.update(newName="registry.example.com/ml/harnessrl", newTag="7.7")
    component.write_text(yaml.safe_dump(doc))
    new = "registry.example.com/ml/harnessrl:7.7"
    out = subprocess.run(["kubectl", "kustomize", str(copy / overlay)], capture_output=True,
                         text=True, check=True, timeout=120).stdout  # fmt: skip
    assert "ghcr.io/harnessrl" not in out
    docs = [d for d in yaml.safe_load_all(out) if d]
    train_pods = 0
    for d in docs:
        for pod in pod_templates(d):
            for c in pod.get("initContainers", []) + pod["containers"]:
                if "harnessrl" in c["image"]:
                    assert c["image"] == new, (d["metadata"]["name"], c["image"])
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                if c.get("command", [])[:3] == ["python", "-m", "proxy_sidecar.inject.webhook"]:
                    assert env["HARNESSRL_IMAGE"] == new
                    assert "--sidecar-image=$(HARNESSRL_IMAGE)" in c["args"]
                if c.get("command", [])[:3] == ["python", "-m", "harnessrl.train"]:
                    train_pods += 1
                    (cm,) = [x for x in docs if x["kind"] == "ConfigMap"
                             and x["metadata"]["name"] == "harnessrl-train"]  # fmt: skip
                    f = tmp_path / "train.yaml"
                    f.write_text(cm["data"]["train.yaml"])
                    args = [a.replace("$(HARNESSRL_IMAGE)", env["HARNESSRL_IMAGE"])
                            .replace("$(HARNESSRL_STORE_URL)", "postgresql://h@p/t")
                            .replace("/etc/harnessrl/train.yaml", str(f)) for a in c["args"]]  # fmt: skip
                    cfg = load_config(None, args)
                    assert cfg.rollout.kubernetes.image == new
                    assert cfg.rollout.kubernetes.sidecar.image == new
                    # A harness image the ConfigMap names wins over the default.
                    text = f.read_text()
                    assert text.count("\n  kubernetes:\n") == 1
                    f.write_text(text.replace(
                        "\n  kubernetes:\n",
                        "\n  kubernetes:\n    image: registry.example.com/agent:2\n"))  # fmt: skip
                    mine = load_config(None, args).rollout.kubernetes
                    assert (mine.image, mine.sidecar.image) == ("registry.example.com/agent:2", new)
    assert train_pods == (0 if overlay.endswith("services") else 1)


def test_the_guides_set_the_image_where_every_overlay_reads_it() -> None:
    for guide in GUIDES.values():
        lines = shell_lines(guide)
        assert any(
            ln.startswith("(cd k8s/image && kustomize edit set image ghcr.io/harnessrl/harnessrl=")
            for ln in lines
        ), guide.name
    for overlay in ("base", "gke-tpu", "gke-tpu/services", "gpu", "gpu/services", "controller"):
        doc = yaml.safe_load((K8S / overlay / "kustomization.yaml").read_text())
        assert any(c.endswith("image") for c in doc.get("components", [])), overlay
    assert "images" not in yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
