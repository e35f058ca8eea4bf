//! What `rustws.memory` reads from the core: every workspace of the process (a registry of weak
//! references, host and device), their recording, their segments and
//! timelines at one moment, and the replay behind a recommended configuration.

use std::sync::{Arc, Mutex, Weak};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use rustws_core::history::{Event, Segment};
use rustws_core::replay::{Outcome, Step};
use rustws_core::WorkspaceConfiguration;

use crate::config::{config_from_dict, config_to_dict};
use crate::errors::{self, to_py};
use crate::shared::Shared;
use crate::stacks;

/// A workspace of the process and the memory it holds: `"cpu"`, `"cuda"` (with its device's
/// ordinal) or `"standin"` (host memory treated as a device's).
struct Entry {
    shared: Weak<Shared>,
    device: &'static str,
    ordinal: usize,
}

static REGISTRY: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

/// Lists a new workspace; `false` where there was no room in the list.
pub(crate) fn register(shared: &Arc<Shared>, device: &'static str, ordinal: usize) -> bool {
    let mut list = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
    list.retain(|e| e.shared.strong_count() > 0);
    if list.try_reserve(1).is_err() {
        return false;
    }
    list.push(Entry { shared: Arc::downgrade(shared), device, ordinal });
    true
}

fn live() -> Vec<(Arc<Shared>, &'static str, usize)> {
    let list = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
    list.iter().filter_map(|e| e.shared.upgrade().map(|s| (s, e.device, e.ordinal))).collect()
}

/// Starts recording every workspace's timeline, now and as they are made, into rings of
/// `max_entries` events (None: stops and drops what was recorded); `stacks`: with the Python
/// stack of each allocation.
#[pyfunction]
#[pyo3(signature = (max_entries, stacks))]
pub(crate) fn record_history(py: Python<'_>, max_entries: Option<usize>, stacks: bool) -> PyResult<()> {
    if max_entries == Some(0) {
        return Err(PyValueError::new_err("max_entries must be at least 1, got 0"));
    }
    rustws_core::history::record_new_workspaces(max_entries);
    stacks::set(stacks && max_entries.is_some());
    for (shared, _, _) in live() {
        let done = shared.lock().record_history(max_entries);
        done.map_err(|e| to_py(py, e))?;
    }
    Ok(())
}

/// Whether stacks are recorded.
#[pyfunction]
pub(crate) fn recording_stacks() -> bool {
    stacks::is_on()
}

type BlockRow = (usize, usize, usize, bool);
type SegmentRow = (&'static str, usize, usize, Vec<BlockRow>);
type EventRow = (&'static str, usize, usize, u64, u64, u32, u8, u64);

/// Every live workspace now: `(name, id, device, ordinal, segments, events, dropped)`, where a
/// segment is `(kind, address, size, blocks)`, a block `(address, size, requested, pinned)` and
/// an event `(action, address, size, cycle, time_ns, stack, block kind, extra)`.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub(crate) fn memory_state(
    py: Python<'_>,
) -> PyResult<Vec<(String, u64, &'static str, usize, Vec<SegmentRow>, Vec<EventRow>, u64)>> {
    let mut out = Vec::new();
    for (shared, device, ordinal) in live() {
        // What the core holds is copied under the lock; Python objects are made after it (making
        // them may run the collector, which may free this workspace's arrays).
        let (segments, events) = {
            let ws = shared.lock();
            (ws.segments(), ws.recorder().events())
        };
        let (Some(segments), Some((events, dropped))) = (segments, events) else {
            return Err(errors::no_memory(py));
        };
        let segments = segments.into_iter().map(segment_row).collect();
        let events = events.into_iter().map(event_row).collect();
        out.push((shared.name.to_string(), shared.id, device, ordinal, segments, events, dropped));
    }
    Ok(out)
}

fn segment_row(s: Segment) -> SegmentRow {
    let blocks = s.blocks.iter().map(|b| (b.addr, b.size, b.requested, b.pinned)).collect();
    (s.kind.name(), s.address, s.size, blocks)
}

fn event_row(e: Event) -> EventRow {
    (e.action.name(), e.addr, e.size, e.cycle, e.time_ns, e.context, e.kind, e.extra)
}

/// The frames of a recorded stack: `(code object, byte offset of its instruction)`, innermost
/// first (`rustws.memory` finds the lines).
#[pyfunction]
pub(crate) fn stack_frames(py: Python<'_>, stack: u32) -> Vec<(Py<PyAny>, i32)> {
    stacks::frames(py, stack)
}

/// A recorded loop's steps: `(0 open | 1 close | 2 alloc | 3 free, block, size)`.
fn steps(rows: Vec<(u8, u64, usize)>) -> PyResult<Vec<Step>> {
    rows.into_iter()
        .map(|(op, id, size)| match op {
            0 => Ok(Step::Open),
            1 => Ok(Step::Close),
            2 => Ok(Step::Alloc { id, size }),
            3 => Ok(Step::Free { id }),
            _ => Err(PyValueError::new_err(format!("invalid step {op}: expected 0 to 3"))),
        })
        .collect()
}

type OutcomeRow = (u64, u64, u64, usize, usize, u64);

fn outcome_row(o: Outcome) -> OutcomeRow {
    (o.cycles, o.spills, o.spilled_cycles, o.footprint, o.capacity, o.refusals)
}

/// Replays `steps` under `config`: `(cycles, spills, spilled cycles, footprint, capacity,
/// refusals)`.
#[pyfunction]
pub(crate) fn replay(py: Python<'_>, config: &Bound<'_, PyDict>, steps: Vec<(u8, u64, usize)>) -> PyResult<OutcomeRow> {
    let c: WorkspaceConfiguration = config_from_dict(config)?;
    let steps = self::steps(steps)?;
    let done = py.detach(|| rustws_core::replay::replay(&c, &steps));
    done.map(outcome_row).map_err(|e| to_py(py, e))
}

/// The configuration recommended for `steps` recorded under `config`: `(configuration, its
/// outcome, the recorded configuration's outcome, the recorded need)`.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub(crate) fn recommend<'py>(
    py: Python<'py>,
    config: &Bound<'py, PyDict>,
    steps: Vec<(u8, u64, usize)>,
) -> PyResult<(Bound<'py, PyDict>, OutcomeRow, OutcomeRow, usize)> {
    let c = config_from_dict(config)?;
    let steps = self::steps(steps)?;
    let done = py.detach(|| rustws_core::replay::recommend(&c, &steps));
    let r = done.map_err(|e| to_py(py, e))?;
    Ok((config_to_dict(py, &r.config)?, outcome_row(r.outcome), outcome_row(r.recorded), r.need))
}
