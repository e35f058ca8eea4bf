"""np.resize and ndarray.resize(refcheck=False) by a row up and down (realloc in place across
neighbouring classes); buffers carried from cycle to cycle; ws.cycles(range)."""

import numpy as np
from common import Hasher, Kept, check_zero, report, ws

W = ws("rs")
H, K = Hasher(), Kept()
rng = np.random.default_rng(4)
for cols in (2048, 65_536):  # rows of 16 KiB and 512 KiB
    buf = np.ones((12, cols))
    for i in W.cycles(range(60)):
        r0 = buf.shape[0]
        keep_part = buf[:r0].copy()
        grow = 1 if i % 3 != 2 else -1
        newr = max(9, r0 + grow)
        buf.resize((newr, cols), refcheck=False)  # realloc: in place or moved
        if newr > r0:
            check_zero(buf[r0:], f"p04 resize tail cols={cols} i={i}")
            buf[r0:] = i
        if not np.array_equal(buf[: min(r0, newr)], keep_part[: min(r0, newr)]):
            K.errors.append(f"resize lost contents cols={cols} i={i}")
        b2 = np.resize(buf, (newr + 1, cols))  # repeats content
        b3 = np.resize(buf[:, : cols // 2].astype(np.float32), (newr * 2 + 1, cols // 2))
        flat = buf.ravel().copy()
        flat.resize(flat.size + cols // 8 + 1, refcheck=False)
        check_zero(flat[buf.size :], f"p04 flat tail cols={cols} i={i}")
        t = np.tanh(b2 * 0.01 + rng.standard_normal(b2.shape[1]))
        H.add(buf)
        H.add(b2)
        H.add(b3)
        H.add(t.sum(axis=0))
        buf = buf * 1.0001 + 0.5  # new buffer each cycle, old one freed
        if i % 7 == 0:
            K.keep(b3, f"cols={cols} i={i}")
        if i % 5 == 0:
            K.check(f"cols={cols} i={i}")
    K.drop_some()
K.check("end")
report(H, K, wss=[W])
