//! The adaptive profile and what a workspace commits: convergence from any first cycle, decay
//! after outliers, pre-faulting bounded by what cycles used, zeroed memory that stays lazy, and
//! arenas mapped within a long learning cycle. Each test runs against every host backend.

mod common;

use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{backends, fill, intact};
use rustws_core::*;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// Counts what the workspace asks of its upstream: bytes zeroed by writing, bytes populated.
#[derive(Debug)]
struct Recorder {
    upstream: Arc<dyn Backend>,
    zeroed: AtomicUsize,
    populated: AtomicUsize,
}

impl Recorder {
    fn new(upstream: Arc<dyn Backend>) -> Arc<Self> {
        Arc::new(Recorder { upstream, zeroed: AtomicUsize::new(0), populated: AtomicUsize::new(0) })
    }
}

impl Backend for Recorder {
    fn name(&self) -> &'static str {
        "recorder"
    }
    fn map(&self, len: usize, prefault: bool) -> Result<NonNull<u8>, String> {
        if prefault {
            self.populated.fetch_add(len, Ordering::Relaxed);
        }
        self.upstream.map(len, prefault)
    }
    unsafe fn unmap(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: forwarded with the caller's guarantee.
        unsafe { self.upstream.unmap(ptr, len) }
    }
    fn alloc_block(&self, len: usize) -> Result<NonNull<u8>, String> {
        self.upstream.alloc_block(len)
    }
    fn alloc_block_zeroed(&self, len: usize) -> Result<NonNull<u8>, String> {
        self.upstream.alloc_block_zeroed(len)
    }
    unsafe fn free_block(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: forwarded with the caller's guarantee.
        unsafe { self.upstream.free_block(ptr, len) }
    }
    fn host_accessible(&self) -> bool {
        self.upstream.host_accessible()
    }
    unsafe fn zero(&self, ptr: NonNull<u8>, len: usize) -> Result<(), String> {
        self.zeroed.fetch_add(len, Ordering::Relaxed);
        // SAFETY: forwarded with the caller's guarantee.
        unsafe { self.upstream.zero(ptr, len) }
    }
    fn populate(&self, ptr: NonNull<u8>, len: usize) {
        self.populated.fetch_add(len, Ordering::Relaxed);
        self.upstream.populate(ptr, len)
    }
    fn discard(&self, ptr: NonNull<u8>, len: usize) {
        self.upstream.discard(ptr, len)
    }
    fn discard_zeroes(&self) -> bool {
        self.upstream.discard_zeroes()
    }
}

fn adaptive(b: &Arc<dyn Backend>) -> Workspace {
    Workspace::with_backend("A", WorkspaceConfiguration::adaptive(), b.clone()).unwrap()
}

/// One cycle of a loop body: `n` temporaries of `size` bytes, each written, freed in turn.
fn body(w: &mut Workspace, n: usize, size: usize) {
    w.enter().unwrap();
    let mut prev: Option<NonNull<u8>> = None;
    for i in 0..n {
        let p = w.alloc(size).unwrap();
        fill(p.as_ptr(), size.min(4096), i as u8);
        if let Some(q) = prev.replace(p) {
            // SAFETY: live, freed once.
            unsafe { w.free(q) };
        }
    }
    if let Some(q) = prev {
        // SAFETY: live, freed once.
        unsafe { w.free(q) };
    }
    w.exit().unwrap();
}

#[test]
fn adaptive_converges_to_zero_spills_from_any_first_cycle() {
    for (name, b) in backends() {
        // (first cycles, then the repeating body)
        let firsts: [(&str, &[(usize, usize)]); 4] = [
            ("empty", &[(0, 0)]),
            ("smaller", &[(3, 64)]),
            ("larger", &[(3, 8 * MIB)]),
            ("empty, then larger", &[(0, 0), (4, 4 * MIB)]),
        ];
        for (what, first) in firsts {
            let mut w = adaptive(&b);
            for &(n, size) in first {
                body(&mut w, n, size);
            }
            let mut spills = Vec::new();
            for _ in 0..6 {
                let before = w.stats().spill_count;
                body(&mut w, 3, 256 * KIB);
                spills.push(w.stats().spill_count - before);
            }
            assert!(spills[2..].iter().all(|&s| s == 0), "{name}, {what} first: spills per cycle {spills:?}");
            w.verify();
        }
    }
}

#[test]
fn the_learned_need_decays_after_an_outlier_and_the_arena_shrinks() {
    for (name, b) in backends() {
        let mut w = adaptive(&b);
        for _ in 0..3 {
            body(&mut w, 3, MIB);
        }
        let usual = w.stats().capacity_bytes;
        body(&mut w, 4, 40 * MIB); // one outlier cycle
        let spilled = w.stats().spill_count;
        assert!(spilled > 0, "{name}");
        let grown = w.stats().capacity_bytes;
        assert!(grown > 4 * usual, "{name}: the outlier grows the arena: {usual} -> {grown}");
        let mut caps = Vec::new();
        for _ in 0..NEED_WINDOW + 2 {
            body(&mut w, 3, MIB);
            caps.push(w.stats().capacity_bytes);
        }
        assert_eq!(*caps.last().unwrap(), usual, "{name}: back to the usual arena: {caps:?}");
        assert!(w.learned_need() < 4 * MIB, "{name}");
        assert_eq!(w.stats().spill_count, spilled, "{name}: only the outlier spilled");
    }
}

#[test]
fn prefaulted_bytes_never_exceed_what_cycles_used() {
    for (name, b) in backends() {
        let rec = Recorder::new(b.clone());
        let backend: Arc<dyn Backend> = rec.clone();
        let mut w = adaptive(&backend);
        for size in [MIB, 4 * MIB, 2 * MIB, 9 * MIB] {
            body(&mut w, 3, size);
            let populated = rec.populated.load(Ordering::Relaxed);
            assert_eq!(populated as u64, w.prefaulted_bytes(), "{name}");
            // Each mapping pre-faults at most the need learned when it was mapped (page-rounded),
            // never its overallocation: the total stays below the sum of the needs so far.
            let cap = w.stats().capacity_bytes as usize;
            assert!(w.learned_need() <= cap, "{name}");
        }
        // One mapping per growth (1, 4, then 9 MiB temporaries); two live at a time.
        let needs = [2 * (MIB + 64), 2 * (4 * MIB + 64), 2 * (9 * MIB + 64)];
        let bound: usize = needs.iter().map(|n| n.next_multiple_of(4096)).sum();
        assert!(w.prefaulted_bytes() as usize <= bound, "{name}: {} > {bound}", w.prefaulted_bytes());
        // An explicit initial size is never pre-faulted: nothing was learned.
        let rec = Recorder::new(b.clone());
        let backend: Arc<dyn Backend> = rec.clone();
        let c = WorkspaceConfiguration {
            initial_size: 32 * MIB as u64,
            policy_learning: LearningPolicy::None,
            ..Default::default()
        };
        let w = Workspace::with_backend("N", c, backend).unwrap();
        assert!(w.stats().capacity_bytes > 0);
        assert_eq!(rec.populated.load(Ordering::Relaxed), 0, "{name}");
    }
}

#[test]
fn zeroed_requests_from_never_used_memory_are_not_written() {
    for (name, b) in backends() {
        let rec = Recorder::new(b.clone());
        let backend: Arc<dyn Backend> = rec.clone();
        let c = WorkspaceConfiguration {
            initial_size: 8 * MIB as u64,
            policy_learning: LearningPolicy::None,
            ..Default::default()
        };
        let mut w = Workspace::with_backend("Z", c, backend).unwrap();
        w.enter().unwrap();
        let a = w.alloc_zeroed(MIB).unwrap();
        let host = b.host_accessible();
        if host {
            assert_eq!(rec.zeroed.load(Ordering::Relaxed), 0, "{name}: a fresh region is zero already");
            // SAFETY: a live block of 1 MiB.
            assert!(unsafe { std::slice::from_raw_parts(a.as_ptr(), MIB) }.iter().all(|&x| x == 0));
        } else {
            assert_eq!(rec.zeroed.load(Ordering::Relaxed), MIB, "{name}: device memory is cleared by the backend");
        }
        fill(a.as_ptr(), MIB, 5);
        // SAFETY: live, freed once.
        unsafe { w.free(a) };
        w.exit().unwrap();
        // The next cycle carves the same, now used, memory: it must be cleared.
        let zeroed = rec.zeroed.load(Ordering::Relaxed);
        w.enter().unwrap();
        let c = w.alloc_zeroed(MIB).unwrap();
        assert_eq!(rec.zeroed.load(Ordering::Relaxed) - zeroed, MIB, "{name}: reused memory is cleared");
        if host {
            // SAFETY: a live block of 1 MiB.
            assert!(unsafe { std::slice::from_raw_parts(c.as_ptr(), MIB) }.iter().all(|&x| x == 0), "{name}");
        }
        // Past what was ever used, memory is fresh again.
        let zeroed = rec.zeroed.load(Ordering::Relaxed);
        let d = w.alloc_zeroed(2 * MIB).unwrap();
        let expect = if host { 0 } else { 2 * MIB };
        assert_eq!(rec.zeroed.load(Ordering::Relaxed) - zeroed, expect, "{name}");
        // SAFETY: live, freed once.
        unsafe {
            w.free(d);
            w.free(c);
        }
        w.exit().unwrap();
    }
}

#[test]
fn memory_freed_inside_a_cycle_is_found_again_before_the_arena_grows() {
    for (name, b) in backends() {
        let mut w = adaptive(&b);
        body(&mut w, 3, MIB);
        body(&mut w, 3, MIB);
        let cap = w.stats().capacity_bytes;
        // One long cycle: many temporaries, freed out of order, never more than two live.
        w.enter().unwrap();
        let mut live: Vec<NonNull<u8>> = Vec::new();
        for i in 0..200 {
            let p = w.alloc(MIB / 2 + (i % 7) * 4096).unwrap();
            fill(p.as_ptr(), 4096, i as u8);
            live.push(p);
            if live.len() > 2 {
                let q = live.remove(i % 2);
                // SAFETY: live, freed once.
                unsafe { w.free(q) };
            }
        }
        for p in live {
            // SAFETY: live, freed once.
            unsafe { w.free(p) };
        }
        let s = w.stats();
        w.exit().unwrap();
        assert_eq!(s.spill_count, 0, "{name}: {s:?}");
        assert_eq!(s.capacity_bytes, cap, "{name}: the arena did not grow");
        w.verify();
    }
}

#[test]
fn a_long_learning_cycle_maps_its_arena_before_it_ends() {
    for (name, b) in backends() {
        for config in [WorkspaceConfiguration::adaptive(), WorkspaceConfiguration::default()] {
            let mut w = Workspace::with_backend("LONG", config.clone(), b.clone()).unwrap();
            w.enter().unwrap();
            let kept = w.alloc(10_000).unwrap();
            fill(kept.as_ptr(), 10_000, 42);
            for i in 0..400 {
                let p = w.alloc(100 * KIB).unwrap();
                fill(p.as_ptr(), 4096, i as u8);
                // SAFETY: live, freed once.
                unsafe { w.free(p) };
            }
            let s = w.stats();
            assert!(s.capacity_bytes > 0, "{name} {:?}: an arena was mapped within the cycle", config.policy_learning);
            // From then on the cycle's smaller blocks are served from the arena; a large one
            // still comes from the C heap until the cycle ends.
            let p = w.alloc(100 * KIB).unwrap();
            assert_eq!(w.stats().used_bytes, 100 * KIB as u64, "{name}");
            let large = w.alloc(4 * MIB).unwrap();
            assert_eq!(w.stats().used_bytes, 100 * KIB as u64, "{name}");
            // SAFETY: live, freed once.
            unsafe { w.free(large) };
            // SAFETY: live, freed once.
            unsafe { w.free(p) };
            w.exit().unwrap();
            assert!(intact(kept.as_ptr(), 10_000, 42));
            // SAFETY: live, freed once.
            unsafe { w.free(kept) };
            assert_eq!(w.stats().spill_count, 0, "{name}: a learning cycle does not spill");
            w.verify();
        }
    }
}

#[test]
fn huge_mappings_are_reused_while_their_size_recurs_and_released_when_it_stops() {
    let mut w = Workspace::new("HUGE", WorkspaceConfiguration::adaptive()).unwrap();
    let huge = HUGE_BLOCK_MIN;
    let mut first = None;
    for _ in 0..3 {
        w.enter().unwrap();
        let (a, b) = (w.alloc(huge).unwrap(), w.alloc(huge).unwrap());
        first.get_or_insert(a);
        // SAFETY: live, freed once.
        unsafe {
            w.free(a);
            w.free(b);
        }
        w.exit().unwrap();
        assert_eq!(w.huge_cached().0, 2, "both mappings kept for the next cycle");
    }
    w.enter().unwrap();
    let again = w.alloc(huge).unwrap();
    assert!(Some(again) == first || w.huge_cached().0 == 1, "a cached mapping is reused");
    // A huge request of another size: what is cached does not recur and goes back first.
    let other = w.alloc(2 * huge).unwrap();
    assert_eq!(w.huge_cached(), (0, 0));
    // SAFETY: live, freed once.
    unsafe {
        w.free(other);
        w.free(again);
    }
    w.exit().unwrap();
    assert_eq!(w.huge_cached().0, 2);
    // Cycles without huge requests release them.
    for _ in 0..3 {
        body(&mut w, 3, 64 * KIB);
    }
    assert_eq!(w.huge_cached(), (0, 0));
    assert_eq!(w.stats().external_bytes, 0);
}

mod long_cycles {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(usize),
        Free(usize),
        Cycle,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (6u32..19).prop_map(|bits| Op::Alloc((1usize << bits) + (bits as usize) * 40)),
            5 => any::<usize>().prop_map(Op::Free),
            1 => Just(Op::Cycle),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: common::cases(48), ..ProptestConfig::default() })]

        /// Long adaptive cycles that churn through external memory (provisional arenas, walks
        /// for freed memory, grants of untouched memory): live blocks never overlap and keep
        /// their contents, and every region's chain stays consistent.
        #[test]
        fn live_blocks_keep_their_contents(ops in proptest::collection::vec(op(), 200..1200)) {
            let mut w = Workspace::new("P", WorkspaceConfiguration::adaptive()).unwrap();
            w.enter().unwrap();
            let mut live: Vec<(NonNull<u8>, usize, u8)> = Vec::new();
            for (i, op) in ops.into_iter().enumerate() {
                match op {
                    Op::Alloc(size) => {
                        let p = w.alloc(size).unwrap();
                        let seed = i as u8;
                        fill(p.as_ptr(), (size - 1).min(512), seed);
                        // SAFETY: a live block of `size` bytes; its last byte is ours.
                        unsafe { *p.as_ptr().add(size - 1) = seed };
                        live.push((p, size, seed));
                    }
                    Op::Free(k) if !live.is_empty() => {
                        let (p, size, seed) = live.swap_remove(k % live.len());
                        prop_assert!(intact(p.as_ptr(), (size - 1).min(512), seed));
                        // SAFETY: live, freed once.
                        prop_assert_eq!(unsafe { *p.as_ptr().add(size - 1) }, seed);
                        // SAFETY: live, freed once.
                        unsafe { w.free(p) };
                    }
                    Op::Free(_) => {}
                    Op::Cycle => {
                        w.exit().unwrap();
                        w.enter().unwrap();
                    }
                }
            }
            let mut spans: Vec<(usize, usize)> = live.iter().map(|(p, s, _)| (p.as_ptr() as usize, *s)).collect();
            spans.sort_unstable();
            for pair in spans.windows(2) {
                prop_assert!(pair[0].0 + pair[0].1 <= pair[1].0, "live blocks overlap");
            }
            for (p, size, seed) in live {
                prop_assert!(intact(p.as_ptr(), (size - 1).min(512), seed));
                // SAFETY: live, freed once.
                unsafe { w.free(p) };
            }
            w.exit().unwrap();
            w.verify();
        }
    }
}
