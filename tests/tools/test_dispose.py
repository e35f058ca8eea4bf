"""Dispose scopes: unit behaviour and a hypothesis state machine (open, close in any order, create,
move out, detach, dispose everything but) checked against a model, statistics included."""

from __future__ import annotations

import gc
import threading
import warnings

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import rustws
from rustws import DeviceArray, DisposedArrayError, WorkspaceConfiguration


def device_ws():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return rustws.workspace("DISPOSE", WorkspaceConfiguration(initial_size="1MiB"), device="cuda:0")


@pytest.fixture(autouse=True)
def _fresh_counters():
    rustws.dispose_statistics().reset()
    yield


def test_arrays_created_in_a_scope_are_disposed_at_exit_unless_moved_out():
    ws = device_ws()
    with ws, rustws.dispose_scope() as outer:
        with rustws.dispose_scope() as inner:
            a, b, c = ws.zeros(3), ws.zeros(3), ws.zeros(3)
            assert len(inner) == 3 and inner.contains(a) and a in inner
            assert inner.move_to_outer(b) is b
            assert inner.detach(c) is c
        assert a.is_disposed and not b.is_disposed and not c.is_disposed
        assert outer.contains(b) and not outer.contains(c)
    assert b.is_disposed and not c.is_disposed
    s = rustws.dispose_statistics()
    assert (s.created_in_scope, s.disposed_in_scope, s.attached, s.detached) == (3, 2, 1, 1)
    c.dispose()
    assert s.disposed_outside_scope == 1 and s.live == 0


def test_moving_out_of_the_outermost_scope_detaches():
    ws = device_ws()
    with ws, rustws.dispose_scope() as only:
        a = ws.zeros(2)
        only.move_to_outer(a)
    assert not a.is_disposed and rustws.dispose_statistics().detached == 1


def test_dispose_everything_and_everything_but():
    ws = device_ws()
    with ws, rustws.dispose_scope() as scope:
        a, b, c = ws.zeros(1), ws.zeros(1), ws.zeros(1)
        scope.dispose_everything_but(b)
        assert a.is_disposed and c.is_disposed and not b.is_disposed
        assert len(scope) == 1 and scope.contains(b)
        d = ws.zeros(1)
        scope.dispose_everything()
        assert b.is_disposed and d.is_disposed and len(scope) == 0
    with pytest.raises(DisposedArrayError):
        np.asarray(a)


def test_scopes_closed_out_of_order_unlink():
    ws = device_ws()
    with ws:
        s1 = rustws.dispose_scope().__enter__()
        s2 = rustws.dispose_scope().__enter__()
        a = ws.zeros(1)  # in s2
        s1.close()  # out of order: s2 stays open and innermost
        b = ws.zeros(1)
        assert s2.contains(a) and s2.contains(b)
        s2.move_to_outer(b)  # no outer scope any more: detached
        s2.close()
        s2.close()  # harmless
        s1.__exit__(None, None, None)  # harmless too
    assert a.is_disposed and not b.is_disposed
    assert s1.is_closed and s2.is_closed
    with pytest.raises(RuntimeError):
        s1.__enter__()


def test_attach_and_bad_arguments():
    ws = device_ws()
    with ws:
        loose, foreign = ws.zeros(1), ws.zeros(1)
        with rustws.dispose_scope() as scope:
            assert scope.attach(loose) is loose and scope.contains(loose)
            with pytest.raises(TypeError):
                scope.move_to_outer(np.ones(2))
            mine = ws.zeros(1)
            with pytest.raises(ValueError, match="not held"):
                scope.detach(mine, foreign)
            assert scope.contains(mine), "a refused call changes nothing"
    assert rustws.dispose_statistics().attached == 1 and mine.is_disposed and not foreign.is_disposed


def test_scopes_are_per_thread_and_host_arrays_are_not_tracked():
    ws = device_ws()
    seen = {}
    with ws, rustws.dispose_scope() as scope:
        host = ws.zeros(1)
        plain = np.ones(3) * 2  # host NumPy arrays: governed by cycles, not scopes

        def other():
            other_ws = device_ws()
            with other_ws:
                seen["a"] = other_ws.zeros(1)
            seen["stats"] = rustws.dispose_statistics().created_outside_scope

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert len(scope) == 1 and scope.contains(host)
    assert not seen["a"].is_disposed and seen["stats"] == 1
    assert plain.sum() == 6


def test_live_counts_arrays_dropped_without_dispose():
    ws = device_ws()
    with ws:
        a = ws.zeros(1)
    assert rustws.dispose_statistics().live == 1
    del a
    gc.collect()
    assert rustws.dispose_statistics().live == 0


class DisposeMachine(RuleBasedStateMachine):
    """Model: each array is (disposed, scope index or None); scopes are a list of open scopes."""

    def __init__(self) -> None:
        super().__init__()
        self.ws = device_ws()
        self.ws.__enter__()
        gc.collect()  # earlier examples' arrays are gone before the baseline is read
        rustws.dispose_statistics().reset()
        self.base_live = rustws.dispose_statistics().live
        self.open: list[rustws.DisposeScope] = []
        self.arrays: list[DeviceArray] = []
        self.where: dict[int, rustws.DisposeScope | None] = {}
        self.disposed: set[int] = set()
        self.expect = {
            "created_in_scope": 0,
            "created_outside_scope": 0,
            "disposed_in_scope": 0,
            "disposed_outside_scope": 0,
            "attached": 0,
            "detached": 0,
        }

    def _dispose_model(self, a):
        if id(a) in self.disposed:
            return
        self.disposed.add(id(a))
        key = "disposed_in_scope" if self.where[id(a)] is not None else "disposed_outside_scope"
        self.expect[key] += 1
        self.where[id(a)] = None

    @rule()
    def open_scope(self):
        if len(self.open) < 5:
            self.open.append(rustws.dispose_scope().__enter__())

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def close_any(self, data):
        scope = self.open.pop(data.draw(st.integers(0, len(self.open) - 1)))
        for a in self.arrays:
            if self.where.get(id(a)) is scope:
                self._dispose_model(a)
        scope.close()

    @rule()
    def create(self):
        a = self.ws.zeros(2)
        self.arrays.append(a)
        scope = self.open[-1] if self.open else None
        self.where[id(a)] = scope
        self.expect["created_in_scope" if scope else "created_outside_scope"] += 1

    def _held(self):
        return [a for a in self.arrays if self.where.get(id(a)) is not None]

    @precondition(lambda self: any(s is not None for s in self.where.values()))
    @rule(data=st.data())
    def move_out(self, data):
        held = self._held()
        a = held[data.draw(st.integers(0, len(held) - 1))]
        scope = self.where[id(a)]
        i = self.open.index(scope)
        outer = self.open[i - 1] if i > 0 else None
        scope.move_to_outer(a)
        self.where[id(a)] = outer
        self.expect["attached" if outer else "detached"] += 1

    @precondition(lambda self: any(s is not None for s in self.where.values()))
    @rule(data=st.data())
    def detach(self, data):
        held = self._held()
        a = held[data.draw(st.integers(0, len(held) - 1))]
        self.where[id(a)].detach(a)
        self.where[id(a)] = None
        self.expect["detached"] += 1

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def dispose_everything_but(self, data):
        scope = self.open[data.draw(st.integers(0, len(self.open) - 1))]
        mine = [a for a in self.arrays if self.where.get(id(a)) is scope]
        keep = data.draw(st.lists(st.sampled_from(mine), unique_by=id)) if mine else []
        scope.dispose_everything_but(*keep)
        for a in mine:
            if all(a is not k for k in keep):
                self._dispose_model(a)

    @precondition(lambda self: self.arrays)
    @rule(data=st.data())
    def dispose_one(self, data):
        a = self.arrays[data.draw(st.integers(0, len(self.arrays) - 1))]
        a.dispose()
        self._dispose_model(a)

    @invariant()
    def matches_the_model(self):
        for a in self.arrays:
            assert a.is_disposed == (id(a) in self.disposed)
            for s in self.open:
                assert s.contains(a) == (self.where.get(id(a)) is s)
        stats = rustws.dispose_statistics()
        for key, value in self.expect.items():
            assert getattr(stats, key) == value, key
        assert stats.live == self.base_live + len(self.arrays) - len(self.disposed)
        assert sum(len(s) for s in self.open) == len(self._held())

    def teardown(self):
        for s in reversed(self.open):
            s.close()
        for a in self.arrays:
            a.dispose()
        self.ws.__exit__(None, None, None)


DisposeMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestDisposeScopes = DisposeMachine.TestCase
