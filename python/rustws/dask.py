"""Dask integration: ``client.register_plugin(rustws.dask.WorkspacePlugin(name, config))`` gives every
worker thread its own workspace and runs each task on it as one cycle, as dask-cuda's
``LocalCUDACluster(rmm_pool_size=...)`` gives every worker its RMM pool.

The plugin wraps the worker's thread pool: each task submitted to it opens a cycle of the executing
thread's workspace ``name`` around the task, so the temporaries of every task come from that
thread's arena, which after its first tasks serves them without a page fault. With
``every_task=False`` only tasks annotated ``dask.annotate(executor="rustws")`` run in cycles (Dask's
own way of sending a task to a named executor of the worker); the others run as before.

``workspace_stats(client)`` gathers the statistics of every worker thread's workspace into one
table (``print_workspace_stats`` prints it): workspaces belong to the threads that made them, so
``client.run(rustws.workspaces)``, which runs on each worker's event loop, sees none of them.

Dask (``distributed``) is an optional dependency: ``pip install 'rustws[dask]'``. Importing this
module imports ``distributed``.
"""

from __future__ import annotations

import contextvars
import os
import pickle
import resource
import sys
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TextIO

try:
    import distributed
except ImportError as e:  # pragma: no cover - exercised where dask is missing
    raise ImportError(
        "rustws.dask needs Dask's distributed, which is not installed (pip install 'rustws[dask]')"
    ) from e

from ._config import WorkspaceConfiguration
from ._cycle import _ThreadWorkspace, thread_statistics
from ._workspace import Workspace, _check_config, _check_name, _fmt_bytes

__all__ = [
    "EXECUTOR",
    "WorkspacePlugin",
    "format_memory_report",
    "format_workspace_stats",
    "memory_report",
    "print_workspace_stats",
    "workspace_stats",
]

EXECUTOR = "rustws"
"""The executor name that ``dask.annotate(executor=...)`` gives to send a task into a cycle."""


def _task_context(fn: Callable[..., Any]) -> contextvars.Context | None:
    """The context a submitted callable runs its task in, if it carries one. Distributed runs each
    task through ``lambda: context.run(task, ...)`` with a copy of its event loop's context, and
    NumPy's allocator is a context variable: the cycle's scope must be opened in that context
    for the task's allocations to be captured."""
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, contextvars.Context):
            return value
    return None


def _in_cycle(ws: Workspace, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    ctx = _task_context(fn)
    if ctx is None:
        with ws:
            return fn(*args, **kwargs)
    ctx.run(ws.__enter__)
    try:
        result = fn(*args, **kwargs)
    except BaseException as e:
        if not ctx.run(ws.__exit__, type(e), e, e.__traceback__):
            raise
        return None
    ctx.run(ws.__exit__, None, None, None)
    return result


class _CycleThreadPoolExecutor(Executor):
    """A worker's thread pool whose every submitted call is one cycle of the executing thread's
    workspace. (Its name says ThreadPoolExecutor: that is how a worker recognises a pool of
    threads, whose tasks it runs with their context and thread bookkeeping.)"""

    def __init__(self, inner: Executor, target: _ThreadWorkspace) -> None:
        self.inner = inner
        self._target = target

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        target = self._target

        def run() -> Any:
            return _in_cycle(target.get(), fn, args, kwargs)

        return self.inner.submit(run)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.inner.shutdown(wait=wait, cancel_futures=cancel_futures)

    def __getattr__(self, name: str) -> Any:  # _max_workers, _threads ... of the wrapped pool
        return getattr(self.inner, name)


class WorkspacePlugin(distributed.WorkerPlugin):
    """Every worker thread gets its workspace ``name`` (made with ``config``; the adaptive profile
    when None), and each task one cycle of it: all tasks, or with ``every_task=False`` those
    annotated ``dask.annotate(executor="rustws")``.

    ``client.register_plugin(rustws.dask.WorkspacePlugin("TASK", cfg))``; workers that join later get
    it too. Unregistering it (or closing the worker) restores the worker's own pool. With
    ``record_history=True`` each worker records its workspaces' history from the start
    (``rustws.memory.record_history()``), for ``memory_report``."""

    idempotent = True

    def __init__(
        self,
        name: str = "DEFAULT",
        config: WorkspaceConfiguration | None = None,
        *,
        every_task: bool = True,
        record_history: bool = False,
    ) -> None:
        self.workspace_name = _check_name(name)
        self.config = _check_config(config)
        for flag, value in (("every_task", every_task), ("record_history", record_history)):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be a bool, got {type(value).__name__}")
        self.every_task = every_task
        self.record_history = record_history
        self.name = f"rustws-{self.workspace_name}"
        self._original: dict[str, Executor] = {}

    def setup(self, worker: distributed.Worker) -> None:
        if self.record_history:
            from . import memory

            memory.record_history(True)
        default = worker.executors["default"]
        if isinstance(default, _CycleThreadPoolExecutor):
            return
        wrapped = _CycleThreadPoolExecutor(default, _ThreadWorkspace(self.workspace_name, self.config))
        self._original = {"default": default}
        worker.executors[EXECUTOR] = wrapped
        if self.every_task:
            worker.executors["default"] = wrapped

    def teardown(self, worker: distributed.Worker) -> None:
        if worker.executors.get(EXECUTOR) is not None:
            del worker.executors[EXECUTOR]
        if "default" in self._original:
            worker.executors["default"] = self._original.pop("default")


def _worker_rows(dask_worker: distributed.Worker) -> list[dict[str, Any]]:
    """This worker's rows: one per thread workspace, with the process's resident set."""
    rss = hwm = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    worker = str(dask_worker.name)
    # The process's workspaces, of this worker's threads: workers sharing a process (a cluster of
    # threads) each list their own.
    threads = _worker_threads(dask_worker)
    return [
        {"worker": worker, **row, "rss_bytes": rss, "peak_rss_bytes": hwm, "minor_faults": faults}
        for row in thread_statistics()
        if threads is None or row["thread"] in threads
    ]


def _worker_threads(dask_worker: distributed.Worker) -> set[str] | None:
    """The names of the threads of the worker's executors (None where one does not list them)."""
    names: set[str] = set()
    for executor in list(dask_worker.executors.values()):
        threads = getattr(executor, "_threads", None)
        if threads is None:
            return None
        names.update(t.name for t in list(threads))
    return names


def workspace_stats(client: distributed.Client, name: str | None = None) -> list[dict[str, Any]]:
    """One row per worker thread workspace on the cluster (``worker``, ``thread``, ``workspace``,
    the fields of ``WorkspaceStats``, and the worker process's ``rss_bytes``, ``peak_rss_bytes``
    and ``minor_faults``), sorted by worker and thread; ``name`` selects one workspace name."""
    per_worker = client.run(_worker_rows)
    rows = [row for rows in per_worker.values() for row in rows]
    if name is not None:
        rows = [r for r in rows if r["workspace"] == name]
    return sorted(rows, key=lambda r: (r["worker"], r["workspace"], r["thread"]))


def format_workspace_stats(rows: list[dict[str, Any]]) -> str:
    """The rows of ``workspace_stats`` as a text table."""
    cols = ("worker", "thread", "workspace", "cycles", "capacity", "peak/cycle", "pinned", "spills", "RSS")
    lines = []
    for r in rows:
        lines.append(
            (
                r["worker"],
                r["thread"],
                r["workspace"],
                str(r["cycles"]),
                _fmt_bytes(r["capacity_bytes"]),
                _fmt_bytes(r["peak_cycle_bytes"]),
                _fmt_bytes(r["pinned_bytes"]),
                str(r["spill_count"]),
                _fmt_bytes(r["rss_bytes"]),
            )
        )
    return _table(cols, lines, "(no worker thread has a workspace yet)")


def _table(cols: tuple[str, ...], lines: list[tuple[str, ...]], empty: str) -> str:
    """Columns padded to their widest cell, under a header and a rule; ``empty`` without rows."""
    widths = [max([len(c)] + [len(v[i]) for v in lines]) for i, c in enumerate(cols)]
    out = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)) for line in lines]
    if not lines:
        out.append(empty)
    return "\n".join(out)


def _worker_memory() -> dict[str, Any]:
    from . import memory

    return memory.snapshot()


def memory_report(
    client: distributed.Client, *, snapshots: str | os.PathLike[str] | None = None
) -> list[dict[str, Any]]:
    """Gathers every worker's memory snapshot (``rustws.memory.snapshot()``; start recording on
    the workers first, for example with ``client.run(rustws.memory.record_history)``) and the
    configuration recommended for each workspace that recorded cycles: one row per worker and
    workspace (``worker``, ``workspace``, ``workspace_id``: one per worker thread, ``cycles``,
    ``need_bytes``, ``recorded`` and
    ``recommended`` spills and footprints, ``configuration``). ``snapshots``: a folder where
    each worker's snapshot is also written, as ``<worker>.pickle`` for the memory_viz page."""
    from . import memory

    per_worker = client.run(_worker_memory)
    if snapshots is not None:
        os.makedirs(snapshots, exist_ok=True)
    rows = []
    for address, snap in sorted(per_worker.items()):
        worker = address.replace("/", "_").replace(":", "_")
        if snapshots is not None:
            with open(os.path.join(os.fspath(snapshots), f"{worker}.pickle"), "wb") as f:
                pickle.dump(snap, f)
        for wid, name in memory.recorded_workspaces(snap):
            r = memory.recommend(snap, workspace=wid)
            rows.append(
                {
                    "worker": address,
                    "workspace": name,
                    "workspace_id": wid,
                    "cycles": r.recorded.cycles,
                    "need_bytes": r.need_bytes,
                    "recorded_spills": r.recorded.spills,
                    "recorded_footprint_bytes": r.recorded.footprint_bytes,
                    "recommended_spills": r.outcome.spills,
                    "recommended_footprint_bytes": r.outcome.footprint_bytes,
                    "configuration": r.configuration,
                }
            )
    return rows


def format_memory_report(rows: list[dict[str, Any]]) -> str:
    """The rows of ``memory_report`` as a text table."""
    cols = (
        "worker",
        "workspace",
        "cycles",
        "need",
        "spills",
        "footprint",
        "-> spills",
        "-> footprint",
        "initial_size",
    )
    lines = [
        (
            r["worker"],
            r["workspace"],
            str(r["cycles"]),
            _fmt_bytes(r["need_bytes"]),
            str(r["recorded_spills"]),
            _fmt_bytes(r["recorded_footprint_bytes"]),
            str(r["recommended_spills"]),
            _fmt_bytes(r["recommended_footprint_bytes"]),
            _fmt_bytes(r["configuration"].initial_size),
        )
        for r in rows
    ]
    return _table(
        cols, lines, "(no worker recorded a cycle: start rustws.memory.record_history on the workers)"
    )


def print_workspace_stats(
    client: distributed.Client, name: str | None = None, file: TextIO | None = None
) -> None:
    """Prints ``workspace_stats(client, name)`` as one table."""
    table = format_workspace_stats(workspace_stats(client, name))
    print(table, file=file if file is not None else sys.stdout)
