"""Bad input gets a clear exception naming the argument, as NumPy gives it, never a crash or a
silent surprise; and the cycle detector's traces do not pile up over clean cycles."""

from __future__ import annotations

import numpy as np
import pytest

import rustws
from rustws import WorkspaceConfiguration

MiB = 1 << 20


@pytest.fixture
def ws():
    return rustws.workspace("INPUT", WorkspaceConfiguration(initial_size=MiB, policy_learning="NONE"))


# NumPy 1 reads None as () (with a DeprecationWarning), which `test_numpy_signatures` compares.
_NO_SHAPES = [{}, {2: 3}, set(), (True, 2), True, iter([2, 3]), (2.0,), "3"]
_NO_SHAPES += [None] if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else []


@pytest.mark.parametrize("shape", _NO_SHAPES)
def test_shapes_numpy_refuses_are_refused(ws, shape):
    with pytest.raises(TypeError):
        np.empty(shape)
    with pytest.raises(TypeError, match="shape"):
        ws.empty(shape)
    with pytest.raises(TypeError, match="shape"):
        ws.zeros(shape)


@pytest.mark.parametrize("shape", [3, (2, 3), [2, 3], np.array([2, 3]), (np.int64(4),), ()])
def test_shapes_numpy_takes_are_taken(ws, shape):
    assert ws.empty(shape).shape == np.empty(shape).shape


def test_full_broadcasts_an_array_fill_value_as_numpy_does(ws):
    got = ws.full((2, 2), [1, 2])
    np.testing.assert_array_equal(got, np.full((2, 2), [1, 2]))
    assert got.dtype == np.full((2, 2), [1, 2]).dtype
    got = ws.full((3, 2), np.array([[5.0], [6.0], [7.0]]), dtype=np.float32)
    np.testing.assert_array_equal(got, np.full((3, 2), np.array([[5.0], [6.0], [7.0]]), dtype=np.float32))
    with pytest.raises(ValueError, match="broadcast"):
        ws.full((2, 2), [1, 2, 3])


def test_an_unknown_debug_mode_in_the_environment_is_an_error(monkeypatch):
    monkeypatch.setenv("RUSTWS_DEBUG_MODE", "bogus")
    config = WorkspaceConfiguration(initial_size=MiB)  # the configuration itself is fine
    with pytest.raises(ValueError, match=r"RUSTWS_DEBUG_MODE.*bogus"):
        rustws.workspace("BOGUS", config)
    with pytest.raises(ValueError, match="RUSTWS_DEBUG_MODE"):
        rustws._rustws.env_debug_mode()
    monkeypatch.setenv("RUSTWS_DEBUG_MODE", "Spill")
    ws = rustws.workspace("SPILL", WorkspaceConfiguration(initial_size=MiB))
    assert ws.debug_mode_name == "SPILL_EVERYTHING"


def test_traces_of_clean_cycles_are_not_kept(monkeypatch):
    monkeypatch.setenv("RUSTWS_TRACE", "1")
    ws = rustws.workspace("TRACED", WorkspaceConfiguration(initial_size=MiB, use_cycle_detector=True))
    for _ in range(3000):
        with ws:
            ws.empty(10)
            ws.zeros(10)
    assert len(ws._traces) < 200, "one trace kept per allocation of clean cycles"
    # An escape is still reported with where it was allocated.
    with pytest.warns(ResourceWarning, match="test_bad_input.py"), ws:
        kept = ws.empty(10)
    del kept
