//! The per-context scope stack: which workspace is innermost, which NumPy handler to restore.
//!
//! The stack lives in one Python `ContextVar` (so threads and asyncio tasks each see their own),
//! as a linked list of tuples `(owner, previous_handler, parent)`: `owner` is a workspace or None
//! (`scope_out_of_workspaces`), `previous_handler` is the NumPy handler to restore at exit or None
//! when the scope did not change it. Pushing and popping are O(1).
//!
//! `PyContextVar_Get` / `PyContextVar_Set` are public C API since CPython 3.7 and exported by
//! every CPython build, but not part of the limited API's headers; they are declared here so an
//! abi3 build can call them without a Python-level method call per cycle.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyTuple;

use crate::handler;

const OWNER: usize = 0;
const PREVIOUS_HANDLER: usize = 1;
const PARENT: usize = 2;

extern "C" {
    fn PyContextVar_Get(
        var: *mut pyo3::ffi::PyObject,
        default_value: *mut pyo3::ffi::PyObject,
        value: *mut *mut pyo3::ffi::PyObject,
    ) -> std::ffi::c_int;
    fn PyContextVar_Set(var: *mut pyo3::ffi::PyObject, value: *mut pyo3::ffi::PyObject) -> *mut pyo3::ffi::PyObject;
}

/// The innermost node (None when the stack is empty).
fn get_top<'py>(py: Python<'py>, var: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let mut out: *mut pyo3::ffi::PyObject = std::ptr::null_mut();
    // SAFETY: `var` is a ContextVar (made by `scope_var`); on success `out` is a new reference
    // (its default, None, when unset); on failure an exception is set.
    let rc = unsafe { PyContextVar_Get(var.as_ptr(), std::ptr::null_mut(), &mut out) };
    if rc != 0 || out.is_null() {
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new reference we own.
    Ok(unsafe { Bound::from_owned_ptr(py, out) })
}

fn set_top(py: Python<'_>, var: &Bound<'_, PyAny>, node: &Bound<'_, PyAny>) -> PyResult<()> {
    // SAFETY: `var` is a ContextVar and `node` a live object; the result is a new reference to
    // a Token (dropped at once) or NULL with an exception set.
    let token = unsafe { PyContextVar_Set(var.as_ptr(), node.as_ptr()) };
    // SAFETY: as above.
    unsafe { Bound::from_owned_ptr_or_err(py, token) }.map(drop)
}

/// The `ContextVar` holding the innermost scope node (None when empty).
pub fn scope_var(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    static VAR: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    VAR.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
        let cv = py.import("contextvars")?.getattr("ContextVar")?;
        let kwargs = pyo3::types::PyDict::new(py);
        kwargs.set_item("default", py.None())?;
        Ok(cv.call(("rustws_scopes",), Some(&kwargs))?.unbind())
    })
    .map(|v| v.bind(py))
}

/// What a new scope does to NumPy's current handler.
pub enum Install<'a, 'py> {
    /// Leave it.
    Keep,
    /// NumPy's default allocator.
    Default,
    /// This `mem_handler` capsule.
    Handler(&'a Bound<'py, PyAny>),
}

pub fn thread_ident() -> u64 {
    // SAFETY: a plain query, callable with or without the GIL.
    unsafe { pyo3::ffi::PyThread_get_thread_ident() as u64 }
}

/// Pushes a scope for `owner` (a workspace, or None).
pub fn push(py: Python<'_>, owner: &Bound<'_, PyAny>, install: Install<'_, '_>) -> PyResult<()> {
    let var = scope_var(py)?;
    let parent = get_top(py, var)?;
    let previous = match install {
        Install::Keep => py.None().into_bound(py),
        Install::Default => handler::set_handler(py, None)?,
        Install::Handler(h) => handler::set_handler(py, Some(h))?,
    };
    let pushed = PyTuple::new(py, [owner.clone(), previous.clone(), parent]).and_then(|n| set_top(py, var, n.as_any()));
    if pushed.is_err() && !previous.is_none() {
        // No scope records the handler it replaced: put it back before reporting the error.
        let _ = handler::set_handler(py, Some(&previous));
    }
    pushed
}

/// Pops the innermost scope, which must belong to `owner`; restores the handler it replaced.
/// `elsewhere` tells, for the error message only, whether `owner` was entered on another thread.
pub fn pop(py: Python<'_>, owner: &Bound<'_, PyAny>, elsewhere: impl FnOnce() -> bool) -> PyResult<()> {
    let var = scope_var(py)?;
    let top = get_top(py, var)?;
    let innermost = if top.is_none() { None } else { Some(top.cast::<PyTuple>()?.get_item(OWNER)?) };
    if !innermost.as_ref().is_some_and(|o| o.is(owner)) {
        let what = describe(owner);
        let msg = if elsewhere() {
            format!("{what} exited from another thread than the one that entered it")
        } else {
            let inner = innermost.map_or_else(|| "none".to_string(), |o| describe(&o));
            format!("{what} is not the innermost scope (the innermost is {inner})")
        };
        return Err(crate::py_error(py, "ScopeError", msg));
    }
    let top = top.cast::<PyTuple>()?;
    set_top(py, var, &top.get_item(PARENT)?)?;
    let previous = top.get_item(PREVIOUS_HANDLER)?;
    if !previous.is_none() {
        handler::set_handler(py, Some(&previous))?;
    }
    Ok(())
}

fn describe(owner: &Bound<'_, PyAny>) -> String {
    if owner.is_none() {
        return "scope_out_of_workspaces()".to_string();
    }
    match owner.getattr("name").and_then(|n| n.extract::<String>()) {
        Ok(name) => format!("workspace {name:?}").replace('"', "'"),
        Err(_) => "a workspace".to_string(),
    }
}

/// The workspace of the innermost scope, or None.
pub fn current(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let top = get_top(py, scope_var(py)?)?;
    if top.is_none() {
        return Ok(top);
    }
    top.cast::<PyTuple>()?.get_item(OWNER)
}
