//! Failure injection: allocator programs over a backend that fails every `n`th map or block
//! allocation with `ENOMEM` or `ENOSPC`. Every failure must come back as a clean error naming what
//! the system said, live blocks must keep their contents, the statistics must stay consistent, and
//! once the system stops refusing the workspace must serve again.

mod common;

use std::ptr::NonNull;
use std::sync::Arc;

use common::{fill, intact};
use proptest::prelude::*;
use rustws_core::backend::FaultAdaptor;
use rustws_core::*;

#[derive(Debug, Clone)]
enum Op {
    Alloc(usize),
    Free(usize),
    Realloc(usize, usize),
    CycleEnd,
}

/// Under Miri, which runs each step thousands of times slower, programs are shorter and blocks
/// and arenas smaller; the paths they take are the same.
const MIRI: bool = cfg!(miri);
const LARGE: usize = if MIRI { 30_000 } else { 300_000 };
const LONG: usize = if MIRI { 40 } else { 150 };

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![1usize..4000, 4000usize..LARGE];
    prop_oneof![
        5 => size.clone().prop_map(Op::Alloc),
        3 => any::<usize>().prop_map(Op::Free),
        1 => (any::<usize>(), size).prop_map(|(i, s)| Op::Realloc(i, s)),
        2 => Just(Op::CycleEnd),
    ]
}

fn config() -> impl Strategy<Value = WorkspaceConfiguration> {
    (
        prop_oneof![Just(0u64), Just(64 << 10), Just(if MIRI { 128 << 10 } else { 1 << 20 })],
        prop_oneof![Just(LearningPolicy::None), Just(LearningPolicy::FirstLoop), Just(LearningPolicy::OverTime)],
        prop_oneof![Just(SpillPolicy::Fail), Just(SpillPolicy::Reallocate), Just(SpillPolicy::External)],
        prop_oneof![Just(ResetPolicy::BlockLeft), Just(ResetPolicy::EndOfBufferReached)],
        prop_oneof![
            Just(AllocationPolicy::Strict),
            Just(AllocationPolicy::Overallocate),
            Just(AllocationPolicy::Always)
        ],
    )
        .prop_map(|(initial, learning, spill, reset, alloc)| WorkspaceConfiguration {
            initial_size: initial,
            policy_learning: learning,
            policy_spill: spill,
            policy_reset: reset,
            policy_allocation: alloc,
            ..Default::default()
        })
}

struct Live {
    p: NonNull<u8>,
    size: usize,
    seed: u8,
}

fn system_said(e: &Error, errno: i32) {
    if let Error::SystemOutOfMemory { detail, .. } = e {
        let said = std::io::Error::from_raw_os_error(errno).to_string();
        let said = said.split(" (os error").next().unwrap_or_default();
        assert!(detail.contains(said), "{detail:?} does not say {said:?}");
    }
}

fn check(w: &Workspace, live: &[Live], ctx: &str) {
    for b in live {
        assert!(intact(b.p.as_ptr(), b.size.min(256), b.seed), "{ctx}: block contents changed");
    }
    w.verify();
    let s = w.stats();
    assert_eq!(s.used_bytes + s.cached_bytes + s.overhead_bytes, s.capacity_bytes, "{ctx}: capacity identity");
}

fn run(config: WorkspaceConfiguration, source: u8, every: u64, errno: i32, ops: Vec<Op>) {
    let upstream: Arc<dyn Backend> = if source % 2 == 0 { Arc::new(HeapMemory) } else { Arc::new(AnonymousMemory) };
    let faults = Arc::new(FaultAdaptor::fail_every(upstream, every, errno));
    let backend: Arc<dyn Backend> = faults.clone();
    let mut w = match Workspace::with_backend("F", config.clone(), backend.clone()) {
        Ok(w) => w,
        Err(e) => {
            assert!(matches!(e, Error::SystemOutOfMemory { .. }), "{e}");
            system_said(&e, errno);
            faults.set_armed(false);
            let w = Workspace::with_backend("F", config.clone(), backend).expect("the system serves again");
            faults.set_armed(true);
            w
        }
    };
    w.enter().unwrap();
    let mut live: Vec<Live> = Vec::new();
    let mut seed = 0u8;
    let mut alloc = |w: &mut Workspace, live: &mut Vec<Live>, size: usize| match w.alloc(size) {
        Ok(p) => {
            seed = seed.wrapping_add(1);
            fill(p.as_ptr(), size.min(256), seed);
            live.push(Live { p, size, seed });
            true
        }
        Err(e @ (Error::OutOfMemory { .. } | Error::SystemOutOfMemory { .. })) => {
            system_said(&e, errno);
            false
        }
        Err(e) => panic!("unexpected {e}"),
    };
    for (step, op) in ops.into_iter().enumerate() {
        let ctx = format!("step {step} {op:?}");
        match op {
            Op::Alloc(size) => {
                alloc(&mut w, &mut live, size);
            }
            Op::Free(i) if !live.is_empty() => {
                let b = live.swap_remove(i % live.len());
                // SAFETY: `b` is live and removed from the model before its free.
                unsafe { w.free(b.p) };
            }
            Op::Realloc(i, size) if !live.is_empty() => {
                let k = i % live.len();
                // SAFETY: a live block; on success the old pointer is replaced in the model.
                match unsafe { w.realloc(live[k].p, size) } {
                    Ok(q) => {
                        let keep = live[k].size.min(size).min(256);
                        assert!(intact(q.as_ptr(), keep, live[k].seed), "{ctx}: realloc lost contents");
                        fill(q.as_ptr(), size.min(256), live[k].seed);
                        live[k] = Live { p: q, size, seed: live[k].seed };
                    }
                    Err(e) => system_said(&e, errno),
                }
            }
            Op::CycleEnd => {
                w.exit().expect("a cycle end never fails, even when growth does");
                w.enter().unwrap();
            }
            _ => {}
        }
        check(&w, &live, &ctx);
    }
    // The system serves again: so does the workspace, within a cycle or two.
    faults.set_armed(false);
    w.exit().unwrap();
    for b in live.drain(..) {
        // SAFETY: live, freed once.
        unsafe { w.free(b.p) };
    }
    for _ in 0..2 {
        w.enter().unwrap();
        let served = [64usize, 5000, 100_000].iter().all(|&n| alloc(&mut w, &mut live, n));
        if config.policy_spill != SpillPolicy::Fail {
            assert!(served, "the workspace stayed unusable after the failures");
        }
        check(&w, &live, "after");
        for b in live.drain(..) {
            // SAFETY: live, freed once.
            unsafe { w.free(b.p) };
        }
        w.exit().unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(128), ..ProptestConfig::default() })]

    #[test]
    fn every_injected_failure_is_a_clean_error_and_the_workspace_recovers(
        config in config(),
        source in any::<u8>(),
        every in 1u64..6,
        enospc in any::<bool>(),
        ops in prop::collection::vec(op(), 1..LONG),
    ) {
        run(config, source, every, if enospc { libc::ENOSPC } else { libc::ENOMEM }, ops);
    }
}

#[test]
fn spills_refused_by_the_system_are_reported_and_later_ones_served() {
    let faults = Arc::new(FaultAdaptor::fail_every(Arc::new(AnonymousMemory), 2, libc::ENOMEM));
    let config = WorkspaceConfiguration {
        initial_size: 64 << 10,
        policy_learning: LearningPolicy::None,
        policy_spill: SpillPolicy::External,
        ..Default::default()
    };
    let mut w = Workspace::with_backend("F", config, faults.clone()).unwrap();
    w.enter().unwrap();
    let (mut served, mut refused) = (Vec::new(), 0);
    for _ in 0..6 {
        match w.alloc(300_000) {
            Ok(p) => served.push(p),
            Err(e) => {
                assert!(matches!(e, Error::SystemOutOfMemory { .. }), "{e}");
                system_said(&e, libc::ENOMEM);
                refused += 1;
            }
        }
    }
    assert!(refused > 0 && !served.is_empty(), "{refused} refused, {} served", served.len());
    assert_eq!(faults.injected(), refused);
    w.verify();
    for p in served {
        // SAFETY: live, freed once.
        unsafe { w.free(p) };
    }
    w.exit().unwrap();
    assert_eq!(w.stats().external_bytes, 0);
}
