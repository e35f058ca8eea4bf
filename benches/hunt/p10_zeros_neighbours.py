"""Neighbouring classes and zeros: each step makes and drops a dirty array one class up, then
asks for np.zeros / np.empty+fill / resize of the class below; kept arrays checked after every
later cycle. Sizes 128 KiB to 48 MiB; `with ws:` per step, then ws.cycles."""

import numpy as np
from common import Hasher, Kept, check_zero, report, ws

W = ws("zn")
H, K = Hasher(), Kept()


def class_size(n):  # rustws classes above 1 KiB: 8 per doubling
    s = n - 1
    e = s.bit_length()
    m = (s >> (e - 4)) & 7
    return (9 + m) << (e - 4)


base_sizes = [128 << 10, 140 << 10, 1 << 20, (1 << 20) + 4096, 5 << 20, 33 << 20, 48 << 20]


def step(sz, t):
    up = class_size(sz) + 8  # just into the next class
    dirty = np.full(up // 8, -1.0)  # one class up, every byte non-zero
    dirty2 = np.full(up // 8 + 1, 7.0)
    del dirty, dirty2  # free blocks of the next class up
    z = np.zeros(sz // 8)  # own class empty: takes a dirty block?
    check_zero(z, f"p10 zeros sz={sz} t={t}")
    c = np.zeros(sz // 4, np.float32)
    check_zero(c, f"p10 zeros32 sz={sz} t={t}")
    r = np.ones(sz // 8 - 1)
    r.resize(class_size(sz) // 8 + 3, refcheck=False)  # realloc into the next class
    check_zero(r[sz // 8 - 1 :], f"p10 resize tail sz={sz} t={t}")
    r2 = np.arange(up // 8, dtype=np.float64)
    r2.resize(sz // 8, refcheck=False)  # realloc down one class
    if not np.array_equal(r2, np.arange(sz // 8, dtype=np.float64)):
        K.errors.append(f"shrink lost contents sz={sz} t={t}")
    z[::4096] = t
    return z, c, r, r2


for t in range(6):
    for sz in base_sizes:
        with W:
            z, c, r, r2 = step(sz, t)
            H.add(z[::1024])
            H.add(r)
            H.add(r2[-100:])
            if t % 2 == 0:
                K.keep(z, f"z sz={sz} t={t}")
                K.keep(r, f"r sz={sz} t={t}")
        K.check(f"with t={t} sz={sz}")
for t in W.cycles(range(6, 14)):
    for sz in base_sizes[:5]:
        z, c, r, r2 = step(sz, t)
        H.add(z[::1024])
        H.add(r)
        if t % 3 == 0:
            K.keep(r2, f"r2 sz={sz} t={t}")
    K.check(f"cycles t={t}")
    if t == 10:
        K.drop_some()
K.check("end")
report(H, K, wss=[W])
