"""Running programs on the Core AI runtime: :class:`Session` (``session``), the event loop the
runtime's coroutines run on (``loop``), and the runtime's own messages kept off stderr
(``chatter``)."""

from coreai_torch.runtime.session import (
    Session,
    numpy_dtype,
    run_program,
    to_ndarray,
    to_numpy,
)

__all__ = ["Session", "numpy_dtype", "run_program", "to_ndarray", "to_numpy"]
