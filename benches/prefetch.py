"""AsyncPrefetch overlap: a producer and a consumer that each take 10 ms per item, iterated plainly
and through AsyncPrefetch; median of 5 runs of 40 items. ``python benches/prefetch.py``"""

import statistics
import time

import numpy as np

import rustws

ITEMS, COST = 40, 0.010


def source():
    for i in range(ITEMS):
        time.sleep(COST)  # loading / decoding one batch
        yield np.full((256, 256), i, np.float32), i


def consume(batches) -> float:
    t = time.perf_counter()
    for x, label in batches:
        assert x[0, 0] == label
        time.sleep(COST)  # one training step
    return time.perf_counter() - t


plain, prefetched = [], []
for _ in range(5):
    plain.append(consume(source()))
    with rustws.AsyncPrefetch(source(), buffer_size=4) as it:
        prefetched.append(consume(it))
p, q = statistics.median(plain), statistics.median(prefetched)
print(f"plain {p * 1e3:.0f} ms, AsyncPrefetch {q * 1e3:.0f} ms for {ITEMS} items: ratio {q / p:.2f}")
