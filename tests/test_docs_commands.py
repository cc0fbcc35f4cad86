"""Every command README.md and docs/*.md tell a user to run exists after the documented install.

Commands come from the fenced ```bash blocks (every line) and from inline code spans that read as a
command (a bare program name followed by arguments, not an expression like `n > 1`). Each simple
command (split at `&&`, `|`, `;`, `$( )`) is checked by what runs it: `python -m X` imports X and
its `--help` runs and names every documented flag; `make T` is a Makefile target; `python -m
harnessrl.train key=value` overrides load with `harnessrl.config.load_config`; console scripts are
in the virtualenv's bin; repository paths exist; cluster tools are allowed by name, with the reason,
only in guides that list them under "Tools on your workstation".
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import itertools
import os
import re
import shlex
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harnessrl.config import load_config

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
VENV_BIN = Path(sys.executable).parent
# Tools the how-to guides run on the user's workstation against their cloud or cluster: installed by
# the user (not by pip), named in each guide's "Tools on your workstation" line.
WORKSTATION_TOOLS = {
    "gcloud": "Google Cloud CLI: creates the GKE cluster, node pools and image registry",
    "kubectl": "Kubernetes CLI: applies the manifests and watches the jobs",
    "kustomize": "sets the image in k8s/base (kubectl's built-in kustomize has no `edit`)",
    "docker": "builds and pushes the project image from k8s/Dockerfile",
    "helm": "installs the NVIDIA GPU Operator",
    "openssl": "generates the PostgreSQL password and the control token",
}
# Modules that run in another environment than the project's, with the page that sets it up.
EXTERNAL_MODULES = {"vllm": "vLLM's own environment (docs/howto-vllm.md; `make vllm-env` on CPU)"}
# Interpreters the docs create with a Makefile target before using them.
OTHER_PYTHONS = {".venv-vllm/bin/python": "vllm-env"}
SHELL_BUILTINS = {"cd", "export", "kill"}
PYTHONS = {"python", "python3", ".venv/bin/python"}
SPLIT_TOKENS = {"(", ")", "&&", "||", "|", ";", "&"}
REPO_DIRS = ("k8s/", "tests/", "tpu_configs/", "examples/", "docs/", "harnessrl/", "proxy_sidecar/",
             "recipes/")  # fmt: skip
PROJECT_PACKAGES = ("harnessrl", "proxy_sidecar")
INLINE_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
PROGRAM = re.compile(r"[a-z][a-z0-9_-]*")
PYTHON_KEYWORDS = {"with", "for", "if", "import", "from", "return", "def", "class", "lambda"}


@dataclasses.dataclass(frozen=True)
class Command:
    doc: str
    line: int
    words: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {shlex.join(self.words)}"


def split_commands(text: str, doc: str, line: int) -> list[Command]:
    """Simple commands of one shell line (continuations already joined), env prefixes dropped."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands, words = [], []
    for token in [*lexer, ";"]:
        if token not in SPLIT_TOKENS:
            words.append(token)
            continue
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            words.pop(0)  # VAR=value prefix, or a bare assignment
        if words:
            commands.append(Command(doc, line, tuple(words)))
        words = []
    return commands


def reads_as_command(span: str) -> bool:
    words = span.split()
    return (
        len(words) >= 2
        and PROGRAM.fullmatch(words[0]) is not None
        and words[0] not in PYTHON_KEYWORDS
        and not re.fullmatch(r"[=<>×*+/-]+|==", words[1])
    )


def doc_commands(path: Path) -> list[Command]:
    text, doc, out = path.read_text(), path.relative_to(REPO).as_posix(), []
    for fence in FENCE.finditer(text):
        if fence.group(1) not in ("bash", "sh", "shell"):
            continue
        first, pending, start = text[: fence.start(2)].count("\n") + 1, "", 0
        for offset, line in enumerate(fence.group(2).splitlines()):
            start = start if pending else first + offset
            if line.endswith("\\"):  # continues the line, in and out of quotes, as in bash
                pending += line[:-1]
                continue
            try:
                out += split_commands(pending + line, doc, start)
            except ValueError:  # "No closing quotation": a quoted argument spans lines
                pending += line + "\n"
                continue
            pending = ""
        assert not pending, f"{doc}:{start}: unterminated shell command"
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for span in INLINE_SPAN.finditer(prose):
        if reads_as_command(span.group(1)):
            line = prose[: span.start()].count("\n") + 1
            out += split_commands(span.group(1), doc, line)
    return out


ALL_COMMANDS = [c for path in DOCS for c in doc_commands(path)]


def program_of(command: Command) -> tuple[str, tuple[str, ...]]:
    """(what runs, its arguments); `python -m X ...` runs X."""
    first, rest = command.words[0], command.words[1:]
    if (first in PYTHONS or first in OTHER_PYTHONS) and rest[:1] == ("-m",) and len(rest) > 1:
        return f"-m {rest[1]}", rest[2:]
    return first, rest


def project_module(name: str) -> bool:
    return name.split(".")[0] in PROJECT_PACKAGES


def help_argv(command: Command) -> tuple[str, ...] | None:
    """The `--help` call that shows this command's flags, where it is ours and cheap to start."""
    program, args = program_of(command)
    if program.startswith("-m ") and project_module(program[3:]):
        if importlib.util.find_spec(program[3:]) is None:
            return None  # reported as a missing module
        return (sys.executable, "-m", program[3:], "--help")
    first = command.words[0]
    if first in PYTHONS or first in OTHER_PYTHONS:
        script = args[0] if program == first and args else ""
        if script.endswith(".py") and (REPO / script).is_file():
            return (sys.executable, str(REPO / script), "--help")  # argparse help, lazy imports
        return None
    name = first.removeprefix(".venv/bin/")
    if (VENV_BIN / name).is_file():
        return (str(VENV_BIN / name), "--help")
    return None


def run_help(argv: tuple[str, ...]) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{shlex.join(argv)} failed:\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def help_texts() -> dict[tuple[str, ...], str]:
    wanted = sorted({argv for c in ALL_COMMANDS if (argv := help_argv(c)) is not None})
    with ThreadPoolExecutor(max_workers=2) as pool:  # each start imports JAX: a few seconds
        return dict(zip(wanted, pool.map(run_help, wanted), strict=True))


def makefile_targets() -> dict[str, list[str]]:
    """Target name -> its recipe lines."""
    targets: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in (REPO / "Makefile").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", line)
        if match:
            current = targets.setdefault(match.group(1), [])
        elif line.startswith("\t") and current is not None:
            current.append(line.strip())
        elif line.strip() and not line.startswith("#"):
            current = None
    return targets


def check_train_overrides(words: tuple[str, ...], where: str) -> None:
    """Overrides of `python -m harnessrl.train`, loaded as the CLI loads them, beneath the
    repository's own `--config` files (a user's file is theirs to write)."""
    flags = {"--smoke", "--help", "--config", "--mesh"}
    overrides = [w for w in words if "=" in w and w.split("=")[0] not in flags]
    unknown = [w for w in words if w.startswith("-") and "=" not in w and w not in flags]
    assert not unknown, f"{where}: harnessrl.train has no flag {unknown}"
    files = [b for a, b in itertools.pairwise(words) if a == "--config"]
    files += [w.split("=", 1)[1] for w in words if w.startswith("--config=")]
    ours = [f"--config={REPO / f}" for f in files if f.startswith(REPO_DIRS)]
    try:
        load_config(overrides=[*ours, *overrides], smoke="--smoke" in words)
    except ValueError as err:
        pytest.fail(f"{where}: documented overrides do not load: {err}")


def check_flags(words: tuple[str, ...], help_text: str, where: str) -> None:
    for word in words:
        flag = word.split("=")[0]
        if re.fullmatch(r"--?[A-Za-z][A-Za-z0-9_-]*", flag):
            named = re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", help_text, re.M)
            assert named, f"{where}: {flag} is not among the flags its --help lists"


def check_pip(args: tuple[str, ...], where: str) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    names = [a for a in args if a != "install" and not a.startswith("-")]
    assert names, f"{where}: pip with nothing to install"
    for name in names:
        match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", name)
        if match:
            missing = [e for e in (match.group(1) or "").split(",") if e and e not in extras]
            assert not missing, f"{where}: pyproject.toml has no extra {missing}"
        else:
            try:
                importlib.metadata.distribution(re.split(r"[<>=!\[ ]", name)[0])
            except importlib.metadata.PackageNotFoundError:
                pytest.fail(f"{where}: {name} is not installed by the documented install")


def check_repo_paths(args: tuple[str, ...], where: str) -> None:
    for arg in args:
        value = arg.split("=", 1)[-1] if arg.startswith("--") else arg
        # "ns/pod:/path" (kubectl cp) and URLs name other machines' files, not ours.
        if value.startswith(REPO_DIRS) and ":" not in value:
            assert (REPO / value).exists(), f"{where}: {value} does not exist in the repository"


def check_command(command: Command, help_texts: dict[tuple[str, ...], str]) -> None:
    where, (program, args) = str(command), program_of(command)
    first = command.words[0]
    check_repo_paths(args, where)
    if first in OTHER_PYTHONS:
        target = OTHER_PYTHONS[first]
        assert target in makefile_targets(), f"{where}: no `make {target}` creates {first}"
    if program.startswith("-m "):
        module = program[3:]
        top = module.split(".")[0]
        if top in EXTERNAL_MODULES:
            return
        assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
        if module == "harnessrl.train":
            check_train_overrides(args, where)
    elif first == "make":
        check_make(args, where)
        return
    elif first == "pip":
        check_pip(args, where)
        return
    elif first.startswith(REPO_DIRS):
        assert os.access(REPO / first, os.X_OK), f"{where}: {first} is not an executable file"
        return
    elif first in WORKSTATION_TOOLS or first in SHELL_BUILTINS:
        return
    elif first not in PYTHONS and first not in OTHER_PYTHONS:
        name = first.removeprefix(".venv/bin/")
        assert (VENV_BIN / name).is_file(), (
            f"{where}: nothing in the documented install provides `{name}` "
            f"(not in {VENV_BIN}, not a workstation tool of the how-to guides)"
        )
    argv = help_argv(command)
    if argv is not None and program != "-m harnessrl.train":  # train: overrides checked above
        check_flags(args, help_texts[argv], where)


def check_make(args: tuple[str, ...], where: str) -> None:
    targets, makefile = makefile_targets(), (REPO / "Makefile").read_text()
    names = [a for a in args if "=" not in a]
    assert names, f"{where}: make without a target"
    for name in names:
        assert name in targets, f"{where}: the Makefile has no target {name!r}"
    for assignment in (a for a in args if "=" in a):
        var, value = assignment.split("=", 1)
        assert f"$({var})" in makefile, f"{where}: the Makefile never reads {var}"
        for name in names:
            if any("harnessrl.train" in r and f"$({var})" in r for r in targets[name]):
                check_train_overrides(tuple(shlex.split(value)), where)


def test_train_commands_load_the_repository_config_they_name() -> None:
    """The override grades coding tasks, which only the recipe's own rollout.tasks names."""
    words = ("--config", "recipes/qwen3-8b-swe-8xh100.yaml", "rollout.evaluator=coding")
    check_train_overrides(words, "with the recipe")
    with pytest.raises(pytest.fail.Exception, match="grades coding tasks only"):
        check_train_overrides(words[2:], "without it")


def test_docs_have_commands() -> None:
    """The extraction finds what the pages obviously contain (guards against a silent regex)."""
    found = {str(c).split(": ", 1)[1] for c in ALL_COMMANDS}
    for expected in ("make train", "python -m harnessrl.train --smoke", "kubectl apply -k k8s/gpu"):
        assert expected in found, f"{expected!r} not extracted"
    assert len(ALL_COMMANDS) > 60


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=str)
def test_documented_command_exists(command: Command, help_texts: dict) -> None:
    check_command(command, help_texts)


@pytest.mark.parametrize("doc", [p for p in DOCS if p.name.startswith("howto-")], ids=str)
def test_guides_list_their_workstation_tools(doc: Path) -> None:
    used = {c.words[0] for c in doc_commands(doc) if c.words[0] in WORKSTATION_TOOLS}
    listed = re.search(r"^Tools on your workstation:(.*?)(?:\n\n|\Z)", doc.read_text(), re.M | re.S)
    if not used:
        return
    assert listed, (
        f"{doc.name} runs {sorted(used)} but has no 'Tools on your workstation:' paragraph"
    )
    missing = [t for t in sorted(used) if f"`{t}`" not in listed.group(1)]
    assert not missing, f"{doc.name}: its workstation tools paragraph does not name {missing}"


@pytest.mark.parametrize(
    ("line", "fails"),
    [
        ("python -m harnessrl.train no_such.key=1", "do not load"),
        ("python -m harnessrl.train --config recipes/no-such.yaml", "does not exist"),
        ("python -m harnessrl.nope", "no module"),
        ("make no-such-target", "no target"),
        ("make train NOPE=1", "never reads NOPE"),
        ("python -m harnessrl.serve --no-such-flag", "is not among the flags"),
        ("frobnicate --all", "nothing in the documented install"),
        ("kubectl apply -k k8s/no-such-overlay", "does not exist"),
        ("pip install -e '.[nope]'", "no extra"),
    ],
)
def test_the_checks_catch_broken_commands(line: str, fails: str) -> None:
    (command,) = split_commands(line, "example.md", 1)
    argv = help_argv(command)
    texts = {argv: run_help(argv)} if argv is not None else {}
    with pytest.raises((AssertionError, pytest.fail.Exception), match=re.escape(fails)):
        check_command(command, texts)
