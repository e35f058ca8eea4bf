"""Functions decorated with ``@rustws.cycle`` at module level, so that process pools can pickle them by
name (test_cycle.py, test_ray.py beside it)."""

from __future__ import annotations

import os

import numpy as np

import rustws


@rustws.cycle("POOL")
def step(i: int) -> tuple[int, str | None, bool, int]:
    """Temporaries of 1 MiB; reports the process, the current workspace, whether a temporary came
    from it, and the cycles completed before this one."""
    x = np.full(1 << 18, float(i), np.float32)
    y = np.tanh(x * 2.0)
    ws = rustws.current_workspace()
    if ws is None:
        return os.getpid(), None, False, 0
    return os.getpid(), ws.name, rustws.owner(y) is ws, ws.generation


def stats() -> list[dict[str, object]]:
    return rustws.thread_statistics()
