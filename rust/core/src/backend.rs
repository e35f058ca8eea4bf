//! Memory sources under the one arena logic. A [`Backend`] hands out large regions (the arena) and
//! individual blocks (spills and external allocations); adaptors such as [`LimitAdaptor`] and
//! [`FaultAdaptor`] wrap an explicit upstream backend, in the manner of RMM's
//! `*_resource_adaptor`.

/// Under Miri, which runs no `madvise`, `sysconf` or `malloc_trim`: advice is accepted and ignored
/// (it is only advice), pages are 4 KiB, 4 GiB of memory is available, and the C heap keeps its
/// free memory. Everything else is the real `libc`.
#[cfg(miri)]
mod libc {
    pub use ::libc::*;

    /// # Safety
    /// None: nothing is done.
    pub unsafe fn madvise(_addr: *mut c_void, _len: size_t, _advice: c_int) -> c_int {
        0
    }

    /// # Safety
    /// None: a constant is returned.
    pub unsafe fn sysconf(name: c_int) -> c_long {
        match name {
            _SC_PAGESIZE => 4096,
            _SC_AVPHYS_PAGES | _SC_PHYS_PAGES => 1 << 20,
            _ => -1,
        }
    }

    /// # Safety
    /// None: nothing is done.
    pub unsafe fn malloc_trim(_pad: size_t) -> c_int {
        0
    }

    /// The most a mapping may hold under Miri, which aborts on a mapping it cannot hold where the
    /// kernel would refuse it with `ENOMEM`.
    const MAP_LIMIT: size_t = 1 << 32;

    /// # Safety
    /// As for `libc::mmap`.
    pub unsafe fn mmap(
        addr: *mut c_void,
        len: size_t,
        prot: c_int,
        flags: c_int,
        fd: c_int,
        off: off_t,
    ) -> *mut c_void {
        if len > MAP_LIMIT {
            // SAFETY: the calling thread's errno.
            unsafe { *__errno_location() = ENOMEM };
            return MAP_FAILED;
        }
        // SAFETY: forwarded with the caller's guarantee.
        unsafe { ::libc::mmap(addr, len, prot, flags, fd, off) }
    }
}

use std::alloc::{self, Layout};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::arena::{HEADER, LARGE_DATA_ALIGN};
use crate::classes::PAGE_ALIGNED_SIZE;
use crate::history::{Action, Recorder};

pub use crate::error::{BackendError, Cause};

/// Alignment of every region and block any backend hands out.
pub const BLOCK_ALIGN: usize = 64;

/// Regions at least this large get transparent-huge-page advice.
pub const HUGE_PAGE_THRESHOLD: usize = 4 << 20;

/// The size of a transparent huge page (x86-64 and most AArch64 kernels): the unit in which the
/// system faults memory advised for huge pages.
pub const HUGE_PAGE: usize = 2 << 20;

/// A source of memory. Implementations must be usable from any thread.
pub trait Backend: Send + Sync + fmt::Debug {
    /// A short name for statistics and messages.
    fn name(&self) -> &'static str;

    /// Maps a zero-filled region of `len` bytes aligned to at least [`BLOCK_ALIGN`]. When
    /// `prefault` is set, every page is resident on return, so that first writes take no fault.
    /// Every backend refuses `len == 0` (a region holds at least one block header).
    fn map(&self, len: usize, prefault: bool) -> Result<NonNull<u8>, BackendError>;

    /// Releases a region.
    ///
    /// # Safety
    /// `ptr` and `len` come from one earlier call of `map` on this backend, the region was not
    /// released before, and nothing reads or writes it any more.
    unsafe fn unmap(&self, ptr: NonNull<u8>, len: usize);

    /// Allocates one block of `len` bytes aligned to [`BLOCK_ALIGN`] (contents unspecified).
    fn alloc_block(&self, len: usize) -> Result<NonNull<u8>, BackendError> {
        let layout = Layout::from_size_align(len.max(1), BLOCK_ALIGN)
            .map_err(|_| BackendError::refused("alloc", len, "more than an address space holds"))?;
        // SAFETY: the layout has a non-zero size.
        NonNull::new(unsafe { alloc::alloc(layout) }).ok_or(BackendError::os("alloc", len, libc::ENOMEM))
    }

    /// Releases one block.
    ///
    /// # Safety
    /// `ptr` and `len` come from one earlier call of `alloc_block` on this backend, and the block
    /// was not released before.
    unsafe fn free_block(&self, ptr: NonNull<u8>, len: usize) {
        let layout = Layout::from_size_align(len.max(1), BLOCK_ALIGN).expect("layout was valid at allocation");
        // SAFETY: the caller guarantees `ptr` came from `alloc_block` with this same layout.
        unsafe { alloc::dealloc(ptr.as_ptr(), layout) }
    }

    /// Allocates one zero-filled block of `len` bytes aligned to [`BLOCK_ALIGN`]; released with
    /// [`Backend::free_block`]. Backends that know when memory is already zero (a fresh mapping)
    /// override it so that such memory is not written.
    fn alloc_block_zeroed(&self, len: usize) -> Result<NonNull<u8>, BackendError> {
        let p = self.alloc_block(len)?;
        // SAFETY: `p` is a fresh block of `len` bytes, owned by the caller.
        if let Err(e) = unsafe { self.zero(p, len) } {
            // SAFETY: allocated just above with `len`, never handed out.
            unsafe { self.free_block(p, len) };
            return Err(e);
        }
        Ok(p)
    }

    /// Makes the first `len` bytes of a region resident now (page-aligned, within a region
    /// mapped by `map` without pre-faulting), so that first writes there take no fault. Blocks
    /// may live in the range (and be written by other threads meanwhile): their bytes are never
    /// changed. The default does nothing: the pages fault in on first use.
    fn populate(&self, ptr: NonNull<u8>, len: usize) {
        let _ = (ptr, len);
    }

    /// Gives the whole pages of `[ptr, ptr + len)`, inside one block of
    /// [`Backend::alloc_block`], back to the system just before the block is freed, where its
    /// source would keep them resident for reuse (the C heap keeps freed blocks in its free
    /// lists). The default does nothing.
    ///
    /// # Safety
    /// The range lies in one live block of this backend, owned by the caller, whose bytes are not
    /// read again; the block is freed next.
    unsafe fn give_back_pages(&self, ptr: NonNull<u8>, len: usize) {
        let _ = (ptr, len);
    }

    /// Advises whether the whole pages of `[ptr, ptr + len)`, within a region from
    /// [`Backend::map`], are to be backed by huge pages where they fault in (`on`) or never (a
    /// region's room to grow, which a huge page straddling its end would make resident). The
    /// default does nothing.
    fn huge_pages(&self, ptr: NonNull<u8>, len: usize, on: bool) {
        let _ = (ptr, len, on);
    }

    /// Returns to the system what the block allocator keeps of freed blocks (the C heap's free
    /// memory): called when an arena takes over the blocks it served. The default keeps it.
    fn trim(&self) {}

    /// Whether [`Backend::discard`] leaves the pages reading as zero.
    fn discard_zeroes(&self) -> bool {
        false
    }

    /// Whether mapped memory costs nothing until it is touched, so that a region may map more
    /// than it serves (anonymous and file mappings; not device or pinned memory, which is taken
    /// whole when mapped).
    fn faults_lazily(&self) -> bool {
        false
    }

    /// Whether the CPU can read and write this backend's memory.
    fn host_accessible(&self) -> bool {
        true
    }

    /// The alignment every block of [`Backend::alloc_block`] has (at least [`BLOCK_ALIGN`]): a
    /// device driver's allocations are more aligned than host blocks need.
    fn block_align(&self) -> usize {
        BLOCK_ALIGN
    }

    /// Fills `len` bytes at `ptr` with zeros; `Err` describes a fill the device refused (the
    /// bytes are then unspecified).
    ///
    /// # Safety
    /// `[ptr, ptr + len)` lies in one live block or region of this backend, owned by the caller.
    unsafe fn zero(&self, ptr: NonNull<u8>, len: usize) -> Result<(), BackendError> {
        // SAFETY: the caller guarantees the range is ours and host-accessible for host backends.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(())
    }

    /// Zero-fills `len` bytes at `ptr`, in a block of [`Backend::alloc_block`] that served
    /// before and serves again (the external cache's reuse), as [`Backend::zero`] does. Backends
    /// whose blocks are the C heap's drop the whole pages of a large one instead of writing them
    /// (see [`zero_heap_block`]), so that `np.zeros` of a large array, sparsely used, stays as
    /// small as NumPy's.
    ///
    /// # Safety
    /// As for [`Backend::zero`], in a block of [`Backend::alloc_block`].
    unsafe fn zero_reused(&self, ptr: NonNull<u8>, len: usize) -> Result<(), BackendError> {
        // SAFETY: forwarded with the caller's guarantee.
        unsafe { self.zero(ptr, len) }
    }

    /// Copies `len` bytes from `src` to `dst` (both this backend's memory, not overlapping);
    /// `Err` describes a copy the device refused (`dst` is then unspecified, `src` unchanged).
    ///
    /// # Safety
    /// Both ranges lie in live blocks of this backend owned by the caller and do not overlap.
    unsafe fn copy(&self, dst: NonNull<u8>, src: NonNull<u8>, len: usize) -> Result<(), BackendError> {
        // SAFETY: as the caller guarantees.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_ptr(), len) };
        Ok(())
    }

    /// Copies `len` bytes of this backend's memory at `src` into host memory at `dst`; `Err`
    /// describes a failed transfer.
    ///
    /// # Safety
    /// `[src, src + len)` lies in a live block of this backend owned by the caller, and `dst` is
    /// valid host memory for `len` bytes of writes, not overlapping it.
    unsafe fn copy_to_host(&self, dst: NonNull<u8>, src: NonNull<u8>, len: usize) -> Result<(), BackendError> {
        // SAFETY: as the caller guarantees (a host-memory backend: both ranges are host memory).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_ptr(), len) };
        Ok(())
    }

    /// Copies `len` bytes of host memory at `src` into this backend's memory at `dst`; `Err`
    /// describes a failed transfer.
    ///
    /// # Safety
    /// `[dst, dst + len)` lies in a live block of this backend owned by the caller, and `src` is
    /// valid host memory for `len` bytes of reads, not overlapping it.
    unsafe fn copy_from_host(&self, dst: NonNull<u8>, src: NonNull<u8>, len: usize) -> Result<(), BackendError> {
        // SAFETY: as the caller guarantees (a host-memory backend: both ranges are host memory).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_ptr(), len) };
        Ok(())
    }

    /// Tells the backend that `[ptr, ptr + len)` of a mapped region holds nothing of value; it
    /// may return the pages to the system (they read as zero where [`Backend::discard_zeroes`],
    /// or their old contents, afterwards). `ptr` and `len` are page-aligned. Returns whether the
    /// pages went back: false where the backend keeps them (the default) or the system refused
    /// (locked memory), and then any of them may keep its bytes.
    fn discard(&self, ptr: NonNull<u8>, len: usize) -> bool {
        let _ = (ptr, len);
        false
    }
}

/// The whole pages inside `[start, start + len)`: from the first page boundary at or after
/// `start` to the last at or before its end (none where the first is not below the last).
pub(crate) fn whole_pages(start: usize, len: usize) -> (usize, usize) {
    let page = page_size();
    (start.next_multiple_of(page), (start + len) / page * page)
}

/// `madvise(advice)` over the whole pages inside `[start, start + len)`, if any; a refusal is
/// ignored (the advice is only advice, or the caller gives the bytes up either way).
///
/// # Safety
/// The range lies in one mapping or block of the caller's, which `advice` may act on.
unsafe fn advise_whole_pages(start: usize, len: usize, advice: libc::c_int) {
    let (a, b) = whole_pages(start, len);
    if a < b {
        // SAFETY: as the caller guarantees; whole pages inside their range.
        unsafe { libc::madvise(a as *mut libc::c_void, b - a, advice) };
    }
}

/// The page size, asked of the system once (cycle ends round to it).
fn page_size() -> usize {
    static PAGE: AtomicUsize = AtomicUsize::new(0);
    let known = PAGE.load(Ordering::Relaxed);
    if known != 0 {
        return known;
    }
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let p = if p > 0 { p as usize } else { 4096 };
    PAGE.store(p, Ordering::Relaxed);
    p
}

/// Bytes of physical memory free right now (`sysconf(_SC_AVPHYS_PAGES)`), or `usize::MAX` when
/// the system does not say.
pub fn available_memory() -> usize {
    // SAFETY: plain queries without preconditions.
    let (pages, size) = unsafe { (libc::sysconf(libc::_SC_AVPHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    if pages > 0 && size > 0 {
        (pages as usize).saturating_mul(size as usize)
    } else {
        usize::MAX
    }
}

/// `madvise` advice that faults pages in writable without writing them (Linux 5.14).
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// Set by [`testing::refuse_populate_write`]: pre-faulting acts as on a kernel that refuses
/// `MADV_POPULATE_WRITE`.
static POPULATE_WRITE_REFUSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Pages touched by the fallback of [`try_prefault`] so far.
static PAGES_TOUCHED: AtomicU64 = AtomicU64::new(0);

/// Switches for tests of the paths a machine may not take by itself.
#[doc(hidden)]
pub mod testing {
    use std::sync::atomic::Ordering;

    /// Makes pre-faulting act as on a kernel without `MADV_POPULATE_WRITE` (before 5.14, or
    /// gVisor): every page is touched instead.
    pub fn refuse_populate_write(refuse: bool) {
        super::POPULATE_WRITE_REFUSED.store(refuse, Ordering::Relaxed);
    }

    /// Pages the touching fallback of pre-faulting has touched in this process.
    pub fn pages_touched() -> u64 {
        super::PAGES_TOUCHED.load(Ordering::Relaxed)
    }
}

/// Makes every page of `[ptr, ptr + len)` resident and writable. Only `EINVAL` (a kernel before
/// 5.14, which does not know `MADV_POPULATE_WRITE`, or gVisor) falls back to touching each page;
/// any other refusal (`ENOMEM` under a memory limit, `EFAULT` / `EIO` for a file without backing
/// store) is an error: touching would turn it into the OOM killer or a `SIGBUS`.
///
/// The range may hold live blocks (an arena pre-faults when a cycle opens, with blocks made
/// between cycles in use, possibly written by other threads), so the fallback never changes a
/// byte: see [`touch_for_write`].
fn try_prefault(ptr: NonNull<u8>, len: usize) -> Result<(), BackendError> {
    let rc = if POPULATE_WRITE_REFUSED.load(Ordering::Relaxed) {
        Err(std::io::Error::from_raw_os_error(libc::EINVAL))
    } else {
        // SAFETY: [ptr, ptr+len) is one mapping we own; the advice only populates pages.
        match unsafe { libc::madvise(ptr.as_ptr().cast(), len, MADV_POPULATE_WRITE) } {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        }
    };
    let Err(err) = rc else { return Ok(()) };
    if err.raw_os_error() != Some(libc::EINVAL) {
        return Err(BackendError::os("make resident", len, err.raw_os_error().unwrap_or(0)));
    }
    let page = page_size();
    let mut off = 0;
    while off < len {
        // SAFETY: `off < len` lies inside the mapping, and `off` is a multiple of the page size
        // from a page-aligned start, so the word there is aligned.
        unsafe { touch_for_write(ptr.as_ptr().add(off)) };
        PAGES_TOUCHED.fetch_add(1, Ordering::Relaxed);
        off += page;
    }
    Ok(())
}

/// Faults the page of `p` in for writing without changing it: an atomic read-modify-write of
/// the word at `p` that writes back what it read (a locked `or` of 0 on x86-64, a load-exclusive /
/// store-exclusive pair on AArch64, a compare-exchange of the value with itself elsewhere). A
/// write of zero would destroy a live block's bytes, and a plain read maps only the shared zero
/// page; a concurrent writer's store is never lost, since the hardware makes the
/// read-modify-write atomic with respect to every other access to the word.
///
/// # Safety
/// `p` is 8-byte aligned and lies in a mapping of this process, readable and writable.
#[inline]
unsafe fn touch_for_write(p: *mut u8) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    // SAFETY: the caller guarantees `p` is an aligned word of a writable mapping; `lock or` of 0
    // leaves it as it is, atomically.
    unsafe {
        std::arch::asm!("lock or qword ptr [{p}], 0", p = in(reg) p, options(nostack));
    }
    #[cfg(all(target_arch = "aarch64", not(miri)))]
    // SAFETY: as above; the store-exclusive writes back the value its load-exclusive read, and
    // fails (to retry) if anything else wrote the word in between.
    unsafe {
        std::arch::asm!(
            "2:",
            "ldxr {v}, [{p}]",
            "stxr {s:w}, {v}, [{p}]",
            "cbnz {s:w}, 2b",
            p = in(reg) p,
            v = out(reg) _,
            s = out(reg) _,
            options(nostack),
        );
    }
    #[cfg(any(miri, not(any(target_arch = "x86_64", target_arch = "aarch64"))))]
    {
        // SAFETY: the caller guarantees an aligned word of a writable mapping; a compare-exchange
        // of the value with itself changes nothing (and one that fails found the page written).
        let word = unsafe { AtomicU64::from_ptr(p.cast::<u64>()) };
        let v = word.load(Ordering::Relaxed);
        let _ = word.compare_exchange(v, v, Ordering::Relaxed, Ordering::Relaxed);
    }
}

/// Prefaults where the system allows it; a refusal leaves the pages to fault in on first use.
fn prefault(ptr: NonNull<u8>, len: usize) {
    let _ = try_prefault(ptr, len);
}

/// Pages asked about per `mincore` call: its answer, a byte a page, fits on the stack.
const RESIDENCY_BATCH: usize = 4096;

/// Calls `run(offset, len, resident)` for each run of pages of `[ptr, ptr + len)` (page-aligned)
/// alike in whether they are resident now, in address order. Returns false where the system
/// cannot say (then `run` may have been called for a prefix only). Under Miri, which has no
/// `mincore`, never says.
pub(crate) fn resident_runs(ptr: NonNull<u8>, len: usize, mut run: impl FnMut(usize, usize, bool)) -> bool {
    if cfg!(miri) {
        return false;
    }
    let page = page_size();
    debug_assert!(ptr.as_ptr() as usize % page == 0 && len % page == 0);
    let mut vec = [0u8; RESIDENCY_BATCH];
    let (mut done, mut open): (usize, Option<(usize, bool)>) = (0, None);
    while done < len {
        let n = ((len - done) / page).min(RESIDENCY_BATCH);
        // SAFETY: `[ptr + done, + n pages)` lies in the caller's page-aligned range, and `vec`
        // holds a byte for each of its pages.
        let rc = unsafe { libc::mincore(ptr.as_ptr().add(done).cast(), n * page, vec.as_mut_ptr()) };
        if rc != 0 {
            return false;
        }
        for (i, v) in vec[..n].iter().enumerate() {
            let (at, resident) = (done + i * page, v & 1 == 1);
            match open {
                Some((_, r)) if r == resident => {}
                Some((from, r)) => {
                    run(from, at - from, r);
                    open = Some((at, resident));
                }
                None => open = Some((at, resident)),
            }
        }
        done += n * page;
    }
    if let Some((from, r)) = open {
        run(from, len - from, r);
    }
    true
}

/// Bytes of the whole pages inside `[p, p + len)` resident now. For tests: panics where the system
/// cannot say.
#[cfg(test)]
pub(crate) fn resident_bytes(p: NonNull<u8>, len: usize) -> usize {
    let (a, b) = whole_pages(p.as_ptr() as usize, len);
    let mut bytes = 0;
    let pages = NonNull::new(a as *mut u8).expect("a page of the block");
    assert!(resident_runs(pages, b - a, |_, n, resident| bytes += if resident { n } else { 0 }), "mincore answers");
    bytes
}

/// Refuses lengths no backend maps: 0 (a region holds at least one block header) and more than
/// an address space holds.
fn check_map_len(len: usize) -> Result<(), BackendError> {
    if len == 0 {
        return Err(BackendError::refused("map", 0, "a region holds at least one block"));
    }
    if len > isize::MAX as usize {
        return Err(BackendError::refused("map", len, "more than an address space holds"));
    }
    Ok(())
}

fn mmap_checked(
    len: usize,
    prot: libc::c_int,
    flags: libc::c_int,
    fd: libc::c_int,
) -> Result<NonNull<u8>, BackendError> {
    check_map_len(len)?;
    // SAFETY: a fresh mapping at an address the kernel chooses; no existing memory is affected.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, 0) };
    if p == libc::MAP_FAILED {
        return Err(BackendError::last_os("mmap", len));
    }
    NonNull::new(p.cast()).ok_or(BackendError::refused("mmap", len, "the kernel returned null"))
}

/// The least time between two returns of the C heap's free memory ([`AnonymousMemory`]'s
/// `trim`).
pub const TRIM_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether the C heap's free memory may be returned now: no return in the last
/// [`TRIM_INTERVAL`] (the first one always is). Claims the slot when it says yes.
fn trim_due() -> bool {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static START: OnceLock<std::time::Instant> = OnceLock::new();
    // Milliseconds after START of the last return, plus one (0: none yet).
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = START.get_or_init(std::time::Instant::now).elapsed().as_millis() as u64 + 1;
    let last = LAST.load(Ordering::Relaxed);
    let interval = TRIM_INTERVAL.as_millis() as u64;
    (last == 0 || now >= last + interval)
        && LAST.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
}

/// Anonymous private memory from `mmap`, with huge-page advice for large regions.
#[derive(Debug, Default, Clone, Copy)]
pub struct AnonymousMemory;

impl Backend for AnonymousMemory {
    fn name(&self) -> &'static str {
        "anonymous"
    }

    fn map(&self, len: usize, prefault_now: bool) -> Result<NonNull<u8>, BackendError> {
        let ptr = mmap_checked(len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1)?;
        if len >= HUGE_PAGE_THRESHOLD {
            // SAFETY: advice on our own fresh mapping; failure (no THP support) is harmless.
            unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
        }
        if prefault_now {
            prefault(ptr, len);
        }
        Ok(ptr)
    }

    /// # Safety
    /// As for [`Backend::unmap`].
    unsafe fn unmap(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: the caller guarantees this is one whole mapping of ours, no longer used.
        unsafe { libc::munmap(ptr.as_ptr().cast(), len) };
    }

    fn discard(&self, ptr: NonNull<u8>, len: usize) -> bool {
        // SAFETY: the caller passes page-aligned memory of one of our mappings that holds no live
        // data; for private anonymous memory the pages are dropped and read back as zeros.
        unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_DONTNEED) == 0 }
    }

    fn populate(&self, ptr: NonNull<u8>, len: usize) {
        prefault(ptr, len);
    }

    /// # Safety
    /// As for [`Backend::give_back_pages`].
    unsafe fn give_back_pages(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: whole pages inside a block of ours from the C heap (private anonymous memory,
        // from its heap or a mapping of its own), whose bytes nobody reads again: they read back
        // as zeros. The C heap's own records lie outside the block (its chunk header in front,
        // the next chunk's behind) and are written only by `free`, after this.
        unsafe { advise_whole_pages(ptr.as_ptr() as usize, len, libc::MADV_DONTNEED) };
    }

    fn huge_pages(&self, ptr: NonNull<u8>, len: usize, on: bool) {
        let advice = if on { libc::MADV_HUGEPAGE } else { libc::MADV_NOHUGEPAGE };
        // SAFETY: advice on whole pages of one of our own mappings (the caller's range lies in
        // one); it changes no byte, and a refusal (no THP support) is harmless.
        unsafe { advise_whole_pages(ptr.as_ptr() as usize, len, advice) };
    }

    fn discard_zeroes(&self) -> bool {
        // Miri runs no `madvise` (see the shim above): there the pages keep their bytes.
        !cfg!(miri)
    }

    fn faults_lazily(&self) -> bool {
        true
    }

    /// At most once per [`TRIM_INTERVAL`] in the process: `malloc_trim` walks the whole C heap,
    /// tens of milliseconds for a large fragmented one even when it finds nothing to return, and a
    /// program making a workspace per thread or task would pay that for each.
    fn trim(&self) {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        if trim_due() {
            // SAFETY: a plain glibc call without preconditions.
            unsafe {
                libc::malloc_trim(0);
            }
        }
    }

    /// Blocks come from the C heap, as NumPy's default allocator's do: small ones are recycled
    /// by it, large ones are mappings of its own whose size it learns (glibc raises its mapping
    /// threshold as they are freed), so a cycle served outside the arena costs what it costs
    /// without rustws.
    fn alloc_block(&self, len: usize) -> Result<NonNull<u8>, BackendError> {
        c_heap_block(len, false)
    }

    /// `calloc` underneath: memory the C heap knows to be zero (a fresh mapping) is not written.
    fn alloc_block_zeroed(&self, len: usize) -> Result<NonNull<u8>, BackendError> {
        c_heap_block(len, true)
    }

    /// # Safety
    /// As for [`Backend::zero_reused`].
    unsafe fn zero_reused(&self, ptr: NonNull<u8>, len: usize) -> Result<(), BackendError> {
        // SAFETY: forwarded with the caller's guarantee: a block of `c_heap_block`.
        unsafe { zero_heap_block(ptr, len) };
        Ok(())
    }

    /// # Safety
    /// As for [`Backend::free_block`].
    unsafe fn free_block(&self, ptr: NonNull<u8>, _len: usize) {
        // SAFETY: blocks of this backend come from `c_heap_block`, which stores the distance to
        // the allocation's start in the word before the block.
        unsafe {
            let back = ptr.as_ptr().sub(C_HEAP_TAG).cast::<usize>().read();
            libc::free(ptr.as_ptr().sub(back).cast());
        }
    }
}

/// Bytes in front of a C-heap block that record where its allocation starts.
const C_HEAP_TAG: usize = std::mem::size_of::<usize>();

/// Bytes from which a block of the C heap that served before is zero-filled by dropping its
/// whole pages (`MADV_DONTNEED`: private memory reads back as zeros, and takes no room until
/// written) rather than by writing them: glibc's largest mapping threshold, above which its
/// `calloc`, and so NumPy's `np.zeros`, always hands out pages that nothing wrote yet.
pub const ZERO_BY_DISCARD: usize = 32 << 20;

/// Zero-fills `len` bytes at `ptr`, in a block of [`c_heap_block`]: written below
/// [`ZERO_BY_DISCARD`] bytes, its whole pages dropped above (the partial pages at its ends
/// written).
///
/// # Safety
/// `[ptr, ptr + len)` lies in one live block of [`c_heap_block`], owned by the caller.
unsafe fn zero_heap_block(ptr: NonNull<u8>, len: usize) {
    let start = ptr.as_ptr() as usize;
    let (a, b) = whole_pages(start, len);
    // SAFETY: the advice covers whole pages inside the caller's block, whose bytes it gives up;
    // the C heap's own bookkeeping lies outside them (in front of the block). A refusal leaves
    // the pages as they were, and they are written instead.
    let dropped = len >= ZERO_BY_DISCARD
        && !cfg!(miri)
        && a < b
        && unsafe { libc::madvise(a as *mut libc::c_void, b - a, libc::MADV_DONTNEED) } == 0;
    // SAFETY: ranges inside the caller's block.
    unsafe {
        if dropped {
            std::ptr::write_bytes(ptr.as_ptr(), 0, a - start);
            std::ptr::write_bytes(b as *mut u8, 0, start + len - b);
        } else {
            std::ptr::write_bytes(ptr.as_ptr(), 0, len);
        }
    }
}

/// A [`BLOCK_ALIGN`]-aligned block of `len` bytes from `malloc` (or `calloc`), with the distance
/// back to the allocation's start stored in the word in front of it. A block of a page-aligned
/// class (a slot of at least [`PAGE_ALIGNED_SIZE`] plus its header) starts [`HEADER`] bytes short
/// of a [`LARGE_DATA_ALIGN`] boundary, so that its data, behind the header, starts there as the
/// arena places such blocks (and as tcmalloc and mimalloc place large allocations): threaded BLAS
/// kernels run measurably faster on page-aligned matrices than at the C heap's 16 bytes past a
/// page. The pad costs address space only, up to 4 KiB per block: where the C heap maps the block
/// on its own (glibc, from 128 KiB until its threshold rises) it shares the page the heap's own
/// header touches; `calloc` zeroes it with the rest.
fn c_heap_block(len: usize, zeroed: bool) -> Result<NonNull<u8>, BackendError> {
    let align_data = len >= PAGE_ALIGNED_SIZE + HEADER;
    let room = if align_data { LARGE_DATA_ALIGN } else { BLOCK_ALIGN };
    let total = len.checked_add(room + C_HEAP_TAG).ok_or(BackendError::refused(
        "malloc",
        len,
        "more than an address space holds",
    ))?;
    // SAFETY: plain C allocation calls with a non-zero size.
    let raw = unsafe {
        if zeroed {
            libc::calloc(1, total)
        } else {
            libc::malloc(total)
        }
    }
    .cast::<u8>();
    if raw.is_null() {
        return Err(BackendError::os(if zeroed { "calloc" } else { "malloc" }, len, libc::ENOMEM));
    }
    let start = raw as usize;
    // `at` lies at most `room - 1` past `start + C_HEAP_TAG`; HEADER is a multiple of BLOCK_ALIGN.
    let at = if align_data {
        (start + C_HEAP_TAG + HEADER).next_multiple_of(LARGE_DATA_ALIGN) - HEADER
    } else {
        (start + C_HEAP_TAG).next_multiple_of(BLOCK_ALIGN)
    };
    let back = at - start;
    // SAFETY: `at - C_HEAP_TAG >= raw` and `at + len <= raw + total`, so both the tag and the
    // block lie inside the allocation; the tag is aligned (both addresses are multiples of 8).
    let block = unsafe {
        let block = raw.add(back);
        block.sub(C_HEAP_TAG).cast::<usize>().write(back);
        NonNull::new_unchecked(block)
    };
    if len >= HUGE_PAGE_THRESHOLD {
        // As NumPy does for its large arrays: huge pages for the whole pages of the block.
        // SAFETY: advice on our own allocation; it changes no byte, and failure is harmless.
        unsafe { advise_whole_pages(at, len, libc::MADV_HUGEPAGE) };
    }
    Ok(block)
}

/// Memory mapped from a file. Each region gets a file of its own, so regions never share pages,
/// and the workspace never writes a file it did not create:
///
/// - a folder `path` gets a new file per region, unlinked at once (it disappears with its
///   mapping);
/// - a file `path` that does not exist is created (exclusively: `O_CREAT | O_EXCL`) for one region
///   and removed when that region is released; while it exists (mapped by another region, or
///   another process, or a file of someone else's) further regions get unlinked files beside it,
///   and the existing file is never opened for writing, truncated or removed.
///
/// A region's blocks are reserved on the file system when it is mapped (`posix_fallocate`), so a
/// full file system is an error then, never a `SIGBUS` later.
///
/// At `fork()` the regions are copied, in the prepare handler, into private anonymous memory, and
/// the child's copies of the shared mappings are replaced by those snapshots before the child
/// runs any code: the child sees exactly what its parent had when it forked, and the two
/// processes never carve, write or free each other's blocks.
#[derive(Debug)]
pub struct FileMappedMemory {
    path: PathBuf,
    /// Open files by mapping address, with the named path each created, if any.
    files: std::sync::Mutex<Vec<(usize, File, Option<CreatedFile>)>>,
    /// Cleared once the file system refused to punch a hole (`MADV_REMOVE`): it is not asked
    /// again.
    punches_holes: AtomicBool,
}

/// A named file a region created: removed when the region is released, by the process that
/// created it (a forked child inherits the record but not the file).
#[derive(Debug)]
struct CreatedFile {
    path: PathBuf,
    pid: u32,
}

static FILE_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Named files created and mapped right now by any `FileMappedMemory` of this process.
static NAMED_FILES_IN_USE: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Every file-backed region of this process, `(address, length)`, and their snapshots while a
/// `fork()` is under way.
struct RegionTable {
    regions: Vec<(usize, usize)>,
    /// The private copy of each region made by `before_fork` (0: none could be made); reserved
    /// as regions are added, so the fork handlers do not allocate.
    snapshots: Vec<usize>,
}

/// [`RegionTable`] behind a spin lock rather than a mutex: `fork()` takes it in its prepare
/// handler and both sides release it, which a std mutex guard cannot express.
struct SharedRegions {
    busy: std::sync::atomic::AtomicBool,
    table: std::cell::UnsafeCell<RegionTable>,
}

// SAFETY: `table` is only reached through `with` or the fork handlers, under `busy`.
unsafe impl Sync for SharedRegions {}

static SHARED_REGIONS: SharedRegions = SharedRegions {
    busy: std::sync::atomic::AtomicBool::new(false),
    table: std::cell::UnsafeCell::new(RegionTable { regions: Vec::new(), snapshots: Vec::new() }),
};

impl SharedRegions {
    fn acquire(&self) {
        while self.busy.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            std::hint::spin_loop();
        }
    }

    fn release(&self) {
        self.busy.store(false, Ordering::Release);
    }

    fn with<R>(&self, f: impl FnOnce(&mut RegionTable) -> R) -> R {
        self.acquire();
        // SAFETY: `busy` is held, so this is the only reference to the table.
        let r = f(unsafe { &mut *self.table.get() });
        self.release();
        r
    }
}

/// Prepare handler: takes the table's lock (held across `fork()`) and snapshots every region into
/// private anonymous memory, which the child inherits (copy-on-write) as it is at this point.
extern "C" fn before_fork() {
    SHARED_REGIONS.acquire();
    // SAFETY: `busy` is held until one of the after-fork handlers releases it.
    let table = unsafe { &mut *SHARED_REGIONS.table.get() };
    table.snapshots.clear();
    for &(addr, len) in &table.regions {
        // SAFETY: each entry is a live mapping of ours (entries are removed before unmapping).
        let copy = unsafe { snapshot(addr as *const u8, len) };
        // Capacity was reserved as regions were added: this does not allocate.
        table.snapshots.push(copy);
    }
}

extern "C" fn after_fork_in_parent() {
    // SAFETY: `before_fork` holds `busy` for this thread.
    let table = unsafe { &mut *SHARED_REGIONS.table.get() };
    for (&(_, len), &copy) in table.regions.iter().zip(&table.snapshots) {
        if copy != 0 {
            // SAFETY: `copy` is the snapshot `before_fork` mapped with `len` bytes; only the child
            // uses its own copy of it.
            unsafe { libc::munmap(copy as *mut libc::c_void, len) };
        }
    }
    table.snapshots.clear();
    SHARED_REGIONS.release();
}

extern "C" fn after_fork_in_child() {
    // SAFETY: `before_fork` acquired the lock in the thread that forked, the only thread of the
    // child; the table is not reached otherwise until `release`.
    let table = unsafe { &mut *SHARED_REGIONS.table.get() };
    for (&(addr, len), &copy) in table.regions.iter().zip(&table.snapshots) {
        // SAFETY: each entry is a live mapping of ours and `copy` its snapshot (or 0).
        unsafe { replace_with_snapshot(addr as *mut libc::c_void, len, copy as *mut libc::c_void) };
    }
    // The child's regions are private memory now: a later fork of the child copies none of them.
    table.regions.clear();
    table.snapshots.clear();
    SHARED_REGIONS.release();
}

/// A private anonymous copy of the `len` bytes at `addr`, as an address (0 when no memory could
/// be mapped for it).
///
/// # Safety
/// `[addr, addr + len)` is a readable mapping.
unsafe fn snapshot(addr: *const u8, len: usize) -> usize {
    // SAFETY: a fresh private mapping at an address the kernel chooses.
    let copy = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if copy == libc::MAP_FAILED {
        return 0;
    }
    // SAFETY: both are live mappings of `len` bytes and do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(addr, copy.cast::<u8>(), len) };
    copy as usize
}

/// Moves the snapshot `copy` over the shared mapping `[addr, addr + len)` (which the kernel
/// unmaps). Where there is no snapshot, or the move fails, the region is made inaccessible: a
/// child that touches it faults instead of corrupting its parent.
///
/// # Safety
/// `[addr, addr + len)` is one whole mapping, `copy` a private mapping of `len` bytes or null,
/// and no other thread runs (the child of `fork()`).
unsafe fn replace_with_snapshot(addr: *mut libc::c_void, len: usize, copy: *mut libc::c_void) {
    if !copy.is_null() {
        // SAFETY: moves our private copy over the caller's mapping; same length.
        let moved = unsafe { libc::mremap(copy, len, len, libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED, addr) };
        if moved != libc::MAP_FAILED {
            return;
        }
        // SAFETY: `copy` is ours and unused.
        unsafe { libc::munmap(copy, len) };
    }
    // SAFETY: the caller guarantees this is one of our mappings.
    unsafe { libc::mprotect(addr, len, libc::PROT_NONE) };
}

fn register_fork_handlers() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if cfg!(miri) {
            return; // Miri runs no fork handlers (and no fork).
        }
        // SAFETY: the handlers are plain functions that neither allocate nor unwind.
        unsafe { libc::pthread_atfork(Some(before_fork), Some(after_fork_in_parent), Some(after_fork_in_child)) };
    });
}

/// Reserves `len` bytes of `file` on its file system.
fn reserve(file: &File, len: usize) -> Result<(), BackendError> {
    let len_off =
        libc::off_t::try_from(len).map_err(|_| BackendError::refused("reserve file space", len, "too large a file"))?;
    // SAFETY: a valid open descriptor; the call only sizes and allocates the file.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len_off) };
    match rc {
        0 => Ok(()),
        // A file system that cannot reserve (and no emulation): a sparse file as before.
        libc::EOPNOTSUPP | libc::EINVAL => file.set_len(len as u64).map_err(|e| io_error("size a file", len, &e)),
        errno => Err(BackendError::os("reserve file space", len, errno)),
    }
}

/// An I/O error as a backend's refusal (`EIO` where it carries no `errno`).
fn io_error(op: &'static str, len: usize, e: &std::io::Error) -> BackendError {
    BackendError::os(op, len, e.raw_os_error().unwrap_or(libc::EIO))
}

impl FileMappedMemory {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        register_fork_handlers();
        FileMappedMemory {
            path: path.into(),
            files: std::sync::Mutex::new(Vec::new()),
            punches_holes: AtomicBool::new(true),
        }
    }

    /// A new file in `dir`, unlinked once open.
    fn unnamed_in(dir: &std::path::Path, stem: &str) -> Result<File, BackendError> {
        let name = format!("{stem}-{}-{}.mmap", std::process::id(), FILE_COUNTER.fetch_add(1, Ordering::Relaxed));
        let full = dir.join(name);
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&full)
            .map_err(|e| io_error("create a file", 0, &e))?;
        let _ = std::fs::remove_file(&full);
        Ok(f)
    }

    /// The file for a new region, and the named file it created, if any.
    fn open(&self) -> Result<(File, Option<CreatedFile>), BackendError> {
        if self.path.is_dir() {
            return Ok((Self::unnamed_in(&self.path, "rustws")?, None));
        }
        let parent = match self.path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let parent = std::fs::canonicalize(&parent).map_err(|e| io_error("find the folder", 0, &e))?;
        let file_name =
            self.path.file_name().ok_or(BackendError::refused("create a file", 0, "temp_file_path names no file"))?;
        let canonical = parent.join(file_name);
        let stem = file_name.to_string_lossy().into_owned();
        let mut in_use = NAMED_FILES_IN_USE.lock().unwrap_or_else(|e| e.into_inner());
        if in_use.try_reserve(1).is_err() {
            return Err(BackendError::os("create a file", 0, libc::ENOMEM));
        }
        if in_use.contains(&canonical) {
            // Another region of this process maps the named file.
            drop(in_use);
            return Ok((Self::unnamed_in(&parent, &stem)?, None));
        }
        // Only a file this call creates is ever written: an existing one belongs to someone else
        // (a user's data, or a region of another process).
        match OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(&canonical) {
            Ok(f) => {
                in_use.push(canonical.clone());
                Ok((f, Some(CreatedFile { path: canonical, pid: std::process::id() })))
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                drop(in_use);
                Ok((Self::unnamed_in(&parent, &stem)?, None))
            }
            Err(e) => Err(io_error("create a file", 0, &e)),
        }
    }

    /// Releases a region's file: a named file it created is removed (by its creator, and only if
    /// the path still names that file) and leaves the list of names in use.
    fn release_file(file: File, created: Option<CreatedFile>) {
        let Some(created) = created else { return };
        if created.pid == std::process::id() {
            let ours = file.metadata().ok().map(|m| (m.dev(), m.ino()));
            let named = std::fs::symlink_metadata(&created.path).ok().map(|m| (m.dev(), m.ino()));
            if ours.is_some() && ours == named {
                let _ = std::fs::remove_file(&created.path);
            }
        }
        drop(file);
        let mut in_use = NAMED_FILES_IN_USE.lock().unwrap_or_else(|e| e.into_inner());
        in_use.retain(|p| *p != created.path);
    }
}

impl Backend for FileMappedMemory {
    fn name(&self) -> &'static str {
        "mmap-file"
    }

    fn map(&self, len: usize, prefault_now: bool) -> Result<NonNull<u8>, BackendError> {
        check_map_len(len)?;
        let (file, created) = self.open()?;
        let mapped = reserve(&file, len)
            .and_then(|()| {
                // The tables below get room first: a full table refuses cleanly.
                let room = SHARED_REGIONS.with(|t| {
                    let want = t.regions.len() + 1;
                    t.regions.try_reserve(1).is_ok()
                        && t.snapshots.try_reserve(want.saturating_sub(t.snapshots.len())).is_ok()
                }) && self.files.lock().unwrap_or_else(|e| e.into_inner()).try_reserve(1).is_ok();
                if room {
                    Ok(())
                } else {
                    Err(BackendError::os("mmap", len, libc::ENOMEM))
                }
            })
            .and_then(|()| mmap_checked(len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, file.as_raw_fd()))
            .and_then(|ptr| {
                if !prefault_now {
                    return Ok(ptr);
                }
                try_prefault(ptr, len).map(|()| ptr).inspect_err(|_| {
                    // SAFETY: mapped just above, never handed out.
                    unsafe { libc::munmap(ptr.as_ptr().cast(), len) };
                })
            });
        let ptr = match mapped {
            Ok(p) => p,
            Err(e) => {
                Self::release_file(file, created);
                return Err(e);
            }
        };
        // Room was reserved above: these pushes do not allocate.
        SHARED_REGIONS.with(|t| t.regions.push((ptr.as_ptr() as usize, len)));
        self.files.lock().unwrap_or_else(|e| e.into_inner()).push((ptr.as_ptr() as usize, file, created));
        Ok(ptr)
    }

    /// # Safety
    /// As for [`Backend::unmap`].
    unsafe fn unmap(&self, ptr: NonNull<u8>, len: usize) {
        let addr = ptr.as_ptr() as usize;
        SHARED_REGIONS.with(|t| t.regions.retain(|&(a, _)| a != addr));
        // SAFETY: the caller guarantees this is one whole mapping of ours, no longer used.
        unsafe { libc::munmap(ptr.as_ptr().cast(), len) };
        let entry = {
            let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
            files.iter().position(|(p, ..)| *p == addr).map(|i| files.swap_remove(i))
        };
        if let Some((_, file, created)) = entry {
            Self::release_file(file, created);
        }
    }

    /// The pages go back together with the file's blocks under them (`MADV_REMOVE`: a hole
    /// punched in the file), where its file system punches holes, and otherwise at least leave
    /// the process (`MADV_DONTNEED`; the file keeps its blocks): a region retired while blocks in
    /// it live keeps only what is under them resident, as an anonymous one does. What the range
    /// then reads is not promised ([`Backend::discard_zeroes`] stays false): the arena never takes
    /// discarded file pages for zeros.
    fn discard(&self, ptr: NonNull<u8>, len: usize) -> bool {
        // SAFETY: the caller passes page-aligned memory of one of our mappings that holds no live
        // data; the file under it is this region's alone (created for it, or unnamed), and a
        // forked child maps a private snapshot of its own, so no one else reads what goes.
        unsafe {
            if self.punches_holes.load(Ordering::Relaxed) {
                if libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_REMOVE) == 0 {
                    return true;
                }
                if std::io::Error::last_os_error().raw_os_error() == Some(libc::EOPNOTSUPP) {
                    self.punches_holes.store(false, Ordering::Relaxed);
                }
            }
            libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_DONTNEED) == 0
        }
    }

    /// # Safety
    /// As for [`Backend::give_back_pages`].
    unsafe fn give_back_pages(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: a block of `alloc_block`, which is `AnonymousMemory`'s.
        unsafe { AnonymousMemory.give_back_pages(ptr, len) }
    }

    /// Blocks outside the file-backed arena (spills, first cycles) come from the C heap, as
    /// [`AnonymousMemory`]'s do.
    fn alloc_block(&self, len: usize) -> Result<NonNull<u8>, BackendError> {
        AnonymousMemory.alloc_block(len)
    }

    fn alloc_block_zeroed(&self, len: usize) -> Result<NonNull<u8>, BackendError> {
        AnonymousMemory.alloc_block_zeroed(len)
    }

    /// # Safety
    /// As for [`Backend::free_block`].
    unsafe fn free_block(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: forwarded: our blocks are AnonymousMemory's.
        unsafe { AnonymousMemory.free_block(ptr, len) }
    }

    /// # Safety
    /// As for [`Backend::zero_reused`].
    unsafe fn zero_reused(&self, ptr: NonNull<u8>, len: usize) -> Result<(), BackendError> {
        // SAFETY: forwarded: our blocks are AnonymousMemory's.
        unsafe { AnonymousMemory.zero_reused(ptr, len) }
    }

    fn trim(&self) {
        AnonymousMemory.trim();
    }
}

/// Regions from the global heap: a host stand-in with the shape of a device backend (no mmap, no
/// advice), so the arena logic can be proven against a non-mapping source.
#[derive(Debug, Default, Clone, Copy)]
pub struct HeapMemory;

impl Backend for HeapMemory {
    fn name(&self) -> &'static str {
        "heap"
    }

    fn map(&self, len: usize, _prefault: bool) -> Result<NonNull<u8>, BackendError> {
        check_map_len(len)?;
        let layout = Layout::from_size_align(len, 4096)
            .map_err(|_| BackendError::refused("map", len, "more than an address space holds"))?;
        // SAFETY: non-zero size.
        NonNull::new(unsafe { alloc::alloc_zeroed(layout) }).ok_or(BackendError::os("map", len, libc::ENOMEM))
    }

    /// # Safety
    /// As for [`Backend::unmap`].
    unsafe fn unmap(&self, ptr: NonNull<u8>, len: usize) {
        let layout = Layout::from_size_align(len, 4096).expect("layout was valid at map");
        // SAFETY: the caller guarantees `ptr` came from `map` with this length.
        unsafe { alloc::dealloc(ptr.as_ptr(), layout) }
    }
}

/// A host stand-in for device memory: heap memory that declares itself not host-accessible, so
/// the arena keeps its headers elsewhere and touches it only through `zero` and `copy`. Every
/// region and block is filled with [`OpaqueMemory::CANARY`] when handed out, so a test can prove
/// that nothing but the owner of a block wrote into it.
#[derive(Debug, Default, Clone, Copy)]
pub struct OpaqueMemory;

impl OpaqueMemory {
    pub const CANARY: u8 = 0xA5;
}

impl Backend for OpaqueMemory {
    fn name(&self) -> &'static str {
        "opaque (device stand-in)"
    }

    fn map(&self, len: usize, prefault: bool) -> Result<NonNull<u8>, BackendError> {
        let p = HeapMemory.map(len, prefault)?;
        // SAFETY: freshly allocated, `len` bytes.
        unsafe { p.as_ptr().write_bytes(Self::CANARY, len) };
        Ok(p)
    }

    /// # Safety
    /// As for [`Backend::unmap`].
    unsafe fn unmap(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: forwarded: our regions are HeapMemory's.
        unsafe { HeapMemory.unmap(ptr, len) }
    }

    fn alloc_block(&self, len: usize) -> Result<NonNull<u8>, BackendError> {
        let p = HeapMemory.alloc_block(len)?;
        // SAFETY: freshly allocated, `len` bytes.
        unsafe { p.as_ptr().write_bytes(Self::CANARY, len) };
        Ok(p)
    }

    /// # Safety
    /// As for [`Backend::free_block`].
    unsafe fn free_block(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: forwarded: our blocks are HeapMemory's.
        unsafe { HeapMemory.free_block(ptr, len) }
    }

    fn host_accessible(&self) -> bool {
        false
    }
}

/// The data-access methods of an adaptor whose data lives in its `upstream` backend: zeroing
/// and copying go straight through.
macro_rules! forward_data_access {
    () => {
        fn huge_pages(&self, ptr: NonNull<u8>, len: usize, on: bool) {
            self.upstream.huge_pages(ptr, len, on);
        }

        /// # Safety
        /// As for [`Backend::give_back_pages`].
        unsafe fn give_back_pages(&self, ptr: NonNull<u8>, len: usize) {
            // SAFETY: forwarded with the caller's guarantee.
            unsafe { self.upstream.give_back_pages(ptr, len) }
        }

        fn block_align(&self) -> usize {
            self.upstream.block_align()
        }

        /// # Safety
        /// As for [`Backend::zero`].
        unsafe fn zero(&self, ptr: NonNull<u8>, len: usize) -> Result<(), BackendError> {
            // SAFETY: forwarded with the caller's guarantee.
            unsafe { self.upstream.zero(ptr, len) }
        }

        /// # Safety
        /// As for [`Backend::zero_reused`].
        unsafe fn zero_reused(&self, ptr: NonNull<u8>, len: usize) -> Result<(), BackendError> {
            // SAFETY: forwarded with the caller's guarantee.
            unsafe { self.upstream.zero_reused(ptr, len) }
        }

        /// # Safety
        /// As for [`Backend::copy`].
        unsafe fn copy(&self, dst: NonNull<u8>, src: NonNull<u8>, len: usize) -> Result<(), BackendError> {
            // SAFETY: forwarded with the caller's guarantee.
            unsafe { self.upstream.copy(dst, src, len) }
        }

        /// # Safety
        /// As for [`Backend::copy_to_host`].
        unsafe fn copy_to_host(&self, dst: NonNull<u8>, src: NonNull<u8>, len: usize) -> Result<(), BackendError> {
            // SAFETY: forwarded with the caller's guarantee.
            unsafe { self.upstream.copy_to_host(dst, src, len) }
        }

        /// # Safety
        /// As for [`Backend::copy_from_host`].
        unsafe fn copy_from_host(&self, dst: NonNull<u8>, src: NonNull<u8>, len: usize) -> Result<(), BackendError> {
            // SAFETY: forwarded with the caller's guarantee.
            unsafe { self.upstream.copy_from_host(dst, src, len) }
        }
    };
}

/// Refuses once the bytes it holds would exceed `limit`: failure injection for tests, and a hard
/// cap for users (RMM's `limiting_resource_adaptor`).
#[derive(Debug)]
pub struct LimitAdaptor {
    upstream: Arc<dyn Backend>,
    limit: usize,
    held: AtomicUsize,
    /// Every mapping and block passes here: while recording, each is a segment event.
    recorder: Recorder,
}

impl LimitAdaptor {
    pub fn new(upstream: Arc<dyn Backend>, limit: usize) -> Self {
        LimitAdaptor { upstream, limit, held: AtomicUsize::new(0), recorder: Recorder::default() }
    }

    /// The history of what passes (and of the workspace above, which records there too).
    pub fn recorder(&self) -> &Recorder {
        &self.recorder
    }

    fn segment(&self, action: Action, at: NonNull<u8>, len: usize) {
        if self.recorder.is_on() {
            self.recorder.record(action, at.as_ptr() as usize, len, 0, 0);
        }
    }

    /// The backend under the limit.
    pub fn upstream(&self) -> &Arc<dyn Backend> {
        &self.upstream
    }

    /// Bytes currently held through this adaptor.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// The most it holds at once.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes it would still grant.
    pub fn room(&self) -> usize {
        self.limit.saturating_sub(self.held())
    }

    /// Stops counting the mapping of `len` bytes at `at`, made through this adaptor, which now
    /// leaves for another owner (it goes back to the system through another source).
    pub(crate) fn let_go(&self, at: NonNull<u8>, len: usize) {
        self.segment(Action::SegmentFree, at, len);
        self.held.fetch_sub(len, Ordering::Relaxed);
    }

    /// Counts a mapping of `len` bytes at `at` that another owner made and hands over (it goes
    /// back to the system through this adaptor from now on); refused past the limit.
    pub(crate) fn take_over(&self, at: NonNull<u8>, len: usize) -> Result<(), BackendError> {
        self.reserve("map", len)?;
        self.segment(Action::SegmentAlloc, at, len);
        Ok(())
    }

    fn reserve(&self, op: &'static str, len: usize) -> Result<(), BackendError> {
        let mut cur = self.held.load(Ordering::Relaxed);
        loop {
            let next = cur.checked_add(len).filter(|n| *n <= self.limit).ok_or(BackendError {
                op,
                bytes: len,
                cause: Cause::Limit { limit: self.limit, held: cur },
            })?;
            match self.held.compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Ok(()),
                Err(actual) => cur = actual,
            }
        }
    }
}

impl Backend for LimitAdaptor {
    fn name(&self) -> &'static str {
        "limit"
    }

    fn map(&self, len: usize, prefault_now: bool) -> Result<NonNull<u8>, BackendError> {
        self.reserve("map", len)?;
        let at = self.upstream.map(len, prefault_now).inspect_err(|_| {
            self.held.fetch_sub(len, Ordering::Relaxed);
        })?;
        self.segment(Action::SegmentAlloc, at, len);
        Ok(at)
    }

    /// # Safety
    /// As for [`Backend::unmap`].
    unsafe fn unmap(&self, ptr: NonNull<u8>, len: usize) {
        self.segment(Action::SegmentFree, ptr, len);
        // SAFETY: forwarded with the caller's guarantee.
        unsafe { self.upstream.unmap(ptr, len) };
        self.held.fetch_sub(len, Ordering::Relaxed);
    }

    fn alloc_block(&self, len: usize) -> Result<NonNull<u8>, BackendError> {
        self.reserve("alloc_block", len)?;
        let at = self.upstream.alloc_block(len).inspect_err(|_| {
            self.held.fetch_sub(len, Ordering::Relaxed);
        })?;
        self.segment(Action::SegmentAlloc, at, len);
        Ok(at)
    }

    /// # Safety
    /// As for [`Backend::free_block`].
    unsafe fn free_block(&self, ptr: NonNull<u8>, len: usize) {
        self.segment(Action::SegmentFree, ptr, len);
        // SAFETY: forwarded with the caller's guarantee.
        unsafe { self.upstream.free_block(ptr, len) };
        self.held.fetch_sub(len, Ordering::Relaxed);
    }

    fn host_accessible(&self) -> bool {
        self.upstream.host_accessible()
    }

    fn discard(&self, ptr: NonNull<u8>, len: usize) -> bool {
        self.upstream.discard(ptr, len)
    }

    fn discard_zeroes(&self) -> bool {
        self.upstream.discard_zeroes()
    }

    fn faults_lazily(&self) -> bool {
        self.upstream.faults_lazily()
    }

    fn trim(&self) {
        self.upstream.trim();
    }

    fn populate(&self, ptr: NonNull<u8>, len: usize) {
        self.upstream.populate(ptr, len);
    }

    fn alloc_block_zeroed(&self, len: usize) -> Result<NonNull<u8>, BackendError> {
        self.reserve("alloc_block", len)?;
        let at = self.upstream.alloc_block_zeroed(len).inspect_err(|_| {
            self.held.fetch_sub(len, Ordering::Relaxed);
        })?;
        self.segment(Action::SegmentAlloc, at, len);
        Ok(at)
    }

    forward_data_access!();
}

/// Fails chosen calls of `map` and `alloc_block` on its upstream with the error the system would
/// report (`ENOMEM`, `ENOSPC` ...): failure injection for tests. Calls are counted from 1 across
/// both methods; [`FaultAdaptor::fail_nth`] fails one call, [`FaultAdaptor::fail_every`] every
/// `n`th. `unmap`, `free_block` and the rest pass through.
#[derive(Debug)]
pub struct FaultAdaptor {
    upstream: Arc<dyn Backend>,
    /// Fail call `nth`, and with `every` each multiple of it.
    nth: u64,
    every: bool,
    errno: i32,
    calls: AtomicU64,
    injected: AtomicU64,
    armed: std::sync::atomic::AtomicBool,
}

impl FaultAdaptor {
    /// Fails call `n` (1-based) once, with `errno`.
    pub fn fail_nth(upstream: Arc<dyn Backend>, n: u64, errno: i32) -> Self {
        Self::build(upstream, n, false, errno)
    }

    /// Fails every `n`th call (n >= 1), with `errno`.
    pub fn fail_every(upstream: Arc<dyn Backend>, n: u64, errno: i32) -> Self {
        Self::build(upstream, n.max(1), true, errno)
    }

    fn build(upstream: Arc<dyn Backend>, nth: u64, every: bool, errno: i32) -> Self {
        FaultAdaptor {
            upstream,
            nth,
            every,
            errno,
            calls: AtomicU64::new(0),
            injected: AtomicU64::new(0),
            armed: std::sync::atomic::AtomicBool::new(true),
        }
    }

    /// Calls of `map` and `alloc_block` so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Failures injected so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }

    /// Stops (false) or resumes (true) injecting.
    pub fn set_armed(&self, armed: bool) {
        self.armed.store(armed, Ordering::Relaxed);
    }

    fn check(&self, op: &'static str, len: usize) -> Result<(), BackendError> {
        let k = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        let hit = if self.every { k % self.nth == 0 } else { k == self.nth };
        if hit && self.armed.load(Ordering::Relaxed) {
            self.injected.fetch_add(1, Ordering::Relaxed);
            return Err(BackendError::os(op, len, self.errno));
        }
        Ok(())
    }
}

impl Backend for FaultAdaptor {
    fn name(&self) -> &'static str {
        "fault-injection"
    }

    fn map(&self, len: usize, prefault_now: bool) -> Result<NonNull<u8>, BackendError> {
        self.check("map", len)?;
        self.upstream.map(len, prefault_now)
    }

    /// # Safety
    /// As for [`Backend::unmap`].
    unsafe fn unmap(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: forwarded with the caller's guarantee.
        unsafe { self.upstream.unmap(ptr, len) }
    }

    fn alloc_block(&self, len: usize) -> Result<NonNull<u8>, BackendError> {
        self.check("alloc_block", len)?;
        self.upstream.alloc_block(len)
    }

    /// # Safety
    /// As for [`Backend::free_block`].
    unsafe fn free_block(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: forwarded with the caller's guarantee.
        unsafe { self.upstream.free_block(ptr, len) }
    }

    fn host_accessible(&self) -> bool {
        self.upstream.host_accessible()
    }

    fn faults_lazily(&self) -> bool {
        self.upstream.faults_lazily()
    }

    fn discard(&self, ptr: NonNull<u8>, len: usize) -> bool {
        self.upstream.discard(ptr, len)
    }

    fn discard_zeroes(&self) -> bool {
        self.upstream.discard_zeroes()
    }

    forward_data_access!();
}

/// `n` rounded up to a multiple of the system page size, or None when that does not fit a
/// `usize`.
pub fn checked_round_to_page(n: usize) -> Option<usize> {
    let p = page_size();
    n.div_ceil(p).checked_mul(p)
}

/// `n` rounded up to a multiple of the system page size; `usize::MAX` (a length no backend maps
/// or allocates, so the request fails cleanly) when that does not fit a `usize`.
pub fn round_to_page(n: usize) -> usize {
    checked_round_to_page(n).unwrap_or(usize::MAX)
}

/// The system page size.
pub fn page_bytes() -> usize {
    page_size()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exercise(b: &dyn Backend) {
        let len = round_to_page(1 << 20);
        let p = b.map(len, true).unwrap();
        assert_eq!(p.as_ptr() as usize % BLOCK_ALIGN, 0);
        // SAFETY: freshly mapped, len bytes.
        let s = unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), len) };
        assert!(s.iter().all(|&x| x == 0), "fresh regions are zero-filled");
        s.fill(7);
        // SAFETY: mapped above, released once.
        unsafe { b.unmap(p, len) };
        for len in [100, 256 << 10, 3 << 20] {
            let q = b.alloc_block(len).unwrap();
            assert_eq!(q.as_ptr() as usize % BLOCK_ALIGN, 0);
            // SAFETY: allocated above with `len` bytes.
            unsafe {
                q.as_ptr().write_bytes(0xAB, len);
                b.free_block(q, len);
            }
        }
    }

    #[test]
    fn the_c_heap_is_trimmed_at_most_once_an_interval() {
        // Other tests may trim meanwhile: either way, the second of two calls in a row is due
        // only an interval after the first.
        let _ = trim_due();
        assert!(!trim_due(), "a second return of the C heap's memory within {TRIM_INTERVAL:?}");
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri maps no files")]
    fn every_host_backend_maps_zeroed_aligned_memory() {
        exercise(&AnonymousMemory);
        exercise(&HeapMemory);
        exercise(&FileMappedMemory::new(std::env::temp_dir()));
        let named = std::env::temp_dir().join(format!("rustws-test-{}.bin", std::process::id()));
        exercise(&FileMappedMemory::new(&named));
        let _ = std::fs::remove_file(named);
    }

    #[test]
    fn c_heap_blocks_of_page_aligned_classes_have_their_data_on_a_page() {
        let page = LARGE_DATA_ALIGN;
        let large = PAGE_ALIGNED_SIZE + HEADER;
        let big = if cfg!(miri) { large + (1 << 16) } else { 16 << 20 };
        for (len, zeroed) in [(large, false), (large, true), (big, false), (large - BLOCK_ALIGN, false)] {
            let q = c_heap_block(len, zeroed).unwrap();
            let at = q.as_ptr() as usize;
            assert_eq!(at % BLOCK_ALIGN, 0);
            if len >= large {
                assert_eq!((at + HEADER) % page, 0, "{len} bytes: data at {} past a page", (at + HEADER) % page);
            }
            // SAFETY: allocated above with `len` bytes; every byte is ours, then released once.
            unsafe {
                if zeroed {
                    assert!(std::slice::from_raw_parts(q.as_ptr(), len).iter().all(|&x| x == 0));
                }
                q.as_ptr().write_bytes(0xAB, len);
                AnonymousMemory.free_block(q, len);
            }
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri maps no files")]
    fn regions_from_one_named_file_never_share_pages() {
        let named = std::env::temp_dir().join(format!("rustws-shared-{}.bin", std::process::id()));
        let _ = std::fs::remove_file(&named);
        let (a, b) = (FileMappedMemory::new(&named), FileMappedMemory::new(&named));
        let len = round_to_page(1 << 16);
        let p = a.map(len, false).unwrap();
        assert_eq!(std::fs::metadata(&named).unwrap().len() as usize, len, "the first region is the named file");
        let q = a.map(len, false).unwrap(); // a second region of the same backend
        let r = b.map(len, false).unwrap(); // a region of another workspace on the same path
                                            // SAFETY: three live mappings of `len` bytes each.
        unsafe {
            p.as_ptr().write_bytes(1, len);
            q.as_ptr().write_bytes(2, len);
            r.as_ptr().write_bytes(3, len);
            assert!(std::slice::from_raw_parts(p.as_ptr(), len).iter().all(|&x| x == 1));
            assert!(std::slice::from_raw_parts(q.as_ptr(), len).iter().all(|&x| x == 2));
            a.unmap(q, len);
            b.unmap(r, len);
        }
        assert!(named.exists(), "the named file lives while its region does");
        // SAFETY: mapped above.
        unsafe { a.unmap(p, len) };
        assert!(!named.exists(), "the file the workspace created is removed with its region");
        // Released: the named file can be made again.
        let again = a.map(len, false).unwrap();
        assert!(named.exists());
        // SAFETY: mapped above.
        unsafe { a.unmap(again, len) };
        assert!(!named.exists());
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri maps no files")]
    fn an_existing_file_is_never_written_truncated_or_removed() {
        let named = std::env::temp_dir().join(format!("rustws-existing-{}.npy", std::process::id()));
        let data: Vec<u8> = (0..208u32).map(|i| i as u8).collect();
        std::fs::write(&named, &data).unwrap();
        let b = FileMappedMemory::new(&named);
        let len = round_to_page(1 << 16);
        for prefault in [false, true] {
            let p = b.map(len, prefault).unwrap();
            // SAFETY: mapped above, `len` bytes.
            unsafe { p.as_ptr().write_bytes(9, len) };
            assert_eq!(std::fs::read(&named).unwrap(), data, "a file the workspace did not create was written");
            // SAFETY: mapped above.
            unsafe { b.unmap(p, len) };
            assert_eq!(std::fs::read(&named).unwrap(), data, "a file the workspace did not create was changed");
        }
        let _ = std::fs::remove_file(named);
    }

    #[test]
    fn no_backend_maps_zero_bytes_or_a_length_that_overflows() {
        let backends: Vec<Arc<dyn Backend>> = vec![
            Arc::new(AnonymousMemory),
            Arc::new(HeapMemory),
            Arc::new(OpaqueMemory),
            Arc::new(LimitAdaptor::new(Arc::new(HeapMemory), usize::MAX)),
            Arc::new(FaultAdaptor::fail_nth(Arc::new(HeapMemory), u64::MAX, libc::ENOMEM)),
        ];
        for b in &backends {
            assert!(b.map(0, false).is_err(), "{}: mapped 0 bytes", b.name());
            assert!(b.map(0, true).is_err(), "{}: mapped 0 bytes", b.name());
            for len in [usize::MAX, usize::MAX - 4095, isize::MAX as usize + 1, round_to_page(usize::MAX - 1)] {
                assert!(b.map(len, false).is_err(), "{}: mapped {len} bytes", b.name());
            }
            for len in [usize::MAX, usize::MAX - 63, isize::MAX as usize] {
                assert!(b.alloc_block(len).is_err(), "{}: allocated {len} bytes", b.name());
                assert!(b.alloc_block_zeroed(len).is_err(), "{}: allocated {len} bytes", b.name());
            }
        }
        #[cfg(not(miri))]
        {
            let dir = FileMappedMemory::new(std::env::temp_dir());
            assert!(dir.map(0, false).is_err());
            assert!(dir.map(usize::MAX, false).is_err());
        }
    }

    #[test]
    fn page_rounding_never_wraps() {
        let page = page_size();
        assert_eq!(round_to_page(0), 0);
        assert_eq!(round_to_page(1), page);
        assert_eq!(round_to_page(page), page);
        assert_eq!(checked_round_to_page(usize::MAX), None);
        assert_eq!(checked_round_to_page(usize::MAX - page + 2), None);
        assert_eq!(checked_round_to_page(usize::MAX / page * page), Some(usize::MAX / page * page));
        for n in [usize::MAX, usize::MAX - 1, usize::MAX - page, usize::MAX / page * page + 1] {
            assert!(round_to_page(n) >= n, "round_to_page({n}) = {} is smaller", round_to_page(n));
        }
    }

    /// The fallback of pre-faulting (kernels without `MADV_POPULATE_WRITE`) runs over memory
    /// that holds live blocks: every byte stays as it was, whatever page it is on.
    #[test]
    fn touching_pages_for_a_refused_populate_never_changes_a_byte() {
        let page = page_size();
        let len = 16 * page;
        let p = AnonymousMemory.map(len, false).unwrap();
        // SAFETY: a fresh mapping of `len` bytes.
        let s = unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), len) };
        for (i, x) in s.iter_mut().enumerate().filter(|(i, _)| (i / page) % 3 != 2) {
            *x = (i % 251) as u8 + 1; // live blocks on two pages of three, page starts included
        }
        let before = s.to_vec();
        testing::refuse_populate_write(true);
        let touched = testing::pages_touched();
        AnonymousMemory.populate(p, len);
        testing::refuse_populate_write(false);
        assert!(testing::pages_touched() >= touched + 16, "the fallback did not run");
        // SAFETY: as above.
        let s = unsafe { std::slice::from_raw_parts(p.as_ptr(), len) };
        assert!(s == before.as_slice(), "pre-faulting changed live bytes");
        // SAFETY: mapped above.
        unsafe { AnonymousMemory.unmap(p, len) };
    }

    /// A word written by another thread while its page is touched keeps the last value written.
    #[test]
    #[cfg_attr(miri, ignore = "the writer's plain stores race the touch by design")]
    fn touching_a_page_never_loses_a_concurrent_write() {
        let page = page_size();
        let p = AnonymousMemory.map(page, true).unwrap();
        let addr = p.as_ptr() as usize;
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        const WRITES: u64 = 2_000_000;
        let writer = {
            let done = done.clone();
            std::thread::spawn(move || {
                for i in 1..=WRITES {
                    // SAFETY: the page is mapped until both threads are done.
                    unsafe { std::ptr::write_volatile(addr as *mut u64, i) };
                }
                done.store(true, Ordering::Release);
            })
        };
        while !done.load(Ordering::Acquire) {
            // SAFETY: an aligned word of our writable mapping.
            unsafe { touch_for_write(addr as *mut u8) };
        }
        writer.join().unwrap();
        // SAFETY: as above; the writer has finished.
        assert_eq!(unsafe { std::ptr::read_volatile(addr as *const u64) }, WRITES);
        // SAFETY: mapped above.
        unsafe { AnonymousMemory.unmap(p, page) };
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri maps no files")]
    fn a_file_region_is_reserved_on_the_file_system() {
        let b = FileMappedMemory::new(std::env::temp_dir());
        let len = round_to_page(1 << 20);
        let p = b.map(len, false).unwrap();
        let fd = b.files.lock().unwrap()[0].1.as_raw_fd();
        // SAFETY: an all-zero `stat` is a valid output buffer for `fstat`.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a valid descriptor and buffer.
        assert_eq!(unsafe { libc::fstat(fd, &mut st) }, 0);
        assert!(st.st_blocks as usize * 512 >= len, "the file's blocks are allocated, not sparse");
        // SAFETY: mapped above.
        unsafe { b.unmap(p, len) };
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri maps no files")]
    fn a_refused_prefault_is_an_error_not_a_touch() {
        // Pages past the end of a file have no backing store: MADV_POPULATE_WRITE refuses them
        // (EFAULT / EIO), and touching them would raise SIGBUS.
        let page = page_size();
        let probe = mmap_checked(page, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1);
        let probe = probe.unwrap();
        // SAFETY: our fresh one-page mapping.
        let known = unsafe { libc::madvise(probe.as_ptr().cast(), page, 23) } == 0;
        // SAFETY: mapped above.
        unsafe { libc::munmap(probe.as_ptr().cast(), page) };
        if !known {
            eprintln!("skipped: this kernel has no MADV_POPULATE_WRITE (before 5.14), so prefault touches pages");
            return;
        }
        let f = FileMappedMemory::unnamed_in(&std::env::temp_dir(), "rustws-short").unwrap();
        f.set_len(page as u64).unwrap();
        let len = 4 * page;
        let p = mmap_checked(len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, f.as_raw_fd()).unwrap();
        let r = try_prefault(p, len);
        // SAFETY: mapped above, never handed out.
        unsafe { libc::munmap(p.as_ptr().cast(), len) };
        assert!(r.is_err(), "a prefault past the end of the file succeeded");
    }

    #[test]
    fn fault_adaptor_fails_the_chosen_calls_with_the_system_error() {
        let once = FaultAdaptor::fail_nth(Arc::new(HeapMemory), 2, libc::ENOSPC);
        let a = once.map(4096, false).unwrap();
        let e = once.alloc_block(64).unwrap_err();
        assert!(e.to_string().contains("No space left on device"), "{e}");
        let b = once.alloc_block(64).unwrap();
        assert_eq!((once.calls(), once.injected()), (3, 1));
        // SAFETY: each released once, as allocated.
        unsafe {
            once.unmap(a, 4096);
            once.free_block(b, 64);
        }
        let every = FaultAdaptor::fail_every(Arc::new(HeapMemory), 3, libc::ENOMEM);
        let results: Vec<bool> = (0..6)
            .map(|_| {
                every
                    .map(4096, false)
                    .inspect(|p| {
                        // SAFETY: mapped just now.
                        unsafe { every.unmap(*p, 4096) }
                    })
                    .is_ok()
            })
            .collect();
        assert_eq!(results, [true, true, false, true, true, false]);
        every.set_armed(false);
        assert!((0..3).all(|_| every
            .alloc_block(8)
            .map(|p| {
                // SAFETY: allocated just now.
                unsafe { every.free_block(p, 8) }
            })
            .is_ok()));
    }

    #[test]
    fn limit_adaptor_refuses_past_its_limit_and_recovers() {
        let lim = LimitAdaptor::new(Arc::new(HeapMemory), 8192);
        let a = lim.map(4096, false).unwrap();
        let b = lim.map(4096, false).unwrap();
        assert!(lim.map(4096, false).unwrap_err().to_string().contains("limit of 8192"));
        assert!(lim.alloc_block(1).is_err());
        // SAFETY: both mapped above.
        unsafe {
            lim.unmap(a, 4096);
            lim.unmap(b, 4096);
        }
        assert_eq!(lim.held(), 0);
        let c = lim.alloc_block(8192).unwrap();
        // SAFETY: allocated above.
        unsafe { lim.free_block(c, 8192) };
    }
}
