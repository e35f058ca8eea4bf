//! Blocks of their own: what a workspace serves outside its arena (learning cycles, spills,
//! `helper_min_size`, the bypass modes), each a block from the backend's block allocator with a
//! header, and the cache that recycles them by size class.
//!
//! Every block of its own, live or cached, huge mappings included, is listed in one table by the
//! address of its data. The table is the one truth of whether an address outside the arena is
//! the workspace's: a free looks there before it reads a header, so a pointer that is no block of
//! ours (a double free after the block went back, another allocator's) is never read.
//!
//! A freed external block goes on the LIFO list of its class, as a caching allocator keeps them,
//! instead of going back to the C heap (and, for large blocks, to the system) between uses: the
//! next request of its class takes it, warm, with no system call and no page fault. What the
//! cache may hold is bounded by the recent cycles' external footprint ([`ExternalPeaks`]);
//! classes unused for a few cycles go back to the system.
//!
//! Where the CPU can touch the memory a header sits in front of its block; otherwise (device
//! memory) the block starts at its data, keeping the driver's alignment, and its header lives on
//! the host, owned by the table.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::arena::{BlockHeader, BlockKind, HEADER, MAGIC_FREE};
use crate::backend::Backend;
use crate::classes::{floor_class, ClassSet, CLASSES};
use crate::error::BackendError;
use crate::fallible::try_box;
use crate::learner::NEED_WINDOW;
use crate::sanitizer::{poison, unpoison};

/// A class unused for this many cycles gives its cached blocks back.
const CACHE_CYCLES: u64 = 2;

/// Bytes from which a block superseded by the arena gives its pages back to the system as it is
/// released ([`OwnBlocks::release_superseded`]): sixteen pages, where one system call costs less
/// than the memory it returns is worth.
const GIVE_BACK_FROM: usize = 64 << 10;

/// Hashes block addresses (multiples of 64) by multiplication: cheap, and spreads consecutive
/// blocks over the table.
#[derive(Default, Clone, Copy)]
pub(crate) struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn write_usize(&mut self, n: usize) {
        let h = ((n as u64) >> 6).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = h ^ (h >> 29);
    }
}

/// Blocks of their own by the address of their data.
type Table = HashMap<usize, NonNull<BlockHeader>, BuildHasherDefault<AddressHasher>>;

/// The blocks of their own of one workspace.
#[derive(Debug)]
pub(crate) struct OwnBlocks {
    /// Where external blocks come from (through the workspace's limit).
    backend: Arc<dyn Backend>,
    /// Where bypass blocks come from: outside the workspace's accounts and limit.
    upstream: Arc<dyn Backend>,
    /// Whether headers sit in front of their blocks (the CPU can touch the backend's memory).
    inline: bool,
    /// The token of the workspace the blocks belong to.
    owner: u64,
    table: Table,
    /// Kilobytes of lists: boxed, so that a workspace is small where it is shared.
    cache: Box<BlockCache>,
    pub peaks: ExternalPeaks,
}

/// Freed external blocks by class: LIFO lists linked through their headers' `links[1]`.
#[derive(Debug)]
struct BlockCache {
    /// The first cached block of each class (its data; null: none).
    heads: [*mut u8; CLASSES],
    nonempty: ClassSet,
    /// The generation each class was last used in.
    used: [u64; CLASSES],
    /// Classes whose cached blocks served a request lately (since new blocks of a quarter of the
    /// recent peak were made; cycle ends keep them, so that the next cycle finds its blocks before
    /// it reuses them): they recur.
    recurring: ClassSet,
    /// Bytes of new blocks made since `recurring` was last forgotten.
    made: usize,
    /// Slot bytes of the cached blocks.
    bytes: usize,
}

/// The most bytes of blocks of classes that did not recur the external cache keeps inside a cycle
/// when a new block is made (and what it may always keep between cycles): cached blocks of
/// classes a cycle of changing sizes no longer asks for go back rather than add to what it
/// holds, while those it asks for again stay within the recent peak.
pub(crate) const SLACK: usize = 4 << 20;

/// The least of that slack: a process whose arrays outside the arena come to a few megabytes
/// keeps a quarter of them, and no less than this, so that the slack stays small beside what it
/// holds.
pub(crate) const MIN_SLACK: usize = 1 << 20;

/// What recent cycles had live outside the arena. Between cycles the external cache holds at most
/// that, together with what lives, so that the next cycle finds its blocks again; inside a cycle,
/// before a new block is made, it keeps only a slack ([`ExternalPeaks::slack`]) beside what
/// lives, so that a cycle of changing sizes never holds much more than it uses.
#[derive(Debug, Default, Clone)]
pub(crate) struct ExternalPeaks {
    /// Peak slot bytes of live external blocks in the open cycle.
    pub open: usize,
    /// The peaks of the recent cycles, by generation modulo the window.
    window: [usize; NEED_WINDOW],
    /// Bytes of external blocks made fresh in the open cycle (for returning the block
    /// allocator's cache once an arena takes over).
    pub made: usize,
    /// Slot bytes outside the arena when the open cycle began, and how many of them (blocks of
    /// earlier cycles) it has freed since: the rest of what lives outside is the cycle's own.
    at_open: usize,
    freed_earlier: usize,
    /// The least slot bytes of the cycle's own blocks outside the arena so far, and the most they
    /// rose above such a low: what the cycle had outside at once, however often a temporary went
    /// out and came back.
    low: usize,
    pub rise: usize,
}

impl ExternalPeaks {
    /// A cycle opens with `live` slot bytes outside the arena.
    pub fn open_cycle(&mut self, live: usize) {
        self.open = live;
        self.at_open = live;
        self.freed_earlier = 0;
        self.low = 0;
        self.rise = 0;
    }

    /// A block of an earlier cycle outside the arena, of `slot` bytes, was freed.
    pub fn free_earlier(&mut self, slot: usize) {
        self.freed_earlier = self.freed_earlier.saturating_add(slot);
    }

    /// Of `live` slot bytes outside the arena, those of the open cycle's own blocks.
    fn own(&self, live: usize) -> usize {
        live.saturating_add(self.freed_earlier).saturating_sub(self.at_open)
    }

    /// A block went outside the arena: `before` slot bytes lived there just before it, `live`
    /// now (only frees came since the last note, so `before` is the least since then).
    #[inline]
    pub fn note(&mut self, before: usize, live: usize) {
        self.open = self.open.max(live);
        self.low = self.low.min(self.own(before));
        self.rise = self.rise.max(self.own(live) - self.low);
    }

    /// The open cycle, `generation`, ends.
    pub fn close_cycle(&mut self, generation: u64) {
        self.window[(generation % NEED_WINDOW as u64) as usize] = self.open;
        self.made = 0;
    }

    /// The largest external footprint of the recent cycles and the open one.
    pub fn peak(&self) -> usize {
        self.window.iter().copied().max().unwrap_or(0).max(self.open)
    }

    /// What the cache keeps of classes that did not recur when a block is made inside a cycle
    /// with `live` slot bytes live outside the arena: a quarter of the recent peak (or of what
    /// lives), within [`MIN_SLACK`] and [`SLACK`].
    pub fn slack(&self, live: usize) -> usize {
        (self.peak().max(live) / 4).clamp(MIN_SLACK, SLACK)
    }

    /// What the cache may hold between cycles with `live` slot bytes live outside the arena:
    /// live and cached together within the recent cycles' peak, or [`SLACK`].
    pub fn cache_budget(&self, live: usize) -> usize {
        let peak = self.peak().max(live);
        (peak - live).max(SLACK)
    }
}

// SAFETY: the table's headers and the cache's links are owned by this structure and reached only
// through `&mut self` (or `&self` for reads); moving it moves that ownership.
unsafe impl Send for OwnBlocks {}

impl Drop for OwnBlocks {
    fn drop(&mut self) {
        self.shrink_to(0);
        if !self.inline {
            for (_, h) in self.table.drain() {
                // SAFETY: each header is owned by the table (device blocks); reclaimed once.
                unsafe { drop(Box::from_raw(h.as_ptr())) };
            }
        }
    }
}

impl OwnBlocks {
    /// The blocks of the workspace `owner`; `Err` when the system has no room for their lists.
    pub fn new(backend: Arc<dyn Backend>, upstream: Arc<dyn Backend>, owner: u64) -> Result<Self, BackendError> {
        let cache = try_box(BlockCache {
            heads: [std::ptr::null_mut(); CLASSES],
            nonempty: ClassSet::default(),
            used: [0; CLASSES],
            recurring: ClassSet::default(),
            made: 0,
            bytes: 0,
        })
        .ok_or(BackendError::os("make a workspace", std::mem::size_of::<BlockCache>(), libc::ENOMEM))?;
        Ok(OwnBlocks {
            inline: backend.host_accessible(),
            owner,
            backend,
            upstream,
            table: Table::default(),
            cache,
            peaks: ExternalPeaks::default(),
        })
    }

    /// The source of blocks of `kind`.
    fn source(&self, kind: BlockKind) -> &dyn Backend {
        if kind == BlockKind::Bypass {
            &*self.upstream
        } else {
            &*self.backend
        }
    }

    /// Room in the table for one more block: a full table refuses before memory is taken.
    pub fn reserve(&mut self, bytes: usize) -> Result<(), BackendError> {
        self.table.try_reserve(1).map_err(|_| BackendError::os("list a block", bytes, libc::ENOMEM))
    }

    /// A fresh block of `kind` for a request of `size` bytes occupying `slot` bytes (header
    /// included), its header written live with the workspace's generation and stamp
    /// ([`BlockHeader::stamp`]).
    pub fn new_block(
        &mut self,
        kind: BlockKind,
        size: usize,
        slot: usize,
        zeroed: bool,
        (generation, stamp): (u64, u64),
    ) -> Result<NonNull<u8>, BackendError> {
        self.reserve(slot)?;
        let mut header = BlockHeader::live(kind, self.owner, 0, slot, size, generation);
        header.set_stamp(stamp);
        if !self.inline {
            let h = try_box(header).ok_or(BackendError::os("list a block", slot, libc::ENOMEM))?;
            let take = slot - HEADER;
            let src = self.source(kind);
            let at = if zeroed { src.alloc_block_zeroed(take) } else { src.alloc_block(take) };
            return match at {
                Ok(at) => {
                    // Room was reserved above: this insert does not allocate.
                    self.table.insert(at.as_ptr() as usize, NonNull::from(Box::leak(h)));
                    Ok(at)
                }
                Err(e) => Err(e),
            };
        }
        let src = self.source(kind);
        let at = if zeroed { src.alloc_block_zeroed(slot) } else { src.alloc_block(slot) }?;
        debug_assert_eq!(at.as_ptr() as usize % std::mem::align_of::<BlockHeader>(), 0);
        // SAFETY: `at` is a fresh 64-aligned block of `slot >= HEADER` bytes owned by us.
        unsafe { at.cast::<BlockHeader>().as_ptr().write(header) };
        // SAFETY: the block holds its header and at least its data's first byte.
        let p = unsafe { at.add(HEADER) };
        // SAFETY: its header sits in front of it, readable until it leaves the table.
        unsafe { self.register(p) };
        Ok(p)
    }

    /// Lists a block whose header sits in front of it (an external block, a huge mapping).
    ///
    /// # Safety
    /// `p` is a block of this workspace whose header sits in front of it, readable until
    /// [`OwnBlocks::unregister`] takes it off; the table has room ([`OwnBlocks::reserve`]).
    pub unsafe fn register(&mut self, p: NonNull<u8>) {
        debug_assert!(self.table.len() < self.table.capacity());
        // SAFETY: the caller's guarantee.
        self.table.insert(p.as_ptr() as usize, unsafe { p.sub(HEADER).cast() });
    }

    /// Takes a block whose header sits in front of it off the table.
    pub fn unregister(&mut self, p: NonNull<u8>) {
        self.table.remove(&(p.as_ptr() as usize));
    }

    /// The header of `p` if it is a block of this table (live or cached).
    #[inline]
    pub fn header_of(&self, p: NonNull<u8>) -> Option<NonNull<BlockHeader>> {
        self.table.get(&(p.as_ptr() as usize)).copied()
    }

    /// Whether `addr` lies in the data of a live block of this workspace outside its arena
    /// (external and huge blocks; not bypass blocks, which are not workspace memory). O(blocks):
    /// for diagnostics.
    pub fn holds(&self, addr: usize) -> bool {
        self.table.iter().any(|(&at, h)| {
            // SAFETY: the table's headers are readable while listed.
            let h = unsafe { h.as_ref() };
            h.is_live() && h.kind != BlockKind::Bypass && at <= addr && addr - at < h.slot - HEADER
        })
    }

    /// Each block of the table (live or cached; bypass blocks too): its data and header.
    pub fn each(&self) -> impl Iterator<Item = (usize, &BlockHeader)> + '_ {
        // SAFETY: the table's headers are readable while listed.
        self.table.iter().map(|(&at, h)| (at, unsafe { h.as_ref() }))
    }

    /// Whether headers sit in front of their blocks (else the table owns them).
    pub fn inline(&self) -> bool {
        self.inline
    }

    /// Gives a block back to its source.
    ///
    /// # Safety
    /// `p` is a block of this table of `slot` bytes and of `kind` that nothing uses any more,
    /// released once.
    pub unsafe fn release(&mut self, p: NonNull<u8>, slot: usize, kind: BlockKind) {
        let h = self.table.remove(&(p.as_ptr() as usize)).expect("a block of this table");
        if self.inline {
            // SAFETY: the header in front of the block is ours; it goes back with the block.
            unsafe { (*h.as_ptr()).magic = 0 };
            unpoison(p.as_ptr(), slot - HEADER);
            // SAFETY: the block was allocated by `new_block` from this source with `slot`
            // bytes, its data `HEADER` bytes in; the caller gives it up.
            unsafe { self.source(kind).free_block(p.sub(HEADER), slot) };
            return;
        }
        // SAFETY: the table owned the header; removed above, so released once.
        unsafe { drop(Box::from_raw(h.as_ptr())) };
        // SAFETY: the block was allocated by `new_block` with `slot - HEADER` bytes starting at
        // its data; the caller gives it up.
        unsafe { self.source(kind).free_block(p, slot - HEADER) };
    }

    /// As [`OwnBlocks::release`], for a block whose size the arena now serves: its pages go back
    /// to the system with it. The C heap would keep them resident in its free lists for requests
    /// that no longer come to it, beside the arena's pages that serve those requests now.
    ///
    /// # Safety
    /// As for [`OwnBlocks::release`].
    pub unsafe fn release_superseded(&mut self, p: NonNull<u8>, slot: usize, kind: BlockKind) {
        if slot >= GIVE_BACK_FROM && self.inline {
            // SAFETY: the block's data, `slot - HEADER` bytes at `p`, is ours and released next.
            unsafe { self.source(kind).give_back_pages(p, slot - HEADER) };
        }
        // SAFETY: forwarded.
        unsafe { self.release(p, slot, kind) }
    }

    /// A cached block that serves class `class` (its header says free; the caller rewrites it
    /// live), and its slot.
    #[inline]
    pub fn take_cached(&mut self, class: usize, generation: u64) -> Option<(NonNull<u8>, usize)> {
        if !self.cache.nonempty.contains(class) {
            return None;
        }
        self.cache.used[class] = generation;
        self.cache.recurring.insert(class);
        let (p, slot) = self.pop(class);
        if self.inline {
            unpoison(p.as_ptr(), slot - HEADER);
        }
        Some((p, slot))
    }

    /// Takes the first block off the (non-empty) list of `class`.
    fn pop(&mut self, class: usize) -> (NonNull<u8>, usize) {
        let p = NonNull::new(self.cache.heads[class]).expect("a listed block");
        let h = self.header_of(p).expect("a cached block is listed");
        let (next, slot) = {
            // SAFETY: a cached block of ours; the borrow ends in this block.
            let h = unsafe { &mut *h.as_ptr() };
            let next = std::mem::replace(&mut h.links, [std::ptr::null_mut(); 2])[1];
            (next, h.slot)
        };
        self.cache.heads[class] = next;
        if next.is_null() {
            self.cache.nonempty.remove(class);
        }
        self.cache.bytes -= slot;
        (p, slot)
    }

    /// Keeps a freed external block of `slot` bytes for reuse, on the cache's list of its class.
    ///
    /// # Safety
    /// `p` is a block of this table that nothing uses any more, put once.
    pub unsafe fn put_cached(&mut self, p: NonNull<u8>, slot: usize, generation: u64) {
        let class = floor_class(slot - HEADER).expect("blocks hold at least 64 bytes");
        let next = if self.cache.nonempty.contains(class) { self.cache.heads[class] } else { std::ptr::null_mut() };
        let h = self.header_of(p).expect("a block of this table");
        // SAFETY: a block of ours; its header is ours to write.
        let h = unsafe { &mut *h.as_ptr() };
        h.magic = MAGIC_FREE;
        h.links = [std::ptr::null_mut(), next];
        if self.inline {
            poison(p.as_ptr(), slot - HEADER);
        }
        self.cache.heads[class] = p.as_ptr();
        self.cache.nonempty.insert(class);
        self.cache.used[class] = generation;
        self.cache.bytes += slot;
    }

    /// Slot bytes of the cached blocks.
    pub fn cached_bytes(&self) -> usize {
        self.cache.bytes
    }

    /// Gives cached blocks back, largest classes first, until at most `bytes` are cached.
    pub fn shrink_to(&mut self, bytes: usize) {
        while self.cache.bytes > bytes {
            let Some(class) = self.cache.nonempty.iter_desc().next() else { break };
            self.release_one(class);
        }
    }

    /// Gives every cached block back: with its pages ([`OwnBlocks::release_superseded`]) where
    /// the arena now serves its class, as it is for the classes kept `apart` from the arena.
    pub fn release_superseded_cache(&mut self, apart: &ClassSet) {
        loop {
            let Some(class) = self.cache.nonempty.iter_desc().next() else { break };
            if apart.contains(class) {
                self.release_one(class);
                continue;
            }
            let (p, slot) = self.pop(class);
            // SAFETY: taken off the cache just above: nothing else refers to it; cached blocks
            // are external ones.
            unsafe { self.release_superseded(p, slot, BlockKind::External) };
        }
    }

    /// Gives cached blocks back until at most `cold` bytes are cached, those of classes that did
    /// not recur since the last cycle end first (largest first), then any, down to `most`.
    pub fn shrink_cold(&mut self, cold: usize, most: usize) {
        while self.cache.bytes > cold {
            let recurring = &self.cache.recurring;
            let Some(class) = self.cache.nonempty.iter_desc().find(|&c| !recurring.contains(c)) else { break };
            self.release_one(class);
        }
        self.shrink_to(most.max(cold));
    }

    /// Which classes recur is learned anew.
    fn forget_recurring(&mut self) {
        self.cache.recurring = ClassSet::default();
        self.cache.made = 0;
    }

    /// A new block of `len` bytes was made; once new blocks of more than a quarter of `peak` were
    /// made (a cycle of changing sizes), which classes recur is learned anew.
    pub fn note_made(&mut self, len: usize, peak: usize) {
        self.cache.made = self.cache.made.saturating_add(len);
        if self.cache.made > peak / 4 {
            self.forget_recurring();
        }
    }

    /// Gives back the cached blocks of every class unused since `generation - CACHE_CYCLES`.
    pub fn release_stale(&mut self, generation: u64) {
        let mut from = 0;
        while let Some(class) = self.cache.nonempty.next_from(from) {
            if self.cache.used[class] + CACHE_CYCLES <= generation {
                while self.cache.nonempty.contains(class) {
                    self.release_one(class);
                }
            }
            from = class + 1;
            if from >= CLASSES {
                break;
            }
        }
    }

    fn release_one(&mut self, class: usize) {
        let (p, slot) = self.pop(class);
        // SAFETY: taken off the cache just above: nothing else refers to it; cached blocks are
        // external ones.
        unsafe { self.release(p, slot, BlockKind::External) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::HeapMemory;
    use crate::classes::{class_of, class_size};

    fn blocks() -> OwnBlocks {
        OwnBlocks::new(Arc::new(HeapMemory), Arc::new(HeapMemory), 7).expect("room for the lists")
    }

    #[test]
    fn blocks_are_found_by_address_and_cached_by_class() {
        let mut b = blocks();
        let class = class_of(1000).unwrap();
        let slot = class_size(class) + HEADER;
        let p = b.new_block(BlockKind::External, 1000, slot, false, (0, 0)).unwrap();
        let h = b.header_of(p).expect("listed");
        // SAFETY: the live header just written.
        assert_eq!(unsafe { h.as_ref() }.owner, 7);
        assert!(b.holds(p.as_ptr() as usize + 999) && !b.holds(p.as_ptr() as usize + slot));
        // SAFETY: live, given up once.
        unsafe { b.put_cached(p, slot, 3) };
        assert_eq!(b.cached_bytes(), slot);
        assert_eq!(b.take_cached(class_of(50_000).unwrap(), 3), None, "another class");
        assert_eq!(b.take_cached(class, 4), Some((p, slot)));
        // SAFETY: taken off the cache: ours.
        unsafe { b.put_cached(p, slot, 4) };
        b.release_stale(4 + CACHE_CYCLES - 1);
        assert_eq!(b.cached_bytes(), slot, "used recently");
        b.release_stale(4 + CACHE_CYCLES);
        assert_eq!(b.cached_bytes(), 0);
        assert!(b.header_of(p).is_none(), "released blocks leave the table");
    }

    #[test]
    fn shrinking_gives_the_largest_classes_back_first() {
        let mut b = blocks();
        let mut put = |size: usize| {
            let slot = class_size(class_of(size).unwrap()) + HEADER;
            let p = b.new_block(BlockKind::External, size, slot, true, (0, 0)).unwrap();
            // SAFETY: live, given up once.
            unsafe { b.put_cached(p, slot, 0) };
            slot
        };
        let small = put(100);
        let large = put(100_000);
        assert_eq!(b.cached_bytes(), small + large);
        b.shrink_to(small);
        assert_eq!(b.cached_bytes(), small);
        b.shrink_to(0);
        assert_eq!(b.cached_bytes(), 0);
    }

    #[test]
    fn classes_that_recur_stay_cached_and_the_others_go_back_first() {
        let mut b = blocks();
        let cache = |b: &mut OwnBlocks, size: usize| {
            let class = class_of(size).unwrap();
            let slot = class_size(class) + HEADER;
            let p = b.new_block(BlockKind::External, size, slot, false, (0, 0)).unwrap();
            // SAFETY: live, given up once.
            unsafe { b.put_cached(p, slot, 0) };
            (class, slot)
        };
        let (hot, hot_slot) = cache(&mut b, 300_000);
        let (_, cold_slot) = cache(&mut b, 100_000);
        // The hot class is asked for again: it recurs.
        let (p, slot) = b.take_cached(hot, 0).unwrap();
        // SAFETY: taken off the cache: ours to put back.
        unsafe { b.put_cached(p, slot, 0) };
        assert_eq!(b.cached_bytes(), hot_slot + cold_slot);
        b.shrink_cold(0, hot_slot);
        assert_eq!(b.cached_bytes(), hot_slot, "the cold class went, the recurring one stayed");
        b.shrink_cold(0, 0);
        assert_eq!(b.cached_bytes(), 0, "within `most` only");
        // It recurs again; then making more bytes than the peak forgets what recurred.
        cache(&mut b, 300_000);
        let (p, slot) = b.take_cached(hot, 1).unwrap();
        // SAFETY: taken off the cache: ours to put back.
        unsafe { b.put_cached(p, slot, 1) };
        b.shrink_cold(0, usize::MAX);
        assert_eq!(b.cached_bytes(), hot_slot, "recurring: kept");
        b.note_made(10, 5);
        b.shrink_cold(0, usize::MAX);
        assert_eq!(b.cached_bytes(), 0, "nothing recurs any more");
    }

    #[test]
    fn the_cache_holds_the_recent_peak_between_cycles_and_a_slack_at_least() {
        const M: usize = 1 << 20;
        let mut peaks = ExternalPeaks::default();
        peaks.open_cycle(0);
        peaks.note(0, 100 * M);
        peaks.note(30 * M, 40 * M);
        peaks.close_cycle(0);
        assert_eq!(peaks.cache_budget(0), 100 * M);
        assert_eq!(peaks.cache_budget(60 * M), 40 * M, "what is live takes its share");
        assert_eq!(peaks.cache_budget(100 * M), SLACK, "at the peak: the slack");
        assert_eq!(peaks.slack(0), SLACK, "a quarter of a 100 MiB peak is more than the most");
        // The rise: what the cycle's own blocks had outside at once. 50 MiB of earlier blocks
        // live outside as it opens; 30 MiB of them are freed, a 10 MiB block spilled, the other
        // 20 MiB freed, a second 10 MiB block spilled: both spills live at once.
        let mut rise = ExternalPeaks::default();
        rise.open_cycle(50 * M);
        rise.free_earlier(30 * M);
        rise.note(20 * M, 30 * M);
        assert_eq!(rise.rise, 10 * M);
        rise.free_earlier(20 * M);
        rise.note(10 * M, 20 * M);
        assert_eq!(rise.rise, 20 * M, "earlier blocks freed on the way do not hide a spill");
        // The first spill freed and a third made: a temporary spilled again counts once.
        rise.note(10 * M, 20 * M);
        assert_eq!(rise.rise, 20 * M, "a temporary spilled again counts once");
        rise.note(20 * M, 25 * M);
        assert_eq!(rise.rise, 25 * M, "more at once: more");
        let mut small = ExternalPeaks::default();
        small.open_cycle(0);
        assert_eq!(small.slack(0), MIN_SLACK, "nothing held yet: the least");
        small.note(0, 8 * M);
        assert_eq!(small.slack(M), 2 * M, "a quarter of the peak");
        assert_eq!(small.slack(12 * M), 3 * M, "or of what lives, when more lives");
        // Once the window has moved past the peak, the budget follows the smaller cycles.
        for g in 1..=NEED_WINDOW as u64 {
            peaks.open_cycle(0);
            peaks.note(0, 30 * M);
            peaks.close_cycle(g);
        }
        peaks.open_cycle(0);
        assert_eq!(peaks.cache_budget(0), 30 * M);
    }
}
