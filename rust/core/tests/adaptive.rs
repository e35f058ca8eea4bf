//! The adaptive profile and what a workspace commits: convergence from any first cycle, decay
//! after outliers, pre-faulting bounded by what cycles used, zeroed memory that stays lazy, blocks
//! recycled by class within a long learning cycle, and kept results that never grow the arena.
//! Each test runs against every host backend.

mod common;

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use common::{backends, fill, intact, miri_or};
use rustws_core::*;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// Counts what the workspace asks of its upstream: bytes zeroed by writing, bytes populated.
#[derive(Debug)]
struct Recorder {
    upstream: Arc<dyn Backend>,
    zeroed: AtomicUsize,
    populated: AtomicUsize,
    /// Blocks asked of the block allocator.
    blocks: AtomicUsize,
    /// Times the block allocator was asked to return its free memory.
    trims: AtomicUsize,
    /// Regions mapped.
    maps: AtomicUsize,
    /// Bytes given back (or refused), and whether the system is to refuse (locked memory).
    discarded: AtomicUsize,
    refuse_discard: AtomicBool,
}

impl Recorder {
    fn new(upstream: Arc<dyn Backend>) -> Arc<Self> {
        Arc::new(Recorder {
            upstream,
            zeroed: AtomicUsize::new(0),
            populated: AtomicUsize::new(0),
            blocks: AtomicUsize::new(0),
            trims: AtomicUsize::new(0),
            maps: AtomicUsize::new(0),
            discarded: AtomicUsize::new(0),
            refuse_discard: AtomicBool::new(false),
        })
    }
}

impl Backend for Recorder {
    fn name(&self) -> &'static str {
        "recorder"
    }
    fn map(&self, len: usize, prefault: bool) -> Result<NonNull<u8>, BackendError> {
        self.maps.fetch_add(1, Ordering::Relaxed);
        if prefault {
            self.populated.fetch_add(len, Ordering::Relaxed);
        }
        self.upstream.map(len, prefault)
    }
    unsafe fn unmap(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: forwarded with the caller's guarantee.
        unsafe { self.upstream.unmap(ptr, len) }
    }
    fn alloc_block(&self, len: usize) -> Result<NonNull<u8>, BackendError> {
        self.blocks.fetch_add(1, Ordering::Relaxed);
        self.upstream.alloc_block(len)
    }
    fn alloc_block_zeroed(&self, len: usize) -> Result<NonNull<u8>, BackendError> {
        self.blocks.fetch_add(1, Ordering::Relaxed);
        self.upstream.alloc_block_zeroed(len)
    }
    unsafe fn free_block(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: forwarded with the caller's guarantee.
        unsafe { self.upstream.free_block(ptr, len) }
    }
    fn host_accessible(&self) -> bool {
        self.upstream.host_accessible()
    }
    unsafe fn zero(&self, ptr: NonNull<u8>, len: usize) -> Result<(), BackendError> {
        self.zeroed.fetch_add(len, Ordering::Relaxed);
        // SAFETY: forwarded with the caller's guarantee.
        unsafe { self.upstream.zero(ptr, len) }
    }
    fn populate(&self, ptr: NonNull<u8>, len: usize) {
        self.populated.fetch_add(len, Ordering::Relaxed);
        self.upstream.populate(ptr, len)
    }
    fn discard(&self, ptr: NonNull<u8>, len: usize) -> bool {
        self.discarded.fetch_add(len, Ordering::Relaxed);
        !self.refuse_discard.load(Ordering::Relaxed) && self.upstream.discard(ptr, len)
    }
    fn discard_zeroes(&self) -> bool {
        self.upstream.discard_zeroes()
    }
    fn faults_lazily(&self) -> bool {
        self.upstream.faults_lazily()
    }
    fn trim(&self) {
        self.trims.fetch_add(1, Ordering::Relaxed);
        self.upstream.trim()
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
        fill(p.as_ptr(), size.min(miri_or(4096, 256)), i as u8);
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
fn a_temporary_spilled_again_and_again_grows_the_arena_once() {
    // An arena learned on small cycles meets a cycle whose 2 MiB temporaries, two alive at once,
    // are made twelve times over: 24 MiB spill, of which 4 MiB was outside at once. The arena
    // grows by the 4, not the 24, and the next such cycle is served without a spill.
    for (name, b) in backends() {
        let mut w = adaptive(&b);
        for _ in 0..3 {
            body(&mut w, 3, 64 * KIB);
        }
        let small = w.stats().capacity_bytes as usize;
        let size = miri_or(2 * MIB, 256 * KIB);
        body(&mut w, 12, size);
        let s = w.stats();
        assert!(s.spill_count >= 12, "{name}: the cycle spilled: {s:?}");
        let grown = s.capacity_bytes as usize;
        assert!(grown >= 2 * size, "{name}: grown to hold two temporaries: {small} -> {grown}");
        assert!(
            grown <= 2 * (small + 2 * size),
            "{name}: grown by what was outside at once, not by all that spilled: {small} -> {grown}"
        );
        body(&mut w, 12, size);
        assert_eq!(w.stats().spill_count, s.spill_count, "{name}: the next such cycle is served");
        w.verify();
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
fn state_a_loop_replaces_is_never_resident_twice_when_the_arena_is_sized() {
    // `a = f(k); b = g(a); c = h(b)` with a, b and c kept until the next cycle replaces them
    // (globals, attributes): NumPy's allocator frees each old copy as its replacement comes, so at
    // most one of the three is there twice. The first cycle serves them outside the arena; the
    // cycles that size the arena must neither keep the old copies cached beside it nor pre-fault
    // the room of the new ones while the old ones still live.
    const STATE: usize = 4 * MIB;
    for (name, b) in backends() {
        let rec = Recorder::new(b.clone());
        let backend: Arc<dyn Backend> = rec.clone();
        let mut w = adaptive(&backend);
        let mut state: Vec<NonNull<u8>> = Vec::new();
        for k in 0..miri_or(6, 4) {
            let populated = rec.populated.load(Ordering::Relaxed);
            w.enter().unwrap();
            for i in 0..3 {
                let p = w.alloc(STATE).unwrap();
                fill(p.as_ptr(), miri_or(STATE, 256), (k * 3 + i) as u8);
                if state.len() == 3 {
                    // SAFETY: live (kept from the last cycle), freed once.
                    unsafe { w.free(state.remove(0)) };
                }
                state.push(p);
                // The old copies freed so far are not kept beside what replaced them.
                assert!(w.external_cached_bytes() < STATE, "{name}: cycle {k}: {} cached", w.external_cached_bytes());
            }
            let faulted = rec.populated.load(Ordering::Relaxed) - populated;
            assert!(faulted < STATE, "{name}: cycle {k} opened with {faulted} bytes pre-faulted beside its old state");
            w.exit().unwrap();
        }
        for (i, p) in state.into_iter().enumerate() {
            assert!(intact(p.as_ptr(), miri_or(STATE, 256), (miri_or(6, 4) * 3 - 3 + i) as u8), "{name}");
            // SAFETY: live, freed once.
            unsafe { w.free(p) };
        }
        w.verify();
    }
}

/// A large zeroed request from used arena memory is zeroed as it is resident: the pages the
/// system holds are written, the others given back (they read as zeros); where the system keeps
/// them (locked memory), all are written. Every byte reads zero, a partial last page included.
#[test]
#[cfg_attr(miri, ignore = "no mincore there, and discarded pages keep their bytes")]
fn large_zeroed_blocks_from_used_memory_write_what_is_resident_and_give_back_the_rest() {
    let size = 4 * MIB + 100;
    let page = rustws_core::backend::page_bytes();
    for refuse in [false, true] {
        let rec = Recorder::new(Arc::new(AnonymousMemory));
        rec.refuse_discard.store(refuse, Ordering::Relaxed);
        let c = WorkspaceConfiguration {
            initial_size: 16 * MIB as u64,
            policy_learning: LearningPolicy::None,
            ..Default::default()
        };
        let backend: Arc<dyn Backend> = rec.clone();
        let mut w = Workspace::with_backend("sparing", c, backend).unwrap();
        w.enter().unwrap();
        let a = w.alloc(size).unwrap();
        let start = a.as_ptr() as usize;
        let (from, to) = ((start + MIB).next_multiple_of(page), (start + 3 * MIB) / page * page);
        // SAFETY: whole pages inside the live block, whose bytes this test owns: small pages
        // (khugepaged would make more of them resident again), then the middle given back, as
        // the system takes pages back.
        unsafe {
            libc::madvise(start.next_multiple_of(page) as *mut libc::c_void, 4 * MIB, libc::MADV_NOHUGEPAGE);
        }
        fill(a.as_ptr(), size, 7);
        // SAFETY: as above.
        assert_eq!(unsafe { libc::madvise(from as *mut libc::c_void, to - from, libc::MADV_DONTNEED) }, 0);
        // SAFETY: live, freed once.
        unsafe { w.free(a) };
        w.exit().unwrap();
        let (zeroed, discarded) = (rec.zeroed.load(Ordering::Relaxed), rec.discarded.load(Ordering::Relaxed));
        w.enter().unwrap();
        let b = w.alloc_zeroed(size).unwrap();
        assert_eq!(b, a, "the same memory serves again");
        // SAFETY: a live block of `size` bytes.
        assert!(unsafe { std::slice::from_raw_parts(b.as_ptr(), size) }.iter().all(|&x| x == 0), "refuse {refuse}");
        let written = rec.zeroed.load(Ordering::Relaxed) - zeroed;
        let asked = rec.discarded.load(Ordering::Relaxed) - discarded;
        assert!(asked >= to - from, "refuse {refuse}: what is not resident is given back: {asked}");
        if refuse {
            assert_eq!(written, size, "the system kept the pages: all are written");
        } else {
            assert!(written <= size - (to - from), "resident pages only are written: {written}");
        }
        // SAFETY: live, freed once.
        unsafe { w.free(b) };
        w.exit().unwrap();
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
        // Under Miri, smaller blocks: every byte checked costs there.
        let size = miri_or(MIB, 64 * KIB);
        w.enter().unwrap();
        let a = w.alloc_zeroed(size).unwrap();
        let host = b.host_accessible();
        if host {
            assert_eq!(rec.zeroed.load(Ordering::Relaxed), 0, "{name}: a fresh region is zero already");
            // SAFETY: a live block of `size` bytes.
            assert!(unsafe { std::slice::from_raw_parts(a.as_ptr(), size) }.iter().all(|&x| x == 0));
        } else {
            assert_eq!(rec.zeroed.load(Ordering::Relaxed), size, "{name}: device memory is cleared by the backend");
        }
        fill(a.as_ptr(), size, 5);
        // SAFETY: live, freed once.
        unsafe { w.free(a) };
        w.exit().unwrap();
        // The next cycle carves the same, now used, memory: it must be cleared.
        let zeroed = rec.zeroed.load(Ordering::Relaxed);
        w.enter().unwrap();
        let c = w.alloc_zeroed(size).unwrap();
        assert_eq!(rec.zeroed.load(Ordering::Relaxed) - zeroed, size, "{name}: reused memory is cleared");
        if host {
            // SAFETY: a live block of `size` bytes.
            assert!(unsafe { std::slice::from_raw_parts(c.as_ptr(), size) }.iter().all(|&x| x == 0), "{name}");
        }
        // Past what was ever used, memory is fresh again.
        let zeroed = rec.zeroed.load(Ordering::Relaxed);
        let d = w.alloc_zeroed(2 * size).unwrap();
        let expect = if host { 0 } else { 2 * size };
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
        for i in 0..miri_or(200, 30) {
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
fn a_long_learning_cycle_recycles_its_blocks_by_class() {
    for (name, b) in backends() {
        for config in [WorkspaceConfiguration::adaptive(), WorkspaceConfiguration::default()] {
            let rec = Recorder::new(b.clone());
            let backend: Arc<dyn Backend> = rec.clone();
            let mut w = Workspace::with_backend("LONG", config.clone(), backend).unwrap();
            w.enter().unwrap();
            let kept = w.alloc(10_000).unwrap();
            fill(kept.as_ptr(), 10_000, 42);
            for i in 0..miri_or(400, 40) {
                // Sizes within one class: every one after the first takes the same block back.
                let p = w.alloc(100 * KIB - (i % 5) * 1000).unwrap();
                fill(p.as_ptr(), miri_or(4096, 256), i as u8);
                // SAFETY: live, freed once.
                unsafe { w.free(p) };
            }
            let blocks = rec.blocks.load(Ordering::Relaxed);
            assert_eq!(blocks, 2, "{name} {:?}: the kept block and one recycled block", config.policy_learning);
            assert!(w.external_cached_bytes() >= 100 * KIB, "{name}: the freed block is cached");
            assert_eq!(w.stats().spill_count, 0, "{name}: a learning cycle does not spill");
            w.exit().unwrap();
            // The next cycles are served by the arena learned from this one (the cache went back
            // when it was mapped). Under FIRST_LOOP (which never grows) their second temporary
            // spills, every cycle, to one block the cache keeps; the adaptive profile grows
            // instead, and its cache stays empty.
            for _ in 0..6 {
                body(&mut w, 4, 100 * KIB);
            }
            assert!(w.stats().capacity_bytes > 0, "{name}");
            if config.policy_learning == LearningPolicy::Adaptive {
                assert_eq!(w.external_cached_bytes(), 0, "{name}: the cache was returned once unused");
            } else {
                assert!(w.stats().spill_count >= 6, "{name}: {:?}", w.stats());
                assert_eq!(rec.blocks.load(Ordering::Relaxed), 3, "{name}: spills are served by the cache");
            }
            assert!(intact(kept.as_ptr(), 10_000, 42));
            // SAFETY: live, freed once.
            unsafe { w.free(kept) };
            w.verify();
        }
    }
}

#[test]
fn kept_results_are_not_need_and_never_grow_the_arena() {
    // `results.append(f(x))`: every cycle keeps an 80 KB result; its own temporaries need about
    // 400 KB. The arena follows what a cycle itself has live, never the kept results.
    for (name, b) in backends() {
        let rec = Recorder::new(b.clone());
        let backend: Arc<dyn Backend> = rec.clone();
        let mut w = Workspace::with_backend("KEEP", WorkspaceConfiguration::adaptive(), backend).unwrap();
        let mut results = Vec::new();
        let mut caps = Vec::new();
        for k in 0..miri_or(2000, 24) {
            w.enter().unwrap();
            let t1 = w.alloc(160_000).unwrap();
            let a = w.alloc(160_000).unwrap();
            // SAFETY: live, freed once.
            unsafe { w.free(t1) };
            let c = w.alloc(80_000).unwrap();
            let r = w.alloc(80_000).unwrap();
            fill(r.as_ptr(), 64, k as u8);
            // SAFETY: live, freed once.
            unsafe {
                w.free(c);
                w.free(a);
            }
            results.push((r, k as u8));
            w.exit().unwrap();
            caps.push(w.stats().capacity_bytes);
        }
        let s = w.stats();
        assert!(caps[5..].iter().all(|&c| c == caps[5]), "{name}: the arena was remapped: {:?}", &caps[..12]);
        assert!(s.capacity_bytes < 2 * MIB as u64, "{name}: {s:?}");
        assert!(w.learned_need() < MIB, "{name}: need {}", w.learned_need());
        assert!(w.external_cached_bytes() < MIB, "{name}: cache {}", w.external_cached_bytes());
        // Blocks asked of the system: the kept results, and a handful of temporaries.
        let blocks = rec.blocks.load(Ordering::Relaxed);
        assert!(blocks < results.len() + 20, "{name}: {blocks} blocks for {} results", results.len());
        for (r, seed) in results {
            assert!(intact(r.as_ptr(), 64, seed), "{name}: a kept result changed");
            // SAFETY: live, freed once.
            unsafe { w.free(r) };
        }
        w.verify();
    }
}

#[test]
fn results_kept_by_overlapping_cycles_neither_count_as_need_nor_grow_the_arena() {
    // Two loops advanced in turn over one workspace (`zip(ws.cycles(a), ws.cycles(b))`), or
    // asyncio tasks each in a cycle of their own: a cycle is always open, so nothing is ever
    // pinned, and each close learns beside the other still open. Every turn keeps a result (32 KB,
    // or 130 KB, a page-aligned class whose blocks the need counts with a filler) and makes two
    // temporaries of its size: the arena follows the temporaries and the results of the last few
    // closes, not everything kept.
    for ((name, b), size) in backends().into_iter().flat_map(|nb| [(nb.clone(), 32_000), (nb, 130_000)]) {
        let mut w = adaptive(&b);
        let mut results = Vec::new();
        w.open_cycle().unwrap();
        let turns = miri_or(3000, 40);
        for k in 0..turns {
            w.open_cycle().unwrap();
            let t1 = w.alloc(size).unwrap();
            let t2 = w.alloc(size).unwrap();
            let r = w.alloc(size).unwrap();
            fill(r.as_ptr(), 64, k as u8);
            // SAFETY: live, freed once.
            unsafe {
                w.free(t1);
                w.free(t2);
            }
            results.push((r, k as u8));
            w.close_cycle().unwrap();
        }
        let s = w.stats();
        let kept = (turns * size) as u64;
        let need = w.learned_need();
        assert!(need < 16 * size, "{name}: need {need} for {kept} bytes kept in results of {size}");
        // A region that never rewinds fills with what is kept; past it, results go outside the
        // arena as they would in a plain process, rather than growing region after region.
        assert!(s.capacity_bytes < 128 * size as u64, "{name}: {kept} bytes kept: {s:?}");
        for (r, seed) in results {
            assert!(intact(r.as_ptr(), 64, seed), "{name}: a kept result changed");
            // SAFETY: live, freed once.
            unsafe { w.free(r) };
        }
        w.close_cycle().unwrap();
        w.verify();
    }
}

/// What [`tasks_in_turn`] saw.
struct Turns {
    /// Spills of each round (every task's step).
    spills: Vec<u64>,
    /// The most bytes the tasks held at once in the last round.
    in_flight: usize,
    /// The need learned and the arena's capacity by the end of the last round (before the tasks
    /// finish, each closing a last cycle with less in flight).
    need: usize,
    capacity: usize,
    /// The most bytes cached outside the arena at a round's end once it has one.
    cached: usize,
}

/// `tasks` asyncio tasks in turn over one workspace, each in a cycle of its own per step: a
/// temporary of `size` bytes, an await, a second one, an await, both freed and the cycle closed.
/// Every close comes while the other tasks hold their temporaries. Each temporary is checked
/// intact before it is freed.
fn tasks_in_turn(w: &mut Workspace, tasks: usize, rounds: usize, size: impl Fn(usize) -> usize) -> Turns {
    let mut held: Vec<Vec<(NonNull<u8>, usize, u8)>> = vec![Vec::new(); tasks];
    let mut spills = Vec::new();
    let (mut most, mut cached) = (0, 0);
    // Each task is at a phase of its step: 0 opens and makes the first, 1 the second, 2 frees
    // both and closes. The tasks start a phase apart, so closes always have others open.
    let mut phase: Vec<usize> = (0..tasks).map(|t| t % 3).collect();
    for t in 0..tasks {
        for _ in 0..phase[t] {
            if held[t].is_empty() {
                w.open_cycle().unwrap();
            }
            let (n, seed) = (size(0), (t + held[t].len()) as u8);
            let p = w.alloc(n).unwrap();
            fill(p.as_ptr(), n.min(miri_or(4096, 256)), seed);
            held[t].push((p, n, seed));
        }
    }
    for round in 0..rounds {
        let before = w.stats().spill_count;
        for t in 0..tasks {
            if phase[t] == 2 {
                for (p, n, seed) in held[t].drain(..) {
                    assert!(intact(p.as_ptr(), n.min(miri_or(4096, 256)), seed), "a temporary changed");
                    // SAFETY: live, freed once.
                    unsafe { w.free(p) };
                }
                w.close_cycle().unwrap();
                phase[t] = 0;
                continue;
            }
            if phase[t] == 0 {
                w.open_cycle().unwrap();
            }
            let (n, seed) = (size(round), (round + t + phase[t]) as u8);
            let p = w.alloc(n).unwrap();
            fill(p.as_ptr(), n.min(miri_or(4096, 256)), seed);
            held[t].push((p, n, seed));
            phase[t] += 1;
            if round + 1 == rounds {
                most = most.max(held.iter().flatten().map(|&(_, n, _)| n).sum());
            }
        }
        spills.push(w.stats().spill_count - before);
        if w.stats().capacity_bytes > 0 {
            cached = cached.max(w.external_cached_bytes());
        }
    }
    let (need, capacity) = (w.learned_need(), w.stats().capacity_bytes as usize);
    for (t, h) in held.iter_mut().enumerate() {
        if phase[t] > 0 {
            for (p, _, _) in h.drain(..) {
                // SAFETY: live, freed once.
                unsafe { w.free(p) };
            }
            w.close_cycle().unwrap();
        }
    }
    Turns { spills, in_flight: most, need, capacity, cached }
}

#[test]
fn temporaries_in_flight_in_overlapping_cycles_are_need_and_stop_spilling() {
    // Asyncio tasks with large temporaries: every close sees the other tasks' temporaries live,
    // as it would results kept on, but they are new blocks each time. What has lived through the
    // last closes is kept; the rest is need, so the arena comes to hold all tasks' temporaries at
    // once and spills stop (it held one task's, and most temporaries spilled). Blocks made
    // outside before the arena served them go back as they are freed rather than stay cached
    // beside it; and a region mapped while cycles overlap grows where it lies.
    // Sixteen tasks: a temporary lives through more closes than four tasks make.
    for ((name, b), tasks) in backends().into_iter().flat_map(|nb| [(nb.clone(), 4), (nb, 16)]) {
        let r = Recorder::new(b.clone());
        let mut w = Workspace::with_backend("T", WorkspaceConfiguration::adaptive(), r.clone()).unwrap();
        let size = miri_or(256 * KIB, 64 * KIB);
        let rounds = miri_or(60, 30);
        // The temporaries grow by a quarter after a third of the rounds (a larger batch).
        let Turns { spills, in_flight, need, capacity, cached } =
            tasks_in_turn(&mut w, tasks, rounds, |round| if round < rounds / 3 { size } else { size * 5 / 4 });
        let late = &spills[rounds - 10..];
        assert!(late.iter().all(|&s| s == 0), "{name}, {tasks} tasks: spills per round {spills:?}");
        assert!(need >= in_flight, "{name}, {tasks} tasks: need {need} for {in_flight} in flight");
        assert!(capacity >= in_flight, "{name}, {tasks} tasks: {capacity} bytes for {in_flight} in flight");
        assert_eq!(cached, 0, "{name}: blocks made outside before the arena stayed cached beside it");
        if b.discard_zeroes() && b.faults_lazily() && tasks == 4 {
            // The first region is mapped when a few tasks have begun, with room to grow twofold.
            assert_eq!(r.maps.load(Ordering::Relaxed), 1, "{name}: one region, grown where it lies");
        }
        w.verify();
    }
}

/// `cycles` cycles of `preds.append(f(x))` with a batch size that changes every cycle: two
/// temporaries of 4 KB to 1 MB (a quarter under Miri), and (`keep`) a 2 KB result kept for good. Returns the spills of
/// each cycle and the workspace, with every kept result checked and freed.
fn changing_sizes_keeping_results(b: &Arc<dyn Backend>, cycles: usize, keep: bool) -> (Vec<u64>, Workspace) {
    let mut w = adaptive(b);
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut results = Vec::new();
    let mut spills = Vec::new();
    for k in 0..cycles {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let rows = [1, 4, 16, 64, 256, 37, 129][(seed % 7) as usize];
        let before = w.stats().spill_count;
        w.enter().unwrap();
        let x = w.alloc(rows * miri_or(4096, 1024)).unwrap();
        let h = w.alloc(rows * miri_or(4096, 1024)).unwrap();
        fill(h.as_ptr(), 64, k as u8);
        if keep {
            let r = w.alloc(2048).unwrap();
            fill(r.as_ptr(), 2048, k as u8);
            results.push((r, k as u8));
        }
        // SAFETY: live, freed once.
        unsafe {
            w.free(x);
            w.free(h);
        }
        w.exit().unwrap();
        spills.push(w.stats().spill_count - before);
    }
    for (r, seed) in results {
        assert!(intact(r.as_ptr(), 2048, seed), "a kept result changed");
        // SAFETY: live, freed once.
        unsafe { w.free(r) };
    }
    w.verify();
    (spills, w)
}

#[test]
fn results_kept_among_changing_sizes_are_put_apart_and_cost_no_spills() {
    // Kept results scattered through the arena cut its free runs, and temporaries spill around
    // them (every request of every cycle, before they were put apart). Once a cycle ends with
    // results of an earlier one still live in the region, their class is served outside the
    // arena: the loop then spills no more than it does keeping nothing (where the arena follows
    // a window of recent cycles, and a large batch after a run of small ones spills). Under Miri,
    // on two backends: every cycle maps and walks megabytes.
    for (name, b) in backends().into_iter().take(miri_or(usize::MAX, 2)) {
        let (cycles, tail) = (miri_or(1500, 30), miri_or(500, 10));
        let (kept, w) = changing_sizes_keeping_results(&b, cycles, true);
        let (plain, _) = changing_sizes_keeping_results(&b, cycles, false);
        let late = |s: &[u64]| s[cycles - tail..].iter().sum::<u64>();
        assert!(
            late(&kept) <= late(&plain),
            "{name}: {} spills in the last {tail} cycles, {} keeping nothing",
            late(&kept),
            late(&plain)
        );
        assert_eq!(w.kept_apart(), vec![classes::class_of(2048).unwrap()], "{name}");
        assert!(w.stats().capacity_bytes < 8 * MIB as u64, "{name}: {:?}", w.stats());
    }
}

#[test]
fn a_freed_block_is_reused_before_untouched_memory() {
    for (name, b) in backends() {
        let config = WorkspaceConfiguration {
            initial_size: 4 * MIB as u64,
            policy_learning: LearningPolicy::None,
            ..Default::default()
        };
        let mut w = Workspace::with_backend("REUSE", config, b.clone()).unwrap();
        w.enter().unwrap();
        let keep = w.alloc(4 * KIB).unwrap(); // pins the region: no rewind at this cycle's end
        let a = w.alloc(64 * KIB).unwrap();
        let b2 = w.alloc(64 * KIB).unwrap();
        // SAFETY: live, freed once.
        unsafe { w.free(a) };
        let again = w.alloc(64 * KIB - 1000).unwrap();
        assert_eq!(again, a, "{name}: the block just freed, of the same class, comes back first");
        // SAFETY: live, freed once.
        unsafe {
            w.free(again);
            w.free(b2);
        }
        w.exit().unwrap();
        // Across the cycle end (with a block kept), the freed blocks still come back first.
        w.enter().unwrap();
        let c = w.alloc(64 * KIB).unwrap();
        assert!(c == b2 || c == a, "{name}: a freed block of the class was reused");
        // SAFETY: live, freed once.
        unsafe {
            w.free(c);
            w.free(keep);
        }
        w.exit().unwrap();
        w.verify();
    }
}

#[test]
fn huge_mappings_are_reused_while_their_size_recurs_and_released_when_it_stops() {
    let mut w = Workspace::new("HUGE", WorkspaceConfiguration::adaptive()).unwrap();
    let huge = HUGE_BLOCK_MIN;
    let mut last = None;
    for cycle in 0..3 {
        w.enter().unwrap();
        let (a, b) = (w.alloc(huge).unwrap(), w.alloc(huge).unwrap());
        last = Some(b); // freed last: the warmest
                        // SAFETY: live, freed once.
        unsafe {
            w.free(a);
            w.free(b);
        }
        if cycle == 0 {
            // A size seen in one cycle only goes back as it is freed, as NumPy's would: kept, it
            // would stay resident beside what the rest of a long cycle touches.
            assert_eq!(w.huge_cached(), (0, 0), "released as freed: the size has not recurred yet");
        }
        w.exit().unwrap();
        if cycle > 0 {
            assert_eq!(w.huge_cached().0, 2, "both mappings kept for the next cycle");
        }
    }
    w.enter().unwrap();
    let again = w.alloc(huge).unwrap();
    assert_eq!(Some(again), last, "the cached mapping freed last is reused");
    assert_eq!(w.huge_cached().0, 1);
    // A huge request of another size: what is cached does not recur and goes back first.
    let other = w.alloc(2 * huge).unwrap();
    assert_eq!(w.huge_cached(), (0, 0));
    // SAFETY: live, freed once.
    unsafe {
        w.free(other);
        w.free(again);
    }
    w.exit().unwrap();
    assert_eq!(w.huge_cached().0, 1, "the size that recurs is kept, the one seen once released");
    // Cycles without huge requests release them.
    for _ in 0..3 {
        body(&mut w, 3, 64 * KIB);
    }
    assert_eq!(w.huge_cached(), (0, 0));
    assert_eq!(w.stats().external_bytes, 0);
}

/// The `VmFlags` of the mapping of this process that holds `addr`, as `/proc/self/smaps` lists
/// them (`hg`: huge pages advised, `nh`: small pages advised).
fn vm_flags(addr: usize) -> Vec<String> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("/proc/self/smaps");
    let mut holds = false;
    for line in smaps.lines() {
        let head = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = head.split_once('-').filter(|_| !head.ends_with(':')) {
            let (a, b) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16));
            holds = matches!((a, b), (Ok(a), Ok(b)) if a <= addr && addr < b);
        } else if holds && head == "VmFlags:" {
            return line.split_whitespace().skip(1).map(str::to_owned).collect();
        }
    }
    panic!("no mapping holds {addr:#x}");
}

#[test]
#[cfg_attr(miri, ignore = "no /proc and no madvise there")]
fn the_head_of_a_huge_block_faults_in_small_pages_and_the_rest_in_huge_ones() {
    let mut w = Workspace::new("HEAD", WorkspaceConfiguration::adaptive()).unwrap();
    let size = HUGE_BLOCK_MIN + 5 * MIB + 12_345;
    w.enter().unwrap();
    let p = w.alloc(size).unwrap();
    let start = p.as_ptr() as usize;
    let behind = vm_flags(start + size / 2);
    if !behind.iter().any(|f| f == "hg") {
        println!("the system takes no huge-page advice here (flags {behind:?}): nothing to check");
    } else {
        // The first rows used alone fault in 4 KiB however the mapping lies against 2 MiB
        // boundaries: the header in front of the block, and its first 256 KiB.
        for at in [start - 64, start, start + 98_760, start + 256 * KIB - 1] {
            let flags = vm_flags(at);
            assert!(
                flags.iter().any(|f| f == "nh"),
                "{} bytes into the block: {flags:?}",
                at as isize - start as isize
            );
        }
        for at in [start + 2 * MIB + 256 * KIB, start + size - 1] {
            assert!(vm_flags(at).iter().any(|f| f == "hg"), "{} bytes into the block", at - start);
        }
    }
    // SAFETY: live, freed once.
    unsafe { w.free(p) };
    w.exit().unwrap();
}

/// Bytes of the whole pages of `[p, p + len)` resident now (`mincore`).
fn resident(p: NonNull<u8>, len: usize) -> usize {
    let page = rustws_core::backend::page_bytes();
    let (a, b) = ((p.as_ptr() as usize).next_multiple_of(page), (p.as_ptr() as usize + len) / page * page);
    let mut vec = vec![0u8; (b - a) / page];
    // SAFETY: whole pages of a mapping of ours (live or cached), and a byte a page to answer in.
    assert_eq!(unsafe { libc::mincore(a as *mut libc::c_void, b - a, vec.as_mut_ptr()) }, 0);
    vec.iter().filter(|&&v| v & 1 == 1).count() * page
}

/// Writes a byte in every page of `[p, p + len)`.
fn touch(p: NonNull<u8>, len: usize, byte: u8) {
    for i in (0..len).step_by(4096) {
        // SAFETY: inside a live block of `len` bytes.
        unsafe { p.as_ptr().add(i).write(byte) };
    }
}

#[test]
#[cfg_attr(miri, ignore = "Miri has no mincore: no page is known resident")]
fn a_huge_block_freed_beside_an_unwritten_one_of_its_size_gives_its_pages_back() {
    let mut w = Workspace::new("REBIND", WorkspaceConfiguration::adaptive()).unwrap();
    let size = HUGE_BLOCK_MIN;
    // `a = np.empty(n); a[:] = ...` each cycle: the new block is made while the old one lives,
    // and written once the rebinding has freed the old one.
    let mut a: Option<NonNull<u8>> = None;
    let mut kept = Vec::new();
    for cycle in 0..5u8 {
        w.enter().unwrap();
        let b = w.alloc(size).unwrap();
        if let Some(old) = a.take() {
            // SAFETY: live, freed once.
            unsafe { w.free(old) };
            if w.huge_cached().0 == 1 {
                kept.push(resident(old, size));
            }
        }
        touch(b, size, cycle);
        a = Some(b);
        w.exit().unwrap();
    }
    assert!(kept.len() >= 3, "the mappings freed are kept for the next cycle: {kept:?}");
    assert!(kept.iter().all(|&r| r < size / 64), "kept without their pages: {kept:?}");
    // SAFETY: live, freed once.
    unsafe { w.free(a.unwrap()) };
    // Temporaries in a chain (`u = t + 1`, `t` freed, `v = np.tanh(u)`): the block freed beside a
    // written one keeps its pages, and the next request of its size takes them.
    for _ in 0..3 {
        w.enter().unwrap();
        let t = w.alloc(size).unwrap();
        touch(t, size, 1);
        let u = w.alloc(size).unwrap();
        touch(u, size, 2);
        // SAFETY: live, freed once.
        unsafe { w.free(t) };
        let pages = resident(t, size);
        let v = w.alloc(size).unwrap();
        if w.stats().cycles >= 2 {
            assert!(pages > size / 2, "kept with its pages: {pages}");
            assert_eq!(v, t, "and taken again");
        }
        // SAFETY: live, freed once each.
        unsafe {
            w.free(u);
            w.free(v);
        }
        w.exit().unwrap();
    }
}

#[test]
#[cfg_attr(miri, ignore = "256 MiB of blocks: too slow under the interpreter")]
fn cached_huge_mappings_too_small_to_be_huge_any_more_are_released() {
    let mut w = Workspace::new("OUTGROWN", WorkspaceConfiguration::adaptive()).unwrap();
    let size = HUGE_BLOCK_MIN;
    for _ in 0..2 {
        w.enter().unwrap();
        let p = w.alloc(size).unwrap();
        // SAFETY: live, freed once.
        unsafe { w.free(p) };
        w.exit().unwrap();
    }
    assert_eq!(w.huge_cached().0, 1, "kept while its size recurs");
    // A cycle that also needs three times as much beside it: requests of its size go to the
    // arena from the next cycle on, and the mapping would never serve again.
    w.enter().unwrap();
    let p = w.alloc(size).unwrap();
    // SAFETY: live, freed once.
    unsafe { w.free(p) };
    let more: Vec<_> = (0..48).map(|_| w.alloc(4 * MIB).unwrap()).collect();
    for q in more {
        // SAFETY: live, freed once.
        unsafe { w.free(q) };
    }
    w.exit().unwrap();
    assert_eq!(w.huge_cached(), (0, 0), "released once the need outgrew it");
}

#[test]
fn a_huge_request_that_fits_max_size_only_unrounded_is_served_and_served_again() {
    let size = 70 * MIB;
    let c = WorkspaceConfiguration { max_size: (71 * MIB) as u64, ..WorkspaceConfiguration::adaptive() };
    let rec = Recorder::new(Arc::new(AnonymousMemory));
    let backend: Arc<dyn Backend> = rec.clone();
    let mut w = Workspace::with_backend("EXACT", c, backend).unwrap();
    let mut maps = Vec::new();
    for _ in 0..4 {
        w.enter().unwrap();
        // Its class is 72 MiB, past the limit: it is mapped at its own size.
        let p = w.alloc(size).expect("70 MiB under a max_size of 71 MiB");
        // SAFETY: live, freed once.
        unsafe { w.free(p) };
        w.exit().unwrap();
        maps.push(rec.maps.load(Ordering::Relaxed));
    }
    assert_eq!(maps[3], maps[1], "the mapping kept serves the same request again: {maps:?}");
    w.enter().unwrap();
    assert!(w.alloc(72 * MIB).is_err(), "and a request past the limit is refused");
    w.exit().unwrap();
}

#[test]
#[cfg_attr(miri, ignore = "Miri has no mincore: no page is known resident")]
fn a_huge_block_shrinks_where_it_lies_and_gives_its_tail_back() {
    let mut w = Workspace::new("SHRINK", WorkspaceConfiguration::adaptive()).unwrap();
    let (size, smaller) = (HUGE_BLOCK_MIN + 16 * MIB, HUGE_BLOCK_MIN - 8 * MIB);
    w.enter().unwrap();
    let p = w.alloc(size).unwrap();
    fill(p.as_ptr(), size, 5);
    assert_eq!(w.stats().external_bytes, size as u64);
    // SAFETY: live and ours.
    let q = unsafe { w.realloc(p, smaller) }.unwrap();
    assert_eq!(q, p, "shrunk where it lies, not copied");
    assert!(intact(q.as_ptr(), smaller, 5), "the bytes it keeps are intact");
    assert_eq!(w.stats().external_bytes, smaller as u64);
    // SAFETY: the block's mapping runs past the new end, up to the old one.
    let tail = unsafe { NonNull::new_unchecked(q.as_ptr().add(smaller + 4096)) };
    assert!(resident(tail, size - smaller - 8192) < MIB, "its tail went back to the system");
    // SAFETY: live, freed once.
    unsafe { w.free(q) };
    w.exit().unwrap();
    assert_eq!(w.stats().external_bytes, 0);
}

#[test]
fn huge_mappings_recur_across_nested_levels_and_not_every_other_cycle() {
    let mut w = Workspace::new("HUGE", WorkspaceConfiguration::adaptive()).unwrap();
    let huge = HUGE_BLOCK_MIN;
    // A loop of `with ws:` inside an outer one: each level left is a pass of the loop.
    w.enter().unwrap();
    let (mut cached, mut at) = (Vec::new(), Vec::new());
    for _ in 0..4 {
        w.enter().unwrap(); // nests
        let p = w.alloc(huge).unwrap();
        at.push(p);
        // SAFETY: live, freed once.
        unsafe { w.free(p) };
        cached.push(w.huge_cached().0);
        w.exit().unwrap();
    }
    w.exit().unwrap();
    assert_eq!(cached, [0, 1, 1, 1], "kept from the second pass on");
    assert!(at[2] == at[1] && at[3] == at[1], "and reused");
    // Cycles that each hold a nested level of their own (two passes a cycle) recur by cycles.
    body(&mut w, 3, 64 * KIB);
    body(&mut w, 3, 64 * KIB);
    body(&mut w, 3, 64 * KIB);
    assert_eq!(w.huge_cached(), (0, 0));
    let (mut cached, mut at) = (Vec::new(), Vec::new());
    for _ in 0..4 {
        w.enter().unwrap();
        w.enter().unwrap(); // a helper's own `with ws:`
        w.exit().unwrap();
        let p = w.alloc(huge).unwrap();
        at.push(p);
        // SAFETY: live, freed once.
        unsafe { w.free(p) };
        cached.push(w.huge_cached().0);
        w.exit().unwrap();
    }
    assert_eq!(cached, [0, 1, 1, 1], "kept from the second cycle on");
    assert!(at[2] == at[1] && at[3] == at[1], "and reused");
    for _ in 0..3 {
        body(&mut w, 3, 64 * KIB); // the cache lets go of what these cycles do not use
    }
    assert_eq!(w.huge_cached(), (0, 0));
    // A size used every other cycle would be released unused after the idle cycle: never kept.
    for cycle in 0..6 {
        w.enter().unwrap();
        if cycle % 2 == 0 {
            let p = w.alloc(huge).unwrap();
            // SAFETY: live, freed once.
            unsafe { w.free(p) };
            assert_eq!(w.huge_cached(), (0, 0), "cycle {cycle}: released as freed");
        }
        w.exit().unwrap();
    }
}

mod long_cycles {
    use super::*;
    use common::program::{Op, Program};
    use proptest::prelude::*;

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (6u32..19).prop_map(|bits| Op::Alloc((1usize << bits) + (bits as usize) * 40)),
            1 => (6u32..19).prop_map(|bits| Op::Calloc((1usize << bits) - (bits as usize) * 2)),
            5 => any::<usize>().prop_map(Op::Free),
            1 => (any::<usize>(), 6u32..19).prop_map(|(i, bits)| Op::Realloc(i, 1 << bits)),
            1 => Just(Op::CycleEnd),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: common::cases(48), ..ProptestConfig::default() })]

        /// Long adaptive cycles that churn through external memory (blocks recycled by class,
        /// walks for freed memory, grants of untouched memory, free lists and hot slots): live
        /// blocks never overlap and keep their contents, and every region's chain and lists stay
        /// consistent.
        #[test]
        fn live_blocks_keep_their_contents(ops in proptest::collection::vec(op(), miri_or(200, 40)..miri_or(1200, 120))) {
            let mut w = Workspace::new("P", WorkspaceConfiguration::adaptive()).unwrap();
            w.enter().unwrap();
            let mut program = Program::new(w);
            for (step, op) in ops.into_iter().enumerate() {
                program.apply(op, &mut |e| panic!("refused: {e}"));
                if step % 32 == 0 {
                    program.check(&format!("step {step}"));
                }
            }
            program.check("end");
            let mut w = program.finish();
            w.exit().unwrap();
            w.verify();
        }
    }
}

/// Empty first cycles (warm-ups, `with ws: pass`) learn nothing that stops the adaptive profile:
/// the cycles after them that need more than the initial arena grow it, as they would have
/// without the warm-ups, and stop spilling. (ND4J's `FIRST_LOOP`, an explicit configuration,
/// learns its size from the first cycle, empty or not.) Each cycle keeps its two results until
/// the next one has made its own.
#[test]
fn empty_first_cycles_do_not_stop_the_adaptive_arena_from_growing() {
    for (name, backend) in backends() {
        for warmups in [0, 1, 3] {
            let config = WorkspaceConfiguration { initial_size: MIB as u64, ..WorkspaceConfiguration::adaptive() };
            let mut w = Workspace::with_backend(name, config, backend.clone()).unwrap();
            for _ in 0..warmups {
                w.enter().unwrap();
                w.exit().unwrap();
            }
            let mut kept: Vec<NonNull<u8>> = Vec::new();
            let mut spills = Vec::new();
            for k in 0..12usize {
                let size = [2 * MIB, 3 * MIB, MIB + 300 * KIB, 2 * MIB + 100 * KIB][k % 4];
                w.enter().unwrap();
                let made = [w.alloc(size).unwrap(), w.alloc(size).unwrap()];
                for p in kept.drain(..) {
                    // SAFETY: live blocks of this workspace, freed once.
                    unsafe { w.free(p) };
                }
                kept.extend(made);
                let before = w.stats().spill_count;
                w.exit().unwrap();
                spills.push(before);
            }
            let s = w.stats();
            assert!(s.capacity_bytes >= 6 * MIB as u64, "{name}, {warmups} warm-ups: arena {s:?}");
            assert_eq!(spills[11], spills[4], "{name}, {warmups} warm-ups: still spilling after learning: {spills:?}");
            for p in kept {
                // SAFETY: live blocks of this workspace, freed once.
                unsafe { w.free(p) };
            }
        }
    }
}

#[test]
fn the_block_allocators_free_memory_goes_back_before_a_workspaces_first_large_block() {
    // Free memory the program's setup left in the C heap would be reused by NumPy's allocator;
    // a block of its own, larger than NumPy's request, is mapped beside it: it goes back first,
    // once, and not for small blocks, which the C heap serves from that memory anyway.
    for (name, b) in backends() {
        let r = Recorder::new(b.clone());
        let mut w = Workspace::with_backend("T", WorkspaceConfiguration::adaptive(), r.clone()).unwrap();
        let trims = || r.trims.load(Ordering::Relaxed);
        w.enter().unwrap();
        let small: Vec<_> = (0..8).map(|_| w.alloc(64 * KIB).unwrap()).collect();
        assert_eq!(trims(), 0, "{name}: small blocks");
        let large = w.alloc(2 * MIB).unwrap();
        assert_eq!(trims(), 1, "{name}: the first large block");
        let more = w.alloc(4 * MIB).unwrap();
        assert_eq!(trims(), 1, "{name}: once");
        for p in small.into_iter().chain([large, more]) {
            // SAFETY: live, freed once.
            unsafe { w.free(p) };
        }
        w.exit().unwrap();
        let after_first = trims();
        for _ in 0..3 {
            body(&mut w, 3, 2 * MIB);
        }
        assert_eq!(trims(), after_first, "{name}: cycles served by the arena return nothing");
        w.verify();
    }
}

#[test]
fn an_arena_that_follows_changing_needs_resizes_where_it_is() {
    // Needs that fall after larger cycles and rise again within what the arena mapped: where the
    // backend's memory costs nothing until touched and its discarded pages read back as zeros,
    // the region shrinks and grows back within its mapping, with no new mapping; elsewhere a new
    // region replaces it each time.
    for (name, b) in backends() {
        let r = Recorder::new(b.clone());
        let mut w = Workspace::with_backend("T", WorkspaceConfiguration::adaptive(), r.clone()).unwrap();
        let maps = || r.maps.load(Ordering::Relaxed);
        for _ in 0..3 {
            body(&mut w, 3, MIB);
        }
        let (big, mapped) = (w.stats().capacity_bytes, maps());
        for _ in 0..12 {
            body(&mut w, 3, 384 * KIB);
        }
        let small = w.stats().capacity_bytes;
        assert!(small > 0 && small < big / 2, "{name}: the arena shrank ({big} -> {small} bytes)");
        let in_place = b.discard_zeroes() && b.faults_lazily();
        assert_eq!(maps() == mapped, in_place, "{name}: {} regions mapped for the shrink", maps() - mapped);
        let mut spills = Vec::new();
        for _ in 0..4 {
            let before = w.stats().spill_count;
            body(&mut w, 3, 640 * KIB);
            spills.push(w.stats().spill_count - before);
        }
        let grown = w.stats().capacity_bytes;
        assert!(grown > small && grown <= big, "{name}: it grew back to {grown} bytes");
        assert!(spills[1..].iter().all(|&s| s == 0), "{name}: spills per cycle {spills:?}");
        assert_eq!(maps() == mapped, in_place, "{name}: {} regions mapped for the growth", maps() - mapped);
        w.verify();
    }
}

#[test]
fn results_of_ever_new_sizes_replace_the_region_a_few_times_not_every_cycle() {
    // Each cycle keeps a result of a size no cycle kept before, beside the same temporaries:
    // most cycle ends put a new class apart (40 sizes, 25 classes). The region is replaced for
    // them at once the first few times, then after waits that double, so that a loop whose kept
    // sizes keep changing maps a few regions, not one per cycle (each pre-faulted anew). What is
    // apart stays apart.
    for (name, b) in backends() {
        let r = Recorder::new(b.clone());
        let mut w = Workspace::with_backend("T", WorkspaceConfiguration::adaptive(), r.clone()).unwrap();
        // Fewer under Miri, where each region mapped is pre-faulted byte by byte (minutes).
        let cycles = miri_or(40, 14);
        let mut kept = Vec::new();
        for k in 0..cycles {
            w.enter().unwrap();
            let size = 1100 + 700 * k; // all under 32 KiB
            let keep = w.alloc(size).unwrap();
            fill(keep.as_ptr(), size, k as u8);
            kept.push((keep, size, k as u8));
            for _ in 0..3 {
                let t = w.alloc(200 * KIB).unwrap();
                fill(t.as_ptr(), miri_or(4096, 256), 1);
                // SAFETY: live, freed once.
                unsafe { w.free(t) };
            }
            w.exit().unwrap();
        }
        let maps = r.maps.load(Ordering::Relaxed);
        // Memory taken whole when mapped (a file's reserved space, a device's), or whose discarded
        // pages keep their bytes (anonymous memory under Miri), has its regions replaced by
        // smaller ones as the need falls, as kept blocks let it.
        let most = if b.faults_lazily() && b.discard_zeroes() { 8 } else { 24 };
        assert!(maps <= most, "{name}: {maps} regions mapped in {cycles} cycles");
        assert!(w.kept_apart().len() >= miri_or(10, 4), "{name}: {} classes apart", w.kept_apart().len());
        for (p, size, v) in kept {
            assert!(intact(p.as_ptr(), size, v), "{name}: a kept result changed");
            // SAFETY: live, freed once.
            unsafe { w.free(p) };
        }
        w.verify();
    }
}
