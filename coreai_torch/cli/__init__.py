"""The ``coreai-torch`` command line (``coreai-torch --help``; docs/cli.md)."""

from coreai_torch.cli.main import main

__all__ = ["main"]
