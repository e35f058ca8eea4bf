"""Each call one cycle: the ``@rustws.cycle`` decorator, for Ray tasks, process and thread pools and any
callable, and the process-wide list of workspaces that such entry points made on their threads
(``thread_statistics``), which is how statistics of executor threads are gathered.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar, overload

from ._config import WorkspaceConfiguration
from ._workspace import Workspace, _check_config, _check_name, workspace

__all__ = ["cycle", "thread_statistics"]

P = ParamSpec("P")
R = TypeVar("R")

# Workspaces made by the decorator and the Dask plugin, with the name of their thread: workspaces
# belong to the thread that made them, so these entry points record theirs for statistics read
# from elsewhere (``rustws.dask.workspace_stats`` runs on the event loop of each worker).
_SEEN_LOCK = threading.Lock()
_SEEN: dict[int, tuple[str, weakref.ref[Workspace]]] = {}


def _note(ws: Workspace) -> None:
    with _SEEN_LOCK:
        _SEEN[id(ws)] = (threading.current_thread().name, weakref.ref(ws))


def thread_statistics() -> list[dict[str, Any]]:
    """One row per live workspace that ``@rustws.cycle`` or ``rustws.dask.WorkspacePlugin`` made in
    this process, whatever its thread: ``thread``, ``workspace`` and the fields of ``WorkspaceStats``."""
    rows = []
    with _SEEN_LOCK:
        seen = list(_SEEN.items())
    for key, (thread, ref) in seen:
        ws = ref()
        if ws is None or ws.is_destroyed:
            with _SEEN_LOCK:
                _SEEN.pop(key, None)
            continue
        rows.append({"thread": thread, "workspace": ws.name, **ws.stats().as_dict()})
    return sorted(rows, key=lambda r: (r["workspace"], r["thread"]))


class _ThreadWorkspace:
    """The calling thread's workspace ``name``, looked up once per thread and again only when it
    was destroyed or replaced."""

    def __init__(self, name: str, config: WorkspaceConfiguration | None) -> None:
        self.name, self.config = name, config
        self._local = threading.local()

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled with the function it serves (cloudpickle sends closures by value): the
        # workspace is the receiving thread's own.
        return (_ThreadWorkspace, (self.name, self.config))

    def get(self) -> Workspace:
        ws: Workspace | None = getattr(self._local, "ws", None)
        if ws is None or ws.is_destroyed:
            ws = self._local.ws = workspace(self.name, self.config)
            _note(ws)
        return ws


@overload
def cycle(name: Callable[P, R], /) -> Callable[P, R]: ...
@overload
def cycle(
    name: str = "DEFAULT", config: WorkspaceConfiguration | None = None
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...
def cycle(name: Any = "DEFAULT", config: Any = None) -> Any:
    """``@rustws.cycle(name="DEFAULT", config=None)``: each call of the decorated function is one
    cycle of the calling thread's workspace ``name`` (made with ``config`` on the thread's first
    call). Its temporaries come from the workspace (capture), which after the first calls serves
    every call without a page fault; what the function returns outlives the cycle safely (pinned
    until it dies). ``@rustws.cycle`` without arguments uses the ``"DEFAULT"`` workspace.

    Works for plain functions and ``async def`` (each awaited call is one cycle of its task);
    decorated module-level functions pickle by name, so process pools and Ray take them.
    """
    if callable(name) and not isinstance(name, str):
        return cycle()(name)
    ws_name = _check_name(name)
    cfg = _check_config(config)

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        if not callable(fn):
            raise TypeError(f"rustws.cycle decorates a callable, got {type(fn).__name__}")
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise TypeError(
                f"rustws.cycle cannot decorate the generator function {fn.__qualname__}: its body "
                "runs after the call returns; open the cycles inside its loop instead"
            )
        target = _ThreadWorkspace(ws_name, cfg)
        if inspect.iscoroutinefunction(fn):
            coro_fn: Callable[..., Coroutine[Any, Any, Any]] = fn

            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                with target.get():
                    return await coro_fn(*args, **kwargs)

            run_async.workspace_name = ws_name  # type: ignore[attr-defined]
            return run_async  # type: ignore[return-value]

        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            with target.get():
                return fn(*args, **kwargs)

        run.workspace_name = ws_name  # type: ignore[attr-defined]
        return run

    return decorate
