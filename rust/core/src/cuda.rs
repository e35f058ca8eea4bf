//! CUDA device memory as a [`Backend`], through cudarc's driver API loaded at run time: the crate
//! builds with no CUDA toolkit, and a machine without a driver gets an [`Error::Unavailable`]
//! naming the reason (cudarc panics when `libcuda` is missing, so the library is probed first).
//!
//! Device memory is not host-accessible: arenas over it keep their block headers on the host,
//! and zeroing and copying go through the driver.
//!
//! Releases are deferred: `free_block` and `unmap` (which the workspace calls under its lock)
//! only queue the pointer, and [`DeferredRelease::reclaim`] hands the queue to `cuMemFree` /
//! `cuMemFreeHost` later, from wherever the owner holds no lock (the bindings also release the
//! GIL around it). An allocation the driver refuses reclaims the queue and tries once more.
//!
//! Blocks used by other streams are released in stream order: [`CudaMemory::record_release`]
//! records an event on each stream that used a block, and the owner gives the block back only
//! once [`CudaMemory::is_complete`] says the event has passed.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use cudarc::driver::{result, sys};

use crate::backend::Backend;
use crate::error::{BackendError, Cause, Error};

/// A driver's refusal of `op` on `bytes` bytes.
fn driver(op: &'static str, bytes: usize, e: result::DriverError) -> BackendError {
    // SAFETY: `cuGetErrorName` and `cuGetErrorString` return static strings of the driver
    // library, which cudarc loads once and never unloads: they live as long as the process.
    let forever = |c: &std::ffi::CStr| unsafe { std::mem::transmute::<&str, &'static str>(c.to_str().unwrap_or("")) };
    let name = e.error_name().map(forever).unwrap_or_else(|_| known_name(e.0 as u32));
    let text = e.error_string().map(forever).unwrap_or("");
    BackendError { op, bytes, cause: Cause::Driver { code: e.0 as u32, name, text } }
}

/// The names of the results this backend meets most, for drivers that do not name them.
fn known_name(code: u32) -> &'static str {
    match code {
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        600 => "CUDA_ERROR_NOT_READY",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        719 => "CUDA_ERROR_LAUNCH_FAILED",
        _ => "CUDA_ERROR_UNKNOWN",
    }
}

/// A device that cannot be used, and the driver's reason.
fn unusable(what: &'static str, op: &'static str, e: result::DriverError) -> Error {
    Error::Unavailable { what: what.into(), cause: Some(driver(op, 0, e)) }
}

/// Devices the driver sees; `Err` says why none can be used (no driver, a failed init).
pub fn device_count() -> Result<usize, Error> {
    // SAFETY: only tries to load the driver library; nothing is called through it.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::unavailable("no CUDA driver: libcuda.so.1 cannot be loaded"));
    }
    result::init().map_err(|e| unusable("the CUDA driver failed to initialise", "cuInit", e))?;
    let n = result::device::get_count()
        .map_err(|e| unusable("the CUDA driver cannot count devices", "cuDeviceGetCount", e))?;
    Ok(n.max(0) as usize)
}

/// Checks that device `ordinal` exists; `Err` names what is missing.
pub fn probe(ordinal: usize) -> Result<(), Error> {
    let count = device_count()?;
    if count == 0 {
        return Err(Error::unavailable("the CUDA driver sees no device"));
    }
    if ordinal >= count {
        return Err(Error::unavailable(format!("bad device ordinal {ordinal}: the driver sees {count} device(s)")));
    }
    Ok(())
}

/// Device memory of one GPU, in its primary context.
#[derive(Debug)]
pub struct CudaMemory {
    ordinal: usize,
    device: sys::CUdevice,
    /// The primary context, as an address (contexts may be used from any thread).
    context: usize,
    released: ReleaseQueue,
}

impl CudaMemory {
    /// Device `ordinal`'s memory; retains its primary context until dropped.
    pub fn new(ordinal: usize) -> Result<Self, Error> {
        probe(ordinal)?;
        let device = result::device::get(ordinal as i32)
            .map_err(|e| unusable("cannot open the CUDA device", "cuDeviceGet", e))?;
        // SAFETY: `device` was returned by `device::get`.
        let context = unsafe { result::primary_ctx::retain(device) }
            .map_err(|e| unusable("cannot create a context on the CUDA device", "cuDevicePrimaryCtxRetain", e))?;
        Ok(CudaMemory { ordinal, device, context: context as usize, released: ReleaseQueue::default() })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Makes this device's context current on the calling thread until the guard drops, which
    /// restores the thread's previous context: the frameworks sharing the thread (PyTorch, CuPy)
    /// keep the device they had.
    fn make_current(&self) -> Result<ContextGuard, BackendError> {
        make_current(self.context)
    }
}

/// See [`CudaMemory::make_current`]; `context` must stay retained while the guard lives.
fn make_current(context: usize) -> Result<ContextGuard, BackendError> {
    let ours = context as sys::CUcontext;
    let previous = result::ctx::get_current().map_err(|e| driver("cuCtxGetCurrent", 0, e))?;
    if previous == Some(ours) {
        return Ok(ContextGuard { restore: None });
    }
    // SAFETY: the caller keeps the context retained while the guard lives.
    unsafe { result::ctx::set_current(ours) }.map_err(|e| driver("cuCtxSetCurrent", 0, e))?;
    Ok(ContextGuard { restore: Some(previous.map_or(0, |c| c as usize)) })
}

/// Pointers released by a backend and not yet handed to the driver (see the module docs).
#[derive(Debug, Default)]
struct ReleaseQueue {
    queue: Mutex<Vec<usize>>,
    /// Whether `queue` holds anything: read without the lock on every allocation.
    pending: AtomicBool,
    /// Releases the driver refused (their memory is lost to the process, not to the arena).
    failed: AtomicUsize,
}

impl ReleaseQueue {
    fn push(&self, ptr: usize) {
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).push(ptr);
        self.pending.store(true, Ordering::Release);
    }

    fn take(&self) -> Vec<usize> {
        if !self.pending.load(Ordering::Acquire) {
            return Vec::new();
        }
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        self.pending.store(false, Ordering::Release);
        std::mem::take(&mut *q)
    }
}

/// A backend whose releases wait in a queue until the owner calls [`reclaim`](Self::reclaim)
/// outside its locks.
pub trait DeferredRelease: Send + Sync {
    /// Whether released memory waits for `reclaim`.
    fn has_deferred(&self) -> bool;
    /// Hands every queued release to the driver. Safe to call from any thread, at any time.
    fn reclaim(&self);
    /// Releases the driver refused so far.
    fn failed_releases(&self) -> usize;
}

/// An event recorded on a stream (see [`CudaMemory::record_release`]).
#[derive(Debug)]
pub struct StreamEvent {
    event: usize,
}

/// Contexts the driver refused to restore (see [`failed_context_restores`]).
static FAILED_RESTORES: AtomicUsize = AtomicUsize::new(0);

/// How many times the driver refused to make a thread's previous context current again after a
/// call of this module: each left the device's primary context current on that thread.
pub fn failed_context_restores() -> usize {
    FAILED_RESTORES.load(Ordering::Relaxed)
}

/// Restores a thread's CUDA context (see [`CudaMemory::make_current`]).
struct ContextGuard {
    /// The context to restore, as an address (0: none was current).
    restore: Option<usize>,
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if let Some(previous) = self.restore {
            // SAFETY: `previous` was the thread's current context when the guard was made (or
            // null, which unbinds); the caller's framework keeps its own context alive.
            if unsafe { result::ctx::set_current(previous as sys::CUcontext) }.is_err() {
                FAILED_RESTORES.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        self.reclaim();
        // SAFETY: `device` came from `device::get`, and its primary context was retained once.
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}

impl crate::release::StreamOrder for CudaMemory {
    type Event = StreamEvent;
    fn record_release(&self, stream: usize) -> Result<StreamEvent, BackendError> {
        CudaMemory::record_release(self, stream)
    }
    fn is_complete(&self, event: &StreamEvent) -> bool {
        CudaMemory::is_complete(self, event)
    }
    fn wait(&self, event: &StreamEvent) {
        CudaMemory::wait(self, event)
    }
    fn destroy_event(&self, event: StreamEvent) {
        CudaMemory::destroy_event(self, event)
    }
    fn synchronize(&self) -> Result<(), BackendError> {
        CudaMemory::synchronize(self)
    }
    fn reclaim(&self) {
        if self.has_deferred() {
            DeferredRelease::reclaim(self);
        }
    }
}

impl DeferredRelease for CudaMemory {
    fn has_deferred(&self) -> bool {
        self.released.pending.load(Ordering::Relaxed)
    }

    fn reclaim(&self) {
        let ptrs = self.released.take();
        if ptrs.is_empty() {
            return;
        }
        let Ok(_ctx) = self.make_current() else {
            self.released.failed.fetch_add(ptrs.len(), Ordering::Relaxed);
            return;
        };
        for p in ptrs {
            // SAFETY: every queued pointer came from `cuMemAlloc` in `alloc_device`, was released
            // by the arena (nothing uses it), and leaves the queue once.
            if unsafe { result::free_sync(p as sys::CUdeviceptr) }.is_err() {
                self.released.failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn failed_releases(&self) -> usize {
        self.released.failed.load(Ordering::Relaxed)
    }
}

impl Backend for CudaMemory {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn map(&self, len: usize, _prefault: bool) -> Result<NonNull<u8>, BackendError> {
        if len == 0 {
            return Err(BackendError::refused("map", 0, "a region holds at least one block"));
        }
        let _ctx = self.make_current()?;
        let p = self.alloc_device(len)?;
        // Regions are zero-filled by contract.
        // SAFETY: `p` is the fresh allocation of `len` bytes above.
        if let Err(e) = unsafe { result::memset_d8_sync(p.as_ptr() as usize as sys::CUdeviceptr, 0, len) } {
            // SAFETY: allocated above, never handed out.
            unsafe { self.unmap(p, len) };
            return Err(driver("cuMemsetD8", len, e));
        }
        Ok(p)
    }

    /// Queues the release for [`DeferredRelease::reclaim`].
    ///
    /// # Safety
    /// As for [`Backend::unmap`].
    unsafe fn unmap(&self, ptr: NonNull<u8>, _len: usize) {
        self.released.push(ptr.as_ptr() as usize);
    }

    fn alloc_block(&self, len: usize) -> Result<NonNull<u8>, BackendError> {
        let _ctx = self.make_current()?;
        self.alloc_device(len.max(1))
    }

    /// # Safety
    /// As for [`Backend::free_block`].
    unsafe fn free_block(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: blocks are allocations of `map`; forwarded with the caller's guarantee.
        unsafe { self.unmap(ptr, len) }
    }

    /// # Safety
    /// As for [`Backend::zero`].
    unsafe fn zero(&self, ptr: NonNull<u8>, len: usize) -> Result<(), BackendError> {
        let _ctx = self.make_current()?;
        // SAFETY: the caller guarantees the range lies in one of our live allocations.
        unsafe { result::memset_d8_sync(ptr.as_ptr() as usize as sys::CUdeviceptr, 0, len) }
            .map_err(|e| driver("cuMemsetD8", len, e))
    }

    /// # Safety
    /// As for [`Backend::copy`].
    unsafe fn copy(&self, dst: NonNull<u8>, src: NonNull<u8>, len: usize) -> Result<(), BackendError> {
        let _ctx = self.make_current()?;
        // SAFETY: the caller guarantees both ranges lie in our live allocations, disjoint.
        unsafe {
            result::memcpy_dtod_sync(
                dst.as_ptr() as usize as sys::CUdeviceptr,
                src.as_ptr() as usize as sys::CUdeviceptr,
                len,
            )
        }
        .map_err(|e| driver("cuMemcpyDtoD", len, e))
    }

    /// # Safety
    /// As for [`Backend::copy_to_host`].
    unsafe fn copy_to_host(&self, dst: NonNull<u8>, src: NonNull<u8>, len: usize) -> Result<(), BackendError> {
        let _ctx = self.make_current()?;
        // SAFETY: the caller guarantees `dst` is host memory valid for `len` bytes of writes and
        // `src` lies in one of our live allocations.
        let host = unsafe { std::slice::from_raw_parts_mut(dst.as_ptr(), len) };
        // SAFETY: as above; the copy is synchronous, so `host` is not used after return.
        unsafe { result::memcpy_dtoh_sync(host, src.as_ptr() as usize as sys::CUdeviceptr) }
            .map_err(|e| driver("cuMemcpyDtoH", len, e))
    }

    /// # Safety
    /// As for [`Backend::copy_from_host`].
    unsafe fn copy_from_host(&self, dst: NonNull<u8>, src: NonNull<u8>, len: usize) -> Result<(), BackendError> {
        let _ctx = self.make_current()?;
        // SAFETY: the caller guarantees `src` is host memory valid for `len` bytes of reads.
        let host = unsafe { std::slice::from_raw_parts(src.as_ptr(), len) };
        // SAFETY: `dst` lies in one of our live allocations; the copy is synchronous.
        unsafe { result::memcpy_htod_sync(dst.as_ptr() as usize as sys::CUdeviceptr, host) }
            .map_err(|e| driver("cuMemcpyHtoD", len, e))
    }

    fn host_accessible(&self) -> bool {
        false
    }

    /// `cuMemAlloc` aligns every allocation to at least 256 bytes.
    fn block_align(&self) -> usize {
        DEVICE_BLOCK_ALIGN
    }
}

/// The alignment of every `cuMemAlloc` allocation (the CUDA programming guide's guarantee).
pub const DEVICE_BLOCK_ALIGN: usize = 256;

impl CudaMemory {
    /// `len` fresh bytes of device memory; the context must be current. A refusal while
    /// releases wait in the queue reclaims them and tries once more.
    fn alloc_device(&self, len: usize) -> Result<NonNull<u8>, BackendError> {
        if len > isize::MAX as usize {
            return Err(BackendError::refused("cuMemAlloc", len, "more than a device holds"));
        }
        if self.has_deferred() {
            // Normally the owner reclaims outside its locks right after releasing; this only
            // catches owners that never do.
            self.reclaim();
        }
        // SAFETY: the caller made the context current; the result is a fresh device allocation.
        let mut r = unsafe { result::malloc_sync(len) };
        if r.is_err() && self.has_deferred() {
            self.reclaim();
            // SAFETY: as above.
            r = unsafe { result::malloc_sync(len) };
        }
        let p = r.map_err(|e| driver("cuMemAlloc", len, e))?;
        NonNull::new(p as usize as *mut u8).ok_or(BackendError::refused("cuMemAlloc", len, "the driver returned null"))
    }

    /// Records an event on `stream` (a `CUstream` handle, or 1 / 2 for the legacy / per-thread
    /// default stream) after the work submitted to it so far: a block that stream used may be
    /// handed out again once [`is_complete`](Self::is_complete) says so.
    pub fn record_release(&self, stream: usize) -> Result<StreamEvent, BackendError> {
        let _ctx = self.make_current()?;
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| driver("cuEventCreate", 0, e))?;
        // SAFETY: `event` is live; the caller names a stream of this context (the stream a
        // consumer declared through DLPack, or the one PyTorch passed to its allocator).
        if let Err(e) = unsafe { result::event::record(event, stream as sys::CUstream) } {
            // SAFETY: created above, never recorded.
            let _ = unsafe { result::event::destroy(event) };
            return Err(driver("cuEventRecord", 0, e));
        }
        Ok(StreamEvent { event: event as usize })
    }

    /// Whether the work before `event` has finished. A failed query counts as finished after
    /// waiting for the event (a broken event must not hold memory forever).
    pub fn is_complete(&self, event: &StreamEvent) -> bool {
        let Ok(_ctx) = self.make_current() else { return false };
        // SAFETY: `event` was created by `record_release` and not destroyed (it is borrowed).
        match unsafe { result::event::query(event.event as sys::CUevent) } {
            Ok(()) => true,
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => false,
            Err(_) => {
                // SAFETY: as above.
                let _ = unsafe { result::event::synchronize(event.event as sys::CUevent) };
                true
            }
        }
    }

    /// Waits until the work before `event` has finished.
    pub fn wait(&self, event: &StreamEvent) {
        if let Ok(_ctx) = self.make_current() {
            // SAFETY: `event` was created by `record_release` and not destroyed.
            let _ = unsafe { result::event::synchronize(event.event as sys::CUevent) };
        }
    }

    /// Destroys an event of `record_release`.
    pub fn destroy_event(&self, event: StreamEvent) {
        let _ctx = self.make_current();
        // SAFETY: created by `record_release`, destroyed once (it is consumed).
        let _ = unsafe { result::event::destroy(event.event as sys::CUevent) };
    }

    /// Orders work later submitted to `stream` (a `CUstream` handle, or 1 / 2 for the legacy /
    /// per-thread default stream, as DLPack and the CUDA array interface number them) after
    /// everything this backend has issued so far. Its copies and fills run on the legacy default
    /// stream, which already orders the legacy stream itself.
    pub fn order_before(&self, stream: usize) -> Result<(), BackendError> {
        if stream == 1 {
            return Ok(());
        }
        let _ctx = self.make_current()?;
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| driver("cuEventCreate", 0, e))?;
        // SAFETY: `event` is live until destroyed below; the legacy stream always exists, and the
        // caller names a stream of this context (the DLPack / CAI contract of the consumer).
        let r = unsafe {
            result::event::record(event, 1usize as sys::CUstream).and_then(|()| {
                result::stream::wait_event(
                    stream as sys::CUstream,
                    event,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            })
        };
        // SAFETY: created above; destroying a recorded event defers its release to completion.
        let _ = unsafe { result::event::destroy(event) };
        r.map_err(|e| driver("cuStreamWaitEvent", 0, e))
    }

    /// Whether work on `stream` (a valid `CUstream` handle, or 1 / 2 for the legacy / per-thread
    /// default stream) is ordered by the legacy default stream: true for the default streams and
    /// streams made without `CU_STREAM_NON_BLOCKING`. An event recorded on the legacy stream then
    /// completes only after the work submitted to that stream before it, so a release can wait
    /// for the stream without keeping its handle (which its owner may destroy meanwhile).
    pub fn synchronizes_with_legacy(&self, stream: usize) -> Result<bool, BackendError> {
        if stream == 1 || stream == 2 {
            return Ok(true);
        }
        let _ctx = self.make_current()?;
        let mut flags: std::ffi::c_uint = 0;
        // SAFETY: the caller names a live stream of this context (valid while the consumer that
        // declared it is inside the call); `flags` is a valid output.
        let rc = unsafe { sys::cuStreamGetFlags(stream as sys::CUstream, &mut flags) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            return Err(driver("cuStreamGetFlags", 0, result::DriverError(rc)));
        }
        Ok(flags & sys::CUstream_flags_enum::CU_STREAM_NON_BLOCKING as std::ffi::c_uint == 0)
    }

    /// Waits until all work submitted to this device's context, on every stream, has finished.
    pub fn synchronize(&self) -> Result<(), BackendError> {
        let _ctx = self.make_current()?;
        result::ctx::synchronize().map_err(|e| driver("cuCtxSynchronize", 0, e))
    }

    /// Free and total bytes of the device.
    pub fn memory_info(&self) -> Result<(usize, usize), BackendError> {
        let _ctx = self.make_current()?;
        result::mem_get_info().map_err(|e| driver("cuMemGetInfo", 0, e))
    }
}

/// Page-locked host memory from the CUDA driver: the host side of a mirrored device workspace,
/// and the fast path for copies to and from the device. Host-accessible, so the arena keeps its
/// headers inline.
#[derive(Debug)]
pub struct PinnedHostMemory {
    device: CudaMemory,
    released: ReleaseQueue,
}

impl PinnedHostMemory {
    /// Pinned memory usable by device `ordinal` (and, being portable, by every context).
    pub fn new(ordinal: usize) -> Result<Self, Error> {
        Ok(PinnedHostMemory { device: CudaMemory::new(ordinal)?, released: ReleaseQueue::default() })
    }

    fn alloc_pinned(&self, len: usize) -> Result<*mut std::ffi::c_void, BackendError> {
        if len > isize::MAX as usize {
            return Err(BackendError::refused("cuMemHostAlloc", len, "more than can be pinned"));
        }
        // SAFETY: a fresh allocation of `len` bytes, with this device's context current.
        let mut r = unsafe { result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) };
        if r.is_err() && self.has_deferred() {
            self.reclaim();
            // SAFETY: as above.
            r = unsafe { result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) };
        }
        r.map_err(|e| driver("cuMemHostAlloc", len, e))
    }
}

impl Drop for PinnedHostMemory {
    fn drop(&mut self) {
        self.reclaim();
    }
}

impl DeferredRelease for PinnedHostMemory {
    fn has_deferred(&self) -> bool {
        self.released.pending.load(Ordering::Relaxed)
    }

    fn reclaim(&self) {
        let ptrs = self.released.take();
        if ptrs.is_empty() {
            return;
        }
        let Ok(_ctx) = self.device.make_current() else {
            self.released.failed.fetch_add(ptrs.len(), Ordering::Relaxed);
            return;
        };
        for p in ptrs {
            // SAFETY: every queued pointer came from `cuMemHostAlloc` in `map`, was released by
            // its owner (nothing uses it), and leaves the queue once.
            if unsafe { result::free_host(p as *mut std::ffi::c_void) }.is_err() {
                self.released.failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn failed_releases(&self) -> usize {
        self.released.failed.load(Ordering::Relaxed)
    }
}

impl Backend for PinnedHostMemory {
    fn name(&self) -> &'static str {
        "cuda-pinned-host"
    }

    fn map(&self, len: usize, _prefault: bool) -> Result<NonNull<u8>, BackendError> {
        if len == 0 {
            return Err(BackendError::refused("map", 0, "a region holds at least one block"));
        }
        let _ctx = self.device.make_current()?;
        let p = self.alloc_pinned(len)?;
        let p = NonNull::new(p.cast::<u8>()).ok_or(BackendError::refused(
            "cuMemHostAlloc",
            len,
            "the driver returned null",
        ))?;
        // Regions are zero-filled by contract (and pinned pages are resident: this is no fault).
        // SAFETY: `p` is `len` bytes of host memory we own.
        unsafe { p.as_ptr().write_bytes(0, len) };
        Ok(p)
    }

    /// Queues the release for [`DeferredRelease::reclaim`].
    ///
    /// # Safety
    /// As for [`Backend::unmap`].
    unsafe fn unmap(&self, ptr: NonNull<u8>, _len: usize) {
        self.released.push(ptr.as_ptr() as usize);
    }

    fn alloc_block(&self, len: usize) -> Result<NonNull<u8>, BackendError> {
        self.map(len.max(1), false)
    }

    /// # Safety
    /// As for [`Backend::free_block`].
    unsafe fn free_block(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: blocks are allocations of `map`; forwarded with the caller's guarantee.
        unsafe { self.unmap(ptr, len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LearningPolicy, Workspace, WorkspaceConfiguration};
    use std::sync::Arc;

    #[test]
    fn a_missing_driver_or_device_is_an_error_naming_it_never_a_panic() {
        match CudaMemory::new(0) {
            Err(e @ Error::Unavailable { .. }) => {
                let what = e.to_string();
                assert!(what.contains("driver") || what.contains("device"), "{what}");
            }
            Err(other) => panic!("unexpected error {other:?}"),
            Ok(gpu) => {
                // A GPU is present: the arena runs on device memory with headers on the host.
                let config = WorkspaceConfiguration {
                    initial_size: 1 << 20,
                    policy_learning: LearningPolicy::None,
                    ..Default::default()
                };
                let mut w = Workspace::with_backend("GPU", config, Arc::new(gpu)).unwrap();
                w.enter().unwrap();
                let a = w.alloc_zeroed(1000).unwrap();
                let b = w.alloc(3 << 20).unwrap(); // spills to a plain device allocation
                                                   // SAFETY: live, freed once.
                unsafe {
                    w.free(a);
                    w.free(b);
                }
                w.exit().unwrap();
                w.verify();
            }
        }
        let bad = probe(1 << 20).unwrap_err().to_string();
        assert!(bad.contains("driver") || bad.contains("device") || bad.contains("ordinal"), "{bad}");
    }
}
