"""Shared pytest configuration."""

from __future__ import annotations

import os

import pytest
import torch

# The runtime's CPU backend and torch both use threads; keep the two test workers from
# oversubscribing a small machine.
torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_configure(config: pytest.Config) -> None:
    """Refuse ``--dist loadgroup`` where it would silently ignore ``xdist_group``.

    pytest-xdist (3.8) groups a test by suffixing its node id with ``@group``; pytest 9.2
    keeps node ids where xdist cannot change them, so grouped tests were spread over the
    workers (``pyproject.toml`` keeps pytest below 9.2 for that reason)."""
    from packaging.version import Version

    dist = getattr(config.option, "dist", "no")
    if dist == "loadgroup" and Version(pytest.__version__) >= Version("9.2"):
        raise pytest.UsageError(
            f"--dist loadgroup ignores xdist_group with pytest {pytest.__version__} "
            "(pytest-xdist cannot tag its node ids): install pytest<9.2 (pyproject.toml)"
        )
