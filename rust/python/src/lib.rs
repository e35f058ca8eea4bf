//! `rustws._rustws`: the one binding crate. It translates configurations and statistics between
//! Python and the core, maps each core error to one Python exception class (defined in
//! `rustws._errors`), exposes a workspace as `WorkspaceCore`, and installs NumPy's data-memory
//! handler. Policy, learning and arena logic all live in `rustws-core`.

mod handler;
mod scope;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use numpy::npyffi::npy_intp;
use numpy::{PyArrayDescr, PyArrayDescrMethods, PY_ARRAY_API};
use pyo3::exceptions::{PyMemoryError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyString, PyTuple};
use rustws_core::{
    parse_size as core_parse_size, AllocationPolicy, DebugMode, Error, LearningPolicy, LocationPolicy, MirroringPolicy,
    ResetPolicy, SpillPolicy, Workspace, WorkspaceConfiguration,
};

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
fn to_py(py: Python<'_>, e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::InvalidConfig { .. } => PyValueError::new_err(msg),
        Error::OutOfMemory { .. } | Error::SystemOutOfMemory { .. } => py_error(py, "WorkspaceOutOfMemory", msg),
        Error::Destroyed { .. } => py_error(py, "WorkspaceClosedError", msg),
        Error::NotOpen { .. } => py_error(py, "ScopeError", msg),
        Error::ForeignPointer { .. } => py_error(py, "WorkspaceError", msg),
        Error::Unavailable { .. } => py_error(py, "DeviceUnavailableError", msg),
    }
}

fn field_error(field: &str, message: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("invalid {field}: {message}"))
}

fn size_field(d: &Bound<'_, PyDict>, field: &'static str) -> PyResult<Option<u64>> {
    let Some(v) = d.get_item(field)? else { return Ok(None) };
    if let Ok(s) = v.cast::<PyString>() {
        return core_parse_size(s.to_str()?).map(Some).map_err(|m| field_error(field, m));
    }
    match v.extract::<i128>() {
        Ok(n) if n < 0 => Err(field_error(field, format!("must be >= 0, got {n}"))),
        Ok(n) => u64::try_from(n).map(Some).map_err(|_| field_error(field, format!("{n} is too large"))),
        Err(_) => {
            Err(PyTypeError::new_err(format!("{field} must be an int or a size string, got {}", v.get_type().name()?)))
        }
    }
}

fn policy_field<T: std::str::FromStr<Err = String>>(d: &Bound<'_, PyDict>, field: &'static str) -> PyResult<Option<T>> {
    let Some(v) = d.get_item(field)? else { return Ok(None) };
    let text: String = match v.getattr("value") {
        Ok(inner) if !v.is_instance_of::<PyString>() => inner.extract()?,
        _ => v.extract().map_err(|_| PyTypeError::new_err(format!("{field} must be a policy member or its name")))?,
    };
    text.parse::<T>().map(Some).map_err(|m| field_error(field, m))
}

const FIELDS: &[&str] = &[
    "initial_size",
    "min_size",
    "max_size",
    "overallocation_limit",
    "cycles_before_initialization",
    "policy_allocation",
    "policy_learning",
    "policy_spill",
    "policy_reset",
    "policy_mirroring",
    "policy_location",
    "temp_file_path",
    "temp_block_size",
    "helper_min_size",
    "helper_allow_fallback",
    "use_cycle_detector",
    "debug_mode",
];

/// Builds and validates a core configuration from a dict of the contract's fields.
fn config_from_dict(d: &Bound<'_, PyDict>) -> PyResult<WorkspaceConfiguration> {
    for key in d.keys() {
        let k: String = key.extract()?;
        if !FIELDS.contains(&k.as_str()) {
            return Err(PyTypeError::new_err(format!("unknown configuration field {k:?}")));
        }
    }
    let mut c = WorkspaceConfiguration::default();
    macro_rules! set {
        ($f:ident, size) => {
            if let Some(v) = size_field(d, stringify!($f))? {
                c.$f = v;
            }
        };
        ($f:ident, policy) => {
            if let Some(v) = policy_field(d, stringify!($f))? {
                c.$f = v;
            }
        };
        ($f:ident, bool) => {
            if let Some(v) = d.get_item(stringify!($f))? {
                c.$f = v
                    .extract::<bool>()
                    .map_err(|_| PyTypeError::new_err(concat!(stringify!($f), " must be a bool")))?;
            }
        };
    }
    set!(initial_size, size);
    set!(min_size, size);
    set!(max_size, size);
    set!(temp_block_size, size);
    set!(helper_min_size, size);
    set!(policy_allocation, policy);
    set!(policy_learning, policy);
    set!(policy_spill, policy);
    set!(policy_reset, policy);
    set!(policy_mirroring, policy);
    set!(policy_location, policy);
    set!(debug_mode, policy);
    set!(helper_allow_fallback, bool);
    set!(use_cycle_detector, bool);
    if let Some(v) = d.get_item("overallocation_limit")? {
        if v.is_instance_of::<pyo3::types::PyBool>() {
            return Err(PyTypeError::new_err("overallocation_limit must be a number"));
        }
        c.overallocation_limit =
            v.extract::<f64>().map_err(|_| PyTypeError::new_err("overallocation_limit must be a number"))?;
    }
    if let Some(v) = d.get_item("cycles_before_initialization")? {
        let n = v.extract::<i128>().map_err(|_| PyTypeError::new_err("cycles_before_initialization must be an int"))?;
        c.cycles_before_initialization = u64::try_from(n)
            .map_err(|_| field_error("cycles_before_initialization", format!("must be >= 0, got {n}")))?;
    }
    if let Some(v) = d.get_item("temp_file_path")? {
        if !v.is_none() {
            let os = py_fspath(&v)?;
            c.temp_file_path = Some(os.into());
        }
    }
    c.validate().map_err(|e| to_py(d.py(), e))?;
    Ok(c)
}

fn py_fspath(v: &Bound<'_, PyAny>) -> PyResult<String> {
    let os = v.py().import("os")?.call_method1("fspath", (v,)).map_err(|_| {
        PyTypeError::new_err(format!(
            "temp_file_path must be a str or os.PathLike, got {}",
            v.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        ))
    })?;
    os.extract::<String>().map_err(|_| PyTypeError::new_err("temp_file_path must be a text path"))
}

/// Parses a size with units (`"64MiB"`) into bytes.
#[pyfunction]
fn parse_size(text: &str) -> PyResult<u64> {
    core_parse_size(text).map_err(PyValueError::new_err)
}

/// Validates a configuration dict; raises `ValueError` naming the field.
#[pyfunction]
fn validate_config(config: &Bound<'_, PyDict>) -> PyResult<()> {
    config_from_dict(config).map(|_| ())
}

/// `RUSTWS_DEBUG_MODE` as the core reads it (`None` when unset or unknown).
#[pyfunction]
fn env_debug_mode() -> Option<&'static str> {
    DebugMode::from_env().map(DebugMode::as_str)
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
    d.set_item("cuda_backend", "core (cudarc, loaded at run time); Python device arrays: host fallback")?;
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

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A workspace: the core behind a lock, and its NumPy memory handler. Subclassed by
/// `rustws.Workspace`, which adds the context-manager protocol.
#[pyclass(subclass, frozen, module = "rustws._rustws")]
struct WorkspaceCore {
    shared: Arc<Shared>,
    capsule: Py<PyAny>,
    /// Debug mode BYPASS_EVERYTHING: arrays come from NumPy's default allocator.
    bypass: bool,
    /// Whether cycles make this workspace NumPy's current allocator.
    capture: std::sync::atomic::AtomicBool,
    /// `use_cycle_detector`: report arrays that outlive their cycle.
    cycle_detector: bool,
}

impl WorkspaceCore {
    /// Whether a cycle makes this workspace NumPy's current allocator.
    fn installs_handler(&self) -> bool {
        self.capture.load(Ordering::Relaxed) && !self.bypass
    }

    fn note_entered(&self) {
        self.shared.entered_on.store(scope::thread_ident(), Ordering::Relaxed);
    }

    /// For the message of a refused exit: was the scope entered on another thread?
    fn entered_elsewhere(&self) -> bool {
        let on = self.shared.entered_on.load(Ordering::Relaxed);
        on != 0 && on != scope::thread_ident()
    }
}

/// Pushes a scope for `owner` (a workspace or None). `install`: make `handler` (a capsule, or
/// None for NumPy's default) current; otherwise leave NumPy's handler alone.
#[pyfunction]
fn push_scope(
    py: Python<'_>,
    owner: &Bound<'_, PyAny>,
    install: bool,
    handler: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let how = match (install, handler) {
        (false, _) => scope::Install::Keep,
        (true, None) => scope::Install::Default,
        (true, Some(h)) => scope::Install::Handler(h),
    };
    scope::push(py, owner, how)?;
    if let Ok(ws) = owner.cast::<WorkspaceCore>() {
        ws.get().note_entered();
    }
    Ok(())
}

/// Pops the innermost scope, which must be `owner`'s (else `ScopeError`).
#[pyfunction]
fn pop_scope(py: Python<'_>, owner: &Bound<'_, PyAny>) -> PyResult<()> {
    scope::pop(py, owner, || owner.cast::<WorkspaceCore>().is_ok_and(|w| w.get().entered_elsewhere()))
}

/// The workspace of the innermost scope of this thread or task (None when there is none).
#[pyfunction]
fn current_workspace(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    scope::current(py)
}

fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type().name().map(|n| n.to_string()).unwrap_or_default()
}

fn extract_dim(item: &Bound<'_, PyAny>) -> PyResult<npy_intp> {
    item.extract::<npy_intp>()
        .map_err(|_| PyTypeError::new_err(format!("shape entries must be ints, got {}", type_name(item))))
}

/// The most dimensions an array may have (NumPy 2's limit; NumPy 1 refuses more than 32 itself).
const MAX_DIMS: usize = 64;

/// A shape on the stack: allocation-free for the hot path.
struct Dims {
    buf: [npy_intp; MAX_DIMS],
    len: usize,
}

impl Dims {
    fn new() -> Self {
        Dims { buf: [0; MAX_DIMS], len: 0 }
    }

    fn push(&mut self, d: npy_intp) -> PyResult<()> {
        if self.len == MAX_DIMS {
            return Err(PyValueError::new_err(format!("shape has more than {MAX_DIMS} dimensions")));
        }
        self.buf[self.len] = d;
        self.len += 1;
        Ok(())
    }

    fn as_mut_slice(&mut self) -> &mut [npy_intp] {
        &mut self.buf[..self.len]
    }
}

/// A shape: an int or a sequence of ints. Tuples (the common case) are read without detours.
fn extract_shape(shape: &Bound<'_, PyAny>) -> PyResult<Dims> {
    let mut dims = Dims::new();
    if let Ok(t) = shape.cast::<PyTuple>() {
        for item in t.iter() {
            dims.push(extract_dim(&item)?)?;
        }
        return Ok(dims);
    }
    if shape.is_instance_of::<PyInt>() {
        dims.push(extract_dim(shape)?)?;
        return Ok(dims);
    }
    if shape.is_instance_of::<PyString>() || shape.is_instance_of::<pyo3::types::PyBytes>() {
        return Err(PyTypeError::new_err(format!(
            "shape must be an int or a sequence of ints, got {}",
            type_name(shape)
        )));
    }
    if shape.hasattr("__index__")? && !shape.hasattr("__len__")? {
        dims.push(extract_dim(shape)?)?;
        return Ok(dims);
    }
    let iter = shape.try_iter().map_err(|_| {
        PyTypeError::new_err(format!("shape must be an int or a sequence of ints, got {}", type_name(shape)))
    })?;
    for item in iter {
        dims.push(extract_dim(&item?)?)?;
    }
    Ok(dims)
}

fn extract_descr<'py>(py: Python<'py>, dtype: Option<&Bound<'py, PyAny>>) -> PyResult<Bound<'py, PyArrayDescr>> {
    let descr = match dtype {
        None => numpy::dtype::<f64>(py),
        Some(d) if d.is_none() => numpy::dtype::<f64>(py),
        Some(d) => PyArrayDescr::new(py, d)?,
    };
    if descr.has_object() {
        return Err(PyTypeError::new_err(format!(
            "dtype {} holds Python objects; workspace memory never holds Python references",
            descr.str()?
        )));
    }
    Ok(descr)
}

/// `PyArrayObject_fields` of NumPy >= 1.22 up to its `mem_handler` field. The layout is checked
/// once at run time against an array NumPy made (see `direct_arrays_supported`).
#[repr(C)]
struct ArrayFields {
    ob_base: pyo3::ffi::PyObject,
    data: *mut std::ffi::c_char,
    nd: std::ffi::c_int,
    dimensions: *mut npy_intp,
    strides: *mut npy_intp,
    base: *mut pyo3::ffi::PyObject,
    descr: *mut std::ffi::c_void,
    flags: std::ffi::c_int,
    weakreflist: *mut pyo3::ffi::PyObject,
    buffer_info: *mut std::ffi::c_void,
    mem_handler: *mut pyo3::ffi::PyObject,
}

const NPY_ARRAY_OWNDATA: std::ffi::c_int = 0x0004;
const NPY_ARRAY_C_CONTIGUOUS: std::ffi::c_int = 0x0001;
const NPY_ARRAY_F_CONTIGUOUS: std::ffi::c_int = 0x0002;
const NPY_ARRAY_ALIGNED: std::ffi::c_int = 0x0100;
const NPY_ARRAY_WRITEABLE: std::ffi::c_int = 0x0400;

/// Whether arrays can be built over workspace memory directly: NumPy must keep the handler of an
/// array where `ArrayFields` says. Checked once, on an array NumPy allocates with its default
/// handler.
fn direct_arrays_supported(py: Python<'_>) -> bool {
    static SUPPORTED: pyo3::sync::PyOnceLock<bool> = pyo3::sync::PyOnceLock::new();
    *SUPPORTED.get_or_init(py, || {
        let probe = || -> PyResult<bool> {
            let previous = handler::set_handler(py, None)?;
            let default = handler::get_handler(py);
            let mut dims = [4 as npy_intp];
            // SAFETY: one dimension in `dims`; the descriptor reference is stolen.
            let raw = unsafe {
                PY_ARRAY_API.PyArray_Empty(py, 1, dims.as_mut_ptr(), numpy::dtype::<f64>(py).into_ptr().cast(), 0)
            };
            handler::set_handler(py, Some(&previous))?;
            let default = default?;
            // SAFETY: a new reference or NULL with an exception set.
            let arr = unsafe { Bound::from_owned_ptr_or_err(py, raw) }?;
            // SAFETY: `arr` is a live ndarray; we only read fields NumPy >= 1.22 defines.
            let f = unsafe { &*(arr.as_ptr() as *const ArrayFields) };
            Ok(f.mem_handler == default.as_ptr()
                && f.flags & NPY_ARRAY_OWNDATA != 0
                && f.flags & NPY_ARRAY_WRITEABLE != 0
                && f.nd == 1)
        };
        probe().unwrap_or(false)
    })
}

impl WorkspaceCore {
    fn new_array<'py>(
        &self,
        py: Python<'py>,
        shape: &Bound<'py, PyAny>,
        dtype: Option<&Bound<'py, PyAny>>,
        order: &str,
        zeroed: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let mut shape = extract_shape(shape)?;
        let dims = shape.as_mut_slice();
        let descr = extract_descr(py, dtype)?;
        let fortran = match order {
            "C" | "c" => 0,
            "F" | "f" => 1,
            other => return Err(PyValueError::new_err(format!("order must be 'C' or 'F', got {other:?}"))),
        };
        if self.shared.destroyed.load(Ordering::Relaxed) {
            return Err(to_py(py, Error::Destroyed { workspace: self.shared.name.clone() }));
        }
        let capsule = self.capsule.bind(py);
        if !self.bypass && descr.itemsize() > 0 && direct_arrays_supported(py) {
            return self.new_array_direct(py, dims, descr, fortran, zeroed);
        }
        // Through NumPy's allocation path, with the right handler current.
        let current = handler::get_handler(py)?;
        let wanted = if self.bypass { None } else { Some(capsule) };
        let swap = match wanted {
            Some(c) => !current.is(c),
            None => true,
        };
        let previous = if swap { Some(handler::set_handler(py, wanted)?) } else { None };
        handler::take_last_refusal();
        let nd = dims.len() as std::ffi::c_int;
        // SAFETY: `dims` holds `nd` dimensions and outlives the call; the descriptor reference is
        // stolen by NumPy, as both functions document.
        let raw = unsafe {
            if zeroed {
                PY_ARRAY_API.PyArray_Zeros(py, nd, dims.as_mut_ptr(), descr.into_ptr().cast(), fortran)
            } else {
                PY_ARRAY_API.PyArray_Empty(py, nd, dims.as_mut_ptr(), descr.into_ptr().cast(), fortran)
            }
        };
        // SAFETY: a new reference, or NULL with an exception set.
        let result = unsafe { Bound::from_owned_ptr_or_err(py, raw) };
        if let Some(prev) = previous {
            handler::set_handler(py, Some(&prev))?;
        }
        match result {
            Ok(a) => Ok(a),
            Err(e) if e.is_instance_of::<PyMemoryError>(py) => match handler::take_last_refusal() {
                Some(refusal) => Err(to_py(py, refusal)),
                None => Err(e),
            },
            Err(e) => Err(e),
        }
    }

    /// Allocates the data from the workspace, wraps it in an array, and hands the array the
    /// workspace's handler so that NumPy frees the data back to it (NEP 49: `OWNDATA` data must
    /// come with its `mem_handler`).
    fn new_array_direct<'py>(
        &self,
        py: Python<'py>,
        dims: &mut [npy_intp],
        descr: Bound<'py, PyArrayDescr>,
        fortran: std::ffi::c_int,
        zeroed: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let mut nbytes = descr.itemsize();
        for &d in dims.iter() {
            if d < 0 {
                return Err(PyValueError::new_err("negative dimensions are not allowed"));
            }
            nbytes = nbytes.checked_mul(d as usize).filter(|n| *n <= isize::MAX as usize).ok_or_else(|| {
                PyValueError::new_err(
                    "array is too big; `arr.size * arr.dtype.itemsize` is larger than the maximum possible size.",
                )
            })?;
        }
        let data = {
            let mut ws = self.shared.lock();
            if zeroed {
                ws.alloc_zeroed(nbytes.max(1))
            } else {
                ws.alloc(nbytes.max(1))
            }
        }
        .map_err(|e| to_py(py, e))?;
        let nd = dims.len() as std::ffi::c_int;
        // SAFETY: `dims` holds `nd` dimensions; `data` is a live workspace block of at least
        // `nbytes` bytes, 64-byte aligned; the descriptor reference is stolen by NumPy.
        let raw = unsafe {
            let array_type = numpy::npyffi::get_type_object(py, numpy::npyffi::NpyTypes::PyArray_Type);
            PY_ARRAY_API.PyArray_NewFromDescr(
                py,
                array_type,
                descr.into_ptr().cast(),
                nd,
                dims.as_mut_ptr(),
                std::ptr::null_mut(),
                data.as_ptr().cast(),
                NPY_ARRAY_WRITEABLE
                    | NPY_ARRAY_ALIGNED
                    | if fortran != 0 { NPY_ARRAY_F_CONTIGUOUS } else { NPY_ARRAY_C_CONTIGUOUS },
                std::ptr::null_mut(),
            )
        };
        if raw.is_null() {
            // SAFETY: the block is ours and no array took it.
            unsafe { self.shared.lock().free(data) };
            return Err(PyErr::fetch(py));
        }
        // SAFETY: `raw` is a new ndarray built over external data, so NumPy left its handler
        // NULL and OWNDATA clear; the layout was checked by `direct_arrays_supported`. Setting
        // both makes NumPy free `data` through our handler (which holds the workspace alive).
        unsafe {
            let f = &mut *(raw as *mut ArrayFields);
            debug_assert!(f.mem_handler.is_null());
            pyo3::ffi::Py_XDECREF(f.mem_handler);
            f.mem_handler = self.capsule.clone_ref(py).into_ptr();
            f.flags |= NPY_ARRAY_OWNDATA;
            Ok(Bound::from_owned_ptr(py, raw))
        }
    }
}

#[pymethods]
impl WorkspaceCore {
    #[new]
    fn new(py: Python<'_>, name: &str, config: &Bound<'_, PyDict>) -> PyResult<Self> {
        let c = config_from_dict(config)?;
        let ws = Workspace::new(name, c).map_err(|e| to_py(py, e))?;
        let bypass = ws.debug_mode() == DebugMode::BypassEverything;
        let cycle_detector = ws.config().use_cycle_detector;
        let shared = Arc::new(Shared::new(NEXT_ID.fetch_add(1, Ordering::Relaxed), ws));
        let capsule = handler::new_capsule(py, &shared)?;
        Ok(WorkspaceCore { shared, capsule, bypass, capture: true.into(), cycle_detector })
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

    /// Whether cycles make this workspace NumPy's current allocator.
    #[getter]
    fn capture(&self) -> bool {
        self.capture.load(Ordering::Relaxed)
    }

    #[setter]
    fn set_capture(&self, value: bool) {
        self.capture.store(value, Ordering::Relaxed);
    }

    /// Opens a cycle (or nests in the open one) and makes this workspace current.
    fn __enter__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, Self>> {
        let py = slf.py();
        let me = slf.get();
        me.shared.lock().enter().map_err(|e| to_py(py, e))?;
        let capsule = me.capsule.bind(py);
        let how = if me.installs_handler() { scope::Install::Handler(capsule) } else { scope::Install::Keep };
        if let Err(e) = scope::push(py, slf.as_any(), how) {
            let _ = me.shared.lock().exit();
            return Err(e);
        }
        me.note_entered();
        Ok(slf.clone())
    }

    /// Closes the innermost scope; the outermost level ends the cycle. Reports refused
    /// requests and escaped arrays through `_after_cycle` when there are any.
    #[pyo3(signature = (exc_type=None, _exc=None, _tb=None))]
    fn __exit__(
        slf: &Bound<'_, Self>,
        exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let py = slf.py();
        let me = slf.get();
        scope::pop(py, slf.as_any(), || me.entered_elsewhere())?;
        if me.shared.destroyed.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let r = me.shared.lock().exit().map_err(|e| to_py(py, e))?;
        let failures = me.shared.has_failures.load(Ordering::Relaxed);
        let leaked = r.completed && r.escaped_blocks > 0 && me.cycle_detector;
        if failures || leaked {
            let clean = exc_type.is_none_or(|t| t.is_none());
            slf.call_method1("_after_cycle", (leaked && clean, r.escaped_blocks, r.escaped_bytes))?;
        }
        Ok(false)
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

    /// Whether `array` (an ndarray that owns its data) holds memory of this workspace: its
    /// handler is this workspace's and its block is in the arena or external, not a bypass block
    /// (`helper_min_size`, debug bypass, allocations after `destroy()`).
    fn _holds(&self, py: Python<'_>, array: &Bound<'_, PyAny>) -> PyResult<bool> {
        if !array.is_instance_of::<numpy::PyUntypedArray>() {
            return Ok(false);
        }
        if !direct_arrays_supported(py) {
            return Ok(true); // the layout is unknown: the handler's name is all there is
        }
        // SAFETY: `array` is a live ndarray and the layout of `ArrayFields` was checked.
        let f = unsafe { &*(array.as_ptr() as *const ArrayFields) };
        let Some(data) = std::ptr::NonNull::new(f.data.cast::<u8>()) else { return Ok(false) };
        if f.mem_handler != self.capsule.as_ptr() || f.flags & NPY_ARRAY_OWNDATA == 0 {
            return Ok(false);
        }
        let ws = self.shared.lock();
        // SAFETY: NumPy allocated `data` through this workspace's handler (the array's
        // mem_handler is our capsule and it owns its data), and the array is alive, so the block
        // is live in this workspace.
        let info = unsafe { ws.block_info(data) };
        Ok(info.kind != rustws_core::BlockKind::Bypass)
    }

    /// Sizes the arena now from what was learned.
    fn initialize(&self, py: Python<'_>) -> PyResult<()> {
        self.shared.lock().initialize().map_err(|e| to_py(py, e))
    }

    /// Core part of `destroy()`: memory under live arrays is kept until they die.
    fn _destroy(&self) {
        self.shared.destroyed.store(true, Ordering::Relaxed);
        self.shared.lock().destroy();
    }

    /// A new uninitialised array over workspace memory.
    #[pyo3(signature = (shape, dtype=None, order="C"))]
    fn empty<'py>(
        &self,
        py: Python<'py>,
        shape: &Bound<'py, PyAny>,
        dtype: Option<&Bound<'py, PyAny>>,
        order: &str,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.new_array(py, shape, dtype, order, false)
    }

    /// A new zero-filled array over workspace memory.
    #[pyo3(signature = (shape, dtype=None, order="C"))]
    fn zeros<'py>(
        &self,
        py: Python<'py>,
        shape: &Bound<'py, PyAny>,
        dtype: Option<&Bound<'py, PyAny>>,
        order: &str,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.new_array(py, shape, dtype, order, true)
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
    m.add_function(wrap_pyfunction!(parse_size, m)?)?;
    m.add_function(wrap_pyfunction!(validate_config, m)?)?;
    m.add_function(wrap_pyfunction!(env_debug_mode, m)?)?;
    m.add_function(wrap_pyfunction!(set_handler, m)?)?;
    m.add_function(wrap_pyfunction!(get_handler, m)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_probe, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_device_count, m)?)?;
    m.add_function(wrap_pyfunction!(push_scope, m)?)?;
    m.add_function(wrap_pyfunction!(pop_scope, m)?)?;
    m.add_function(wrap_pyfunction!(current_workspace, m)?)?;
    m.add("SCOPES", scope::scope_var(m.py())?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("HEADER_BYTES", Workspace::header_bytes())?;
    Ok(())
}
