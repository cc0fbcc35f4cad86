"""Fixtures of the manifest tests."""

from __future__ import annotations

import pytest
from kubectl_needed import require_kubectl


@pytest.fixture
def kubectl() -> None:
    """kubectl is on PATH: else the test skips, or fails under CI (`kubectl_needed`)."""
    require_kubectl()
