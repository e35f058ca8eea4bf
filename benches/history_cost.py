"""What recording a workspace's history costs per captured allocation: a cycle of small NumPy
temporaries (each allocated and freed through the workspace) timed with recording off, on
without stacks, and on with Python stacks, alternated in one process, medians of the rounds.

    python benches/history_cost.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import rustws
from rustws import memory

PER_CYCLE = 2000


def one_cycle(ws, x) -> float:
    t0 = time.perf_counter_ns()
    with ws:
        for _ in range(PER_CYCLE):
            y = x + 1.0  # one allocation and one free per step
            del y
    return (time.perf_counter_ns() - t0) / PER_CYCLE


def deep(n: int, f, *args):
    """Runs ``f`` ``n`` frames deeper: stacks as deep as a program's."""
    return f(*args) if n == 0 else deep(n - 1, f, *args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--depth", type=int, default=20, help="extra Python frames under the loop")
    args = p.parse_args()
    ws = rustws.workspace(
        "HISTORY", rustws.WorkspaceConfiguration(initial_size="4MiB", policy_learning="NONE")
    )
    x = np.ones(64)
    variants = {"off": None, "events": None, "events+stacks": "python"}
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for name, stacks in variants.items():
            memory.record_history(name != "off", max_entries=1 << 16, stacks=stacks)
            deep(args.depth, one_cycle, ws, x)  # warm
            times[name].append(deep(args.depth, one_cycle, ws, x))
            memory.record_history(False)
    base = statistics.median(times["off"])
    print(
        f"ns per step (one allocation + one free), median of {args.rounds} rounds, {args.depth} extra frames"
    )
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:<15} {m:8.0f} ns   +{m - base:6.0f} ns per allocation")


if __name__ == "__main__":
    main()
