"""The package layers of docs/architecture.md, checked on every source file (sub-folders
included): a package imports only packages of lower layers, and no two files import each other
in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Lowest first. A package may import its own modules and any package of a lower layer.
LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(layer.split())
    for layer in (
        "cli http kernels host_memory report",
        "traces model",
        "data engine rollout proxy_sidecar",
        "learner serve coding",
        "pods view",
        "fleet config",
        "stack",
        "train",
        "curate",
        "benchmarks",
    )
)
RANK = {package: i for i, layer in enumerate(LAYERS) for package in layer}
# Inside the model package: shared parts below the families, the registry and the loaders above.
MODEL_LAYERS = ("shared", "families", "registry", "formats.load formats.export")


def _sources() -> list[Path]:
    return sorted([*(ROOT / "harnessrl").rglob("*.py"), *(ROOT / "proxy_sidecar").rglob("*.py")])


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    """The layered package of a module: `harnessrl.X...` is X, `proxy_sidecar...` is proxy_sidecar."""
    parts = module.split(".")
    return "proxy_sidecar" if parts[0] == "proxy_sidecar" else parts[1]


def _imports(path: Path, top_level_only: bool = False) -> set[str]:
    """Our modules a file imports (`from a.b import c` counts a.b and a.b.c when c is a module)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in ("harnessrl", "proxy_sidecar"))
    return found


def _existing(module: str, known: set[str]) -> str | None:
    while module and module not in known:
        module = module.rpartition(".")[0]
    return module or None


def test_every_package_has_a_layer() -> None:
    packages = {_package(_module(p)) for p in _sources() if _module(p) != "harnessrl"}
    assert packages == set(RANK), f"unlayered: {packages - set(RANK)}, gone: {set(RANK) - packages}"


def test_no_package_imports_a_higher_or_equal_layer() -> None:
    known = {_module(p) for p in _sources()}
    upward = []
    for path in _sources():
        source = _module(path)
        if source == "harnessrl":
            continue
        for target in filter(None, (_existing(m, known) for m in _imports(path))):
            if target == "harnessrl":
                continue
            here, there = _package(source), _package(target)
            if here != there and RANK[there] >= RANK[here]:
                upward.append(f"{source} -> {target}")
    assert not upward, "imports against the layers:\n" + "\n".join(sorted(upward))


def _model_rank(module: str) -> int:
    rest = module.removeprefix("harnessrl.model").removeprefix(".")
    for i, layer in enumerate(MODEL_LAYERS):
        if any(rest == part or rest.startswith(part + ".") for part in layer.split()):
            return i
    return 0  # attention, cache, hooks, sharding, tokenizer, formats.safetensors, ...


def test_model_shared_parts_sit_below_the_families_and_the_registry_above() -> None:
    known = {_module(p) for p in _sources()}
    wrong = []
    for path in (ROOT / "harnessrl" / "model").rglob("*.py"):
        source = _module(path)
        for target in filter(None, (_existing(m, known) for m in _imports(path))):
            if not target.startswith("harnessrl.model.") or target.startswith(source):
                continue
            same_family = source.split(".")[:4] == target.split(".")[:4]
            if _model_rank(target) > _model_rank(source) or (
                _model_rank(target) == _model_rank(source) == 1 and not same_family
            ):
                wrong.append(f"{source} -> {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_circle_between_files() -> None:
    known = {_module(p) for p in _sources()}
    graph = {
        _module(p): {t for t in (_existing(m, known) for m in _imports(p, True)) if t}
        - {_module(p)}
        for p in _sources()
    }
    # A package's __init__ is imported with each of its modules; an edge into an ancestor
    # package is therefore not a circle of files.
    for source, targets in graph.items():
        graph[source] = {t for t in targets if not source.startswith(t + ".")}
    cycles = _cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one file."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("name", ["qwen3_5", "Qwen35", "qwen35", "Qwen3.5", "DeltaNet"])
def test_no_module_outside_the_families_names_a_family(name: str) -> None:
    families = ROOT / "harnessrl" / "model" / "families"
    # The benchmarks measure a family's own kernels and shapes by name.
    benchmarks = ROOT / "harnessrl" / "benchmarks"
    naming = [
        str(p.relative_to(ROOT))
        for p in _sources()
        if not p.is_relative_to(families)
        and not p.is_relative_to(benchmarks)
        and name.lower() in p.read_text().lower()
    ]
    assert not naming, f"{name!r} named outside model/families/: {naming}"
