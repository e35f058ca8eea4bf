"""A differential fuzzer: hypothesis writes small NumPy programs (ufuncs, reductions, views,
resize, concatenation, sorting, escapes, nested cycles, threads) and each runs twice, once plain
and once captured by a workspace. The results must be identical and the workspace's statistics
must add up, during the run and once every array is gone."""

from __future__ import annotations

import threading

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rustws
from rustws import ResetPolicy, SpillPolicy, WorkspaceConfiguration

CONFIGS = [
    WorkspaceConfiguration(),
    WorkspaceConfiguration(initial_size="64KiB", policy_learning="NONE", policy_spill=SpillPolicy.REALLOCATE),
    WorkspaceConfiguration(
        initial_size="256KiB", policy_learning="NONE", policy_reset=ResetPolicy.ENDOFBUFFER_REACHED
    ),
    WorkspaceConfiguration(initial_size="32KiB", policy_learning="NONE", policy_spill=SpillPolicy.EXTERNAL),
]

UNARY = ["negative", "abs", "sqrt_abs", "square", "cumsum", "sort", "argsort", "copy_f", "transpose_copy"]
BINARY = ["add", "multiply", "maximum", "concatenate", "matmul"]
REDUCE = ["sum0", "sum1", "mean", "max", "prod_small"]
VIEW = ["slice", "stride", "reshape", "resize_fn", "resize_method"]

op = st.one_of(
    st.tuples(st.just("unary"), st.sampled_from(UNARY), st.integers(0, 7)),
    st.tuples(st.just("binary"), st.sampled_from(BINARY), st.integers(0, 7), st.integers(0, 7)),
    st.tuples(st.just("reduce"), st.sampled_from(REDUCE), st.integers(0, 7)),
    st.tuples(st.just("view"), st.sampled_from(VIEW), st.integers(0, 7)),
    st.tuples(st.just("escape"), st.integers(0, 7)),
    st.tuples(st.just("nested"), st.integers(0, 7)),
    st.tuples(st.just("thread"), st.integers(0, 7)),
)

program = st.fixed_dictionaries(
    {
        "rows": st.integers(1, 40),
        "cols": st.integers(1, 40),
        "dtype": st.sampled_from(["int64", "float64", "int32", "float32"]),
        "cycles": st.integers(1, 3),
        "ops": st.lists(op, min_size=1, max_size=25),
        "config": st.integers(0, len(CONFIGS) - 1),
    }
)


def as2d(a: np.ndarray) -> np.ndarray:
    return a.reshape(a.shape[0], -1) if a.ndim >= 2 else a.reshape(1, -1) if a.ndim == 1 else a.reshape(1, 1)


def step(arrays: list[np.ndarray], o: tuple, escaped: list[np.ndarray], ws: rustws.Workspace | None) -> None:
    kind = o[0]
    pick = arrays[o[-1] % len(arrays)] if kind not in ("binary",) else None
    if kind == "unary":
        name, a = o[1], pick
        out = {
            "negative": lambda: np.negative(a),
            "abs": lambda: np.abs(a),
            "sqrt_abs": lambda: np.sqrt(np.abs(a).astype(np.float64)),
            "square": lambda: np.square(a % 1000),
            "cumsum": lambda: np.cumsum(a % 1000, axis=-1),
            "sort": lambda: np.sort(a, axis=None),
            "argsort": lambda: np.argsort(a, axis=-1, kind="stable"),
            "copy_f": lambda: np.asfortranarray(a).copy(order="F"),
            "transpose_copy": lambda: np.ascontiguousarray(as2d(a).T),
        }[name]()
    elif kind == "binary":
        name, a, b = o[1], arrays[o[2] % len(arrays)], arrays[o[3] % len(arrays)]
        a2, b2 = as2d(a), as2d(b)
        if name == "concatenate":
            out = np.concatenate([a.ravel(), b.ravel()])
        elif name == "matmul":
            out = (a2 % 100) @ (as2d(b2.T) % 100)[: a2.shape[1]] if b2.shape[1] >= a2.shape[1] else a2.copy()
        else:
            n = min(a.size, b.size)
            out = getattr(np, name)(a.ravel()[:n], b.ravel()[:n])
    elif kind == "reduce":
        name, a = o[1], as2d(pick)
        out = {
            "sum0": lambda: a.sum(axis=0),
            "sum1": lambda: a.sum(axis=1),
            "mean": lambda: np.atleast_1d(a.mean(axis=0)),
            "max": lambda: a.max(axis=1),
            "prod_small": lambda: (a % 3).prod(axis=0),
        }[name]()
    elif kind == "view":
        name, a = o[1], pick
        if name == "slice":
            out = a[..., ::2]
        elif name == "stride":
            out = a.ravel()[1::3]
        elif name == "reshape":
            out = a.reshape(-1)
        elif name == "resize_fn":
            out = np.resize(a, (a.size + 7,))
        else:
            out = a.copy()
            out.resize((a.size * 2 + 1,), refcheck=False)  # grows in place: a realloc
    elif kind == "escape":
        out = pick.copy()
        escaped.append(out)
    elif kind == "nested":
        if ws is not None:
            with ws:
                out = np.add(pick, pick) * 2
        else:
            out = np.add(pick, pick) * 2
    else:  # thread: another thread computes; capture is per thread, its memory is NumPy's
        box: list[np.ndarray] = []
        t = threading.Thread(target=lambda: box.append(np.sort(pick.ravel()) + 1))
        t.start()
        t.join()
        out = box[0]
    if out.size:
        arrays.append(out)
    if len(arrays) > 12:
        del arrays[1]


def run(p: dict, ws: rustws.Workspace | None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(p["rows"] * 1000 + p["cols"])
    base = (rng.integers(-50, 50, size=(p["rows"], p["cols"]))).astype(p["dtype"])
    escaped: list[np.ndarray] = []
    results: list[np.ndarray] = []
    for _ in range(p["cycles"]):
        if ws is not None:
            with ws:
                arrays = [base.copy()]
                for o in p["ops"]:
                    step(arrays, o, escaped, ws)
                results.extend(arrays)
        else:
            arrays = [base.copy()]
            for o in p["ops"]:
                step(arrays, o, escaped, None)
            results.extend(arrays)
    return results, escaped


def same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    if a.dtype.kind == "f":
        np.testing.assert_allclose(a, b, rtol=1e-6 if a.dtype == np.float32 else 1e-12, atol=1e-9)
    else:
        np.testing.assert_array_equal(a, b)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=program)
def test_captured_programs_compute_what_plain_ones_do(p):
    plain, plain_escaped = run(p, None)
    ws = rustws.workspace("DIFF", CONFIGS[p["config"]])
    with np.errstate(all="ignore"):
        captured, captured_escaped = run(p, ws)
    assert len(plain) == len(captured) and len(plain_escaped) == len(captured_escaped)
    for pair in zip(plain + plain_escaped, captured + captured_escaped, strict=True):
        same(*pair)
    del pair
    s = ws.stats()
    assert s.capacity_bytes == s.used_bytes + s.cached_bytes + s.overhead_bytes
    assert s.cycles == ws.generation
    assert s.allocation_count > 0 or all(a.size == 0 for a in captured)
    del captured, captured_escaped
    with ws:
        pass
    s = ws.stats()
    assert s.used_bytes == 0 and s.external_bytes == 0 and s.pinned_bytes == 0, s
    assert s.capacity_bytes == s.cached_bytes + s.overhead_bytes
    ws.destroy()
