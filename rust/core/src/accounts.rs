//! The accounts of a workspace: what is live, pinned and served, kept exact on every allocation
//! and free, and turned into the [`WorkspaceStats`] of the contract.
//!
//! The hot path updates only a few counters (requested and slot bytes of live blocks, the cycle's
//! peaks, the allocation count); everything else is derived when asked, or updated off the hot
//! path (spills, frees of pinned blocks, cycle ends).

use crate::arena::{most_filler as filler, HEADER};
use crate::backend::checked_round_to_page;
use crate::classes::{class_of, class_size, floor_class};
use crate::learner::NEED_WINDOW;

/// The statistics of the contract, all in bytes or counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkspaceStats {
    /// Completed cycles.
    pub cycles: u64,
    /// Bytes mapped for arenas (the current one and retired ones still holding live blocks).
    pub capacity_bytes: u64,
    /// Requested bytes of live blocks inside arenas.
    pub used_bytes: u64,
    /// Peak of live requested bytes (arena and external) in the open cycle, or the last one.
    pub peak_cycle_bytes: u64,
    /// Arena bytes holding no live block: reusable.
    pub cached_bytes: u64,
    /// Requested bytes of live blocks outside the arena.
    pub external_bytes: u64,
    /// Requested bytes of live blocks that outlived the cycle that allocated them.
    pub pinned_bytes: u64,
    /// Arena bytes of headers and alignment padding of live blocks.
    pub overhead_bytes: u64,
    /// Allocations served, all kinds.
    pub allocation_count: u64,
    /// Allocations served outside an initialised arena.
    pub spill_count: u64,
    /// Requests refused.
    pub failed_allocations: u64,
}

impl WorkspaceStats {
    /// The fields' names, in the order of [`WorkspaceStats::values`]: the one definition of the
    /// statistics, which the bindings, the Python dataclass and its stub follow.
    pub const FIELDS: [&'static str; 11] = [
        "cycles",
        "capacity_bytes",
        "used_bytes",
        "peak_cycle_bytes",
        "cached_bytes",
        "external_bytes",
        "pinned_bytes",
        "overhead_bytes",
        "allocation_count",
        "spill_count",
        "failed_allocations",
    ];

    /// The values, in the order of [`WorkspaceStats::FIELDS`].
    pub fn values(&self) -> [u64; 11] {
        let WorkspaceStats {
            cycles,
            capacity_bytes,
            used_bytes,
            peak_cycle_bytes,
            cached_bytes,
            external_bytes,
            pinned_bytes,
            overhead_bytes,
            allocation_count,
            spill_count,
            failed_allocations,
        } = *self;
        [
            cycles,
            capacity_bytes,
            used_bytes,
            peak_cycle_bytes,
            cached_bytes,
            external_bytes,
            pinned_bytes,
            overhead_bytes,
            allocation_count,
            spill_count,
            failed_allocations,
        ]
    }
}

/// What one cycle did, as its close reports it: what escaped it, what it spilled, and what
/// happened to the arena. The bindings log and report from this, never from differences of
/// statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CycleReport {
    /// Whether this exit closed a cycle (not a nested level).
    pub completed: bool,
    /// The cycle's number (0 for the first).
    pub cycle: u64,
    /// Blocks allocated in this cycle that are still live (they are now pinned); counted when
    /// the last open cycle closes.
    pub escaped_blocks: u64,
    /// Their requested bytes.
    pub escaped_bytes: u64,
    /// Requests served in the cycle, and how many of them spilled outside an initialised arena.
    pub allocations: u64,
    pub spills: u64,
    /// Peak of live requested bytes in the cycle.
    pub peak_bytes: u64,
    /// Arena capacity (all regions) when the cycle opened, and after its close sized the arena:
    /// they differ where the close mapped, grew, shrank or released a region.
    pub arena_before: u64,
    pub arena_after: u64,
    /// Requested bytes pinned under blocks that outlived their cycles, after the close.
    pub pinned_bytes: u64,
}

impl CycleReport {
    /// Whether the close remapped the arena (mapped, grew, shrank or released it).
    pub fn remapped(&self) -> bool {
        self.arena_before != self.arena_after
    }
}

/// A slot of `slot` bytes with the most filler it may take in an arena.
fn with_filler(slot: usize) -> usize {
    slot + filler(slot)
}

/// Bytes a request of `size` takes where a workspace places it: its class's slot (the class
/// rounding and a header) and, for the classes whose data starts on a page, the most filler that
/// asks for; past the classes, a mapping of whole pages with a header.
pub fn placed_size(size: usize) -> usize {
    match class_of(size.max(1)) {
        Some(c) => with_filler(class_size(c) + HEADER),
        None => checked_round_to_page(size.saturating_add(HEADER)).unwrap_or(usize::MAX),
    }
}

/// The largest request that a free run of `run` bytes serves wherever it lies: the largest
/// class size that [`placed_size`] gives at most `run` (0 where none fits).
pub(crate) fn largest_served(run: usize) -> usize {
    let mut c = floor_class(run.saturating_sub(HEADER));
    while let Some(k) = c {
        if placed_size(class_size(k)) <= run {
            return class_size(k);
        }
        c = k.checked_sub(1);
    }
    0
}

/// The most closes by which blocks are told apart by age where cycles overlap.
const AGE_BUCKETS: usize = 64;

/// The slot bytes of the live blocks handed out since cycles began to overlap, by age.
#[derive(Debug, Clone)]
struct Ages {
    /// Those stamped from `aged_through` on, by stamp modulo [`AGE_BUCKETS`] (the open interval's
    /// entry is filled at the next close, from what the open cycles hold and no other counts).
    by_close: [usize; AGE_BUCKETS],
    /// Those stamped before `aged_through`: they have lived through the window ([`Ages::window`]).
    aged: usize,
    aged_through: u64,
    /// The most cycles open at once since they began to overlap.
    most_open: u32,
}

impl Default for Ages {
    fn default() -> Self {
        Ages { by_close: [0; AGE_BUCKETS], aged: 0, aged_through: 0, most_open: 0 }
    }
}

impl Ages {
    /// The closes a block lives through before it counts as kept on: a temporary of one of `n`
    /// cycles taking turns lives through the other ones' closes (`n - 1`); twice that, at least
    /// [`NEED_WINDOW`], at most what the buckets hold.
    fn window(&self) -> u64 {
        (2 * self.most_open as u64).clamp(NEED_WINDOW as u64, AGE_BUCKETS as u64)
    }
}

/// Live, pinned and served memory. Slot bytes count what blocks occupy (header and class
/// rounding included); requested bytes what callers asked for.
#[derive(Debug, Default, Clone)]
pub(crate) struct Accounts {
    /// Slot bytes of live blocks, arena and external.
    pub live_slot: usize,
    /// Requested bytes of live arena blocks.
    pub used: u64,
    /// Requested and slot bytes, and the number, of live external blocks (huge ones included).
    pub external: u64,
    pub external_slot: usize,
    pub external_blocks: usize,
    /// Live blocks from earlier cycles: blocks, requested bytes, slot bytes.
    pub pinned_blocks: usize,
    pub pinned: u64,
    pub pinned_slot: usize,
    /// Peak of the slot bytes the open cycle itself has live (`live_slot - pinned_slot`).
    pub own_peak: usize,
    /// Slot bytes of blocks of earlier cycles freed in the open cycle: state a loop replaces
    /// every cycle (`w = w - lr * g`), live beside the cycle's own blocks until replaced.
    pub unpinned_slot: usize,
    /// What the open cycle's own accounts held as it opened (`own_live`): nothing where it opened
    /// with none open (the close before pinned all), and where cycles overlap, the blocks that
    /// the cycles still open had live when the last of them closed.
    pub open_live: usize,
    /// Whether cycles overlapped since the last close with none left open: one opened while
    /// another was. Then nothing is pinned until all close, and what the open cycles hold tells
    /// results kept on from temporaries in flight only by how long it has lived ([`Ages`]).
    overlap: bool,
    ages: Ages,
    /// The most filler the live blocks may need in front of them in the arena (those of the
    /// page-aligned and the coloured classes), and what of it the pinned ones may: the cycle's
    /// need includes it.
    pub filler_live: usize,
    pub filler_pinned: usize,
    /// Peak of live requested bytes in the open cycle, and in the last one.
    pub cycle_peak: u64,
    pub last_cycle_peak: u64,
    pub allocations: u64,
    pub spills: u64,
    pub failures: u64,
    /// Frees of pointers that were no live block of the workspace (double frees, another
    /// allocator's pointers): ignored, and counted.
    pub bad_frees: u64,
    /// Bytes pre-faulted synchronously, in total.
    pub prefaulted: u64,
}

impl Accounts {
    /// A block of the open cycle was handed out.
    #[inline(always)]
    pub fn count_live(&mut self, slot: usize) {
        self.allocations += 1;
        self.live_slot += slot;
        self.filler_live += filler(slot);
        self.own_peak = self.own_peak.max(self.own_live());
        self.cycle_peak = self.cycle_peak.max(self.used + self.external);
    }

    /// What the open cycle's own live blocks take in an arena, fillers included.
    #[inline(always)]
    pub(crate) fn own_live(&self) -> usize {
        self.live_slot - self.pinned_slot + (self.filler_live - self.filler_pinned)
    }

    /// What all live blocks take in an arena, fillers included (as [`placed_size`] counts a request).
    pub fn held(&self) -> usize {
        self.live_slot + self.filler_live
    }

    /// A live block of `slot` bytes is gone.
    #[inline(always)]
    fn uncount_live(&mut self, slot: usize) {
        self.live_slot -= slot;
        self.filler_live -= filler(slot);
    }

    /// An arena block of `size` requested bytes in a slot of `slot` bytes was handed out.
    #[inline(always)]
    pub fn count_arena(&mut self, size: usize, slot: usize) {
        self.used += size as u64;
        self.count_live(slot);
    }

    /// An arena block of the open cycle was freed.
    #[inline(always)]
    pub fn uncount_arena(&mut self, size: usize, slot: usize) {
        self.used -= size as u64;
        self.uncount_live(slot);
    }

    /// An external block (huge ones included) was handed out.
    pub fn count_external(&mut self, size: usize, slot: usize) {
        self.external += size as u64;
        self.external_slot += slot;
        self.external_blocks += 1;
        self.count_live(slot);
    }

    pub fn uncount_external(&mut self, size: usize, slot: usize) {
        self.external -= size as u64;
        self.external_slot -= slot;
        self.external_blocks -= 1;
        self.uncount_live(slot);
    }

    /// A huge block (a mapping of its own, outside the slot accounts: it never sizes the arena)
    /// was handed out.
    pub fn count_huge(&mut self, size: usize) {
        self.external += size as u64;
        self.external_blocks += 1;
        self.allocations += 1;
        self.cycle_peak = self.cycle_peak.max(self.used + self.external);
    }

    pub fn uncount_huge(&mut self, size: usize) {
        self.external -= size as u64;
        self.external_blocks -= 1;
    }

    /// A block of an earlier cycle was freed.
    #[cold]
    pub fn unpin(&mut self, size: usize, slot: usize) {
        self.pinned_blocks -= 1;
        self.pinned -= size as u64;
        self.pinned_slot -= slot;
        self.unpinned_slot += slot + filler(slot);
        self.filler_pinned -= filler(slot);
    }

    /// What the open cycle needs: its own peak, and the state of earlier cycles it replaced.
    /// Blocks kept on (results a loop collects) never count: where cycles overlap and none
    /// pins, what was live as the cycle opened and still is comes off (at most the lesser of
    /// the two), or results kept by overlapping cycles would add up to a need for all of them.
    pub fn cycle_need(&self) -> usize {
        let kept = self.kept_on().min(self.own_live());
        self.own_peak.saturating_sub(kept).saturating_add(self.unpinned_slot)
    }

    /// Of what the open cycle's accounts held as it opened, what is kept on: where cycles
    /// overlap, what has lived through the last closes ([`Ages::window`]; the other cycles'
    /// temporaries in flight, live at every close but each time others, are need: the arena holds
    /// them at once).
    fn kept_on(&self) -> usize {
        if self.overlap {
            self.ages.aged.min(self.open_live)
        } else {
            self.open_live
        }
    }

    /// A cycle opens beside others after `closes` cycles closed, `open` cycles open with it: from
    /// here until all close, live blocks are told apart by age ([`BlockHeader::stamp`]: the
    /// closes before they were handed out). What the open cycles held as they began to overlap
    /// was handed out since the last close.
    ///
    /// [`BlockHeader::stamp`]: crate::arena::BlockHeader::stamp
    #[cold]
    pub fn open_beside(&mut self, open: u32, closes: u64) {
        if !self.overlap {
            self.overlap = true;
            self.ages.by_close = [0; AGE_BUCKETS];
            self.ages.aged = 0;
            self.ages.aged_through = closes;
            self.ages.most_open = 0;
        }
        self.ages.most_open = self.ages.most_open.max(open);
    }

    /// Whether cycles overlapped since the last close with none left open.
    pub fn overlapping(&self) -> bool {
        self.overlap
    }

    /// A live block of `slot` bytes stamped `stamp`, not pinned, is gone after `closes` closes.
    #[inline(always)]
    pub fn forget_stamped(&mut self, slot: usize, stamp: u64, closes: u64) {
        if self.overlap {
            self.forget_aged(slot, stamp, closes);
        }
    }

    #[cold]
    fn forget_aged(&mut self, slot: usize, stamp: u64, closes: u64) {
        // As `own_live` counts it: with the filler a page-aligned block may need.
        let slot = with_filler(slot);
        let a = &mut self.ages;
        if stamp < a.aged_through {
            a.aged = a.aged.saturating_sub(slot);
        } else if stamp < closes {
            let b = &mut a.by_close[(stamp % AGE_BUCKETS as u64) as usize];
            *b = b.saturating_sub(slot);
        }
        // Stamped since the last close: the open interval's entry is not filled yet.
    }

    /// The cycle `closes - 1` closed; `all` when none is open any more (everything live is
    /// pinned now). Where cycles overlap, the interval that ends gets its entry, and the entries
    /// of blocks that have lived through the window age.
    pub fn count_close(&mut self, closes: u64, all: bool) {
        if all {
            self.overlap = false;
        } else if self.overlap {
            let own = self.own_live();
            let a = &mut self.ages;
            let earlier = a.by_close.iter().sum::<usize>().saturating_add(a.aged);
            // Its entry held blocks stamped `AGE_BUCKETS` closes earlier, aged since (the window
            // is at most that long): it is empty.
            a.by_close[((closes - 1) % AGE_BUCKETS as u64) as usize] = own.saturating_sub(earlier);
            while a.aged_through.saturating_add(a.window()) <= closes {
                let b = std::mem::take(&mut a.by_close[(a.aged_through % AGE_BUCKETS as u64) as usize]);
                a.aged = a.aged.saturating_add(b);
                a.aged_through += 1;
            }
        }
    }

    /// A cycle opens.
    pub fn open_cycle(&mut self) {
        self.cycle_peak = self.used + self.external;
        self.own_peak = self.own_live();
        self.open_live = self.own_peak;
        self.unpinned_slot = 0;
    }

    /// The outermost cycle ends with `live_blocks` blocks live: they are all pinned now.
    /// Returns what escaped this cycle: blocks and requested bytes.
    pub fn close_cycle(&mut self, live_blocks: usize) -> (u64, u64) {
        let escaped = ((live_blocks - self.pinned_blocks) as u64, self.used + self.external - self.pinned);
        self.pinned_blocks = live_blocks;
        self.pinned = self.used + self.external;
        self.pinned_slot = self.live_slot;
        self.filler_pinned = self.filler_live;
        self.last_cycle_peak = self.cycle_peak;
        escaped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arena::LARGE_DATA_ALIGN;
    use crate::classes::PAGE_ALIGNED_SIZE;

    /// A block of the smallest page-aligned class, and the most filler in front of it.
    const LARGE_SLOT: usize = PAGE_ALIGNED_SIZE + HEADER;
    const MOST_PAD: usize = LARGE_DATA_ALIGN - HEADER;

    /// `FIELDS` names the struct's fields in declaration order: checked against the derived
    /// `Debug`, which prints them so.
    #[test]
    fn stats_fields_are_the_struct_fields_in_order() {
        let s = WorkspaceStats { cycles: 1, spill_count: 7, failed_allocations: 9, ..Default::default() };
        let debug = format!("{s:?}");
        let names: Vec<&str> = debug
            .trim_start_matches("WorkspaceStats { ")
            .trim_end_matches(" }")
            .split(", ")
            .map(|kv| kv.split(':').next().unwrap())
            .collect();
        assert_eq!(names, WorkspaceStats::FIELDS);
        let v = s.values();
        assert_eq!((v[0], v[9], v[10]), (1, 7, 9));
    }

    /// A cycle's need counts its own peak and the earlier state it replaced, never what it keeps.
    #[test]
    fn a_cycle_needs_its_peak_and_what_it_replaced() {
        let mut a = Accounts::default();
        a.open_cycle();
        a.count_arena(100, 192);
        a.count_arena(100, 192);
        a.uncount_arena(100, 192);
        assert_eq!(a.cycle_need(), 384);
        assert_eq!(a.close_cycle(1), (1, 100));
        assert_eq!((a.pinned_blocks, a.pinned, a.pinned_slot), (1, 100, 192));
        // Next cycle: the kept block is replaced (freed, pinned), and a new one made.
        a.open_cycle();
        assert_eq!(a.cycle_need(), 0, "a kept block is not this cycle's need");
        a.unpin(100, 192);
        a.uncount_arena(100, 192);
        a.count_arena(100, 192);
        assert_eq!(a.cycle_need(), 192 + 192, "the replaced state and the new block");
        assert_eq!(a.close_cycle(1), (1, 100));
    }

    /// Blocks of the page-aligned classes count the filler an arena may put in front of them.
    #[test]
    fn large_blocks_count_their_filler() {
        let mut a = Accounts::default();
        a.open_cycle();
        a.count_arena(PAGE_ALIGNED_SIZE, LARGE_SLOT);
        assert_eq!(a.cycle_need(), LARGE_SLOT + MOST_PAD);
        a.count_external(10, 128);
        assert_eq!((a.external, a.external_slot, a.external_blocks), (10, 128, 1));
        a.count_huge(1 << 30);
        assert_eq!(a.cycle_peak, (PAGE_ALIGNED_SIZE + 10 + (1 << 30)) as u64);
        a.uncount_huge(1 << 30);
        a.uncount_external(10, 128);
        assert_eq!((a.external, a.external_blocks), (0, 0));
    }
}
