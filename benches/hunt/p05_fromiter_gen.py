"""A generator pipeline: each cycle a generator yields records, np.fromiter of unknown length
(NumPy grows its buffer by realloc) and a filtered fromiter; a generator that itself runs the
loop form and yields arrays to the consumer, which keeps some of them."""

import numpy as np
from common import Hasher, Kept, check_zero, report, ws

H, K = Hasher(), Kept()
rng = np.random.default_rng(5)
data = rng.standard_normal(120_000)


def batches(W, sizes):
    for n in W.cycles(sizes):
        a = np.fromiter((v * 2.0 for v in data[:n]), dtype=np.float64)  # unknown length
        b = np.fromiter((v for v in data[:n] if v > -0.3), dtype=np.float32)  # filtered
        c = np.fromiter(iter(range(n + 1)), dtype=np.int64)
        z = np.zeros(n + 1)
        check_zero(z, f"p05 n={n}")
        yield a, b, c, np.sort(a) - np.cumsum(z[:n])


W = ws("gen")
sizes = [16_385 + (i % 5) * 3000 for i in range(12)] + [100_000 + (i % 3) for i in range(6)]
held = None
for j, (a, b, c, s) in enumerate(batches(W, sizes)):
    H.add(a)
    H.add(b)
    H.add(c)
    H.add(s)
    m = np.median(s)
    if j % 3 == 0:
        K.keep(b, f"j={j}")
    held = a if j % 2 else held  # lives into later cycles
    K.check(f"j={j}")
H.add(held)
# a second generator abandoned halfway (closed by del) and a third run to the end
g = batches(W, sizes[:8])
for _, t in zip(range(3), g, strict=False):
    H.add(t[3])
del g
for t in batches(W, sizes[8:]):
    H.add(t[0])
K.drop_some()
K.check("end")
report(H, K, wss=[W])
