//! Frees from other threads while the owner allocates and closes cycles, as the bindings share a
//! workspace (behind one lock): NumPy arrays die on whatever thread drops them, in the middle of
//! the owner's cycles. Under ThreadSanitizer (scripts/sanitizers.sh) every access to the workspace
//! and to the blocks' bytes is checked for races; everywhere, the blocks keep their contents and
//! the accounts add up to nothing once everything is freed.

mod common;

use std::ptr::NonNull;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use common::program::MIRI;
use common::{fill, intact};
use rustws_core::*;

/// A block on its way to the thread that frees it, with what its bytes must hold.
struct Sent(NonNull<u8>, usize, u8);
// SAFETY: a block of a workspace may be freed (and read) on any thread; the workspace is reached
// only through its lock.
unsafe impl Send for Sent {}

#[test]
fn frees_from_other_threads_overlap_the_owners_allocations_and_cycle_ends() {
    let cycles = if MIRI { 6 } else { 400 };
    let configs = [
        WorkspaceConfiguration::adaptive(),
        WorkspaceConfiguration { max_size: 8 << 20, ..WorkspaceConfiguration::adaptive() },
        WorkspaceConfiguration {
            initial_size: 1 << 20,
            policy_learning: LearningPolicy::None,
            policy_spill: SpillPolicy::Reallocate,
            ..Default::default()
        },
    ];
    for config in configs {
        let w = Arc::new(Mutex::new(Workspace::with_backend("T", config, Arc::new(HeapMemory)).unwrap()));
        let (tx, rx) = mpsc::channel::<Sent>();
        let rx = Arc::new(Mutex::new(rx));
        let freers: Vec<_> = (0..2)
            .map(|_| {
                let (w, rx) = (w.clone(), rx.clone());
                std::thread::spawn(move || loop {
                    let next = rx.lock().unwrap().recv();
                    let Ok(Sent(p, n, seed)) = next else { break };
                    // The consumer reads what the owner wrote, then drops it.
                    assert!(intact(p.as_ptr(), n, seed), "a block sent to another thread changed");
                    // SAFETY: a live block of `w`, freed once, under its lock.
                    unsafe { w.lock().unwrap().free(p) };
                })
            })
            .collect();
        for cycle in 0..cycles {
            let mut mine = Vec::new();
            w.lock().unwrap().enter().unwrap();
            for i in 0..16usize {
                let n = 64 + (i * 977 + cycle * 131) % 40_000;
                let p = w.lock().unwrap().alloc(n);
                let Ok(p) = p else { continue }; // the limited workspace may refuse
                let seed = (cycle * 16 + i) as u8;
                fill(p.as_ptr(), n.min(256), seed);
                if i % 2 == 0 {
                    tx.send(Sent(p, n.min(256), seed)).unwrap();
                } else {
                    mine.push((p, n.min(256), seed));
                }
            }
            for (p, n, seed) in mine {
                assert!(intact(p.as_ptr(), n, seed), "a block of the owner changed");
                // SAFETY: a live block of `w`, freed once, under its lock.
                unsafe { w.lock().unwrap().free(p) };
            }
            w.lock().unwrap().exit().unwrap();
        }
        drop(tx);
        for t in freers {
            t.join().unwrap();
        }
        let w = w.lock().unwrap();
        w.verify();
        let s = w.stats();
        assert_eq!((s.used_bytes, s.external_bytes, s.pinned_bytes), (0, 0, 0), "{s:?}");
        assert_eq!(w.bad_frees(), 0);
    }
}
