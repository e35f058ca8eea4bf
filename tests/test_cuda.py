"""Device workspaces on a real GPU, with PyTorch, CuPy and JAX where they are installed. Every test
here carries the ``cuda`` marker and is skipped, with the reason, on a machine without a usable
GPU (the same code paths run on a host stand-in in ``test_device_standin.py``)."""

from __future__ import annotations

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


def test_jax_takes_arrays_through_dlpack():
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU backend here")
    ws = gpu()
    with ws:
        a = ws.full(16, 4.0, np.float32)
        j = jax.dlpack.from_dlpack(a)
        assert float(j.sum()) == 64.0


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
        with rustws.torch.use_workspace(ws):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    count, nbytes = rustws.torch.held_by_torch()
    assert count > 0 and nbytes > 0 and ws.stats().allocation_count >= count
    assert isinstance(ws.empty(4), DeviceArray)
