"""``ws.empty((1000,), np.float32)`` inside an open cycle against ``np.empty`` of the same shape,
interleaved, median of 21 ratios. ``python benches/empty_vs_numpy.py``"""

import statistics
import timeit

import numpy as np

import rustws

ws = rustws.workspace("E", rustws.WorkspaceConfiguration(initial_size="16MiB"))
N = 100_000
ratios, t_ws, t_np = [], [], []
with ws:
    for _ in range(21):
        a = timeit.timeit(lambda: ws.empty((1000,), np.float32), number=N)
        b = timeit.timeit(lambda: np.empty((1000,), np.float32), number=N)
        t_ws.append(a / N * 1e9)
        t_np.append(b / N * 1e9)
        ratios.append(a / b)
med = statistics.median
print(f"ws.empty {med(t_ws):.0f} ns, np.empty {med(t_np):.0f} ns, median ratio {med(ratios):.2f}")
