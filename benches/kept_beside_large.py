"""Peak RSS, page faults and time of loops whose cycles keep blocks beside large ones, each run
plainly and captured (`with rustws.workspace(...)` per cycle) in fresh processes, alternated.
``python benches/kept_beside_large.py [--runs N] [PROGRAM ...]``

- ``periodic``: a large cycle (three 48 MB arrays) every 25 cycles among cycles of random sizes
  (0.4-3.2 MB), a view of a result kept every 7th cycle for 28 cycles;
- ``zeros``: cycles of 8 B, 80 B, a 400 MB ``np.zeros`` written every 800 KB, 8 KB, a 96 MB
  ``np.zeros`` beside 48 MB temporaries whose sorted result is kept (through a view) for two
  rounds, and nothing, repeated;
- ``zeros-full``: a 64 MB ``np.zeros`` written in full every cycle.

Python keeps a loop body's variables past its ``with``: the last cycle's arrays live into the
next one, as in any loop, and so do the kept views' blocks.
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _fresh import cycle, main


def periodic(ws) -> None:
    rng = np.random.default_rng(3)
    kept = []
    for i in range(400):
        with cycle(ws):
            n = 6_000_000 if i % 25 == 0 else int(rng.integers(50_000, 400_000))
            a = rng.standard_normal(n)
            b = np.cumsum(a)
            c = b * 0.5 + a
            if i % 7 == 0:
                kept.append(c[::3])
            if len(kept) > 4:
                kept.pop(0)


def zeros(ws) -> None:
    rng = np.random.default_rng(2)
    kept = []
    for _ in range(6):
        for kind in range(6):
            with cycle(ws):
                if kind in (0, 1, 3):
                    x = np.ones((1, 10, 0, 1000)[kind])
                elif kind == 2:
                    z = np.zeros(50_000_000)
                    z[::100_000] = 1.0
                elif kind == 4:
                    z = np.zeros(12_000_000)
                    a = rng.standard_normal(6_000_000)
                    b = a * 2
                    c = b + z[:6_000_000]
                    kept.append(np.sort(c)[10:])
                    if len(kept) > 2:
                        kept.pop(0)
    del x, z


def zeros_full(ws) -> None:
    x = np.ones(8_000_000)
    for _ in range(60):
        with cycle(ws):
            acc = np.zeros(8_000_000)
            acc += x
            y = acc * 2
            float(y.sum())


PROGRAMS = {"periodic": periodic, "zeros": zeros, "zeros-full": zeros_full}


if __name__ == "__main__":
    main(__doc__, __file__, PROGRAMS, "KEPT")
