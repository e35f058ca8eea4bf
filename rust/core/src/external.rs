//! Blocks of their own: what a workspace serves outside its arena (learning cycles, spills,
//! `helper_min_size`, the bypass modes), each a block from the backend's block allocator with a
//! header, and the cache that recycles them by size class.
//!
//! A freed external block goes on the LIFO list of its class, as a caching allocator keeps
//! them, instead of going back to the C heap (and, for large blocks, to the system) between
//! uses: the next request of its class takes it, warm, with no system call and no page fault.
//! What the cache may hold is bounded by the workspace ([`BlockCache::shrink_to`]); classes
//! unused for a few cycles go back to the system.
//!
//! Where the CPU can touch the memory a header sits in front of its block; otherwise (device
//! memory) the block starts at its data, keeping the driver's alignment, and its header lives on
//! the host, in a table by data address.

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::arena::{write_live_header, BlockHeader, BlockKind, HEADER, MAGIC_FREE};
use crate::backend::Backend;
use crate::classes::{floor_class, ClassSet, CLASSES};

/// A class unused for this many cycles gives its cached blocks back.
const CACHE_CYCLES: u64 = 2;

/// The blocks of their own of one workspace.
#[derive(Debug)]
pub(crate) struct OwnBlocks {
    backend: Arc<dyn Backend>,
    /// Whether headers sit in front of their blocks (the CPU can touch the backend's memory).
    inline: bool,
    /// The token of the workspace the blocks belong to.
    owner: u64,
    /// Headers of blocks whose header cannot sit in front of them, by data address; each
    /// pointer owns its allocation.
    outside: HashMap<usize, NonNull<BlockHeader>>,
    /// The first of the live blocks whose headers sit in front of them (its data; null: none),
    /// huge ones included, linked through their headers' `links`.
    first: *mut u8,
    cache: BlockCache,
}

/// Freed external blocks by class: LIFO lists linked through their headers (`requested` holds
/// the next block's data address, 0 ending the list).
#[derive(Debug)]
struct BlockCache {
    /// The first cached block of each class (its data; null: none), the others linked through
    /// their headers' `links[1]`.
    heads: Box<[*mut u8; CLASSES]>,
    nonempty: ClassSet,
    /// The generation each class was last used in.
    used: Box<[u64; CLASSES]>,
    /// Slot bytes of the cached blocks.
    bytes: usize,
}

impl Drop for OwnBlocks {
    fn drop(&mut self) {
        self.shrink_to(0);
        for (_, h) in self.outside.drain() {
            // SAFETY: each pointer owns a header allocated in `new_block`; reclaimed once, here.
            unsafe { free_header(h) };
        }
    }
}

/// A header on the host for a block whose memory the CPU cannot touch; None when the host has
/// no memory for it (never an abort).
fn alloc_header(h: BlockHeader) -> Option<NonNull<BlockHeader>> {
    let layout = std::alloc::Layout::new::<BlockHeader>();
    // SAFETY: the layout has a non-zero size.
    let p = NonNull::new(unsafe { std::alloc::alloc(layout) }.cast::<BlockHeader>())?;
    // SAFETY: fresh, aligned and large enough for one header.
    unsafe { p.as_ptr().write(h) };
    Some(p)
}

/// # Safety
/// `h` came from `alloc_header` and is released once.
unsafe fn free_header(h: NonNull<BlockHeader>) {
    // SAFETY: the caller's guarantee; the layout is the one it was allocated with.
    unsafe { std::alloc::dealloc(h.as_ptr().cast(), std::alloc::Layout::new::<BlockHeader>()) };
}

impl OwnBlocks {
    pub fn new(backend: Arc<dyn Backend>, owner: u64) -> Self {
        OwnBlocks {
            inline: backend.host_accessible(),
            owner,
            backend,
            outside: HashMap::new(),
            first: std::ptr::null_mut(),
            cache: BlockCache {
                heads: Box::new([std::ptr::null_mut(); CLASSES]),
                nonempty: ClassSet::default(),
                used: Box::new([0; CLASSES]),
                bytes: 0,
            },
        }
    }

    /// A fresh block from the backend for a request of `size` bytes occupying `slot` bytes
    /// (header included), its header written live.
    pub fn new_block(
        &mut self,
        kind: BlockKind,
        size: usize,
        slot: usize,
        zeroed: bool,
        generation: u64,
    ) -> Result<NonNull<u8>, String> {
        let header = BlockHeader::live(kind, self.owner, 0, slot, size, generation);
        if !self.inline {
            // The table has room before the driver is asked: a full table refuses cleanly.
            self.outside.try_reserve(1).map_err(|_| "no host memory for a block header".to_string())?;
            let h = alloc_header(header).ok_or_else(|| "no host memory for a block header".to_string())?;
            let take = slot - HEADER;
            let at = if zeroed { self.backend.alloc_block_zeroed(take) } else { self.backend.alloc_block(take) };
            return match at {
                Ok(at) => {
                    self.outside.insert(at.as_ptr() as usize, h);
                    Ok(at)
                }
                Err(e) => {
                    // SAFETY: allocated just above, never shared.
                    unsafe { free_header(h) };
                    Err(e)
                }
            };
        }
        let at = if zeroed { self.backend.alloc_block_zeroed(slot) } else { self.backend.alloc_block(slot) }?;
        // SAFETY: `at` is a fresh 64-aligned block of `slot >= HEADER` bytes owned by us.
        let p = unsafe { write_live_header(at, kind, self.owner, 0, slot, size, generation) };
        // SAFETY: a block whose header sits in front of it, just made.
        unsafe { self.link(p) };
        Ok(p)
    }

    /// Puts `p` on the list of blocks whose headers sit in front of them.
    ///
    /// # Safety
    /// `p` is a block of this workspace whose header sits in front of it, not on the list, and
    /// stays readable until [`OwnBlocks::unlink`] takes it off.
    pub unsafe fn link(&mut self, p: NonNull<u8>) {
        let first = self.first;
        // SAFETY: the caller's guarantee; the first block's header is ours to write.
        unsafe {
            (*p.sub(HEADER).cast::<BlockHeader>().as_ptr()).links = [std::ptr::null_mut(), first];
            if let Some(f) = NonNull::new(first) {
                (*f.sub(HEADER).cast::<BlockHeader>().as_ptr()).links[0] = p.as_ptr();
            }
        }
        self.first = p.as_ptr();
    }

    /// Takes `p` off the list of blocks whose headers sit in front of them.
    ///
    /// # Safety
    /// `p` is on the list.
    pub unsafe fn unlink(&mut self, p: NonNull<u8>) {
        // SAFETY: blocks on the list are readable and ours (the caller's guarantee for `p`).
        unsafe {
            let [prev, next] = (*p.sub(HEADER).cast::<BlockHeader>().as_ptr()).links;
            match NonNull::new(prev) {
                Some(q) => (*q.sub(HEADER).cast::<BlockHeader>().as_ptr()).links[1] = next,
                None => self.first = next,
            }
            if let Some(q) = NonNull::new(next) {
                (*q.sub(HEADER).cast::<BlockHeader>().as_ptr()).links[0] = prev;
            }
        }
    }

    /// Whether `addr` lies in the data of a live block of this workspace outside its arena
    /// (external and huge blocks; not bypass blocks, which are not workspace memory). O(blocks):
    /// for diagnostics.
    pub fn holds(&self, addr: usize) -> bool {
        let inside = |at: usize, h: &BlockHeader, len: usize| {
            h.is_live() && h.kind != BlockKind::Bypass && at <= addr && addr - at < len
        };
        if !self.inline {
            return self.outside.iter().any(|(&at, h)| {
                // SAFETY: the table owns each header, alive while it is in the table.
                let h = unsafe { h.as_ref() };
                inside(at, h, h.slot - HEADER)
            });
        }
        let mut p = self.first;
        while let Some(q) = NonNull::new(p) {
            // SAFETY: blocks on the list are readable and ours.
            let h = unsafe { &*q.sub(HEADER).cast::<BlockHeader>().as_ptr() };
            if inside(q.as_ptr() as usize, h, h.slot - HEADER) {
                return true;
            }
            p = h.links[1];
        }
        false
    }

    /// The header of a block of its own.
    ///
    /// # Safety
    /// `p` is a live (or cached) block of this table.
    #[inline]
    pub unsafe fn header(&self, p: NonNull<u8>) -> NonNull<BlockHeader> {
        if self.inline {
            // SAFETY: the caller guarantees a block of ours, whose header precedes it.
            return unsafe { p.sub(HEADER).cast() };
        }
        *self.outside.get(&(p.as_ptr() as usize)).expect("a block of this workspace")
    }

    /// The header of `p` if it is a block of this table whose header lives on the host.
    pub fn find_header(&self, p: NonNull<u8>) -> Option<NonNull<BlockHeader>> {
        self.outside.get(&(p.as_ptr() as usize)).copied()
    }

    /// Gives a block back to the backend.
    ///
    /// # Safety
    /// `p` is a block of this table of `slot` bytes that nothing uses any more, released once.
    pub unsafe fn release(&mut self, p: NonNull<u8>, slot: usize) {
        if self.inline {
            // SAFETY: the block is on the list since `new_block`; its header is ours and is
            // released with the block just below.
            unsafe {
                self.unlink(p);
                (*p.sub(HEADER).cast::<BlockHeader>().as_ptr()).magic = 0;
            }
            // SAFETY: the block was allocated by `new_block` with `slot` bytes, its data `HEADER`
            // bytes in; the caller gives it up.
            unsafe { self.backend.free_block(p.sub(HEADER), slot) };
            return;
        }
        if let Some(h) = self.outside.remove(&(p.as_ptr() as usize)) {
            // SAFETY: the table owned it; removed above, so released once.
            unsafe { free_header(h) };
        }
        // SAFETY: the block was allocated by `new_block` with `slot - HEADER` bytes starting at
        // its data; the caller gives it up.
        unsafe { self.backend.free_block(p, slot - HEADER) };
    }

    /// A cached block that serves class `class` (its header says free; the caller rewrites it
    /// live), and its slot.
    #[inline]
    pub fn take_cached(&mut self, class: usize, generation: u64) -> Option<(NonNull<u8>, usize)> {
        if !self.cache.nonempty.contains(class) {
            return None;
        }
        self.cache.used[class] = generation;
        Some(self.pop(class))
    }

    /// Takes the first block off the (non-empty) list of `class`; a block whose header sits in
    /// front of it goes back on the list of blocks of their own.
    fn pop(&mut self, class: usize) -> (NonNull<u8>, usize) {
        let p = NonNull::new(self.cache.heads[class]).expect("a listed block");
        let (next, slot) = {
            // SAFETY: a cached block of ours; the borrow ends in this block.
            let h = unsafe { &mut *self.header(p).as_ptr() };
            let next = std::mem::replace(&mut h.links, [std::ptr::null_mut(); 2])[1];
            (next, h.slot)
        };
        self.cache.heads[class] = next;
        if next.is_null() {
            self.cache.nonempty.remove(class);
        }
        self.cache.bytes -= slot;
        if self.inline {
            // SAFETY: on neither list since `put_cached`; readable until released.
            unsafe { self.link(p) };
        }
        (p, slot)
    }

    /// Keeps a freed external block of `slot` bytes for reuse: off the list of blocks of their
    /// own (nothing lives in it), onto the cache's list of its class.
    ///
    /// # Safety
    /// `p` is a block of this table that nothing uses any more, put once.
    pub unsafe fn put_cached(&mut self, p: NonNull<u8>, slot: usize, generation: u64) {
        let class = floor_class(slot - HEADER).expect("blocks hold at least 64 bytes");
        let next = if self.cache.nonempty.contains(class) { self.cache.heads[class] } else { std::ptr::null_mut() };
        if self.inline {
            // SAFETY: a live block of ours whose header sits in front of it: on the list.
            unsafe { self.unlink(p) };
        }
        // SAFETY: a block of ours; its header is ours to write.
        let h = unsafe { &mut *self.header(p).as_ptr() };
        h.magic = MAGIC_FREE;
        h.links = [std::ptr::null_mut(), next];
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
        // SAFETY: taken off the cache just above: nothing else refers to it.
        unsafe { self.release(p, slot) };
    }
}
