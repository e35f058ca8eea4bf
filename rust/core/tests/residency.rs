//! Residency: what the arena keeps resident. In a binary of its own, so that no other test's
//! memory moves the process's resident size while it is measured.

mod common;

use common::{fill, intact};
use rustws_core::*;

fn cfg() -> WorkspaceConfiguration {
    WorkspaceConfiguration::default()
}

/// Resident bytes of this process, from /proc (Linux).
fn resident_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[test]
fn a_retired_region_keeps_only_pages_under_live_blocks() {
    // REALLOCATE growth retires the old arena; one small pinned block must not keep it resident.
    let c = WorkspaceConfiguration {
        initial_size: 64 << 20,
        policy_learning: LearningPolicy::None,
        policy_spill: SpillPolicy::Reallocate,
        ..cfg()
    };
    let before = resident_bytes();
    let mut w = Workspace::new("RET", c).unwrap();
    w.enter().unwrap();
    let pinned = w.alloc(100).unwrap();
    fill(pinned.as_ptr(), 100, 4);
    w.exit().unwrap();
    w.enter().unwrap();
    let big = w.alloc(100 << 20).unwrap(); // spills; the arena grows at the cycle end
                                           // SAFETY: live, freed once.
    unsafe { w.free(big) };
    w.exit().unwrap();
    let after = resident_bytes();
    let s = w.stats();
    assert!(s.capacity_bytes > (83 + 100) << 20, "old and new regions are both mapped: {s:?}");
    // The new ~130 MiB arena is pre-faulted; the old 83 MiB one gave back all but a page or two
    // (resident together they would be over 210 MiB).
    let grown = after.saturating_sub(before);
    assert!(grown < 160 << 20, "retired region still resident: grew by {} MiB", grown >> 20);
    assert!(intact(pinned.as_ptr(), 100, 4));
    // SAFETY: live, freed once.
    unsafe { w.free(pinned) };
    assert!(w.stats().capacity_bytes < s.capacity_bytes, "the retired region goes with its last block");
}
