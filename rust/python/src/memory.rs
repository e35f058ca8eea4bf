//! What `rustws.memory` reads from the core: every workspace of the process (a registry of weak
//! references, host and device), their recording, their segments and
//! timelines at one moment, and the replay behind a recommended configuration.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use rustws_core::history::{Action, Event, Segment};
use rustws_core::replay::{Outcome, Step};
use rustws_core::WorkspaceConfiguration;

use crate::config::{config_from_dict, config_to_dict};
use crate::errors::{self, to_py};
use crate::shared::{self, listed};
use crate::stacks;

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
    if max_entries.is_none() {
        stacks::clear();
    }
    for (shared, _, _) in listed().ok_or_else(|| errors::no_memory(py))? {
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
type StateRow<'py> = (String, u64, &'static str, usize, Bound<'py, PyDict>, Vec<SegmentRow>, Vec<EventRow>, u64);

/// Every live workspace now, or (`refusal`: a workspace's name and the bytes it refused) as it
/// was at that refusal of a captured request where it was kept: `(name, id, device, ordinal,
/// configuration, segments, events, dropped)`, where a segment is `(kind, address, size,
/// blocks)`, a block `(address, size, requested, pinned)` and an event `(action, address, size,
/// cycle, time_ns, stack, block kind, extra)`.
#[pyfunction]
#[pyo3(signature = (refusal=None))]
pub(crate) fn memory_state(py: Python<'_>, refusal: Option<(String, u64)>) -> PyResult<Vec<StateRow<'_>>> {
    // What the core holds is copied under each lock; Python objects are made after (making them
    // may run the collector, which may free a workspace's arrays).
    let kept = refusal.and_then(|(name, requested)| shared::take_frozen(&name, requested));
    let states = match kept {
        Some(states) => states,
        None => shared::memory_states().ok_or_else(|| errors::no_memory(py))?,
    };
    let mut out = Vec::new();
    for s in states {
        let config = config_to_dict(py, &s.config)?;
        let segments = s.segments.into_iter().map(segment_row).collect();
        let events = s.events.into_iter().map(event_row).collect();
        out.push((s.name.to_string(), s.id, s.device, s.ordinal, config, segments, events, s.dropped));
    }
    Ok(out)
}

/// Keeps every workspace's memory as it is at each refusal of a captured request from now on (for
/// `memory_state(refusal=...)`), or stops.
#[pyfunction]
pub(crate) fn freeze_at_refusals(on: bool) {
    shared::freeze_at_refusals(on);
}

/// One workspace's allocations of one cycle: `(size, stack, block kind)` each.
#[pyfunction]
pub(crate) fn cycle_allocations(py: Python<'_>, id: u64, cycle: u64) -> PyResult<Vec<(usize, u32, u8)>> {
    let Some(all) = listed() else { return Err(errors::no_memory(py)) };
    let Some((shared, _, _)) = all.into_iter().find(|(s, _, _)| s.id == id) else { return Ok(Vec::new()) };
    let picked = shared.lock().recorder().select(|e| e.action == Action::Alloc && e.cycle == cycle);
    let picked = picked.ok_or_else(|| errors::no_memory(py))?;
    Ok(picked.into_iter().map(|e| (e.size, e.context, e.kind)).collect())
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
