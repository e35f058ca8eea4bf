"""Peak RSS, page faults and time of loops whose cycles overlap for good (a cycle is always open,
so nothing is pinned and the arena never rewinds), each run plainly and captured in fresh
processes, alternated. ``python benches/overlapping_cycles.py [--runs N] [PROGRAM ...]``

- ``tasks4``, ``tasks8``, ``tasks16``: 4 asyncio tasks with 4 MB temporaries (300 steps), 8 with
  4 MB (100 steps), 16 with 2 MB (100 steps); each step is a cycle of the task's own
  (``with ws:``) with two awaits inside it, so every close comes while the other tasks hold their
  temporaries;
- ``keep8``: 8 tasks keeping an 80 KB result per step (300 steps each);
- ``temps8``: 8 tasks with 160 KB temporaries and nothing kept (3,000 steps each);
- ``zipped``: two loop forms advanced in turn (``zip(ws.cycles(a), ws.cycles(b))``) keeping a
  32 KB result per turn (3,000 turns).
"""

import asyncio
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _fresh import cycle, main


def tasks(ws, count: int, nbytes: int, steps: int, keep: bool) -> None:
    src = np.random.default_rng(0).random(nbytes // 8)
    kept = []

    async def task(k: int) -> float:
        acc = 0.0
        for _ in range(steps):
            with cycle(ws):
                a = src * (1.0 + k)
                await asyncio.sleep(0)
                b = np.sqrt(a + 1.0)
                await asyncio.sleep(0)
                if keep:
                    kept.append(b - a)
                else:
                    acc += float((b - a).sum())
        return acc

    async def run() -> list[float]:
        return await asyncio.gather(*(task(k) for k in range(count)))

    asyncio.run(run())


def zipped(ws) -> None:
    x = np.random.default_rng(0).random(4000)
    kept = []
    turns = (ws.cycles(range(3000)), ws.cycles(range(3000))) if ws is not None else (range(3000), range(3000))
    for _ in zip(*turns, strict=True):
        t = x * 2.0
        u = t + 1.0
        kept.append((u * 0.5).copy())


PROGRAMS = {
    "tasks4": lambda ws: tasks(ws, 4, 4 << 20, 300, False),
    "tasks8": lambda ws: tasks(ws, 8, 4 << 20, 100, False),
    "tasks16": lambda ws: tasks(ws, 16, 2 << 20, 100, False),
    "keep8": lambda ws: tasks(ws, 8, 80_000, 300, True),
    "temps8": lambda ws: tasks(ws, 8, 160_000, 3000, False),
    "zipped": zipped,
}


if __name__ == "__main__":
    main(__doc__, __file__, PROGRAMS, "OVERLAP")
