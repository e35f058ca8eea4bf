"""A distributed workload of tasks with internal temporaries, on a ``LocalCluster`` with worker
processes, run plainly and with ``rustws.dask.WorkspacePlugin``: time per task (measured inside the
task), minor page faults per task and resident set per worker.

Each task makes four float32 arrays of ``--mib`` MiB (``x = np.full(...)``, then ``a = x * w;
b = a + 1; np.tanh(b)``) and returns one float, as a map over chunks does. Each variant runs on a
fresh cluster; the variants alternate for ``--repeats`` rounds and the medians are reported.

Run: ``pip install '.[dask]' && python benches/dask_tasks.py [--tasks 400] [--mib 4] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from typing import Any

import numpy as np


def task(i: int, n: int) -> tuple[float, float]:
    """The task: its own time, and a result that depends on every element."""
    t0 = time.perf_counter()
    x = np.full(n, 1.0 + i % 7, np.float32)
    w = np.float32(0.5)
    a = x * w
    b = a + 1
    c = np.tanh(b)
    return time.perf_counter() - t0, float(c[:: n // 64].sum())


def _worker_memory() -> dict[str, int]:
    out = {"minflt": resource.getrusage(resource.RUSAGE_SELF).ru_minflt}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def run(variant: str, tasks: int, mib: int, workers: int) -> dict[str, Any]:
    from distributed import Client, LocalCluster

    import rustws.dask

    n = (mib << 20) // 4
    with (
        LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            worker_dashboard_address=None,
        ) as cluster,
        Client(cluster) as client,
    ):
        if variant == "plugin":
            client.register_plugin(rustws.dask.WorkspacePlugin("TASK"))
        client.gather(client.map(task, range(2 * workers), [n] * (2 * workers), pure=False))  # warm-up
        before = client.run(_worker_memory)
        t0 = time.perf_counter()
        results = client.gather(client.map(task, range(tasks), [n] * tasks, pure=False))
        wall = time.perf_counter() - t0
        after = client.run(_worker_memory)
        stats = rustws.dask.workspace_stats(client) if variant == "plugin" else []
    faults = sum(after[w]["minflt"] - before[w]["minflt"] for w in after)
    return {
        "task_s": statistics.median(t for t, _ in results),
        "wall_s": wall,
        "faults_per_task": faults / tasks,
        "rss_mib": statistics.mean(a["VmRSS"] for a in after.values()) / 2**20,
        "peak_rss_mib": max(a["VmHWM"] for a in after.values()) / 2**20,
        "check": sum(v for _, v in results),
        "spills": sum(r["spill_count"] for r in stats),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=400)
    p.add_argument("--mib", type=int, default=4, help="MiB per temporary")
    p.add_argument("--workers", type=int, default=2, help="worker processes, one thread each")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "plugin": []}
    for r in range(args.repeats):
        for variant in runs:
            runs[variant].append(run(variant, args.tasks, args.mib, args.workers))
            print(f"round {r + 1}/{args.repeats} {variant}: done", flush=True)
    med = {v: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for v, rs in runs.items()}
    assert med["plain"]["check"] == med["plugin"]["check"], "the two variants computed different results"
    print(
        f"\n{args.tasks} tasks of 4 float32 arrays of {args.mib} MiB on {args.workers} worker processes "
        f"x 1 thread, median of {args.repeats} fresh clusters per variant"
    )
    print(
        f"{'variant':8}{'task':>11}{'wall':>10}{'faults/task':>13}{'RSS/worker':>12}{'peak RSS':>10}"
        f"{'spills':>8}"
    )
    for v, m in med.items():
        print(
            f"{v:8}{m['task_s'] * 1e3:>8.2f} ms{m['wall_s']:>8.2f} s{m['faults_per_task']:>13.1f}"
            f"{m['rss_mib']:>8.1f} MiB{m['peak_rss_mib']:>6.1f} MiB{m['spills']:>8.0f}"
        )
    ratio = med["plugin"]["task_s"] / med["plain"]["task_s"]
    word = "faster" if ratio < 1 else "slower"
    print(f"plugin / plain time per task = {ratio:.2f} ({'plugin ' + word})")


if __name__ == "__main__":
    main()
