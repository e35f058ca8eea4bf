//! A workspace: one named memory pool with cycles. It owns the current arena region (and regions
//! retired by growth while blocks in them still live), its blocks of their own and their cache,
//! and its huge mappings; it counts what it serves ([`Accounts`]) and asks the [`CycleLearner`]
//! at each cycle end how large the arena should be. All methods take `&mut self`: a binding that
//! frees from several threads puts the workspace behind one lock.
//!
//! An allocation climbs one ladder ([`Workspace::alloc`]):
//! 1. a block of its size class freed in the arena (the most recently freed: cache-hot);
//! 2. the arena's bump hole, or a run of freed memory its walk finds;
//! 3. a cached external block of its class (one freed outside the arena);
//! 4. a new block of its own (or, for a huge request, a mapping of its own), within `max_size`;
//! 5. a refusal, under the spill policy or the limits.
//!
//! What a cycle never touched costs address space, not memory: a region pre-faults at most what
//! the learned cycles used (and never more than [`PREFAULT_LIMIT`]), zeroed requests carved from
//! never-used memory are not written, and huge requests get lazily faulted mappings of their own.

use std::ptr::NonNull;
use std::sync::Arc;

use crate::accounts::{Accounts, CycleReport, WorkspaceStats};
use crate::arena::{live_kind, write_live_header, ArenaRegion, BlockHeader, BlockKind, HEADER};
use crate::backend::{available_memory, round_to_page, AnonymousMemory, Backend, FileMappedMemory, BLOCK_ALIGN};
use crate::classes::{class_of, class_size};
use crate::config::{AllocationPolicy, DebugMode, LocationPolicy, ResetPolicy, SpillPolicy, WorkspaceConfiguration};
use crate::error::{Error, Name};
use crate::external::OwnBlocks;
use crate::huge::{HugeCache, HUGE_BLOCK_MIN};
use crate::learner::{CycleFacts, CycleLearner, Sizing, NEED_WINDOW};

/// The most a region pre-faults when it is mapped; pages beyond fault in on first use.
pub const PREFAULT_LIMIT: usize = 1 << 30;

/// External bytes a cycle must have served before the block allocator's cache is returned when
/// an arena takes over.
const TRIM_AFTER: usize = 1 << 20;

/// A retired region rescans for free pages to return once this much (and an eighth of it) was
/// freed since the last scan.
const RETIRED_RESCAN: usize = 1 << 20;

impl Drop for Workspace {
    fn drop(&mut self) {
        self.huge.release_all(&*self.backend);
    }
}

/// Workspace tokens: unique in the process, never 0.
static NEXT_TOKEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Where a live block lives, for tests and `owner` lookups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockInfo {
    pub kind: BlockKind,
    pub requested: usize,
    /// The pinning epoch it was handed out in.
    pub generation: u64,
    /// Base address and capacity of the region holding an arena block.
    pub region: Option<(usize, usize)>,
}

/// One workspace.
#[derive(Debug)]
pub struct Workspace {
    name: Name,
    /// Unique in the process; written in the header of every block the workspace hands out.
    token: u64,
    config: WorkspaceConfiguration,
    debug: DebugMode,
    backend: Arc<dyn Backend>,
    /// Whether headers sit in front of their blocks (the CPU can touch the backend's memory).
    inline_headers: bool,
    region: Option<ArenaRegion>,
    retired: Vec<ArenaRegion>,
    next_region_id: u32,
    /// Cycles open now: more than one when asyncio tasks or threads each run a cycle of this
    /// workspace at the same time.
    active: u32,
    /// Levels nested inside the open cycles (`with ws:` inside `with ws:`).
    nesting: u32,
    /// The pinning epoch: blocks handed out in an earlier one are pinned. It advances when the
    /// last open cycle closes.
    epoch: u64,
    /// Cycles completed (each outermost exit, overlapping ones included).
    cycles: u64,
    /// The one truth of whether the workspace was destroyed.
    destroyed: bool,
    learner: CycleLearner,
    accounts: Accounts,
    own: OwnBlocks,
    /// Huge requests get mappings of their own (host memory the workspace maps itself).
    huge_blocks: bool,
    huge: HugeCache,
    /// Slot bytes served outside an initialised arena in the open cycle.
    cycle_spilled: usize,
    /// Whether blocks of earlier cycles were in the arena when the open cycle began.
    kept_in_arena: bool,
    /// Peak slot bytes of live external blocks in the open cycle, and in the recent ones: what
    /// the external cache may hold at most, together with what lives.
    external_peak: usize,
    external_peaks: [usize; NEED_WINDOW],
    /// Bytes of external blocks made fresh in the open cycle (for returning the block
    /// allocator's cache once an arena takes over).
    cycle_heap_bytes: usize,
    /// Bytes pre-faulted synchronously, in total.
    prefaulted_bytes: u64,
    /// Bytes of the current region to pre-fault when the next cycle opens.
    pending_prefault: usize,
    /// Frees of pointers that are no live block of this workspace (double frees, foreign
    /// pointers): ignored, and counted.
    bad_frees: u64,
}

// SAFETY: a workspace exclusively owns its regions, its blocks' headers and its caches; every
// access goes through `&mut self`, so it can move between threads.
unsafe impl Send for Workspace {}

impl Workspace {
    /// A workspace over the backend its configuration's location policy names.
    pub fn new(name: &str, config: WorkspaceConfiguration) -> Result<Self, Error> {
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
    pub fn with_backend(name: &str, config: WorkspaceConfiguration, backend: Arc<dyn Backend>) -> Result<Self, Error> {
        config.validate()?;
        let debug = config.effective_debug_mode();
        let huge_blocks = backend.host_accessible() && config.policy_location == LocationPolicy::Ram;
        let token = NEXT_TOKEN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut ws = Workspace {
            name: Name::from(name),
            token,
            learner: CycleLearner::new(&config),
            config,
            debug,
            inline_headers: backend.host_accessible(),
            own: OwnBlocks::new(backend.clone(), token),
            backend,
            region: None,
            retired: Vec::new(),
            next_region_id: 1,
            active: 0,
            nesting: 0,
            epoch: 0,
            cycles: 0,
            destroyed: false,
            accounts: Accounts::default(),
            huge_blocks,
            huge: HugeCache::default(),
            cycle_spilled: 0,
            kept_in_arena: false,
            external_peak: 0,
            external_peaks: [0; NEED_WINDOW],
            cycle_heap_bytes: 0,
            prefaulted_bytes: 0,
            pending_prefault: 0,
            bad_frees: 0,
        };
        if ws.config.initial_size > 0 && ws.uses_arena() {
            // Nothing was learned yet: the pages fault in as cycles first touch them.
            let cap = crate::learner::capacity_for(&ws.config, 0);
            ws.replace_region(cap, 0)?;
        }
        Ok(ws)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Unique in the process (never 0); every block's header names it.
    pub fn token(&self) -> u64 {
        self.token
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
        self.active > 0
    }

    /// Open cycles and the levels nested in them.
    pub fn depth(&self) -> u32 {
        self.active + self.nesting
    }

    /// Cycles open now (more than one when they overlap).
    pub fn open_cycles(&self) -> u32 {
        self.active
    }

    pub fn is_destroyed(&self) -> bool {
        self.destroyed
    }

    /// Completed cycles.
    pub fn generation(&self) -> u64 {
        self.cycles
    }

    /// The pinning epoch: it advances when the last open cycle closes; a live block handed out in
    /// an earlier one is pinned (see [`BlockInfo::generation`]).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn is_initialized(&self) -> bool {
        self.learner.initialized
    }

    /// Live blocks in all regions and outside them (bypass blocks excluded).
    pub fn live_blocks(&self) -> usize {
        self.region.iter().chain(self.retired.iter()).map(|r| r.live_blocks()).sum::<usize>()
            + self.accounts.external_blocks
    }

    fn uses_arena(&self) -> bool {
        self.config.policy_allocation != AllocationPolicy::Always && self.debug == DebugMode::Disabled
    }

    fn capacity_total(&self) -> usize {
        self.region.iter().chain(self.retired.iter()).map(|r| r.capacity()).sum()
    }

    /// Bytes the workspace holds for the `max_size` limit: regions, blocks of their own (live
    /// and cached) and huge mappings (live and cached).
    fn footprint(&self) -> usize {
        self.capacity_total()
            .saturating_add(self.accounts.external_slot)
            .saturating_add(self.own.cached_bytes())
            .saturating_add(self.huge.live_len)
            .saturating_add(self.huge.cached().1)
    }

    /// The one place `max_size` is enforced: room for `bytes` more, giving cached memory back
    /// first; else the refusal for a request of `size`.
    fn reserve(&mut self, size: usize, bytes: usize) -> Result<(), Error> {
        let max = self.config.max_size as usize;
        if max == 0 || self.footprint().saturating_add(bytes) <= max {
            return Ok(());
        }
        self.own.shrink_to(0);
        self.huge.release_all(&*self.backend);
        if self.footprint().saturating_add(bytes) <= max {
            return Ok(());
        }
        Err(self.refuse(size, "max_size reached"))
    }

    /// Counts a refusal and builds its error (which allocates nothing).
    fn refuse(&mut self, size: usize, reason: &'static str) -> Error {
        self.accounts.failures += 1;
        self.out_of_memory(size, reason)
    }

    fn out_of_memory(&self, size: usize, reason: &'static str) -> Error {
        Error::OutOfMemory {
            workspace: self.name.clone(),
            requested: size as u64,
            in_use: self.accounts.used + self.accounts.external,
            limit: if self.config.max_size > 0 { self.config.max_size } else { self.capacity_total() as u64 },
            reason,
        }
    }

    fn system_refused(&mut self, size: usize, detail: String) -> Error {
        self.accounts.failures += 1;
        Error::SystemOutOfMemory { workspace: self.name.clone(), requested: size as u64, detail }
    }

    /// Maps a new current region of `cap` bytes, whose first `used` bytes (what the learned
    /// cycles used) are pre-faulted when the next cycle opens; the old one is dropped, or
    /// retired while blocks in it live.
    fn replace_region(&mut self, cap: usize, used: usize) -> Result<(), Error> {
        if cap == 0 {
            return Ok(());
        }
        let id = self.next_region_id;
        let lists = self.config.policy_reset == ResetPolicy::BlockLeft;
        let region = ArenaRegion::new(id, self.token, cap, self.backend.clone(), lists).map_err(|detail| {
            Error::SystemOutOfMemory { workspace: self.name.clone(), requested: cap as u64, detail }
        })?;
        // Pre-fault what cycles will touch again, so that a learned cycle takes no page faults;
        // the overallocation, and anything past the bounds, costs address space only. Deferred
        // to the next cycle: a workload that never has one (a whole program in one cycle) does
        // not pay for it.
        self.pending_prefault = used.min(cap).min(PREFAULT_LIMIT);
        self.next_region_id = self.next_region_id.wrapping_add(1).max(1);
        if let Some(mut old) = self.region.replace(region) {
            if old.live_blocks() > 0 {
                old.retire();
                self.retired.push(old);
            }
        }
        Ok(())
    }

    fn apply(&mut self, sizing: Sizing) -> Result<(), Error> {
        match sizing {
            Sizing::Keep => Ok(()),
            Sizing::Map { capacity, prefault } => self.replace_region(capacity, prefault),
        }
    }

    /// Sizes the arena now from what was learned (or from the initial and minimum sizes).
    pub fn initialize(&mut self) -> Result<(), Error> {
        self.check_alive()?;
        let current = self.region.as_ref().map_or(0, |r| r.capacity());
        let sizing = self.learner.initialize(&self.config, current, self.uses_arena());
        self.apply(sizing)
    }

    fn check_alive(&self) -> Result<(), Error> {
        if self.destroyed {
            Err(Error::Destroyed { workspace: self.name.clone() })
        } else {
            Ok(())
        }
    }

    /// Opens a cycle, or nests in the open one (one caller's view: `with ws:` inside `with ws:`).
    pub fn enter(&mut self) -> Result<(), Error> {
        if self.active > 0 {
            self.nest()
        } else {
            self.open_cycle()
        }
    }

    /// Closes the innermost level; the outermost one ends the cycle: learning, sizing, caches,
    /// rewind (or, at the next open, once what outlived the cycle has died).
    pub fn exit(&mut self) -> Result<CycleReport, Error> {
        if self.nesting > 0 {
            self.unnest().map(|()| CycleReport::default())
        } else {
            self.close_cycle()
        }
    }

    /// Opens a cycle of its own, beside any open ones (another asyncio task's, another
    /// thread's): each counts as a cycle, and the arena rewinds only when none is open.
    pub fn open_cycle(&mut self) -> Result<(), Error> {
        self.check_alive()?;
        if self.active == 0 {
            if self.config.policy_reset == ResetPolicy::BlockLeft {
                // Blocks that outlived the last cycle and died since leave the region empty but
                // carved up: it starts over, as it would have had they died inside that cycle.
                if let Some(r) = self.region.as_mut().filter(|r| r.live_blocks() == 0) {
                    r.rewind();
                }
            }
            self.accounts.open_cycle();
            self.cycle_spilled = 0;
            self.kept_in_arena = self.region.as_ref().is_some_and(|r| r.live_blocks() > 0);
            self.external_peak = self.accounts.external_slot;
            if self.pending_prefault > 0 {
                self.prefault_now();
            }
        }
        self.active += 1;
        Ok(())
    }

    /// Nests a level in an open cycle.
    pub fn nest(&mut self) -> Result<(), Error> {
        self.check_alive()?;
        if self.active == 0 {
            return Err(Error::NotOpen { workspace: self.name.clone(), operation: "nest" });
        }
        self.nesting += 1;
        Ok(())
    }

    /// Leaves a nested level.
    pub fn unnest(&mut self) -> Result<(), Error> {
        if self.nesting == 0 {
            return Err(Error::NotOpen { workspace: self.name.clone(), operation: "exit" });
        }
        self.nesting -= 1;
        Ok(())
    }

    /// Pre-faults what the last learning asked for, within a quarter of the memory available.
    #[cold]
    fn prefault_now(&mut self) {
        let mut want = std::mem::take(&mut self.pending_prefault).min(available_memory() / 4);
        if let Some(r) = self.region.as_mut() {
            // Blocks of earlier cycles that a new region's need counted (state the loop replaces)
            // still live outside it, in the region it replaced or outside the arena: their
            // replacements take their room here, after them. Pre-faulting that room now would keep
            // both copies resident at once; it faults in when first used instead.
            if r.live_blocks() == 0 {
                want = want.saturating_sub(self.accounts.pinned_slot);
            }
            self.prefaulted_bytes += r.populate(want) as u64;
        }
    }

    /// Closes one open cycle: the learner sizes the arena from what the open cycles needed since
    /// the last close; when it was the last one open, the arena rewinds and what is still live is
    /// pinned. What escaped is reported then (with cycles overlapping, no block belongs to one).
    pub fn close_cycle(&mut self) -> Result<CycleReport, Error> {
        if self.active == 0 {
            return Err(Error::NotOpen { workspace: self.name.clone(), operation: "exit" });
        }
        self.active -= 1;
        if self.destroyed {
            return Ok(CycleReport::default());
        }
        if self.active == 0 {
            self.nesting = 0;
        }
        self.cycles += 1;
        let live_blocks = self.live_blocks(); // sizing below moves regions, not blocks
        let facts = CycleFacts {
            need: self.accounts.cycle_need(),
            escaped: self.accounts.live_slot - self.accounts.pinned_slot,
            spilled: self.cycle_spilled,
            kept_in_arena: self.kept_in_arena,
        };
        let current = self.region.as_ref().map_or(0, |r| r.capacity());
        let region_before = self.region.as_ref().map(|r| r.id());
        let sizing = self.learner.end_cycle(&self.config, self.cycles - 1, facts, current, self.uses_arena());
        if self.apply(sizing).is_err() && !self.learner.is_adaptive(&self.config) {
            // A failure to map leaves the workspace serving externally; it retries next cycle.
            self.learner.initialized = false;
        }
        if self.region.as_ref().map(|r| r.id()) != region_before {
            // An arena now serves what blocks of their own served this cycle: the cached ones,
            // and what the block allocator keeps of the others, would only add to the arena.
            self.own.shrink_to(0);
            if self.cycle_heap_bytes >= TRIM_AFTER {
                self.backend.trim();
            }
        }
        self.cycle_heap_bytes = 0;
        self.huge.release_stale(&*self.backend, self.cycles);
        self.settle_external_cache();
        self.cycle_spilled = 0;
        if self.active > 0 {
            // Other cycles are still open: nothing rewinds and nothing is pinned yet; the next
            // close learns from what happens from here on.
            self.accounts.open_cycle();
            self.external_peak = self.accounts.external_slot;
            return Ok(CycleReport { completed: true, escaped_blocks: 0, escaped_bytes: 0 });
        }
        if self.config.policy_reset == ResetPolicy::BlockLeft {
            if let Some(r) = self.region.as_mut() {
                r.rewind();
            }
        }
        self.epoch += 1;
        let (escaped_blocks, escaped_bytes) = self.accounts.close_cycle(live_blocks);
        Ok(CycleReport { completed: true, escaped_blocks, escaped_bytes })
    }

    /// At a cycle end, the external cache keeps what recent cycles used outside the arena, and
    /// no more: classes unused for two cycles go back, and so does anything above the largest
    /// external footprint of the recent cycles.
    fn settle_external_cache(&mut self) {
        let slot = (self.cycles % NEED_WINDOW as u64) as usize;
        self.external_peaks[slot] = self.external_peak;
        if self.own.cached_bytes() == 0 {
            return;
        }
        self.own.release_stale(self.cycles);
        let peak = self.external_peaks.iter().copied().max().unwrap_or(0);
        self.own.shrink_to((peak + peak / 2).saturating_sub(self.accounts.external_slot));
    }

    /// Allocates `size` bytes, 64-byte aligned, under the workspace's policies.
    #[inline]
    pub fn alloc(&mut self, size: usize) -> Result<NonNull<u8>, Error> {
        self.alloc_in(size, false)
    }

    /// Allocates `size` zero-filled bytes. Memory known to be zero already (never used since it
    /// was mapped) is not written, so untouched pages stay untouched.
    pub fn alloc_zeroed(&mut self, size: usize) -> Result<NonNull<u8>, Error> {
        self.alloc_in(size, true)
    }

    /// The allocation ladder (see the module docs).
    #[inline(always)]
    fn alloc_in(&mut self, size: usize, zeroed: bool) -> Result<NonNull<u8>, Error> {
        let Some(class) = class_of(size) else {
            return Err(self.refuse(size, "request too large"));
        };
        let slot = class_size(class) + HEADER;
        // 1, 2: the arena. (A destroyed workspace has no region, so it takes the slow path.)
        if (size as u64) >= self.config.helper_min_size {
            if let Some(p) = self.carve_arena(class, slot, size, zeroed) {
                return Ok(p);
            }
        }
        self.alloc_outside(size, class, slot, zeroed)
    }

    /// Allocates a block holding `size` bytes from its first `align`-aligned address (`align` a
    /// power of two, at most a page): the block is `align - 64` bytes larger where its alignment
    /// is not known to be `align` (arena blocks), and exactly `size` where the backend's own
    /// blocks are aligned so and keep their headers apart (a device driver's). Freed with
    /// [`Workspace::free`] of the pointer returned, not of the aligned address.
    pub fn alloc_aligned(&mut self, size: usize, align: usize) -> Result<NonNull<u8>, Error> {
        if !align.is_power_of_two() || align > round_to_page(1) {
            return Err(self.refuse(size, "alignment not a power of two up to a page"));
        }
        let pad = align.saturating_sub(BLOCK_ALIGN);
        if pad == 0 {
            return self.alloc_in(size, false);
        }
        let Some(padded) = size.checked_add(pad) else {
            return Err(self.refuse(size, "request too large"));
        };
        if self.inline_headers || self.backend.block_align() < align {
            return self.alloc_in(padded, false);
        }
        let (Some(pc), Some(ec)) = (class_of(padded), class_of(size)) else {
            return Err(self.refuse(size, "request too large"));
        };
        if (padded as u64) >= self.config.helper_min_size {
            if let Some(p) = self.carve_arena(pc, class_size(pc) + HEADER, padded, false) {
                return Ok(p);
            }
        }
        self.alloc_outside(size, ec, class_size(ec) + HEADER, false)
    }

    /// Rungs 1 and 2: a block from the current region, if it has one.
    #[inline(always)]
    fn carve_arena(&mut self, class: usize, slot: usize, size: usize, zeroed: bool) -> Option<NonNull<u8>> {
        let region = self.region.as_mut()?;
        let (p, slot, off) = region.take(class, slot, size, self.epoch)?;
        // Host memory is zero-filled when mapped: never-carved memory needs no write.
        let clear = zeroed && !(self.inline_headers && region.is_fresh(off));
        self.accounts.count_arena(size, slot);
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

    /// Rungs 3 to 5: outside the arena.
    #[cold]
    fn alloc_outside(&mut self, size: usize, class: usize, slot: usize, zeroed: bool) -> Result<NonNull<u8>, Error> {
        if self.destroyed {
            return Err(Error::Destroyed { workspace: self.name.clone() });
        }
        if self.debug == DebugMode::BypassEverything || (size as u64) < self.config.helper_min_size {
            return self.bypass_block(size, slot, zeroed);
        }
        let spill = (self.learner.initialized && self.config.policy_allocation != AllocationPolicy::Always)
            || self.debug == DebugMode::SpillEverything;
        if spill && self.debug == DebugMode::Disabled && self.config.policy_spill == SpillPolicy::Fail {
            return Err(self.refuse(size, "the arena is full and the spill policy is FAIL"));
        }
        if self.huge_blocks
            && self.debug == DebugMode::Disabled
            && size >= HUGE_BLOCK_MIN
            && size >= self.learner.need / 2
        {
            return self.alloc_huge(size, round_to_page(slot), zeroed);
        }
        let p = match self.cached_block(class, size, zeroed) {
            Some(p) => p,
            None => self.new_external(size, slot, zeroed)?,
        };
        if spill {
            self.accounts.spills += 1;
            self.cycle_spilled = self.cycle_spilled.saturating_add(slot);
        }
        self.external_peak = self.external_peak.max(self.accounts.external_slot);
        Ok(p)
    }

    /// Rung 3: a cached block of the class, made live.
    fn cached_block(&mut self, class: usize, size: usize, zeroed: bool) -> Option<NonNull<u8>> {
        let (p, slot) = self.own.take_cached(class, self.cycles)?;
        // SAFETY: a block of ours just taken off the cache: its header is ours to write (its
        // links keep it on the list of blocks of their own).
        unsafe {
            let h = self.own.header(p).as_ptr();
            let links = (*h).links;
            h.write(BlockHeader {
                links,
                ..BlockHeader::live(BlockKind::External, self.token, 0, slot, size, self.epoch)
            })
        };
        self.accounts.count_external(size, slot);
        // SAFETY: `p` is valid for `size <= slot - HEADER` bytes of the backend's memory.
        if zeroed && unsafe { self.backend.zero(p, size) }.is_err() {
            // A fill the device refused: the block goes back, and a new block is asked for.
            // SAFETY: `p` was made live just above and never reached the caller.
            unsafe { self.free(p) };
            return None;
        }
        Some(p)
    }

    /// Rung 4: a new block of its own (rounded to `temp_block_size` when one is set), within
    /// `max_size`, with the external cache kept within what recent cycles used.
    fn new_external(&mut self, size: usize, slot: usize, zeroed: bool) -> Result<NonNull<u8>, Error> {
        let mut len = slot;
        if self.config.temp_block_size > 0 {
            let g = self.config.temp_block_size as usize;
            len = len.div_ceil(g).saturating_mul(g);
        }
        self.reserve(size, len)?;
        // Memory outside the arena stays within what the recent cycles had live there, and half
        // as much again for blocks of other classes cached meanwhile: beyond that, cached blocks
        // go back before a new one is made.
        let live = self.accounts.external_slot.saturating_add(len);
        let peak = self.external_peaks.iter().copied().max().unwrap_or(0).max(self.external_peak).max(live);
        self.own.shrink_to((peak + peak / 2) - live);
        let p = match self.own.new_block(BlockKind::External, size, len, zeroed, self.epoch) {
            Ok(p) => p,
            Err(detail) => return Err(self.system_refused(size, detail)),
        };
        self.accounts.count_external(size, len);
        self.cycle_heap_bytes = self.cycle_heap_bytes.saturating_add(len);
        Ok(p)
    }

    /// A block outside the workspace's accounts (`helper_min_size`, the bypass mode).
    fn bypass_block(&mut self, size: usize, slot: usize, zeroed: bool) -> Result<NonNull<u8>, Error> {
        match self.own.new_block(BlockKind::Bypass, size, slot, zeroed, self.epoch) {
            Ok(p) => Ok(p),
            Err(detail) => Err(self.system_refused(size, detail)),
        }
    }

    /// A huge request: a mapping of its own, lazily faulted, reused from the cache when one of a
    /// fitting size was freed (not for zeroed requests, unless the backend re-zeroes discarded
    /// pages: a fresh mapping is zero without being written).
    #[cold]
    fn alloc_huge(&mut self, size: usize, len: usize, zeroed: bool) -> Result<NonNull<u8>, Error> {
        let reusable = !zeroed || self.backend.discard_zeroes();
        let (at, len) = match reusable.then(|| self.huge.take(len)).flatten() {
            Some((at, len)) => {
                if zeroed {
                    self.backend.discard(at, len);
                }
                (at, len)
            }
            None => {
                // What is cached does not recur: it goes back before more is mapped, so that huge
                // requests of changing sizes (one long cycle over varied work) never add up.
                self.huge.release_all(&*self.backend);
                self.reserve(size, len)?;
                match self.backend.map(len, false) {
                    Ok(at) => (at, len),
                    Err(detail) => return Err(self.system_refused(size, detail)),
                }
            }
        };
        // SAFETY: `at` is a fresh or reclaimed mapping of `len >= HEADER` bytes, page-aligned,
        // owned by us; huge blocks exist only where headers sit in front of their blocks.
        let p = unsafe { write_live_header(at, BlockKind::Huge, self.token, 0, len, size, self.epoch) };
        // SAFETY: its header sits in front of it; off the list until its free.
        unsafe { self.own.link(p) };
        self.huge.live_len += len;
        self.accounts.count_huge(size);
        Ok(p)
    }

    /// Allocates outside the workspace's arena and accounts (a bypass block), whatever its state:
    /// for callers that must keep working after `destroy`. Freed with [`Workspace::free`].
    pub fn alloc_unaccounted(&mut self, size: usize, zeroed: bool) -> Result<NonNull<u8>, Error> {
        let Some(class) = class_of(size) else {
            return Err(self.refuse(size, "request too large"));
        };
        self.bypass_block(size, class_size(class) + HEADER, zeroed)
    }

    /// Takes a block back. Frees of blocks from earlier cycles unpin them; a region retired by
    /// growth, or kept alive by a destroyed workspace, is released with its last block. A pointer
    /// that is no live block of this workspace (a double free, a foreign pointer) is ignored and
    /// counted ([`Workspace::bad_frees`]).
    ///
    /// # Safety
    /// `p` was returned by `alloc`, `alloc_zeroed`, `alloc_aligned` or `realloc` of this
    /// workspace (or the header in front of it is readable, for host memory).
    #[inline]
    pub unsafe fn free(&mut self, p: NonNull<u8>) {
        // SAFETY: forwarded.
        let Some(hp) = (unsafe { self.header(p) }) else {
            self.bad_frees += 1;
            return;
        };
        // SAFETY: a header of ours (or the 64 readable, aligned bytes in front of a host block).
        let Some(kind) = (unsafe { live_kind(hp.as_ptr()) }) else {
            self.bad_frees += 1;
            return;
        };
        let (owner, generation, region, slot, requested) = {
            // SAFETY: a live header; the borrow ends before anything writes it.
            let h = unsafe { hp.as_ref() };
            (h.owner, h.generation, h.region, h.slot, h.requested)
        };
        if owner != self.token {
            // Another workspace's block (or another allocator's): never ours to free.
            self.bad_frees += 1;
            return;
        }
        // The common case: an arena block of the current region, freed in its own cycle.
        if kind == BlockKind::Arena && generation == self.epoch {
            if let Some(r) = self.region.as_mut().filter(|r| r.id() == region) {
                self.accounts.uncount_arena(requested, slot);
                // SAFETY: the header is live, names this region and is not borrowed.
                unsafe { r.release(hp) };
                return;
            }
        }
        // SAFETY: forwarded.
        unsafe { self.free_slow(p, hp) }
    }

    /// The header of a block, if `p` is one of ours.
    ///
    /// # Safety
    /// For host memory: the 64 bytes in front of `p` are readable (`p` came from this workspace).
    #[inline]
    unsafe fn header(&self, p: NonNull<u8>) -> Option<NonNull<BlockHeader>> {
        if self.inline_headers {
            // SAFETY: the caller guarantees the header in front of `p` is readable.
            return Some(unsafe { p.sub(HEADER).cast() });
        }
        // SAFETY: forwarded.
        unsafe { self.header_elsewhere(p) }
    }

    /// # Safety
    /// As for [`Workspace::header`].
    #[cold]
    unsafe fn header_elsewhere(&self, p: NonNull<u8>) -> Option<NonNull<BlockHeader>> {
        for r in self.region.iter().chain(self.retired.iter()) {
            // SAFETY: the region checks that `p` lies in it and reads its header there.
            if let Some(h) = unsafe { r.header_for(p) } {
                return Some(h);
            }
        }
        self.own.find_header(p)
    }

    /// # Safety
    /// `hp` is the live header of the block `p` of this workspace, not borrowed.
    #[cold]
    unsafe fn free_slow(&mut self, p: NonNull<u8>, hp: NonNull<BlockHeader>) {
        // Copy everything out: the memory holding the header may be released below.
        let (size, slot, gen, kind, region) = {
            // SAFETY: the caller guarantees a live header; the borrow ends in this block.
            let h = unsafe { hp.as_ref() };
            (h.requested, h.slot, h.generation, h.kind, h.region)
        };
        let pinned = gen != self.epoch;
        match kind {
            BlockKind::Huge => {
                self.accounts.uncount_huge(size);
                if pinned {
                    self.accounts.unpin(size, 0);
                }
                self.huge.live_len -= slot;
                // SAFETY: on the list since `alloc_huge`; the header is ours to write, and
                // nothing else refers to it any more.
                unsafe {
                    self.own.unlink(p);
                    (*hp.as_ptr()).magic = 0;
                }
                // SAFETY: a huge block's mapping starts at its header and is `slot` bytes long;
                // the caller gives the block up.
                let at = unsafe { p.sub(HEADER) };
                if self.destroyed {
                    // SAFETY: as above.
                    unsafe { self.backend.unmap(at, slot) };
                } else {
                    // SAFETY: as above.
                    unsafe { self.huge.put(&*self.backend, at, slot, self.cycles) };
                }
            }
            BlockKind::Arena => {
                if !self.region.iter().chain(self.retired.iter()).any(|r| r.id() == region) {
                    // No region of ours: a foreign pointer. Accounts stay as they were.
                    self.bad_frees += 1;
                    return;
                }
                if pinned {
                    self.accounts.unpin(size, slot);
                }
                self.accounts.uncount_arena(size, slot);
                // SAFETY: the header is live, not borrowed, and names a region of ours.
                unsafe { self.release_arena(hp, region) };
            }
            BlockKind::External => {
                if pinned {
                    self.accounts.unpin(size, slot);
                }
                self.accounts.uncount_external(size, slot);
                if self.caches_blocks() {
                    // SAFETY: the caller gives the block up; it is put once.
                    unsafe { self.own.put_cached(p, slot, self.cycles) };
                } else {
                    // SAFETY: as above.
                    unsafe { self.own.release(p, slot) };
                }
            }
            BlockKind::Bypass => {
                // SAFETY: the caller gives the block up.
                unsafe { self.own.release(p, slot) };
            }
            BlockKind::Foreign => self.bad_frees += 1,
        }
    }

    /// Whether freed external blocks are kept for reuse: not once destroyed, not by `ALWAYS`
    /// (every allocation fresh, for debugging), not in the debug modes.
    fn caches_blocks(&self) -> bool {
        !self.destroyed
            && self.config.policy_allocation != AllocationPolicy::Always
            && self.debug == DebugMode::Disabled
    }

    /// # Safety
    /// `hp` is the live header of an arena block of region `id` of this workspace, not borrowed.
    unsafe fn release_arena(&mut self, hp: NonNull<BlockHeader>, id: u32) {
        if let Some(r) = self.region.as_mut().filter(|r| r.id() == id) {
            // SAFETY: forwarded.
            unsafe { r.release(hp) };
            return;
        }
        let Some(idx) = self.retired.iter().position(|r| r.id() == id) else { return };
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

    /// Resizes a block, keeping its contents up to the smaller size. In place when its class
    /// does not change.
    ///
    /// # Safety
    /// As for [`Workspace::free`].
    pub unsafe fn realloc(&mut self, p: NonNull<u8>, new_size: usize) -> Result<NonNull<u8>, Error> {
        // SAFETY: forwarded.
        let hp = unsafe { self.header(p) }.filter(|h| {
            // SAFETY: a header of ours (or the bytes in front of a host pointer).
            unsafe { live_kind(h.as_ptr()) }.is_some_and(|k| k != BlockKind::Foreign)
        });
        let Some(hp) = hp else {
            self.bad_frees += 1;
            return Err(self.refuse(new_size, "not a live block of this workspace"));
        };
        // SAFETY: a live header of ours; the borrow ends before the block can be freed below.
        let h = unsafe { &mut *hp.as_ptr() };
        let old = h.requested;
        if h.kind == BlockKind::Arena && crate::arena::slot_for(new_size) == Some(h.slot) && !self.destroyed {
            h.requested = new_size;
            let (o, n) = (old as u64, new_size as u64);
            self.accounts.used = self.accounts.used + n - o;
            if h.generation != self.epoch {
                self.accounts.pinned = self.accounts.pinned + n - o;
            }
            let live = self.accounts.used + self.accounts.external;
            self.accounts.cycle_peak = self.accounts.cycle_peak.max(live);
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
    /// As for [`Workspace::free`]; `p` is live.
    pub unsafe fn block_info(&self, p: NonNull<u8>) -> BlockInfo {
        // SAFETY: the caller guarantees `p` is a live block of ours.
        let h = unsafe { self.header(p).expect("a block of this workspace").as_ref() };
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
        self.active = 0;
        self.nesting = 0;
        // The current region retires like one replaced by growth: kept while blocks live in it.
        if let Some(mut r) = self.region.take() {
            if r.live_blocks() > 0 {
                r.retire();
                self.retired.push(r);
            }
        }
        self.retired.retain(|r| r.live_blocks() > 0);
        self.huge.release_all(&*self.backend);
        self.own.shrink_to(0);
    }

    pub fn stats(&self) -> WorkspaceStats {
        let a = &self.accounts;
        let cap = self.capacity_total() as u64;
        let arena_live = (a.live_slot - a.external_slot) as u64;
        WorkspaceStats {
            cycles: self.cycles,
            capacity_bytes: cap,
            used_bytes: a.used,
            peak_cycle_bytes: if self.active > 0 { a.cycle_peak } else { a.last_cycle_peak },
            cached_bytes: cap - arena_live,
            external_bytes: a.external,
            pinned_bytes: a.pinned,
            overhead_bytes: arena_live - a.used,
            allocation_count: a.allocations,
            spill_count: a.spills,
            failed_allocations: a.failures,
        }
    }

    /// Whether `addr` lies in this workspace's memory: an arena region (its current one, or one
    /// retired while blocks in it live) or a live block of its own outside the arena. O(blocks
    /// outside the arena): for diagnostics, such as finding the workspace under a consumer's view
    /// of its memory (a tensor, an Arrow buffer) by address.
    pub fn holds(&self, addr: usize) -> bool {
        self.region.iter().chain(self.retired.iter()).any(|r| r.contains(addr as *const u8)) || self.own.holds(addr)
    }

    /// Counts a refusal that happened outside the workspace (for example a request too large for
    /// the caller's own arithmetic).
    pub fn record_failure(&mut self) {
        self.accounts.failures += 1;
    }

    /// Frees of pointers that were no live block of this workspace, ignored.
    pub fn bad_frees(&self) -> u64 {
        self.bad_frees
    }

    /// Checks every region's chain and lists against the counters. For tests: O(blocks).
    #[doc(hidden)]
    pub fn verify(&self) {
        let a = &self.accounts;
        let arena_live: usize = self.region.iter().chain(self.retired.iter()).map(|r| r.verify()).sum();
        assert_eq!(arena_live, a.live_slot - a.external_slot, "slot bytes disagree");
        assert!(a.pinned_blocks <= self.live_blocks() && a.pinned_slot <= a.live_slot);
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
        self.huge.cached()
    }

    /// Slot bytes of freed external blocks kept for reuse.
    pub fn external_cached_bytes(&self) -> usize {
        self.own.cached_bytes()
    }

    /// The header size every block carries, for callers sizing arenas by hand.
    pub const fn header_bytes() -> usize {
        HEADER
    }
}
