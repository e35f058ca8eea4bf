//! `rustws._rustws`: the one binding crate. It translates configurations and statistics between
//! Python and the core, maps each core error to one Python exception class (defined in
//! `rustws._errors`), exposes a workspace as `WorkspaceCore`, and installs NumPy's data-memory
//! handler. Policy, learning and arena logic all live in `rustws-core`.

mod arrays;
mod config;
mod cycles;
mod devarray;
mod device;
mod dlpack;
mod handler;
mod scope;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use rustws_core::cuda::{CudaMemory, PinnedHostMemory};
use rustws_core::{
    AllocationPolicy, Backend, DebugMode, Error, LearningPolicy, LocationPolicy, MirroringPolicy, OpaqueMemory,
    ResetPolicy, SpillPolicy, Workspace,
};

use arrays::{direct_arrays_supported, ArrayFields, NPY_ARRAY_OWNDATA};
use config::{config_from_dict, parse_size, validate_config};
use devarray::{DeviceArray, DeviceSide, DisposeStatistics};
use device::{reclaim, DeviceBuffer, Memory, Source};
use handler::Shared;

/// Raises the Python exception class `name` of `rustws._errors`.
pub(crate) fn py_error(py: Python<'_>, name: &str, message: String) -> PyErr {
    match py.import("rustws._errors").and_then(|m| m.getattr(name)) {
        Ok(cls) => match cls.call1((message.clone(),)) {
            Ok(inst) => PyErr::from_value(inst),
            Err(e) => e,
        },
        Err(_) => pyo3::exceptions::PyRuntimeError::new_err(message),
    }
}

/// One core error, one Python exception class.
pub(crate) fn to_py(py: Python<'_>, e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::InvalidConfig { .. } => PyValueError::new_err(msg),
        Error::OutOfMemory { .. } | Error::SystemOutOfMemory { .. } => py_error(py, "WorkspaceOutOfMemory", msg),
        Error::Destroyed { .. } => py_error(py, "WorkspaceClosedError", msg),
        Error::NotOpen { .. } => py_error(py, "ScopeError", msg),
        Error::Unavailable { .. } => py_error(py, "DeviceUnavailableError", msg),
    }
}

/// `RUSTWS_DEBUG_MODE` as the core reads it (`None` when unset; `ValueError` when unknown).
#[pyfunction]
fn env_debug_mode(py: Python<'_>) -> PyResult<Option<&'static str>> {
    DebugMode::env_override().map(|m| m.map(DebugMode::as_str)).map_err(|e| to_py(py, e))
}

/// Makes `handler` (a `mem_handler` capsule, or None for NumPy's default) current in this
/// context; returns the previous one.
#[pyfunction]
#[pyo3(signature = (handler))]
fn set_handler<'py>(py: Python<'py>, handler: Option<&Bound<'py, PyAny>>) -> PyResult<Bound<'py, PyAny>> {
    if let Some(h) = handler {
        if !h.is_instance_of::<pyo3::types::PyCapsule>() {
            return Err(PyTypeError::new_err("handler must be a mem_handler capsule or None"));
        }
    }
    handler::set_handler(py, handler)
}

/// The handler current in this context.
#[pyfunction]
fn get_handler(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    handler::get_handler(py)
}

/// Version, build features and policy names, for `python -m rustws info`.
#[pyfunction]
fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("version", env!("CARGO_PKG_VERSION"))?;
    d.set_item("header_bytes", Workspace::header_bytes())?;
    d.set_item("profile", if cfg!(debug_assertions) { "debug" } else { "release" })?;
    d.set_item("cuda_backend", "cudarc driver API, loaded at run time (CUDA 12.8 bindings)")?;
    let names = |all: &[&'static str]| all.to_vec();
    d.set_item("allocation_policies", names(&AllocationPolicy::ALL.iter().map(|p| p.as_str()).collect::<Vec<_>>()))?;
    d.set_item("learning_policies", names(&LearningPolicy::ALL.iter().map(|p| p.as_str()).collect::<Vec<_>>()))?;
    d.set_item("spill_policies", names(&SpillPolicy::ALL.iter().map(|p| p.as_str()).collect::<Vec<_>>()))?;
    d.set_item("reset_policies", names(&ResetPolicy::ALL.iter().map(|p| p.as_str()).collect::<Vec<_>>()))?;
    d.set_item("mirroring_policies", names(&MirroringPolicy::ALL.iter().map(|p| p.as_str()).collect::<Vec<_>>()))?;
    d.set_item("location_policies", names(&LocationPolicy::ALL.iter().map(|p| p.as_str()).collect::<Vec<_>>()))?;
    Ok(d)
}

/// Why CUDA device `ordinal` cannot be used (no driver, no device, a bad ordinal), or None.
#[pyfunction]
fn cuda_probe(ordinal: usize) -> Option<String> {
    rustws_core::cuda::probe(ordinal).err().map(|e| e.to_string())
}

/// GPUs the CUDA driver sees (0 without a driver).
#[pyfunction]
fn cuda_device_count() -> usize {
    rustws_core::cuda::device_count().unwrap_or(0)
}

/// A workspace: the core behind a lock, and its NumPy memory handler. Subclassed by
/// `rustws.Workspace`, which adds the context-manager protocol.
#[pyclass(subclass, frozen, module = "rustws._rustws")]
struct WorkspaceCore {
    pub(crate) shared: Arc<Shared>,
    pub(crate) capsule: Py<PyAny>,
    /// Debug mode BYPASS_EVERYTHING: arrays come from NumPy's default allocator.
    pub(crate) bypass: bool,
    /// `use_cycle_detector`: report arrays that outlive their cycle.
    cycle_detector: bool,
    /// Where the memory comes from (and the CUDA device, for device workspaces).
    pub(crate) memory: Arc<Memory>,
    /// Set once for device workspaces: their `empty` / `zeros` return `DeviceArray`s.
    device: std::sync::OnceLock<DeviceSide>,
    /// The states of this workspace's open scopes (`with ws:`), innermost last: an exit that
    /// runs where its scope is not in the stack closes one through them.
    open_scopes: std::sync::Mutex<Vec<Arc<scope::ScopeState>>>,
}

impl WorkspaceCore {
    /// Whether a scope of this workspace opened now pushes a capture handler: while `capture` is
    /// on (the handler then follows the flag while the scope is open, handing requests to the
    /// handler below it once it is off); otherwise the scope is transparent.
    pub(crate) fn installs_handler(&self) -> bool {
        !self.bypass && self.shared.host_accessible && self.shared.capture.load(Ordering::Relaxed)
    }

    /// Opens a scope of this workspace in this thread's or task's stack: a cycle of its own, or
    /// a level nested in this stack's open cycle.
    pub(crate) fn enter_scope(&self, py: Python<'_>, me: &Bound<'_, PyAny>) -> PyResult<Arc<scope::ScopeState>> {
        let task = scope::current_task(py);
        let nested = scope::is_open_here(py, me, task)?;
        // The guard is dropped before any Python runs: building an exception can run the GC,
        // which may free this workspace's arrays and take the lock again.
        let entered = if nested { self.shared.lock().nest() } else { self.shared.lock().open_cycle() };
        entered.map_err(|e| to_py(py, e))?;
        let undo = |e: PyErr| {
            let mut ws = self.shared.lock();
            let _ = if nested { ws.unnest() } else { ws.close_cycle().map(drop) };
            e
        };
        let installs = self.installs_handler();
        // The node the last `with` of this workspace left here, reopened in place; else a new one.
        let reopened = if installs { scope::reopen(py, me, !nested, task).map_err(undo)? } else { None };
        let state = match reopened {
            Some(state) => state,
            None => {
                let how = if installs {
                    scope::Install::Capture(self.shared.clone(), self.capsule.bind(py))
                } else {
                    scope::Install::Keep
                };
                let state = scope::ScopeState::new(!nested, task);
                scope::push(py, me, me, how, state.clone()).map_err(undo)?;
                state
            }
        };
        self.open_scopes.lock().unwrap_or_else(|e| e.into_inner()).push(state.clone());
        Ok(state)
    }

    /// The loop form's end of an iteration: closes `state`'s cycle (or nested level) and leaves
    /// its node in place for the next iteration.
    pub(crate) fn end_iteration(
        &self,
        py: Python<'_>,
        me: &Bound<'_, PyAny>,
        state: &scope::ScopeState,
    ) -> PyResult<()> {
        state.close();
        if self.shared.destroyed.load(Ordering::Relaxed) {
            return Ok(());
        }
        let ended = {
            let mut ws = self.shared.lock();
            if state.opened_cycle() {
                ws.close_cycle()
            } else {
                ws.unnest().map(|()| rustws_core::CycleReport::default())
            }
        };
        reclaim(py, &self.memory);
        let r = ended.map_err(|e| to_py(py, e))?;
        self.after_cycle(py, me, r, true)
    }

    /// The loop form's next iteration in the scope of `state`, reopened in place; false when its
    /// node is no longer NumPy's current handler here (then a scope is entered anew).
    pub(crate) fn begin_iteration(&self, py: Python<'_>, state: &scope::ScopeState, top: bool) -> PyResult<bool> {
        if !top {
            return Ok(false);
        }
        let opened = {
            let mut ws = self.shared.lock();
            if state.opened_cycle() {
                ws.open_cycle()
            } else {
                ws.nest()
            }
        };
        opened.map_err(|e| to_py(py, e))?;
        state.open.store(true, Ordering::Relaxed);
        Ok(true)
    }

    /// Drops `state` from the open scopes (its node stays, closed, until settled).
    pub(crate) fn forget_scope(&self, state: &Arc<scope::ScopeState>) {
        self.open_scopes.lock().unwrap_or_else(|e| e.into_inner()).retain(|s| !Arc::ptr_eq(s, state));
    }

    /// Reports refused requests and escaped arrays through `_after_cycle`, when there are any.
    pub(crate) fn after_cycle(
        &self,
        py: Python<'_>,
        me: &Bound<'_, PyAny>,
        r: rustws_core::CycleReport,
        clean: bool,
    ) -> PyResult<()> {
        let _ = py;
        let failures = self.shared.has_failures.load(Ordering::Relaxed);
        let leaked = r.completed && r.escaped_blocks > 0 && self.cycle_detector;
        if failures || leaked {
            me.call_method1("_after_cycle", (leaked && clean, r.escaped_blocks, r.escaped_bytes))?;
        }
        Ok(())
    }

    /// Closes this workspace's innermost scope in this stack (see `__exit__`).
    pub(crate) fn exit_scope(&self, py: Python<'_>, me: &Bound<'_, PyAny>, clean: bool) -> PyResult<()> {
        let (state, unlinked, elsewhere) = match scope::pop(py, me, None)? {
            scope::Popped::Innermost(state) => (state, None, false),
            scope::Popped::Unlinked(state, innermost) => (state, Some(innermost), false),
            scope::Popped::NotHere => {
                // Not in this stack: the most recent scope of this workspace still open closes.
                let last = self.open_scopes.lock().unwrap_or_else(|e| e.into_inner()).last().cloned();
                let Some(state) = last else {
                    let what = scope::describe(me);
                    return Err(py_error(py, "ScopeError", format!("{what} is not open (exited twice?)")));
                };
                state.close();
                (state, None, true)
            }
        };
        self.open_scopes.lock().unwrap_or_else(|e| e.into_inner()).retain(|s| !Arc::ptr_eq(s, &state));
        if !self.shared.destroyed.load(Ordering::Relaxed) {
            let exited = {
                let mut ws = self.shared.lock();
                if state.opened_cycle() {
                    ws.close_cycle()
                } else {
                    ws.unnest().map(|()| rustws_core::CycleReport::default())
                }
            };
            reclaim(py, &self.memory);
            let r = exited.map_err(|e| to_py(py, e))?;
            self.after_cycle(py, me, r, clean)?;
        }
        if elsewhere {
            let what = scope::describe(me);
            let whence = if state.thread != scope::thread_ident() { "another thread" } else { "another task" };
            return Err(py_error(
                py,
                "ScopeError",
                format!("{what} exited in {whence} than the one that entered it; its scope was closed"),
            ));
        }
        if let Some(innermost) = unlinked {
            scope::warn_unlinked(py, &scope::describe(me), &innermost)?;
        }
        Ok(())
    }
}

impl Drop for WorkspaceCore {
    /// The last Python reference is gone (a thread that ended without `destroy()`, a dropped
    /// local): nothing can open a cycle any more, so the workspace is destroyed and its memory
    /// returned but for the pages under arrays still alive, which go as those arrays die.
    fn drop(&mut self) {
        self.shared.destroyed.store(true, Ordering::Relaxed);
        self.shared.lock().destroy();
    }
}

/// The id of the workspace whose memory holds `array`'s data (an ndarray that owns it, handed
/// out by a handler of ours), or None: NumPy's own memory, a bypass block (`helper_min_size`,
/// the debug bypass, allocations after `destroy()`), or anything else.
#[pyfunction]
fn block_owner(py: Python<'_>, array: &Bound<'_, PyAny>) -> Option<u64> {
    if !array.is_instance_of::<numpy::PyUntypedArray>() || !direct_arrays_supported(py) {
        return None;
    }
    // SAFETY: `array` is a live ndarray and the layout of `ArrayFields` was checked.
    let f = unsafe { &*(array.as_ptr() as *const ArrayFields) };
    let data = std::ptr::NonNull::new(f.data.cast::<u8>())?;
    if f.mem_handler.is_null() || f.flags & NPY_ARRAY_OWNDATA == 0 {
        return None;
    }
    // SAFETY: a live array owns a strong reference to its handler.
    let handler = unsafe { Bound::from_borrowed_ptr(py, f.mem_handler) };
    handler::served_by(&handler)?;
    // SAFETY: a handler of ours handed out `data` (the array owns it and names the handler), so
    // a live header of ours precedes it.
    unsafe {
        let h = rustws_core::arena::header_of(data).as_ptr();
        match rustws_core::arena::live_kind(h)? {
            rustws_core::BlockKind::Arena | rustws_core::BlockKind::External | rustws_core::BlockKind::Huge => {
                Some((*h).owner)
            }
            _ => None,
        }
    }
}

/// The handler serving NumPy here as the open scopes chose it (past closed scopes left on top
/// of the stack, which hand every request to it).
#[pyfunction]
fn effective_handler(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    scope::effective(py)
}

/// The name of a `mem_handler` capsule's handler (None for anything else).
#[pyfunction]
fn handler_name(capsule: &Bound<'_, PyAny>) -> Option<String> {
    handler::name_of(capsule)
}

/// Drops closed scopes from the top of this context's scope stack.
#[pyfunction]
fn settle_scopes(py: Python<'_>) -> PyResult<()> {
    scope::settle(py)
}

/// The workspace of the innermost scope of this thread or task (None when there is none).
#[pyfunction]
fn current_workspace(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    scope::current(py)
}

#[pymethods]
impl WorkspaceCore {
    /// `backend`: None for host memory as the configuration's location policy says,
    /// `"cuda:N"` for device N's memory, `"pinned:N"` for page-locked host memory registered
    /// with device N's driver, `"standin"` for host memory that the workspace treats as device
    /// memory (headers kept apart, every access through the backend).
    #[new]
    #[pyo3(signature = (name, config, backend=None))]
    fn new(py: Python<'_>, name: &str, config: &Bound<'_, PyDict>, backend: Option<&str>) -> PyResult<Self> {
        // A value of RUSTWS_DEBUG_MODE that names no mode must not silently leave workspaces on.
        DebugMode::env_override().map_err(|e| to_py(py, e))?;
        let c = config_from_dict(config)?;
        let ordinal = |spec: &str| -> PyResult<usize> {
            spec.parse::<usize>()
                .map_err(|_| PyValueError::new_err(format!("invalid backend {backend:?}: bad ordinal")))
        };
        let (ws, source) = match backend {
            None => {
                let ws = Workspace::new(name, c).map_err(|e| to_py(py, e))?;
                let source = Source::host(ws.backend().clone());
                (ws, source)
            }
            Some(spec) => {
                let source = if spec == "standin" {
                    Source::host(Arc::new(OpaqueMemory))
                } else if let Some(n) = spec.strip_prefix("cuda:") {
                    Source::cuda(Arc::new(CudaMemory::new(ordinal(n)?).map_err(|e| to_py(py, e))?))
                } else if let Some(n) = spec.strip_prefix("pinned:") {
                    let pinned = Arc::new(PinnedHostMemory::new(ordinal(n)?).map_err(|e| to_py(py, e))?);
                    Source::with_deferred(pinned.clone(), pinned)
                } else {
                    return Err(PyValueError::new_err(format!(
                        "invalid backend {spec:?}: expected None, 'cuda:N', 'pinned:N' or 'standin'"
                    )));
                };
                let backend: Arc<dyn Backend> = source.backend.clone();
                let ws = Workspace::with_backend(name, c, backend).map_err(|e| to_py(py, e))?;
                (ws, source)
            }
        };
        let bypass = ws.debug_mode() == DebugMode::BypassEverything;
        let cycle_detector = ws.config().use_cycle_detector;
        let shared = Arc::new(Shared::new(ws));
        let capsule = handler::new_capsule(py, &shared)?;
        let memory = source.into_memory(shared.clone());
        Ok(WorkspaceCore {
            shared,
            capsule,
            bypass,
            cycle_detector,
            memory,
            device: std::sync::OnceLock::new(),
            open_scopes: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// The workspace's name.
    #[getter]
    fn name(&self) -> &str {
        &self.shared.name
    }

    /// A process-wide id, also in the handler's name (`rustws:<id>:<name>`).
    #[getter]
    fn id(&self) -> u64 {
        self.shared.id
    }

    /// The name of the memory source (`anonymous`, `cuda`, `cuda-pinned-host` ...).
    #[getter]
    fn backend_name(&self) -> &'static str {
        self.memory.backend.name()
    }

    /// Whether the CPU can read and write this workspace's memory.
    #[getter]
    fn host_accessible(&self) -> bool {
        self.shared.host_accessible
    }

    /// A `DeviceBuffer` of `nbytes` (256-byte aligned) from this workspace; freed when the last
    /// reference to it dies.
    #[pyo3(signature = (nbytes, zeroed=false))]
    fn _buffer(&self, py: Python<'_>, nbytes: usize, zeroed: bool) -> PyResult<DeviceBuffer> {
        if self.shared.destroyed.load(Ordering::Relaxed) {
            return Err(to_py(py, Error::Destroyed { workspace: self.shared.name.clone() }));
        }
        Ok(DeviceBuffer { block: Arc::new(self.new_block(py, nbytes, zeroed)?) })
    }

    /// Makes this a device workspace (once): `empty` and `zeros` then return `DeviceArray`s on
    /// `device` (`"cuda:N"`, or `"cpu"` for host memory), exported to DLPack as `dl`; over the
    /// workspace's memory when `on_device`, else over host arrays of the workspace.
    fn _set_device(&self, py: Python<'_>, device: &str, on_device: bool, dl: (i32, i32)) -> PyResult<()> {
        if on_device && self.shared.host_accessible {
            return Err(PyValueError::new_err(format!(
                "workspace {:?} holds host memory: its arrays cannot be device arrays",
                self.shared.name
            )));
        }
        let side = DeviceSide { name: pyo3::types::PyString::new(py, device).unbind(), dl, on_device };
        self.device.set(side).map_err(|_| PyValueError::new_err("the workspace's device is already set"))
    }

    /// The DLPack device of a device workspace (None for a host workspace).
    #[getter]
    fn _dl(&self) -> Option<(i32, i32)> {
        self.device.get().map(|d| d.dl)
    }

    /// Whether the arrays of a device workspace live in device memory.
    #[getter]
    fn _on_device(&self) -> bool {
        self.device.get().is_some_and(|d| d.on_device)
    }

    /// Hands the driver releases the backend queued to the driver now (they also go at the end
    /// of each cycle and after each release); returns how many releases the driver refused so far.
    fn _reclaim(&self, py: Python<'_>) -> usize {
        if let Some(p) = &self.memory.pending {
            p.settle(false);
        }
        reclaim(py, &self.memory);
        self.memory.deferred.as_ref().map_or(0, |d| d.failed_releases())
    }

    /// Free and total bytes of this workspace's CUDA device (None for other memory).
    fn device_memory_info(&self, py: Python<'_>) -> PyResult<Option<(usize, usize)>> {
        match &self.memory.cuda {
            Some(c) => c.memory_info().map(Some).map_err(|e| to_py(py, Error::Unavailable { what: e })),
            None => Ok(None),
        }
    }

    /// Its NumPy `mem_handler` capsule.
    #[getter]
    fn handler(&self, py: Python<'_>) -> Py<PyAny> {
        self.capsule.clone_ref(py)
    }

    #[getter]
    fn is_open(&self) -> bool {
        self.shared.lock().is_open()
    }

    #[getter]
    fn is_destroyed(&self) -> bool {
        self.shared.lock().is_destroyed()
    }

    /// Completed cycles.
    #[getter]
    fn generation(&self) -> u64 {
        self.shared.lock().generation()
    }

    /// Nesting depth of the open cycle (0: closed).
    #[getter]
    fn depth(&self) -> u32 {
        self.shared.lock().depth()
    }

    /// The debug mode in force (`RUSTWS_DEBUG_MODE` overrides the configuration).
    #[getter]
    fn debug_mode_name(&self) -> &'static str {
        self.shared.lock().debug_mode().as_str()
    }

    /// Whether cycles make this workspace NumPy's current allocator (never for device memory).
    #[getter]
    fn capture(&self) -> bool {
        self.shared.capture.load(Ordering::Relaxed) && self.shared.host_accessible
    }

    #[setter]
    fn set_capture(&self, value: bool) {
        self.shared.capture.store(value, Ordering::Relaxed);
    }

    /// Opens a cycle and makes this workspace current. Inside an open scope of this workspace on
    /// this thread and task it nests; beside one of another task or thread, it is a cycle of its
    /// own.
    fn __enter__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, Self>> {
        slf.get().enter_scope(slf.py(), slf.as_any())?;
        Ok(slf.clone())
    }

    /// Closes this workspace's innermost scope here; a cycle's scope ends the cycle. Reports
    /// refused requests and escaped arrays through `_after_cycle` when there are any. A scope
    /// that is not the innermost is unlinked and the exit warns (`ResourceWarning`); one that is
    /// not in this thread's or task's stack at all (a generator finalised on another thread) is
    /// closed all the same, and the exit raises `ScopeError`.
    #[pyo3(signature = (exc_type=None, _exc=None, _tb=None))]
    fn __exit__(
        slf: &Bound<'_, Self>,
        exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let clean = exc_type.is_none_or(|t| t.is_none());
        slf.get().exit_scope(slf.py(), slf.as_any(), clean)?;
        Ok(false)
    }

    /// Iterates over `iterable`, each item one cycle of this workspace (the loop form: the scope
    /// is set up once for the whole loop; leaving the loop, by `break` or an exception, closes
    /// the open cycle).
    fn cycles(slf: &Bound<'_, Self>, iterable: &Bound<'_, PyAny>) -> PyResult<cycles::Cycles> {
        cycles::Cycles::new(slf, iterable)
    }

    /// The statistics as a tuple in the order of `WorkspaceStats`' fields.
    fn _stats(&self) -> (u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64) {
        let s = self.shared.lock().stats();
        (
            s.cycles,
            s.capacity_bytes,
            s.used_bytes,
            s.peak_cycle_bytes,
            s.cached_bytes,
            s.external_bytes,
            s.pinned_bytes,
            s.overhead_bytes,
            s.allocation_count,
            s.spill_count,
            s.failed_allocations,
        )
    }

    /// Messages of requests refused since the last call.
    fn _drain_failures(&self) -> Vec<String> {
        self.shared.drain_failures()
    }

    /// Opens (or nests) a cycle without making the workspace current: for a workspace that
    /// follows another's cycles, such as a device workspace's host mirror.
    fn _open_cycle(&self, py: Python<'_>) -> PyResult<()> {
        let entered = self.shared.lock().enter();
        entered.map_err(|e| to_py(py, e))
    }

    /// Closes what `_open_cycle` opened.
    fn _close_cycle(&self, py: Python<'_>) -> PyResult<()> {
        let exited = self.shared.lock().exit();
        reclaim(py, &self.memory);
        exited.map(|_| ()).map_err(|e| to_py(py, e))
    }

    /// Sizes the arena now from what was learned.
    fn initialize(&self, py: Python<'_>) -> PyResult<()> {
        let done = self.shared.lock().initialize();
        done.map_err(|e| to_py(py, e))
    }

    /// Core part of `destroy()`: memory under live arrays is kept until they die.
    fn _destroy(&self, py: Python<'_>) {
        self.shared.destroyed.store(true, Ordering::Relaxed);
        self.shared.lock().destroy();
        reclaim(py, &self.memory);
    }

    /// A new uninitialised array over workspace memory: an ndarray, or a `DeviceArray` for a
    /// device workspace.
    #[pyo3(signature = (shape, dtype=None, order="C"))]
    fn empty<'py>(
        slf: &Bound<'py, Self>,
        shape: &Bound<'py, PyAny>,
        dtype: Option<&Bound<'py, PyAny>>,
        order: &str,
    ) -> PyResult<Bound<'py, PyAny>> {
        match slf.get().device.get() {
            Some(side) => WorkspaceCore::device_array(slf, side, shape, dtype, order, false),
            None => slf.get().new_array(slf.py(), shape, dtype, order, false),
        }
    }

    /// A new zero-filled array over workspace memory: an ndarray, or a `DeviceArray` for a
    /// device workspace.
    #[pyo3(signature = (shape, dtype=None, order="C"))]
    fn zeros<'py>(
        slf: &Bound<'py, Self>,
        shape: &Bound<'py, PyAny>,
        dtype: Option<&Bound<'py, PyAny>>,
        order: &str,
    ) -> PyResult<Bound<'py, PyAny>> {
        match slf.get().device.get() {
            Some(side) => WorkspaceCore::device_array(slf, side, shape, dtype, order, true),
            None => slf.get().new_array(slf.py(), shape, dtype, order, true),
        }
    }

    /// A new ndarray over workspace memory (refused for device memory), whatever the workspace.
    #[pyo3(signature = (shape, dtype=None, order="C", zeroed=false))]
    fn _ndarray<'py>(
        &self,
        py: Python<'py>,
        shape: &Bound<'py, PyAny>,
        dtype: Option<&Bound<'py, PyAny>>,
        order: &str,
        zeroed: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.new_array(py, shape, dtype, order, zeroed)
    }

    fn __repr__(&self) -> String {
        let ws = self.shared.lock();
        let state = if ws.is_destroyed() {
            "destroyed"
        } else if ws.is_open() {
            "open"
        } else {
            "closed"
        };
        let s = ws.stats();
        format!(
            "<Workspace {:?} {state}, {} cycles, capacity {} bytes, used {} bytes>",
            self.shared.name, s.cycles, s.capacity_bytes, s.used_bytes
        )
    }
}

#[pymodule]
fn _rustws(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<WorkspaceCore>()?;
    m.add_class::<DeviceBuffer>()?;
    m.add_class::<scope::Scope>()?;
    m.add_class::<cycles::Cycles>()?;
    m.add_class::<DeviceArray>()?;
    m.add_class::<DisposeStatistics>()?;
    m.add_function(wrap_pyfunction!(devarray::wrap_host, m)?)?;
    m.add_function(wrap_pyfunction!(devarray::dispose_statistics, m)?)?;
    m.add_function(wrap_pyfunction!(devarray::dispose_push, m)?)?;
    m.add_function(wrap_pyfunction!(devarray::dispose_remove, m)?)?;
    m.add_function(wrap_pyfunction!(devarray::dispose_chain, m)?)?;
    m.add_function(wrap_pyfunction!(device::torch_route, m)?)?;
    m.add_function(wrap_pyfunction!(device::torch_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(device::torch_share, m)?)?;
    m.add_function(wrap_pyfunction!(device::torch_unshare, m)?)?;
    m.add_function(wrap_pyfunction!(parse_size, m)?)?;
    m.add_function(wrap_pyfunction!(validate_config, m)?)?;
    m.add_function(wrap_pyfunction!(env_debug_mode, m)?)?;
    m.add_function(wrap_pyfunction!(set_handler, m)?)?;
    m.add_function(wrap_pyfunction!(get_handler, m)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_probe, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_device_count, m)?)?;
    m.add_function(wrap_pyfunction!(current_workspace, m)?)?;
    m.add_function(wrap_pyfunction!(settle_scopes, m)?)?;
    m.add_function(wrap_pyfunction!(effective_handler, m)?)?;
    m.add_function(wrap_pyfunction!(handler_name, m)?)?;
    m.add_function(wrap_pyfunction!(block_owner, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("HEADER_BYTES", Workspace::header_bytes())?;
    Ok(())
}
