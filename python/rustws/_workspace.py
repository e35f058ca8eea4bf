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
import logging
import os
import sys
import threading
import traceback
import warnings
import weakref
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np

from . import _rustws
from ._config import WorkspaceConfiguration, WorkspaceStats
from ._errors import LeakedArrayError, NoSuchWorkspaceError, WorkspaceClosedError

try:  # NumPy 2
    from numpy._core.multiarray import get_handler_name as _get_handler_name
except ImportError:  # pragma: no cover - NumPy 1.x
    from numpy.core.multiarray import get_handler_name as _get_handler_name

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

logger = logging.getLogger("rustws")

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

    def __init__(self, name: str, config: dict[str, Any], backend: str | None = None) -> None:
        # Made directly (``rustws.Workspace(name, {})``) rather than by ``rustws.workspace``: a
        # usable workspace of no thread's registry, its configuration read back from the dict
        # the core validated. ``rustws.workspace`` sets it up again for its thread.
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
            for fname in ("empty", "zeros", "full", "empty_like", "zeros_like"):
                setattr(self, fname, self._traced(getattr(self, fname)))

    def _traced(self, allocate: Any) -> Any:
        def traced(*args: Any, **kwargs: Any) -> Any:
            a = allocate(*args, **kwargs)
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
    # hook runs only when a cycle has something to report.
    def _after_cycle(self, leaked: bool, escaped_blocks: int, escaped_bytes: int) -> None:
        for message in self._drain_failures():
            logger.warning("%s", message)
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
            warnings.warn(message, ResourceWarning, stacklevel=3)

    def borrow(self) -> contextlib.AbstractContextManager[Workspace]:
        """Makes this workspace current (and capturing) without opening a new cycle. Entering and
        leaving are single steps in the bindings: no exception can leave the scope half open."""
        if self.is_destroyed:
            raise WorkspaceClosedError(f"workspace {self.name!r} was destroyed")
        install = self.capture and self.debug_mode_name != "BYPASS_EVERYTHING"
        return _rustws.Scope(self, install, self.handler)  # type: ignore[return-value]

    # -- allocation ---------------------------------------------------------------------------
    def full(self, shape: Any, fill_value: Any, dtype: Any = None, order: str = "C") -> np.ndarray:
        """A new array over workspace memory filled with ``fill_value``."""
        fill = np.asarray(fill_value)
        if dtype is None:
            dtype = fill.dtype
        a = self._ndarray(shape, dtype, order)
        if fill.ndim == 0:
            a.fill(fill_value)
        else:
            # As ``np.full``: an array fill value broadcasts to the shape.
            np.copyto(a, fill, casting="unsafe")
        return a

    def empty_like(self, a: Any, dtype: Any = None) -> np.ndarray:
        a = np.asarray(a)
        order = "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"
        return self._ndarray(a.shape, a.dtype if dtype is None else dtype, order)

    def zeros_like(self, a: Any, dtype: Any = None) -> np.ndarray:
        a = np.asarray(a)
        order = "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"
        return self._ndarray(a.shape, a.dtype if dtype is None else dtype, order, True)

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


def workspace(
    name: str = "DEFAULT",
    config: WorkspaceConfiguration | None = None,
    *,
    device: str = "cpu",
    capture: bool = True,
) -> Workspace:
    """The calling thread's workspace ``name``, created on first use; every ``with`` is one cycle.

    Without ``config`` a host workspace uses ``WorkspaceConfiguration.adaptive()``. Asking again
    with a different configuration replaces a closed workspace (an open one raises
    ``ValueError``).
    """
    name = _check_name(name)
    cfg = _check_config(config)
    dev, ordinal = _check_device(device)
    if not isinstance(capture, bool):
        raise TypeError(f"capture must be a bool, got {type(capture).__name__}")
    reg = _registry()
    ws = reg.get(name)
    if ws is not None and not ws.is_destroyed:
        if (cfg is None or cfg == ws.config) and dev == getattr(ws, "requested_device", ws.device):
            ws.capture = capture
            return ws
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
    if ordinal is None:
        ws = Workspace(name, cfg._core_dict())
        ws._setup(cfg, dev, capture)
    else:
        if _device_factory is None:  # pragma: no cover - the package imports rustws.cuda
            raise RuntimeError("device workspaces need rustws.cuda, which is not imported")
        ws = _device_factory(name, cfg, dev, ordinal, capture)
    ws._registry = weakref.ref(reg)
    reg[name] = ws
    _BY_ID[ws.id] = ws
    return ws


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
    return _rustws.current_workspace()  # type: ignore[return-value]


def workspaces() -> list[Workspace]:
    """This thread's workspaces."""
    return [ws for ws in _registry().values() if not ws.is_destroyed]


def scope_out_of_workspaces() -> contextlib.AbstractContextManager[None]:
    """Inside, no workspace is current and NumPy allocates with its default allocator."""
    return _rustws.Scope(None, True, None)  # type: ignore[return-value]


def destroy_all_workspaces_for_current_thread() -> None:
    for ws in list(_registry().values()):
        ws.destroy()


def detach(a: Any) -> np.ndarray:
    """An independent copy of ``a`` in ordinary memory (also inside a capturing cycle)."""
    previous = _rustws.set_handler(None)
    try:
        return np.array(a, copy=True, subok=True)
    finally:
        _rustws.set_handler(previous)


def leverage_to(name: str, a: Any, *, enforce_existence: bool = False) -> Any:
    """A copy of ``a`` in the open workspace ``name``; ``a`` itself when there is none (or
    ``NoSuchWorkspaceError`` when ``enforce_existence``)."""
    target = get_workspace(name)
    if target is None or not target.is_open:
        if enforce_existence:
            raise NoSuchWorkspaceError(f"no open workspace {name!r} on this thread")
        return a
    arr = np.asarray(a)
    out = target.empty_like(arr)
    np.copyto(out, arr, casting="no")
    return out


def owner(a: Any) -> Workspace | None:
    """The workspace whose memory holds ``a`` (following ``.base``), else None."""
    if isinstance(a, _rustws.DeviceArray):
        if a.is_disposed:
            return None
        return owner(a._host) if a._host is not None else a.workspace
    base = a
    while isinstance(base, np.ndarray) and not base.flags.owndata and base.base is not None:
        base = base.base
    if not isinstance(base, np.ndarray) or not base.flags.owndata:
        return None
    name = _get_handler_name(base)
    if not name or not name.startswith("rustws:"):
        return None
    try:
        ident = int(name.split(":", 2)[1])
    except (IndexError, ValueError):
        return None
    ws = _BY_ID.get(ident)
    return ws if ws is not None and ws._holds(base) else None


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
