//! NumPy's data-memory handler (NEP 49) over a workspace.
//!
//! Each workspace owns one `mem_handler` capsule. Its `ctx` is a strong reference to the
//! workspace's [`Shared`] state, released by the capsule's destructor; NumPy keeps a reference to
//! the capsule in every array it allocates through it, so a workspace's memory stays mapped until
//! the last such array is gone, whatever thread frees it and whether or not the workspace was
//! destroyed. That handler serves every request (explicit allocations use it).
//!
//! Capture goes through a scope's own handler instead ([`capture_handler`]), whose `ctx` is the
//! scope's [`Capture`]: it serves a request from the workspace only where the scope is open (its
//! thread, its task), and for requests of at least `helper_min_size` bytes; every other request (a
//! thread or task that runs a copy of the opening context, a scope already closed, a destroyed
//! workspace, a small request) is served by the handler below the scope (NumPy's own allocator,
//! or a scope below), exactly as that handler serves it: same size, no header, no lock.
//!
//! A free finds out where its block came from without reading memory in front of it. NumPy frees
//! a block with the size it asked for (its own small-block cache relies on that), so a block
//! smaller than `helper_min_size` was never the workspace's; any other block is the workspace's
//! if the workspace says so, which it answers from its own memory alone (the ranges of its arena
//! regions and its table of blocks outside them). A block that is not the workspace's goes back
//! to the handler below, and a reallocation keeps a block with the allocator that made it
//! (a workspace block moves out to the handler below only where the workspace no longer serves).
//!
//! The handlers' functions never call into Python code and never unwind: a refusal is recorded
//! (for the Python layer to report) and NumPy gets NULL. While stacks are recorded, an allocation
//! reads the calling frames through CPython's frame API (see `stacks`), which runs no Python code.

use std::ffi::{c_char, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::{null_mut, NonNull};
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use pyo3::exceptions::PyRuntimeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use rustws_core::BlockKind;

use crate::shared::{thread_ident, ScopeState, Shared};

/// The capsule name NumPy requires, at the start of a page of its own. NumPy compares it with
/// its own copy (`strcmp`) at every allocation and free it makes through a capsule of ours; the
/// vector `strcmp` takes a slower path when either string lies near the end of a page, so where
/// the linker happened to put this one cost a tenth of a microsecond per step of a small loop.
#[repr(C, align(4096))]
struct PageStart([u8; 12]);
static CAPSULE_NAME_BYTES: PageStart = PageStart(*b"mem_handler\0");
pub const CAPSULE_NAME: &CStr = match CStr::from_bytes_with_nul(&CAPSULE_NAME_BYTES.0) {
    Ok(name) => name,
    Err(_) => panic!("a C string"),
};

/// `PyDataMemAllocator` from NumPy's `ndarraytypes.h`.
///
/// # Safety
/// Its functions are called only with its own `ctx`, as NumPy calls them: `free` and `realloc`
/// with a pointer the same allocator served, live, and `free` with the size it was asked for.
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

/// What a scope's capture handler serves through: the workspace, and the scope's state (where it
/// was opened, whether it is still open).
#[derive(Debug)]
pub(crate) struct Capture {
    pub shared: Arc<Shared>,
    pub state: Arc<ScopeState>,
    /// Puts back what was below a closed scope's node (the scope module's, given here so that
    /// the handler needs nothing above it).
    pub settle: fn(Python<'_>, *const c_void),
    /// The handler in force below the scope, which serves what the workspace does not take; the
    /// node keeps it alive.
    pub below: *const PyDataMemHandler,
    /// The node whose data holds this capture (for settling a closed one).
    pub node: *const c_void,
    /// `shared.small`, and the allocator of `below`, read once: a request the workspace does not
    /// take costs one comparison and one indirect call.
    small: usize,
    lend: Option<PyDataMemAllocator>,
}

impl std::fmt::Debug for PyDataMemAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PyDataMemAllocator").field("ctx", &self.ctx).finish_non_exhaustive()
    }
}

impl Capture {
    /// The capture of a scope with `state` over `shared`, lending what the workspace does not
    /// take to `below` (kept alive by the node; a handler never changes), or to NumPy's default
    /// when `below` is null (known from the module's import on: a failed search fails the import).
    pub(crate) fn new(
        shared: Arc<Shared>,
        state: Arc<ScopeState>,
        settle: fn(Python<'_>, *const c_void),
        below: *const PyDataMemHandler,
    ) -> Self {
        let small = shared.small;
        Capture { shared, state, settle, below, node: std::ptr::null(), small, lend: allocator_of(below) }
    }

    /// Whether a request of `size` bytes made now is served by the workspace.
    #[inline]
    fn takes(&self, size: usize) -> bool {
        size >= self.small
            && self.shared.capture.load(Ordering::Relaxed)
            && self.state.captures_here()
            && !self.shared.is_destroyed()
    }

    /// The scope is closed and this is its thread: the node left in place after the scope's
    /// exit is taken out of NumPy's context variable now (see `scope::settle_closed`).
    #[cold]
    fn settle_if_closed(&self) {
        if self.state.open.load(Ordering::Relaxed) || self.state.thread != thread_ident() {
            return;
        }
        if crate::threadstate::attached() {
            // SAFETY: this thread's thread state is attached: it holds the GIL.
            let py = unsafe { Python::assume_attached() };
            (self.settle)(py, self.node);
        }
    }
}

// -- the handlers below a workspace: NumPy's own, or a scope's --------------------------------------

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

/// The allocator of the handler `via` (NumPy's default when null); None when none is known.
fn allocator_of(via: *const PyDataMemHandler) -> Option<PyDataMemAllocator> {
    let via = if via.is_null() { default_handler_ptr() } else { via };
    // SAFETY: `via` is a live handler: NumPy's default (a static of NumPy's) or the one a scope
    // node lends below it, which the node (and so every block it serves) keeps alive.
    (!via.is_null()).then(|| unsafe { (*via).allocator })
}

/// A block of `size` bytes from the allocator `lend` of a handler (see [`allocator_of`]), as
/// that handler serves it; NULL when it refuses (NumPy then raises `MemoryError`).
fn allocate(lend: Option<PyDataMemAllocator>, size: usize, zeroed: bool) -> *mut c_void {
    let Some(a) = lend else { return null_mut() };
    // SAFETY: the handler's own functions with its own context.
    unsafe {
        if zeroed {
            (a.calloc)(a.ctx, 1, size)
        } else {
            (a.malloc)(a.ctx, size)
        }
    }
}

/// Gives `ptr` (of `size` bytes) back to the handler whose allocator `lend` served it.
///
/// # Safety
/// `ptr` was served by `lend` and is freed once.
unsafe fn release(lend: Option<PyDataMemAllocator>, ptr: *mut c_void, size: usize) {
    if let Some(a) = lend {
        // SAFETY: the caller's guarantee; the handler's own function with its own context.
        unsafe { (a.free)(a.ctx, ptr, size) };
    }
}

/// Resizes `ptr` with the handler whose allocator `lend` served it.
///
/// # Safety
/// `ptr` was served by `lend` and is live.
unsafe fn resize(lend: Option<PyDataMemAllocator>, ptr: *mut c_void, new_size: usize) -> *mut c_void {
    match lend {
        // SAFETY: the caller's guarantee; the handler's own function with its own context.
        Some(a) => unsafe { (a.realloc)(a.ctx, ptr, new_size) },
        None => null_mut(),
    }
}

/// Resizes `p` if it is a block of this workspace: in the workspace when `stays`, else moved
/// to the handler whose allocator is `out`. None when `p` is no block of this workspace.
///
/// # Safety
/// As for `Shared::free_if_ours`; `p` is live.
unsafe fn realloc_if_ours(
    shared: &Shared,
    p: NonNull<u8>,
    new_size: usize,
    stays: bool,
    out: Option<PyDataMemAllocator>,
) -> Option<*mut c_void> {
    let mut ws = shared.lock_allocating();
    // SAFETY: the caller's guarantee.
    let info = unsafe { ws.find_block(p) }?;
    if stays {
        // SAFETY: a live block of this workspace, given up on success.
        let r = unsafe { ws.realloc(p, new_size) };
        drop(ws);
        return Some(match r {
            Ok(q) => q.as_ptr().cast(),
            Err(e) => shared.refuse(e),
        });
    }
    // Out of the workspace: the handler below may be a scope of this same workspace, so the
    // lock is not held while it serves.
    drop(ws);
    let q = allocate(out, new_size, false);
    if !q.is_null() {
        // SAFETY: both blocks are live host memory, distinct, valid for the bytes copied.
        unsafe { std::ptr::copy_nonoverlapping(p.as_ptr(), q.cast::<u8>(), info.requested.min(new_size)) };
        // SAFETY: a live block of this workspace, given up now.
        unsafe { shared.lock().free(p) };
    }
    Some(q)
}

fn guarded<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(fallback)
}

// -- the workspace's own handler ----------------------------------------------------------------------

/// # Safety
/// `ctx` is the `Shared` pointer this module stored in the handler (alive while the capsule is).
unsafe fn shared<'a>(ctx: *mut c_void) -> &'a Shared {
    // SAFETY: the caller guarantees `ctx` came from `Arc::into_raw` in `new_capsule` and the
    // capsule holding that strong reference is alive (NumPy calls us only through it).
    unsafe { &*(ctx as *const Shared) }
}

/// # Safety
/// Called by NumPy with the `ctx` of this workspace's handler (its `Shared`, kept alive by the
/// capsule), and, for `realloc` / `free`, a pointer this handler served.
unsafe extern "C" fn ws_malloc(ctx: *mut c_void, size: usize) -> *mut c_void {
    // SAFETY: NumPy passes back the ctx we registered.
    guarded(null_mut(), || unsafe { shared(ctx) }.alloc(size, false))
}

/// # Safety
/// Called by NumPy with the `ctx` of this workspace's handler (its `Shared`, kept alive by the
/// capsule), and, for `realloc` / `free`, a pointer this handler served.
unsafe extern "C" fn ws_calloc(ctx: *mut c_void, nelem: usize, elsize: usize) -> *mut c_void {
    guarded(null_mut(), || {
        // SAFETY: NumPy passes back the ctx we registered.
        let s = unsafe { shared(ctx) };
        match nelem.checked_mul(elsize) {
            Some(n) => s.alloc(n, true),
            None => {
                let e = s.lock().refusal(u64::MAX, "element count times element size overflows");
                s.refuse(e)
            }
        }
    })
}

/// # Safety
/// Called by NumPy with the `ctx` of this workspace's handler (its `Shared`, kept alive by the
/// capsule), and, for `realloc` / `free`, a pointer this handler served.
unsafe extern "C" fn ws_realloc(ctx: *mut c_void, ptr: *mut c_void, new_size: usize) -> *mut c_void {
    guarded(null_mut(), || {
        // SAFETY: NumPy passes back the ctx we registered.
        let s = unsafe { shared(ctx) };
        let Some(p) = NonNull::new(ptr.cast::<u8>()) else { return s.alloc(new_size, false) };
        let numpy = allocator_of(null_mut());
        // SAFETY: NumPy reallocates only data it allocated through this handler and owns: a block
        // of this workspace, or NumPy's own (served after `destroy`).
        unsafe { realloc_if_ours(s, p, new_size, true, numpy) }
            .unwrap_or_else(|| unsafe { resize(numpy, ptr, new_size) })
    })
}

/// # Safety
/// Called by NumPy with the `ctx` of this workspace's handler (its `Shared`, kept alive by the
/// capsule), and, for `realloc` / `free`, a pointer this handler served.
unsafe extern "C" fn ws_free(ctx: *mut c_void, ptr: *mut c_void, size: usize) {
    guarded((), || {
        let Some(p) = NonNull::new(ptr.cast::<u8>()) else { return };
        // SAFETY: NumPy passes back the ctx we registered; it frees only data it allocated
        // through this handler, once: a block of this workspace, or NumPy's own.
        unsafe {
            if !shared(ctx).free_if_ours(p) {
                release(allocator_of(null_mut()), ptr, size);
            }
        }
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

/// # Safety
/// Called by NumPy with the `ctx` of a scope node's capture handler (its `Capture`, kept alive by
/// the node), and, for `realloc` / `free`, a pointer this handler served.
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
            allocate(c.lend, size, false)
        }
    })
}

/// # Safety
/// Called by NumPy with the `ctx` of a scope node's capture handler (its `Capture`, kept alive by
/// the node), and, for `realloc` / `free`, a pointer this handler served.
unsafe extern "C" fn capture_calloc(ctx: *mut c_void, nelem: usize, elsize: usize) -> *mut c_void {
    guarded(null_mut(), || {
        // SAFETY: NumPy passes back the ctx the node registered.
        let c = unsafe { capture(ctx) };
        match nelem.checked_mul(elsize) {
            Some(n) if c.takes(n) => c.shared.alloc(n, true),
            Some(n) => {
                c.settle_if_closed();
                allocate(c.lend, n, true)
            }
            None => null_mut(),
        }
    })
}

/// # Safety
/// Called by NumPy with the `ctx` of a scope node's capture handler (its `Capture`, kept alive by
/// the node), and, for `realloc` / `free`, a pointer this handler served.
unsafe extern "C" fn capture_realloc(ctx: *mut c_void, ptr: *mut c_void, new_size: usize) -> *mut c_void {
    guarded(null_mut(), || {
        // SAFETY: NumPy passes back the ctx the node registered.
        let c = unsafe { capture(ctx) };
        let captured = c.takes(new_size);
        let Some(p) = NonNull::new(ptr.cast::<u8>()) else {
            return if captured { c.shared.alloc(new_size, false) } else { allocate(c.lend, new_size, false) };
        };
        // SAFETY: NumPy reallocates only data it allocated through this handler and owns: a block
        // of this workspace (resized in it while the scope captures, else moved to the handler
        // below), or one the handler below served (which resizes it).
        unsafe {
            match realloc_if_ours(&c.shared, p, new_size, captured, c.lend) {
                Some(q) => q,
                None => resize(c.lend, ptr, new_size),
            }
        }
    })
}

/// # Safety
/// Called by NumPy with the `ctx` of a scope node's capture handler (its `Capture`, kept alive by
/// the node), and, for `realloc` / `free`, a pointer this handler served.
unsafe extern "C" fn capture_free(ctx: *mut c_void, ptr: *mut c_void, size: usize) {
    guarded((), || {
        let Some(p) = NonNull::new(ptr.cast::<u8>()) else { return };
        // SAFETY: NumPy passes back the ctx the node registered; it frees only data it allocated
        // through this handler, once, with the size it asked for: a block of this workspace
        // (never one smaller than `helper_min_size`), or one the handler below served.
        unsafe {
            let c = capture(ctx);
            if size < c.small || !c.shared.free_if_ours(p) {
                release(c.lend, ptr, size);
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

/// # Safety
/// Called by Python once, with a capsule `new_capsule` made, as it is freed.
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
    crate::once::get_or_try_make(&TABLE, py, || -> PyResult<usize> {
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

/// The id of the workspace whose block `data` is, for an array that owns `data` and holds the
/// handler `capsule`: the workspace of that handler (its own, or a scope's capture handler), or
/// of a capture handler below it that served the block; None for NumPy's own memory and for
/// blocks outside the workspaces' accounts (bypass blocks). Asks the workspaces, reading none of
/// the memory around `data`.
pub fn owner_of(capsule: &Bound<'_, PyAny>, data: NonNull<u8>) -> Option<u64> {
    let mut h = lent_handler(capsule).cast::<PyDataMemHandler>().cast_const();
    while !h.is_null() {
        // SAFETY: a live handler: the capsule's (held by the array), or one a node below it lends
        // (held by that node, which the capsule's node holds).
        let a = unsafe { (*h).allocator };
        let (shared, below) = if a.malloc as usize == ws_malloc as *const () as usize {
            // SAFETY: a workspace handler's ctx is its `Shared`, alive as long as the handler.
            (unsafe { &*(a.ctx as *const Shared) }, std::ptr::null())
        } else if a.malloc as usize == capture_malloc as *const () as usize {
            // SAFETY: a capture handler's ctx is the `Capture` boxed beside it, alive as long as it.
            let c = unsafe { &*(a.ctx as *const Capture) };
            (&*c.shared, c.below)
        } else {
            return None;
        };
        // SAFETY: `data` starts a block that this handler or one below it served.
        match unsafe { shared.kind_of(data) } {
            Some(BlockKind::Arena | BlockKind::External | BlockKind::Huge) => return Some(shared.id),
            Some(_) => return None,
            None => h = below,
        }
    }
    None
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
    crate::once::get_or_try_make(&DEFAULT, py, || -> PyResult<Py<PyAny>> {
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
