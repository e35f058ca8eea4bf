//! What `rustws.memory` reads from the core: every workspace of the process (a registry of weak
//! references, host and device), their recording, their segments and
//! timelines at one moment, and the replay behind a recommended configuration.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};
use rustws_core::history::Action;
use rustws_core::replay::{Outcome, Step};
use rustws_core::WorkspaceConfiguration;

use crate::calls::{self, Arg};
use crate::config::config_from_dict;
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

/// Every live workspace now, or (`refusal`: a workspace's name and the bytes it refused) as it
/// was at that refusal of a captured request where it was kept. One tuple per workspace: `(name,
/// id, device, ordinal, configuration, segments, blocks, events, dropped)`, the configuration
/// its fields' values in the order of `CONFIG_FIELDS`, and the rest native-endian 64-bit words
/// as `bytes`: 5 a segment (kind, address, size, first block, blocks), 4 a live block (address,
/// size, requested, pinned), 8 an event (action, address, size, cycle, time_ns, stack, block
/// kind, extra); kinds and actions number `SEGMENT_KINDS` and `EVENT_ACTIONS`.
///
/// Made where memory may have run out (a refusal's snapshot): every allocation on the way can
/// fail, and a failure is Python's `MemoryError`.
#[pyfunction]
#[pyo3(signature = (refusal=None))]
pub(crate) fn memory_state<'py>(
    py: Python<'py>,
    refusal: Option<(Bound<'py, PyString>, u64)>,
) -> PyResult<Bound<'py, PyAny>> {
    // What the core holds is copied under each lock; Python objects are made after (making them
    // may run the collector, which may free a workspace's arrays).
    let kept = match &refusal {
        Some((name, requested)) => shared::take_frozen(name.to_str()?, *requested),
        None => None,
    };
    let states = match kept {
        Some(states) => states,
        None => shared::memory_states().ok_or_else(|| errors::no_memory(py))?,
    };
    let out = calls::list(py)?;
    for s in &states {
        let (segments, blocks, events) = pack(s).ok_or_else(|| errors::no_memory(py))?;
        let config = config_values(py, &s.config)?;
        let row = calls::tuple(
            py,
            &[
                Arg::Text(&s.name),
                Arg::Int(s.id),
                Arg::Text(s.device),
                Arg::Int(s.ordinal as u64),
                Arg::Object(&config),
                Arg::Words(&segments),
                Arg::Words(&blocks),
                Arg::Words(&events),
                Arg::Int(s.dropped),
            ],
        )?;
        calls::append(&out, &row)?;
    }
    Ok(out)
}

/// A workspace's segments, blocks and events as words (see [`memory_state`]); `None` where the
/// system had no room for them.
fn pack(s: &shared::MemoryState) -> Option<(Vec<u64>, Vec<u64>, Vec<u64>)> {
    let blocks_len = s.segments.iter().map(|g| g.blocks.len()).sum::<usize>();
    let (mut segments, mut blocks, mut events) = (Vec::new(), Vec::new(), Vec::new());
    segments.try_reserve_exact(5 * s.segments.len()).ok()?;
    blocks.try_reserve_exact(4 * blocks_len).ok()?;
    events.try_reserve_exact(8 * s.events.len()).ok()?;
    for g in &s.segments {
        let first = (blocks.len() / 4) as u64;
        segments.extend([g.kind as u64, g.address as u64, g.size as u64, first, g.blocks.len() as u64]);
        for b in &g.blocks {
            blocks.extend([b.addr as u64, b.size as u64, b.requested as u64, u64::from(b.pinned)]);
        }
    }
    for e in &s.events {
        events.extend([
            e.action as u64,
            e.addr as u64,
            e.size as u64,
            e.cycle,
            e.time_ns,
            u64::from(e.context),
            u64::from(e.kind),
            e.extra,
        ]);
    }
    Some((segments, blocks, events))
}

/// A configuration's values in the order of `WorkspaceConfiguration::FIELDS`, as a tuple.
fn config_values<'py>(py: Python<'py>, c: &WorkspaceConfiguration) -> PyResult<Bound<'py, PyAny>> {
    let path = c.temp_file_path.as_deref().and_then(|p| p.to_str());
    calls::tuple(
        py,
        &[
            Arg::Int(c.initial_size),
            Arg::Int(c.min_size),
            Arg::Int(c.max_size),
            Arg::Float(c.overallocation_limit),
            Arg::Int(c.cycles_before_initialization),
            Arg::Text(c.policy_allocation.as_str()),
            Arg::Text(c.policy_learning.as_str()),
            Arg::Text(c.policy_spill.as_str()),
            Arg::Text(c.policy_reset.as_str()),
            Arg::Text(c.policy_mirroring.as_str()),
            Arg::Text(c.policy_location.as_str()),
            path.map_or(Arg::None, Arg::Text),
            Arg::Int(c.temp_block_size),
            Arg::Int(c.helper_min_size),
            Arg::Bool(c.helper_allow_fallback),
            Arg::Bool(c.use_cycle_detector),
            Arg::Text(c.debug_mode.as_str()),
        ],
    )
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

/// The frames of a recorded stack: a list of `(code object, byte offset of its instruction)`,
/// innermost first (`rustws.memory` finds the lines). Made where memory may have run out: a
/// failure is Python's `MemoryError`.
#[pyfunction]
pub(crate) fn stack_frames(py: Python<'_>, stack: u32) -> PyResult<Bound<'_, PyAny>> {
    let frames = stacks::frames(py, stack).ok_or_else(|| errors::no_memory(py))?;
    let out = calls::list(py)?;
    for (code, lasti) in frames {
        let code = code.into_bound(py);
        let row = calls::tuple(py, &[Arg::Object(&code), Arg::Int(lasti.max(0) as u64)])?;
        calls::append(&out, &row)?;
    }
    Ok(out)
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
/// outcome, the recorded configuration's outcome, the recorded need)`, the configuration its
/// fields' values in the order of `CONFIG_FIELDS` (as `memory_state` gives them).
#[pyfunction]
#[allow(clippy::type_complexity)]
pub(crate) fn recommend<'py>(
    py: Python<'py>,
    config: &Bound<'py, PyDict>,
    steps: Vec<(u8, u64, usize)>,
) -> PyResult<(Bound<'py, PyAny>, OutcomeRow, OutcomeRow, usize)> {
    let c = config_from_dict(config)?;
    let steps = self::steps(steps)?;
    let done = py.detach(|| rustws_core::replay::recommend(&c, &steps));
    let r = done.map_err(|e| to_py(py, e))?;
    Ok((config_values(py, &r.config)?, outcome_row(r.outcome), outcome_row(r.recorded), r.need))
}
