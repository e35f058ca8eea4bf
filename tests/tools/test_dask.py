"""``rustws.dask.WorkspacePlugin`` on a real ``LocalCluster`` with worker processes: every worker
thread gets its workspace, each task (or each annotated task) is one cycle whose temporaries are
captured, and ``workspace_stats`` gathers every thread's statistics."""

from __future__ import annotations

import io

import numpy as np
import pytest

import rustws

distributed = pytest.importorskip(
    "distributed", reason="Dask's distributed is not installed (pip install 'rustws[dask]')"
)
dask = pytest.importorskip("dask", reason="Dask is not installed (pip install 'rustws[dask]')")
import rustws.dask  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def cluster(processes: bool) -> distributed.LocalCluster:
    """Two workers of two threads, in processes of their own or in this one."""
    return distributed.LocalCluster(
        n_workers=2,
        threads_per_worker=2,
        processes=processes,
        dashboard_address=":0",  # any free port: None still means 8787
        worker_dashboard_address=None,
    )


@pytest.fixture(scope="module")
def client():
    with cluster(processes=True) as workers, distributed.Client(workers) as c:
        yield c


def task(i: int) -> tuple[str, str | None, bool, float]:
    """Temporaries of 1 MiB; reports its thread, the current workspace and whether a temporary came
    from it."""
    import threading

    x = np.full(1 << 18, float(i), np.float32)
    y = np.tanh(x * 2.0 + 1.0)
    ws = rustws.current_workspace()
    name = None if ws is None else ws.name
    return threading.current_thread().name, name, rustws.owner(y) is ws, float(y[0])


def test_every_task_is_a_cycle_of_its_threads_workspace(client):
    cfg = rustws.WorkspaceConfiguration.adaptive()
    client.register_plugin(rustws.dask.WorkspacePlugin("TASK", cfg))
    try:
        results = client.gather(client.map(task, range(120), pure=False))
        assert all(name == "TASK" and captured for _, name, captured, _ in results)
        assert [r[3] for r in results] == [float(np.tanh(np.float32(i) * 2 + 1)) for i in range(120)]
        rows = rustws.dask.workspace_stats(client, "TASK")
        threads = {r[0] for r in results}
        assert {r["thread"] for r in rows} == threads and len(rows) <= 4
        assert {r["worker"] for r in rows} <= {"0", "1"}
        assert sum(r["cycles"] for r in rows) == 120  # one cycle per task
        for r in rows:
            assert r["peak_cycle_bytes"] >= 3 << 20  # the task's three temporaries
            assert r["spill_count"] <= 2  # learned within the first cycles
            assert r["rss_bytes"] > 0 and r["minor_faults"] > 0
        out = io.StringIO()
        rustws.dask.print_workspace_stats(client, file=out)
        table = out.getvalue()
        assert all(t in table for t in threads) and "peak/cycle" in table
    finally:
        client.unregister_worker_plugin("rustws-TASK")
    # Unregistered: the workers' own pools again, no cycles.
    assert all(name is None for _, name, _, _ in client.gather(client.map(task, range(8), pure=False)))


def test_workers_sharing_a_process_each_list_their_own_threads():
    with cluster(processes=False) as workers, distributed.Client(workers) as c:
        c.register_plugin(rustws.dask.WorkspacePlugin("SHARED"))
        results = c.gather(c.map(task, range(40), pure=False))
        assert all(name == "SHARED" and captured for _, name, captured, _ in results)
        rows = rustws.dask.workspace_stats(c, "SHARED")
        threads = [r["thread"] for r in rows]
        assert len(threads) == len(set(threads)), f"a thread listed twice: {rows}"
        assert set(threads) == {r[0] for r in results}
        assert sum(r["cycles"] for r in rows) == 40  # one cycle per task, each counted once


def test_only_annotated_tasks_run_in_cycles(client):
    client.register_plugin(rustws.dask.WorkspacePlugin("ANNOTATED", every_task=False))
    try:
        plain = client.gather(client.map(task, range(8), pure=False))
        with dask.annotate(executor=rustws.dask.EXECUTOR):
            annotated = client.gather(client.map(task, range(100, 108), pure=False))
        assert all(name is None for _, name, _, _ in plain)
        assert all(name == "ANNOTATED" and captured for _, name, captured, _ in annotated)
        assert sum(r["cycles"] for r in rustws.dask.workspace_stats(client, "ANNOTATED")) == 8
    finally:
        client.unregister_worker_plugin("rustws-ANNOTATED")


def test_the_decorator_under_dask(client):
    @rustws.cycle("DECORATED")
    def decorated(i: int) -> tuple[str, str | None, bool, float]:
        return task(i)

    results = client.gather(client.map(decorated, range(16), pure=False))
    assert all(name == "DECORATED" and captured for _, name, captured, _ in results)
    assert sum(r["cycles"] for r in rustws.dask.workspace_stats(client, "DECORATED")) == 16


def test_memory_report_gathers_every_workers_snapshot_and_recommendation(client, tmp_path):
    from rustws import memory

    try:
        cfg = rustws.WorkspaceConfiguration.adaptive()
        client.register_plugin(rustws.dask.WorkspacePlugin("RECORDED", cfg, record_history=True))
        try:
            client.gather(client.map(task, range(40), pure=False))
            rows = rustws.dask.memory_report(client, snapshots=tmp_path)
        finally:
            client.unregister_worker_plugin("rustws-RECORDED")
    finally:
        client.run(memory.record_history, False)
    mine = [r for r in rows if r["workspace"] == "RECORDED"]
    assert mine and {r["worker"] for r in mine} <= set(client.scheduler_info()["workers"])
    assert sum(r["cycles"] for r in mine) == 40  # one cycle per task, every one recorded
    assert len({(r["worker"], r["workspace_id"]) for r in mine}) == len(mine) <= 4, "a row per thread"
    for r in mine:
        assert r["recommended_spills"] == 0 and r["need_bytes"] >= 3 << 20
        assert r["configuration"].initial_size == r["need_bytes"]
    assert len(list(tmp_path.glob("*.pickle"))) == 2, "one snapshot per worker"
    table = rustws.dask.format_memory_report(rows)
    assert "RECORDED" in table and "-> footprint" in table


def test_plugin_arguments_are_checked():
    with pytest.raises(TypeError):
        rustws.dask.WorkspacePlugin(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="every_task"):
        rustws.dask.WorkspacePlugin("X", every_task="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="record_history"):
        rustws.dask.WorkspacePlugin("X", record_history=1)  # type: ignore[arg-type]
    assert rustws.dask.format_workspace_stats([]).endswith("(no worker thread has a workspace yet)")
    assert rustws.dask.format_memory_report([]).endswith("on the workers)")
