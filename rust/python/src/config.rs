//! Configurations across the boundary: a dict of the contract's fields (sizes as ints or strings
//! with units, policies as enum members or names) becomes a validated core configuration, and
//! every invalid value raises `ValueError` / `TypeError` naming its field.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};
use rustws_core::{parse_size as core_parse_size, WorkspaceConfiguration};

use crate::calls;
use crate::errors::to_py;

pub(crate) fn field_error(field: &str, message: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("invalid {field}: {message}"))
}

/// The value of `field` in `d`, looked up by its name made at import (see `calls::Names`).
fn item<'py>(d: &Bound<'py, PyDict>, field: &'static str) -> PyResult<Option<Bound<'py, PyAny>>> {
    let i = FIELDS.iter().position(|f| *f == field).expect("a field of the configuration");
    d.get_item(calls::names(d.py())?.fields[i].bind(d.py()))
}

fn size_field(d: &Bound<'_, PyDict>, field: &'static str) -> PyResult<Option<u64>> {
    let Some(v) = item(d, field)? else { return Ok(None) };
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
    let Some(v) = item(d, field)? else { return Ok(None) };
    let value = calls::names(d.py())?.value.bind(d.py());
    let text = match v.getattr(value) {
        Ok(inner) if !v.is_instance_of::<PyString>() => inner,
        _ => v,
    };
    let Ok(text) = text.cast::<PyString>() else {
        return Err(PyTypeError::new_err(format!("{field} must be a policy member or its name")));
    };
    text.to_str()?.parse::<T>().map(Some).map_err(|m| field_error(field, m))
}

const FIELDS: [&str; 17] = WorkspaceConfiguration::FIELDS;

/// Builds and validates a core configuration from a dict of the contract's fields.
pub(crate) fn config_from_dict(d: &Bound<'_, PyDict>) -> PyResult<WorkspaceConfiguration> {
    for key in d.keys() {
        let known = key.cast::<PyString>().ok().and_then(|k| k.to_str().ok()).is_some_and(|k| FIELDS.contains(&k));
        if !known {
            return Err(PyTypeError::new_err(format!("unknown configuration field {key:?}")));
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
            if let Some(v) = item(d, stringify!($f))? {
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
    if let Some(v) = item(d, "overallocation_limit")? {
        if v.is_instance_of::<pyo3::types::PyBool>() {
            return Err(PyTypeError::new_err("overallocation_limit must be a number"));
        }
        c.overallocation_limit =
            v.extract::<f64>().map_err(|_| PyTypeError::new_err("overallocation_limit must be a number"))?;
    }
    if let Some(v) = item(d, "cycles_before_initialization")? {
        const FIELD: &str = "cycles_before_initialization";
        let not_int = || PyTypeError::new_err("cycles_before_initialization must be an int");
        if v.is_instance_of::<pyo3::types::PyBool>() {
            return Err(not_int());
        }
        // Any integer (`operator.index`, NumPy's included); one past 128 bits is out of range as
        // surely as one past 64.
        // SAFETY: a live object; the result is a new reference, or NULL with an exception set.
        let v = unsafe { Bound::from_owned_ptr_or_err(d.py(), pyo3::ffi::PyNumber_Index(v.as_ptr())) }
            .map_err(|_| not_int())?;
        c.cycles_before_initialization = match v.extract::<u64>() {
            Ok(n) => n,
            Err(_) if v.lt(0)? => return Err(field_error(FIELD, format!("must be >= 0, got {v}"))),
            Err(_) => {
                let most = rustws_core::MAX_CYCLES_BEFORE_INITIALIZATION;
                return Err(field_error(FIELD, format!("must be at most {most}, got {v}")));
            }
        };
    }
    if let Some(v) = item(d, "temp_file_path")? {
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
pub(crate) fn parse_size(text: &str) -> PyResult<u64> {
    core_parse_size(text).map_err(PyValueError::new_err)
}

/// Bytes a request of `size` bytes takes where a workspace places it (its size class, a header
/// and any alignment filler).
#[pyfunction]
pub(crate) fn placed_size(size: u64) -> u64 {
    usize::try_from(size).map_or(u64::MAX, |s| rustws_core::placed_size(s) as u64)
}

/// Validates a configuration dict; raises `ValueError` naming the field.
#[pyfunction]
pub(crate) fn validate_config(config: &Bound<'_, PyDict>) -> PyResult<()> {
    config_from_dict(config).map(|_| ())
}
