"""W1 at 1 MiB in one process: the limit (preallocated out=), a capturing cycle per step, and all steps
in one cycle, interleaved 15 x 100 steps; prints median ratios. ``python benches/w1_interleaved.py``"""

import statistics
import time

import numpy as np

import rustws

n = (1 << 20) // 4
x = np.random.default_rng(0).random(n, dtype=np.float32)
w = np.full(n, 0.5, np.float32)
bufs = [np.empty(n, np.float32) for _ in range(3)]
ws = rustws.workspace("B")


def body(x, w):
    a = x * w
    b = a + 1
    return np.tanh(b)


def limit():
    np.multiply(x, w, out=bufs[0])
    np.add(bufs[0], 1, out=bufs[1])
    np.tanh(bufs[1], out=bufs[2])


def cycle_per_step():
    with ws:
        body(x, w)


def timed(f, steps=100):
    t = time.perf_counter()
    for _ in range(steps):
        f()
    return (time.perf_counter() - t) / steps


for f in (limit, cycle_per_step):
    f()
    f()
rl, rc, rw = [], [], []
for _ in range(15):
    rl.append(timed(limit))
    rc.append(timed(cycle_per_step))
    with ws:
        rw.append(timed(lambda: body(x, w)))
med = statistics.median
print(
    f"limit {med(rl) * 1e6:.0f} us, cycle per step {med(rc) * 1e6:.0f} us, one cycle {med(rw) * 1e6:.0f} us"
)
print(f"cycle per step / limit: {med([c / b for c, b in zip(rc, rl, strict=True)]):.3f}")
print(f"one cycle / limit:      {med([c / b for c, b in zip(rw, rl, strict=True)]):.3f}")
print(ws.stats())
