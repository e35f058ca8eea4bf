"""The exception classes of rustws; the Rust bindings raise these by name."""

from __future__ import annotations

__all__ = [
    "DeviceUnavailableError",
    "DisposedArrayError",
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


class WorkspaceClosedError(WorkspaceError):
    """The workspace was destroyed (or is otherwise unusable)."""


class ScopeError(WorkspaceError):
    """A scope was exited out of order, twice, or from another thread."""


class LeakedArrayError(WorkspaceError):
    """Arrays outlived their cycle while strict cycle detection was requested (``RUSTWS_STRICT=1``)."""


class NoSuchWorkspaceError(WorkspaceError, KeyError):
    """No workspace of that name is open on this thread."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""


class DeviceUnavailableError(WorkspaceError):
    """A device workspace cannot be created: no driver, no device, or a bad ordinal."""


class DisposedArrayError(WorkspaceError):
    """The array was disposed."""
