"""Every policy of the configuration at work: learning, allocation, spill, reset, location,
``helper_min_size``, ``temp_block_size`` and the debug modes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import rustws
from rustws import (
    AllocationPolicy,
    LearningPolicy,
    ResetPolicy,
    SpillPolicy,
    WorkspaceConfiguration,
)

MiB = 1 << 20


def cfg(**kw):
    return WorkspaceConfiguration(**kw)


@pytest.mark.parametrize("policy", list(LearningPolicy))
def test_learning_policies(policy):
    c = cfg(policy_learning=policy, cycles_before_initialization=2)
    ws = rustws.workspace("L", c)
    caps = []
    for _ in range(4):
        with ws:
            a = ws.empty(MiB // 8)
            del a
        caps.append(ws.stats().capacity_bytes)
    if policy is LearningPolicy.NONE:
        assert caps == [0, 0, 0, 0]
        assert ws.stats().external_bytes == 0 and ws.stats().spill_count == 4
    elif policy is LearningPolicy.FIRST_LOOP:
        assert caps[0] == 0 and caps[1] > MiB
    elif policy is LearningPolicy.ADAPTIVE:
        # Every cycle informs the size: the arena is mapped after the first one.
        assert caps[0] > MiB and len(set(caps)) == 1
    else:
        assert caps[0] == 0 and caps[1] > MiB


def test_over_time_keeps_adapting():
    ws = rustws.workspace("OT", cfg(policy_learning=LearningPolicy.OVER_TIME))
    for n in (MiB, MiB, 4 * MiB, 4 * MiB):
        with ws:
            a = ws.empty(n, np.uint8)
            del a
    s = ws.stats()
    assert s.capacity_bytes > 4 * MiB and s.spill_count == 1


def test_initialize_sizes_the_arena_now():
    ws = rustws.workspace("I", cfg(min_size=2 * MiB))
    assert ws.stats().capacity_bytes == 0
    ws.initialize()
    assert ws.stats().capacity_bytes >= 2 * MiB
    with ws:
        a = ws.empty(MiB, np.uint8)
        assert ws.stats().used_bytes == MiB and ws.stats().external_bytes == 0
        del a


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (AllocationPolicy.STRICT, MiB),
        (AllocationPolicy.OVERALLOCATE, MiB + 3 * MiB // 10),
        (AllocationPolicy.ALWAYS, 0),
    ],
)
def test_allocation_policies(policy, expected):
    ws = rustws.workspace("AP", cfg(initial_size=MiB, policy_allocation=policy))
    cap = ws.stats().capacity_bytes
    assert expected <= cap < expected + 8192
    with ws:
        a = ws.empty(1000, np.uint8)
        s = ws.stats()
        if policy is AllocationPolicy.ALWAYS:
            assert (s.used_bytes, s.external_bytes) == (0, 1000)
        else:
            assert (s.used_bytes, s.external_bytes) == (1000, 0)
        del a


def test_spill_fail_raises_workspace_out_of_memory():
    ws = rustws.workspace(
        "F",
        cfg(
            initial_size=MiB,
            policy_learning="NONE",
            policy_spill=SpillPolicy.FAIL,
            policy_allocation="STRICT",
        ),
    )
    with ws:
        a = ws.empty(600_000, np.uint8)
        with pytest.raises(rustws.WorkspaceOutOfMemory) as info:
            ws.empty(600_000, np.uint8)
        assert isinstance(info.value, MemoryError) and isinstance(info.value, rustws.WorkspaceError)
        msg = str(info.value)
        assert "'F'" in msg or '"F"' in msg
        assert "600000" in msg and "FAIL" in msg
        del a
    assert ws.stats().failed_allocations == 1


@pytest.mark.parametrize("policy", [SpillPolicy.REALLOCATE, SpillPolicy.EXTERNAL])
def test_spill_reallocate_grows_external_does_not(policy):
    ws = rustws.workspace("S", cfg(initial_size=MiB, policy_learning="NONE", policy_spill=policy))
    for _ in range(3):
        with ws:
            a = ws.empty(3 * MiB, np.uint8)
            a.fill(1)
            del a
    s = ws.stats()
    if policy is SpillPolicy.REALLOCATE:
        assert s.capacity_bytes > 3 * MiB and s.spill_count == 1
    else:
        assert s.capacity_bytes < 2 * MiB and s.spill_count == 3


def test_max_size_limits_the_footprint():
    ws = rustws.workspace("M", cfg(initial_size=MiB, max_size=2 * MiB))
    with ws, pytest.raises(rustws.WorkspaceOutOfMemory, match="max_size"):
        ws.empty(4 * MiB, np.uint8)


def test_circular_reset_keeps_items_alive_across_wraps():
    ws = rustws.workspace(
        "RING", cfg(initial_size=MiB, policy_learning="NONE", policy_reset=ResetPolicy.ENDOFBUFFER_REACHED)
    )
    live = []
    for i in range(200):
        with ws:
            a = ws.full(20_000, i, np.int32)
        live.append(a)
        if len(live) > 5:
            old = live.pop(0)
            assert (old == i - 5).all()
    assert ws.stats().spill_count == 0


def test_helper_min_size_bypasses_small_requests():
    ws = rustws.workspace("H", cfg(initial_size=MiB, helper_min_size=1024))
    with ws:
        small = ws.empty(10, np.uint8)
        big = ws.empty(4096, np.uint8)
        s = ws.stats()
        assert s.used_bytes == 4096 and s.external_bytes == 0
        del small, big


def test_temp_block_size_rounds_growth():
    ws = rustws.workspace("T", cfg(initial_size=100_000, temp_block_size="1MiB", policy_allocation="STRICT"))
    assert ws.stats().capacity_bytes == MiB


def test_mmap_location(tmp_path):
    c = cfg(policy_location="MMAP", policy_learning="NONE", initial_size=MiB, temp_file_path=tmp_path)
    ws = rustws.workspace("MM", c)
    with ws:
        a = ws.full(1000, 7, np.int64)
        assert a.sum() == 7000 and rustws.owner(a) is ws
        del a
    named = tmp_path / "arena.bin"
    ws2 = rustws.workspace("MM2", c.replace(temp_file_path=str(named)))
    assert named.stat().st_size == ws2.stats().capacity_bytes


def test_debug_mode_spill_everything():
    ws = rustws.workspace("DS", cfg(initial_size=MiB, debug_mode="SPILL_EVERYTHING"))
    with ws:
        a = ws.empty(100)
        assert ws.stats().spill_count == 1 and ws.stats().used_bytes == 0
        del a


def test_debug_mode_bypass_everything_gives_ordinary_arrays():
    ws = rustws.workspace("DB", cfg(initial_size=MiB, debug_mode="BYPASS_EVERYTHING"))
    with ws:
        a = ws.empty(100)
        b = np.ones(100) + 1
        assert rustws.owner(a) is None and rustws.owner(b) is None
    assert ws.stats().allocation_count == 0


@pytest.mark.parametrize(("value", "expect_owner"), [("bypass", False), ("spill", True)])
def test_debug_mode_from_the_environment(value, expect_owner):
    code = (
        "import numpy as np, rustws\n"
        "ws = rustws.workspace('E', rustws.WorkspaceConfiguration(initial_size=1<<20))\n"
        "with ws:\n"
        "    a = ws.empty(100)\n"
        "    print(rustws.owner(a) is ws, ws.stats().spill_count, ws.stats().capacity_bytes)\n"
    )
    env = dict(os.environ, RUSTWS_DEBUG_MODE=value)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    owned, spills, cap = out.split()
    assert owned == str(expect_owner)
    assert cap == "0"
    assert int(spills) == (1 if value == "spill" else 0)
