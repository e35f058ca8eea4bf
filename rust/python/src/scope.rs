//! The per-context scope stack: which workspace is innermost, which NumPy handler to restore.
//!
//! The stack lives in NumPy's own current-handler `ContextVar` (so threads and asyncio tasks each
//! see their own, exactly as they see their own handler): each scope is a *node*, a `mem_handler`
//! capsule that serves NumPy inside the scope, and whose context is a [`NodeData`]: `owner` is a
//! workspace or None (`scope_out_of_workspaces`), `key` identifies the scope (the workspace for a
//! cycle, the [`Scope`] object for `borrow()` and `scope_out_of_workspaces()`), `below` is the
//! value the variable held before (the parent node, or the handler to restore), `served` the
//! capsule whose handler the node lends when it does not capture, and `state` the scope's
//! [`ScopeState`]: the thread that opened it and whether it is still open.
//!
//! A capturing node lends a handler of its own ([`handler::capture_handler`]), which serves a
//! request from the workspace only on the scope's thread while the scope is open. So a context
//! copied while the scope was open (a thread pool's task, `asyncio.to_thread`, `copy_context()`)
//! captures nothing on another thread, nor anywhere once the scope has closed; reading the stack
//! likewise skips the nodes of closed scopes and of other threads.
//!
//! A workspace's scope that exits as the innermost one closes at once (a capturing node's handler
//! hands every request to the handler below it from then on; a node that does not capture lends
//! that handler anyway) but its node stays in place: the next cycle of the same workspace in this
//! context reopens it in place, so a loop of `with ws:` blocks writes NumPy's context variable
//! once, not twice per cycle. The first request made through a closed capturing node outside any
//! cycle, or the next scope opened here, puts back what was below it ([`settle`]). `borrow()` and
//! `scope_out_of_workspaces()` restore what was below them when they exit.
//!
//! Scopes may exit out of order, as TorchSharp's dispose scopes do: the scope that exits is
//! unlinked wherever it is in the stack (the open nodes above it are rebuilt over what was below
//! it), and the caller warns with a `ResourceWarning`. A scope whose exit runs where its node is
//! not in the stack (a generator finalised on another thread, a task destroyed while pending) is
//! closed all the same through its state. Each push and pop runs with the cyclic garbage
//! collector paused: no finaliser can change the stack between reading and writing it.

use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use pyo3::exceptions::PyResourceWarning;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use crate::errors;
use crate::handler::{self, Capture, PyDataMemHandler};
use crate::shared::{thread_ident, ScopeState, Shared};

/// A capturing node's handler and what it serves through, inside the node's (boxed) data, so the
/// handler's `ctx` (the capture) stays put.
struct CaptureHandler {
    capture: Capture,
    handler: PyDataMemHandler,
}

/// What a node records: strong references, released by `node_destructor`.
struct NodeData {
    /// The workspace, or None.
    owner: *mut ffi::PyObject,
    /// What identifies the scope.
    key: *mut ffi::PyObject,
    /// The variable's value before the push: the parent node, or the handler to restore.
    below: *mut ffi::PyObject,
    /// The capsule whose handler the node lends when it does not capture.
    served: *mut ffi::PyObject,
    /// Whether the scope chose the handler (else it lends whatever is below it).
    installs: bool,
    state: Arc<ScopeState>,
    /// The node's own handler, when it captures.
    capture: Option<CaptureHandler>,
    /// The node's capsule (borrowed: the capsule owns this data).
    capsule: *mut ffi::PyObject,
}

/// # Safety
/// Called by Python once, with the GIL held, with a node capsule as it is freed.
unsafe extern "C" fn node_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python (GIL held) with a node capsule.
    let ctx = unsafe { ffi::PyCapsule_GetContext(capsule) };
    if ctx.is_null() {
        // SAFETY: as above; a destructor must not leave an exception behind.
        unsafe { ffi::PyErr_Clear() };
        return;
    }
    // Nothing may unwind into the interpreter: a panic leaks what was left.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: the context is the `NodeData` box `new_node` stored, released once here with
        // the references it holds.
        unsafe {
            let data = Box::from_raw(ctx.cast::<NodeData>());
            for obj in [data.owner, data.key, data.below, data.served] {
                ffi::Py_DECREF(obj);
            }
        }
    }));
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
    /// Open, on this thread: a scope of this stack's own.
    fn is_here(&self) -> bool {
        self.data.state.is_here()
    }
    fn shared(&self) -> Option<Arc<Shared>> {
        self.data.capture.as_ref().map(|c| c.capture.shared.clone())
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

/// How a node serves NumPy.
enum Lends<'a, 'py> {
    /// The handler of this capsule.
    Handler(&'a Bound<'py, PyAny>),
    /// A capture handler of its own over this workspace (`served` is the workspace's capsule).
    Capture(Arc<Shared>, &'a Bound<'py, PyAny>),
}

/// A node for `owner` / `key` with `state`, over `below`.
fn new_node<'py>(
    py: Python<'py>,
    owner: &Bound<'py, PyAny>,
    key: &Bound<'py, PyAny>,
    below: &Bound<'py, PyAny>,
    lends: Lends<'_, 'py>,
    installs: bool,
    state: Arc<ScopeState>,
) -> PyResult<Bound<'py, PyAny>> {
    let (served, capture) = match lends {
        Lends::Handler(h) => (h, None),
        Lends::Capture(shared, capsule) => {
            // What the workspace does not take goes to the handler below (kept alive by the
            // node's reference to `below`).
            let below_handler = handler::lent_handler(below).cast::<PyDataMemHandler>().cast_const();
            let handler = handler::capture_handler(std::ptr::null(), &shared);
            let capture = Capture::new(shared, state.clone(), settle_closed, below_handler);
            (capsule, Some(CaptureHandler { handler, capture }))
        }
    };
    let data = Box::into_raw(Box::new(NodeData {
        owner: owner.clone().into_ptr(),
        key: key.clone().into_ptr(),
        below: below.clone().into_ptr(),
        served: served.clone().into_ptr(),
        installs,
        state,
        capture,
        capsule: std::ptr::null_mut(),
    }));
    // SAFETY: `data` is the fresh box just made, owned here until the capsule takes it.
    let lent = unsafe {
        match (*data).capture.as_mut() {
            Some(c) => {
                // The handler's context is the capture beside it, in the same box.
                c.handler.allocator.ctx = (&c.capture as *const Capture).cast_mut().cast();
                c.capture.node = data.cast_const().cast();
                (&mut c.handler as *mut PyDataMemHandler).cast::<c_void>()
            }
            None => handler::lent_handler(served),
        }
    };
    let cap = if lent.is_null() {
        std::ptr::null_mut()
    } else {
        // SAFETY: `lent` is a `PyDataMemHandler` the node keeps alive (its own, in its data, or
        // `served`'s, which its data references); the name is a static C string as the capsule
        // API requires.
        unsafe { ffi::PyCapsule_New(lent, handler::CAPSULE_NAME.as_ptr(), Some(node_destructor)) }
    };
    if cap.is_null() {
        // SAFETY: the box was never handed to a capsule: released here, with its references.
        unsafe {
            let data = Box::from_raw(data);
            for obj in [data.owner, data.key, data.below, data.served] {
                ffi::Py_DECREF(obj);
            }
        }
        return Err(if lent.is_null() {
            pyo3::exceptions::PyTypeError::new_err("a scope's handler must be a mem_handler capsule")
        } else {
            PyErr::fetch(py)
        });
    }
    // SAFETY: a new reference we own; its destructor finds no context yet and returns.
    let cap = unsafe { Bound::from_owned_ptr(py, cap) };
    // SAFETY: `cap` is our fresh capsule; the context takes ownership of the box, which
    // `node_destructor` releases. Setting a capsule's context cannot fail for a valid capsule.
    unsafe {
        (*data).capsule = cap.as_ptr();
        ffi::PyCapsule_SetContext(cap.as_ptr(), data.cast::<c_void>());
    }
    Ok(cap)
}

/// NumPy's current-handler `ContextVar` (`current_allocator`), found once, so a scope reads and
/// writes it directly: one variable write per push and per pop. None when it cannot be found
/// (then NumPy's `PyDataMem_GetHandler` / `PyDataMem_SetHandler` serve).
#[inline]
fn numpy_var(py: Python<'_>) -> Option<&Bound<'_, PyAny>> {
    static VAR: PyOnceLock<Option<Py<PyAny>>> = PyOnceLock::new();
    crate::once::get_or_make(&VAR, py, || {
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
    /// Capture: the workspace behind this handler capsule serves the scope's thread while it is
    /// open.
    Capture(Arc<Shared>, &'a Bound<'py, PyAny>),
}

/// The asyncio task running on this thread (its address), or 0: no task runs, or asyncio was
/// never imported (then none can).
pub fn current_task(py: Python<'_>) -> usize {
    static FUNCTIONS: PyOnceLock<Option<(Py<PyAny>, Py<PyAny>)>> = PyOnceLock::new();
    // SAFETY: the GIL is held (`py`); the interpreter's module dict is borrowed, alive as long as
    // the interpreter.
    let modules = unsafe { ffi::PyImport_GetModuleDict() };
    if modules.is_null() {
        return 0;
    }
    // SAFETY: as above.
    let modules = unsafe { Bound::from_borrowed_ptr(py, modules) };
    let Ok(modules) = modules.cast::<pyo3::types::PyDict>() else { return 0 };
    let Ok(names) = crate::calls::names(py) else { return 0 };
    if !modules.contains(names.asyncio.bind(py)).unwrap_or(false) {
        return 0;
    }
    let functions = crate::once::get_or_make(&FUNCTIONS, py, || {
        let events = py.import("asyncio").ok()?;
        Some((events.getattr("_get_running_loop").ok()?.unbind(), events.getattr("current_task").ok()?.unbind()))
    });
    let Some((running_loop, current_task)) = functions else { return 0 };
    let Ok(event_loop) = running_loop.bind(py).call0() else { return 0 };
    if event_loop.is_none() {
        return 0;
    }
    match current_task.bind(py).call1((event_loop,)) {
        Ok(task) if !task.is_none() => task.as_ptr() as usize,
        _ => 0,
    }
}

/// Pushes a scope for `owner` (a workspace, or None) identified by `key`, with `state`.
pub fn push(
    py: Python<'_>,
    owner: &Bound<'_, PyAny>,
    key: &Bound<'_, PyAny>,
    how: Install<'_, '_>,
    state: Arc<ScopeState>,
) -> PyResult<()> {
    let _gc = GcPaused::new(py);
    let mut below = current_handler(py)?;
    // Closed scopes left on top (a loop left by `break` whose iterator died elsewhere) go: the
    // new scope restores what was below them.
    while let Some(node) = as_node(&below) {
        if node.data.state.open.load(Ordering::Relaxed) {
            break;
        }
        let next = node.below();
        below = next;
    }
    let node = match how {
        Install::Keep => new_node(py, owner, key, &below, Lends::Handler(&below), false, state.clone())?,
        Install::Default => {
            new_node(py, owner, key, &below, Lends::Handler(handler::default_handler(py)?), true, state.clone())?
        }
        Install::Capture(shared, capsule) => {
            new_node(py, owner, key, &below, Lends::Capture(shared, capsule), true, state.clone())?
        }
    };
    install(py, &node)?;
    state.mark_context();
    Ok(())
}

/// The handler that serves NumPy here as the open scopes chose it: NumPy's current one, past the
/// nodes of closed scopes left on top.
pub fn effective(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let mut top = current_handler(py)?;
    while let Some(node) = as_node(&top) {
        if node.data.state.open.load(Ordering::Relaxed) {
            break;
        }
        let next = node.below();
        top = next;
    }
    Ok(top)
}

/// Drops the nodes of closed scopes from the top of this context's stack (scopes closed from
/// elsewhere: a finaliser on another thread, a loop's iterator dropped elsewhere), so that NumPy's
/// current handler is again what the open scopes chose.
pub fn settle(py: Python<'_>) -> PyResult<()> {
    let _gc = GcPaused::new(py);
    let top = current_handler(py)?;
    let mut below = top.clone();
    while let Some(node) = as_node(&below) {
        if node.data.state.open.load(Ordering::Relaxed) {
            break;
        }
        let next = node.below();
        below = next;
    }
    if !below.is(&top) {
        install(py, &below)?;
    }
    Ok(())
}

/// Whether this context's stack holds the node of `state` (a loop's scope of the workspace `key`),
/// wherever it is, and how many levels of `key` nested in its cycle lie above it: the loop form
/// ends that cycle and reopens its scope in place when nothing took it out meanwhile (another
/// loop's scope may lie above it, when two loops over a workspace advance in turn). The nested
/// levels (a `with ws:` entered in the loop's cycle and still open, in a generator advanced beside
/// the loop) are orphaned here: the cycle they nested in ends under them, and their exits will
/// only unwind. The caller takes them off the workspace's nesting as the cycle ends.
pub fn in_stack(py: Python<'_>, key: &Bound<'_, PyAny>, state: &Arc<ScopeState>) -> PyResult<(bool, u32)> {
    let top = current_handler(py)?;
    // The common case: the loop's own scope is the innermost.
    if as_node(&top).is_some_and(|node| Arc::ptr_eq(&node.data.state, state)) {
        return Ok((true, 0));
    }
    let mut above: Vec<Bound<'_, PyAny>> = Vec::new();
    let mut cursor = top;
    while let Some(node) = as_node(&cursor) {
        if Arc::ptr_eq(&node.data.state, state) {
            return Ok((true, orphan_nested(key, above.iter().rev())));
        }
        let next = node.below();
        if node.is_here() {
            above.push(cursor);
        }
        cursor = next;
    }
    Ok((false, 0))
}

/// Marks orphaned the levels of the workspace `key` among `nodes` (from the one just above a scope
/// whose cycle ends, upwards) that nested in that cycle: up to the first scope of `key` opening a
/// cycle of its own, above which levels nest in that one. Returns how many it marked.
fn orphan_nested<'a, 'py: 'a>(key: &Bound<'_, PyAny>, nodes: impl Iterator<Item = &'a Bound<'py, PyAny>>) -> u32 {
    let mut orphans = 0;
    for node in nodes.filter_map(as_node) {
        if !(node.key_is(key) && node.is_here()) {
            continue;
        }
        if node.data.state.opened_cycle() {
            break;
        }
        if !node.data.state.is_orphaned() {
            node.data.state.orphan();
            orphans += 1;
        }
    }
    orphans
}

/// Reopens the innermost node when it is a closed scope of the workspace `key` opened on this
/// thread (the last `with ws:` of this workspace here) that captures when `captures`: its state,
/// open again, is returned, with `cycle` recorded; NumPy's handler is already the node's. None
/// otherwise.
pub fn reopen(
    py: Python<'_>,
    key: &Bound<'_, PyAny>,
    captures: bool,
    cycle: bool,
    task: usize,
) -> PyResult<Option<Arc<ScopeState>>> {
    let top = current_handler(py)?;
    let Some(node) = as_node(&top) else { return Ok(None) };
    let state = &node.data.state;
    if !node.key_is(key)
        || state.held
        || node.data.owner != key.as_ptr()
        || node.data.capture.is_some() != captures
        || state.thread != thread_ident()
        || state.task != task
        || state.open.load(Ordering::Relaxed)
    {
        return Ok(None);
    }
    state.reopen(cycle);
    Ok(Some(state.clone()))
}

/// Called by a closed capturing node's handler on the thread that opened it, with the GIL held:
/// when that node is still NumPy's current handler in this context, what was below it goes back
/// (a request outside any cycle after a `with ws:` block), so later requests no longer pass
/// through it.
pub(crate) fn settle_closed(py: Python<'_>, node: *const c_void) {
    let Ok(top) = current_handler(py) else {
        // SAFETY: the GIL is held; the failed read set an exception nobody awaits.
        unsafe { ffi::PyErr_Clear() };
        return;
    };
    let Some(n) = as_node(&top) else { return };
    if !std::ptr::eq(n.data as *const NodeData as *const c_void, node) {
        return;
    }
    let _gc = GcPaused::new(py);
    if install(py, &n.below()).is_err() {
        // SAFETY: as above.
        unsafe { ffi::PyErr_Clear() };
    }
}

/// Whether NumPy's current handler in this context is a capture of the workspace `shared` that
/// serves this thread now (its scope open here, capture on) and takes requests of every size (no
/// `helper_min_size`: smaller ones would go to the handler below it, which may be another
/// workspace's): NumPy then allocates from this workspace without a handler being installed.
pub fn captures_here(py: Python<'_>, shared: &Arc<Shared>) -> PyResult<bool> {
    let top = current_handler(py)?;
    let Some(node) = as_node(&top) else { return Ok(false) };
    let mine = node.data.capture.as_ref().is_some_and(|c| Arc::ptr_eq(&c.capture.shared, shared));
    Ok(mine && shared.small == 0 && node.data.state.captures_here() && shared.installs_handler())
}

/// Whether this stack holds an open scope of `key` opened on this thread, in this asyncio task
/// (`task`, 0 for none): a `with ws:` inside `with ws:` nests in it.
pub fn is_open_here(py: Python<'_>, key: &Bound<'_, PyAny>, task: usize) -> PyResult<bool> {
    let mut cursor = current_handler(py)?;
    while let Some(node) = as_node(&cursor) {
        let state = &node.data.state;
        if node.key_is(key) && node.is_here() && state.task == task && !state.is_orphaned() {
            return Ok(true);
        }
        let next = node.below();
        cursor = next;
    }
    Ok(false)
}

/// How a scope left the stack (with its state, now closed).
pub enum Popped {
    /// It was the innermost open scope.
    Innermost(Arc<ScopeState>),
    /// It was unlinked from under the scope described here (the innermost open one), with the
    /// number of levels of its workspace nested in its cycle above it, which ended with it.
    Unlinked(Arc<ScopeState>, String, u32),
    /// This stack does not hold it open (another thread's, another task's, or closed already).
    NotHere,
}

/// Pops the scope `key` with `state` (None: the innermost of `key` a `with` entered on this
/// thread), closes its state and restores what was below it. The innermost scope is popped in
/// O(1); another one is unlinked from wherever it is, the open nodes above it rebuilt over what
/// was below it (a node that lent the handler below it now lends the new one). Nodes of closed
/// scopes and of other threads on the way are dropped.
pub fn pop(py: Python<'_>, key: &Bound<'_, PyAny>, state: Option<&Arc<ScopeState>>) -> PyResult<Popped> {
    let _gc = GcPaused::new(py);
    let top = current_handler(py)?;
    // Without a state (a `with`'s exit): the innermost scope of `key` that the frame running the
    // exit entered, else the innermost one that a frame called from one running the exit
    // entered (a wrapper's `__enter__`, a helper), else the innermost one of `key`; a loop's scope
    // is the loop's to exit. A generator suspended in a nested `with` of the same workspace
    // leaves its level among the block's own: each exit takes its own scope, so the block's cycle
    // ends with the block, and the generator's level with its own exit. Only a `with`
    // statement's frame is recorded as the one that entered a scope, and it runs until the
    // statement's exit: its address names it.
    use crate::shared::Recorded::ByWith;
    let matches = |node: &Node<'_, '_>| exit_matches(node, key, state);
    let frame = if state.is_none() { crate::shared::caller_frames::<1>()[0] } else { 0 };
    // Of a node `matches` holds for: its scope entered by the exiting frame, or by a wrapper it
    // called (the callers read only for a scope a wrapper entered).
    let own = |node: &Node<'_, '_>| frame != 0 && node.data.state.entering_frame(ByWith) == frame;
    let callers = std::cell::OnceCell::new();
    let near = |node: &Node<'_, '_>| {
        let state = &node.data.state;
        state.entering_caller(ByWith) != 0
            && state.entered_near(callers.get_or_init(crate::shared::caller_frames::<4>), ByWith)
    };
    let top_node = as_node(&top);
    let top_matches = top_node.as_ref().is_some_and(matches);
    #[derive(Clone, Copy)]
    enum By {
        Innermost,
        Frame,
        Caller,
    }
    let by = if state.is_some()
        || (top_matches && top_node.as_ref().is_some_and(|n| n.data.state.entering_frame(ByWith) == frame))
    {
        By::Innermost
    } else {
        // One walk down the stack: a scope the exiting frame entered comes first wherever it is.
        let mut by = By::Innermost;
        let mut cursor = top.clone();
        while let Some(node) = as_node(&cursor) {
            if matches(&node) {
                if own(&node) {
                    by = By::Frame;
                    break;
                }
                if matches!(by, By::Innermost) && near(&node) {
                    by = By::Caller;
                }
            }
            let next = node.below();
            cursor = next;
        }
        by
    };
    if let (Some(node), true, By::Innermost) = (top_node.as_ref(), top_matches, by) {
        node.data.state.close();
        // A workspace's own scope stays, closed, until reopened or settled (see the module docs);
        // `borrow()` and `scope_out_of_workspaces()` restore what was below them.
        if node.data.owner != node.data.key {
            install(py, &node.below())?;
        }
        return Ok(Popped::Innermost(node.data.state.clone()));
    }
    let matches = |node: &Node<'_, '_>| match by {
        By::Innermost => matches(node),
        By::Frame => matches(node) && own(node),
        By::Caller => matches(node) && near(node),
    };
    // Out of order, or over closed nodes: find the scope, rebuild the open nodes above it.
    let mut above: Vec<Bound<'_, PyAny>> = Vec::new();
    let mut cursor = top.clone();
    let (below_found, popped) = loop {
        let Some(node) = as_node(&cursor) else { return Ok(Popped::NotHere) };
        if matches(&node) {
            node.data.state.close();
            break (node.below(), node.data.state.clone());
        }
        let next = node.below();
        if node.is_here() {
            above.push(cursor);
        }
        cursor = next;
    };
    let mut rebuilt = below_found;
    for node in above.iter().rev().filter_map(as_node) {
        let lends = match node.shared() {
            Some(shared) => Lends::Capture(shared, &node.served()),
            None if node.data.installs => Lends::Handler(&node.served()),
            None => Lends::Handler(&rebuilt),
        };
        let lends = match lends {
            Lends::Handler(h) => Lends::Handler(&h.clone()),
            other => other,
        };
        rebuilt = new_node(
            py,
            &node.owner(),
            &node.key(),
            &rebuilt.clone(),
            lends,
            node.data.installs,
            node.data.state.clone(),
        )?;
    }
    install(py, &rebuilt)?;
    // Levels of this workspace nested in the popped scope's cycle (above it, below any cycle of
    // the workspace opened above it) end with that cycle.
    let orphans = if popped.opened_cycle() { orphan_nested(key, above.iter().rev()) } else { 0 };
    // Nothing observable is out of order where only `with` levels of the same workspace lie
    // above a level: they are alike.
    let alike = !popped.opened_cycle()
        && above
            .iter()
            .filter_map(as_node)
            .all(|n| n.key_is(key) && !n.data.state.opened_cycle() && !n.data.state.held);
    match above.first().and_then(as_node) {
        Some(n) if !alike => {
            let innermost = if n.owner().is(key) {
                "a later scope of the same workspace".to_string()
            } else {
                describe(&n.owner())
            };
            Ok(Popped::Unlinked(popped, innermost, orphans))
        }
        _ => Ok(Popped::Innermost(popped)),
    }
}

/// Whether `node` is the scope of `key` that an exit with `state` (None: a `with`'s, which a
/// loop's held scope is not) leaves, where it is open here.
#[inline(always)]
fn exit_matches(node: &Node<'_, '_>, key: &Bound<'_, PyAny>, state: Option<&Arc<ScopeState>>) -> bool {
    node.key_is(key) && node.is_here() && state.map_or(!node.data.state.held, |s| Arc::ptr_eq(s, &node.data.state))
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

/// The workspace of the innermost open scope of this thread, or None.
pub fn current(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let mut cursor = current_handler(py)?;
    while let Some(node) = as_node(&cursor) {
        if node.is_here() {
            return Ok(node.owner());
        }
        let next = node.below();
        cursor = next;
    }
    Ok(py.None().into_bound(py))
}

/// A scope without a cycle: `Workspace.borrow()` (the workspace current, capturing when it
/// captures) and `scope_out_of_workspaces()` (no workspace current, NumPy's default allocator).
/// Entering pushes and exiting pops in one step each, so no exception (a signal handler's
/// `KeyboardInterrupt`) can leave it half done; an exit where the scope is not in the stack (a
/// finaliser on another thread) still closes it.
#[pyclass(frozen, module = "rustws._rustws")]
pub struct Scope {
    /// The workspace, or None.
    owner: Py<PyAny>,
    /// What it makes NumPy's handler: the workspace's capture (when the workspace captures as
    /// the scope opens), or NumPy's default.
    lends: Option<(Arc<Shared>, Py<PyAny>)>,
    /// The states of this object's open scopes, innermost last (an object may be entered again
    /// inside itself).
    open: std::sync::Mutex<Vec<Arc<ScopeState>>>,
}

impl Scope {
    /// A scope that makes `owner` (a workspace over `shared`, whose handler capsule is `capsule`)
    /// current.
    pub(crate) fn of_workspace(owner: Py<PyAny>, shared: Arc<Shared>, capsule: Py<PyAny>) -> Self {
        Scope { owner, lends: Some((shared, capsule)), open: std::sync::Mutex::new(Vec::new()) }
    }
}

#[pymethods]
impl Scope {
    /// `scope_out_of_workspaces()`: no workspace current inside, NumPy's default allocator.
    #[new]
    fn new(py: Python<'_>) -> Self {
        Scope { owner: py.None(), lends: None, open: std::sync::Mutex::new(Vec::new()) }
    }

    fn __enter__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let me = slf.get();
        let owner = me.owner.bind(py);
        let how = match &me.lends {
            None => Install::Default,
            Some((shared, capsule)) if shared.installs_handler() => Install::Capture(shared.clone(), capsule.bind(py)),
            Some(_) => Install::Keep,
        };
        let state = ScopeState::new(false, 0, false);
        push(py, owner, slf.as_any(), how, state.clone())?;
        me.open.lock().unwrap_or_else(|e| e.into_inner()).push(state);
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
        let me = slf.get();
        let owner = me.owner.bind(py);
        let what = || if owner.is_none() { describe(owner) } else { format!("borrow() of {}", describe(owner)) };
        let task = current_task(py);
        let (state, any_open) = {
            let mut open = me.open.lock().unwrap_or_else(|e| e.into_inner());
            // The innermost scope of this object opened here (this thread, task and context), else
            // the one whose entering frame runs this exit (its owner, finalised elsewhere).
            let i =
                open.iter().rposition(|s| s.is_here() && s.task == task).or_else(|| crate::shared::entered_here(&open));
            (i.map(|i| open.remove(i)), !open.is_empty())
        };
        let Some(state) = state else {
            let why = if any_open {
                "exited on another thread or task than the one that entered it; nothing changed"
            } else {
                "is not open (exited twice?)"
            };
            return Err(errors::new(py, errors::Class::Scope, &format!("{} {why}", what())));
        };
        match pop(py, slf.as_any(), Some(&state))? {
            Popped::Innermost(_) => Ok(false),
            Popped::Unlinked(_, innermost, _) => warn_unlinked(py, &what(), &innermost).map(|()| false),
            Popped::NotHere => {
                // Its owner's exit, run elsewhere: the scope closes, and its node, closed, is left
                // for its own thread to drop.
                state.close();
                Ok(false)
            }
        }
    }
}
