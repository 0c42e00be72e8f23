"""The former place of :mod:`coreai_torch.tensors.lazy`, kept so that existing imports keep
working: ``coreai_torch.ir.lazy`` is that very module."""

import sys

from coreai_torch.tensors import lazy

sys.modules[__name__] = lazy
