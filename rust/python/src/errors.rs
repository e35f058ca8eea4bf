//! Errors across the boundary. Each core error variant becomes one exception class of
//! `rustws._errors` (each also the nearest built-in: `WorkspaceOutOfMemory` a `MemoryError`), made
//! by a factory there from the error's numbers and fixed text. The message is formatted in Python:
//! where memory ran out, a failure to format it is a `MemoryError` too, and nothing on the way
//! allocates on Rust's heap or panics (PyO3's conversions panic when Python cannot make an object;
//! these go through the C API and take Python's own error instead).

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use rustws_core::{BackendError, Cause, Error};

use crate::calls::{call, Arg};

/// The exception classes of `rustws._errors` the bindings raise by themselves.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Class {
    Scope,
    Disposed,
}

/// What `rustws._errors` provides, found once when the extension is imported.
struct Errors {
    refused: Py<PyAny>,
    system_refused: Py<PyAny>,
    backend_refusal: Py<PyAny>,
    closed: Py<PyAny>,
    not_open: Py<PyAny>,
    unavailable: Py<PyAny>,
    classes: [Py<PyAny>; 2],
}

static ERRORS: PyOnceLock<Errors> = PyOnceLock::new();

/// Finds the factories and classes of `rustws._errors`: called when the extension is imported,
/// so that raising never has to look anything up.
pub(crate) fn init(py: Python<'_>) -> PyResult<()> {
    crate::once::get_or_try_make(&ERRORS, py, || -> PyResult<Errors> {
        let m = py.import("rustws._errors")?;
        let get = |name: &str| m.getattr(name).map(Bound::unbind);
        Ok(Errors {
            refused: get("_refused")?,
            system_refused: get("_system_refused")?,
            backend_refusal: get("_backend_refusal")?,
            closed: get("_closed")?,
            not_open: get("_not_open")?,
            unavailable: get("_unavailable")?,
            classes: [get("ScopeError")?, get("DisposedArrayError")?],
        })
    })?;
    Ok(())
}

fn errors(py: Python<'_>) -> PyResult<&Errors> {
    ERRORS.get(py).ok_or_else(|| PyRuntimeError::new_err("rustws._errors was not found when rustws was imported"))
}

/// One core error, one Python exception.
pub(crate) fn to_py(py: Python<'_>, e: Error) -> PyErr {
    match exception(py, &e) {
        Ok(exc) => PyErr::from_value(exc),
        Err(err) => err,
    }
}

fn exception<'py>(py: Python<'py>, e: &Error) -> PyResult<Bound<'py, PyAny>> {
    if let Error::InvalidConfig { field, message } = e {
        // Made when a configuration is read, never where memory ran out.
        return Err(PyValueError::new_err(format!("invalid {field}: {message}")));
    }
    let f = errors(py)?;
    match e {
        Error::OutOfMemory(r) => call(
            py,
            f.refused.bind(py),
            &[
                Arg::Text(&r.workspace),
                Arg::Int(r.requested),
                Arg::Int(r.in_use),
                Arg::Int(r.limit),
                Arg::Int(r.footprint),
                Arg::Int(r.pinned),
                Arg::Int(r.cached),
                Arg::Int(r.largest_free),
                Arg::Int(r.room),
                Arg::Int(r.held),
                Arg::Int(r.live_end),
                Arg::Text(r.reason),
            ],
        ),
        Error::SystemOutOfMemory { workspace, requested, in_use, limit, cause } => {
            let system = describe(py, cause)?;
            let args =
                [Arg::Text(workspace), Arg::Int(*requested), Arg::Int(*in_use), Arg::Int(*limit), Arg::Object(&system)];
            call(py, f.system_refused.bind(py), &args)
        }
        Error::Destroyed { workspace } => call(py, f.closed.bind(py), &[Arg::Text(workspace)]),
        Error::NotOpen { workspace, operation } => {
            call(py, f.not_open.bind(py), &[Arg::Text(workspace), Arg::Text(operation)])
        }
        Error::Unavailable { what, cause } => {
            let system = match cause {
                Some(c) => describe(py, c)?,
                None => Arg::Text("").make(py)?,
            };
            call(py, f.unavailable.bind(py), &[Arg::Text(what), Arg::Object(&system)])
        }
        Error::InvalidConfig { .. } => unreachable!("handled above"),
    }
}

/// What a memory source refused, as a Python string.
fn describe<'py>(py: Python<'py>, e: &BackendError) -> PyResult<Bound<'py, PyAny>> {
    let (kind, code, held, name, text) = match e.cause {
        Cause::Os(errno) => (0, errno.unsigned_abs() as u64, 0, "", ""),
        Cause::Driver { code, name, text } => (1, code as u64, 0, name, text),
        Cause::Limit { limit, held } => (2, limit as u64, held as u64, "", ""),
        Cause::Refused(why) => (3, 0, 0, "", why),
    };
    let f = errors(py)?;
    call(
        py,
        f.backend_refusal.bind(py),
        &[
            Arg::Text(e.op),
            Arg::Int(e.bytes as u64),
            Arg::Int(kind),
            Arg::Int(code),
            Arg::Int(held),
            Arg::Text(name),
            Arg::Text(text),
        ],
    )
}

/// Python's `MemoryError` (a preallocated instance: raising it needs no memory).
pub(crate) fn no_memory(py: Python<'_>) -> PyErr {
    // SAFETY: the GIL is held (`py`); sets Python's `MemoryError`.
    unsafe { pyo3::ffi::PyErr_NoMemory() };
    PyErr::fetch(py)
}

/// A new exception of `class` with `message`.
pub(crate) fn new(py: Python<'_>, class: Class, message: &str) -> PyErr {
    let made = errors(py).and_then(|f| {
        let i = class as usize;
        call(py, f.classes[i].bind(py), &[Arg::Text(message)])
    });
    match made {
        Ok(exc) => PyErr::from_value(exc),
        Err(err) => err,
    }
}
