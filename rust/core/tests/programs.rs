//! Allocator programs as property tests: random sequences of alloc / free / realloc / cycle end /
//! escape / destroy, under random policies and backend limits. After every step, live blocks must
//! not overlap, must be aligned, must lie inside their region (arena blocks), must keep their
//! contents, and the statistics must match a model computed from the live blocks.

mod common;

use std::ptr::NonNull;
use std::sync::Arc;

use common::{fill, intact};
use proptest::prelude::*;
use rustws_core::*;

#[derive(Debug, Clone)]
enum Op {
    Alloc(usize),
    Free(usize),
    Realloc(usize, usize),
    /// Ends the cycle and opens the next one; live blocks escape.
    CycleEnd,
    /// Opens a nested level and closes it again.
    Nested(usize),
    Destroy,
}

/// Under Miri, which runs each step thousands of times slower, programs are shorter and blocks
/// and arenas smaller; the paths they take are the same.
const MIRI: bool = cfg!(miri);
const LARGE: usize = if MIRI { 20_000 } else { 200_000 };
const LONG: usize = if MIRI { 40 } else { 300 };

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![1usize..200, 200usize..5000, 5000usize..LARGE, Just(0usize)];
    prop_oneof![
        6 => size.clone().prop_map(Op::Alloc),
        4 => any::<usize>().prop_map(Op::Free),
        1 => (any::<usize>(), size.clone()).prop_map(|(i, s)| Op::Realloc(i, s)),
        2 => Just(Op::CycleEnd),
        1 => size.prop_map(Op::Nested),
        // Rare: the rest of the program then only frees.
        0 => Just(Op::Destroy),
    ]
}

fn config() -> impl Strategy<Value = (WorkspaceConfiguration, Option<usize>)> {
    (
        prop_oneof![Just(0u64), Just(64 << 10), Just(if MIRI { 128 << 10 } else { 1 << 20 })],
        prop_oneof![
            Just(LearningPolicy::None),
            Just(LearningPolicy::FirstLoop),
            Just(LearningPolicy::OverTime),
            Just(LearningPolicy::Adaptive)
        ],
        prop_oneof![Just(SpillPolicy::Fail), Just(SpillPolicy::Reallocate), Just(SpillPolicy::External)],
        prop_oneof![Just(ResetPolicy::BlockLeft), Just(ResetPolicy::EndOfBufferReached)],
        prop_oneof![
            Just(AllocationPolicy::Strict),
            Just(AllocationPolicy::Overallocate),
            Just(AllocationPolicy::Always)
        ],
        prop_oneof![Just(0u64), Just(100)],
        prop_oneof![Just(None), Just(Some(LARGE * 5)), Just(Some(LARGE * 20))],
        0u64..3,
    )
        .prop_map(|(initial, learning, spill, reset, alloc, helper, limit, cbi)| {
            (
                WorkspaceConfiguration {
                    initial_size: initial,
                    policy_learning: learning,
                    policy_spill: spill,
                    policy_reset: reset,
                    policy_allocation: alloc,
                    helper_min_size: helper,
                    cycles_before_initialization: cbi,
                    ..Default::default()
                },
                limit,
            )
        })
}

struct Live {
    p: NonNull<u8>,
    size: usize,
    seed: u8,
}

fn check(w: &Workspace, live: &[Live], ctx: &str) {
    let mut spans: Vec<(usize, usize)> = Vec::new();
    let (mut used, mut external, mut pinned) = (0u64, 0u64, 0u64);
    for b in live {
        let addr = b.p.as_ptr() as usize;
        assert_eq!(addr % BLOCK_ALIGN, 0, "{ctx}: misaligned block");
        assert!(intact(b.p.as_ptr(), b.size.min(512), b.seed), "{ctx}: block contents changed");
        // SAFETY: every block in `live` is live in `w`.
        let info = unsafe { w.block_info(b.p) };
        assert_eq!(info.requested, b.size, "{ctx}");
        spans.push((addr, addr + b.size.max(1)));
        match info.kind {
            BlockKind::Arena => {
                let (base, cap) = info.region.expect("arena blocks have a region");
                assert!(addr >= base + HEADER && addr + b.size <= base + cap, "{ctx}: block outside its region");
                used += b.size as u64;
            }
            BlockKind::External | BlockKind::Huge => external += b.size as u64,
            BlockKind::Bypass => continue,
        }
        if info.generation < w.generation() {
            pinned += b.size as u64;
        }
    }
    spans.sort();
    for pair in spans.windows(2) {
        assert!(pair[0].1 <= pair[1].0, "{ctx}: live blocks overlap: {pair:?}");
    }
    w.verify();
    let s = w.stats();
    assert_eq!(s.used_bytes, used, "{ctx}: used_bytes");
    assert_eq!(s.external_bytes, external, "{ctx}: external_bytes");
    assert_eq!(s.pinned_bytes, pinned, "{ctx}: pinned_bytes");
    assert_eq!(s.used_bytes + s.cached_bytes + s.overhead_bytes, s.capacity_bytes, "{ctx}: capacity identity");
    assert_eq!(s.cycles, w.generation());
}

fn run(config: WorkspaceConfiguration, limit: Option<usize>, source: u8, ops: Vec<Op>) {
    // The heap keeps discarded pages; anonymous memory really drops them; the opaque device
    // stand-in keeps headers on the host.
    let upstream: Arc<dyn Backend> = match source % 3 {
        0 => Arc::new(HeapMemory),
        1 => Arc::new(AnonymousMemory),
        _ => Arc::new(OpaqueMemory),
    };
    let backend: Arc<dyn Backend> = match limit {
        Some(l) => Arc::new(LimitAdaptor::new(upstream, l)),
        None => upstream,
    };
    let mut w = match Workspace::with_backend("P", config, backend) {
        Ok(w) => w,
        Err(Error::SystemOutOfMemory { .. }) => return,
        Err(e) => panic!("{e}"),
    };
    w.enter().unwrap();
    let mut live: Vec<Live> = Vec::new();
    let mut seed = 0u8;
    let mut alloc = |w: &mut Workspace, live: &mut Vec<Live>, size: usize| match w.alloc(size) {
        Ok(p) => {
            seed = seed.wrapping_add(1);
            fill(p.as_ptr(), size.min(512), seed);
            live.push(Live { p, size, seed });
        }
        Err(Error::OutOfMemory { .. } | Error::SystemOutOfMemory { .. } | Error::Destroyed { .. }) => {}
        Err(e) => panic!("unexpected {e}"),
    };
    for (step, op) in ops.into_iter().enumerate() {
        let ctx = format!("step {step} {op:?}");
        match op {
            Op::Alloc(size) => alloc(&mut w, &mut live, size),
            Op::Free(i) if !live.is_empty() => {
                let b = live.swap_remove(i % live.len());
                // SAFETY: `b` is live and removed from the model before its free.
                unsafe { w.free(b.p) };
            }
            Op::Realloc(i, size) if !live.is_empty() => {
                let k = i % live.len();
                // SAFETY: live block; on success the old pointer is replaced in the model.
                if let Ok(q) = unsafe { w.realloc(live[k].p, size) } {
                    let keep = live[k].size.min(size).min(512);
                    assert!(intact(q.as_ptr(), keep, live[k].seed), "{ctx}: realloc lost contents");
                    fill(q.as_ptr(), size.min(512), live[k].seed);
                    live[k] = Live { p: q, size, seed: live[k].seed };
                }
            }
            Op::CycleEnd if !w.is_destroyed() => {
                w.exit().unwrap();
                w.enter().unwrap();
            }
            Op::Nested(size) if !w.is_destroyed() => {
                w.enter().unwrap();
                alloc(&mut w, &mut live, size);
                let r = w.exit().unwrap();
                assert!(!r.completed, "{ctx}: a nested exit ended the cycle");
            }
            Op::Destroy => w.destroy(),
            _ => {}
        }
        check(&w, &live, &ctx);
    }
    for b in live.drain(..) {
        // SAFETY: live, freed once.
        unsafe { w.free(b.p) };
    }
    let s = w.stats();
    assert_eq!((s.used_bytes, s.external_bytes, s.pinned_bytes, s.overhead_bytes), (0, 0, 0, 0));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(256), ..ProptestConfig::default() })]

    #[test]
    fn random_programs_keep_blocks_disjoint_intact_and_counted(
        (config, limit) in config(),
        source in any::<u8>(),
        ops in prop::collection::vec(op(), 1..LONG),
    ) {
        run(config, limit, source, ops);
    }

    #[test]
    fn random_programs_survive_destroy(
        (config, limit) in config(),
        source in any::<u8>(),
        mut ops in prop::collection::vec(op(), 1..LONG / 2),
        at in any::<prop::sample::Index>(),
    ) {
        let k = at.index(ops.len());
        ops.insert(k, Op::Destroy);
        run(config, limit, source, ops);
    }
}
