//! NumPy's data-memory handler (NEP 49) over a workspace.
//!
//! Each workspace owns one `mem_handler` capsule. Its `ctx` is a strong reference to the
//! workspace's [`Shared`] state, released by the capsule's destructor; NumPy keeps a reference to
//! the capsule in every array it allocates through it, so a workspace's memory stays mapped until
//! the last such array is gone, whatever thread frees it and whether or not the workspace was
//! destroyed. The handler's functions never call into Python and never unwind: a refusal is
//! recorded (for the Python layer to report) and NumPy gets NULL.

use std::cell::RefCell;
use std::ffi::{c_char, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::{null_mut, NonNull};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::exceptions::PyRuntimeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use rustws_core::{Error, Workspace};

/// The capsule name NumPy requires.
pub const CAPSULE_NAME: &CStr = c"mem_handler";

/// `PyDataMemAllocator` from NumPy's `ndarraytypes.h`.
#[repr(C)]
struct PyDataMemAllocator {
    ctx: *mut c_void,
    malloc: unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void,
    calloc: unsafe extern "C" fn(*mut c_void, usize, usize) -> *mut c_void,
    realloc: unsafe extern "C" fn(*mut c_void, *mut c_void, usize) -> *mut c_void,
    free: unsafe extern "C" fn(*mut c_void, *mut c_void, usize),
}

/// `PyDataMem_Handler` from NumPy's `ndarraytypes.h` (version 1).
#[repr(C)]
struct PyDataMemHandler {
    name: [c_char; 127],
    version: u8,
    allocator: PyDataMemAllocator,
}

/// A workspace as the bindings share it: the core behind one lock, plus what the handler
/// records for the Python layer.
#[derive(Debug)]
pub struct Shared {
    pub id: u64,
    pub name: rustws_core::error::Name,
    /// Mirrors the core's destroyed flag, readable without the lock.
    pub destroyed: AtomicBool,
    workspace: Mutex<Workspace>,
    /// Messages of requests refused while capturing, drained and logged by the Python layer.
    failures: Mutex<Vec<String>>,
    /// Whether `failures` holds anything: read at every cycle exit without the lock.
    pub has_failures: AtomicBool,
    /// The thread that last opened a scope of this workspace, to name a cross-thread exit.
    pub entered_on: std::sync::atomic::AtomicU64,
    /// Whether the CPU can touch the workspace's memory: NumPy may allocate from it only then.
    pub host_accessible: bool,
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
    pub fn new(id: u64, workspace: Workspace) -> Self {
        let host_accessible = workspace.backend().host_accessible();
        Shared {
            id,
            name: workspace.name().into(),
            destroyed: AtomicBool::new(false),
            workspace: Mutex::new(workspace),
            failures: Mutex::new(Vec::new()),
            has_failures: AtomicBool::new(false),
            entered_on: std::sync::atomic::AtomicU64::new(0),
            host_accessible,
        }
    }

    /// The workspace; a panic while it was held leaves it usable (its counters are updated
    /// only after the operations they count succeed).
    pub fn lock(&self) -> MutexGuard<'_, Workspace> {
        self.workspace.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn drain_failures(&self) -> Vec<String> {
        self.has_failures.store(false, Ordering::Relaxed);
        std::mem::take(&mut *self.failures.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn refuse(&self, e: Error) -> *mut c_void {
        {
            let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
            // Kept for the next cycle exit to log; a workspace used without cycles must not
            // accumulate them forever.
            if failures.len() < MAX_KEPT_FAILURES {
                failures.push(e.to_string());
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
        let mut ws = self.lock();
        let r = if ws.is_destroyed() {
            // Captured code still running after `destroy()` gets ordinary memory.
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
        let Some(p) = NonNull::new(ptr.cast::<u8>()) else {
            return s.alloc(new_size, false);
        };
        let mut ws = s.lock();
        // SAFETY: NumPy reallocates only data it allocated through this handler and still owns.
        let r = unsafe { ws.realloc(p, new_size) };
        drop(ws);
        match r {
            Ok(q) => q.as_ptr().cast(),
            Err(e) => s.refuse(e),
        }
    })
}

unsafe extern "C" fn ws_free(ctx: *mut c_void, ptr: *mut c_void, _size: usize) {
    guarded((), || {
        let Some(p) = NonNull::new(ptr.cast::<u8>()) else { return };
        // SAFETY: NumPy passes back the ctx we registered.
        let s = unsafe { shared(ctx) };
        // SAFETY: NumPy frees only data it allocated through this handler, once.
        unsafe { s.lock().free(p) };
    })
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
    let mut name = [0 as c_char; 127];
    let text = format!("rustws:{}:{}", shared.id, shared.name);
    for (dst, src) in name.iter_mut().zip(text.bytes().filter(|b| *b != 0).take(126)) {
        *dst = src as c_char;
    }
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
