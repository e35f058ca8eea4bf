"""Dispose scopes (TorchSharp's technique 3) over ``DeviceArray``s and other rustws-owned arrays.

Each thread has a chain of open scopes. An array created while a scope is innermost is registered
with it, and disposed when the scope closes unless it was moved out (``move_to_outer``) or
detached. Scopes may close out of order: closing one unlinks it wherever it is in the chain.
Host NumPy arrays are not tracked here: workspace cycles govern them.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

__all__ = ["DisposeScope", "DisposeStatistics", "dispose_scope", "dispose_statistics"]


@dataclasses.dataclass
class DisposeStatistics:
    """Counters of one thread: arrays created in and outside scopes, disposed in and outside
    scopes, attached to and detached from scopes, and live (created, not yet disposed or freed)."""

    created_in_scope: int = 0
    created_outside_scope: int = 0
    disposed_in_scope: int = 0
    disposed_outside_scope: int = 0
    attached: int = 0
    detached: int = 0
    live: int = 0

    def reset(self) -> None:
        """Zeroes every counter but ``live`` (a state, not a count of events)."""
        live = self.live
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)
        self.live = live


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.chain: list[DisposeScope] = []
        self.stats = DisposeStatistics()


_state = _ThreadState()


def _check(arrays: tuple[Any, ...], held_by: DisposeScope | None = None) -> None:
    """Every argument is a rustws array (and, with ``held_by``, held by that scope)."""
    from .cuda import DeviceArray

    for a in arrays:
        if not isinstance(a, DeviceArray):
            raise TypeError(f"dispose scopes track rustws arrays (DeviceArray), got {type(a).__name__}")
        if held_by is not None and not held_by.contains(a):
            raise ValueError(f"{a!r} is not held by this dispose scope")


class DisposeScope:
    """``with rustws.dispose_scope() as scope:``; everything created inside is disposed at exit."""

    def __init__(self) -> None:
        self._arrays: dict[int, Any] = {}
        self._closed = False
        self._stats = _state.stats

    def __enter__(self) -> DisposeScope:
        if self._closed:
            raise RuntimeError("a closed dispose scope cannot be entered again")
        _state.chain.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Disposes what the scope still holds and unlinks it (wherever it is in the chain).
        Closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        chain = _state.chain
        if self in chain:
            chain.remove(self)
        self.dispose_everything()

    def _outer(self) -> DisposeScope | None:
        chain = _state.chain
        if self not in chain:
            return None
        i = chain.index(self)
        return chain[i - 1] if i > 0 else None

    def _take(self, a: Any) -> None:
        del self._arrays[id(a)]
        a._scope = None

    def _give(self, a: Any) -> None:
        self._arrays[id(a)] = a
        a._scope = self

    def move_to_outer(self, *arrays: Any) -> Any:
        """Hands ``arrays`` to the next scope outwards (or to none: then they are detached)."""
        _check(arrays, held_by=self)
        outer = self._outer()
        for a in arrays:
            self._take(a)
            if outer is not None:
                outer._give(a)
                self._stats.attached += 1
            else:
                self._stats.detached += 1
        return arrays[0] if len(arrays) == 1 else arrays

    def detach(self, *arrays: Any) -> Any:
        """Removes ``arrays`` from the scope: nobody disposes them but their owner."""
        _check(arrays, held_by=self)
        for a in arrays:
            self._take(a)
            self._stats.detached += 1
        return arrays[0] if len(arrays) == 1 else arrays

    def attach(self, *arrays: Any) -> Any:
        """Puts ``arrays`` (from another scope or none) into this scope."""
        _check(arrays)
        for a in arrays:
            if a.is_disposed:
                raise ValueError("cannot attach a disposed array")
            current = getattr(a, "_scope", None)
            if current is self:
                continue
            if current is not None:
                current._take(a)
            self._give(a)
            self._stats.attached += 1
        return arrays[0] if len(arrays) == 1 else arrays

    def dispose_everything(self) -> None:
        for a in list(self._arrays.values()):
            a.dispose()
        self._arrays.clear()

    def dispose_everything_but(self, *arrays: Any) -> None:
        """Disposes everything the scope holds except ``arrays``, which it keeps."""
        _check(arrays)
        keep = {id(a) for a in arrays}
        for key, a in list(self._arrays.items()):
            if key not in keep:
                a.dispose()

    def contains(self, a: Any) -> bool:
        return id(a) in self._arrays and self._arrays[id(a)] is a

    def __contains__(self, a: Any) -> bool:
        return self.contains(a)

    def __len__(self) -> int:
        return len(self._arrays)

    @property
    def is_closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<DisposeScope {state}, {len(self._arrays)} array(s)>"


def dispose_scope() -> DisposeScope:
    """A new dispose scope; enter it with ``with``."""
    return DisposeScope()


def dispose_statistics() -> DisposeStatistics:
    """This thread's counters (a live object: it keeps counting)."""
    return _state.stats


def _register(a: Any) -> None:
    """Called by every new rustws-owned array; the array calls ``_collected`` when it dies."""
    stats = _state.stats
    stats.live += 1
    chain = _state.chain
    a._scope = None
    a._stats = stats
    if chain:
        chain[-1]._give(a)
        stats.created_in_scope += 1
    else:
        stats.created_outside_scope += 1


def _collected(a: Any) -> None:
    """Called when an array that was never disposed dies."""
    stats = getattr(a, "_stats", None)
    if stats is not None and not a._disposed:
        stats.live -= 1


def _disposed(a: Any) -> None:
    """Called by an array's ``dispose()``, once (counted on the thread that created it)."""
    stats = a._stats
    a._disposed = True
    stats.live -= 1
    scope = a._scope
    if scope is not None:
        scope._arrays.pop(id(a), None)
        a._scope = None
        stats.disposed_in_scope += 1
    else:
        stats.disposed_outside_scope += 1
