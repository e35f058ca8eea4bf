//! `DeviceArray`, the array type of device workspaces (it registers with the per-thread dispose
//! statistics and scope chain of [`crate::dispose`]).
//!
//! Over device memory a `DeviceArray` owns a [`Block`] and exports it through
//! `__cuda_array_interface__` (v3) and `__dlpack__` (versioned capsules whose tensors own the
//! block, so a consumer keeps the memory however long it lives); in a host fallback (or under
//! `HOST_ONLY` mirroring) it wraps a host ndarray of the workspace, with `__array_interface__` and
//! a CPU DLPack device. `dispose()` releases the memory at once; any later use raises
//! `DisposedArrayError`. The device path of `ws.empty` builds one of these with no Python code
//! running: it is the per-call cost of a device allocation.

use std::ffi::c_int;
use std::sync::Arc;

use numpy::npyffi::npy_intp;
use numpy::{PyArrayDescr, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods, PY_ARRAY_API};
use pyo3::exceptions::{PyAttributeError, PyBufferError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyList, PyString, PyTuple};

use crate::arrays::{extract_descr, extract_shape, none_as_no_dimensions};
use crate::device::{Block, Memory};
use crate::dlpack::dlpack_capsule;
use crate::errors::{self, to_py};
use crate::{dispose, handler};

const KDL_CPU: i32 = 1;
const KDL_CUDA: i32 = 2;

// -- DeviceArray ----------------------------------------------------------------------------------

/// What a device workspace needs to build its arrays: the device as users see it, and where its
/// memory is.
pub(crate) struct DeviceSide {
    /// `"cuda:N"`, or `"cpu"` for a host fallback.
    pub(crate) name: Py<PyString>,
    /// The DLPack device `(type, id)`.
    pub(crate) dl: (i32, i32),
    /// Whether the workspace's memory is device memory (else its arrays wrap host ndarrays).
    pub(crate) on_device: bool,
}

/// The block under a device-memory array: its own until a DLPack export shares it.
enum Held {
    None,
    Own(Block),
    Shared(Arc<Block>),
}

impl Held {
    fn get(&self) -> Option<&Block> {
        match self {
            Held::None => None,
            Held::Own(b) => Some(b),
            Held::Shared(b) => Some(b),
        }
    }

    /// The block as shared ownership (for an export that outlives the array).
    fn share(&mut self) -> Option<Arc<Block>> {
        if let Held::Own(_) = self {
            let Held::Own(b) = std::mem::replace(self, Held::None) else { unreachable!() };
            *self = Held::Shared(Arc::new(b));
        }
        match self {
            Held::Shared(b) => Some(b.clone()),
            _ => None,
        }
    }
}

/// An array of a device workspace.
///
/// Over device memory it exposes `__cuda_array_interface__` and `__dlpack__` (a CUDA device); in
/// a host fallback (or `HOST_ONLY`) its memory is host memory of the workspace, with `device ==
/// "cpu"`, `__array_interface__` and a CPU DLPack device. Implicit conversion of device memory to
/// NumPy is refused: use `to_numpy()`.
#[pyclass(module = "rustws._rustws", weakref)]
pub(crate) struct DeviceArray {
    block: Held,
    host: Option<Py<PyAny>>,
    mirror: Option<Py<PyAny>>,
    workspace: Py<PyAny>,
    device: Py<PyString>,
    dl: (i32, i32),
    shape: Py<PyTuple>,
    dtype: Py<PyArrayDescr>,
    itemsize: usize,
    size: usize,
    fortran: bool,
    /// Handed out through an interface whose consumer references the memory through this object
    /// (`__cuda_array_interface__`, `__array_interface__`, the buffer protocol): `dispose` keeps
    /// the memory until the object dies.
    exported: bool,
    disposed: bool,
    /// The dispose scope holding the array (set by the scope).
    #[pyo3(get, set, name = "_scope")]
    scope: Option<Py<PyAny>>,
    /// The thread that created the array (its dispose counters count it).
    thread: u64,
}

impl Drop for DeviceArray {
    fn drop(&mut self) {
        if !self.disposed {
            dispose::count_freed(self.thread);
        }
    }
}

fn disposed_error(py: Python<'_>) -> PyErr {
    errors::new(py, errors::Class::Disposed, "this DeviceArray was disposed")
}

fn numpy(py: Python<'_>) -> PyResult<Bound<'_, PyModule>> {
    py.import("numpy")
}

/// Registers a new array with this thread's dispose statistics and innermost scope.
fn register<'py>(py: Python<'py>, array: DeviceArray, scope: Option<Py<PyAny>>) -> PyResult<Bound<'py, DeviceArray>> {
    let obj = Bound::new(py, array)?;
    let scoped = scope.is_some();
    dispose::count_created(scoped);
    if let Some(scope) = scope {
        scope.bind(py).call_method1("_give", (&obj,))?;
    }
    Ok(obj)
}

/// A shape as a tuple of non-negative ints, and its element count. A tuple of ints (the common
/// case) is kept as it is.
fn shape_tuple<'py>(py: Python<'py>, shape: &Bound<'py, PyAny>) -> PyResult<(Bound<'py, PyTuple>, usize)> {
    let count = |dims: &mut dyn Iterator<Item = isize>| -> PyResult<usize> {
        let mut n: usize = 1;
        for d in dims {
            if d < 0 {
                return Err(PyValueError::new_err("negative dimensions are not allowed"));
            }
            n = n.checked_mul(d as usize).ok_or_else(|| PyValueError::new_err("array is too big"))?;
        }
        Ok(n)
    };
    if let Ok(t) = shape.cast_exact::<PyTuple>() {
        let mut n: usize = 1;
        let mut plain = true;
        for d in t.iter_borrowed() {
            if !d.is_exact_instance_of::<PyInt>() {
                plain = false;
                break;
            }
            let d = d.extract::<isize>()?;
            if d < 0 {
                return Err(PyValueError::new_err("negative dimensions are not allowed"));
            }
            n = n.checked_mul(d as usize).ok_or_else(|| PyValueError::new_err("array is too big"))?;
        }
        if plain {
            return Ok((t.clone(), n));
        }
    }
    let mut dims = extract_shape(shape)?;
    let dims = dims.as_mut_slice();
    let n = count(&mut dims.iter().copied())?;
    Ok((PyTuple::new(py, dims.iter())?, n))
}

fn is_fortran(order: &str) -> PyResult<bool> {
    match order {
        "C" | "c" => Ok(false),
        "F" | "f" => Ok(true),
        other => Err(PyValueError::new_err(format!("order must be 'C' or 'F', got {other:?}"))),
    }
}

/// Byte strides of a contiguous array.
fn contiguous_strides(shape: &[usize], itemsize: usize, fortran: bool) -> Vec<isize> {
    let mut strides = vec![0isize; shape.len()];
    let mut step = itemsize as isize;
    let mut set = |i: usize| {
        strides[i] = step;
        step = step.saturating_mul(shape[i].max(1) as isize);
    };
    if fortran {
        (0..shape.len()).for_each(&mut set);
    } else {
        (0..shape.len()).rev().for_each(&mut set);
    }
    strides
}

/// DLPack's `(code, bits, lanes)` for `dtype`, or `BufferError` when a consumer would misread it.
fn dl_dtype(dtype: &Bound<'_, PyArrayDescr>) -> PyResult<(u8, u8, u16)> {
    let code = match dtype.kind() {
        b'i' => Some(0),
        b'u' => Some(1),
        b'f' if dtype.itemsize() <= 8 => Some(2),
        b'c' if dtype.itemsize() <= 16 => Some(5),
        b'b' => Some(6),
        _ => None,
    };
    match code {
        Some(code) if !dtype.has_fields() && !dtype.has_subarray() && dtype.is_native_byteorder() != Some(false) => {
            Ok((code, (dtype.itemsize() * 8) as u8, 1))
        }
        _ => Err(PyBufferError::new_err(format!("dtype {} cannot be exported through DLPack", dtype.str()?))),
    }
}

/// A new host ndarray in NumPy's own memory, even inside a capturing cycle.
fn host_empty<'py>(
    py: Python<'py>,
    shape: &Bound<'py, PyTuple>,
    dtype: &Bound<'py, PyArrayDescr>,
    fortran: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let mut dims: Vec<npy_intp> = shape.iter().map(|d| d.extract::<npy_intp>()).collect::<PyResult<_>>()?;
    let previous = handler::set_handler(py, None)?;
    // SAFETY: `dims` holds `len` dimensions and outlives the call; the descriptor reference is
    // stolen by NumPy.
    let raw = unsafe {
        PY_ARRAY_API.PyArray_Empty(
            py,
            dims.len() as std::ffi::c_int,
            dims.as_mut_ptr(),
            dtype.clone().into_ptr().cast(),
            fortran as std::ffi::c_int,
        )
    };
    // SAFETY: a new reference, or NULL with an exception set.
    let out = unsafe { Bound::from_owned_ptr_or_err(py, raw) };
    handler::set_handler(py, Some(&previous))?;
    out
}

/// What an array's memory is: its host ndarray, or its device block.
type MemoryOf<'py> = (Option<Bound<'py, PyAny>>, Option<Arc<Block>>);

/// The host mirror workspace of a device workspace (None without `FULL` mirroring).
fn mirror_ws<'py>(ws: &Bound<'py, PyAny>) -> Option<Bound<'py, PyAny>> {
    let name = crate::calls::names(ws.py()).ok()?.mirror_ws.bind(ws.py());
    ws.getattr(name).ok().filter(|m| !m.is_none())
}

/// An independent copy of `a` in ordinary memory.
fn detached<'py>(py: Python<'py>, a: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let previous = handler::set_handler(py, None)?;
    let out = a.call_method1("copy", ("K",));
    handler::set_handler(py, Some(&previous))?;
    out
}

impl DeviceArray {
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        if self.disposed {
            return Err(disposed_error(py));
        }
        Ok(())
    }

    /// The host array of a host-memory DeviceArray.
    fn array<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.check(py)?;
        match &self.host {
            Some(h) => Ok(h.bind(py).clone()),
            None => Err(PyTypeError::new_err(format!(
                "this DeviceArray lives in device memory ({}); use .to_numpy() for a host copy",
                self.device.bind(py)
            ))),
        }
    }

    fn block(&self, py: Python<'_>) -> PyResult<&Block> {
        self.check(py)?;
        self.block.get().ok_or_else(|| disposed_error(py))
    }

    fn dims(&self, py: Python<'_>) -> PyResult<Vec<usize>> {
        self.shape.bind(py).iter().map(|d| d.extract::<usize>()).collect()
    }

    fn order(&self) -> &'static str {
        if self.fortran {
            "F"
        } else {
            "C"
        }
    }

    /// The host array, or the block (shared out of the array, so that a transfer runs with no
    /// borrow of the array held while the GIL is released).
    fn memory_of<'py>(slf: &Bound<'py, Self>) -> PyResult<MemoryOf<'py>> {
        let py = slf.py();
        let mut me = slf.borrow_mut();
        me.check(py)?;
        if let Some(h) = &me.host {
            return Ok((Some(h.bind(py).clone()), None));
        }
        let block = me.block.share().ok_or_else(|| disposed_error(py))?;
        Ok((None, Some(block)))
    }

    /// The pinned host mirror (`MirroringPolicy.FULL`), allocated on first use.
    fn mirror_of<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let (ws, shape, dtype, order) = {
            let me = slf.borrow();
            if let Some(m) = &me.mirror {
                return Ok(m.bind(py).clone());
            }
            (me.workspace.clone_ref(py), me.shape.clone_ref(py), me.dtype.clone_ref(py), me.order())
        };
        let Some(mws) = mirror_ws(ws.bind(py)) else {
            let name = ws.bind(py).getattr("name")?;
            return Err(PyValueError::new_err(format!(
                "workspace {} keeps no host mirror (policy_mirroring is not FULL)",
                name.repr()?
            )));
        };
        let m = mws.call_method1("empty", (shape, dtype, order))?;
        let mut me = slf.borrow_mut();
        match &me.mirror {
            Some(first) => Ok(first.bind(py).clone()), // another thread made one meanwhile
            None => {
                me.mirror = Some(m.clone().unbind());
                Ok(m)
            }
        }
    }

    fn host_dlpack<'py>(
        &self,
        py: Python<'py>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<&Bound<'py, PyAny>>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let a = self.array(py)?;
        if let Some(s) = stream {
            if !s.is_none() && !s.eq(-1)? {
                return Err(PyBufferError::new_err("a host DeviceArray takes no stream (pass None)"));
            }
        }
        if let Some(d) = dl_device {
            if d != (KDL_CPU, 0) {
                return Err(PyBufferError::new_err(format!("cannot export a host DeviceArray to device {d:?}")));
            }
        }
        let kwargs = PyDict::new(py);
        if let Some(v) = max_version {
            if !v.is_none() {
                kwargs.set_item("max_version", v)?;
            }
        }
        if let Some(c) = copy {
            kwargs.set_item("copy", c)?;
        }
        match a.call_method("__dlpack__", (), Some(&kwargs)) {
            Err(e) if e.is_instance_of::<PyTypeError>(py) => a.call_method0("__dlpack__"), // NumPy < 2.1
            other => other,
        }
    }
}

#[pymethods]
impl DeviceArray {
    #[getter]
    fn shape(&self, py: Python<'_>) -> PyResult<Py<PyTuple>> {
        self.check(py)?;
        Ok(self.shape.clone_ref(py))
    }

    #[getter]
    fn dtype(&self, py: Python<'_>) -> PyResult<Py<PyArrayDescr>> {
        self.check(py)?;
        Ok(self.dtype.clone_ref(py))
    }

    #[getter]
    fn strides<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.check(py)?;
        if let Some(h) = &self.host {
            return h.bind(py).getattr("strides");
        }
        let strides = contiguous_strides(&self.dims(py)?, self.itemsize, self.fortran);
        Ok(PyTuple::new(py, strides)?.into_any())
    }

    #[getter]
    fn ndim(&self, py: Python<'_>) -> PyResult<usize> {
        self.check(py)?;
        Ok(self.shape.bind(py).len())
    }

    #[getter]
    fn size(&self, py: Python<'_>) -> PyResult<usize> {
        self.check(py)?;
        Ok(self.size)
    }

    #[getter]
    fn nbytes(&self, py: Python<'_>) -> PyResult<usize> {
        self.check(py)?;
        Ok(self.size * self.itemsize)
    }

    #[getter]
    fn device(&self, py: Python<'_>) -> PyResult<Py<PyString>> {
        self.check(py)?;
        Ok(self.device.clone_ref(py))
    }

    /// The address of the first element.
    #[getter]
    fn ptr(&self, py: Python<'_>) -> PyResult<usize> {
        self.check(py)?;
        if let Some(h) = &self.host {
            let a = h.bind(py).cast::<PyUntypedArray>()?;
            // SAFETY: a live ndarray; `data` is a field of every NumPy's array struct.
            return Ok(unsafe { (*a.as_array_ptr()).fields.data } as usize);
        }
        Ok(self.block(py)?.ptr)
    }

    /// The workspace the array came from.
    #[getter]
    fn workspace(&self, py: Python<'_>) -> Py<PyAny> {
        self.workspace.clone_ref(py)
    }

    #[getter]
    fn is_disposed(&self) -> bool {
        self.disposed
    }

    /// The host ndarray of a host-memory array (None over device memory, or once disposed).
    #[getter]
    fn _host(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.host.as_ref().filter(|_| !self.disposed).map(|h| h.clone_ref(py))
    }

    /// Whether the array is in Fortran order (and not also in C order).
    #[getter]
    fn _fortran(&self) -> bool {
        self.fortran
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        self.check(py)?;
        let shape = self.shape.bind(py);
        if shape.is_empty() {
            return Err(PyTypeError::new_err("len() of a 0-d DeviceArray"));
        }
        shape.get_item(0)?.extract()
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        if self.disposed {
            return Ok("DeviceArray(<disposed>)".to_string());
        }
        Ok(format!(
            "DeviceArray(shape={}, dtype={}, device={})",
            self.shape.bind(py).repr()?,
            self.dtype.bind(py).str()?,
            self.device.bind(py).repr()?
        ))
    }

    // -- exchange ----------------------------------------------------------------------------------
    /// The host array's interface. Its consumer (`np.asarray`) makes an array whose `base` is this
    /// object and which points into its memory: the array is marked exported, so that `dispose`
    /// keeps the memory for as long as this object lives.
    #[getter]
    fn __array_interface__<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        if self.host.is_none() && !self.disposed {
            return Err(PyAttributeError::new_err("a DeviceArray over device memory has no __array_interface__"));
        }
        let interface = self.array(py)?.getattr("__array_interface__")?;
        self.exported = true;
        Ok(interface)
    }

    /// The buffer protocol of a host-memory array (`memoryview(d)`, `np.frombuffer(d)`): the host
    /// array's own buffer, zero-copy. The view holds the host array, so the memory lives as long
    /// as the view, whatever happens to this object.
    ///
    /// # Safety
    /// `view` is a `Py_buffer` for CPython to fill, as the buffer protocol passes it.
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut pyo3::ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let py = slf.py();
        let host = {
            let mut me = slf.borrow_mut();
            me.check(py)?;
            let Some(h) = &me.host else {
                return Err(PyBufferError::new_err(format!(
                    "a DeviceArray in device memory ({}) has no host buffer; use .to_numpy() for a host copy",
                    me.device.bind(py)
                )));
            };
            let h = h.clone_ref(py);
            me.exported = true;
            h
        };
        // SAFETY: `view` is the caller's buffer to fill; the host ndarray fills it (its `obj` a
        // new reference to that ndarray) or sets an exception and leaves it unfilled.
        if unsafe { pyo3::ffi::PyObject_GetBuffer(host.as_ptr(), view, flags) } != 0 {
            return Err(PyErr::fetch(py));
        }
        Ok(())
    }

    #[getter]
    fn __cuda_array_interface__<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.check(py)?;
        let Some(block) = self.block.get() else {
            return Err(PyAttributeError::new_err("a DeviceArray over host memory has no __cuda_array_interface__"));
        };
        if self.host.is_some() {
            return Err(PyAttributeError::new_err("a DeviceArray over host memory has no __cuda_array_interface__"));
        }
        let ptr = if self.size > 0 { block.ptr } else { 0 };
        let c_order = !self.fortran || self.shape.bind(py).len() <= 1;
        // A consumer now references the memory through this object: it stays alive with it.
        self.exported = true;
        let typestr = self.dtype.bind(py).getattr(crate::calls::names(py)?.str_.bind(py))?;
        let d = PyDict::new(py);
        d.set_item("shape", self.shape.bind(py))?;
        d.set_item("typestr", &typestr)?;
        d.set_item("descr", PyList::new(py, [("", &typestr)])?)?;
        d.set_item("data", (ptr, false))?;
        if c_order {
            d.set_item("strides", py.None())?;
        } else {
            d.set_item("strides", self.strides(py)?)?;
        }
        d.set_item("version", 3)?;
        // The workspace's own fills and copies run on the legacy default stream.
        d.set_item("stream", 1)?;
        Ok(d)
    }

    #[pyo3(signature = (dtype=None, copy=None))]
    fn __array__<'py>(
        &self,
        py: Python<'py>,
        dtype: Option<&Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let a = self.array(py)?;
        let dtype = dtype.filter(|d| !d.is_none());
        if copy == Some(true) {
            let kwargs = PyDict::new(py);
            kwargs.set_item("dtype", dtype)?;
            kwargs.set_item("copy", true)?;
            return numpy(py)?.call_method("array", (a,), Some(&kwargs));
        }
        match dtype {
            None => Ok(a),
            Some(d) => {
                let kwargs = PyDict::new(py);
                kwargs.set_item("copy", false)?;
                a.call_method("astype", (d,), Some(&kwargs))
            }
        }
    }

    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &mut self,
        py: Python<'py>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<&Bound<'py, PyAny>>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        if self.host.is_some() || self.disposed || self.block.get().is_none() {
            return self.host_dlpack(py, stream, max_version, dl_device, copy).map(Bound::unbind);
        }
        if let Some(d) = dl_device {
            if d != self.dl {
                return Err(PyBufferError::new_err(format!("cannot export an array on {:?} to device {d:?}", self.dl)));
            }
        }
        let dtype = self.dtype.bind(py);
        let dl_dtype = dl_dtype(dtype)?;
        let stream = stream.filter(|s| !s.is_none());
        let stream: Option<i64> = if self.dl.0 == KDL_CUDA {
            let s = match stream {
                None => 1,
                Some(s) if s.is_instance_of::<pyo3::types::PyBool>() || !s.is_instance_of::<PyInt>() => {
                    return Err(PyTypeError::new_err(format!(
                        "stream must be an int or None, got {}",
                        s.get_type().name()?
                    )));
                }
                Some(s) => s.extract::<i64>()?,
            };
            if s == 0 || s < -1 {
                return Err(PyValueError::new_err(format!(
                    "invalid stream {s}: 0 is ambiguous; use 1 (legacy default) or 2"
                )));
            }
            Some(s)
        } else {
            match stream {
                None => None,
                Some(s) if s.eq(-1)? => None,
                Some(_) => {
                    return Err(PyBufferError::new_err(format!(
                        "a DeviceArray on DLPack device {:?} takes no stream (pass None)",
                        self.dl
                    )));
                }
            }
        };
        self.check(py)?;
        let mut block = self.block.share().ok_or_else(|| disposed_error(py))?;
        let mut copied = false;
        if copy == Some(true) {
            let fresh = Block::new(&block.memory, block.nbytes, false).map_err(|e| to_py(py, e))?;
            fresh.copy_from(py, &block, block.nbytes)?;
            block = Arc::new(fresh);
            copied = true;
        }
        if let Some(s) = stream.filter(|&s| s != -1) {
            block.order_before(py, s as usize)?; // after the copy: the consumer waits for it too
        }
        let versioned = match max_version {
            Some(v) if !v.is_none() => {
                let (major, _minor) = v.extract::<(i64, i64)>().map_err(|_| {
                    PyTypeError::new_err(format!("max_version must be a (major, minor) tuple of ints, got {v}"))
                })?;
                major >= 1
            }
            _ => false,
        };
        let shape: Vec<i64> = self.dims(py)?.into_iter().map(|d| d as i64).collect();
        let strides = if self.fortran {
            Some(
                contiguous_strides(&self.dims(py)?, self.itemsize, true)
                    .into_iter()
                    .map(|s| (s / self.itemsize.max(1) as isize) as i64)
                    .collect(),
            )
        } else {
            None
        };
        let ptr = block.ptr;
        dlpack_capsule(py, block, ptr, shape, strides, dl_dtype, self.dl, versioned, false, copied)
    }

    fn __dlpack_device__(&self, py: Python<'_>) -> PyResult<(i32, i32)> {
        self.check(py)?;
        Ok(self.dl)
    }

    // -- host side ---------------------------------------------------------------------------------
    /// The host mirror in pinned memory (`FULL` mirroring), as last synchronised; for a
    /// host-memory array, the array itself.
    #[getter]
    fn host<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        match Self::memory_of(slf)? {
            (Some(h), _) => Ok(h),
            _ => Self::mirror_of(slf),
        }
    }

    /// Copies the device contents into the host mirror and returns it.
    fn sync_to_host<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        match Self::memory_of(slf)? {
            (Some(h), _) => Ok(h),
            (None, block) => {
                let mirror = Self::mirror_of(slf)?;
                block.ok_or_else(|| disposed_error(py))?.copy_to_host(py, &mirror)?;
                Ok(mirror)
            }
        }
    }

    /// Copies the host mirror into device memory; returns self.
    fn sync_to_device<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, Self>> {
        let py = slf.py();
        if let (None, Some(block)) = Self::memory_of(slf)? {
            let mirror = Self::mirror_of(slf)?;
            block.copy_from_host(py, &mirror)?;
        }
        Ok(slf.clone())
    }

    /// An independent copy in ordinary host memory.
    #[allow(clippy::wrong_self_convention)] // the Python API's name
    fn to_numpy<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let (host, block) = Self::memory_of(slf)?;
        if let Some(h) = host {
            return detached(py, &h);
        }
        let (shape, dtype, fortran, ws) = {
            let me = slf.borrow();
            (me.shape.clone_ref(py), me.dtype.clone_ref(py), me.fortran, me.workspace.clone_ref(py))
        };
        let out = host_empty(py, shape.bind(py), dtype.bind(py), fortran)?;
        if mirror_ws(ws.bind(py)).is_some() {
            let mirror = Self::sync_to_host(slf)?; // a DMA into pinned memory, then one host copy
            numpy(py)?.call_method1("copyto", (&out, mirror))?;
        } else {
            block.ok_or_else(|| disposed_error(py))?.copy_to_host(py, &out)?;
        }
        Ok(out)
    }

    /// Copies `host_array` (same shape, castable) into this array; returns self.
    fn copy_from<'py>(slf: &Bound<'py, Self>, host_array: &Bound<'py, PyAny>) -> PyResult<Bound<'py, Self>> {
        let py = slf.py();
        let (shape, dtype, fortran, ws) = {
            let me = slf.borrow();
            me.check(py)?;
            (me.shape.clone_ref(py), me.dtype.clone_ref(py), me.fortran, me.workspace.clone_ref(py))
        };
        let (shape, dtype) = (shape.bind(py), dtype.bind(py));
        let np = numpy(py)?;
        let src = np.call_method1("asarray", (host_array,))?;
        if !src.getattr("shape")?.eq(shape)? {
            return Err(PyValueError::new_err(format!(
                "copy_from: shape {} does not match {}",
                src.getattr("shape")?.repr()?,
                shape.repr()?
            )));
        }
        let same_kind = PyDict::new(py);
        same_kind.set_item("casting", "same_kind")?;
        let (host, block) = Self::memory_of(slf)?;
        if let Some(h) = host {
            np.call_method("copyto", (h, &src), Some(&same_kind))?;
            return Ok(slf.clone());
        }
        let src_dtype = src.getattr("dtype")?;
        if !np.call_method1("can_cast", (&src_dtype, dtype, "same_kind"))?.is_truthy()? {
            return Err(PyTypeError::new_err(format!(
                "copy_from: cannot cast {} to {} under 'same_kind'",
                src_dtype.str()?,
                dtype.str()?
            )));
        }
        if mirror_ws(ws.bind(py)).is_some() {
            let mirror = Self::mirror_of(slf)?;
            np.call_method("copyto", (&mirror, &src), Some(&same_kind))?;
            return Self::sync_to_device(slf);
        }
        let order = if fortran { "F" } else { "C" };
        let kwargs = PyDict::new(py);
        kwargs.set_item("dtype", dtype)?;
        kwargs.set_item("order", order)?;
        let mut staged = np.call_method("asarray", (&src,), Some(&kwargs))?;
        let flags = staged.getattr("flags")?;
        if !flags.getattr(if fortran { "f_contiguous" } else { "c_contiguous" })?.is_truthy()? {
            let kw = PyDict::new(py);
            kw.set_item("order", order)?;
            staged = staged.call_method("copy", (), Some(&kw))?;
        }
        block.ok_or_else(|| disposed_error(py))?.copy_from_host(py, &staged)?;
        Ok(slf.clone())
    }

    /// Releases the memory now (idempotent); any later use raises `DisposedArrayError`.
    ///
    /// Consumers that took the array through DLPack or the buffer protocol keep their memory
    /// alive; an array handed out through `__cuda_array_interface__` or `__array_interface__`
    /// (whose consumers point into it through this object) keeps its memory until the object
    /// itself dies.
    fn dispose(slf: &Bound<'_, Self>) -> PyResult<()> {
        let py = slf.py();
        let (scope, thread, released, memory) = {
            let mut me = slf.borrow_mut();
            if me.disposed {
                return Ok(());
            }
            me.disposed = true;
            let host = if me.exported { None } else { me.host.take() };
            let mirror = me.mirror.take();
            let block = if me.exported { Held::None } else { std::mem::replace(&mut me.block, Held::None) };
            let memory = block.get().map(|b| b.memory.clone());
            (me.scope.take(), me.thread, (host, mirror, block), memory)
        };
        drop(released); // outside the borrow: releasing may run Python (a mirror's finaliser)
        if let Some(memory) = memory {
            crate::device::reclaim(py, &memory);
        }
        let scoped = scope.is_some();
        dispose::count_disposed(thread, scoped);
        if let Some(scope) = scope {
            let arrays = scope.bind(py).getattr("_arrays")?;
            arrays.call_method1("pop", (slf.as_ptr() as usize, py.None()))?;
        }
        Ok(())
    }
}

/// A `DeviceArray` over the host ndarray `host` of `workspace` (host fallback, `HOST_ONLY`).
#[pyfunction]
#[pyo3(signature = (host, workspace, device="cpu"))]
pub(crate) fn wrap_host<'py>(
    py: Python<'py>,
    host: &Bound<'py, PyAny>,
    workspace: &Bound<'py, PyAny>,
    device: &str,
) -> PyResult<Bound<'py, DeviceArray>> {
    let Ok(a) = host.cast::<PyUntypedArray>() else {
        return Err(PyTypeError::new_err(format!("DeviceArray wraps an ndarray, got {}", host.get_type().name()?)));
    };
    let (thread, scope) = dispose::state(py);
    let array = DeviceArray {
        block: Held::None,
        host: Some(host.clone().unbind()),
        mirror: None,
        workspace: workspace.clone().unbind(),
        device: PyString::new(py, device).unbind(),
        dl: (KDL_CPU, 0),
        shape: host.getattr("shape")?.cast_into::<PyTuple>()?.unbind(),
        dtype: a.dtype().unbind(),
        itemsize: a.dtype().itemsize(),
        size: a.len(),
        fortran: a.is_fortran_contiguous() && !a.is_c_contiguous(),
        exported: false,
        disposed: false,
        scope: None,
        thread,
    };
    register(py, array, scope)
}

/// `empty` / `zeros` of a device workspace whose arrays live in device memory: a `DeviceArray`
/// over a new block of `memory`, the memory of `workspace`.
pub(crate) fn new_device_array<'py>(
    workspace: &Bound<'py, PyAny>,
    memory: &Arc<Memory>,
    side: &DeviceSide,
    shape: &Bound<'py, PyAny>,
    dtype: Option<&Bound<'py, PyAny>>,
    order: &str,
    zeroed: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let py = workspace.py();
    let no_dimensions;
    let shape = if none_as_no_dimensions(shape)? {
        no_dimensions = PyTuple::empty(py).into_any();
        &no_dimensions
    } else {
        shape
    };
    // The dtype first, then the shape: a call wrong in both fails as NumPy's does.
    let descr = match dtype {
        Some(d) if d.is_instance_of::<PyArrayDescr>() => {
            let d = d.cast::<PyArrayDescr>()?.clone();
            if d.has_object() {
                return extract_descr(py, Some(d.as_any())).map(Bound::into_any);
                // the refusal
            }
            d
        }
        other => extract_descr(py, other)?,
    };
    let (shape, size) = shape_tuple(py, shape)?;
    let fortran = is_fortran(order)?;
    let itemsize = descr.itemsize();
    let nbytes = size
        .checked_mul(itemsize)
        .filter(|n| *n <= isize::MAX as usize)
        .ok_or_else(|| PyValueError::new_err("array is too big"))?;
    memory.shared.check_alive().map_err(|e| to_py(py, e))?;
    let block = Block::new_py(py, memory, nbytes, zeroed)?;
    let (thread, scope) = dispose::state(py);
    let array = DeviceArray {
        block: Held::Own(block),
        host: None,
        mirror: None,
        workspace: workspace.clone().unbind(),
        device: side.name.clone_ref(py),
        dl: side.dl,
        shape: shape.unbind(),
        dtype: descr.unbind(),
        itemsize,
        size,
        fortran,
        exported: false,
        disposed: false,
        scope: None,
        thread,
    };
    register(py, array, scope).map(Bound::into_any)
}
