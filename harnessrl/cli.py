"""Config dataclasses as command lines: YAML files and `key=value` flags in, a frozen config out.

In: a frozen dataclass (its dataclass-typed fields are sections, to any depth), argv, YAML files and
environment defaults. Out: the validated instance, `--help` text and the markdown tables of
docs/configuration.md. Unknown keys and values of the wrong type are ValueErrors naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import json
import math
import re
import shlex
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import yaml

BOOLS = {"true": True, "yes": True, "on": True, "1": True}
BOOLS |= {"false": False, "no": False, "off": False, "0": False}
Pairs = list[tuple[str, Any]]


class ConfigError(ValueError):
    """A bad key or value, already named; enclosing sections pass it on unchanged."""


def _is_section(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


@functools.cache
def sections(cls: type, path: str = "") -> dict[str, type]:
    """Dotted path → dataclass of every section under `cls` ("" is `cls` itself), in field order."""
    out: dict[str, type] = {path: cls}
    for name, hint in typing.get_type_hints(cls).items():
        if _is_section(hint):
            out.update(sections(hint, f"{path}{name}."))
    return {p.rstrip("."): c for p, c in out.items()}


@functools.cache
def leaves(cls: type) -> dict[str, Any]:
    """Every settable field under `cls`: dotted key → its type."""
    out: dict[str, Any] = {}
    for path, owner in sections(cls).items():
        for name, hint in typing.get_type_hints(owner).items():
            if not _is_section(hint):
                out[f"{path}.{name}".lstrip(".")] = hint
    return out


def resolve(cls: type, key: str, aliases: Mapping[str, tuple[str, ...]] = {}) -> tuple[str, ...]:
    """A key as written → the full keys it sets.

    `section.field` names one field; a shorter dotted tail (`steps`, `kubernetes.namespace`)
    names the shallowest field that ends with it, and two at that depth are ambiguous.
    """
    name = key.strip().lstrip("-").replace("-", "_")
    if name in aliases:
        return aliases[name]
    table = leaves(cls)
    if name in table:
        return (name,)
    hits = [k for k in table if k.endswith("." + name)]
    if not hits:
        raise ConfigError(_unknown(cls, key, name))
    depth = min(k.count(".") for k in hits)
    best = [k for k in hits if k.count(".") == depth]
    if len(best) > 1:
        raise ConfigError(f"config key {key!r} is ambiguous; write one of {best}")
    return (best[0],)


def _unknown(cls: type, key: str, name: str) -> str:
    head, dot, tail = name.rpartition(".")
    owners = [p for p in sections(cls) if p and (p == head or p.endswith("." + head))]
    if dot and not owners:
        tops = [p for p in sections(cls) if p and "." not in p]
        return f"unknown config section {head!r} in {key!r}; sections: {tops}"
    by_name: dict[str, str] = {}  # field name → its shallowest key, for a spelling hint
    for k in leaves(cls):
        if not dot or k.rpartition(".")[0] == owners[0]:
            by_name.setdefault(k.rpartition(".")[2], k)
    near = difflib.get_close_matches(tail, list(by_name), 1, 0.75)
    hint = f" (did you mean {by_name[near[0]]!r}?)" if near else ""
    if not dot:
        return f"unknown config key {key!r}{hint}; see --help for every option"
    names = sorted(f.name for f in dataclasses.fields(sections(cls)[owners[0]]))
    return f"unknown config key {key!r}{hint}: section {owners[0]!r} has {names}"


def coerce(key: str, value: Any, hint: Any) -> Any:
    """`value` (from YAML, or a command-line string) as type `hint`, or a ValueError naming `key`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if is_none and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(key, value, arg)
            except ValueError as err:
                errors.append(str(err))
        raise ConfigError(
            errors[0] if len(errors) == 1 else f"{key}: {value!r} fits none of {args}"
        )
    if hint is Any:
        return value
    if origin in (tuple, dict) or hint in (tuple, dict):
        return _coerce_container(key, value, origin or hint, args)
    if isinstance(value, str) and hint is not str:
        value = _parse_scalar(key, value, hint)
    return _check_scalar(key, value, hint)


def _parse_scalar(key: str, text: str, hint: Any) -> Any:
    t = text.strip()
    try:
        if hint is bool:
            return BOOLS[t.lower()]
        if hint in (int, float):
            return hint(t)
    except (KeyError, ValueError):
        raise ConfigError(f"{key} must be {hint.__name__}, got {text!r}") from None
    return text


def _check_scalar(key: str, value: Any, hint: Any) -> Any:
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if hint is float and isinstance(value, float) and math.isnan(value):
        raise ConfigError(f"{key} must be a number, got NaN")
    if isinstance(hint, type) and (
        not isinstance(value, hint) or (hint is int and isinstance(value, bool))
    ):
        name = getattr(hint, "__name__", str(hint))
        raise ConfigError(f"{key} must be {name}, got {type(value).__name__} {value!r}")
    return value


def _words(text: str) -> list[str]:
    # Spaces or commas separate items, as in `--upstream a,b` or `--command "python h.py"`;
    # quotes keep an item whole.
    lexer = shlex.shlex(text, posix=True)
    lexer.whitespace += ","
    lexer.whitespace_split, lexer.commenters = True, ""
    return list(lexer)


def _structure(text: str) -> Any:
    # JSON first: `render` writes it, and YAML 1.1 would read its `1e-05` as a string.
    try:
        return json.loads(text)
    except ValueError:
        return yaml.safe_load(text)


def _coerce_container(key: str, value: Any, origin: Any, args: tuple[Any, ...]) -> Any:
    if isinstance(value, str):
        flat = origin is tuple and all(typing.get_origin(a) is None for a in args)
        try:
            value = _words(value) if flat and value.strip()[:1] != "[" else _structure(value)
        except (yaml.YAMLError, ValueError) as err:
            raise ConfigError(f"{key}: cannot parse {value!r} ({err})") from err
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, e.g. {{a: 1}}, got {value!r}")
        return dict(value)
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key} must be a list, e.g. [1, 2], got {value!r}")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
    if args and len(args) != len(value):
        raise ConfigError(f"{key} must have {len(args)} items, got {value!r}")
    return tuple(
        coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args, strict=True))
    )


def parse_argv(argv: Sequence[str], is_flag: Callable[[str], bool]) -> Pairs:
    """`key=value`, `--key=value`, `--key value` and a bare boolean `--flag` → (key, raw value)."""
    pairs: Pairs = []
    items = list(argv)
    while items:
        item = items.pop(0)
        key, sep, value = item.partition("=")
        if sep and key.strip("-"):
            pairs.append((key.strip(), value))
        elif not item.startswith("--") or not item.strip("-"):
            raise ConfigError(f"override {item!r} must look like key=value (or --key=value)")
        elif is_flag(item):
            bare = not items or items[0].lower() not in BOOLS
            pairs.append((item, True if bare else items.pop(0)))
        elif not items or items[0].startswith("--"):
            raise ConfigError(f"{item} needs a value: {item}=VALUE or {item} VALUE")
        else:
            pairs.append((item, items.pop(0)))
    return pairs


def load_yaml(path: str | Path) -> Any:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        return yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {p}: not YAML ({err})") from err


def read_yaml(cls: type, path: str | Path) -> Pairs:
    """A YAML file of sections (nested mappings) and bare keys → (dotted key, value) pairs."""
    return flatten(cls, load_yaml(path), str(path))


def flatten(cls: type, doc: Any, where: str, path: str = "") -> Pairs:
    if doc is None:
        return []
    if not isinstance(doc, dict):
        raise ConfigError(f"config file {where}: expected a mapping of sections, got {doc!r}")
    out: Pairs = []
    for name, body in doc.items():
        key = f"{path}{name}"
        if key in sections(cls) and isinstance(body, dict):
            out += flatten(cls, body, where, key + ".")
        else:
            out.append((key, body))  # a field, or a bare key resolved (or rejected) like a flag
    return out


def typed(cls: type, pairs: Iterable[tuple[str, Any]], aliases: Mapping[str, tuple[str, ...]] = {},
          name: Callable[[str], str] = str) -> dict[str, Any]:  # fmt: skip
    """(key as written, raw value) pairs → {full key: typed value}; later pairs win."""
    table, out = leaves(cls), {}
    for key, raw in pairs:
        for full in resolve(cls, key, aliases):
            out[full] = coerce(name(full), raw, table[full])
    return out


def build(base: Any, values: Mapping[str, Any], name: Callable[[str], str] = str,
          path: str = "") -> Any:  # fmt: skip
    """`base` with `values` (full keys) replaced; each section is validated by its own class."""
    changes = {}
    for f in dataclasses.fields(base):
        key, current = f"{path}{f.name}", getattr(base, f.name)
        if dataclasses.is_dataclass(current) and any(k.startswith(key + ".") for k in values):
            changes[f.name] = build(current, values, name, key + ".")
        elif key in values:
            changes[f.name] = values[key]
    if not changes:
        return base
    try:
        return dataclasses.replace(base, **changes)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(_name_section(str(err), type(base), path, name)) from err


def _name_section(message: str, owner: type, path: str, name: Callable[[str], str]) -> str:
    # A class's own messages start with its bare field name ("port must be ..."); say which key.
    first = re.match(r"\w+", message)
    if first and first.group() in {f.name for f in dataclasses.fields(owner)}:
        return name(path + first.group()) + message[first.end() :]
    return f"config section {path.rstrip('.')!r}: {message}" if path else message


def get(obj: Any, key: str) -> Any:
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def render(value: Any) -> str:
    """A value as `coerce` reads it back from the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "none"
    if isinstance(value, (tuple, list, dict)):
        return json.dumps(value)
    return str(getattr(value, "value", value))


def to_argv(obj: Any, skip: Iterable[str] = ()) -> list[str]:
    """`--key=value` for every field of `obj`: what `command_line` turns back into `obj`."""
    cls: type = type(obj)
    return [f"--{key}={render(get(obj, key))}" for key in leaves(cls) if key not in skip]


def flag(cls: type, key: str) -> str:
    """The shortest `--flag` that names `key` in `cls`."""
    parts = key.split(".")
    for i in range(len(parts) - 1, -1, -1):
        tail = ".".join(parts[i:])
        try:
            if resolve(cls, tail) == (key,):
                return "--" + tail.replace("_", "-")
        except ConfigError:
            continue
    return "--" + key.replace("_", "-")


def field_docs(cls: type) -> dict[str, str]:
    """Each field's trailing `# comment` (or the comment lines right above it) in the source."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    above: list[str] = []
    names = {f.name for f in dataclasses.fields(cls)}
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# "))
            continue
        m = re.match(r"\s*(\w+)\s*:", line)
        if m and m.group(1) in names and m.group(1) not in docs:
            docs[m.group(1)] = _trailing_comment(lines, i) or " ".join(above)
        above = []
    return docs


def _trailing_comment(lines: list[str], i: int) -> str:
    # A default may span lines (an open parenthesis); its comment is then on the closing line.
    j = i
    if lines[i].rstrip().endswith("("):
        while j + 1 < len(lines) and not lines[j].lstrip().startswith(")"):
            j += 1
    _code, sep, comment = lines[j].partition("#")
    return comment.strip() if sep else ""


def describe(base: Any, help: Mapping[str, str] = {}, markdown: bool = False,
             flags: Mapping[str, tuple[str, ...]] | None = None) -> str:  # fmt: skip
    """Every option with its type, default and meaning, one block per section.

    `flags` (full key → extra names) lists keys as command-line flags (`--port`) instead of
    dotted keys (`serve.port`); `help` gives meanings the source comments lack.
    """
    out: list[str] = []
    root: type = type(base)
    for path, cls in sections(root).items():
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        rows = [f for f in dataclasses.fields(cls) if not _is_section(hints[f.name])]
        if not rows:
            continue
        title = (inspect.getdoc(cls) or "").splitlines()[0]
        if path:
            out.append(f"\n### `{path}` — {title}\n" if markdown else f"\n[{path}] {title}")
        if markdown:
            out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for f in rows:
            key = f"{path}.{f.name}".lstrip(".")
            value = get(base, key)
            default = repr(getattr(value, "value", value)) if markdown else render(value)
            meaning = help.get(key) or docs.get(f.name, "")
            meaning = meaning.replace("|", "\\|") if markdown else meaning
            kind = _type_name(hints[f.name], markdown)
            shown = key if flags is None else ", ".join([flag(root, key), *flags.get(key, ())])
            if markdown:
                out.append(f"| `{shown}` | {kind} | `{default}` | {meaning} |")
            else:
                out.append(f"  {shown}={default}  ({kind})  {meaning}")
    return "\n".join(out).lstrip("\n") + "\n"


def _type_name(hint: Any, markdown: bool) -> str:
    text = str(hint) if typing.get_origin(hint) else getattr(hint, "__name__", str(hint))
    text = text.replace("typing.", "").replace("NoneType", "None")
    return text.replace("|", "\\|") if markdown else text


def fail(prog: str, message: object) -> NoReturn:
    """Exit as argparse does on a usage error: status 2, the reason on stderr."""
    sys.stderr.write(f"usage: {prog} [--key=value ...]  (--help lists every key)\n")
    sys.stderr.write(f"{prog}: error: {message}\n")
    raise SystemExit(2)


def command_line(
    base: Any,
    argv: Sequence[str],
    prog: str,
    doc: str,
    aliases: Mapping[str, tuple[str, ...]] = {},
    env: Mapping[str, str] = {},
    env_keys: Mapping[str, str] = {},
    required: Sequence[str] = (),
) -> Any:
    """`base` with the command line applied: `--key=value`/`--key value`/`key=value` and
    `--config FILE.yaml`; defaults come from `env[env_keys[key]]` where set. Exits on a bad one."""
    cls: type = type(base)
    names = {k: tuple(f"--{a.replace('_', '-')}" for a, ks in aliases.items() if ks == (k,))
             for k in leaves(cls)}  # fmt: skip

    def name(key: str) -> str:  # errors say the flag as the user would type it
        return (names[key] or (flag(cls, key),))[0]

    if "-h" in argv or "--help" in argv:
        sys.stdout.write(
            f"usage: {prog} [-h, --help] [--config FILE.yaml] [--key=value ...]\n\n{doc}\n\n"
        )
        sys.stdout.write(describe(base, flags=names))
        raise SystemExit(0)
    try:
        pairs = parse_argv(argv, lambda k: is_bool(cls, k, aliases))
        user = [(k, env[var]) for k, var in env_keys.items() if env.get(var)]
        for key, value in pairs:  # a YAML file counts where it stands among the flags
            user += read_yaml(cls, value) if key.lstrip("-") == "config" else [(key, value)]
        values = typed(cls, user, aliases, name)
        missing = [k for k in required if k not in values]
        if missing:
            raise ConfigError(f"{name(missing[0])} is required; see --help")
        return build(base, values, name)
    except ValueError as err:
        fail(prog, err)


def is_bool(cls: type, key: str, aliases: Mapping[str, tuple[str, ...]] = {}) -> bool:
    """Whether `key` names only booleans, so that `--key` alone means true (`--config` does not)."""
    if key.lstrip("-") == "config":
        return False
    return all(leaves(cls)[k] is bool for k in resolve(cls, key, aliases))
