"""Dispose scopes (TorchSharp's technique 3) over ``DeviceArray``s and other rustws-owned arrays.

Each thread has a chain of open scopes. An array created while a scope is innermost is registered
with it, and disposed when the scope closes unless it was moved out (``move_to_outer``) or
detached. Scopes may close out of order: closing one unlinks it wherever it is in the chain.
Host NumPy arrays are not tracked here: workspace cycles govern them.

The chain and the counters live in the bindings, where a new ``DeviceArray`` registers itself
without running Python (it calls the innermost scope's ``_give`` only when there is one).
"""

from __future__ import annotations

from typing import Any

from . import _rustws

__all__ = ["DisposeScope", "DisposeStatistics", "dispose_scope", "dispose_statistics"]

DisposeStatistics = _rustws.DisposeStatistics


def _check(arrays: tuple[Any, ...], held_by: DisposeScope | None = None) -> None:
    """Every argument is a rustws array (and, with ``held_by``, held by that scope)."""
    for a in arrays:
        if not isinstance(a, _rustws.DeviceArray):
            raise TypeError(f"dispose scopes track rustws arrays (DeviceArray), got {type(a).__name__}")
        if held_by is not None and not held_by.contains(a):
            raise ValueError(f"{a!r} is not held by this dispose scope")


class DisposeScope:
    """``with rustws.dispose_scope() as scope:``; everything created inside is disposed at exit."""

    def __init__(self) -> None:
        self._arrays: dict[int, Any] = {}
        self._closed = False
        self._stats = _rustws.dispose_statistics()

    def __enter__(self) -> DisposeScope:
        if self._closed:
            raise RuntimeError("a closed dispose scope cannot be entered again")
        _rustws.dispose_push(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Disposes what the scope still holds and unlinks it (wherever it is in the chain).
        Closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        _rustws.dispose_remove(self)
        self.dispose_everything()

    def _outer(self) -> DisposeScope | None:
        chain = _rustws.dispose_chain()
        for i, scope in enumerate(chain):
            if scope is self:
                return chain[i - 1] if i > 0 else None
        return None

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
    return _rustws.dispose_statistics()
