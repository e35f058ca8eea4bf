"""Bad shapes, dtypes, orders and argument types to the allocation functions: each a clear
exception, never a crash."""

from __future__ import annotations

import numpy as np
import pytest

import rustws
from rustws import (
    SpillPolicy,
    WorkspaceConfiguration,
)

MiB = 1 << 20


def cfg(**kw):
    return WorkspaceConfiguration(**kw)


@pytest.mark.parametrize(
    ("shape", "exc"),
    [
        (-1, ValueError),
        ((3, -2), ValueError),
        ((1 << 40, 1 << 40), ValueError),
        ((1 << 62,), (ValueError, MemoryError)),
        ("3", TypeError),
        ((2.5,), TypeError),
        # NumPy 1 reads None as (), with a DeprecationWarning (an error under this suite's filter).
        (None, TypeError if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else DeprecationWarning),
        (object(), TypeError),
        (tuple(range(1, 70)), ValueError),
        (1 << 70, (TypeError, OverflowError, ValueError)),
    ],
)
def test_bad_shapes(shape, exc):
    ws = rustws.workspace("BS", cfg(initial_size=MiB))
    with ws, pytest.raises(exc):
        ws.empty(shape)
    assert ws.stats().used_bytes == 0


@pytest.mark.parametrize("dtype", [object, "O", [("a", "O")], np.dtype([("x", "i4"), ("y", "O")])])
def test_object_dtypes_are_refused(dtype):
    ws = rustws.workspace("OB", cfg(initial_size=MiB))
    with ws:
        for fn in (ws.empty, ws.zeros):
            with pytest.raises(TypeError, match="Python references"):
                fn(3, dtype)
        with pytest.raises(TypeError, match="Python references"):
            ws.full(3, None, dtype)


@pytest.mark.parametrize("dtype", ["nonsense", 3.5, "f16x"])
def test_unknown_dtypes(dtype):
    ws = rustws.workspace("UD", cfg(initial_size=MiB))
    with ws, pytest.raises(TypeError):
        ws.empty(3, dtype)


def test_bad_order():
    ws = rustws.workspace("BO2")
    with ws, pytest.raises(ValueError, match="order"):
        ws.empty(3, order="Z")


@pytest.mark.parametrize(
    ("call", "exc"),
    [
        (lambda: rustws.workspace(5), TypeError),
        (lambda: rustws.workspace(""), ValueError),
        (lambda: rustws.Workspace("", {}), ValueError),
        (lambda: rustws.workspace("X", config=5), TypeError),
        (lambda: rustws.workspace("X", device=0), TypeError),
        (lambda: rustws.workspace("X", device="tpu"), ValueError),
        (lambda: rustws.workspace("X", device="cuda:x"), ValueError),
        (lambda: rustws.workspace("X", capture="yes"), TypeError),
        (lambda: rustws.get_workspace(None), TypeError),
        (lambda: rustws.leverage_to(3, np.ones(2)), TypeError),
    ],
)
def test_wrong_argument_types(call, exc):
    with pytest.raises(exc):
        call()


def test_config_as_dict_is_accepted():
    ws = rustws.workspace("DC", {"initial_size": "1MiB", "policy_spill": "FAIL"})
    assert ws.config.policy_spill is SpillPolicy.FAIL
