"""The exception classes of rustws; the Rust bindings raise these by name.

Each also subclasses the nearest built-in, so code written for NumPy, PyTorch or CuPy catches them
where it catches theirs: ``MemoryError`` for memory, ``RuntimeError`` for state (a destroyed
workspace, a scope exited out of turn, a disposed array, an unusable device, arrays that outlived
their cycle under ``RUSTWS_STRICT=1``), ``KeyError`` for lookups.
"""

from __future__ import annotations

import math
import os
from typing import Any

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

    The message names the workspace, the request, the bytes in use and the limit. The numbers are
    also attributes: ``workspace``, ``requested`` (bytes), ``in_use`` (requested bytes of live
    blocks), ``limit`` (``max_size``, or the arena's capacity where there is none), ``footprint``
    (bytes the workspace held from the system), ``pinned`` (bytes of blocks that outlived their
    cycle), ``cached`` (bytes kept for reuse), ``largest_free`` (the largest request the arena's
    free memory could still serve), ``room`` (bytes the limit still grants), ``takes`` (bytes the
    request takes where it is placed: its size class, a header and any alignment filler),
    ``held`` (bytes the live blocks take, counted alike), ``live_end`` (where the arena's last
    live block ends) and ``reason``; for a
    refusal of the system, ``system`` says what the system refused (``None`` for the workspace's
    own refusals). ``verdict`` says what caused a refusal of the workspace (the limit, the
    arena's fragmentation, the spill policy) and what to change; it is also the error's note.
    """

    workspace: str | None = None
    requested: int | None = None
    in_use: int | None = None
    limit: int | None = None
    footprint: int | None = None
    pinned: int | None = None
    cached: int | None = None
    largest_free: int | None = None
    room: int | None = None
    takes: int | None = None
    held: int | None = None
    live_end: int | None = None
    reason: str | None = None
    system: str | None = None
    verdict: str | None = None


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


# -- made by the bindings --------------------------------------------------------------------------
# The Rust core's errors carry numbers and fixed text; these factories turn them into exceptions,
# formatting their messages here, in Python: building an error where memory ran out then needs
# no allocation of the bindings' own, and a message that cannot be formatted for want of memory is
# a ``MemoryError`` like the one it reports.


def _refused(
    workspace: str,
    requested: int,
    in_use: int,
    limit: int,
    footprint: int,
    pinned: int,
    cached: int,
    largest_free: int,
    room: int,
    held: int,
    live_end: int,
    reason: str,
) -> WorkspaceOutOfMemory:
    size = "more bytes than a size holds" if requested >= 2**64 - 1 else f"{requested} bytes"
    e = WorkspaceOutOfMemory(
        f"workspace {_quoted(workspace)} cannot allocate {size}: {in_use} bytes in use, limit {limit} bytes "
        f"({reason})"
    )
    e.workspace, e.requested, e.in_use, e.limit = workspace, requested, in_use, limit
    e.footprint, e.pinned, e.cached, e.reason = footprint, pinned, cached, reason
    e.largest_free, e.room, e.held, e.live_end = largest_free, room, held, live_end
    e.takes = _placed_size(requested)
    e.verdict = _verdict(e)
    e.add_note(e.verdict)
    if _refusal_hook is not None:
        _refusal_hook(e)
    return e


# Set by ``rustws.memory``: the snapshot and observers that run at each refusal.
_refusal_hook: Any = None


def _placed_size(requested: int) -> int:
    """What a request of ``requested`` bytes takes where the workspace places it."""
    if requested >= 2**64 - 1:
        return requested
    # Imported here: this module is read while the extension initialises.
    from . import _rustws

    return int(_rustws.placed_size(requested))


def _verdict(e: WorkspaceOutOfMemory) -> str:
    """What caused a refusal of the workspace, and what to change."""
    req, live, limit = e.requested or 0, e.in_use or 0, e.limit or 0
    pinned, largest, room = e.pinned or 0, e.largest_free or 0, e.room or 0
    # What the advice must cover: the request and the live blocks as the workspace places them
    # (size classes, headers, fillers), not as they were asked for.
    takes = req if e.takes is None else e.takes
    held = live if e.held is None else e.held
    facts = (
        f"request {_fmt(req)} (taking {_fmt(takes)}), limit {_fmt(limit)}, live {_fmt(live)} "
        f"(pinned {_fmt(pinned)}), cached {_fmt(e.cached or 0)}, largest request the arena's free "
        f"memory serves {_fmt(largest)}, room under the limit {_fmt(room)}"
    )
    if req >= 2**64 - 1 or e.reason == "request too large":
        cause = "the request itself is too large for any workspace"
        change = "check the array's shape and dtype"
    elif e.reason and "not a live block" in e.reason:
        cause = "the block to resize is no live block of this workspace"
        change = "resize arrays through the workspace that made them"
    elif e.reason and "FAIL" in e.reason:
        cause = "the spill policy FAIL: the arena cannot hold the request and spills are refused"
        # The arena's blocks as they lie, and the request past the last of them: where frees
        # left runs too small before it, the live bytes and the request are not enough.
        end = e.live_end or 0
        size = _fmt(max(held, end) + takes, up=True)
        split = ", as its live blocks lie (frees left runs too small before the last)" if end > held else ""
        change = (
            f"size the arena for the cycle (initial_size of at least {size}{split}; "
            "rustws.memory.recommend() computes one from a recording) or allow spills "
            "(policy_spill=EXTERNAL or REALLOCATE)"
        )
    elif held + takes > limit:
        cause = "the limit: the live blocks and the request together exceed max_size"
        change = f"raise max_size to at least {_fmt(held + takes, up=True)}"
        if pinned:
            change += (
                f", or let go of the arrays kept from earlier cycles ({_fmt(pinned)} pinned "
                "by arrays that outlived their cycle)"
            )
    else:
        cause = (
            f"fragmentation: {_fmt(max(limit - held, 0))} under the limit is not live, but no free "
            f"block holds the request (the arena's largest is {_fmt(largest)}, and the limit "
            f"grants {_fmt(room)} more)"
        )
        change = (
            f"raise max_size by {_fmt(takes - min(takes, room), up=True)}, size the arena up front so the "
            "cycle's blocks fit in it (initial_size; rustws.memory.recommend() computes one), or "
            "free the long-lived arrays that split the arena"
        )
    return f"rustws verdict: {cause}. {facts}. To change: {change}."


def _fmt(n: int, up: bool = False) -> str:
    """`n` bytes for a reader; `up`: never below `n` (a size to set, which must be enough)."""
    if abs(n) < 1024:
        return f"{n} B"
    x = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        x /= 1024
        if abs(x) < 1024 or unit == "TiB":
            break
    if up:
        x = math.ceil(x * 10) / 10
    return f"{x:.1f} {unit}"


def _system_refused(
    workspace: str, requested: int, in_use: int, limit: int, system: str
) -> WorkspaceOutOfMemory:
    e = WorkspaceOutOfMemory(
        f"workspace {_quoted(workspace)} cannot allocate {requested} bytes: {in_use} bytes in use, "
        f"limit {limit} bytes (the system refused memory: {system})"
    )
    e.workspace, e.requested, e.reason, e.system = workspace, requested, "the system refused memory", system
    e.in_use, e.limit = in_use, limit
    e.verdict = (
        f"rustws verdict: the system: it refused {_fmt(requested)} ({system}) before the workspace's "
        "own limit was reached. To change: set max_size below the memory this process may use, so that "
        "the workspace refuses first and says what it holds, or free memory elsewhere."
    )
    e.add_note(e.verdict)
    if _refusal_hook is not None:
        _refusal_hook(e)
    return e


def _backend_refusal(op: str, nbytes: int, kind: int, code: int, held: int, name: str, text: str) -> str:
    """What a memory source refused, as the core describes it (``kind``: 0 the operating system's
    ``errno`` ``code``, 1 the CUDA driver's result ``code`` named ``name`` (``text`` its
    description), 2 a limit of ``code`` bytes of which ``held`` were held, 3 the source's own
    reason ``text``)."""
    head = f"{op} of {nbytes} bytes failed: " if nbytes else f"{op} failed: "
    if kind == 0:
        return head + f"{os.strerror(code)} (os error {code})"
    if kind == 1:
        return head + (f"{name}: {text}" if text else name) + f" (CUDA error {code})"
    if kind == 2:
        return head + f"limit of {code} bytes reached ({held} held)"
    return head + text


def _closed(workspace: str) -> WorkspaceClosedError:
    return WorkspaceClosedError(f"workspace {_quoted(workspace)} was destroyed")


def _not_open(workspace: str, operation: str) -> ScopeError:
    return ScopeError(f"workspace {_quoted(workspace)} has no open cycle: {operation} needs one")


def _quoted(name: str) -> str:
    """A workspace's name as the core's own messages quote it (in double quotes, escaped)."""
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _unavailable(what: str, system: str) -> DeviceUnavailableError:
    return DeviceUnavailableError(f"{what}: {system}" if system else what)
