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
