"""Event data: boolean masks, np.unique with counts and inverse, argsort, bincount,
searchsorted; `with ws:` per batch, results kept in a dict, some dropped."""

import numpy as np
from common import Hasher, Kept, check_zero, report, ws

W = ws("ev")
H, K = Hasher(), Kept()
rng = np.random.default_rng(6)
results = {}
for step in range(80):
    n = (200_000, 200_001, 1_500_000, 1_499_999)[step % 4]
    ids = rng.integers(0, n // 3, n)
    vals = rng.standard_normal(n)
    with W:
        mask = vals > (step % 7 - 3) * 0.05
        sel = vals[mask]
        sid = ids[mask]
        u, inv, cnt = np.unique(sid, return_inverse=True, return_counts=True)
        sums = np.bincount(inv, weights=sel)
        order = np.argsort(sel, kind="stable")
        top = sel[order[-1000:]]
        pos = np.searchsorted(u, ids[: n // 2])
        neg = vals[~mask].astype(np.float32)
        both = np.concatenate([sel, neg.astype(np.float64)])
        z = np.zeros(len(sel) + 1, np.int64)
        check_zero(z, f"p06 step={step}")
        H.add(u)
        H.add(cnt)
        H.add(sums)
        H.add(top)
        H.add(pos)
        H.add(both)
        results[step] = (sums, u)
        K.keep(sums, f"step={step}")
    if step % 10 == 9:
        for k in list(results)[::2]:
            del results[k]
        K.drop_some(3)
        K.check(f"step={step}")
for k in sorted(results):
    H.add(results[k][0])
K.check("end")
report(H, K, wss=[W])
