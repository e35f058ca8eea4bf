//! Shared helpers for the integration tests: the backends every conformance test runs against.

#![allow(dead_code)]

pub mod program;
#[cfg(feature = "cuda")]
pub mod standin;

use std::sync::Arc;

use rustws_core::{AnonymousMemory, Backend, HeapMemory, LimitAdaptor, OpaqueMemory};

/// Every host backend, an adaptor over one, and the CUDA backends over the driver stand-in,
/// by name. Under Miri, which maps no files, the file-backed one is left out.
pub fn backends() -> Vec<(&'static str, Arc<dyn Backend>)> {
    #[allow(unused_mut)]
    let mut all: Vec<(&'static str, Arc<dyn Backend>)> = vec![
        ("anonymous", Arc::new(AnonymousMemory)),
        ("heap", Arc::new(HeapMemory)),
        ("opaque (device stand-in)", Arc::new(OpaqueMemory)),
        ("limit(anonymous)", Arc::new(LimitAdaptor::new(Arc::new(AnonymousMemory), 1 << 34))),
    ];
    #[cfg(not(miri))]
    all.insert(1, ("mmap-file", Arc::new(rustws_core::FileMappedMemory::new(std::env::temp_dir()))));
    #[cfg(feature = "cuda")]
    {
        standin::load();
        let cuda = rustws_core::cuda::CudaMemory::new(0).expect("the driver stand-in serves device 0");
        let pinned = rustws_core::cuda::PinnedHostMemory::new(0).expect("the driver stand-in serves device 0");
        all.push(("cuda (driver stand-in)", Arc::new(cuda)));
        all.push(("cuda-pinned-host (driver stand-in)", Arc::new(pinned)));
    }
    all
}

/// `normal`, or `miri` under Miri, where each step of a test costs thousands of times more: counts
/// of cycles and steps, and sizes, of the tests Miri runs. The paths they take are the same.
pub const fn miri_or(normal: usize, miri: usize) -> usize {
    if cfg!(miri) {
        miri
    } else {
        normal
    }
}

/// The number of cases of a property test: `default`, or `RUSTWS_PROPTEST_CASES` when set (CI
/// runs fewer under Miri and the sanitizers, where every case costs far more).
pub fn cases(default: u32) -> u32 {
    std::env::var("RUSTWS_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Fills `len` bytes at `p` with a pattern derived from `seed`.
pub fn fill(p: *mut u8, len: usize, seed: u8) {
    for i in 0..len {
        // SAFETY: the caller passes a live block of at least `len` bytes.
        unsafe { *p.add(i) = seed.wrapping_add((i as u8).wrapping_mul(31)) };
    }
}

/// Whether the pattern of `fill` is intact.
pub fn intact(p: *const u8, len: usize, seed: u8) -> bool {
    (0..len).all(|i| {
        // SAFETY: as for `fill`.
        unsafe { *p.add(i) == seed.wrapping_add((i as u8).wrapping_mul(31)) }
    })
}
