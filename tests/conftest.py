"""Every test starts with no workspaces on its thread and NumPy's default handler current, and
leaves it so (closed scopes settled)."""

from __future__ import annotations

import gc

import pytest

import rustws
from rustws import _rustws


@pytest.fixture(autouse=True)
def _clean_workspaces():
    before = _rustws.get_handler()
    yield
    rustws.destroy_all_workspaces_for_current_thread()
    gc.collect()
    after = _rustws.get_handler()
    assert after is before, "a test left a workspace handler current"


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs an NVIDIA GPU with a driver")
    config.addinivalue_line("markers", "frameworks: launches PyTorch, CuPy or JAX kernels on the GPU")
