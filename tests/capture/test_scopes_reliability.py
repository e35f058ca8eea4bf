"""Scopes under Python's control flow: out-of-order exits (a generator finalised while another
scope is innermost), exceptions raised at any point of entering or leaving a scope (as a signal
handler's ``KeyboardInterrupt`` can be), exiting twice, and a state machine over every kind of
scope exited in any order."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import rustws
from rustws import WorkspaceConfiguration, _rustws
from rustws._workspace import _CycleObserver

MiB = 1 << 20


def serving(ws) -> bool:
    """Whether the handler serving NumPy here is ``ws``'s (itself, or a scope lending it)."""
    return effective_name() == f"rustws:{ws.id}:{ws.name}"


def effective_name() -> str | None:
    """The name of the handler serving NumPy here, past closed scopes left in place."""
    return _rustws.handler_name(_rustws.effective_handler())


def cfg(**kw):
    return WorkspaceConfiguration(**{"initial_size": MiB, "policy_learning": "NONE", **kw})


def test_a_generator_finalised_under_another_scope_leaves_nothing_open():
    a = rustws.workspace("GEN-A", cfg())
    b = rustws.workspace("GEN-B", cfg())
    default = _rustws.get_handler()

    def produce():
        with a:
            yield np.ones(3)

    g = produce()
    next(g)
    with b:
        with pytest.warns(ResourceWarning, match="'GEN-A' exited while workspace 'GEN-B'"):
            del g  # closing the generator exits `a` while `b` is innermost
        assert not a.is_open and a.depth == 0
        assert rustws.current_workspace() is b
        assert rustws.owner(np.ones(5) * 2) is b
    assert rustws.current_workspace() is None
    assert _rustws.effective_handler() is default
    assert rustws.owner(np.ones(5) * 2) is None  # `a` captures nothing any more


def test_a_generator_nested_in_the_same_workspace_closed_on_another_thread_leaves_nothing_open():
    # The generator's `with` nests in the outer `with` of the same workspace; the outer block ends
    # first (its cycle with it, the generator's level with the cycle), and the generator is closed
    # on another thread: its exit only unwinds, and nothing stays open or capturing.
    ws = rustws.workspace("GEN-NESTED", cfg())
    default = _rustws.get_handler()

    def produce():
        with ws:
            yield np.arange(1000.0)

    def loop():
        yield from ws.cycles(range(3))

    with pytest.warns(ResourceWarning, match="'GEN-NESTED' exited while a later scope of the same"), ws:
        g, h = produce(), loop()
        kept = next(g)
        next(h)
    assert ws.stats().cycles == 1  # the outer block's cycle ended with it
    errors = []

    def close():
        for gen in (g, h):
            try:
                gen.close()
            except BaseException as e:
                errors.append(e)

    t = threading.Thread(target=close)
    t.start()
    t.join()
    assert errors == []
    assert not ws.is_open and ws.depth == 0
    assert rustws.current_workspace() is None and rustws.owner(np.ones(1 << 16)) is None
    assert _rustws.effective_handler() is default
    assert np.array_equal(kept, np.arange(1000.0))
    with ws:
        assert rustws.owner(np.ones(1 << 16)) is ws
    assert not ws.is_open


def test_each_exit_of_a_frame_and_of_a_generator_takes_its_own_scope():
    # The caller's inner `with` and the generator's nested one are both levels of the caller's
    # cycle: the generator leaving its own (while the caller's inner one is innermost) takes its
    # own, quietly (the levels are alike), and the caller's cycle ends with its outer block only.
    ws = rustws.workspace("OWN-EXITS", cfg())

    def producer():
        with ws:
            yield 1
        yield 2

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ws:
            g = producer()
            next(g)
            with ws:
                next(g)  # the generator's `with` exits under the caller's inner one
            assert ws.is_open and ws.depth == 1
            assert rustws.owner(np.ones(1 << 16)) is ws
        assert not ws.is_open and ws.stats().cycles == 1
    assert rustws.current_workspace() is None and rustws.owner(np.ones(1 << 16)) is None


def test_a_level_whose_cycle_ended_captures_nothing_and_its_exit_leaves_a_later_block_open():
    ws = rustws.workspace("ORPHAN", cfg(policy_spill="FAIL"))

    def producer():
        with ws:
            yield 1

    with pytest.warns(ResourceWarning, match="'ORPHAN' exited while a later scope of the same"), ws:
        g = producer()
        next(g)
    # The outer block's cycle ended with it, and the generator's level with the cycle: nothing
    # outside any cycle is the workspace's (under FAIL it would be refused).
    assert not ws.is_open
    assert rustws.owner(np.ones(1 << 18)) is None
    with ws:
        with pytest.warns(ResourceWarning, match="'ORPHAN' exited while"):
            g.close()  # the generator's exit takes its own ended level, not this block's scope
        assert ws.is_open and rustws.current_workspace() is ws
        assert rustws.owner(np.ones(1 << 16)) is ws
    assert not ws.is_open and rustws.current_workspace() is None


class _Use:
    """A wrapper entering and leaving a workspace from methods of its own, through one helper
    (each entry and exit a frame of the same function, gone once it returns)."""

    kept = None

    def __init__(self, ws):
        self.ws = ws

    def _go(self, on, keep=False):
        try:
            {}["missing"]
        except KeyError as e:
            if keep:
                _Use.kept = e  # its traceback keeps this frame alive for a while
        if on:
            self.ws.__enter__()
        else:
            self.ws.__exit__(None, None, None)

    def __enter__(self):
        self._go(True, keep=not self.ws.is_open)
        return self

    def __exit__(self, *exc):
        self._go(False)


class _Wrap:
    def __init__(self, ws):
        self.ws = ws

    def __enter__(self):
        self.ws.__enter__()
        return self

    def __exit__(self, *exc):
        return self.ws.__exit__(*exc)


def test_scopes_entered_through_wrappers_and_helpers_exit_in_their_own_order():
    ws = rustws.workspace("WRAPPED", cfg())

    def producer():
        with _Wrap(ws):
            yield 1

    # The outer wrapper's exit is the outer block's (called from the frame that called its
    # entry), not the suspended generator's.
    with pytest.warns(ResourceWarning, match="'WRAPPED' exited while a later scope of the same"), _Wrap(ws):
        g = producer()
        next(g)
    assert not ws.is_open and rustws.owner(np.ones(1 << 16)) is None
    g.close()
    # Nested in order through one helper: the frame of a helper that entered a scope and returned
    # is not taken for the one that entered it, so the inner exit's frame (of the same helper, at
    # the same address perhaps) takes the innermost scope.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with _Use(ws):
            with _Use(ws):
                _Use.kept = None  # the outer entry's frame would be freed here
            assert ws.is_open and rustws.owner(np.ones(1 << 16)) is ws
        assert not ws.is_open
    assert rustws.current_workspace() is None


def test_a_loop_left_by_a_return_ends_its_cycle_with_the_function():
    ws = rustws.workspace("RETURNED", cfg())

    def first_step():
        steps = ws.cycles(range(10))
        for step in steps:
            assert rustws.owner(np.ones(1 << 16)) is ws
            return step

    assert first_step() == 0
    # The loop's iterator, a local, went with the function's frame, and its cycle with it.
    assert not ws.is_open and ws.depth == 0 and ws.stats().cycles == 1
    assert rustws.current_workspace() is None


def test_a_frame_that_entered_a_scope_keeps_nothing_alive_once_it_returns():
    ws = rustws.workspace("SESSION", cfg())
    freed = []

    class Marker:
        def __del__(self):
            freed.append(True)

    class Session:
        """Enters its workspace when made, and exits it when freed."""

        def __init__(self):
            ws.__enter__()

        def __del__(self):
            ws.__exit__(None, None, None)

    def setup():
        marker = Marker()  # noqa: F841 - a local of the frame that enters
        ws.__enter__()

    setup()
    assert freed == [True] and ws.is_open
    ws.__exit__(None, None, None)
    session = Session()
    assert ws.is_open
    del session  # nothing else keeps it: not the frame of its `__init__`
    assert not ws.is_open and ws.depth == 0 and ws.stats().cycles == 2
    assert rustws.current_workspace() is None


def test_levels_entered_by_coroutines_and_generators_that_end_first_exit_in_order():
    """A coroutine or a generator that enters or exits by hand and ends at once: its frame goes,
    and a later one takes its address; the exits, in order, still take the innermost level."""
    ws = rustws.workspace("ENDED-HELPERS", cfg())

    async def use(on):
        ws.__enter__() if on else ws.__exit__(None, None, None)

    def use_gen(on):
        ws.__enter__() if on else ws.__exit__(None, None, None)
        yield

    def setup():
        ws.__enter__()

    def levels():
        return ws.depth, rustws.owner(np.ones(1 << 16)) is ws

    async def main():
        for _ in range(10):
            await use(True)
            setup()
            await use(False)
            assert levels() == (1, True)
            await use(False)
            assert levels() == (0, False)
            for _ in use_gen(True):
                setup()
            for _ in use_gen(False):
                assert levels() == (1, True)  # the generator's exit ran before its `yield`
            for _ in use_gen(False):
                pass
            assert levels() == (0, False)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        asyncio.run(main())
    assert not ws.is_open and rustws.current_workspace() is None


def test_unlinking_a_scope_fixes_the_handler_the_scopes_above_restore():
    a = rustws.workspace("FIX-A", cfg())
    b = rustws.workspace("FIX-B", cfg(), capture=False)
    default = _rustws.get_handler()
    a.__enter__()
    b.__enter__()  # does not capture: `a` still serves NumPy
    assert serving(a)
    with pytest.warns(ResourceWarning, match="unlinked"):
        a.__exit__(None, None, None)
    # No scope above `a` installs a handler: NumPy's default is back at once.
    assert effective_name() == "default_allocator"
    assert rustws.current_workspace() is b
    b.__exit__(None, None, None)
    assert _rustws.effective_handler() is default

    c = rustws.workspace("FIX-C", cfg())
    a.__enter__()
    c.__enter__()
    with pytest.warns(ResourceWarning, match="unlinked"):
        a.__exit__(None, None, None)
    assert serving(c)
    c.__exit__(None, None, None)  # restores what `a` had replaced, not `a`'s handler
    assert _rustws.effective_handler() is default
    assert rustws.current_workspace() is None


def test_a_second_exit_says_not_open():
    ws = rustws.workspace("TWICE", cfg())
    ws.__enter__()
    ws.__exit__(None, None, None)
    with pytest.raises(rustws.ScopeError, match=r"'TWICE' is not open"):
        ws.__exit__(None, None, None)
    s = rustws.scope_out_of_workspaces()
    with s:
        pass
    with pytest.raises(rustws.ScopeError, match=r"scope_out_of_workspaces\(\) is not open"):
        s.__exit__(None, None, None)


class _InterruptAt:
    """A trace function that raises ``KeyboardInterrupt`` at the ``n``-th Python line run while it
    is set (as a signal handler's can land between any two lines)."""

    def __init__(self, n: int) -> None:
        self.n, self.lines = n, 0

    def __call__(self, frame, event, arg):
        if event == "line":
            self.lines += 1
            if self.lines == self.n:
                raise KeyboardInterrupt
        return self

    def run(self, call) -> bool:
        """Runs ``call()`` under it; returns whether it ran to its end without the interrupt."""
        sys.settrace(self)
        try:
            call()
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        return self.lines < self.n


def _interrupt_at_every_line(factory) -> list[int]:
    """Runs ``with factory(): pass`` once per Python line it executes, raising
    ``KeyboardInterrupt`` at that line; returns the runs that left a scope behind."""
    default = _rustws.get_handler()
    leaked = []
    for n in range(1, 40):
        # Set in this frame, the trace function sees the lines of the frames called from here
        # (the scopes' Python, if any), not the `with` statement's own.
        sys.settrace(_InterruptAt(n))
        try:
            with factory():
                pass
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        if _rustws.current_workspace() is not None or _rustws.effective_handler() is not default:
            leaked.append(n)
            _rustws.set_handler(default)
    return leaked


def test_an_exception_anywhere_in_scope_out_of_workspaces_leaves_no_scope():
    assert _interrupt_at_every_line(rustws.scope_out_of_workspaces) == []


def test_an_exception_anywhere_in_borrow_leaves_no_scope():
    ws = rustws.workspace("ATOMIC", cfg())
    assert _interrupt_at_every_line(ws.borrow) == []
    assert not ws.is_open


def test_an_exception_anywhere_in_a_cycle_leaves_no_scope():
    ws = rustws.workspace("ATOMIC-CYCLE", cfg())
    assert _interrupt_at_every_line(lambda: ws) == []
    assert not ws.is_open and ws.depth == 0


def test_an_exception_anywhere_in_an_observed_cycle_leaves_no_scope(caplog):
    # With the rustws logger at DEBUG a workspace's cycles are logged (observed), the page faults
    # of each opening too; no Python runs between the bindings' opening and the `with` block,
    # where an exception (a logging filter's, a Ctrl-C) would leave the cycle open.
    with caplog.at_level(logging.DEBUG, logger="rustws"):
        ws = rustws.workspace("ATOMIC-OBSERVED", cfg())
        assert isinstance(ws, _CycleObserver)
        assert type(ws).__enter__ is _rustws.WorkspaceCore.__enter__
        assert type(ws).__exit__ is _rustws.WorkspaceCore.__exit__
        assert _interrupt_at_every_line(lambda: ws) == []
        assert not ws.is_open and ws.depth == 0
        with ws:
            np.ones(1 << 16)
    assert ws.stats().cycles > 0


def _interrupt_at_every_line_of(call) -> int:
    """Runs ``call()`` once per Python line it executes, raising ``KeyboardInterrupt`` at that
    line, and checks after each run that the workspace current here and NumPy's handler are what
    they were before; returns the runs made."""
    before = (_rustws.current_workspace(), _rustws.effective_handler())
    for n in range(1, 400):
        finished = _InterruptAt(n).run(call)
        after = (_rustws.current_workspace(), _rustws.effective_handler())
        assert after[0] is before[0] and after[1] is before[1], f"interrupted at line {n}"
        if finished:  # no line left to interrupt
            return n
    raise AssertionError("the call never ran to its end")


def test_an_exception_anywhere_in_numpy_made_arrays_or_detach_leaves_the_handler_as_it_was():
    # `ws.asarray`, `*_like` of a subclass and `detach` run NumPy with a handler of their choice
    # for the call: the bindings switch it and back in one step, so an exception at any line
    # (a signal handler's `KeyboardInterrupt`) cannot leave it switched.
    ws = rustws.workspace("ATOMIC-HANDLER", cfg())

    class Sub(np.ndarray):
        pass

    sub, kept = np.arange(64.0).view(Sub), np.arange(64.0)
    calls = (lambda: ws.asarray([1.0, 2.0]), lambda: ws.full_like(sub, 2.0), lambda: rustws.detach(kept))
    assert all(_interrupt_at_every_line_of(call) > 1 for call in calls)
    # Inside a cycle opened and closed by calls from frames of their own (a setup and a teardown).
    ws.__enter__()
    assert all(_interrupt_at_every_line_of(call) > 1 for call in calls)
    assert rustws.owner(rustws.detach(kept)) is None and rustws.owner(ws.asarray([1.0, 2.0])) is ws
    ws.__exit__(None, None, None)
    assert not ws.is_open and rustws.current_workspace() is None
    assert rustws.owner(np.ones(1 << 16)) is None


def test_borrow_and_scope_out_nest_and_restore():
    ws = rustws.workspace("NEST", cfg())
    default = _rustws.get_handler()
    with ws.borrow() as w:
        assert w is ws and rustws.current_workspace() is ws
        assert rustws.owner(np.ones(4) + 1) is ws
        with rustws.scope_out_of_workspaces() as nothing:
            assert nothing is None and rustws.current_workspace() is None
            assert rustws.owner(np.ones(4) + 1) is None
        assert rustws.current_workspace() is ws
    assert _rustws.effective_handler() is default
    assert not ws.is_open


def test_a_borrow_exited_out_of_order_is_unlinked():
    a = rustws.workspace("BOR-A", cfg())
    b = rustws.workspace("BOR-B", cfg())
    scope = a.borrow()
    scope.__enter__()
    with b, pytest.warns(ResourceWarning, match=r"borrow\(\) of workspace 'BOR-A'"):
        scope.__exit__(None, None, None)
    assert rustws.current_workspace() is None


def test_scope_objects_lend_only_what_the_bindings_choose():
    # The binding's scope object takes no handler from Python: a workspace's scope comes from the
    # workspace (``borrow()``), the bare one lends NumPy's default.
    with pytest.raises(TypeError):
        _rustws.Scope(None, True, "not a capsule")  # type: ignore[call-arg]
    ws = rustws.Workspace("LEND", {})
    with ws.borrow() as inside:
        assert inside is ws and rustws.current_workspace() is ws
        a = np.ones(1 << 16)
        with _rustws.Scope() as none:
            assert none is None and rustws.current_workspace() is None
            b = np.ones(1 << 16)
    assert rustws.owner(a) is ws and rustws.owner(b) is None
    ws.destroy()
    with pytest.raises(rustws.WorkspaceClosedError, match="LEND"):
        ws.borrow()


# -- a state machine over every kind of scope, exited in any order -----------------------------------

KINDS = ("cycle", "borrow", "out")
SPACES = {"CAP-A": True, "CAP-B": True, "QUIET": False}  # name -> capture


class ScopeStack(RuleBasedStateMachine):
    """Cycles, ``borrow()`` and ``scope_out_of_workspaces()`` entered in any nesting and exited in
    any order. The model: the stack of entries; the innermost workspace is current; NumPy serves
    from the innermost entry that installs a handler (a capturing cycle or borrow, or a
    ``scope_out_of_workspaces``), else from its default; each workspace's depth counts its cycles."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[tuple[str, rustws.Workspace | None, object]] = []

    def space(self, name: str) -> rustws.Workspace:
        return rustws.workspace(name, cfg(), capture=SPACES[name])

    @precondition(lambda self: len(self.entries) < 8)
    @rule(kind=st.sampled_from(KINDS), name=st.sampled_from(sorted(SPACES)))
    def enter(self, kind, name):
        ws = self.space(name)
        if kind == "cycle":
            ws.__enter__()
            self.entries.append((kind, ws, ws))
        elif kind == "borrow":
            scope = ws.borrow()
            scope.__enter__()
            self.entries.append((kind, ws, scope))
        else:
            scope = rustws.scope_out_of_workspaces()
            scope.__enter__()
            self.entries.append((kind, None, scope))

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def exit_any(self, data):
        i = data.draw(st.integers(0, len(self.entries) - 1))
        kind, ws, key = self.entries[i]
        # A cycle's exit takes its workspace's innermost cycle; a scope object is its own key.
        j = max(k for k, e in enumerate(self.entries) if e[2] is key and e[0] == kind)
        exiting = key if kind != "cycle" else ws
        if j == len(self.entries) - 1:
            exiting.__exit__(None, None, None)
        else:
            with pytest.warns(ResourceWarning, match="unlinked"):
                exiting.__exit__(None, None, None)
        del self.entries[j]

    @rule()
    def allocate(self):
        a = np.ones(100) + 1
        assert rustws.owner(a) is self.serving()

    def serving(self) -> rustws.Workspace | None:
        for kind, ws, _ in reversed(self.entries):
            if kind == "out":
                return None
            if ws is not None and ws.capture:
                return ws
        return None

    @invariant()
    def the_model_holds(self):
        top = self.entries[-1][1] if self.entries else None
        assert rustws.current_workspace() is top
        ws = self.serving()
        if ws is None:
            assert effective_name() == "default_allocator"
        else:
            assert serving(ws)
        for name in SPACES:
            w = rustws.get_workspace(name)
            if w is not None:
                assert w.depth == sum(1 for k, e, _ in self.entries if k == "cycle" and e is w)

    def teardown(self):
        while self.entries:
            kind, ws, key = self.entries.pop()
            (key if kind != "cycle" else ws).__exit__(None, None, None)
        assert rustws.current_workspace() is None


ScopeStack.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestScopeStack = ScopeStack.TestCase
