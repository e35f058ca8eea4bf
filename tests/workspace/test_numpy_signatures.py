"""Workspaces speak NumPy: ``ones``, ``*_like(a, dtype, order, subok, shape)``, ``full_like``,
``asarray`` with NumPy's results (values, dtype, layout, subclass), and every rustws API that
copies an array keeps its ndarray subclass, as ``np.copy(subok=True)`` does."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import rustws

# NumPy's own warning whenever np.matrix is built (its `*` included); rustws warns about nothing here.
pytestmark = pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")

CFG = rustws.WorkspaceConfiguration(initial_size="4MiB", policy_spill="REALLOCATE")


class Tagged(np.ndarray):
    """A user subclass whose attribute travels through ``__array_finalize__``."""

    def __array_finalize__(self, obj):
        self.tag = getattr(obj, "tag", None)


def _masked():
    return np.ma.MaskedArray([1.0, 2.0, 1000.0], mask=[False, False, True])


def _matrix():
    # A view: np.matrix(...) itself warns (PendingDeprecationWarning) on construction.
    return np.array([[1.0, 2.0], [3.0, 4.0]]).view(np.matrix)


def _tagged():
    t = np.arange(4.0).view(Tagged)
    t.tag = "kept"
    return t


SUBCLASSES = {"MaskedArray": _masked, "matrix": _matrix, "user subclass": _tagged}


def _same_meaning(copy, original):
    """The copy behaves as the original: its type, and what the subclass is for."""
    assert type(copy) is type(original)
    assert not np.shares_memory(np.asarray(copy), np.asarray(original))
    if isinstance(original, np.ma.MaskedArray):
        assert copy.sum() == 3.0 and list(copy.mask) == [False, False, True]
    elif isinstance(original, np.matrix):
        assert (np.asarray(copy * copy) == [[7.0, 10.0], [15.0, 22.0]]).all()  # matrix product
    else:
        assert copy.tag == "kept" and (np.asarray(copy) == np.arange(4.0)).all()


@pytest.mark.parametrize("make", SUBCLASSES.values(), ids=SUBCLASSES.keys())
def test_every_copying_api_keeps_the_subclass(make):
    ws = rustws.workspace("TARGET", CFG)
    mgr = rustws.LayerWorkspaceMgr.builder().default_workspace("TARGET", CFG).build()
    other = rustws.workspace("OTHER", CFG)
    original = make()  # in ordinary memory
    with ws:
        results = {
            "rustws.leverage_to": rustws.leverage_to("TARGET", original),
            "mgr.dup": mgr.dup(rustws.ArrayType.ACTIVATIONS, original),
            "mgr.leverage_to": mgr.leverage_to(rustws.ArrayType.ACTIVATIONS, original),
            "ws.empty_like + copy": ws.empty_like(original),
        }
        results["ws.empty_like + copy"][...] = original
        if isinstance(original, np.ma.MaskedArray):
            results["ws.empty_like + copy"].mask = original.mask
        with other:
            elsewhere = other._copy_of(original)
        act = rustws.ArrayType.ACTIVATIONS
        migrated = mgr.validate_array_location(act, elsewhere, migrate_if_invalid=True)
        results["mgr.validate_array_location(migrate)"] = migrated
        for what, copy in results.items():
            assert rustws.owner(copy) is ws, what
            _same_meaning(copy, original)
        _same_meaning(rustws.detach(results["mgr.dup"]), original)
        assert rustws.owner(rustws.detach(results["mgr.dup"])) is None
    with rustws.AsyncPrefetch([make() for _ in range(3)]) as it:
        for item in it:
            assert rustws.owner(item) is it.workspace
            _same_meaning(item, original)


@pytest.mark.parametrize("make", SUBCLASSES.values(), ids=SUBCLASSES.keys())
@pytest.mark.parametrize("subok", [True, False])
@pytest.mark.parametrize("kind", ["empty_like", "zeros_like", "ones_like", "full_like"])
def test_like_functions_keep_subclasses_as_numpy_does(make, subok, kind):
    ws = rustws.workspace("LIKE", CFG)
    a = make()
    args = (a, 7.0) if kind == "full_like" else (a,)
    with ws:
        got = getattr(ws, kind)(*args, subok=subok)
        want = getattr(np, kind)(*args, subok=subok)
        assert type(got) is type(want) and got.shape == want.shape and got.dtype == want.dtype
        assert rustws.owner(got) is ws
        if kind != "empty_like":
            assert (np.asarray(got) == np.asarray(want)).all()
        if isinstance(want, Tagged):
            assert got.tag == want.tag == "kept"


def _prototypes():
    base = np.arange(24.0).reshape(2, 3, 4)
    return {
        "C": base,
        "F": np.asfortranarray(base),
        "strided": base.transpose(2, 0, 1),  # neither C nor F: "K" keeps its axis order
        "list": [[1, 2], [3, 4]],
        "int32 F": np.asfortranarray(base.astype(np.int32)),
    }


@pytest.mark.parametrize("proto", _prototypes().values(), ids=_prototypes().keys())
@pytest.mark.parametrize("order", ["K", "A", "C", "F"])
@pytest.mark.parametrize("shape", [None, (6, 4), 5])
@pytest.mark.parametrize("dtype", [None, np.float32])
def test_like_functions_match_numpy_layouts(proto, order, shape, dtype):
    ws = rustws.workspace("LIKE", CFG)
    with ws:
        for kind in ("empty_like", "zeros_like", "ones_like", "full_like"):
            extra = (3,) if kind == "full_like" else ()
            got = getattr(ws, kind)(proto, *extra, dtype=dtype, order=order, shape=shape)
            want = getattr(np, kind)(proto, *extra, dtype=dtype, order=order, shape=shape)
            assert (got.shape, got.dtype, got.strides) == (want.shape, want.dtype, want.strides), kind
            assert type(got) is np.ndarray and rustws.owner(got) is ws
            if kind != "empty_like":
                assert (got == want).all()


def _outcome(make, *args):
    try:
        return make(*args)
    except Exception as e:  # NumPy's refusal, which the workspace must match
        return type(e)


def _warned(make, *args):
    """The outcome of ``make(*args)`` and the categories of the warnings it gave (NumPy 1's
    deprecations among them, which the workspace must give as NumPy does)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcome = _outcome(make, *args)
    return outcome, sorted({w.category.__name__ for w in caught})


_FILL_PROTOTYPES = {
    "str": np.array(["ab", "cd"]),
    "bytes": np.array([b"ab", b"cd"]),
    "bool": np.array([True, False]),
    "complex64": np.arange(3, dtype=np.complex64),
    "datetime64": np.array(["2020-01-01", "2021-06-30"], dtype="datetime64[D]"),
    "uint8": np.arange(4, dtype=np.uint8),
    "masked str": np.ma.array(["ab", "cd"], mask=[False, True]),
}


@pytest.mark.parametrize("proto", _FILL_PROTOTYPES.values(), ids=_FILL_PROTOTYPES.keys())
@pytest.mark.parametrize("fill", [0, 1, 0.0, True, -1, "7"], ids=repr)
def test_like_functions_fill_every_dtype_as_numpy_does(proto, fill):
    # A zero fill is no zeroed memory for strings ("0", not ""), and zeros_like of strings is "".
    ws = rustws.workspace("FILL", CFG)
    with ws:
        for kind, args in (("zeros_like", (proto,)), ("ones_like", (proto,)), ("full_like", (proto, fill))):
            got = _outcome(getattr(ws, kind), *args)
            want = _outcome(getattr(np, kind), *args)
            if isinstance(want, type):
                assert got is want, (kind, got)
                continue
            assert type(got) is type(want) and got.dtype == want.dtype, kind
            assert np.array_equal(np.asarray(got), np.asarray(want)), (kind, got, want)


def _same_array(got, want):
    if type(got) is not type(want) or got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.dtype.kind in "mM":  # NaT is unequal to itself
        return np.array_equal(got.view("i8"), want.view("i8"))
    return np.array_equal(got, want, equal_nan=got.dtype.kind in "fc")


_DTYPES = [None, np.uint8, np.int32, np.int64, np.float16, np.float32, np.complex64, bool]
_DTYPES += ["<U3", "S3", "M8[D]", "m8[s]"]


@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::numpy.exceptions.ComplexWarning")
@pytest.mark.parametrize("dtype", _DTYPES, ids=repr)
def test_full_converts_every_fill_as_numpy_does(dtype):
    # NaN, infinities and complex numbers into integers, datetimes into integers, out-of-range
    # integers: whatever NumPy's unsafe copy makes of them, or the error it raises.
    fills = [0, 1, -1, 300, -(2**63), 2049, 2.5, -0.0, np.nan, np.inf, 1e300, 1 + 2j, True, False]
    fills += ["7", b"7", np.float64(2.5), np.int64(-1), np.datetime64("2020-01-01"), [1, 2], np.array(3)]
    ws = rustws.workspace("FULL", CFG)
    with ws:
        for fill in fills:
            for shape in [(2,), ()]:
                got, got_warnings = _warned(ws.full, shape, fill, dtype)
                want, want_warnings = _warned(np.full, shape, fill, dtype)
                # Before an error, what warned depends on the order the arguments are read in.
                if not isinstance(want, type):
                    assert got_warnings == want_warnings, (fill, shape, got_warnings, want_warnings)
                if isinstance(want, type) or isinstance(got, type):
                    assert got is want, (fill, shape, got, want)
                else:
                    assert _same_array(got, want), (fill, shape, got, want)


_SHAPES = [(), 0, 3, (2, 3), [2, 3], (0, 5), (2, 0, 3), np.int64(4), (np.int32(2), 3), np.array(3)]
_SHAPES += [np.array([2, 3]), -1, (2, -1), 2.0, (2.0,), "3", None, True, (2, (3,)), (1 << 40, 1 << 40)]
_NEW_DTYPES = [None, float, int, np.float32, ">f8", "<i2", np.dtype([("a", "i4"), ("b", "f8")]), "U3"]
_NEW_DTYPES += ["S0", "V8", "M8", "m8[ms]", "nonsense", complex, bool, "float64,float32"]


@pytest.mark.parametrize("kind", ["empty", "zeros", "ones"])
def test_new_arrays_read_shapes_dtypes_and_orders_as_numpy_does(kind):
    # The same array (dtype, shape, strides: NumPy's zero strides for no elements), or the same
    # error; NumPy's MemoryError is the workspace's, a MemoryError too.
    ws = rustws.workspace("NEW", CFG)
    with ws:
        for shape in _SHAPES:
            for dtype in _NEW_DTYPES:
                for order in ["C", "F", "A", "K", "c", "f", None, "X", 1]:
                    got, got_warnings = _warned(getattr(ws, kind), shape, dtype, order)
                    want, want_warnings = _warned(getattr(np, kind), shape, dtype, order)
                    case = (shape, dtype, order, got, want, got_warnings, want_warnings)
                    if not isinstance(want, type):  # before an error, as above
                        assert got_warnings == want_warnings, case
                    if isinstance(want, type) and issubclass(want, MemoryError):
                        assert isinstance(got, type) and issubclass(got, MemoryError), case
                    elif isinstance(want, type) or isinstance(got, type):
                        assert got is want, case
                    else:
                        assert got.strides == want.strides and got.flags.owndata, case
                        assert kind == "empty" or _same_array(got, want) or got.dtype.names, case
                        assert got.size == 0 or rustws.owner(got) is ws or got.nbytes < 1024, case


@pytest.mark.filterwarnings("ignore::numpy.exceptions.ComplexWarning")
@pytest.mark.parametrize("value", [3, -1, 2.5, 1 + 2j, True, "7", b"7", [1 + 2j], (2.5,)], ids=repr)
@pytest.mark.parametrize("dtype", [None, np.float32, "i2", "U2", "c8", "M8[s]"], ids=repr)
def test_asarray_converts_python_values_as_numpy_does(value, dtype):
    # A scalar's conversion is no array's cast: a complex number is no float, a float no datetime.
    ws = rustws.workspace("AS", CFG)
    with ws:
        got = _outcome(ws.asarray, value, dtype)
        want = _outcome(np.asarray, value, dtype)
        if isinstance(want, type) or isinstance(got, type):
            assert got is want, (got, want)
        else:
            assert _same_array(got, want), (got, want)


def test_ones_and_asarray():
    ws = rustws.workspace("NP", CFG)
    with ws:
        o = ws.ones((3, 2), np.int16, order="F")
        assert o.dtype == np.int16 and o.flags.f_contiguous and (o == 1).all() and rustws.owner(o) is ws
        assert ws.ones(4).dtype == np.float64
        outside = rustws.detach(np.arange(6.0))
        inside = ws.asarray(outside)
        assert rustws.owner(inside) is ws and (inside == outside).all()
        assert ws.asarray(inside) is inside  # already here: no copy, as np.asarray
        as32 = ws.asarray(inside, dtype=np.float32)
        assert as32.dtype == np.float32 and rustws.owner(as32) is ws
        from_list = ws.asarray([[1, 2], [3, 4]], order="F")
        assert from_list.flags.f_contiguous and rustws.owner(from_list) is ws
        m = ws.asarray(_matrix())
        assert type(m) is np.ndarray and rustws.owner(m) is ws  # np.asarray drops subclasses too
        with pytest.raises(TypeError, match="Python references"):
            ws.asarray([object()])
        with pytest.raises(TypeError, match="Python references"):
            ws.ones_like(np.array([None, 1]))


def test_a_refused_like_allocation_is_the_workspace_error():
    cfg = rustws.WorkspaceConfiguration(initial_size="64KiB", policy_learning="NONE", policy_spill="FAIL")
    ws = rustws.workspace("SMALL", cfg)
    big = np.ma.MaskedArray(np.zeros(1 << 20))
    with ws, pytest.raises(rustws.WorkspaceOutOfMemory, match="SMALL"):
        ws.empty_like(big)


class OldArrayLike:
    """An array-like whose ``__array__`` predates NumPy 2's ``copy`` keyword (as PyTorch's
    tensors' did): NumPy warns when it has to pass ``copy``."""

    def __init__(self):
        self.data = np.arange(5.0)

    def __array__(self, dtype=None):
        return self.data if dtype is None else self.data.astype(dtype)


def test_no_warning_from_rustws_call_sites_on_old_array_likes():
    if np.lib.NumpyVersion(np.__version__) >= "2.0.0":
        with pytest.warns(DeprecationWarning):  # what rustws must not trigger
            np.array(OldArrayLike(), copy=True)
    ws = rustws.workspace("OLD", CFG)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ws:
            for copy in (
                rustws.detach(OldArrayLike()),
                rustws.leverage_to("OLD", OldArrayLike()),
                ws.asarray(OldArrayLike()),
                ws.empty_like(OldArrayLike()),
            ):
                assert copy.shape == (5,)


def test_device_workspaces_take_the_same_signatures():
    from rustws.cuda import _standin_workspace

    ws = _standin_workspace("DEV")
    try:
        with ws:
            f = np.asfortranarray(np.arange(6.0).reshape(2, 3))
            for got, want in (
                (ws.ones((2, 3), np.int32), np.ones((2, 3), np.int32)),
                (ws.ones_like(f), np.ones_like(f)),
                (ws.full_like(f, 4, np.float32, shape=(3, 2)), np.full_like(f, 4, np.float32, shape=(3, 2))),
                (ws.zeros_like(f, order="C"), np.zeros_like(f, order="C")),
                (ws.asarray(f), f),
            ):
                assert isinstance(got, rustws.DeviceArray) and got.workspace is ws
                host = got.to_numpy()
                assert (host == want).all() and host.dtype == want.dtype
                assert got._fortran == (want.flags.f_contiguous and not want.flags.c_contiguous)
            d = ws.asarray(f)
            assert ws.asarray(d) is d
    finally:
        ws.destroy()


def test_the_direct_paths_of_like_and_asarray_keep_numpys_results_and_the_workspaces_errors():
    cfg = rustws.WorkspaceConfiguration(initial_size="64KiB", policy_learning="NONE", policy_spill="FAIL")
    ws = rustws.workspace("DIRECT", cfg)
    big, many = np.zeros(1 << 20), [0.0] * (1 << 16)  # made plainly, before the cycle
    with ws:
        # An ndarray prototype: built in the bindings (C and Fortran layouts, zeros over reused
        # memory), a list or tuple made by NumPy under the capture.
        for proto in (np.arange(12.0).reshape(3, 4), np.asfortranarray(np.ones((3, 4), np.int32))):
            for make, want in ((ws.empty_like, np.empty_like), (ws.zeros_like, np.zeros_like)):
                got, ref = make(proto), want(proto)
                assert (got.shape, got.dtype, got.strides) == (ref.shape, ref.dtype, ref.strides)
                assert rustws.owner(got) is ws
                got[...] = 7
                del got
            z = ws.zeros_like(proto)
            assert (z == 0).all()
        t = ws.asarray((1.5, 2.5, 3.5))
        assert t.dtype == np.float64 and rustws.owner(t) is ws and t.tolist() == [1.5, 2.5, 3.5]
        with pytest.raises(TypeError, match="Python references"):
            ws.asarray([object(), 1])
        with pytest.raises(rustws.WorkspaceOutOfMemory, match="DIRECT"):
            ws.empty_like(big)
        with pytest.raises(rustws.WorkspaceOutOfMemory, match="DIRECT"):
            ws.asarray(many)
    # Outside any cycle (no capture here) a list still lands in the workspace.
    out = ws.asarray([1.0] * 100)
    assert rustws.owner(out) is ws


def test_explicit_calls_never_land_in_the_workspace_below():
    # A workspace with a `helper_min_size` (the adaptive profile: 1 KiB) inside one without: its
    # small explicit arrays are none of the outer workspace's memory, whatever path made them.
    outer = rustws.workspace("OUTER", rustws.WorkspaceConfiguration(initial_size="1MiB"))
    inner = rustws.workspace("INNER")
    assert inner.config.helper_min_size > 0
    with outer, inner:
        made = [
            inner.asarray([1.0] * 50),
            inner.full((10,), 1.0),
            inner.ones_like(np.ma.MaskedArray(np.zeros(10))),
            inner.asarray(np.arange(10.0)),
        ]
        for a in made:
            assert rustws.owner(a) is not outer
