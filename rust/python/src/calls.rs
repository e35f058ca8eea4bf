//! Calls into Python that cannot panic. PyO3's conversions of Rust values (a `&str` attribute
//! name, an integer argument) panic when Python cannot make the object; where memory may have run
//! out (raising a workspace's error, ending a cycle, entering one) the bindings make their
//! arguments through the C API and take Python's own error instead, and look attributes up by
//! names made once, when the extension is imported.

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyString;

/// An argument of a call into Python.
pub(crate) enum Arg<'a, 'py> {
    Int(u64),
    Float(f64),
    Bool(bool),
    None,
    Text(&'a str),
    /// Native-endian 64-bit words, as `bytes`.
    Words(&'a [u64]),
    Object(&'a Bound<'py, PyAny>),
}

impl<'py> Arg<'_, 'py> {
    /// The argument as a Python object (a new reference), or Python's error (a `MemoryError`).
    pub(crate) fn make(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let raw = match self {
            // SAFETY: plain constructors of the C API; each returns a new reference or NULL with an
            // exception set.
            Arg::Int(v) => unsafe { ffi::PyLong_FromUnsignedLongLong(*v) },
            // SAFETY: as above.
            Arg::Float(v) => unsafe { ffi::PyFloat_FromDouble(*v) },
            // SAFETY: as above (a new reference to `True` or `False`).
            Arg::Bool(b) => unsafe { ffi::PyBool_FromLong(*b as std::ffi::c_long) },
            // SAFETY: `None` is immortal-or-counted; a new reference to it.
            Arg::None => unsafe {
                ffi::Py_IncRef(ffi::Py_None());
                ffi::Py_None()
            },
            // SAFETY: as above; the words are valid for their length in bytes.
            Arg::Words(w) => unsafe {
                ffi::PyBytes_FromStringAndSize(w.as_ptr().cast(), std::mem::size_of_val(*w) as ffi::Py_ssize_t)
            },
            // SAFETY: as above; `s` is valid UTF-8 of its length.
            Arg::Text(s) => unsafe { ffi::PyUnicode_FromStringAndSize(s.as_ptr().cast(), s.len() as ffi::Py_ssize_t) },
            Arg::Object(o) => return Ok((*o).clone()),
        };
        // SAFETY: a new reference, or NULL with an exception set.
        unsafe { Bound::from_owned_ptr_or_err(py, raw) }
    }
}

/// A tuple of `args`, or Python's error.
pub(crate) fn tuple<'py>(py: Python<'py>, args: &[Arg<'_, 'py>]) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: a new tuple of `args.len()` slots, or NULL with an exception set.
    let tuple = unsafe { Bound::from_owned_ptr_or_err(py, ffi::PyTuple_New(args.len() as ffi::Py_ssize_t)) }?;
    for (i, a) in args.iter().enumerate() {
        let item = a.make(py)?;
        // SAFETY: a fresh tuple with slot `i` empty; `PyTuple_SetItem` steals the reference.
        if unsafe { ffi::PyTuple_SetItem(tuple.as_ptr(), i as ffi::Py_ssize_t, item.into_ptr()) } != 0 {
            return Err(PyErr::fetch(py));
        }
    }
    Ok(tuple)
}

/// An empty list, or Python's error.
pub(crate) fn list(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    // SAFETY: a new list, or NULL with an exception set.
    unsafe { Bound::from_owned_ptr_or_err(py, ffi::PyList_New(0)) }
}

/// Appends `item` to `list` (made by [`list`]), or Python's error.
pub(crate) fn append(list: &Bound<'_, PyAny>, item: &Bound<'_, PyAny>) -> PyResult<()> {
    // SAFETY: both are live objects, `list` a list; the item is not stolen.
    if unsafe { ffi::PyList_Append(list.as_ptr(), item.as_ptr()) } != 0 {
        return Err(PyErr::fetch(list.py()));
    }
    Ok(())
}

/// `f(*args)`.
pub(crate) fn call<'py>(py: Python<'py>, f: &Bound<'py, PyAny>, args: &[Arg<'_, 'py>]) -> PyResult<Bound<'py, PyAny>> {
    let tuple = tuple(py, args)?;
    // SAFETY: live objects; the result is a new reference or NULL with an exception set.
    unsafe { Bound::from_owned_ptr_or_err(py, ffi::PyObject_Call(f.as_ptr(), tuple.as_ptr(), std::ptr::null_mut())) }
}

/// `obj.<name>(*args)`, the name one of [`Names`].
pub(crate) fn call_method<'py>(
    obj: &Bound<'py, PyAny>,
    name: &Py<PyString>,
    args: &[Arg<'_, 'py>],
) -> PyResult<Bound<'py, PyAny>> {
    let py = obj.py();
    let f = obj.getattr(name.bind(py))?;
    call(py, &f, args)
}

/// Attribute and key names used where memory may have run out, made once.
pub(crate) struct Names {
    pub after_cycle: Py<PyString>,
    pub value: Py<PyString>,
    pub asyncio: Py<PyString>,
    pub mirror_ws: Py<PyString>,
    pub str_: Py<PyString>,
    /// The configuration's fields, in the order of `WorkspaceConfiguration::FIELDS`.
    pub fields: Vec<Py<PyString>>,
}

static NAMES: PyOnceLock<Names> = PyOnceLock::new();

/// Makes the names: called when the extension is imported.
pub(crate) fn init(py: Python<'_>) -> PyResult<()> {
    crate::once::get_or_make(&NAMES, py, || Names {
        after_cycle: PyString::intern(py, "_after_cycle").unbind(),
        value: PyString::intern(py, "value").unbind(),
        asyncio: PyString::intern(py, "asyncio").unbind(),
        mirror_ws: PyString::intern(py, "_mirror_ws").unbind(),
        str_: PyString::intern(py, "str").unbind(),
        fields: rustws_core::WorkspaceConfiguration::FIELDS.iter().map(|f| PyString::intern(py, f).unbind()).collect(),
    });
    Ok(())
}

pub(crate) fn names(py: Python<'_>) -> PyResult<&Names> {
    NAMES.get(py).ok_or_else(|| pyo3::exceptions::PyRuntimeError::new_err("rustws's names were not made at import"))
}
