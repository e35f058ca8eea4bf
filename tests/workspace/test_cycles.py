"""Workspaces and their cycles: one per name and thread, each ``with`` one cycle, learning that
ends page faults, arrays kept past their cycle, frees from other threads, destroying, and
workspaces made directly."""

from __future__ import annotations

import gc
import resource
import threading

import numpy as np
import pytest

import rustws
from rustws import (
    LearningPolicy,
    WorkspaceConfiguration,
)

MiB = 1 << 20


def cfg(**kw):
    return WorkspaceConfiguration(**kw)


def test_workspace_is_per_thread_and_reused_by_name():
    a = rustws.workspace("A")
    assert rustws.workspace("A") is a
    assert rustws.get_workspace("A") is a
    assert rustws.get_and_activate_workspace(None, "A") is a
    assert rustws.get_workspace("B") is None
    assert rustws.workspaces() == [a]
    seen = []
    t = threading.Thread(target=lambda: seen.append((rustws.get_workspace("A"), rustws.workspace("A"))))
    t.start()
    t.join()
    assert seen[0][0] is None
    assert seen[0][1] is not a


def test_default_name_and_properties():
    ws = rustws.workspace()
    assert ws.name == "DEFAULT"
    assert ws.config == WorkspaceConfiguration.adaptive()
    assert ws.config.policy_learning is LearningPolicy.ADAPTIVE
    assert ws.device == "cpu"
    assert not ws.is_open and not ws.is_destroyed and ws.generation == 0
    assert "DEFAULT" in repr(ws)


def test_each_with_is_one_cycle_and_nesting_does_not_reset():
    ws = rustws.workspace("C", cfg(initial_size=MiB))
    with ws as entered:
        assert entered is ws and ws.is_open
        assert rustws.current_workspace() is ws
        a = ws.empty(100)
        with ws:
            b = ws.empty(100)
            assert ws.generation == 0
        assert ws.is_open and ws.generation == 0
        assert a.ctypes.data != b.ctypes.data
    assert not ws.is_open and ws.generation == 1
    assert rustws.current_workspace() is None
    assert ws.stats().cycles == 1


def test_different_config_replaces_a_closed_workspace_and_refuses_an_open_one():
    ws = rustws.workspace("R", cfg(initial_size=MiB))
    with ws, pytest.raises(ValueError, match="open"):
        rustws.workspace("R", cfg(initial_size=2 * MiB))
    ws2 = rustws.workspace("R", cfg(initial_size=2 * MiB))
    assert ws2 is not ws and ws.is_destroyed
    assert ws2.stats().capacity_bytes >= 2 * MiB


def test_first_loop_learns_then_has_zero_page_faults():
    ws = rustws.workspace("PF")
    faults = []
    for _ in range(6):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with ws:
            a = ws.empty(4_000_000, np.float32)
            a.fill(1.0)
            b = ws.empty(4_000_000, np.float32)
            b.fill(2.0)
            assert float(a[-1] + b[0]) == 3.0
            del a, b
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    s = ws.stats()
    assert s.spill_count == 0 and s.capacity_bytes >= 32_000_000
    # The learning cycle faults in its 32 MB: 7,800 faults in 4 KiB pages, and at least 15 where
    # the system backs it with 2 MiB huge pages, as it does NumPy's own large arrays when it has
    # them free. Learned cycles reuse pre-faulted memory: fewer faults than even huge pages would
    # take. (The strict zero is measured in benches/; the interpreter may fault on its own.)
    huge_pages = -(-32_000_000 // (2 * MiB))
    assert faults[0] >= huge_pages - 1, faults
    assert max(faults[2:]) < huge_pages - 1, faults


def test_array_kept_past_its_cycle_keeps_contents_for_100_cycles_and_is_pinned():
    ws = rustws.workspace("K", cfg(initial_size=4 * MiB))
    with ws:
        kept = ws.empty(1000, np.float64)
        kept[:] = np.arange(1000)
    assert ws.stats().pinned_bytes == 8000
    for i in range(100):
        with ws:
            t = ws.empty(1000, np.float64)
            t.fill(-i)
            u = np.full(1000, float(i))  # captured
            assert rustws.owner(u) is ws
            del t, u
        assert ws.stats().pinned_bytes == 8000
    np.testing.assert_array_equal(kept, np.arange(1000))
    del kept
    gc.collect()
    assert ws.stats().pinned_bytes == 0


def test_escaping_every_cycle_stays_bounded():
    ws = rustws.workspace("SGD")
    w = np.ones(100_000, np.float32)
    for _ in range(100):
        with ws:
            g = w * 0.5
            w = w - 0.01 * g
    s = ws.stats()
    assert rustws.owner(w) is ws
    assert s.spill_count <= 2, s
    assert s.capacity_bytes < 8 * 400_000, s
    assert s.pinned_bytes == w.nbytes + g.nbytes  # both names still hold their arrays


def test_memory_freed_inside_one_long_cycle_is_reused():
    ws = rustws.workspace("LONG", cfg(initial_size=8 * MiB, policy_learning=LearningPolicy.NONE))
    x = np.ones(50_000)
    with ws:
        for _ in range(500):
            x = np.sqrt(x * 1.0001) + 0.0
        s = ws.stats()
    assert s.spill_count == 0, s
    assert s.external_bytes == 0
    assert s.capacity_bytes < 8 * MiB * 1.3 + 8192  # never grew


def test_arrays_outlive_their_workspace():
    ws = rustws.workspace("D", cfg(initial_size=MiB))
    with ws:
        a = ws.full(1000, 3.0)
        b = np.arange(1000.0) * 2  # captured
    ws.destroy()
    ws.destroy()  # idempotent
    assert ws.is_destroyed and rustws.get_workspace("D") is None
    gc.collect()
    assert a.sum() == 3000.0 and b[-1] == 1998.0
    assert ws.stats().capacity_bytes > 0
    del a, b
    gc.collect()
    assert ws.stats().capacity_bytes == 0


def test_close_is_destroy():
    ws = rustws.workspace("CL")
    ws.close()
    assert ws.is_destroyed


def test_destroy_all_workspaces_for_current_thread():
    a, b = rustws.workspace("A1"), rustws.workspace("B1")
    rustws.destroy_all_workspaces_for_current_thread()
    assert a.is_destroyed and b.is_destroyed and rustws.workspaces() == []


def test_using_a_destroyed_workspace():
    ws = rustws.workspace("GONE")
    ws.destroy()
    with pytest.raises(rustws.WorkspaceClosedError, match="GONE"):
        ws.empty(3)
    with pytest.raises(rustws.WorkspaceClosedError), ws:
        pass
    with pytest.raises(rustws.WorkspaceClosedError):
        ws.initialize()
    with pytest.raises(rustws.WorkspaceClosedError), ws.borrow():
        pass


def test_destroying_an_open_workspace_keeps_captured_code_working():
    ws = rustws.workspace("DO", cfg(initial_size=MiB))
    with ws:
        a = np.ones(10) * 3
        ws.destroy()
        b = np.ones(10) * 4  # ordinary memory now
        assert rustws.owner(b) is None
    assert a.sum() == 30 and b.sum() == 40


def test_frees_from_another_thread():
    ws = rustws.workspace("FT", cfg(initial_size=MiB))
    with ws:
        arrays = [ws.full(1000, i) for i in range(50)]
    box = [arrays]
    del arrays

    def drop():
        box.clear()
        gc.collect()

    t = threading.Thread(target=drop)
    t.start()
    t.join()
    assert ws.stats().used_bytes == 0 and ws.stats().pinned_bytes == 0


@pytest.mark.timeout(30)
def test_raising_does_not_hold_the_workspace_lock():
    # Building the exception may run the GC, which may free an array of this very workspace.
    ws = rustws.workspace("GCLOCK", cfg(initial_size=MiB))
    gc.disable()
    try:
        cycle = [ws.empty(1000)]
        cycle.append(cycle)
        del cycle
        ws.destroy()
        gc.set_threshold(gc.get_count()[0] + 2)
        with pytest.raises(rustws.WorkspaceClosedError), ws:
            pass
    finally:
        gc.set_threshold(700, 10, 10)
        gc.enable()
        gc.collect()


@pytest.mark.parametrize(
    "config",
    [{}, {"initial_size": "1MiB", "policy_spill": "FAIL"}, WorkspaceConfiguration.adaptive().to_dict()],
)
def test_a_workspace_made_directly_works_like_any_other(config):
    """``rustws.Workspace(name, config_dict)``: constructible, so it must work, down to ``destroy``."""
    ws = rustws.Workspace("DIRECT", config)
    assert ws.config == WorkspaceConfiguration.from_dict(config) and ws.device == "cpu"
    assert rustws.get_workspace("DIRECT") is None  # no thread's registry holds it
    with ws:
        a = ws.full(1000, 3.0)  # above the adaptive profile's helper_min_size
        b = np.ones(1000) * 2  # captured
    assert rustws.owner(a) is ws and rustws.owner(b) is ws
    assert ws.stats().cycles == 1 and ws.generation == 1
    ws.destroy()
    ws.destroy()
    assert ws.is_destroyed and (a == 3.0).all()


def test_a_workspace_made_directly_refuses_bad_configurations():
    with pytest.raises(ValueError, match="initial_size"):
        rustws.Workspace("DIRECT", {"initial_size": -1})
    with pytest.raises(TypeError, match="unknown"):
        rustws.Workspace("DIRECT", {"sizes": 1})
    with pytest.raises(TypeError):
        rustws.Workspace("DIRECT", WorkspaceConfiguration())  # a dict of its fields, as to_dict() gives


def test_stats_are_frozen_and_consistent():
    ws = rustws.workspace("ST", cfg(initial_size=MiB))
    with ws:
        a = ws.empty(1000, np.uint8)
        s = ws.stats()
    assert s.capacity_bytes == s.used_bytes + s.cached_bytes + s.overhead_bytes
    assert s.used_bytes == 1000 and s.allocation_count == 1 and s.peak_cycle_bytes == 1000
    d = s.as_dict()
    assert list(d) == [
        "cycles",
        "capacity_bytes",
        "used_bytes",
        "peak_cycle_bytes",
        "cached_bytes",
        "external_bytes",
        "pinned_bytes",
        "overhead_bytes",
        "allocation_count",
        "spill_count",
        "failed_allocations",
    ]
    with pytest.raises(AttributeError):
        s.used_bytes = 0  # type: ignore[misc]
    del a
