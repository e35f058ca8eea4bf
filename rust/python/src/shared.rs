//! What the handlers (C entry points, any thread, with or without the GIL) and the Python side
//! share: a workspace's [`Shared`] state (the core behind one lock, and the refusals the handler
//! records for the Python layer) and a scope's [`ScopeState`] (where it was opened, whether it is
//! still open). Both are plain data: nothing here calls into NumPy's handlers or walks the scope
//! stack, so `handler` and `scope` build on this module and neither needs the other's internals.

use std::cell::{RefCell, UnsafeCell};
use std::ffi::{c_char, c_void};
use std::mem::ManuallyDrop;
use std::ptr::{null_mut, NonNull};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use pyo3::ffi;
use pyo3::Python;
use rustws_core::history::{Event, Segment};
use rustws_core::lock::{SpinGuard, SpinLock};
use rustws_core::{BlockKind, DebugMode, Error, Workspace, WorkspaceConfiguration};

/// A workspace as the bindings share it: the core behind one lock, plus what the handler
/// records for the Python layer.
#[derive(Debug)]
pub struct Shared {
    pub id: u64,
    pub name: rustws_core::error::Name,
    /// Set with the core's own flag by [`Shared::destroy`], and read without the lock.
    destroyed: AtomicBool,
    /// Taken by every captured allocation and free: one read-modify-write to lock, none to
    /// unlock (see `rustws_core::lock`).
    workspace: SpinLock<Workspace>,
    /// Requests refused while capturing, drained and reported by the Python layer.
    failures: Mutex<Vec<Error>>,
    /// Whether `failures` holds anything: read at every cycle exit without the lock.
    pub has_failures: AtomicBool,
    /// Whether the Python layer logs every cycle (the `rustws` logger at INFO): each exit then
    /// reports through `_after_cycle`, the loop form's cycles too.
    pub observed: AtomicBool,
    /// While observed: the page faults of this thread while the last outermost cycle opened (the
    /// arena's learned part pre-faulted), and that cycle's number, for the cycle's log; taken by
    /// `_opening_faults` (0 faults: none to report).
    pub opening_faults: [AtomicU64; 2],
    /// Whether the CPU can touch the workspace's memory: NumPy may allocate from it only then.
    pub host_accessible: bool,
    /// Captured requests smaller than this are served by NumPy's own allocator
    /// (`helper_min_size`).
    pub small: usize,
    /// Whether cycles capture (`Workspace.capture`; switching it off acts at once).
    pub capture: AtomicBool,
    /// Debug mode BYPASS_EVERYTHING: arrays come from NumPy's default allocator, and no scope
    /// captures.
    pub bypass: bool,
    /// The name of its handlers: `rustws:<id>:<workspace name>`.
    pub handler_name: [c_char; 127],
}

/// Refusals kept between two cycle exits; later ones are counted, not kept.
const MAX_KEPT_FAILURES: usize = 64;

thread_local! {
    /// The last refusal on this thread, so that an explicit allocation can raise the workspace's
    /// own error instead of NumPy's generic `MemoryError`. Never dropped with the thread (a
    /// refusal left here when a thread ends keeps a reference to a workspace's name): a
    /// thread-local that needs no destructor is never registered with the C library, which can
    /// itself fail where memory ran out.
    static LAST_REFUSAL: ManuallyDrop<RefCell<Option<Error>>> = const { ManuallyDrop::new(RefCell::new(None)) };
}

/// Takes the last refusal recorded on this thread.
pub fn take_last_refusal() -> Option<Error> {
    LAST_REFUSAL.with(|r| r.borrow_mut().take())
}

impl Shared {
    /// The shared state of `workspace`, whose id is its token.
    pub fn new(workspace: Workspace) -> Self {
        let id = workspace.token();
        let host_accessible = workspace.backend().host_accessible();
        let small = usize::try_from(workspace.config().helper_min_size).unwrap_or(usize::MAX);
        let bypass = workspace.debug_mode() == DebugMode::BypassEverything;
        Shared {
            bypass,
            small,
            capture: AtomicBool::new(true),
            handler_name: handler_name(&format!("rustws:{id}:{}", workspace.name())),
            id,
            name: workspace.name().into(),
            destroyed: AtomicBool::new(false),
            workspace: SpinLock::new(workspace),
            failures: Mutex::new(Vec::new()),
            has_failures: AtomicBool::new(false),
            observed: AtomicBool::new(false),
            opening_faults: [AtomicU64::new(0), AtomicU64::new(0)],
            host_accessible,
        }
    }

    /// The workspace; a panic while it was held leaves it usable (its counters are updated
    /// only after the operations they count succeed).
    #[inline]
    pub fn lock(&self) -> SpinGuard<'_, Workspace> {
        self.workspace.lock()
    }

    /// The workspace, locked for an allocation the calling Python code asks for: while stacks are
    /// recorded, the caller's stack is read first (no lock held: reading it makes frame objects)
    /// and the allocation is recorded with it; any stack left by an allocation that never came is
    /// replaced.
    pub fn lock_allocating(&self) -> SpinGuard<'_, Workspace> {
        if !crate::stacks::is_on() {
            return self.lock();
        }
        let context = crate::stacks::context();
        let ws = self.lock();
        ws.recorder().set_context(context);
        ws
    }

    /// Destroys the workspace: nothing opens a cycle or allocates from it any more, and its
    /// memory goes back but for the blocks still live, which go as they die.
    pub fn destroy(&self) {
        self.destroyed.store(true, Ordering::Relaxed);
        self.lock().destroy();
    }

    /// Whether [`Shared::destroy`] ran (no lock taken).
    #[inline]
    pub fn is_destroyed(&self) -> bool {
        self.destroyed.load(Ordering::Relaxed)
    }

    /// The core's error for a destroyed workspace, where explicit allocations and scopes ask
    /// (no lock taken).
    pub fn check_alive(&self) -> Result<(), Error> {
        if self.is_destroyed() {
            Err(Error::destroyed(&self.name))
        } else {
            Ok(())
        }
    }

    /// Whether a scope of this workspace opened now pushes a capture handler: while `capture` is
    /// on (the handler then follows the flag while the scope is open, handing requests to the
    /// handler below it once it is off); otherwise the scope is transparent.
    pub fn installs_handler(&self) -> bool {
        !self.bypass && self.host_accessible && self.capture.load(Ordering::Relaxed)
    }

    /// The refusals recorded since the last call.
    pub fn drain_failures(&self) -> Vec<Error> {
        self.has_failures.store(false, Ordering::Relaxed);
        std::mem::take(&mut *self.failures.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Records a refusal (allocating nothing but room the list may fail to get) and returns the
    /// NULL NumPy turns into `MemoryError`.
    pub(crate) fn refuse(&self, e: Error) -> *mut c_void {
        {
            let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
            // Kept for the next cycle exit to report; a workspace used without cycles must not
            // accumulate them forever. Out of memory, the list may find no room: then the refusal
            // still reaches the caller through `LAST_REFUSAL`.
            if failures.len() < MAX_KEPT_FAILURES && failures.try_reserve(1).is_ok() {
                failures.push(e.clone());
            }
        }
        self.has_failures.store(true, Ordering::Relaxed);
        if FREEZE_AT_REFUSALS.load(Ordering::Relaxed) {
            let requested = match &e {
                Error::OutOfMemory(r) => Some(r.requested),
                Error::SystemOutOfMemory { requested, .. } => Some(*requested),
                _ => None,
            };
            if let Some(requested) = requested {
                freeze(&self.name, requested);
            }
        }
        LAST_REFUSAL.with(|r| *r.borrow_mut() = Some(e));
        null_mut()
    }

    /// A block for NumPy from the workspace (outside its accounts once it is destroyed: the
    /// core decides); NULL for a refusal.
    pub(crate) fn alloc(&self, size: usize, zeroed: bool) -> *mut c_void {
        if !self.host_accessible {
            // Device memory under a NumPy array would crash the first read.
            return self.refuse(Error::unavailable("a device workspace's memory cannot hold NumPy arrays"));
        }
        let r = {
            let mut ws = self.lock_allocating();
            if zeroed {
                ws.alloc_zeroed(size)
            } else {
                ws.alloc(size)
            }
        };
        match r {
            Ok(p) => p.as_ptr().cast(),
            Err(e) => self.refuse(e),
        }
    }

    /// Frees `p` if it is a block of this workspace; says whether it was.
    ///
    /// # Safety
    /// `p` is a block NumPy frees through a handler of this workspace: its own, or one a handler
    /// below served; freed once.
    pub(crate) unsafe fn free_if_ours(&self, p: NonNull<u8>) -> bool {
        // SAFETY: the caller's guarantee: `p` starts a block of this workspace or of another
        // allocator.
        unsafe { self.lock().free_if_ours(p) }
    }

    /// The kind of `p` if it is a live block of this workspace.
    ///
    /// # Safety
    /// As for [`Shared::free_if_ours`]; `p` is live.
    pub(crate) unsafe fn kind_of(&self, p: NonNull<u8>) -> Option<BlockKind> {
        // SAFETY: forwarded.
        unsafe { self.lock().find_block(p) }.map(|b| b.kind)
    }
}

/// State touched only with the GIL held and never across a call into Python: the GIL orders
/// every access, so reaching it takes no lock (an uncontended lock and unlock cost as much as the
/// rest of a cycle boundary).
pub(crate) struct GilCell<T>(UnsafeCell<T>);

// SAFETY: the module declares that it uses the GIL (`gil_used = true`: a free-threaded
// interpreter turns the GIL on when it imports it), and every access goes through `with`, which
// needs a `Python` token, so the GIL is held and no two threads touch the value at once; `with`'s
// closures call no Python, so no access nests.
unsafe impl<T: Send> Sync for GilCell<T> {}

impl<T> GilCell<T> {
    pub(crate) fn new(value: T) -> Self {
        GilCell(UnsafeCell::new(value))
    }

    /// Runs `f` on the value; `f` must not call into Python (which could re-enter).
    #[inline]
    pub(crate) fn with<R>(&self, _py: Python<'_>, f: impl FnOnce(&mut T) -> R) -> R {
        // SAFETY: see the `Sync` impl: the GIL is held and no other access is in progress.
        f(unsafe { &mut *self.0.get() })
    }

    pub(crate) fn get_mut(&mut self) -> &mut T {
        self.0.get_mut()
    }
}

/// One open scope, shared by its node (and the nodes rebuilt for it) and its owner.
#[derive(Debug)]
pub(crate) struct ScopeState {
    /// The thread that opened it.
    pub thread: u64,
    /// Until it exits.
    pub open: AtomicBool,
    /// Whether it opened a cycle of its workspace (else it nests in one, or borrows).
    cycle: AtomicBool,
    /// The asyncio task that opened it (its address), or 0 outside any running task: tasks of
    /// one thread that enter the same workspace run cycles of their own, not nested ones.
    pub task: usize,
    /// The `contextvars.Context` it was (re)opened in (its address; 0: not known): capture stays
    /// in it, not in copies of it (see `threadstate`).
    context: AtomicUsize,
    /// The Python frame that entered it and the frame that called that one (their addresses; 0:
    /// none): the one place, besides its own thread, where an exit of it is its owner's (a
    /// generator or coroutine finalised on another thread runs its exit in that frame, or in a
    /// wrapper's frame called from it where `with` entered a wrapper that entered it).
    /// Only a frame that lives until the scope's exit ([`lives_to_its_exit`]), so that no later
    /// frame can take its address while the scope is open: the frame of a helper that entered it
    /// and returned could be followed at its address by the frame of a call of the same helper
    /// that exits it. No reference is held: it would keep the frame's locals alive after it
    /// returned (the loop form's iterator among them, which ends its cycle when freed). None for
    /// the loop form's scopes (`held`).
    frames: [AtomicUsize; 2],
    /// Whether `frames` were recorded at a `with` statement's entry, which runs until the
    /// statement's exit; else by a generator or coroutine that entered by hand, which most
    /// likely lives to its exit but can end first ([`Recorded`]).
    by_with: AtomicBool,
    /// A level nested in a cycle that ended under it (the cycle's scope unlinked while this one,
    /// above it, was still open): the level ended with the cycle, and its exit only unwinds.
    orphaned: AtomicBool,
    /// Open and not orphaned: NumPy's requests made in it are the workspace's (one load for the
    /// handlers, which read it at every request).
    capturing: AtomicBool,
    /// Held by the code that entered it (the loop form), which ends its cycles and exits it with
    /// this state: a `with` of the same workspace never exits or reopens it.
    pub held: bool,
}

impl ScopeState {
    pub fn new(cycle: bool, task: usize, held: bool) -> Arc<Self> {
        let (frames, by_with) = if held { ([0; 2], false) } else { entry_frames() };
        Arc::new(ScopeState {
            thread: thread_ident(),
            open: AtomicBool::new(true),
            cycle: AtomicBool::new(cycle),
            task,
            context: AtomicUsize::new(0),
            frames: frames.map(AtomicUsize::new),
            by_with: AtomicBool::new(by_with),
            orphaned: AtomicBool::new(false),
            capturing: AtomicBool::new(true),
            held,
        })
    }

    /// Marks it a level whose cycle ended under it (see `orphaned`).
    pub fn orphan(&self) {
        self.orphaned.store(true, Ordering::Relaxed);
        self.capturing.store(false, Ordering::Relaxed);
    }

    pub fn is_orphaned(&self) -> bool {
        self.orphaned.load(Ordering::Relaxed)
    }

    pub fn opened_cycle(&self) -> bool {
        self.cycle.load(Ordering::Relaxed)
    }

    /// Open, and this is where it was opened: its thread, and its context (not a copy of it).
    #[inline]
    pub fn is_here(&self) -> bool {
        self.open.load(Ordering::Relaxed) && self.runs_where_opened()
    }

    /// Whether NumPy's requests made now are its workspace's: [`ScopeState::is_here`], and not a
    /// level whose cycle ended under it.
    #[inline]
    pub fn captures_here(&self) -> bool {
        self.capturing.load(Ordering::Relaxed) && self.runs_where_opened()
    }

    /// Whether the code running now runs where it was opened: its thread, and its context.
    #[inline(always)]
    fn runs_where_opened(&self) -> bool {
        if self.thread != thread_ident() {
            return false;
        }
        let mine = self.context.load(Ordering::Relaxed);
        mine == 0 || {
            let now = crate::threadstate::current_context();
            now == 0 || now == mine
        }
    }

    /// Records the context it runs in now (after it was pushed or reopened: the push made sure
    /// the thread has one).
    pub fn mark_context(&self) {
        self.context.store(crate::threadstate::current_context(), Ordering::Relaxed);
    }

    /// Whether the frame that called the one that entered it is among `now[1..]` (the frames
    /// under the one running an exit, [`caller_frames`]): a wrapper's `__enter__` entered it and
    /// its `__exit__` exits it, both called by the owner's `with` (some wrappers exit through more
    /// than one frame of their own).
    pub fn entered_near(&self, now: &[usize], recorded: Recorded) -> bool {
        let caller = self.entering_caller(recorded);
        caller != 0 && now[1..].contains(&caller)
    }

    /// The address of the frame that called the one that entered it, where a wrapper entered it
    /// (0: none, or not recorded as `recorded` asks).
    #[inline]
    pub fn entering_caller(&self, recorded: Recorded) -> usize {
        if self.trusted(recorded) {
            self.frames[1].load(Ordering::Relaxed)
        } else {
            0
        }
    }

    /// The address of the frame that entered it (0: none, or not recorded as `recorded` asks).
    #[inline]
    pub fn entering_frame(&self, recorded: Recorded) -> usize {
        if self.trusted(recorded) {
            self.frames[0].load(Ordering::Relaxed)
        } else {
            0
        }
    }

    /// Whether its frames count for an exit that takes those `recorded` asks.
    #[inline]
    fn trusted(&self, recorded: Recorded) -> bool {
        recorded == Recorded::Any || self.by_with.load(Ordering::Relaxed)
    }

    /// Forgets the frames that entered it: closed, it is no exit's to take.
    fn forget_frames(&self) {
        for at in &self.frames {
            at.store(0, Ordering::Relaxed);
        }
    }

    /// Closes it; returns whether it was open. Only code holding the GIL opens and closes scopes
    /// (the handlers only read `open`), so this reads and writes, with no read-modify-write.
    pub fn close(&self) -> bool {
        let was = self.open.load(Ordering::Relaxed);
        if was {
            self.open.store(false, Ordering::Relaxed);
            self.capturing.store(false, Ordering::Relaxed);
            self.forget_frames();
        }
        was
    }

    /// Opens it again (the loop form's next iteration, a `with` reopening it in place), from the
    /// frame running now.
    pub fn reopen(&self, cycle: bool) {
        self.cycle.store(cycle, Ordering::Relaxed);
        if !self.held {
            let (frames, by_with) = entry_frames();
            for (at, f) in self.frames.iter().zip(frames) {
                at.store(f, Ordering::Relaxed);
            }
            self.by_with.store(by_with, Ordering::Relaxed);
        }
        self.orphaned.store(false, Ordering::Relaxed);
        self.open.store(true, Ordering::Relaxed);
        self.capturing.store(true, Ordering::Relaxed);
        self.mark_context();
    }
}

// -- every workspace of the process, and its memory at one moment ------------------------------------

/// A workspace of the process and the memory it holds: `"cpu"`, `"cuda"` (with its device's
/// ordinal) or `"standin"` (host memory treated as a device's).
struct Listed {
    shared: Weak<Shared>,
    device: &'static str,
    ordinal: usize,
}

static LISTED: Mutex<Vec<Listed>> = Mutex::new(Vec::new());

/// Lists a new workspace; `false` where there was no room in the list.
pub(crate) fn list(shared: &Arc<Shared>, device: &'static str, ordinal: usize) -> bool {
    let mut list = LISTED.lock().unwrap_or_else(|e| e.into_inner());
    list.retain(|e| e.shared.strong_count() > 0);
    if list.try_reserve(1).is_err() {
        return false;
    }
    list.push(Listed { shared: Arc::downgrade(shared), device, ordinal });
    true
}

/// The live workspaces, with their memory; `None` where there was no room for the list.
pub(crate) fn listed() -> Option<Vec<(Arc<Shared>, &'static str, usize)>> {
    let list = LISTED.lock().unwrap_or_else(|e| e.into_inner());
    let mut out = Vec::new();
    out.try_reserve(list.len()).ok()?;
    out.extend(list.iter().filter_map(|e| e.shared.upgrade().map(|s| (s, e.device, e.ordinal))));
    Some(out)
}

/// One workspace's memory at one moment: what it holds and what it recorded.
pub(crate) struct MemoryState {
    pub name: rustws_core::error::Name,
    pub id: u64,
    pub device: &'static str,
    pub ordinal: usize,
    pub config: WorkspaceConfiguration,
    pub segments: Vec<Segment>,
    pub events: Vec<Event>,
    pub dropped: u64,
}

/// Every live workspace's memory now (each copied under its lock, one at a time); `None` where
/// the system had no room for the copy. The caller holds no workspace's lock.
pub(crate) fn memory_states() -> Option<Vec<MemoryState>> {
    let all = listed()?;
    let mut out = Vec::new();
    out.try_reserve(all.len()).ok()?;
    for (shared, device, ordinal) in all {
        let ws = shared.lock();
        let segments = ws.segments()?;
        let (events, dropped) = ws.recorder().events()?;
        let config = try_clone(ws.config())?;
        drop(ws);
        out.push(MemoryState {
            name: shared.name.clone(),
            id: shared.id,
            device,
            ordinal,
            config,
            segments,
            events,
            dropped,
        });
    }
    Some(out)
}

/// A copy of a configuration, made where memory may have run out (`None`: no room for its path).
fn try_clone(c: &WorkspaceConfiguration) -> Option<WorkspaceConfiguration> {
    let path = match &c.temp_file_path {
        Some(p) => {
            let mut copy = std::ffi::OsString::new();
            copy.try_reserve_exact(p.as_os_str().len()).ok()?;
            copy.push(p.as_os_str());
            Some(copy.into())
        }
        None => None,
    };
    Some(WorkspaceConfiguration { temp_file_path: path, ..*c })
}

/// Whether a refusal of a captured request copies every workspace's memory as it is then.
static FREEZE_AT_REFUSALS: AtomicBool = AtomicBool::new(false);

/// The memory at the last such refusal: the workspace's name, the bytes refused, the states.
type Frozen = (rustws_core::error::Name, u64, Vec<MemoryState>);
static FROZEN: Mutex<Option<Frozen>> = Mutex::new(None);

/// Copies every workspace's memory at refusals of captured requests from now on (or stops).
pub(crate) fn freeze_at_refusals(on: bool) {
    FREEZE_AT_REFUSALS.store(on, Ordering::Relaxed);
    if !on {
        *FROZEN.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// Keeps the memory of every workspace as it is at a refusal of `requested` bytes by the
/// workspace `name` (nothing where the system has no room for the copy). Called where NumPy's
/// handler refuses, with no workspace's lock held: the refusal reaches Python only at the cycle's
/// end, when what was live at the refusal may be gone.
fn freeze(name: &rustws_core::error::Name, requested: u64) {
    let states = memory_states();
    *FROZEN.lock().unwrap_or_else(|e| e.into_inner()) = states.map(|s| (name.clone(), requested, s));
}

/// The memory kept at the refusal of `requested` bytes by the workspace `name`, if that is the
/// last refusal kept (taken: each is reported once). Only the last is kept, and it is known by
/// name and size: a refusal reported later than another of the same workspace and size may be
/// shown the other's memory.
pub(crate) fn take_frozen(name: &str, requested: u64) -> Option<Vec<MemoryState>> {
    let mut frozen = FROZEN.lock().unwrap_or_else(|e| e.into_inner());
    let matches = frozen.as_ref().is_some_and(|(n, r, _)| &**n == name && *r == requested);
    if matches {
        frozen.take().map(|(_, _, s)| s)
    } else {
        None
    }
}

/// Marks the levels nested in the cycle that `scopes[at]` opened (none if it opened no cycle) as
/// ended with it and returns how many there were: the open scopes entered after it on its thread
/// and in its task that nest (open no cycle), up to the next one there that opens a cycle. For a
/// scope closed from elsewhere, whose own stack cannot be walked from here (see `scope::pop` for
/// the same thread).
pub(crate) fn orphan_nested_after(scopes: &[Arc<ScopeState>], at: usize) -> u32 {
    let opener = &scopes[at];
    if !opener.opened_cycle() {
        return 0;
    }
    let mut orphans = 0;
    for s in scopes[at + 1..].iter().filter(|s| s.thread == opener.thread && s.task == opener.task) {
        if s.opened_cycle() {
            break;
        }
        if s.open.load(Ordering::Relaxed) && !s.is_orphaned() {
            s.orphan();
            orphans += 1;
        }
    }
    orphans
}

/// Which of `scopes` (innermost last) the frame running this exit entered: the innermost one its
/// very frame entered ([`ScopeState::entering_frame`]), else the innermost one a wrapper called
/// from it entered ([`ScopeState::entered_near`]). An exit from elsewhere is its owner's only so.
pub(crate) fn entered_here(scopes: &[Arc<ScopeState>]) -> Option<usize> {
    let now = caller_frames::<4>();
    scopes
        .iter()
        .rposition(|s| now[0] != 0 && s.entering_frame(Recorded::Any) == now[0])
        .or_else(|| scopes.iter().rposition(|s| s.entered_near(&now, Recorded::Any)))
}

/// The `N` innermost Python frames of this thread (their addresses, innermost first), 0 for each
/// that is not there.
pub(crate) fn caller_frames<const N: usize>() -> [usize; N] {
    let mut out = [0; N];
    // SAFETY: the GIL is held by every caller (scopes are entered and left from Python); the
    // frames are only compared by address: the current one is borrowed, the callers' new
    // references dropped at once (the running frame keeps its callers alive). Making the frame
    // objects can fail for want of memory: then the frames from there on are not recorded and
    // the error is cleared.
    unsafe {
        let mut f = ffi::PyEval_GetFrame();
        for (i, at) in out.iter_mut().enumerate() {
            if f.is_null() {
                break;
            }
            *at = f as usize;
            if i + 1 < N {
                let back = PyFrame_GetBack(f);
                if i > 0 {
                    ffi::Py_DECREF(f.cast());
                }
                f = back;
            } else if i > 0 {
                ffi::Py_DECREF(f.cast());
            }
        }
        if !ffi::PyErr_Occurred().is_null() {
            ffi::PyErr_Clear();
        }
    }
    out
}

/// Which recorded frames an exit may take a scope by ([`ScopeState::entering_frame`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Recorded {
    /// Only those recorded at a `with` statement's entry: an exit on the scope's own thread,
    /// which takes the innermost scope where none matches.
    ByWith,
    /// Those of a generator or coroutine that entered by hand too: an exit from elsewhere (a
    /// generator finalised on another thread), which is refused where none matches.
    Any,
}

/// The two innermost Python frames of this thread ([`caller_frames`]), where a scope is entered,
/// each kept only where it lives until the scope's exit ([`lives_to_its_exit`]): the first where
/// it entered the scope itself; else the second, where it entered a wrapper that entered it.
/// With them, whether they were recorded at a `with` statement's entry.
fn entry_frames() -> ([usize; 2], bool) {
    let [first] = caller_frames::<1>();
    if let Some(by_with) = lives_to_its_exit(first) {
        return ([first, 0], by_with);
    }
    let [_, second] = caller_frames::<2>();
    match lives_to_its_exit(second) {
        Some(by_with) => ([0, second], by_with),
        None => ([0, 0], false),
    }
}

/// The opcode of `BEFORE_WITH`, which calls a `with` statement's `__enter__`, on the running
/// interpreter (`opcode.opmap`); 0 (`CACHE`, never executed) where it has none.
static BEFORE_WITH: AtomicU8 = AtomicU8::new(0);

/// Where a code object holds its flags (a C `int`), as the interpreter's own member table for
/// `co_flags` says (0: not found; then no frame is told a generator's).
static CO_FLAGS_OFFSET: AtomicUsize = AtomicUsize::new(0);

/// Learns the running interpreter's `BEFORE_WITH` and where code objects hold their flags (at
/// import).
pub fn init_frames(py: Python<'_>) {
    let v = py.version_info();
    let op = match (v.major, v.minor) {
        (3, 11 | 12) => 53,
        (3, 13) => 2,
        // Later interpreters enter a `with` through a plain call: its frame is a helper's.
        _ => 0,
    };
    BEFORE_WITH.store(op, Ordering::Relaxed);
    let code_type = py.import("types").and_then(|types| pyo3::types::PyAnyMethods::getattr(types.as_any(), "CodeType"));
    if let Ok(code_type) = code_type {
        // SAFETY: the GIL is held; `code_type` is a type object (`types.CodeType`, the type of
        // every code object), alive while it is borrowed here. `PyType_GetSlot` reads any type's
        // slots (3.10+); its member table, where it has one, is an array ended by an entry
        // without a name, each name a C string.
        unsafe {
            let members = ffi::PyType_GetSlot(code_type.as_ptr().cast(), ffi::Py_tp_members).cast::<ffi::PyMemberDef>();
            let mut at = members;
            while !at.is_null() && !(*at).name.is_null() {
                let m = &*at;
                if std::ffi::CStr::from_ptr(m.name) == c"co_flags" && m.type_code == ffi::Py_T_INT && m.offset > 0 {
                    CO_FLAGS_OFFSET.store(m.offset as usize, Ordering::Relaxed);
                    break;
                }
                at = at.add(1);
            }
            if !ffi::PyErr_Occurred().is_null() {
                ffi::PyErr_Clear();
            }
        }
    }
}

/// The flags of `code` (a live code object), where the member table told where they lie.
///
/// # Safety
/// `code` is a live code object.
unsafe fn code_flags(code: *mut ffi::PyObject) -> Option<std::ffi::c_long> {
    let offset = CO_FLAGS_OFFSET.load(Ordering::Relaxed);
    // SAFETY: (the caller's, and `init_frames`') `code` is a code object, which holds its flags
    // as a C `int` at the offset the interpreter's member table gives for `co_flags`.
    (offset != 0).then(|| unsafe { code.cast::<u8>().add(offset).cast::<std::ffi::c_int>().read_unaligned() }.into())
}

/// The code flags of generators, coroutines and asynchronous generators (`inspect.CO_*`).
const CO_SUSPENDABLE: std::ffi::c_long = 0x20 | 0x80 | 0x100 | 0x200;

/// Whether `frame` (a live frame object of this thread, entering a scope; 0: none) lives until
/// that scope's exit, so that no other frame can take its address while the scope is open:
/// `Some(true)` where it runs a `with` statement's entry (its current instruction is
/// `BEFORE_WITH`; the statement's exit runs in it); `Some(false)` where it is a generator's or
/// coroutine's, which outlives its suspensions and runs its exits when closed, unless it ends
/// first; `None` otherwise (a plain function can return with the scope open), and where it
/// cannot be told (for want of memory: the error is cleared).
fn lives_to_its_exit(frame: usize) -> Option<bool> {
    if frame == 0 {
        return None;
    }
    let frame = frame as *mut ffi::PyFrameObject;
    let op = BEFORE_WITH.load(Ordering::Relaxed);
    // SAFETY: the GIL is held (scopes are entered from Python) and `frame` is a running frame,
    // alive; no error is set on entry (the bindings' methods run with none). `PyFrame_GetCode`
    // returns a new reference (never null); `PyCode_GetCode` a new reference to the code's bytes
    // as `co_code` gives them (instrumentation and specialisation undone; cached in the code
    // object), or null with an error set; `PyFrame_GetLasti` the byte offset of the instruction
    // running, checked against the bytes' length before it is read. `code` is a live code
    // object ([`code_flags`]).
    unsafe {
        let code = PyFrame_GetCode(frame);
        let bytes = if op == 0 { null_mut() } else { PyCode_GetCode(code) };
        let with = !bytes.is_null() && {
            let at = usize::try_from(PyFrame_GetLasti(frame)).ok();
            let at = at.filter(|&at| (at as isize) < ffi::PyBytes_Size(bytes));
            let is = at.is_some_and(|at| *ffi::PyBytes_AsString(bytes).cast::<u8>().add(at) == op);
            ffi::Py_DECREF(bytes);
            is
        };
        let suspendable = !with && code_flags(code).is_some_and(|flags| flags & CO_SUSPENDABLE != 0);
        ffi::Py_DECREF(code);
        if !ffi::PyErr_Occurred().is_null() {
            ffi::PyErr_Clear();
        }
        (with || suspendable).then_some(with)
    }
}

extern "C" {
    // Public C API since CPython 3.9, exported by every CPython build, but outside the limited
    // API's headers.
    fn PyFrame_GetBack(frame: *mut ffi::PyFrameObject) -> *mut ffi::PyFrameObject;
    // Public C API since CPython 3.9 (`PyFrame_GetCode`) and 3.11 (the others), outside the
    // limited API's headers.
    fn PyFrame_GetCode(frame: *mut ffi::PyFrameObject) -> *mut ffi::PyObject;
    fn PyFrame_GetLasti(frame: *mut ffi::PyFrameObject) -> std::ffi::c_int;
    fn PyCode_GetCode(code: *mut ffi::PyObject) -> *mut ffi::PyObject;
}

/// The Python identity of the calling thread.
pub fn thread_ident() -> u64 {
    // SAFETY: a plain query, callable with or without the GIL.
    unsafe { ffi::PyThread_get_thread_ident() as u64 }
}

fn handler_name(text: &str) -> [c_char; 127] {
    let mut name = [0 as c_char; 127];
    for (dst, src) in name.iter_mut().zip(text.bytes().filter(|b| *b != 0).take(126)) {
        *dst = src as c_char;
    }
    name
}
