//! DLPack capsules (the `__dlpack__` protocol): a `DLManagedTensor` in a `"dltensor"` capsule, or
//! a `DLManagedTensorVersioned` in a `"dltensor_versioned"` capsule for consumers that ask for
//! DLPack >= 1.0. The tensor's `manager_ctx` holds a strong reference to the workspace block that
//! owns the memory, so the memory lives as long as the consumer's tensor,
//! whoever frees it and on whatever thread.

use std::ffi::{c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;

use crate::device::Block;

const LEGACY: &CStr = c"dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";

/// DLPack's ABI version of the versioned structures.
const DLPACK_MAJOR: u32 = 1;
const DLPACK_MINOR: u32 = 0;
const FLAG_READ_ONLY: u64 = 1;
const FLAG_IS_COPIED: u64 = 1 << 1;

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// What a tensor's `manager_ctx` owns: the workspace block holding the memory (released without
/// the GIL, from whatever thread the consumer deletes the tensor on) and the shape and strides
/// the tensor points into.
struct Context {
    _owner: Arc<Block>,
    shape: Vec<i64>,
    strides: Vec<i64>,
}

/// The two managed-tensor structures, as their one deleter sees them.
trait Managed {
    fn manager_ctx(&self) -> *mut c_void;
}

impl Managed for DLManagedTensor {
    fn manager_ctx(&self) -> *mut c_void {
        self.manager_ctx
    }
}

impl Managed for DLManagedTensorVersioned {
    fn manager_ctx(&self) -> *mut c_void {
        self.manager_ctx
    }
}

/// The deleter of both structures: frees the tensor and releases its `Context`.
unsafe extern "C" fn delete<T: Managed>(t: *mut T) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        if t.is_null() {
            return;
        }
        // SAFETY: `t` came from `Box::into_raw` in `dlpack_capsule`, and DLPack calls the deleter
        // once; `manager_ctx` came from `Box::into_raw` of a `Context`.
        unsafe {
            let t = Box::from_raw(t);
            drop(Box::from_raw(t.manager_ctx() as *mut Context));
        }
    }));
}

/// A capsule nobody consumed (still under its original name) deletes its tensor.
unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: Python passes our capsule; `PyCapsule_IsValid` sets no exception.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, LEGACY.as_ptr()) == 1 {
            delete(ffi::PyCapsule_GetPointer(capsule, LEGACY.as_ptr()) as *mut DLManagedTensor);
        } else if ffi::PyCapsule_IsValid(capsule, VERSIONED.as_ptr()) == 1 {
            delete(ffi::PyCapsule_GetPointer(capsule, VERSIONED.as_ptr()) as *mut DLManagedTensorVersioned);
        }
    }
}

/// A DLPack capsule over `ptr` (`shape`, `strides` in elements or None for C order, `dtype` as
/// DLPack's `(code, bits, lanes)`, on `device` `(type, id)`), keeping `owner` alive until the
/// consumer deletes the tensor. `versioned` selects the DLPack 1.0 structure and capsule name.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dlpack_capsule(
    py: Python<'_>,
    owner: Arc<Block>,
    ptr: usize,
    shape: Vec<i64>,
    strides: Option<Vec<i64>>,
    dtype: (u8, u8, u16),
    device: (i32, i32),
    versioned: bool,
    readonly: bool,
    copied: bool,
) -> PyResult<Py<PyAny>> {
    if shape.iter().any(|&d| d < 0) {
        return Err(PyValueError::new_err(format!("invalid shape {shape:?}: negative dimension")));
    }
    let strides = match strides {
        Some(s) if s.len() != shape.len() => {
            return Err(PyValueError::new_err(format!("strides {s:?} do not match shape {shape:?}")));
        }
        Some(s) => s,
        None => {
            // C order, in elements.
            let mut s = vec![0i64; shape.len()];
            let mut step = 1i64;
            for (i, &d) in shape.iter().enumerate().rev() {
                s[i] = step;
                step = step.saturating_mul(d.max(1));
            }
            s
        }
    };
    if dtype.2 == 0 || dtype.1 == 0 {
        return Err(PyBufferError::new_err(format!("dtype {dtype:?} cannot be exported through DLPack")));
    }
    let ndim = shape.len() as i32;
    let mut ctx = Box::new(Context { _owner: owner, shape, strides });
    let tensor = DLTensor {
        data: ptr as *mut c_void,
        device: DLDevice { device_type: device.0, device_id: device.1 },
        ndim,
        dtype: DLDataType { code: dtype.0, bits: dtype.1, lanes: dtype.2 },
        shape: ctx.shape.as_mut_ptr(),
        strides: ctx.strides.as_mut_ptr(),
        byte_offset: 0,
    };
    let ctx = Box::into_raw(ctx) as *mut c_void;
    let (pointer, name): (*mut c_void, &CStr) = if versioned {
        let flags = if readonly { FLAG_READ_ONLY } else { 0 } | if copied { FLAG_IS_COPIED } else { 0 };
        let t = Box::new(DLManagedTensorVersioned {
            version: DLPackVersion { major: DLPACK_MAJOR, minor: DLPACK_MINOR },
            manager_ctx: ctx,
            deleter: Some(delete::<DLManagedTensorVersioned>),
            flags,
            dl_tensor: tensor,
        });
        (Box::into_raw(t).cast(), VERSIONED)
    } else {
        let t =
            Box::new(DLManagedTensor { dl_tensor: tensor, manager_ctx: ctx, deleter: Some(delete::<DLManagedTensor>) });
        (Box::into_raw(t).cast(), LEGACY)
    };
    // SAFETY: `pointer` is a heap tensor whose ownership passes to the capsule; the name is static.
    let cap = unsafe { ffi::PyCapsule_New(pointer, name.as_ptr(), Some(capsule_destructor)) };
    if cap.is_null() {
        // SAFETY: no capsule took the tensor: delete it here, once.
        unsafe {
            if versioned {
                delete(pointer.cast::<DLManagedTensorVersioned>());
            } else {
                delete(pointer.cast::<DLManagedTensor>());
            }
        }
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new strong reference we own.
    Ok(unsafe { Bound::from_owned_ptr(py, cap) }.unbind())
}
