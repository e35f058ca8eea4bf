"""Explicit allocation: real ndarrays over workspace memory, zeros over reused memory, every
dtype, empty arrays; and the helpers that move arrays out of and between workspaces."""

from __future__ import annotations

import numpy as np
import pytest

import rustws
from rustws import (
    WorkspaceConfiguration,
)

MiB = 1 << 20


def cfg(**kw):
    return WorkspaceConfiguration(**kw)


def test_allocation_functions_return_real_ndarrays_over_workspace_memory():
    ws = rustws.workspace("AF", cfg(initial_size=MiB))
    with ws:
        e = ws.empty((3, 4), np.float32)
        z = ws.zeros((5,), "int16")
        f = ws.full((2, 2), 7.5)
        fl = ws.full(3, 2, dtype=np.uint8)
        el = ws.empty_like(z)
        zl = ws.zeros_like(np.ones((2, 3), order="F"))
        d = ws.empty(4)
    for a in (e, z, f, fl, el, zl, d):
        assert type(a) is np.ndarray
        assert rustws.owner(a) is ws
        assert a.ctypes.data % 64 == 0
    assert e.shape == (3, 4) and e.dtype == np.float32
    assert z.dtype == np.int16 and not z.any()
    assert f.dtype == np.float64 and (f == 7.5).all()
    assert fl.dtype == np.uint8 and (fl == 2).all()
    assert el.shape == (5,) and el.dtype == np.int16
    assert zl.flags.f_contiguous and not zl.any()
    assert d.dtype == np.float64
    assert rustws.owner(e[1:, ::2]) is ws
    assert ws.empty((2, 3), order="F").flags.f_contiguous


def test_zeros_are_zero_even_over_reused_memory():
    ws = rustws.workspace("Z", cfg(initial_size=MiB))
    for _ in range(3):
        with ws:
            a = ws.full(10_000, 255, np.uint8)
            del a
            z = ws.zeros(10_000, np.uint8)
            assert not z.any()
            del z


@pytest.mark.parametrize(
    "dtype",
    ["bool", "int8", "uint64", "float16", "complex128", "S5", "U3", "M8[s]", [("a", "i4"), ("b", "f8")]],
)
def test_many_dtypes(dtype):
    ws = rustws.workspace("DT", cfg(initial_size=MiB))
    with ws:
        a = ws.zeros((4, 3), dtype)
        assert a.dtype == np.dtype(dtype) and a.shape == (4, 3)
        np.testing.assert_array_equal(a, np.zeros((4, 3), dtype))


def test_zero_size_arrays():
    ws = rustws.workspace("Z0", cfg(initial_size=MiB))
    with ws:
        for shape in [(0,), (3, 0), ()]:
            a = ws.empty(shape)
            assert a.shape == shape
        assert ws.empty(()).ndim == 0


def test_detach_makes_an_independent_ordinary_copy():
    ws = rustws.workspace("DE", cfg(initial_size=MiB))
    with ws:
        a = ws.full(10, 1.0)
        d = rustws.detach(a)
        assert rustws.owner(d) is None
        a[0] = 5
        assert d[0] == 1.0
        assert rustws.owner(rustws.detach([1, 2, 3])) is None
        m = rustws.detach(np.ma.masked_array([1, 2], mask=[0, 1]))
        assert isinstance(m, np.ma.MaskedArray)


def test_leverage_to():
    src = np.arange(6.0).reshape(2, 3)
    assert rustws.leverage_to("NOPE", src) is src
    with pytest.raises(rustws.NoSuchWorkspaceError, match="NOPE") as info:
        rustws.leverage_to("NOPE", src, enforce_existence=True)
    assert isinstance(info.value, KeyError)
    outer = rustws.workspace("OUT", cfg(initial_size=MiB))
    inner = rustws.workspace("IN", cfg(initial_size=MiB))
    with outer:
        with inner:
            t = np.ones(4) * 2
            assert rustws.owner(t) is inner
            moved = rustws.leverage_to("OUT", t)
        assert rustws.owner(moved) is outer
        np.testing.assert_array_equal(moved, [2, 2, 2, 2])
    # a closed workspace does not receive copies
    assert rustws.leverage_to("OUT", src) is src


def test_owner_follows_base_and_knows_foreign_arrays():
    assert rustws.owner(np.ones(3)) is None
    assert rustws.owner([1, 2]) is None
    assert rustws.owner(np.frombuffer(b"abcd", np.uint8)) is None
    ws = rustws.workspace("OW", cfg(initial_size=MiB))
    with ws:
        a = ws.empty((4, 4))
    assert rustws.owner(a.T[1:]) is ws
    assert rustws.owner(a.reshape(16).view(np.int64)) is ws


def test_explicit_arrays_take_every_shape_length_and_scalar_type_as_numpy_does():
    """Shapes of more dimensions than a shape keeps inline, and dtypes given as NumPy scalar types
    (read directly) or anything else (NumPy's converter), give what ``np.empty`` gives."""
    ws = rustws.workspace("SHAPES")
    most = 64 if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else 32  # NumPy's own maximum
    for n in (0, 1, 7, 8, 9, 12, most):
        shape = tuple(3 if i < 4 else 1 for i in range(n))
        assert ws.empty(shape, np.int8).shape == np.empty(shape, np.int8).shape
        assert ws.zeros(list(shape), np.int8).shape == shape
    for make in (np.empty, ws.empty, ws.zeros):
        with pytest.raises(ValueError, match="dimension"):
            make((1,) * (most + 1), np.int8)
    for dt in (
        np.float32,
        np.int8,
        np.bool_,
        np.complex128,
        np.str_,
        np.bytes_,
        np.void,
        np.datetime64,
        float,
        int,
        "f4",
        np.dtype(">i4"),
    ):
        assert ws.empty((3, 2), dt).dtype == np.empty((3, 2), dt).dtype, dt
    with pytest.raises(ValueError, match="more than 64"):
        ws.empty((1,) * 65)
    with pytest.raises(TypeError, match="holds Python objects"):
        ws.empty(3, np.object_)


def test_vectors_of_4_to_128_kib_start_512_bytes_or_more_into_a_page():
    # Where a kernel writes a vector while it reads a large array's rows, 4 KiB apart, stores that
    # fall 16 to 192 bytes behind the rows' page offset alias their loads: an SGD step's
    # `X.T @ r` ran a sixth slower with its gradient 192 bytes into a page. The arena (learned
    # from the first cycles, served outside it) starts blocks of 4 KiB to 128 KiB at
    # least 512 bytes into one; smaller ones pack as they come, larger ones start on a page.
    ws = rustws.workspace("colour")
    x = np.ones(1000, np.float32)
    for cycle in ws.cycles(range(4)):
        small = [np.empty(n, np.float32) for n in (100, 1000)]
        vectors = [x[:1] + np.zeros(n, np.float32) for n in (1024, 1025, 4096, 4097, 16_384, 30_000)]
        large = np.empty(64 << 10, np.float32)
        if cycle > 1:
            assert ws.stats().capacity_bytes > 0
            for v in vectors:
                assert v.ctypes.data % 4096 >= 512, (v.nbytes, v.ctypes.data % 4096)
            assert large.ctypes.data % 4096 == 0
        del small, vectors, large
