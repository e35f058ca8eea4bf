//! Arrays over workspace memory: shapes and dtypes from Python, and NumPy arrays built directly
//! over a workspace block that carry the workspace's memory handler (NEP 49: data an array owns
//! comes with its `mem_handler`), with NumPy's own allocation path as the fallback.

use numpy::npyffi::npy_intp;
use numpy::{PyArrayDescr, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods, PY_ARRAY_API};
use pyo3::exceptions::{PyMemoryError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt, PyString, PyTuple};

use crate::errors::to_py;
use crate::handler;
use crate::shared::{self, Shared};

fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type().name().map(|n| n.to_string()).unwrap_or_default()
}

fn extract_dim(item: &Bound<'_, PyAny>) -> PyResult<npy_intp> {
    // NumPy refuses bools as dimensions (`np.empty((True, 2))`), though they are ints.
    if item.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err("shape entries must be ints, got bool"));
    }
    item.extract::<npy_intp>()
        .map_err(|_| PyTypeError::new_err(format!("shape entries must be ints, got {}", type_name(item))))
}

fn not_a_shape(shape: &Bound<'_, PyAny>) -> PyErr {
    PyTypeError::new_err(format!("shape must be an int or a sequence of ints, got {}", type_name(shape)))
}

/// The most dimensions an array may have (NumPy 2's limit; NumPy 1 refuses more than 32 itself).
const MAX_DIMS: usize = 64;

/// Dimensions a shape holds on the stack; more go to the heap (rare, and never on the hot path).
const INLINE_DIMS: usize = 8;

/// A shape: small, so that reading one and passing it on copies a few words, not NumPy's
/// largest shape.
pub(crate) struct Dims {
    inline: [npy_intp; INLINE_DIMS],
    len: usize,
    /// Every dimension, once there are more than `INLINE_DIMS`.
    more: Vec<npy_intp>,
}

impl Dims {
    fn new() -> Self {
        Dims { inline: [0; INLINE_DIMS], len: 0, more: Vec::new() }
    }

    fn push(&mut self, d: npy_intp) -> PyResult<()> {
        if self.len == MAX_DIMS {
            return Err(PyValueError::new_err(format!("shape has more than {MAX_DIMS} dimensions")));
        }
        if self.len < INLINE_DIMS {
            self.inline[self.len] = d;
        } else {
            if self.more.is_empty() {
                // Room for the most dimensions, once: nothing below reallocates.
                self.more.try_reserve_exact(MAX_DIMS).map_err(|_| PyMemoryError::new_err(()))?;
                self.more.extend_from_slice(&self.inline);
            }
            self.more.push(d);
        }
        self.len += 1;
        Ok(())
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [npy_intp] {
        if self.len > INLINE_DIMS {
            &mut self.more
        } else {
            &mut self.inline[..self.len]
        }
    }
}

/// Whether `shape` is None read as NumPy 1 reads it, `()` with a `DeprecationWarning` (given
/// here, first, as NumPy gives it before it reads the other arguments). NumPy 2 refuses it.
pub(crate) fn none_as_no_dimensions(shape: &Bound<'_, PyAny>) -> PyResult<bool> {
    if !shape.is_none() || numpy::npyffi::is_numpy_2(shape.py()) {
        return Ok(false);
    }
    let py = shape.py();
    let msg = c"Passing None into shape arguments as an alias for () is deprecated.";
    PyErr::warn(py, &py.get_type::<pyo3::exceptions::PyDeprecationWarning>(), msg, 1)?;
    Ok(true)
}

/// A shape: an int or a sequence of ints. Tuples (the common case) are read without detours.
pub(crate) fn extract_shape(shape: &Bound<'_, PyAny>) -> PyResult<Dims> {
    let mut dims = Dims::new();
    if let Ok(t) = shape.cast::<PyTuple>() {
        for item in t.iter() {
            dims.push(extract_dim(&item)?)?;
        }
        return Ok(dims);
    }
    if none_as_no_dimensions(shape)? {
        return Ok(dims);
    }
    if shape.is_instance_of::<PyBool>() {
        return Err(not_a_shape(shape));
    }
    if shape.is_instance_of::<PyInt>() {
        dims.push(extract_dim(shape)?)?;
        return Ok(dims);
    }
    if shape.is_instance_of::<PyString>() || shape.is_instance_of::<pyo3::types::PyBytes>() {
        return Err(not_a_shape(shape));
    }
    if shape.hasattr("__index__")? {
        // An integer of another type (a NumPy integer, a 0-d integer array): one dimension, as
        // NumPy reads it. What is no integer (a 1-d array) is read as a sequence below.
        // SAFETY: a live object; the result is a new reference, or NULL with an exception set.
        let index = unsafe { Bound::from_owned_ptr_or_opt(shape.py(), pyo3::ffi::PyNumber_Index(shape.as_ptr())) };
        match index {
            Some(i) => {
                dims.push(extract_dim(&i)?)?;
                return Ok(dims);
            }
            None => {
                let not_an_integer = PyErr::take(shape.py());
                if !shape.hasattr("__len__")? {
                    return Err(not_an_integer.unwrap_or_else(|| not_a_shape(shape)));
                }
            }
        }
    }
    // As NumPy: a sequence (a list, an array), never a dict, set or iterator.
    // SAFETY: a live object; the check reads its type slots only.
    if unsafe { pyo3::ffi::PySequence_Check(shape.as_ptr()) } != 1 {
        return Err(not_a_shape(shape));
    }
    for item in shape.try_iter()? {
        dims.push(extract_dim(&item?)?)?;
    }
    Ok(dims)
}

/// The descriptor of a NumPy scalar type (`np.float32` ...: the common `dtype=` argument) read
/// directly, without NumPy's general converter; None for anything else (or if NumPy declines).
fn scalar_type_descr<'py>(py: Python<'py>, d: &Bound<'py, PyAny>) -> Option<Bound<'py, PyArrayDescr>> {
    // SAFETY: NumPy's API table is loaded (as for every array made here); type checks of live
    // objects, `d` a type object where `PyType_IsSubtype` reads it.
    let scalar = unsafe {
        let generic = numpy::npyffi::get_type_object(py, numpy::npyffi::NpyTypes::PyGenericArrType_Type);
        pyo3::ffi::PyType_Check(d.as_ptr()) != 0 && pyo3::ffi::PyType_IsSubtype(d.as_ptr().cast(), generic) != 0
    };
    if !scalar {
        return None;
    }
    // SAFETY: `d` is a subtype of `np.generic`; the result is a new reference or NULL with an
    // exception set.
    let raw = unsafe { PY_ARRAY_API.PyArray_DescrFromTypeObject(py, d.as_ptr()) };
    if raw.is_null() {
        // NumPy's general converter says why, below.
        PyErr::take(py);
        return None;
    }
    // SAFETY: a new reference to a descriptor.
    Some(unsafe { Bound::from_owned_ptr(py, raw.cast()).cast_into_unchecked() })
}

pub(crate) fn extract_descr<'py>(
    py: Python<'py>,
    dtype: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArrayDescr>> {
    let descr = match dtype {
        None => numpy::dtype::<f64>(py),
        Some(d) if d.is_none() => numpy::dtype::<f64>(py),
        Some(d) => match scalar_type_descr(py, d) {
            Some(descr) => descr,
            None => PyArrayDescr::new(py, d)?,
        },
    };
    refuse_objects(&descr)?;
    Ok(descr)
}

/// `TypeError` for a dtype that holds Python objects: workspace memory never holds references.
pub(crate) fn refuse_objects(descr: &Bound<'_, PyArrayDescr>) -> PyResult<()> {
    if descr.has_object() {
        return Err(PyTypeError::new_err(format!(
            "dtype {} holds Python objects; workspace memory never holds Python references",
            descr.str()?
        )));
    }
    Ok(())
}

/// `np.asarray(items)` for a list or tuple, made by NumPy with the handler current here (the
/// caller checked it is a capture of the workspace `ws`): the result is new memory of `ws`;
/// one holding Python objects is refused, and a refusal of the workspace raises its own error.
pub(crate) fn sequence_array<'py>(
    py: Python<'py>,
    ws: &Shared,
    items: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    static ASARRAY: pyo3::sync::PyOnceLock<Py<PyAny>> = pyo3::sync::PyOnceLock::new();
    let asarray =
        crate::once::get_or_try_make(&ASARRAY, py, || py.import("numpy")?.getattr("asarray").map(Bound::unbind))?;
    shared::take_last_refusal();
    let made = match asarray.bind(py).call1((items,)) {
        Ok(made) => made,
        Err(e) if e.is_instance_of::<PyMemoryError>(py) => {
            // Raised here, it is reported here: not again at the cycle's end.
            drop(ws.drain_failures());
            return Err(shared::take_last_refusal().map_or(e, |refusal| to_py(py, refusal)));
        }
        Err(e) => return Err(e),
    };
    refuse_objects(&made.cast::<PyUntypedArray>()?.dtype())?;
    Ok(made)
}

/// `PyArrayObject_fields` of NumPy >= 1.22 up to its `mem_handler` field. The layout is checked
/// once at run time against an array NumPy made (see `direct_arrays_supported`).
#[repr(C)]
pub(crate) struct ArrayFields {
    pub(crate) ob_base: pyo3::ffi::PyObject,
    pub(crate) data: *mut std::ffi::c_char,
    pub(crate) nd: std::ffi::c_int,
    pub(crate) dimensions: *mut npy_intp,
    pub(crate) strides: *mut npy_intp,
    pub(crate) base: *mut pyo3::ffi::PyObject,
    pub(crate) descr: *mut std::ffi::c_void,
    pub(crate) flags: std::ffi::c_int,
    pub(crate) weakreflist: *mut pyo3::ffi::PyObject,
    pub(crate) buffer_info: *mut std::ffi::c_void,
    pub(crate) mem_handler: *mut pyo3::ffi::PyObject,
}

pub(crate) const NPY_ARRAY_OWNDATA: std::ffi::c_int = 0x0004;
const NPY_ARRAY_C_CONTIGUOUS: std::ffi::c_int = 0x0001;
const NPY_ARRAY_F_CONTIGUOUS: std::ffi::c_int = 0x0002;
const NPY_ARRAY_ALIGNED: std::ffi::c_int = 0x0100;
const NPY_ARRAY_WRITEABLE: std::ffi::c_int = 0x0400;

/// Whether arrays can be built over workspace memory directly: NumPy must keep the handler of an
/// array where `ArrayFields` says. Checked once, on an array NumPy allocates with its default
/// handler.
pub(crate) fn direct_arrays_supported(py: Python<'_>) -> bool {
    static SUPPORTED: pyo3::sync::PyOnceLock<bool> = pyo3::sync::PyOnceLock::new();
    *crate::once::get_or_make(&SUPPORTED, py, || {
        let probe = || -> PyResult<bool> {
            let previous = handler::set_handler(py, None)?;
            let default = handler::get_handler(py);
            let mut dims = [4 as npy_intp];
            // SAFETY: one dimension in `dims`; the descriptor reference is stolen.
            let raw = unsafe {
                PY_ARRAY_API.PyArray_Empty(py, 1, dims.as_mut_ptr(), numpy::dtype::<f64>(py).into_ptr().cast(), 0)
            };
            // SAFETY: a new reference or NULL with an exception set; owned before anything can fail.
            let arr = unsafe { Bound::from_owned_ptr_or_err(py, raw) };
            handler::set_handler(py, Some(&previous))?;
            let (arr, default) = (arr?, default?);
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

/// A new ndarray of `shape`, `dtype` and `order` over memory of the workspace `shared`, whose
/// handler is `capsule` (`bypass`: from NumPy's default allocator instead).
#[allow(clippy::too_many_arguments)]
pub(crate) fn new_array<'py>(
    py: Python<'py>,
    shared: &Shared,
    capsule: &Bound<'py, PyAny>,
    bypass: bool,
    shape: &Bound<'py, PyAny>,
    dtype: Option<&Bound<'py, PyAny>>,
    order: &str,
    zeroed: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let mut shape = extract_shape(shape)?;
    let descr = extract_descr(py, dtype)?;
    let fortran = match order {
        "C" | "c" => 0,
        "F" | "f" => 1,
        other => return Err(PyValueError::new_err(format!("order must be 'C' or 'F', got {other:?}"))),
    };
    make_array(py, shared, capsule, bypass, shape.as_mut_slice(), descr, fortran, zeroed)
}

/// NumPy's `empty_like(proto)` / `zeros_like(proto)` over memory of the workspace `shared`, for
/// an ndarray (not a subclass) that is contiguous and holds no objects: its shape, dtype and
/// layout. None for any other prototype (the caller takes NumPy's general path).
pub(crate) fn like_array<'py>(
    py: Python<'py>,
    shared: &Shared,
    capsule: &Bound<'py, PyAny>,
    bypass: bool,
    proto: &Bound<'py, PyAny>,
    zeroed: bool,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    // SAFETY: a type check of a live object.
    if unsafe { numpy::npyffi::PyArray_CheckExact(py, proto.as_ptr()) } == 0 {
        return Ok(None);
    }
    let a = proto.cast::<PyUntypedArray>()?;
    let descr = a.dtype();
    let (c, f) = (a.is_c_contiguous(), a.is_fortran_contiguous());
    if descr.has_object() || !(c || f) {
        return Ok(None);
    }
    let mut dims = Dims::new();
    for &d in a.shape() {
        dims.push(d as npy_intp)?;
    }
    let fortran = std::ffi::c_int::from(f && !c);
    make_array(py, shared, capsule, bypass, dims.as_mut_slice(), descr, fortran, zeroed).map(Some)
}

/// A new ndarray of `dims` and `descr` (Fortran order when `fortran` is 1) over memory of the
/// workspace `shared`.
#[allow(clippy::too_many_arguments)]
fn make_array<'py>(
    py: Python<'py>,
    shared: &Shared,
    capsule: &Bound<'py, PyAny>,
    bypass: bool,
    dims: &mut [npy_intp],
    descr: Bound<'py, PyArrayDescr>,
    fortran: std::ffi::c_int,
    zeroed: bool,
) -> PyResult<Bound<'py, PyAny>> {
    shared.check_alive().map_err(|e| to_py(py, e))?;
    if !shared.host_accessible {
        return Err(PyTypeError::new_err(format!(
                "workspace {:?} holds device memory: NumPy arrays cannot live in it (device workspaces return DeviceArrays)",
                shared.name
            )));
    }
    // An array of no elements takes NumPy's own path, which gives it NumPy's strides (all 0).
    if !bypass && descr.itemsize() > 0 && !dims.contains(&0) && direct_arrays_supported(py) {
        return new_array_direct(py, shared, capsule, dims, descr, fortran, zeroed);
    }
    // Through NumPy's allocation path, with the right handler current.
    let current = handler::get_handler(py)?;
    let wanted = if bypass { None } else { Some(capsule) };
    let swap = match wanted {
        Some(c) => !current.is(c),
        None => true,
    };
    let previous = if swap { Some(handler::set_handler(py, wanted)?) } else { None };
    shared::take_last_refusal();
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
        Err(e) if e.is_instance_of::<PyMemoryError>(py) => match shared::take_last_refusal() {
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
    py: Python<'py>,
    shared: &Shared,
    capsule: &Bound<'py, PyAny>,
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
        let mut ws = shared.lock_allocating();
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
        unsafe { shared.lock().free(data) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `raw` is a new ndarray built over external data, so NumPy left its handler
    // NULL and OWNDATA clear; the layout was checked by `direct_arrays_supported`. Setting
    // both makes NumPy free `data` through our handler (which holds the workspace alive).
    unsafe {
        let f = &mut *(raw as *mut ArrayFields);
        debug_assert!(f.mem_handler.is_null());
        pyo3::ffi::Py_XDECREF(f.mem_handler);
        f.mem_handler = capsule.clone().into_ptr();
        f.flags |= NPY_ARRAY_OWNDATA;
    }
    // NumPy reports what a handler returns to tracemalloc, in its own domain, and the free
    // (`PyDataMem_UserFREE`) withdraws it: an array made here is reported as NumPy would have,
    // so tracemalloc sees every workspace array. A no-op while tracemalloc is not tracing.
    // SAFETY: the GIL is held; the call only records the address and size.
    unsafe { PyTraceMalloc_Track(NUMPY_TRACE_DOMAIN, data.as_ptr() as usize, nbytes.max(1)) };
    // SAFETY: `raw` is a new reference, checked non-null above.
    Ok(unsafe { Bound::from_owned_ptr(py, raw) })
}

/// NumPy's tracemalloc domain (`NPY_TRACE_DOMAIN` in its headers).
const NUMPY_TRACE_DOMAIN: std::ffi::c_uint = 389047;

extern "C" {
    /// Public C API of every CPython since 3.7 (outside the limited API's headers; exported by
    /// each interpreter 3.11 to 3.13). Returns -2 at once when tracemalloc is not tracing.
    fn PyTraceMalloc_Track(domain: std::ffi::c_uint, ptr: usize, size: usize) -> std::ffi::c_int;
}
