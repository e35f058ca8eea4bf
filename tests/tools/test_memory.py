"""``rustws.memory``: snapshots in PyTorch's memory_viz schema, the out-of-memory verdict and
snapshot, growth attributed to the code that allocated, and a recommended configuration that
replays the recorded loop without spills."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import pickle
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

import rustws
from rustws import WorkspaceConfiguration, WorkspaceOutOfMemory, memory

KiB, MiB = 1 << 10, 1 << 20
HERE = os.path.abspath(__file__)


@pytest.fixture(autouse=True)
def _recording():
    memory.record_history(True)
    yield
    memory.record_history(False)
    memory.set_oom_snapshot(None)
    memory.record_history(False)


def fixed(size: str = "1MiB", **changes) -> WorkspaceConfiguration:
    """An arena of exactly ``size``, mapped at once, never resized by learning."""
    return WorkspaceConfiguration(
        initial_size=size,
        policy_learning="NONE",
        policy_allocation="STRICT",
        helper_min_size=0,
        **changes,
    )


def line() -> int:
    """The caller's next line."""
    return inspect.currentframe().f_back.f_lineno + 1


def trace_of(snap, name):
    return [e for t in snap["device_traces"] for e in t if e.get("workspace") == name]


def check_memory_viz(snap) -> None:
    """What PyTorch's memory_viz views rely on: segments tiled by their blocks (``segsum``
    asserts allocated + free == reserved), blocks in address order, every trace entry an action
    with numbers, each free after its allocation, one trace per device."""
    assert len(snap["device_traces"]) == len(snap["devices"])
    for seg in snap["segments"]:
        at = seg["address"]
        allocated = 0
        for b in seg["blocks"]:
            assert b["address"] == at, "blocks tile their segment"
            assert b["size"] > 0 and b["state"] in ("active_allocated", "inactive")
            if b["state"] == "active_allocated":
                assert 0 < b["requested_size"] <= b["size"]
                allocated += b["size"]
                assert isinstance(b["frames"], list)
            at += b["size"]
        assert at == seg["address"] + seg["total_size"]
        assert allocated == seg["allocated_size"]
        assert 0 <= seg["device"] < len(snap["devices"])
    for trace in snap["device_traces"]:
        live = set()
        for e in trace:
            assert isinstance(e["addr"], int) and isinstance(e["size"], int) and e["stream"] == 0
            if e["action"] == "alloc":
                assert e["addr"] not in live, "an address handed out twice while live"
                live.add(e["addr"])
            elif e["action"] == "free_completed" and e["addr"] in live:
                live.discard(e["addr"])
        times = [e["time_us"] for e in trace]
        assert times == sorted(times)
    # What MemoryViz.js does to draw any step: from the final segments back through the trace,
    # every block an event names lies in a segment mapped at that moment.
    for dev, trace in enumerate(snap["device_traces"]):
        mapped = {(s["address"], s["total_size"]) for s in snap["segments"] if s["device"] == dev}
        for e in reversed(trace):
            if e["action"] == "segment_free":
                mapped.add((e["addr"], e["size"]))
            elif e["action"] == "segment_alloc":
                mapped.discard((e["addr"], e["size"]))
            elif e["action"] in ("alloc", "free_completed"):
                assert any(a <= e["addr"] < a + n for a, n in mapped), f"{e} lies in no segment"


def test_a_known_program_has_exactly_its_segments_blocks_and_events():
    ws = rustws.workspace("SNAP", fixed())
    with ws:
        at_a = line()
        a = ws.empty(1000, np.uint8)
        at_b = line()
        b = np.empty(3 * MiB // 8)  # past the 1 MiB arena: a block of its own
        pa, pb = a.ctypes.data, b.ctypes.data
        del a
    snap = memory.snapshot()
    check_memory_viz(snap)
    trace = trace_of(snap, "SNAP")
    assert [(e["action"], e["size"]) for e in trace] == [
        ("segment_alloc", MiB),  # the arena, mapped as the workspace was made
        ("cycle_open", 0),
        ("alloc", 1000),
        ("segment_alloc", 3 * MiB + 64),  # b's block: its size and a header
        ("alloc", 3 * MiB),
        ("free_completed", 1000),
        ("cycle_close", 3 * MiB + 1000),
    ], trace
    assert [e["addr"] for e in trace if e["action"] in ("alloc", "free_completed")] == [pa, pb, pa]
    assert [e.get("kind") for e in trace if e["action"] == "alloc"] == ["arena", "external"]
    for e, at in zip([e for e in trace if e["action"] == "alloc"], (at_a, at_b), strict=True):
        f = memory.user_frame(e["frames"])
        assert (f["filename"], f["line"], f["name"]) == (HERE, at, inspect.currentframe().f_code.co_name)
    assert snap["cycles"] == [
        {
            "workspace": "SNAP",
            "workspace_id": ws.id,
            "cycle": 0,
            "time_us": trace[-1]["time_us"],
            "peak_bytes": 3 * MiB + 1000,
            "spills": 1,
            "segment_bytes": 3 * MiB + 64,
            "sites": snap["cycles"][0]["sites"],
        }
    ]
    assert snap["cycles"][0]["sites"][0]["bytes"] == 3 * MiB
    segs = [s for s in snap["segments"] if s["workspace"] == "SNAP"]
    assert {s["kind"]: (s["total_size"], s["allocated_size"], s["requested_size"]) for s in segs} == {
        "arena": (MiB, 0, 0),
        "external": (3 * MiB + 64, 3 * MiB, 3 * MiB),
    }
    assert len(segs) == 2
    own = next(s for s in segs if s["kind"] == "external")
    assert [(b["state"], b["size"]) for b in own["blocks"]] == [
        ("inactive", 64),
        ("active_allocated", 3 * MiB),
    ]
    live = own["blocks"][1]
    assert live["address"] == pb and live["pinned"], "b outlived its cycle"
    assert memory.user_frame(live["frames"])["line"] == at_b
    assert snap["devices"][segs[0]["device"]] == "cpu"
    del b


def test_torch_memory_viz_text_views_accept_the_snapshot(tmp_path):
    try:
        from torch.cuda import _memory_viz
    except ImportError:
        pytest.skip("PyTorch is not installed: torch.cuda._memory_viz cannot read the snapshot here")
    ws = rustws.workspace("VIZ", fixed())
    for _ in range(3):
        with ws:
            x = np.ones(100_000)
            y = np.sqrt(x) + np.empty(300_000)[:100_000]
            del x, y
    memory.dump_snapshot(tmp_path / "s.pickle")
    snap = pickle.loads((tmp_path / "s.pickle").read_bytes())
    summary = _memory_viz.segsum(snap)
    assert "total_reserved" in summary
    text = _memory_viz.trace(snap)
    assert "cudaMalloc(" in text and "# free completed for" in text
    out = subprocess.run(
        [sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(tmp_path / "s.pickle")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "segments:" in out.stdout


def test_recording_is_off_until_asked_and_bad_arguments_are_refused():
    memory.record_history(False)
    ws = rustws.workspace("OFF", fixed())
    with ws:
        a = np.empty(1000)
    del a
    assert trace_of(memory.snapshot(), "OFF") == []
    with pytest.raises(ValueError, match="max_entries"):
        memory.record_history(True, max_entries=0)
    with pytest.raises(ValueError, match="stacks"):
        memory.record_history(True, stacks="c++")
    with pytest.raises(TypeError, match="enabled"):
        memory.record_history("yes")


def test_a_small_ring_keeps_the_last_events_and_counts_the_rest():
    memory.record_history(True, max_entries=8, stacks=None)
    ws = rustws.workspace("RING", fixed())
    for _ in range(10):
        with ws:
            a = np.empty(1000)
            del a
    snap = memory.snapshot()
    trace = trace_of(snap, "RING")
    assert len(trace) == 8
    assert trace[-1]["action"] == "cycle_close" and trace[-1]["cycle"] == 9
    assert all(e["frames"] == [] for e in trace), "stacks=None records none"
    (info,) = [w for w in snap["workspaces"] if w["name"] == "RING"]
    assert info["dropped"] == 10 * 4 + 1 - 8  # open, alloc, free, close per cycle; the mapping


@contextlib.contextmanager
def observed():
    """The refusals an OOM observer sees while the block runs."""
    seen = []
    memory.attach_oom_observer(seen.append)
    try:
        yield seen
    finally:
        memory.detach_oom_observer(seen.append)


def test_an_oom_under_max_size_gives_the_verdict_and_writes_the_snapshot(tmp_path):
    path = tmp_path / "oom.pickle"
    memory.set_oom_snapshot(path)
    with observed() as seen:
        ws = rustws.workspace("OOM", fixed(max_size="4MiB"))
        with ws:
            kept = ws.empty(2 * MiB, np.uint8)
            with pytest.raises(WorkspaceOutOfMemory) as info:
                ws.empty(3 * MiB, np.uint8)
            del kept
    e = info.value
    assert seen == [e]
    assert e.verdict.startswith("rustws verdict: the limit")
    assert "raise max_size to at least" in e.verdict
    assert e.verdict in e.__notes__
    room = 4 * MiB - MiB - (2 * MiB + 64)
    assert e.room == room, "a 1 MiB arena and a 2 MiB block (and its header) under 4 MiB"
    snap = pickle.loads(path.read_bytes())
    check_memory_viz(snap)
    ooms = [x for x in trace_of(snap, "OOM") if x["action"] == "oom"]
    assert [(x["size"], x["device_free"]) for x in ooms] == [(3 * MiB, room)]
    assert any(str(path) in n for n in e.__notes__)


def test_a_captured_refusal_is_observed_with_the_memory_as_it_was_at_the_refusal():
    with observed() as seen:
        ws = rustws.workspace("FROZEN", fixed(max_size="4MiB"))
        with ws:
            kept = ws.empty(2 * MiB, np.uint8)
            with pytest.raises(MemoryError):
                np.ones(3 * MiB // 8)  # NumPy's own MemoryError: reported when the cycle ends
            assert seen == []
            del kept
    (e,) = seen
    assert isinstance(e, WorkspaceOutOfMemory) and e.requested == 3 * MiB
    snap = e.memory_snapshot
    check_memory_viz(snap)
    live = [b for s in snap["segments"] if s["workspace"] == "FROZEN" for b in s["blocks"]]
    assert [b["requested_size"] for b in live if b["state"] == "active_allocated"] == [2 * MiB], (
        "the kept block, live at the refusal though freed before the cycle ended"
    )
    assert [x["size"] for x in trace_of(snap, "FROZEN") if x["action"] == "oom"] == [3 * MiB]


def test_workspaces_of_one_name_on_several_threads_are_told_apart():
    import threading

    def run(n: int) -> None:
        ws = rustws.workspace("PERTHREAD", fixed())  # one per thread, alive while its thread is
        for _ in range(3):
            with ws:
                a = np.ones(n)
                del a
        ids.append(ws.id)
        done.release()
        snapped.wait()

    ids: list[int] = []
    done, snapped = threading.Semaphore(0), threading.Event()
    threads = [threading.Thread(target=run, args=(n,)) for n in (300_000, 30_000)]
    for t in threads:
        t.start()
    for _ in threads:
        done.acquire()
    snap = memory.snapshot()
    snapped.set()
    for t in threads:
        t.join()
    assert memory.recorded_workspaces(snap) == sorted((i, "PERTHREAD") for i in ids)
    with pytest.raises(ValueError, match="several workspaces are named"):
        memory.recommend(snap, workspace="PERTHREAD")
    needs = sorted(memory.recommend(snap, workspace=i).need_bytes for i in ids)
    assert needs[0] < 30_000 * 8 * 2 < 300_000 * 8 <= needs[1], needs
    assert sorted(c["workspace_id"] for c in snap["cycles"] if c["workspace"] == "PERTHREAD") == sorted(
        ids * 3
    )


def test_the_verdict_tells_the_limit_from_fragmentation_and_the_spill_policy():
    from rustws._errors import _refused, _system_refused

    M = MiB
    # workspace, requested, in use, limit, footprint, pinned, cached, largest free, room, held,
    # live end
    limit = _refused("W", 3 * M, 2 * M, 4 * M, 4 * M, M, 0, 0, 0, 2 * M + 128, 0, "max_size")
    limit = limit.verdict
    assert (
        "the limit" in limit and "raise max_size to at least 5.1 MiB" in limit and "1.0 MiB pinned" in limit
    )
    frag = _refused("W", 2 * M, M, 8 * M, 8 * M, 0, 0, M, M // 2, M + 64, 0, "max_size")
    frag = frag.verdict
    assert "fragmentation" in frag and "largest is 1.0 MiB" in frag and "raise max_size by 1.6 MiB" in frag
    refused = "map of 3145728 bytes failed: Cannot allocate memory (os error 12)"
    system = _system_refused("W", 3 * M, M, 0, refused)
    assert system.verdict.startswith("rustws verdict: the system") and "set max_size" in system.verdict
    assert system.__notes__ == [system.verdict]
    fail = _refused("W", M, 0, M, M, 0, 0, 0, 0, 0, 0, "the spill policy is FAIL")
    fail = fail.verdict
    assert "spill policy FAIL" in fail and "policy_spill" in fail


def test_rustws_oom_snapshot_in_the_environment_dumps_at_a_captured_refusal(tmp_path):
    path = tmp_path / "env.pickle"
    code = (
        "import numpy as np, rustws\n"
        "ws = rustws.workspace('ENV', rustws.WorkspaceConfiguration(initial_size='1MiB', "
        "policy_learning='NONE', max_size='2MiB'))\n"
        "try:\n"
        "    with ws:\n"
        "        a = np.ones(4 << 20)\n"
        "except MemoryError as e:\n"
        "    print('NOTES', e.__notes__)\n"
    )
    env = {**os.environ, "RUSTWS_OOM_SNAPSHOT": str(path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "rustws verdict: the limit" in out.stdout, out.stdout + out.stderr
    snap = pickle.loads(path.read_bytes())
    ooms = [x for x in trace_of(snap, "ENV") if x["action"] == "oom"]
    assert [x["size"] for x in ooms] == [32 * MiB]
    assert memory.user_frame(ooms[0]["frames"]) is None, "a refusal has no allocation stack"


def loop(ws, cycles: int = 6) -> None:
    """A loop that keeps its state from one cycle to the next, with temporaries of mixed sizes."""
    h = np.ones(300_000)
    for _ in range(cycles):
        with ws:
            t = np.tanh(h) * 0.5
            u = np.empty(700_000)
            u[:300_000] = t
            h = t + u[:300_000]
            del t, u
    del h


def test_recommend_returns_a_configuration_that_runs_the_loop_without_spills(tmp_path):
    small = fixed("1MiB", policy_spill="EXTERNAL")
    loop(rustws.workspace("REC", small))
    snap = memory.snapshot()
    memory.dump_snapshot(tmp_path / "rec.pickle")
    r = memory.recommend(snap, workspace="REC")
    assert r.recorded.spills > 0 and r.recorded.cycles == 6
    assert (r.outcome.spills, r.outcome.refusals) == (0, 0)
    assert r.configuration.initial_size == r.need_bytes >= 3 * 300_000 * 8
    # The recommendation, run for real: no spill, and the arena it promised.
    memory.record_history(False)
    ws = rustws.workspace("REC2", r.configuration)
    loop(ws)
    stats = ws.stats()
    assert stats.spill_count == 0
    assert stats.capacity_bytes == r.outcome.arena_bytes
    # The same from the dumped file, through the command line.
    assert memory.recommend(tmp_path / "rec.pickle", workspace="REC") == r
    out = subprocess.run(
        [sys.executable, "-m", "rustws", "replay", str(tmp_path / "rec.pickle"), "--workspace", "REC"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "recommended" in out.stdout and f"initial_size={r.configuration.initial_size}" in out.stdout


def test_the_replay_command_says_why_it_cannot_replay_a_file(tmp_path):
    memory.record_history(False)
    memory.dump_snapshot(tmp_path / "empty.pickle")
    (tmp_path / "junk.pickle").write_bytes(b"not a pickle")
    for name, why in (("empty.pickle", "no allocation"), ("junk.pickle", "cannot read")):
        out = subprocess.run(
            [sys.executable, "-m", "rustws", "replay", str(tmp_path / name)], capture_output=True, text=True
        )
        assert out.returncode == 2 and why in out.stderr, out.stderr


def test_recommend_refuses_what_it_cannot_read():
    with pytest.raises(TypeError, match="snapshot"):
        memory.recommend(42)
    with pytest.raises(ValueError, match="no allocation"):
        memory.recommend({"device_traces": [[]]})
    one = {"action": "alloc", "addr": 64, "size": 8, "workspace": "A", "workspace_id": 1}
    with pytest.raises(ValueError, match="allocated nothing"):
        memory.recommend({"device_traces": [[one]]}, workspace="nope")
    with pytest.raises(TypeError, match="name or an id"):
        memory.recommend({"device_traces": [[one]]}, workspace=1.5)


def test_a_spilling_cycle_names_the_code_that_spilled(caplog):
    with caplog.at_level(logging.DEBUG, logger="rustws"):
        ws = rustws.workspace("SITES", fixed())  # observed: made while logging is on
        with ws:
            at = line()
            big = np.empty(2 * MiB // 8)
            del big
    msgs = [r.getMessage() for r in caplog.records if "spilled" in r.getMessage()]
    assert len(msgs) == 1, msgs
    assert f"spilled at {HERE}:{at} " in msgs[0] and "2.0 MiB" in msgs[0]


def test_a_cycle_that_grows_the_arena_names_the_code_that_made_it_grow(caplog):
    with caplog.at_level(logging.DEBUG, logger="rustws"):
        ws = rustws.workspace("GROW")  # the adaptive profile: the first cycle sizes the arena
        with ws:
            at = line()
            big = np.ones(2 * MiB // 8)
            del big
    msgs = [r.getMessage() for r in caplog.records if "mapped an arena" in r.getMessage()]
    assert len(msgs) == 1, [r.getMessage() for r in caplog.records]
    assert f"served outside the arena at {HERE}:{at} " in msgs[0]
    (c,) = [c for c in memory.snapshot()["cycles"] if c["workspace"] == "GROW"]
    assert c["spills"] == 0 and c["segment_bytes"] > 0
    assert memory.user_frame(c["sites"][0]["frames"])["line"] == at


def test_tracemalloc_sees_explicit_workspace_arrays():
    ws = rustws.workspace("TRACE", fixed())
    tracemalloc.start()
    try:
        with ws:
            a = ws.empty((1000,), np.float64)
            b = ws.zeros((300,), np.int32)
            domain = [tracemalloc.DomainFilter(True, 389047)]
            traced = tracemalloc.take_snapshot().filter_traces(domain)
            assert sum(s.size for s in traced.statistics("filename")) == 8000 + 1200
            del a, b
            after = tracemalloc.take_snapshot().filter_traces(domain)
            assert sum(s.size for s in after.statistics("filename")) == 0, "freeing withdraws them"
    finally:
        tracemalloc.stop()


def test_device_memory_is_a_device_of_its_own_with_its_blocks_and_stacks():
    """The device stand-in (host memory a workspace treats as a device's: headers kept apart)."""
    from rustws import _rustws

    core = _rustws.WorkspaceCore("STANDIN", fixed()._core_dict(), backend="standin")
    core._open_cycle()
    at = line()
    small, big = core._buffer(1000), core._buffer(3 * MiB)
    del small
    core._close_cycle()
    snap = memory.snapshot()
    check_memory_viz(snap)
    segs = {s["kind"]: s for s in snap["segments"] if s["workspace"] == "STANDIN"}
    dev = segs["arena"]["device"]
    assert snap["devices"][dev] == "standin" and segs["external"]["device"] == dev
    assert [b["state"] for b in segs["arena"]["blocks"]] == ["inactive"]
    assert [b["state"] for b in segs["external"]["blocks"]] == ["active_allocated"], (
        "no header in device memory"
    )
    allocs = [e for e in snap["device_traces"][dev] if e["action"] == "alloc"]
    assert [e["kind"] for e in allocs] == ["arena", "external"]
    assert all(memory.user_frame(e["frames"])["line"] == at for e in allocs)
    del big, core
