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

use crate::config::config_from_dict;
use crate::devarray::{self, DeviceSide};
use crate::device::{reclaim, DeviceBuffer, Source};
use crate::errors::{self, to_py};
use crate::handler;
use crate::shared::Shared;
use crate::state::CoreState;
use crate::{arrays, cycles, scope};

/// A workspace: the core behind a lock, and its NumPy memory handler. Subclassed by
/// `rustws.Workspace`, which adds the context-manager protocol.
#[pyclass(subclass, frozen, module = "rustws._rustws")]
pub(crate) struct WorkspaceCore {
    /// Always there once the object is made. When Python cannot make a subclass's instance
    /// dictionary (out of memory), it deallocates the object before PyO3 has written this: the
    /// object's memory is zero-filled, which reads as `None`, so that drop is harmless.
    state: Option<Arc<CoreState>>,
}

impl WorkspaceCore {
    /// `__enter__` of an observed workspace: an outermost cycle's opening counts its page faults
    /// for the cycle's log, here rather than in a Python `__enter__` around this one (Python code
    /// between the cycle's opening and the `with` block could raise, a `KeyboardInterrupt`, and a
    /// `with` whose `__enter__` raises never exits).
    #[cold]
    #[inline(never)]
    fn enter_observed(&self, py: Python<'_>, me: &Bound<'_, PyAny>) -> PyResult<()> {
        let counted = !self.shared.lock().is_open();
        let before = if counted { thread_faults() } else { 0 };
        self.enter_with(py, me)?;
        if counted {
            let faults = thread_faults().saturating_sub(before);
            let cycle = self.shared.lock().generation();
            self.shared.opening_faults[0].store(faults, Ordering::Relaxed);
            self.shared.opening_faults[1].store(cycle, Ordering::Relaxed);
        }
        Ok(())
    }

    /// What the object holds, shared with its loop-form iterators.
    fn core(&self) -> Arc<CoreState> {
        self.state.clone().expect("a workspace is made before it is used")
    }
}

impl std::ops::Deref for WorkspaceCore {
    type Target = CoreState;

    fn deref(&self) -> &CoreState {
        self.state.as_deref().expect("a workspace is made before it is used")
    }
}

impl WorkspaceCore {
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
            Some(side) if !side.on_device => {
                let host = slf.get().new_array(slf.py(), shape, dtype, order, zeroed)?;
                devarray::wrap_host(slf.py(), &host, slf.as_any(), side.name.to_str(slf.py())?).map(Bound::into_any)
            }
            Some(side) => {
                devarray::new_device_array(slf.as_any(), &slf.get().memory, side, shape, dtype, order, zeroed)
            }
            None => slf.get().new_array(slf.py(), shape, dtype, order, zeroed),
        }
    }
}

impl WorkspaceCore {
    /// `empty_like` / `zeros_like`: the direct path where it applies, else `_like` (Python).
    fn like<'py>(
        slf: &Bound<'py, Self>,
        a: &Bound<'py, PyAny>,
        dtype: Option<&Bound<'py, PyAny>>,
        order: Option<&Bound<'py, PyAny>>,
        subok: Option<&Bound<'py, PyAny>>,
        shape: Option<&Bound<'py, PyAny>>,
        zeroed: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let me = slf.get();
        let keeps_order = order.is_none_or(|o| o.extract::<&str>().is_ok_and(|s| s == "K"));
        if dtype.is_none() && shape.is_none() && keeps_order && me.device.get().is_none() {
            let (shared, capsule) = (&me.shared, me.capsule.bind(py));
            if let Some(array) = arrays::like_array(py, shared, capsule, shared.bypass, a, zeroed)? {
                return Ok(array);
            }
        }
        let order = match order {
            Some(o) => o.clone(),
            None => pyo3::types::PyString::new(py, "K").into_any(),
        };
        let subok = match subok {
            Some(s) => s.clone(),
            None => pyo3::types::PyBool::new(py, true).to_owned().into_any(),
        };
        slf.call_method1("_like", (a, dtype, order, subok, shape, zeroed))
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
    /// `backend`: None for host memory as the configuration's location policy says, `"cuda"`
    /// for the memory of CUDA device `ordinal`, `"pinned"` for page-locked host memory registered
    /// with that device's driver, `"standin"` for host memory that the workspace treats as device
    /// memory (headers kept apart, every access through the backend). The Python layer parses
    /// device strings; the ordinal arrives as a number.
    #[new]
    #[pyo3(signature = (name, config, backend=None, ordinal=0))]
    fn new(
        py: Python<'_>,
        name: &str,
        config: &Bound<'_, PyDict>,
        backend: Option<&str>,
        ordinal: usize,
    ) -> PyResult<Self> {
        // What a workspace keeps (its state, its handler, its tables) lives on: it is made from
        // memory the system serves, never from the allocator's emergency reserve (which is for the
        // allocations on the way to an error, and would run out if workspaces kept it).
        let reserve = rustws_core::reserve::served();
        // A value of RUSTWS_DEBUG_MODE that names no mode must not silently leave workspaces on.
        DebugMode::env_override().map_err(|e| to_py(py, e))?;
        let c = config_from_dict(config)?;
        let source = match backend {
            None => None,
            Some("standin") => Some(Source::host(Arc::new(OpaqueMemory))),
            Some("cuda") => Some(Source::cuda(Arc::new(CudaMemory::new(ordinal).map_err(|e| to_py(py, e))?))),
            Some("pinned") => {
                let pinned = Arc::new(PinnedHostMemory::new(ordinal).map_err(|e| to_py(py, e))?);
                Some(Source::with_deferred(pinned.clone(), pinned))
            }
            Some(other) => {
                return Err(PyValueError::new_err(format!(
                    "invalid backend {other:?}: expected None, 'cuda', 'pinned' or 'standin'"
                )))
            }
        };
        let device = match backend {
            Some("cuda") => "cuda",
            Some("standin") => "standin",
            _ => "cpu",
        };
        let (ws, source) = match source {
            None => {
                let ws = Workspace::new(name, c).map_err(|e| to_py(py, e))?;
                let source = Source::host(ws.backend().clone());
                (ws, source)
            }
            Some(source) => {
                let backend: Arc<dyn Backend> = source.backend.clone();
                let ws = Workspace::with_backend(name, c, backend).map_err(|e| to_py(py, e))?;
                (ws, source)
            }
        };
        let cycle_detector = ws.config().use_cycle_detector;
        let shared = Arc::new(Shared::new(ws));
        if !crate::shared::list(&shared, device, ordinal) {
            return Err(errors::no_memory(py));
        }
        let capsule = handler::new_capsule(py, &shared)?;
        let memory = source.into_memory(shared.clone());
        let state = Arc::new(CoreState {
            shared,
            capsule,
            cycle_detector,
            memory,
            device: std::sync::OnceLock::new(),
            open_scopes: crate::shared::GilCell::new(Vec::new()),
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
        self.shared.check_alive().map_err(|e| to_py(py, e))?;
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
        let me = slf.get();
        if me.shared.observed.load(Ordering::Relaxed) {
            me.enter_observed(slf.py(), slf.as_any())?;
        } else {
            me.enter_with(slf.py(), slf.as_any())?;
        }
        Ok(slf.clone())
    }

    /// Closes this workspace's innermost scope here; a cycle's scope ends the cycle. Reports
    /// refused requests and escaped arrays through `_after_cycle` when there are any (every exit,
    /// while the workspace is observed). A scope that is not the innermost is unlinked and the
    /// exit warns (`ResourceWarning`); one that is not in this thread's or task's stack at all is
    /// closed all the same where the frame that entered it runs the exit (a generator finalised on
    /// another thread), levels nested in its cycle ending with it, and otherwise the exit raises
    /// `ScopeError` and changes nothing.
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
        cycles::Cycles::new(slf.as_any(), slf.get().core(), iterable)
    }

    /// A snapshot of the statistics: their values in the order of `STATS_FIELDS`.
    fn _stats(&self) -> [u64; 11] {
        self.shared.lock().stats().values()
    }

    /// What the cycle that closed last did: (cycle, allocations, spills, peak bytes, arena
    /// capacity before, arena capacity after, pinned bytes), from the core's own report.
    fn _last_cycle(&self) -> (u64, u64, u64, u64, u64, u64, u64) {
        let r = self.shared.lock().last_cycle();
        (r.cycle, r.allocations, r.spills, r.peak_bytes, r.arena_before, r.arena_after, r.pinned_bytes)
    }

    /// Whether NumPy allocates from this workspace here already (a capturing scope of it is the
    /// innermost, open on this thread and task).
    fn _captures_here(&self, py: Python<'_>) -> PyResult<bool> {
        scope::captures_here(py, &self.shared)
    }

    /// Whether every exit reports through `_after_cycle` (the Python layer's cycle log).
    fn _observe(&self, on: bool) {
        self.shared.observed.store(on, Ordering::Relaxed);
    }

    /// The page faults of the thread while the last observed outermost cycle opened, and that
    /// cycle's number; (0, 0) once taken, or where none were counted.
    fn _opening_faults(&self) -> (u64, u64) {
        let faults = self.shared.opening_faults[0].swap(0, Ordering::Relaxed);
        (faults, if faults > 0 { self.shared.opening_faults[1].load(Ordering::Relaxed) } else { 0 })
    }

    /// Raises `WorkspaceClosedError` once the workspace is destroyed.
    fn _check_alive(&self, py: Python<'_>) -> PyResult<()> {
        self.shared.check_alive().map_err(|e| to_py(py, e))
    }

    /// A scope that makes this workspace current (and capturing, while it captures) without
    /// opening a cycle: `Workspace.borrow()`.
    fn _borrow(slf: &Bound<'_, Self>) -> PyResult<scope::Scope> {
        let me = slf.get();
        me.shared.check_alive().map_err(|e| to_py(slf.py(), e))?;
        let capsule = me.capsule.clone_ref(slf.py());
        Ok(scope::Scope::of_workspace(slf.clone().into_any().unbind(), me.shared.clone(), capsule))
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
    #[pyo3(signature = (shape, dtype=None, order=Some("C")), text_signature = "(self, /, shape, dtype=None, order='C')")]
    fn empty<'py>(
        slf: &Bound<'py, Self>,
        shape: &Bound<'py, PyAny>,
        dtype: Option<&Bound<'py, PyAny>>,
        order: Option<&str>,
    ) -> PyResult<Bound<'py, PyAny>> {
        Self::allocate_array(slf, shape, dtype, order.unwrap_or("C"), false)
    }

    /// A new zero-filled array over workspace memory: an ndarray, or a `DeviceArray` for a
    /// device workspace.
    #[pyo3(signature = (shape, dtype=None, order=Some("C")), text_signature = "(self, /, shape, dtype=None, order='C')")]
    fn zeros<'py>(
        slf: &Bound<'py, Self>,
        shape: &Bound<'py, PyAny>,
        dtype: Option<&Bound<'py, PyAny>>,
        order: Option<&str>,
    ) -> PyResult<Bound<'py, PyAny>> {
        Self::allocate_array(slf, shape, dtype, order.unwrap_or("C"), true)
    }

    /// As `np.asarray`, with the result in this workspace. A list or tuple, where the workspace
    /// captures here, is made by NumPy directly (it is new memory, served by the capture);
    /// anything else goes through `_asarray`.
    #[pyo3(signature = (a, dtype=None, order=None))]
    fn asarray<'py>(
        slf: &Bound<'py, Self>,
        a: &Bound<'py, PyAny>,
        dtype: Option<&Bound<'py, PyAny>>,
        order: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let me = slf.get();
        let sequence =
            a.is_exact_instance_of::<pyo3::types::PyList>() || a.is_exact_instance_of::<pyo3::types::PyTuple>();
        let plain = sequence && dtype.is_none() && order.is_none() && !me.shared.is_destroyed();
        if plain && scope::captures_here(py, &me.shared)? {
            return arrays::sequence_array(py, &me.shared, a);
        }
        slf.call_method1("_asarray", (a, dtype, order))
    }

    /// As `np.empty_like`, over workspace memory: the shape, dtype and layout of a contiguous
    /// ndarray prototype are read and the array built here directly; anything else (subclasses,
    /// a dtype, order or shape given, other prototypes) goes through `_like`.
    #[pyo3(signature = (a, dtype=None, order=None, subok=None, shape=None))]
    fn empty_like<'py>(
        slf: &Bound<'py, Self>,
        a: &Bound<'py, PyAny>,
        dtype: Option<&Bound<'py, PyAny>>,
        order: Option<&Bound<'py, PyAny>>,
        subok: Option<&Bound<'py, PyAny>>,
        shape: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        Self::like(slf, a, dtype, order, subok, shape, false)
    }

    /// As `np.zeros_like`, over workspace memory (see `empty_like`).
    #[pyo3(signature = (a, dtype=None, order=None, subok=None, shape=None))]
    fn zeros_like<'py>(
        slf: &Bound<'py, Self>,
        a: &Bound<'py, PyAny>,
        dtype: Option<&Bound<'py, PyAny>>,
        order: Option<&Bound<'py, PyAny>>,
        subok: Option<&Bound<'py, PyAny>>,
        shape: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        Self::like(slf, a, dtype, order, subok, shape, true)
    }

    /// A new ndarray over workspace memory (refused for device memory), whatever the workspace.
    #[pyo3(
        signature = (shape, dtype=None, order=Some("C"), zeroed=false),
        text_signature = "(self, /, shape, dtype=None, order='C', zeroed=False)"
    )]
    fn _ndarray<'py>(
        &self,
        py: Python<'py>,
        shape: &Bound<'py, PyAny>,
        dtype: Option<&Bound<'py, PyAny>>,
        order: Option<&str>,
        zeroed: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.new_array(py, shape, dtype, order.unwrap_or("C"), zeroed)
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

/// Minor page faults of the calling thread so far (0 where the system does not say).
fn thread_faults() -> u64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `getrusage` writes a `rusage` into the memory given, which is one.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, usage.as_mut_ptr()) };
    if rc != 0 {
        return 0;
    }
    // SAFETY: written by the call above, which succeeded (and zeroed before it).
    u64::try_from(unsafe { usage.assume_init() }.ru_minflt).unwrap_or(0)
}
