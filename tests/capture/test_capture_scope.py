"""Capture is confined to the scope that opened it: the thread (or asyncio task) that entered it,
while it is open. Copied contexts on other threads, contexts run after the scope closed, and
scopes closed from elsewhere (a generator finalised on another thread, a task destroyed while
pending) capture nothing. Concurrent tasks on one workspace each run a cycle of their own. The loop
form ``ws.cycles()`` makes each iteration one cycle."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import logging
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import rustws
from rustws import WorkspaceConfiguration, _rustws

MiB = 1 << 20
BIG = 4096  # float64 elements: 32 KB, above any helper_min_size used here


def cfg(**kw):
    return WorkspaceConfiguration(**{"initial_size": 4 * MiB, **kw})


def allocate():
    """A captured-sized array made here, and who serves it (None: NumPy's own allocator)."""
    a = np.ones(BIG) * 2
    return rustws.owner(a), rustws.current_workspace()


@pytest.mark.parametrize("run", ["pool", "to_thread", "copy_context_thread"])
def test_a_context_copied_into_another_thread_captures_nothing_there(run):
    ws = rustws.workspace("COPY", cfg())
    with ws:
        assert allocate() == (ws, ws)
        if run == "pool":
            # A pool submits with a copy of the caller's context (as dask's threaded scheduler
            # and concurrent.futures users do with contextvars.copy_context()).
            ctx = contextvars.copy_context()
            with ThreadPoolExecutor(1) as pool:
                there = pool.submit(ctx.run, allocate).result()
        elif run == "to_thread":

            async def main():
                return await asyncio.to_thread(allocate)

            there = asyncio.run(main())
        else:
            ctx = contextvars.copy_context()
            out = []
            t = threading.Thread(target=lambda: out.append(ctx.run(allocate)))
            t.start()
            t.join()
            there = out[0]
        assert there == (None, None), "the other thread's allocations came from this thread's workspace"
        assert allocate() == (ws, ws)
    s = ws.stats()
    assert s.cycles == 1 and s.spill_count == 0


def test_a_context_copied_inside_a_cycle_captures_nothing_once_it_closed():
    ws = rustws.workspace("LATER", cfg())
    with ws:
        ctx = contextvars.copy_context()
    assert ctx.run(allocate) == (None, None)
    ws.destroy()
    assert ctx.run(allocate) == (None, None)


def test_concurrent_tasks_on_one_workspace_each_run_a_cycle():
    ws = rustws.workspace("SERVER", cfg())
    caps = []

    async def request(i):
        with ws:
            a = np.ones(BIG) * i
            assert rustws.owner(a) is ws
            await asyncio.sleep(0)  # other requests enter meanwhile
            assert (a == i).all()
            del a

    async def main():
        await asyncio.gather(*(request(i) for i in range(200)))
        caps.append(ws.stats())

    asyncio.run(main())
    s = caps[0]
    assert s.cycles == 200, "each task's outermost with is a cycle of its own"
    assert not ws.is_open and ws.depth == 0
    assert s.used_bytes == 0
    # Nothing was live after the last task: the arena rewound, and the next cycle starts at its
    # beginning.
    with ws:
        first = np.ones(BIG)
    with ws:
        again = np.ones(BIG)
        assert again.ctypes.data == first.ctypes.data or rustws.owner(again) is ws


def test_nested_with_in_one_task_nests_and_other_tasks_do_not():
    ws = rustws.workspace("NEST", cfg())

    async def inner():
        with ws:
            return ws.depth

    async def main():
        with ws:
            with ws:
                depth_nested = ws.depth
            depth_other = await asyncio.create_task(inner())
        return depth_nested, depth_other

    nested, other = asyncio.run(main())
    assert nested == 2 and other == 2  # the other task's cycle sits beside this one
    assert ws.stats().cycles == 2 and ws.depth == 0


def _enter_directly(ws):
    with ws:
        yield np.ones(BIG)


def _enter_through_an_exit_stack(ws):
    with contextlib.ExitStack() as stack:
        stack.enter_context(ws)  # the scope is entered, and exited, by the stack's own frames
        yield np.ones(BIG)


@pytest.mark.parametrize(
    ("produce", "observed"),
    [(_enter_directly, False), (_enter_through_an_exit_stack, False), (_enter_directly, True)],
)
def test_a_generator_finalised_on_another_thread_closes_its_scope(produce, observed, request):
    """Also where a wrapper's frames enter and exit the scope for the generator: an `ExitStack`'s,
    or the cycle observer's, which a workspace gets while the rustws logger is at INFO."""
    if observed:
        log = logging.getLogger("rustws")
        request.addfinalizer(lambda level=log.level: log.setLevel(level))
        log.setLevel(logging.INFO)
    ws = rustws.workspace("GEN", cfg())
    assert isinstance(ws, rustws._workspace._CycleObserver) == observed

    g = produce(ws)
    next(g)
    assert allocate() == (ws, ws)
    errors = []

    def finalise():
        try:
            g.close()
        except rustws.ScopeError as e:  # pragma: no cover - close() reports errors, not raises
            errors.append(e)

    t = threading.Thread(target=finalise)
    t.start()
    t.join()
    # Closing the generator there exited the scope there: it is closed, here too.
    assert not ws.is_open and ws.depth == 0
    assert allocate() == (None, None), "the workspace kept capturing on its thread"
    rustws.destroy_all_workspaces_for_current_thread()
    assert _rustws.get_handler() is _rustws.effective_handler()


@pytest.mark.parametrize("opener", ["with", "loop"])
def test_a_level_nested_in_a_cycle_closed_on_another_thread_ends_with_it(opener):
    """Two generators paused inside a cycle (the first in a `with ws:` or the loop form, the
    second in `with ws:`): the second nests in the first one's cycle. The first, finalised on
    another thread, closes its cycle there; the second's level ended with it, so its exit only
    unwinds, and its next `with ws:` opens a cycle of its own."""
    ws = rustws.workspace(f"GEN_NESTED_{opener}", cfg())

    def gen():
        for _ in range(3):
            with ws:
                yield np.ones(BIG)

    def loop():
        for _ in ws.cycles(range(3)):
            yield np.ones(BIG)

    first, second = [gen() if opener == "with" else loop()], gen()
    next(first[0])
    next(second)
    assert ws.depth == 2 and ws.stats().cycles == 0

    def finalise():
        first[0].close()
        # The last reference goes here too: where `close` keeps a paused generator's locals
        # (CPython 3.12.3, python/cpython#118272), the loop's iterator goes with the generator.
        first.clear()

    t = threading.Thread(target=finalise)
    t.start()
    t.join()
    assert not ws.is_open and ws.depth == 0 and ws.stats().cycles == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = next(second)  # the orphaned level unwinds; the next one opens a cycle
        assert rustws.owner(a) is ws and ws.is_open and ws.depth == 1
        assert allocate() == (ws, ws)
        second.close()
    assert not ws.is_open and ws.depth == 0 and ws.stats().cycles == 2
    assert allocate() == (None, None), "the workspace kept capturing on its thread"


def test_concurrent_tasks_keeping_results_do_not_grow_the_arena_for_them():
    """Tasks interleaved on one workspace keep a cycle open at every moment, so nothing is ever
    pinned: what they keep must still not count as what a cycle needs (it grew region after
    region, to gigabytes of address space and twice the memory kept)."""
    ws = rustws.workspace("TASKS_KEEP")  # the adaptive profile
    kept = []

    async def worker(t):
        for k in range(100):
            with ws:
                x = np.full((100, 100), float(t * 100 + k))
                await asyncio.sleep(0)
                kept.append(x * 2)

    async def main():
        await asyncio.gather(*(worker(t) for t in range(8)))

    asyncio.run(main())
    s = ws.stats()
    assert len(kept) == 800 and all(float(k.min()) == float(k.max()) for k in kept)
    assert sorted(float(k[0, 0]) / 2 for k in kept) == [float(i) for i in range(800)]
    assert s.capacity_bytes < 16 * MiB, f"{len(kept) * 80_000} bytes kept: {s}"


def test_an_outlier_leaves_the_arena_of_tasks_that_keep_cycles_open():
    """The arena grows for a task's outlier and shrinks once it leaves the learner's window, also
    where other tasks keep a cycle open at every moment (their temporaries live in the region)."""
    ws = rustws.workspace("TASKS_OUTLIER")  # the adaptive profile
    seen = {}

    async def worker(t):
        for k in range(200):
            with ws:
                x = np.ones((1 << 21) if (t == 0 and k in (20, 40)) else 4096) * 2
                await asyncio.sleep(0)
                del x
            if t == 0 and k in (41, 199):
                seen[k] = ws.stats().capacity_bytes

    async def main():
        await asyncio.gather(*(worker(t) for t in range(4)))

    asyncio.run(main())
    assert seen[41] >= 16 * MiB, seen  # it grew for the 16 MiB outliers
    assert seen[199] < 4 * MiB, seen  # and shrank while the tasks still ran


def test_a_task_destroyed_while_pending_closes_its_cycle():
    """The coroutine's exit runs where the task is collected, outside the task: it is the exit of
    the frame that entered the scope, so it closes the scope, quietly (an unraisable error would
    fail this test under pytest's filters)."""
    ws = rustws.workspace("ORPHAN", cfg())
    started = []

    async def stuck():
        with ws:
            started.append(np.ones(BIG))
            await asyncio.Event().wait()  # never set

    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(stuck())
        loop.run_until_complete(asyncio.sleep(0.01))
    finally:
        loop.close()  # the task is still pending
    assert started and ws.is_open
    del task  # the task and its coroutine are collected; the coroutine's exit closes the scope
    for _ in range(3):
        gc.collect()
    assert not ws.is_open, "the destroyed task left the workspace open"
    before = ws.stats().cycles
    for _ in range(5):
        with ws:
            np.ones(BIG)
    assert ws.stats().cycles == before + 5


def test_switching_capture_off_acts_inside_the_open_cycle():
    ws = rustws.workspace("SWITCH", cfg())
    with ws:
        assert allocate()[0] is ws
        ws.capture = False
        assert allocate()[0] is None
        ws.capture = True
    assert ws.capture


def test_looking_a_workspace_up_keeps_capture_off():
    ws = rustws.workspace("OFF", cfg(), capture=False)
    assert rustws.workspace("OFF") is ws and not ws.capture
    with ws:
        assert allocate()[0] is None
    assert rustws.workspace("OFF", capture=True).capture


def test_the_loop_form_makes_each_iteration_a_cycle():
    ws = rustws.workspace("LOOP", cfg())
    seen = []
    for i in ws.cycles(range(5)):
        a = np.ones(BIG) * i
        assert rustws.owner(a) is ws and rustws.current_workspace() is ws
        seen.append((i, ws.stats().cycles))
        del a
    assert seen == [(i, i) for i in range(5)]
    assert ws.stats().cycles == 5 and not ws.is_open
    assert rustws.current_workspace() is None and allocate() == (None, None)


def test_leaving_the_loop_form_by_break_or_exception_closes_the_cycle():
    ws = rustws.workspace("BREAK", cfg())
    for i in ws.cycles(range(100)):
        if i == 2:
            break
    assert not ws.is_open and ws.stats().cycles == 3
    assert allocate() == (None, None)
    with pytest.raises(ZeroDivisionError):
        for i in ws.cycles(range(100)):
            if i == 1:
                1 / 0  # noqa: B018
    assert not ws.is_open and ws.stats().cycles == 5
    with pytest.raises(KeyError):
        for _ in ws.cycles({}.__getitem__(k) for k in [1]):  # the iterable itself raises
            pass
    assert not ws.is_open and allocate() == (None, None)


def _generated(items):
    yield from items


@pytest.mark.parametrize("kind", ["range", "list", "tuple", "generator"])
def test_every_iterable_ends_and_reports_each_cycle_at_the_same_point(kind):
    """A range, list or tuple makes its next item without running Python, and the boundary takes
    it first; what a cycle's end reports (here: an array that outlived it) comes at the same point
    for every iterable: before the next iteration's body."""
    ws = rustws.workspace("EVERY", cfg(use_cycle_detector=True))
    wrap = {"range": lambda r: r, "list": list, "tuple": tuple, "generator": _generated}[kind]
    items = wrap(range(4))
    kept, seen = [], []
    with pytest.warns(rustws.EscapedArrayWarning) as rec:
        for i in ws.cycles(items):
            seen.append((i, len(rec), ws.stats().cycles, rustws.owner(np.ones(BIG)) is ws))
            if i % 2 == 0:
                kept.append(np.ones(BIG))  # outlives the cycle: reported at its end
    assert seen == [(0, 0, 0, True), (1, 1, 1, True), (2, 1, 2, True), (3, 2, 3, True)]
    assert len(rec) == 2 and all("outlived cycle" in str(w.message) for w in rec)
    assert ws.stats().cycles == 4 and not ws.is_open and allocate() == (None, None)
    assert all(rustws.owner(a) is ws and (a == 1).all() for a in kept)


@pytest.mark.parametrize("kind", ["range", "generator"])
def test_an_item_is_not_lost_when_its_cycles_start_raises(kind):
    """The end of a cycle can raise (here: an escaped array under RUSTWS_STRICT-like warnings as
    errors); the next item, taken or not, comes with the next call."""
    ws = rustws.workspace("NOLOSS", cfg(use_cycle_detector=True))
    it = ws.cycles(range(4) if kind == "range" else _generated(range(4)))
    seen, kept = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error", rustws.EscapedArrayWarning)
        while True:
            try:
                i = next(it)
            except StopIteration:
                break
            except rustws.EscapedArrayWarning:
                seen.append("reported")
                continue
            seen.append(i)
            if i == 1:
                kept.append(np.ones(BIG))
    assert seen == [0, 1, "reported", 2, 3]
    assert ws.stats().cycles == 4 and not ws.is_open and allocate() == (None, None)


def test_a_lists_items_are_freed_outside_any_cycle():
    """An exhausted list iterator drops its list, and so its items, whose finalisers may
    allocate: that happens outside the loop's last cycle, as every item is made outside one."""
    ws = rustws.workspace("LISTFREE", cfg(use_cycle_detector=True))
    made = []

    class Finalised:
        def __del__(self):
            made.append((rustws.current_workspace(), np.ones(BIG)))

    with warnings.catch_warnings():
        warnings.simplefilter("error", rustws.EscapedArrayWarning)
        for item in ws.cycles([Finalised(), Finalised()]):  # noqa: B007 (kept after the loop)
            pass
    assert len(made) == 1  # the first; the loop variable still holds the second
    del item
    assert len(made) == 2 and all(w is None and rustws.owner(a) is None for w, a in made)


def _orphan_a_with(ws):
    """A loop over `ws` left while a `with ws:` in its body (a paused generator's) is still
    open; returns the generator."""

    def paused():
        with ws:
            yield

    g = paused()
    loop = ws.cycles(range(3))
    next(loop)
    next(g)  # a level nested in the loop's cycle
    assert ws.depth == 2
    with pytest.warns(ResourceWarning, match="unlinked"):
        loop.close_loop()
    return g


def test_a_with_orphaned_by_a_loop_opens_no_level_in_another_threads_cycle():
    ws = rustws.workspace("ORPHAN-THREADS", cfg())
    g = _orphan_a_with(ws)
    started, release = threading.Event(), threading.Event()

    def other():
        with ws:
            started.set()
            release.wait(10)

    t = threading.Thread(target=other)
    t.start()
    try:
        assert started.wait(10)
        with ws:  # a cycle of its own, not a level of the other thread's
            assert allocate() == (ws, ws)
    finally:
        release.set()
        t.join()
    g.close()
    assert ws.stats().cycles == 3 and ws.depth == 0 and rustws.current_workspace() is None


def test_the_iterable_makes_its_items_outside_any_cycle():
    ws = rustws.workspace("ITEMS", cfg())
    made = []

    def batches():
        for _ in range(3):
            made.append((rustws.current_workspace(), ws.depth))
            yield np.ones(BIG)

    for batch in ws.cycles(batches()):
        assert rustws.owner(batch) is None and allocate() == (ws, ws)
    assert made == [(None, 0)] * 3 and ws.stats().cycles == 3


def test_the_loop_form_cannot_be_reentered_from_its_iterable():
    """As a generator cannot be resumed from inside itself: the iterable (or code it runs) that
    advances or closes the loop it feeds gets a ValueError, and the loop goes on unharmed."""
    ws = rustws.workspace("REENTER", cfg())
    loop = []
    errors = []

    def items():
        for i in range(3):
            if i == 1:
                for action in (lambda: next(loop[0]), loop[0].close_loop):
                    with pytest.raises(ValueError, match="already running") as e:
                        action()
                    errors.append(e.value)
            yield i

    loop.append(ws.cycles(items()))
    assert list(loop[0]) == [0, 1, 2] and len(errors) == 2
    assert ws.stats().cycles == 3 and not ws.is_open and allocate() == (None, None)
    assert next(loop[0], "done") == "done"


def test_a_with_left_open_in_a_loop_ends_with_the_loops_cycle():
    """A `with ws:` entered in a loop's body and still open when the loop is left (a generator
    paused inside it) ended with the loop's cycle: a `with ws:` meanwhile opens a cycle of its own
    instead of nesting in none, and the generator's exit only unwinds."""
    ws = rustws.workspace("ORPHAN", cfg())
    g = _orphan_a_with(ws)
    assert ws.depth == 0
    with ws:
        assert ws.depth == 1 and allocate() == (ws, ws)
    g.close()
    assert rustws.current_workspace() is None and allocate() == (None, None)
    assert ws.stats().cycles == 2 and not ws.is_open


def test_a_with_open_across_a_loops_boundary_ends_with_that_cycle():
    """A `with ws:` entered in a loop's cycle and still open when the loop moves on (entered by
    hand, or in a generator advanced beside the loop) nested in the cycle that ended: it ended
    with it, capture goes on in the loop's next cycle, and its exit only unwinds."""
    ws = rustws.workspace("ACROSS", cfg())
    loop = ws.cycles(range(3))
    next(loop)
    ws.__enter__()
    assert ws.depth == 2
    next(loop)
    assert ws.depth == 1 and allocate() == (ws, ws)
    ws.__exit__(None, None, None)  # no error: the level ended with the cycle it nested in
    assert ws.depth == 1 and allocate() == (ws, ws)
    assert list(loop) == [2]
    assert not ws.is_open and ws.depth == 0 and rustws.current_workspace() is None
    assert ws.stats().cycles == 3 and allocate() == (None, None)


def test_a_with_never_exits_a_loops_scope_above_it():
    """A generator holding a `with ws:` advanced beside a loop over `ws` (`zip`): the `with`
    exits while the loop's scope is the innermost one. It unlinks its own scope, with a warning,
    not the loop's: the loop goes on, and once everything closed the workspace is closed and
    every `with ws:` is a cycle again."""
    ws = rustws.workspace("BESIDE", cfg())

    def held(n):
        with ws:
            yield from range(n)

    def looped(n):
        yield from ws.cycles(range(n))

    inner = looped(4)
    with pytest.warns(ResourceWarning, match="unlinked"):
        for i, j in zip(held(3), inner, strict=False):  # `held` ends first
            assert allocate() == (ws, ws) and i == j
    assert ws.stats().cycles == 3  # the `with`'s cycle, and two of the loop's
    assert next(inner) == 3 and allocate() == (ws, ws)
    inner.close()
    assert not ws.is_open and ws.depth == 0 and rustws.current_workspace() is None
    assert allocate() == (None, None)
    before = ws.stats().cycles
    for _ in range(5):
        with ws:
            assert allocate() == (ws, ws)
    assert ws.stats().cycles == before + 5 and not ws.is_open


def test_the_loop_form_nests_in_an_open_cycle_of_another_workspace():
    outer = rustws.workspace("OUTER", cfg())
    inner = rustws.workspace("INNER", cfg())
    with outer:
        for _ in inner.cycles(range(3)):
            assert allocate()[0] is inner
        assert allocate()[0] is outer
    assert inner.stats().cycles == 3 and outer.stats().cycles == 1


def test_a_scope_reopened_in_place_follows_the_capture_switch():
    """A workspace's closed scope stays in place for its next cycle, whether it captures or not;
    switching ``capture`` between cycles makes the next cycle capture as the switch says."""
    ws = rustws.workspace("SWITCH", cfg(), capture=False)
    outer = rustws.workspace("SWITCH-OUTER", cfg())
    with outer:
        for capture in (False, False, True, True, False, True):
            ws.capture = capture
            with ws:
                assert allocate() == ((ws if capture else outer), ws)
            assert allocate() == (outer, outer)  # the closed scope lends what is below it
    assert allocate() == (None, None)
    with ws:
        assert allocate() == (ws, ws)
    assert allocate() == (None, None)
    assert ws.stats().cycles == 7 and outer.stats().cycles == 1


def _close_frees_a_generators_locals() -> bool:
    """Whether ``generator.close()`` frees a paused generator's locals at once. CPython 3.12.3
    (Ubuntu 24.04's) keeps them until the generator itself is freed when nothing in the generator
    handles the exit (python/cpython#118272)."""

    class Probe:
        pass

    def paused(probe):
        yield

    probe = Probe()
    freed = weakref.ref(probe)
    g = paused(probe)
    next(g)
    del probe
    g.close()
    return freed() is None


def test_a_loop_paused_in_a_generator_closes_its_cycle_on_the_thread_that_finalises_it():
    ws = rustws.workspace("GENLOOP", cfg())
    close_frees = _close_frees_a_generators_locals()

    def produce():
        for _ in ws.cycles(range(10)):
            yield np.ones(BIG)

    def produce_in_try():
        try:
            for _ in ws.cycles(range(10)):
                yield np.ones(BIG)
        finally:
            pass

    for how in ("close", "close, the loop in a try", "last reference"):
        holder = [produce_in_try() if "try" in how else produce()]
        next(holder[0])
        assert ws.is_open and allocate() == (ws, ws)
        before = ws.stats().cycles
        target = holder[0].close if how.startswith("close") else holder.clear
        t = threading.Thread(target=target)
        t.start()
        t.join()
        holder.clear()
        if how == "close" and not close_frees:
            # The closed generator still holds the loop's iterator: it is dropped with the
            # generator, here.
            assert ws.is_open
            del target
        # The loop's iterator was dropped: its cycle closed, and this thread is captured no more
        # (it was: the loop's scope stayed open forever).
        assert not ws.is_open and ws.depth == 0, how
        assert ws.stats().cycles == before + 1, how
        assert allocate() == (None, None), how
    rustws.destroy_all_workspaces_for_current_thread()
    assert _rustws.get_handler() is _rustws.effective_handler()


def test_a_loop_in_a_generator_collected_by_the_periodic_gc_thread_closes_its_cycle():
    ws = rustws.workspace("GCLOOP", cfg())

    def produce():
        for _ in ws.cycles(range(10)):
            yield np.ones(BIG)

    g = produce()
    next(g)
    cycle = [g]
    cycle.append(cycle)  # only the cyclic collector frees it
    del g, cycle
    with rustws.gc_window(5):
        deadline = time.monotonic() + 10
        while ws.is_open and time.monotonic() < deadline:
            time.sleep(0.01)
    assert not ws.is_open, "the periodic GC thread collected the loop without closing its cycle"
    assert allocate() == (None, None)


def test_two_loops_over_one_workspace_advanced_in_turn_each_run_cycles():
    ws = rustws.workspace("ZIP", cfg())
    rows = []
    for i, j in zip(ws.cycles(range(4)), ws.cycles(range(10, 14)), strict=True):
        a = np.ones(BIG) * (i + j)
        assert rustws.owner(a) is ws and (a == i + j).all()
        rows.append(ws.depth)
    assert rows == [2, 2, 2, 2], "each loop's iteration is a cycle of its own, both open in the body"
    assert not ws.is_open and ws.depth == 0
    assert ws.stats().cycles == 8
    assert allocate() == (None, None)
    for _ in ws.cycles(range(2)):  # the workspace goes on as before
        assert allocate() == (ws, ws)


def test_a_loop_inside_an_open_cycle_of_its_workspace_runs_cycles_of_its_own():
    ws = rustws.workspace("INLOOP", cfg())
    with ws:
        kept = np.ones(BIG)
        for _ in ws.cycles(range(3)):
            assert ws.depth == 2 and allocate() == (ws, ws)
        assert ws.depth == 1 and allocate() == (ws, ws)
        assert (kept == 1).all()
    assert ws.stats().cycles == 4 and not ws.is_open
    assert allocate() == (None, None)


@pytest.mark.skipif(
    not _rustws.build_info()["scopes_follow_contexts"],
    reason="this interpreter's thread state is unknown to the build: scopes capture on their thread",
)
def test_capture_stays_in_the_task_that_opened_the_scope():
    ws = rustws.workspace("TASKS", cfg())

    async def child():
        await asyncio.sleep(0)
        return allocate()

    async def main():
        seen = []
        with ws:
            t = asyncio.create_task(child())
            seen.append(allocate())
            seen.append(await t)
        with ws:  # the parent reopens its scope in place: the child's copy still sees none of it
            t = asyncio.create_task(child())
            seen.append(await t)
            seen.append(allocate())
        return seen

    here, in_child, in_child_again, here_again = asyncio.run(main())
    assert here == (ws, ws) and here_again == (ws, ws)
    assert in_child == (None, None), "a child task was captured by its parent's scope"
    assert in_child_again == (None, None), "a child task was captured when its parent reopened its scope"


@pytest.mark.skipif(
    not _rustws.build_info()["scopes_follow_contexts"],
    reason="this interpreter's thread state is unknown to the build: scopes capture on their thread",
)
def test_a_copied_context_run_on_the_same_thread_is_not_captured():
    ws = rustws.workspace("SAMECOPY", cfg())
    with ws:
        ctx = contextvars.copy_context()
        assert ctx.run(allocate) == (None, None)
        assert allocate() == (ws, ws)

        # A scope opened inside the copy captures there, and only there.
        def inside():
            with ws:
                return allocate(), ws.depth

        assert ctx.run(inside) == ((ws, ws), 2)
        assert allocate() == (ws, ws)
    assert not ws.is_open
