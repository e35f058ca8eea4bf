//! Allocator programs as property tests (the shared model of `common::program`): random
//! sequences of allocations, zeroed ones, frees (some from another thread), reallocations across
//! classes, cycle ends with and without escapes, nested and overlapping cycles and destroy, under
//! random policies, `max_size` and backend limits. After every step, live blocks must not overlap,
//! must be aligned, must lie inside their region (arena blocks), must keep their contents, the
//! statistics must match the model, and the footprint must be within `max_size`.

mod common;

use std::sync::Arc;

use common::program::{op, Op, Program, LARGE, LONG, MIRI};
use proptest::prelude::*;
use rustws_core::*;

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
        prop_oneof![Just(0u64), Just(LARGE as u64 * 4), Just(LARGE as u64 * 16)],
    )
        .prop_map(|(initial, learning, spill, reset, alloc, helper, limit, cbi, max)| {
            (
                WorkspaceConfiguration {
                    initial_size: initial,
                    max_size: if max > 0 { max.max(initial) } else { 0 },
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
    let mut program = Program::new(w);
    let mut refused = |e: &Error| {
        assert!(
            matches!(e, Error::OutOfMemory(_) | Error::SystemOutOfMemory { .. } | Error::Destroyed { .. }),
            "unexpected {e}"
        )
    };
    for (step, op) in ops.into_iter().enumerate() {
        let ctx = format!("step {step} {op:?}");
        program.apply(op, &mut refused);
        program.check(&ctx);
    }
    program.finish();
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
