"""What one empty cycle costs: ``with ws: pass`` against ``with contextlib.nullcontext(): pass``,
side by side in one process. The two are timed in alternation (so both see the same machine load),
and the ratio reported is the median of the per-round ratios.

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
    print(f"median of {rounds} alternating rounds of {number} cycles each")
    print(f"{'with contextlib.nullcontext(): pass':40s} {statistics.median(times['null']):8.1f} ns")
    for key in ("capture on", "capture off"):
        ratios = [t / n for t, n in zip(times[key], times["null"], strict=True)]
        print(
            f"{'with ws: pass (' + key + ')':40s} {statistics.median(times[key]):8.1f} ns"
            f"  ratio {statistics.median(ratios):.2f}x"
        )
    ws.destroy()
    off.destroy()


if __name__ == "__main__":
    main()
