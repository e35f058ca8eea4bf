"""Time-series features: np.diff(prepend=...), standardise, cumsum; `with ws:` per step.
Lengths n, n+1, n+2 in turn; every 5th cumsum kept (some dropped later)."""

import numpy as np
from common import Hasher, Kept, check_zero, report, ws

W = ws("ts")
H, K = Hasher(), Kept()
rng = np.random.default_rng(1)
for N in (40_000, 300_000, 2_100_000):  # 312 KiB, 2.3 MiB, 16 MiB of float64
    base = rng.standard_normal(N + 8)
    for step in range(45):
        with W:
            n = N + (step % 3)
            x = base[:n] * (1.0 + step * 1e-3)
            d = np.diff(x, prepend=x[0])  # n+1 copy, then n result
            d2 = np.diff(x, n=2, prepend=[0.0, 0.0])
            z = (d - d.mean()) / d.std()
            s = np.cumsum(z)
            ret = np.diff(np.log(np.abs(x) + 1.0), prepend=0.0, append=0.0)
            f32 = s.astype(np.float32)
            z0 = np.zeros(n + 1)
            check_zero(z0, f"p01 N={N} step={step}")
            z0[::7] = s[0]
            H.add(s)
            H.add(d2)
            H.add(ret)
            H.add(f32)
            H.add(z0)
            if step % 5 == 0:
                K.keep(s, f"N={N} step={step}")
        if step % 9 == 0:
            K.check(f"N={N} step={step}")
    K.drop_some()
K.check("end")
report(H, K, wss=[W])
