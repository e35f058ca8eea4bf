"""Asyncio tasks, each with `with ws:` around awaits: feature windows from a simulated stream,
three tasks sharing one workspace and one task with its own; results gathered and kept."""

import asyncio

import numpy as np
from common import Hasher, Kept, check_zero, report, ws

H, K = Hasher(), Kept()
rng = np.random.default_rng(8)
stream = rng.standard_normal(3_000_000)
WS = ws("shared")
WO = ws("own")
res = {}


async def handler(tid, W):
    acc = []
    for step in range(25):
        n = (32_767, 32_768, 32_769, 400_000, 400_001)[(step + tid) % 5]
        with W:
            x = stream[tid * 1000 + step : tid * 1000 + step + n]
            w = np.diff(x, prepend=x[:1]) * (tid + 1)
            await asyncio.sleep(0)
            spec = np.abs(np.fft.rfft(w))
            await asyncio.sleep(0)
            pad = np.pad(spec, (0, 1))
            z = np.zeros(pad.size + 1)
            check_zero(z, f"p08 t{tid} step={step}")
            await asyncio.sleep(0)
            feat = np.concatenate([pad[:64], [w.std(), x.mean()]])
            big = np.cumsum(pad)
        acc.append(feat)
        K.keep(big, f"t{tid} step={step}")
        if step % 6 == 5:
            acc = acc[1:]
            K.check(f"t{tid} step={step}")
    res[tid] = np.vstack(acc)


async def main():
    await asyncio.gather(*(handler(t, WS) for t in range(3)), handler(3, WO))


asyncio.run(main())
for t in range(4):
    H.add(res[t])
K.drop_some()
K.check("end")
report(H, K, wss=[WS, WO])
