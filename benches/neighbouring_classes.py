"""Peak RSS, page faults and time of loops whose large temporaries fall in neighbouring size
classes, each run plainly and captured (`with rustws.workspace(...)` per cycle) in fresh
processes, alternated. ``python benches/neighbouring_classes.py [--runs N] [PROGRAM ...]``

- ``gradients``, ``gradients-large``, ``gradients-small``: image gradients of a float32 image of
  1024x1024 (4 MiB), 1448x1448 (8 MiB) and 512x512 (1 MiB), 30 cycles. ``np.diff(x,
  prepend=0)`` makes a float64 copy one row larger than the float64 results that follow it;
- ``rows``: a float64 matrix grown by one row and cut back by one each cycle (``np.vstack``,
  ``[1:]``), with results of the plain shape in between: 200 cycles of 2 MiB to 4 MiB arrays.
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _fresh import cycle, main


def gradients(ws, side: int = 1024) -> None:
    img = np.random.default_rng(11).random((side, side), dtype=np.float32)
    total = 0.0
    for i in range(30):
        with cycle(ws):
            x = img * (1 + i % 5)
            gx = np.diff(x, axis=0, prepend=0)
            gy = np.diff(x, axis=1, prepend=0)
            mag = np.sqrt(gx * gx + gy * gy)
            edges = np.where(mag > mag.mean(), 1.0, 0.0).astype(np.float32)
            total += float(mag.sum()) + float(edges.sum())


def rows(ws) -> None:
    rng = np.random.default_rng(5)
    for i in range(200):
        with cycle(ws):
            n = 256 + 128 * (i % 3)
            a = rng.standard_normal((n, 1024))
            grown = np.vstack([a, a[:1]])
            b = np.tanh(a) * 0.5
            c = grown[1:] + b
            float(c.sum())


PROGRAMS = {
    "gradients": gradients,
    "gradients-large": lambda ws: gradients(ws, 1448),
    "gradients-small": lambda ws: gradients(ws, 512),
    "rows": rows,
}


if __name__ == "__main__":
    main(__doc__, __file__, PROGRAMS, "CLASSES")
