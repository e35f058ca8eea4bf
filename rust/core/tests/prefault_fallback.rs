//! Pre-faulting on a kernel that refuses `MADV_POPULATE_WRITE` (before 5.14, or gVisor): the
//! fallback touches every page of the learned part of the arena when a cycle opens, while blocks
//! made between cycles and blocks pinned by an earlier cycle live there. Not one of their bytes,
//! and not one block header, may change. A test binary of its own: the switch that refuses the
//! advice is process-wide.

mod common;

use std::ptr::NonNull;

use common::{fill, intact};
use rustws_core::backend::testing;
use rustws_core::*;

const MIB: usize = 1 << 20;

#[test]
fn the_touching_fallback_never_changes_a_live_block() {
    testing::refuse_populate_write(true);
    for (name, b) in common::backends().into_iter().filter(|(_, b)| b.host_accessible()) {
        let mut w = Workspace::with_backend("P", WorkspaceConfiguration::adaptive(), b.clone()).unwrap();
        // Cycles that teach a need of a few MiB and leave blocks pinned across cycles.
        let mut live: Vec<(NonNull<u8>, usize, u8)> = Vec::new();
        let mut touched_over_live = false;
        for cycle in 0..4u8 {
            let touched = testing::pages_touched();
            let in_arena = w.stats().used_bytes > 0;
            w.enter().unwrap();
            touched_over_live |= in_arena && testing::pages_touched() > touched;
            for (p, len, seed) in &live {
                assert!(intact(p.as_ptr(), *len, *seed), "{name}: cycle {cycle} changed a live block");
            }
            let mut temps = Vec::new();
            for i in 0..6 {
                let len = MIB / 2 + i * 4096 + 24;
                let p = w.alloc(len).unwrap();
                fill(p.as_ptr(), len, i as u8);
                temps.push(p);
            }
            // One block of each cycle escapes it.
            let keep = w.alloc(100_000).unwrap();
            fill(keep.as_ptr(), 100_000, 100 + cycle);
            live.push((keep, 100_000, 100 + cycle));
            for p in temps {
                // SAFETY: live, freed once.
                unsafe { w.free(p) };
            }
            w.exit().unwrap();
            // Blocks made between cycles (`ws.empty` outside a `with`, `borrow()`).
            for i in 0..8u8 {
                let len = 3000 + i as usize * 777;
                let p = w.alloc(len).unwrap();
                fill(p.as_ptr(), len, 200 + i);
                live.push((p, len, 200 + i));
            }
        }
        if matches!(name, "anonymous" | "limit(anonymous)") {
            assert!(touched_over_live, "{name}: no cycle pre-faulted an arena holding live blocks");
        }
        for (p, len, seed) in live.drain(..) {
            assert!(intact(p.as_ptr(), len, seed), "{name}: a live block changed");
            // SAFETY: live, freed once (a header the fallback had overwritten would make this a
            // double free or a foreign pointer).
            unsafe { w.free(p) };
        }
        w.verify();
        assert_eq!(w.stats().used_bytes + w.stats().external_bytes, 0, "{name}");
    }
    testing::refuse_populate_write(false);
}
