//! NumPy's data-memory handler (NEP 49) over a workspace.
//!
//! Each workspace owns one `mem_handler` capsule. Its `ctx` is a strong reference to the
//! workspace's [`Shared`] state, released by the capsule's destructor; NumPy keeps a reference to
//! the capsule in every array it allocates through it, so a workspace's memory stays mapped until
//! the last such array is gone, whatever thread frees it and whether or not the workspace was
//! destroyed. That handler serves every request (explicit allocations use it).
//!
//! Capture goes through a scope's own handler instead ([`capture_handler`]), whose `ctx` is the
//! scope's [`Capture`]: it serves a request from the workspace only on the thread that opened the
//! scope, while the scope is open, and for requests of at least `helper_min_size` bytes; every
//! other request (a thread or task that runs a copy of the opening context, a scope already
//! closed, a destroyed workspace, a small request) is served by NumPy's own allocator, without
//! taking the workspace's lock. Such *foreign* blocks carry a header too, so that every free finds
//! out, lock-free, where its block came from.
//!
//! The handlers' functions never call into Python and never unwind: a refusal is recorded (for
//! the Python layer to report) and NumPy gets NULL.

use std::cell::RefCell;
use std::ffi::{c_char, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::{null_mut, NonNull};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use pyo3::exceptions::PyRuntimeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use rustws_core::arena::{header_of, live_kind, write_live_header, BlockHeader, HEADER};
use rustws_core::{BlockKind, Error, Workspace};

/// The capsule name NumPy requires.
pub const CAPSULE_NAME: &CStr = c"mem_handler";

/// `PyDataMemAllocator` from NumPy's `ndarraytypes.h`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct PyDataMemAllocator {
    pub(crate) ctx: *mut c_void,
    malloc: unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void,
    calloc: unsafe extern "C" fn(*mut c_void, usize, usize) -> *mut c_void,
    realloc: unsafe extern "C" fn(*mut c_void, *mut c_void, usize) -> *mut c_void,
    free: unsafe extern "C" fn(*mut c_void, *mut c_void, usize),
}

/// `PyDataMem_Handler` from NumPy's `ndarraytypes.h` (version 1).
#[repr(C)]
pub(crate) struct PyDataMemHandler {
    name: [c_char; 127],
    version: u8,
    pub(crate) allocator: PyDataMemAllocator,
}

/// A workspace as the bindings share it: the core behind one lock, plus what the handler
/// records for the Python layer.
#[derive(Debug)]
pub struct Shared {
    pub id: u64,
    pub name: rustws_core::error::Name,
    /// Set with the core's own flag by [`Shared::destroy`], and read without the lock.
    destroyed: AtomicBool,
    workspace: Mutex<Workspace>,
    /// Requests refused while capturing, drained and logged by the Python layer.
    failures: Mutex<Vec<Error>>,
    /// Whether `failures` holds anything: read at every cycle exit without the lock.
    pub has_failures: AtomicBool,
    /// Whether the CPU can touch the workspace's memory: NumPy may allocate from it only then.
    pub host_accessible: bool,
    /// Captured requests smaller than this are served by NumPy's own allocator
    /// (`helper_min_size`).
    pub small: usize,
    /// Whether cycles capture (`Workspace.capture`; switching it off acts at once).
    pub capture: AtomicBool,
    /// The name of its handlers: `rustws:<id>:<workspace name>`.
    pub handler_name: [c_char; 127],
}

/// Refusal messages kept between two cycle exits; later ones are counted, not kept.
const MAX_KEPT_FAILURES: usize = 64;

thread_local! {
    /// The last refusal on this thread, so that an explicit allocation can raise the workspace's
    /// own error instead of NumPy's generic `MemoryError`.
    static LAST_REFUSAL: RefCell<Option<Error>> = const { RefCell::new(None) };
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
        Shared {
            small,
            capture: AtomicBool::new(true),
            handler_name: handler_name(&format!("rustws:{id}:{}", workspace.name())),
            id,
            name: workspace.name().into(),
            destroyed: AtomicBool::new(false),
            workspace: Mutex::new(workspace),
            failures: Mutex::new(Vec::new()),
            has_failures: AtomicBool::new(false),
            host_accessible,
        }
    }

    /// The workspace; a panic while it was held leaves it usable (its counters are updated
    /// only after the operations they count succeed).
    pub fn lock(&self) -> MutexGuard<'_, Workspace> {
        self.workspace.lock().unwrap_or_else(|e| e.into_inner())
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

    pub fn drain_failures(&self) -> Vec<String> {
        self.has_failures.store(false, Ordering::Relaxed);
        let failures = std::mem::take(&mut *self.failures.lock().unwrap_or_else(|e| e.into_inner()));
        failures.iter().map(Error::to_string).collect()
    }

    /// Records a refusal (allocating nothing but room the list may fail to get) and returns the
    /// NULL NumPy turns into `MemoryError`.
    fn refuse(&self, e: Error) -> *mut c_void {
        {
            let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
            // Kept for the next cycle exit to log; a workspace used without cycles must not
            // accumulate them forever. Out of memory, the list may find no room: then the
            // refusal still reaches the caller through `LAST_REFUSAL`.
            if failures.len() < MAX_KEPT_FAILURES && failures.try_reserve(1).is_ok() {
                failures.push(e.clone());
            }
        }
        self.has_failures.store(true, Ordering::Relaxed);
        LAST_REFUSAL.with(|r| *r.borrow_mut() = Some(e));
        null_mut()
    }

    fn alloc(&self, size: usize, zeroed: bool) -> *mut c_void {
        if !self.host_accessible {
            // Device memory under a NumPy array would crash the first read.
            return self.refuse(Error::Unavailable {
                what: format!("workspace {:?} holds device memory, which NumPy cannot use", self.name),
            });
        }
        if self.is_destroyed() {
            // Code still running after `destroy()` gets ordinary memory.
            return foreign_alloc(std::ptr::null(), size, zeroed);
        }
        let mut ws = self.lock();
        let r = if ws.is_destroyed() {
            ws.alloc_unaccounted(size, zeroed)
        } else if zeroed {
            ws.alloc_zeroed(size)
        } else {
            ws.alloc(size)
        };
        drop(ws);
        match r {
            Ok(p) => p.as_ptr().cast(),
            Err(e) => self.refuse(e),
        }
    }

    /// Frees a block of this workspace or a foreign one.
    ///
    /// # Safety
    /// `p` was handed out by one of this workspace's handlers (or a capture handler of it) and is
    /// freed once.
    unsafe fn free(&self, p: NonNull<u8>) {
        // SAFETY: every block the handlers hand out has a header in front of it.
        if unsafe { free_if_foreign(p) } {
            return;
        }
        // SAFETY: the caller's guarantee (the core checks that the header names this workspace).
        unsafe { self.lock().free(p) };
    }

    /// Whether the block `p` (handed out by a handler of ours) is this workspace's.
    ///
    /// # Safety
    /// A header of ours, live, precedes `p`.
    unsafe fn owns(&self, p: NonNull<u8>) -> bool {
        // SAFETY: the caller's guarantee.
        unsafe {
            let h = header_of(p).as_ptr();
            live_kind(h).is_some() && std::ptr::addr_of!((*h).owner).read() == self.id
        }
    }

    /// # Safety
    /// As for [`Shared::free`]; `ptr` is live.
    unsafe fn realloc(
        &self,
        p: NonNull<u8>,
        new_size: usize,
        captured: bool,
        via: *const PyDataMemHandler,
    ) -> *mut c_void {
        // SAFETY: every block the handlers hand out has a header in front of it.
        let foreign = unsafe { foreign_header(p) };
        if foreign.is_some() || !captured || self.is_destroyed() {
            // Moved: to workspace memory when this request is captured, else to NumPy's own.
            let old = match foreign {
                Some(h) => h.requested,
                // SAFETY: a live block of this workspace.
                None => unsafe { self.lock().block_info(p) }.requested,
            };
            let q = if captured { self.alloc(new_size, false) } else { foreign_alloc(via, new_size, false) };
            if !q.is_null() {
                // SAFETY: both blocks are live host memory, distinct, valid for the bytes copied.
                unsafe { std::ptr::copy_nonoverlapping(p.as_ptr(), q.cast::<u8>(), old.min(new_size)) };
                // SAFETY: the caller gives `p` up; freed once.
                unsafe { self.free(p) };
            }
            return q;
        }
        let mut ws = self.lock();
        // SAFETY: NumPy reallocates only data it allocated through this handler and still owns.
        let r = unsafe { ws.realloc(p, new_size) };
        drop(ws);
        match r {
            Ok(q) => q.as_ptr().cast(),
            Err(e) => self.refuse(e),
        }
    }
}

/// What a scope's capture handler serves through: the workspace, and the scope's state (the
/// thread that opened it, whether it is still open).
#[derive(Debug)]
pub(crate) struct Capture {
    pub shared: Arc<Shared>,
    pub state: Arc<crate::scope::ScopeState>,
    /// The handler in force below the scope, which serves what the workspace does not take; the
    /// node keeps it alive.
    pub below: *const PyDataMemHandler,
    /// The node whose data holds this capture (for settling a closed one).
    pub node: *const c_void,
}

impl Capture {
    /// Whether a request of `size` bytes made now is served by the workspace.
    #[inline]
    fn takes(&self, size: usize) -> bool {
        size >= self.shared.small
            && self.shared.capture.load(Ordering::Relaxed)
            && self.state.is_here()
            && !self.shared.is_destroyed()
    }

    /// The scope is closed and this is its thread: the node left in place after the scope's
    /// exit is taken out of NumPy's context variable now (see `scope::settle_closed`).
    #[cold]
    fn settle_if_closed(&self) {
        if self.state.open.load(Ordering::Relaxed) || self.state.thread != crate::scope::thread_ident() {
            return;
        }
        if attached() {
            // SAFETY: this thread's thread state is attached: it holds the GIL.
            let py = unsafe { Python::assume_attached() };
            crate::scope::settle_closed(py, self.node);
        }
    }
}

/// Whether the calling thread has an attached Python thread state (holds the GIL): CPython's
/// unchecked thread-state getter, found at run time (`PyThreadState_GetUnchecked` from 3.13,
/// `_PyThreadState_UncheckedGet` before). False when neither is there.
fn attached() -> bool {
    type Getter = unsafe extern "C" fn() -> *mut ffi::PyThreadState;
    static GETTER: OnceLock<Option<Getter>> = OnceLock::new();
    let getter = GETTER.get_or_init(|| {
        for name in [c"PyThreadState_GetUnchecked", c"_PyThreadState_UncheckedGet"] {
            // SAFETY: a symbol lookup in the process's global scope, with a C string name.
            let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
            if !f.is_null() {
                // SAFETY: both symbols are `PyThreadState *(void)` in every CPython that has them.
                return Some(unsafe { std::mem::transmute::<*mut c_void, Getter>(f) });
            }
        }
        None
    });
    // SAFETY: the getter only reads this thread's current thread state.
    getter.is_some_and(|g| !unsafe { g() }.is_null())
}

// -- foreign blocks: NumPy's own allocator, with a header -----------------------------------------

/// Room in front of a foreign block's data: its header, and what aligning it to 64 bytes may take
/// from an allocation aligned to 16.
const FOREIGN_PAD: usize = HEADER + 48;

/// NumPy's default allocator as its handler lends it (found once; NumPy keeps it for the life of
/// the process).
static DEFAULT_ALLOCATOR: OnceLock<usize> = OnceLock::new();

/// Finds NumPy's default allocator: called before any handler of this module can run.
pub fn init_default_allocator(py: Python<'_>) -> PyResult<()> {
    if DEFAULT_ALLOCATOR.get().is_none() {
        let handler = lent_handler(default_handler(py)?);
        if handler.is_null() {
            return Err(PyRuntimeError::new_err("NumPy's default memory handler is not a mem_handler capsule"));
        }
        let _ = DEFAULT_ALLOCATOR.set(handler as usize);
    }
    Ok(())
}

/// NumPy's default handler (its `PyDataMemHandler`), once found.
fn default_handler_ptr() -> *const PyDataMemHandler {
    DEFAULT_ALLOCATOR.get().map_or(std::ptr::null(), |&p| p as *const PyDataMemHandler)
}

/// A block of `size` bytes from the handler `via` (NumPy's default when null), with a foreign
/// header that names it; NULL when that handler refuses (NumPy then raises `MemoryError`).
fn foreign_alloc(via: *const PyDataMemHandler, size: usize, zeroed: bool) -> *mut c_void {
    let via = if via.is_null() { default_handler_ptr() } else { via };
    let Some(total) = size.checked_add(FOREIGN_PAD) else { return null_mut() };
    if via.is_null() {
        return null_mut();
    }
    // SAFETY: `via` is a live handler: NumPy's default (a static of NumPy's) or the one a scope
    // node lends below it, which the node (and so every block it serves) keeps alive.
    let a = unsafe { (*via).allocator };
    // SAFETY: the handler's own functions with its own context; the sizes are non-zero.
    let raw = unsafe {
        if zeroed {
            (a.calloc)(a.ctx, 1, total)
        } else {
            (a.malloc)(a.ctx, total)
        }
    };
    let Some(raw) = NonNull::new(raw.cast::<u8>()) else { return null_mut() };
    let offset = (raw.as_ptr() as usize).next_multiple_of(64) - raw.as_ptr() as usize;
    // SAFETY: `raw` holds `total = size + HEADER + 48` bytes and the header starts at most 48
    // bytes in, 64-aligned: it and the data behind it lie inside the allocation, owned by us.
    // The header records the offset and the handler, to give the allocation back.
    unsafe { write_live_header(raw.add(offset), BlockKind::Foreign, 0, offset as u32, total, size, via as u64) }
        .as_ptr()
        .cast()
}

/// The header of `p` when it is a live foreign block.
///
/// # Safety
/// `p` was handed out by a handler of this module (a header is in front of it).
unsafe fn foreign_header<'a>(p: NonNull<u8>) -> Option<&'a BlockHeader> {
    // SAFETY: the caller's guarantee: a header of ours, 64-aligned, precedes `p`.
    unsafe {
        let h = header_of(p).as_ptr();
        (live_kind(h) == Some(BlockKind::Foreign)).then(|| &*h)
    }
}

/// Frees `p` to NumPy's allocator if it is a foreign block; returns whether it was.
///
/// # Safety
/// As for [`foreign_header`]; the block is freed once.
unsafe fn free_if_foreign(p: NonNull<u8>) -> bool {
    // SAFETY: forwarded.
    let Some(h) = (unsafe { foreign_header(p) }) else { return false };
    let (offset, total, via) = (h.region as usize, h.slot, h.generation as usize as *const PyDataMemHandler);
    // SAFETY: the handler that served the block is alive: NumPy's default, or one a scope node
    // lends, kept alive by that node, which every block it served keeps alive.
    let a = unsafe { (*via).allocator };
    // SAFETY: the header is ours; the allocation it lies in started `offset` bytes before it and
    // holds `total` bytes; it is given back once, to the handler that made it.
    unsafe {
        let at = header_of(p).as_ptr();
        (*at).magic = 0;
        (a.free)(a.ctx, at.cast::<u8>().sub(offset).cast(), total);
    }
    true
}

fn guarded<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(fallback)
}

/// # Safety
/// `ctx` is the `Shared` pointer this module stored in the handler (alive while the capsule is).
unsafe fn shared<'a>(ctx: *mut c_void) -> &'a Shared {
    // SAFETY: the caller guarantees `ctx` came from `Arc::into_raw` in `new_capsule` and the
    // capsule holding that strong reference is alive (NumPy calls us only through it).
    unsafe { &*(ctx as *const Shared) }
}

unsafe extern "C" fn ws_malloc(ctx: *mut c_void, size: usize) -> *mut c_void {
    // SAFETY: NumPy passes back the ctx we registered.
    guarded(null_mut(), || unsafe { shared(ctx) }.alloc(size, false))
}

unsafe extern "C" fn ws_calloc(ctx: *mut c_void, nelem: usize, elsize: usize) -> *mut c_void {
    guarded(null_mut(), || {
        // SAFETY: NumPy passes back the ctx we registered.
        let s = unsafe { shared(ctx) };
        match nelem.checked_mul(elsize) {
            Some(n) => s.alloc(n, true),
            None => {
                let mut ws = s.lock();
                ws.record_failure();
                let e = Error::OutOfMemory {
                    workspace: s.name.clone(),
                    requested: u64::MAX,
                    in_use: 0,
                    limit: 0,
                    reason: "element count times element size overflows",
                };
                drop(ws);
                s.refuse(e)
            }
        }
    })
}

unsafe extern "C" fn ws_realloc(ctx: *mut c_void, ptr: *mut c_void, new_size: usize) -> *mut c_void {
    guarded(null_mut(), || {
        // SAFETY: NumPy passes back the ctx we registered.
        let s = unsafe { shared(ctx) };
        match NonNull::new(ptr.cast::<u8>()) {
            None => s.alloc(new_size, false),
            // SAFETY: NumPy reallocates only data it allocated through this handler and owns.
            Some(p) => unsafe { s.realloc(p, new_size, true, std::ptr::null()) },
        }
    })
}

unsafe extern "C" fn ws_free(ctx: *mut c_void, ptr: *mut c_void, _size: usize) {
    guarded((), || {
        let Some(p) = NonNull::new(ptr.cast::<u8>()) else { return };
        // SAFETY: NumPy passes back the ctx we registered; it frees only data it allocated
        // through this handler, once.
        unsafe { shared(ctx).free(p) };
    })
}

// -- a scope's capture handler -------------------------------------------------------------------

/// # Safety
/// `ctx` is the `Capture` of a live scope node (NumPy calls us only through that node, which
/// keeps it alive).
unsafe fn capture<'a>(ctx: *mut c_void) -> &'a Capture {
    // SAFETY: the caller's guarantee.
    unsafe { &*(ctx as *const Capture) }
}

/// Whether `h` is a handler of this module (a workspace's or a scope's).
fn is_ours(h: *const PyDataMemHandler) -> bool {
    if h.is_null() {
        return false;
    }
    // SAFETY: a live handler (the caller's).
    let m = unsafe { (*h).allocator.malloc } as usize;
    m == ws_malloc as *const () as usize || m == capture_malloc as *const () as usize
}

/// Serves what a scope's workspace does not take through the handler below it: one of ours
/// directly (its blocks carry our headers), any other with a foreign header.
fn delegate(below: *const PyDataMemHandler, size: usize, zeroed: bool) -> *mut c_void {
    if !is_ours(below) {
        return foreign_alloc(below, size, zeroed);
    }
    // SAFETY: one of our handlers, alive as long as the node that lends it below this one.
    let a = unsafe { (*below).allocator };
    // SAFETY: the handler's own functions with its own context.
    unsafe {
        if zeroed {
            (a.calloc)(a.ctx, 1, size)
        } else {
            (a.malloc)(a.ctx, size)
        }
    }
}

unsafe extern "C" fn capture_malloc(ctx: *mut c_void, size: usize) -> *mut c_void {
    guarded(null_mut(), || {
        // SAFETY: NumPy passes back the ctx the node registered.
        let c = unsafe { capture(ctx) };
        if c.takes(size) {
            c.shared.alloc(size, false)
        } else {
            if !c.state.open.load(Ordering::Relaxed) {
                c.settle_if_closed();
            }
            delegate(c.below, size, false)
        }
    })
}

unsafe extern "C" fn capture_calloc(ctx: *mut c_void, nelem: usize, elsize: usize) -> *mut c_void {
    guarded(null_mut(), || {
        // SAFETY: NumPy passes back the ctx the node registered.
        let c = unsafe { capture(ctx) };
        match nelem.checked_mul(elsize) {
            Some(n) if c.takes(n) => c.shared.alloc(n, true),
            Some(n) => {
                c.settle_if_closed();
                delegate(c.below, n, true)
            }
            None => null_mut(),
        }
    })
}

unsafe extern "C" fn capture_realloc(ctx: *mut c_void, ptr: *mut c_void, new_size: usize) -> *mut c_void {
    guarded(null_mut(), || {
        // SAFETY: NumPy passes back the ctx the node registered.
        let c = unsafe { capture(ctx) };
        let captured = c.takes(new_size);
        let Some(p) = NonNull::new(ptr.cast::<u8>()) else {
            return if captured { c.shared.alloc(new_size, false) } else { delegate(c.below, new_size, false) };
        };
        // SAFETY: NumPy reallocates only data it allocated through this handler and owns: a
        // foreign block, one of this workspace, or one the handler below served.
        unsafe {
            if foreign_header(p).is_some() || c.shared.owns(p) {
                return c.shared.realloc(p, new_size, captured, c.below);
            }
            let a = (*c.below).allocator;
            if !captured {
                return (a.realloc)(a.ctx, ptr, new_size);
            }
            // Moved into this workspace, out of the one below.
            let old = (*header_of(p).as_ptr()).requested;
            let q = c.shared.alloc(new_size, false);
            if !q.is_null() {
                std::ptr::copy_nonoverlapping(p.as_ptr(), q.cast::<u8>(), old.min(new_size));
                (a.free)(a.ctx, ptr, old);
            }
            q
        }
    })
}

unsafe extern "C" fn capture_free(ctx: *mut c_void, ptr: *mut c_void, size: usize) {
    guarded((), || {
        let Some(p) = NonNull::new(ptr.cast::<u8>()) else { return };
        // SAFETY: NumPy passes back the ctx the node registered; it frees only data it allocated
        // through this handler, once: a foreign block, one of this workspace, or one the handler
        // below served (which frees it).
        unsafe {
            let c = capture(ctx);
            if free_if_foreign(p) {
                return;
            }
            if c.shared.owns(p) {
                c.shared.lock().free(p);
            } else if is_ours(c.below) {
                let a = (*c.below).allocator;
                (a.free)(a.ctx, ptr, size);
            }
        }
    })
}

/// The handler of a capturing scope over `shared`: its `ctx` is `capture`, which must outlive it.
pub(crate) fn capture_handler(capture: *const Capture, shared: &Shared) -> PyDataMemHandler {
    PyDataMemHandler {
        name: shared.handler_name,
        version: 1,
        allocator: PyDataMemAllocator {
            ctx: capture as *mut c_void,
            malloc: capture_malloc,
            calloc: capture_calloc,
            realloc: capture_realloc,
            free: capture_free,
        },
    }
}

fn handler_name(text: &str) -> [c_char; 127] {
    let mut name = [0 as c_char; 127];
    for (dst, src) in name.iter_mut().zip(text.bytes().filter(|b| *b != 0).take(126)) {
        *dst = src as c_char;
    }
    name
}

unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with our capsule; the name matches the one it was created with.
    let ptr = unsafe { ffi::PyCapsule_GetPointer(capsule, CAPSULE_NAME.as_ptr()) } as *mut PyDataMemHandler;
    if ptr.is_null() {
        // SAFETY: the failed lookup set an exception; a destructor must not leave one behind.
        unsafe { ffi::PyErr_Clear() };
        return;
    }
    // Releasing the last reference drops the workspace (its regions are unmapped): nothing of that
    // may unwind into the interpreter. A panic leaks what was left.
    guarded((), || {
        // SAFETY: the pointer came from `Box::into_raw` in `new_capsule` and this destructor runs
        // once.
        let handler = unsafe { Box::from_raw(ptr) };
        // SAFETY: `ctx` holds the strong reference taken in `new_capsule`, released once here.
        drop(unsafe { Arc::from_raw(handler.allocator.ctx as *const Shared) });
    });
}

/// The `mem_handler` capsule of a workspace; its name is `rustws:<id>:<workspace name>`.
pub fn new_capsule(py: Python<'_>, shared: &Arc<Shared>) -> PyResult<Py<PyAny>> {
    init_default_allocator(py)?;
    let name = shared.handler_name;
    let ctx = Arc::into_raw(shared.clone()) as *mut c_void;
    let handler = Box::into_raw(Box::new(PyDataMemHandler {
        name,
        version: 1,
        allocator: PyDataMemAllocator { ctx, malloc: ws_malloc, calloc: ws_calloc, realloc: ws_realloc, free: ws_free },
    }));
    // SAFETY: `handler` is a valid heap pointer whose ownership passes to the capsule; the name is
    // a static C string as the capsule API requires.
    let cap = unsafe { ffi::PyCapsule_New(handler.cast(), CAPSULE_NAME.as_ptr(), Some(capsule_destructor)) };
    if cap.is_null() {
        // SAFETY: the capsule was not created, so we still own both the box and the reference.
        unsafe {
            drop(Box::from_raw(handler));
            drop(Arc::from_raw(ctx as *const Shared));
        }
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `cap` is a new strong reference we own.
    Ok(unsafe { Bound::from_owned_ptr(py, cap) }.unbind())
}

/// NumPy's C-API table, for the handler slots rust-numpy does not expose.
fn api_table(py: Python<'_>) -> PyResult<*const *const c_void> {
    static TABLE: PyOnceLock<usize> = PyOnceLock::new();
    TABLE
        .get_or_try_init(py, || -> PyResult<usize> {
            let module = py.import("numpy._core.multiarray").or_else(|_| py.import("numpy.core.multiarray"))?;
            let capsule = module.getattr("_ARRAY_API")?;
            // SAFETY: `_ARRAY_API` is NumPy's unnamed capsule holding its C-API table.
            let p = unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), std::ptr::null()) };
            if p.is_null() {
                return Err(PyErr::fetch(py));
            }
            // SAFETY: slot 0 is `PyArray_GetNDArrayCVersion`; slot 211 is
            // `PyArray_GetNDArrayCFeatureVersion`, present since NumPy 1.4.
            let feature: unsafe extern "C" fn() -> u32 =
                unsafe { std::mem::transmute(*(p as *const *const c_void).add(211)) };
            // SAFETY: a plain query with no arguments.
            if unsafe { feature() } < 0x0f {
                return Err(PyRuntimeError::new_err("rustws needs NumPy >= 1.22 (NEP 49 memory handlers)"));
            }
            // The capsule is kept alive by NumPy's module for the life of the process.
            Ok(p as usize)
        })
        .map(|p| *p as *const *const c_void)
}

/// The name of the handler a `mem_handler` capsule lends.
pub fn name_of(capsule: &Bound<'_, PyAny>) -> Option<String> {
    let h = lent_handler(capsule).cast::<PyDataMemHandler>();
    if h.is_null() {
        return None;
    }
    // SAFETY: a valid `mem_handler` capsule lends a `PyDataMemHandler` that lives as long as it;
    // its name is a NUL-terminated array (NumPy's contract).
    let name = unsafe { std::ffi::CStr::from_ptr((*h).name.as_ptr()) };
    Some(name.to_string_lossy().into_owned())
}

/// The workspace whose memory a `mem_handler` capsule serves (its own handler's, or a scope's
/// capture handler's), if it is one of ours.
pub fn served_by(capsule: &Bound<'_, PyAny>) -> Option<*const Shared> {
    let h = lent_handler(capsule).cast::<PyDataMemHandler>();
    if h.is_null() {
        return None;
    }
    // SAFETY: a valid `mem_handler` capsule lends a `PyDataMemHandler` that lives as long as it.
    let a = unsafe { (*h).allocator };
    if a.malloc as usize == ws_malloc as *const () as usize {
        Some(a.ctx as *const Shared)
    } else if a.malloc as usize == capture_malloc as *const () as usize {
        // SAFETY: a capture handler's ctx is the `Capture` boxed beside it, alive as long as it.
        Some(Arc::as_ptr(&unsafe { &*(a.ctx as *const Capture) }.shared))
    } else {
        None
    }
}

/// `PyDataMem_SetHandler`: makes `handler` (None: NumPy's default) current in this context and
/// returns the previous one.
pub fn set_handler<'py>(py: Python<'py>, handler: Option<&Bound<'py, PyAny>>) -> PyResult<Bound<'py, PyAny>> {
    let table = api_table(py)?;
    // SAFETY: slot 304 of NumPy's C-API table is `PyObject *PyDataMem_SetHandler(PyObject *)`
    // since NumPy 1.22 (checked in `api_table`).
    let f: unsafe extern "C" fn(*mut ffi::PyObject) -> *mut ffi::PyObject =
        unsafe { std::mem::transmute(*table.add(304)) };
    let arg = handler.map_or(std::ptr::null_mut(), |h| h.as_ptr());
    // SAFETY: `arg` is a borrowed capsule (or NULL for the default); the result is a new reference.
    let old = unsafe { f(arg) };
    // SAFETY: a new reference, or NULL with an exception set.
    unsafe { Bound::from_owned_ptr_or_err(py, old) }
}

/// NumPy's default handler capsule (the same object for the life of the process).
pub fn default_handler(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    static DEFAULT: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    DEFAULT
        .get_or_try_init(py, || -> PyResult<Py<PyAny>> {
            let previous = set_handler(py, None)?;
            let default = get_handler(py);
            set_handler(py, Some(&previous))?;
            Ok(default?.unbind())
        })
        .map(|h| h.bind(py))
}

/// The `PyDataMemHandler` a `mem_handler` capsule lends (null for anything else; no exception).
pub fn lent_handler(capsule: &Bound<'_, PyAny>) -> *mut c_void {
    // SAFETY: a live object; `PyCapsule_IsValid` sets no exception, and `GetPointer` is called only
    // on a valid capsule of that name.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule.as_ptr(), CAPSULE_NAME.as_ptr()) != 1 {
            return null_mut();
        }
        ffi::PyCapsule_GetPointer(capsule.as_ptr(), CAPSULE_NAME.as_ptr())
    }
}

/// `PyDataMem_GetHandler`: the handler current in this context.
pub fn get_handler(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let table = api_table(py)?;
    // SAFETY: slot 305 is `PyObject *PyDataMem_GetHandler(void)` since NumPy 1.22.
    let f: unsafe extern "C" fn() -> *mut ffi::PyObject = unsafe { std::mem::transmute(*table.add(305)) };
    // SAFETY: returns a new reference or NULL with an exception set.
    unsafe { Bound::from_owned_ptr_or_err(py, f()) }
}
