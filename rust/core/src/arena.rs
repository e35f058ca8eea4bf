//! One arena region and its allocator.
//!
//! Every block carries a 64-byte [`BlockHeader`] in front of its data, and the headers of a region
//! tile it from offset 0 up to its *chain end*. Blocks are carved in class sizes
//! ([`crate::classes`]). A block under 128 KiB freed in a region that rewinds at cycle ends goes
//! on the LIFO free list of its class and is the first handed out again for a request of that
//! class, before any other memory: a cycle's footprint follows its peak live bytes, and the reused
//! block is cache-hot. Larger blocks go on one list in address order, merged with their free
//! neighbours, and a large request takes the free block that holds it best (see [`ORDERED`]).
//! Otherwise allocation bumps a cursor through the current *hole*, a run of memory known to be
//! free; when the hole is exhausted the allocator walks the header chain for the next run of freed
//! blocks (listed or not), skipping blocks that are still live (pinned), and merges runs as it
//! goes. Every operation is O(1) but the walk, which costs O(1) amortised per block freed, and the
//! large blocks' list, walked over at most [`ORDERED_SCAN`] blocks. When nothing is live at a
//! cycle end the region rewinds in O(1): this is the common case and it costs nothing. When blocks escape, later
//! cycles allocate around them: memory is never handed out twice while a block lives.
//!
//! Blocks of 128 KiB and more start their data on a 4 KiB boundary (a free filler block goes in
//! front of one carved elsewhere; the cycle's need counts room for it): large arrays whose
//! addresses differ by a few cache lines modulo 4 KiB slow loops over them by 10-15% (4K
//! aliasing), and arrays that all start on a page boundary never do.
//!
//! A circular region (`ResetPolicy::ENDOFBUFFER_REACHED`) keeps no free lists: allocation moves
//! on through the region across cycles and wraps at its end, as the policy says.

use std::ptr::{addr_of, NonNull};
use std::sync::Arc;

use crate::backend::{AnonymousMemory, Backend, BLOCK_ALIGN, HUGE_PAGE_THRESHOLD};
use crate::classes::{
    class_of, class_size, ClassSet, CLASSES, COLOURED_FROM, COLOURED_SIZE, COLOUR_MIN, PAGE_ALIGNED_FROM,
    PAGE_ALIGNED_SIZE,
};
use crate::error::BackendError;
use crate::fallible::try_box;
use crate::sanitizer::{poison, unpoison};

/// Bytes of the header in front of every block; also the alignment of every block's data.
pub const HEADER: usize = 64;

/// Memory no cycle has touched yet is handed out this much at a time (beyond the request), so
/// that freed memory is looked for before more is touched.
const TAIL_GRANT: usize = 2 << 20;

/// Bytes from which a zeroed request carved from used memory is zeroed page by page as it is
/// resident ([`ArenaRegion::zero_sparing`]) rather than written whole: a question to the system
/// (a few microseconds) against a write of a megabyte or more.
pub const ZERO_SPARING_MIN: usize = 1 << 20;

/// A block carved from memory not resident before, and a free run lying idle, of at least this
/// many bytes: glibc's largest mapping threshold, from which NumPy's allocator maps every block of
/// its own and unmaps it at its free, so that a plain process holds no free memory of such blocks
/// and faults each one in afresh ([`ArenaRegion::give_back_idle`]).
pub const GIVE_BACK_MIN: usize = 32 << 20;

/// Blocks of the large list looked at for idle runs of [`GIVE_BACK_MIN`] bytes: a bound on the
/// cost of the look, made only where a large block takes memory not resident.
const GIVE_BACK_SCAN: usize = 1024;

/// Where the data of blocks of the classes from [`PAGE_ALIGNED_FROM`] on starts (see there).
pub(crate) const LARGE_DATA_ALIGN: usize = 4096;

/// The most filler an arena puts in front of a block of `slot` bytes ([`ArenaRegion::pad`]):
/// up to a page for the page-aligned classes, [`COLOUR_MIN`] for the coloured ones.
#[inline(always)]
pub(crate) fn most_filler(slot: usize) -> usize {
    if slot >= PAGE_ALIGNED_SIZE + HEADER {
        LARGE_DATA_ALIGN - HEADER
    } else if slot >= COLOURED_SIZE + HEADER {
        COLOUR_MIN
    } else {
        0
    }
}

const MAGIC_LIVE: u32 = 0x5257_534C; // "RWSL"
pub(crate) const MAGIC_FREE: u32 = 0x5257_5346; // "RWSF"
/// Free and on a free list: `region` holds the lists' epoch (which never wraps), `requested` the
/// next block's offset and `generation` the previous one's (see [`FreeLists`]).
const MAGIC_LISTED: u32 = 0x5257_5345; // "RWSE"
/// Free and in its class's hot slot (see [`FreeLists`]).
const MAGIC_HOT: u32 = 0x5257_5348; // "RWSH"

/// No block (the end of a free list).
const NONE: usize = usize::MAX;

/// Ranges of a region's offsets whose pages went back to the system: a few, merged into their
/// neighbours when more come (a range standing for more than went back costs a question to the
/// system, never memory).
#[derive(Debug, Default, Clone, Copy)]
struct GivenBack {
    ranges: [(usize, usize); 8],
    n: usize,
}

impl GivenBack {
    fn overlaps(&self, from: usize, to: usize) -> bool {
        self.ranges[..self.n].iter().any(|&(a, b)| a < to && from < b)
    }

    fn add(&mut self, mut from: usize, mut to: usize) {
        // Ranges it touches merge into it.
        let mut i = 0;
        while i < self.n {
            let (a, b) = self.ranges[i];
            if a <= to && from <= b {
                (from, to) = (from.min(a), to.max(b));
                self.n -= 1;
                self.ranges[i] = self.ranges[self.n];
                // Grown, it may touch ranges already passed.
                i = 0;
            } else {
                i += 1;
            }
        }
        if self.n == self.ranges.len() {
            // Full: it merges with the nearest one.
            let gap = |&(a, b): &(usize, usize)| if b <= from { from - b } else { a.saturating_sub(to) };
            let k = (0..self.n).min_by_key(|&k| gap(&self.ranges[k])).expect("full");
            let (a, b) = self.ranges[k];
            self.n -= 1;
            self.ranges[k] = self.ranges[self.n];
            return self.add(from.min(a), to.max(b));
        }
        self.ranges[self.n] = (from, to);
        self.n += 1;
    }

    /// Takes `[from, to)` out; a range it splits stays whole where there is no room for both
    /// parts.
    fn remove(&mut self, from: usize, to: usize) {
        let mut i = 0;
        while i < self.n {
            let (a, b) = self.ranges[i];
            if !(a < to && from < b) {
                i += 1;
                continue;
            }
            let (low, high) = ((a < from).then_some((a, from)), (to < b).then_some((to, b)));
            match (low, high) {
                (None, None) => {
                    self.n -= 1;
                    self.ranges[i] = self.ranges[self.n];
                    continue;
                }
                (Some(r), None) | (None, Some(r)) => self.ranges[i] = r,
                (Some(l), Some(h)) if self.n < self.ranges.len() => {
                    self.ranges[i] = l;
                    self.ranges[self.n] = h;
                    self.n += 1;
                }
                (Some(_), Some(_)) => {}
            }
            i += 1;
        }
    }
}

/// The class of a block that has none (not carved from an arena).
pub const NO_CLASS: u16 = u16::MAX;

/// Larger classes a request may take a listed block of, when its own list is empty.
const CLASS_SLACK: usize = 4;

/// The free list of every block of a page-aligned class (128 KiB and more): one list in address
/// order, its neighbours merged as they are freed, from which a request takes the lowest block at
/// most an eighth larger than itself (of its class, the next one up, or a merged run of about that
/// size), else the smallest block that holds it (best fit, the lowest of equals). Lists by class keep the blocks of each size apart:
/// where the sizes of a loop's temporaries change from cycle to cycle (a table grown by a row,
/// images of several shapes, state one class up from the last cycle's), each class's blocks keep
/// places of their own around the state still live, and the region's whole room becomes resident.
const ORDERED: usize = PAGE_ALIGNED_FROM;

/// The smallest slot on the [`ORDERED`] list.
const ORDERED_MIN_SLOT: usize = PAGE_ALIGNED_SIZE + HEADER;

/// Free blocks a block put on the [`ORDERED`] list absorbs at most on either side: the cost of a
/// free stays bounded where many small free blocks lie around it.
const MERGE_STEPS: usize = 8;

/// Listed blocks the [`ORDERED`] list is walked over at most, to place a freed block or to find
/// one for a request: the cost stays bounded where many large free blocks lie apart (a block then
/// goes in where the walk stopped, and a request beyond it carves new memory).
const ORDERED_SCAN: usize = 64;

/// The list a free block of `slot` bytes goes on: its class's, or [`ORDERED`] from 128 KiB on
/// (where merged blocks have slots of no class size).
#[inline]
fn list_of(slot: usize) -> usize {
    if slot >= ORDERED_MIN_SLOT {
        ORDERED
    } else {
        slot_class(slot)
    }
}

/// Whether a block of the class one up from `class` may serve a request of `class` where it lies
/// (`realloc` to a size of the class below): from 128 KiB on, where a block is at most an eighth
/// larger than the request's class.
#[inline(always)]
const fn borrows_up(class: usize) -> bool {
    class >= PAGE_ALIGNED_FROM && class + 1 < CLASSES
}

/// Where a block's memory came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum BlockKind {
    /// Inside an arena region.
    Arena = 1,
    /// Outside the arena, counted as external memory (spills, learning cycles, ALWAYS).
    External = 2,
    /// Outside the arena and outside the workspace's accounts (`helper_min_size`, bypass mode).
    Bypass = 3,
    /// A request far larger than a cycle's usual footprint: a lazily faulted mapping of its own,
    /// counted as external memory and kept for reuse while such requests recur.
    Huge = 4,
}

/// The header in front of every block. Exactly one cache line, so data stays 64-byte aligned.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct BlockHeader {
    pub magic: u32,
    pub kind: BlockKind,
    /// The size class of an arena block ([`NO_CLASS`] for other blocks).
    pub class: u16,
    /// Id of the region holding an arena block: unique in its workspace for the life of the
    /// process (64 bits never wrap), so a stale header never names a live region by chance.
    pub region: u64,
    /// The token of the workspace that handed the block out ([`crate::Workspace::token`]).
    pub owner: u64,
    /// Bytes from this header to the next one (arena) or of the whole allocation (external).
    pub slot: usize,
    /// Bytes the caller asked for.
    pub requested: usize,
    /// The workspace generation (completed cycles) when the block was handed out.
    pub generation: u64,
    /// For a live block: in the first, the workspace's count of closed cycles when it was handed
    /// out ([`BlockHeader::stamp`]). For a cached block of its own: null and the next cached block
    /// of its class. Unused in a free arena block.
    pub links: [*mut u8; 2],
}

const _: () = assert!(std::mem::size_of::<BlockHeader>() == HEADER);

impl BlockHeader {
    /// The header of a block just handed out by the workspace `owner`.
    pub fn live(kind: BlockKind, owner: u64, region: u64, slot: usize, requested: usize, generation: u64) -> Self {
        BlockHeader {
            magic: MAGIC_LIVE,
            kind,
            class: NO_CLASS,
            region,
            owner,
            slot,
            requested,
            generation,
            links: [std::ptr::null_mut(); 2],
        }
    }

    pub fn is_live(&self) -> bool {
        self.magic == MAGIC_LIVE
    }

    /// Of a live block: the workspace's count of closed cycles when it was handed out (kept in
    /// the first link, which live blocks use for nothing else): where cycles overlap, how many
    /// closes it has outlived.
    #[inline(always)]
    pub fn stamp(&self) -> u64 {
        self.links[0].addr() as u64
    }

    #[inline(always)]
    pub fn set_stamp(&mut self, closes: u64) {
        self.links[0] = std::ptr::without_provenance_mut(closes as usize);
    }
}

/// The free lists of a region: one LIFO list per class below 128 KiB and one list in address
/// order above (see [`ORDERED`]), doubly linked through the headers of the listed blocks
/// (offsets), so that the walk can take a listed block out of its list in O(1) when it merges it
/// into a run. Clearing them all is O(1): a new epoch makes every header listed under an older one
/// an ordinary free header.
#[derive(Debug)]
struct FreeLists {
    /// Each class's most recently freed block, kept out of the list: a temporary freed and the
    /// next one of its size (the loop body's common case) cost one store each way, no linking.
    hot: [usize; CLASSES],
    /// The classes whose hot slot may hold a block (a superset: cleared in bulk).
    hot_set: ClassSet,
    heads: [usize; CLASSES],
    nonempty: ClassSet,
    /// Advances at every clear; 64 bits never wrap back to an epoch still written in a header.
    epoch: u64,
    /// Slot bytes of the blocks in hot slots and on the lists.
    bytes: usize,
}

impl FreeLists {
    fn new() -> Self {
        FreeLists {
            hot: [NONE; CLASSES],
            hot_set: ClassSet::default(),
            heads: [NONE; CLASSES],
            nonempty: ClassSet::default(),
            epoch: 1,
            bytes: 0,
        }
    }

    fn clear(&mut self) {
        let heads = &mut self.heads;
        self.nonempty.drain(|c| heads[c] = NONE);
        let hot = &mut self.hot;
        self.hot_set.drain(|c| hot[c] = NONE);
        self.epoch = self.epoch.wrapping_add(1);
        self.bytes = 0;
    }
}

/// The class of a block by its slot; the slots of blocks carved are a class size plus a header.
#[inline]
fn slot_class(slot: usize) -> usize {
    let c = class_of(slot - HEADER).expect("slots are class sized");
    debug_assert_eq!(class_size(c) + HEADER, slot, "a slot that is no class size");
    c
}

/// Bytes a request of `size` occupies in a region: its data rounded up to its class size, plus a
/// header.
#[inline]
pub fn slot_for(size: usize) -> Option<usize> {
    Some(class_size(class_of(size)?) + HEADER)
}

/// Whether an arena block of `slot` bytes serves a request of `size` bytes where it lies: its
/// slot is the request's, or one class up from 128 KiB on (see [`borrows_up`]).
pub fn stays_in(slot: usize, size: usize) -> bool {
    let Some(c) = class_of(size) else { return false };
    class_size(c) + HEADER == slot || (borrows_up(c) && class_size(c + 1) + HEADER == slot)
}

/// Writes a live header at `at` and returns the data pointer behind it.
///
/// # Safety
/// `at` is 64-byte aligned and valid for writes of `HEADER` bytes, and the caller owns
/// `[at, at + slot)` exclusively.
#[allow(clippy::too_many_arguments)]
pub unsafe fn write_live_header(
    at: NonNull<u8>,
    kind: BlockKind,
    owner: u64,
    region: u64,
    slot: usize,
    requested: usize,
    generation: u64,
) -> NonNull<u8> {
    debug_assert_eq!(at.as_ptr() as usize % BLOCK_ALIGN, 0);
    // SAFETY: the caller guarantees `at` is aligned and writable for a header.
    unsafe {
        at.cast::<BlockHeader>().as_ptr().write(BlockHeader::live(kind, owner, region, slot, requested, generation));
        at.add(HEADER)
    }
}

/// The kind of the block whose header is at `h`, if the header says live; None for a freed
/// header, and for bytes that are no header at all (the kind byte is read as a byte and checked,
/// so any bytes may be asked about).
///
/// # Safety
/// `h` is readable for `HEADER` bytes and 64-byte aligned.
#[inline]
pub unsafe fn live_kind(h: *const BlockHeader) -> Option<BlockKind> {
    // SAFETY: the caller's guarantee; both fields are read as plain integers.
    let (magic, kind) = unsafe { (addr_of!((*h).magic).read(), addr_of!((*h).kind).cast::<u8>().read()) };
    if magic != MAGIC_LIVE || !(BlockKind::Arena as u8..=BlockKind::Huge as u8).contains(&kind) {
        return None;
    }
    // SAFETY: `BlockKind` is `repr(u8)` with the values from `Arena` to `Huge`, checked above.
    Some(unsafe { std::mem::transmute::<u8, BlockKind>(kind) })
}

/// Whether the header at `h` is that of a live arena block (the free path's one question).
///
/// # Safety
/// As for [`live_kind`].
#[inline(always)]
pub unsafe fn is_live_arena(h: *const BlockHeader) -> bool {
    // SAFETY: the caller's guarantee; both fields are read as plain integers.
    unsafe {
        addr_of!((*h).magic).read() == MAGIC_LIVE && addr_of!((*h).kind).cast::<u8>().read() == BlockKind::Arena as u8
    }
}

/// One mapped region and its allocation state.
///
/// Block memory (`data`) comes from the backend. Headers live at the same offsets in `meta`: the
/// same mapping when the CPU can touch the backend's memory, else a sparse anonymous host mapping
/// (only pages holding headers become resident), so device memory is never read or written here.
#[derive(Debug)]
pub struct ArenaRegion {
    id: u64,
    /// The token of the workspace it belongs to (written in its blocks' headers).
    owner: u64,
    data: NonNull<u8>,
    meta: NonNull<u8>,
    /// The bytes it serves: what was mapped, or less after [`ArenaRegion::resize_in_place`].
    capacity: usize,
    /// The bytes mapped (of data, and of headers where they are apart).
    mapped: usize,
    backend: Arc<dyn Backend>,
    /// The current hole is `[cursor, limit)`.
    cursor: usize,
    limit: usize,
    /// Headers tile `[0, top)`, except the current hole when it is not the tail.
    top: usize,
    /// Whether the current hole is the never-carved tail `[top.., capacity)`; then the chain end
    /// is `cursor` and `top` is only a lower bound.
    tail: bool,
    live_blocks: usize,
    /// Bytes marked free since the last walk that found nothing: gates wrap-around walks.
    freed_since_scan: usize,
    /// The largest free run that walks which found nothing passed over since the region last
    /// started over: too small for their requests, perhaps not for a later, smaller one that the
    /// tail cannot hold, which walks for it then (a run taken since makes one walk that finds
    /// nothing, and corrects it).
    passed: usize,
    /// Every block in `[0, live_prefix)` is live: walks start here, so long-lived blocks at the
    /// front of the region cost nothing per cycle. Lowered by any free below it.
    live_prefix: usize,
    /// Every byte at or above this offset is still zero as mapped (never carved, or released to
    /// the system since): a zeroed request carved there needs no write. Blocks carved in the
    /// current never-carved tail are accounted for when the tail closes (see `carved_end`).
    dirty_end: usize,
    /// Bytes from the start made resident when the region was mapped (pre-faulted).
    prefaulted: usize,
    /// Where pages went back to the system ([`ArenaRegion::give_back_idle`]) and no block has
    /// been found resident since.
    given_back: GivenBack,
    /// The LIFO free lists by class; None in a circular region.
    lists: Option<Box<FreeLists>>,
    /// Whether the data of free blocks is poisoned for AddressSanitizer (host memory only).
    poisons: bool,
}

// SAFETY: the region exclusively owns its mapping; the raw base pointer is only dereferenced
// through `&mut self` (or by the owner of a live block it handed out), so moving the region to
// another thread moves that ownership with it.
unsafe impl Send for ArenaRegion {}

impl ArenaRegion {
    /// Maps a region of `capacity` bytes (a multiple of 64) from `backend`; `lists`: keep LIFO
    /// free lists by class (a region that rewinds at cycle ends), else allocate circularly. Its
    /// pages fault in on first use, or earlier through [`ArenaRegion::populate`].
    pub fn new(
        id: u64,
        owner: u64,
        capacity: usize,
        backend: Arc<dyn Backend>,
        lists: bool,
    ) -> Result<Self, BackendError> {
        Self::with_room(id, owner, capacity, capacity, backend, lists)
    }

    /// As [`ArenaRegion::new`], mapping `mapped >= capacity` bytes (whole pages where larger):
    /// room to grow where it lies ([`ArenaRegion::resize_in_place`]).
    pub fn with_room(
        id: u64,
        owner: u64,
        capacity: usize,
        mapped: usize,
        backend: Arc<dyn Backend>,
        lists: bool,
    ) -> Result<Self, BackendError> {
        debug_assert_eq!(capacity % BLOCK_ALIGN, 0);
        debug_assert!(mapped == capacity || (mapped > capacity && mapped % crate::backend::page_bytes() == 0));
        let lists = if lists {
            // The lists before the mapping: no room for them is a clean refusal.
            Some(try_box(FreeLists::new()).ok_or(BackendError::os("map", mapped, libc::ENOMEM))?)
        } else {
            None
        };
        let data = backend.map(mapped, false)?;
        let meta = if backend.host_accessible() {
            data
        } else {
            match AnonymousMemory.map(mapped, false) {
                Ok(m) => m,
                Err(e) => {
                    // SAFETY: mapped just above, released once, never handed out.
                    unsafe { backend.unmap(data, mapped) };
                    // No host memory for the headers of a device region.
                    return Err(e);
                }
            }
        };
        let mut region = ArenaRegion {
            id,
            owner,
            data,
            meta,
            capacity,
            mapped,
            backend,
            cursor: 0,
            limit: 0,
            top: 0,
            tail: true,
            live_blocks: 0,
            freed_since_scan: 0,
            passed: 0,
            live_prefix: 0,
            dirty_end: 0,
            prefaulted: 0,
            given_back: GivenBack::default(),
            lists,
            poisons: meta == data,
        };
        region.take_tail(0);
        if mapped > capacity {
            region.advise_huge_pages();
        }
        Ok(region)
    }

    /// Huge pages for what the region serves once that reaches the size the backend gives them
    /// to ([`HUGE_PAGE_THRESHOLD`], as NumPy does for its arrays), and none in its room to grow:
    /// a huge page straddling the end of what it serves would make up to 2 MiB resident that no
    /// block uses. (Where the system gives huge pages without advice, a region with room that
    /// serves less than the threshold takes none, as one without room would under the default
    /// `madvise` setting.)
    fn advise_huge_pages(&self) {
        if self.mapped < HUGE_PAGE_THRESHOLD {
            // The mapping was given no advice, and nothing it serves calls for any.
            return;
        }
        self.backend.huge_pages(self.data, self.capacity, self.capacity >= HUGE_PAGE_THRESHOLD);
        if self.mapped > self.capacity {
            // SAFETY: `capacity < mapped`: the offset lies inside the mapping.
            let room = unsafe { self.data.add(self.capacity) };
            self.backend.huge_pages(room, self.mapped - self.capacity, false);
        }
    }

    /// The end of the memory ever carved from this region (or carved since it was last released
    /// to the system): what a cycle has touched at most, the rest is untouched address space.
    pub fn carved_end(&self) -> usize {
        if self.tail {
            self.dirty_end.max(self.cursor)
        } else {
            self.dirty_end.max(self.top)
        }
    }

    /// The end of what may be resident: what was carved, and what was pre-faulted.
    pub fn resident_end(&self) -> usize {
        self.carved_end().max(self.prefaulted)
    }

    /// Whether `[off, ..)`, just carved, is still zero as mapped. Exact: the tail is carved
    /// upwards from `cursor`, and every hole below the chain end lies below `dirty_end`.
    #[inline]
    pub fn is_fresh(&self, off: usize) -> bool {
        off >= self.dirty_end
    }

    /// Makes the first `len` bytes resident now (page-rounded); returns the bytes this added.
    pub fn populate(&mut self, len: usize) -> usize {
        let len = crate::backend::round_to_page(len).min(self.capacity);
        if len <= self.prefaulted {
            return 0;
        }
        self.backend.populate(self.data, len);
        let added = len - self.prefaulted;
        self.prefaulted = len;
        self.given_back.remove(0, len);
        added
    }

    /// Hands the region, holding no live block, to another owner: it starts over, its blocks
    /// carry `owner`'s token and region id `id` from here on, and its mapping goes back through
    /// `backend` (the same memory source, under the new owner's limit). What earlier cycles
    /// carved counts as resident, as it does for the region's own blocks, so that a pre-fault
    /// asked for by the new owner touches only what lies above.
    pub fn hand_over(&mut self, id: u64, owner: u64, backend: Arc<dyn Backend>) {
        debug_assert_eq!(self.live_blocks, 0);
        self.rewind();
        self.id = id;
        self.owner = owner;
        self.backend = backend;
        if self.given_back.n == 0 {
            let page = crate::backend::page_bytes();
            self.prefaulted = self.prefaulted.max(self.carved_end().min(self.capacity) / page * page);
        }
    }

    /// Bytes freed since the last walk or retirement scan.
    pub fn freed_since_scan(&self) -> usize {
        self.freed_since_scan
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes mapped: [`ArenaRegion::capacity`], or more after a shrink in place.
    pub fn mapped(&self) -> usize {
        self.mapped
    }

    /// Returns the whole pages of `[from, to)` (offsets within the mapping, holding no live
    /// block) to the system. Returns whether the data's pages went back (or there were none).
    fn discard_pages(&self, from: usize, to: usize) -> bool {
        let page = crate::backend::page_bytes();
        let (a, b) = (from.next_multiple_of(page), to.min(self.mapped) / page * page);
        if a >= b {
            return true;
        }
        // SAFETY: `[a, b)` lies inside both mappings (offsets below `mapped`).
        let (p, m) = unsafe { (self.data.add(a), self.meta.add(a)) };
        if m != p {
            AnonymousMemory.discard(m, b - a);
        }
        self.backend.discard(p, b - a)
    }

    /// Zero-fills the `len` bytes at `p`, a block just carved from this region, without making
    /// more of it resident: pages resident now are written, the others go back to the system
    /// (anonymous memory reads them back as zeros), so that they take no room until written, as
    /// the fresh pages NumPy's `np.zeros` of a large array gets from the C heap. The partial
    /// pages at its ends are written. Returns false where the backend or the system cannot (some
    /// of the block may be zero already): the caller writes the block.
    ///
    /// # Safety
    /// `[p, p + len)` is the data of a block just carved from this region, owned by the caller:
    /// its bytes are written or given back.
    #[cold]
    pub unsafe fn zero_sparing(&self, p: NonNull<u8>, len: usize) -> bool {
        let start = p.as_ptr() as usize;
        let (a, b) = crate::backend::whole_pages(start, len);
        if a >= b || !self.backend.discard_zeroes() || self.meta != self.data {
            return false;
        }
        // SAFETY: `a` lies in the mapping (inside the caller's block), so it is not null.
        let pages = unsafe { NonNull::new_unchecked(a as *mut u8) };
        // Whole pages inside the block: its header and its neighbours' lie outside them.
        let mut written = true;
        let known = crate::backend::resident_runs(pages, b - a, |off, n, resident| {
            // SAFETY: `a + off` lies inside the caller's block, so it is not null.
            let run = unsafe { NonNull::new_unchecked((a + off) as *mut u8) };
            if resident || !self.backend.discard(run, n) {
                // SAFETY: `[a + off, + n)` lies inside the caller's block.
                written &= unsafe { self.backend.zero(run, n) }.is_ok();
            }
        });
        if !known || !written {
            return false;
        }
        // SAFETY: `[start, a)` and `[b, start + len)` lie inside the caller's block; `b` is not
        // null (it lies at or after `a`).
        unsafe {
            let end = NonNull::new_unchecked(b as *mut u8);
            self.backend.zero(p, a - start).is_ok() && self.backend.zero(end, start + len - b).is_ok()
        }
    }

    /// The block of `slot` bytes at `off`, just carved, is a large one: where it lies on memory
    /// not resident and the region holds idle free runs of [`GIVE_BACK_MIN`] bytes and more, as
    /// much of them goes back to the system ([`ArenaRegion::give_back_idle`]). Returns the bytes
    /// given back.
    #[cold]
    #[inline(never)]
    pub fn give_back_for(&mut self, off: usize, slot: usize) -> usize {
        // Memory carved by earlier cycles or pre-faulted, where nothing went back since, is
        // taken as resident without asking (a block never written is not, and gives nothing
        // back: the look errs towards keeping memory).
        let end = off + slot;
        let resident = end <= self.dirty_end.max(self.prefaulted) && !self.given_back.overlaps(off, end);
        if resident || !self.gives_back() || !self.has_idle_run() {
            return 0;
        }
        let page = crate::backend::page_bytes();
        let (a, b) = ((off + HEADER).next_multiple_of(page), (off + slot) / page * page);
        if a >= b {
            return 0;
        }
        let mut absent = 0;
        // SAFETY: `a` lies inside the block, inside the mapping (whose base is page-aligned):
        // not null.
        let pages = unsafe { self.data.add(a) };
        if !crate::backend::resident_runs(pages, b - a, |_, len, resident| absent += if resident { 0 } else { len }) {
            return 0;
        }
        // The block's pages are the caller's now: found resident, or about to be written.
        self.given_back.remove(off, end);
        // A few pages a give-back took from under it cost less to fault in again than a give-back
        // elsewhere, which the next large block would find missing in turn.
        if absent < (slot / 4).min(GIVE_BACK_MIN) {
            return 0;
        }
        self.give_back_idle(absent)
    }

    /// A new block of `slot` bytes, [`GIVE_BACK_MIN`] or more, was made outside the region (a
    /// spill): fresh memory, as a block carved on memory not resident is. As much of the
    /// region's idle free runs goes back to the system ([`ArenaRegion::give_back_idle`]).
    /// Returns the bytes given back.
    #[cold]
    #[inline(never)]
    pub fn give_back_beside(&mut self, slot: usize) -> usize {
        if slot < GIVE_BACK_MIN || !self.gives_back() || !self.has_idle_run() {
            return 0;
        }
        self.give_back_idle(slot)
    }

    /// Whether free memory given back reads back as zeros and its headers lie in it (anonymous
    /// host memory): only then do [`ArenaRegion::give_back_idle`]'s runs go back.
    fn gives_back(&self) -> bool {
        self.backend.discard_zeroes() && self.meta == self.data
    }

    /// Whether a free run of [`GIVE_BACK_MIN`] bytes or more lies idle: the hole, or one of the
    /// first [`GIVE_BACK_SCAN`] blocks of the large list.
    fn has_idle_run(&self) -> bool {
        if self.idle_holes().iter().any(|&(from, to)| to - from >= GIVE_BACK_MIN) {
            return true;
        }
        let Some(l) = self.lists.as_deref() else { return false };
        let mut at = if l.nonempty.contains(ORDERED) { l.heads[ORDERED] } else { NONE };
        for _ in 0..GIVE_BACK_SCAN {
            if at == NONE {
                break;
            }
            let h = self.header_at(at);
            if h.slot >= GIVE_BACK_MIN {
                return true;
            }
            at = h.requested;
        }
        false
    }

    /// Gives up to `budget` bytes of resident free memory back to the system (anonymous memory,
    /// which reads back as zeros): the resident pages of free runs of [`GIVE_BACK_MIN`] bytes and
    /// more (the current hole, and those among the first [`GIVE_BACK_SCAN`] blocks of the large
    /// list, [`ORDERED_SCAN`] at most), the highest first, where a request looks last. The caller
    /// found as much of one large block's memory not resident: the block then does not add to
    /// the region's resident footprint while such runs lie idle (a zeroed block its caller
    /// writes sparsely may take less than that, and the runs fault in again where used), as
    /// NumPy's allocator gives back every block that large at its free. Returns the bytes given
    /// back. O(listed large blocks), plus one residency question per run given back.
    pub fn give_back_idle(&mut self, budget: usize) -> usize {
        if budget == 0 || !self.gives_back() {
            return 0;
        }
        let mut runs = [(0usize, 0usize); ORDERED_SCAN + 2];
        let mut n = 0;
        // The holes have no header: all of them may go.
        for (from, to) in self.idle_holes() {
            if to - from >= GIVE_BACK_MIN {
                runs[n] = (from, to);
                n += 1;
            }
        }
        if let Some(l) = self.lists.as_deref() {
            let mut at = if l.nonempty.contains(ORDERED) { l.heads[ORDERED] } else { NONE };
            for _ in 0..GIVE_BACK_SCAN {
                if at == NONE || n == runs.len() {
                    break;
                }
                let h = self.header_at(at);
                if h.slot >= GIVE_BACK_MIN {
                    // The header stays: the list runs through it.
                    runs[n] = (at + HEADER, at + h.slot);
                    n += 1;
                }
                at = h.requested;
            }
        }
        runs[..n].sort_unstable_by_key(|r| std::cmp::Reverse(r.0));
        let mut given = 0;
        for &(from, to) in &runs[..n] {
            if given >= budget {
                break;
            }
            given += self.give_back_run(from, to, budget - given);
        }
        given
    }

    /// The free memory without headers, as far as it may be resident: the current hole, and the
    /// never-carved tail up to what was carved or pre-faulted (blocks freed back into it), which
    /// lies past the chain's end where a walk closed the hole (and is the hole where it is the
    /// tail). Empty ranges where there is none.
    fn idle_holes(&self) -> [(usize, usize); 2] {
        let resident = self.resident_end();
        if self.tail {
            [(self.cursor, resident.clamp(self.cursor, self.capacity)), (0, 0)]
        } else {
            [(self.cursor, self.limit), (self.top, resident.clamp(self.top, self.capacity))]
        }
    }

    /// Gives back the resident whole pages of the free memory `[from, to)` (offsets), from its
    /// high end, up to `budget` bytes; returns the bytes given back.
    fn give_back_run(&mut self, from: usize, to: usize, budget: usize) -> usize {
        let page = crate::backend::page_bytes();
        let (a, b) = (from.next_multiple_of(page), to.min(self.capacity) / page * page);
        if a >= b {
            return 0;
        }
        let mut resident = [(0usize, 0usize); 8];
        let mut n = 0;
        // SAFETY: `a` lies inside the mapping, so `data + a` is not null.
        let pages = unsafe { NonNull::new_unchecked(self.data.as_ptr().add(a)) };
        // The highest resident runs (a few suffice: runs of one free block are few).
        let known = crate::backend::resident_runs(pages, b - a, |off, len, is| {
            if is {
                if n == resident.len() {
                    resident.copy_within(1.., 0);
                    n -= 1;
                }
                resident[n] = (a + off, len);
                n += 1;
            }
        });
        if !known {
            return 0;
        }
        let mut given = 0;
        for &(off, len) in resident[..n].iter().rev() {
            if given >= budget {
                break;
            }
            let take = len.min((budget - given).next_multiple_of(page));
            let from = off + len - take;
            if self.discard_pages(from, off + len) {
                given += take;
                self.given_back.add(from, off + len);
            }
        }
        given
    }

    /// Makes the region serve `capacity` bytes (whole pages) within what it has mapped, without
    /// mapping anew: what is resident below stays, and faults in no more. A region grows so at
    /// any time, up to what it mapped. It shrinks so only
    /// when empty, where discarded pages read back as zeros (anonymous memory): it rewinds, and
    /// the pages above `capacity` go back to the system. Returns whether it was resized.
    pub fn resize_in_place(&mut self, capacity: usize) -> bool {
        let page = crate::backend::page_bytes();
        if capacity == 0 || capacity > self.mapped || capacity % page != 0 {
            return false;
        }
        if capacity < self.capacity {
            if self.live_blocks > 0 || !self.backend.discard_zeroes() {
                return false;
            }
            self.rewind();
            let resident = self.dirty_end.max(self.prefaulted);
            if !self.discard_pages(capacity, resident.next_multiple_of(page)) {
                // The pages above keep their bytes: a growth back must not take them for zeros.
                return false;
            }
            self.dirty_end = self.dirty_end.min(capacity);
            self.prefaulted = self.prefaulted.min(capacity);
            self.capacity = capacity;
            self.take_tail(0);
        } else {
            // The tail, or a walk, reaches the new end from here on.
            self.capacity = capacity;
        }
        self.advise_huge_pages();
        true
    }

    pub fn live_blocks(&self) -> usize {
        self.live_blocks
    }

    /// Whether `p` points into this region's block memory.
    pub fn contains(&self, p: *const u8) -> bool {
        let b = self.data.as_ptr() as usize;
        (b..b + self.capacity).contains(&(p as usize))
    }

    /// The offset of the header of a block whose data would start at `p`: None unless `p` lies
    /// in this region with room for a header in front of it, on a block boundary.
    #[inline(always)]
    pub fn header_offset(&self, p: NonNull<u8>) -> Option<usize> {
        // One comparison for both bounds: below `data + HEADER` wraps to a huge offset.
        let off = (p.as_ptr() as usize).wrapping_sub(self.data.as_ptr() as usize).wrapping_sub(HEADER);
        (off < self.capacity - HEADER && off % BLOCK_ALIGN == 0).then_some(off)
    }

    /// The base address of the region's block memory.
    pub fn base(&self) -> NonNull<u8> {
        self.data
    }

    /// Where the header of a block whose data starts at `p` lies, when `p` is on a block
    /// boundary of this region with room for a header in front of it: memory this region maps,
    /// readable whatever it holds (a live header, a free one, or a live block's data).
    #[inline(always)]
    pub fn header_at_data(&self, p: NonNull<u8>) -> Option<NonNull<BlockHeader>> {
        let off = self.header_offset(p)?;
        // SAFETY: `off < capacity`, inside the header mapping.
        Some(unsafe { self.meta.add(off).cast() })
    }

    fn header_at(&self, off: usize) -> &BlockHeader {
        debug_assert!(off + HEADER <= self.capacity && off % BLOCK_ALIGN == 0);
        // SAFETY: `off` is below the chain end, where headers tile the region, so a header
        // written by this region lies there; the mapping is alive while `self` is.
        unsafe { &*self.meta.as_ptr().add(off).cast::<BlockHeader>() }
    }

    fn header_mut(&mut self, off: usize) -> &mut BlockHeader {
        debug_assert!(off + HEADER <= self.capacity && off % BLOCK_ALIGN == 0);
        // SAFETY: as in `header_at`; `&mut self` makes the borrow exclusive.
        unsafe { &mut *self.meta.as_ptr().add(off).cast::<BlockHeader>() }
    }

    /// Stamps the live block whose header is at `off` ([`BlockHeader::stamp`]).
    #[inline(always)]
    pub fn set_stamp(&mut self, off: usize, closes: u64) {
        self.header_mut(off).set_stamp(closes);
    }

    /// Poisons `[off, off + len)` of the block memory (see [`crate::sanitizer`]).
    #[inline(always)]
    fn poison(&self, off: usize, len: usize) {
        if self.poisons {
            poison(self.data.as_ptr().wrapping_add(off), len);
        }
    }

    #[inline(always)]
    fn unpoison(&self, off: usize, len: usize) {
        if self.poisons {
            unpoison(self.data.as_ptr().wrapping_add(off), len);
        }
    }

    fn write_free_header(&mut self, off: usize, slot: usize) {
        debug_assert!(slot >= HEADER && off + slot <= self.capacity);
        // The spot may lie in the poisoned data of a block freed before.
        self.unpoison(off, HEADER);
        // SAFETY: `[off, off+slot)` is free memory inside the region (a closed hole or a merged
        // run of freed blocks); nothing else refers to it.
        unsafe {
            self.meta.as_ptr().add(off).cast::<BlockHeader>().write(BlockHeader {
                magic: MAGIC_FREE,
                kind: BlockKind::Arena,
                class: NO_CLASS,
                region: self.id,
                owner: self.owner,
                slot,
                requested: 0,
                generation: 0,
                links: [std::ptr::null_mut(); 2],
            })
        };
    }

    /// Hands out a block for a request of `requested` bytes of class `class` (slot `slot`,
    /// header included): below 128 KiB the class's most recently freed block (its hot slot, then
    /// its list), from 128 KiB on a listed block that holds it (see [`ORDERED`]); else from the
    /// hole, else a listed block a few classes larger, else from a run found by the walk. Returns
    /// the data pointer, the block's slot, and the offset of its header.
    #[inline(always)]
    pub fn take(
        &mut self,
        class: usize,
        slot: usize,
        requested: usize,
        generation: u64,
    ) -> Option<(NonNull<u8>, usize, usize)> {
        debug_assert!(slot % BLOCK_ALIGN == 0 && slot >= HEADER && slot == class_size(class) + HEADER);
        if let Some(l) = self.lists.as_deref_mut() {
            let hot = l.hot[class];
            if hot != NONE {
                l.hot[class] = NONE;
                l.bytes -= slot;
                return Some(self.reuse(hot, slot, requested, generation));
            }
        }
        if self.limit - self.cursor >= slot
            && !self.lists.as_deref().is_some_and(|l| l.nonempty.contains(class.min(ORDERED)))
            && self.pad(class, self.cursor) == 0
        {
            let off = self.cursor;
            self.cursor = off + slot;
            // SAFETY: `[off, off+slot)` was just carved for this slot.
            return Some((unsafe { self.hand_out(off, slot, requested, generation) }, slot, off));
        }
        self.take_slow(class, slot, requested, generation)
    }

    /// A free block of this region coming back as it was handed out before: only what changes
    /// is written.
    #[inline(always)]
    fn reuse(&mut self, off: usize, slot: usize, requested: usize, generation: u64) -> (NonNull<u8>, usize, usize) {
        let id = self.id;
        let h = self.header_mut(off);
        h.magic = MAGIC_LIVE;
        h.region = id;
        h.requested = requested;
        h.generation = generation;
        self.live_blocks += 1;
        self.unpoison(off + HEADER, slot - HEADER);
        // SAFETY: a block of this region, inside the mapping.
        (unsafe { self.data.add(off + HEADER) }, slot, off)
    }

    #[cold]
    #[inline(never)]
    fn take_slow(
        &mut self,
        class: usize,
        slot: usize,
        requested: usize,
        generation: u64,
    ) -> Option<(NonNull<u8>, usize, usize)> {
        if class < ORDERED && self.lists.as_deref().is_some_and(|l| l.nonempty.contains(class)) {
            let off = self.lists.as_deref().expect("lists").heads[class];
            self.unlist(off, class);
            return Some(self.reuse(off, slot, requested, generation));
        }
        let found = if class >= ORDERED { self.best_fit(class, slot) } else { None };
        let (off, slot) = match found.or_else(|| self.carve_here(class, slot)) {
            Some(off) => (off, slot),
            None => self.carve_slow(class, slot)?,
        };
        // SAFETY: `[off, off+slot)` was just carved for this slot.
        Some((unsafe { self.hand_out(off, slot, requested, generation) }, slot, off))
    }

    /// Carves a block of page-aligned class `class` from a block on the [`ORDERED`] list: the
    /// first of its class or the next one up, else the smallest that holds it (the lowest of
    /// equals); its rest goes back on the list. None where no block within [`ORDERED_SCAN`] holds
    /// it, or the smallest lies above a hole that holds it.
    fn best_fit(&mut self, class: usize, slot: usize) -> Option<usize> {
        let l = self.lists.as_deref()?;
        if !l.nonempty.contains(ORDERED) {
            return None;
        }
        // A block at most an eighth larger than the request (its class or the next one up, or a
        // merged run of about that size) holds nothing else as well: it is taken first.
        let snug = slot + slot / 8;
        let (mut at, mut best, mut best_slot, mut snugly) = (l.heads[ORDERED], NONE, usize::MAX, false);
        for _ in 0..ORDERED_SCAN {
            if at == NONE {
                break;
            }
            let h = self.header_at(at);
            let pad = self.pad(class, at);
            if h.slot >= pad + slot {
                if h.slot - pad <= snug {
                    (best, snugly) = (at, true);
                    break;
                }
                if h.slot < best_slot {
                    (best, best_slot) = (at, h.slot);
                }
            }
            at = h.requested;
        }
        let hole_holds = self.limit - self.cursor >= self.pad(class, self.cursor) + slot;
        if best == NONE || (!snugly && hole_holds && self.cursor < best) {
            return None;
        }
        let at = best;
        let len = self.unlist(at, ORDERED).slot;
        let pad = self.pad(class, at);
        if pad > 0 {
            self.write_free_header(at, pad);
        }
        let off = at + pad;
        let rest = len - pad - slot;
        if rest > 0 {
            self.write_free_header(off + slot, rest);
            if rest >= ORDERED_MIN_SLOT {
                // Not merged backwards: the block in front is the one being carved, whose header
                // is written only as it is handed out.
                self.list_ordered(off + slot, rest, false);
            }
        }
        Some(off)
    }

    /// Puts the free block at `off` (its header already says free) on the [`ORDERED`] list in
    /// address order, merged with the free memory around it: the free blocks after it (listed
    /// or not, up to a live block, the hole or [`MERGE_STEPS`] blocks), and the listed block
    /// before it where only free blocks lie between. Where it then reaches the hole, the hole
    /// grows back over it instead. A large free run then lies on the list whole, where a request
    /// finds it: runs left apart (by a small free block, or the filler in front of a large one)
    /// hold no request as large as both, which then takes memory the cycle has not touched yet.
    /// Never while a walk is under way: it could step onto a header merged away. `back`: merge
    /// with the free memory before it too (the headers in front of `off` are all written).
    #[inline(never)]
    fn list_ordered(&mut self, off: usize, slot: usize, back: bool) {
        if self.lists.is_none() {
            return;
        }
        let hole = self.hole_start();
        let chain_end = if self.tail { self.cursor } else { self.top };
        let mut end = off + slot;
        for _ in 0..MERGE_STEPS {
            if end == hole || end >= chain_end {
                break;
            }
            let h = self.header_at(end);
            if !self.plausible(end, h) || h.is_live() {
                break;
            }
            let next = end + h.slot;
            self.take_off(end);
            end = next;
        }
        let prev = self.ordered_before(off);
        let start = if back { self.free_back_to(prev, off) } else { off };
        if end == hole {
            // The hole grows back over the run.
            if start != off {
                self.unlist(start, ORDERED);
            }
            self.cursor = start;
            return;
        }
        if start != off {
            // It joins the listed block before, across the free blocks between.
            let h = self.header_mut(start);
            let grown = end - start - h.slot;
            h.slot = end - start;
            self.lists.as_deref_mut().expect("lists").bytes += grown;
            return;
        }
        self.insert_after(prev, off, end - off);
    }

    /// Links the free block at `off` (its header says free and `slot` bytes, or is rewritten to)
    /// into the [`ORDERED`] list in address order, merged with nothing.
    fn insert_ordered(&mut self, off: usize, slot: usize) {
        self.insert_after(self.ordered_before(off), off, slot);
    }

    /// As [`ArenaRegion::insert_ordered`], after the listed block `prev` (NONE: at the head).
    fn insert_after(&mut self, prev: usize, off: usize, slot: usize) {
        let Some(l) = self.lists.as_deref_mut() else { return };
        let epoch = l.epoch;
        l.bytes += slot;
        let next = if prev != NONE {
            let n = self.header_at(prev).requested;
            self.header_mut(prev).requested = off;
            n
        } else {
            let n = if l.nonempty.contains(ORDERED) { l.heads[ORDERED] } else { NONE };
            l.heads[ORDERED] = off;
            l.nonempty.insert(ORDERED);
            n
        };
        self.link_listed(off, epoch, prev, next).slot = slot;
    }

    /// The last block on the [`ORDERED`] list that lies below `off` (within [`ORDERED_SCAN`]
    /// blocks of its head), or NONE.
    fn ordered_before(&self, off: usize) -> usize {
        let Some(l) = self.lists.as_deref().filter(|l| l.nonempty.contains(ORDERED)) else { return NONE };
        let (mut prev, mut at) = (NONE, l.heads[ORDERED]);
        for _ in 0..ORDERED_SCAN {
            if at == NONE || at > off {
                break;
            }
            prev = at;
            at = self.header_at(at).requested;
        }
        prev
    }

    /// Where the free memory that ends at `off` starts, taking it off its lists: the listed block
    /// `prev` where at most [`MERGE_STEPS`] free blocks lie between its end and `off` (they are
    /// taken off their lists, and `prev` stays listed), else `off`.
    fn free_back_to(&mut self, prev: usize, off: usize) -> usize {
        if prev == NONE {
            return off;
        }
        let (hole, from) = (self.hole_start(), prev + self.header_at(prev).slot);
        let mut pos = from;
        for _ in 0..MERGE_STEPS {
            if pos >= off || pos == hole {
                break;
            }
            let h = self.header_at(pos);
            if !self.plausible(pos, h) || h.is_live() {
                return off;
            }
            pos += h.slot;
        }
        if pos != off {
            return off;
        }
        let mut pos = from;
        while pos < off {
            let next = pos + self.header_at(pos).slot;
            self.take_off(pos);
            pos = next;
        }
        prev
    }

    /// Takes the free block at `pos` out of its list or hot slot, if it is in one (a merge
    /// absorbs it); its header then says free.
    fn take_off(&mut self, pos: usize) {
        let h = self.header_at(pos);
        let (slot, hot) = (h.slot, h.magic == MAGIC_HOT);
        if self.is_listed(pos) {
            self.unlist(pos, list_of(slot));
        } else if hot {
            if let Some(l) = self.lists.as_deref_mut() {
                let c = slot_class(slot);
                if l.hot[c] == pos {
                    l.hot[c] = NONE;
                    l.bytes -= slot;
                }
            }
            self.header_mut(pos).magic = MAGIC_FREE;
        }
    }

    /// Where the current hole starts, where it has no header there: the never-carved tail, or a
    /// hole that is not empty; NONE otherwise.
    #[inline]
    fn hole_start(&self) -> usize {
        if self.tail || self.cursor < self.limit {
            self.cursor
        } else {
            NONE
        }
    }

    /// Bytes to skip at `off` so that a block of class `class` carved there has its data on a
    /// [`LARGE_DATA_ALIGN`] boundary (from [`PAGE_ALIGNED_FROM`] on), or at least [`COLOUR_MIN`]
    /// bytes into a page (from [`COLOURED_FROM`] on); 0 below. A filler, where there is one,
    /// holds a header at least: offsets and the data's start are multiples of 64.
    #[inline(always)]
    fn pad(&self, class: usize, off: usize) -> usize {
        if class < COLOURED_FROM {
            return 0;
        }
        let at = self.data.as_ptr() as usize + off + HEADER;
        if class < PAGE_ALIGNED_FROM {
            return COLOUR_MIN.saturating_sub(at % LARGE_DATA_ALIGN);
        }
        at.wrapping_neg() % LARGE_DATA_ALIGN
    }

    /// Carves a block of class `class` from the current hole, after a free filler block where
    /// its data must start further on; None when the hole is too small.
    fn carve_here(&mut self, class: usize, slot: usize) -> Option<usize> {
        let pad = self.pad(class, self.cursor);
        if self.limit - self.cursor < pad + slot {
            return None;
        }
        if pad > 0 {
            // Headers are 64 bytes and offsets multiples of 64: a filler holds at least a header.
            self.write_free_header(self.cursor, pad);
        }
        let off = self.cursor + pad;
        self.cursor = off + slot;
        Some(off)
    }

    #[cold]
    fn carve_slow(&mut self, class: usize, slot: usize) -> Option<(usize, usize)> {
        if let Some(l) = self.lists.as_deref() {
            if let Some(c) = l.nonempty.next_from(class).filter(|&c| c <= class + CLASS_SLACK && c < ORDERED) {
                let off = l.heads[c];
                self.unlist(off, c);
                return Some((off, class_size(c) + HEADER));
            }
        }
        if !self.find_hole(slot + most_filler(slot)) {
            return None;
        }
        self.carve_here(class, slot).map(|off| (off, slot))
    }

    /// Keeps the block at `off`, just freed, for the next request of its class: in the class's
    /// hot slot when it is empty, else on the list; from 128 KiB on, on the [`ORDERED`] list.
    #[inline(always)]
    fn keep(&mut self, off: usize, slot: usize, class: usize) {
        if class >= ORDERED {
            self.list_ordered(off, slot, true);
            return;
        }
        let Some(l) = self.lists.as_deref_mut() else { return };
        if l.hot[class] == NONE {
            l.hot[class] = off;
            l.hot_set.insert(class);
            l.bytes += slot;
            self.header_mut(off).magic = MAGIC_HOT;
            return;
        }
        self.list_cold(off, slot, class);
    }

    #[cold]
    #[inline(never)]
    fn list_cold(&mut self, off: usize, slot: usize, class: usize) {
        self.list(off, slot, class);
    }

    /// Moves the blocks of the hot slots onto the lists (before a walk, which takes listed blocks
    /// out of their lists as it merges them).
    fn flush_hot(&mut self) {
        let Some(l) = self.lists.as_deref_mut() else { return };
        let set = std::mem::take(&mut l.hot_set);
        for c in set.iter_desc() {
            let Some(l) = self.lists.as_deref_mut() else { return };
            let off = std::mem::replace(&mut l.hot[c], NONE);
            if off != NONE {
                let slot = class_size(c) + HEADER;
                l.bytes -= slot;
                self.list(off, slot, c);
            }
        }
    }

    /// Puts the free block at `off` (its header already says free) on the list of its class.
    #[inline]
    fn list(&mut self, off: usize, slot: usize, class: usize) {
        let Some(l) = self.lists.as_deref_mut() else { return };
        let head = if l.nonempty.contains(class) { l.heads[class] } else { NONE };
        let epoch = l.epoch;
        l.heads[class] = off;
        l.nonempty.insert(class);
        l.bytes += slot;
        self.link_listed(off, epoch, NONE, head);
    }

    /// Makes the header at `off` a listed one between `prev` and `next` (either NONE), linking
    /// `next` back to it; the caller links `prev` (or the list's head) to it.
    #[inline]
    fn link_listed(&mut self, off: usize, epoch: u64, prev: usize, next: usize) -> &mut BlockHeader {
        if next != NONE {
            self.header_mut(next).generation = off as u64;
        }
        let h = self.header_mut(off);
        h.magic = MAGIC_LISTED;
        h.region = epoch;
        h.requested = next;
        h.generation = prev as u64;
        h
    }

    /// Takes the listed block at `off` (of class `class`) off its list; its header then says free,
    /// and is returned for the caller to rewrite.
    #[inline]
    fn unlist(&mut self, off: usize, class: usize) -> &mut BlockHeader {
        let (next, prev, slot) = {
            let h = self.header_at(off);
            (h.requested, h.generation as usize, h.slot)
        };
        if next != NONE {
            self.header_mut(next).generation = prev as u64;
        }
        if prev != NONE {
            self.header_mut(prev).requested = next;
        }
        let l = self.lists.as_deref_mut().expect("a listed block has lists");
        if prev == NONE {
            l.heads[class] = next;
            if next == NONE {
                l.nonempty.remove(class);
            }
        }
        l.bytes -= slot;
        let h = self.header_mut(off);
        h.magic = MAGIC_FREE;
        h
    }

    /// Whether the free header at `off` is on a list now (listed under the current epoch).
    fn is_listed(&self, off: usize) -> bool {
        let h = self.header_at(off);
        h.magic == MAGIC_LISTED && self.lists.as_deref().is_some_and(|l| l.epoch == h.region)
    }

    /// Slot bytes of the blocks on the free lists.
    #[cfg(test)]
    pub fn listed_bytes(&self) -> usize {
        self.lists.as_deref().map_or(0, |l| l.bytes)
    }

    /// Hands a carved slot out: writes its live header and counts it.
    ///
    /// # Safety
    /// `[off, off + slot)` was just carved for this block (from the hole or a free block) and is
    /// handed out once.
    #[inline]
    pub unsafe fn hand_out(&mut self, off: usize, slot: usize, requested: usize, generation: u64) -> NonNull<u8> {
        self.live_blocks += 1;
        self.unpoison(off, slot);
        // SAFETY: `[off, off+slot)` was carved from a hole for the caller and is inside the
        // mapping; offsets are multiples of 64 from 64-aligned bases; headers go to `meta`.
        unsafe {
            write_live_header(self.meta.add(off), BlockKind::Arena, self.owner, self.id, slot, requested, generation);
            (*self.meta.add(off).cast::<BlockHeader>().as_ptr()).class = slot_class(slot) as u16;
            self.data.add(off + HEADER)
        }
    }

    /// Ends the current hole: the rest of it becomes a free block in the chain.
    /// Afterwards the hole is empty: `cursor == limit`.
    fn close_hole(&mut self) {
        if self.tail {
            self.dirty_end = self.dirty_end.max(self.cursor);
            self.top = self.cursor;
            self.tail = false;
            self.limit = self.cursor;
        } else {
            debug_assert!(self.limit <= self.top);
            if self.cursor < self.limit {
                self.write_free_header(self.cursor, self.limit - self.cursor);
            }
            self.cursor = self.limit;
        }
    }

    /// A header whose slot would not advance the walk, or would leave the region, means the
    /// memory in front of a block was overwritten: stop walking rather than loop or stray.
    fn plausible(&self, pos: usize, h: &BlockHeader) -> bool {
        let ok = h.slot >= HEADER
            && h.slot % BLOCK_ALIGN == 0
            && pos.checked_add(h.slot).is_some_and(|end| end <= self.capacity);
        debug_assert!(ok, "corrupt block header at offset {pos} of region {}", self.id);
        ok
    }

    /// The end of the run of freed blocks that starts at `pos` (at most the chain end), taking
    /// the listed ones off their lists (the run is merged); None when a header on the way is
    /// implausible.
    fn free_run_end(&mut self, mut pos: usize) -> Option<usize> {
        while pos < self.top {
            let h = self.header_at(pos);
            if !self.plausible(pos, h) {
                return None;
            }
            if h.is_live() {
                break;
            }
            let slot = h.slot;
            self.take_off(pos);
            pos += slot;
        }
        Some(pos)
    }

    /// Walks the chain from the end of the last hole for a run of at least `need` free bytes,
    /// wrapping to the start once when enough has been freed since the last fruitless walk.
    /// Memory never used yet (a tail past everything carved so far) is taken only after the
    /// freed memory behind the walk was searched: address-ordered reuse keeps what a long cycle
    /// makes resident close to what it keeps live.
    fn find_hole(&mut self, need: usize) -> bool {
        self.flush_hot();
        let was_tail = self.tail;
        let resume = if was_tail { self.cursor } else { self.limit };
        let rest = (self.cursor, self.limit - self.cursor);
        self.close_hole();
        if !was_tail && rest.1 >= ORDERED_MIN_SLOT {
            // What the hole leaves is a free run: large requests find it on the list. (Merged with
            // nothing: the walk starts where it ends.)
            self.insert_ordered(rest.0, rest.1);
        }
        let start = resume.min(self.top).max(self.live_prefix);
        let mut pos = start;
        let mut wrapped = false;
        // Set when the walk wrapped before taking an untouched tail that fits: if nothing
        // freed fits, the tail is taken after all.
        let mut tail_fallback = false;
        // Whether every block from `live_prefix` to `pos` was live: the prefix then grows.
        let mut extending = pos == self.live_prefix;
        // The largest free run the walk passed over.
        let mut largest = 0;
        loop {
            if wrapped && pos >= start {
                if tail_fallback {
                    self.freed_since_scan = 0;
                    self.passed = largest;
                    return self.take_tail(need);
                }
                break;
            }
            if pos >= self.top {
                let tail_fits = self.capacity - self.top >= need;
                // A run passed before is looked for only where nothing else serves: walks behind
                // for every request it could hold would cut up large free runs that the tail
                // spares.
                let behind = self.freed_since_scan >= need || (!tail_fits && self.passed >= need);
                let may_wrap = !wrapped && start > self.live_prefix && behind;
                let touched = self.top < self.dirty_end.max(self.prefaulted);
                // Touched memory is taken at once; untouched memory only after a walk behind.
                if tail_fits && (touched || !may_wrap) {
                    return self.take_tail(need);
                }
                if !may_wrap {
                    break;
                }
                tail_fallback = tail_fits;
                wrapped = true;
                pos = self.live_prefix;
                extending = true;
                continue;
            }
            let h = self.header_at(pos);
            if !self.plausible(pos, h) {
                break;
            }
            if h.is_live() {
                pos += h.slot;
                if extending {
                    self.live_prefix = pos;
                }
                continue;
            }
            extending = false;
            let run_start = pos;
            let Some(end) = self.free_run_end(pos) else { break };
            pos = end;
            if pos >= self.top {
                // The run reaches the chain end: it joins the never-carved tail.
                self.top = run_start;
                pos = run_start;
                continue;
            }
            if pos - run_start >= need {
                self.cursor = run_start;
                self.limit = pos;
                self.tail = false;
                // Freed memory found again no longer calls for walks.
                self.freed_since_scan = self.freed_since_scan.saturating_sub(pos - run_start);
                return true;
            }
            // Too small for this request: merge the run so later walks step over it at once, and
            // list it where a large request finds it.
            self.write_free_header(run_start, pos - run_start);
            if pos - run_start >= ORDERED_MIN_SLOT {
                self.insert_ordered(run_start, pos - run_start);
            }
            largest = largest.max(pos - run_start);
        }
        // A walk that saw every run (it wrapped, or began at the front) leaves none unseen, and
        // knows the largest; one that did not, only those ahead of where it began: what was freed
        // behind is still to be looked at.
        if wrapped || start <= self.live_prefix {
            self.freed_since_scan = 0;
            self.passed = largest;
        } else {
            self.passed = self.passed.max(largest);
        }
        self.cursor = self.top;
        self.limit = self.top;
        self.tail = false;
        false
    }

    /// Makes the never-carved tail `[top, capacity)` the current hole: up to the end of what
    /// is resident already when the request fits there (the next walk then looks for freed
    /// memory before touching more), else the request and a grant of untouched memory.
    fn take_tail(&mut self, need: usize) -> bool {
        self.cursor = self.top;
        let resident = self.dirty_end.max(self.prefaulted);
        let end = self.top.saturating_add(need);
        self.limit = if end <= resident { resident } else { end.saturating_add(TAIL_GRANT) }.min(self.capacity);
        self.tail = true;
        true
    }

    /// Takes a block back.
    ///
    /// # Safety
    /// `header` points to the live header of a block this region handed out, and no reference
    /// to that header is alive.
    #[inline(always)]
    pub unsafe fn release(&mut self, header: NonNull<BlockHeader>) {
        // SAFETY: the caller guarantees a live header of this region, not otherwise borrowed;
        // the region's mapping (and so the header) outlives this call.
        let h = unsafe { &mut *header.as_ptr() };
        debug_assert!(h.is_live() && h.region == self.id);
        let off = (header.as_ptr() as usize) - self.meta.as_ptr() as usize;
        let (slot, class) = (h.slot, h.class as usize);
        self.live_blocks -= 1;
        h.magic = MAGIC_FREE;
        self.poison(off + HEADER, slot - HEADER);
        self.live_prefix = self.live_prefix.min(off);
        // Its memory was used: a zeroed request served from it must be written.
        self.dirty_end = self.dirty_end.max(off + slot);
        if off + slot == self.cursor {
            // The block ends where the hole begins (typically the last one carved): the hole
            // grows back over it, which needs no header inside the hole.
            self.cursor = off;
            if class >= ORDERED {
                self.hole_joins_back();
            }
        } else {
            self.freed_since_scan += slot;
            self.keep(off, slot, class);
        }
    }

    /// The hole grew back over a large block: the listed run before it (across free blocks)
    /// joins it too, so that the cycle's next large requests carve there before further on.
    #[cold]
    #[inline(never)]
    fn hole_joins_back(&mut self) {
        if self.lists.is_none() {
            return;
        }
        let prev = self.ordered_before(self.cursor);
        let start = self.free_back_to(prev, self.cursor);
        if start != self.cursor {
            self.unlist(start, ORDERED);
            self.cursor = start;
        }
    }

    /// Rewinds at a cycle end. With nothing live this is O(1); otherwise the next allocation
    /// walks from the start around the pinned blocks.
    pub fn rewind(&mut self) {
        if self.live_blocks == 0 {
            self.dirty_end = self.carved_end();
            self.top = 0;
            self.take_tail(0);
            self.freed_since_scan = 0;
            self.passed = 0;
            self.live_prefix = 0;
            if let Some(l) = self.lists.as_deref_mut() {
                l.clear();
            }
        } else if self.lists.is_none() {
            self.close_hole();
            self.cursor = self.live_prefix;
            self.limit = self.live_prefix;
            self.tail = false;
        }
        // With free lists and blocks still live, the next cycle takes the freed blocks from the
        // lists and goes on from the hole: nothing to do.
    }

    /// Calls `f(offset, slot, requested, generation)` for each live block, in address order
    /// (`offset` of its header). O(blocks): for snapshots and refusals, never on the hot path.
    pub fn each_live(&self, mut f: impl FnMut(usize, usize, usize, u64)) {
        let chain_end = if self.tail { self.cursor } else { self.top };
        let (hole_lo, hole_hi) = if self.tail { (self.cursor, self.cursor) } else { (self.cursor, self.limit) };
        let mut pos = 0;
        while pos < chain_end {
            if pos == hole_lo && hole_lo < hole_hi {
                pos = hole_hi;
                continue;
            }
            let h = self.header_at(pos);
            if !self.plausible(pos, h) {
                return;
            }
            if h.is_live() {
                f(pos, h.slot, h.requested, h.generation);
            }
            pos += h.slot;
        }
    }

    /// The largest run of memory between live blocks (headers included), the hole and the
    /// never-carved tail among them, and the end of the last live block (0 with none live): what
    /// a refusal says of the region. O(blocks).
    pub fn free_runs(&self) -> (usize, usize) {
        let (mut end, mut largest) = (0, 0);
        self.each_live(|pos, slot, _, _| {
            largest = largest.max(pos - end);
            end = pos + slot;
        });
        (largest.max(self.capacity - end), end)
    }

    /// Walks the whole chain and checks the region's invariants; panics on a violation. Returns
    /// the slot bytes of the live blocks. For tests: O(blocks).
    #[doc(hidden)]
    pub fn verify(&self) -> usize {
        let chain_end = if self.tail { self.cursor } else { self.top };
        let (hole_lo, hole_hi) = if self.tail { (self.cursor, self.cursor) } else { (self.cursor, self.limit) };
        assert!(self.live_prefix <= chain_end, "live prefix beyond the chain end");
        assert!(self.cursor <= self.limit && self.limit <= self.capacity);
        let (mut pos, mut live, mut bytes, mut listed) = (0, 0, 0, 0);
        while pos < chain_end {
            if pos == hole_lo && hole_lo < hole_hi {
                pos = hole_hi;
                continue;
            }
            let h = self.header_at(pos);
            assert!(self.plausible(pos, h), "corrupt chain at {pos}");
            assert!([MAGIC_LIVE, MAGIC_FREE, MAGIC_LISTED, MAGIC_HOT].contains(&h.magic), "bad magic at {pos}");
            if pos < self.live_prefix {
                assert!(h.is_live(), "free block at {pos} inside the live prefix {}", self.live_prefix);
            }
            if h.is_live() {
                live += 1;
                bytes += h.slot;
            }
            if self.is_listed(pos) || h.magic == MAGIC_HOT {
                listed += h.slot;
            }
            pos += h.slot;
        }
        assert_eq!(pos.max(chain_end), chain_end, "chain overruns its end");
        assert_eq!(live, self.live_blocks, "live count disagrees with the chain");
        if let Some(l) = self.lists.as_deref() {
            let mut on_lists = 0;
            for c in 0..CLASSES {
                assert_eq!(l.nonempty.contains(c), l.heads[c] != NONE, "class {c}: set and head disagree");
                let (mut at, mut prev) = (if l.nonempty.contains(c) { l.heads[c] } else { NONE }, NONE);
                while at != NONE {
                    assert!(at < chain_end && self.is_listed(at), "class {c}: {at} is not a listed block");
                    let h = self.header_at(at);
                    assert_eq!(list_of(h.slot), c, "block {at} on the wrong list");
                    assert_eq!(h.generation as usize, prev, "block {at}: broken back link");
                    on_lists += h.slot;
                    (prev, at) = (at, h.requested);
                }
            }
            for c in 0..CLASSES {
                if l.hot[c] != NONE {
                    assert!(l.hot_set.contains(c), "class {c}: a hot block outside the hot set");
                    let h = self.header_at(l.hot[c]);
                    assert!(h.magic == MAGIC_HOT && slot_class(h.slot) == c, "class {c}: a bad hot block");
                    on_lists += h.slot;
                }
            }
            assert_eq!(on_lists, listed, "listed blocks in the chain and on the lists disagree");
            assert_eq!(on_lists, l.bytes, "listed bytes disagree");
        }
        bytes
    }

    /// Retires the region (a larger one replaces it, or its workspace is destroyed) while blocks
    /// in it live: no more allocation happens here, so the pages of its free runs go back to the
    /// system and only pages under live blocks stay resident. O(blocks), once.
    pub fn retire(&mut self) {
        self.freed_since_scan = 0;
        self.passed = 0;
        if let Some(l) = self.lists.as_deref_mut() {
            // Nothing is allocated here any more: listed blocks are plain free memory.
            l.clear();
        }
        self.close_hole();
        let page = crate::backend::page_bytes();
        // Nothing is carved here again: a page the system kept is only memory not given back.
        let discard = |r: &Self, from, to| {
            let _ = r.discard_pages(from, to);
        };
        let mut pos = 0;
        while pos < self.top {
            let h = self.header_at(pos);
            if !self.plausible(pos, h) {
                return;
            }
            if h.is_live() {
                pos += h.slot;
                continue;
            }
            let run_start = pos;
            let Some(end) = self.free_run_end(pos) else { return };
            pos = end;
            if pos >= self.top {
                self.top = run_start;
                break;
            }
            // One header for the whole run keeps the chain walkable; the rest may go.
            self.write_free_header(run_start, pos - run_start);
            discard(self, run_start + HEADER, pos);
        }
        discard(self, self.top, self.capacity);
        // Nothing is carved here any more.
        self.dirty_end = self.dirty_end.min(self.top.next_multiple_of(page));
        self.cursor = self.top;
        self.limit = self.top;
        self.tail = false;
    }
}

impl Drop for ArenaRegion {
    fn drop(&mut self) {
        // The addresses may be mapped again by anyone: nothing of them stays poisoned.
        self.unpoison(0, self.mapped);
        // SAFETY: the region was mapped by `backend` with `mapped` bytes and is released once,
        // here; the owning workspace drops a region only when no block in it is live, or when
        // the workspace itself is dropped (its contract: all blocks released first).
        unsafe { self.backend.unmap(self.data, self.mapped) };
        if self.meta != self.data {
            // SAFETY: the header mapping was made by `AnonymousMemory` for this region, released
            // once, here.
            unsafe { AnonymousMemory.unmap(self.meta, self.mapped) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::HeapMemory;
    use crate::classes::class_of;

    const CAP: usize = 64 << 10;

    fn region(lists: bool) -> ArenaRegion {
        ArenaRegion::new(1, 7, CAP, Arc::new(HeapMemory), lists).expect("memory for a test region")
    }

    fn take(r: &mut ArenaRegion, size: usize) -> Option<NonNull<u8>> {
        let class = class_of(size).unwrap();
        r.take(class, class_size(class) + HEADER, size, 0).map(|(p, _, _)| p)
    }

    fn free(r: &mut ArenaRegion, p: NonNull<u8>) {
        let h = r.header_at_data(p).expect("a block of the region");
        // SAFETY: the live header of a block of `r`.
        unsafe { r.release(h) };
    }

    #[test]
    fn blocks_tile_the_region_and_a_rewind_starts_over() {
        for lists in [true, false] {
            let mut r = region(lists);
            let a = take(&mut r, 1000).unwrap();
            let b = take(&mut r, 3000).unwrap();
            assert_eq!(a.as_ptr() as usize % BLOCK_ALIGN, 0);
            assert!(b > a && r.live_blocks() == 2);
            // SAFETY: a live header written by `take`.
            let h = unsafe { r.header_at_data(a).unwrap().as_ref() };
            assert_eq!((h.owner, h.region, h.requested, h.kind), (7, 1, 1000, BlockKind::Arena));
            assert!(r.header_at_data(NonNull::new(a.as_ptr().wrapping_add(8)).unwrap()).is_none(), "not a boundary");
            free(&mut r, a);
            free(&mut r, b);
            assert_eq!(r.verify(), 0, "lists {lists}: nothing live");
            r.rewind();
            assert_eq!(take(&mut r, 1000), Some(a), "lists {lists}: a rewound region starts at its base");
        }
    }

    #[test]
    fn a_merged_run_at_most_an_eighth_larger_is_snug_as_a_block_of_the_next_class_up() {
        let mut r = ArenaRegion::new(1, 7, 8 << 20, Arc::new(HeapMemory), true).expect("a test region");
        let slot = |size| class_size(class_of(size).unwrap()) + HEADER;
        // A 208 KiB block and five blocks of 3.25 KiB after it (of a class placed wherever it
        // falls), freed: one run of 224.6 KiB and six headers, more than a block of the next
        // class up (224 KiB and one header) and under an eighth more than a 208 KiB request. A
        // 208 KiB block lies free higher up.
        let low = take(&mut r, 200 << 10).unwrap();
        let small: Vec<_> = (0..5).map(|_| take(&mut r, 3300).unwrap()).collect();
        let _fence = take(&mut r, 1000).unwrap();
        let high = take(&mut r, 200 << 10).unwrap();
        let _fence = take(&mut r, 1000).unwrap();
        for p in small {
            free(&mut r, p);
        }
        free(&mut r, low);
        free(&mut r, high);
        assert_eq!(r.listed_bytes(), 2 * slot(200 << 10) + 5 * slot(3300), "the run merged whole");
        // The lowest snug block is taken: the run, before the exact block above it.
        assert_eq!(take(&mut r, 200 << 10), Some(low), "the merged run, snug");
        assert_eq!(take(&mut r, 200 << 10), Some(high));
        r.verify();
    }

    #[test]
    fn blocks_of_4_to_128_kib_start_their_data_512_bytes_or_more_into_a_page() {
        // A 16 KiB matrix-vector product's output written while the rows of a large array are
        // read, 4 KiB apart: stores 16 to 192 bytes behind the rows' page offset (0, or 16 where
        // the C heap maps the array) alias their loads, and the product ran a sixth slower.
        let mut r = ArenaRegion::new(1, 7, 8 << 20, Arc::new(HeapMemory), true).expect("a test region");
        let mut live = Vec::new();
        for (i, size) in [4096, 16 << 10, 100, 4000, 5000, 16 << 10, 1000, 60 << 10, 4096, 120 << 10]
            .iter()
            .cycle()
            .take(200)
            .enumerate()
        {
            let p = take(&mut r, *size).expect("room");
            let at = p.as_ptr() as usize % 4096;
            if *size >= 4000 {
                assert!(at >= 512, "block {i} of {size} bytes {at} bytes into its page");
            }
            live.push(p);
        }
        // The fillers are free memory: freed, everything merges back.
        for p in live {
            free(&mut r, p);
        }
        r.verify();
    }

    #[test]
    fn a_large_request_takes_a_snug_free_block_else_the_smallest_that_holds_it() {
        let mut r = ArenaRegion::new(1, 7, 8 << 20, Arc::new(HeapMemory), true).expect("a test region");
        let slot = |size| class_size(class_of(size).unwrap()) + HEADER;
        // Free blocks of 512 KiB, 256 KiB and 176 KiB apart, freed high one first: the list keeps
        // address order.
        let a = take(&mut r, 512 << 10).unwrap();
        let _fence = take(&mut r, 1000).unwrap();
        let b = take(&mut r, 256 << 10).unwrap();
        let _fence = take(&mut r, 1000).unwrap();
        let c = take(&mut r, 176 << 10).unwrap();
        let _fence = take(&mut r, 1000).unwrap();
        for p in [c, b, a] {
            free(&mut r, p);
        }
        // 160 KiB: the 176 KiB block is of the next class up, snug, taken though it lies highest.
        assert_eq!(take(&mut r, 160 << 10), Some(c), "the snug block");
        // 200 KiB: none snug; the smallest that holds it, not the lowest.
        assert_eq!(take(&mut r, 200 << 10), Some(b), "the smallest block that holds it");
        // 128 KiB: the front of the last one, before any new memory.
        assert_eq!(take(&mut r, 128 << 10), Some(a), "the front of the one left");
        assert_eq!(r.verify(), slot(160 << 10) + slot(200 << 10) + slot(128 << 10) + 3 * slot(1000));
        assert_eq!(r.listed_bytes(), slot(512 << 10) - slot(128 << 10), "its rest listed");
        // A block freed where a listed one begins joins it: the front taken, freed again, makes
        // the block whole.
        let front = a;
        free(&mut r, front);
        assert_eq!(r.listed_bytes(), slot(512 << 10), "whole again, counted once");
        assert_eq!(take(&mut r, 512 << 10), Some(a));
        r.verify();
        // Below 128 KiB a request keeps to its own class: a free block one class up stays free.
        let (small, small_up) = (100 << 10, 110 << 10);
        assert_eq!(class_of(small_up), class_of(small).map(|c| c + 1));
        let d = take(&mut r, small_up).unwrap();
        let _fence = take(&mut r, 1000).unwrap();
        free(&mut r, d);
        assert_ne!(take(&mut r, small).unwrap(), d);
        assert_eq!(take(&mut r, small_up), Some(d), "still free for its own class");
        r.verify();
    }

    #[test]
    fn a_freed_large_block_merges_across_the_free_blocks_around_it() {
        let mut r = ArenaRegion::new(1, 7, 8 << 20, Arc::new(HeapMemory), true).expect("a test region");
        // A large block, a small one, the filler that page-aligns the next large block, that
        // block, and a live fence.
        let a = take(&mut r, 256 << 10).unwrap();
        let s = take(&mut r, 1000).unwrap();
        let b = take(&mut r, 256 << 10).unwrap();
        let fence = take(&mut r, 1000).unwrap();
        let fence_at = fence.as_ptr() as usize - HEADER;
        let a_at = a.as_ptr() as usize - HEADER;
        // The small block goes to its hot slot; the large one after it takes it and the filler.
        free(&mut r, s);
        free(&mut r, a);
        assert_eq!(r.listed_bytes(), b.as_ptr() as usize - HEADER - a_at, "the small block and the filler joined");
        // The second large block joins the run before it, across nothing now.
        free(&mut r, b);
        assert_eq!(r.listed_bytes(), fence_at - a_at, "one run from the first block to the fence");
        r.verify();
        // A request as large as the whole run finds it, rather than memory not touched yet.
        assert_eq!(take(&mut r, fence_at - a_at - HEADER - 4096), Some(a));
        assert_eq!(r.listed_bytes(), 0);
        // The small block was taken off its hot slot: its class carves anew.
        assert_ne!(take(&mut r, 1000), Some(s));
        r.verify();
    }

    #[test]
    fn a_large_block_freed_against_the_hole_takes_the_run_before_it_along() {
        let mut r = ArenaRegion::new(1, 7, 8 << 20, Arc::new(HeapMemory), true).expect("a test region");
        let pin = take(&mut r, 1000).unwrap();
        let a = take(&mut r, 256 << 10).unwrap();
        let s = take(&mut r, 1000).unwrap();
        let b = take(&mut r, 256 << 10).unwrap();
        free(&mut r, s);
        free(&mut r, a);
        assert!(r.listed_bytes() > 0);
        // The last block carved: the hole grows back over it, and over the listed run before it.
        free(&mut r, b);
        assert_eq!(r.listed_bytes(), 0, "nothing left listed");
        assert_eq!(r.verify(), slot_for(1000).unwrap(), "the pin alone");
        assert_eq!(take(&mut r, 512 << 10), Some(a), "carved where the first block was");
        free(&mut r, pin);
        r.verify();
    }

    #[test]
    fn a_run_a_walk_passes_over_goes_on_the_large_list() {
        // Two runs of 45 small free blocks (of a class placed wherever it falls) between live
        // fences, in a region whose tail is full: a request larger than either walks over both
        // and is refused.
        let (small, count) = (3000, 45);
        let mut r = ArenaRegion::new(1, 7, 1 << 20, Arc::new(HeapMemory), true).expect("a test region");
        let mut runs = Vec::new();
        for _ in 0..2 {
            let run: Vec<_> = (0..count).map(|_| take(&mut r, small).unwrap()).collect();
            let _fence = take(&mut r, 1000).unwrap();
            runs.push(run);
        }
        while take(&mut r, 64 << 10).is_some() {}
        while take(&mut r, 1000).is_some() {}
        for p in runs.iter().flatten() {
            free(&mut r, *p);
        }
        let run = count * slot_for(small).unwrap();
        assert!(run >= ORDERED_MIN_SLOT);
        assert_eq!(take(&mut r, run + 4096), None, "no run holds it");
        // The walk merged each run and listed it, where a large request finds it at once.
        assert_eq!(r.listed_bytes(), 2 * run, "both runs listed whole");
        let p = take(&mut r, 128 << 10).expect("a listed run holds it").as_ptr() as usize;
        let first = runs[0][0].as_ptr() as usize - HEADER;
        assert!((first..first + run).contains(&p), "from the first run, at its front");
        assert!(p - first < 4096 + HEADER, "at its front");
        r.verify();
    }

    #[test]
    fn the_rest_of_a_cut_block_never_merges_back_over_the_block_carved() {
        // The rest of a listed block cut for a request goes back on the list before the block
        // carved from it has its header: merged backwards, it would read the bytes there (here the
        // free header the same class left at that place) and grow over the block.
        let mut r = ArenaRegion::new(1, 7, 954_368, Arc::new(HeapMemory), true).expect("a test region");
        let _pin = take(&mut r, 1000).unwrap();
        let b = take(&mut r, 512 << 10).unwrap();
        let s = take(&mut r, 1000).unwrap();
        let y = take(&mut r, 256 << 10).unwrap();
        let u = take(&mut r, 1000).unwrap();
        let t = take(&mut r, 128 << 10).unwrap();
        let _fence = take(&mut r, 1000).unwrap();
        for p in [b, y, t] {
            free(&mut r, p);
        }
        // A walk makes the first large block's run the hole, for a request the tail cannot hold.
        let _z = take(&mut r, 30_000).unwrap();
        free(&mut r, s);
        free(&mut r, u);
        // A walk for a request nothing holds lists the hole's rest and the run from `s` on.
        assert_eq!(take(&mut r, 600 << 10), None);
        r.verify();
        let y2 = take(&mut r, 256 << 10).unwrap();
        assert_eq!(y2, y, "cut from the run, after a filler, where the same class lay before");
        r.verify();
        if let Some(w) = take(&mut r, 600 << 10) {
            let (w, y2) = (w.as_ptr() as usize, y2.as_ptr() as usize);
            assert!(w + (600 << 10) + HEADER <= y2 || y2 + (256 << 10) + HEADER <= w, "memory handed out twice");
        }
        r.verify();
    }

    #[test]
    #[cfg_attr(miri, ignore = "hundreds of thousands of steps")]
    fn random_takes_frees_and_rewinds_keep_blocks_disjoint_intact_and_the_chain_whole() {
        // Small, medium and large requests freed in random order, with rewinds while blocks live,
        // in regions small enough that walks, merges, the hole growing back and refusals are
        // frequent. After every step the chain verifies; blocks never overlap and keep their
        // bytes.
        for seed in 1..=20u64 {
            let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut next = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            let cap = [2 << 20, 6 << 20, 16 << 20][seed as usize % 3];
            let mut r = ArenaRegion::new(1, 7, cap, Arc::new(HeapMemory), true).expect("a test region");
            let mut live: Vec<(usize, usize, u8)> = Vec::new();
            for step in 0..1000 {
                match next() % 16 {
                    0..=7 => {
                        let size = match next() % 4 {
                            0 => 64 + next() % 4000,
                            1 => 4096 + next() % 126_000,
                            2 => (128 << 10) + next() % (384 << 10),
                            _ => (512 << 10) + next() % (1 << 20),
                        } as usize;
                        if let Some(p) = take(&mut r, size) {
                            let tag = (next() % 255 + 1) as u8;
                            // SAFETY: `size` bytes at `p` were just handed out.
                            unsafe { std::ptr::write_bytes(p.as_ptr(), tag, size) };
                            live.push((p.as_ptr() as usize, size, tag));
                        }
                    }
                    8..=14 if !live.is_empty() => {
                        let (p, size, tag) = live.swap_remove((next() % live.len() as u64) as usize);
                        // SAFETY: a live block of `size` bytes.
                        let bytes = unsafe { std::slice::from_raw_parts(p as *const u8, size) };
                        assert!(bytes.iter().all(|&b| b == tag), "seed {seed} step {step}: a block changed");
                        free(&mut r, NonNull::new(p as *mut u8).unwrap());
                    }
                    _ => r.rewind(),
                }
                let slots: usize = live
                    .iter()
                    .map(|&(p, _, _)| {
                        let h = r.header_at_data(NonNull::new(p as *mut u8).unwrap()).expect("a block of the region");
                        // SAFETY: the header of a live block of `r`.
                        unsafe { h.as_ref().slot }
                    })
                    .sum();
                assert_eq!(r.verify(), slots, "seed {seed} step {step}: the live slots");
                live.sort_unstable();
                for w in live.windows(2) {
                    assert!(w[0].0 + w[0].1 + HEADER <= w[1].0, "seed {seed} step {step}: blocks overlap");
                }
            }
        }
    }

    #[test]
    fn a_full_region_refuses_and_a_pinned_block_is_walked_around() {
        let mut r = region(false);
        let mut blocks = Vec::new();
        while let Some(p) = take(&mut r, 3000) {
            blocks.push(p);
        }
        assert!(blocks.len() >= CAP / (3072 + HEADER) - 1, "{} blocks", blocks.len());
        // Keep the second block (pinned across the cycle end); the others die.
        let kept = blocks[1];
        for &p in blocks.iter().filter(|&&p| p != kept) {
            free(&mut r, p);
        }
        r.rewind();
        let again: Vec<_> = std::iter::from_fn(|| take(&mut r, 3000)).collect();
        assert_eq!(again.len(), blocks.len() - 1, "every block but the kept one comes back");
        assert!(!again.contains(&kept), "never the memory under the kept block");
        let slot = class_size(class_of(3000).unwrap()) + HEADER;
        assert_eq!(r.verify(), (again.len() + 1) * slot, "the live slots, the kept block's included");
    }

    #[test]
    #[cfg_attr(miri, ignore = "pages of a mapping discarded")]
    fn a_region_resizes_in_place_within_its_mapping() {
        let page = crate::backend::page_bytes();
        let mut r = ArenaRegion::new(1, 7, 16 * page, Arc::new(AnonymousMemory), true).expect("a test region");
        let all: Vec<_> = std::iter::from_fn(|| take(&mut r, 3000)).collect();
        for p in &all {
            // SAFETY: live blocks of 3000 bytes.
            unsafe { std::ptr::write_bytes(p.as_ptr(), 0xAB, 3000) };
        }
        assert!(!r.resize_in_place(4 * page), "a region with live blocks shrinks by a new mapping");
        for &p in &all {
            free(&mut r, p);
        }
        assert!(!r.resize_in_place(32 * page), "never past what it mapped");
        assert!(r.resize_in_place(4 * page));
        assert_eq!((r.capacity(), r.mapped()), (4 * page, 16 * page));
        // The freed blocks' data stays poisoned for AddressSanitizer: read it all the same.
        crate::sanitizer::unpoison(r.data.as_ptr().wrapping_add(4 * page), 12 * page);
        // SAFETY: inside the mapping; the pages above the capacity went back, and read as zeros.
        assert!((4 * page..16 * page).step_by(page / 2).all(|off| unsafe { *r.data.as_ptr().add(off) } == 0));
        let small: Vec<_> = std::iter::from_fn(|| take(&mut r, 3000)).collect();
        let end = r.data.as_ptr() as usize + 4 * page;
        assert!(small.len() < all.len() / 3 && small.iter().all(|p| p.as_ptr() as usize + 3000 <= end));
        assert!(r.resize_in_place(16 * page), "it grows back where it is, its blocks live");
        let more: Vec<_> = std::iter::from_fn(|| take(&mut r, 3000)).collect();
        assert_eq!(small.len() + more.len(), all.len(), "the whole mapping serves again");
        for p in small.into_iter().chain(more) {
            free(&mut r, p);
        }
        assert_eq!(r.verify(), 0);
    }

    #[test]
    fn ranges_given_back_merge_split_and_stay_few() {
        let mut g = GivenBack::default();
        g.add(100, 200);
        g.add(300, 400);
        g.add(200, 300); // joins both
        assert_eq!((g.n, g.ranges[0]), (1, (100, 400)));
        g.remove(150, 250); // splits
        assert!(g.overlaps(100, 151) && !g.overlaps(150, 250) && g.overlaps(249, 260));
        g.remove(0, 1000);
        assert_eq!(g.n, 0);
        // More ranges than it keeps: the nearest merge, and every offset added stays covered.
        for k in 0..20 {
            g.add(k * 1000, k * 1000 + 10);
        }
        assert!(g.n <= g.ranges.len());
        assert!((0..20).all(|k| g.overlaps(k * 1000, k * 1000 + 10)));
        assert!(!g.overlaps(20_000, 30_000));
        // No room to split a range: it stays whole (it only costs a question).
        assert_eq!(g.n, g.ranges.len());
        g.remove(5, 6);
        assert!(g.overlaps(5, 6) && g.overlaps(0, 5) && g.overlaps(6, 10), "{g:?}");
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri has no mincore: no page is known resident")]
    fn a_large_block_on_memory_not_resident_gives_back_as_much_idle_free_memory_highest_first() {
        const MIB: usize = 1 << 20;
        let page = crate::backend::page_bytes();
        let mut r = ArenaRegion::new(1, 7, 256 * MIB, Arc::new(AnonymousMemory), true).expect("a test region");
        let resident = crate::backend::resident_bytes;
        let write = |p: NonNull<u8>, len: usize| {
            // SAFETY: a live block of `len` bytes.
            unsafe { std::ptr::write_bytes(p.as_ptr(), 0xAB, len) };
        };
        let take_at = |r: &mut ArenaRegion, size: usize| {
            let class = class_of(size).unwrap();
            r.take(class, class_size(class) + HEADER, size, 0).unwrap()
        };
        // Two 40 MiB runs, resident and free, fenced apart: idle.
        let (low, _, _) = take_at(&mut r, 40 * MIB);
        let _fence = take(&mut r, 1000).unwrap();
        let (high, _, _) = take_at(&mut r, 40 * MIB);
        let _fence = take(&mut r, 1000).unwrap();
        for p in [low, high] {
            write(p, 40 * MIB);
            free(&mut r, p);
        }
        assert_eq!((resident(low, 40 * MIB), resident(high, 40 * MIB)), (40 * MIB, 40 * MIB));
        // A 48 MiB block (no run holds it) carved from the tail, never touched: the higher run
        // goes back whole, then the top 8 MiB of the lower one.
        let (big, slot, off) = take_at(&mut r, 48 * MIB);
        assert!(big > high, "carved beyond both runs");
        // (Transparent huge pages may have made its first pages resident with the fence's.)
        let absent = 48 * MIB - resident(big, 48 * MIB);
        assert!(absent > 44 * MIB, "{absent}");
        let given = r.give_back_for(off, slot);
        assert!(given.abs_diff(absent) <= 2 * page, "{given} given back for {absent}");
        assert_eq!(resident(high, 40 * MIB), 0, "the higher run first");
        let kept = resident(low, 40 * MIB);
        assert!(kept.abs_diff(80 * MIB - absent) <= 2 * page, "{kept} of the lower run stays");
        assert_eq!(resident(low, kept), kept, "its low end stays, where requests look first");
        // Now resident, freed and taken again: no memory not resident, nothing goes back.
        write(big, 48 * MIB);
        free(&mut r, big);
        let (again, slot, off) = take_at(&mut r, 48 * MIB);
        assert_eq!(again, big);
        assert_eq!(r.give_back_for(off, slot), 0, "a block on resident memory");
        assert_eq!(resident(low, 40 * MIB), kept);
        // The runs still serve, as they were listed.
        assert_eq!(take_at(&mut r, 40 * MIB).0, low);
        assert_eq!(take_at(&mut r, 40 * MIB).0, high);
        r.verify();
    }

    #[test]
    fn a_free_run_too_small_for_one_request_serves_a_smaller_one_after() {
        // Kept blocks with freed ones between them, and the tail too short for what comes: a
        // request larger than any freed run finds nothing, and one that fits a run then finds
        // it, whether the walk for the larger one looked behind (enough was freed for it: two
        // runs) or not (one).
        let (run, big, small) = (300_000, 500_000, 200_000);
        for (freed, rewinds) in [(1, 0), (1, 1), (2, 0), (2, 1)] {
            let blocks = 2 * freed + 1;
            let cap = (blocks * slot_for(run).unwrap() + slot_for(small).unwrap() / 2).next_multiple_of(BLOCK_ALIGN);
            let mut r = ArenaRegion::new(1, 7, cap, Arc::new(HeapMemory), true).expect("a test region");
            let mut kept: Vec<_> = (0..blocks).map(|_| take(&mut r, run).unwrap()).collect();
            // Every other block goes: runs between kept blocks.
            let runs: Vec<_> = (0..freed).map(|k| kept.remove(k + 1)).collect();
            for &q in &runs {
                free(&mut r, q);
            }
            for _ in 0..rewinds {
                r.rewind();
            }
            for _ in 0..2 {
                // Twice: a second walk for it, with nothing freed since, finds nothing either.
                assert_eq!(take(&mut r, big), None, "larger than any free run");
            }
            let p = take(&mut r, small).expect("a freed run holds it");
            let at = p.as_ptr() as usize;
            let inside = |q: &NonNull<u8>| at >= q.as_ptr() as usize && at < q.as_ptr() as usize + run;
            assert!(runs.iter().any(inside), "{freed} runs, {rewinds} rewinds: from a freed run");
            for q in kept.into_iter().chain([p]) {
                free(&mut r, q);
            }
            assert_eq!(r.verify(), 0);
        }
    }
}
