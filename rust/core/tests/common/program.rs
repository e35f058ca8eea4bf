//! One model of an allocator program, shared by the property tests: the operations a workspace
//! sees (allocations, zeroed ones, frees, frees from another thread, reallocations across
//! classes, cycle ends with and without escapes, nested levels, overlapping cycles, destroy),
//! applied to a workspace and mirrored in a list of live blocks whose contents are known. After
//! every step [`Program::check`] proves that live blocks do not overlap, stay aligned and inside
//! their region, keep their contents, read zero where they were handed out zeroed, that the
//! statistics match what the model computes, and that the footprint is within `max_size`.

#![allow(dead_code)]

use std::ptr::NonNull;

use proptest::prelude::*;
use rustws_core::*;

use super::{fill, intact};

/// Bytes of each block the model fills and checks.
const CHECKED: usize = 512;

/// Under Miri, which runs each step thousands of times slower, programs are shorter and blocks
/// and arenas smaller; the paths they take are the same.
pub const MIRI: bool = cfg!(miri);
/// The largest request of a program.
pub const LARGE: usize = if MIRI { 20_000 } else { 200_000 };
/// The longest program.
pub const LONG: usize = if MIRI { 40 } else { 300 };

#[derive(Debug, Clone)]
pub enum Op {
    Alloc(usize),
    /// An allocation that must read zero.
    Calloc(usize),
    Free(usize),
    /// A free made on another thread (the workspace behind a lock, as the bindings share it).
    FreeElsewhere(usize),
    Realloc(usize, usize),
    /// Ends the cycle and opens the next one; live blocks escape.
    CycleEnd,
    /// Frees every block of the open cycle, then ends it: a cycle with nothing escaping.
    CleanCycleEnd,
    /// Opens a nested level, allocates in it and closes it again.
    Nested(usize),
    /// Opens a second cycle beside the open one (another task's), allocates, closes it.
    Beside(usize),
    Destroy,
}

/// Request sizes across every kind of class: small, page-sized, large, zero.
pub fn size() -> impl Strategy<Value = usize> + Clone {
    prop_oneof![1usize..200, 200usize..5000, 5000usize..LARGE, Just(0usize)]
}

/// Operations, weighted as loop bodies make them; `destroy` is rare.
pub fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => size().prop_map(Op::Alloc),
        1 => size().prop_map(Op::Calloc),
        4 => any::<usize>().prop_map(Op::Free),
        1 => any::<usize>().prop_map(Op::FreeElsewhere),
        1 => (any::<usize>(), size()).prop_map(|(i, s)| Op::Realloc(i, s)),
        2 => Just(Op::CycleEnd),
        1 => Just(Op::CleanCycleEnd),
        1 => size().prop_map(Op::Nested),
        1 => size().prop_map(Op::Beside),
        0 => Just(Op::Destroy),
    ]
}

/// A live block as the model knows it.
pub struct Live {
    pub p: NonNull<u8>,
    pub size: usize,
    pub seed: u8,
    /// The workspace's pinning epoch when it was handed out (the open cycles then).
    pub cycle: u64,
}

/// What an allocation the workspace refused means to the test running the program.
pub type OnRefusal<'a> = &'a mut dyn FnMut(&Error);

/// A workspace driven by a program, and the model of its live blocks.
pub struct Program {
    pub w: Workspace,
    pub live: Vec<Live>,
    seed: u8,
    /// Whether statistics are checked exactly (not under failure injection, where a failed
    /// growth may leave them as they were).
    pub exact: bool,
}

/// Sends a pointer to a thread that frees it (the model keeps it out of its lists before).
struct Sendable(NonNull<u8>);
// SAFETY: the pointer is only handed to the workspace's `free`, under the lock the test holds.
unsafe impl Send for Sendable {}

impl Program {
    pub fn new(w: Workspace) -> Self {
        Program { w, live: Vec::new(), seed: 0, exact: true }
    }

    fn allocate(&mut self, size: usize, zeroed: bool, refused: OnRefusal<'_>) {
        let r = if zeroed { self.w.alloc_zeroed(size) } else { self.w.alloc(size) };
        match r {
            Ok(p) => {
                if zeroed {
                    // SAFETY: a live block of `size` bytes.
                    let zero = (0..size.min(CHECKED)).all(|i| unsafe { *p.as_ptr().add(i) } == 0);
                    assert!(zero, "a zeroed block of {size} bytes was not zero");
                }
                self.seed = self.seed.wrapping_add(1);
                fill(p.as_ptr(), size.min(CHECKED), self.seed);
                self.live.push(Live { p, size, seed: self.seed, cycle: self.w.epoch() });
            }
            Err(e) => refused(&e),
        }
    }

    /// Applies `op`; refusals go to `refused` (which may assert what they must say).
    pub fn apply(&mut self, op: Op, refused: OnRefusal<'_>) {
        match op {
            Op::Alloc(size) => self.allocate(size, false, refused),
            Op::Calloc(size) => self.allocate(size, true, refused),
            Op::Free(i) if !self.live.is_empty() => {
                let b = self.live.swap_remove(i % self.live.len());
                // SAFETY: `b` is live and removed from the model before its free.
                unsafe { self.w.free(b.p) };
            }
            Op::FreeElsewhere(i) if !self.live.is_empty() => {
                let b = Sendable(self.live.swap_remove(i % self.live.len()).p);
                let w = std::sync::Mutex::new(&mut self.w);
                std::thread::scope(|s| {
                    s.spawn(|| {
                        let b = b;
                        // SAFETY: live, removed from the model, freed once, under the lock.
                        unsafe { w.lock().unwrap().free(b.0) };
                    });
                });
            }
            Op::Realloc(i, size) if !self.live.is_empty() => {
                let k = i % self.live.len();
                // SAFETY: a live block; on success the old pointer is replaced in the model.
                match unsafe { self.w.realloc(self.live[k].p, size) } {
                    Ok(q) => {
                        let b = &self.live[k];
                        let keep = b.size.min(size).min(CHECKED);
                        assert!(intact(q.as_ptr(), keep, b.seed), "realloc lost contents");
                        fill(q.as_ptr(), size.min(CHECKED), b.seed);
                        let cycle = if q == b.p { b.cycle } else { self.w.epoch() };
                        self.live[k] = Live { p: q, size, seed: b.seed, cycle };
                    }
                    Err(e) => refused(&e),
                }
            }
            Op::CycleEnd if !self.w.is_destroyed() => {
                self.w.exit().expect("a cycle end never fails, even when growth does");
                // The next cycle opens through the same borrow, as the loop form's boundary does.
                if self.w.depth() == 0 {
                    self.w.reopen_cycle().unwrap();
                } else {
                    self.w.enter().unwrap();
                }
            }
            Op::CleanCycleEnd if !self.w.is_destroyed() => {
                let cycle = self.w.epoch();
                let (mine, kept): (Vec<Live>, Vec<Live>) = self.live.drain(..).partition(|b| b.cycle == cycle);
                self.live = kept;
                for b in mine {
                    // SAFETY: live, removed from the model, freed once.
                    unsafe { self.w.free(b.p) };
                }
                let r = self.w.exit().unwrap();
                assert!(r.completed && r.escaped_blocks == 0, "nothing escaped, yet {r:?}");
                self.w.enter().unwrap();
            }
            Op::Nested(size) if !self.w.is_destroyed() => {
                self.w.enter().unwrap();
                self.allocate(size, false, refused);
                let r = self.w.exit().unwrap();
                assert!(!r.completed, "a nested exit ended the cycle");
            }
            Op::Beside(size) if !self.w.is_destroyed() => {
                let cycles = self.w.generation();
                self.w.open_cycle().unwrap();
                self.allocate(size, false, refused);
                let r = self.w.close_cycle().unwrap();
                assert!(r.completed && r.escaped_blocks == 0, "a cycle beside another pins nothing");
                assert_eq!(self.w.generation(), cycles + 1, "each overlapping cycle counts");
                assert!(self.w.is_open(), "the other cycle is still open");
            }
            Op::Destroy => self.w.destroy(),
            _ => {}
        }
    }

    /// Checks the workspace against the model.
    pub fn check(&self, ctx: &str) {
        let w = &self.w;
        let mut spans: Vec<(usize, usize)> = Vec::new();
        let (mut used, mut external, mut pinned) = (0u64, 0u64, 0u64);
        for b in &self.live {
            let addr = b.p.as_ptr() as usize;
            assert_eq!(addr % BLOCK_ALIGN, 0, "{ctx}: misaligned block");
            assert!(intact(b.p.as_ptr(), b.size.min(CHECKED), b.seed), "{ctx}: block contents changed");
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
            if info.generation < w.epoch() {
                pinned += b.size as u64;
            }
        }
        spans.sort();
        for pair in spans.windows(2) {
            assert!(pair[0].1 <= pair[1].0, "{ctx}: live blocks overlap: {pair:?}");
        }
        w.verify();
        let max = w.config().max_size as usize;
        assert!(max == 0 || w.footprint() <= max, "{ctx}: footprint {} past max_size {max}", w.footprint());
        let s = w.stats();
        assert_eq!(s.used_bytes + s.cached_bytes + s.overhead_bytes, s.capacity_bytes, "{ctx}: capacity identity");
        if self.exact {
            assert_eq!(s.used_bytes, used, "{ctx}: used_bytes");
            assert_eq!(s.external_bytes, external, "{ctx}: external_bytes");
            assert_eq!(s.pinned_bytes, pinned, "{ctx}: pinned_bytes");
            assert_eq!(s.cycles, w.generation());
        }
    }

    /// Frees every live block; afterwards nothing is in use.
    pub fn finish(mut self) -> Workspace {
        for b in self.live.drain(..) {
            // SAFETY: live, freed once.
            unsafe { self.w.free(b.p) };
        }
        let s = self.w.stats();
        assert_eq!((s.used_bytes, s.external_bytes, s.pinned_bytes, s.overhead_bytes), (0, 0, 0, 0));
        self.w
    }
}
