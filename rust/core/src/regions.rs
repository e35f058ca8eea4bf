//! The arena's regions: the current one, where allocation happens, and those retired by a resize
//! or by `destroy` while blocks in them still live. Nothing is allocated in a retired region; its
//! free pages go back to the system as its blocks die, and the region itself with its last
//! block. Region ids are never reused in a workspace, so a header that names a region names
//! that one.
//!
//! The current region also carries what it should pre-fault when the next cycle opens: the part
//! the learned cycles will touch again.

use std::ptr::NonNull;

use crate::arena::{ArenaRegion, BlockHeader};

/// A retired region rescans for free pages to return once this much (and an eighth of it) was
/// freed since the last scan.
const RETIRED_RESCAN: usize = 1 << 20;

#[derive(Debug)]
pub(crate) struct Regions {
    current: Option<ArenaRegion>,
    retired: Vec<ArenaRegion>,
    /// The id of the next region mapped (ids start at 1 and never repeat).
    next_id: u64,
    /// Bytes of the current region to pre-fault when the next cycle opens.
    pending_prefault: usize,
}

/// Where a block's header was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InRegion {
    Current,
    Retired(usize),
}

impl Regions {
    pub fn new() -> Self {
        Regions { current: None, retired: Vec::new(), next_id: 1, pending_prefault: 0 }
    }

    #[inline(always)]
    pub fn current(&self) -> Option<&ArenaRegion> {
        self.current.as_ref()
    }

    #[inline(always)]
    pub fn current_mut(&mut self) -> Option<&mut ArenaRegion> {
        self.current.as_mut()
    }

    /// Every region: the current one first, then the retired ones.
    pub fn iter(&self) -> impl Iterator<Item = &ArenaRegion> {
        self.current.iter().chain(self.retired.iter())
    }

    /// Bytes all regions serve (what they map, less what regions resized in place left above).
    pub fn capacity(&self) -> usize {
        self.iter().map(ArenaRegion::capacity).sum()
    }

    /// Bytes of the current region (0: none).
    pub fn current_capacity(&self) -> usize {
        self.current.as_ref().map_or(0, ArenaRegion::capacity)
    }

    /// Whether the current region exists and holds no live block (it may be dropped whole).
    pub fn current_is_empty(&self) -> bool {
        self.current.as_ref().is_some_and(|r| r.live_blocks() == 0)
    }

    pub fn live_blocks(&self) -> usize {
        self.iter().map(ArenaRegion::live_blocks).sum()
    }

    pub fn contains(&self, addr: usize) -> bool {
        self.iter().any(|r| r.contains(addr as *const u8))
    }

    /// The header in front of `p` when `p` lies on a block boundary of one of the regions, and
    /// where: memory the workspace still maps, whatever the header says.
    pub fn header_of(&self, p: NonNull<u8>) -> Option<(NonNull<BlockHeader>, InRegion)> {
        if let Some(h) = self.current.as_ref().and_then(|r| r.header_at_data(p)) {
            return Some((h, InRegion::Current));
        }
        self.retired.iter().enumerate().find_map(|(i, r)| r.header_at_data(p).map(|h| (h, InRegion::Retired(i))))
    }

    /// The region at `at`.
    pub fn get(&self, at: InRegion) -> &ArenaRegion {
        match at {
            InRegion::Current => self.current.as_ref().expect("a current region"),
            InRegion::Retired(i) => &self.retired[i],
        }
    }

    /// A fresh id for the next region.
    pub fn take_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    pub fn skip_ids(&mut self, n: u64) {
        self.next_id += n;
    }

    /// Whether a region with live blocks could be retired now without allocating (room for one
    /// more in the list of retired regions).
    pub fn reserve_retirement(&mut self) -> bool {
        self.retired.try_reserve(1).is_ok()
    }

    /// Takes out the current region, which holds no live block, with what it was to pre-fault.
    pub fn take_empty_current(&mut self) -> Option<(ArenaRegion, usize)> {
        let r = self.current.take_if(|r| r.live_blocks() == 0)?;
        Some((r, std::mem::take(&mut self.pending_prefault)))
    }

    /// Drops the current region, which holds no live block.
    pub fn drop_empty_current(&mut self) {
        debug_assert!(self.current_is_empty());
        self.current = None;
    }

    /// Makes `region` the current one, whose first `prefault` bytes are pre-faulted when the
    /// next cycle opens; the old one is dropped, or retired while blocks in it live (the caller
    /// reserved room for that with [`Regions::reserve_retirement`]).
    pub fn install(&mut self, region: ArenaRegion, prefault: usize) {
        self.pending_prefault = prefault.min(region.capacity());
        if let Some(old) = self.current.replace(region) {
            self.retire(old);
        }
    }

    fn retire(&mut self, mut old: ArenaRegion) {
        if old.live_blocks() > 0 {
            old.retire();
            // Room was reserved: a push past it would allocate, so a full list (which the
            // callers rule out) keeps the region mapped rather than abort.
            if self.retired.len() < self.retired.capacity() {
                self.retired.push(old);
            } else {
                std::mem::forget(old);
            }
        }
    }

    /// The current region, resized in place, has its first `prefault` bytes pre-faulted when
    /// the next cycle opens.
    pub fn set_prefault(&mut self, prefault: usize) {
        self.pending_prefault = prefault.min(self.current_capacity());
    }

    /// What the next cycle should pre-fault (taken: it is done once).
    pub fn take_prefault(&mut self) -> usize {
        std::mem::take(&mut self.pending_prefault)
    }

    pub fn has_pending_prefault(&self) -> bool {
        self.pending_prefault > 0
    }

    /// Takes a block back into region `at`; a retired region that lost its last block goes back
    /// to the system, and one that freed much since its last scan returns its free pages.
    ///
    /// # Safety
    /// `header` is the live header of a block of the region at `at`, not borrowed.
    pub unsafe fn release(&mut self, header: NonNull<BlockHeader>, at: InRegion) {
        match at {
            InRegion::Current => {
                let r = self.current.as_mut().expect("a current region");
                // SAFETY: forwarded.
                unsafe { r.release(header) };
            }
            InRegion::Retired(i) => {
                let r = &mut self.retired[i];
                // SAFETY: forwarded; the region (and the header in it) stays mapped through this
                // call.
                unsafe { r.release(header) };
                if r.live_blocks() == 0 {
                    // The last block: the region goes back to the system whole.
                    self.retired.swap_remove(i);
                } else if r.freed_since_scan() >= RETIRED_RESCAN.max(r.capacity() / 8) {
                    // Pages freed since the retirement go back too, so that what stays resident
                    // is proportional to what lives.
                    r.retire();
                }
            }
        }
    }

    /// Retires every region (the workspace is destroyed): those without live blocks go back to
    /// the system now, the others with their last block.
    pub fn retire_all(&mut self) {
        self.pending_prefault = 0;
        if let Some(r) = self.current.take() {
            if r.live_blocks() > 0 && self.reserve_retirement() {
                self.retire(r);
            } else if r.live_blocks() > 0 {
                // No room to list it: it stays mapped for its live blocks.
                std::mem::forget(r);
            }
        }
        self.retired.retain(|r| r.live_blocks() > 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arena::HEADER;
    use crate::backend::HeapMemory;
    use crate::classes::{class_of, class_size};
    use std::sync::Arc;

    const CAP: usize = 64 << 10;

    fn region(regions: &mut Regions) -> ArenaRegion {
        ArenaRegion::new(regions.take_id(), 7, CAP, Arc::new(HeapMemory), true).expect("memory for a test region")
    }

    /// A block of `size` bytes from the current region: its data and header.
    fn take(regions: &mut Regions, size: usize, generation: u64) -> (NonNull<u8>, NonNull<BlockHeader>) {
        let class = class_of(size).unwrap();
        let r = regions.current_mut().expect("a current region");
        let (p, _, _) = r.take(class, class_size(class) + HEADER, size, generation).expect("room");
        (p, r.header_at_data(p).expect("a header spot"))
    }

    #[test]
    fn a_freed_block_is_the_next_of_its_class_and_the_region_rewinds() {
        let mut regions = Regions::new();
        let r = region(&mut regions);
        regions.install(r, 4096);
        assert_eq!((regions.take_prefault(), regions.take_prefault()), (4096, 0), "pre-faulted once");
        let (p, h) = take(&mut regions, 1000, 0);
        let (q, _) = take(&mut regions, 1000, 0);
        assert_ne!(p, q);
        let (hp, at) = regions.header_of(p).expect("in the region");
        assert_eq!((hp, at), (h, InRegion::Current));
        // SAFETY: the live header of a block of the current region.
        unsafe { regions.release(h, InRegion::Current) };
        let current = regions.current().unwrap();
        assert_eq!(current.listed_bytes(), class_size(class_of(1000).unwrap()) + HEADER);
        assert_eq!(take(&mut regions, 1000, 0).0, p, "the most recently freed block of the class");
        assert_eq!(regions.live_blocks(), 2);
        assert!(regions.contains(p.as_ptr() as usize) && !regions.contains(p.as_ptr() as usize + CAP));
    }

    #[test]
    fn a_replaced_region_is_retired_while_blocks_live_and_released_with_the_last() {
        let mut regions = Regions::new();
        let first = region(&mut regions);
        let first_id = first.id();
        regions.install(first, 0);
        let (p, h) = take(&mut regions, 5000, 0);
        assert!(regions.reserve_retirement());
        let second = region(&mut regions);
        assert_ne!(second.id(), first_id, "ids are never reused");
        regions.install(second, 0);
        assert_eq!(regions.capacity(), 2 * CAP, "the old region stays under its live block");
        let (found, at) = regions.header_of(p).expect("still found");
        assert_eq!((found, at), (h, InRegion::Retired(0)));
        assert_eq!(regions.get(at).id(), first_id);
        // SAFETY: the live header of the retired region's one block.
        unsafe { regions.release(h, at) };
        assert_eq!(regions.capacity(), CAP, "released with its last block");
        assert!(regions.header_of(p).is_none(), "an address of a released region is no block of ours");
        regions.retire_all();
        assert_eq!(regions.capacity(), 0, "an empty current region goes back at once");
    }
}
