"""What one empty cycle costs: ``with ws: pass`` against ``with contextlib.nullcontext(): pass``,
and a cycle boundary of the loop form (``for _ in ws.cycles(items): pass``, less the bare loop)
against a ``with nullcontext(): pass`` in a loop (less the bare loop), side by side in one process.
The cases are timed in alternation (so all see the same machine load), and each ratio reported is
the median of the per-round ratios.

Run: ``.venv/bin/python benches/scope_cost.py [rounds]``. It measures the scope machinery only
(entering and leaving a cycle, making the workspace NumPy's current allocator and restoring the
previous one); it says nothing about allocation speed.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import timeit

import rustws


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    number = 100_000
    ws = rustws.workspace("SCOPE-COST")
    off = rustws.workspace("SCOPE-COST-OFF", capture=False)
    null = contextlib.nullcontext()
    env: dict[str, object] = {"ws": ws, "off": off, "null": null}
    cases = {"null": "with null: pass", "capture on": "with ws: pass", "capture off": "with off: pass"}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for key, stmt in cases.items():
            times[key].append(timeit.timeit(stmt, globals=env, number=number) / number * 1e9)
    loops = {
        "bare": "for _ in items: pass",
        "null": "for _ in items:\n    with null: pass",
        "cycles": "for _ in ws.cycles(items): pass",
    }
    env["items"] = range(number)
    loop_times: dict[str, list[float]] = {k: [] for k in loops}
    for _ in range(rounds):
        for key, stmt in loops.items():
            loop_times[key].append(timeit.timeit(stmt, globals=env, number=1) / number * 1e9)
    print(f"median of {rounds} alternating rounds of {number} cycles each")
    print(f"{'with contextlib.nullcontext(): pass':40s} {statistics.median(times['null']):8.1f} ns")
    for key in ("capture on", "capture off"):
        ratios = [t / n for t, n in zip(times[key], times["null"], strict=True)]
        print(
            f"{'with ws: pass (' + key + ')':40s} {statistics.median(times[key]):8.1f} ns"
            f"  ratio {statistics.median(ratios):.2f}x"
        )
    bare = loop_times["bare"]
    boundary = [c - b for c, b in zip(loop_times["cycles"], bare, strict=True)]
    null_with = [n - b for n, b in zip(loop_times["null"], bare, strict=True)]
    print(f"{'loop form: one cycle boundary':40s} {statistics.median(boundary):8.1f} ns")
    print(f"{'a with nullcontext() in a loop':40s} {statistics.median(null_with):8.1f} ns")
    ratios = [c / n for c, n in zip(boundary, null_with, strict=True)]
    print(f"{'boundary / with nullcontext()':40s} {statistics.median(ratios):8.2f}x")
    ws.destroy()
    off.destroy()


if __name__ == "__main__":
    main()
