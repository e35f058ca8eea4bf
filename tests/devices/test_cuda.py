"""Device workspaces on a real GPU, with PyTorch, CuPy and JAX where they are installed. Every test
here carries the ``cuda`` marker and is skipped, with the reason, on a machine without a usable
GPU (the same code paths run on a host stand-in in ``test_device_standin.py``)."""

from __future__ import annotations

import contextlib
import gc

import numpy as np
import pytest

import rustws
from rustws import DeviceArray, DeviceUnavailableError, WorkspaceConfiguration, WorkspaceOutOfMemory

REASON = rustws.cuda.unavailable_reason(0)
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(REASON is not None, reason=f"no usable GPU: {REASON}"),
]
# Tests that launch a framework's kernels (PyTorch, CuPy, JAX): they need the real driver.
frameworks = pytest.mark.frameworks

CFG = WorkspaceConfiguration(initial_size="16MiB", policy_mirroring="DISABLED")


def gpu(name="GPU", cfg=CFG):
    return rustws.workspace(name, cfg, device="cuda:0")


def test_device_workspaces_serve_device_memory():
    ws = gpu()
    assert rustws.cuda.is_available() and rustws.cuda.device_count() >= 1
    assert ws.backend_name == "cuda" and not ws.host_accessible and ws.device == "cuda:0"
    free, total = ws.device_memory_info()
    assert 0 < free <= total
    for cycle in range(3):
        with ws:
            a = ws.full((256, 256), float(cycle), np.float32)
            z = ws.zeros(1 << 20, np.uint8)
            assert (a.to_numpy() == cycle).all() and not z.to_numpy().any()
            assert a.__cuda_array_interface__["data"][0] == a.ptr and a.ptr % 256 == 0
            del a, z
    s = ws.stats()
    assert s.cycles == 3 and s.spill_count == 0 and s.used_bytes == 0


def test_bad_ordinal_and_out_of_memory_are_exceptions():
    bad = rustws.cuda.device_count()
    with pytest.raises(DeviceUnavailableError, match="ordinal"):
        rustws.workspace("BAD", CFG.replace(helper_allow_fallback=False), device=f"cuda:{bad}")
    ws = gpu("OOM", CFG.replace(policy_learning="NONE"))
    with ws, pytest.raises(WorkspaceOutOfMemory):
        ws.empty(1 << 50, np.uint8)


def test_full_mirroring_uses_pinned_host_memory():
    ws = gpu("MIRROR", CFG.replace(policy_mirroring="FULL"))
    assert ws._mirror_ws.backend_name == "cuda-pinned-host"
    with ws:
        a = ws.zeros((64, 64), np.float64)
        a.host[:] = 3.0
        a.sync_to_device()
        np.testing.assert_array_equal(a.to_numpy(), np.full((64, 64), 3.0))


@frameworks
def test_torch_takes_arrays_zero_copy():
    torch = pytest.importorskip("torch")
    ws = gpu()
    with ws:
        a = ws.full((4, 8), 2.0, np.float32)
        t = torch.from_dlpack(a)
        assert t.is_cuda and t.data_ptr() == a.ptr and t.shape == (4, 8)
        t.mul_(3.0)
        torch.cuda.synchronize()
        assert (a.to_numpy() == 6.0).all()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            u = torch.from_dlpack(a.__dlpack__(stream=s.cuda_stream))
        assert u.data_ptr() == a.ptr
    del a
    gc.collect()
    assert float(t.sum()) == 6.0 * 32, "the tensor keeps the workspace memory alive"


@frameworks
def test_cupy_takes_arrays_through_the_interface_and_allocates_from_the_workspace():
    cupy = pytest.importorskip("cupy")
    ws = gpu()
    with ws:
        a = ws.full(1000, 1.5, np.float64)
        c = cupy.asarray(a)
        assert c.data.ptr == a.ptr
        c *= 2
        cupy.cuda.runtime.deviceSynchronize()
        assert (a.to_numpy() == 3.0).all()
        before = ws.stats().allocation_count
        with cupy.cuda.using_allocator(rustws.cupy.allocator(ws)):
            x = cupy.arange(10_000, dtype=cupy.float32)
            y = (x * 2).sum()
        assert ws.stats().allocation_count > before
        assert float(y) == float(np.arange(10_000, dtype=np.float32).sum() * 2)


@frameworks
def test_jax_takes_arrays_through_dlpack():
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU backend here")
    ws = gpu()
    with ws:
        a = ws.full(16, 4.0, np.float32)
        j = jax.dlpack.from_dlpack(a)
        assert float(j.sum()) == 64.0


@frameworks
def test_a_torch_training_step_under_use_workspace():
    torch = pytest.importorskip("torch")
    ws = gpu("TORCH", CFG.replace(initial_size=0))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(128, 64, device="cuda")
    y = torch.randint(0, 10, (128,), device="cuda")
    losses = []
    for _ in range(5):
        with rustws.torch.use_workspace(ws) as pool:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()  # on the autograd engine's device thread
            opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    ours = [s for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == tuple(pool.id)]

    def from_the_workspace(t):
        return any(s["address"] <= t.data_ptr() < s["address"] + s["total_size"] for s in ours)

    assert all(from_the_workspace(p.grad) for p in model.parameters()), "backward allocates from ws"
    count, nbytes = rustws.torch.held_by_torch()
    assert count > 0 and nbytes > 0 and ws.stats().allocation_count >= count
    assert isinstance(ws.empty(4), DeviceArray)


@frameworks
def test_dlpack_round_trips_keep_their_contents_across_later_cycles():
    """torch <-> DeviceArray <-> cupy without copies; memory a consumer still holds is never
    handed out again, however many cycles follow (the safety rule, on the device)."""
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    ws = gpu("ROUNDTRIP", CFG.replace(initial_size="4MiB"))
    kept = []
    for cycle in range(4):
        with ws:
            a = ws.full((512,), float(cycle + 1), np.float32)
            t = torch.from_dlpack(a)  # DeviceArray -> torch
            c = cupy.from_dlpack(t)  # torch -> cupy
            back = torch.from_dlpack(c)  # cupy -> torch
            assert t.data_ptr() == c.data.ptr == back.data_ptr() == a.ptr
            c += 1  # visible through every view
            cupy.cuda.runtime.deviceSynchronize()
            assert (a.to_numpy() == cycle + 2).all()
            kept.append((cycle + 2, t, c))
            # Scratch that the next cycles would put where the kept arrays live if they were free.
            scratch = [ws.full((512,), -7.0, np.float32) for _ in range(8)]
            del a, back, scratch
    for _ in range(3):
        with ws:
            junk = [ws.full((512,), -9.0, np.float32) for _ in range(16)]
            del junk
    torch.cuda.synchronize()
    ptrs = {t.data_ptr() for _, t, _ in kept}
    assert len(ptrs) == len(kept), "a kept block was handed out twice"
    for value, t, c in kept:
        assert float(t.min()) == float(t.max()) == value
        assert float(c.min()) == float(c.max()) == value


@frameworks
def test_cupy_allocations_from_the_workspace_stay_alive_through_torch():
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    ws = gpu("CUPYTORCH", CFG.replace(initial_size="4MiB"))
    alloc = rustws.cupy.allocator(ws)
    with ws, cupy.cuda.using_allocator(alloc):
        c = cupy.arange(4096, dtype=cupy.float64)
        t = torch.from_dlpack(c)
    del c
    for _ in range(3):
        with ws, cupy.cuda.using_allocator(alloc):
            junk = [cupy.full(4096, -1.0) for _ in range(8)]
            del junk
    torch.cuda.synchronize()
    assert torch.equal(t.cpu(), torch.arange(4096, dtype=torch.float64))


def _train(torch, model, steps, under):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(64, 32, device="cuda", generator=g)
    y = torch.randint(0, 4, (64,), device="cuda", generator=g)
    losses = []
    for _ in range(steps):
        with under():
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        losses.append(loss.item())
    return losses


@frameworks
def test_training_under_the_workspace_gives_the_caching_allocators_losses():
    import copy

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)).cuda()
    twin = copy.deepcopy(model)
    ws = gpu("LOSSES", CFG.replace(initial_size=0))
    plain = _train(torch, model, 8, contextlib.nullcontext)
    routed = _train(torch, twin, 8, lambda: rustws.torch.use_workspace(ws))
    assert plain == routed, "the same steps give the same losses, bit for bit"
    assert ws.stats().allocation_count > 0


@frameworks
def test_a_cupy_loop_under_set_allocator_matches_the_memory_pool():
    cupy = pytest.importorskip("cupy")
    ws = gpu("CUPYLOOP", CFG.replace(initial_size=0))

    def loop(cycle):
        rng = cupy.random.default_rng(3)
        acc = cupy.zeros((128, 128), cupy.float32)
        for _ in range(6):
            with cycle():
                m = rng.standard_normal((128, 128), dtype=cupy.float32)
                acc += cupy.tanh(m @ m.T) * 0.5
        return cupy.asnumpy(acc)

    expected = loop(contextlib.nullcontext)
    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(rustws.cupy.allocator(ws))
    try:
        got = loop(lambda: ws)
    finally:
        cupy.cuda.set_allocator(previous)
    np.testing.assert_array_equal(got, expected)
    s = ws.stats()
    assert s.cycles == 6 and s.allocation_count > 0
    assert s.capacity_bytes > 0 and s.spill_count < s.allocation_count, "later cycles come from the arena"
