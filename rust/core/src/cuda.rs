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

    fn make_current(&self) -> Result<(), String> {
        // SAFETY: the context was retained in `new` and is released only in `drop`.
        unsafe { result::ctx::set_current(self.context as sys::CUcontext) }.map_err(|e| format!("{e:?}"))
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
        self.make_current()?;
        // SAFETY: the context is current; the result is a fresh device allocation.
        let p = unsafe { result::malloc_sync(len) }
            .map_err(|e| format!("CUDA device {} out of memory for {len} bytes: {e:?}", self.ordinal))?;
        NonNull::new(p as usize as *mut u8).ok_or_else(|| "cuMemAlloc returned null".to_string())
    }

    /// # Safety
    /// As for [`Backend::unmap`].
    unsafe fn unmap(&self, ptr: NonNull<u8>, _len: usize) {
        let _ = self.make_current();
        // SAFETY: the caller guarantees `ptr` came from `map` and is released once.
        let _ = unsafe { result::free_sync(ptr.as_ptr() as usize as sys::CUdeviceptr) };
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

    /// # Safety
    /// As for [`Backend::zero`].
    unsafe fn zero(&self, ptr: NonNull<u8>, len: usize) {
        let _ = self.make_current();
        // SAFETY: the caller guarantees the range lies in one of our live allocations.
        let _ = unsafe { result::memset_d8_sync(ptr.as_ptr() as usize as sys::CUdeviceptr, 0, len) };
    }

    /// # Safety
    /// As for [`Backend::copy`].
    unsafe fn copy(&self, dst: NonNull<u8>, src: NonNull<u8>, len: usize) {
        let _ = self.make_current();
        // SAFETY: the caller guarantees both ranges lie in our live allocations, disjoint.
        let _ = unsafe {
            result::memcpy_dtod_sync(
                dst.as_ptr() as usize as sys::CUdeviceptr,
                src.as_ptr() as usize as sys::CUdeviceptr,
                len,
            )
        };
    }

    fn host_accessible(&self) -> bool {
        false
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
