"""CUDA: device discovery, ``DeviceArray`` and ``asarray``.

A device workspace (``rustws.workspace(name, cfg, device="cuda:N")``) serves its arrays from
device memory through the core's CUDA backend (the driver API, loaded at run time). Its arrays are
``DeviceArray``s: they carry ``__cuda_array_interface__`` (v3) and ``__dlpack__``, so PyTorch,
CuPy, JAX and Numba take them without a copy, and their memory stays alive as long as any such
consumer holds it.

The mirroring policy decides the host side: ``FULL`` gives each array a host mirror in pinned
memory on first use (``.host``, ``sync_to_host()``, ``sync_to_device()``), through which
``to_numpy`` and ``copy_from`` move data; ``DISABLED`` keeps device memory only and copies
straight to and from ordinary host arrays; ``HOST_ONLY`` serves the workspace from host memory.

Without a usable GPU a device workspace falls back to host memory with a ``RuntimeWarning`` when
``helper_allow_fallback`` is true (the default), and raises ``DeviceUnavailableError`` saying why
otherwise. Host-memory arrays are still ``DeviceArray``s, with ``device == "cpu"``,
``__array_interface__`` and a CPU DLPack device, so the same program runs unchanged.

Device memory is reused in the order of the legacy default stream, on which the workspace issues
its own fills and copies: a consumer that works on another stream must be done with an array
(``torch.cuda.Stream.synchronize``, ``record_stream``) before the array dies.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from . import _rustws
from ._dispose import _collected, _disposed, _register
from ._errors import DeviceUnavailableError, DisposedArrayError

__all__ = ["DeviceArray", "asarray", "device_count", "is_available", "unavailable_reason"]

_KDL_CPU = 1
_KDL_CUDA = 2

# DLPack type codes by NumPy kind.
_DL_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}


def device_count() -> int:
    """GPUs the CUDA driver sees (0 without a driver)."""
    return _rustws.cuda_device_count()


def unavailable_reason(ordinal: int = 0) -> str | None:
    """Why ``cuda:<ordinal>`` cannot hold a device workspace (no driver, no device, a bad
    ordinal), or None when it can."""
    if isinstance(ordinal, bool) or not isinstance(ordinal, int) or ordinal < 0:
        raise ValueError(f"invalid device ordinal {ordinal!r}: must be an int >= 0")
    return _rustws.cuda_probe(ordinal)


def is_available() -> bool:
    """Whether device workspaces can use a GPU."""
    return unavailable_reason(0) is None


def _dl_dtype(dtype: np.dtype[Any]) -> tuple[int, int, int]:
    code = _DL_CODES.get(dtype.kind)
    if (
        code is None
        or dtype.fields is not None
        or dtype.subdtype is not None
        or not dtype.isnative
        or (dtype.kind == "f" and dtype.itemsize > 8)
        or (dtype.kind == "c" and dtype.itemsize > 16)
    ):
        raise BufferError(f"dtype {dtype} cannot be exported through DLPack")
    return (code, dtype.itemsize * 8, 1)


def _contiguous_strides(shape: tuple[int, ...], itemsize: int, fortran: bool) -> tuple[int, ...]:
    strides = [0] * len(shape)
    step = itemsize
    order = range(len(shape)) if fortran else range(len(shape) - 1, -1, -1)
    for i in order:
        strides[i] = step
        step *= max(shape[i], 1)
    return tuple(strides)


def _normalize_shape(shape: Any) -> tuple[int, ...]:
    if type(shape) is tuple:  # the common case, without a generator
        for d in shape:
            if type(d) is not int or d < 0:
                break
        else:
            return shape
    if type(shape) is int and shape >= 0:
        return (shape,)
    if isinstance(shape, tuple):
        dims = shape
    elif isinstance(shape, (str, bytes)):
        raise TypeError(f"shape must be an int or a sequence of ints, got {type(shape).__name__}")
    elif hasattr(shape, "__index__"):
        dims = (shape,)
    else:
        try:
            dims = tuple(shape)
        except TypeError:
            raise TypeError(
                f"shape must be an int or a sequence of ints, got {type(shape).__name__}"
            ) from None
    try:
        out = tuple(operator.index(d) for d in dims)
    except TypeError:
        raise TypeError(f"shape entries must be ints, got {shape!r}") from None
    if any(d < 0 for d in out):
        raise ValueError(f"negative dimensions are not allowed: {out}")
    return out


def _host_copy(shape: tuple[int, ...], dtype: np.dtype[Any], fortran: bool) -> np.ndarray:
    """A new host array in NumPy's own memory, even inside a capturing cycle."""
    previous = _rustws.set_handler(None)
    try:
        return np.empty(shape, dtype, order="F" if fortran else "C")
    finally:
        _rustws.set_handler(previous)


_new = object.__new__


class DeviceArray:
    """An array of a device workspace.

    Over device memory it exposes ``__cuda_array_interface__`` and ``__dlpack__`` (a CUDA
    device); in a host fallback (or ``HOST_ONLY``) its memory is host memory of the workspace,
    with ``device == "cpu"``, ``__array_interface__`` and a CPU DLPack device. Implicit
    conversion of device memory to NumPy is refused: use ``to_numpy()``.
    """

    __slots__ = (
        "__weakref__",
        "_buf",
        "_device",
        "_disposed",
        "_dl",
        "_dtype",
        "_exported",
        "_fortran",
        "_host",
        "_mirror",
        "_scope",
        "_shape",
        "_stats",
        "_strides",
        "_workspace",
    )

    _buf: Any
    _host: np.ndarray | None

    def __init__(self, host: np.ndarray, workspace: Any, device: str = "cpu") -> None:
        """A DeviceArray over a host array of ``workspace`` (host fallback, ``HOST_ONLY``)."""
        if not isinstance(host, np.ndarray):
            raise TypeError(f"DeviceArray wraps an ndarray, got {type(host).__name__}")
        self._host = host
        self._buf = None
        self._mirror = None
        self._workspace = workspace
        self._device = device
        self._dl = (_KDL_CPU, 0)
        self._shape = host.shape
        self._dtype = host.dtype
        self._strides = host.strides
        self._fortran = host.flags.f_contiguous and not host.flags.c_contiguous
        self._exported = False
        self._disposed = False
        _register(self)

    @classmethod
    def _over_buffer(
        cls,
        buf: Any,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        fortran: bool,
        workspace: Any,
        device: str,
        dl: tuple[int, int],
    ) -> DeviceArray:
        """A DeviceArray over a ``DeviceBuffer`` of ``workspace`` (device memory)."""
        self = _new(cls)
        self._buf = buf
        self._host = self._mirror = self._strides = None
        self._workspace = workspace
        self._device = device
        self._dl = dl
        self._shape = shape
        self._dtype = dtype
        self._fortran = fortran
        self._exported = self._disposed = False
        _register(self)
        return self

    def __del__(self) -> None:
        # Not contextlib.suppress: at interpreter shutdown module globals may already be cleared.
        try:  # noqa: SIM105
            _collected(self)
        except Exception:  # pragma: no cover
            pass

    def _check(self) -> None:
        if self._disposed:
            raise DisposedArrayError("this DeviceArray was disposed")

    def _array(self) -> np.ndarray:
        """The host array of a host-memory DeviceArray."""
        self._check()
        host = self._host
        if host is None:
            raise TypeError(
                f"this DeviceArray lives in device memory ({self._device}); use .to_numpy() for a host copy"
            )
        return host

    # -- description -----------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        self._check()
        return self._shape

    @property
    def dtype(self) -> np.dtype[Any]:
        self._check()
        return self._dtype

    @property
    def strides(self) -> tuple[int, ...]:
        self._check()
        strides = self._strides
        if strides is None:
            strides = self._strides = _contiguous_strides(self._shape, self._dtype.itemsize, self._fortran)
        return strides

    @property
    def ndim(self) -> int:
        self._check()
        return len(self._shape)

    @property
    def size(self) -> int:
        self._check()
        n = 1
        for d in self._shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.size * self._dtype.itemsize

    @property
    def device(self) -> str:
        self._check()
        return self._device

    @property
    def ptr(self) -> int:
        self._check()
        if self._host is not None:
            return int(self._host.ctypes.data)
        return int(self._buf.ptr)

    @property
    def workspace(self) -> Any:
        return self._workspace

    @property
    def is_disposed(self) -> bool:
        return self._disposed

    def __len__(self) -> int:
        self._check()
        if not self._shape:
            raise TypeError("len() of a 0-d DeviceArray")
        return self._shape[0]

    def __repr__(self) -> str:
        if self._disposed:
            return "DeviceArray(<disposed>)"
        return f"DeviceArray(shape={self._shape}, dtype={self._dtype}, device={self._device!r})"

    # -- exchange --------------------------------------------------------------------------------
    @property
    def __array_interface__(self) -> dict[str, Any]:
        if self._host is None and not self._disposed:
            raise AttributeError("a DeviceArray over device memory has no __array_interface__")
        return self._array().__array_interface__

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if self._host is not None or self._disposed:
            if self._disposed:
                raise DisposedArrayError("this DeviceArray was disposed")
            raise AttributeError("a DeviceArray over host memory has no __cuda_array_interface__")
        # A consumer now references the memory through this object: it stays alive with it.
        self._exported = True
        c_order = not self._fortran or len(self._shape) <= 1
        return {
            "shape": self._shape,
            "typestr": self._dtype.str,
            "descr": [("", self._dtype.str)],
            "data": (int(self._buf.ptr) if self.size else 0, False),
            "strides": None if c_order else self.strides,
            "version": 3,
            # The workspace's own fills and copies run on the legacy default stream.
            "stream": 1,
        }

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        a = self._array()
        if copy:
            return np.array(a, dtype=dtype, copy=True)
        return a if dtype is None else a.astype(dtype, copy=False)

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        if self._host is not None or self._disposed:
            return self._host_dlpack(stream, max_version, dl_device, copy)
        if dl_device is not None and tuple(dl_device) != self._dl:
            raise BufferError(f"cannot export an array on {self._dl} to device {tuple(dl_device)}")
        buf = self._buf
        dl_dtype = _dl_dtype(self._dtype)
        if self._dl[0] == _KDL_CUDA:
            if stream is None:
                stream = 1
            if isinstance(stream, bool) or not isinstance(stream, int):
                raise TypeError(f"stream must be an int or None, got {type(stream).__name__}")
            if stream == 0 or stream < -1:
                raise ValueError(f"invalid stream {stream}: 0 is ambiguous; use 1 (legacy default) or 2")
        elif stream is not None and stream != -1:
            raise BufferError(f"a DeviceArray on DLPack device {self._dl} takes no stream (pass None)")
        copied = False
        if copy:
            fresh = self._workspace._buffer(buf.nbytes)
            fresh.copy_from(buf, buf.nbytes)
            buf, copied = fresh, True
        if stream is not None and stream != -1:
            buf.order_before(stream)  # after the copy: the consumer waits for it too
        versioned = max_version is not None and int(max_version[0]) >= 1
        itemsize = self._dtype.itemsize
        strides = None if not self._fortran else [s // itemsize for s in self.strides]
        return _rustws.dlpack_capsule(
            buf,
            int(buf.ptr),
            list(self._shape),
            strides,
            dl_dtype,
            self._dl,
            versioned,
            False,
            copied,
        )

    def _host_dlpack(self, stream: Any, max_version: Any, dl_device: Any, copy: Any) -> Any:
        a = self._array()
        if stream is not None and stream != -1:
            raise BufferError("a host DeviceArray takes no stream (pass None)")
        if dl_device is not None and tuple(dl_device) != (_KDL_CPU, 0):
            raise BufferError(f"cannot export a host DeviceArray to device {dl_device}")
        kwargs: dict[str, Any] = {}
        if max_version is not None:
            kwargs["max_version"] = max_version
        if copy is not None:
            kwargs["copy"] = copy
        try:
            return a.__dlpack__(**kwargs)
        except TypeError:  # NumPy < 2.1 knows only `stream`
            return a.__dlpack__()

    def __dlpack_device__(self) -> tuple[int, int]:
        self._check()
        return self._dl

    # -- host side -------------------------------------------------------------------------------
    def _mirror_array(self) -> np.ndarray:
        """The pinned host mirror (``MirroringPolicy.FULL``), allocated on first use."""
        mirror = self._mirror
        if mirror is None:
            mws = getattr(self._workspace, "_mirror_ws", None)
            if mws is None:
                raise ValueError(
                    f"workspace {self._workspace.name!r} keeps no host mirror (policy_mirroring is not FULL)"
                )
            mirror = self._mirror = mws.empty(self._shape, self._dtype, "F" if self._fortran else "C")
        return mirror

    @property
    def host(self) -> np.ndarray:
        """The host mirror in pinned memory (``FULL`` mirroring), as last synchronised; for a
        host-memory array, the array itself."""
        self._check()
        if self._host is not None:
            return self._host
        return self._mirror_array()

    def sync_to_host(self) -> np.ndarray:
        """Copies the device contents into the host mirror and returns it."""
        self._check()
        if self._host is not None:
            return self._host
        mirror = self._mirror_array()
        self._buf.copy_to_host(mirror)
        return mirror

    def sync_to_device(self) -> DeviceArray:
        """Copies the host mirror into device memory; returns self."""
        self._check()
        if self._host is None:
            mirror = self._mirror_array()
            self._buf.copy_from_host(mirror)
        return self

    def to_numpy(self) -> np.ndarray:
        """An independent copy in ordinary host memory."""
        self._check()
        if self._host is not None:
            from ._workspace import detach

            return detach(self._host)
        out = _host_copy(self._shape, self._dtype, self._fortran)
        if getattr(self._workspace, "_mirror_ws", None) is not None:
            np.copyto(out, self.sync_to_host())  # a DMA into pinned memory, then one host copy
        else:
            self._buf.copy_to_host(out)
        return out

    def copy_from(self, host_array: Any) -> DeviceArray:
        """Copies ``host_array`` (same shape, castable) into this array; returns self."""
        self._check()
        src = np.asarray(host_array)
        if src.shape != self._shape:
            raise ValueError(f"copy_from: shape {src.shape} does not match {self._shape}")
        if self._host is not None:
            np.copyto(self._host, src, casting="same_kind")
            return self
        if not np.can_cast(src.dtype, self._dtype, "same_kind"):
            raise TypeError(f"copy_from: cannot cast {src.dtype} to {self._dtype} under 'same_kind'")
        if getattr(self._workspace, "_mirror_ws", None) is not None:
            np.copyto(self._mirror_array(), src, casting="same_kind")
            return self.sync_to_device()
        order = "F" if self._fortran else "C"
        staged = np.asarray(src, dtype=self._dtype, order=order)
        if not (staged.flags.f_contiguous if self._fortran else staged.flags.c_contiguous):
            staged = staged.copy(order=order)
        self._buf.copy_from_host(staged)
        return self

    def dispose(self) -> None:
        """Releases the memory now (idempotent); any later use raises ``DisposedArrayError``.

        Consumers that took the array through DLPack keep their memory alive; an array handed
        out through ``__cuda_array_interface__`` keeps its memory until the object itself dies.
        """
        if self._disposed:
            return
        self._host = None
        self._mirror = None
        if not self._exported:
            self._buf = None
        _disposed(self)


def asarray(a: Any, workspace: Any) -> DeviceArray:
    """A ``DeviceArray`` copy of ``a`` in ``workspace`` (a host workspace gives a host-memory one)."""
    from ._workspace import Workspace

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
    return DeviceArray(out, workspace, "cpu")


def _gpu_ordinal(ws: Any, user: str) -> int:
    """The CUDA ordinal of ``ws``, a live device workspace on a GPU; else a ``TypeError`` /
    ``ValueError`` saying why ``user`` cannot take it."""
    from ._workspace import DeviceWorkspace

    if not isinstance(ws, DeviceWorkspace):
        raise TypeError(f"{user} needs a device workspace, got {type(ws).__name__}")
    if ws.is_destroyed:
        raise ValueError(f"workspace {ws.name!r} was destroyed")
    if not ws._on_device or ws._dl[0] != _KDL_CUDA:
        raise ValueError(
            f"workspace {ws.name!r} holds host memory ({ws.fallback_reason or 'HOST_ONLY mirroring'}); "
            f"{user} needs a workspace on a GPU"
        )
    return int(ws._dl[1])


def _fallback_or_raise(device: str, ordinal: int, allow_fallback: bool) -> str | None:
    """For ``workspace(device="cuda:N")``: None when the GPU can be used; else the reason (the
    workspace then falls back to host memory), or ``DeviceUnavailableError`` when it may not."""
    reason = unavailable_reason(ordinal)
    if reason is not None and not allow_fallback:
        raise DeviceUnavailableError(f"device {device!r} is unavailable: {reason}")
    return reason
