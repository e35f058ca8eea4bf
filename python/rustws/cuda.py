"""CUDA: device discovery, ``DeviceArray`` and ``asarray``.

The core has a CUDA memory backend (cudarc, driver loaded at run time), but Python device arrays
over device memory are not built yet: a device workspace (``rustws.workspace(name, cfg,
device="cuda:N")``) falls back to host memory with a ``RuntimeWarning`` when
``helper_allow_fallback`` is true (the default), and raises ``DeviceUnavailableError`` saying why
otherwise. Its arrays are still ``DeviceArray``s, with ``device == "cpu"``, ``__array_interface__``
and a CPU DLPack device, so the same program runs unchanged. The core's driver probe names the
reason: no driver, no device, or a bad ordinal.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _rustws
from ._errors import DeviceUnavailableError, DisposedArrayError

__all__ = ["DeviceArray", "asarray", "device_count", "is_available", "unavailable_reason"]

_KDL_CPU = 1


def device_count() -> int:
    """GPUs the CUDA driver sees (0 without a driver)."""
    return _rustws.cuda_device_count()


def unavailable_reason(ordinal: int = 0) -> str | None:
    """Why ``cuda:<ordinal>`` cannot hold a device workspace in this build, or None."""
    if isinstance(ordinal, bool) or not isinstance(ordinal, int) or ordinal < 0:
        raise ValueError(f"invalid device ordinal {ordinal!r}: must be an int >= 0")
    reason = _rustws.cuda_probe(ordinal)
    if reason is not None:
        return reason
    return "this build serves device workspaces from host memory (no device arrays yet)"


def is_available() -> bool:
    """Whether device workspaces can use a GPU."""
    return unavailable_reason(0) is None


class DeviceArray:
    """An array of a device workspace. In a host fallback its memory is host memory of the
    workspace: ``device == "cpu"``, with ``__array_interface__`` and a CPU DLPack device."""

    __slots__ = ("__weakref__", "_device", "_dispose_flag", "_host", "_scope", "_stats", "_workspace")

    def __init__(self, host: np.ndarray, workspace: Any, device: str = "cpu") -> None:
        if not isinstance(host, np.ndarray):
            raise TypeError(f"DeviceArray wraps an ndarray, got {type(host).__name__}")
        self._host: np.ndarray | None = host
        self._workspace = workspace
        self._device = device
        self._dispose_flag = [False]
        from ._dispose import _register

        _register(self)

    def _array(self) -> np.ndarray:
        host = self._host
        if host is None:
            raise DisposedArrayError("this DeviceArray was disposed")
        return host

    # -- description -----------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._array().shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._array().dtype

    @property
    def strides(self) -> tuple[int, ...]:
        return self._array().strides

    @property
    def nbytes(self) -> int:
        return self._array().nbytes

    @property
    def ndim(self) -> int:
        return self._array().ndim

    @property
    def size(self) -> int:
        return self._array().size

    @property
    def device(self) -> str:
        self._array()
        return self._device

    @property
    def ptr(self) -> int:
        return int(self._array().ctypes.data)

    @property
    def workspace(self) -> Any:
        return self._workspace

    @property
    def is_disposed(self) -> bool:
        return self._host is None

    def __repr__(self) -> str:
        if self._host is None:
            return "DeviceArray(<disposed>)"
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, device={self._device!r})"

    # -- exchange --------------------------------------------------------------------------------
    @property
    def __array_interface__(self) -> dict[str, Any]:
        return self._array().__array_interface__

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
        self._array()
        return (_KDL_CPU, 0)

    def to_numpy(self) -> np.ndarray:
        """An independent copy in ordinary host memory."""
        from ._workspace import detach

        return detach(self._array())

    def copy_from(self, host_array: Any) -> DeviceArray:
        """Copies ``host_array`` (same shape, castable) into this array; returns self."""
        a = self._array()
        src = np.asarray(host_array)
        if src.shape != a.shape:
            raise ValueError(f"copy_from: shape {src.shape} does not match {a.shape}")
        np.copyto(a, src, casting="same_kind")
        return self

    def dispose(self) -> None:
        """Releases the memory now (idempotent); any later use raises ``DisposedArrayError``."""
        if self._host is None:
            return
        self._host = None
        from ._dispose import _disposed

        _disposed(self)


def asarray(a: Any, workspace: Any) -> DeviceArray:
    """A ``DeviceArray`` copy of ``a`` in ``workspace``."""
    from ._workspace import Workspace

    if not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must be a rustws Workspace, got {type(workspace).__name__}")
    src = np.asarray(a)
    out = workspace.empty_like(src)
    host = out._array() if isinstance(out, DeviceArray) else out
    np.copyto(host, src, casting="no")
    return out if isinstance(out, DeviceArray) else DeviceArray(out, workspace, "cpu")


def _fallback_or_raise(device: str, ordinal: int, allow_fallback: bool) -> str:
    """For ``workspace(device="cuda:N")``: the reason a GPU cannot be used (warned about when the
    workspace may fall back to host memory), or raises ``DeviceUnavailableError``."""
    reason = unavailable_reason(ordinal) or "no device arrays over device memory yet"
    if not allow_fallback:
        raise DeviceUnavailableError(f"device {device!r} is unavailable: {reason}")
    return reason
