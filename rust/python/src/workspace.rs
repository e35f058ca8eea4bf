//! `WorkspaceCore`, a workspace as Python sees it (subclassed by `rustws.Workspace`): the core
//! behind its lock and NumPy memory handler ([`Shared`]), where its memory comes from
//! ([`Memory`]), its scopes (`with ws:`, the loop form, the mirror's cycles), its arrays and
//! blocks, and its statistics. What each piece does lives in its own module: scopes in
//! [`crate::scope`], ndarrays in [`crate::arrays`], device arrays in [`crate::devarray`], device
//! memory in [`crate::device`]; policy, learning and the arena in `rustws-core`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use rustws_core::cuda::{CudaMemory, PinnedHostMemory};
use rustws_core::{Backend, DebugMode, Error, OpaqueMemory, Workspace};

use crate::calls::{self, Arg};
use crate::config::config_from_dict;
use crate::devarray::{self, DeviceSide};
use crate::device::{reclaim, Block, DeviceBuffer, Memory, Source};
use crate::errors::{self, to_py};
use crate::handler::{self, Shared};
use crate::{arrays, cycles, scope};

/// A snapshot of a workspace's statistics (`WorkspaceStats`' fields, by name).
#[pyclass(frozen, get_all, module = "rustws._rustws")]
pub(crate) struct Stats {
    cycles: u64,
    capacity_bytes: u64,
    used_bytes: u64,
    peak_cycle_bytes: u64,
    cached_bytes: u64,
    external_bytes: u64,
    pinned_bytes: u64,
    overhead_bytes: u64,
    allocation_count: u64,
    spill_count: u64,
    failed_allocations: u64,
}

impl From<rustws_core::WorkspaceStats> for Stats {
    fn from(s: rustws_core::WorkspaceStats) -> Self {
        Stats {
            cycles: s.cycles,
            capacity_bytes: s.capacity_bytes,
            used_bytes: s.used_bytes,
            peak_cycle_bytes: s.peak_cycle_bytes,
            cached_bytes: s.cached_bytes,
            external_bytes: s.external_bytes,
            pinned_bytes: s.pinned_bytes,
            overhead_bytes: s.overhead_bytes,
            allocation_count: s.allocation_count,
            spill_count: s.spill_count,
            failed_allocations: s.failed_allocations,
        }
    }
}

/// A workspace: the core behind a lock, and its NumPy memory handler. Subclassed by
/// `rustws.Workspace`, which adds the context-manager protocol.
#[pyclass(subclass, frozen, module = "rustws._rustws")]
pub(crate) struct WorkspaceCore {
    /// Always there once the object is made. When Python cannot make a subclass's instance
    /// dictionary (out of memory), it deallocates the object before PyO3 has written this: the
    /// object's memory is zero-filled, which reads as `None`, so that drop is harmless.
    state: Option<Box<CoreState>>,
}

impl std::ops::Deref for WorkspaceCore {
    type Target = CoreState;

    fn deref(&self) -> &CoreState {
        self.state.as_deref().expect("a workspace is made before it is used")
    }
}

/// What a [`WorkspaceCore`] holds.
pub(crate) struct CoreState {
    pub(crate) shared: Arc<Shared>,
    pub(crate) capsule: Py<PyAny>,
    /// Debug mode BYPASS_EVERYTHING: arrays come from NumPy's default allocator.
    pub(crate) bypass: bool,
    /// `use_cycle_detector`: report arrays that outlive their cycle.
    pub(crate) cycle_detector: bool,
    /// Where the memory comes from (and the CUDA device, for device workspaces).
    pub(crate) memory: Arc<Memory>,
    /// Set once for device workspaces: their `empty` / `zeros` return `DeviceArray`s.
    pub(crate) device: std::sync::OnceLock<DeviceSide>,
    /// The states of this workspace's open scopes (`with ws:`), innermost last: an exit that
    /// runs where its scope is not in the stack closes one through them.
    open_scopes: std::sync::Mutex<Vec<Arc<scope::ScopeState>>>,
}

impl WorkspaceCore {
    /// A new ndarray over this workspace's memory (refused for device memory).
    pub(crate) fn new_array<'py>(
        &self,
        py: Python<'py>,
        shape: &Bound<'py, PyAny>,
        dtype: Option<&Bound<'py, PyAny>>,
        order: &str,
        zeroed: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        arrays::new_array(py, &self.shared, self.capsule.bind(py), self.bypass, shape, dtype, order, zeroed)
    }

    /// A new block of `nbytes` from this workspace, zero-filled when `zeroed`.
    pub(crate) fn new_block(&self, py: Python<'_>, nbytes: usize, zeroed: bool) -> PyResult<Block> {
        let block = Block::new(&self.memory, nbytes, zeroed);
        // Releases queued by blocks that died where the GIL could not be released go now.
        reclaim(py, &self.memory);
        block.map_err(|e| to_py(py, e))
    }

    /// Whether a scope of this workspace opened now pushes a capture handler: while `capture` is
    /// on (the handler then follows the flag while the scope is open, handing requests to the
    /// handler below it once it is off); otherwise the scope is transparent.
    pub(crate) fn installs_handler(&self) -> bool {
        !self.bypass && self.shared.host_accessible && self.shared.capture.load(Ordering::Relaxed)
    }

    /// Opens a scope of this workspace in this thread's or task's stack: a cycle of its own, or
    /// (`with ws:` inside an open `with ws:` here, `nests`) a level nested in this stack's open
    /// cycle. The loop form always opens a cycle of its own: each iteration is one.
    pub(crate) fn enter_scope(
        &self,
        py: Python<'_>,
        me: &Bound<'_, PyAny>,
        nests: bool,
    ) -> PyResult<Arc<scope::ScopeState>> {
        let task = scope::current_task(py);
        let nested = nests && scope::is_open_here(py, me, task)?;
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
        let reopened = if nests { scope::reopen(py, me, installs, !nested, task).map_err(undo)? } else { None };
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
        self.remember_scope(py, &state).map_err(undo)?;
        Ok(state)
    }

    /// Lists `state` among the open scopes (room first: none is a `MemoryError`, and nothing is
    /// left half done).
    fn remember_scope(&self, py: Python<'_>, state: &Arc<scope::ScopeState>) -> PyResult<()> {
        let mut open = self.open_scopes.lock().unwrap_or_else(|e| e.into_inner());
        if open.try_reserve(1).is_err() {
            drop(open);
            state.close();
            return Err(errors::no_memory(py));
        }
        open.push(state.clone());
        Ok(())
    }

    /// The loop form's end of an iteration: closes `state`'s cycle and leaves its node in place
    /// for the next iteration.
    pub(crate) fn end_iteration(
        &self,
        py: Python<'_>,
        me: &Bound<'_, PyAny>,
        state: &scope::ScopeState,
    ) -> PyResult<()> {
        state.close();
        self.end_level(py, me, state, true)
    }

    /// Ends what `state` opened in the core (its cycle, or its nested level), then reports
    /// refused requests and escaped arrays (see `after_cycle`); nothing once destroyed.
    fn end_level(&self, py: Python<'_>, me: &Bound<'_, PyAny>, state: &scope::ScopeState, clean: bool) -> PyResult<()> {
        if self.shared.is_destroyed() {
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
        self.after_cycle(py, me, r, clean)
    }

    /// The loop form's next iteration in the scope of `state`, reopened in place (a cycle of its
    /// own); false when its node is no longer in this stack (then a scope is entered anew).
    pub(crate) fn begin_iteration(&self, py: Python<'_>, state: &scope::ScopeState, in_stack: bool) -> PyResult<bool> {
        if !in_stack {
            return Ok(false);
        }
        let opened = self.shared.lock().open_cycle();
        opened.map_err(|e| to_py(py, e))?;
        state.reopen(true);
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
        let failures = self.shared.has_failures.load(Ordering::Relaxed);
        let leaked = r.completed && r.escaped_blocks > 0 && self.cycle_detector;
        if failures || leaked {
            let names = calls::names(py)?;
            let args = [Arg::Bool(leaked && clean), Arg::Int(r.escaped_blocks), Arg::Int(r.escaped_bytes)];
            calls::call_method(me, &names.after_cycle, &args)?;
        }
        Ok(())
    }

    /// Closes this workspace's innermost scope here (see `__exit__`).
    pub(crate) fn exit_scope(&self, py: Python<'_>, me: &Bound<'_, PyAny>, clean: bool) -> PyResult<()> {
        match scope::pop(py, me, None)? {
            scope::Popped::Innermost(state) => self.exit_level(py, me, &state, None, clean),
            scope::Popped::Unlinked(state, innermost) => self.exit_level(py, me, &state, Some(innermost), clean),
            scope::Popped::NotHere => {
                // Not in this stack. The scope whose entering frame runs this exit is its owner's
                // (a generator or coroutine finalised on another thread or outside its task): it
                // closes. Any other exit from elsewhere changes nothing.
                let (owned, any_open) = {
                    let open = self.open_scopes.lock().unwrap_or_else(|e| e.into_inner());
                    (open.iter().rev().find(|s| s.entered_here()).cloned(), !open.is_empty())
                };
                let what = scope::describe(me);
                match owned {
                    Some(state) => {
                        state.close();
                        self.exit_level(py, me, &state, None, clean)
                    }
                    None if any_open => Err(errors::new(
                        py,
                        errors::Class::Scope,
                        &format!(
                            "{what} exited on another thread or task than the one that entered it; nothing changed"
                        ),
                    )),
                    None => Err(errors::new(py, errors::Class::Scope, &format!("{what} is not open (exited twice?)"))),
                }
            }
        }
    }

    /// The loop form leaves the scope of `state`, wherever it runs (its iterator dropped on another
    /// thread closes it all the same).
    pub(crate) fn exit_state(
        &self,
        py: Python<'_>,
        me: &Bound<'_, PyAny>,
        state: &Arc<scope::ScopeState>,
        clean: bool,
    ) -> PyResult<()> {
        match scope::pop(py, me, Some(state))? {
            scope::Popped::Innermost(_) => self.exit_level(py, me, state, None, clean),
            scope::Popped::Unlinked(_, innermost) => self.exit_level(py, me, state, Some(innermost), clean),
            scope::Popped::NotHere => {
                state.close();
                self.exit_level(py, me, state, None, clean)
            }
        }
    }

    /// After a scope left the stack: it leaves the open scopes, its level ends, and an exit out
    /// of order warns.
    fn exit_level(
        &self,
        py: Python<'_>,
        me: &Bound<'_, PyAny>,
        state: &Arc<scope::ScopeState>,
        unlinked_under: Option<String>,
        clean: bool,
    ) -> PyResult<()> {
        self.forget_scope(state);
        self.end_level(py, me, state, clean)?;
        if let Some(innermost) = unlinked_under {
            scope::warn_unlinked(py, &scope::describe(me), &innermost)?;
        }
        Ok(())
    }

    /// `empty` and `zeros`: an ndarray over workspace memory, or a `DeviceArray` for a device
    /// workspace.
    fn allocate_array<'py>(
        slf: &Bound<'py, Self>,
        shape: &Bound<'py, PyAny>,
        dtype: Option<&Bound<'py, PyAny>>,
        order: &str,
        zeroed: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        match slf.get().device.get() {
            Some(side) => devarray::new_device_array(slf, side, shape, dtype, order, zeroed),
            None => slf.get().new_array(slf.py(), shape, dtype, order, zeroed),
        }
    }
}

impl Drop for WorkspaceCore {
    /// The last Python reference is gone (a thread that ended without `destroy()`, a dropped
    /// local): nothing can open a cycle any more, so the workspace is destroyed and its memory
    /// returned but for the pages under arrays still alive, which go as those arrays die.
    fn drop(&mut self) {
        if let Some(state) = &self.state {
            state.shared.destroy();
        }
    }
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
        // What a workspace keeps (its state, its handler, its tables) lives on: it is made from
        // memory the system serves, never from the allocator's emergency reserve (which is for the
        // allocations on the way to an error, and would run out if workspaces kept it).
        let reserve = rustws_core::reserve::served();
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
        let state = Box::new(CoreState {
            shared,
            capsule,
            bypass,
            cycle_detector,
            memory,
            device: std::sync::OnceLock::new(),
            open_scopes: std::sync::Mutex::new(Vec::new()),
        });
        if rustws_core::reserve::served() != reserve {
            return Err(errors::no_memory(py)); // what was made goes back as it drops
        }
        Ok(WorkspaceCore { state: Some(state) })
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
        if self.shared.is_destroyed() {
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

    /// Whether `address` lies in this workspace's memory (see `Workspace::holds`).
    fn _holds(&self, address: usize) -> bool {
        self.shared.lock().holds(address)
    }

    /// Free and total bytes of this workspace's CUDA device (None for other memory).
    fn device_memory_info(&self, py: Python<'_>) -> PyResult<Option<(usize, usize)>> {
        match &self.memory.cuda {
            Some(c) => {
                c.memory_info().map(Some).map_err(|e| to_py(py, Error::device("cannot read the device's memory", e)))
            }
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
        self.shared.is_destroyed()
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
        slf.get().enter_scope(slf.py(), slf.as_any(), true)?;
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

    /// A snapshot of the statistics.
    fn _stats(&self) -> Stats {
        Stats::from(self.shared.lock().stats())
    }

    /// The errors of requests refused since the last call, as they would have been raised.
    fn _drain_failures(&self, py: Python<'_>) -> Vec<Py<PyAny>> {
        self.shared.drain_failures().into_iter().map(|e| to_py(py, e).into_value(py).into_any()).collect()
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
        self.shared.destroy();
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
        Self::allocate_array(slf, shape, dtype, order, false)
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
        Self::allocate_array(slf, shape, dtype, order, true)
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
        let state = if self.shared.is_destroyed() {
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
