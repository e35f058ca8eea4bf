//! Replays a recorded loop through a workspace of another configuration, and recommends one: the
//! smallest arena that would have served every recorded cycle without a spill. The replay takes
//! address space, not memory: its regions are never pre-faulted and blocks are never written
//! beyond their headers.

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::backend::{AnonymousMemory, Backend, BackendError};
use crate::classes::{class_of, class_size};
use crate::config::{AllocationPolicy, LearningPolicy, SpillPolicy, WorkspaceConfiguration};
use crate::error::Error;
use crate::workspace::Workspace;
use crate::HEADER;

/// One step of a recorded loop. Blocks are named by the recording (any number unique among the
/// blocks live at once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Open,
    Close,
    Alloc { id: u64, size: usize },
    Free { id: u64 },
}

/// What a replay did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Cycles closed.
    pub cycles: u64,
    /// Requests served outside a sized arena.
    pub spills: u64,
    /// Cycles with at least one spill.
    pub spilled_cycles: u64,
    /// The most the workspace held from the system at once (bytes).
    pub footprint: usize,
    /// The arena's size at the end (bytes).
    pub capacity: usize,
    /// Requests refused (under a `max_size` or the FAIL spill policy).
    pub refusals: u64,
}

/// A recommended configuration, what the replay of the recording under it did, and what the
/// replay under the configuration it was recorded with did.
#[derive(Debug, Clone, PartialEq)]
pub struct Recommendation {
    pub config: WorkspaceConfiguration,
    pub outcome: Outcome,
    pub recorded: Outcome,
    /// The largest slot bytes (headers included) live at once inside a cycle of the recording.
    pub need: usize,
}

/// Anonymous memory that a replay never pre-faults.
#[derive(Debug)]
struct AddressSpaceOnly;

impl Backend for AddressSpaceOnly {
    fn name(&self) -> &'static str {
        "replay"
    }

    fn map(&self, len: usize, _prefault: bool) -> Result<NonNull<u8>, BackendError> {
        AnonymousMemory.map(len, false)
    }

    /// # Safety
    /// As for [`Backend::unmap`].
    unsafe fn unmap(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: forwarded: the mapping is AnonymousMemory's.
        unsafe { AnonymousMemory.unmap(ptr, len) }
    }

    fn alloc_block(&self, len: usize) -> Result<NonNull<u8>, BackendError> {
        AnonymousMemory.alloc_block(len)
    }

    /// # Safety
    /// As for [`Backend::free_block`].
    unsafe fn free_block(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: forwarded: the block is AnonymousMemory's.
        unsafe { AnonymousMemory.free_block(ptr, len) }
    }

    fn discard(&self, ptr: NonNull<u8>, len: usize) -> bool {
        AnonymousMemory.discard(ptr, len)
    }

    fn discard_zeroes(&self) -> bool {
        AnonymousMemory.discard_zeroes()
    }
}

/// Replays `steps` through a workspace configured by `config`. Steps that do not fit the
/// recording's own order (a free of a block never allocated, a close with no cycle open: a
/// recording whose oldest events were dropped) are skipped.
pub fn replay(config: &WorkspaceConfiguration, steps: &[Step]) -> Result<Outcome, Error> {
    // Replays record nothing, whatever workspaces made now do.
    let mut ws = Workspace::made("replay", config.clone(), Arc::new(AddressSpaceOnly), None)?;
    let mut live: HashMap<u64, NonNull<u8>> = HashMap::new();
    let mut out = Outcome::default();
    let mut result = Ok(());
    for step in steps {
        match *step {
            Step::Open => {
                if let Err(e) = ws.open_cycle() {
                    result = Err(e);
                    break;
                }
            }
            Step::Close if ws.open_cycles() > 0 => match ws.close_cycle() {
                Ok(r) => {
                    out.cycles += 1;
                    out.spilled_cycles += u64::from(r.spills > 0);
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            },
            Step::Close => {}
            Step::Alloc { id, size } => match ws.alloc(size.max(1)) {
                Ok(p) => {
                    if let Some(old) = live.insert(id, p) {
                        // The recording reused a name without its free: the old block goes.
                        // SAFETY: a live block of `ws`, freed once.
                        unsafe { ws.free(old) };
                    }
                }
                Err(e) if e.is_out_of_memory() => out.refusals += 1,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            },
            Step::Free { id } => {
                if let Some(p) = live.remove(&id) {
                    // SAFETY: a live block of `ws`, freed once.
                    unsafe { ws.free(p) };
                }
            }
        }
        out.footprint = out.footprint.max(ws.footprint());
    }
    for (_, p) in live.drain() {
        // SAFETY: a live block of `ws`, freed once: the workspace is dropped with none live.
        unsafe { ws.free(p) };
    }
    result?;
    let stats = ws.stats();
    out.spills = stats.spill_count;
    out.capacity = stats.capacity_bytes as usize;
    Ok(out)
}

/// The largest slot bytes live at once inside a cycle (blocks of earlier cycles still live
/// included): what an arena must hold for the recording to run without spills, before the room
/// fragmentation takes.
pub fn cycle_need(steps: &[Step]) -> usize {
    let slot = |size: usize| class_of(size.max(1)).map_or(usize::MAX / 2, |c| class_size(c) + HEADER);
    let mut live: HashMap<u64, usize> = HashMap::new();
    let (mut bytes, mut need, mut open) = (0usize, 0usize, 0u32);
    for step in steps {
        match *step {
            Step::Open => open += 1,
            Step::Close => open = open.saturating_sub(1),
            Step::Alloc { id, size } => {
                let s = slot(size);
                bytes = bytes.saturating_add(s);
                if let Some(old) = live.insert(id, s) {
                    bytes -= old;
                }
                if open > 0 {
                    need = need.max(bytes);
                }
            }
            Step::Free { id } => bytes -= live.remove(&id).unwrap_or(0),
        }
    }
    need
}

/// Overallocations tried, smallest first: the first that replays without a spill is chosen.
const OVERALLOCATIONS: [f64; 7] = [0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0];

/// The configuration that would have served the recorded loop from its first cycle without a
/// spill, with the least memory: `base` (the configuration it was recorded with) with an arena
/// sized up front (`initial_size` the recorded need, the smallest overallocation that replays
/// without spills, no learning) and spills that grow the arena should a later cycle need more.
/// Where no size replays without spills, the one with the fewest.
pub fn recommend(base: &WorkspaceConfiguration, steps: &[Step]) -> Result<Recommendation, Error> {
    let recorded = replay(base, steps)?;
    let need = cycle_need(steps);
    let mut best: Option<(WorkspaceConfiguration, Outcome)> = None;
    for over in OVERALLOCATIONS {
        let mut c = base.clone();
        c.initial_size = need as u64;
        c.min_size = 0;
        c.cycles_before_initialization = 0;
        c.policy_learning = LearningPolicy::None;
        c.policy_allocation = AllocationPolicy::Overallocate;
        c.overallocation_limit = over;
        if c.policy_spill != SpillPolicy::Fail {
            c.policy_spill = SpillPolicy::Reallocate;
        }
        if c.validate().is_err() {
            continue;
        }
        let o = replay(&c, steps)?;
        let better = best.as_ref().is_none_or(|(_, b)| (o.spills, o.refusals) < (b.spills, b.refusals));
        if better {
            best = Some((c, o));
        }
        if o.spills == 0 && o.refusals == 0 {
            break;
        }
    }
    let (config, outcome) = best.unwrap_or_else(|| (base.clone(), recorded));
    Ok(Recommendation { config, outcome, recorded, need })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A loop of `cycles` cycles, each allocating `sizes` and freeing all but the last one
    /// (kept until the next cycle frees it: state a loop replaces).
    fn program(cycles: u64, sizes: &[usize]) -> Vec<Step> {
        let mut steps = Vec::new();
        let mut id = 0;
        let mut kept = None;
        for _ in 0..cycles {
            steps.push(Step::Open);
            let first = id;
            for &size in sizes {
                steps.push(Step::Alloc { id, size });
                id += 1;
            }
            if let Some(k) = kept.take() {
                steps.push(Step::Free { id: k });
            }
            for i in first..id - 1 {
                steps.push(Step::Free { id: i });
            }
            kept = Some(id - 1);
            steps.push(Step::Close);
        }
        steps
    }

    #[test]
    fn the_recommendation_replays_without_spills_and_is_no_larger_than_needed() {
        let steps = program(12, &[1 << 20, 300 << 10, 2 << 20, 5000, 1 << 20]);
        let need = cycle_need(&steps);
        assert!(need > (4 << 20) + (300 << 10), "the cycle's blocks and the kept one: {need}");
        // A small fixed arena spills every cycle.
        let small = WorkspaceConfiguration {
            initial_size: 1 << 20,
            policy_learning: LearningPolicy::None,
            policy_spill: SpillPolicy::External,
            ..WorkspaceConfiguration::default()
        };
        let r = recommend(&small, &steps).unwrap();
        assert!(r.recorded.spills >= 12, "{:?}", r.recorded);
        assert_eq!((r.outcome.spills, r.outcome.refusals), (0, 0), "{:?}", r);
        assert_eq!(r.outcome.cycles, 12);
        assert_eq!(r.config.initial_size as usize, need);
        assert!(r.outcome.footprint <= 2 * need, "{} for a need of {need}", r.outcome.footprint);
        // Replayed under the recommendation, it is what `recommend` said.
        assert_eq!(replay(&r.config, &steps).unwrap(), r.outcome);
    }

    #[test]
    fn frees_of_unknown_blocks_and_stray_closes_are_skipped() {
        let steps =
            [Step::Free { id: 9 }, Step::Close, Step::Open, Step::Alloc { id: 1, size: 100 }, Step::Close, Step::Close];
        let o = replay(&WorkspaceConfiguration::default(), &steps).unwrap();
        assert_eq!(o.cycles, 1);
    }
}
