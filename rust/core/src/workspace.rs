//! A workspace: one named memory pool with cycles. Its state lives in one type per concern: the
//! arena's [`Regions`], the blocks outside the arena ([`OwnBlocks`], with their cache and the
//! external peaks that bound it), huge mappings ([`HugeCache`]), the [`CycleLearner`], the
//! [`Accounts`], the open [`Cycles`], and the [`Route`] its policies fix. Every mapping and block
//! it takes from the system passes one [`LimitAdaptor`] (its `max_size`), so what it holds never
//! exceeds the limit. All methods take `&mut self`: a binding that frees from several threads
//! puts the workspace behind one lock.
//!
//! An allocation climbs one ladder ([`Workspace::alloc`]), in this order:
//! 1. a block of its size class freed in the arena (the most recently freed: cache-hot), the
//!    arena's bump hole, or a run of freed memory the arena's walk finds; not for a class kept
//!    apart ([`Workspace::kept_apart`]), which starts at rung 5;
//! 2. a bypass block, for requests under `helper_min_size` (all of them in the bypass mode, and
//!    after `destroy`);
//! 3. a refusal, where the spill policy is FAIL and the arena is sized;
//! 4. for a huge request, a lazily faulted mapping of its own (reused from its cache);
//! 5. a cached external block of its class (one freed outside the arena);
//! 6. a new external block;
//!
//! and rungs 4 and 6 take memory through the limit: when it refuses, the caches go back and the
//! request is tried once more, then refused ([`Error::OutOfMemory`]).
//!
//! Blocks that outlive their cycles (results a loop keeps) stay where they were carved, and later
//! cycles allocate around them: scattered through the arena, they cut its free runs, so that
//! temporaries of changing sizes no longer fit and spill, and the region never rewinds, so that
//! allocation moves on through all of it and every page of it stays resident. Under the adaptive
//! profile without `max_size`, a cycle end that finds blocks of up to [`APART_MAX`] bytes pinned
//! at an earlier one still live in the region puts their size classes apart ([`Apart`]): from
//! then on those classes are served outside the arena, as results in a plain process are, a
//! fresh region replaces the old one (at once the first few times, then after waits that
//! double: a loop whose kept sizes keep changing would replace it at every cycle), and the arena
//! holds temporaries (and state each cycle replaces) only. Larger classes stay: the cycle's own
//! large temporaries usually share them, and would leave the arena too while it stays sized for
//! them. Under a limit, the arena and what is
//! served outside it share one budget, and a class moved out could find no room there.
//!
//! What a cycle never touched costs address space, not memory: a region pre-faults at most what
//! the learned cycles used (and never more than [`PREFAULT_LIMIT`]), zeroed requests carved from
//! never-used memory are not written, and huge requests get lazily faulted mappings of their own.
//! So an arena that follows changing needs is resized within what its region maps where it can
//! ([`ArenaRegion::resize_in_place`]), keeping what it has resident, and is not replaced by a
//! smaller one that would give nothing back.
//!
//! What a cycle touched stays resident for the next ones, except where a large block (from
//! [`GIVE_BACK_MIN`], glibc's largest mapping threshold) is carved on memory not resident while
//! free runs that large lie idle elsewhere in the region (between blocks other cycles keep): as
//! much of them goes back to the system ([`ArenaRegion::give_back_idle`]) as the block found
//! not resident (a quarter of it, or 32 MiB, at least: a few pages do not pay for a give-back
//! elsewhere). Those pages fault in again where a later block takes them. A plain process maps
//! every block that large afresh and unmaps it at its free; a run freed by smaller blocks would
//! have stayed in its heap.

use std::ptr::NonNull;
use std::sync::Arc;

use crate::accounts::{largest_served, Accounts, CycleReport, WorkspaceStats};
use crate::arena::{is_live_arena, live_kind, write_live_header, ArenaRegion, BlockHeader, BlockKind, HEADER};
use crate::arena::{GIVE_BACK_MIN, ZERO_SPARING_MIN};
use crate::backend::{available_memory, round_to_page, AnonymousMemory, Backend, FileMappedMemory, LimitAdaptor};
use crate::backend::{page_bytes, BLOCK_ALIGN};
use crate::classes::{class_of, class_size, ClassSet};
use crate::config::{
    AllocationPolicy, DebugMode, LearningPolicy, LocationPolicy, ResetPolicy, SpillPolicy, WorkspaceConfiguration,
};
use crate::error::{BackendError, Error, Name, Refusal};
use crate::external::OwnBlocks;
use crate::history::{Action, LiveBlock, Recorder, Segment, SegmentKind};
use crate::huge::{spare_head, HugeCache, HUGE_BLOCK_MIN};
use crate::learner::{CycleFacts, CycleLearner, Sizing, MAX_HOLD, NEED_WINDOW};
use crate::regions::{InRegion, Regions};

/// The most a region pre-faults when it is mapped; pages beyond fault in on first use.
pub const PREFAULT_LIMIT: usize = 1 << 30;

/// A region shrinks in place while it maps at most this many times what it is to serve.
const IN_PLACE_MAX: usize = 4;

/// A new region of lazily faulted memory maps this many times what it serves, so that it can
/// grow where it lies (address space only: its pages fault in as they are used).
const ROOM_TO_GROW: usize = 2;

/// External bytes a cycle must have served before the block allocator's cache is returned when
/// an arena takes over.
const TRIM_AFTER: usize = 1 << 20;

/// Refusals that are not for want of memory (no `oom` event records them).
const REFUSED_ALIGNMENT: &str = "alignment not a power of two up to a page";
const REFUSED_NOT_OURS: &str = "not a live block of this workspace";

/// Workspace tokens: unique in the process, never 0.
static NEXT_TOKEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

thread_local! {
    /// The token of the workspace whose cycle opened last on this thread, with none open before
    /// (0: none), among those that lend ([`Route::lends`]). One access per cycle: a thread local
    /// of a shared library is reached through a call.
    static LAST_OPENED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

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

/// The rungs of the allocation ladder a workspace climbs, fixed when it is made: its policies,
/// debug mode and memory do not change afterwards.
#[derive(Debug, Clone, Copy)]
struct Route {
    /// The debug mode in force (the environment overrides the configuration).
    debug: DebugMode,
    /// Requests below this go to bypass blocks (`helper_min_size`; all of them in the bypass mode).
    bypass_below: u64,
    /// Whether an arena serves (no `ALWAYS`, no debug mode).
    arena: bool,
    /// Whether every request outside the arena is a spill (`SPILL_EVERYTHING`).
    spill_all: bool,
    /// Whether requests outside a sized arena count as spills (not under `ALWAYS`).
    spills: bool,
    /// Whether a spill is refused (the spill policy FAIL, no debug mode).
    fail_spills: bool,
    /// Whether huge requests get mappings of their own (host memory the workspace maps itself).
    huge: bool,
    /// Whether freed external blocks are kept for reuse (no `ALWAYS`, no debug mode).
    caches: bool,
    /// Whether free lists serve (a region that rewinds at cycle ends).
    lists: bool,
    /// Whether the CPU can touch the memory (headers sit in front of their blocks; fresh memory
    /// reads as zero).
    host: bool,
    /// Whether size classes whose blocks outlive their cycles are served outside the arena once
    /// they fragment it (the adaptive profile).
    apart: bool,
    /// Whether its empty region may go to the lot when another workspace's cycles alternate
    /// with its own, and it may take one from there ([`crate::lot`]): an arena of anonymous
    /// memory that rewinds, under no limit.
    lends: bool,
    /// Whether the learner grows the arena by what a cycle spills (the adaptive profile): a
    /// spill is then a passing state, and the arena's idle runs go back beside a large one.
    grows_by_spills: bool,
}

impl Route {
    fn new(config: &WorkspaceConfiguration, debug: DebugMode, backend: &dyn Backend) -> Self {
        let plain = debug == DebugMode::Disabled;
        let always = config.policy_allocation == AllocationPolicy::Always;
        let lists = config.policy_reset == ResetPolicy::BlockLeft;
        let fail_spills = plain && config.policy_spill == SpillPolicy::Fail;
        Route {
            debug,
            bypass_below: if debug == DebugMode::BypassEverything { u64::MAX } else { config.helper_min_size },
            arena: plain && !always,
            spill_all: debug == DebugMode::SpillEverything,
            spills: !always,
            fail_spills,
            huge: plain && backend.host_accessible() && config.policy_location == LocationPolicy::Ram,
            caches: plain && !always,
            lists,
            host: backend.host_accessible(),
            apart: plain
                && !always
                && lists
                && !fail_spills
                && config.policy_learning == LearningPolicy::Adaptive
                && config.max_size == 0,
            // A workspace given a size (initial, least or most) keeps what it was given; one whose
            // spills fail keeps the arena it refuses them from.
            lends: plain
                && !always
                && lists
                && !fail_spills
                && config.max_size == 0
                && config.initial_size == 0
                && config.min_size == 0
                && backend.name() == AnonymousMemory.name(),
            grows_by_spills: config.policy_learning == LearningPolicy::Adaptive,
        }
    }
}

/// The largest blocks whose classes are put apart (see the module docs).
const APART_MAX: usize = 256 << 10;

/// The size classes kept apart from the arena (see the module docs), and what tells a cycle end
/// when to look for more.
#[derive(Debug, Default, Clone)]
struct Apart {
    /// Classes served outside the arena: their blocks outlived cycles in it.
    classes: ClassSet,
    /// The [`Cycles::kept_here`] at which the last look found no class to put apart.
    looked: (u64, usize),
    /// The region in which classes were put apart since it was last replaced for them (none
    /// once another replaced it, their kept blocks retired with it).
    pending: Option<u64>,
    /// The cycle from which the region may be replaced for classes put apart again, the cycles
    /// to wait after that, and the replacements so far. The first few come at once: a loop that
    /// keeps results of a few sizes has them all apart within a few cycles, while kept blocks of
    /// those sizes scattered through the arena would keep it from rewinding, and more of it
    /// resident, until then. After them the wait doubles at each replacement, so that a loop
    /// whose kept sizes keep changing (a new class at most cycle ends) replaces its region a few
    /// more times, not at every cycle.
    next: u64,
    wait: u64,
    replaced: u32,
}

/// Replacements of a region for classes put apart that come at once.
const APART_AT_ONCE: u32 = 4;

/// The cycles to wait after those, before the next replacement.
const APART_WAIT: u64 = NEED_WINDOW as u64;

/// Opens in a row after another workspace's cycle opened on the thread from which a workspace
/// counts as entered in turn with others: not one that ran once after another.
const IN_TURN: u8 = 2;

/// Opens in a row that found the workspace itself opened last on the thread, from which it looks
/// only at every this many opens: a loop of one workspace pays for the look a thirty-second of
/// the time, and one that comes to alternate with another is seen within as many cycles.
const ALONE: u8 = 32;

/// The cycles of a workspace: how many are open, how deep, and the pinning epoch.
#[derive(Debug, Default, Clone)]
struct Cycles {
    /// Cycles open now: more than one when asyncio tasks or threads each run a cycle of this
    /// workspace at the same time.
    active: u32,
    /// Levels nested inside the open cycles (`with ws:` inside `with ws:`).
    nesting: u32,
    /// The pinning epoch: blocks handed out in an earlier one are pinned. It advances when the
    /// last open cycle closes.
    epoch: u64,
    /// Cycles completed (each outermost exit, overlapping ones included).
    completed: u64,
    /// Slot bytes served outside an initialised arena in the open cycle.
    spilled: usize,
    /// Whether one of its spills found as many bytes free in the arena as it asked for.
    spilled_in_room: bool,
    /// Whether blocks of earlier cycles were in the arena when the open cycle began (beside
    /// cycles still open, whether the region held any block at the last close: a region that
    /// never rewinds fills with what such cycles keep).
    kept_in_arena: bool,
    /// Slot bytes of blocks of earlier cycles that the last closed cycle freed (state it
    /// replaced), which the need learned then counts beside their replacements.
    replaced: usize,
    /// Whether the last close mapped a new region: blocks outside the arena that earlier cycles
    /// left live (state this cycle replaces) go back as they are freed, as the cached ones did
    /// then, rather than staying cached beside the arena that now serves their sizes.
    remapped: bool,
    /// The count of closes when the arena was last remapped: where cycles overlap, blocks
    /// outside it stamped before ([`BlockHeader::stamp`]) are the open cycles' from before it
    /// served their sizes, and go back as they are freed too.
    remapped_at: u64,
    /// The current region's id, and how many of the blocks pinned there at the last cycle end
    /// still live (results kept across cycles, once the cycle that replaces state has run).
    kept_here: (u64, usize),
    /// Whether the workspace was destroyed: no cycle opens again, and its memory goes back as
    /// its last blocks die. The one place this is decided.
    destroyed: bool,
    /// Opens in a row (up to [`IN_TURN`]) at which the last cycle to open on the thread was
    /// another workspace's: workspaces entered in turn, whose empty regions go to the lot
    /// ([`crate::lot`]) from the [`IN_TURN`]th on.
    turns: u8,
    /// Opens in a row (up to 255) that found it opened last on the thread.
    alone: u8,
    /// The capacity and pre-fault of the region it parked in the lot, which the next open
    /// replaces (0: none parked).
    parked: (usize, usize),
    /// The id of the last region it took from the lot (0: none), which the learner does not
    /// shrink: it may serve more than this workspace's need, for another's (the lot shrinks it
    /// once no workspace asks for that much).
    adopted: u64,
    /// The lot's count of parks and takes at this workspace's last take from it (0: none): the
    /// lot keeps regions parked for the turns it sees between a workspace's takes.
    last_take: u64,
    /// Whether the block allocator's free memory was returned before the workspace's first
    /// large block of its own (see [`Workspace::new_external`]).
    trimmed: bool,
    /// Counters when the open cycle began: allocations, spills, arena capacity.
    opened: (u64, u64, u64),
    /// What the last close reported.
    last: CycleReport,
    /// Allocations and live blocks when the last cycle closed, for checking that a
    /// [`Workspace::reopen_cycle`] follows its close with nothing in between.
    #[cfg(debug_assertions)]
    closed_with: (u64, usize),
}

/// One request on its way down the ladder.
#[derive(Debug, Clone, Copy)]
struct Request {
    /// Bytes an arena block holds: what was asked for, and any padding an alignment needs.
    size: usize,
    class: usize,
    /// Bytes the block occupies in the arena: its class size and a header.
    slot: usize,
    zeroed: bool,
    /// Bytes a block outside the arena holds: `size`, or less where the backend's own blocks
    /// are aligned as asked already (a device driver's) and need no padding.
    outside: usize,
}

impl Request {
    #[inline(always)]
    fn new(size: usize, zeroed: bool) -> Option<Self> {
        let class = class_of(size)?;
        Some(Request { size, class, slot: class_size(class) + HEADER, zeroed, outside: size })
    }

    /// `size` bytes from an `align`-aligned address (`align` a power of two): arena blocks are
    /// 64-byte aligned, so they carry `align - 64` bytes of padding; blocks of the backend's own
    /// carry none where the backend aligns them to `own_align >= align` with their headers apart.
    fn aligned(size: usize, align: usize, own_align: Option<usize>) -> Option<Self> {
        let padded = size.checked_add(align.saturating_sub(BLOCK_ALIGN))?;
        let mut req = Request::new(padded, false)?;
        if own_align.is_some_and(|a| a >= align) {
            class_of(size)?;
            req.outside = size;
        }
        Some(req)
    }

    /// The request a block outside the arena serves.
    fn outside(self) -> Self {
        if self.outside == self.size {
            return self;
        }
        let class = class_of(self.outside).expect("smaller than a request that has a class");
        Request { size: self.outside, class, slot: class_size(class) + HEADER, ..self }
    }
}

/// One workspace.
#[derive(Debug)]
pub struct Workspace {
    name: Name,
    /// Unique in the process; written in the header of every block the workspace hands out.
    token: u64,
    config: WorkspaceConfiguration,
    route: Route,
    /// The memory source under the limit every mapping and block passes (`max_size`; none: the
    /// largest `usize`): what it holds is the workspace's footprint.
    limit: Arc<LimitAdaptor>,
    regions: Regions,
    own: OwnBlocks,
    huge: HugeCache,
    cycles: Cycles,
    learner: CycleLearner,
    accounts: Accounts,
    apart: Apart,
    /// Whether its history is recorded (in the limit's [`Recorder`]): the one flag the ladder
    /// and frees test, so that recording costs nothing while off.
    recording: bool,
}

// SAFETY: a workspace exclusively owns its regions, its blocks' headers and its caches; every
// access goes through `&mut self`, so it can move between threads.
unsafe impl Send for Workspace {}

impl Drop for Workspace {
    fn drop(&mut self) {
        self.huge.release_all(&*self.limit);
        if self.route.lends {
            // What it parked and nobody took (perhaps not the region it parked last).
            crate::lot::evict(self.token);
        }
    }
}

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
    /// Where workspaces made now record ([`crate::history::record_new_workspaces`]), it records
    /// from its first mapping on (without, where the system has no room for the ring).
    pub fn with_backend(name: &str, config: WorkspaceConfiguration, backend: Arc<dyn Backend>) -> Result<Self, Error> {
        Self::made(name, config, backend, crate::history::new_workspace_ring())
    }

    /// A workspace that records into a ring of `ring` events from the start (None: it does not).
    pub(crate) fn made(
        name: &str,
        config: WorkspaceConfiguration,
        backend: Arc<dyn Backend>,
        ring: Option<usize>,
    ) -> Result<Self, Error> {
        config.validate()?;
        let debug = config.effective_debug_mode();
        let max = if config.max_size > 0 { config.max_size as usize } else { usize::MAX };
        let limit = Arc::new(LimitAdaptor::new(backend.clone(), max));
        let token = NEXT_TOKEN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = Name::from(name);
        let own = OwnBlocks::new(limit.clone(), backend.clone(), token)
            .map_err(|cause| Error::system(&name, cause.bytes as u64, 0, config.max_size, cause))?;
        let mut ws = Workspace {
            name,
            token,
            route: Route::new(&config, debug, &*backend),
            learner: CycleLearner::new(&config),
            config,
            own,
            limit,
            regions: Regions::new(),
            huge: HugeCache::default(),
            cycles: Cycles::default(),
            accounts: Accounts::default(),
            apart: Apart::default(),
            recording: false,
        };
        if ring.is_some() {
            // Recording is a diagnostic: a ring the system has no room for leaves it off.
            let _ = ws.record_history(ring);
        }
        if ws.config.initial_size > 0 && ws.route.arena {
            // Nothing was learned yet: the pages fault in as cycles first touch them.
            let cap = crate::learner::capacity_for(&ws.config, 0);
            ws.resize_arena(cap, 0, false)?;
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

    /// The memory source (under the workspace's limit).
    pub fn backend(&self) -> &Arc<dyn Backend> {
        self.limit.upstream()
    }

    /// The debug mode in force (the environment overrides the configuration).
    pub fn debug_mode(&self) -> DebugMode {
        self.route.debug
    }

    pub fn is_open(&self) -> bool {
        self.cycles.active > 0
    }

    /// Open cycles and the levels nested in them.
    pub fn depth(&self) -> u32 {
        self.cycles.active + self.cycles.nesting
    }

    /// Cycles open now (more than one when they overlap).
    pub fn open_cycles(&self) -> u32 {
        self.cycles.active
    }

    pub fn is_destroyed(&self) -> bool {
        self.cycles.destroyed
    }

    /// Completed cycles.
    pub fn generation(&self) -> u64 {
        self.cycles.completed
    }

    /// The pinning epoch: it advances when the last open cycle closes; a live block handed out in
    /// an earlier one is pinned (see [`BlockInfo::generation`]).
    pub fn epoch(&self) -> u64 {
        self.cycles.epoch
    }

    pub fn is_initialized(&self) -> bool {
        self.learner.initialized
    }

    /// Live blocks in all regions and outside them (bypass blocks excluded).
    pub fn live_blocks(&self) -> usize {
        self.regions.live_blocks() + self.accounts.external_blocks
    }

    /// Bytes the workspace holds from its memory source, all of which `max_size` bounds: arena
    /// regions (the current one and those retired while blocks in them live), blocks outside the
    /// arena (live and cached, headers included, as asked of the block allocator) and huge
    /// mappings (live and cached). Not counted: bypass blocks (outside the workspace's accounts)
    /// and the host memory holding the headers of a device workspace.
    pub fn footprint(&self) -> usize {
        self.limit.held()
    }

    /// The `max_size` limit in bytes (`usize::MAX`: none).
    pub fn limit(&self) -> usize {
        self.limit.limit()
    }

    /// `Err(Destroyed)` once the workspace was destroyed: the one place that decides what a
    /// destroyed workspace refuses (opening cycles and sizing; bindings ask it before explicit
    /// allocations). Frees go on working, and allocations are served outside its accounts.
    pub fn check_alive(&self) -> Result<(), Error> {
        if self.cycles.destroyed {
            Err(Error::destroyed(&self.name))
        } else {
            Ok(())
        }
    }

    // -- the limit ---------------------------------------------------------------------------------

    /// Gives back what the workspace keeps for reuse (cached blocks and huge mappings): the first
    /// thing a full limit does.
    fn release_caches(&mut self) {
        self.own.shrink_to(0);
        self.huge.release_all(&*self.limit);
    }

    /// Takes memory for a request of `size` through `take`, which asks the limited source; when
    /// the limit refuses, the caches go back and `take` runs once more. A limit that still
    /// refuses is the workspace's refusal (`max_size`), any other the system's.
    fn within_limit<T>(
        &mut self,
        size: usize,
        mut take: impl FnMut(&mut Self) -> Result<T, BackendError>,
    ) -> Result<T, Error> {
        match take(self) {
            Ok(v) => return Ok(v),
            Err(e) if self.is_our_limit(&e) => self.release_caches(),
            Err(e) => return Err(self.system_refused(size, e)),
        }
        match take(self) {
            Ok(v) => Ok(v),
            Err(e) if self.is_our_limit(&e) => Err(self.refuse(size, "max_size reached")),
            Err(e) => Err(self.system_refused(size, e)),
        }
    }

    /// Whether `e` is the refusal of this workspace's own limit (not of a limit under it).
    fn is_our_limit(&self, e: &BackendError) -> bool {
        e.is_limit() && self.limit.room() < e.bytes
    }

    /// Counts a refusal and builds its error (which allocates nothing).
    fn refuse(&mut self, size: usize, reason: &'static str) -> Error {
        self.refusal(size as u64, reason)
    }

    /// Counts a refusal of `requested` bytes for `reason` made outside the workspace (a request
    /// too large for the caller's own arithmetic) and builds its error, which allocates nothing.
    pub fn refusal(&mut self, requested: u64, reason: &'static str) -> Error {
        self.accounts.failures += 1;
        self.out_of_memory(requested, reason)
    }

    fn out_of_memory(&self, requested: u64, reason: &'static str) -> Error {
        let room = self.room();
        let (largest, live_end) = self.regions.current().map_or((0, 0), ArenaRegion::free_runs);
        let recorder = self.limit.recorder();
        // The caller's stack was for a block that is not coming.
        recorder.set_context(0);
        // Not for want of memory: a bad alignment, a pointer that is no block, a size that
        // overflowed the caller's arithmetic.
        if reason != REFUSED_ALIGNMENT && reason != REFUSED_NOT_OURS && requested != u64::MAX {
            recorder.record(Action::Oom, 0, requested as usize, 0, room as u64);
        }
        Error::OutOfMemory(Refusal {
            workspace: self.name.clone(),
            requested,
            in_use: self.accounts.used + self.accounts.external,
            limit: self.refusal_limit(),
            footprint: self.footprint() as u64,
            pinned: self.accounts.pinned,
            cached: (self.own.cached_bytes() + self.huge.cached().1) as u64,
            largest_free: largest_served(largest) as u64,
            // Huge mappings count their whole length, as the limit counts it.
            held: self.accounts.held().saturating_add(self.huge.live_len) as u64,
            live_end: live_end as u64,
            room: room as u64,
            reason,
        })
    }

    fn system_refused(&mut self, size: usize, cause: BackendError) -> Error {
        self.accounts.failures += 1;
        let recorder = self.limit.recorder();
        recorder.set_context(0);
        recorder.record(Action::Oom, 0, size, 0, self.room() as u64);
        self.system_error(size as u64, cause)
    }

    /// The system refused `requested` bytes for `cause`: the error, with what the workspace holds
    /// live and its limit, as a refusal of its own gives them.
    fn system_error(&self, requested: u64, cause: BackendError) -> Error {
        Error::system(&self.name, requested, self.accounts.used + self.accounts.external, self.refusal_limit(), cause)
    }

    /// The limit a refusal names: `max_size`, or the arena's capacity where there is none.
    fn refusal_limit(&self) -> u64 {
        if self.config.max_size > 0 {
            self.config.max_size
        } else {
            self.regions.capacity() as u64
        }
    }

    /// Bytes the workspace could still take: what its limit grants, or without one what the
    /// system has available.
    fn room(&self) -> usize {
        if self.limit.limit() == usize::MAX {
            available_memory()
        } else {
            self.limit.room()
        }
    }

    // -- the arena's size --------------------------------------------------------------------------

    /// Makes the current region `cap` bytes, of which the first `prefault` are pre-faulted when
    /// the next cycle opens; the old one is dropped, or retired while blocks in it live. Within
    /// the limit: a region that would take the footprint past `max_size` (with the caches given
    /// back) is mapped smaller where growth still fits, else not at all, and the workspace keeps
    /// what it has (`Ok(false)`). Where the old region goes back, it goes first, so that the two
    /// never coexist past the limit. Without a limit, a region of lazily faulted memory is
    /// resized where it lies when it can ([`ArenaRegion::resize_in_place`]), unless `fresh`
    /// asks for a new one.
    fn resize_arena(&mut self, cap: usize, prefault: usize, fresh: bool) -> Result<bool, Error> {
        if cap == 0 {
            return Ok(true);
        }
        let current = self.regions.current_capacity();
        if cap != current && !fresh && self.lazily_resized() {
            // Within what the region maps, it is resized where it is: an arena that follows
            // changing needs keeps what it has resident, with no new mapping and no pre-fault
            // of it again. A region much larger than it is to serve is replaced (its address
            // space goes back too); a limit counts what is mapped, so under one it always is.
            if let Some(r) = self.regions.current_mut() {
                if (cap > current || r.mapped() <= cap.saturating_mul(IN_PLACE_MAX)) && r.resize_in_place(cap) {
                    self.regions.set_prefault(prefault.min(PREFAULT_LIMIT));
                    return Ok(true);
                }
            }
        }
        let freed = if self.regions.current_is_empty() { current } else { 0 };
        let mut room = self.limit.room().saturating_add(freed);
        if cap > room {
            self.release_caches();
            room = self.limit.room().saturating_add(freed);
        }
        let cap = if cap <= room {
            cap
        } else {
            // Growth still fits, smaller: what the limit leaves, in whole pages.
            let fits = room / page_bytes() * page_bytes();
            if cap <= current || fits <= current {
                return Ok(false);
            }
            fits
        };
        if freed == 0 && self.regions.current().is_some() && !self.regions.reserve_retirement() {
            // The old region's blocks would have nowhere to be listed: keep it.
            return Ok(false);
        }
        if freed > 0 && cap > self.limit.room() {
            self.regions.drop_empty_current();
        }
        let id = self.regions.take_id();
        let (token, lists) = (self.token, self.route.lists);
        // Where cycles overlap (nothing is pinned, and the region never rewinds while any is
        // open) and the region's pages cost memory only once touched, it maps room to grow where
        // it lies: a need that rises by steps then grows it there, rather than a second region
        // filling beside the first while the open cycles' blocks in it live.
        let roomy = (self.accounts.overlapping() && self.lazily_resized() && cap % page_bytes() == 0)
            .then(|| {
                ArenaRegion::with_room(id, token, cap, cap.saturating_mul(ROOM_TO_GROW), self.limit.clone(), lists).ok()
            })
            .flatten();
        let region = match roomy {
            Some(r) => r,
            // A region the system refuses is no refusal of a request (the cycle goes on outside
            // the arena, and sizing is tried again): counted, not recorded.
            None => ArenaRegion::new(id, token, cap, self.limit.clone(), lists).map_err(|cause| {
                self.accounts.failures += 1;
                self.system_error(cap as u64, cause)
            })?,
        };
        // Pre-fault what cycles will touch again, so that a learned cycle takes no page faults;
        // the overallocation, and anything past the bounds, costs address space only. Deferred
        // to the next cycle: a workload that never has one (a whole program in one cycle) does
        // not pay for it.
        self.regions.install(region, prefault.min(PREFAULT_LIMIT));
        Ok(true)
    }

    /// Notes this workspace's open on the thread, and whether it comes in turn with others'.
    #[inline]
    fn note_open_on_thread(&mut self) {
        let last = LAST_OPENED.with(|t| t.replace(self.token));
        let c = &mut self.cycles;
        if last != 0 && last != self.token {
            c.alone = 0;
            c.turns = c.turns.saturating_add(1).min(IN_TURN);
        } else {
            c.alone = c.alone.saturating_add(1);
            c.turns = 0;
        }
    }

    /// Whether its cycles come in turn with other workspaces' on its thread.
    #[inline]
    fn in_turn(&self) -> bool {
        self.cycles.turns >= IN_TURN
    }

    /// Makes a region from the lot that serves `cap` bytes (resized where it lies) the current
    /// one, whose first `prefault` bytes are pre-faulted as the cycle opens; the old one, empty
    /// if any, goes back. Returns whether the lot had one. Taken only as a cycle opens, to be
    /// used now: a workspace sized at a close may not open again for long, and its own new
    /// region costs nothing until then.
    #[cold]
    #[inline(never)]
    fn take_from_lot(&mut self, cap: usize, prefault: usize) -> bool {
        let page = page_bytes();
        if cap % page != 0 || self.accounts.overlapping() {
            return false;
        }
        let taken = crate::lot::take(cap, cap.saturating_mul(IN_PLACE_MAX), &mut self.cycles.last_take);
        let Some((mut r, serve)) = taken else { return false };
        let id = self.regions.take_id();
        r.hand_over(id, self.token, self.limit.clone());
        if self.limit.take_over(r.base(), r.mapped()).is_err() {
            // A workspace that lends has no limit to refuse; dropped, the region goes back
            // through this one's source without having been counted there.
            r.hand_over(id, self.token, self.limit.upstream().clone());
            return false;
        }
        // Empty, it grows in place where it serves less than `cap`. Where it serves more, it
        // serves what wider workspaces in turn still ask for (kept resident for the next of
        // them), and gives back the pages above that.
        let serve = serve.next_multiple_of(page).min(r.mapped());
        if r.capacity() < cap || r.capacity() > serve {
            let _ = r.resize_in_place(if r.capacity() < cap { cap } else { serve });
        }
        self.cycles.adopted = id;
        self.regions.install(r, prefault.min(PREFAULT_LIMIT));
        true
    }

    /// Parks the current region, empty, in the lot for the next workspace entered in turn with
    /// this one; the next open of this one takes a region of its size back (from the lot where
    /// one is there). Nothing happens where the lot is busy or full of another thread's.
    #[cold]
    #[inline(never)]
    fn park(&mut self) {
        let Some((mut r, prefault)) = self.regions.take_empty_current() else { return };
        let (id, at, len, cap) = (r.id(), r.base(), r.mapped(), r.capacity());
        r.hand_over(0, 0, self.limit.upstream().clone());
        self.limit.let_go(at, len);
        match crate::lot::park(r, self.token) {
            None => self.cycles.parked = (cap, prefault.max(self.learner.need)),
            Some(mut r) => {
                // Back as it was: counted again (there is no limit to refuse it).
                r.hand_over(id, self.token, self.limit.clone());
                let _ = self.limit.take_over(at, len);
                self.regions.install(r, prefault);
            }
        }
    }

    /// Trades the current region, empty and not pre-faulted yet, for one from the lot, resident
    /// already: each of the workspaces entered in turn maps a region of its own (at a close),
    /// and pre-faulting them all would make as many resident.
    #[cold]
    #[inline(never)]
    fn trade_for_resident(&mut self) {
        let prefault = self.regions.take_prefault();
        if !self.take_from_lot(self.regions.current_capacity(), prefault) {
            self.regions.set_prefault(prefault);
        }
    }

    /// A region of the size of the one parked, at the open of a cycle: from the lot, or mapped.
    #[cold]
    #[inline(never)]
    fn unpark(&mut self) {
        let (parked, prefault) = std::mem::take(&mut self.cycles.parked);
        // What the learner asks for now: the region it parked may have been wider than that
        // (taken over from a wider workspace, which its learner does not shrink).
        let cap = if self.learner.initialized && self.learner.need > 0 {
            crate::learner::capacity_for(&self.config, self.learner.need)
        } else {
            parked
        };
        if !self.take_from_lot(cap, prefault) {
            // A failure to map leaves the cycle serving outside the arena; the learner sizes it
            // again.
            let _ = self.resize_arena(cap, prefault, true);
        }
    }

    /// Whether the arena's regions may serve less than they map: no limit counts what they map,
    /// and their pages cost memory only once touched.
    fn lazily_resized(&self) -> bool {
        self.limit.limit() == usize::MAX && self.route.lists && self.limit.faults_lazily()
    }

    /// Applies a sizing; one that could not be applied (the limit, the system) is retried at the
    /// next cycle end, and the cycle keeps the arena it has. `fresh`: a new region, not the
    /// current one resized.
    fn apply(&mut self, sizing: Sizing, fresh: bool) -> Result<(), Error> {
        let Sizing::Map { capacity, prefault } = sizing else { return Ok(()) };
        match self.resize_arena(capacity, prefault, fresh) {
            Ok(true) => Ok(()),
            Ok(false) => {
                self.learner.retry_later(&self.config);
                Ok(())
            }
            Err(e) => {
                self.learner.retry_later(&self.config);
                Err(e)
            }
        }
    }

    /// Sizes the arena now from what was learned (or from the initial and minimum sizes).
    pub fn initialize(&mut self) -> Result<(), Error> {
        self.check_alive()?;
        let current = self.regions.current_capacity();
        let sizing = self.learner.initialize(&self.config, current, self.route.arena);
        self.apply(sizing, false)
    }

    // -- cycles ------------------------------------------------------------------------------------

    /// Opens a cycle, or nests in the open one (one caller's view: `with ws:` inside `with ws:`).
    pub fn enter(&mut self) -> Result<(), Error> {
        if self.cycles.active > 0 {
            self.nest()
        } else {
            self.open_cycle()
        }
    }

    /// Closes the innermost level; the outermost one ends the cycle: learning, sizing, caches,
    /// rewind (or, at the next open, once what outlived the cycle has died).
    pub fn exit(&mut self) -> Result<CycleReport, Error> {
        if self.cycles.nesting > 0 {
            self.unnest().map(|()| CycleReport::default())
        } else {
            self.close_cycle()
        }
    }

    /// Opens a cycle of its own, beside any open ones (another asyncio task's, another
    /// thread's): each counts as a cycle, and the arena rewinds only when none is open.
    pub fn open_cycle(&mut self) -> Result<(), Error> {
        self.open_cycle_after(true)
    }

    /// Opens the next cycle right after [`Workspace::close_cycle`] closed the last one, through
    /// the same borrow (nothing was allocated or freed in between): as [`Workspace::open_cycle`],
    /// without rewinding the region that the close just rewound. Called otherwise, it is still
    /// safe, but a region left carved up by blocks that died since stays so until the next close.
    pub fn reopen_cycle(&mut self) -> Result<(), Error> {
        self.open_cycle_after(false)
    }

    fn open_cycle_after(&mut self, rewind: bool) -> Result<(), Error> {
        self.check_alive()?;
        #[cfg(debug_assertions)]
        debug_assert!(
            rewind || self.cycles.closed_with == (self.accounts.allocations, self.live_blocks()),
            "reopen_cycle after allocations or frees since the last close"
        );
        if self.cycles.active == 0 {
            if rewind && self.route.lists {
                // Blocks that outlived the last cycle and died since leave the region empty but
                // carved up: it starts over, as it would have had they died inside that cycle.
                if let Some(r) = self.regions.current_mut().filter(|r| r.live_blocks() == 0) {
                    r.rewind();
                }
            }
            if self.route.lends {
                // A reopen follows its own close, with nothing opened on the thread between; a
                // workspace that found itself opened last many times in a row looks only now and
                // then (the thread local costs a call).
                let c = &self.cycles;
                if rewind && (c.alone < ALONE || c.completed % u64::from(ALONE) == 0) {
                    self.note_open_on_thread();
                }
                if self.cycles.parked.0 > 0 && self.regions.current().is_none() {
                    self.unpark();
                } else if self.in_turn() && self.regions.has_pending_prefault() && self.regions.current_is_empty() {
                    self.trade_for_resident();
                }
            }
            self.accounts.open_cycle();
            self.cycles.spilled = 0;
            self.cycles.spilled_in_room = false;
            self.cycles.kept_in_arena = self.regions.current().is_some_and(|r| r.live_blocks() > 0);
            self.own.peaks.open_cycle(self.accounts.external_slot);
            self.mark_cycle_start();
            if self.regions.has_pending_prefault() {
                self.prefault_now();
            }
        }
        if self.cycles.active > 0 {
            self.accounts.open_beside(self.cycles.active.saturating_add(1), self.cycles.completed);
        }
        if self.recording {
            self.record_open();
        }
        self.cycles.active += 1;
        Ok(())
    }

    /// Records an open, overlapping ones too: each has its close.
    #[cold]
    #[inline(never)]
    fn record_open(&self) {
        let r = self.limit.recorder();
        if self.cycles.active == 0 {
            r.set_cycle(self.cycles.completed);
        }
        r.record(Action::CycleOpen, 0, (self.accounts.used + self.accounts.external) as usize, 0, 0);
    }

    /// Counts the next cycle report from here: when a cycle opens with none open, or when one
    /// closes beside others still open.
    fn mark_cycle_start(&mut self) {
        let a = &self.accounts;
        self.cycles.opened = (a.allocations, a.spills, self.regions.capacity() as u64);
    }

    /// What the cycle that closed last did (escapes, spills, the arena's size before and after).
    pub fn last_cycle(&self) -> CycleReport {
        self.cycles.last
    }

    /// Nests a level in an open cycle.
    pub fn nest(&mut self) -> Result<(), Error> {
        self.check_alive()?;
        if self.cycles.active == 0 {
            return Err(Error::not_open(&self.name, "nest"));
        }
        self.cycles.nesting += 1;
        Ok(())
    }

    /// Leaves a nested level.
    pub fn unnest(&mut self) -> Result<(), Error> {
        if self.cycles.nesting == 0 {
            return Err(Error::not_open(&self.name, "exit"));
        }
        self.cycles.nesting -= 1;
        self.huge.end_pass();
        Ok(())
    }

    /// Pre-faults what the last learning asked for, within a quarter of the memory available.
    #[cold]
    fn prefault_now(&mut self) {
        let mut want = self.regions.take_prefault().min(available_memory() / 4);
        let pinned_slot = self.accounts.pinned_slot;
        let replaced = self.cycles.replaced.min(pinned_slot);
        if let Some(r) = self.regions.current_mut() {
            // Blocks of earlier cycles still live outside a new region (in the one it replaced,
            // or outside the arena): state the loop replaces, and results kept on. The need counts
            // the state twice, as the old copies until freed and as their replacements, which the
            // cycle carves here from the region's start. Pre-faulting either share now would keep
            // both copies resident at once (as NumPy's allocator never does: each old copy goes as
            // its replacement comes); that room faults in when first used instead.
            if r.live_blocks() == 0 {
                want = want.saturating_sub(pinned_slot.saturating_add(replaced));
            }
            let added = r.populate(want) as u64;
            self.accounts.prefaulted += added;
        }
    }

    /// Closes one open cycle: the learner sizes the arena from what the open cycles needed since
    /// the last close; when it was the last one open, the arena rewinds and what is still live is
    /// pinned. What escaped is reported then (with cycles overlapping, no block belongs to one).
    pub fn close_cycle(&mut self) -> Result<CycleReport, Error> {
        if self.cycles.active == 0 {
            return Err(Error::not_open(&self.name, "exit"));
        }
        self.cycles.active -= 1;
        if self.cycles.destroyed {
            return Ok(CycleReport::default());
        }
        if self.cycles.active == 0 {
            self.cycles.nesting = 0;
        }
        self.cycles.completed += 1;
        let live_blocks = self.live_blocks(); // sizing below moves regions, not blocks
        let facts = CycleFacts {
            need: self.accounts.cycle_need(),
            escaped: self.accounts.live_slot - self.accounts.pinned_slot,
            // What spilled and was outside at once: a temporary spilled again and again counts
            // once, as the arena would have held it once.
            spilled: self.cycles.spilled.min(self.own.peaks.rise),
            kept_in_arena: self.cycles.kept_in_arena,
            spilled_in_room: self.cycles.spilled_in_room,
            // Blocks pinned in the region at an earlier cycle's end that still live (results kept
            // from cycle to cycle, not state that this cycle replaced).
            pinned_in_arena: self.cycles.kept_here.1 > 0
                && self.regions.current().map(ArenaRegion::id) == Some(self.cycles.kept_here.0),
        };
        // Counted before the arena is sized: a close that leaves none open ends the overlap.
        self.accounts.count_close(self.cycles.completed, self.cycles.active == 0);
        self.cycles.replaced = self.accounts.unpinned_slot;
        let current = self.regions.current_capacity();
        // Put apart before the arena is sized, at the last close: it sees which blocks outlived
        // cycles.
        let apart = self.cycles.active == 0 && self.route.apart && self.replace_for_apart();
        let sizing = self.learner.end_cycle(&self.config, self.cycles.completed - 1, facts, current, self.route.arena);
        // Before the arena is sized for the new need: the huge mappings no request takes any more
        // go first.
        self.huge.release_unused(&*self.limit, self.cycles.completed, HUGE_BLOCK_MIN.max(self.learner.need / 2));
        // Most closes keep the arena as it is: what sizes it lies out of their way.
        self.cycles.remapped = (apart || !matches!(sizing, Sizing::Keep)) && self.size_at_close(sizing, apart, current);
        self.huge.end_pass();
        self.settle_external_cache();
        self.cycles.spilled = 0;
        self.cycles.spilled_in_room = false;
        let (allocations, spills, arena_before) = self.cycles.opened;
        let mut report = CycleReport {
            completed: true,
            cycle: self.cycles.completed - 1,
            allocations: self.accounts.allocations - allocations,
            spills: self.accounts.spills - spills,
            peak_bytes: self.accounts.cycle_peak,
            arena_before,
            arena_after: self.regions.capacity() as u64,
            ..CycleReport::default()
        };
        if self.cycles.active > 0 {
            self.close_beside();
        } else {
            if self.route.lists {
                if let Some(r) = self.regions.current_mut() {
                    r.rewind();
                }
            }
            self.cycles.epoch += 1;
            (report.escaped_blocks, report.escaped_bytes) = self.accounts.close_cycle(live_blocks);
            self.cycles.kept_here = self.regions.current().map_or((0, 0), |r| (r.id(), r.live_blocks()));
            if self.in_turn() && self.regions.current_is_empty() {
                self.park();
            }
        }
        report.pinned_bytes = self.accounts.pinned;
        self.cycles.last = report;
        #[cfg(debug_assertions)]
        {
            self.cycles.closed_with = (self.accounts.allocations, live_blocks);
        }
        if self.recording {
            self.record_close(&report);
        }
        Ok(report)
    }

    /// Sizes the arena at a cycle end as the learner (`sizing`) and the classes put apart now
    /// (`apart`) ask, with the current region of `current` bytes. Returns whether the arena was
    /// remapped: a new region, or the current one grown where it lies.
    #[cold]
    #[inline(never)]
    fn size_at_close(&mut self, mut sizing: Sizing, apart: bool, current: usize) -> bool {
        let region_before = self.regions.current().map(ArenaRegion::id);
        if apart && matches!(sizing, Sizing::Keep) {
            // The kept blocks of the classes now apart still cut the region's free runs: a fresh
            // region of the same size replaces it, and the old one keeps only the pages under them.
            sizing = Sizing::Map { capacity: current, prefault: self.learner.need };
        }
        if let (Sizing::Map { capacity, prefault }, Some(r)) = (sizing, self.regions.current()) {
            // A smaller region gives nothing back where the cycles never touched more of this one
            // than the new one would pre-fault (one grown twofold beside kept blocks), while
            // blocks in it live (it cannot shrink where it lies): it stays, rather than a new one
            // be mapped and pre-faulted beside it until they die. One taken over from the lot
            // stays too: it serves a wider workspace's need as well (see `take_from_lot`).
            let untouched = r.resident_end() <= prefault;
            let small = r.mapped() <= capacity.saturating_mul(IN_PLACE_MAX);
            let pinned_down = r.live_blocks() > 0 && untouched && small && self.lazily_resized();
            if capacity < current && (pinned_down || r.id() == self.cycles.adopted) {
                sizing = Sizing::Keep;
            }
        }
        // A failure to map leaves the workspace serving outside the arena; it retries next cycle.
        let _ = self.apply(sizing, apart);
        // A new region, or the current one grown where it lies: the arena now serves what
        // blocks of their own served.
        let remapped =
            self.regions.current().map(ArenaRegion::id) != region_before || self.regions.current_capacity() > current;
        if remapped {
            self.cycles.remapped_at = self.cycles.completed;
            // An arena now serves what blocks of their own served this cycle: the cached ones
            // (their pages too, which the C heap would keep), and what the block allocator keeps
            // of the others, would only add to the arena.
            self.own.release_superseded_cache(&self.apart.classes);
            if self.own.peaks.made >= TRIM_AFTER {
                self.limit.upstream().trim();
            }
        }
        remapped
    }

    /// A cycle closed while others are still open: nothing rewinds and nothing is pinned yet;
    /// the next close learns (and reports) from what happens from here on, with what the region
    /// holds now as held from earlier (a region that never rewinds fills with what overlapping
    /// cycles keep: spills past it are no reason to grow it).
    #[cold]
    #[inline(never)]
    fn close_beside(&mut self) {
        self.accounts.open_cycle();
        self.cycles.kept_in_arena = self.regions.current().is_some_and(|r| r.live_blocks() > 0);
        self.own.peaks.open_cycle(self.accounts.external_slot);
        self.mark_cycle_start();
    }

    #[cold]
    #[inline(never)]
    fn record_close(&self, report: &CycleReport) {
        let r = self.limit.recorder();
        r.record(Action::CycleClose, 0, report.peak_bytes as usize, 0, report.spills);
        r.set_cycle(self.cycles.completed);
    }

    /// Puts apart the classes of the blocks in the current region that an earlier cycle end left
    /// live and this cycle did not free: results kept across cycles. Returns whether a class was
    /// put apart now. Looks (O(blocks of the region)) only where such blocks live, and not again
    /// while they are the ones a look found nothing new among.
    #[inline]
    fn keep_apart(&mut self) -> bool {
        self.apart_look_due() && self.look_apart()
    }

    /// Whether [`Workspace::keep_apart`] looks: blocks an earlier cycle end left live in the
    /// current region, and not those a look found nothing new among.
    #[inline]
    fn apart_look_due(&self) -> bool {
        let kept = self.cycles.kept_here;
        kept.1 > 0 && kept != self.apart.looked && self.regions.current().map(ArenaRegion::id) == Some(kept.0)
    }

    /// Puts apart the classes of results kept in the region ([`Workspace::keep_apart`]), and
    /// says whether the region is replaced now for those put apart since it last was: the first
    /// [`APART_AT_ONCE`] times at once, then after a wait that doubles each time (up to
    /// [`MAX_HOLD`] cycles), if results kept then still live in it. Meanwhile the classes are
    /// apart all the same, and their kept blocks stay where they are.
    #[inline]
    fn replace_for_apart(&mut self) -> bool {
        // Nothing is pending and nothing new to look at: most closes.
        if self.apart.pending.is_none() && !self.apart_look_due() {
            return false;
        }
        self.replace_for_apart_now()
    }

    #[cold]
    #[inline(never)]
    fn replace_for_apart_now(&mut self) -> bool {
        let region = self.regions.current().map(ArenaRegion::id);
        if self.keep_apart() {
            self.apart.pending = region;
        }
        let kept = self.cycles.kept_here;
        let a = &mut self.apart;
        if a.pending != region {
            a.pending = None;
        }
        if a.pending.is_none() || self.cycles.completed < a.next || kept.1 == 0 || region != Some(kept.0) {
            return false;
        }
        a.pending = None;
        a.replaced = a.replaced.saturating_add(1);
        if a.replaced >= APART_AT_ONCE {
            a.wait = (a.wait * 2).clamp(APART_WAIT, MAX_HOLD);
            a.next = self.cycles.completed + a.wait;
        }
        true
    }

    #[cold]
    #[inline(never)]
    fn look_apart(&mut self) -> bool {
        let epoch = self.cycles.epoch;
        let Some(r) = self.regions.current() else { return false };
        let (classes, mut added) = (&mut self.apart.classes, false);
        r.each_live(|_, _, requested, generation| {
            if generation < epoch && requested <= APART_MAX {
                if let Some(c) = class_of(requested) {
                    added |= !classes.contains(c);
                    classes.insert(c);
                }
            }
        });
        if !added {
            self.apart.looked = self.cycles.kept_here;
        }
        added
    }

    /// Which size classes are served outside the arena because their blocks outlive cycles.
    pub fn kept_apart(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.apart.classes.iter_desc().collect();
        v.reverse();
        v
    }

    /// At a cycle end, the external cache keeps what recent cycles used outside the arena, and
    /// no more: classes unused for two cycles go back, and so does anything above the largest
    /// external footprint of the recent cycles.
    fn settle_external_cache(&mut self) {
        self.own.peaks.close_cycle(self.cycles.completed);
        if self.own.cached_bytes() > 0 {
            self.shrink_external_cache();
        }
    }

    #[inline(never)]
    fn shrink_external_cache(&mut self) {
        self.own.release_stale(self.cycles.completed);
        let live = self.accounts.external_slot;
        self.own.shrink_to(self.own.peaks.cache_budget(live));
    }

    // -- the ladder --------------------------------------------------------------------------------

    /// Allocates `size` bytes, 64-byte aligned, under the workspace's policies; once the
    /// workspace is destroyed, outside its accounts (a bypass block), so that code still running
    /// keeps working.
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
        let Some(req) = Request::new(size, zeroed) else {
            return Err(self.refuse(size, "request too large"));
        };
        self.climb(req)
    }

    /// Climbs the ladder from rung 1 for `req`.
    #[inline(always)]
    fn climb(&mut self, req: Request) -> Result<NonNull<u8>, Error> {
        if self.recording {
            return self.climb_recorded(req);
        }
        // A destroyed workspace has no region, so it takes the slow path.
        if (req.size as u64) >= self.route.bypass_below {
            if self.apart.classes.contains(req.class) {
                return self.alloc_apart(req);
            }
            if let Some(p) = self.carve_arena(req) {
                return Ok(p);
            }
        }
        self.alloc_outside(req)
    }

    /// [`Workspace::climb`], recorded: the block handed out is an event (bypass blocks, not
    /// workspace memory, are not).
    #[cold]
    #[inline(never)]
    fn climb_recorded(&mut self, req: Request) -> Result<NonNull<u8>, Error> {
        self.recording = false;
        let got = self.climb(req);
        self.recording = true;
        let recorder = self.limit.recorder();
        if let Ok(p) = got {
            // SAFETY: `p` was just handed out by this workspace.
            match unsafe { self.find_block(p) } {
                Some(b) if b.kind != BlockKind::Bypass => {
                    recorder.record(Action::Alloc, p.as_ptr() as usize, b.requested, b.kind as u8, 0)
                }
                _ => recorder.set_context(0),
            }
        } else {
            recorder.set_context(0);
        }
        got
    }

    /// Allocates a block holding `size` bytes from its first `align`-aligned address (`align` a
    /// power of two, at most a page): the block is `align - 64` bytes larger where its alignment
    /// is not known to be `align` (arena blocks), and exactly `size` where the backend's own
    /// blocks are aligned so and keep their headers apart (a device driver's). Freed with
    /// [`Workspace::free`] of the pointer returned, not of the aligned address.
    pub fn alloc_aligned(&mut self, size: usize, align: usize) -> Result<NonNull<u8>, Error> {
        if !align.is_power_of_two() || align > round_to_page(1) {
            return Err(self.refuse(size, REFUSED_ALIGNMENT));
        }
        let own_align = (!self.route.host).then(|| self.limit.upstream().block_align());
        let Some(req) = Request::aligned(size, align, own_align) else {
            return Err(self.refuse(size, "request too large"));
        };
        self.climb(req)
    }

    /// Rung 1: a block from the current region, if it has one.
    #[inline(always)]
    fn carve_arena(&mut self, req: Request) -> Option<NonNull<u8>> {
        let inline = self.route.host;
        let region = self.regions.current_mut()?;
        let (p, slot, off) = region.take(req.class, req.slot, req.size, self.cycles.epoch)?;
        region.set_stamp(off, self.cycles.completed);
        if inline && slot >= GIVE_BACK_MIN {
            // A large block on memory not resident: as much of the region's idle free memory
            // goes back to the system (see `give_back_idle`).
            region.give_back_for(off, slot);
        }
        // Host memory is zero-filled when mapped: never-carved memory needs no write.
        let clear = req.zeroed && !(inline && region.is_fresh(off));
        // A large one is zeroed without making more of it resident (its pages not resident now
        // go back to the system): as large as NumPy's `np.zeros` (fresh pages of the C heap),
        // however little of it is written.
        // SAFETY: `p` is the data of the block just carved, of `size` bytes, not yet handed out.
        let cleared = clear && inline && req.size >= ZERO_SPARING_MIN && unsafe { region.zero_sparing(p, req.size) };
        self.accounts.count_arena(req.size, slot);
        // SAFETY: `p` is valid for `size` bytes of the backend's memory, just handed out.
        if clear && !cleared && unsafe { self.limit.zero(p, req.size) }.is_err() {
            // A fill the device refused: the block goes back, and the request is served outside
            // the arena, where a refused fill is an error.
            // SAFETY: `p` was handed out just above and never reached the caller.
            unsafe { self.free(p) };
            return None;
        }
        Some(p)
    }

    /// Rungs 2 to 6: outside the arena.
    #[cold]
    fn alloc_outside(&mut self, req: Request) -> Result<NonNull<u8>, Error> {
        let spill = (self.learner.initialized && self.route.spills) || self.route.spill_all;
        self.serve_outside(req, spill)
    }

    /// A request of a class kept apart: rungs 2 to 6, and no spill, since the arena is meant not
    /// to hold it.
    #[cold]
    fn alloc_apart(&mut self, req: Request) -> Result<NonNull<u8>, Error> {
        self.serve_outside(req, false)
    }

    fn serve_outside(&mut self, req: Request, spill: bool) -> Result<NonNull<u8>, Error> {
        let req = req.outside();
        if (req.size as u64) < self.route.bypass_below || self.cycles.destroyed {
            // Code still running after `destroy` (an array NumPy resizes, a handler still
            // installed) is served outside the workspace.
            return self.bypass_block(req);
        }
        if spill && self.route.fail_spills {
            return Err(self.refuse(req.size, "the arena is full and the spill policy is FAIL"));
        }
        if self.route.huge && req.size >= HUGE_BLOCK_MIN && req.size >= self.learner.need / 2 {
            return self.alloc_huge(req);
        }
        let before = self.accounts.external_slot;
        let cached = self.cached_block(req);
        let fresh = cached.is_none();
        let p = match cached {
            Some(p) => p,
            None => self.new_external(req)?,
        };
        if spill {
            self.accounts.spills += 1;
            self.cycles.spilled = self.cycles.spilled.saturating_add(req.slot);
            // What the cycle's own blocks hold in the arena (the rule matters only where no block
            // of an earlier cycle was in the current region as the cycle opened; those in a
            // region it replaced are not in its room). Every external block is taken off: the
            // arena is taken for emptier, never for fuller, than it is, so that a cut-up arena
            // is never taken for a small one.
            let held = self.accounts.own_live().saturating_sub(self.accounts.external_slot);
            self.cycles.spilled_in_room |= req.slot <= self.regions.current_capacity().saturating_sub(held);
            if fresh && self.route.grows_by_spills && self.route.host {
                // A large block made beside the arena, where the arena's free runs lie idle (one
                // pre-faulted for a cycle of another size): they go back as it comes, until the
                // arena grown by the spill serves it.
                if let Some(r) = self.regions.current_mut() {
                    r.give_back_beside(req.slot);
                }
            }
        }
        self.own.peaks.note(before, self.accounts.external_slot);
        Ok(p)
    }

    /// Rung 5: a cached block of the class, made live.
    fn cached_block(&mut self, req: Request) -> Option<NonNull<u8>> {
        if !self.route.caches {
            return None;
        }
        let (p, slot) = self.own.take_cached(req.class, self.cycles.completed)?;
        let h = self.own.header_of(p).expect("a cached block is listed");
        // SAFETY: a block of ours just taken off the cache: its header is ours to write.
        unsafe {
            h.as_ptr().write(BlockHeader::live(BlockKind::External, self.token, 0, slot, req.size, self.cycles.epoch));
            (*h.as_ptr()).set_stamp(self.cycles.completed);
        };
        self.accounts.count_external(req.size, slot);
        // SAFETY: `p` is valid for `size <= slot - HEADER` bytes of the backend's memory.
        if req.zeroed && unsafe { self.limit.zero_reused(p, req.size) }.is_err() {
            // A fill the device refused: the block goes back, and a new block is asked for.
            // SAFETY: `p` was made live just above and never reached the caller.
            unsafe { self.free(p) };
            return None;
        }
        Some(p)
    }

    /// Rung 6: a new block of its own (rounded to `temp_block_size` when one is set), within
    /// `max_size`, with the external cache kept to a small slack beside what lives.
    fn new_external(&mut self, req: Request) -> Result<NonNull<u8>, Error> {
        let mut len = req.slot;
        if self.config.temp_block_size > 0 {
            let g = self.config.temp_block_size as usize;
            len = len.div_ceil(g).saturating_mul(g);
        }
        // Inside a cycle, before a new block is made, cached blocks of classes that did not recur
        // go back but for a small slack, and those that recur stay within the recent peak:
        // memory outside the arena stays within what lives there and what the cycle reuses.
        let live = self.accounts.external_slot.saturating_add(len);
        self.own.shrink_cold(self.own.peaks.slack(live), self.own.peaks.cache_budget(live));
        if !self.cycles.trimmed && len >= TRIM_AFTER && self.regions.capacity() == 0 {
            // The first large block of a workspace that has no arena yet: the C heap may hold
            // free memory that the program's setup left (arrays made and freed before the loop),
            // which NumPy's allocator would have reused. A block of its class, a header and a
            // page's alignment larger than NumPy's request, lies over the mapping threshold
            // glibc learned from NumPy's frees, so it is mapped fresh beside that memory: return
            // the memory first (once per workspace, and at most once a second in the process).
            self.cycles.trimmed = true;
            self.limit.upstream().trim();
        }
        let stamp = (self.cycles.epoch, self.cycles.completed);
        let p =
            self.within_limit(req.size, |ws| ws.own.new_block(BlockKind::External, req.size, len, req.zeroed, stamp))?;
        self.accounts.count_external(req.size, len);
        self.own.peaks.made = self.own.peaks.made.saturating_add(len);
        let peak = self.own.peaks.peak();
        self.own.note_made(len, peak);
        Ok(p)
    }

    /// Rung 2: a block outside the workspace's accounts and limit (`helper_min_size`, the bypass
    /// mode, and code still running after `destroy`).
    fn bypass_block(&mut self, req: Request) -> Result<NonNull<u8>, Error> {
        let stamp = (self.cycles.epoch, self.cycles.completed);
        self.own
            .new_block(BlockKind::Bypass, req.size, req.slot, req.zeroed, stamp)
            .map_err(|cause| self.system_refused(req.size, cause))
    }

    /// Rung 4: a huge request, a mapping of its own, lazily faulted, reused from the cache when
    /// one of a fitting size was freed (not for zeroed requests, unless the backend re-zeroes
    /// discarded pages: a fresh mapping is zero without being written).
    #[cold]
    fn alloc_huge(&mut self, req: Request) -> Result<NonNull<u8>, Error> {
        let len = round_to_page(req.slot);
        self.own.reserve(len).map_err(|cause| self.system_refused(req.size, cause))?;
        let reusable = !req.zeroed || self.limit.upstream().discard_zeroes();
        // The request's own size: what it maps where `max_size` leaves no room for its class.
        let exact = round_to_page(req.size + HEADER);
        let (at, len) = match reusable.then(|| self.huge.take(len, exact)).flatten() {
            Some((at, len)) => {
                if req.zeroed && !self.limit.discard(at, len) {
                    // The system kept the pages (locked memory): they are written instead.
                    // SAFETY: `at` is a mapping of `len` bytes of our own, host memory (its
                    // backend discards to zeros), that nothing references.
                    unsafe { std::ptr::write_bytes(at.as_ptr(), 0, len) };
                }
                (at, len)
            }
            None => {
                // What is cached does not recur: it goes back before more is mapped, so that huge
                // requests of changing sizes (one long cycle over varied work) never add up.
                self.huge.release_all(&*self.limit);
                // Mapped for its class, so that a later request a little larger takes it again;
                // where `max_size` leaves no room for that, for the request alone.
                let (at, len) = self.within_limit(req.size, |ws| match ws.limit.map(len, false) {
                    Err(e) if exact < len && ws.is_our_limit(&e) => ws.limit.map(exact, false).map(|at| (at, exact)),
                    mapped => mapped.map(|at| (at, len)),
                })?;
                spare_head(&*self.limit, at, len);
                (at, len)
            }
        };
        self.huge.note_use(len, self.cycles.completed);
        // SAFETY: `at` is a fresh or reclaimed mapping of `len >= HEADER` bytes, page-aligned,
        // owned by us; huge blocks exist only where headers sit in front of their blocks.
        let p = unsafe { write_live_header(at, BlockKind::Huge, self.token, 0, len, req.size, self.cycles.epoch) };
        // SAFETY: its header sits in front of it, readable until the free; room was reserved.
        unsafe { self.own.register(p) };
        self.huge.note_live(at, len);
        self.accounts.count_huge(req.size);
        Ok(p)
    }

    // -- frees -------------------------------------------------------------------------------------

    /// Where the header of `p` lies, if `p` is a block boundary of this workspace's memory: an
    /// arena region, or a block of its own. Nothing is read: a pointer that is neither (a double
    /// free after the block went back, another allocator's) is found to be no block of ours
    /// without touching memory that may have gone back to the system.
    fn locate(&self, p: NonNull<u8>) -> Option<(NonNull<BlockHeader>, Option<InRegion>)> {
        if let Some((h, at)) = self.regions.header_of(p) {
            return Some((h, Some(at)));
        }
        self.own.header_of(p).map(|h| (h, None))
    }

    /// Takes a block back. Frees of blocks from earlier cycles unpin them; a region retired by
    /// growth, or kept alive by a destroyed workspace, is released with its last block. A pointer
    /// that is no live block of this workspace (another allocator's, a block freed already) is
    /// ignored and counted ([`Workspace::bad_frees`]), and memory that went back to the system is
    /// never read to find that out. (A block freed twice after its memory served another block
    /// frees that block: as with every allocator, a second free is the caller's error.)
    ///
    /// # Safety
    /// `p` was returned by `alloc`, `alloc_zeroed`, `alloc_aligned` or
    /// `realloc` of this workspace, and is not used after this call.
    #[inline(always)]
    pub unsafe fn free(&mut self, p: NonNull<u8>) {
        // SAFETY: forwarded.
        if !unsafe { self.free_if_ours(p) } {
            self.accounts.bad_frees += 1;
        }
    }

    /// Frees `p` if it is a live block of this workspace and says whether it was; anything else
    /// (a block of another allocator, one freed already) is left alone, and finding that out
    /// reads nothing but this workspace's own memory.
    ///
    /// # Safety
    /// `p` starts a block of this workspace or of another allocator (not an address inside a
    /// block of this workspace); if it is a live block of this workspace, the caller gives it up.
    #[inline(always)]
    pub unsafe fn free_if_ours(&mut self, p: NonNull<u8>) -> bool {
        if self.recording {
            // SAFETY: forwarded.
            return unsafe { self.free_recorded(p) };
        }
        let epoch = self.cycles.epoch;
        let token = self.token;
        // The common case: an arena block of the current region, freed in its own cycle.
        if let Some(r) = self.regions.current_mut() {
            if let Some(hp) = r.header_at_data(p) {
                // SAFETY: a header spot of the current region: mapped memory; a free header, or
                // bytes that are no header, fail the magic check before anything else is read.
                if unsafe { is_live_arena(hp.as_ptr()) } {
                    let (owner, generation, region, slot, requested, stamp) = {
                        // SAFETY: a live header (written by us); the borrow ends in this block.
                        let h = unsafe { hp.as_ref() };
                        (h.owner, h.generation, h.region, h.slot, h.requested, h.stamp())
                    };
                    if owner == token && generation == epoch && region == r.id() {
                        // SAFETY: the header is live, names this region and is not borrowed.
                        unsafe { r.release(hp) };
                        self.accounts.uncount_arena(requested, slot);
                        self.accounts.forget_stamped(slot, stamp, self.cycles.completed);
                        return true;
                    }
                }
            }
        }
        // SAFETY: forwarded.
        unsafe { self.free_slow(p) }
    }

    /// [`Workspace::free_if_ours`], recorded (before the block goes, so that the event comes
    /// before any mapping it releases).
    ///
    /// # Safety
    /// As for [`Workspace::free_if_ours`].
    #[cold]
    #[inline(never)]
    unsafe fn free_recorded(&mut self, p: NonNull<u8>) -> bool {
        // SAFETY: forwarded.
        if let Some(b) = unsafe { self.find_block(p) }.filter(|b| b.kind != BlockKind::Bypass) {
            self.limit.recorder().record(Action::Free, p.as_ptr() as usize, b.requested, b.kind as u8, 0);
        }
        self.recording = false;
        // SAFETY: forwarded.
        let freed = unsafe { self.free_if_ours(p) };
        self.recording = true;
        freed
    }

    /// What the workspace knows of `p`, if it is a live block of this workspace (None for
    /// anything else; only this workspace's own memory is read to find out).
    ///
    /// # Safety
    /// `p` starts a block of this workspace or of another allocator (not an address inside a
    /// block of this workspace).
    pub unsafe fn find_block(&self, p: NonNull<u8>) -> Option<BlockInfo> {
        let (hp, at) = self.locate(p)?;
        // SAFETY: memory of ours, at a header spot (see `locate`).
        unsafe { live_kind(hp.as_ptr()) }?;
        // SAFETY: a live header, written by us.
        let h = unsafe { hp.as_ref() };
        if h.owner != self.token {
            return None;
        }
        let region = match at {
            Some(at) => {
                let r = self.regions.get(at);
                if h.kind != BlockKind::Arena || h.region != r.id() {
                    return None;
                }
                Some((r.base().as_ptr() as usize, r.capacity()))
            }
            None if h.kind == BlockKind::Arena => return None,
            None => None,
        };
        Some(BlockInfo { kind: h.kind, requested: h.requested, generation: h.generation, region })
    }

    /// # Safety
    /// As for [`Workspace::free`].
    #[cold]
    unsafe fn free_slow(&mut self, p: NonNull<u8>) -> bool {
        let Some((hp, at)) = self.locate(p) else { return false };
        // SAFETY: memory of ours, at a header spot (see `locate`).
        let Some(kind) = (unsafe { live_kind(hp.as_ptr()) }) else {
            // A block freed already, or bytes that are no header.
            return false;
        };
        // Copy everything out: the memory holding the header may be released below.
        let (size, slot, gen, owner, region, stamp) = {
            // SAFETY: a live header (written by us); the borrow ends in this block.
            let h = unsafe { hp.as_ref() };
            (h.requested, h.slot, h.generation, h.owner, h.region, h.stamp())
        };
        if owner != self.token {
            // Another workspace's block: never ours to free.
            return false;
        }
        let pinned = gen != self.cycles.epoch;
        match (kind, at) {
            (BlockKind::Arena, Some(at)) if self.regions.get(at).id() == region => {
                if pinned {
                    self.accounts.unpin(size, slot);
                    if self.cycles.kept_here.0 == region {
                        self.cycles.kept_here.1 = self.cycles.kept_here.1.saturating_sub(1);
                    }
                } else {
                    self.accounts.forget_stamped(slot, stamp, self.cycles.completed);
                }
                self.accounts.uncount_arena(size, slot);
                // SAFETY: the header is live, not borrowed, and names the region it lies in.
                unsafe { self.regions.release(hp, at) };
                if self.in_turn()
                    && at == InRegion::Current
                    && self.cycles.active == 0
                    && !self.cycles.destroyed
                    && self.regions.current_is_empty()
                {
                    // The last block a cycle of a workspace entered in turn left behind.
                    self.park();
                }
            }
            (BlockKind::Huge, None) => {
                self.accounts.uncount_huge(size);
                if pinned {
                    self.accounts.unpin(size, 0);
                }
                self.own.unregister(p);
                // SAFETY: the header is ours to write, and nothing else refers to it any more.
                unsafe { (*hp.as_ptr()).magic = 0 };
                // SAFETY: a huge block's mapping starts at its header and is `slot` bytes long;
                // the caller gives the block up.
                let at = unsafe { p.sub(HEADER) };
                self.huge.note_dead(at, slot);
                if self.cycles.destroyed {
                    // SAFETY: as above.
                    unsafe { self.limit.unmap(at, slot) };
                } else {
                    // SAFETY: as above.
                    unsafe { self.huge.put_or_release(&*self.limit, at, slot, self.cycles.completed) };
                }
            }
            (BlockKind::External, None) => {
                if pinned {
                    self.accounts.unpin(size, slot);
                    self.own.peaks.free_earlier(slot);
                } else {
                    self.accounts.forget_stamped(slot, stamp, self.cycles.completed);
                }
                self.accounts.uncount_external(size, slot);
                // After a remap, state of earlier cycles goes back as it is freed, but for the
                // classes kept apart, which the arena does not serve.
                let earlier = if pinned { self.cycles.remapped } else { stamp < self.cycles.remapped_at };
                let superseded = earlier && !class_of(size).is_some_and(|c| self.apart.classes.contains(c));
                if self.route.caches && !self.cycles.destroyed && !superseded {
                    // SAFETY: the caller gives the block up; it is put once.
                    unsafe { self.own.put_cached(p, slot, self.cycles.completed) };
                } else if superseded && self.route.caches {
                    // SAFETY: as above.
                    unsafe { self.own.release_superseded(p, slot, BlockKind::External) };
                } else {
                    // SAFETY: as above.
                    unsafe { self.own.release(p, slot, BlockKind::External) };
                }
            }
            (BlockKind::Bypass, None) => {
                // SAFETY: the caller gives the block up.
                unsafe { self.own.release(p, slot, BlockKind::Bypass) };
            }
            // A header that does not match where it lies: not a block of ours.
            _ => return false,
        }
        true
    }

    /// Records a block resized where it lies, where a history is recorded: its old size freed,
    /// its new one allocated.
    fn record_resized(&self, p: NonNull<u8>, old: usize, new_size: usize, kind: BlockKind) {
        if self.recording {
            let (r, at) = (self.limit.recorder(), p.as_ptr() as usize);
            r.record(Action::Free, at, old, kind as u8, 0);
            r.record(Action::Alloc, at, new_size, kind as u8, 0);
        }
    }

    /// Resizes a block, keeping its contents up to the smaller size. In place when its slot is
    /// the new size's, or one class up ([`crate::arena::stays_in`]), and for a huge block that
    /// shrinks.
    ///
    /// # Safety
    /// As for [`Workspace::free`] (`p` is live, and not used after a successful call).
    pub unsafe fn realloc(&mut self, p: NonNull<u8>, new_size: usize) -> Result<NonNull<u8>, Error> {
        // SAFETY: forwarded.
        let found = unsafe { self.find_block(p) }.and_then(|_| self.locate(p)).map(|(h, _)| h);
        let Some(hp) = found else {
            self.accounts.bad_frees += 1;
            return Err(self.refuse(new_size, REFUSED_NOT_OURS));
        };
        // SAFETY: a live header of ours; the borrow ends before the block can be freed below.
        let h = unsafe { &mut *hp.as_ptr() };
        let old = h.requested;
        if h.kind == BlockKind::Arena && crate::arena::stays_in(h.slot, new_size) && !self.cycles.destroyed {
            h.requested = new_size;
            self.record_resized(p, old, new_size, BlockKind::Arena);
            let (o, n) = (old as u64, new_size as u64);
            self.accounts.used = self.accounts.used + n - o;
            if h.generation != self.cycles.epoch {
                self.accounts.pinned = self.accounts.pinned + n - o;
            }
            let live = self.accounts.used + self.accounts.external;
            self.accounts.cycle_peak = self.accounts.cycle_peak.max(live);
            return Ok(p);
        }
        if h.kind == BlockKind::Huge && new_size != 0 && new_size <= old && !self.cycles.destroyed {
            // A huge block shrinks where it lies, as the C heap shrinks a mapping of its own
            // (`ndarray.resize` to fewer elements): no copy, and its pages past the new end go
            // back to the system. The mapping keeps its length (and its place in `max_size`).
            h.requested = new_size;
            let (at, slot) = (p.as_ptr() as usize - HEADER, h.slot);
            let d = (old - new_size) as u64;
            self.accounts.external -= d;
            if h.generation != self.cycles.epoch {
                self.accounts.pinned -= d;
            }
            self.record_resized(p, old, new_size, BlockKind::Huge);
            let from = round_to_page(p.as_ptr() as usize + new_size);
            if from < at + slot {
                // SAFETY: `from` lies inside the block's mapping (`at + slot` is its end).
                let tail = unsafe { p.add(from - p.as_ptr() as usize) };
                // Whole pages of our mapping that hold nothing the caller keeps; a refusal
                // (locked memory) leaves them resident, as they were.
                self.limit.discard(tail, at + slot - from);
            }
            return Ok(p);
        }
        let q = self.alloc(new_size)?;
        // SAFETY: both blocks are live, distinct, of this backend, and valid for the bytes copied.
        if let Err(cause) = unsafe { self.limit.copy(q, p, old.min(new_size)) } {
            // A copy the device refused: the old block stays the caller's, with its contents.
            // SAFETY: `q` was allocated just above and never reached the caller.
            unsafe { self.free(q) };
            return Err(Error::device("a copy on the device failed", cause));
        }
        // SAFETY: `p` is live and ours (caller's guarantee); it is freed once, here.
        unsafe { self.free(p) };
        Ok(q)
    }

    /// What the workspace knows of a live block.
    ///
    /// # Safety
    /// As for [`Workspace::find_block`]; `p` is a live block of this workspace.
    pub unsafe fn block_info(&self, p: NonNull<u8>) -> BlockInfo {
        // SAFETY: forwarded.
        unsafe { self.find_block(p) }.expect("a live block of this workspace")
    }

    /// Destroys the workspace: unreferenced memory is released now, memory under live blocks
    /// when its last block is freed. Idempotent.
    pub fn destroy(&mut self) {
        self.cycles.destroyed = true;
        self.cycles.active = 0;
        self.cycles.nesting = 0;
        // The current region retires like one replaced by growth: kept while blocks live in it.
        self.regions.retire_all();
        self.release_caches();
        self.cycles.parked = (0, 0);
        if self.route.lends {
            crate::lot::evict(self.token);
        }
    }

    // -- what it holds, for snapshots ---------------------------------------------------------------

    /// Starts recording the workspace's timeline (blocks, mappings, refusals, cycles) into a ring
    /// of `max_entries` events, or stops and drops it (`None`). `Err` where the system has no room
    /// for the ring; recording stays as it was.
    pub fn record_history(&mut self, max_entries: Option<usize>) -> Result<(), Error> {
        let r = self.limit.recorder();
        if !r.set(max_entries) {
            let bytes = max_entries.unwrap_or(0).saturating_mul(std::mem::size_of::<crate::history::Event>());
            return Err(self.system_error(bytes as u64, BackendError::os("record a history", bytes, libc::ENOMEM)));
        }
        r.set_cycle(self.cycles.completed);
        self.recording = r.is_on();
        Ok(())
    }

    /// The workspace's recorder: its history, and the context the next allocation is recorded
    /// with.
    pub fn recorder(&self) -> &Recorder {
        self.limit.recorder()
    }

    /// Every mapping and block of its own the workspace holds now (arena regions, external
    /// blocks live or cached, huge mappings live or cached), with the live blocks in each, by
    /// address. `None` where the system has no room for the list. O(blocks).
    pub fn segments(&self) -> Option<Vec<Segment>> {
        fn push<T>(v: &mut Vec<T>, x: T) -> Option<()> {
            v.try_reserve(1).ok()?;
            v.push(x);
            Some(())
        }
        let epoch = self.cycles.epoch;
        let mut out = Vec::new();
        let current = self.regions.current().map(ArenaRegion::id);
        for r in self.regions.iter() {
            let base = r.base().as_ptr() as usize;
            let (mut blocks, mut room) = (Vec::new(), true);
            r.each_live(|pos, slot, requested, generation| {
                let b = LiveBlock {
                    addr: base + pos + HEADER,
                    size: slot - HEADER,
                    requested,
                    pinned: generation != epoch,
                };
                room &= push(&mut blocks, b).is_some();
            });
            if !room {
                return None;
            }
            let kind = if Some(r.id()) == current { SegmentKind::Region } else { SegmentKind::Retired };
            // What it maps, as the trace's segment events count it (more than it serves after
            // a shrink in place).
            push(&mut out, Segment { kind, address: base, size: r.mapped(), blocks })?;
        }
        let inline = self.own.inline();
        for (at, h) in self.own.each() {
            let kind = match h.kind {
                BlockKind::External => SegmentKind::External,
                BlockKind::Huge => SegmentKind::Huge,
                _ => continue, // bypass blocks are not the workspace's memory
            };
            let (address, size) = if inline { (at - HEADER, h.slot) } else { (at, h.slot - HEADER) };
            let mut blocks = Vec::new();
            if h.is_live() {
                let b = LiveBlock {
                    addr: at,
                    size: address + size - at,
                    requested: h.requested,
                    pinned: h.generation != epoch,
                };
                push(&mut blocks, b)?;
            }
            push(&mut out, Segment { kind, address, size, blocks })?;
        }
        for (address, size) in self.huge.each_cached() {
            push(&mut out, Segment { kind: SegmentKind::Huge, address, size, blocks: Vec::new() })?;
        }
        out.sort_unstable_by_key(|s| s.address);
        Some(out)
    }

    pub fn stats(&self) -> WorkspaceStats {
        let a = &self.accounts;
        let cap = self.regions.capacity() as u64;
        let arena_live = (a.live_slot - a.external_slot) as u64;
        WorkspaceStats {
            cycles: self.cycles.completed,
            capacity_bytes: cap,
            used_bytes: a.used,
            peak_cycle_bytes: if self.cycles.active > 0 { a.cycle_peak } else { a.last_cycle_peak },
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
        self.regions.contains(addr) || self.own.holds(addr)
    }

    /// Counts a refusal that happened outside the workspace (for example a request too large for
    /// the caller's own arithmetic).
    pub fn record_failure(&mut self) {
        self.accounts.failures += 1;
    }

    /// Frees of pointers that were no live block of this workspace, ignored.
    pub fn bad_frees(&self) -> u64 {
        self.accounts.bad_frees
    }

    /// Checks every region's chain and lists against the counters, and the footprint against
    /// the limit. For tests: O(blocks).
    #[doc(hidden)]
    pub fn verify(&self) {
        let a = &self.accounts;
        let arena_live: usize = self.regions.iter().map(ArenaRegion::verify).sum();
        assert_eq!(arena_live, a.live_slot - a.external_slot, "slot bytes disagree");
        assert!(a.pinned_blocks <= self.live_blocks() && a.pinned_slot <= a.live_slot);
        assert!(self.footprint() <= self.limit(), "footprint {} past the limit {}", self.footprint(), self.limit());
    }

    /// Bytes pre-faulted synchronously so far, in total.
    pub fn prefaulted_bytes(&self) -> u64 {
        self.accounts.prefaulted
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

    /// Skips `n` region ids, as if that many regions had been mapped and released. For tests.
    #[doc(hidden)]
    pub fn skip_region_ids(&mut self, n: u64) {
        self.regions.skip_ids(n);
    }

    /// The header size every block carries, for callers sizing arenas by hand.
    pub const fn header_bytes() -> usize {
        HEADER
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::HeapMemory;
    use crate::config::LearningPolicy;
    use crate::external::{MIN_SLACK, SLACK};

    fn heap(config: WorkspaceConfiguration) -> Workspace {
        Workspace::with_backend("T", config, Arc::new(HeapMemory)).expect("a workspace")
    }

    #[test]
    fn aligned_requests_pad_arena_blocks_only() {
        // Host memory: arena blocks and blocks of their own both carry the padding.
        let r = Request::aligned(1000, 256, None).unwrap();
        assert_eq!((r.size, r.outside), (1000 + 192, 1000 + 192));
        // A backend aligning its own blocks to 256: only the arena's carry it.
        let r = Request::aligned(1000, 256, Some(256)).unwrap();
        assert_eq!((r.size, r.outside), (1192, 1000));
        let out = r.outside();
        assert_eq!((out.size, out.class), (1000, class_of(1000).unwrap()));
        assert_eq!(out.slot, class_size(out.class) + HEADER);
        // Alignment the backend does not give: padded everywhere; at most 64: no padding.
        assert_eq!(Request::aligned(1000, 512, Some(256)).unwrap().outside, 1000 + 448);
        assert_eq!(Request::aligned(1000, 64, None).unwrap().size, 1000);
        assert!(Request::aligned(usize::MAX - 10, 256, None).is_none());
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri has no mincore: no page is known resident")]
    fn a_large_block_on_memory_not_resident_gives_back_a_run_left_idle_by_an_earlier_cycle() {
        const MIB: usize = 1 << 20;
        let resident = crate::backend::resident_bytes;
        let config = WorkspaceConfiguration {
            initial_size: 256 << 20,
            policy_learning: LearningPolicy::None,
            ..Default::default()
        };
        let mut w = Workspace::new("give back", config).unwrap();
        // A cycle's 40 MiB temporary, written, beside a block kept on: its memory stays in the
        // region, resident and free, when the next cycle opens.
        w.enter().unwrap();
        let temp = w.alloc(40 * MIB).unwrap();
        let kept = w.alloc(1000).unwrap();
        // SAFETY: a live block of 40 MiB.
        unsafe { std::ptr::write_bytes(temp.as_ptr(), 1, 40 * MIB) };
        // SAFETY: live, freed once.
        unsafe { w.free(temp) };
        w.exit().unwrap();
        assert_eq!(resident(temp, 40 * MIB), 40 * MIB);
        // A cycle whose 64 MiB block no free run holds: it takes memory not resident, and the
        // idle run goes back to the system, as NumPy's allocator gives back a block that large.
        w.enter().unwrap();
        let big = w.alloc(64 * MIB).unwrap();
        assert!(big > kept, "{big:?} carved beyond the kept block");
        assert_eq!(resident(temp, 40 * MIB), 0, "the idle run went back");
        // SAFETY: a live block of 64 MiB.
        unsafe { std::ptr::write_bytes(big.as_ptr(), 2, 64 * MIB) };
        // SAFETY: live, freed once.
        unsafe { w.free(big) };
        // The run serves again, zero-filled where asked.
        let again = w.alloc_zeroed(40 * MIB).unwrap();
        assert_eq!(again, temp);
        // SAFETY: a live block of 40 MiB.
        assert!(unsafe { std::slice::from_raw_parts(again.as_ptr(), 40 * MIB) }.iter().all(|&b| b == 0));
        // SAFETY: live, freed once each.
        unsafe {
            w.free(again);
            w.free(kept);
        }
        w.exit().unwrap();
        w.verify();
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri has no mincore: no page is known resident")]
    fn a_large_spill_gives_back_the_idle_arena_pre_faulted_for_a_smaller_cycle() {
        // Batches of two sizes in turn: the arena learned from a 40 MiB cycle is pre-faulted as
        // the next cycle opens, whose 60 MiB block (under the huge mappings' 64 MiB) spills past it. The arena lies idle beside the
        // spill, which a plain process would hold alone: it goes back to the system.
        const MIB: usize = 1 << 20;
        let resident = crate::backend::resident_bytes;
        let mut w = Workspace::new("two sizes", WorkspaceConfiguration::adaptive()).unwrap();
        w.enter().unwrap();
        let first = w.alloc(40 * MIB).unwrap();
        // SAFETY: live, freed once.
        unsafe { w.free(first) };
        w.exit().unwrap();
        w.enter().unwrap();
        let region = w.regions.current().expect("an arena learned from the first cycle");
        let (base, prefaulted) = (region.base(), region.resident_end());
        assert!(prefaulted >= 40 * MIB, "pre-faulted as the cycle opened");
        assert!(resident(base, prefaulted) >= 32 * MIB, "resident");
        let big = w.alloc(60 * MIB).unwrap();
        assert_eq!(w.stats().spill_count, 1);
        assert!(resident(base, prefaulted) < MIB, "the idle arena went back beside the spill");
        // SAFETY: a live block of 60 MiB.
        unsafe { std::ptr::write_bytes(big.as_ptr(), 2, 60 * MIB) };
        // SAFETY: live, freed once.
        unsafe { w.free(big) };
        w.exit().unwrap();
        // The arena grown by the spill serves both sizes from here on, zero-filled where asked.
        for size in [40 * MIB, 60 * MIB, 40 * MIB] {
            w.enter().unwrap();
            let p = w.alloc_zeroed(size).unwrap();
            // SAFETY: a live block of `size` bytes.
            assert!(unsafe { std::slice::from_raw_parts(p.as_ptr(), size) }.iter().all(|&b| b == 0));
            // SAFETY: live, freed once.
            unsafe { w.free(p) };
            w.exit().unwrap();
        }
        assert_eq!(w.stats().spill_count, 1);
        w.verify();
    }

    #[test]
    fn a_cut_up_arena_grows_by_its_spills_with_a_kept_block_left_in_the_region_it_replaced() {
        // A result kept for good in the region that the arena's growth replaced, and cycles whose
        // 24 MiB block fits neither the holes between their 6 MiB blocks nor the tail: the arena
        // is cut up, not too small, and grows until the spills stop. (Counting the kept block as
        // if it were in the new region took it for too small: a spill in every cycle.)
        const MIB: usize = 1 << 20;
        let mut w = Workspace::new("cut up", WorkspaceConfiguration::adaptive()).unwrap();
        let mut kept = None;
        let mut spills = Vec::new();
        for c in 0..16 {
            w.enter().unwrap();
            if c == 0 {
                let t = w.alloc(24 * MIB).unwrap();
                // SAFETY: live, freed once.
                unsafe { w.free(t) };
            } else if c == 1 {
                kept = Some(w.alloc(28 * MIB).unwrap());
            } else {
                let blocks: Vec<_> = (0..10).map(|_| w.alloc(6 * MIB).unwrap()).collect();
                let (even, odd): (Vec<_>, Vec<_>) = blocks.iter().enumerate().partition(|(i, _)| i % 2 == 0);
                // SAFETY: live blocks, each freed once.
                even.iter().for_each(|(_, &p)| unsafe { w.free(p) });
                let big = w.alloc(24 * MIB).unwrap();
                // SAFETY: live, freed once.
                unsafe { w.free(big) };
                // SAFETY: live blocks, each freed once.
                odd.iter().for_each(|(_, &p)| unsafe { w.free(p) });
            }
            spills.push(w.exit().unwrap().spills);
        }
        // (A spill where the window forgets a large cycle and the arena grows back is the
        // learner's, as without the kept block.)
        let spilling = spills[4..].iter().filter(|&&n| n > 0).count();
        assert!(spilling <= 2, "spills by cycle: {spills:?}");
        // SAFETY: live, freed once.
        unsafe { w.free(kept.expect("kept")) };
    }

    #[test]
    fn a_block_larger_than_an_empty_arena_grows_it_to_the_cycle_s_need_not_beyond() {
        // Batches of two sizes in turn: the arena learned from the smaller one, and the larger
        // one's single block spills from it, empty. The arena then holds that block once more,
        // as the cycle needed (84 MiB with its headroom), not the old arena and the spill added up
        // (152 MiB).
        const MIB: usize = 1 << 20;
        let mut w = Workspace::new("batches", WorkspaceConfiguration::adaptive()).unwrap();
        for (i, size) in [38 * MIB, 61 * MIB, 38 * MIB, 61 * MIB].into_iter().enumerate() {
            w.enter().unwrap();
            let a = w.alloc(size).unwrap();
            // SAFETY: live, freed once.
            unsafe { w.free(a) };
            let r = w.exit().unwrap();
            assert_eq!(r.spills, u64::from(i == 1), "{r:?}");
            if i > 1 {
                assert!(r.arena_after >= 61 * MIB as u64 && r.arena_after < 100 * MIB as u64, "{r:?}");
            }
        }
    }

    #[test]
    fn the_route_is_fixed_by_the_policies() {
        let plain = Route::new(&WorkspaceConfiguration::default(), DebugMode::Disabled, &HeapMemory);
        assert!(plain.arena && plain.caches && plain.spills && !plain.fail_spills && !plain.spill_all);
        let always = WorkspaceConfiguration { policy_allocation: AllocationPolicy::Always, ..Default::default() };
        let r = Route::new(&always, DebugMode::Disabled, &HeapMemory);
        assert!(!r.arena && !r.caches && !r.spills);
        let fail = WorkspaceConfiguration { policy_spill: SpillPolicy::Fail, ..Default::default() };
        assert!(Route::new(&fail, DebugMode::Disabled, &HeapMemory).fail_spills);
        assert!(!Route::new(&fail, DebugMode::SpillEverything, &HeapMemory).fail_spills, "debug modes never refuse");
        assert_eq!(Route::new(&fail, DebugMode::BypassEverything, &HeapMemory).bypass_below, u64::MAX);
        let small = WorkspaceConfiguration { helper_min_size: 4096, ..Default::default() };
        assert_eq!(Route::new(&small, DebugMode::Disabled, &HeapMemory).bypass_below, 4096);
    }

    #[test]
    fn each_close_reports_what_its_cycle_did() {
        let mut w = heap(WorkspaceConfiguration {
            policy_learning: LearningPolicy::OverTime,
            policy_allocation: AllocationPolicy::Strict,
            ..Default::default()
        });
        // The learning cycle: served outside, then the arena is mapped.
        w.enter().unwrap();
        let a = w.alloc(10_000).unwrap();
        // SAFETY: live, freed once.
        unsafe { w.free(a) };
        let r = w.exit().unwrap();
        assert!(r.completed && r.remapped() && r.arena_before == 0 && r.arena_after > 0, "{r:?}");
        assert_eq!((r.cycle, r.allocations, r.spills, r.peak_bytes), (0, 1, 0, 10_000));
        assert_eq!(r, w.last_cycle());
        // A cycle the arena serves: nothing changes.
        w.enter().unwrap();
        let a = w.alloc(10_000).unwrap();
        // SAFETY: live, freed once.
        unsafe { w.free(a) };
        let r = w.exit().unwrap();
        assert!(!r.remapped() && r.spills == 0 && r.cycle == 1 && r.allocations == 1, "{r:?}");
        // A cycle that spills, and keeps what it made: the arena grows, the block is pinned.
        w.enter().unwrap();
        let big = w.alloc(1 << 20).unwrap();
        let r = w.exit().unwrap();
        assert!(r.remapped() && r.arena_after > r.arena_before && r.spills == 1, "{r:?}");
        assert_eq!((r.escaped_blocks, r.escaped_bytes, r.pinned_bytes), (1, 1 << 20, 1 << 20));
        // A nested level reports nothing; its close is not a cycle.
        w.enter().unwrap();
        w.enter().unwrap();
        assert_eq!(w.exit().unwrap(), CycleReport::default());
        // SAFETY: live, freed once.
        unsafe { w.free(big) };
        let r = w.exit().unwrap();
        assert_eq!((r.cycle, r.pinned_bytes, r.escaped_blocks), (3, 0, 0));
        w.verify();
    }

    #[test]
    fn a_destroyed_workspace_serves_outside_its_accounts() {
        let mut w = heap(WorkspaceConfiguration { initial_size: 1 << 16, ..Default::default() });
        w.destroy();
        assert!(matches!(w.check_alive(), Err(Error::Destroyed { .. })));
        assert!(matches!(w.enter(), Err(Error::Destroyed { .. })));
        let p = w.alloc_aligned(100, 256).unwrap();
        // SAFETY: live, of this workspace.
        assert_eq!(unsafe { w.block_info(p) }.kind, BlockKind::Bypass);
        assert_eq!(w.stats().allocation_count, 0);
        // SAFETY: live, freed once.
        unsafe { w.free(p) };
        assert_eq!(w.bad_frees(), 0, "the block was found and freed");
    }

    /// A long first cycle of changing sizes holds what lives and a small slack (or the blocks of
    /// classes it reuses, within the peak it had live), never the blocks of every class it once
    /// used; the slack is a quarter of the most it held outside the arena lately, from 1 MiB to
    /// 4 MiB.
    #[test]
    fn a_first_cycle_of_changing_sizes_holds_what_lives_and_a_slack_or_its_peak() {
        for (largest, slack) in [(3 << 20, SLACK), (256 << 10, MIN_SLACK)] {
            let mut w = heap(WorkspaceConfiguration::default());
            w.enter().unwrap();
            let mut live: Vec<(NonNull<u8>, usize)> = Vec::new();
            let mut size = 3000usize;
            let (mut worst, mut peak) = (0usize, 0usize);
            for i in 0..300 {
                size = (size * 7 + i * 977) % largest + 1000;
                let before = w.footprint();
                live.push((w.alloc(size).unwrap(), size));
                // Memory is taken only as a block is made (a cached one was resident already):
                // then the workspace holds what lives (with class rounding, at most a quarter
                // more) and the slack, or blocks of recurring classes within the peak it had live.
                let held: usize = live.iter().map(|&(_, n)| n + HEADER).sum();
                peak = peak.max(held + held / 4);
                let bound = (held + held / 4 + slack).max(peak);
                if w.footprint() > before {
                    worst = worst.max(w.footprint() * 100 / bound);
                    assert!(w.footprint() <= bound, "step {i}: holds {} for {held} live", w.footprint());
                }
                if live.len() > 4 {
                    let (p, _) = live.remove(0);
                    // SAFETY: live, freed once.
                    unsafe { w.free(p) };
                }
            }
            assert!(w.external_cached_bytes() <= slack.max(peak));
            for (p, _) in live {
                // SAFETY: live, freed once.
                unsafe { w.free(p) };
            }
            w.exit().unwrap();
            assert!(worst > 0);
        }
    }

    /// A cycle reopened through the borrow that closed it serves what an ordinary open serves:
    /// the same blocks at the same places, cycle after cycle, with blocks that outlive a cycle
    /// and die in a later one (which leave the region carved up until a rewind).
    #[test]
    fn a_reopened_cycle_serves_as_an_opened_one() {
        let drive = |reopen: bool| {
            let mut w = heap(WorkspaceConfiguration::adaptive());
            let mut kept: Vec<NonNull<u8>> = Vec::new();
            let (mut seen, mut reports) = (Vec::new(), Vec::new());
            w.open_cycle().unwrap();
            for cycle in 0..40usize {
                let sizes = [4096, 1000 + cycle * 7, 64 << 10, 300];
                let got: Vec<_> = sizes.iter().map(|&n| w.alloc(n).unwrap()).collect();
                for p in &got {
                    // SAFETY: live blocks of this workspace.
                    let b = unsafe { w.find_block(*p) }.unwrap();
                    // Where an arena block lies in its region (blocks of their own: their kind).
                    seen.push(b.region.map_or(b.kind as usize, |(base, _)| p.as_ptr() as usize - base));
                }
                for (i, p) in got.into_iter().enumerate() {
                    if (cycle + i) % 5 == 0 {
                        kept.push(p); // outlives its cycle
                    } else {
                        // SAFETY: handed out above, freed once.
                        unsafe { w.free(p) };
                    }
                }
                if cycle % 3 == 2 {
                    for p in kept.drain(..) {
                        // SAFETY: kept from an earlier cycle, freed once.
                        unsafe { w.free(p) };
                    }
                }
                reports.push(w.close_cycle().unwrap());
                if reopen {
                    w.reopen_cycle().unwrap();
                } else {
                    w.open_cycle().unwrap();
                }
            }
            for p in kept {
                // SAFETY: as above.
                unsafe { w.free(p) };
            }
            w.close_cycle().unwrap();
            w.verify();
            (seen, reports, w.regions.capacity())
        };
        let (reopened, opened) = (drive(true), drive(false));
        assert!(reopened.2 > 0, "the arena served the later cycles");
        assert!(reopened.1.iter().any(|r| r.escaped_blocks > 0 && r.allocations > 0));
        assert_eq!(reopened, opened);
    }
}
