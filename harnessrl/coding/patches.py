"""Unified git diffs as text: split by file, the paths a diff touches, reversal, protected paths.

In: `git diff` output (gold patches, test patches, an agent's changes). Out: per-file sections,
path sets, a reversed diff (SWE-smith patches create the bug), and which guard a path falls under.
"""

from __future__ import annotations

import codecs
import fnmatch
import re
from dataclasses import dataclass
from pathlib import PurePosixPath

HEADER = "diff --git "
HUNK = re.compile(r"^@@ -(\d+(?:,\d+)?) \+(\d+(?:,\d+)?) @@(.*)$")
# Files that change how tests are collected or run rather than what the code does: a diff may not
# bring them in, or the grader would be running the agent's test harness instead of ours.
RUNNER_CONFIG = (
    "conftest.py",
    "sitecustomize.py",
    "usercustomize.py",
    "*.pth",
    "pytest.ini",
    ".pytest.ini",
    "tox.ini",
    "setup.cfg",
    "pyproject.toml",
)
TEST_FILES = ("test_*.py", "*_test.py")
TEST_DIRS = ("tests",)


@dataclass(frozen=True)
class FileDiff:
    """One `diff --git` section; `paths` holds the old and new path (one entry when equal)."""

    paths: tuple[str, ...]
    text: str


def _unquote(path: str) -> str:
    """Git C-quotes paths with unusual bytes ("a/t\\303\\251st.py")."""
    if len(path) >= 2 and path[0] == path[-1] == '"':
        raw: bytes = codecs.escape_decode(path[1:-1].encode())[0]
        return raw.decode("utf-8", "surrogateescape")
    return path


def _strip_prefix(path: str) -> str | None:
    path = _unquote(path.split("\t", 1)[0])
    if path == "/dev/null":
        return None
    return path[2:] if path[:2] in ("a/", "b/") else path


def _header_paths(line: str) -> tuple[str, ...]:
    rest = line[len(HEADER) :]
    if rest.startswith('"'):
        old, _, new = rest.partition('" ')
        return (_strip_prefix(old + '"') or "", _strip_prefix(new) or "")
    # Unquoted "a/X b/X": X is the same on both sides unless renamed; the split is then exact.
    half = (len(rest) - 1) // 2
    if rest[half] == " " and rest[2:half] == rest[half + 3 :]:
        return (rest[2:half],)
    old, _, new = rest.partition(" b/")
    return (old[2:], new)


def _section_paths(lines: list[str]) -> tuple[str, ...]:
    found: list[str] = []
    for line in (ln.rstrip("\n") for ln in lines[1:]):
        if line.startswith(("--- ", "+++ ")):
            path = _strip_prefix(line[4:])
            if path is not None:
                found.append(path)
        elif line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            found.append(_unquote(line.split(" ", 2)[2]))
        elif line.startswith("@@") or line.startswith("GIT binary patch"):
            break
    paths = found or list(_header_paths(lines[0].rstrip("\n")))
    return tuple(dict.fromkeys(p for p in paths if p))


def split_diff(diff: str) -> list[FileDiff]:
    """Split a diff into its per-file sections (text before the first header is dropped)."""
    if not isinstance(diff, str):
        raise TypeError(f"diff must be a string, got {type(diff).__name__}")
    sections: list[list[str]] = []
    for line in diff.splitlines(keepends=True):
        if line.startswith(HEADER):
            sections.append([line])
        elif sections:
            sections[-1].append(line)
    return [FileDiff(_section_paths(s), "".join(s)) for s in sections]


def patch_paths(diff: str) -> frozenset[str]:
    """Every path a diff reads or writes."""
    return frozenset(p for section in split_diff(diff) for p in section.paths)


def _reverse_hunk_header(line: str) -> str:
    m = HUNK.match(line.rstrip("\n"))
    if m is None:
        raise ValueError(f"malformed hunk header in patch: {line.rstrip()!r}")
    return f"@@ -{m[2]} +{m[1]} @@{m[3]}\n"


SWAPS = {
    "new file mode ": "deleted file mode ",
    "deleted file mode ": "new file mode ",
    "old mode ": "new mode ",
    "new mode ": "old mode ",
    "rename from ": "rename to ",
    "rename to ": "rename from ",
}


def _reverse_meta(line: str) -> str:
    for prefix, swapped in SWAPS.items():
        if line.startswith(prefix):
            return swapped + line[len(prefix) :]
    if line.startswith("index "):
        ids, sep, mode = line[6:].rstrip("\n").partition(" ")
        old, _, new = ids.partition("..")
        return f"index {new}..{old}{sep}{mode}\n"
    if line.startswith(HEADER):
        paths = _header_paths(line.rstrip("\n"))
        old, new = (paths[0], paths[0]) if len(paths) == 1 else paths
        return f"{HEADER}a/{new} b/{old}\n"
    return line


def _reverse_section(text: str) -> str:
    lines = text.splitlines(keepends=True)
    header_end = next((i for i, ln in enumerate(lines) if ln.startswith("--- ")), len(lines))
    if any(ln.startswith("GIT binary patch") for ln in lines):
        raise ValueError("cannot reverse a binary patch; give the fix as a forward patch")
    out = [_reverse_meta(ln) for ln in lines[:header_end]]
    # The swapped pairs also swap places: git reads "old mode" before "new mode", "from" before "to".
    for first, second in (("new mode ", "old mode "), ("rename to ", "rename from ")):
        i = next((k for k, ln in enumerate(out) if ln.startswith(first)), None)
        j = next((k for k, ln in enumerate(out) if ln.startswith(second)), None)
        if i is not None and j is not None and i < j:
            out[i], out[j] = out[j], out[i]
    body = lines[header_end:]
    if len(body) >= 2 and body[0].startswith("--- ") and body[1].startswith("+++ "):
        out.append("--- " + ("a/" + body[1][6:] if body[1][4:6] == "b/" else body[1][4:]))
        out.append("+++ " + ("b/" + body[0][6:] if body[0][4:6] == "a/" else body[0][4:]))
        body = body[2:]
    for line in body:
        if line.startswith("@@"):
            out.append(_reverse_hunk_header(line))
        elif line.startswith("+"):
            out.append("-" + line[1:])
        elif line.startswith("-"):
            out.append("+" + line[1:])
        else:
            out.append(line)  # context and "\ No newline at end of file" stay with their line
    return "".join(out)


def reverse_patch(diff: str) -> str:
    """The diff that undoes `diff` (what `git apply -R` would apply), for text hunks."""
    sections = split_diff(diff)
    if diff.strip() and not sections:
        raise ValueError("patch has no 'diff --git' sections to reverse")
    return "".join(_reverse_section(s.text) for s in sections)


def guard_for(path: str, protected: frozenset[str] = frozenset()) -> str | None:
    """Which guard keeps `path` out of a graded diff, or None when the agent may change it."""
    p = PurePosixPath(path)
    if path in protected:
        return "edited_tests"
    if p.suffix in (".pyc", ".pyo") or "__pycache__" in p.parts:
        return "bytecode"
    if any(fnmatch.fnmatchcase(p.name, pat) for pat in RUNNER_CONFIG):
        return "runner_config"
    if any(fnmatch.fnmatchcase(p.name, pat) for pat in TEST_FILES) or any(
        part in TEST_DIRS for part in p.parts[:-1]
    ):
        return "edited_tests"
    return None
