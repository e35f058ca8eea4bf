"""The device side of rustws: CUDA discovery, device workspaces, ``DeviceArray`` and ``asarray``.

A device workspace (``rustws.workspace(name, cfg, device="cuda:N")``) serves its arrays from
device memory through the core's CUDA backend (the driver API, loaded at run time). Its arrays are
``DeviceArray``s (a type of the compiled bindings): they carry ``__cuda_array_interface__`` (v3)
and ``__dlpack__``, so PyTorch, CuPy, JAX and Numba take them without a copy, and their memory
stays alive as long as any such consumer holds it.

The mirroring policy decides the host side: ``FULL`` gives each array a host mirror in pinned
memory on first use (``.host``, ``sync_to_host()``, ``sync_to_device()``), through which
``to_numpy`` and ``copy_from`` move data; ``DISABLED`` keeps device memory only and copies
straight to and from ordinary host arrays; ``HOST_ONLY`` serves the workspace from host memory.

Without a usable GPU a device workspace falls back to host memory with a ``RuntimeWarning`` when
``helper_allow_fallback`` is true (the default), and raises ``DeviceUnavailableError`` saying why
otherwise. Host-memory arrays are still ``DeviceArray``s, with ``device == "cpu"``,
``__array_interface__`` and a CPU DLPack device, so the same program runs unchanged.

Device memory is reused in stream order: the workspace issues its own fills and copies on the
legacy default stream, and a block that a consumer declared a stream for (``__dlpack__(stream=)``,
or PyTorch's allocator hooks) goes back to the workspace only after an event recorded on that
stream when the block was released has completed. Consumers of ``__cuda_array_interface__``
declare no stream: they must be done with an array before it dies.

This module imports the host side (``rustws._workspace``); nothing imports it back but the package
and the framework integrations.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from . import _rustws
from ._config import LearningPolicy, MirroringPolicy, WorkspaceConfiguration
from ._errors import DeviceUnavailableError
from ._workspace import _BY_ID, _MAX_ORDINAL, OrderCF, ShapeLike, Workspace, _set_device_factory

_T = TypeVar("_T")

__all__ = ["DeviceArray", "DeviceWorkspace", "asarray", "device_count", "is_available", "unavailable_reason"]

DeviceArray = _rustws.DeviceArray

_KDL_CPU = 1
_KDL_CUDA = 2


def device_count() -> int:
    """GPUs the CUDA driver sees (0 without a driver)."""
    return _rustws.cuda_device_count()


def unavailable_reason(ordinal: int = 0) -> str | None:
    """Why ``cuda:<ordinal>`` cannot hold a device workspace (no driver, no device, a bad
    ordinal), or None when it can."""
    if isinstance(ordinal, bool) or not isinstance(ordinal, int) or not 0 <= ordinal <= _MAX_ORDINAL:
        raise ValueError(f"invalid device ordinal {ordinal!r}: must be an int from 0 to {_MAX_ORDINAL}")
    return _rustws.cuda_probe(ordinal)


def is_available() -> bool:
    """Whether device workspaces can use a GPU."""
    return unavailable_reason(0) is None


class DeviceWorkspace(Workspace):
    """A device workspace: its arrays are ``DeviceArray``s over device memory (with a pinned
    host mirror under ``MirroringPolicy.FULL``). Under ``HOST_ONLY``, or in a host fallback when
    no GPU can be used, its memory is host memory and its arrays have ``device == "cpu"``.

    ``empty`` and ``zeros`` are the bindings' (no Python runs per call)."""

    requested_device: str
    fallback_reason: str | None
    _mirror_ws: Workspace | None

    if TYPE_CHECKING:
        # The bindings' empty and zeros, as a device workspace returns them.
        def empty(  # type: ignore[override]
            self, shape: ShapeLike, dtype: DTypeLike | None = None, order: OrderCF = "C"
        ) -> DeviceArray: ...
        def zeros(  # type: ignore[override]
            self, shape: ShapeLike, dtype: DTypeLike | None = None, order: OrderCF = "C"
        ) -> DeviceArray: ...

    def _setup_device(
        self,
        requested: str,
        reason: str | None,
        on_device: bool,
        dl: tuple[int, int],
        mirror: Workspace | None,
    ) -> None:
        self.requested_device, self.fallback_reason, self._mirror_ws = requested, reason, mirror
        self._set_device(self.device, on_device, dl)

    # Cycles: the mirror follows the device workspace's cycles, without becoming current.
    def __enter__(self) -> DeviceWorkspace:
        mirror = self._mirror_ws
        if mirror is not None and not mirror.is_destroyed:
            mirror._open_cycle()
        try:
            Workspace.__enter__(self)
        except BaseException:
            if mirror is not None and not mirror.is_destroyed:
                mirror._close_cycle()
            raise
        return self

    def __exit__(self, *exc: Any) -> Literal[False]:
        try:
            Workspace.__exit__(self, *exc)
            return False
        finally:
            mirror = self._mirror_ws
            if mirror is not None and mirror.is_open:
                mirror._close_cycle()

    def cycles(self, iterable: Iterable[_T]) -> Iterator[_T]:  # type: ignore[override]
        """The loop form: each item of ``iterable`` is one cycle of this workspace (and of its host
        mirror, which follows its cycles); leaving the loop closes the open cycle."""
        if self._mirror_ws is None:
            return Workspace.cycles(self, iterable)
        return self._cycles_with_mirror(iterable)

    def _cycles_with_mirror(self, iterable: Iterable[_T]) -> Iterator[_T]:
        # Device workspaces never capture NumPy: a `with` per item costs what the loop form saves.
        for item in iterable:
            with self:
                yield item

    def destroy(self) -> None:
        mirror = self._mirror_ws
        if mirror is not None:
            mirror.destroy()
        Workspace.destroy(self)

    close = destroy

    # -- allocation -------------------------------------------------------------------------------
    def full(  # type: ignore[override]
        self, shape: ShapeLike, fill_value: ArrayLike, dtype: DTypeLike | None = None, order: OrderCF = "C"
    ) -> DeviceArray:
        if self._on_device:
            if dtype is None:
                dtype = np.array(fill_value).dtype
            out = self.empty(shape, dtype, order)
            return out.copy_from(np.full(out.shape, fill_value, out.dtype))
        return _rustws.wrap_host(Workspace.full(self, shape, fill_value, dtype, order), self, self.device)

    def _device_like(
        self, a: Any, dtype: Any, order: str, shape: Any
    ) -> tuple[tuple[int, ...], np.dtype[Any], str]:
        """Shape, dtype and order of NumPy's ``*_like`` (DeviceArrays have no subclasses, and
        are C or F contiguous)."""
        if isinstance(a, DeviceArray):
            shp, dt, fortran = a.shape, a.dtype, a._fortran
        else:
            arr = np.asarray(a)
            shp, dt = arr.shape, arr.dtype
            fortran = arr.flags.f_contiguous and not arr.flags.c_contiguous
        o = order.upper() if isinstance(order, str) else order
        if shape is not None:
            new = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape)
            fortran = fortran and (o == "A" or len(new) == len(shp))
            shp = new
        if o in ("K", "A"):
            o = "F" if fortran else "C"
        return shp, dt if dtype is None else np.dtype(dtype), o

    def empty_like(  # type: ignore[override]
        self, a: Any, dtype: DTypeLike | None = None, order: str = "K", subok: bool = True, shape: Any = None
    ) -> DeviceArray:
        return self.empty(*self._device_like(a, dtype, order, shape))

    def zeros_like(  # type: ignore[override]
        self, a: Any, dtype: DTypeLike | None = None, order: str = "K", subok: bool = True, shape: Any = None
    ) -> DeviceArray:
        return self.zeros(*self._device_like(a, dtype, order, shape))

    def ones_like(  # type: ignore[override]
        self, a: Any, dtype: DTypeLike | None = None, order: str = "K", subok: bool = True, shape: Any = None
    ) -> DeviceArray:
        shp, dt, o = self._device_like(a, dtype, order, shape)
        return self.full(shp, 1, dt, o)

    def full_like(  # type: ignore[override]
        self,
        a: Any,
        fill_value: ArrayLike,
        dtype: DTypeLike | None = None,
        order: str = "K",
        subok: bool = True,
        shape: Any = None,
    ) -> DeviceArray:
        shp, dt, o = self._device_like(a, dtype, order, shape)
        return self.full(shp, fill_value, dt, o)

    def asarray(self, a: Any, dtype: Any = None, order: Any = None) -> DeviceArray:  # type: ignore[override]
        """``a`` as a ``DeviceArray`` of this workspace: itself when it is one already (with that
        dtype), else a copy."""
        if isinstance(a, DeviceArray) and a.workspace is self and dtype in (None, a.dtype):
            return a
        src = a.to_numpy() if isinstance(a, DeviceArray) else np.asarray(a)
        if dtype is not None or order is not None:
            src = np.asarray(src, dtype=dtype, order=order)
        return asarray(src, self)

    def _copy_of(self, a: np.ndarray) -> DeviceArray:
        return asarray(a, self)


def asarray(a: Any, workspace: Any) -> DeviceArray:
    """A ``DeviceArray`` copy of ``a`` in ``workspace`` (a host workspace gives a host-memory one)."""
    if not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must be a rustws Workspace, got {type(workspace).__name__}")
    if isinstance(a, DeviceArray):
        a = a.to_numpy()
    src = np.asarray(a)
    if src.dtype.hasobject:
        raise TypeError("object arrays cannot live in workspace memory")
    out = workspace.empty_like(src)
    if isinstance(out, DeviceArray):
        return out.copy_from(src)
    np.copyto(out, src, casting="no")
    return _rustws.wrap_host(out, workspace, "cpu")


def _gpu_ordinal(ws: Any, user: str) -> int:
    """The CUDA ordinal of ``ws``, a live device workspace on a GPU. Otherwise: ``TypeError`` for
    anything but a device workspace, ``WorkspaceClosedError`` for a destroyed one,
    ``DeviceUnavailableError`` (with the reason) for one that fell back to host memory because
    the device is unusable, ``ValueError`` for one configured to hold host memory
    (``HOST_ONLY``)."""
    if not isinstance(ws, DeviceWorkspace):
        raise TypeError(f"{user} needs a device workspace, got {type(ws).__name__}")
    ws._check_alive()
    dl = ws._dl
    if not ws._on_device or dl is None or dl[0] != _KDL_CUDA:
        if ws.fallback_reason is not None:
            raise DeviceUnavailableError(
                f"workspace {ws.name!r} fell back to host memory: device {ws.requested_device!r} is "
                f"unavailable ({ws.fallback_reason}); {user} needs a workspace on a GPU"
            )
        raise ValueError(
            f"workspace {ws.name!r} holds host memory (HOST_ONLY mirroring); "
            f"{user} needs a workspace on a GPU"
        )
    return int(dl[1])


def _mirror_config(cfg: WorkspaceConfiguration) -> dict[str, Any]:
    """The host mirror's configuration: the device's, except that it learns its size from the
    mirrors actually used (pinned memory is scarce, and many programs never read most arrays back)."""
    if cfg.policy_learning != LearningPolicy.NONE:
        cfg = cfg.replace(initial_size=0)
    return cfg._core_dict()


def _host_device_workspace(
    name: str, cfg: WorkspaceConfiguration, requested: str, reason: str | None, capture: bool
) -> DeviceWorkspace:
    ws = DeviceWorkspace(name, cfg._core_dict())
    ws._setup(cfg, "cpu", capture)
    ws._setup_device(requested, reason, False, (_KDL_CPU, 0), None)
    return ws


def _device_workspace(
    name: str, cfg: WorkspaceConfiguration, requested: str, ordinal: int, capture: bool
) -> DeviceWorkspace:
    """A device workspace on ``cuda:<ordinal>`` under ``cfg``'s mirroring policy, or its host
    fallback (warned about, or refused when ``helper_allow_fallback`` is false)."""
    if cfg.policy_mirroring == MirroringPolicy.HOST_ONLY:
        return _host_device_workspace(name, cfg, requested, None, capture)
    reason = unavailable_reason(ordinal)
    if reason is not None:
        if not cfg.helper_allow_fallback:
            raise DeviceUnavailableError(f"device {requested!r} is unavailable: {reason}")
        warnings.warn(
            f"workspace {name!r}: device {requested!r} is unavailable ({reason}); "
            "falling back to host memory",
            RuntimeWarning,
            stacklevel=3,
        )
        return _host_device_workspace(name, cfg, requested, reason, capture)
    mirror = None
    if cfg.policy_mirroring == MirroringPolicy.FULL:
        mirror = Workspace(f"{name}/host-mirror", _mirror_config(cfg), "pinned", ordinal)
        mirror._setup(cfg, "cpu", False)
        _BY_ID[mirror.id] = mirror
    ws = DeviceWorkspace(name, cfg._core_dict(), "cuda", ordinal)
    ws._setup(cfg, requested, False)
    ws._setup_device(requested, None, True, (_KDL_CUDA, ordinal), mirror)
    return ws


def _standin_workspace(
    name: str, config: WorkspaceConfiguration | None = None, *, dl_device: tuple[int, int] = (2, 0)
) -> DeviceWorkspace:
    """A device workspace over host memory that the workspace treats as device memory (headers
    kept apart, every access through the backend), reporting ``dl_device`` to DLPack: the device
    code path without a driver, for tests and the host-side benchmark. Under ``FULL`` mirroring
    its mirror is ordinary host memory. Not registered on the thread."""
    cfg = config if config is not None else WorkspaceConfiguration()
    mirror = None
    if cfg.policy_mirroring == MirroringPolicy.FULL:
        mirror = Workspace(f"{name}/host-mirror", _mirror_config(cfg))
        mirror._setup(cfg, "cpu", False)
        _BY_ID[mirror.id] = mirror
    ws = DeviceWorkspace(name, cfg._core_dict(), "standin")
    ws._setup(cfg, "cuda:0", False)
    ws._setup_device("cuda:0", None, True, dl_device, mirror)
    _BY_ID[ws.id] = ws
    return ws


_set_device_factory(_device_workspace)
