"""Without kubectl the kustomize rendering tests skip on a workstation but fail under CI, so a CI
that could not install kubectl goes red instead of passing without rendering any overlay."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kubectl_needed import have_kubectl, require_kubectl

ROOT = Path(__file__).resolve().parents[2]
RENDERING_TEST = "tests/k8s/test_manifests.py::test_rendered_overlay_validates_and_is_consistent"


def no_kubectl_path(tmp_path: Path) -> str:
    """A PATH holding only this interpreter."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(sys.executable)
    return str(tmp_path / "bin")


@pytest.mark.parametrize(("ci", "outcome"), [("true", "error"), ("", "skipped")])
def test_a_rendering_test_without_kubectl_fails_under_ci(
    tmp_path: Path, ci: str, outcome: str
) -> None:
    env = {**os.environ, "PATH": no_kubectl_path(tmp_path), "CI": ci}
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"{RENDERING_TEST}[base]",
    ]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert f"1 {outcome}" in proc.stdout, proc.stdout[-3000:]
    assert "needs kubectl" in proc.stdout
    assert proc.returncode == (0 if outcome == "skipped" else 1)  # an error at setup: red


@pytest.mark.parametrize("ci", ["1", "true", "True"])
def test_under_ci_a_missing_kubectl_is_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ci: str
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match="fails, not skips"):
        require_kubectl()
    with pytest.raises(pytest.fail.Exception):
        have_kubectl()  # the how-to check that renders only where kubectl is


@pytest.mark.parametrize("ci", [None, "", "false", "0"])
def test_elsewhere_a_missing_kubectl_skips(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ci: str | None
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    assert not have_kubectl()
    with pytest.raises(pytest.skip.Exception, match="needs kubectl"):
        require_kubectl()


def test_ci_entry_point_stops_when_kubectl_cannot_be_installed(tmp_path: Path) -> None:
    """`.ci/run` with every other package present, no kubectl and an apt-get that fails: it exits
    non-zero, saying so, before the test suite (a stub `make` that would leave a mark)."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    mark = tmp_path / "make-ran"
    scripts = {"ls": "exit 0", "bwrap": "exit 0", "chromium": "exit 0",
               "apt-get": "echo \"apt-get $*\" >&2; exit 100", "make": f": > {mark}"}  # fmt: skip
    for name, body in scripts.items():
        (stubs / name).write_text(f"#!/bin/sh\n{body}\n")
        (stubs / name).chmod(0o755)
    (stubs / "dirname").symlink_to(shutil.which("dirname") or "/usr/bin/dirname")
    proc = subprocess.run(["/bin/bash", str(ROOT / ".ci" / "run")], env={"PATH": str(stubs)},
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode != 0, proc.stderr
    assert "apt-get install -y -q kubectl" in proc.stderr
    assert "kubectl could not be installed" in proc.stderr
    assert not mark.exists(), "the suite ran without kubectl"
