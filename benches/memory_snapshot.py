"""A recorded loop, its snapshot and the plot in the README: a small training step (a two-layer
network on random data) whose batch doubles half-way, so that one cycle spills and the arena
grows, under a workspace of the adaptive profile; then the configuration recommended for it.

    python benches/memory_snapshot.py [--out benches/memory_timeline.png] [--pickle PATH]
"""

from __future__ import annotations

import argparse

import numpy as np

import rustws
from rustws import memory


def step(w1: np.ndarray, w2: np.ndarray, x: np.ndarray, y: np.ndarray, lr: float = 1e-6) -> float:
    h = np.maximum(x @ w1, 0.0)
    out = h @ w2
    err = out - y
    g2 = h.T @ err
    gh = (err @ w2.T) * (h > 0)
    g1 = x.T @ gh
    w1 -= lr * g1
    w2 -= lr * g2
    return float((err * err).mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="benches/memory_timeline.png")
    p.add_argument("--pickle", default=None, help="also dump the snapshot here")
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((256, 512)) * 0.05
    w2 = rng.standard_normal((512, 10)) * 0.05
    memory.record_history(True)
    ws = rustws.workspace("train")
    for i in range(args.steps):
        batch = 1024 if i < args.steps // 2 else 2048
        with ws:
            x = rng.standard_normal((batch, 256))
            y = rng.standard_normal((batch, 10))
            step(w1, w2, x, y)
    snap = memory.snapshot()
    if args.pickle:
        memory.dump_snapshot(args.pickle)
    memory.plot_timeline(snap, args.out)
    print(f"wrote {args.out}: {len(snap['device_traces'][snap['devices'].index('cpu')])} events")
    for c in snap["cycles"]:
        if c["spills"] or c["segment_bytes"]:
            sites = ", ".join(
                f"{f['name']}:{f['line']} {s['bytes'] >> 10} KiB"
                for s in c["sites"]
                if (f := memory.user_frame(s["frames"]))
            )
            print(
                f"cycle {c['cycle']}: {c['spills']} spills, mapped {c['segment_bytes'] >> 10} KiB"
                + (f"; spilled at {sites}" if sites else "")
            )
    print(memory.recommend(snap, workspace="train").table())


if __name__ == "__main__":
    main()
