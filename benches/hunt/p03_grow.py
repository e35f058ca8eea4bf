"""A table grown one row at a time with np.vstack / np.concatenate; the table lives into the
next cycle; snapshots kept in a list, every other one dropped later."""

import numpy as np
from common import Hasher, Kept, check_zero, report, ws

W = ws("grow")
H, K = Hasher(), Kept()
rng = np.random.default_rng(3)
A = rng.standard_normal((16, 1024))  # 128 KiB, float64 rows of 8 KiB
v = rng.standard_normal(16_384)
snap = []
for step in range(700):
    with W:
        row = np.sin(A[-1] + step)[None, :]
        A = np.vstack([A, row])  # one row larger each cycle
        v = np.concatenate([v, A[-1, :37]])  # 1-D, 296 B larger each cycle
        col_means = A.mean(axis=0)
        centred = A - col_means
        g = centred.T @ centred[:, :8]
        z = np.zeros_like(A[:, :512])
        check_zero(z, f"p03 step={step}")
        if step % 10 == 0:
            H.add(g)
            H.add(v[-100:])
            H.add(col_means)
        if step % 50 == 0:
            K.keep(A, f"step={step}")
            snap.append(centred)
        if step % 200 == 199:
            K.drop_some()
            snap = snap[::2]
    if step % 25 == 0:
        K.check(f"step={step}")
H.add(A)
H.add(v)
for s in snap:
    H.add(s)
K.check("end")
report(H, K, wss=[W])
