"""A hypothesis state machine over workspace scopes: nested enter / exit in any order the API
allows, loops in the loop form (over a range, a list or a generator: advanced, exhausted, left by
`break` or closed out of order), explicit and captured allocations filled with a pattern, escapes,
views, detach, leverage and destroy. The invariant: every array still referenced holds its
pattern (no memory is handed out twice), and a scope that exits out of order is unlinked (with a
ResourceWarning) while every other scope stays as it was, NumPy's handler always the innermost
workspace's."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import rustws
from rustws import ResetPolicy, SpillPolicy, WorkspaceConfiguration, _rustws

try:  # NumPy 2
    from numpy._core.multiarray import get_handler_name as handler_name
except ImportError:  # NumPy 1.x
    from numpy.core.multiarray import get_handler_name as handler_name

CONFIGS = {
    "LEARN": WorkspaceConfiguration(),
    "SMALL_FAIL": WorkspaceConfiguration(
        initial_size="64KiB",
        policy_learning="NONE",
        policy_spill=SpillPolicy.FAIL,
        policy_allocation="STRICT",
    ),
    "RING": WorkspaceConfiguration(
        initial_size="128KiB", policy_learning="NONE", policy_reset=ResetPolicy.ENDOFBUFFER_REACHED
    ),
    "GROW": WorkspaceConfiguration(initial_size="16KiB", policy_learning="NONE", policy_spill="REALLOCATE"),
}
NAMES = sorted(CONFIGS)
sizes = st.sampled_from([1, 7, 64, 1000, 4096, 20_000, 70_000])


class Loop:
    """A loop in the loop form the machine is inside: its iterator and the items it has left."""

    def __init__(self, ws: rustws.Workspace, kind: str, length: int) -> None:
        items = {
            "range": range(length),
            "list": list(range(length)),
            "generator": (i for i in range(length)),
        }[kind]
        self.ws = ws
        self.it = ws.cycles(items)
        self.left = length


class ScopeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.stack: list[rustws.Workspace] = []
        self.live: list[tuple[np.ndarray, int]] = []
        self.counter = 0
        self.handler = _rustws.get_handler()

    def ws(self, name: str) -> rustws.Workspace:
        return rustws.workspace(name, CONFIGS[name])

    @staticmethod
    def of(entry: rustws.Workspace | Loop) -> rustws.Workspace:
        return entry.ws if isinstance(entry, Loop) else entry

    def top(self) -> rustws.Workspace | None:
        """The workspace of the innermost scope the machine is in (a `with` or a loop)."""
        return self.of(self.stack[-1]) if self.stack else None

    def pattern(self) -> int:
        self.counter = (self.counter + 1) % 251
        return self.counter

    @rule(name=st.sampled_from(NAMES))
    def enter(self, name):
        if len(self.stack) >= 6:
            return
        ws = self.ws(name)
        ws.__enter__()
        self.stack.append(ws)

    @rule(
        name=st.sampled_from(NAMES),
        kind=st.sampled_from(["range", "list", "generator"]),
        n=st.integers(1, 4),
    )
    def start_loop(self, name, kind, n):
        if len(self.stack) >= 6:
            return
        loop = Loop(self.ws(name), kind, n)
        depth = loop.ws.depth
        assert next(loop.it) == 0
        loop.left -= 1
        assert loop.ws.depth == depth + 1
        self.stack.append(loop)

    @precondition(lambda self: self.stack and isinstance(self.stack[-1], Loop))
    @rule()
    def advance_loop(self):
        """The next iteration: a cycle boundary, or the end of the loop (then it leaves)."""
        loop = self.stack[-1]
        ws = loop.ws
        depth, cycles = ws.depth, ws.stats().cycles
        try:
            item = next(loop.it)
        except rustws.WorkspaceClosedError:
            # Destroyed meanwhile: no cycle opens; the loop ends as `for` ends it, dropping it.
            assert ws.is_destroyed
            self.stack.pop()
            del loop
            return
        except StopIteration:
            assert loop.left == 0
            self.stack.pop()
            if not ws.is_destroyed:
                # Less a level; or more (see `exit_innermost`).
                assert ws.depth < depth and ws.stats().cycles == cycles + 1
            return
        assert item == 0 or loop.left > 0
        loop.left -= 1
        if not ws.is_destroyed:
            # As deep; or less, when this cycle was the last one open and levels nested in a cycle
            # that ended under them (see `exit_innermost`) ended with it.
            assert ws.depth <= depth and ws.stats().cycles == cycles + 1

    @precondition(lambda self: any(isinstance(e, Loop) and not e.ws.is_destroyed for e in self.stack[:-1]))
    @rule(data=st.data())
    def advance_a_loop_under_other_scopes(self, data):
        """A loop advanced while scopes entered after it are still open (a generator holding them,
        advanced beside the loop): levels of its workspace nested in the cycle that ends end with
        it, and their exits only unwind; a loop exhausted there closes its scope where it lies,
        the scopes above it as they were."""
        under = [i for i, e in enumerate(self.stack[:-1]) if isinstance(e, Loop) and not e.ws.is_destroyed]
        i = data.draw(st.sampled_from(under))
        loop = self.stack[i]
        ws = loop.ws
        depth, cycles = ws.depth, ws.stats().cycles
        if loop.left == 0:
            with pytest.raises(StopIteration):
                next(loop.it)
            del self.stack[i]
        else:
            next(loop.it)
            loop.left -= 1
        assert ws.depth <= depth and ws.stats().cycles == cycles + 1

    @precondition(lambda self: self.stack)
    @rule()
    def exit_innermost(self):
        top = self.stack.pop()
        ws = top.ws if isinstance(top, Loop) else top
        depth = ws.depth
        if isinstance(top, Loop):
            top.it.close_loop()  # as `break` does (dropping the iterator)
        else:
            ws.__exit__(None, None, None)  # a destroyed workspace's scope still unwinds
        if not ws.is_destroyed:
            # One level less; or more: levels nested in a cycle that ends end with it. None: a
            # `with` nested in a loop's cycle that ended under it (closed out of order) ended with
            # that cycle, and its exit only unwinds.
            assert ws.depth <= depth

    @precondition(lambda self: len(self.stack) >= 2)
    @rule(data=st.data())
    def exit_out_of_order_unlinks(self, data):
        i = data.draw(st.integers(0, len(self.stack) - 2))
        entry = self.stack[i]
        if entry is self.stack[-1]:
            return
        if isinstance(entry, Loop):
            # A loop closed (its iterator dropped) while scopes opened in its body are still open.
            ws, j = entry.ws, i
            depth = ws.depth
            with pytest.warns(ResourceWarning, match="unlinked"):
                entry.it.close_loop()
        else:
            ws = entry
            # Its innermost `with` goes; a loop's scope above it is the loop's to exit.
            j = max(k for k, e in enumerate(self.stack) if e is ws)
            if j == len(self.stack) - 1:
                return  # the innermost of all: an exit in order
            depth = ws.depth
            with pytest.warns(ResourceWarning, match="unlinked"):
                ws.__exit__(None, None, None)
        del self.stack[j]
        if not ws.is_destroyed:
            if isinstance(entry, Loop):
                # `with` scopes of the workspace nested in the loop's cycle end with it when no
                # other cycle of the workspace stays open.
                others = any(self.of(e) is ws for e in self.stack)
                assert ws.depth < depth and (others or ws.depth == 0)
            else:
                assert ws.depth <= depth  # see `exit_innermost`

    @precondition(lambda self: self.stack)
    @rule(n=sizes)
    def allocate_explicit(self, n):
        ws = self.top()
        p = self.pattern()
        try:
            a = ws.empty(n, np.uint8)
        except rustws.WorkspaceOutOfMemory:
            assert ws.config.policy_spill is SpillPolicy.FAIL
            return
        except rustws.WorkspaceClosedError:
            assert ws.is_destroyed
            return
        a.fill(p)
        if not ws.is_destroyed and ws.debug_mode_name == "DISABLED":
            assert rustws.owner(a) is ws
        self.live.append((a, p))

    @rule(n=sizes)
    def allocate_captured(self, n):
        p = self.pattern()
        try:
            a = np.full(n, p, np.uint8) + np.uint8(0)
        except MemoryError:
            return
        self.live.append((a, p))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def drop(self, data):
        self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def keep_a_view(self, data):
        a, p = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.live.append((a[len(a) // 2 :], p))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def detach(self, data):
        a, p = self.live[data.draw(st.integers(0, len(self.live) - 1))]
        d = rustws.detach(a)
        assert rustws.owner(d) is None
        self.live.append((d, p))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), name=st.sampled_from(NAMES))
    def leverage(self, data, name):
        a, p = self.live[data.draw(st.integers(0, len(self.live) - 1))]
        try:
            moved = rustws.leverage_to(name, a)
        except rustws.WorkspaceOutOfMemory:
            return
        ws = rustws.get_workspace(name)
        if ws is not None and ws.is_open and ws.debug_mode_name == "DISABLED":
            assert rustws.owner(moved) is ws
        else:
            assert moved is a
        self.live.append((moved, p))

    @rule(name=st.sampled_from(NAMES))
    def destroy(self, name):
        ws = rustws.get_workspace(name)
        if ws is not None:
            ws.destroy()

    @invariant()
    def every_live_array_keeps_its_pattern(self):
        with rustws.scope_out_of_workspaces():
            for a, p in self.live:
                assert (a == p).all(), "an array's memory was handed out again"

    @invariant()
    def the_innermost_scope_is_current(self):
        top = self.top()
        assert rustws.current_workspace() is top
        if top is not None and top.debug_mode_name != "BYPASS_EVERYTHING":
            assert handler_name() == f"rustws:{top.id}:{top.name}", "NumPy's handler is not the innermost's"
        elif top is None:
            assert _rustws.effective_handler() is self.handler

    @invariant()
    def statistics_stay_consistent(self):
        for ws in rustws.workspaces():
            s = ws.stats()
            assert s.capacity_bytes == s.used_bytes + s.cached_bytes + s.overhead_bytes

    def teardown(self):
        while self.stack:
            self.exit_innermost()
        for a, p in self.live:
            assert (a == p).all()
        assert rustws.current_workspace() is None
        self.live.clear()
        rustws.destroy_all_workspaces_for_current_thread()


ScopeMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestScopes = ScopeMachine.TestCase
