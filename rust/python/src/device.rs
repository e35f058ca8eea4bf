//! Memory of device workspaces as Python sees it: a [`DeviceBuffer`] owns one workspace block
//! (device memory, or its host stand-in) and gives it back when the last reference dies, so a
//! consumer holding the buffer (a DLPack tensor, a CuPy pointer) keeps the memory from being
//! reused. Also the C functions PyTorch's `CUDAPluggableAllocator` loads from this module.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use rustws_core::cuda::CudaMemory;
use rustws_core::{Backend, Error};

use crate::arrays::ArrayFields;
use crate::handler::Shared;
use crate::{to_py, WorkspaceCore};

/// Device buffers start at this alignment (what `cudaMalloc` guarantees and CUDA libraries
/// expect); workspace blocks are 64-byte aligned, so each request carries the difference.
pub(crate) const DEVICE_ALIGN: usize = 256;
const SLACK: usize = DEVICE_ALIGN - rustws_core::BLOCK_ALIGN;

fn align_up(p: usize) -> usize {
    (p + DEVICE_ALIGN - 1) & !(DEVICE_ALIGN - 1)
}

/// The memory source of a workspace and, for CUDA devices, the device itself (for stream
/// ordering and memory queries).
#[derive(Clone)]
pub(crate) struct Memory {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) cuda: Option<Arc<CudaMemory>>,
}

/// Allocates `nbytes` at [`DEVICE_ALIGN`] from `shared`; returns (block, aligned pointer).
pub(crate) fn alloc_aligned(shared: &Shared, nbytes: usize) -> Result<(NonNull<u8>, usize), Error> {
    let request = nbytes.max(1).checked_add(SLACK).ok_or_else(|| Error::OutOfMemory {
        workspace: shared.name.clone(),
        requested: nbytes as u64,
        in_use: 0,
        limit: 0,
        reason: "request too large",
    })?;
    let mut ws = shared.lock();
    let raw = if ws.is_destroyed() { ws.alloc_unaccounted(request, false) } else { ws.alloc(request) }?;
    Ok((raw, align_up(raw.as_ptr() as usize)))
}

/// One block of a workspace, at [`DEVICE_ALIGN`]; released when the last reference dies.
#[pyclass(frozen, module = "rustws._rustws")]
pub(crate) struct DeviceBuffer {
    shared: Arc<Shared>,
    memory: Memory,
    /// The workspace block (freed on drop).
    raw: usize,
    ptr: usize,
    nbytes: usize,
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Some(p) = NonNull::new(self.raw as *mut u8) {
            // SAFETY: `raw` is a live block of this workspace, allocated in `new` and freed only here.
            unsafe { self.shared.lock().free(p) };
        }
    }
}

/// A host ndarray's data: (pointer, bytes); it must be contiguous (and writeable to be written).
fn host_bytes(array: &Bound<'_, PyAny>, writeable: bool) -> PyResult<(NonNull<u8>, usize)> {
    let Ok(a) = array.cast::<PyUntypedArray>() else {
        return Err(PyTypeError::new_err(format!("expected a numpy.ndarray, got {}", array.get_type().name()?)));
    };
    if !a.is_c_contiguous() && !a.is_fortran_contiguous() {
        return Err(PyValueError::new_err("the host array must be contiguous"));
    }
    let nbytes = a.len().checked_mul(a.dtype().itemsize()).ok_or_else(|| PyValueError::new_err("array too large"))?;
    // SAFETY: `a` is a live ndarray; `data` and `flags` sit where `ArrayFields` says in every
    // NumPy this module supports (they precede the fields NumPy ever added).
    let (data, flags) = unsafe {
        let f = &*(a.as_array_ptr() as *const ArrayFields);
        (f.data, f.flags)
    };
    const WRITEABLE: c_int = 0x0400;
    if writeable && flags & WRITEABLE == 0 {
        return Err(PyValueError::new_err("the host array is read-only"));
    }
    let data = NonNull::new(data.cast::<u8>()).unwrap_or(NonNull::dangling());
    Ok((data, nbytes))
}

impl DeviceBuffer {
    fn check_len(&self, what: &str, n: usize) -> PyResult<()> {
        if n > self.nbytes {
            return Err(PyValueError::new_err(format!(
                "{what}: {n} bytes do not fit in a buffer of {} bytes",
                self.nbytes
            )));
        }
        Ok(())
    }

    fn at(&self) -> NonNull<u8> {
        // `ptr` is never null: it is aligned up from a live block.
        NonNull::new(self.ptr as *mut u8).expect("device buffers are never null")
    }
}

#[pymethods]
impl DeviceBuffer {
    /// The address of the first byte (256-byte aligned).
    #[getter]
    fn ptr(&self) -> usize {
        self.ptr
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }

    /// Copies the bytes of `array` (a contiguous ndarray, at most `nbytes` long) into the buffer.
    fn copy_from_host(&self, py: Python<'_>, array: &Bound<'_, PyAny>) -> PyResult<()> {
        let (src, n) = host_bytes(array, false)?;
        self.check_len("copy_from_host", n)?;
        if n == 0 {
            return Ok(());
        }
        let (dst, src) = (self.at().as_ptr() as usize, src.as_ptr() as usize);
        let backend = self.memory.backend.clone();
        // SAFETY: `dst` is this live buffer (n <= nbytes), `src` the host array held alive by
        // `array` for the whole call; a host array never overlaps a workspace block it did not
        // come from, and the bytes are read only.
        py.detach(|| unsafe {
            backend.copy_from_host(NonNull::new_unchecked(dst as *mut u8), NonNull::new_unchecked(src as *mut u8), n)
        })
        .map_err(|e| to_py(py, Error::Unavailable { what: e }))
    }

    /// Copies the buffer's first bytes into `array` (a writeable contiguous ndarray).
    fn copy_to_host(&self, py: Python<'_>, array: &Bound<'_, PyAny>) -> PyResult<()> {
        let (dst, n) = host_bytes(array, true)?;
        self.check_len("copy_to_host", n)?;
        if n == 0 {
            return Ok(());
        }
        let (dst, src) = (dst.as_ptr() as usize, self.at().as_ptr() as usize);
        let backend = self.memory.backend.clone();
        // SAFETY: `src` is this live buffer (n <= nbytes); `dst` the writeable host array held
        // alive by `array` for the whole call.
        py.detach(|| unsafe {
            backend.copy_to_host(NonNull::new_unchecked(dst as *mut u8), NonNull::new_unchecked(src as *mut u8), n)
        })
        .map_err(|e| to_py(py, Error::Unavailable { what: e }))
    }

    /// Copies `nbytes` bytes from `other` (a buffer of the same workspace's backend) into this one.
    fn copy_from(&self, other: &DeviceBuffer, nbytes: usize) -> PyResult<()> {
        self.check_len("copy_from", nbytes)?;
        other.check_len("copy_from", nbytes)?;
        if !Arc::ptr_eq(&self.memory.backend, &other.memory.backend) {
            return Err(PyValueError::new_err("copy_from: the buffers belong to different memory sources"));
        }
        if nbytes > 0 && self.ptr != other.ptr {
            // SAFETY: both are live buffers of this backend, valid for `nbytes`; distinct live
            // blocks never overlap.
            unsafe { self.memory.backend.copy(self.at(), other.at(), nbytes) };
        }
        Ok(())
    }

    /// Makes work later submitted to `stream` (DLPack numbering: 1 legacy default, 2
    /// per-thread default, else a `CUstream` handle) wait for the workspace's own copies and
    /// fills. A no-op for memory that is not a CUDA device's.
    fn order_before(&self, py: Python<'_>, stream: usize) -> PyResult<()> {
        match &self.memory.cuda {
            Some(cuda) => cuda.order_before(stream).map_err(|e| to_py(py, Error::Unavailable { what: e })),
            None => Ok(()),
        }
    }

    fn __repr__(&self) -> String {
        format!("<DeviceBuffer {} bytes at {:#x} of workspace {:?}>", self.nbytes, self.ptr, self.shared.name)
    }
}

impl WorkspaceCore {
    /// A new buffer of `nbytes` from this workspace, zero-filled when `zeroed`.
    pub(crate) fn new_buffer(&self, py: Python<'_>, nbytes: usize, zeroed: bool) -> PyResult<DeviceBuffer> {
        let (raw, ptr) = alloc_aligned(&self.shared, nbytes).map_err(|e| to_py(py, e))?;
        let buffer = DeviceBuffer {
            shared: self.shared.clone(),
            memory: self.memory.clone(),
            raw: raw.as_ptr() as usize,
            ptr,
            nbytes,
        };
        if zeroed && nbytes > 0 {
            // SAFETY: the buffer's `nbytes` bytes lie in the block just allocated.
            unsafe { self.memory.backend.zero(buffer.at(), nbytes) };
        }
        Ok(buffer)
    }
}

// -- PyTorch's pluggable allocator ----------------------------------------------------------------

thread_local! {
    /// The workspace this thread's PyTorch allocations go to, and the device it serves. PyTorch
    /// calls the allocator on the thread that allocates, and `use_mem_pool` routes only that
    /// thread's allocations to the pool, so the route is per thread too.
    static TORCH_TARGET: std::cell::RefCell<Option<(Arc<Shared>, i32)>> = const { std::cell::RefCell::new(None) };
}

/// Blocks handed to PyTorch, by the pointer it got: (workspace, block).
type TorchBlocks = HashMap<usize, (Arc<Shared>, usize)>;
static TORCH_BLOCKS: Mutex<Option<TorchBlocks>> = Mutex::new(None);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Routes this thread's `rustws_torch_malloc` calls to `workspace` on device `ordinal` (None:
/// refuse them).
#[pyfunction]
#[pyo3(signature = (workspace, ordinal=0))]
pub(crate) fn torch_route(workspace: Option<&Bound<'_, WorkspaceCore>>, ordinal: i32) {
    let target = workspace.map(|w| (w.get().shared.clone(), ordinal));
    TORCH_TARGET.with(|t| *t.borrow_mut() = target);
}

/// Blocks PyTorch holds from rustws workspaces, and their total bytes.
#[pyfunction]
pub(crate) fn torch_blocks() -> (usize, usize) {
    let blocks = lock(&TORCH_BLOCKS);
    let Some(map) = blocks.as_ref() else { return (0, 0) };
    let bytes = map.values().map(|(s, raw)| {
        let ws = s.lock();
        // SAFETY: every entry is a live block of its workspace (removed before it is freed).
        NonNull::new(*raw as *mut u8).map_or(0, |p| unsafe { ws.block_info(p) }.requested)
    });
    (map.len(), bytes.sum())
}

/// `void* alloc(ssize_t size, int device, cudaStream_t stream)` for
/// `torch.cuda.memory.CUDAPluggableAllocator`: a block of the workspace routed on this thread,
/// or NULL (which PyTorch reports as out of memory) when nothing is routed, the device differs,
/// or the workspace refuses.
#[no_mangle]
pub extern "C" fn rustws_torch_malloc(size: isize, device: c_int, _stream: *mut c_void) -> *mut c_void {
    catch_unwind(AssertUnwindSafe(|| {
        let Some((shared, ordinal)) = TORCH_TARGET.try_with(|t| t.borrow().clone()).ok().flatten() else {
            return std::ptr::null_mut();
        };
        if device != ordinal || size < 0 {
            return std::ptr::null_mut();
        }
        match alloc_aligned(&shared, size as usize) {
            Ok((raw, ptr)) => {
                lock(&TORCH_BLOCKS).get_or_insert_with(HashMap::new).insert(ptr, (shared, raw.as_ptr() as usize));
                ptr as *mut c_void
            }
            Err(_) => {
                shared.lock().record_failure();
                std::ptr::null_mut()
            }
        }
    }))
    .unwrap_or(std::ptr::null_mut())
}

/// `void free(void* ptr, ssize_t size, int device, cudaStream_t stream)`: gives a block back to
/// the workspace it came from (whichever is routed now). Unknown pointers are ignored.
#[no_mangle]
pub extern "C" fn rustws_torch_free(ptr: *mut c_void, _size: isize, _device: c_int, _stream: *mut c_void) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        let entry = lock(&TORCH_BLOCKS).as_mut().and_then(|m| m.remove(&(ptr as usize)));
        if let Some((shared, raw)) = entry {
            if let Some(p) = NonNull::new(raw as *mut u8) {
                // SAFETY: `raw` is the live block handed out for `ptr`, removed from the table
                // above so it is freed once.
                unsafe { shared.lock().free(p) };
            }
        }
    }));
}
