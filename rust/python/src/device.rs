//! Memory of device workspaces as Python sees it: a [`Block`] owns one workspace block (device
//! memory, or its host stand-in) and gives it back when the last owner drops it, so a consumer
//! holding it (a `DeviceArray`, a DLPack tensor, a CuPy pointer through a [`DeviceBuffer`]) keeps
//! the memory from being reused. Also the C functions PyTorch's `CUDAPluggableAllocator` loads
//! from this module.
//!
//! Releases leave the hot locks: the CUDA backends queue `cuMemFree` / `cuMemFreeHost`, and
//! [`reclaim`] runs the queue after the workspace lock is dropped, with the GIL released. The GIL
//! is released only where a `Python` token proves the thread holds it: `Drop` impls and the C
//! entry points (DLPack deleters, PyTorch's allocator hooks) run on threads that may or may not
//! hold it, so they hand the queue to the driver only when the thread certainly holds no GIL, and
//! otherwise leave it to the next call that has a token (or to the next device allocation).
//!
//! A block a consumer used on another stream goes back to the workspace only once that stream's
//! work submitted before the release has completed: the core's `release` module orders it; this
//! module tells it where blocks go back and whether the thread may block on the driver.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use rustws_core::cuda::{CudaMemory, DeferredRelease};
use rustws_core::release::{PendingReleases, ReleaseOrder};
use rustws_core::{Backend, Error};

use crate::arrays::ArrayFields;
use crate::errors::to_py;
use crate::shared::Shared;

/// Device buffers start at this alignment (what `cudaMalloc` guarantees and CUDA libraries
/// expect); arena blocks are 64-byte aligned, so they carry the difference (blocks of their own
/// from the driver are aligned already, and carry nothing).
pub(crate) const DEVICE_ALIGN: usize = 256;

fn align_up(p: usize) -> usize {
    (p + DEVICE_ALIGN - 1) & !(DEVICE_ALIGN - 1)
}

extern "C" {
    /// Public C API of every CPython (not in the limited API's headers; see `scope.rs`).
    fn PyGILState_Check() -> c_int;
}

/// Whether the calling thread certainly holds no GIL. `PyGILState_Check()` may say 1 for a
/// thread that holds none (on every thread once a subinterpreter exists, and on 3.11 after
/// finalisation), so its 1 proves nothing and is never used to release the GIL; its 0 means this
/// thread's own thread state is not the one running (the thread may at worst hold the GIL through
/// a thread state of its own making, when waiting on the driver with it only costs time).
fn certainly_detached() -> bool {
    // SAFETY: `PyGILState_Check` only reads the runtime's and the thread's thread-state slots; it
    // may be called with or without the GIL, before, during and after finalisation.
    unsafe { PyGILState_Check() == 0 }
}

/// The memory of a workspace: the workspace itself, its backend and, for CUDA devices, the
/// device (for stream ordering and memory queries). Shared by the workspace and its blocks.
pub(crate) struct Memory {
    pub(crate) shared: Arc<Shared>,
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) cuda: Option<Arc<CudaMemory>>,
    /// A backend whose driver releases wait for [`reclaim`].
    pub(crate) deferred: Option<Arc<dyn DeferredRelease>>,
    /// Stream-ordered releases (CUDA devices only).
    pub(crate) pending: Option<PendingReleases<CudaMemory>>,
}

/// What a workspace's memory is, before the workspace exists (see [`Memory`]).
pub(crate) struct Source {
    pub(crate) backend: Arc<dyn Backend>,
    cuda: Option<Arc<CudaMemory>>,
    deferred: Option<Arc<dyn DeferredRelease>>,
}

impl Source {
    pub(crate) fn host(backend: Arc<dyn Backend>) -> Self {
        Source { backend, cuda: None, deferred: None }
    }

    pub(crate) fn cuda(gpu: Arc<CudaMemory>) -> Self {
        Source { backend: gpu.clone(), cuda: Some(gpu.clone()), deferred: Some(gpu) }
    }

    pub(crate) fn with_deferred(backend: Arc<dyn Backend>, deferred: Arc<dyn DeferredRelease>) -> Self {
        Source { backend, cuda: None, deferred: Some(deferred) }
    }

    /// The memory of the workspace `shared` over this source.
    pub(crate) fn into_memory(self, shared: Arc<Shared>) -> Arc<Memory> {
        let pending = self.cuda.as_ref().map(|gpu| {
            let to = shared.clone();
            let free = Box::new(move |p: NonNull<u8>| {
                // SAFETY: a pending block is a live block of this workspace whose last owner
                // released it into the list; it leaves the list once.
                unsafe { to.lock().free(p) }
            });
            PendingReleases::new(gpu.clone(), free, certainly_detached)
        });
        Arc::new(Memory { shared, backend: self.backend, cuda: self.cuda, deferred: self.deferred, pending })
    }
}

/// Hands the backend's queued driver releases to the driver, with the GIL released (`py` proves
/// this thread holds it): called after the workspace lock is dropped.
pub(crate) fn reclaim(py: Python<'_>, memory: &Memory) {
    if let Some(d) = &memory.deferred {
        if d.has_deferred() {
            py.detach(|| d.reclaim());
        }
    }
}

/// [`reclaim`] for code that has no `Python` token (`Drop`, the C entry points): the queue goes
/// to the driver only when the thread certainly holds no GIL, and otherwise waits for the next
/// [`reclaim`] or device allocation. The GIL is never released here.
fn reclaim_detached(memory: &Memory) {
    if let Some(d) = &memory.deferred {
        if d.has_deferred() && certainly_detached() {
            d.reclaim();
        }
    }
}

/// Allocates `nbytes` at [`DEVICE_ALIGN`] from the workspace; returns (block, aligned pointer).
pub(crate) fn alloc_aligned(memory: &Memory, nbytes: usize) -> Result<(NonNull<u8>, usize), Error> {
    let shared = &memory.shared;
    if let Some(p) = &memory.pending {
        p.settle(false);
    }
    // A destroyed workspace serves outside its accounts (the core decides).
    let attempt = || shared.lock_allocating().alloc_aligned(nbytes.max(1), DEVICE_ALIGN);
    let raw = match attempt() {
        Ok(raw) => raw,
        Err(e) => match &memory.pending {
            // Blocks still waiting on other streams: wait for them, then try once more.
            Some(p) if p.any() => {
                p.settle(true);
                attempt()?
            }
            _ => return Err(e),
        },
    };
    Ok((raw, align_up(raw.as_ptr() as usize)))
}

/// One block of a workspace at [`DEVICE_ALIGN`], given back when the last owner drops it.
pub(crate) struct Block {
    pub(crate) memory: Arc<Memory>,
    /// The workspace block (freed on drop).
    raw: usize,
    pub(crate) ptr: usize,
    pub(crate) nbytes: usize,
    /// What the release must wait for (see the module docs).
    release: Mutex<ReleaseOrder>,
}

impl Drop for Block {
    fn drop(&mut self) {
        let order = std::mem::take(self.release.get_mut().unwrap_or_else(|e| e.into_inner()));
        if let Some(p) = NonNull::new(self.raw as *mut u8) {
            match &self.memory.pending {
                Some(pending) => pending.release(p, order),
                // SAFETY: `raw` is a live block of this workspace, allocated in `Block::new` and
                // freed only here.
                None => unsafe { self.memory.shared.lock().free(p) },
            }
        }
        reclaim_detached(&self.memory);
    }
}

impl Block {
    /// [`Block::new`] for Python: releases queued by blocks that died where the GIL could not be
    /// released go to the driver now, and an error is the Python exception.
    pub(crate) fn new_py(py: Python<'_>, memory: &Arc<Memory>, nbytes: usize, zeroed: bool) -> PyResult<Self> {
        let block = Block::new(memory, nbytes, zeroed);
        reclaim(py, memory);
        block.map_err(|e| to_py(py, e))
    }

    /// A new block of `nbytes` from the workspace, zero-filled when `zeroed`.
    pub(crate) fn new(memory: &Arc<Memory>, nbytes: usize, zeroed: bool) -> Result<Self, Error> {
        let (raw, ptr) = alloc_aligned(memory, nbytes)?;
        let block = Block {
            memory: memory.clone(),
            raw: raw.as_ptr() as usize,
            ptr,
            nbytes,
            release: Mutex::new(ReleaseOrder::default()),
        };
        if zeroed && nbytes > 0 {
            // SAFETY: the block's `nbytes` bytes lie in the workspace block just allocated.
            if let Err(cause) = unsafe { memory.backend.zero(block.at(), nbytes) } {
                // The block goes back as it drops.
                return Err(Error::device("the device refused to clear a new block", cause));
            }
        }
        Ok(block)
    }

    pub(crate) fn at(&self) -> NonNull<u8> {
        // `ptr` is never null: it is aligned up from a live block.
        NonNull::new(self.ptr as *mut u8).expect("device buffers are never null")
    }

    fn check_len(&self, what: &str, n: usize) -> PyResult<()> {
        if n > self.nbytes {
            return Err(PyValueError::new_err(format!(
                "{what}: {n} bytes do not fit in a buffer of {} bytes",
                self.nbytes
            )));
        }
        Ok(())
    }

    /// Copies the bytes of `array` (a contiguous ndarray, at most `nbytes` long) into the block.
    pub(crate) fn copy_from_host(&self, py: Python<'_>, array: &Bound<'_, PyAny>) -> PyResult<()> {
        let (src, n) = host_bytes(array, false)?;
        self.check_len("copy_from_host", n)?;
        if n == 0 {
            return Ok(());
        }
        let (dst, src) = (self.at().as_ptr() as usize, src.as_ptr() as usize);
        let backend = self.memory.backend.clone();
        // SAFETY: `dst` is this live block (n <= nbytes), `src` the host array held alive by
        // `array` for the whole call; a host array never overlaps a workspace block it did not
        // come from, and the bytes are read only.
        py.detach(|| unsafe {
            backend.copy_from_host(NonNull::new_unchecked(dst as *mut u8), NonNull::new_unchecked(src as *mut u8), n)
        })
        .map_err(|e| to_py(py, Error::device("a copy to the device failed", e)))
    }

    /// Copies the block's first bytes into `array` (a writeable contiguous ndarray).
    pub(crate) fn copy_to_host(&self, py: Python<'_>, array: &Bound<'_, PyAny>) -> PyResult<()> {
        let (dst, n) = host_bytes(array, true)?;
        self.check_len("copy_to_host", n)?;
        if n == 0 {
            return Ok(());
        }
        let (dst, src) = (dst.as_ptr() as usize, self.at().as_ptr() as usize);
        let backend = self.memory.backend.clone();
        // SAFETY: `src` is this live block (n <= nbytes); `dst` the writeable host array held
        // alive by `array` for the whole call.
        py.detach(|| unsafe {
            backend.copy_to_host(NonNull::new_unchecked(dst as *mut u8), NonNull::new_unchecked(src as *mut u8), n)
        })
        .map_err(|e| to_py(py, Error::device("a copy from the device failed", e)))
    }

    /// Copies `nbytes` bytes from `other` (a block of the same backend) into this one.
    pub(crate) fn copy_from(&self, py: Python<'_>, other: &Block, nbytes: usize) -> PyResult<()> {
        self.check_len("copy_from", nbytes)?;
        other.check_len("copy_from", nbytes)?;
        if !Arc::ptr_eq(&self.memory.backend, &other.memory.backend) {
            return Err(PyValueError::new_err("copy_from: the buffers belong to different memory sources"));
        }
        if nbytes > 0 && self.ptr != other.ptr {
            // SAFETY: both are live blocks of this backend, valid for `nbytes`; distinct live
            // blocks never overlap.
            unsafe { self.memory.backend.copy(self.at(), other.at(), nbytes) }
                .map_err(|e| to_py(py, Error::device("a copy on the device failed", e)))?;
        }
        Ok(())
    }

    /// Makes work later submitted to `stream` (DLPack numbering: 1 legacy default, 2
    /// per-thread default, else a `CUstream` handle, valid during this call) wait for the
    /// workspace's own copies and fills, and makes the block's release wait for that stream's
    /// work without keeping its handle (see the module docs). A no-op for memory that is not a
    /// CUDA device's.
    pub(crate) fn order_before(&self, py: Python<'_>, stream: usize) -> PyResult<()> {
        let Some(cuda) = &self.memory.cuda else { return Ok(()) };
        cuda.order_before(stream)
            .map_err(|e| to_py(py, Error::device("cannot order the stream after the workspace's work", e)))?;
        let ordered = stream == 1 || cuda.synchronizes_with_legacy(stream).unwrap_or(false);
        lock(&self.release).follow(stream, ordered);
        Ok(())
    }

    /// Makes the block's release wait for the work submitted to `stream` (a live stream handle
    /// other than the legacy default) when the release comes, which must be before the stream
    /// can be destroyed: the caller releases the block right after.
    fn release_on(&self, stream: usize) {
        if !lock(&self.release).release_on(stream) {
            // No room to note the stream: its work is waited for now.
            if let Some(cuda) = &self.memory.cuda {
                let _ = cuda.synchronize();
            }
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

/// One block of a workspace as a Python object (the owner CuPy's `UnownedMemory` keeps).
#[pyclass(frozen, module = "rustws._rustws")]
pub(crate) struct DeviceBuffer {
    pub(crate) block: Arc<Block>,
}

#[pymethods]
impl DeviceBuffer {
    /// The address of the first byte (256-byte aligned).
    #[getter]
    fn ptr(&self) -> usize {
        self.block.ptr
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.block.nbytes
    }

    /// Copies the bytes of `array` (a contiguous ndarray, at most `nbytes` long) into the buffer.
    fn copy_from_host(&self, py: Python<'_>, array: &Bound<'_, PyAny>) -> PyResult<()> {
        self.block.copy_from_host(py, array)
    }

    /// Copies the buffer's first bytes into `array` (a writeable contiguous ndarray).
    fn copy_to_host(&self, py: Python<'_>, array: &Bound<'_, PyAny>) -> PyResult<()> {
        self.block.copy_to_host(py, array)
    }

    /// Copies `nbytes` bytes from `other` (a buffer of the same workspace's backend) into this one.
    fn copy_from(&self, py: Python<'_>, other: &DeviceBuffer, nbytes: usize) -> PyResult<()> {
        self.block.copy_from(py, &other.block, nbytes)
    }

    /// See `Block::order_before`.
    fn order_before(&self, py: Python<'_>, stream: usize) -> PyResult<()> {
        self.block.order_before(py, stream)
    }

    fn __repr__(&self) -> String {
        format!(
            "<DeviceBuffer {} bytes at {:#x} of workspace {:?}>",
            self.block.nbytes, self.block.ptr, self.block.memory.shared.name
        )
    }
}

// -- PyTorch's pluggable allocator ----------------------------------------------------------------

thread_local! {
    /// The workspace this thread's PyTorch allocations go to, and the device it serves. PyTorch
    /// calls the allocator on the thread that allocates, and `use_mem_pool` routes only that
    /// thread's allocations to the pool, so the route is per thread too.
    static TORCH_TARGET: std::cell::RefCell<Option<(Arc<Memory>, i32)>> = const { std::cell::RefCell::new(None) };
}

/// Routes for every thread (innermost last): PyTorch's device threads (the autograd engine's)
/// allocate for a block entered on another thread, so a route of the whole device serves the
/// threads that have none of their own.
static TORCH_SHARED: Mutex<Vec<(Arc<Memory>, i32)>> = Mutex::new(Vec::new());

/// Blocks handed to PyTorch, by the pointer it got.
type TorchBlocks = HashMap<usize, Block>;
static TORCH_BLOCKS: Mutex<Option<TorchBlocks>> = Mutex::new(None);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Routes this thread's `rustws_torch_malloc` calls to the workspace of `memory` on device
/// `ordinal` (None: refuse them).
pub(crate) fn torch_route(memory: Option<Arc<Memory>>, ordinal: i32) {
    let target = memory.map(|m| (m, ordinal));
    TORCH_TARGET.with(|t| *t.borrow_mut() = target);
}

/// Adds the workspace of `memory` as the route of every thread without one of its own on device `ordinal`
/// (innermost until removed).
pub(crate) fn torch_share(memory: Arc<Memory>, ordinal: i32) {
    lock(&TORCH_SHARED).push((memory, ordinal));
}

/// Removes the innermost shared route of the workspace of `memory` on device `ordinal`; returns whether there
/// was one.
pub(crate) fn torch_unshare(memory: &Arc<Memory>, ordinal: i32) -> bool {
    let mut shared = lock(&TORCH_SHARED);
    let at = shared.iter().rposition(|(m, o)| Arc::ptr_eq(m, memory) && *o == ordinal);
    // The route is dropped after the lock is released (dropping a memory may free a workspace).
    let removed = at.map(|i| shared.remove(i));
    drop(shared);
    removed.is_some()
}

/// The route of this thread, or else the innermost shared route of `device`.
fn torch_target(device: c_int) -> Option<(Arc<Memory>, i32)> {
    if let Some(mine) = TORCH_TARGET.try_with(|t| t.borrow().clone()).ok().flatten() {
        return Some(mine);
    }
    lock(&TORCH_SHARED).iter().rev().find(|(_, o)| *o == device).cloned()
}

/// Blocks PyTorch holds from rustws workspaces, and their total bytes.
#[pyfunction]
pub(crate) fn torch_blocks() -> (usize, usize) {
    let blocks = lock(&TORCH_BLOCKS);
    let Some(map) = blocks.as_ref() else { return (0, 0) };
    (map.len(), map.values().map(|b| b.nbytes).sum())
}

/// `void* alloc(ssize_t size, int device, cudaStream_t stream)` for
/// `torch.cuda.memory.CUDAPluggableAllocator`: a block of the workspace routed on this thread
/// (else of the innermost shared route of the device), or NULL (which PyTorch reports as out of
/// memory) when nothing is routed, the device differs, or the workspace refuses.
#[no_mangle]
pub extern "C" fn rustws_torch_malloc(size: isize, device: c_int, _stream: *mut c_void) -> *mut c_void {
    catch_unwind(AssertUnwindSafe(|| {
        let Some((memory, ordinal)) = torch_target(device) else {
            return std::ptr::null_mut();
        };
        if device != ordinal || size < 0 {
            return std::ptr::null_mut();
        }
        match Block::new(&memory, size as usize, false) {
            Ok(block) => {
                let ptr = block.ptr;
                lock(&TORCH_BLOCKS).get_or_insert_with(HashMap::new).insert(ptr, block);
                ptr as *mut c_void
            }
            Err(_) => {
                memory.shared.lock().record_failure();
                std::ptr::null_mut()
            }
        }
    }))
    .unwrap_or(std::ptr::null_mut())
}

/// `void free(void* ptr, ssize_t size, int device, cudaStream_t stream)`: gives a block back to
/// the workspace it came from (whichever is routed now), after the work PyTorch queued on
/// `stream` when that is not the legacy default stream. Unknown pointers are ignored.
#[no_mangle]
pub extern "C" fn rustws_torch_free(ptr: *mut c_void, _size: isize, _device: c_int, stream: *mut c_void) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        let entry = lock(&TORCH_BLOCKS).as_mut().and_then(|m| m.remove(&(ptr as usize)));
        if let Some(block) = entry {
            let stream = stream as usize;
            if stream > 1 && block.memory.cuda.is_some() {
                // PyTorch's stream is valid during this call, and the release happens in it.
                block.release_on(stream);
            }
            drop(block); // gives it back (stream-ordered), outside the table's lock
        }
    }));
}
