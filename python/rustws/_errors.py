"""The exception classes of rustws; the Rust bindings raise these by name.

Each also subclasses the nearest built-in, so code written for NumPy, PyTorch or CuPy catches them
where it catches theirs: ``MemoryError`` for memory, ``RuntimeError`` for state (a destroyed
workspace, a scope exited out of turn, a disposed array, an unusable device, arrays that outlived
their cycle under ``RUSTWS_STRICT=1``), ``KeyError`` for lookups.
"""

from __future__ import annotations

__all__ = [
    "DeviceUnavailableError",
    "DisposedArrayError",
    "EscapedArrayWarning",
    "LeakedArrayError",
    "NoSuchWorkspaceError",
    "ScopeError",
    "WorkspaceClosedError",
    "WorkspaceError",
    "WorkspaceOutOfMemory",
]


class WorkspaceError(Exception):
    """Base class of every rustws error."""


class WorkspaceOutOfMemory(WorkspaceError, MemoryError):
    """A request the workspace cannot serve.

    The message names the workspace, the request, the bytes in use and the limit.
    """


class WorkspaceClosedError(WorkspaceError, RuntimeError):
    """The workspace was destroyed (or is otherwise unusable)."""


class ScopeError(WorkspaceError, RuntimeError):
    """A scope was exited out of order, twice, or from another thread."""


class LeakedArrayError(WorkspaceError, RuntimeError):
    """Arrays outlived their cycle while strict cycle detection was requested (``RUSTWS_STRICT=1``)."""


class NoSuchWorkspaceError(WorkspaceError, KeyError):
    """No workspace of that name is open on this thread."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""


class DeviceUnavailableError(WorkspaceError, RuntimeError):
    """A device is unusable: a device workspace cannot be created (no driver, no device, a bad
    ordinal), or a framework hook was given a workspace that fell back to host memory."""


class DisposedArrayError(WorkspaceError, RuntimeError):
    """The array was disposed."""


class EscapedArrayWarning(ResourceWarning):
    """Arrays outlived their cycle (``use_cycle_detector=True``): their memory stays pinned until
    they die. A ``ResourceWarning``, but shown under Python's default warning filters (importing
    rustws puts a ``default`` filter for this category just before the standard one that ignores
    ``ResourceWarning``, so ``-W`` options and filters set by the program still decide)."""
