//! AddressSanitizer's manual poisoning, for memory the workspace holds but no caller may touch:
//! the data of free arena blocks, cached blocks and cached huge mappings. A build for the
//! sanitizer (`RUSTFLAGS="-Zsanitizer=address --cfg rustws_asan"`, as `scripts/sanitizers.sh`
//! runs it) reports any read or write there as a use after free; every other build compiles
//! these calls to nothing. Only host memory is poisoned (device memory is never touched by the
//! CPU, and its stand-ins are written by the backend itself).

#[cfg(rustws_asan)]
extern "C" {
    fn __asan_poison_memory_region(addr: *const std::ffi::c_void, size: usize);
    fn __asan_unpoison_memory_region(addr: *const std::ffi::c_void, size: usize);
}

/// Marks `[p, p + len)` unusable: any access is reported.
#[inline(always)]
pub(crate) fn poison(p: *const u8, len: usize) {
    #[cfg(rustws_asan)]
    // SAFETY: only the sanitizer's shadow memory changes; `[p, p + len)` is memory of ours.
    unsafe {
        __asan_poison_memory_region(p.cast(), len)
    };
    let _ = (p, len);
}

/// Marks `[p, p + len)` usable again.
#[inline(always)]
pub(crate) fn unpoison(p: *const u8, len: usize) {
    #[cfg(rustws_asan)]
    // SAFETY: only the sanitizer's shadow memory changes; `[p, p + len)` is memory of ours.
    unsafe {
        __asan_unpoison_memory_region(p.cast(), len)
    };
    let _ = (p, len);
}
