"""``max_size`` is a limit: what a workspace holds never exceeds it, whatever its arena would grow
to, and a request past it is a ``WorkspaceOutOfMemory`` that says why, with the numbers."""

from __future__ import annotations

import numpy as np
import pytest

import rustws
from rustws import WorkspaceConfiguration, WorkspaceOutOfMemory

MiB = 1 << 20


def held(ws) -> int:
    """What the statistics show of the workspace's footprint: arenas and blocks outside them."""
    s = ws.stats()
    return s.capacity_bytes + s.external_bytes


def test_a_loop_that_replaces_its_state_stays_within_max_size():
    """The README's ``h = f(h)`` loop: the state of the last cycle lives until this cycle replaces
    it, beside this cycle's temporaries."""
    ws = rustws.workspace("HLOOP", WorkspaceConfiguration.adaptive(max_size="64MiB"))
    h = np.ones(20 * MiB // 8)
    for _ in range(12):
        with ws:
            t = np.tanh(h) * 0.5
            h = t + 1.0
            del t
            assert held(ws) <= 64 * MiB, ws.stats()
        assert held(ws) <= 64 * MiB, ws.stats()
    assert ws.stats().failed_allocations == 0
    expected = 1.0
    for _ in range(12):
        expected = np.tanh(expected) * 0.5 + 1.0
    assert np.allclose(h, expected)


def test_a_request_past_max_size_beside_a_kept_array_is_refused_with_the_numbers():
    ws = rustws.workspace("KEPT", WorkspaceConfiguration.adaptive(max_size="64MiB"))
    with ws:
        kept = np.ones(40 * MiB // 8)
    assert held(ws) <= 64 * MiB
    with ws, pytest.raises(MemoryError):
        np.ones(50 * MiB // 8)  # captured: NumPy's own MemoryError, the reason as a note
    assert held(ws) <= 64 * MiB
    with ws, pytest.raises(WorkspaceOutOfMemory, match="max_size reached") as info:
        ws.empty(50 * MiB // 8)  # explicit: the workspace's own error
    e = info.value
    assert (e.workspace, e.requested, e.limit, e.reason) == ("KEPT", 50 * MiB, 64 * MiB, "max_size reached")
    assert e.in_use >= 40 * MiB and e.pinned >= 40 * MiB and e.footprint <= 64 * MiB
    assert held(ws) <= 64 * MiB
    assert (kept == 1).all()
    with ws:
        fits = np.ones(10 * MiB // 8)  # what fits beside the kept array is served
        assert rustws.owner(fits) is ws
    del kept, fits


def test_an_arena_that_would_grow_past_max_size_is_not_mapped_past_it():
    """Cycles that grow, shrink and grow again while their results are kept a cycle longer: the
    learner asks for arenas the limit cannot hold beside the retired ones."""
    ws = rustws.workspace("REGROW", WorkspaceConfiguration.adaptive(max_size="24MiB"))
    kept = None
    served = 0
    for n in [1, 6, 2, 7, 1, 8, 2, 6, 3, 7] * 2:
        with ws:
            try:
                a = np.ones(n * MiB // 8)
                kept = a[: len(a) // 2] * 2  # kept past the cycle, replaced by the next one
                served += 1
                del a
            except MemoryError:
                pass  # refused at the limit: that is what a limit does
            assert held(ws) <= 24 * MiB, ws.stats()
        assert held(ws) <= 24 * MiB, ws.stats()
    assert served >= 10, f"only {served} of 20 cycles were served"
    del kept
