"""AsyncPrefetch / AsyncShield (ordering, structure, errors, early stop, thread shutdown, the
safety rule for kept batches) and the GC controls."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import numpy as np
import pytest

import rustws
from rustws import AsyncPrefetch, AsyncShield


def batches(n, size=1000):
    for i in range(n):
        yield np.full(size, i, np.float32), i


def test_items_arrive_in_order_copied_into_a_workspace():
    seen = []
    with AsyncPrefetch(batches(50), buffer_size=3) as it:
        for x, label in it:
            assert (x == label).all()
            assert rustws.owner(x) is not None and rustws.owner(x).name.startswith("PREFETCH")
            seen.append(label)
    assert seen == list(range(50))
    assert not it.is_alive


def test_structures_are_copied_leaf_by_leaf():
    src = [
        {"x": np.arange(4), "meta": "a", "pair": (np.ones(2), [np.zeros(3)])},
        {"x": np.arange(4) + 1, "meta": "b", "pair": (np.ones(2) * 2, [np.zeros(3)])},
    ]
    it = AsyncPrefetch(src)
    out = list(it)
    assert [o["meta"] for o in out] == ["a", "b"]
    np.testing.assert_array_equal(out[1]["x"], [1, 2, 3, 4])
    assert isinstance(out[0]["pair"], tuple) and isinstance(out[0]["pair"][1], list)
    assert rustws.owner(out[0]["pair"][1][0]) is it.workspace
    assert it.workspace.is_destroyed  # exhausted: closed; the items stay valid


def test_kept_batches_stay_intact_while_the_ring_wraps():
    kept = []
    for k, (x, label) in enumerate(AsyncPrefetch(batches(300, size=20_000), buffer_size=2)):
        if k % 7 == 0:
            kept.append((x, label))
    for x, label in kept:
        assert (x == label).all(), "a batch the consumer kept was overwritten"


def test_items_that_grow_are_served():
    sizes = [100, 100, 5000, 200_000, 100, 300_000]
    out = list(AsyncPrefetch(np.full(n, n, np.int32) for n in sizes))
    assert [len(o) for o in out] == sizes
    assert all((o == len(o)).all() for o in out)


def test_errors_in_the_source_reraise_in_the_consumer_with_their_traceback():
    def source():
        yield np.ones(3)
        raise KeyError("broken batch")

    it = AsyncPrefetch(source())
    next(it)
    with pytest.raises(KeyError, match="broken batch") as info:
        next(it)
    frames = []
    tb = info.value.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert "source" in frames
    assert not it.is_alive


def test_early_stop_and_close_stop_the_thread_promptly():
    def endless():
        i = 0
        while True:
            yield np.full(100, i)
            i += 1

    it = AsyncPrefetch(endless(), buffer_size=2)
    for k, _x in enumerate(it):
        if k == 5:
            break
    t0 = time.perf_counter()
    it.close()
    it.close()  # idempotent
    assert time.perf_counter() - t0 < 2
    assert not it.is_alive
    with pytest.raises(StopIteration):
        next(it)


def test_the_context_manager_closes_on_error():
    with pytest.raises(RuntimeError), AsyncPrefetch(batches(1000)) as it:
        next(it)
        raise RuntimeError("consumer fails")
    assert not it.is_alive


def test_at_most_buffer_size_items_ahead():
    produced = []

    def source():
        for i in range(100):
            produced.append(i)
            yield np.full(10, i)

    it = AsyncPrefetch(source(), buffer_size=3)
    next(it)
    time.sleep(0.3)
    # one consumed, three queued, one waiting to be queued
    assert len(produced) <= 1 + 3 + 1
    it.close()


def test_async_shield_prevents_prefetch():
    threads_before = threading.active_count()
    src = [np.ones(2), np.zeros(2)]
    it = AsyncPrefetch(AsyncShield(src))
    assert threading.active_count() == threads_before and not it.is_alive
    out = list(it)
    assert out[0] is src[0] and out[1] is src[1]


def test_bad_arguments():
    with pytest.raises(TypeError):
        AsyncPrefetch(5)
    with pytest.raises(ValueError, match="buffer_size"):
        AsyncPrefetch([], buffer_size=0)
    with pytest.raises(TypeError):
        AsyncPrefetch([], buffer_size=2.0)
    with pytest.raises(TypeError):
        AsyncPrefetch([], config={"initial_size": 5})


def test_empty_source():
    assert list(AsyncPrefetch([])) == []


# -- GC ---------------------------------------------------------------------------------------


class _Node:
    def __init__(self):
        self.me = self


def test_gc_window_collects_cycles_periodically_instead_of_automatically():
    was_enabled = gc.isenabled()
    with rustws.gc_window(20):
        assert not gc.isenabled()
        ref = weakref.ref(_Node())  # a reference cycle: only the cyclic GC frees it
        deadline = time.time() + 5
        while ref() is not None and time.time() < deadline:
            time.sleep(0.01)
        assert ref() is None, "the periodic collection did not run"
    assert gc.isenabled() == was_enabled


def test_periodic_gc_toggle_and_window():
    rustws.set_auto_gc_window(15)
    rustws.toggle_periodic_gc(True)
    try:
        assert not gc.isenabled()
        ref = weakref.ref(_Node())
        deadline = time.time() + 5
        while ref() is not None and time.time() < deadline:
            time.sleep(0.01)
        assert ref() is None
    finally:
        rustws.toggle_periodic_gc(False)
    assert gc.isenabled()
    rustws.set_auto_gc_window(0)
    assert gc.isenabled()


def test_gc_bad_arguments():
    with pytest.raises(ValueError):
        rustws.set_auto_gc_window(-1)
    with pytest.raises(TypeError):
        rustws.set_auto_gc_window(1.5)
    with pytest.raises(TypeError):
        rustws.toggle_periodic_gc(1)
    with pytest.raises(ValueError), rustws.gc_window(0):
        pass


def _prefetch_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "rustws-prefetch"}


def test_a_loop_left_by_break_stops_its_thread_and_frees_its_workspace():
    def endless():
        i = 0
        while True:
            yield np.full(1000, i)
            i += 1

    before = _prefetch_threads()
    spaces = []
    for _ in range(5):
        it = AsyncPrefetch(endless(), buffer_size=2)
        for k, _x in enumerate(it):
            if k == 2:
                spaces.append(it.workspace)
                break
        del it, _x  # abandoned without close()
    gc.collect()
    deadline = time.monotonic() + 10
    while _prefetch_threads() - before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not (_prefetch_threads() - before), "abandoned prefetch threads still run"
    assert all(ws.is_destroyed for ws in spaces)
