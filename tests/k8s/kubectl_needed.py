"""kubectl for the kustomize rendering tests: where it is missing they skip, except under CI
(`CI` set, as CI services set it), where they fail: CI renders every overlay or goes red."""

from __future__ import annotations

import os
import shutil

import pytest

REASON = "kustomize rendering needs kubectl (apt-get install kubectl)"


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def have_kubectl() -> bool:
    """Whether kubectl is on PATH; under CI a missing kubectl fails the calling test."""
    if shutil.which("kubectl") is not None:
        return True
    if under_ci():
        pytest.fail(f"{REASON}; CI={os.environ['CI']!r}, so a missing kubectl fails, not skips")
    return False


def require_kubectl() -> None:
    """Skips the calling test without kubectl (fails it under CI)."""
    if not have_kubectl():
        pytest.skip(REASON)


# For tests and classes: `@needs_kubectl` (the `kubectl` fixture in conftest.py).
needs_kubectl = pytest.mark.usefixtures("kubectl")
