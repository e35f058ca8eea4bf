"""Scopes without a cycle and the rules every scope follows: ``scope_out_of_workspaces``,
``borrow``, ``capture=False``, exits out of order, and exits from another thread."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import rustws
from rustws import (
    WorkspaceConfiguration,
)

MiB = 1 << 20


def cfg(**kw):
    return WorkspaceConfiguration(**kw)


def test_scope_out_of_workspaces():
    ws = rustws.workspace("SO", cfg(initial_size=MiB))
    with ws:
        with rustws.scope_out_of_workspaces():
            assert rustws.current_workspace() is None
            plain = np.ones(100) * 2
        captured = np.ones(100) * 2
    assert rustws.owner(plain) is None
    assert rustws.owner(captured) is ws


def test_borrow_makes_current_without_a_cycle():
    ws = rustws.workspace("BO", cfg(initial_size=MiB))
    with ws.borrow() as b:
        assert b is ws and rustws.current_workspace() is ws and not ws.is_open
        a = np.zeros(10) + 1
        e = ws.empty(5)
    assert ws.generation == 0
    assert rustws.owner(a) is ws and rustws.owner(e) is ws


def test_capture_false_leaves_numpy_alone():
    ws = rustws.workspace("NC", cfg(initial_size=MiB), capture=False)
    with ws:
        a = np.ones(100) + 1
        b = ws.empty(100)
    assert rustws.owner(a) is None and rustws.owner(b) is ws


def test_exiting_a_scope_that_is_not_the_innermost_unlinks_it():
    a = rustws.workspace("OA", cfg(initial_size=MiB))
    b = rustws.workspace("OB2", cfg(initial_size=MiB))
    a.__enter__()
    b.__enter__()
    with pytest.warns(ResourceWarning, match=r"'OA' exited while workspace 'OB2' was the innermost"):
        a.__exit__(None, None, None)
    assert not a.is_open and b.is_open
    assert rustws.current_workspace() is b
    assert rustws.owner(np.ones(4) + 1) is b  # still capturing into b
    b.__exit__(None, None, None)
    assert not a.is_open and not b.is_open
    assert rustws.current_workspace() is None
    with pytest.raises(rustws.ScopeError, match="'OA' is not open"):
        a.__exit__(None, None, None)


@pytest.mark.parametrize("scope", ["cycle", "borrow", "scope_out"])
def test_an_exit_from_another_thread_is_refused_and_changes_nothing(scope):
    ws = rustws.workspace("TH", cfg(initial_size=MiB))
    cm = {"cycle": ws, "borrow": ws.borrow(), "scope_out": rustws.scope_out_of_workspaces()}[scope]
    cm.__enter__()
    inside = rustws.current_workspace()
    errors = []

    def other():
        try:
            cm.__exit__(None, None, None)
        except rustws.ScopeError as e:
            errors.append(str(e))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    # Another thread's exit is refused with ScopeError and changes nothing: the scope is still
    # open here, and its owner's own exit works.
    assert errors and "another thread" in errors[0] and "nothing changed" in errors[0]
    assert rustws.current_workspace() is inside
    assert ws.is_open == (scope == "cycle")
    assert (rustws.owner(np.ones(1000) + 1) is ws) == (scope in ("cycle", "borrow"))
    cm.__exit__(None, None, None)
    assert not ws.is_open and rustws.current_workspace() is None
    assert rustws.owner(np.ones(1000) + 1) is None
    with pytest.raises(rustws.ScopeError, match="not open"):
        cm.__exit__(None, None, None)
