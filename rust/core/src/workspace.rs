//! A workspace: one named memory pool with cycles. It owns the current arena region (and regions
//! retired by growth while blocks in them still live), learns how much one cycle needs, sizes the
//! arena from that, spills what the arena cannot hold under its spill policy, and keeps the
//! statistics of the contract exact. All methods take `&mut self`: a binding that frees from
//! several threads puts the workspace behind one lock.
//!
//! What a cycle never touched costs address space, not memory: a region pre-faults at most what
//! the learned cycles used (and never more than [`PREFAULT_LIMIT`]), zeroed requests carved from
//! never-used memory are not written, and huge requests get lazily faulted mappings of their own.
//! A learning (or adaptive) cycle that churns through external memory maps its arena before the
//! cycle ends, so one long cycle is served from reused memory too.

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::arena::{header_of, slot_for, write_live_header, ArenaRegion, BlockHeader, BlockKind, HEADER};
use crate::backend::{available_memory, round_to_page, AnonymousMemory, Backend, FileMappedMemory, BLOCK_ALIGN};
use crate::config::{
    AllocationPolicy, DebugMode, LearningPolicy, LocationPolicy, ResetPolicy, SpillPolicy, WorkspaceConfiguration,
};
use crate::error::Error;

/// Arenas at least this large are rounded to whole 2 MiB huge pages.
const HUGE_ROUND_THRESHOLD: usize = 64 << 20;
const HUGE_PAGE: usize = 2 << 20;

/// The most a region pre-faults when it is mapped; pages beyond fault in on first use.
pub const PREFAULT_LIMIT: usize = 1 << 30;

/// Requests at least this large, and at least half the learned need, are huge: served as
/// mappings of their own (see [`BlockKind::Huge`]) rather than sizing the arena after them.
pub const HUGE_BLOCK_MIN: usize = 64 << 20;

/// Huge mappings kept for reuse once freed, at most.
const HUGE_CACHE_BLOCKS: usize = 8;

/// A cached huge mapping unused for this many cycles is released.
const HUGE_CACHE_CYCLES: u64 = 2;

/// Cycles whose needs the adaptive profile remembers: the arena follows their maximum.
pub const NEED_WINDOW: usize = 8;

/// External bytes a cycle must churn through (and at least twice its peak) before an arena is
/// mapped within the cycle.
const MID_CYCLE_CHURN: usize = 16 << 20;

/// An arena mapped within a cycle serves blocks smaller than this: larger ones come from the C
/// heap until the cycle ends (size-binned and its own mappings, as without rustws), so that an
/// irregular first cycle is never bigger than it is without rustws: a bump arena swept by
/// long-lived large blocks would touch several times what lives. The arena learned at the cycle
/// end serves every size.
const PROVISIONAL_MAX_SLOT: usize = 256 << 10;

/// External bytes a cycle must have served before the block allocator's cache is returned when
/// an arena takes over.
const TRIM_AFTER: usize = 1 << 20;

/// A retired region rescans for free pages to return once this much (and an eighth of it) was
/// freed since the last scan.
const RETIRED_RESCAN: usize = 1 << 20;

impl Drop for Workspace {
    fn drop(&mut self) {
        for (_, h) in self.outside_headers.drain() {
            // SAFETY: each pointer owns a box leaked in `alloc_block`; reclaimed once, here.
            drop(unsafe { Box::from_raw(h.as_ptr()) });
        }
        self.release_huge_cache(|_| true);
    }
}

/// A freed huge mapping kept for reuse.
#[derive(Debug, Clone, Copy)]
struct CachedMapping {
    at: NonNull<u8>,
    len: usize,
    /// The generation of its last use.
    used: u64,
}

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

/// What one cycle left behind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CycleReport {
    /// Whether this exit closed the outermost cycle.
    pub completed: bool,
    /// Blocks allocated in this cycle that are still live (they are now pinned).
    pub escaped_blocks: u64,
    /// Their requested bytes.
    pub escaped_bytes: u64,
}

/// Learns the memory one cycle needs: its peak live footprint plus what escapes it (escaped
/// blocks stay pinned while the next cycle reaches the same peak).
#[derive(Debug, Default, Clone, Copy)]
struct CycleLearner {
    cycles_learned: u64,
    need: usize,
    /// The adaptive profile's recent needs, by generation modulo the window.
    recent: [usize; NEED_WINDOW],
}

/// Where a live block lives, for tests and `owner` lookups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockInfo {
    pub kind: BlockKind,
    pub requested: usize,
    pub generation: u64,
    /// Base address and capacity of the region holding an arena block.
    pub region: Option<(usize, usize)>,
}

/// One workspace.
#[derive(Debug)]
pub struct Workspace {
    name: String,
    config: WorkspaceConfiguration,
    debug: DebugMode,
    backend: Arc<dyn Backend>,
    /// Whether headers sit in front of their blocks (the CPU can touch the backend's memory).
    inline_headers: bool,
    /// Headers of external and bypass blocks when they cannot sit in front of them, by data
    /// address; each pointer owns its box.
    outside_headers: HashMap<usize, NonNull<BlockHeader>>,
    region: Option<ArenaRegion>,
    retired: Vec<ArenaRegion>,
    next_region_id: u32,
    depth: u32,
    generation: u64,
    learner: CycleLearner,
    initialized: bool,
    destroyed: bool,
    grow_at_cycle_end: bool,
    /// Huge requests get mappings of their own (host memory the workspace maps itself).
    huge_blocks: bool,
    huge_cache: Vec<CachedMapping>,
    /// Live huge mappings: their total length.
    huge_live_len: usize,
    /// External slot bytes served in the open cycle since the last region was mapped.
    cycle_churn: usize,
    /// The largest slot the current region serves: unlimited but while it is provisional.
    arena_max_slot: usize,
    /// Bytes of external blocks served in the open cycle (for returning the block allocator's
    /// cache once an arena takes over).
    cycle_heap_bytes: usize,
    /// Bytes pre-faulted synchronously, in total.
    prefaulted_bytes: u64,
    /// Bytes of the current region to pre-fault when the next cycle opens.
    pending_prefault: usize,
    // The hot path keeps only these; everything else is derived (see `stats`, `exit`).
    /// Slot bytes (headers and padding included) of live blocks, arena and external.
    live_slot_bytes: usize,
    /// Requested bytes of live arena blocks.
    used_bytes: u64,
    cycle_slot_peak: usize,
    cycle_peak_bytes: u64,
    last_cycle_peak_bytes: u64,
    // Updated off the hot path: spills, and frees of blocks from earlier cycles.
    external_bytes: u64,
    external_slot_bytes: u64,
    external_live_blocks: usize,
    /// Live blocks from earlier cycles: blocks, requested bytes, slot bytes.
    pinned_blocks: usize,
    pinned_bytes: u64,
    pinned_slot_bytes: usize,
    allocation_count: u64,
    spill_count: u64,
    failed_allocations: u64,
}

// SAFETY: a workspace exclusively owns its regions and the bookkeeping of the blocks it handed
// out; every access goes through `&mut self`, so it can move between threads.
unsafe impl Send for Workspace {}

impl Workspace {
    /// A workspace over the backend its configuration's location policy names.
    pub fn new(name: impl Into<String>, config: WorkspaceConfiguration) -> Result<Self, Error> {
        config.validate()?;
        let backend: Arc<dyn Backend> = match config.policy_location {
            LocationPolicy::Ram => Arc::new(AnonymousMemory),
            LocationPolicy::Mmap => {
                Arc::new(FileMappedMemory::new(config.temp_file_path.clone().expect("validated: MMAP has a path")))
            }
        };
        Self::with_backend(name, config, backend)
    }

    /// A workspace over an explicit backend (device memory, a limit adaptor, a test stand-in).
    pub fn with_backend(
        name: impl Into<String>,
        config: WorkspaceConfiguration,
        backend: Arc<dyn Backend>,
    ) -> Result<Self, Error> {
        config.validate()?;
        let debug = config.effective_debug_mode();
        let huge_blocks = backend.host_accessible() && config.policy_location == LocationPolicy::Ram;
        let mut ws = Workspace {
            name: name.into(),
            initialized: config.policy_learning == LearningPolicy::None,
            config,
            debug,
            inline_headers: backend.host_accessible(),
            outside_headers: HashMap::new(),
            backend,
            region: None,
            retired: Vec::new(),
            next_region_id: 1,
            depth: 0,
            generation: 0,
            learner: CycleLearner::default(),
            destroyed: false,
            grow_at_cycle_end: false,
            huge_blocks,
            huge_cache: Vec::new(),
            huge_live_len: 0,
            cycle_churn: 0,
            arena_max_slot: usize::MAX,
            cycle_heap_bytes: 0,
            prefaulted_bytes: 0,
            pending_prefault: 0,
            live_slot_bytes: 0,
            used_bytes: 0,
            cycle_slot_peak: 0,
            cycle_peak_bytes: 0,
            last_cycle_peak_bytes: 0,
            external_bytes: 0,
            external_slot_bytes: 0,
            external_live_blocks: 0,
            pinned_blocks: 0,
            pinned_bytes: 0,
            pinned_slot_bytes: 0,
            allocation_count: 0,
            spill_count: 0,
            failed_allocations: 0,
        };
        if ws.config.initial_size > 0 && ws.uses_arena() {
            // Nothing was learned yet: the pages fault in as cycles first touch them.
            let cap = ws.capacity_for(0);
            ws.replace_region(cap, 0)?;
        }
        Ok(ws)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn config(&self) -> &WorkspaceConfiguration {
        &self.config
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The debug mode in force (the environment overrides the configuration).
    pub fn debug_mode(&self) -> DebugMode {
        self.debug
    }

    pub fn is_open(&self) -> bool {
        self.depth > 0
    }

    pub fn depth(&self) -> u32 {
        self.depth
    }

    pub fn is_destroyed(&self) -> bool {
        self.destroyed
    }

    /// Completed cycles.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn is_initialized(&self) -> bool {
        self.initialized
    }

    /// Live blocks in all regions and outside them (bypass blocks excluded).
    pub fn live_blocks(&self) -> usize {
        self.region.iter().chain(self.retired.iter()).map(|r| r.live_blocks()).sum::<usize>()
            + self.external_live_blocks
    }

    fn uses_arena(&self) -> bool {
        self.config.policy_allocation != AllocationPolicy::Always && self.debug == DebugMode::Disabled
    }

    /// Arena capacity for a learned need of `need` bytes under the allocation policy and limits.
    fn capacity_for(&self, need: usize) -> usize {
        let c = &self.config;
        let base = need.max(c.initial_size as usize);
        let mut cap = match c.policy_allocation {
            AllocationPolicy::Overallocate => base.saturating_add((base as f64 * c.overallocation_limit) as usize),
            _ => base,
        };
        cap = cap.max(c.min_size as usize);
        cap = if cap >= HUGE_ROUND_THRESHOLD { cap.div_ceil(HUGE_PAGE) * HUGE_PAGE } else { round_to_page(cap) };
        if c.temp_block_size > 0 {
            cap = cap.div_ceil(c.temp_block_size as usize) * c.temp_block_size as usize;
        }
        if c.max_size > 0 {
            cap = cap.min(c.max_size as usize / BLOCK_ALIGN * BLOCK_ALIGN);
        }
        cap
    }

    fn capacity_total(&self) -> usize {
        self.region.iter().chain(self.retired.iter()).map(|r| r.capacity()).sum()
    }

    /// Maps a new current region of `cap` bytes, whose first `used` bytes (what the learned
    /// cycles used) are pre-faulted when the next cycle opens; the old one is dropped, or
    /// retired while blocks in it live.
    fn replace_region(&mut self, cap: usize, used: usize) -> Result<(), Error> {
        if cap == 0 {
            return Ok(());
        }
        let id = self.next_region_id;
        let region = ArenaRegion::new(id, cap, self.backend.clone()).map_err(|detail| Error::SystemOutOfMemory {
            workspace: self.name.clone(),
            requested: cap as u64,
            detail,
        })?;
        // Pre-fault what cycles will touch again, so that a learned cycle takes no page faults;
        // the overallocation, and anything past the bounds, costs address space only. Deferred
        // to the next cycle: a workload that never has one (a whole program in one cycle) does
        // not pay for it.
        self.pending_prefault = used.min(cap).min(PREFAULT_LIMIT);
        self.cycle_churn = 0;
        self.arena_max_slot = usize::MAX;
        self.next_region_id = self.next_region_id.wrapping_add(1).max(1);
        if let Some(mut old) = self.region.replace(region) {
            if old.live_blocks() > 0 {
                old.retire();
                self.retired.push(old);
            }
        }
        Ok(())
    }

    /// Sizes the arena now from what was learned (or from the initial and minimum sizes).
    pub fn initialize(&mut self) -> Result<(), Error> {
        self.check_alive()?;
        self.initialized = true;
        if !self.uses_arena() {
            return Ok(());
        }
        let cap = self.capacity_for(self.learner.need);
        if cap > self.region.as_ref().map_or(0, |r| r.capacity()) {
            self.replace_region(cap, self.learner.need)?;
        }
        Ok(())
    }

    fn check_alive(&self) -> Result<(), Error> {
        if self.destroyed {
            Err(Error::Destroyed { workspace: self.name.clone() })
        } else {
            Ok(())
        }
    }

    /// Opens a cycle, or nests in the open one.
    pub fn enter(&mut self) -> Result<(), Error> {
        self.check_alive()?;
        if self.depth == 0 {
            self.cycle_peak_bytes = self.used_bytes + self.external_bytes;
            self.cycle_slot_peak = self.live_slot_bytes;
            self.cycle_churn = 0;
            if self.pending_prefault > 0 {
                self.prefault_now();
            }
        }
        self.depth += 1;
        Ok(())
    }

    /// Pre-faults what the last learning asked for, within a quarter of the memory available.
    #[cold]
    fn prefault_now(&mut self) {
        let want = std::mem::take(&mut self.pending_prefault).min(available_memory() / 4);
        if let Some(r) = self.region.as_mut() {
            self.prefaulted_bytes += r.populate(want) as u64;
        }
    }

    /// Closes the innermost level; the outermost one ends the cycle: learning, growth, rewind.
    pub fn exit(&mut self) -> Result<CycleReport, Error> {
        if self.depth == 0 {
            return Err(Error::NotOpen { workspace: self.name.clone(), operation: "exit" });
        }
        self.depth -= 1;
        if self.depth > 0 || self.destroyed {
            return Ok(CycleReport::default());
        }
        // Blocks of this cycle still live escape it: they stay pinned while the next cycle
        // reaches the same peak, so they count twice in what a cycle needs.
        let live_blocks = self.live_blocks(); // growth below moves regions, not blocks
        let escaped_blocks = live_blocks - self.pinned_blocks;
        let escaped_bytes = self.used_bytes + self.external_bytes - self.pinned_bytes;
        let need = self.cycle_slot_peak + (self.live_slot_bytes - self.pinned_slot_bytes);
        let learning = !self.initialized;
        let region_before = self.region.as_ref().map(|r| r.id());
        if self.adaptive() {
            self.adapt(need);
        } else if learning {
            self.learner.need = self.learner.need.max(need);
            self.learner.cycles_learned += 1;
            if self.learner.cycles_learned >= self.config.cycles_before_initialization.max(1) {
                // A failure to map leaves the workspace serving externally; it retries next cycle.
                if self.initialize().is_err() {
                    self.initialized = false;
                }
            }
        } else if self.grow_at_cycle_end && self.uses_arena() {
            self.learner.need = self.learner.need.max(need);
            let cap = self.capacity_for(self.learner.need);
            if cap > self.region.as_ref().map_or(0, |r| r.capacity()) {
                let _ = self.replace_region(cap, self.learner.need);
            }
        }
        self.grow_at_cycle_end = false;
        self.arena_max_slot = usize::MAX;
        if std::mem::take(&mut self.cycle_heap_bytes) >= TRIM_AFTER
            && self.region.as_ref().map(|r| r.id()) != region_before
        {
            // An arena now serves what the block allocator served this cycle: the memory it
            // keeps of those blocks would only add to the arena's.
            self.backend.trim();
        }
        if !self.huge_cache.is_empty() {
            let now = self.generation;
            self.release_huge_cache(|m| m.used + HUGE_CACHE_CYCLES <= now);
        }
        if self.config.policy_reset == ResetPolicy::BlockLeft {
            if let Some(r) = self.region.as_mut() {
                r.rewind();
            }
        }
        self.generation += 1;
        self.pinned_blocks = live_blocks;
        self.pinned_bytes = self.used_bytes + self.external_bytes;
        self.pinned_slot_bytes = self.live_slot_bytes;
        self.last_cycle_peak_bytes = self.cycle_peak_bytes;
        Ok(CycleReport { completed: true, escaped_blocks: escaped_blocks as u64, escaped_bytes })
    }

    /// The adaptive profile's learning at a cycle end: the need is the largest of the recent
    /// cycles'; the arena grows to it after a cycle that spilled, and shrinks to it once an
    /// outlier cycle has left the window.
    fn adapt(&mut self, need: usize) {
        self.learner.recent[(self.generation % NEED_WINDOW as u64) as usize] = need;
        self.learner.cycles_learned += 1;
        self.initialized = true;
        let window = self.learner.recent.iter().copied().max().unwrap_or(0);
        self.learner.need = window;
        if !self.uses_arena() {
            return;
        }
        let target = self.capacity_for(window);
        let cur = self.region.as_ref().map_or(0, |r| r.capacity());
        let grow = target > cur || (self.grow_at_cycle_end && target > 0);
        // Shrink only well below the current size, so cycles that vary a little never remap.
        let shrink = cur > target.saturating_add(target / 10).max(round_to_page(1));
        if grow || shrink {
            // After spills with room enough on paper (fragmentation around pinned blocks), a
            // fresh region of the same size leaves the pinned blocks behind in the old one.
            let cap = if grow { target.max(cur) } else { target };
            let _ = self.replace_region(cap, window);
        }
    }

    /// Allocates `size` bytes, 64-byte aligned, under the workspace's policies.
    #[inline]
    pub fn alloc(&mut self, size: usize) -> Result<NonNull<u8>, Error> {
        self.alloc_in(size, false)
    }

    /// Allocates a block holding `size` bytes from its first `align`-aligned address (`align` a
    /// power of two, at most a page): the block is `align - 64` bytes larger where its alignment
    /// is not known to be `align` (arena blocks), and exactly `size` where the backend's own
    /// blocks are aligned so and keep their headers apart (a device driver's). Freed with
    /// [`Workspace::free`] of the pointer returned, not of the aligned address.
    pub fn alloc_aligned(&mut self, size: usize, align: usize) -> Result<NonNull<u8>, Error> {
        if !align.is_power_of_two() || align > round_to_page(1) {
            return Err(self.out_of_memory(size, "alignment not a power of two up to a page"));
        }
        let pad = align.saturating_sub(BLOCK_ALIGN);
        if pad == 0 {
            return self.alloc_in(size, false);
        }
        let Some(padded) = size.checked_add(pad) else {
            return Err(self.out_of_memory(size, "request too large"));
        };
        if self.inline_headers || self.backend.block_align() < align {
            return self.alloc_in(padded, false);
        }
        let (Some(slot), Some(exact)) = (slot_for(padded), slot_for(size)) else {
            return Err(self.out_of_memory(size, "request too large"));
        };
        if (padded as u64) >= self.config.helper_min_size && slot < self.arena_max_slot {
            if let Some(p) = self.carve_arena(padded, slot, false) {
                return Ok(p);
            }
        }
        self.alloc_outside(size, exact, false, (padded, slot))
    }

    #[inline(always)]
    fn alloc_in(&mut self, size: usize, zeroed: bool) -> Result<NonNull<u8>, Error> {
        // A destroyed workspace has no current region, so it always takes the slow path.
        let Some(slot) = slot_for(size) else {
            return Err(self.out_of_memory(size, "request too large"));
        };
        if (size as u64) >= self.config.helper_min_size && slot < self.arena_max_slot {
            if let Some(p) = self.carve_arena(size, slot, zeroed) {
                return Ok(p);
            }
        }
        self.alloc_outside(size, slot, zeroed, (size, slot))
    }

    /// Serves a request from the current region, if it fits.
    #[inline(always)]
    fn carve_arena(&mut self, size: usize, slot: usize, zeroed: bool) -> Option<NonNull<u8>> {
        let region = self.region.as_mut()?;
        let off = region.carve(slot)?;
        // Host memory is zero-filled when mapped: never-carved memory needs no write.
        let clear = zeroed && !(self.inline_headers && region.is_fresh(off));
        // SAFETY: `off` was just carved for this slot.
        let p = unsafe { region.hand_out(off, slot, size, self.generation) };
        self.count_arena(slot, size);
        // SAFETY: `p` is valid for `size` bytes of the backend's memory, just handed out.
        if clear && unsafe { self.backend.zero(p, size) }.is_err() {
            // A fill the device refused: the block goes back, and the request is served outside
            // the arena, where a refused fill is an error.
            // SAFETY: `p` was handed out just above and never reached the caller.
            unsafe { self.free(p) };
            return None;
        }
        Some(p)
    }

    #[inline]
    fn count_arena(&mut self, slot: usize, size: usize) {
        self.used_bytes += size as u64;
        self.count_live(slot);
    }

    #[inline]
    fn count_live(&mut self, slot: usize) {
        self.allocation_count += 1;
        self.live_slot_bytes += slot;
        self.cycle_slot_peak = self.cycle_slot_peak.max(self.live_slot_bytes);
        self.cycle_peak_bytes = self.cycle_peak_bytes.max(self.used_bytes + self.external_bytes);
    }

    fn out_of_memory(&self, size: usize, reason: &'static str) -> Error {
        Error::OutOfMemory {
            workspace: self.name.clone(),
            requested: size as u64,
            in_use: self.used_bytes + self.external_bytes,
            limit: if self.config.max_size > 0 { self.config.max_size } else { self.capacity_total() as u64 },
            reason,
        }
    }

    /// Bytes the workspace holds for the `max_size` limit: regions, external and huge blocks.
    fn footprint(&self) -> u64 {
        self.capacity_total() as u64 + self.external_slot_bytes + self.huge_live_len as u64
    }

    /// Serves a request outside the current arena: a block of its own, or a provisional arena's
    /// carving of `carve` (the size and slot an arena block of the request takes).
    #[cold]
    fn alloc_outside(
        &mut self,
        size: usize,
        slot: usize,
        zeroed: bool,
        carve: (usize, usize),
    ) -> Result<NonNull<u8>, Error> {
        if self.destroyed {
            return Err(Error::Destroyed { workspace: self.name.clone() });
        }
        if self.debug == DebugMode::BypassEverything || (size as u64) < self.config.helper_min_size {
            return self.alloc_block(BlockKind::Bypass, size, slot, zeroed);
        }
        let spill = (self.initialized && self.config.policy_allocation != AllocationPolicy::Always)
            || self.debug == DebugMode::SpillEverything;
        if spill && self.debug == DebugMode::Disabled && self.config.policy_spill == SpillPolicy::Fail {
            self.failed_allocations += 1;
            return Err(self.out_of_memory(size, "the arena is full and the spill policy is FAIL"));
        }
        let mut ext = slot;
        if self.config.temp_block_size > 0 {
            let g = self.config.temp_block_size as usize;
            ext = ext.div_ceil(g).saturating_mul(g);
        }
        let huge = self.huge_blocks
            && self.debug == DebugMode::Disabled
            && size >= HUGE_BLOCK_MIN
            && size >= self.learner.need / 2;
        if huge {
            ext = round_to_page(slot);
        }
        if self.config.max_size > 0 && self.footprint().saturating_add(ext as u64) > self.config.max_size {
            self.failed_allocations += 1;
            return Err(self.out_of_memory(size, "max_size reached"));
        }
        if huge {
            return self.alloc_huge(size, ext, zeroed);
        }
        if ext < PROVISIONAL_MAX_SLOT && self.maps_within_cycles() {
            self.cycle_churn = self.cycle_churn.saturating_add(ext);
            // Churn beyond twice the peak (this request included) means freed memory would have
            // served the cycle again.
            let peak = self.cycle_slot_peak.max(self.live_slot_bytes + ext);
            if self.cycle_churn >= MID_CYCLE_CHURN && self.cycle_churn >= peak.saturating_mul(2) {
                if let Some(p) = self.map_within_cycle(carve.0, carve.1, zeroed) {
                    return Ok(p);
                }
            }
        }
        let p = self.alloc_block(BlockKind::External, size, ext, zeroed)?;
        self.cycle_heap_bytes = self.cycle_heap_bytes.saturating_add(ext);
        if spill {
            self.spill_count += 1;
            if self.config.policy_spill == SpillPolicy::Reallocate
                || self.adaptive()
                || (self.config.policy_learning == LearningPolicy::OverTime
                    && self.config.policy_spill != SpillPolicy::Fail)
            {
                self.grow_at_cycle_end = true;
            }
        }
        Ok(p)
    }

    fn adaptive(&self) -> bool {
        self.config.policy_learning == LearningPolicy::Adaptive
    }

    /// Whether an open cycle may map a (larger) arena before it ends: a learning cycle, or any
    /// cycle of the adaptive profile.
    fn maps_within_cycles(&self) -> bool {
        self.depth > 0
            && self.uses_arena()
            && self.config.policy_reset == ResetPolicy::BlockLeft
            && (self.adaptive() || (!self.initialized && self.config.policy_learning != LearningPolicy::None))
    }

    /// The open cycle has churned through external memory: maps a provisional arena for its
    /// smaller blocks (twice the current one, from `MID_CYCLE_CHURN`, so that a growing cycle
    /// remaps O(log) times) and serves the request from it. Its pages fault in as they are first
    /// used, and freed memory is reused before untouched memory.
    #[cold]
    fn map_within_cycle(&mut self, size: usize, slot: usize, zeroed: bool) -> Option<NonNull<u8>> {
        self.cycle_churn = 0;
        let cur = self.region.as_ref().map_or(0, |r| r.capacity());
        let cap = self.capacity_for(cur.saturating_mul(2).max(MID_CYCLE_CHURN));
        if cap <= cur
            || (self.config.max_size > 0 && self.footprint().saturating_add(cap as u64) > self.config.max_size)
        {
            return None;
        }
        self.replace_region(cap, 0).ok()?;
        self.arena_max_slot = PROVISIONAL_MAX_SLOT;
        // The smaller blocks come from the arena from now on: what the block allocator kept of
        // those it served so far goes back to the system, so that the two never add up.
        self.backend.trim();
        self.cycle_heap_bytes = 0;
        self.carve_arena(size, slot, zeroed)
    }

    /// A huge request: a mapping of its own, lazily faulted, reused from the cache when one of a
    /// fitting size was freed (not for zeroed requests, unless the backend re-zeroes discarded
    /// pages: a fresh mapping is zero without being written).
    #[cold]
    fn alloc_huge(&mut self, size: usize, len: usize, zeroed: bool) -> Result<NonNull<u8>, Error> {
        let reusable = !zeroed || self.backend.discard_zeroes();
        let fits = |m: &CachedMapping| m.len >= len && m.len - len <= len / 4;
        let fit = if reusable {
            (0..self.huge_cache.len()).filter(|&i| fits(&self.huge_cache[i])).min_by_key(|&i| self.huge_cache[i].len)
        } else {
            None
        };
        let (at, len) = match fit {
            Some(i) => {
                let m = self.huge_cache.swap_remove(i);
                if zeroed {
                    self.backend.discard(m.at, m.len);
                }
                (m.at, m.len)
            }
            None => {
                // What is cached does not recur: it goes back before more is mapped, so that huge
                // requests of changing sizes (one long cycle over varied work) never add up.
                self.release_huge_cache(|_| true);
                let at = self.backend.map(len, false);
                let at = at.map_err(|detail| {
                    self.failed_allocations += 1;
                    Error::SystemOutOfMemory { workspace: self.name.clone(), requested: size as u64, detail }
                })?;
                (at, len)
            }
        };
        // SAFETY: `at` is a fresh or reclaimed mapping of `len >= HEADER` bytes, page-aligned,
        // owned by us; huge blocks exist only where headers sit in front of their blocks.
        let p = unsafe { write_live_header(at, BlockKind::Huge, 0, len, size, self.generation) };
        self.huge_live_len += len;
        self.external_bytes += size as u64;
        self.external_live_blocks += 1;
        self.allocation_count += 1;
        self.cycle_peak_bytes = self.cycle_peak_bytes.max(self.used_bytes + self.external_bytes);
        Ok(p)
    }

    /// Takes a freed huge mapping back: into the cache, or to the system.
    ///
    /// # Safety
    /// `at` and `len` describe a huge mapping of this workspace that no block uses any more.
    unsafe fn put_huge(&mut self, at: NonNull<u8>, len: usize) {
        if self.destroyed {
            // SAFETY: the caller gives the mapping up.
            unsafe { self.backend.unmap(at, len) };
            return;
        }
        if self.huge_cache.len() >= HUGE_CACHE_BLOCKS {
            let oldest = (0..self.huge_cache.len()).min_by_key(|&i| self.huge_cache[i].used).expect("not empty");
            let m = self.huge_cache.swap_remove(oldest);
            // SAFETY: a cached mapping is owned by the cache alone.
            unsafe { self.backend.unmap(m.at, m.len) };
        }
        self.huge_cache.push(CachedMapping { at, len, used: self.generation });
    }

    /// Releases the cached huge mappings that `which` selects.
    fn release_huge_cache(&mut self, which: impl Fn(&CachedMapping) -> bool) {
        let mut i = 0;
        while i < self.huge_cache.len() {
            if which(&self.huge_cache[i]) {
                let m = self.huge_cache.swap_remove(i);
                // SAFETY: a cached mapping is owned by the cache alone; released once, here.
                unsafe { self.backend.unmap(m.at, m.len) };
            } else {
                i += 1;
            }
        }
    }

    fn alloc_block(&mut self, kind: BlockKind, size: usize, len: usize, zeroed: bool) -> Result<NonNull<u8>, Error> {
        // A block whose header lives on the host starts at its data: it takes `len - HEADER`
        // bytes from the backend, and keeps the backend's alignment (a device driver allocates
        // at a granularity that a header's bytes would make it round up to the next step).
        let take = if self.inline_headers { len } else { len - HEADER };
        let at = if zeroed { self.backend.alloc_block_zeroed(take) } else { self.backend.alloc_block(take) };
        let at = at.map_err(|detail| {
            self.failed_allocations += 1;
            Error::SystemOutOfMemory { workspace: self.name.clone(), requested: size as u64, detail }
        })?;
        let p = if self.inline_headers {
            // SAFETY: `at` is a fresh 64-aligned block of `len >= HEADER` bytes owned by us.
            unsafe { write_live_header(at, kind, 0, len, size, self.generation) }
        } else {
            let h = Box::new(BlockHeader::live(kind, 0, len, size, self.generation));
            self.outside_headers.insert(at.as_ptr() as usize, NonNull::from(Box::leak(h)));
            at
        };
        if kind == BlockKind::External {
            self.external_bytes += size as u64;
            self.external_slot_bytes += len as u64;
            self.external_live_blocks += 1;
            self.count_live(len);
        }
        Ok(p)
    }

    /// Allocates outside the workspace's arena and accounts (a bypass block), whatever its state:
    /// for callers that must keep working after `destroy`. Freed with [`Workspace::free`].
    pub fn alloc_unaccounted(&mut self, size: usize, zeroed: bool) -> Result<NonNull<u8>, Error> {
        let slot = slot_for(size).ok_or_else(|| self.out_of_memory(size, "request too large"))?;
        self.alloc_block(BlockKind::Bypass, size, slot, zeroed)
    }

    /// Allocates `size` zero-filled bytes. Memory known to be zero already (never used since it
    /// was mapped) is not written, so untouched pages stay untouched.
    pub fn alloc_zeroed(&mut self, size: usize) -> Result<NonNull<u8>, Error> {
        self.alloc_in(size, true)
    }

    /// Takes a block back. Frees of blocks from earlier cycles unpin them; a region retired by
    /// growth, or kept alive by a destroyed workspace, is released with its last block.
    ///
    /// # Safety
    /// `p` was returned by `alloc`, `alloc_zeroed` or `realloc` of this workspace and was not freed.
    #[inline]
    pub unsafe fn free(&mut self, p: NonNull<u8>) {
        // SAFETY: the caller guarantees `p` is a live block of ours.
        let hp = unsafe { self.header(p) };
        let (live, kind, generation, region, slot, requested) = {
            // SAFETY: the header of a live block; the shared borrow ends before anything writes it.
            let h = unsafe { hp.as_ref() };
            (h.is_live(), h.kind, h.generation, h.region, h.slot, h.requested)
        };
        debug_assert!(live, "double free or foreign pointer in workspace {:?}", self.name);
        // The common case: an arena block of the current region, freed in its own cycle.
        if kind == BlockKind::Arena && generation == self.generation {
            if let Some(r) = self.region.as_mut().filter(|r| r.id() == region) {
                self.live_slot_bytes -= slot;
                self.used_bytes -= requested as u64;
                // SAFETY: the header is live, names this region and is not borrowed.
                unsafe { r.release(hp) };
                return;
            }
        }
        // SAFETY: forwarded.
        unsafe { self.free_slow(p, hp) }
    }

    /// The header of a live block.
    ///
    /// # Safety
    /// `p` is a live block of this workspace; the header is not used after the block is freed.
    #[inline]
    unsafe fn header(&self, p: NonNull<u8>) -> NonNull<BlockHeader> {
        if self.inline_headers {
            // SAFETY: the caller guarantees a live block, and its header precedes it.
            return unsafe { header_of(p) };
        }
        // SAFETY: forwarded.
        unsafe { self.header_elsewhere(p) }
    }

    /// # Safety
    /// As for [`Workspace::header`].
    #[cold]
    unsafe fn header_elsewhere(&self, p: NonNull<u8>) -> NonNull<BlockHeader> {
        for r in self.region.iter().chain(self.retired.iter()) {
            // SAFETY: forwarded: a live block of ours, so if it is in `r` it is one of r's.
            if let Some(h) = unsafe { r.header_for(p) } {
                return h;
            }
        }
        // The box stays alive until the block is freed (removed from the map, and freed, then).
        *self.outside_headers.get(&(p.as_ptr() as usize)).expect("a live block of this workspace")
    }

    /// # Safety
    /// `hp` is the live header of the block `p` of this workspace, not borrowed.
    #[cold]
    unsafe fn free_slow(&mut self, p: NonNull<u8>, hp: NonNull<BlockHeader>) {
        // Copy everything out: the memory holding the header may be released below.
        let (size, slot, gen, kind) = {
            // SAFETY: the caller guarantees a live header; the borrow ends in this block.
            let h = unsafe { hp.as_ref() };
            (h.requested, h.slot, h.generation, h.kind)
        };
        if kind == BlockKind::Huge {
            self.external_bytes -= size as u64;
            self.external_live_blocks -= 1;
            self.huge_live_len -= slot;
            if gen != self.generation {
                self.unpin(size, 0);
            }
            // SAFETY: the header is ours to write; nothing else refers to it any more.
            unsafe { (*hp.as_ptr()).magic = 0 };
            // SAFETY: a huge block's mapping starts at its header and is `slot` bytes long; the
            // caller gives the block up.
            unsafe { self.put_huge(p.sub(HEADER), slot) };
            return;
        }
        if kind == BlockKind::Arena {
            // SAFETY: the caller guarantees a live header.
            let id = unsafe { hp.as_ref() }.region;
            // Before any counter changes: a block of no region of ours is a foreign pointer, and
            // the panic must leave the workspace's accounts as they were.
            assert!(
                self.region.iter().chain(self.retired.iter()).any(|r| r.id() == id),
                "free of a block of an unknown region in workspace {:?}",
                self.name
            );
        }
        if kind != BlockKind::Bypass {
            self.live_slot_bytes -= slot;
            if gen != self.generation {
                self.unpin(size, slot);
            }
        }
        match kind {
            BlockKind::Arena => {
                self.used_bytes -= size as u64;
                // SAFETY: the header is live, not borrowed, and names the region that handed it out.
                unsafe { self.release_arena(hp) };
            }
            BlockKind::Huge => unreachable!("huge blocks return to the cache above"),
            BlockKind::External | BlockKind::Bypass => {
                if kind == BlockKind::External {
                    self.external_bytes -= size as u64;
                    self.external_slot_bytes -= slot as u64;
                    self.external_live_blocks -= 1;
                }
                // SAFETY: the header is ours to write; it is released just below.
                unsafe { (*hp.as_ptr()).magic = 0 };
                if !self.inline_headers {
                    let owned = self.outside_headers.remove(&(p.as_ptr() as usize)).expect("a tracked header");
                    // SAFETY: the box was leaked in `alloc_block` and is reclaimed once, here.
                    drop(unsafe { Box::from_raw(owned.as_ptr()) });
                }
                // SAFETY: the block was allocated by `alloc_block` of this backend: `slot` bytes
                // with its data `HEADER` bytes in, or, with its header on the host, `slot - HEADER`
                // bytes starting at its data; the caller gives it up, and no reference to its
                // header is alive.
                unsafe {
                    if self.inline_headers {
                        self.backend.free_block(p.sub(HEADER), slot)
                    } else {
                        self.backend.free_block(p, slot - HEADER)
                    }
                };
            }
        }
    }

    #[cold]
    fn unpin(&mut self, size: usize, slot: usize) {
        self.pinned_blocks -= 1;
        self.pinned_bytes -= size as u64;
        self.pinned_slot_bytes -= slot;
    }

    /// # Safety
    /// `hp` is the live header of an arena block of this workspace, not borrowed.
    unsafe fn release_arena(&mut self, hp: NonNull<BlockHeader>) {
        // SAFETY: the caller guarantees a live header.
        let id = unsafe { hp.as_ref() }.region;
        if let Some(r) = self.region.as_mut().filter(|r| r.id() == id) {
            // SAFETY: forwarded.
            unsafe { r.release(hp) };
            return;
        }
        let idx = self.retired.iter().position(|r| r.id() == id).expect("block of an unknown region");
        let r = &mut self.retired[idx];
        // SAFETY: forwarded; the region (and the header in it) stays mapped through this call.
        unsafe { r.release(hp) };
        if r.live_blocks() == 0 {
            // The last block: the region goes back to the system whole.
            self.retired.swap_remove(idx);
        } else if r.freed_since_scan() >= RETIRED_RESCAN.max(r.capacity() / 8) {
            // Pages freed since the retirement go back too, so that what stays resident is
            // proportional to what lives.
            r.retire();
        }
    }

    /// Resizes a block, keeping its contents up to the smaller size. In place when it fits.
    ///
    /// # Safety
    /// As for [`Workspace::free`].
    pub unsafe fn realloc(&mut self, p: NonNull<u8>, new_size: usize) -> Result<NonNull<u8>, Error> {
        // SAFETY: the caller guarantees `p` is a live block of ours; the borrow ends before the
        // block can be freed below.
        let h = unsafe { &mut *self.header(p).as_ptr() };
        let old = h.requested;
        if h.kind == BlockKind::Arena && slot_for(new_size) == Some(h.slot) && !self.destroyed {
            h.requested = new_size;
            let (o, n) = (old as u64, new_size as u64);
            self.used_bytes = self.used_bytes + n - o;
            if h.generation != self.generation {
                self.pinned_bytes = self.pinned_bytes + n - o;
            }
            let live = self.used_bytes + self.external_bytes;
            self.cycle_peak_bytes = self.cycle_peak_bytes.max(live);
            return Ok(p);
        }
        let q = if self.destroyed { self.alloc_unaccounted(new_size, false)? } else { self.alloc(new_size)? };
        // SAFETY: both blocks are live, distinct, of this backend, and valid for the bytes copied.
        if let Err(what) = unsafe { self.backend.copy(q, p, old.min(new_size)) } {
            // A copy the device refused: the old block stays the caller's, with its contents.
            // SAFETY: `q` was allocated just above and never reached the caller.
            unsafe { self.free(q) };
            return Err(Error::Unavailable { what });
        }
        // SAFETY: `p` is live and ours (caller's guarantee); it is freed once, here.
        unsafe { self.free(p) };
        Ok(q)
    }

    /// What the workspace knows of a live block.
    ///
    /// # Safety
    /// As for [`Workspace::free`].
    pub unsafe fn block_info(&self, p: NonNull<u8>) -> BlockInfo {
        // SAFETY: the caller guarantees `p` is a live block of ours.
        let h = unsafe { self.header(p).as_ref() };
        let region = (h.kind == BlockKind::Arena).then(|| {
            let r = self.region.iter().chain(self.retired.iter()).find(|r| r.id() == h.region).expect("known region");
            (r.base().as_ptr() as usize, r.capacity())
        });
        BlockInfo { kind: h.kind, requested: h.requested, generation: h.generation, region }
    }

    /// Destroys the workspace: unreferenced memory is released now, memory under live blocks
    /// when its last block is freed. Idempotent.
    pub fn destroy(&mut self) {
        self.destroyed = true;
        self.depth = 0;
        // The current region retires like one replaced by growth: kept while blocks live in it.
        if let Some(mut r) = self.region.take() {
            if r.live_blocks() > 0 {
                r.retire();
                self.retired.push(r);
            }
        }
        self.retired.retain(|r| r.live_blocks() > 0);
        self.release_huge_cache(|_| true);
    }

    pub fn stats(&self) -> WorkspaceStats {
        let cap = self.capacity_total() as u64;
        let arena_live = self.live_slot_bytes as u64 - self.external_slot_bytes;
        WorkspaceStats {
            cycles: self.generation,
            capacity_bytes: cap,
            used_bytes: self.used_bytes,
            peak_cycle_bytes: if self.depth > 0 { self.cycle_peak_bytes } else { self.last_cycle_peak_bytes },
            cached_bytes: cap - arena_live,
            external_bytes: self.external_bytes,
            pinned_bytes: self.pinned_bytes,
            overhead_bytes: arena_live - self.used_bytes,
            allocation_count: self.allocation_count,
            spill_count: self.spill_count,
            failed_allocations: self.failed_allocations,
        }
    }

    /// Counts a refusal that happened outside the workspace (for example a request too large for
    /// the caller's own arithmetic).
    pub fn record_failure(&mut self) {
        self.failed_allocations += 1;
    }

    /// Checks every region's chain against its counters. For tests: O(blocks).
    #[doc(hidden)]
    pub fn verify(&self) {
        let arena_live: usize = self.region.iter().chain(self.retired.iter()).map(|r| r.verify()).sum();
        assert_eq!(arena_live as u64, self.live_slot_bytes as u64 - self.external_slot_bytes, "slot bytes disagree");
        assert!(self.pinned_blocks <= self.live_blocks() && self.pinned_slot_bytes <= self.live_slot_bytes);
    }

    /// Bytes pre-faulted synchronously so far, in total.
    pub fn prefaulted_bytes(&self) -> u64 {
        self.prefaulted_bytes
    }

    /// The need the workspace has learned (bytes of one cycle, headers included).
    pub fn learned_need(&self) -> usize {
        self.learner.need
    }

    /// Huge mappings kept for reuse, and their total length.
    pub fn huge_cached(&self) -> (usize, usize) {
        (self.huge_cache.len(), self.huge_cache.iter().map(|m| m.len).sum())
    }

    /// The header size every block carries, for callers sizing arenas by hand.
    pub const fn header_bytes() -> usize {
        HEADER
    }
}
