//! The per-context scope stack: which workspace is innermost, which NumPy handler to restore.
//!
//! The stack lives in NumPy's own current-handler `ContextVar` (so threads and asyncio tasks each
//! see their own, exactly as they see their own handler): each scope is a *node*, a
//! `mem_handler` capsule that serves NumPy like the handler in force inside the scope (its
//! pointer is that handler's `PyDataMemHandler`) and whose context is a [`NodeData`]: `owner` is
//! a workspace or None (`scope_out_of_workspaces`), `key` identifies the scope (the workspace for
//! a cycle, the [`Scope`] object for `borrow()` and `scope_out_of_workspaces()`), `below` is the
//! value the variable held before (the parent node, or the handler to restore), `served` the
//! capsule whose handler the node lends (kept alive by it), `installs` whether the scope chose it
//! (else it serves whatever is below). Nodes never change once made. Entering and leaving a scope
//! is one variable write each; arrays NumPy allocates inside keep a reference to the node, as they
//! do to any handler.
//!
//! Scopes may exit out of order, as TorchSharp's dispose scopes do: the scope that exits is
//! unlinked wherever it is in the stack (the nodes above it are rebuilt over what was below it),
//! and the caller warns with a `ResourceWarning`. So a finaliser (a generator closed while another
//! scope is innermost) can never leave a workspace open. Each push and pop runs with the cyclic
//! garbage collector paused: no finaliser can change the stack between reading and writing it.

use std::ffi::c_void;

use pyo3::exceptions::PyResourceWarning;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use crate::handler;

/// What a node records: strong references, released by `node_destructor`.
struct NodeData {
    /// The workspace, or None.
    owner: *mut ffi::PyObject,
    /// What identifies the scope.
    key: *mut ffi::PyObject,
    /// The variable's value before the push: the parent node, or the handler to restore.
    below: *mut ffi::PyObject,
    /// The capsule whose handler the node lends.
    served: *mut ffi::PyObject,
    /// Whether the scope chose the handler (else it lends whatever is below it).
    installs: bool,
}

unsafe extern "C" fn node_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python (GIL held) with a node capsule; its context is the `NodeData` box
    // `new_node` stored, released once here with the references it holds.
    unsafe {
        let ctx = ffi::PyCapsule_GetContext(capsule);
        if ctx.is_null() {
            ffi::PyErr_Clear();
            return;
        }
        let data = Box::from_raw(ctx.cast::<NodeData>());
        for obj in [data.owner, data.key, data.below, data.served] {
            ffi::Py_DECREF(obj);
        }
    }
}

/// A node as read from the stack, borrowing its references from the (live) capsule.
struct Node<'a, 'py> {
    data: &'a NodeData,
    py: Python<'py>,
}

impl<'py> Node<'_, 'py> {
    fn get(&self, obj: *mut ffi::PyObject) -> Bound<'py, PyAny> {
        // SAFETY: the node holds a strong reference to each of its objects while it lives, and the
        // caller holds the node.
        unsafe { Bound::from_borrowed_ptr(self.py, obj) }
    }
    fn owner(&self) -> Bound<'py, PyAny> {
        self.get(self.data.owner)
    }
    fn key_is(&self, key: &Bound<'_, PyAny>) -> bool {
        self.data.key == key.as_ptr()
    }
    fn key(&self) -> Bound<'py, PyAny> {
        self.get(self.data.key)
    }
    fn below(&self) -> Bound<'py, PyAny> {
        self.get(self.data.below)
    }
    fn served(&self) -> Bound<'py, PyAny> {
        self.get(self.data.served)
    }
}

/// `obj` as one of our nodes, if it is one.
fn as_node<'a, 'py>(obj: &'a Bound<'py, PyAny>) -> Option<Node<'a, 'py>> {
    // SAFETY: a live object; the checks read its type and capsule fields only.
    unsafe {
        if ffi::PyCapsule_CheckExact(obj.as_ptr()) == 0 {
            return None;
        }
        let d = ffi::PyCapsule_GetDestructor(obj.as_ptr());
        if d.map(|f| f as *const () as usize) != Some(node_destructor as *const () as usize) {
            ffi::PyErr_Clear();
            return None;
        }
        let ctx = ffi::PyCapsule_GetContext(obj.as_ptr());
        if ctx.is_null() {
            ffi::PyErr_Clear();
            return None;
        }
        // SAFETY: nodes hold their data for as long as they live, and `obj` (borrowed for 'a) is
        // alive.
        Some(Node { data: &*ctx.cast::<NodeData>(), py: obj.py() })
    }
}

/// A node for `owner` / `key` over `below`, lending `served`'s handler.
fn new_node<'py>(
    py: Python<'py>,
    owner: &Bound<'py, PyAny>,
    key: &Bound<'py, PyAny>,
    below: &Bound<'py, PyAny>,
    served: &Bound<'py, PyAny>,
    installs: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let lent = handler::lent_handler(served);
    if lent.is_null() {
        return Err(pyo3::exceptions::PyTypeError::new_err("a scope's handler must be a mem_handler capsule"));
    }
    // SAFETY: `lent` is the `PyDataMemHandler` of `served`, which the node keeps alive through its
    // data; the name is a static C string as the capsule API requires.
    let cap = unsafe { ffi::PyCapsule_New(lent, handler::CAPSULE_NAME.as_ptr(), Some(node_destructor)) };
    if cap.is_null() {
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new reference we own; its destructor finds no context yet and returns.
    let cap = unsafe { Bound::from_owned_ptr(py, cap) };
    let data = Box::into_raw(Box::new(NodeData {
        owner: owner.clone().into_ptr(),
        key: key.clone().into_ptr(),
        below: below.clone().into_ptr(),
        served: served.clone().into_ptr(),
        installs,
    }));
    // SAFETY: `cap` is our fresh capsule; the context takes ownership of the box, which
    // `node_destructor` releases. Setting a capsule's context cannot fail for a valid capsule.
    unsafe { ffi::PyCapsule_SetContext(cap.as_ptr(), data.cast::<c_void>()) };
    Ok(cap)
}

/// NumPy's current-handler `ContextVar` (`current_allocator`), found once, so a scope reads and
/// writes it directly: one variable write per push and per pop. None when it cannot be found
/// (then NumPy's `PyDataMem_GetHandler` / `PyDataMem_SetHandler` serve).
fn numpy_var(py: Python<'_>) -> Option<&Bound<'_, PyAny>> {
    static VAR: PyOnceLock<Option<Py<PyAny>>> = PyOnceLock::new();
    VAR.get_or_init(py, || {
        let find = || -> PyResult<Option<Py<PyAny>>> {
            // Set it in this context (to its own value) so that the context lists it.
            let current = handler::get_handler(py)?;
            handler::set_handler(py, Some(&current))?;
            let ctx = py.import("contextvars")?.call_method0("copy_context")?;
            for var in ctx.call_method0("keys")?.try_iter()? {
                let var = var?;
                let named =
                    var.getattr("name").and_then(|n| n.extract::<String>()).is_ok_and(|n| n == "current_allocator");
                if named && var.call_method0("get")?.is(&current) {
                    return Ok(Some(var.unbind()));
                }
            }
            Ok(None)
        };
        find().ok().flatten()
    })
    .as_ref()
    .map(|v| v.bind(py))
}

/// NumPy's current handler (a new reference).
fn current_handler(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let Some(var) = numpy_var(py) else { return handler::get_handler(py) };
    let mut out: *mut ffi::PyObject = std::ptr::null_mut();
    // SAFETY: `var` is a ContextVar with a default (NumPy's default handler); on success `out` is
    // a new reference; on failure an exception is set.
    let rc = unsafe { PyContextVar_Get(var.as_ptr(), std::ptr::null_mut(), &mut out) };
    if rc != 0 || out.is_null() {
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new reference we own.
    Ok(unsafe { Bound::from_owned_ptr(py, out) })
}

/// Makes `value` (a `mem_handler` capsule) NumPy's current handler.
fn install(py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<()> {
    let Some(var) = numpy_var(py) else { return handler::set_handler(py, Some(value)).map(drop) };
    // SAFETY: `var` is a ContextVar and `value` a live object; the result is a new reference to a
    // Token (dropped at once) or NULL with an exception set.
    let token = unsafe { PyContextVar_Set(var.as_ptr(), value.as_ptr()) };
    // SAFETY: as above.
    unsafe { Bound::from_owned_ptr_or_err(py, token) }.map(drop)
}

extern "C" {
    // Public C API since CPython 3.7, exported by every CPython build, but outside the limited
    // API's headers.
    fn PyContextVar_Get(
        var: *mut ffi::PyObject,
        default_value: *mut ffi::PyObject,
        value: *mut *mut ffi::PyObject,
    ) -> std::ffi::c_int;
    fn PyContextVar_Set(var: *mut ffi::PyObject, value: *mut ffi::PyObject) -> *mut ffi::PyObject;
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
pub fn push(py: Python<'_>, owner: &Bound<'_, PyAny>, key: &Bound<'_, PyAny>, how: Install<'_, '_>) -> PyResult<()> {
    let _gc = GcPaused::new(py);
    let below = current_handler(py)?;
    let node = match how {
        Install::Keep => new_node(py, owner, key, &below, &below, false)?,
        Install::Default => new_node(py, owner, key, &below, handler::default_handler(py)?, true)?,
        Install::Handler(h) => new_node(py, owner, key, &below, h, true)?,
    };
    install(py, &node)
}

/// How a scope left the stack.
pub enum Popped {
    /// It was the innermost.
    Innermost,
    /// It was unlinked from under the scope described here (the innermost one).
    Unlinked(String),
}

/// Pops the scope `key` (of `owner`, for messages) and restores what was below it. The innermost
/// scope is popped in O(1); another one is unlinked from wherever it is, the nodes above it
/// rebuilt over what was below it (a node that lent the handler below it now lends the new one).
/// `ScopeError` when the scope is not in this context's stack: `elsewhere` tells, for the message
/// only, whether it was entered on another thread.
pub fn pop(
    py: Python<'_>,
    owner: &Bound<'_, PyAny>,
    key: &Bound<'_, PyAny>,
    elsewhere: impl FnOnce() -> bool,
) -> PyResult<Popped> {
    let _gc = GcPaused::new(py);
    let top = current_handler(py)?;
    if let Some(node) = as_node(&top) {
        if node.key_is(key) {
            install(py, &node.below())?;
            return Ok(Popped::Innermost);
        }
    }
    // Out of order: find the scope, rebuild the nodes above it over what was below it.
    let mut above: Vec<Bound<'_, PyAny>> = Vec::new();
    let mut cursor = top.clone();
    let below_found = loop {
        let Some(node) = as_node(&cursor) else {
            let what = describe(owner);
            let msg = if elsewhere() {
                format!("{what} exited from another thread than the one that entered it")
            } else {
                format!("{what} is not open in this thread or task (exited twice?)")
            };
            return Err(crate::py_error(py, "ScopeError", msg));
        };
        if node.key_is(key) {
            break node.below();
        }
        let next = node.below();
        above.push(cursor);
        cursor = next;
    };
    let mut rebuilt = below_found;
    for node in above.iter().rev().filter_map(as_node) {
        let served = if node.data.installs { node.served() } else { rebuilt.clone() };
        rebuilt = new_node(py, &node.owner(), &node.key(), &rebuilt, &served, node.data.installs)?;
    }
    install(py, &rebuilt)?;
    let innermost = above.first().and_then(as_node).map_or_else(|| "none".to_string(), |n| describe(&n.owner()));
    Ok(Popped::Unlinked(innermost))
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
    let top = current_handler(py)?;
    Ok(as_node(&top).map_or_else(|| py.None().into_bound(py), |n| n.owner()))
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
