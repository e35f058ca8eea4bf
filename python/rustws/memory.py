"""See what memory does: snapshots in PyTorch's ``memory_viz`` format, out-of-memory reports, and a
recommended configuration replayed from what was recorded.

``record_history()`` starts recording every workspace's timeline (blocks handed out and freed,
mappings taken from the system and given back, refusals, cycle ends), with the Python stack of
each allocation. ``snapshot()`` returns what every workspace holds now and what was recorded, as
``torch.cuda.memory._snapshot()`` does: ``segments`` (each with its ``blocks``) and
``device_traces`` (``alloc``, ``free_completed``, ``segment_alloc``, ``segment_free``, ``oom``,
with ``frames``), for the live workspaces (a destroyed workspace's history goes with it). Host
memory (arenas, blocks outside them, huge mappings) is one device, each CUDA device another;
``devices`` names them by index. ``dump_snapshot(path)`` writes the pickle that
https://pytorch.org/memory_viz and ``python -m torch.cuda._memory_viz`` read.

Beyond PyTorch's schema, a snapshot carries ``cycles`` (one entry per recorded cycle end: its
peak, spills, the mappings it made and the allocation sites that spilled or grew the arena), and
trace entries carry ``workspace``, ``workspace_id`` (one name may be a workspace per thread),
``cycle`` and ``kind``; viewers ignore what they do not know. The 64-byte header in front of each
block is an inactive block of its own in ``segments``.

``recommend(snapshot)`` replays the recorded cycles through the core's allocator and returns the
configuration that would have served them without a spill, with the spills and footprint of
both. ``python -m rustws replay FILE`` prints the same for a dumped snapshot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
from collections.abc import Callable, Iterable
from typing import Any

from . import _errors, _rustws
from ._config import WorkspaceConfiguration

__all__ = [
    "Recommendation",
    "ReplayOutcome",
    "attach_oom_observer",
    "cycle_sites",
    "detach_oom_observer",
    "dump_snapshot",
    "plot_timeline",
    "recommend",
    "record_history",
    "recorded_workspaces",
    "replay",
    "set_oom_snapshot",
    "snapshot",
    "timeline",
    "user_frame",
]

_KINDS = {1: "arena", 2: "external", 3: "bypass", 4: "huge"}


def record_history(
    enabled: bool = True, *, max_entries: int = 100_000, stacks: str | None = "python"
) -> None:
    """Records every workspace's timeline from now on, into a ring of the last ``max_entries``
    events per workspace (workspaces made later record too); ``enabled=False`` stops and drops
    what was recorded. ``stacks="python"`` records the Python stack of each allocation (about
    30 ns a frame: 1 microsecond at 25 frames, see ``benches/README.md``); ``None`` records
    without stacks (about 130 ns per captured allocation). Off, recording costs nothing."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    if stacks not in ("python", None):
        raise ValueError(f"stacks must be 'python' or None, got {stacks!r}")
    if isinstance(max_entries, bool) or not isinstance(max_entries, int):
        raise TypeError(f"max_entries must be an int, got {type(max_entries).__name__}")
    if max_entries < 1:
        raise ValueError(f"max_entries must be at least 1, got {max_entries}")
    _rustws.record_history(max_entries if enabled else None, stacks == "python")


class _Frames:
    """Stack numbers to frame lists, each made once."""

    def __init__(self) -> None:
        self._made: dict[int, list[dict[str, Any]]] = {0: []}
        self._lines: dict[Any, list[tuple[int, int, int | None]]] = {}

    def __call__(self, stack: int) -> list[dict[str, Any]]:
        frames = self._made.get(stack)
        if frames is None:
            frames = [
                {"filename": code.co_filename, "line": self._line(code, lasti), "name": code.co_name}
                for code, lasti in _rustws.stack_frames(stack)
            ]
            self._made[stack] = frames
        return frames

    def _line(self, code: Any, lasti: int) -> int:
        """The line of the instruction at byte offset ``lasti`` (as ``frame.f_lineno`` says)."""
        ranges = self._lines.get(code)
        if ranges is None:
            ranges = self._lines[code] = list(code.co_lines())
        for start, end, line in ranges:
            if start <= lasti < end:
                return line if line is not None else code.co_firstlineno
        return code.co_firstlineno


def snapshot() -> dict[str, Any]:
    """Every workspace's memory now and its recorded timeline, in the schema of
    ``torch.cuda.memory._snapshot()`` (see the module's documentation)."""
    return _snapshot(_rustws.memory_state())


def _decode(packed: list[Any]) -> list[Any]:
    """``_rustws.memory_state()``'s words as rows: ``(name, id, device, ordinal, configuration,
    segments, events, dropped)``, a segment ``(kind, address, size, blocks)``, a block ``(address,
    size, requested, pinned)``, an event ``(action, address, size, cycle, time_ns, stack, block
    kind, extra)``."""
    actions, kinds = _rustws.EVENT_ACTIONS, _rustws.SEGMENT_KINDS
    rows = []
    for name, wid, device, ordinal, values, seg_words, block_words, event_words, dropped in packed:
        words = memoryview(block_words).cast("Q").tolist()
        blocks = [(a, n, r, bool(p)) for a, n, r, p in zip(*[iter(words)] * 4, strict=True)]
        words = memoryview(seg_words).cast("Q").tolist()
        segs = [
            (kinds[k], address, size, blocks[first : first + count])
            for k, address, size, first, count in zip(*[iter(words)] * 5, strict=True)
        ]
        words = memoryview(event_words).cast("Q").tolist()
        events = [(actions[e[0]], *e[1:]) for e in zip(*[iter(words)] * 8, strict=True)]
        config = dict(zip(_rustws.CONFIG_FIELDS, values, strict=True))
        rows.append((name, wid, device, ordinal, config, segs, events, dropped))
    return rows


def _snapshot(packed: list[Any]) -> dict[str, Any]:
    state = _decode(packed)
    names = _device_names({(device, ordinal) for _, _, device, ordinal, *_ in state})
    index = {d: i for i, d in enumerate(names)}
    frames = _Frames()
    segments: list[dict[str, Any]] = []
    traces: list[list[tuple[int, dict[str, Any]]]] = [[] for _ in names]
    cycles: list[dict[str, Any]] = []
    workspaces: list[dict[str, Any]] = []
    for name, wid, device, ordinal, config, segs, events, dropped in state:
        dev = index[_device_name(device, ordinal)]
        workspaces.append(
            {
                "name": name,
                "id": wid,
                "device": dev,
                "config": config,
                "events": len(events),
                "dropped": dropped,
            }
        )
        last_stack: dict[int, int] = {}
        mine: list[dict[str, Any]] = []
        for action, addr, size, cycle, time_ns, stack, block_kind, extra in events:
            e: dict[str, Any] = {
                "action": action,
                "addr": addr,
                "size": size,
                "stream": 0,
                "time_us": time_ns // 1000,
                "frames": frames(stack),
                "workspace": name,
                "workspace_id": wid,
                "cycle": cycle,
            }
            if action == "alloc":
                e["kind"] = _KINDS.get(block_kind, "arena")
                last_stack[addr] = stack
            elif action == "oom":
                e["device_free"] = extra
            elif action == "cycle_close":
                e["spills"] = extra
            traces[dev].append((time_ns, e))
            mine.append(e)
        for kind, address, size, blocks in segs:
            segments.append(_segment(dev, name, wid, kind, address, size, blocks, last_stack, frames))
        cycles.extend(_cycles(name, wid, mine))
    segments.sort(key=lambda s: (s["device"], s["address"]))
    return {
        "segments": segments,
        "device_traces": [[e for _, e in sorted(t, key=lambda p: p[0])] for t in traces],
        "devices": names,
        "workspaces": workspaces,
        "cycles": cycles,
    }


def _device_name(device: str, ordinal: int) -> str:
    return f"cuda:{ordinal}" if device == "cuda" else device


def _device_names(devices: Iterable[tuple[str, int]]) -> list[str]:
    """Device indices as PyTorch numbers them: CUDA devices by ordinal, then host memory (and the
    host stand-in for a device, in tests)."""
    cuda = [o for d, o in devices if d == "cuda"]
    names = [f"cuda:{i}" for i in range(max(cuda) + 1)] if cuda else []
    names.append("cpu")
    if any(d == "standin" for d, _ in devices):
        names.append("standin")
    return names


def _segment(
    device: int,
    workspace: str,
    wid: int,
    kind: str,
    address: int,
    size: int,
    blocks: list[tuple[int, int, int, bool]],
    last_stack: dict[int, int],
    frames: _Frames,
) -> dict[str, Any]:
    """One segment, its blocks tiling it: live blocks, and inactive ones for headers and free
    memory between them."""
    tiles: list[dict[str, Any]] = []
    at, end = address, address + size
    allocated = requested = 0
    for addr, bsize, breq, pinned in sorted(blocks):
        if addr > at:
            tiles.append({"address": at, "size": addr - at, "requested_size": 0, "state": "inactive"})
        tiles.append(
            {
                "address": addr,
                "size": bsize,
                "requested_size": breq,
                "state": "active_allocated",
                "frames": frames(last_stack.get(addr, 0)),
                "pinned": pinned,
            }
        )
        allocated += bsize
        requested += breq
        at = addr + bsize
    if at < end:
        tiles.append({"address": at, "size": end - at, "requested_size": 0, "state": "inactive"})
    return {
        "device": device,
        "address": address,
        "total_size": size,
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": requested,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": tiles,
        "workspace": workspace,
        "workspace_id": wid,
        "kind": kind,
    }


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _library_dirs() -> tuple[str, ...]:
    """Where installed libraries and the standard library live."""
    import sysconfig

    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return tuple(os.path.abspath(d) + os.sep for d in dirs)


_LIBRARIES = _library_dirs()


def user_frame(frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Where the program asked for the memory: the innermost frame outside rustws, installed
    libraries (NumPy's Python layer ...) and the standard library; failing that, the innermost
    outside rustws."""
    paths = [os.path.abspath(f["filename"]) for f in frames]
    for f, p in zip(frames, paths, strict=True):
        if not p.startswith(_PACKAGE) and not p.startswith(_LIBRARIES):
            return f
    for f, p in zip(frames, paths, strict=True):
        if not p.startswith(_PACKAGE):
            return f
    return frames[0] if frames else None


def cycle_sites(trace: list[dict[str, Any]], cycle: int, *, top: int = 5) -> list[dict[str, Any]]:
    """The allocation sites that made cycle ``cycle`` of a recorded trace spill or grow its arena:
    the bytes of its allocations outside the arena, by the stack that made them, largest first."""
    by_site: dict[tuple[tuple[str, int, str], ...], dict[str, Any]] = {}
    for e in trace:
        if e.get("action") != "alloc" or e.get("cycle") != cycle:
            continue
        if e.get("kind") not in ("external", "huge"):
            continue
        key = tuple((f["filename"], f["line"], f["name"]) for f in e["frames"])
        site = by_site.setdefault(key, {"frames": e["frames"], "bytes": 0, "count": 0})
        site["bytes"] += e["size"]
        site["count"] += 1
    return sorted(by_site.values(), key=lambda s: -s["bytes"])[:top]


def _cycles(workspace: str, wid: int, trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per recorded cycle end of one workspace: its peak, spills, the mappings it made,
    and (where it spilled or mapped memory) the sites that allocated outside the arena."""
    made: dict[int, int] = {}
    depth = 0
    for e in trace:
        if e["action"] == "cycle_open":
            depth += 1
        elif e["action"] == "cycle_close":
            depth = max(0, depth - 1)
        elif e["action"] == "segment_alloc" and depth:
            made[e["cycle"]] = made.get(e["cycle"], 0) + e["size"]
    out = []
    for e in trace:
        if e["action"] != "cycle_close":
            continue
        c = e["cycle"]
        out.append(
            {
                "workspace": workspace,
                "workspace_id": wid,
                "cycle": c,
                "time_us": e["time_us"],
                "peak_bytes": e["size"],
                "spills": e["spills"],
                "segment_bytes": made.get(c, 0),
                "sites": cycle_sites(trace, c) if e["spills"] or made.get(c) else [],
            }
        )
    return out


def dump_snapshot(path: str | os.PathLike[str]) -> None:
    """Writes ``snapshot()`` as a pickle: open it at https://pytorch.org/memory_viz, or with
    ``python -m torch.cuda._memory_viz trace_plot PATH``. The file appears whole or not at all
    (an earlier snapshot there stays until the new one is complete)."""
    _write_atomically(os.fspath(path), pickle.dumps(snapshot()))


def _write_atomically(path: str, data: bytes) -> None:
    """``data`` to ``path``, through a temporary file beside it renamed over it."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def timeline(snap: dict[str, Any], device: str = "cpu") -> dict[str, list[int]]:
    """The memory of one device of a snapshot over its recorded trace: at each event, ``time_us``,
    ``reserved`` (bytes of segments) and ``allocated`` (requested bytes of live blocks). What
    was there before the first recorded event is worked back from the snapshot's segments."""
    if device not in snap["devices"]:
        raise ValueError(f"the snapshot has no device {device!r}: it has {snap['devices']}")
    dev = snap["devices"].index(device)
    trace = snap["device_traces"][dev]
    segs = [s for s in snap["segments"] if s["device"] == dev]
    reserved = sum(s["total_size"] for s in segs)
    allocated = sum(s["requested_size"] for s in segs)
    # Back from the end to the start, then forward again.
    for e in trace:
        a = e["action"]
        reserved -= e["size"] if a == "segment_alloc" else -e["size"] if a == "segment_free" else 0
        allocated -= e["size"] if a == "alloc" else -e["size"] if a == "free_completed" else 0
    out: dict[str, list[int]] = {"time_us": [], "reserved": [], "allocated": []}
    for e in trace:
        a = e["action"]
        reserved += e["size"] if a == "segment_alloc" else -e["size"] if a == "segment_free" else 0
        allocated += e["size"] if a == "alloc" else -e["size"] if a == "free_completed" else 0
        out["time_us"].append(e["time_us"])
        out["reserved"].append(reserved)
        out["allocated"].append(allocated)
    return out


def plot_timeline(snap: dict[str, Any], path: str | os.PathLike[str], device: str = "cpu") -> None:
    """Plots ``timeline(snap, device)`` to ``path`` (PNG, SVG ...): reserved and allocated bytes
    over time, each recorded cycle shaded, refusals marked. Needs matplotlib
    (``pip install 'rustws[plots]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as missing:
        raise ImportError("plot_timeline needs matplotlib: pip install 'rustws[plots]'") from missing
    t = timeline(snap, device)
    dev = snap["devices"].index(device)
    trace = snap["device_traces"][dev]
    t0 = t["time_us"][0] if t["time_us"] else 0
    ms = [(x - t0) / 1000 for x in t["time_us"]]
    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=110)
    ax.step(
        ms, [r / 2**20 for r in t["reserved"]], where="post", label="reserved (segments)", color="#4e79a7"
    )
    ax.step(
        ms,
        [a / 2**20 for a in t["allocated"]],
        where="post",
        label="allocated (live blocks)",
        color="#f28e2c",
    )
    opened: dict[int, tuple[float, int]] = {}  # by workspace: when its open cycles began, how many
    for e in trace:
        x = (e["time_us"] - t0) / 1000
        wid = e.get("workspace_id", 0)
        if e["action"] == "cycle_open":
            start, depth = opened.get(wid, (x, 0))
            opened[wid] = (start, depth + 1)
        elif e["action"] == "cycle_close" and wid in opened:
            start, depth = opened.pop(wid)
            if depth > 1:
                opened[wid] = (start, depth - 1)
            else:
                ax.axvspan(start, x, color="#59a14f", alpha=0.08 if e["cycle"] % 2 else 0.16, lw=0)
        elif e["action"] == "oom":
            ax.axvline(x, color="#e15759", lw=1.2, label="refusal")
    ax.set_xlabel("time (ms); shaded: cycles")
    ax.set_ylabel("MiB")
    names = sorted({w["name"] for w in snap["workspaces"] if w["device"] == dev})
    ax.set_title(f"{device}: {', '.join(names)}")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.fspath(path))
    plt.close(fig)


# -- out of memory ---------------------------------------------------------------------------------

_OBSERVERS: list[Callable[[BaseException], Any]] = []
_OOM_PATH: list[str] = []


def _freeze() -> None:
    """Keeps the memory as it is at each refusal of a captured request while anything asks."""
    _rustws.freeze_at_refusals(bool(_OBSERVERS or _OOM_PATH))


def attach_oom_observer(observer: Callable[[BaseException], Any]) -> None:
    """Calls ``observer(error)`` at each refusal of a workspace with its ``WorkspaceOutOfMemory``
    (``verdict`` says why) and, as ``error.memory_snapshot``, the snapshot of every workspace as
    it was at the refusal. An explicit allocation's refusal is observed as it is raised; a
    captured one (NumPy raises its own ``MemoryError``) when its cycle ends, with the snapshot
    still taken at the refusal."""
    if not callable(observer):
        raise TypeError(f"observer must be callable, got {type(observer).__name__}")
    _OBSERVERS.append(observer)
    _freeze()


def detach_oom_observer(observer: Callable[[BaseException], Any]) -> None:
    """Stops calling an observer attached with ``attach_oom_observer``."""
    _OBSERVERS.remove(observer)
    _freeze()


def set_oom_snapshot(path: str | os.PathLike[str] | None) -> None:
    """Dumps a snapshot of every workspace, as it was at the refusal, to ``path`` at each refusal
    (``None``: stops); recording starts, with stacks, if it was off.
    ``RUSTWS_OOM_SNAPSHOT=path`` does this at import."""
    _OOM_PATH.clear()
    if path is not None:
        _OOM_PATH.append(os.fspath(path))
        if not _rustws.recording_stacks():
            record_history(True)
    _freeze()


def _on_refusal(error: Any) -> None:
    """Runs at each refusal, as its exception is made: the snapshot and the observers. A failure
    here is noted on the error, never raised instead of it."""
    if not (_OOM_PATH or _OBSERVERS):
        return
    try:
        snap = _snapshot(_rustws.memory_state((error.workspace, error.requested)))
    except Exception as e:  # the refusal is what the caller must see: noted, not raised
        error.add_note(f"rustws: no memory snapshot: {e!r}")
        return
    error.memory_snapshot = snap
    for path in list(_OOM_PATH):
        try:
            _write_atomically(path, pickle.dumps(snap))
            error.add_note(f"rustws: memory snapshot written to {path}")
        except Exception as e:  # as above
            error.add_note(f"rustws: no memory snapshot written to {path}: {e!r}")
    for observer in list(_OBSERVERS):
        try:
            observer(error)
        except Exception as e:  # as above
            error.add_note(f"rustws: the OOM observer {observer!r} failed: {e!r}")


_errors._refusal_hook = _on_refusal
if os.environ.get("RUSTWS_OOM_SNAPSHOT"):
    set_oom_snapshot(os.environ["RUSTWS_OOM_SNAPSHOT"])


# -- replay and recommendation ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ReplayOutcome:
    """What a replay of recorded cycles did under one configuration."""

    cycles: int
    spills: int
    spilled_cycles: int
    footprint_bytes: int
    arena_bytes: int
    refusals: int


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """A configuration for a recorded loop (``configuration``), what the recorded cycles would
    have done under it (``outcome``), and what they did replayed under the configuration they
    were recorded with (``recorded``); ``need_bytes`` is the most the cycles had live at once."""

    workspace: str
    workspace_id: int
    configuration: WorkspaceConfiguration
    outcome: ReplayOutcome
    recorded: ReplayOutcome
    need_bytes: int

    def table(self) -> str:
        """The comparison as text."""
        from ._workspace import _fmt_bytes

        rows = [("recorded", self.recorded), ("recommended", self.outcome)]
        lines = [
            f"workspace {self.workspace!r}: {self.outcome.cycles} cycles, need {_fmt_bytes(self.need_bytes)}",
            f"{'':<12}{'spills':>8}{'cycles spilling':>17}{'footprint':>12}{'arena':>12}",
        ]
        for label, o in rows:
            lines.append(
                f"{label:<12}{o.spills:>8}{o.spilled_cycles:>17}"
                f"{_fmt_bytes(o.footprint_bytes):>12}{_fmt_bytes(o.arena_bytes):>12}"
            )
        c = self.configuration
        lines.append(
            f"recommended: initial_size={c.initial_size}, policy_allocation="
            f"{c.policy_allocation.value}, overallocation_limit={c.overallocation_limit}, "
            f"policy_learning={c.policy_learning.value}, policy_spill={c.policy_spill.value}"
        )
        return "\n".join(lines)


def _steps(trace: list[dict[str, Any]], wid: int) -> list[tuple[int, int, int]]:
    """One workspace's recorded trace as the core's replay steps (blocks named by address and
    reuse)."""
    steps: list[tuple[int, int, int]] = []
    live: dict[int, int] = {}
    next_id = 0
    for e in trace:
        if e.get("workspace_id") != wid:
            continue
        a = e["action"]
        if a == "cycle_open":
            steps.append((0, 0, 0))
        elif a == "cycle_close":
            steps.append((1, 0, 0))
        elif a == "alloc":
            next_id += 1
            live[e["addr"]] = next_id
            steps.append((2, next_id, e["size"]))
        elif a == "free_completed" and e["addr"] in live:
            steps.append((3, live.pop(e["addr"]), 0))
    return steps


def recorded_workspaces(source: Any) -> list[tuple[int, str]]:
    """The workspaces that allocated in a snapshot's traces (``source``: a snapshot, its pickle's
    path, or a trace): their ids and names."""
    _, trace = _load(source)
    seen: dict[int, str] = {}
    for e in trace:
        if e.get("action") == "alloc" and "workspace_id" in e:
            seen.setdefault(e["workspace_id"], e["workspace"])
    return sorted(seen.items())


def _load(source: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    if isinstance(source, (str, os.PathLike)):
        with open(os.fspath(source), "rb") as f:
            source = pickle.load(f)
    if isinstance(source, dict):
        traces = source.get("device_traces")
        if not isinstance(traces, list):
            raise ValueError("a snapshot needs 'device_traces' (from rustws.memory.snapshot())")
        return source, [e for t in traces for e in t]
    if isinstance(source, list):
        return {}, source
    raise TypeError(f"expected a snapshot dict, its path or a trace list, got {type(source).__name__}")


def _recorded(
    source: Any, workspace: str | int | None, config: WorkspaceConfiguration | None
) -> tuple[str, WorkspaceConfiguration, list[tuple[int, int, int]], int]:
    """The workspace of ``source`` that ``workspace`` names (a name, or an id where several
    workspaces share a name), the configuration it was recorded with, and its steps."""
    snap, trace = _load(source)
    found = recorded_workspaces(trace)
    if not found:
        raise ValueError(
            "the trace holds no allocation of a workspace: record with "
            "rustws.memory.record_history() before the loop runs"
        )
    if workspace is None:
        picked = found
        if len(picked) > 1:
            raise ValueError(f"the trace holds several workspaces, name one (or its id): {found}")
    elif isinstance(workspace, int) and not isinstance(workspace, bool):
        picked = [w for w in found if w[0] == workspace]
    elif isinstance(workspace, str):
        picked = [w for w in found if w[1] == workspace]
        if len(picked) > 1:
            raise ValueError(
                f"several workspaces are named {workspace!r} (one per thread?): pick one by id: {picked}"
            )
    else:
        raise TypeError(f"workspace must be a name or an id, got {type(workspace).__name__}")
    if not picked:
        raise ValueError(f"workspace {workspace!r} allocated nothing in the trace")
    wid, name = picked[0]
    return name, _base(snap, wid, name, config), _steps(trace, wid), wid


def _base(
    snap: dict[str, Any], wid: int, name: str, config: WorkspaceConfiguration | None
) -> WorkspaceConfiguration:
    """The configuration given, else the one the snapshot recorded for the workspace, else the
    live workspace's of that name, else the adaptive profile."""
    if config is not None:
        if not isinstance(config, WorkspaceConfiguration):
            raise TypeError(f"config must be a WorkspaceConfiguration, got {type(config).__name__}")
        return config
    for w in snap.get("workspaces", ()):
        if w.get("id") == wid and isinstance(w.get("config"), dict):
            return WorkspaceConfiguration.from_dict(w["config"])
    from ._workspace import workspaces

    for ws in workspaces():
        if ws.name == name:
            return ws.config
    return WorkspaceConfiguration.adaptive()


def replay(
    source: Any, config: WorkspaceConfiguration, *, workspace: str | int | None = None
) -> ReplayOutcome:
    """Replays the cycles recorded in ``source`` (a snapshot, its pickle's path, or a trace)
    through a workspace configured by ``config``."""
    if not isinstance(config, WorkspaceConfiguration):
        raise TypeError(f"config must be a WorkspaceConfiguration, got {type(config).__name__}")
    _, base, steps, _ = _recorded(source, workspace, config)
    return ReplayOutcome(*_rustws.replay(base._core_dict(), steps))


def recommend(
    source: Any,
    *,
    workspace: str | int | None = None,
    config: WorkspaceConfiguration | None = None,
) -> Recommendation:
    """The configuration that would have served the cycles recorded in ``source`` (a snapshot,
    its pickle's path, or a trace) without a spill and with the least memory: an arena sized up
    front from the recorded need, with the smallest overallocation that replays without spills,
    and spills that grow it should a later cycle need more. ``config`` is the configuration the
    loop was recorded with (by default the one the snapshot holds for it); its other fields are
    kept. ``workspace``: its name, or its id where several workspaces (one per thread) share a
    name."""
    name, base, steps, wid = _recorded(source, workspace, config)
    made, outcome, recorded, need = _rustws.recommend(base._core_dict(), steps)
    return Recommendation(
        workspace=name,
        workspace_id=wid,
        configuration=WorkspaceConfiguration.from_dict(dict(zip(_rustws.CONFIG_FIELDS, made, strict=True))),
        outcome=ReplayOutcome(*outcome),
        recorded=ReplayOutcome(*recorded),
        need_bytes=need,
    )
