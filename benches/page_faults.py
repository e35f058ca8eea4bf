"""Minor page faults per cycle: a loop whose cycle allocates two 16 MB arrays with ``ws.empty`` and
fills them, against the same loop with ``np.empty``. ``python benches/page_faults.py``"""

import resource

import numpy as np

import rustws


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def cycle(alloc) -> int:
    f0 = faults()
    a = alloc((4_000_000,), np.float32)
    a.fill(1.0)
    b = alloc((4_000_000,), np.float32)
    b.fill(2.0)
    del a, b
    return faults() - f0


ws = rustws.workspace("PF")
per_ws = []
for _ in range(12):
    with ws:
        per_ws.append(cycle(ws.empty))
per_np = [cycle(np.empty) for _ in range(12)]
print(f"rustws: faults per cycle {per_ws} (the first cycle learns)")
print(f"numpy:  faults per cycle {per_np}")
print(f"after learning: rustws max {max(per_ws[1:])}, numpy median {sorted(per_np)[6]}")
