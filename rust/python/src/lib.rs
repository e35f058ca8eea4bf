//! `rustws._rustws`: the one binding crate. It translates configurations and statistics between
//! Python and the core, maps each core error to one Python exception class (defined in
//! `rustws._errors`), exposes a workspace as `WorkspaceCore`, and installs NumPy's data-memory
//! handler. Policy, learning and arena logic all live in `rustws-core`.
//!
//! One module per concept, each building only on those below it (no two import each other):
//! `calls`, `errors`, `threadstate`, `panics` (leaves: calls into Python, the error mapping, the
//! thread's context, the panic hook); `shared` (what the handlers and the Python side share: a
//! workspace's core behind its lock, a scope's state); `config` (configurations); `handler`
//! (NumPy's data-memory handlers); `scope` (the capture scopes in NumPy's context variable);
//! `arrays`, `device`, `dlpack`, `dispose`, `devarray` (ndarrays over workspace memory, device
//! blocks and PyTorch's allocator, DLPack capsules, dispose scopes, `DeviceArray`); `state`
//! (what a workspace object holds, and its cycles and scopes); `cycles` (the loop form);
//! `workspace` (`WorkspaceCore`, the Python class). This file holds the module's functions and
//! its registration.

mod arrays;
mod calls;
mod config;
mod cycles;
mod devarray;
mod device;
mod dispose;
mod dlpack;
mod errors;
mod handler;
mod memory;
mod once;
mod panics;
mod scope;
mod shared;
mod stacks;
mod state;
mod threadstate;
mod workspace;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use rustws_core::{
    AllocationPolicy, DebugMode, LearningPolicy, LocationPolicy, MirroringPolicy, ResetPolicy, SpillPolicy, Workspace,
};

use arrays::{direct_arrays_supported, ArrayFields, NPY_ARRAY_OWNDATA};
use config::{parse_size, placed_size, validate_config};
use devarray::DeviceArray;
use device::DeviceBuffer;
use dispose::DisposeStatistics;
use errors::to_py;
pub(crate) use workspace::WorkspaceCore;

/// Routes this thread's requests from PyTorch's pluggable allocator to `workspace` on device
/// `ordinal` (None: refuse them).
#[pyfunction]
#[pyo3(signature = (workspace, ordinal=0))]
fn torch_route(workspace: Option<&Bound<'_, WorkspaceCore>>, ordinal: i32) {
    device::torch_route(workspace.map(|w| w.get().memory.clone()), ordinal);
}

/// Adds `workspace` as the route of every thread without one of its own on device `ordinal`
/// (innermost until removed).
#[pyfunction]
fn torch_share(workspace: &Bound<'_, WorkspaceCore>, ordinal: i32) {
    device::torch_share(workspace.get().memory.clone(), ordinal);
}

/// Removes the innermost shared route of `workspace` on device `ordinal`; returns whether there
/// was one.
#[pyfunction]
fn torch_unshare(workspace: &Bound<'_, WorkspaceCore>, ordinal: i32) -> bool {
    device::torch_unshare(&workspace.get().memory, ordinal)
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

/// Calls `make(*args, **kwargs)` with `handler` (a `mem_handler` capsule, or None for NumPy's
/// default) current in this context, and the previous one current again after, however the call
/// ends: one step for Python, so that no exception (a `KeyboardInterrupt` included, which lands
/// between bytecodes) can leave the handler switched, as it could between a `set_handler` and the
/// `try` that restores it.
#[pyfunction]
#[pyo3(signature = (handler, make, args, kwargs=None))]
fn call_with_handler<'py>(
    py: Python<'py>,
    handler: Option<&Bound<'py, PyAny>>,
    make: &Bound<'py, PyAny>,
    args: &Bound<'py, PyTuple>,
    kwargs: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyAny>> {
    if let Some(h) = handler {
        if !h.is_instance_of::<pyo3::types::PyCapsule>() {
            return Err(PyTypeError::new_err("handler must be a mem_handler capsule or None"));
        }
    }
    let previous = handler::set_handler(py, handler)?;
    let made = make.call(args, kwargs);
    // The call's own error comes first; a failed restore is reported where the call succeeded.
    let restored = handler::set_handler(py, Some(&previous));
    let made = made?;
    restored?;
    Ok(made)
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
    // Whether scopes tell the context that opened them from copies of it (see `threadstate`).
    d.set_item("scopes_follow_contexts", threadstate::knows_contexts())?;
    // The emergency reserve of the allocator (see `panics`): allocations it served while the system
    // refused, and bytes of it in use now.
    d.set_item("reserve_served", rustws_core::reserve::served())?;
    d.set_item("reserve_in_use", rustws_core::reserve::in_use())?;
    // Empty regions that workspaces entered in turn hand on (see `rustws_core::lot`): how many
    // wait now, and the bytes they serve.
    let (parked, parked_bytes) = rustws_core::lot::parked();
    d.set_item("parked_regions", parked)?;
    d.set_item("parked_bytes", parked_bytes)?;
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
    handler::owner_of(&handler, data)
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

// The bindings keep state that only the GIL guards (`shared::GilCell`), and NumPy's small-block
// cache, which the capture handler passes requests to, needs it too: on a free-threaded
// interpreter, importing the module turns the GIL back on.
#[pymodule(gil_used = true)]
fn _rustws(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    // What raising an error, capturing and ending a cycle need is made now, not first where memory
    // ran out.
    panics::install_panic_hook();
    calls::init(py)?;
    errors::init(py)?;
    threadstate::init(py)?;
    handler::init_default_allocator(py)?;
    cycles::init(py);
    shared::init_frames(py);
    // rust-numpy's cells (its C-API table, the NumPy version) are made now, on the importing
    // thread: made first on another thread, PyO3's cells can be left half made by a fork (see
    // `once`); this module's own cells are made so that they cannot. (Nothing here sets NumPy's
    // context variable: set at import, it slowed every later lookup of it in this context.)
    numpy::npyffi::is_numpy_2(py);
    m.add_class::<WorkspaceCore>()?;
    // The one definition of the statistics' and the configuration's fields (the Python
    // dataclasses follow them; a test checks).
    m.add("STATS_FIELDS", pyo3::types::PyTuple::new(m.py(), rustws_core::WorkspaceStats::FIELDS)?)?;
    m.add("CONFIG_FIELDS", pyo3::types::PyTuple::new(m.py(), rustws_core::WorkspaceConfiguration::FIELDS)?)?;
    let actions = rustws_core::history::Action::ALL.map(rustws_core::history::Action::name);
    m.add("EVENT_ACTIONS", pyo3::types::PyTuple::new(m.py(), actions)?)?;
    let kinds = rustws_core::history::SegmentKind::ALL.map(rustws_core::history::SegmentKind::name);
    m.add("SEGMENT_KINDS", pyo3::types::PyTuple::new(m.py(), kinds)?)?;
    m.add_class::<DeviceBuffer>()?;
    m.add_class::<scope::Scope>()?;
    m.add_class::<cycles::Cycles>()?;
    m.add_class::<DeviceArray>()?;
    m.add_class::<DisposeStatistics>()?;
    m.add_function(wrap_pyfunction!(devarray::wrap_host, m)?)?;
    m.add_function(wrap_pyfunction!(dispose::dispose_statistics, m)?)?;
    m.add_function(wrap_pyfunction!(dispose::dispose_push, m)?)?;
    m.add_function(wrap_pyfunction!(dispose::dispose_remove, m)?)?;
    m.add_function(wrap_pyfunction!(dispose::dispose_chain, m)?)?;
    m.add_function(wrap_pyfunction!(torch_route, m)?)?;
    m.add_function(wrap_pyfunction!(device::torch_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(torch_share, m)?)?;
    m.add_function(wrap_pyfunction!(torch_unshare, m)?)?;
    m.add_function(wrap_pyfunction!(memory::record_history, m)?)?;
    m.add_function(wrap_pyfunction!(memory::recording_stacks, m)?)?;
    m.add_function(wrap_pyfunction!(memory::memory_state, m)?)?;
    m.add_function(wrap_pyfunction!(memory::freeze_at_refusals, m)?)?;
    m.add_function(wrap_pyfunction!(memory::cycle_allocations, m)?)?;
    m.add_function(wrap_pyfunction!(memory::stack_frames, m)?)?;
    m.add_function(wrap_pyfunction!(memory::replay, m)?)?;
    m.add_function(wrap_pyfunction!(memory::recommend, m)?)?;
    m.add_function(wrap_pyfunction!(parse_size, m)?)?;
    m.add_function(wrap_pyfunction!(placed_size, m)?)?;
    m.add_function(wrap_pyfunction!(validate_config, m)?)?;
    m.add_function(wrap_pyfunction!(env_debug_mode, m)?)?;
    m.add_function(wrap_pyfunction!(set_handler, m)?)?;
    m.add_function(wrap_pyfunction!(call_with_handler, m)?)?;
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
