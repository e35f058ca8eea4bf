//! `max_size` is a limit: what a workspace holds from its memory source (arena regions, retired
//! regions under pinned blocks, blocks outside the arena live and cached, huge mappings) never
//! exceeds it, at any step, whatever the learning policy wants; a request past it is refused,
//! naming the request and the limit, after the caches went back. And the core's `unsafe` API
//! keeps its word under the frees a caller gets wrong: a pointer that is no live block is never
//! read where its memory went back.

mod common;

use std::ptr::NonNull;
use std::sync::Arc;

use common::program::{Op, Program, MIRI};
use proptest::prelude::*;
use rustws_core::*;

const MIB: usize = 1 << 20;

/// Sizes scaled down under Miri, where every byte costs.
const SCALE: usize = if MIRI { 64 } else { 1 };

fn adaptive(max: usize) -> WorkspaceConfiguration {
    WorkspaceConfiguration { max_size: max as u64, helper_min_size: 0, ..WorkspaceConfiguration::adaptive() }
}

/// Runs `f` on a workspace over each host backend (the opaque device stand-in included).
fn for_each_backend(config: WorkspaceConfiguration, mut f: impl FnMut(&str, Workspace)) {
    let backends: [(&str, Arc<dyn Backend>); 3] =
        [("anonymous", Arc::new(AnonymousMemory)), ("heap", Arc::new(HeapMemory)), ("opaque", Arc::new(OpaqueMemory))];
    for (name, b) in backends {
        f(name, Workspace::with_backend(name, config.clone(), b).unwrap());
    }
}

fn within(w: &Workspace, what: &str) {
    assert!(w.footprint() <= w.limit(), "{what}: footprint {} past max_size {}", w.footprint(), w.limit());
    w.verify();
}

/// The README's `h = f(h)` loop: the state of the last cycle lives until this cycle replaces it.
/// Under a limit that holds two states and the temporaries, every cycle runs, and the footprint
/// never passes the limit, though the learner would size a larger arena.
#[test]
fn a_loop_that_replaces_its_state_stays_within_max_size() {
    let max = 64 * MIB / SCALE;
    for_each_backend(adaptive(max), |name, mut w| {
        let state = 20 * MIB / SCALE;
        let mut h: Option<NonNull<u8>> = None;
        for cycle in 0..12 {
            w.enter().unwrap();
            let t = w.alloc(state / 4).unwrap();
            let next = w.alloc(state).unwrap();
            within(&w, &format!("{name}: cycle {cycle}"));
            // SAFETY: live blocks, each freed once.
            unsafe {
                w.free(t);
                if let Some(old) = h.replace(next) {
                    w.free(old);
                }
            }
            w.exit().unwrap();
            within(&w, &format!("{name}: end of cycle {cycle}"));
        }
        // SAFETY: live, freed once.
        unsafe { w.free(h.unwrap()) };
        assert_eq!(w.stats().failed_allocations, 0, "{name}: a loop within the limit was refused");
    });
}

/// A state kept from the last cycle and a request that together pass the limit: the request is
/// refused, naming itself, what is in use and the limit, and nothing was mapped past it.
#[test]
fn a_request_past_max_size_beside_kept_state_is_refused() {
    let max = 64 * MIB / SCALE;
    for_each_backend(adaptive(max), |name, mut w| {
        w.enter().unwrap();
        let kept = w.alloc(40 * MIB / SCALE).unwrap();
        w.exit().unwrap();
        within(&w, name);
        w.enter().unwrap();
        let err = w.alloc(50 * MIB / SCALE).unwrap_err();
        let Error::OutOfMemory(r) = &err else { panic!("{name}: {err:?}") };
        assert_eq!(r.requested as usize, 50 * MIB / SCALE, "{name}");
        assert_eq!(r.limit as usize, max, "{name}");
        assert!(r.in_use as usize >= 40 * MIB / SCALE && r.footprint as usize <= max, "{name}: {r:?}");
        assert_eq!(r.reason, "max_size reached");
        within(&w, name);
        // What fits beside the kept state is served.
        let fits = w.alloc(10 * MIB / SCALE).unwrap();
        within(&w, name);
        // SAFETY: live, each freed once.
        unsafe {
            w.free(fits);
            w.free(kept);
        }
        w.exit().unwrap();
        assert_eq!(w.stats().failed_allocations, 1);
    });
}

/// The arena wants to grow (REALLOCATE spilled) while its region holds a pinned block: a second
/// region would pass the limit, so the current one stays, and the cycle goes on serving. Once the
/// pinned block is gone, the growth happens within the limit.
#[test]
fn a_region_that_cannot_be_replaced_within_max_size_stays() {
    let c = WorkspaceConfiguration {
        initial_size: (4 * MIB / SCALE) as u64,
        max_size: (8 * MIB / SCALE) as u64,
        policy_allocation: AllocationPolicy::Strict,
        policy_learning: LearningPolicy::None,
        policy_spill: SpillPolicy::Reallocate,
        ..Default::default()
    };
    let half = 5 * MIB / SCALE / 2;
    for_each_backend(c, |name, mut w| {
        let cap = w.stats().capacity_bytes;
        w.enter().unwrap();
        let pinned = w.alloc(MIB / SCALE).unwrap();
        w.exit().unwrap();
        // A cycle that needs 5 MiB: half in the arena, half spilled.
        let cycle = |w: &mut Workspace| {
            w.enter().unwrap();
            let (a, b) = (w.alloc(half).unwrap(), w.alloc(half).unwrap());
            within(w, name);
            // SAFETY: live, each freed once.
            unsafe {
                w.free(a);
                w.free(b);
            }
            w.exit().unwrap();
            within(w, name);
        };
        cycle(&mut w);
        assert!(w.stats().spill_count >= 1, "{name}: nothing spilled");
        assert_eq!(w.stats().capacity_bytes, cap, "{name}: the region was replaced past the limit");
        // The next cycle is served as before.
        cycle(&mut w);
        assert_eq!(w.stats().failed_allocations, 0, "{name}");
        // SAFETY: live, freed once.
        unsafe { w.free(pinned) };
        cycle(&mut w);
        assert!(w.stats().capacity_bytes > cap, "{name}: the arena never grew once it could");
        assert_eq!(w.stats().failed_allocations, 0, "{name}");
    });
}

/// An empty region that a larger one replaces goes back first where both would not fit: the
/// arena grows to what the cycle needed, and never holds both.
#[test]
fn an_empty_region_goes_back_before_its_replacement_is_mapped() {
    let max = 64 * MIB / SCALE;
    let c = WorkspaceConfiguration {
        initial_size: (24 * MIB / SCALE) as u64,
        max_size: max as u64,
        policy_allocation: AllocationPolicy::Overallocate,
        policy_learning: LearningPolicy::None,
        policy_spill: SpillPolicy::Reallocate,
        ..Default::default()
    };
    let upstream = Arc::new(LimitAdaptor::new(Arc::new(HeapMemory), max));
    let mut w = Workspace::with_backend("W", c, upstream.clone()).unwrap();
    w.enter().unwrap();
    let cap = w.stats().capacity_bytes as usize; // 24 MiB and 30% on top
    let big = w.alloc(max - cap - MIB / SCALE).unwrap(); // spilled

    within(&w, "spill");
    // SAFETY: live, freed once.
    unsafe { w.free(big) };
    w.exit().unwrap();
    within(&w, "regrow");
    // The old region and the new one (what spilled and 30% on top) would not fit together: the
    // old region went first (the upstream, limited alike, saw no more than the limit at any
    // time, or the growth would have failed there).
    let grown = w.stats().capacity_bytes as usize;
    assert!(grown > max - cap && grown <= max, "the arena did not grow within the limit: {grown}");
    assert_eq!(w.stats().failed_allocations, 0);
}

/// Cached blocks and mappings go back before the limit refuses.
#[test]
fn caches_go_back_before_a_refusal() {
    let max = 16 * MIB / SCALE;
    let c =
        WorkspaceConfiguration { max_size: max as u64, policy_learning: LearningPolicy::None, ..Default::default() };
    for_each_backend(c, |name, mut w| {
        w.enter().unwrap();
        let blocks: Vec<_> = (0..6).map(|_| w.alloc(2 * MIB / SCALE).unwrap()).collect();
        for p in blocks {
            // SAFETY: live, freed once.
            unsafe { w.free(p) };
        }
        assert!(w.external_cached_bytes() >= 10 * MIB / SCALE, "{name}: nothing was cached");
        // Of another class: only the cache's room makes it fit.
        let other = w.alloc(7 * MIB / SCALE).unwrap();
        within(&w, name);
        // SAFETY: live, freed once.
        unsafe { w.free(other) };
        w.exit().unwrap();
        assert_eq!(w.stats().failed_allocations, 0, "{name}");
    });
}

/// A first cycle far larger than `max_size` under the adaptive profile: what fits is served, the
/// rest refused, and the arena that follows fits the limit.
#[test]
fn the_adaptive_profile_sizes_its_arena_within_max_size() {
    let max = 8 * MIB / SCALE;
    for_each_backend(adaptive(max), |name, mut w| {
        for cycle in 0..6 {
            w.enter().unwrap();
            let mut live = Vec::new();
            for _ in 0..12 {
                match w.alloc(MIB / SCALE) {
                    Ok(p) => live.push(p),
                    Err(e) => assert!(matches!(e, Error::OutOfMemory(_)), "{name}: {e}"),
                }
                within(&w, &format!("{name}: cycle {cycle}"));
            }
            for p in live {
                // SAFETY: live, freed once.
                unsafe { w.free(p) };
            }
            w.exit().unwrap();
            within(&w, &format!("{name}: end of cycle {cycle}"));
        }
        assert!(w.stats().capacity_bytes as usize <= max);
    });
}

fn grow_shrink_op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![1usize..1024, 1024usize..(256 << 10) / SCALE, Just(MIB / SCALE), Just(3 * MIB / SCALE)];
    prop_oneof![
        6 => size.clone().prop_map(Op::Alloc),
        1 => size.prop_map(Op::Calloc),
        4 => any::<usize>().prop_map(Op::Free),
        2 => Just(Op::CycleEnd),
        2 => Just(Op::CleanCycleEnd),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(if MIRI { 2 } else { 96 }), ..ProptestConfig::default() })]

    /// Programs whose cycles grow, shrink and grow again while blocks stay pinned, under an 8 MiB
    /// limit and every learning policy: after every step the footprint is within it.
    #[test]
    fn programs_that_grow_shrink_and_regrow_stay_within_max_size(
        learning in prop_oneof![
            Just(LearningPolicy::Adaptive), Just(LearningPolicy::FirstLoop), Just(LearningPolicy::OverTime)
        ],
        spill in prop_oneof![Just(SpillPolicy::Reallocate), Just(SpillPolicy::External)],
        source in 0u8..3,
        ops in prop::collection::vec(grow_shrink_op(), 1..if MIRI { 30 } else { 200 }),
    ) {
        let max = 8 * MIB / SCALE;
        let c = WorkspaceConfiguration {
            max_size: max as u64,
            policy_learning: learning,
            policy_spill: spill,
            ..Default::default()
        };
        let b: Arc<dyn Backend> = match source {
            0 => Arc::new(AnonymousMemory),
            1 => Arc::new(HeapMemory),
            _ => Arc::new(OpaqueMemory),
        };
        let mut w = Workspace::with_backend("G", c, b).unwrap();
        w.enter().unwrap();
        let mut program = Program::new(w);
        let mut refused = |e: &Error| assert!(matches!(e, Error::OutOfMemory(_)), "unexpected {e}");
        for (step, op) in ops.into_iter().enumerate() {
            let ctx = format!("step {step} {op:?}");
            program.apply(op, &mut refused);
            program.check(&ctx);
            prop_assert!(program.w.footprint() <= max, "{}: footprint {}", ctx, program.w.footprint());
        }
        program.finish();
    }
}

// -- frees a caller gets wrong ---------------------------------------------------------------------

/// A second free of an arena block after its region went back (the workspace destroyed, the
/// block its last one) reads nothing: the pointer lies in no region of the workspace any more.
#[test]
fn a_double_free_after_a_destroyed_region_went_back_reads_nothing() {
    let c = WorkspaceConfiguration { initial_size: 1 << 16, ..Default::default() };
    let mut w = Workspace::with_backend("D", c, Arc::new(HeapMemory)).unwrap();
    w.enter().unwrap();
    let p = w.alloc(1000).unwrap();
    // SAFETY: live.
    assert_eq!(unsafe { w.block_info(p) }.kind, BlockKind::Arena);
    w.destroy();
    // SAFETY: live: its free releases the retired region, the block's last.
    unsafe { w.free(p) };
    assert_eq!((w.stats().capacity_bytes, w.bad_frees()), (0, 0));
    // SAFETY: the double free under test: the region went back; nothing may read it.
    unsafe { w.free(p) };
    assert_eq!(w.bad_frees(), 1);
}

/// The same for a region retired by growth that lost its last block.
#[test]
fn a_double_free_after_a_retired_region_went_back_reads_nothing() {
    let c = WorkspaceConfiguration {
        initial_size: 1 << 16,
        policy_learning: LearningPolicy::None,
        policy_spill: SpillPolicy::Reallocate,
        ..Default::default()
    };
    let mut w = Workspace::with_backend("R", c, Arc::new(HeapMemory)).unwrap();
    w.enter().unwrap();
    let kept = w.alloc(1000).unwrap();
    w.exit().unwrap();
    w.enter().unwrap();
    let big = w.alloc(1 << 17).unwrap(); // spills: the arena grows at the cycle end
                                         // SAFETY: live, freed once.
    unsafe { w.free(big) };
    w.exit().unwrap();
    // SAFETY: live.
    let old = unsafe { w.block_info(kept) }.region.unwrap();
    let cap = w.stats().capacity_bytes as usize;
    assert!(cap > old.1, "the region was not replaced");
    // SAFETY: live: the retired region's last block.
    unsafe { w.free(kept) };
    assert_eq!(w.stats().capacity_bytes as usize, cap - old.1, "the retired region did not go back");
    // SAFETY: the double free under test.
    unsafe { w.free(kept) };
    assert_eq!(w.bad_frees(), 1);
}

/// The same for an external block that went back to the C heap (`ALWAYS` keeps no cache).
#[test]
fn a_double_free_after_an_external_block_went_back_reads_nothing() {
    for b in [Arc::new(HeapMemory) as Arc<dyn Backend>, Arc::new(AnonymousMemory), Arc::new(OpaqueMemory)] {
        let c = WorkspaceConfiguration { policy_allocation: AllocationPolicy::Always, ..Default::default() };
        let mut w = Workspace::with_backend("E", c, b).unwrap();
        w.enter().unwrap();
        let p = w.alloc(100_000).unwrap();
        // SAFETY: live.
        assert_eq!(unsafe { w.block_info(p) }.kind, BlockKind::External);
        // SAFETY: live, freed once: back to the C heap.
        unsafe { w.free(p) };
        assert_eq!((w.footprint(), w.bad_frees()), (0, 0));
        // SAFETY: the double free under test.
        unsafe { w.free(p) };
        assert_eq!(w.bad_frees(), 1);
        w.exit().unwrap();
    }
}

/// A pointer at the very start of a device region has no room for a header in front of it: it is
/// no block, and finding that out reads nothing outside the region's headers.
#[test]
fn a_pointer_at_the_start_of_a_device_region_is_no_block() {
    let c = WorkspaceConfiguration { initial_size: 1 << 16, ..Default::default() };
    let mut w = Workspace::with_backend("O", c, Arc::new(OpaqueMemory)).unwrap();
    w.enter().unwrap();
    let p = w.alloc(1000).unwrap();
    // SAFETY: live.
    let (base, _) = unsafe { w.block_info(p) }.region.unwrap();
    let before = w.stats();
    // SAFETY: the bad free under test.
    unsafe { w.free(NonNull::new(base as *mut u8).unwrap()) };
    assert_eq!((w.bad_frees(), w.stats()), (1, before));
    // SAFETY: live, freed once.
    unsafe { w.free(p) };
    w.exit().unwrap();
    w.verify();
}

/// Blocks of another workspace, and pointers into the middle of a block, are never freed.
#[test]
fn pointers_that_are_no_block_of_this_workspace_change_nothing() {
    let c = WorkspaceConfiguration { initial_size: 1 << 16, ..Default::default() };
    let mut a = Workspace::with_backend("A", c.clone(), Arc::new(HeapMemory)).unwrap();
    let mut b = Workspace::with_backend("B", c, Arc::new(HeapMemory)).unwrap();
    a.enter().unwrap();
    b.enter().unwrap();
    let pa = a.alloc(1000).unwrap();
    let pb = b.alloc(200_000).unwrap();
    let stats = a.stats();
    // SAFETY: the bad frees under test: another workspace's arena block and external block, and
    // an address inside a block of this one.
    unsafe {
        a.free(pb);
        a.free(NonNull::new(pa.as_ptr().add(128)).unwrap());
    }
    assert_eq!((a.bad_frees(), a.stats()), (2, stats));
    // SAFETY: live, each freed once by its own workspace.
    unsafe {
        a.free(pa);
        b.free(pb);
    }
    a.exit().unwrap();
    b.exit().unwrap();
}

/// Region ids never repeat: a header of a region long gone never names a live one, however many
/// regions were mapped since (they were 32 bits and wrapped).
#[test]
fn region_ids_never_wrap_into_a_false_match() {
    let c = WorkspaceConfiguration {
        initial_size: 1 << 16,
        policy_learning: LearningPolicy::None,
        policy_spill: SpillPolicy::Reallocate,
        ..Default::default()
    };
    let mut w = Workspace::with_backend("I", c, Arc::new(HeapMemory)).unwrap();
    w.enter().unwrap();
    let kept = w.alloc(1000).unwrap();
    w.exit().unwrap();
    // As if 2^32 - 1 regions had come and gone: the next one's id equals the kept block's region
    // id in its low 32 bits.
    w.skip_region_ids((1 << 32) - 1);
    w.enter().unwrap();
    let big = w.alloc(1 << 17).unwrap();
    // SAFETY: live, freed once.
    unsafe { w.free(big) };
    w.exit().unwrap();
    w.enter().unwrap();
    let fresh = w.alloc(1000).unwrap();
    // SAFETY: live blocks.
    let (old, new) = unsafe { (w.block_info(kept).region.unwrap(), w.block_info(fresh).region.unwrap()) };
    assert_ne!(old, new, "the arena was not replaced");
    // SAFETY: live, each freed once; both land in their own regions.
    unsafe {
        w.free(kept);
        w.free(fresh);
    }
    w.exit().unwrap();
    w.verify();
    assert_eq!((w.bad_frees(), w.stats().used_bytes), (0, 0));
}
