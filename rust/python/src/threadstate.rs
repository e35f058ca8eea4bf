//! What the calling thread runs, read without calling into Python (the memory handler must not):
//! whether it holds the GIL, and which `contextvars.Context` it runs in, so that a scope captures
//! in the context that opened it and not in a copy of it (a child asyncio task, a callback
//! scheduled with `call_soon`, `copy_context().run`, a pool's task on another thread).
//!
//! The current context is a field of CPython's thread state, outside the limited API. Its offset
//! is known for each supported version and checked once, when the extension is imported, by
//! running a probe inside two fresh contexts: only an offset where both are found is used. Where
//! the check fails (an interpreter this build does not know), scopes fall back to capturing on
//! their thread, whatever its context.

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyCFunction;

type Getter = unsafe extern "C" fn() -> *mut ffi::PyThreadState;

extern "C" {
    /// Public C API of every CPython (stable ABI): this thread's own thread state, attached or
    /// not (NULL for a thread Python never saw).
    fn PyGILState_GetThisThreadState() -> *mut ffi::PyThreadState;
}

/// CPython's unchecked getter of the attached thread state (`PyThreadState_GetUnchecked` from
/// 3.13, `_PyThreadState_UncheckedGet` before), found at run time.
fn unchecked_getter() -> Option<Getter> {
    static GETTER: OnceLock<Option<Getter>> = OnceLock::new();
    *GETTER.get_or_init(|| {
        for name in [c"PyThreadState_GetUnchecked", c"_PyThreadState_UncheckedGet"] {
            // SAFETY: a symbol lookup in the process's global scope, with a C string name.
            let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
            if !f.is_null() {
                // SAFETY: both symbols are `PyThreadState *(void)` in every CPython that has them.
                return Some(unsafe { std::mem::transmute::<*mut c_void, Getter>(f) });
            }
        }
        None
    })
}

/// Whether the calling thread has an attached Python thread state (holds the GIL). False when
/// the getter is not found.
pub(crate) fn attached() -> bool {
    // SAFETY: the getter only reads this thread's current thread state.
    unchecked_getter().is_some_and(|g| !unsafe { g() }.is_null())
}

/// Whether the calling thread certainly holds the GIL: the attached thread state is this
/// thread's own (the getter alone says whether any thread holds it on 3.11). False when the
/// getter is not found.
pub(crate) fn holds_gil() -> bool {
    unchecked_getter().is_some_and(|g| {
        // SAFETY: both calls only read thread-state slots, with or without the GIL.
        let (attached, own) = unsafe { (g(), PyGILState_GetThisThreadState()) };
        !attached.is_null() && attached == own
    })
}

/// The offset of the current context in a thread state, once checked (0: unknown).
static CONTEXT_OFFSET: AtomicUsize = AtomicUsize::new(0);

/// The context the calling thread runs in (its address), or 0 where it cannot be told: a thread
/// Python never saw, a thread that never entered a context, an unknown interpreter.
#[inline]
pub(crate) fn current_context() -> usize {
    let off = CONTEXT_OFFSET.load(Ordering::Relaxed);
    if off == 0 {
        return 0;
    }
    // SAFETY: a plain query of this thread's own thread state.
    let ts = unsafe { PyGILState_GetThisThreadState() };
    if ts.is_null() {
        return 0;
    }
    // SAFETY: `off` was checked to be the context field of a thread state of this interpreter;
    // only this thread writes its own thread state's context.
    unsafe { ts.cast::<u8>().add(off).cast::<usize>().read_volatile() }
}

/// Where each supported version keeps the current context in its thread state.
fn known_offset(py: Python<'_>) -> Option<usize> {
    let v = py.version_info();
    match (v.major, v.minor) {
        (3, 11) => Some(224),
        (3, 12) | (3, 13) => Some(208),
        _ => None,
    }
}

/// Checks the offset of the current context for this interpreter (see the module docs); called
/// when the extension is imported.
pub(crate) fn init(py: Python<'_>) -> PyResult<()> {
    let Some(off) = known_offset(py) else { return Ok(()) };
    let contextvars = py.import("contextvars")?;
    let seen = std::sync::Arc::new(AtomicUsize::new(0));
    let probe = {
        let seen = seen.clone();
        PyCFunction::new_closure(py, None, None, move |_args, _kwargs| -> PyResult<()> {
            // SAFETY: this thread's own thread state, attached (the probe runs with the GIL);
            // `off` lies inside every thread state of the versions `known_offset` names.
            let value = unsafe {
                let ts = PyGILState_GetThisThreadState();
                if ts.is_null() {
                    0
                } else {
                    ts.cast::<u8>().add(off).cast::<usize>().read()
                }
            };
            seen.store(value, Ordering::Relaxed);
            Ok(())
        })?
    };
    for _ in 0..2 {
        let ctx = contextvars.getattr("Context")?.call0()?;
        ctx.call_method1("run", (&probe,))?;
        if seen.load(Ordering::Relaxed) != ctx.as_ptr() as usize {
            return Ok(());
        }
    }
    CONTEXT_OFFSET.store(off, Ordering::Relaxed);
    Ok(())
}

/// Whether scopes can tell their context from a copy of it here.
pub(crate) fn knows_contexts() -> bool {
    CONTEXT_OFFSET.load(Ordering::Relaxed) != 0
}
