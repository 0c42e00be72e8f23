"""Where the codes of weights streamed from their checkpoint wait until they are written.

A weight still in its checkpoint (:mod:`coreai_torch.tensors.lazy`) is read, fitted and let go;
its codes are not held in memory either: they wait in one anonymous temporary file
(:class:`~coreai_torch.ir.weights.SpillFile`) in the temporary directory, while its file system
has room for them (and, beside them, for the asset that holds them again) and is not held in
memory itself (tmpfs).  ``compress()`` keeps the codes it fits there until the asset is
written; :func:`~coreai_torch.compression.calibration.calibrate` keeps there the codes it fits
until ``compress()`` stores them (:class:`SpilledCodes`).  Without room, the codes stay in
memory (``calibrate()``) or are fitted again while the asset is written (``compress()``).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from coreai_torch.ir.compressed import LinearCodes, PaletteCodes
from coreai_torch.ir.saving import SPACE_MARGIN, free_space
from coreai_torch.ir.weights import SpillFile


class Spilling:
    """One spill file, made when the first buffers are spilled (see the module
    documentation)."""

    def __init__(self) -> None:
        self.directory: str | None = None  # known once a weight is to be spilled
        self.usable = True
        self.file: SpillFile | None = None

    def file_for(self, nbytes: int) -> SpillFile | None:
        """The spill file when it has room for ``nbytes`` more (else None)."""
        if self.directory is None:
            self.directory = tempfile.gettempdir()
            self.usable = not memory_backed(self.directory)
        if not self.usable:
            return None
        spilled = self.file.size if self.file is not None else 0
        try:
            if free_space(Path(self.directory)) < 2 * nbytes + spilled + SPACE_MARGIN:
                return None
            if self.file is None:
                self.file = SpillFile(self.directory)
        except OSError:  # a temporary directory that cannot be written
            self.usable = False
            return None
        return self.file


def memory_backed(directory: str) -> bool:
    """Whether ``directory`` is on a file system held in memory (Linux's tmpfs, ramfs)."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return False
    path = os.path.realpath(directory)
    best, kind = "", ""
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, kind = point, fields[2]
    return kind in ("tmpfs", "ramfs")


def array_bytes(codes: Any) -> int:
    """Bytes of the arrays of fitted codes: at least what their constants store."""
    return sum(v.nbytes for v in vars(codes).values() if isinstance(v, np.ndarray))


@dataclass
class SpilledCodes:
    """Fitted codes (:class:`~coreai_torch.ir.compressed.LinearCodes` or
    :class:`~coreai_torch.ir.compressed.PaletteCodes`) whose arrays wait in a spill file;
    :meth:`load` reads them back."""

    file: SpillFile
    kind: type[LinearCodes] | type[PaletteCodes]
    #: per array field: ``(offset in the file, dtype, shape)``
    arrays: dict[str, tuple[int, np.dtype[Any], tuple[int, ...]]]
    #: the other fields (bits, signedness, absent arrays)
    others: dict[str, Any]

    def load(self) -> LinearCodes | PaletteCodes:
        """The codes, their arrays read from the file now."""
        values = dict(self.others)
        for name, (offset, dtype, shape) in self.arrays.items():
            array = np.empty(shape, dtype)
            self.file.read_into(offset, array)
            values[name] = array
        return self.kind(**values)


def spilled(
    codes: LinearCodes | PaletteCodes, spilling: Spilling
) -> LinearCodes | PaletteCodes | SpilledCodes:
    """``codes`` written to ``spilling``'s file (the codes themselves when it has no room)."""
    file = spilling.file_for(array_bytes(codes))
    if file is None:
        return codes
    arrays: dict[str, tuple[int, np.dtype[Any], tuple[int, ...]]] = {}
    others: dict[str, Any] = {}
    for f in dataclasses.fields(codes):
        value = getattr(codes, f.name)
        if isinstance(value, np.ndarray):
            arrays[f.name] = (file.write(value), value.dtype, value.shape)
        else:
            others[f.name] = value
    return SpilledCodes(file, type(codes), arrays, others)
