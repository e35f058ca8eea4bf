//! Failure injection: allocator programs over a backend that fails every `n`th map or block
//! allocation with `ENOMEM` or `ENOSPC`. Every failure must come back as a clean error naming what
//! the system said, live blocks must keep their contents, the statistics must stay consistent, and
//! once the system stops refusing the workspace must serve again.

mod common;

use std::sync::Arc;

use common::program::{op, Op, Program, LONG, MIRI};
use proptest::prelude::*;
use rustws_core::backend::FaultAdaptor;
use rustws_core::*;

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

fn system_said(e: &Error, errno: i32) {
    if let Error::SystemOutOfMemory { cause, .. } = e {
        assert_eq!(cause.cause, Cause::Os(errno), "{e} does not carry the system's errno {errno}");
        let said = std::io::Error::from_raw_os_error(errno).to_string();
        let said = said.split(" (os error").next().unwrap_or_default();
        assert!(e.to_string().contains(said), "{e} does not say {said:?}");
    }
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
    let mut program = Program::new(w);
    // A growth the system refused leaves the arena as it was: the statistics stay consistent,
    // but the model does not predict which blocks spilled.
    program.exact = false;
    let mut refused = |e: &Error| {
        assert!(matches!(e, Error::OutOfMemory(_) | Error::SystemOutOfMemory { .. }), "unexpected {e}");
        system_said(e, errno);
    };
    for (step, op) in ops.into_iter().enumerate() {
        let ctx = format!("step {step} {op:?}");
        program.apply(op, &mut refused);
        program.check(&ctx);
    }
    // The system serves again: so does the workspace, within a cycle or two.
    faults.set_armed(false);
    program.w.exit().unwrap();
    let mut w = program.finish();
    for _ in 0..2 {
        w.enter().unwrap();
        let mut program = Program::new(w);
        let mut failed = false;
        for n in [64usize, 5000, 100_000] {
            program.apply(Op::Alloc(n), &mut |_| failed = true);
        }
        if config.policy_spill != SpillPolicy::Fail {
            assert!(!failed, "the workspace stayed unusable after the failures");
        }
        program.check("after");
        w = program.finish();
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
        ops in prop::collection::vec(op(), 1..LONG / 2),
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
