"""Workspaces as Python sees them: the per-thread registry of named workspaces, and the
module-level helpers of the contract (``workspace``, ``detach``, ``leverage_to``, ``owner`` ...).

Cycles, the per-context scope stack and capture (making a workspace NumPy's current allocator)
are in the bindings; the stack lives in a ``ContextVar``, like NumPy's current handler, so threads
and asyncio tasks each see their own innermost workspace.

Device workspaces are ``rustws.cuda``'s: it registers how to make them (``_set_device_factory``),
so this module never imports it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, SupportsIndex, TextIO, TypeAlias, TypeVar, overload

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

from . import _log, _rustws
from ._config import WorkspaceConfiguration, WorkspaceStats
from ._errors import (
    EscapedArrayWarning,
    LeakedArrayError,
    NoSuchWorkspaceError,
    WorkspaceOutOfMemory,
)

if TYPE_CHECKING:
    from .cuda import DeviceWorkspace

__all__ = [
    "Workspace",
    "current_workspace",
    "destroy_all_workspaces_for_current_thread",
    "detach",
    "get_and_activate_workspace",
    "get_workspace",
    "leverage_to",
    "owner",
    "print_allocation_statistics",
    "scope_out_of_workspaces",
    "workspace",
    "workspaces",
]


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _show_escapes_by_default() -> None:
    """Puts a ``default`` filter for ``EscapedArrayWarning`` just before the standard filter that
    ignores every ``ResourceWarning``, where there is one: filters from ``-W``, the environment and
    the program stay in front of it and keep deciding."""
    filters = warnings.filters
    if any(f[2] is EscapedArrayWarning for f in filters):
        return
    # ``-W`` options and PYTHONWARNINGS go in front of the standard filters, and an option equal to
    # a standard filter replaces it: one naming ResourceWarning is the user's own choice.
    if any("ResourceWarning" in option for option in sys.warnoptions):
        return
    for i in range(len(filters) - 1, -1, -1):
        if tuple(filters[i]) == ("ignore", None, ResourceWarning, None, 0):
            filters.insert(i, ("default", None, EscapedArrayWarning, None, 0))
            mutated = getattr(warnings, "_filters_mutated", None) or getattr(
                warnings, "_filters_mutated_lock_held", None
            )
            if mutated is not None:
                mutated()
            return


_show_escapes_by_default()


def _user_stacklevel() -> int:
    """The ``stacklevel`` for a warning issued by the caller of this function that points at the
    first frame outside rustws and ``contextlib`` (the user's ``with`` or call)."""
    frame = sys._getframe(2)
    level = 2
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith(_PACKAGE_DIR) or frame.f_code.co_filename == contextlib.__file__
    ):
        frame = frame.f_back
        level += 1
    return level


ShapeLike: TypeAlias = "SupportsIndex | Sequence[SupportsIndex]"
OrderCF: TypeAlias = "str | None"
OrderKACF: TypeAlias = 'Literal["K", "A", "C", "F"]'
_ScalarT = TypeVar("_ScalarT", bound=np.generic)
_ArrayT = TypeVar("_ArrayT", bound="np.ndarray[Any, Any]")
_T = TypeVar("_T")

_local = threading.local()
_BY_ID: weakref.WeakValueDictionary[int, Workspace] = weakref.WeakValueDictionary()


# Makes device workspaces: ``(name, config, device, ordinal, capture) -> Workspace``, set by
# ``rustws.cuda`` when it is imported (the package imports it).
_device_factory: Callable[[str, WorkspaceConfiguration, str, int, bool], Workspace] | None = None


def _set_device_factory(factory: Callable[[str, WorkspaceConfiguration, str, int, bool], Workspace]) -> None:
    global _device_factory
    _device_factory = factory


class _Registry(dict[str, "Workspace"]):
    """One thread's workspaces by name. It lives as long as its thread (in a ``threading.local``):
    when the thread ends, the workspaces it left open or undestroyed are destroyed, so their
    memory goes back to the system but for the pages under arrays that still live, whoever still
    holds the workspace objects (arrays made in a cycle keep theirs)."""

    __slots__ = ("__weakref__",)

    def __del__(self) -> None:
        for ws in list(self.values()):
            # At interpreter shutdown the modules it needs may be gone already.
            with contextlib.suppress(Exception):
                ws.destroy()


def _registry() -> _Registry:
    reg = getattr(_local, "workspaces", None)
    if reg is None:
        reg = _local.workspaces = _Registry()
    return reg


class Workspace(_rustws.WorkspaceCore):
    """A named workspace of one thread. Each ``with ws:`` is one cycle; nested ``with`` blocks of
    the same workspace nest without a reset. Get one with ``rustws.workspace(name, config)``."""

    config: WorkspaceConfiguration
    device: str

    def __init__(
        self, name: str, config: dict[str, Any], backend: str | None = None, ordinal: int = 0
    ) -> None:
        # Made directly (``rustws.Workspace(name, {})``) rather than by ``rustws.workspace``: a
        # usable workspace of no thread's registry, its configuration read back from the dict
        # the core validated. ``rustws.workspace`` sets it up again for its thread.
        _check_name(name)
        self._setup(WorkspaceConfiguration.from_dict(config), "cpu", True, trace=False)
        _BY_ID[self.id] = self

    def _setup(self, config: WorkspaceConfiguration, device: str, capture: bool, trace: bool = True) -> None:
        self.config = config
        self.device = device
        self.capture = capture
        # Weak: the registry (alive while its thread is) holds the workspace, not the reverse.
        self._registry: weakref.ref[_Registry] | None = None
        self._traces: list[tuple[weakref.ref[Any], int, str]] = []
        self._traces_limit = 64
        if trace and config.use_cycle_detector and os.environ.get("RUSTWS_TRACE") == "1":
            # Record where explicit allocations happen, for the escape report. (Captured
            # allocations happen inside NumPy, where no Python runs.)
            for fname in (
                "empty",
                "zeros",
                "ones",
                "full",
                "empty_like",
                "zeros_like",
                "ones_like",
                "full_like",
                "asarray",
            ):
                setattr(self, fname, self._traced(getattr(self, fname)))

    def _traced(self, allocate: Any) -> Any:
        def traced(*args: Any, **kwargs: Any) -> Any:
            a = allocate(*args, **kwargs)
            import traceback

            frame = traceback.extract_stack(limit=2)[0]  # the caller of the allocation
            traces = self._traces
            traces.append(
                (weakref.ref(a), self.generation, f"{frame.filename}:{frame.lineno} in {frame.name}")
            )
            if len(traces) >= self._traces_limit:
                # Arrays that died need no trace: drop them, amortised over the appends, so clean
                # cycles keep only the traces of arrays still alive.
                traces[:] = [t for t in traces if t[0]() is not None]
                self._traces_limit = max(64, 2 * len(traces))
            return a

        return traced

    def _escaped_sites(self, cycle: int) -> list[str]:
        sites = [site for ref, gen, site in self._traces if gen == cycle and ref() is not None]
        self._traces = [t for t in self._traces if t[0]() is not None and t[1] > cycle]
        return sites

    # Cycles: ``__enter__`` / ``__exit__`` are the core's (rustws._rustws.WorkspaceCore); this
    # hook runs when an exit has something to report, and at every exit of an observed workspace
    # (``completed``: the exit closed a cycle).
    def _after_cycle(
        self, leaked: bool, escaped_blocks: int, escaped_bytes: int, completed: bool = False
    ) -> None:
        _report_refusals(self._drain_failures())
        if leaked:
            cycle = self.generation - 1
            message = (
                f"workspace {self.name!r}: {escaped_blocks} array(s) ({escaped_bytes} bytes) outlived cycle "
                f"{cycle}; their memory stays pinned until they are freed"
            )
            sites = self._escaped_sites(cycle)
            if sites:
                message += "; explicit allocations among them: " + "; ".join(sites)
            if os.environ.get("RUSTWS_STRICT") == "1":
                raise LeakedArrayError(message)
            warnings.warn(message, EscapedArrayWarning, stacklevel=_user_stacklevel())

    if TYPE_CHECKING:
        # The bindings' methods, as a host workspace returns them (ndarrays; a DeviceWorkspace
        # returns DeviceArrays and says so).
        def __enter__(self) -> Workspace: ...

        # ``asarray``: as ``np.asarray``, the result in this workspace (a list or tuple made here
        # directly where the workspace captures; anything else through ``_asarray``).
        def asarray(
            self, a: ArrayLike, dtype: DTypeLike | None = None, order: OrderKACF | None = None
        ) -> NDArray[Any]: ...

        # ``empty_like`` and ``zeros_like``: NumPy's ``*_like``, an ndarray prototype built in the
        # bindings directly, anything else through ``_like`` (subclasses kept with ``subok``).
        @overload
        def empty_like(
            self,
            a: _ArrayT,
            dtype: None = None,
            order: OrderKACF = "K",
            subok: Literal[True] = True,
            shape: None = None,
        ) -> _ArrayT: ...
        @overload
        def empty_like(
            self,
            a: ArrayLike,
            dtype: DTypeLike | None = None,
            order: OrderKACF = "K",
            subok: bool = True,
            shape: ShapeLike | None = None,
        ) -> NDArray[Any]: ...
        def empty_like(
            self, a: Any, dtype: Any = None, order: str = "K", subok: bool = True, shape: Any = None
        ) -> Any: ...

        @overload
        def zeros_like(
            self,
            a: _ArrayT,
            dtype: None = None,
            order: OrderKACF = "K",
            subok: Literal[True] = True,
            shape: None = None,
        ) -> _ArrayT: ...
        @overload
        def zeros_like(
            self,
            a: ArrayLike,
            dtype: DTypeLike | None = None,
            order: OrderKACF = "K",
            subok: bool = True,
            shape: ShapeLike | None = None,
        ) -> NDArray[Any]: ...
        def zeros_like(
            self, a: Any, dtype: Any = None, order: str = "K", subok: bool = True, shape: Any = None
        ) -> Any: ...

        @overload
        def empty(
            self, shape: ShapeLike, dtype: None = None, order: OrderCF = "C"
        ) -> NDArray[np.float64]: ...
        @overload
        def empty(
            self, shape: ShapeLike, dtype: type[_ScalarT] | np.dtype[_ScalarT], order: OrderCF = "C"
        ) -> NDArray[_ScalarT]: ...
        @overload
        def empty(self, shape: ShapeLike, dtype: DTypeLike | None, order: OrderCF = "C") -> NDArray[Any]: ...
        def empty(self, shape: ShapeLike, dtype: DTypeLike | None = None, order: OrderCF = "C") -> Any: ...
        @overload
        def zeros(
            self, shape: ShapeLike, dtype: None = None, order: OrderCF = "C"
        ) -> NDArray[np.float64]: ...
        @overload
        def zeros(
            self, shape: ShapeLike, dtype: type[_ScalarT] | np.dtype[_ScalarT], order: OrderCF = "C"
        ) -> NDArray[_ScalarT]: ...
        @overload
        def zeros(self, shape: ShapeLike, dtype: DTypeLike | None, order: OrderCF = "C") -> NDArray[Any]: ...
        def zeros(self, shape: ShapeLike, dtype: DTypeLike | None = None, order: OrderCF = "C") -> Any: ...

    def borrow(self) -> contextlib.AbstractContextManager[Workspace]:
        """Makes this workspace current (and capturing) without opening a new cycle. Entering and
        leaving are single steps in the bindings: no exception can leave the scope half open."""
        return self._borrow()

    # -- allocation ---------------------------------------------------------------------------
    # ``empty`` and ``zeros`` are the bindings' (no Python runs per call). The rest follow NumPy's
    # signatures; where NumPy keeps an ndarray subclass (``subok=True``, layouts ``order="K"``
    # cannot express as C or F) NumPy itself makes the array, with this workspace as its allocator
    # for the call, so subclasses and their ``__array_finalize__`` behave exactly as in NumPy.
    def _numpy_here(self, make: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``make(*args, **kwargs)`` with this workspace as NumPy's allocator (whatever scopes are
        open; nothing to install where it captures here already); a refusal raises
        ``WorkspaceOutOfMemory`` with the workspace's reason."""
        self._check_alive()
        try:
            if self._captures_here():
                return make(*args, **kwargs)
            # The bindings switch the handler and back around the call in one step.
            return _rustws.call_with_handler(self.handler, make, args, kwargs)
        except MemoryError as e:
            if isinstance(e, WorkspaceOutOfMemory):
                raise
            refusals = self._drain_failures()
            if not refusals:
                raise
            raise refusals[-1] from None

    def full(
        self, shape: ShapeLike, fill_value: ArrayLike, dtype: DTypeLike | None = None, order: OrderCF = "C"
    ) -> NDArray[Any]:
        """A new array over workspace memory filled with ``fill_value``."""
        if dtype is None:
            fill = np.asarray(fill_value)
            dtype = fill.dtype
            if fill.ndim:
                fill_value = fill  # an array fill value is converted once
        a = self._ndarray(shape, dtype, order)
        _fill(a, fill_value)
        return a

    @overload
    def ones(
        self, shape: ShapeLike, dtype: type[_ScalarT] | np.dtype[_ScalarT], order: OrderCF = "C"
    ) -> NDArray[_ScalarT]: ...
    @overload
    def ones(
        self, shape: ShapeLike, dtype: DTypeLike | None = float, order: OrderCF = "C"
    ) -> NDArray[Any]: ...
    def ones(self, shape: ShapeLike, dtype: DTypeLike | None = float, order: OrderCF = "C") -> Any:
        """As ``np.ones``, over workspace memory."""
        # The dtype as given: the shape is read first, as NumPy reads it.
        return type(self).full(self, shape, 1, float if dtype is None else dtype, order)

    def _like(self, a: Any, dtype: Any, order: str, subok: bool, shape: Any, zeroed: bool) -> Any:
        """NumPy's ``empty_like`` and (``zeroed``) ``zeros_like`` past the bindings' fast path."""
        proto = a if isinstance(a, np.ndarray) else _as_ndarray(a)
        dt = proto.dtype if dtype is None else np.dtype(dtype)
        _refuse_objects(dt)
        o = order.upper() if isinstance(order, str) else order
        contiguous = proto.flags.c_contiguous or proto.flags.f_contiguous
        if (subok and type(proto) is not np.ndarray) or (o == "K" and not contiguous) or o not in "KACF":
            like = np.zeros_like if zeroed else np.empty_like
            # The dtype as given: NumPy 1's `empty_like` of a subclass releases an explicit dtype
            # once too often where the allocation is refused.
            return self._numpy_here(like, proto, dtype, order, subok, shape)
        shp = proto.shape if shape is None else shape
        if o in ("K", "A"):
            # As NumPy: "A" and "K" follow a Fortran-only prototype, "K" only at the same ndim.
            fortran = proto.flags.f_contiguous and not proto.flags.c_contiguous
            if o == "K" and shape is not None:
                fortran = fortran and (len(shp) if isinstance(shp, (tuple, list)) else 1) == proto.ndim
            o = "F" if fortran else "C"
        return self._ndarray(shp, dt, o, zeroed)

    @overload
    def ones_like(
        self,
        a: _ArrayT,
        dtype: None = None,
        order: OrderKACF = "K",
        subok: Literal[True] = True,
        shape: None = None,
    ) -> _ArrayT: ...
    @overload
    def ones_like(
        self,
        a: ArrayLike,
        dtype: DTypeLike | None = None,
        order: OrderKACF = "K",
        subok: bool = True,
        shape: ShapeLike | None = None,
    ) -> NDArray[Any]: ...
    def ones_like(
        self, a: Any, dtype: Any = None, order: str = "K", subok: bool = True, shape: Any = None
    ) -> Any:
        """As ``np.ones_like``, over workspace memory."""
        return self._filled_like(a, dtype, order, subok, shape, 1)

    @overload
    def full_like(
        self,
        a: _ArrayT,
        fill_value: ArrayLike,
        dtype: None = None,
        order: OrderKACF = "K",
        subok: Literal[True] = True,
        shape: None = None,
    ) -> _ArrayT: ...
    @overload
    def full_like(
        self,
        a: ArrayLike,
        fill_value: ArrayLike,
        dtype: DTypeLike | None = None,
        order: OrderKACF = "K",
        subok: bool = True,
        shape: ShapeLike | None = None,
    ) -> NDArray[Any]: ...
    def full_like(
        self,
        a: Any,
        fill_value: Any,
        dtype: Any = None,
        order: str = "K",
        subok: bool = True,
        shape: Any = None,
    ) -> Any:
        """As ``np.full_like``, over workspace memory."""
        return self._filled_like(a, dtype, order, subok, shape, fill_value)

    def _filled_like(self, a: Any, dtype: Any, order: Any, subok: bool, shape: Any, fill: Any) -> Any:
        """As NumPy's ``ones_like`` and ``full_like``: ``empty_like`` (the bindings' fast path),
        then ``copyto(..., casting="unsafe")``. A fill of integer zero into a numeric dtype is
        ``zeros_like`` (fresh memory is not written); into strings it is ``"0"``, as NumPy's."""
        if type(fill) is int and fill == 0:
            dt = getattr(a, "dtype", None) if dtype is None else np.dtype(dtype)
            if isinstance(dt, np.dtype) and dt.kind in "biufcmM":
                return type(self).zeros_like(self, a, dtype, order, subok, shape)
        out = type(self).empty_like(self, a, dtype, order, subok, shape)
        np.copyto(out, fill, casting="unsafe")
        return out

    def _asarray(
        self, a: ArrayLike, dtype: DTypeLike | None = None, order: OrderKACF | None = None
    ) -> NDArray[Any]:
        """``asarray`` past the bindings' fast path: ``a`` itself (as an ndarray) when it already
        lives here with that dtype and order, else a copy made here."""
        if type(a) in (list, tuple) or isinstance(a, (int, float, complex, str, bytes)):
            # A Python sequence or scalar always becomes new memory: made here directly, once,
            # converted as NumPy converts it (a scalar's conversion is no array's cast: a complex
            # number is no float).
            if dtype is not None:
                _refuse_objects(np.dtype(dtype))
            made: NDArray[Any] = self._numpy_here(np.asarray, a, dtype=dtype, order=order)
            _refuse_objects(made.dtype)
            return made
        src = a if isinstance(a, np.ndarray) else _as_ndarray(a)
        _refuse_objects(src.dtype if dtype is None else np.dtype(dtype))
        if owner(src) is self:
            same: NDArray[Any] = self._numpy_here(np.asarray, src, dtype=dtype, order=order)
            return same
        copy: NDArray[Any] = self._numpy_here(
            np.array, src, dtype=dtype, order="K" if order is None else order, copy=True
        )
        return copy

    def _copy_of(self, a: np.ndarray) -> Any:
        """A copy of ``a`` in this workspace, of its subclass (as ``np.copy(a, subok=True)``)."""
        _refuse_objects(a.dtype)
        return self._numpy_here(np.array, a, copy=True, subok=True, order="K")

    # -- state --------------------------------------------------------------------------------
    def stats(self) -> WorkspaceStats:
        return WorkspaceStats(*self._stats())

    def destroy(self) -> None:
        """Releases the workspace. Memory under live arrays is kept until the last one dies. Idempotent."""
        if self.is_destroyed:
            return
        self._destroy()
        reg = self._registry() if self._registry is not None else None
        if reg is not None and reg.get(self.name) is self:
            del reg[self.name]
        # ``owner`` still finds it while this object lives: its memory holds the remaining arrays.

    close = destroy


def _fill(a: NDArray[Any], value: Any) -> None:
    """Fills ``a`` as ``np.full`` does, ``copyto(a, value, casting="unsafe")`` (an array value
    broadcasts; NaN into integers, complex into reals, datetimes into integers convert as NumPy
    converts them); ``ndarray.fill``, which is quicker, where it gives the same: a Python int
    into integers whose range holds it (NumPy 1's ``fill`` warns of one out of range, which
    ``copyto`` casts), a Python float into floating or complex numbers, a small Python int into
    those (exact even in float16), a bool into bools."""
    kind, t = a.dtype.kind, type(value)
    if t is int and kind in "iu":
        bits = 8 * a.dtype.itemsize
        low, high = (0, 1 << bits) if kind == "u" else (-(1 << (bits - 1)), 1 << (bits - 1))
        fits = low <= value < high
    else:
        fits = (t is int and kind in "fc" and -2048 <= value <= 2048) or (t is float and kind in "fc")
    if fits or (t is bool and kind == "b"):
        a.fill(value)
    else:
        np.copyto(a, value, casting="unsafe")


def _refuse_objects(dtype: np.dtype[Any]) -> None:
    if dtype.hasobject:
        raise TypeError(f"dtype {dtype} holds Python objects; workspace memory never holds Python references")


def _as_ndarray(a: Any) -> NDArray[Any]:
    """``a`` as an ndarray without asking it for a copy: ``np.asarray`` calls ``__array__``
    without the ``copy`` keyword, which frameworks written before NumPy 2 (PyTorch's tensors
    among them) answer with a ``DeprecationWarning`` when NumPy passes it."""
    return np.asarray(a)


# A refusal whose own report could not be made: memory ran out again while it was written (the
# error is then the interpreter's bare `MemoryError`).
_REPORT_LOST = (
    "a request was refused, and memory ran out again while its report was made: its verdict and "
    "memory snapshot may be missing"
)


def _report_refusals(refusals: list[BaseException]) -> None:
    """Tells why captured requests were refused. NumPy turns a refusal into its plain
    ``MemoryError`` ("Unable to allocate ..."); when that error is what leaves the cycle, the
    workspace's reasons are added to it as notes (PEP 678), so the traceback says why. Every
    refusal is also logged (WARNING), including those whose error was caught inside the cycle."""
    if not refusals:
        return
    exc = sys.exc_info()[1]
    if isinstance(exc, MemoryError) and not isinstance(exc, WorkspaceOutOfMemory):
        notes = getattr(exc, "__notes__", ())
        for refusal in refusals:
            # The refusal's own notes: its verdict, and where its memory snapshot went.
            text = str(refusal) or _REPORT_LOST
            for note in (f"rustws: {text}", *getattr(refusal, "__notes__", ())):
                if note and note not in notes:
                    exc.add_note(note)
    if refusals and _log.enabled(_log.WARNING):
        for refusal in refusals:
            _log.logger().warning("%s", refusal)


def _check_name(name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"workspace name must be a str, got {type(name).__name__}")
    if not name:
        raise ValueError("workspace name must not be empty")
    return name


def _check_config(config: Any) -> WorkspaceConfiguration | None:
    if config is None or isinstance(config, WorkspaceConfiguration):
        return config
    if isinstance(config, dict):
        return WorkspaceConfiguration.from_dict(config)
    raise TypeError(f"config must be a WorkspaceConfiguration, a dict or None, got {type(config).__name__}")


_MAX_ORDINAL = 2**31 - 1  # CUDA and DLPack number devices with a C int


def _check_device(device: Any) -> tuple[str, int | None]:
    """The normalised device and its CUDA ordinal (None for the host)."""
    if not isinstance(device, str):
        raise TypeError(f"device must be a str such as 'cpu' or 'cuda:0', got {type(device).__name__}")
    d = device.strip().lower()
    if d == "cpu":
        return "cpu", None
    if d == "cuda" or d.startswith("cuda:"):
        ordinal = d[5:] or "0"
        if not (ordinal.isascii() and ordinal.isdigit()) or int(ordinal) > _MAX_ORDINAL:
            raise ValueError(f"invalid device {device!r}: the ordinal must be an int from 0 to 2**31 - 1")
        return f"cuda:{int(ordinal)}", int(ordinal)
    raise ValueError(f"invalid device {device!r}: expected 'cpu' or 'cuda:N'")


CudaDevice: TypeAlias = (
    'Literal["cuda", "cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:4", "cuda:5", "cuda:6", "cuda:7"]'
)


@overload
def workspace(
    name: str = "DEFAULT",
    config: WorkspaceConfiguration | dict[str, Any] | None = None,
    *,
    device: Literal["cpu"] = "cpu",
    capture: bool | None = None,
) -> Workspace: ...
@overload
def workspace(
    name: str = "DEFAULT",
    config: WorkspaceConfiguration | dict[str, Any] | None = None,
    *,
    device: CudaDevice,
    capture: bool | None = None,
) -> DeviceWorkspace: ...
@overload
def workspace(
    name: str = "DEFAULT",
    config: WorkspaceConfiguration | dict[str, Any] | None = None,
    *,
    device: str,
    capture: bool | None = None,
) -> Workspace: ...
def workspace(
    name: str = "DEFAULT",
    config: WorkspaceConfiguration | dict[str, Any] | None = None,
    *,
    device: str = "cpu",
    capture: bool | None = None,
) -> Workspace:
    """The calling thread's workspace ``name``, created on first use; every ``with`` is one cycle.

    Without ``config`` a host workspace uses ``WorkspaceConfiguration.adaptive()``. Asking again
    with a different configuration replaces a closed workspace (an open one raises
    ``ValueError``). ``capture`` defaults to True for a new workspace; looking one up leaves it
    as it is unless given.
    """
    name = _check_name(name)
    cfg = _check_config(config)
    dev, ordinal = _check_device(device)
    if capture is not None and not isinstance(capture, bool):
        raise TypeError(f"capture must be a bool, got {type(capture).__name__}")
    reg = _registry()
    ws = reg.get(name)
    if ws is not None and not ws.is_destroyed:
        if (cfg is None or cfg == ws.config) and dev == getattr(ws, "requested_device", ws.device):
            if capture is not None:
                ws.capture = capture
            return _observed(ws)
        if ws.is_open:
            raise ValueError(
                f"workspace {name!r} is open with a different configuration or device; "
                "close it before asking for another"
            )
        ws.destroy()
    if cfg is None:
        # Without a configuration: the adaptive profile on the host; device workspaces keep
        # ND4J's default (their memory is explicit, never captured).
        cfg = WorkspaceConfiguration.adaptive() if ordinal is None else WorkspaceConfiguration()
    capture = True if capture is None else capture
    if ordinal is None:
        ws = Workspace(name, cfg._core_dict())
        ws._setup(cfg, dev, capture)
    else:
        if _device_factory is None:  # pragma: no cover - the package imports rustws.cuda
            raise RuntimeError("device workspaces need rustws.cuda, which is not imported")
        ws = _device_factory(name, cfg, dev, ordinal, capture)  # a DeviceWorkspace
    ws._registry = weakref.ref(reg)
    reg[name] = ws
    _BY_ID[ws.id] = ws
    return _observed(ws)


# -- diagnostics -----------------------------------------------------------------------------------
# The rustws logger says, at INFO, when a workspace first settles, and at DEBUG what its arena did
# in each cycle. Those records are derived from what the statistics show at cycle ends (and from the
# thread's page faults while a cycle opens), so only workspaces whose records someone reads pay for
# them: ``rustws.workspace()`` gives a workspace the observing class below when the logger is
# enabled for INFO, and an observed workspace drops it again at a cycle end once the logger is not.
# Observed or not, a cycle runs exactly the bindings' ``__enter__`` / ``__exit__``.


class _CycleObserver:
    """Mixed in front of a workspace class: logs what each outermost cycle did. It adds no Python
    to entering or leaving a scope (an exception raised between a cycle's opening and its `with`
    block would leave the cycle open): the bindings count the page faults of an opening and report
    every exit through ``_after_cycle``."""

    __slots__ = ()

    def _after_cycle(
        self, leaked: bool, escaped_blocks: int, escaped_bytes: int, completed: bool = False
    ) -> None:
        # Called by the bindings at every exit while observed, a `with` block's and the loop
        # form's alike. Only an exit that closed the last open cycle reports one (not a nested
        # one, nor one beside cycles still open); a strict leak raised above still logs.
        ws: Any = self
        try:
            super()._after_cycle(leaked, escaped_blocks, escaped_bytes, completed)  # type: ignore[misc]
        finally:
            if completed and not ws.is_open and not ws.is_destroyed:
                _after_observed_cycle(ws)


_OBSERVED: dict[type, type] = {}


def _observed(ws: Workspace) -> Workspace:
    cls = type(ws)
    if isinstance(ws, _CycleObserver) or not _log.enabled(_log.INFO):
        return ws
    observed = _OBSERVED.get(cls)
    if observed is None:
        observed = _OBSERVED[cls] = type(
            cls.__name__, (_CycleObserver, cls), {"__slots__": (), "__module__": cls.__module__}
        )
        observed.__qualname__ = cls.__qualname__
    ws.__class__ = observed
    ws.__dict__.setdefault("_observed_settled", False)
    ws._observe(True)
    return ws


def _after_observed_cycle(ws: Any) -> None:
    if not _log.enabled(_log.INFO):
        ws.__class__ = type(ws).__mro__[2]  # the class it had: back to the bindings' cycles
        ws._observe(False)
        return
    # The core's report of the cycle that just closed: no statistics are compared.
    cycle, allocations, spills, peak, before, after, pinned = ws._last_cycle()
    changed = before != after
    logger = _log.logger()
    faults, opened = ws._opening_faults()
    if logger.isEnabledFor(_log.DEBUG):
        name = ws.name
        if faults:
            logger.debug(
                "workspace %r: %d page faults while opening cycle %d (the arena's learned part is "
                "pre-faulted)",
                name,
                faults,
                opened,
            )
        if changed:
            if before == 0:
                what = f"mapped an arena of {_fmt_bytes(after)}"
            elif after == 0:
                what = f"released its arena of {_fmt_bytes(before)}"
            else:
                verb = "grew" if after > before else "shrank"
                what = f"arena {verb} (remapped) {_fmt_bytes(before)} -> {_fmt_bytes(after)}"
            sites = _outside_sites(ws.id, cycle, "served outside the arena at") if after > before else ""
            logger.debug("workspace %r: cycle %d %s%s", name, cycle, what, sites)
        if spills:
            logger.debug(
                "workspace %r: cycle %d spilled %d request(s) outside the arena (peak %s, arena %s)%s",
                name,
                cycle,
                spills,
                _fmt_bytes(peak),
                _fmt_bytes(before),
                _outside_sites(ws.id, cycle, "spilled at"),
            )
        elif peak > max(before, after) > 0:
            logger.debug(
                "workspace %r: cycle %d served %s beyond its arena without spilling (huge "
                "requests get mappings of their own)",
                name,
                cycle,
                _fmt_bytes(peak - max(before, after)),
            )
        if pinned:
            logger.debug(
                "workspace %r: after cycle %d, %s stay pinned under arrays that outlived it",
                name,
                cycle,
                _fmt_bytes(pinned),
            )
    calm = not spills and not changed and allocations > 0
    if calm and not ws._observed_settled and after > 0:
        ws._observed_settled = True
        logger.info(
            "workspace %r settled after %d cycles: arena %s, peak %s per cycle, no spill or "
            "resize in cycle %d",
            ws.name,
            cycle + 1,
            _fmt_bytes(after),
            _fmt_bytes(peak),
            cycle,
        )


def _outside_sites(wid: int, cycle: int, verb: str) -> str:
    """Where a recorded cycle allocated outside its arena (what spilled, or what made the arena
    grow), while ``rustws.memory.record_history`` records stacks: the three largest sites, each
    its innermost frame outside rustws and its bytes; empty otherwise."""
    from . import memory

    if not _rustws.recording_stacks():
        return ""
    frames = memory._Frames()
    trace = [
        {"action": "alloc", "cycle": cycle, "size": n, "kind": memory._KINDS.get(k), "frames": frames(st)}
        for n, st, k in _rustws.cycle_allocations(wid, cycle)
    ]
    parts = [
        f"{f['filename']}:{f['line']} {f['name']} ({_fmt_bytes(s['bytes'])} in {s['count']})"
        for s in memory.cycle_sites(trace, cycle, top=3)
        if (f := memory.user_frame(s["frames"]))
    ]
    return f"; {verb} " + ", ".join(parts) if parts else ""


def get_and_activate_workspace(
    config: WorkspaceConfiguration | None = None, name: str = "DEFAULT"
) -> Workspace:
    """ND4J's spelling of ``workspace(name, config)``."""
    return workspace(name, config)


def get_workspace(name: str) -> Workspace | None:
    """This thread's workspace ``name``, or None."""
    ws = _registry().get(_check_name(name))
    return ws if ws is not None and not ws.is_destroyed else None


def current_workspace() -> Workspace | None:
    """The innermost workspace of this thread or task (None inside ``scope_out_of_workspaces``)."""
    ws: Workspace | None = _rustws.current_workspace()
    return ws


def workspaces() -> list[Workspace]:
    """This thread's workspaces."""
    return [ws for ws in _registry().values() if not ws.is_destroyed]


def scope_out_of_workspaces() -> contextlib.AbstractContextManager[None]:
    """Inside, no workspace is current and NumPy allocates with its default allocator."""
    return _rustws.Scope()


def destroy_all_workspaces_for_current_thread() -> None:
    for ws in list(_registry().values()):
        ws.destroy()
    # Scopes closed from elsewhere (a finaliser on another thread) leave closed nodes on top of
    # this context's stack: NumPy's handler goes back to what the open scopes chose.
    _rustws.settle_scopes()


@overload
def detach(a: _ArrayT) -> _ArrayT: ...
@overload
def detach(a: ArrayLike | _rustws.DeviceArray) -> NDArray[Any]: ...
def detach(a: Any) -> Any:
    """An independent copy of ``a`` in ordinary memory (also inside a capturing cycle), of its
    ndarray subclass."""
    # NumPy's default allocator for the copy, switched to and back in one step by the bindings.
    return _rustws.call_with_handler(None, _detached_copy, (a,))


def _detached_copy(a: Any) -> Any:
    src = a if isinstance(a, (np.ndarray, _rustws.DeviceArray)) else _as_ndarray(a)
    return np.array(src, copy=True, subok=True)


@overload
def leverage_to(name: str, a: _ArrayT, *, enforce_existence: bool = False) -> _ArrayT: ...
@overload
def leverage_to(name: str, a: _T, *, enforce_existence: bool = False) -> _T | NDArray[Any]: ...
def leverage_to(name: str, a: Any, *, enforce_existence: bool = False) -> Any:
    """A copy of ``a`` in the open workspace ``name`` (of its ndarray subclass); ``a`` itself when
    there is none (or ``NoSuchWorkspaceError`` when ``enforce_existence``)."""
    target = get_workspace(name)
    if target is None or not target.is_open:
        if enforce_existence:
            raise NoSuchWorkspaceError(f"no open workspace {name!r} on this thread")
        return a
    src = a if isinstance(a, np.ndarray) else _as_ndarray(a)
    return target._copy_of(src)


def owner(a: Any) -> Workspace | None:
    """The workspace whose memory holds ``a``, else None. ``a`` is an ndarray (its ``.base`` chain
    is followed, through ``memoryview``s and other buffer exporters on it), a ``memoryview`` (its
    exporter is followed), a ``DeviceArray``, or any other object that exposes its memory (the
    buffer protocol, ``__array_interface__``, ``__cuda_array_interface__``, DLPack, Arrow's
    ``address`` / ``buffers()``: a PyTorch tensor, a CuPy array, an Arrow buffer or array), found
    by the address of its data."""
    last: np.ndarray | None = None
    for _ in range(64):  # exporter chains are short; a cycle of references must not loop forever
        if isinstance(a, _rustws.DeviceArray):
            if a.is_disposed:
                return None
            if a._host is None:
                ws: Workspace | None = a.workspace
                return ws
            a = a._host
            continue
        if isinstance(a, memoryview) and a.obj is not None:
            a = a.obj
            continue
        if isinstance(a, np.ndarray):
            base = a
            while isinstance(base, np.ndarray) and not base.flags.owndata and base.base is not None:
                base = base.base
            if not isinstance(base, np.ndarray):
                last = a
                a = base  # a view of another exporter's memory (np.frombuffer, np.from_dlpack)
                continue
            if base.flags.owndata:
                return _owner_of_data(base)
            return _owner_at(_addresses(base))  # over memory of no Python object (ctypes, C)
        # Another exporter: the view of it that led here, or the addresses it gives of its data.
        return _owner_at([last.ctypes.data] if last is not None and last.size else _addresses(a))
    return None


def _addresses(obj: Any) -> list[int]:
    """The addresses of the data an object exposes (empty when it exposes none)."""
    out: list[int] = []
    for attr in ("__cuda_array_interface__", "__array_interface__"):
        try:
            iface = getattr(obj, attr, None)
        except Exception:  # a CPU torch tensor refuses the CUDA interface with an error
            iface = None
        data = iface.get("data") if isinstance(iface, dict) else None
        if isinstance(data, tuple) and data and isinstance(data[0], int) and data[0]:
            return [data[0]]
    if isinstance(getattr(obj, "address", None), int):  # an Arrow buffer
        return [obj.address]
    buffers = getattr(obj, "buffers", None)  # an Arrow array: its buffers
    if callable(buffers):
        try:
            out = [b.address for b in buffers() if isinstance(getattr(b, "address", None), int)]
        except Exception:
            out = []
        if out:
            return out
    if hasattr(obj, "__dlpack__"):
        try:
            view = np.from_dlpack(obj)
            if view.size:
                return [view.ctypes.data]
        except Exception:  # device memory, a dtype NumPy has not, a tensor that needs grad
            pass
    try:
        with memoryview(obj) as mv:
            if mv.nbytes:
                return [np.frombuffer(mv, np.uint8).ctypes.data]
    except (TypeError, ValueError, BufferError):
        pass
    return out


def _owner_at(addresses: list[int]) -> Workspace | None:
    """The workspace whose memory holds one of ``addresses`` (a lookup in every workspace)."""
    for address in addresses:
        for ws in list(_BY_ID.values()):
            if ws._holds(address):
                return ws
    return None


def _owner_of_data(base: np.ndarray) -> Workspace | None:
    if not base.flags.owndata:
        return None
    ident = _rustws.block_owner(base)
    return _BY_ID.get(ident) if ident is not None else None


def _fmt_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def print_allocation_statistics(file: TextIO | None = None) -> None:
    """Prints a table of this thread's workspaces."""
    out = file if file is not None else sys.stdout
    cols = (
        "name",
        "cycles",
        "capacity",
        "used",
        "peak/cycle",
        "cached",
        "external",
        "pinned",
        "allocs",
        "spills",
    )
    rows = []
    for ws in workspaces():
        s = ws.stats()
        rows.append(
            (
                ws.name,
                str(s.cycles),
                _fmt_bytes(s.capacity_bytes),
                _fmt_bytes(s.used_bytes),
                _fmt_bytes(s.peak_cycle_bytes),
                _fmt_bytes(s.cached_bytes),
                _fmt_bytes(s.external_bytes),
                _fmt_bytes(s.pinned_bytes),
                str(s.allocation_count),
                str(s.spill_count),
            )
        )
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)), file=out)
    if not rows:
        print("(no workspaces on this thread)", file=out)
    info = _rustws.build_info()
    if info["parked_regions"]:
        # Empty regions of workspaces entered in turn, waiting for the next one that opens.
        parked = f"{info['parked_regions']} region(s), {_fmt_bytes(info['parked_bytes'])}"
        print(f"handed on between workspaces entered in turn: {parked}", file=out)
