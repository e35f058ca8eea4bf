//! CUDA device memory as a [`Backend`], through cudarc's driver API loaded at run time: the crate
//! builds with no CUDA toolkit, and a machine without a driver gets an [`Error::Unavailable`]
//! naming the reason (cudarc panics when `libcuda` is missing, so the library is probed first).
//!
//! Device memory is not host-accessible: arenas over it keep their block headers on the host,
//! and zeroing and copying go through the driver.

use std::ptr::NonNull;

use cudarc::driver::{result, sys};

use crate::backend::Backend;
use crate::error::Error;

fn unavailable(what: impl Into<String>) -> Error {
    Error::Unavailable { what: what.into() }
}

/// Devices the driver sees; `Err` says why none can be used (no driver, a failed init).
pub fn device_count() -> Result<usize, Error> {
    // SAFETY: only tries to load the driver library; nothing is called through it.
    if !unsafe { sys::is_culib_present() } {
        return Err(unavailable("no CUDA driver: libcuda.so.1 cannot be loaded"));
    }
    result::init().map_err(|e| unavailable(format!("the CUDA driver failed to initialise: {e:?}")))?;
    let n =
        result::device::get_count().map_err(|e| unavailable(format!("the CUDA driver cannot count devices: {e:?}")))?;
    Ok(n.max(0) as usize)
}

/// Checks that device `ordinal` exists; `Err` names what is missing.
pub fn probe(ordinal: usize) -> Result<(), Error> {
    let count = device_count()?;
    if count == 0 {
        return Err(unavailable("the CUDA driver sees no device"));
    }
    if ordinal >= count {
        return Err(unavailable(format!("bad device ordinal {ordinal}: the driver sees {count} device(s)")));
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
}

impl CudaMemory {
    /// Device `ordinal`'s memory; retains its primary context until dropped.
    pub fn new(ordinal: usize) -> Result<Self, Error> {
        probe(ordinal)?;
        let device = result::device::get(ordinal as i32)
            .map_err(|e| unavailable(format!("cannot open CUDA device {ordinal}: {e:?}")))?;
        // SAFETY: `device` was returned by `device::get`.
        let context = unsafe { result::primary_ctx::retain(device) }
            .map_err(|e| unavailable(format!("cannot create a context on CUDA device {ordinal}: {e:?}")))?;
        Ok(CudaMemory { ordinal, device, context: context as usize })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Makes this device's context current on the calling thread until the guard drops, which
    /// restores the thread's previous context: the frameworks sharing the thread (PyTorch, CuPy)
    /// keep the device they had.
    fn make_current(&self) -> Result<ContextGuard, String> {
        let ours = self.context as sys::CUcontext;
        let previous = result::ctx::get_current().map_err(|e| format!("{e:?}"))?;
        if previous == Some(ours) {
            return Ok(ContextGuard { restore: None });
        }
        // SAFETY: the context was retained in `new` and is released only in `drop`.
        unsafe { result::ctx::set_current(ours) }.map_err(|e| format!("{e:?}"))?;
        Ok(ContextGuard { restore: Some(previous.map_or(0, |c| c as usize)) })
    }
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
            let _ = unsafe { result::ctx::set_current(previous as sys::CUcontext) };
        }
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        // SAFETY: `device` came from `device::get`, and its primary context was retained once.
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}

impl Backend for CudaMemory {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn map(&self, len: usize, _prefault: bool) -> Result<NonNull<u8>, String> {
        let _ctx = self.make_current()?;
        let p = self.alloc_device(len)?;
        // Regions are zero-filled by contract.
        // SAFETY: `p` is the fresh allocation of `len` bytes above.
        unsafe { result::memset_d8_sync(p.as_ptr() as usize as sys::CUdeviceptr, 0, len) }
            .map_err(|e| format!("cannot clear {len} bytes on CUDA device {}: {e:?}", self.ordinal))?;
        Ok(p)
    }

    /// # Safety
    /// As for [`Backend::unmap`].
    unsafe fn unmap(&self, ptr: NonNull<u8>, _len: usize) {
        let _ctx = self.make_current();
        // SAFETY: the caller guarantees `ptr` came from `map` and is released once.
        let _ = unsafe { result::free_sync(ptr.as_ptr() as usize as sys::CUdeviceptr) };
    }

    fn alloc_block(&self, len: usize) -> Result<NonNull<u8>, String> {
        let _ctx = self.make_current()?;
        self.alloc_device(len)
    }

    /// # Safety
    /// As for [`Backend::free_block`].
    unsafe fn free_block(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: blocks are allocations of `map`; forwarded with the caller's guarantee.
        unsafe { self.unmap(ptr, len) }
    }

    /// # Safety
    /// As for [`Backend::zero`].
    unsafe fn zero(&self, ptr: NonNull<u8>, len: usize) {
        let _ctx = self.make_current();
        // SAFETY: the caller guarantees the range lies in one of our live allocations.
        let _ = unsafe { result::memset_d8_sync(ptr.as_ptr() as usize as sys::CUdeviceptr, 0, len) };
    }

    /// # Safety
    /// As for [`Backend::copy`].
    unsafe fn copy(&self, dst: NonNull<u8>, src: NonNull<u8>, len: usize) {
        let _ctx = self.make_current();
        // SAFETY: the caller guarantees both ranges lie in our live allocations, disjoint.
        let _ = unsafe {
            result::memcpy_dtod_sync(
                dst.as_ptr() as usize as sys::CUdeviceptr,
                src.as_ptr() as usize as sys::CUdeviceptr,
                len,
            )
        };
    }

    /// # Safety
    /// As for [`Backend::copy_to_host`].
    unsafe fn copy_to_host(&self, dst: NonNull<u8>, src: NonNull<u8>, len: usize) -> Result<(), String> {
        let _ctx = self.make_current()?;
        // SAFETY: the caller guarantees `dst` is host memory valid for `len` bytes of writes and
        // `src` lies in one of our live allocations.
        let host = unsafe { std::slice::from_raw_parts_mut(dst.as_ptr(), len) };
        // SAFETY: as above; the copy is synchronous, so `host` is not used after return.
        unsafe { result::memcpy_dtoh_sync(host, src.as_ptr() as usize as sys::CUdeviceptr) }
            .map_err(|e| format!("copy from CUDA device {} failed: {e:?}", self.ordinal))
    }

    /// # Safety
    /// As for [`Backend::copy_from_host`].
    unsafe fn copy_from_host(&self, dst: NonNull<u8>, src: NonNull<u8>, len: usize) -> Result<(), String> {
        let _ctx = self.make_current()?;
        // SAFETY: the caller guarantees `src` is host memory valid for `len` bytes of reads.
        let host = unsafe { std::slice::from_raw_parts(src.as_ptr(), len) };
        // SAFETY: `dst` lies in one of our live allocations; the copy is synchronous.
        unsafe { result::memcpy_htod_sync(dst.as_ptr() as usize as sys::CUdeviceptr, host) }
            .map_err(|e| format!("copy to CUDA device {} failed: {e:?}", self.ordinal))
    }

    fn host_accessible(&self) -> bool {
        false
    }
}

impl CudaMemory {
    /// `len` fresh bytes of device memory; the context must be current.
    fn alloc_device(&self, len: usize) -> Result<NonNull<u8>, String> {
        // SAFETY: the caller made the context current; the result is a fresh device allocation.
        let p = unsafe { result::malloc_sync(len) }
            .map_err(|e| format!("CUDA device {} out of memory for {len} bytes: {e:?}", self.ordinal))?;
        NonNull::new(p as usize as *mut u8).ok_or_else(|| "cuMemAlloc returned null".to_string())
    }

    /// Orders work later submitted to `stream` (a `CUstream` handle, or 1 / 2 for the legacy /
    /// per-thread default stream, as DLPack and the CUDA array interface number them) after
    /// everything this backend has issued so far. Its copies and fills run on the legacy default
    /// stream, which already orders the legacy stream itself.
    pub fn order_before(&self, stream: usize) -> Result<(), String> {
        if stream == 1 {
            return Ok(());
        }
        let _ctx = self.make_current()?;
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| format!("cannot create a CUDA event: {e:?}"))?;
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
        r.map_err(|e| format!("cannot order CUDA stream {stream:#x} after the workspace's work: {e:?}"))
    }

    /// Free and total bytes of the device.
    pub fn memory_info(&self) -> Result<(usize, usize), String> {
        let _ctx = self.make_current()?;
        result::mem_get_info().map_err(|e| format!("{e:?}"))
    }
}

/// Page-locked host memory from the CUDA driver: the host side of a mirrored device workspace,
/// and the fast path for copies to and from the device. Host-accessible, so the arena keeps its
/// headers inline.
#[derive(Debug)]
pub struct PinnedHostMemory {
    device: CudaMemory,
}

impl PinnedHostMemory {
    /// Pinned memory usable by device `ordinal` (and, being portable, by every context).
    pub fn new(ordinal: usize) -> Result<Self, Error> {
        Ok(PinnedHostMemory { device: CudaMemory::new(ordinal)? })
    }
}

impl Backend for PinnedHostMemory {
    fn name(&self) -> &'static str {
        "cuda-pinned-host"
    }

    fn map(&self, len: usize, _prefault: bool) -> Result<NonNull<u8>, String> {
        let _ctx = self.device.make_current()?;
        // SAFETY: a fresh allocation of `len` bytes; filled below before anything reads it.
        let p = unsafe { result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| format!("cannot pin {len} bytes of host memory: {e:?}"))?;
        let p = NonNull::new(p.cast::<u8>()).ok_or_else(|| "cuMemHostAlloc returned null".to_string())?;
        // Regions are zero-filled by contract (and pinned pages are resident: this is no fault).
        // SAFETY: `p` is `len` bytes of host memory we own.
        unsafe { p.as_ptr().write_bytes(0, len) };
        Ok(p)
    }

    /// # Safety
    /// As for [`Backend::unmap`].
    unsafe fn unmap(&self, ptr: NonNull<u8>, _len: usize) {
        let _ctx = self.device.make_current();
        // SAFETY: the caller guarantees `ptr` came from `map` (cuMemHostAlloc), released once.
        let _ = unsafe { result::free_host(ptr.as_ptr().cast()) };
    }

    fn alloc_block(&self, len: usize) -> Result<NonNull<u8>, String> {
        self.map(len, false)
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
            Err(Error::Unavailable { what }) => {
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
