//! In the AddressSanitizer build (`--cfg rustws_asan`, as scripts/sanitizers.sh runs it), memory
//! the workspace holds but nobody may touch is poisoned: the data of a freed arena block, of a
//! cached block outside the arena, of a cached huge mapping. A read there is reported as the use
//! after free it is. Each case runs in a child process of this test binary (ASan ends the process
//! it reports in), and the parent checks the report. Outside that build these tests do not exist.
#![cfg(rustws_asan)]

mod common;

use std::process::Command;
use std::ptr::NonNull;
use std::sync::Arc;

use rustws_core::*;

/// Runs the ignored test `name` of this binary in a child process; its standard error.
fn child(name: &str) -> (bool, String) {
    let exe = std::env::current_exe().unwrap();
    let out =
        Command::new(exe).args(["--ignored", "--exact", name, "--nocapture", "--test-threads=1"]).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn reported(name: &str) {
    let (ok, err) = child(name);
    assert!(!ok && err.contains("use-after-poison"), "{name}: the read was not reported:\n{err}");
}

/// Reads the byte at `p` (defeating the optimiser).
fn read(p: NonNull<u8>) -> u8 {
    // SAFETY: deliberately a read of memory the workspace poisoned: ASan reports it before it runs.
    unsafe { std::ptr::read_volatile(p.as_ptr()) }
}

#[test]
fn reading_a_freed_arena_block_is_reported() {
    reported("reads_a_freed_arena_block");
}

#[test]
fn reading_a_cached_external_block_is_reported() {
    reported("reads_a_cached_external_block");
}

#[test]
fn reading_a_cached_huge_mapping_is_reported() {
    reported("reads_a_cached_huge_mapping");
}

#[test]
fn live_blocks_carved_from_freed_memory_are_readable() {
    let (ok, err) = child("reuses_freed_memory");
    assert!(ok, "a live block read as poisoned:\n{err}");
}

#[test]
#[ignore = "run in a child process by reading_a_freed_arena_block_is_reported, which expects it to fail"]
fn reads_a_freed_arena_block() {
    let c = WorkspaceConfiguration { initial_size: 1 << 20, ..Default::default() };
    let mut w = Workspace::with_backend("P", c, Arc::new(AnonymousMemory)).unwrap();
    w.enter().unwrap();
    let p = w.alloc(4096).unwrap();
    let _keep = w.alloc(4096).unwrap(); // so `p` does not melt into the hole
                                        // SAFETY: live, freed once.
    unsafe { w.free(p) };
    eprintln!("read {}", read(p));
}

#[test]
#[ignore = "run in a child process by reading_a_cached_external_block_is_reported, which expects it to fail"]
fn reads_a_cached_external_block() {
    let mut w = Workspace::with_backend("P", WorkspaceConfiguration::default(), Arc::new(AnonymousMemory)).unwrap();
    w.enter().unwrap(); // a learning cycle: blocks of their own, cached when freed
    let p = w.alloc(100_000).unwrap();
    // SAFETY: live, freed once.
    unsafe { w.free(p) };
    assert!(w.external_cached_bytes() > 0);
    eprintln!("read {}", read(p));
}

#[test]
#[ignore = "run in a child process by reading_a_cached_huge_mapping_is_reported, which expects it to fail"]
fn reads_a_cached_huge_mapping() {
    let mut w = Workspace::with_backend("P", WorkspaceConfiguration::adaptive(), Arc::new(AnonymousMemory)).unwrap();
    // Kept once its size recurs from cycle to cycle.
    let mut p = NonNull::dangling();
    for _ in 0..2 {
        w.enter().unwrap();
        p = w.alloc(HUGE_BLOCK_MIN).unwrap();
        // SAFETY: live, freed once.
        unsafe { w.free(p) };
        w.exit().unwrap();
    }
    w.enter().unwrap();
    assert_eq!(w.huge_cached().0, 1);
    eprintln!("read {}", read(NonNull::new(p.as_ptr().wrapping_add(4096)).unwrap()));
}

#[test]
#[ignore = "run in a child process by live_blocks_carved_from_freed_memory_are_readable"]
fn reuses_freed_memory() {
    let c = WorkspaceConfiguration { initial_size: 1 << 20, ..Default::default() };
    let mut w = Workspace::with_backend("P", c, Arc::new(AnonymousMemory)).unwrap();
    for cycle in 0..20usize {
        w.enter().unwrap();
        let blocks: Vec<_> = (0..30).map(|i| w.alloc(100 + (i * 997 + cycle * 61) % 20_000).unwrap()).collect();
        for (i, &p) in blocks.iter().enumerate() {
            let n = 100 + (i * 997 + cycle * 61) % 20_000;
            common::fill(p.as_ptr(), n, i as u8);
            assert!(common::intact(p.as_ptr(), n, i as u8));
        }
        for p in blocks {
            // SAFETY: live, freed once.
            unsafe { w.free(p) };
        }
        w.exit().unwrap();
    }
}
