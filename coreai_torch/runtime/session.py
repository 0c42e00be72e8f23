"""Run Core AI programs on the Core AI runtime, from synchronous or asynchronous code.

    with Session(program) as session:            # saves the asset once, loads it
        out = session.run({"x": x})               # {output_name: np.ndarray}
        out = session.run({"x": x}, state={"kv": kv})   # states persist across calls
        out = await session.arun({"x": x})        # the same call, awaited (any event loop)

The runtime's API is asynchronous; its coroutines run on the package's runtime loop, in a
thread of its own (:mod:`coreai_torch.runtime.loop`), so ``run`` works from any thread and
inside a running event loop (a notebook, an async server), and ``arun`` never blocks the
caller's loop.  Before each call the session checks the feeds the runtime would abort on
(wrong dtype or rank, empty tensors, and -- for programs from ``to_coreai()`` -- sizes outside
the ranges the program was exported for or that would make a consumed value empty, see
:mod:`coreai_torch.frontend.sizes`); a failed ``.item()`` range check inside the program
becomes a ``ValueError`` naming the ``.item()`` line.
"""

from __future__ import annotations

import asyncio
import functools
import os
import platform
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coreai_torch._mlir import ca
from coreai_torch.errors import InvalidAssetError, UnsupportedPlatformError
from coreai_torch.ir.assets import check_asset, check_hash, compile_isolated, isolation_available
from coreai_torch.runtime import loop
from coreai_torch.runtime.chatter import quiet_runtime


def to_ndarray(value: Any) -> Any:
    """A runtime ``NDArray`` of a tensor, a numpy array or a nested list (a copy)."""
    from coreai.runtime import NDArray

    if isinstance(value, NDArray):
        return value
    if isinstance(value, torch.Tensor):
        value = value.detach().contiguous()
        if value.dtype == torch.bfloat16:
            import ml_dtypes

            return NDArray(value.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
        return NDArray(value.numpy())
    return NDArray(np.asarray(value))


def to_numpy(array: Any) -> np.ndarray:
    """A runtime ``NDArray`` as a numpy array (``NDArray.numpy()``).

    numpy 2.5 made ``np.from_dlpack`` raise ``BufferError`` (earlier: ``RuntimeError``) for
    dtypes DLPack lacks (bfloat16, float8); coreai-core 1.0.0b3 falls back to the buffer
    protocol only on the old exception, so that fallback is done here.
    """
    try:
        converted: np.ndarray = array.numpy()
        return converted
    except BufferError:
        from coreai.runtime import _ndarray

        tensor = array._tensor
        dtype = np.dtype(_ndarray._RUNTIME_TO_NUMPY_DTYPE.get(tensor.dtype, tensor.dtype))
        buffer = memoryview(tensor)
        raw = buffer if buffer.c_contiguous else buffer.tobytes()
        return np.frombuffer(raw, dtype=dtype).reshape(tensor.shape)


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a runtime descriptor's dtype name (``"float32"``, ``"bfloat16"``)."""
    if name == "bfloat16":
        import ml_dtypes

        bfloat16: np.dtype = np.dtype(ml_dtypes.bfloat16)
        return bfloat16
    return np.dtype(name)


def _check_one(kind: str, name: str, array: Any, descriptor: Any, entrypoint: str) -> None:
    expected = list(descriptor.shape)
    shape = list(array.shape)
    where = f"{kind} '{name}' of '{entrypoint}'"
    if str(array.dtype) != str(descriptor.dtype):
        raise ValueError(f"{where} must be {descriptor.dtype}, got {array.dtype}")
    if len(shape) != len(expected) or any(
        e not in (-1, s) for e, s in zip(expected, shape, strict=False)
    ):
        shown = tuple("?" if e == -1 else e for e in expected)
        raise ValueError(f"{where} must have shape {shown}, got {tuple(shape)}")
    if 0 in shape:
        raise ValueError(
            f"{where} has zero elements {tuple(shape)}; the Core AI runtime "
            "cannot run on empty tensors"
        )


def _check_feeds(
    desc: Any, feeds: Mapping[str, Any], states: Mapping[str, Any], entrypoint: str
) -> None:
    """Reject inputs the runtime would abort on (wrong rank, empty tensors) with a clear error."""
    expected, given = list(desc.input_names), set(feeds)
    missing = [n for n in expected if n not in given]
    unknown = sorted(given - set(expected))
    if missing or unknown:
        raise ValueError(
            f"'{entrypoint}' takes inputs {expected}; missing {missing}, unknown {unknown}"
        )
    for name in expected:
        _check_one("input", name, feeds[name], desc.input_descriptor(name), entrypoint)
    state_names = list(desc.state_names)
    if state_names:
        absent = [n for n in state_names if n not in states]
        if absent:
            raise ValueError(
                f"'{entrypoint}' has states {state_names}; pass them with "
                f"state={{...}} (missing {absent})"
            )
        for name in state_names:
            _check_one("state", name, states[name], desc.state_descriptor(name), entrypoint)


class Session:
    """A program saved as an ``.aimodel`` and loaded on the Core AI runtime.

    A saved asset (a path) is checked before the runtime reads it
    (:func:`coreai_torch.ir.assets.check_asset`: its files are present and complete, its
    bytecode matches ``main.hash`` and is laid out as bytecode); ``verify_hash=False`` skips
    the hash (about a second per GB).  On Linux the program is compiled for the runtime in a child
    process, so a malformed program raises :class:`~coreai_torch.errors.InvalidAssetError`
    instead of aborting this process.

    **Threads and tasks.**  One session may be shared by any number of threads and tasks.  Calls
    run concurrently on the runtime, except calls on the session's stored states (``state=``
    given with ``keep_state=True``, the default, or no ``state=`` on an entry point with
    states): those share buffers and run one at a time, in the order they arrive.  A call with
    its own buffers (``state=..., keep_state=False``) never waits for another: that is how
    concurrent requests each keep their own sequence (:meth:`zero_states` makes a set).
    Open the session before sharing it, and close it once the calls are done.
    """

    def __init__(
        self, program: ca.AIProgram | str | os.PathLike[str], *, verify_hash: bool = True
    ) -> None:
        if not isinstance(program, (str, os.PathLike)) and not hasattr(program, "save_asset"):
            raise TypeError(
                "Session takes an AIProgram or the path of a saved .aimodel asset, got "
                f"{type(program).__name__}"
            )
        self._program = program
        self._verify_hash = verify_hash
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        #: the program compiled for the runtime (Linux), while the session is open
        self._compiled: tempfile.TemporaryDirectory[str] | None = None
        self._exec_cm: Any = None
        self.model: Any = None
        self._functions: dict[str, Any] = {}
        self._loading = threading.Lock()
        #: serializes the calls on the stored states (created on the runtime loop)
        self._stored_states_lock: asyncio.Lock | None = None
        #: entry point -> symbolic sizes its inputs determine (programs from to_coreai() only)
        self._sizes: dict[str, Any] = {
            name: signature.sizes
            for name, signature in (getattr(program, "signatures", None) or {}).items()
            if getattr(signature, "sizes", None)
        }
        #: runtime state buffers per entry point, updated in place by each call
        self.states: dict[str, Any] = {}

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> Session:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Session:
        """``async with Session(...)``: opens in a worker thread (loading takes seconds)."""
        await asyncio.to_thread(self.open)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)

    @property
    def is_open(self) -> bool:
        return self.model is not None

    def open(self) -> None:
        """Check, compile and load the program (blocks the calling thread meanwhile)."""
        asset_path: Path | None = None
        hash_verified = False
        hash_check = None
        if isinstance(self._program, (str, os.PathLike)):
            asset_path = Path(self._program)
            # with a child compiling, the hash is checked while it works (and before use)
            overlap = self._verify_hash and isolation_available()
            check_asset(asset_path, verify_hash=self._verify_hash, defer_hash=overlap)
            hash_verified = self._verify_hash and not overlap
            if overlap:
                hash_check = functools.partial(check_hash, asset_path)
            try:
                asset = ca.AIModelAsset.load(asset_path)
            except RuntimeError as error:
                raise InvalidAssetError(
                    f"{asset_path}: coreai-core cannot read the asset ({error})"
                ) from error
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="coreai_torch_")
            asset = self._program.save_asset(Path(self._tmp.name) / "program.aimodel")
        try:
            if isolation_available():
                compiled = self._compile_isolated(asset, asset_path, hash_verified, hash_check)
                self.model = loop.run(_load_model(compiled))
            else:
                self._exec_cm = asset.executable()
                self.model = loop.run(self._exec_cm.__aenter__())
        except BaseException:
            self.close()
            raise

    def _compile_isolated(
        self,
        asset: Any,
        asset_path: Path | None,
        hashed: bool,
        hash_check: Callable[[], Any] | None,
    ) -> Path:
        """What ``asset.executable()`` does off macOS before loading (compile to ODIX), in a
        child process (:func:`coreai_torch.ir.assets.compile_isolated`); the compiled
        directory."""
        self._compiled = tempfile.TemporaryDirectory(suffix=".aimodelx")
        out = Path(self._compiled.name)
        what = f"'{asset_path}'" if asset_path is not None else "the program"
        compile_isolated(
            lambda: asset._write_odix(out),
            what=what,
            asset_path=asset_path,
            hash_verified=hashed,
            meanwhile=hash_check,
        )
        return out

    def close(self) -> None:
        """Release the runtime's model and the session's files (calls must be done)."""
        exec_cm, self._exec_cm = self._exec_cm, None
        try:
            if exec_cm is not None:
                loop.run(exec_cm.__aexit__(None, None, None))
        finally:
            self.model = None
            self._functions.clear()
            self._stored_states_lock = None
            if self._compiled is not None:
                self._compiled.cleanup()
                self._compiled = None
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None

    # -- calls --------------------------------------------------------------------------------

    def function(self, entrypoint: str = "main") -> Any:
        """The runtime function of ``entrypoint``, loaded on first use."""
        function = self._functions.get(entrypoint)
        if function is not None:
            return function
        with self._loading:
            if entrypoint not in self._functions:
                self._functions[entrypoint] = self._load_function(entrypoint)
        return self._functions[entrypoint]

    def _load_function(self, entrypoint: str) -> Any:
        model = self._open_model()
        names = list(getattr(model, "function_names", None) or [])
        if names and entrypoint not in names:
            raise KeyError(
                f"the program has no entry point '{entrypoint}'; its entry points are {names}"
            )
        try:
            with quiet_runtime():
                return model.load_function(entrypoint)
        except RuntimeError as error:
            if "metal4_kernel" not in str(error):
                raise
            raise UnsupportedPlatformError(
                f"entry point '{entrypoint}' calls custom Metal kernels "
                "(coreai.metal4_kernel), which only run on Apple GPUs; the Core AI runtime "
                f"on {platform.system()} cannot execute them. The program is valid: save it "
                "with save_asset() and run it on an Apple device."
            ) from error

    def _open_model(self) -> Any:
        model = self.model
        if model is None:
            raise RuntimeError(
                "the session is closed; use it inside a `with` block (or call open() first)"
            )
        return model

    def descriptor(self, entrypoint: str = "main") -> Any:
        return self.function(entrypoint).desc

    def run(
        self,
        inputs: Mapping[str, Any],
        *,
        entrypoint: str = "main",
        state: Mapping[str, Any] | None = None,
        keep_state: bool = True,
    ) -> dict[str, np.ndarray]:
        """Call ``entrypoint`` once; returns ``{output_name: numpy array}``.

        ``state`` values (numpy arrays, tensors or runtime ``NDArray``s) are the entry point's
        states for this call, updated in place by the runtime.  With ``keep_state`` they are
        also stored for later calls without ``state=`` (read them back with
        :meth:`state_values`); with ``keep_state=False`` the session keeps nothing, and the
        call never waits for another (see the class's note on threads).
        """
        call = self._prepare(inputs, entrypoint, state, keep_state)
        return self._finish(entrypoint, lambda: loop.run(call))

    async def arun(
        self,
        inputs: Mapping[str, Any],
        *,
        entrypoint: str = "main",
        state: Mapping[str, Any] | None = None,
        keep_state: bool = True,
    ) -> dict[str, np.ndarray]:
        """:meth:`run`, awaited: the caller's event loop keeps running while the runtime works.
        Cancelling the awaiting task cancels the call (a call already running on the runtime
        completes in the background, its buffers held until then)."""
        if entrypoint not in self._functions:  # the first load of a function takes a while
            await asyncio.to_thread(self.function, entrypoint)
        call = self._prepare(inputs, entrypoint, state, keep_state)
        outputs = await loop.arun(call)
        return self._finish(entrypoint, lambda: outputs)

    def _prepare(
        self,
        inputs: Mapping[str, Any],
        entrypoint: str,
        state: Mapping[str, Any] | None,
        keep_state: bool,
    ) -> Any:
        """The coroutine of one call (to run on the runtime loop), its feeds checked."""
        fn = self.function(entrypoint)
        states = self.states.get(entrypoint, {})
        if state is not None:
            states = {k: to_ndarray(v) for k, v in state.items()}
            if keep_state:
                self.states[entrypoint] = states
        feeds = {k: to_ndarray(v) for k, v in inputs.items()}
        _check_feeds(fn.desc, feeds, states, entrypoint)
        if entrypoint in self._sizes:
            self._sizes[entrypoint].check(feeds, entrypoint)
        return self._call(fn, feeds, states, serialized=bool(states) and keep_state)

    async def _call(
        self,
        fn: Any,
        feeds: dict[str, Any],
        states: dict[str, Any],
        *,
        serialized: bool,
    ) -> dict[str, Any]:
        """On the runtime loop: one runtime call, after the previous call on the stored states
        when it uses them."""
        call = fn(feeds, state=states) if states else fn(feeds)
        if not serialized:
            return await loop.shielded(call)
        if self._stored_states_lock is None:
            self._stored_states_lock = asyncio.Lock()
        async with self._stored_states_lock:
            return await loop.shielded(call)

    def _finish(
        self, entrypoint: str, outputs: Callable[[], dict[str, Any]]
    ) -> dict[str, np.ndarray]:
        try:
            out = outputs()
        except RuntimeError as error:  # e.g. a failed .item() range check (frontend.sizes)
            sizes = self._sizes.get(entrypoint)
            explained = sizes.explain(error, entrypoint) if sizes else None
            if explained is not None:
                raise explained from error
            raise
        return {k: to_numpy(v) for k, v in out.items()}

    def zero_states(self, entrypoint: str = "main") -> dict[str, Any]:
        """New runtime buffers, zeroed, for every state of ``entrypoint`` (pass them as
        ``state=`` to :meth:`run`; one set per independent sequence)."""
        from coreai.runtime import NDArray

        desc = self.descriptor(entrypoint)
        return {
            name: NDArray(
                np.zeros(
                    list(desc.state_descriptor(name).shape),
                    numpy_dtype(desc.state_descriptor(name).dtype),
                )
            )
            for name in desc.state_names
        }

    def state_values(self, entrypoint: str = "main") -> dict[str, np.ndarray]:
        """The current state buffers of ``entrypoint`` as numpy arrays (copies)."""
        return {k: to_numpy(v) for k, v in self.states.get(entrypoint, {}).items()}


async def _load_model(compiled: Path) -> Any:
    from coreai.runtime import AIModel

    return await AIModel.load(path=compiled)


def run_program(
    program: ca.AIProgram,
    inputs: Mapping[str, Any],
    *,
    entrypoint: str = "main",
    state: Mapping[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """Save, load and call ``program`` once (see :class:`Session` for repeated calls)."""
    with Session(program) as session:
        return session.run(inputs, entrypoint=entrypoint, state=state)
