//! The per-context scope stack: which workspace is innermost, which NumPy handler to restore.
//!
//! The stack lives in one Python `ContextVar` (so threads and asyncio tasks each see their own),
//! as a linked list of immutable tuples `(owner, previous_handler, parent, key)`: `owner` is a
//! workspace or None (`scope_out_of_workspaces`), `previous_handler` is the NumPy handler to
//! restore at exit or None when the scope did not change it, `key` identifies the scope (the
//! workspace for a cycle, the [`Scope`] object for `borrow()` and `scope_out_of_workspaces()`).
//! Pushing and popping the innermost scope are O(1).
//!
//! Scopes may exit out of order, as TorchSharp's dispose scopes do: the scope that exits is
//! unlinked wherever it is in the stack (the nodes above it are rebuilt, their handlers fixed),
//! and the caller warns with a `ResourceWarning`. So a finaliser (a generator closed while another
//! scope is innermost) can never leave a workspace open. Each push and pop runs with the cyclic
//! garbage collector paused: no finaliser can change the stack between reading and writing it.
//!
//! `PyContextVar_Get` / `PyContextVar_Set` are public C API since CPython 3.7 and exported by
//! every CPython build, but not part of the limited API's headers; they are declared here so an
//! abi3 build can call them without a Python-level method call per cycle.

use pyo3::exceptions::PyResourceWarning;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyTuple;

use crate::handler;

const OWNER: usize = 0;
const PREVIOUS_HANDLER: usize = 1;
const PARENT: usize = 2;
const KEY: usize = 3;

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

/// The cyclic garbage collector paused while it lives: a collection can run finalisers (a
/// generator closed inside a `with`), and those must not change the stack between our read and
/// our write.
struct GcPaused(bool);

impl GcPaused {
    fn new(_py: Python<'_>) -> Self {
        // SAFETY: the GIL is held (witnessed by `_py`); the call only clears a flag and returns
        // whether it was set.
        GcPaused(unsafe { pyo3::ffi::PyGC_Disable() } != 0)
    }
}

impl Drop for GcPaused {
    fn drop(&mut self) {
        if self.0 {
            // SAFETY: made by `new` with the GIL held, which is still held (the guard is never
            // sent across a release of the GIL).
            unsafe { pyo3::ffi::PyGC_Enable() };
        }
    }
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

/// Pushes a scope for `owner` (a workspace, or None) identified by `key`.
pub fn push(
    py: Python<'_>,
    owner: &Bound<'_, PyAny>,
    key: &Bound<'_, PyAny>,
    install: Install<'_, '_>,
) -> PyResult<()> {
    let _gc = GcPaused::new(py);
    let var = scope_var(py)?;
    let parent = get_top(py, var)?;
    let previous = match install {
        Install::Keep => py.None().into_bound(py),
        Install::Default => handler::set_handler(py, None)?,
        Install::Handler(h) => handler::set_handler(py, Some(h))?,
    };
    let pushed = PyTuple::new(py, [owner.clone(), previous.clone(), parent, key.clone()])
        .and_then(|n| set_top(py, var, n.as_any()));
    if pushed.is_err() && !previous.is_none() {
        // No scope records the handler it replaced: put it back before reporting the error.
        let _ = handler::set_handler(py, Some(&previous));
    }
    pushed
}

/// How a scope left the stack.
pub enum Popped {
    /// It was the innermost.
    Innermost,
    /// It was unlinked from under the scope described here (the innermost one).
    Unlinked(String),
}

/// Pops the scope `key` (of `owner`, for messages) and restores the handler it replaced. The
/// innermost scope is popped in O(1); another one is unlinked from wherever it is, and the
/// handler the scopes above it restore is fixed up. `ScopeError` when the scope is not in this
/// context's stack: `elsewhere` tells, for the message only, whether it was entered on another
/// thread.
pub fn pop(
    py: Python<'_>,
    owner: &Bound<'_, PyAny>,
    key: &Bound<'_, PyAny>,
    elsewhere: impl FnOnce() -> bool,
) -> PyResult<Popped> {
    let _gc = GcPaused::new(py);
    let var = scope_var(py)?;
    let top = get_top(py, var)?;
    if !top.is_none() {
        let node = top.cast::<PyTuple>()?;
        if node.get_item(KEY)?.is(key) {
            set_top(py, var, &node.get_item(PARENT)?)?;
            let previous = node.get_item(PREVIOUS_HANDLER)?;
            if !previous.is_none() {
                handler::set_handler(py, Some(&previous))?;
            }
            return Ok(Popped::Innermost);
        }
    }
    // Out of order: find the scope, rebuild the nodes above it on its parent.
    let mut above: Vec<Bound<'_, PyTuple>> = Vec::new();
    let mut cursor = top.clone();
    let found = loop {
        if cursor.is_none() {
            let what = describe(owner);
            let msg = if elsewhere() {
                format!("{what} exited from another thread than the one that entered it")
            } else {
                format!("{what} is not open in this thread or task (exited twice?)")
            };
            return Err(crate::py_error(py, "ScopeError", msg));
        }
        let node = cursor.cast_into::<PyTuple>()?;
        if node.get_item(KEY)?.is(key) {
            break node;
        }
        cursor = node.get_item(PARENT)?;
        above.push(node);
    };
    let replaced = found.get_item(PREVIOUS_HANDLER)?;
    // Whether the handler `found` installed is still to be undone: by the lowest scope above it
    // that installs one (it now restores what `found` replaced), or here, when none does.
    let mut undo = !replaced.is_none();
    let mut rebuilt = found.get_item(PARENT)?;
    for node in above.iter().rev() {
        let mut previous = node.get_item(PREVIOUS_HANDLER)?;
        if undo && !previous.is_none() {
            previous = replaced.clone();
            undo = false;
        }
        let copy = PyTuple::new(py, [node.get_item(OWNER)?, previous, rebuilt, node.get_item(KEY)?])?;
        rebuilt = copy.into_any();
    }
    set_top(py, var, &rebuilt)?;
    if undo {
        handler::set_handler(py, Some(&replaced))?;
    }
    let innermost = above.first().map_or_else(|| "none".to_string(), |n| describe_node(n));
    Ok(Popped::Unlinked(innermost))
}

fn describe_node(node: &Bound<'_, PyTuple>) -> String {
    node.get_item(OWNER).map_or_else(|_| "a scope".to_string(), |o| describe(&o))
}

pub fn describe(owner: &Bound<'_, PyAny>) -> String {
    if owner.is_none() {
        return "scope_out_of_workspaces()".to_string();
    }
    match owner.getattr("name").and_then(|n| n.extract::<String>()) {
        Ok(name) => format!("workspace {name:?}").replace('"', "'"),
        Err(_) => "a workspace".to_string(),
    }
}

/// Warns (`ResourceWarning`) that `what` exited while `innermost` was the innermost scope.
pub fn warn_unlinked(py: Python<'_>, what: &str, innermost: &str) -> PyResult<()> {
    let msg = std::ffi::CString::new(format!(
        "{what} exited while {innermost} was the innermost scope; its scope was unlinked \
         (scopes should exit in the reverse order of entering)"
    ))
    .unwrap_or_default();
    PyErr::warn(py, &py.get_type::<PyResourceWarning>(), &msg, 1)
}

/// The workspace of the innermost scope, or None.
pub fn current(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let top = get_top(py, scope_var(py)?)?;
    if top.is_none() {
        return Ok(top);
    }
    top.cast::<PyTuple>()?.get_item(OWNER)
}

/// A scope without a cycle: `Workspace.borrow()` (the workspace current, capturing when it
/// captures) and `scope_out_of_workspaces()` (no workspace current, NumPy's default allocator).
/// Entering pushes and exiting pops in one step each, so no exception (a signal handler's
/// `KeyboardInterrupt`) can leave it half done.
#[pyclass(frozen, module = "rustws._rustws")]
pub struct Scope {
    owner: Py<PyAny>,
    install: bool,
    handler: Option<Py<PyAny>>,
}

#[pymethods]
impl Scope {
    /// `owner`: a workspace or None; `install`: make `handler` (a capsule, or None for NumPy's
    /// default) current inside, else leave NumPy's handler alone.
    #[new]
    #[pyo3(signature = (owner, install, handler=None))]
    fn new(py: Python<'_>, owner: Py<PyAny>, install: bool, handler: Option<Py<PyAny>>) -> PyResult<Self> {
        if let Some(h) = &handler {
            if !h.bind(py).is_instance_of::<pyo3::types::PyCapsule>() {
                return Err(pyo3::exceptions::PyTypeError::new_err("handler must be a mem_handler capsule or None"));
            }
        }
        Ok(Scope { owner, install, handler })
    }

    fn __enter__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let me = slf.get();
        let owner = me.owner.bind(py);
        let handler = me.handler.as_ref().map(|h| h.bind(py));
        let how = match (me.install, handler) {
            (false, _) => Install::Keep,
            (true, None) => Install::Default,
            (true, Some(h)) => Install::Handler(h),
        };
        push(py, owner, slf.as_any(), how)?;
        if let Ok(ws) = owner.cast::<crate::WorkspaceCore>() {
            ws.get().note_entered();
        }
        Ok(owner.clone())
    }

    #[pyo3(signature = (_exc_type=None, _exc=None, _tb=None))]
    fn __exit__(
        slf: &Bound<'_, Self>,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let py = slf.py();
        let owner = slf.get().owner.bind(py);
        if let Popped::Unlinked(innermost) = pop(py, owner, slf.as_any(), || false)? {
            let what = if owner.is_none() { describe(owner) } else { format!("borrow() of {}", describe(owner)) };
            warn_unlinked(py, &what, &innermost)?;
        }
        Ok(false)
    }
}
