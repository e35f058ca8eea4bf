"""DL4J's layer workspace manager: which workspace each kind of array (``ArrayType``) lives in.

A network asks the manager for activations, gradients and working memory by type; the manager maps
each type to a named workspace of the calling thread (or to none: ordinary memory), creates arrays
there, moves arrays between them, and checks that an array is where its type says it should be.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from ._config import ArrayType, WorkspaceConfiguration
from ._errors import WorkspaceError
from ._workspace import Workspace, _check_name, detach, owner, scope_out_of_workspaces, workspace

__all__ = ["LayerWorkspaceMgr", "LayerWorkspaceMgrBuilder"]

_Target = tuple[str, WorkspaceConfiguration] | None


def _check_type(t: Any) -> ArrayType:
    if isinstance(t, ArrayType):
        return t
    if isinstance(t, str):
        return ArrayType.coerce(t, "array_type")
    raise TypeError(f"array_type must be an ArrayType, got {type(t).__name__}")


def _check_target(name: Any, config: Any) -> tuple[str, WorkspaceConfiguration]:
    _check_name(name)
    if config is None:
        config = WorkspaceConfiguration()
    if not isinstance(config, WorkspaceConfiguration):
        raise TypeError(f"config must be a WorkspaceConfiguration, got {type(config).__name__}")
    return name, config


class LayerWorkspaceMgrBuilder:
    """``LayerWorkspaceMgr.builder().with_(t, name, config).no_workspace_for(t).default_workspace(
    name, config).default_no_workspace().build()``"""

    def __init__(self) -> None:
        self._targets: dict[ArrayType, _Target] = {}
        self._default: _Target = None
        self._has_default = False

    def with_(
        self, array_type: Any, name: str, config: WorkspaceConfiguration | None = None
    ) -> LayerWorkspaceMgrBuilder:
        self._targets[_check_type(array_type)] = _check_target(name, config)
        return self

    def no_workspace_for(self, array_type: Any) -> LayerWorkspaceMgrBuilder:
        self._targets[_check_type(array_type)] = None
        return self

    def default_workspace(
        self, name: str, config: WorkspaceConfiguration | None = None
    ) -> LayerWorkspaceMgrBuilder:
        self._default, self._has_default = _check_target(name, config), True
        return self

    def default_no_workspace(self) -> LayerWorkspaceMgrBuilder:
        self._default, self._has_default = None, True
        return self

    def build(self) -> LayerWorkspaceMgr:
        missing = [t.name for t in ArrayType if t not in self._targets]
        if missing and not self._has_default:
            raise ValueError(
                f"no workspace (or no_workspace_for) given for {', '.join(missing)}; "
                "set them, or call default_workspace(...) or default_no_workspace()"
            )
        targets = {t: self._targets.get(t, self._default) for t in ArrayType}
        return LayerWorkspaceMgr(targets)


class LayerWorkspaceMgr:
    """Maps each ``ArrayType`` to a workspace (or to none) and allocates arrays by type."""

    def __init__(self, targets: dict[ArrayType, _Target]) -> None:
        self._targets = dict(targets)
        self._helpers: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()
        self._live: dict[ArrayType, int] = dict.fromkeys(ArrayType, 0)
        self._peak: dict[ArrayType, int] = dict.fromkeys(ArrayType, 0)

    @staticmethod
    def builder() -> LayerWorkspaceMgrBuilder:
        return LayerWorkspaceMgrBuilder()

    @staticmethod
    def no_workspaces() -> LayerWorkspaceMgr:
        """A manager that keeps every type in ordinary memory."""
        return LayerWorkspaceMgr(dict.fromkeys(ArrayType))

    @staticmethod
    def for_mode(
        mode: Any, config: WorkspaceConfiguration | None = None, prefix: str = "LAYER"
    ) -> LayerWorkspaceMgr:
        """DL4J's ``WorkspaceMode``: ENABLED gives every ArrayType but INPUT a workspace of its own
        (``<prefix>_<TYPE>``, all with ``config``); NONE gives ``no_workspaces()``."""
        from ._config import WorkspaceMode

        mode = WorkspaceMode.coerce(mode, "mode")
        if mode is WorkspaceMode.NONE:
            return LayerWorkspaceMgr.no_workspaces()
        b = LayerWorkspaceMgr.builder().no_workspace_for(ArrayType.INPUT)
        for t in ArrayType:
            if t is not ArrayType.INPUT:
                b = b.with_(t, f"{prefix}_{t.name}", config)
        return b.build()

    def __repr__(self) -> str:
        parts = [f"{t.name}={(tgt[0] if tgt else None)!r}" for t, tgt in self._targets.items()]
        return f"LayerWorkspaceMgr({', '.join(parts)})"

    # -- lookups ---------------------------------------------------------------------------------
    def workspace_name(self, array_type: Any) -> str | None:
        """The workspace name for ``array_type`` (None: ordinary memory)."""
        tgt = self._targets[_check_type(array_type)]
        return tgt[0] if tgt else None

    def is_scoped_out(self, array_type: Any) -> bool:
        return self._targets[_check_type(array_type)] is None

    def workspace_for(self, array_type: Any) -> Workspace | None:
        """This thread's workspace for ``array_type``, created on first use (None: no workspace)."""
        tgt = self._targets[_check_type(array_type)]
        return None if tgt is None else workspace(tgt[0], tgt[1])

    def _open_workspace(self, t: ArrayType, operation: str) -> Workspace | None:
        ws = self.workspace_for(t)
        if ws is not None and not ws.is_open:
            raise WorkspaceError(
                f"{operation} for {t.name}: its workspace {ws.name!r} is not open; "
                f"enter it first (with mgr.notify_scope_entered(ArrayType.{t.name}))"
            )
        return ws

    def _track(self, t: ArrayType, a: np.ndarray) -> np.ndarray:
        n = a.nbytes
        with self._lock:
            self._live[t] += n
            self._peak[t] = max(self._peak[t], self._live[t])
        weakref.finalize(a, self._untrack, t, n)
        return a

    def _untrack(self, t: ArrayType, n: int) -> None:
        with self._lock:
            self._live[t] -= n

    # -- allocation -----------------------------------------------------------------------------
    def create(self, array_type: Any, shape: Any, dtype: Any = float, order: str = "C") -> np.ndarray:
        """An uninitialised array in ``array_type``'s workspace (ordinary memory when it has none)."""
        t = _check_type(array_type)
        ws = self._open_workspace(t, "create")
        if ws is None:
            with scope_out_of_workspaces():
                return self._track(t, np.empty(shape, dtype, order))
        return self._track(t, ws.empty(shape, dtype, order))

    def zeros(self, array_type: Any, shape: Any, dtype: Any = float, order: str = "C") -> np.ndarray:
        t = _check_type(array_type)
        ws = self._open_workspace(t, "zeros")
        if ws is None:
            with scope_out_of_workspaces():
                return self._track(t, np.zeros(shape, dtype, order))
        return self._track(t, ws.zeros(shape, dtype, order))

    def dup(self, array_type: Any, a: Any) -> np.ndarray:
        """A copy of ``a`` in ``array_type``'s workspace."""
        t = _check_type(array_type)
        src = np.asanyarray(a)  # subclasses are kept, as by np.copy(subok=True)
        ws = self._open_workspace(t, "dup")
        if ws is None:
            return self._track(t, detach(src))
        return self._track(t, ws._copy_of(src))

    def leverage_to(self, array_type: Any, a: Any) -> np.ndarray:
        """``a`` in ``array_type``'s workspace: itself when already there, else a copy (a detached
        copy when the type has no workspace)."""
        t = _check_type(array_type)
        arr = np.asanyarray(a)
        ws = self._open_workspace(t, "leverage_to")
        if ws is None:
            return arr if owner(arr) is None else self._track(t, detach(arr))
        if owner(arr) is ws:
            return arr
        return self.dup(t, arr)

    def validate_array_location(
        self,
        array_type: Any,
        a: Any,
        *,
        migrate_if_invalid: bool = False,
        exception_if_detached: bool = False,
    ) -> np.ndarray:
        """Returns ``a`` when it lives where ``array_type`` says (or migrated there when asked);
        raises a ``WorkspaceError`` naming the expected and the actual workspace otherwise."""
        t = _check_type(array_type)
        arr = np.asanyarray(a)
        expected = self.workspace_name(t)
        actual = owner(arr)
        actual_name = None if actual is None else actual.name
        if actual_name == expected:
            return arr
        if actual is None:
            if exception_if_detached:
                raise WorkspaceError(
                    f"array of type {t.name} is detached (ordinary memory); expected workspace {expected!r}"
                )
            return arr
        if migrate_if_invalid:
            return self.leverage_to(t, arr)
        want = "no workspace (ordinary memory)" if expected is None else f"workspace {expected!r}"
        raise WorkspaceError(f"array of type {t.name} is in workspace {actual_name!r}; expected {want}")

    # -- scopes ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def notify_scope_entered(self, array_type: Any) -> Iterator[Workspace | None]:
        """One cycle of ``array_type``'s workspace (or, with none, a scope out of workspaces)."""
        ws = self.workspace_for(_check_type(array_type))
        if ws is None:
            with scope_out_of_workspaces():
                yield None
        else:
            with ws:
                yield ws

    @contextlib.contextmanager
    def notify_scope_borrowed(self, array_type: Any) -> Iterator[Workspace | None]:
        """``array_type``'s workspace made current without a new cycle."""
        ws = self.workspace_for(_check_type(array_type))
        if ws is None:
            with scope_out_of_workspaces():
                yield None
        else:
            with ws.borrow():
                yield ws

    # -- helper workspace -----------------------------------------------------------------------
    def set_helper_workspace(self, key: str, a: Any) -> None:
        """Registers one shared scratch buffer under ``key`` (None removes it)."""
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        if a is None:
            self._helpers.pop(key, None)
        else:
            self._helpers[key] = np.asarray(a)

    def get_helper_workspace(self, key: str) -> np.ndarray | None:
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        return self._helpers.get(key)

    # -- statistics -----------------------------------------------------------------------------
    def stats(self) -> dict[ArrayType, int]:
        """Live bytes per ArrayType of the arrays this manager made. Gradient memory is
        ``ACTIVATION_GRAD + UPDATER_WORKING_MEM``."""
        with self._lock:
            return dict(self._live)

    def peak_stats(self) -> dict[ArrayType, int]:
        """Peak live bytes per ArrayType since the manager was made."""
        with self._lock:
            return dict(self._peak)
