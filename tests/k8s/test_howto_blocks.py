"""Every shell block of the cluster and vLLM how-tos, checked without a cluster or a network.

Each simple command of each ```bash block is checked by what it runs: the harnessrl and
proxy_sidecar commands parse with their own parsers (the Job preview really prints a Job, which
validates against Kubernetes 1.33); vLLM's flags and environment variables exist in the installed
vLLM (when `make vllm-env` made one); `kubectl apply/delete -k` overlays render; gcloud, kubectl,
helm, docker, kustomize and openssl use known subcommands and options; every variable a block sets
is read later in the guide or by the code; the Secrets the applied manifests and the train
config's sidecars read are all created by the guide; the GKE cluster enforces NetworkPolicy.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import itertools
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import kubernetes_validate
import pytest
import yaml
from kubectl_needed import have_kubectl, needs_kubectl

from harnessrl.cli import resolve
from harnessrl.config import load_config
from harnessrl.pods import k8s as launcher
from proxy_sidecar.config import SidecarConfig
from proxy_sidecar.inject import webhook

ROOT = Path(__file__).resolve().parents[2]
GUIDES = [ROOT / "docs" / f"howto-{n}.md" for n in ("gke-tpu", "gpu-cluster", "vllm")]
VLLM = next((ROOT / ".venv-vllm" / "lib").glob("python3*/site-packages/vllm"), None) if (
    ROOT / ".venv-vllm" / "lib").is_dir() else None  # fmt: skip
SPLIT = {"&&", "||", "|", ";", "(", ")", "&"}
# Subcommands and the options the guides may give them (besides global ones), from each tool's
# reference; a typo or an option of another subcommand fails here instead of on the user's shell.
GCLOUD = {
    "config set": set(),
    "services enable": set(),
    "container clusters create": {"--location", "--release-channel", "--machine-type",
        "--num-nodes", "--enable-autoscaling", "--min-nodes", "--max-nodes", "--addons",
        "--workload-pool", "--enable-dataplane-v2", "--enable-network-policy"},
    "container node-pools create": {"--cluster", "--location", "--node-locations",
        "--machine-type", "--tpu-topology", "--num-nodes", "--accelerator"},
    "container clusters get-credentials": {"--location"},
    "container clusters delete": {"--location"},
    "artifacts repositories create": {"--repository-format", "--location"},
    "filestore instances list": set(),
}  # fmt: skip
KUBECTL = {
    "apply": {"-k", "-f", "--server-side"},
    "delete": {"-k", "-f"},
    "create": {"--from-literal", "--from-file"},
    "get": {"-l", "-o", "--watch"},
    "logs": {"-f", "-l", "-c"},
    "rollout": set(),
    "run": {"--image", "--restart", "--overrides", "--rm", "-it", "--labels"},
    "exec": set(),
    "cp": set(),
    "scale": {"--replicas"},
    "kustomize": set(),
}
OTHER_TOOLS: dict[str, dict[str, set[str]]] = {
    "helm": {"repo add": set(), "repo update": set(),
             "install": {"-n", "--create-namespace", "--wait"}},
    "docker": {"build": {"-f", "--build-arg", "-t"}, "push": set()},
    "kustomize": {"edit set image": set()},
    "openssl": {"rand": {"-hex"}},
}  # fmt: skip
SCRIPTS_OF_THE_REPO = ("k8s/", "tests/")


@dataclass(frozen=True)
class Command:
    guide: str
    line: int
    env: tuple[str, ...]  # VAR=value prefixes (or a bare assignment)
    words: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.guide}:{self.line}: {shlex.join(self.env + self.words)}"


def commands(guide: Path) -> list[Command]:
    """The simple commands of every ```bash block (continuations joined, split at && | ; ( ))."""
    text, out = guide.read_text(), []
    for block in re.finditer(r"^```bash\n(.*?)^```", text, re.S | re.M):
        first = text[: block.start(1)].count("\n") + 1
        pending, start = "", first
        for i, line in enumerate(block.group(1).splitlines()):
            start = start if pending else first + i
            if line.endswith("\\"):
                pending += line[:-1]
                continue
            try:
                lexer = shlex.shlex(pending + line, posix=True, punctuation_chars=True)
                lexer.whitespace_split, lexer.commenters = True, "#"
                tokens = [*lexer, ";"]
            except ValueError:  # a quoted argument over several lines
                pending += line + "\n"
                continue
            pending, words = "", []
            for token in tokens:
                if token not in SPLIT:
                    words.append(token)
                    continue
                env = []
                while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
                    env.append(words.pop(0))
                if words[:1] == ["export"]:
                    env, words = env + words[1:], []
                if env or words:
                    out.append(Command(guide.name, start, tuple(env), tuple(words)))
                words = []
        assert not pending, f"{guide.name}:{start}: unterminated command"
    return out


ALL = [c for g in GUIDES for c in commands(g)]


def test_the_blocks_are_found() -> None:
    found = {shlex.join(c.words) for c in ALL}
    for expected in ("kubectl apply -k k8s/gke-tpu", "kubectl apply -k k8s/gpu", "make vllm-env"):
        assert expected in found
    assert len(ALL) > 60


def options(words: tuple[str, ...]) -> list[str]:
    """The options of a command line, up to a `--` (what follows is another program's argv)."""
    end = words.index("--") if "--" in words else len(words)
    return [w.split("=")[0] for w in words[:end] if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", w)]


def check_tool(command: Command) -> None:
    tool, rest = command.words[0], command.words[1:]
    if tool == "kubectl":
        table = {k: v | {"-n"} for k, v in KUBECTL.items()}
        words = [w for w in rest if w]
        if words[:1] == ["-n"]:
            words = words[2:]
        sub = next((s for s in table if words[:1] == [s]), None)
    else:
        table = GCLOUD if tool == "gcloud" else OTHER_TOOLS[tool]
        sub = next((s for s in table if rest[: len(s.split())] == tuple(s.split())), None)
    assert sub is not None, f"{command}: no known `{tool}` subcommand"
    unknown = set(options(rest)) - table[sub]
    assert not unknown, f"{command}: `{tool} {sub}` takes no {sorted(unknown)}"
    for w in rest:  # files of this repository that the command reads
        if w.startswith("--from-file="):
            path = w.split("=")[-1]
            assert (ROOT / path).is_file(), f"{command}: {path} does not exist"


@functools.cache
def render(overlay: str) -> list[dict[str, Any]]:
    """The overlay as kubectl renders it (once per run; callers only read it)."""
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / overlay)], capture_output=True,
                         text=True, check=True, timeout=120).stdout  # fmt: skip
    return [d for d in yaml.safe_load_all(out) if d]


def check_manifests(command: Command) -> None:
    words = command.words
    if not {"apply", "delete"} & set(words[1:4]):  # elsewhere -f is --follow
        return
    for flag, value in itertools.pairwise(words):
        if flag not in ("-k", "-f") or value.startswith("https://"):
            continue
        assert (ROOT / value).exists(), f"{command}: {value} does not exist"
        if flag == "-k" and have_kubectl():
            assert render(value), f"{command}: {value} renders nothing"


def vllm_source(*parts: str) -> str:
    assert VLLM is not None
    return "\n".join((VLLM / p).read_text() for p in parts)


def check_vllm(command: Command) -> None:
    """vLLM's flags are its config dataclasses' fields (`--max-model-len` ↔ `max_model_len`)."""
    if VLLM is None:
        pytest.skip("vLLM is not installed here (make vllm-env)")
    fields = vllm_source("engine/arg_utils.py", "entrypoints/launchers/cli_args.py")
    for flag in options(command.words[3:]):
        name = flag.lstrip("-").replace("-", "_")
        assert re.search(rf"^    {name}\s*:", fields, re.M), f"{command}: vLLM has no {flag}"
    envs = vllm_source("envs.py")
    for assignment in command.env:
        name = assignment.split("=")[0]
        assert f'"{name}"' in envs, f"{command}: vLLM reads no {name}"


def check_ours(command: Command) -> None:
    module, args = command.words[2], list(command.words[3:])
    if module == "harnessrl.pods.k8s":
        for flag in options(command.words[3:]):
            resolve(launcher.JobsCommand, flag)  # raises naming the unknown key
        if "--dry-run" in args:  # what the guide prints is a Job the API server takes
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                assert launcher.main(args) == 0
            kubernetes_validate.validate(yaml.safe_load(buf.getvalue()), "1.33", strict=True)
    elif module == "proxy_sidecar":
        for flag in options(command.words[3:]):
            resolve(SidecarConfig, flag, {"upstream": ("upstreams",)})
    elif module == "proxy_sidecar.inject.webhook":
        webhook.parse_args(args)
    elif module == "harnessrl.train":
        overrides = [w for w in args if re.fullmatch(r"[a-z_]+(\.[a-z_]+)+=.*", w)]
        load_config(None, overrides)
    elif module.startswith(("harnessrl.benchmarks.", "harnessrl.learner.plan")):
        parse_only(module, args)
    elif module != "pytest":
        pytest.fail(f"{command}: no check for python -m {module}")


class _Parsed(Exception):
    """Raised in place of running a tool once its command line parsed."""


def parse_only(module: str, args: list[str]) -> None:
    """The tool's own argparse takes `args` (an unknown flag or bad value exits), nothing runs."""
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *a: Any, **kw: Any) -> Any:
        parse(self, *a, **kw)
        raise _Parsed

    main = importlib.import_module(module).main
    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop),
        mock.patch.object(sys, "argv", [module, *args]),
        pytest.raises(_Parsed),
    ):
        main()


def assigned(command: Command) -> list[str]:
    return [a.split("=")[0] for a in command.env]


@functools.cache
def code_text() -> str:
    """The code, manifests and Makefile: what may read a variable a guide sets."""
    paths = [p for folder in ("harnessrl", "proxy_sidecar", "k8s", "tests")
             for p in (ROOT / folder).rglob("*")
             if p.suffix in (".py", ".yaml", ".sh") and p != Path(__file__)]  # fmt: skip
    return "\n".join(p.read_text() for p in [*paths, ROOT / "Makefile"])


def code_reads(name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", code_text()) is not None


@pytest.mark.parametrize("command", ALL, ids=str)
def test_each_command_is_right(command: Command) -> None:
    words = command.words
    if not words:  # an assignment: read by a later line of its guide, or by the code
        guide = next(g for g in GUIDES if g.name == command.guide).read_text()
        after = "\n".join(guide.splitlines()[command.line :])
        for name in assigned(command):
            assert re.search(rf"\$\{{?{name}\b", after) or code_reads(name), (
                f"{command}: nothing reads {name}"
            )
        return
    program = words[0].removeprefix(".venv/bin/").removeprefix(".venv-vllm/bin/")
    if program in ("python", "python3") and words[1:2] == ("-m",):
        if words[2].startswith("vllm."):
            check_vllm(command)
        else:
            check_ours(command)
    elif program in ("python", "python3"):  # a script of the repository, or inline code
        assert words[1] == "-c" or (ROOT / words[1]).is_file(), f"{command}: no {words[1]}"
    elif program in ("gcloud", "kubectl", *OTHER_TOOLS):
        check_tool(command)
        check_manifests(command)
    elif program == "make":
        assert re.search(rf"^{words[1]}:", (ROOT / "Makefile").read_text(), re.M), command
    elif words[0].startswith(SCRIPTS_OF_THE_REPO):
        assert (ROOT / words[0]).is_file(), f"{command}: no {words[0]}"
    elif program not in ("cd", "curl"):
        pytest.fail(f"{command}: no check for `{program}`")
    for name in assigned(command):  # VAR=value for one command: what it runs must read it
        assert code_reads(name) or (program.startswith("python") and words[2:3] and
                                    words[2].startswith("vllm.")), f"{command}: nothing reads {name}"  # fmt: skip


def secrets_read(docs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """(Secret, key) pairs the pods of `docs` read; a whole Secret volume as (name, "*")."""
    found: set[tuple[str, str]] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("secretKeyRef")
            if isinstance(ref, dict):
                found.add((ref["name"], ref["key"]))
            if isinstance(node.get("secret"), dict) and "secretName" in node["secret"]:
                found.add((node["secret"]["secretName"], "*"))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(docs)
    return found


def created_secrets(guide: Path) -> set[tuple[str, str]]:
    out = set()
    for c in commands(guide):
        w = c.words
        if w[:1] == ("kubectl",) and "secret" in w and "generic" in w:
            name = w[w.index("generic") + 1]
            out |= {(name, v.split("=")[1]) for v in w if v.startswith("--from-literal=")}
            out |= {(name, "*")}
        if w[:1] == ("k8s/webhook-certs.sh",):
            script = (ROOT / w[0]).read_text()
            out |= {(m, "*") for m in re.findall(r"secret tls (\S+)", script)}
    return out


@needs_kubectl
@pytest.mark.parametrize("guide", GUIDES[:2], ids=lambda g: g.name)
def test_the_guide_creates_every_secret_its_cluster_reads(guide: Path, tmp_path: Path) -> None:
    from harnessrl.stack import pod_sidecar

    applied = [c.words[c.words.index("-k") + 1] for c in commands(guide)
               if c.words[:2] == ("kubectl", "apply") and "-k" in c.words]  # fmt: skip
    docs = [d for overlay in applied for d in render(overlay)]
    wanted = secrets_read(docs)
    cm = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "harnessrl-train"
    )
    (tmp_path / "train.yaml").write_text(cm["data"]["train.yaml"])
    needed = ["rollout.kubernetes.image=x", "rollout.store=postgresql://h@p/t"]  # the train pods'
    jobs = pod_sidecar(load_config(tmp_path / "train.yaml", needed))  # the harness Jobs' sidecars
    wanted |= {(jobs.store_secret, "url"), (jobs.control_secret, "token")}
    wanted |= {(jobs.upstream_key_secret, "api-key")} if jobs.upstream_key_secret else set()
    made = created_secrets(guide)
    missing = {
        (n, k) for n, k in wanted if (n, k) not in made and not (k == "*" and (n, "*") in made)
    }
    assert not missing, f"{guide.name} never creates {sorted(missing)}"
    assert ("harnessrl-vllm", "api-key") in wanted


def test_the_gke_cluster_enforces_network_policy() -> None:
    (create,) = [
        c for c in commands(GUIDES[0]) if c.words[1:4] == ("container", "clusters", "create")
    ]
    assert {"--enable-dataplane-v2", "--enable-network-policy"} & set(options(create.words)), (
        "without enforcement the NetworkPolicies of k8s/base are ignored"
    )
    table = GUIDES[1].read_text()
    assert re.search(r"^\| a CNI that enforces NetworkPolicy \|.*\| Calico, Cilium", table, re.M)


def test_probes_of_vllm_send_its_key_or_ask_health() -> None:
    """vLLM asks every route but /health for its key (k8s/base/vllm_guard.py)."""
    for c in (c for c in ALL if "curl" in c.words):
        for url in (w for w in c.words if re.match(r"https?://vllm", w)):
            assert url.endswith("/health") or any("Authorization" in w for w in c.words), str(c)


@pytest.mark.parametrize(
    ("line", "fails"),
    [
        ("gcloud container clusters create x --enable-netpol", "takes no"),
        ("kubectl frobnicate pods", "no known"),
        ("kubectl apply -k k8s/no-such-overlay", "does not exist"),
        ("python -m harnessrl.pods.k8s --dry-run --imagee x", "imagee"),
        ("python -m proxy_sidecar --upstreem http://a:1", "upstreem"),
        ("NOT_READ_ANYWHERE_X=1 make vllm-env", "nothing reads"),
    ],
)
def test_the_checks_catch_broken_lines(line: str, fails: str, tmp_path: Path) -> None:
    guide = tmp_path / "howto-x.md"
    guide.write_text(f"```bash\n{line}\n```\n")
    (command,) = commands(guide)
    with pytest.raises((AssertionError, ValueError), match=fails):
        test_each_command_is_right(command)


def test_the_shipped_vllm_flags_and_env_exist_in_vllm() -> None:
    """k8s/base/vllm.yaml runs what the guides run: its flags and env must be vLLM's too."""
    (sts,) = [d for d in yaml.safe_load_all((ROOT / "k8s/base/vllm.yaml").read_text())
              if d and d["kind"] == "StatefulSet"]  # fmt: skip
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    env = tuple(f"{e['name']}=x" for e in c["env"] if e["name"] != "PYTHONPATH")
    check_vllm(Command("vllm.yaml", 0, env, ("python", "-m", *c["command"][2:], *c["args"])))
