//! One conformance suite, run against every backend: the arena logic is the same whatever the
//! memory source, so each test here is instantiated once per backend by `for_each_backend`.

mod common;

use std::ptr::NonNull;
use std::sync::Arc;

use common::{backends, fill, intact, miri_or};
use rustws_core::*;

fn ws(backend: &Arc<dyn Backend>, config: WorkspaceConfiguration) -> Workspace {
    Workspace::with_backend("T", config, backend.clone()).unwrap()
}

fn for_each_backend(test: impl Fn(&str, &Arc<dyn Backend>)) {
    for (name, b) in backends() {
        test(name, &b);
    }
}

fn cfg() -> WorkspaceConfiguration {
    WorkspaceConfiguration::default()
}

const MB16: usize = 16 << 20;

#[test]
fn first_loop_learns_then_serves_every_cycle_from_the_arena() {
    for_each_backend(|name, b| {
        let mut w = ws(b, cfg());
        for cycle in 0..5 {
            w.enter().unwrap();
            let a = w.alloc(MB16).unwrap();
            let c = w.alloc(MB16).unwrap();
            fill(a.as_ptr(), 4096, 1);
            fill(c.as_ptr(), 4096, 2);
            let s = w.stats();
            if cycle == 0 {
                assert_eq!(s.capacity_bytes, 0, "{name}: nothing mapped while learning");
                assert_eq!(s.external_bytes, 2 * MB16 as u64, "{name}");
            } else {
                assert_eq!(s.external_bytes, 0, "{name}: cycle {cycle} spilled");
                assert_eq!(s.used_bytes, 2 * MB16 as u64, "{name}");
            }
            // SAFETY: both live, freed once.
            unsafe {
                w.free(a);
                w.free(c);
            }
            w.exit().unwrap();
        }
        let s = w.stats();
        assert_eq!(s.cycles, 5);
        assert_eq!(s.spill_count, 0, "{name}");
        // OVERALLOCATE 0.3 on top of two 16 MiB blocks and their headers, rounded to 2 MiB.
        let need = 2 * (MB16 + HEADER);
        assert!(s.capacity_bytes as usize >= need + need * 3 / 10, "{name}: {s:?}");
        assert!((s.capacity_bytes as usize) < need * 14 / 10 + (2 << 20), "{name}: {s:?}");
        assert_eq!(s.used_bytes + s.cached_bytes + s.overhead_bytes, s.capacity_bytes);
    });
}

#[test]
fn a_block_kept_past_its_cycle_keeps_its_contents_and_is_pinned() {
    for_each_backend(|name, b| {
        let mut w = ws(b, WorkspaceConfiguration { initial_size: 1 << 20, ..cfg() });
        w.enter().unwrap();
        let kept = w.alloc(10_000).unwrap();
        fill(kept.as_ptr(), 10_000, 9);
        w.exit().unwrap();
        assert_eq!(w.stats().pinned_bytes, 10_000, "{name}");
        for i in 0..miri_or(100, 4) {
            w.enter().unwrap();
            let mut tmp = Vec::new();
            for j in 0..20 {
                let p = w.alloc(5_000 + j * 100).unwrap();
                fill(p.as_ptr(), miri_or(5_000, 64), i as u8);
                tmp.push(p);
            }
            for p in tmp {
                // SAFETY: live, freed once.
                unsafe { w.free(p) };
            }
            w.exit().unwrap();
            assert!(intact(kept.as_ptr(), miri_or(10_000, 512), 9), "{name}: pinned block overwritten in cycle {i}");
        }
        assert_eq!(w.stats().pinned_bytes, 10_000);
        // SAFETY: live, freed once.
        unsafe { w.free(kept) };
        assert_eq!(w.stats().pinned_bytes, 0);
    });
}

#[test]
fn escaping_every_cycle_stays_bounded() {
    // `w = w - lr * g`: each cycle allocates the new weights and frees the previous ones.
    for_each_backend(|name, b| {
        let mut w = ws(b, cfg());
        let mut weights: Option<NonNull<u8>> = None;
        let mut caps = Vec::new();
        let size = miri_or(1 << 20, 1 << 15);
        let cycles = miri_or(200, 16) as u32;
        for i in 0..cycles {
            w.enter().unwrap();
            let g = w.alloc(size).unwrap();
            let nw = w.alloc(size).unwrap();
            fill(nw.as_ptr(), 1 << 12, i as u8);
            // SAFETY: live blocks, each freed once.
            unsafe {
                w.free(g);
                if let Some(old) = weights.replace(nw) {
                    w.free(old);
                }
            }
            w.exit().unwrap();
            caps.push(w.stats().capacity_bytes);
        }
        let s = w.stats();
        assert!(caps[10..].iter().all(|c| *c == caps[10]), "{name}: capacity kept changing: {:?}", &caps[..20]);
        assert!((s.capacity_bytes as usize) < 6 * size, "{name}: {s:?}");
        assert!(s.spill_count <= 2, "{name}: {s:?}");
        assert!(intact(weights.unwrap().as_ptr(), 1 << 12, (cycles - 1) as u8));
    });
}

#[test]
fn memory_freed_inside_one_long_cycle_is_reused() {
    for_each_backend(|name, b| {
        let mut w =
            ws(b, WorkspaceConfiguration { initial_size: 8 << 20, policy_learning: LearningPolicy::None, ..cfg() });
        w.enter().unwrap();
        let mut live: Vec<(NonNull<u8>, usize, u8)> = Vec::new();
        for step in 0..miri_or(20_000, 150) {
            let size = 1000 + (step * 7919) % 60_000;
            let p = w.alloc(size).unwrap();
            fill(p.as_ptr(), size.min(256), step as u8);
            live.push((p, size, step as u8));
            if live.len() > 40 {
                let (q, n, seed) = live.remove((step * 31) % live.len());
                assert!(intact(q.as_ptr(), n.min(256), seed), "{name}");
                // SAFETY: live, freed once.
                unsafe { w.free(q) };
            }
        }
        let s = w.stats();
        assert_eq!(s.spill_count, 0, "{name}: the arena should have been enough: {s:?}");
        assert_eq!(s.external_bytes, 0);
        w.exit().unwrap();
        for (p, ..) in live {
            // SAFETY: live, freed once.
            unsafe { w.free(p) };
        }
    });
}

#[test]
fn spill_fail_refuses_with_the_limit_in_the_message() {
    for_each_backend(|name, b| {
        let c = WorkspaceConfiguration {
            initial_size: 1 << 20,
            policy_learning: LearningPolicy::None,
            policy_spill: SpillPolicy::Fail,
            policy_allocation: AllocationPolicy::Strict,
            ..cfg()
        };
        let mut w = ws(b, c);
        w.enter().unwrap();
        let a = w.alloc(900_000).unwrap();
        let err = w.alloc(900_000).unwrap_err();
        assert!(matches!(err, Error::OutOfMemory(Refusal { requested: 900_000, .. })), "{name}: {err:?}");
        let msg = err.to_string();
        assert!(msg.contains("\"T\"") && msg.contains("900000") && msg.contains("FAIL"), "{msg}");
        assert_eq!(w.stats().failed_allocations, 1);
        // SAFETY: live, freed once.
        unsafe { w.free(a) };
        w.exit().unwrap();
    });
}

#[test]
fn spill_reallocate_grows_and_external_never_does() {
    for_each_backend(|name, b| {
        for (policy, grows) in [(SpillPolicy::Reallocate, true), (SpillPolicy::External, false)] {
            let c = WorkspaceConfiguration {
                initial_size: 1 << 20,
                policy_learning: LearningPolicy::None,
                policy_spill: policy,
                ..cfg()
            };
            let mut w = ws(b, c);
            let before = w.stats().capacity_bytes;
            for _ in 0..3 {
                w.enter().unwrap();
                let a = w.alloc(3 << 20).unwrap();
                // SAFETY: live, freed once.
                unsafe { w.free(a) };
                w.exit().unwrap();
            }
            let s = w.stats();
            if grows {
                assert!(s.capacity_bytes > 3 << 20, "{name}: {s:?}");
                assert_eq!(s.spill_count, 1, "{name}: only the first cycle spills");
            } else {
                assert_eq!(s.capacity_bytes, before, "{name}");
                assert_eq!(s.spill_count, 3, "{name}");
            }
        }
    });
}

#[test]
fn circular_reset_continues_across_cycles_and_wraps_around_live_blocks() {
    for_each_backend(|name, b| {
        let c = WorkspaceConfiguration {
            initial_size: miri_or(1 << 20, 12 << 10) as u64,
            policy_learning: LearningPolicy::None,
            policy_reset: ResetPolicy::EndOfBufferReached,
            policy_allocation: AllocationPolicy::Strict,
            ..cfg()
        };
        let mut w = ws(b, c);
        let mut ring: std::collections::VecDeque<(NonNull<u8>, u8)> = Default::default();
        let mut addrs = std::collections::BTreeSet::new();
        let size = miri_or(100_000, 1_000);
        for i in 0..miri_or(400, 24) as u32 {
            w.enter().unwrap();
            let p = w.alloc(size).unwrap();
            fill(p.as_ptr(), size, i as u8);
            addrs.insert(p.as_ptr() as usize);
            ring.push_back((p, i as u8));
            w.exit().unwrap();
            if ring.len() > 4 {
                let (q, seed) = ring.pop_front().unwrap();
                assert!(intact(q.as_ptr(), size, seed), "{name}: item {i} overwrote a live one");
                // SAFETY: live, freed once.
                unsafe { w.free(q) };
            }
        }
        assert_eq!(w.stats().spill_count, 0, "{name}: {:?}", w.stats());
        assert!(addrs.len() >= 8, "{name}: allocation should move around the ring, saw {} places", addrs.len());
    });
}

#[test]
fn destroying_with_live_blocks_keeps_their_memory() {
    for_each_backend(|name, b| {
        let mut w = ws(b, WorkspaceConfiguration { initial_size: 1 << 20, ..cfg() });
        w.enter().unwrap();
        let p = w.alloc(4096).unwrap();
        fill(p.as_ptr(), 4096, 5);
        w.exit().unwrap();
        w.destroy();
        w.destroy();
        assert!(matches!(w.enter(), Err(Error::Destroyed { .. })));
        assert!(matches!(w.check_alive(), Err(Error::Destroyed { .. })));
        // Code still running after `destroy` is served outside the workspace's accounts.
        let before = w.stats();
        let q = w.alloc(100).unwrap();
        // SAFETY: live, of this workspace.
        assert_eq!(unsafe { w.block_info(q) }.kind, BlockKind::Bypass, "{name}");
        assert_eq!(w.stats(), before, "{name}: a block after destroy is counted");
        // SAFETY: live, freed once.
        unsafe { w.free(q) };
        assert!(intact(p.as_ptr(), 4096, 5), "{name}");
        assert!(w.stats().capacity_bytes > 0, "{name}: memory under a live block released");
        // SAFETY: live, freed once.
        unsafe { w.free(p) };
        assert_eq!(w.stats().capacity_bytes, 0, "{name}: released with its last block");
    });
}

#[test]
fn nested_cycles_reset_only_at_the_outermost_exit() {
    for_each_backend(|_, b| {
        let mut w = ws(b, WorkspaceConfiguration { initial_size: 1 << 20, ..cfg() });
        w.enter().unwrap();
        w.enter().unwrap();
        let p = w.alloc(100).unwrap();
        assert!(!w.exit().unwrap().completed);
        assert_eq!(w.generation(), 0);
        assert!(w.is_open());
        let r = w.exit().unwrap();
        assert!(r.completed && r.escaped_blocks == 1 && r.escaped_bytes == 100);
        assert_eq!(w.generation(), 1);
        assert!(matches!(w.exit(), Err(Error::NotOpen { .. })));
        // SAFETY: live, freed once.
        unsafe { w.free(p) };
    });
}

#[test]
fn over_time_learns_for_its_cycles_then_keeps_adapting() {
    for_each_backend(|name, b| {
        let c = WorkspaceConfiguration {
            policy_learning: LearningPolicy::OverTime,
            cycles_before_initialization: 3,
            ..cfg()
        };
        let mut w = ws(b, c);
        let run = |w: &mut Workspace, size: usize| {
            w.enter().unwrap();
            let p = w.alloc(size).unwrap();
            // SAFETY: live, freed once.
            unsafe { w.free(p) };
            w.exit().unwrap();
        };
        run(&mut w, 100_000);
        run(&mut w, 300_000);
        assert_eq!(w.stats().capacity_bytes, 0, "{name}: still learning");
        run(&mut w, 200_000);
        let c1 = w.stats().capacity_bytes;
        assert!(c1 as usize >= 300_000, "{name}: learned the largest of the three: {c1}");
        run(&mut w, 1_000_000);
        let c2 = w.stats().capacity_bytes;
        assert!(c2 as usize >= 1_000_000, "{name}: adapted to a larger cycle: {c2}");
        run(&mut w, 1_000_000);
        assert_eq!(w.stats().spill_count, 1, "{name}");
    });
}

#[test]
fn allocation_policies_size_the_arena() {
    for_each_backend(|name, b| {
        let strict = ws(
            b,
            WorkspaceConfiguration { initial_size: 1 << 20, policy_allocation: AllocationPolicy::Strict, ..cfg() },
        );
        assert_eq!(strict.stats().capacity_bytes, 1 << 20, "{name}");
        let over = ws(b, WorkspaceConfiguration { initial_size: 1 << 20, overallocation_limit: 0.5, ..cfg() });
        assert_eq!(over.stats().capacity_bytes, 3 << 19, "{name}");
        let mut always = ws(
            b,
            WorkspaceConfiguration { initial_size: 1 << 20, policy_allocation: AllocationPolicy::Always, ..cfg() },
        );
        assert_eq!(always.stats().capacity_bytes, 0, "{name}");
        always.enter().unwrap();
        let p = always.alloc(1000).unwrap();
        assert_eq!(always.stats().external_bytes, 1000);
        // SAFETY: live, freed once.
        unsafe { always.free(p) };
        always.exit().unwrap();
        let minmax =
            ws(b, WorkspaceConfiguration { initial_size: 1000, min_size: 1 << 20, max_size: 2 << 20, ..cfg() });
        assert_eq!(minmax.stats().capacity_bytes, 1 << 20, "{name}: min_size wins over a small initial size");
    });
}

#[test]
fn max_size_bounds_the_footprint_under_every_spill_policy() {
    for_each_backend(|name, b| {
        for policy in [SpillPolicy::External, SpillPolicy::Reallocate] {
            let c = WorkspaceConfiguration { initial_size: 1 << 20, max_size: 2 << 20, policy_spill: policy, ..cfg() };
            let mut w = ws(b, c);
            w.enter().unwrap();
            let a = w.alloc(1 << 20).unwrap();
            let err = w.alloc(3 << 20).unwrap_err();
            assert!(matches!(err, Error::OutOfMemory(Refusal { limit, .. }) if limit == 2 << 20), "{name}: {err:?}");
            // SAFETY: live, freed once.
            unsafe { w.free(a) };
            w.exit().unwrap();
        }
    });
}

#[test]
fn helper_min_size_bypasses_the_accounts() {
    for_each_backend(|_, b| {
        let mut w = ws(b, WorkspaceConfiguration { initial_size: 1 << 20, helper_min_size: 1024, ..cfg() });
        w.enter().unwrap();
        let small = w.alloc(100).unwrap();
        let big = w.alloc(2048).unwrap();
        // SAFETY: both live.
        let (ks, kb) = unsafe { (w.block_info(small).kind, w.block_info(big).kind) };
        assert_eq!((ks, kb), (BlockKind::Bypass, BlockKind::Arena));
        assert_eq!(w.stats().used_bytes, 2048);
        // SAFETY: live, freed once.
        unsafe {
            w.free(small);
            w.free(big);
        }
        w.exit().unwrap();
    });
}

#[test]
fn realloc_keeps_contents_in_place_or_moved() {
    for_each_backend(|name, b| {
        let mut w = ws(b, WorkspaceConfiguration { initial_size: 1 << 20, ..cfg() });
        w.enter().unwrap();
        let p = w.alloc(1000).unwrap();
        fill(p.as_ptr(), 1000, 3);
        // SAFETY: live blocks throughout, each freed once.
        unsafe {
            let q = w.realloc(p, 1010).unwrap();
            assert_eq!(q, p, "{name}: same slot, same place");
            let r = w.realloc(q, 100_000).unwrap();
            assert!(intact(r.as_ptr(), 1000, 3), "{name}");
            assert_eq!(w.stats().used_bytes, 100_000);
            let s = w.realloc(r, 10).unwrap();
            assert!(intact(s.as_ptr(), 10, 3));
            w.free(s);
        }
        assert_eq!(w.stats().used_bytes, 0);
        w.exit().unwrap();
    });
}

#[test]
fn realloc_keeps_a_large_block_in_place_one_class_down() {
    for_each_backend(|name, b| {
        let config = WorkspaceConfiguration { policy_learning: LearningPolicy::None, initial_size: 8 << 20, ..cfg() };
        let mut w = ws(b, config);
        w.enter().unwrap();
        // SAFETY: live blocks throughout, each freed once.
        unsafe {
            // A block of the 144 KiB class serves a size of the class below (128 KiB) in place.
            let up = w.alloc(140 << 10).unwrap();
            let fence = w.alloc(1000).unwrap();
            fill(up.as_ptr(), 1000, 5);
            assert_eq!(w.realloc(up, 128 << 10).unwrap(), up, "{name}: one class down stays");
            assert_eq!(w.realloc(up, 140 << 10).unwrap(), up, "{name}: the block's own class stays");
            assert_eq!(w.stats().used_bytes, (140 << 10) + 1000);
            let moved = w.realloc(up, 100 << 10).unwrap();
            assert_ne!(moved, up, "{name}: two classes down moves");
            assert!(intact(moved.as_ptr(), 1000, 5), "{name}");
            w.free(moved);
            w.free(fence);
        }
        assert_eq!(w.stats().used_bytes, 0);
        w.exit().unwrap();
    });
}

#[test]
fn a_refusing_backend_is_an_error_not_a_panic() {
    let limited: Arc<dyn Backend> = Arc::new(LimitAdaptor::new(Arc::new(AnonymousMemory), 1 << 20));
    let err = Workspace::with_backend("L", WorkspaceConfiguration { initial_size: 4 << 20, ..cfg() }, limited.clone())
        .unwrap_err();
    assert!(matches!(err, Error::SystemOutOfMemory { .. }), "{err:?}");
    let mut w = Workspace::with_backend("L", cfg(), limited).unwrap();
    w.enter().unwrap();
    let err = w.alloc(2 << 20).unwrap_err();
    assert!(err.to_string().contains("limit of 1048576"), "{err}");
    assert_eq!(w.stats().failed_allocations, 1);
    let p = w.alloc(1000).unwrap();
    // SAFETY: live, freed once.
    unsafe { w.free(p) };
    w.exit().unwrap();
}

#[test]
fn debug_spill_everything_spills_every_allocation() {
    let mut w = Workspace::new(
        "D",
        WorkspaceConfiguration { initial_size: 1 << 20, debug_mode: DebugMode::SpillEverything, ..cfg() },
    )
    .unwrap();
    if w.debug_mode() != DebugMode::SpillEverything {
        return; // RUSTWS_DEBUG_MODE overrides the configuration in this environment.
    }
    w.initialize().unwrap();
    w.enter().unwrap();
    let p = w.alloc(10).unwrap();
    assert_eq!(w.stats().spill_count, 1);
    assert_eq!(w.stats().capacity_bytes, 0);
    // SAFETY: live, freed once.
    unsafe { w.free(p) };
    w.exit().unwrap();
}

#[test]
fn frees_from_another_thread_through_a_lock() {
    let w = Arc::new(std::sync::Mutex::new(
        Workspace::new("X", WorkspaceConfiguration { initial_size: 1 << 20, ..cfg() }).unwrap(),
    ));
    /// Blocks handed to the thread that frees them.
    struct Blocks(Vec<NonNull<u8>>);
    // SAFETY: workspace blocks may be freed from any thread (through the workspace's lock).
    unsafe impl Send for Blocks {}
    let blocks = {
        let mut g = w.lock().unwrap();
        g.enter().unwrap();
        let v = (0..100).map(|_| g.alloc(1000).unwrap()).collect();
        g.exit().unwrap();
        Blocks(v)
    };
    let w2 = w.clone();
    std::thread::spawn(move || {
        let blocks = blocks;
        for p in blocks.0 {
            // SAFETY: each pointer is a live block of this workspace, freed once.
            unsafe { w2.lock().unwrap().free(p) };
        }
    })
    .join()
    .unwrap();
    let s = w.lock().unwrap().stats();
    assert_eq!((s.used_bytes, s.pinned_bytes), (0, 0));
}

#[test]
fn an_opaque_backend_is_never_written_by_the_arena() {
    // Device memory must not be touched by the arena: headers live on the host. Nothing here
    // writes block data, so every byte in front of an arena block (where an inline header would
    // sit) and at the start of a block of its own (which starts at its data), across reuse,
    // escapes, spills and growth, must still hold the stand-in's canary. (Data integrity on this
    // backend is covered by every other test of this suite.)
    let b: Arc<dyn Backend> = Arc::new(OpaqueMemory);
    let c = WorkspaceConfiguration { initial_size: 1 << 20, policy_spill: SpillPolicy::Reallocate, ..cfg() };
    let mut w = ws(&b, c);
    let mut kept = Vec::new();
    let front_is_canary = |w: &Workspace, p: NonNull<u8>| {
        // SAFETY: `p` is a live block of `w`.
        let in_region = unsafe { w.block_info(p) }.region.is_some();
        // SAFETY: the `HEADER` bytes in front of an arena block lie inside its region; a block of
        // its own holds at least `HEADER` bytes from its data on.
        let front = unsafe {
            let at = if in_region { p.as_ptr().sub(HEADER) } else { p.as_ptr() };
            std::slice::from_raw_parts(at, HEADER)
        };
        front.iter().all(|&x| x == OpaqueMemory::CANARY)
    };
    for cycle in 0..miri_or(30, 8) {
        w.enter().unwrap();
        let mut blocks = Vec::new();
        for i in 0..miri_or(50, 20) {
            blocks.push(w.alloc(100 + (i * 997 + cycle * 31) % 20_000).unwrap());
        }
        if cycle % 10 == 3 {
            blocks.push(w.alloc(3 << 20).unwrap()); // spills, then the arena grows
        }
        for &p in &blocks {
            assert!(front_is_canary(&w, p), "cycle {cycle}: something was written in front of a block");
        }
        kept.push(blocks.swap_remove(cycle % blocks.len()));
        for p in blocks {
            // SAFETY: live, freed once.
            unsafe { w.free(p) };
        }
        w.exit().unwrap();
        w.verify();
    }
    let s = w.stats();
    assert!(s.pinned_bytes > 0 && s.spill_count >= 1 && s.capacity_bytes > 3 << 20, "{s:?}");
    for p in kept {
        assert!(front_is_canary(&w, p));
        // SAFETY: live, freed once.
        unsafe { w.free(p) };
    }
    assert_eq!(w.stats().used_bytes, 0);
}

#[test]
fn a_named_mmap_file_keeps_live_blocks_through_growth() {
    // Growth maps a second region while a block of the first lives: they must not share a file.
    let named = std::env::temp_dir().join(format!("rustws-grow-{}.bin", std::process::id()));
    let c = WorkspaceConfiguration {
        initial_size: 1 << 20,
        policy_location: LocationPolicy::Mmap,
        policy_learning: LearningPolicy::None,
        policy_spill: SpillPolicy::Reallocate,
        temp_file_path: Some(named.clone()),
        ..cfg()
    };
    let mut w = Workspace::new("MM", c.clone()).unwrap();
    let mut other = Workspace::new("MM2", c).unwrap(); // a second workspace on the same path
    w.enter().unwrap();
    let a = w.alloc(4096).unwrap();
    fill(a.as_ptr(), 4096, 0xAB);
    let spill = w.alloc(4 << 20).unwrap();
    // SAFETY: live, freed once.
    unsafe { w.free(spill) };
    w.exit().unwrap(); // grows: a new region, the old one retired with `a` in it
    assert!(w.stats().capacity_bytes > 4 << 20);
    w.enter().unwrap();
    other.enter().unwrap();
    let b = w.alloc(4096).unwrap();
    let o = other.alloc(4096).unwrap();
    fill(b.as_ptr(), 4096, 0xCD);
    fill(o.as_ptr(), 4096, 0x11);
    assert!(intact(a.as_ptr(), 4096, 0xAB), "a live block was clobbered through a shared file");
    // SAFETY: live, freed once.
    unsafe {
        w.free(a);
        w.free(b);
        other.free(o);
    }
    w.exit().unwrap();
    other.exit().unwrap();
    drop((w, other));
    let _ = std::fs::remove_file(named);
}

#[test]
fn host_transfers_round_trip_through_every_backend() {
    // The path of `copy_from` / `to_numpy`: host bytes in, the backend's own copy and zero, host
    // bytes out. On a device backend only these calls may touch the memory.
    for_each_backend(|name, b| {
        let mut w = ws(b, WorkspaceConfiguration { initial_size: 1 << 20, ..cfg() });
        w.enter().unwrap();
        let src: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 251) as u8).collect();
        let a = w.alloc(src.len()).unwrap();
        let c = w.alloc(src.len()).unwrap();
        let z = w.alloc_zeroed(src.len()).unwrap();
        let mut back = vec![0u8; src.len()];
        // SAFETY: `a`, `c` and `z` are live blocks of `src.len()` bytes; the host buffers are ours.
        unsafe {
            b.copy_from_host(a, NonNull::new(src.as_ptr() as *mut u8).unwrap(), src.len()).unwrap();
            b.copy(c, a, src.len()).unwrap();
            b.copy_to_host(NonNull::new(back.as_mut_ptr()).unwrap(), c, src.len()).unwrap();
            assert_eq!(back, src, "{name}: bytes changed on the way through");
            b.copy_to_host(NonNull::new(back.as_mut_ptr()).unwrap(), z, src.len()).unwrap();
            assert!(back.iter().all(|&x| x == 0), "{name}: alloc_zeroed left non-zero bytes");
            w.free(a);
            w.free(c);
            w.free(z);
        }
        w.exit().unwrap();
        w.verify();
    });
}

/// Requests near `usize::MAX` are errors on every backend, whatever path they take (the arena,
/// a block of their own, a huge mapping): no size computation wraps to a small mapping that a
/// header is then written past.
#[test]
fn requests_near_usize_max_are_errors_never_wrapped_sizes() {
    let page = 4096usize;
    let sizes = [
        usize::MAX,
        usize::MAX - 1,
        usize::MAX - 63,
        usize::MAX - 64 - 63,
        usize::MAX - page,
        usize::MAX - 2 * page,
        usize::MAX / 2 + 1,
        isize::MAX as usize,
        isize::MAX as usize - page,
        1 << 62,
    ];
    // Miri aborts on an allocation it cannot hold where the system would refuse it: under Miri
    // only the sizes no address space holds, which must be refused before anything is allocated.
    let sizes: Vec<usize> = sizes.into_iter().filter(|&s| !cfg!(miri) || s > isize::MAX as usize).collect();
    for_each_backend(|name, b| {
        for config in
            [WorkspaceConfiguration::adaptive(), cfg(), WorkspaceConfiguration { initial_size: 1 << 20, ..cfg() }]
        {
            let mut w = ws(b, config);
            w.enter().unwrap();
            let small = w.alloc(100).unwrap();
            for &size in &sizes {
                assert!(w.alloc(size).is_err(), "{name}: alloc({size}) succeeded");
                assert!(w.alloc_zeroed(size).is_err(), "{name}: alloc_zeroed({size}) succeeded");
                // SAFETY: `small` is live; a failed realloc leaves it so.
                assert!(unsafe { w.realloc(small, size) }.is_err(), "{name}: realloc to {size} succeeded");
            }
            // SAFETY: live, freed once.
            unsafe { w.free(small) };
            w.exit().unwrap();
            w.verify();
        }
    });
}

#[test]
fn large_blocks_start_on_4_kib_and_learned_arenas_still_fit_their_cycle() {
    for_each_backend(|name, b| {
        for config in [
            WorkspaceConfiguration { policy_allocation: AllocationPolicy::Strict, ..cfg() },
            WorkspaceConfiguration::adaptive(),
        ] {
            let mut w = ws(b, config.clone());
            for cycle in 0..4 {
                w.enter().unwrap();
                let mut live = Vec::new();
                // Small and large blocks interleaved: every large one follows a small one.
                for i in 0..6usize {
                    let small = w.alloc(1000 + 64 * i).unwrap();
                    let large = w.alloc((128 << 10) + 4096 * i + 8).unwrap();
                    if cycle > 0 {
                        assert_eq!(large.as_ptr() as usize % 4096, 0, "{name}: a large block's data");
                    }
                    fill(large.as_ptr(), 64, i as u8);
                    live.push(small);
                    live.push(large);
                }
                for p in live {
                    // SAFETY: live, freed once.
                    unsafe { w.free(p) };
                }
                w.exit().unwrap();
                if cycle > 0 {
                    assert_eq!(w.stats().spill_count, 0, "{name} {config:?}: cycle {cycle} spilled");
                }
            }
            w.verify();
        }
    });
}

#[test]
fn holds_finds_live_memory_of_the_workspace_by_address() {
    for_each_backend(|name, b| {
        let config = WorkspaceConfiguration { helper_min_size: 512, ..WorkspaceConfiguration::adaptive() };
        let mut w = ws(b, config);
        let mut other = ws(b, WorkspaceConfiguration::adaptive());
        w.enter().unwrap();
        let external = w.alloc(100_000).unwrap(); // learning cycle: a block of its own
        let bypass = w.alloc(100).unwrap(); // below helper_min_size: not workspace memory
        let o = other.alloc(100_000).unwrap();
        let at = external.as_ptr() as usize;
        assert!(w.holds(at) && w.holds(at + 99_999), "{name}: a live block of its own");
        assert!(!w.holds(bypass.as_ptr() as usize), "{name}: a bypass block");
        assert!(!w.holds(o.as_ptr() as usize) && other.holds(o.as_ptr() as usize), "{name}");
        // SAFETY: live, freed once.
        unsafe { w.free(external) };
        assert!(!w.holds(at), "{name}: a cached block holds nothing");
        w.exit().unwrap();
        w.enter().unwrap();
        let arena = w.alloc(100_000).unwrap();
        assert!(w.stats().capacity_bytes > 0 && w.holds(arena.as_ptr() as usize + 50_000), "{name}: the arena");
        // SAFETY: live, freed once each.
        unsafe {
            w.free(arena);
            w.free(bypass);
            other.free(o);
        }
        w.exit().unwrap();
    });
}

#[test]
fn blocks_that_die_between_cycles_leave_the_next_cycle_a_whole_arena() {
    // Three cycles share a workspace in each step (DL4J's layer working memory: forward, backward,
    // updater); each keeps a result alive past its end that dies before the next step begins.
    // Each step then finds the arena as the first did: the same addresses, never a spill.
    for_each_backend(|name, b| {
        let config = WorkspaceConfiguration {
            policy_allocation: AllocationPolicy::Strict,
            policy_spill: SpillPolicy::Reallocate,
            ..cfg()
        };
        let mut w = ws(b, config);
        let sizes: [&[usize]; 3] = [&[2 << 20, 700_000, 48_000], &[2 << 20, 1 << 20, 300_000], &[600_000, 90_000]];
        let mut first_of_step = Vec::new();
        for _step in 0..miri_or(30, 5) {
            let mut kept = Vec::new();
            for (k, cycle) in sizes.iter().enumerate() {
                w.enter().unwrap();
                let blocks: Vec<_> = cycle.iter().map(|&s| w.alloc(s).unwrap()).collect();
                if k == 0 {
                    first_of_step.push(blocks[0]);
                }
                // The last block outlives the cycle; the others are temporaries.
                for p in &blocks[..blocks.len() - 1] {
                    // SAFETY: live, freed once.
                    unsafe { w.free(*p) };
                }
                kept.push(blocks[blocks.len() - 1]);
                w.exit().unwrap();
            }
            for p in kept {
                // SAFETY: live, freed once, between cycles.
                unsafe { w.free(p) };
            }
        }
        let s = w.stats();
        assert!(s.spill_count <= 1, "{name}: learning aside, nothing spills: {s:?}");
        assert!(first_of_step[2..].iter().all(|p| *p == first_of_step[2]), "{name}: the arena drifted");
        assert!((s.capacity_bytes as usize) < 6 << 20, "{name}: {s:?}");
    });
}
