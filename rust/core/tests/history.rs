//! A workspace's recorded timeline and its segments at one moment: a known program gives exactly
//! the events and segments it should, the segments tile their mappings with the live blocks, and
//! a refusal is the timeline's last event with the numbers the verdict needs.

use std::sync::Arc;

use rustws_core::backend::FaultAdaptor;
use rustws_core::history::{self, Action, Event, SegmentKind};
use rustws_core::*;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn fixed(initial: usize) -> WorkspaceConfiguration {
    WorkspaceConfiguration {
        initial_size: initial as u64,
        policy_learning: LearningPolicy::None,
        policy_allocation: AllocationPolicy::Strict,
        ..WorkspaceConfiguration::default()
    }
}

fn actions(events: &[Event]) -> Vec<(&'static str, usize)> {
    events.iter().map(|e| (e.action.name(), e.size)).collect()
}

/// A 1 MiB arena under a 2 MiB limit, recording `ring` events, its cycle open.
fn limited_and_recording(name: &str, ring: usize) -> Workspace {
    let config = WorkspaceConfiguration { max_size: (2 * MIB) as u64, ..fixed(MIB) };
    let mut ws = Workspace::with_backend(name, config, Arc::new(AnonymousMemory)).unwrap();
    ws.record_history(Some(ring)).unwrap();
    ws.open_cycle().unwrap();
    ws
}

#[test]
fn a_known_program_records_its_blocks_mappings_and_cycles() {
    let mut ws = Workspace::with_backend("h", fixed(MIB), Arc::new(AnonymousMemory)).unwrap();
    ws.record_history(Some(100)).unwrap();
    ws.open_cycle().unwrap();
    ws.recorder().set_context(42);
    let a = ws.alloc(1000).unwrap();
    let b = ws.alloc(3 * MIB).unwrap(); // past the 1 MiB arena: a block of its own, a spill
                                        // SAFETY: live blocks of `ws`, freed once.
    unsafe { ws.free(a) };
    let report = ws.close_cycle().unwrap();
    assert_eq!(report.spills, 1);
    let (events, dropped) = ws.recorder().events().unwrap();
    assert_eq!(dropped, 0);
    let spill_slot = 3 * MIB + HEADER; // 3 MiB is a class of its own: its size and a header
    assert_eq!(
        actions(&events),
        [
            ("cycle_open", 0),
            ("alloc", 1000),
            ("segment_alloc", spill_slot),
            ("alloc", 3 * MIB),
            ("free_completed", 1000),
            ("cycle_close", report.peak_bytes as usize),
        ],
        "{events:#?}"
    );
    assert_eq!((events[1].addr, events[1].context, events[1].kind), (a.as_ptr() as usize, 42, BlockKind::Arena as u8));
    assert_eq!(
        (events[3].addr, events[3].context, events[3].kind),
        (b.as_ptr() as usize, 0, BlockKind::External as u8)
    );
    assert_eq!(events[2].addr + HEADER, b.as_ptr() as usize, "the block's header starts its segment");
    assert_eq!(events[5].extra, 1, "the close counts the spill");
    assert!(events.iter().all(|e| e.cycle == 0));

    // Now: the 1 MiB region, empty, and the 3 MiB block, live and pinned (it outlived its cycle).
    let segments = ws.segments().unwrap();
    assert_eq!(segments.len(), 2, "{segments:#?}");
    let region = segments.iter().find(|s| s.kind == SegmentKind::Region).unwrap();
    assert_eq!((region.size, region.blocks.len()), (MIB, 0));
    let own = segments.iter().find(|s| s.kind == SegmentKind::External).unwrap();
    assert_eq!((own.address, own.size), (events[2].addr, spill_slot));
    assert_eq!(own.blocks.len(), 1);
    let blk = own.blocks[0];
    assert_eq!((blk.addr, blk.requested, blk.pinned), (b.as_ptr() as usize, 3 * MIB, true));
    assert_eq!(blk.addr + blk.size, own.address + own.size, "the block fills its segment after its header");

    // SAFETY: live, freed once.
    unsafe { ws.free(b) };
    let (events, _) = ws.recorder().events().unwrap();
    let last = &events[events.len() - 1];
    assert_eq!((last.action, last.addr, last.size), (Action::Free, b.as_ptr() as usize, 3 * MIB));
    ws.record_history(None).unwrap();
    assert!(ws.recorder().events().unwrap().0.is_empty(), "stopping drops the history");
}

#[test]
fn arena_segments_list_their_live_blocks_in_address_order() {
    let mut ws = Workspace::with_backend("s", fixed(MIB), Arc::new(AnonymousMemory)).unwrap();
    ws.open_cycle().unwrap();
    let blocks: Vec<_> = [100, 5 * KIB, 70 * KIB, 1].iter().map(|&n| (ws.alloc(n).unwrap(), n)).collect();
    // SAFETY: a live block of `ws`, freed once.
    unsafe { ws.free(blocks[1].0) };
    let segments = ws.segments().unwrap();
    assert_eq!(segments.len(), 1);
    let live: Vec<_> = segments[0].blocks.iter().map(|b| (b.addr, b.requested)).collect();
    let want: Vec<_> = [0, 2, 3].iter().map(|&i| (blocks[i].0.as_ptr() as usize, blocks[i].1)).collect();
    assert_eq!(live, want);
    let base = segments[0].address;
    let mut end = base;
    for b in &segments[0].blocks {
        assert!(b.addr >= end + HEADER, "blocks do not overlap, headers in front");
        assert!(b.size >= b.requested && !b.pinned);
        end = b.addr + b.size;
    }
    assert!(end <= base + segments[0].size);
    for (p, _) in [blocks[0], blocks[2], blocks[3]] {
        // SAFETY: live blocks of `ws`, freed once.
        unsafe { ws.free(p) };
    }
    ws.close_cycle().unwrap();
}

#[test]
fn a_refusal_is_the_last_event_and_names_the_largest_free_run() {
    let mut ws = limited_and_recording("o", 16);
    let kept = ws.alloc(512 * KIB).unwrap();
    let err = ws.alloc(3 * MIB).unwrap_err();
    let Error::OutOfMemory(r) = &err else { panic!("{err:?}") };
    assert_eq!(r.requested, 3 * MIB as u64);
    assert_eq!(r.room, MIB as u64, "a 1 MiB region under a 2 MiB limit leaves 1 MiB");
    // The run after the kept block (large blocks start on a page: the run before it is smaller).
    let region = &ws.segments().unwrap()[0];
    let kept_block = region.blocks[0];
    assert_eq!(kept_block.addr, kept.as_ptr() as usize);
    let free_run = region.address + region.size - (kept_block.addr + kept_block.size);
    // The largest request that run serves: a size class whose slot, header and filler (a page
    // less a header, for the classes that start on a page) fit it, and the next class's do not.
    let takes = |size: usize| size + HEADER + if size >= classes::PAGE_ALIGNED_SIZE { 4096 - HEADER } else { 0 };
    let c = classes::class_of(r.largest_free as usize).unwrap();
    assert_eq!(classes::class_size(c), r.largest_free as usize, "a class size");
    assert!(takes(classes::class_size(c)) <= free_run && takes(classes::class_size(c + 1)) > free_run, "{r:?}");
    assert!(placed_size(r.requested as usize) > r.requested as usize && r.held >= r.in_use + HEADER as u64, "{r:?}");
    let (events, _) = ws.recorder().events().unwrap();
    let last = events.last().unwrap();
    assert_eq!((last.action, last.size, last.extra), (Action::Oom, 3 * MIB, MIB as u64));
    // SAFETY: live, freed once.
    unsafe { ws.free(kept) };
    ws.close_cycle().unwrap();
}

#[test]
fn recording_while_off_costs_no_event_and_segments_exist_before_recording() {
    let mut ws = Workspace::with_backend("x", fixed(MIB), Arc::new(AnonymousMemory)).unwrap();
    ws.open_cycle().unwrap();
    let p = ws.alloc(100).unwrap();
    assert!(ws.recorder().events().unwrap().0.is_empty());
    assert_eq!(ws.segments().unwrap()[0].blocks.len(), 1, "the region mapped before recording is listed");
    // SAFETY: live, freed once.
    unsafe { ws.free(p) };
    ws.close_cycle().unwrap();
}

#[test]
fn overlapping_cycles_each_record_their_open_and_close() {
    let mut ws = Workspace::with_backend("v", fixed(MIB), Arc::new(AnonymousMemory)).unwrap();
    ws.record_history(Some(64)).unwrap();
    ws.open_cycle().unwrap();
    ws.open_cycle().unwrap(); // another task's cycle, beside the first
    let a = ws.alloc(100).unwrap();
    ws.close_cycle().unwrap();
    let b = ws.alloc(200).unwrap();
    ws.close_cycle().unwrap();
    let (events, _) = ws.recorder().events().unwrap();
    let opens = events.iter().filter(|e| e.action == Action::CycleOpen).count();
    let closes: Vec<u64> = events.iter().filter(|e| e.action == Action::CycleClose).map(|e| e.cycle).collect();
    assert_eq!((opens, closes), (2, vec![0, 1]), "{events:#?}");
    let second = events.iter().position(|e| e.action == Action::Alloc && e.size == 200).unwrap();
    assert_eq!(events[second].cycle, 1, "after the first close, events belong to the next cycle");
    for p in [a, b] {
        // SAFETY: live blocks of `ws`, freed once.
        unsafe { ws.free(p) };
    }
}

#[test]
fn only_refusals_for_want_of_memory_are_oom_events_and_a_refusal_drops_the_pending_stack() {
    let mut ws = limited_and_recording("r", 64);
    ws.recorder().set_context(7);
    assert!(ws.alloc_aligned(100, 3).is_err(), "an alignment that is no power of two");
    assert!(ws.alloc(usize::MAX - 4096).is_err(), "too large for any size class");
    let p = ws.alloc(100).unwrap();
    let (events, _) = ws.recorder().events().unwrap();
    let ooms: Vec<usize> = events.iter().filter(|e| e.action == Action::Oom).map(|e| e.size).collect();
    assert_eq!(ooms, [usize::MAX - 4096], "the bad alignment is no oom");
    let alloc = events.iter().find(|e| e.action == Action::Alloc).unwrap();
    assert_eq!(alloc.context, 0, "the refused request's stack is not the next block's");
    // SAFETY: live, freed once.
    unsafe { ws.free(p) };
    ws.close_cycle().unwrap();
}

#[test]
fn a_ring_the_system_cannot_reserve_leaves_new_workspaces_unrecorded() {
    history::record_new_workspaces(Some(usize::MAX / 2));
    let made = Workspace::with_backend("u", fixed(MIB), Arc::new(AnonymousMemory));
    history::record_new_workspaces(None);
    let ws = made.expect("made, without recording");
    assert!(!ws.recorder().is_on());
}

#[test]
fn an_arena_the_system_refuses_at_a_cycle_end_is_no_oom_event() {
    // The first cycle's block is call 1; the arena the learner maps at its end, call 2, fails.
    let faults = Arc::new(FaultAdaptor::fail_nth(Arc::new(AnonymousMemory), 2, libc::ENOMEM));
    let mut ws = Workspace::with_backend("f", WorkspaceConfiguration::default(), faults.clone()).unwrap();
    ws.record_history(Some(64)).unwrap();
    ws.open_cycle().unwrap();
    let p = ws.alloc(100 << 10).unwrap();
    // SAFETY: live, freed once.
    unsafe { ws.free(p) };
    ws.close_cycle().unwrap();
    assert_eq!(faults.injected(), 1, "the arena's mapping was refused");
    assert_eq!(ws.stats().capacity_bytes, 0, "no arena yet: the next cycle end tries again");
    let (events, _) = ws.recorder().events().unwrap();
    assert!(events.iter().all(|e| e.action != Action::Oom), "no request was refused: {events:#?}");
}
