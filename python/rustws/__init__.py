"""rustws: workspaces for Python loops.

A workspace learns how much memory one cycle of a loop needs, then serves every later cycle from
one pre-faulted arena. Inside ``with rustws.workspace(...)`` every NumPy allocation of the thread
comes from the workspace (NEP 49 capture). Memory is never handed out again while an array still
references it.
"""

from __future__ import annotations

import importlib as _importlib
import os as _os
from typing import TYPE_CHECKING

from . import _rustws, cuda, cupy, torch
from ._config import (
    AllocationPolicy,
    ArrayType,
    DebugMode,
    LearningPolicy,
    LocationPolicy,
    MirroringPolicy,
    ResetPolicy,
    SpillPolicy,
    WorkspaceConfiguration,
    WorkspaceConfigurationBuilder,
    WorkspaceMode,
    WorkspaceStats,
)
from ._cycle import cycle, thread_statistics
from ._dispose import DisposeScope, DisposeStatistics, dispose_scope, dispose_statistics
from ._errors import (
    DeviceUnavailableError,
    DisposedArrayError,
    EscapedArrayWarning,
    LeakedArrayError,
    NoSuchWorkspaceError,
    ScopeError,
    WorkspaceClosedError,
    WorkspaceError,
    WorkspaceOutOfMemory,
)
from ._workspace import (
    Workspace,
    current_workspace,
    destroy_all_workspaces_for_current_thread,
    detach,
    get_and_activate_workspace,
    get_workspace,
    leverage_to,
    owner,
    print_allocation_statistics,
    scope_out_of_workspaces,
    workspace,
    workspaces,
)
from .cuda import DeviceArray, DeviceWorkspace

if TYPE_CHECKING:
    from . import memory
    from ._layers import LayerWorkspaceMgr, LayerWorkspaceMgrBuilder
    from ._pipeline import AsyncPrefetch, AsyncShield, gc_window, set_auto_gc_window, toggle_periodic_gc

# Parts a loop that only captures never uses are imported when first named (PEP 562): each
# costs the import's memory and time in every process otherwise (``memory`` reads the
# interpreter's configuration for its stack filter; the pipeline imports ``queue``).
_LAZY = {
    "memory": "",
    "AsyncPrefetch": "._pipeline",
    "AsyncShield": "._pipeline",
    "gc_window": "._pipeline",
    "set_auto_gc_window": "._pipeline",
    "toggle_periodic_gc": "._pipeline",
    "LayerWorkspaceMgr": "._layers",
    "LayerWorkspaceMgrBuilder": "._layers",
}


if not TYPE_CHECKING:  # checkers see the imports above, and flag a misspelt name

    def __getattr__(name: str) -> object:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        if module:
            value = getattr(_importlib.import_module(module, __name__), name)
        else:
            value = _importlib.import_module(f".{name}", __name__)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if _os.environ.get("RUSTWS_OOM_SNAPSHOT"):
    # Read by ``memory`` as it is imported: the snapshot is set up before any workspace refuses.
    from . import memory


__version__: str = _rustws.__version__

__all__ = [
    "AllocationPolicy",
    "ArrayType",
    "AsyncPrefetch",
    "AsyncShield",
    "DebugMode",
    "DeviceArray",
    "DeviceUnavailableError",
    "DeviceWorkspace",
    "DisposeScope",
    "DisposeStatistics",
    "DisposedArrayError",
    "EscapedArrayWarning",
    "LayerWorkspaceMgr",
    "LayerWorkspaceMgrBuilder",
    "LeakedArrayError",
    "LearningPolicy",
    "LocationPolicy",
    "MirroringPolicy",
    "NoSuchWorkspaceError",
    "ResetPolicy",
    "ScopeError",
    "SpillPolicy",
    "Workspace",
    "WorkspaceClosedError",
    "WorkspaceConfiguration",
    "WorkspaceConfigurationBuilder",
    "WorkspaceError",
    "WorkspaceMode",
    "WorkspaceOutOfMemory",
    "WorkspaceStats",
    "__version__",
    "cuda",
    "cupy",
    "current_workspace",
    "cycle",
    "destroy_all_workspaces_for_current_thread",
    "detach",
    "dispose_scope",
    "dispose_statistics",
    "gc_window",
    "get_and_activate_workspace",
    "get_workspace",
    "leverage_to",
    "memory",
    "owner",
    "print_allocation_statistics",
    "scope_out_of_workspaces",
    "set_auto_gc_window",
    "thread_statistics",
    "toggle_periodic_gc",
    "torch",
    "workspace",
    "workspaces",
]
