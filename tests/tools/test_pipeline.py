"""AsyncPrefetch / AsyncShield (ordering, structure, errors, early stop, thread shutdown, the
safety rule for kept batches) and the GC controls."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
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


_INTERRUPTED = """
import faulthandler, gc, random, signal, sys, threading, time
import numpy as np
import rustws
faulthandler.dump_traceback_later(60, exit=True)  # a hang fails with every stack
def interrupt(signum, frame):
    raise KeyboardInterrupt
signal.signal(signal.SIGALRM, interrupt)
rng = random.Random(int(sys.argv[1]))
interrupted = 0
for i in range(ROUNDS):
    try:
BODY
        signal.setitimer(signal.ITIMER_REAL, 0)
    except KeyboardInterrupt:
        interrupted += 1
    except RuntimeError as e:  # CPython's own: Thread.start waits on a Python lock it can break
        if "release unlocked lock" not in str(e):
            raise
        interrupted += 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
DROP
# Threads told to stop see it within a few of their waits. One that CPython's `Thread.start` never
# got running (the interrupt landed inside it, after it listed the thread) is listed, not alive.
THREAD = "THREAD"
deadline = time.monotonic() + 5
while any(t.name == THREAD and t.is_alive() for t in threading.enumerate()):
    assert time.monotonic() < deadline, "a thread outlived its owner"
    time.sleep(0.01)
AFTER
print("interrupted", interrupted)
"""


def run_interrupted(
    body: str, *, rounds: int, delay: float, thread: str, drop: str = "", after: str = ""
) -> None:
    """Runs `body` `rounds` times in a fresh interpreter, a KeyboardInterrupt from a signal
    handler landing at a random point within `delay` seconds of its line `ARM`; then `drop` (what
    lets go of the last round's objects), checks that no thread named `thread` is left, and runs
    `after`. Fails on a hang (with every stack) and where no interrupt landed."""
    code = (
        _INTERRUPTED.replace("ROUNDS", str(rounds))
        .replace("BODY", textwrap.indent(textwrap.dedent(body).strip(), " " * 8))
        .replace("ARM", f"signal.setitimer(signal.ITIMER_REAL, rng.random() * {delay!r})")
        .replace('"THREAD"', repr(thread))
        .replace("DROP", textwrap.dedent(drop).strip())
        .replace("AFTER", textwrap.dedent(after).strip())
    )
    for seed in (1, 2):
        argv = [sys.executable, "-c", code, str(seed)]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=100)
        assert r.returncode == 0, r.stdout + r.stderr
        assert int(r.stdout.split()[-1]) > rounds // 100, r.stdout  # the interrupts did land


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="no signal.setitimer on this platform")
@pytest.mark.skipif(
    sys.version_info >= (3, 13),
    reason="on CPython 3.13 a KeyboardInterrupt from a signal handler landing in NumPy's `.all()` "
    "can escape the `except` around it (also with a plain iterator in place of AsyncPrefetch)",
)
@pytest.mark.timeout(120)
def test_ctrl_c_at_any_point_of_the_loop_leaves_close_working():
    """An exception from a signal handler (Ctrl-C) may land anywhere in the consumer, between or
    inside the queue's calls and close(): the loop is left, close() returns and the thread ends.
    (Python's `queue.Queue` and `threading.Event` take locks such an exception can leave held.)"""
    # Armed once the thread started: `threading.Thread.start` itself waits on a Python lock.
    body = """
        with rustws.AsyncPrefetch([np.full(5000, float(k)) for k in range(8)], buffer_size=2) as pf:
            ARM
            for k, batch in enumerate(pf):
                assert (batch == k).all()
    """
    # The last round's iterator, dropped, stops its thread (an interrupt may have landed in its
    # close() before the stop).
    run_interrupted(body, rounds=400, delay=0.0005, thread="rustws-prefetch", drop="pf = None")


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="no signal.setitimer on this platform")
@pytest.mark.timeout(120)
def test_ctrl_c_around_gc_windows_never_hangs_and_leaves_automatic_gc_on():
    """Ctrl-C landing anywhere in entering or leaving `gc_window` blocks: nothing waits forever,
    and within a window of the last block Python's automatic GC is back and the thread gone."""
    body = """
        ARM
        with rustws.gc_window(rng.choice([1, 5, 50])):
            garbage = [[] for _ in range(10)]
    """
    after = """
        assert gc.isenabled(), "automatic GC left off"
    """
    run_interrupted(body, rounds=1500, delay=0.0003, thread="rustws-gc", after=after)


def test_gc_window_is_a_decorator_too():
    @rustws.gc_window(5)
    def inside() -> bool:
        return gc.isenabled()

    assert gc.isenabled()
    assert [inside() for _ in range(3)] == [False] * 3
    assert gc.isenabled()


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


def _gc_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "rustws-gc" and t.is_alive()]


def _gc_thread_ended(seconds: float = 5) -> bool:
    """The collector thread outlives the last block by a short idle wait, then ends."""
    deadline = time.time() + seconds
    while _gc_threads() and time.time() < deadline:
        time.sleep(0.01)
    return not _gc_threads()


def test_blocks_one_after_another_share_one_collector_thread_which_then_ends():
    """A `gc_window` around each step of a loop: one thread serves every step (none is started
    and joined per block), automatic GC is off in each step and back between them, and once the
    loop is over the thread ends."""
    assert _gc_thread_ended()
    seen = set()
    for _ in range(200):
        with rustws.gc_window(50):
            assert not gc.isenabled()
            (thread,) = _gc_threads()
            seen.add(thread)
        assert gc.isenabled()
    assert len(seen) == 1, f"{len(seen)} collector threads for 200 blocks"
    with rustws.gc_window(5):  # the same thread takes a shorter window at once
        assert _collects_within(5)
    assert _gc_thread_ended(), "the collector thread outlived the loop"
    assert gc.isenabled()


def _collects_within(seconds: float) -> bool:
    ref = weakref.ref(_Node())  # a reference cycle: only the cyclic GC frees it
    deadline = time.time() + seconds
    while ref() is not None and time.time() < deadline:
        time.sleep(0.005)
    return ref() is None


@pytest.mark.parametrize("threads", [2, 4, 8])
@pytest.mark.parametrize("order", ["fifo", "lifo", "random"])
def test_gc_windows_from_many_threads_restore_automatic_gc(threads, order):
    """Windows entered from several threads, overlapping, exited in any order: inside any of them
    collection is periodic; once every block has exited, automatic GC is back and no rustws-gc
    thread runs."""
    import random

    assert gc.isenabled()
    entered = threading.Barrier(threads + 1)
    release = [threading.Event() for _ in range(threads)]
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            with rustws.gc_window(5 + i):
                entered.wait()
                release[i].wait(10)
                assert not gc.isenabled()
        except BaseException as e:
            errors.append(e)

    workers = [threading.Thread(target=body, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    entered.wait()
    assert not gc.isenabled() and len(_gc_threads()) == 1
    assert _collects_within(5), "no periodic collection while the windows are open"
    exits = list(range(threads))
    if order == "lifo":
        exits.reverse()
    elif order == "random":
        random.Random(threads).shuffle(exits)
    for n, i in enumerate(exits):
        release[i].set()
        workers[i].join(10)
        if n < threads - 1:
            assert not gc.isenabled(), "a window is still open"
    assert not errors, errors
    assert gc.isenabled(), "automatic GC stayed off after every window exited"
    assert _gc_thread_ended(), "a rustws-gc thread outlived every window"


def test_gc_windows_churned_by_many_threads_end_in_automatic_gc():
    def churn(seed: int) -> None:
        for k in range(50):
            with rustws.gc_window(1 + (seed + k) % 7):
                if k % 5 == 0:
                    time.sleep(0.001)

    workers = [threading.Thread(target=churn, args=(i,)) for i in range(6)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    assert gc.isenabled() and _gc_thread_ended()


def test_gc_windows_and_the_switch_combine():
    rustws.set_auto_gc_window(10)
    rustws.toggle_periodic_gc(True)
    try:
        done = threading.Event()

        def other() -> None:
            with rustws.gc_window(3):
                done.wait(10)

        t = threading.Thread(target=other)
        t.start()
        time.sleep(0.02)
        done.set()
        t.join()
        assert not gc.isenabled() and len(_gc_threads()) == 1, "the switch keeps periodic collection"
        assert _collects_within(5)
    finally:
        rustws.toggle_periodic_gc(False)
    assert gc.isenabled() and _gc_thread_ended()
    with rustws.gc_window(5):  # nested windows of one thread
        with rustws.gc_window(7):
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled() and _gc_thread_ended()


@pytest.mark.parametrize("ms", [2**31, 2**70, 10**30])
def test_gc_windows_too_long_for_a_timed_wait_are_refused_at_the_call(ms):
    with pytest.raises(ValueError, match="window"):
        rustws.set_auto_gc_window(ms)
    with pytest.raises(ValueError, match="window"), rustws.gc_window(ms):
        pass
    assert gc.isenabled() and _gc_thread_ended()


def test_the_longest_window_keeps_the_collector_alive():
    rustws.set_auto_gc_window(2**31 - 1)
    rustws.toggle_periodic_gc(True)
    try:
        time.sleep(0.05)
        assert len(_gc_threads()) == 1, "the collector thread died"
        rustws.set_auto_gc_window(5)  # takes effect at once, not after the long wait
        assert _collects_within(5)
    finally:
        rustws.toggle_periodic_gc(False)
        rustws.set_auto_gc_window(100)
    assert gc.isenabled() and _gc_thread_ended()


class _RaisesInCollection:
    calls = 0

    def __init__(self):
        self.me = self

    def __del__(self):
        type(self).calls += 1
        raise RuntimeError("a finaliser that raises")


def test_a_collection_that_raises_never_ends_periodic_collection(monkeypatch):
    unraisable: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with rustws.gc_window(5):
        _RaisesInCollection()
        deadline = time.time() + 5
        while _RaisesInCollection.calls == 0 and time.time() < deadline:
            time.sleep(0.005)
        assert _RaisesInCollection.calls == 1
        assert _collects_within(5), "collection stopped after a finaliser raised"
        assert len(_gc_threads()) == 1


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


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_a_child_forked_inside_a_window_collects_periodically_and_gets_automatic_gc_back():
    """The child of a fork inside a `gc_window` has no collector thread of its parent's: it gets its
    own while the block is open, and automatic GC back when the block exits."""
    code = textwrap.dedent(
        """
        import gc, os, sys, time, weakref
        import rustws

        class Node:
            def __init__(self):
                self.me = self

        with rustws.gc_window(5):
            pid = os.fork()
            if pid == 0:
                ref = weakref.ref(Node())
                deadline = time.time() + 5
                while ref() is not None and time.time() < deadline:
                    time.sleep(0.005)
                collected = ref() is None
        if pid == 0:
            os._exit(0 if collected and gc.isenabled() else 3)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0"], "the child collected no cycle, or kept automatic GC off"


def test_the_collector_ends_soon_after_a_long_window_closes():
    """A block of a long window, or the switch with the longest, leaves no thread waiting out that
    window once it is over: the thread ends within its idle wait."""
    with rustws.gc_window(60_000):
        assert len(_gc_threads()) == 1
    assert _gc_thread_ended(3), "the collector waited out the block's window"
    rustws.set_auto_gc_window(rustws._pipeline.MAX_GC_WINDOW_MS)
    rustws.toggle_periodic_gc(True)
    try:
        assert not gc.isenabled()
    finally:
        rustws.toggle_periodic_gc(False)
        rustws.set_auto_gc_window(100)
    assert gc.isenabled() and _gc_thread_ended(3), "the collector waited out the switch's window"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_a_child_forked_while_another_thread_has_a_window_open_gets_automatic_gc_back():
    """Blocks of other threads do not exist in a forked child (no thread there will exit them):
    the child gets automatic GC back at once."""
    code = textwrap.dedent(
        """
        import gc, os, threading
        import rustws

        entered, leave = threading.Event(), threading.Event()

        def hold():
            with rustws.gc_window(5):
                entered.set()
                leave.wait(10)

        t = threading.Thread(target=hold)
        t.start()
        entered.wait(10)
        assert not gc.isenabled()
        pid = os.fork()
        if pid == 0:
            os._exit(0 if gc.isenabled() else 3)
        leave.set()
        t.join()
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "0", "the child kept automatic GC off for another thread's block"
