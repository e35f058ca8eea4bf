//! Memory sources under the one arena logic. A [`Backend`] hands out large regions (the arena) and
//! individual blocks (spills and external allocations); adaptors such as [`LimitAdaptor`] and
//! [`FaultAdaptor`] wrap an explicit upstream backend, in the manner of RMM's
//! `*_resource_adaptor`.

/// Under Miri, which runs no `madvise` or `sysconf`: advice is accepted and ignored (it is only
/// advice) and pages are 4 KiB. Everything else is the real `libc`.
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
    pub unsafe fn sysconf(_name: c_int) -> c_long {
        4096
    }
}

use std::alloc::{self, Layout};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Alignment of every region and block any backend hands out.
pub const BLOCK_ALIGN: usize = 64;

/// Regions at least this large get transparent-huge-page advice.
pub const HUGE_PAGE_THRESHOLD: usize = 4 << 20;

/// A source of memory. Implementations must be usable from any thread.
pub trait Backend: Send + Sync + fmt::Debug {
    /// A short name for statistics and messages.
    fn name(&self) -> &'static str;

    /// Maps a zero-filled region of `len` bytes aligned to at least [`BLOCK_ALIGN`]. When
    /// `prefault` is set, every page is resident on return, so that first writes take no fault.
    fn map(&self, len: usize, prefault: bool) -> Result<NonNull<u8>, String>;

    /// Releases a region.
    ///
    /// # Safety
    /// `ptr` and `len` come from one earlier call of `map` on this backend, the region was not
    /// released before, and nothing reads or writes it any more.
    unsafe fn unmap(&self, ptr: NonNull<u8>, len: usize);

    /// Allocates one block of `len` bytes aligned to [`BLOCK_ALIGN`] (contents unspecified).
    fn alloc_block(&self, len: usize) -> Result<NonNull<u8>, String> {
        let layout = Layout::from_size_align(len.max(1), BLOCK_ALIGN).map_err(|e| e.to_string())?;
        // SAFETY: the layout has a non-zero size.
        NonNull::new(unsafe { alloc::alloc(layout) }).ok_or_else(|| format!("the system allocator refused {len} bytes"))
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
    fn alloc_block_zeroed(&self, len: usize) -> Result<NonNull<u8>, String> {
        let p = self.alloc_block(len)?;
        // SAFETY: `p` is a fresh block of `len` bytes, owned by the caller.
        unsafe { self.zero(p, len) };
        Ok(p)
    }

    /// Makes the first `len` bytes of a region resident now (page-aligned, within a region
    /// mapped by `map` without pre-faulting), so that first writes there take no fault. The
    /// default does nothing: the pages fault in on first use.
    fn populate(&self, ptr: NonNull<u8>, len: usize) {
        let _ = (ptr, len);
    }

    /// Returns to the system what the block allocator keeps of freed blocks (the C heap's free
    /// memory): called when an arena takes over the blocks it served. The default keeps it.
    fn trim(&self) {}

    /// Whether [`Backend::discard`] leaves the pages reading as zero.
    fn discard_zeroes(&self) -> bool {
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

    /// Fills `len` bytes at `ptr` with zeros.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` lies in one live block or region of this backend, owned by the caller.
    unsafe fn zero(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: the caller guarantees the range is ours and host-accessible for host backends.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) }
    }

    /// Copies `len` bytes from `src` to `dst` (both this backend's memory, not overlapping).
    ///
    /// # Safety
    /// Both ranges lie in live blocks of this backend owned by the caller and do not overlap.
    unsafe fn copy(&self, dst: NonNull<u8>, src: NonNull<u8>, len: usize) {
        // SAFETY: as the caller guarantees.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_ptr(), len) }
    }

    /// Copies `len` bytes of this backend's memory at `src` into host memory at `dst`; `Err`
    /// describes a failed transfer.
    ///
    /// # Safety
    /// `[src, src + len)` lies in a live block of this backend owned by the caller, and `dst` is
    /// valid host memory for `len` bytes of writes, not overlapping it.
    unsafe fn copy_to_host(&self, dst: NonNull<u8>, src: NonNull<u8>, len: usize) -> Result<(), String> {
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
    unsafe fn copy_from_host(&self, dst: NonNull<u8>, src: NonNull<u8>, len: usize) -> Result<(), String> {
        // SAFETY: as the caller guarantees (a host-memory backend: both ranges are host memory).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_ptr(), len) };
        Ok(())
    }

    /// Tells the backend that `[ptr, ptr + len)` of a mapped region holds nothing of value; it
    /// may return the pages to the system (they read as zero, or their old contents, afterwards).
    /// `ptr` and `len` are page-aligned. The default keeps them.
    fn discard(&self, ptr: NonNull<u8>, len: usize) {
        let _ = (ptr, len);
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// Makes every page of a fresh mapping resident and writable. Only `EINVAL` (a kernel before
/// 5.14, which does not know `MADV_POPULATE_WRITE`) falls back to touching each page; any other
/// refusal (`ENOMEM` under a memory limit, `EFAULT` / `EIO` for a file without backing store) is
/// an error: touching would turn it into the OOM killer or a `SIGBUS`.
fn try_prefault(ptr: NonNull<u8>, len: usize) -> Result<(), String> {
    const MADV_POPULATE_WRITE: libc::c_int = 23;
    // SAFETY: [ptr, ptr+len) is one mapping we own; the advice only populates pages.
    let rc = unsafe { libc::madvise(ptr.as_ptr().cast(), len, MADV_POPULATE_WRITE) };
    if rc == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EINVAL) {
        return Err(format!("cannot make {len} bytes resident: {err}"));
    }
    // The mapping is zero-filled, so writing zero leaves its contents unchanged.
    let page = page_size();
    let mut off = 0;
    while off < len {
        // SAFETY: off < len, inside the mapping; volatile so the write is not elided.
        unsafe { std::ptr::write_volatile(ptr.as_ptr().add(off), 0) };
        off += page;
    }
    Ok(())
}

/// Prefaults where the system allows it; a refusal leaves the pages to fault in on first use.
fn prefault(ptr: NonNull<u8>, len: usize) {
    let _ = try_prefault(ptr, len);
}

fn mmap_checked(len: usize, prot: libc::c_int, flags: libc::c_int, fd: libc::c_int) -> Result<NonNull<u8>, String> {
    if len == 0 {
        return Err("cannot map 0 bytes".to_string());
    }
    // SAFETY: a fresh mapping at an address the kernel chooses; no existing memory is affected.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, 0) };
    if p == libc::MAP_FAILED {
        return Err(format!("mmap of {len} bytes failed: {}", std::io::Error::last_os_error()));
    }
    NonNull::new(p.cast()).ok_or_else(|| "mmap returned null".to_string())
}

/// Anonymous private memory from `mmap`, with huge-page advice for large regions.
#[derive(Debug, Default, Clone, Copy)]
pub struct AnonymousMemory;

impl Backend for AnonymousMemory {
    fn name(&self) -> &'static str {
        "anonymous"
    }

    fn map(&self, len: usize, prefault_now: bool) -> Result<NonNull<u8>, String> {
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

    fn discard(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: the caller passes page-aligned memory of one of our mappings that holds no live
        // data; for private anonymous memory the pages are dropped and read back as zeros.
        unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_DONTNEED) };
    }

    fn populate(&self, ptr: NonNull<u8>, len: usize) {
        prefault(ptr, len);
    }

    fn discard_zeroes(&self) -> bool {
        true
    }

    fn trim(&self) {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: a plain glibc call without preconditions.
        unsafe {
            libc::malloc_trim(0);
        }
    }

    /// Blocks come from the C heap, as NumPy's default allocator's do: small ones are recycled
    /// by it, large ones are mappings of its own whose size it learns (glibc raises its mapping
    /// threshold as they are freed), so a cycle served outside the arena costs what it costs
    /// without rustws.
    fn alloc_block(&self, len: usize) -> Result<NonNull<u8>, String> {
        c_heap_block(len, false)
    }

    /// `calloc` underneath: memory the C heap knows to be zero (a fresh mapping) is not written.
    fn alloc_block_zeroed(&self, len: usize) -> Result<NonNull<u8>, String> {
        c_heap_block(len, true)
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

/// A [`BLOCK_ALIGN`]-aligned block of `len` bytes from `malloc` (or `calloc`), with the distance
/// back to the allocation's start stored in the word in front of it.
fn c_heap_block(len: usize, zeroed: bool) -> Result<NonNull<u8>, String> {
    let total =
        len.checked_add(BLOCK_ALIGN + C_HEAP_TAG).ok_or_else(|| format!("a block of {len} bytes is too large"))?;
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
        return Err(format!("the system allocator refused {len} bytes"));
    }
    let start = raw as usize;
    let at = (start + C_HEAP_TAG).next_multiple_of(BLOCK_ALIGN);
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
        let page = page_size();
        let (a, b) = (at.next_multiple_of(page), (at + len) / page * page);
        if a < b {
            // SAFETY: advice on whole pages inside our own allocation; failure is harmless.
            unsafe { libc::madvise(a as *mut libc::c_void, b - a, libc::MADV_HUGEPAGE) };
        }
    }
    Ok(block)
}

/// Memory mapped from a file. Each region gets a file of its own, so regions never share pages:
/// a folder `path` gets a new file per region, unlinked at once (it disappears with its
/// mapping); a file `path` is used by one region at a time across every process (held with an
/// exclusive `flock`, truncated and kept afterwards), and further regions get unlinked files
/// beside it. A region's blocks are reserved on the file system when it is mapped
/// (`posix_fallocate`), so a full file system is an error then, never a `SIGBUS` later.
///
/// After `fork()` the child's copies of the regions are made private (anonymous memory holding the
/// same contents): a `MAP_SHARED` mapping would otherwise let the child and the parent carve,
/// write and free the same blocks.
#[derive(Debug)]
pub struct FileMappedMemory {
    path: PathBuf,
    /// Open files by mapping address, with the named path they hold, if any.
    files: std::sync::Mutex<Vec<(usize, File, Option<PathBuf>)>>,
}

static FILE_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Named files mapped right now by any `FileMappedMemory` of this process.
static NAMED_FILES_IN_USE: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Every file-backed region of this process, `(address, length)`, for the child side of `fork()`.
/// A spin lock rather than a mutex: `fork()` takes it in its prepare handler and both sides release
/// it, which a std mutex guard cannot express.
struct SharedRegions {
    busy: std::sync::atomic::AtomicBool,
    regions: std::cell::UnsafeCell<Vec<(usize, usize)>>,
}

// SAFETY: `regions` is only reached through `with`, under `busy`.
unsafe impl Sync for SharedRegions {}

static SHARED_REGIONS: SharedRegions =
    SharedRegions { busy: std::sync::atomic::AtomicBool::new(false), regions: std::cell::UnsafeCell::new(Vec::new()) };

impl SharedRegions {
    fn acquire(&self) {
        while self.busy.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            std::hint::spin_loop();
        }
    }

    fn release(&self) {
        self.busy.store(false, Ordering::Release);
    }

    fn with<R>(&self, f: impl FnOnce(&mut Vec<(usize, usize)>) -> R) -> R {
        self.acquire();
        // SAFETY: `busy` is held, so this is the only reference to the vector.
        let r = f(unsafe { &mut *self.regions.get() });
        self.release();
        r
    }
}

extern "C" fn before_fork() {
    SHARED_REGIONS.acquire();
}

extern "C" fn after_fork_in_parent() {
    SHARED_REGIONS.release();
}

extern "C" fn after_fork_in_child() {
    // SAFETY: `before_fork` acquired the lock in the thread that forked, the only thread of the
    // child; the vector is not reached otherwise until `release`.
    let regions = unsafe { &*SHARED_REGIONS.regions.get() };
    for &(addr, len) in regions {
        // SAFETY: each entry is a live mapping of ours (entries are removed before unmapping).
        unsafe { privatize(addr as *mut libc::c_void, len) };
    }
    SHARED_REGIONS.release();
}

/// Replaces the shared mapping `[addr, addr + len)` with private anonymous memory holding the same
/// contents. Where that is impossible (no memory for the copy), the region is made inaccessible:
/// a child that touches it faults instead of corrupting its parent.
///
/// # Safety
/// `[addr, addr + len)` is one whole mapping, and no other thread runs (the child of `fork()`).
unsafe fn privatize(addr: *mut libc::c_void, len: usize) {
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
        // SAFETY: the caller guarantees this is one of our mappings.
        unsafe { libc::mprotect(addr, len, libc::PROT_NONE) };
        return;
    }
    // SAFETY: both are live mappings of `len` bytes and do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, copy as *mut u8, len) };
    // SAFETY: moves the private copy over the shared mapping, which the kernel unmaps; same length.
    let moved = unsafe { libc::mremap(copy, len, len, libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED, addr) };
    if moved == libc::MAP_FAILED {
        // SAFETY: `copy` is ours and unused; `addr` is the caller's mapping.
        unsafe {
            libc::munmap(copy, len);
            libc::mprotect(addr, len, libc::PROT_NONE);
        }
    }
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

/// Whether `file` could be locked exclusively (`flock`); Err for failures other than "held".
fn try_lock(file: &File) -> Result<bool, String> {
    // SAFETY: a valid open descriptor; the lock lives with the open file description.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EWOULDBLOCK) => Ok(false),
        // A file system without locks: the process-wide list still protects this process.
        Some(libc::ENOLCK) | Some(libc::EOPNOTSUPP) => Ok(true),
        _ => Err(format!("cannot lock: {err}")),
    }
}

/// Reserves `len` bytes of `file` on its file system.
fn reserve(file: &File, len: usize, path: &std::path::Path) -> Result<(), String> {
    let len_off = libc::off_t::try_from(len).map_err(|_| format!("{len} bytes is too large a file"))?;
    // SAFETY: a valid open descriptor; the call only sizes and allocates the file.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len_off) };
    match rc {
        0 => Ok(()),
        // A file system that cannot reserve (and no emulation): a sparse file as before.
        libc::EOPNOTSUPP | libc::EINVAL => {
            file.set_len(len as u64).map_err(|e| format!("cannot size {} to {len} bytes: {e}", path.display()))
        }
        errno => Err(format!(
            "cannot reserve {len} bytes for {}: {}",
            path.display(),
            std::io::Error::from_raw_os_error(errno)
        )),
    }
}

impl FileMappedMemory {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        register_fork_handlers();
        FileMappedMemory { path: path.into(), files: std::sync::Mutex::new(Vec::new()) }
    }

    /// A new file in `dir`, unlinked once open.
    fn unnamed_in(dir: &std::path::Path, stem: &str) -> Result<File, String> {
        let name = format!("{stem}-{}-{}.mmap", std::process::id(), FILE_COUNTER.fetch_add(1, Ordering::Relaxed));
        let full = dir.join(name);
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&full)
            .map_err(|e| format!("cannot create {}: {e}", full.display()))?;
        let _ = std::fs::remove_file(&full);
        Ok(f)
    }

    /// The file for a new region, and the named path it holds (to release at unmap).
    fn open(&self) -> Result<(File, Option<PathBuf>), String> {
        if self.path.is_dir() {
            return Ok((Self::unnamed_in(&self.path, "rustws")?, None));
        }
        let parent = match self.path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let parent = std::fs::canonicalize(&parent).map_err(|e| format!("cannot use {}: {e}", parent.display()))?;
        let file_name = self.path.file_name().ok_or_else(|| format!("{} names no file", self.path.display()))?;
        let canonical = parent.join(file_name);
        let stem = file_name.to_string_lossy().into_owned();
        let mut in_use = NAMED_FILES_IN_USE.lock().unwrap_or_else(|e| e.into_inner());
        if in_use.contains(&canonical) {
            // Another region maps the named file: truncating or sharing it would clobber live
            // blocks, so this region gets a file of its own beside it.
            drop(in_use);
            return Ok((Self::unnamed_in(&parent, &stem)?, None));
        }
        // Not truncated before the lock is ours: another process may map it.
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&canonical)
            .map_err(|e| format!("cannot open {}: {e}", canonical.display()))?;
        if !try_lock(&f).map_err(|e| format!("{}: {e}", canonical.display()))? {
            // Another process maps the named file.
            drop(in_use);
            return Ok((Self::unnamed_in(&parent, &stem)?, None));
        }
        f.set_len(0).map_err(|e| format!("cannot truncate {}: {e}", canonical.display()))?;
        in_use.push(canonical.clone());
        Ok((f, Some(canonical)))
    }

    fn release_name(name: Option<PathBuf>) {
        if let Some(name) = name {
            let mut in_use = NAMED_FILES_IN_USE.lock().unwrap_or_else(|e| e.into_inner());
            in_use.retain(|p| *p != name);
        }
    }
}

impl Backend for FileMappedMemory {
    fn name(&self) -> &'static str {
        "mmap-file"
    }

    fn map(&self, len: usize, prefault_now: bool) -> Result<NonNull<u8>, String> {
        if len == 0 {
            return Err("cannot map 0 bytes".to_string());
        }
        let (file, name) = self.open()?;
        let shown = name.clone().unwrap_or_else(|| self.path.clone());
        let mapped = reserve(&file, len, &shown)
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
                if name.is_some() {
                    let _ = file.set_len(0);
                }
                Self::release_name(name);
                return Err(e);
            }
        };
        SHARED_REGIONS.with(|r| r.push((ptr.as_ptr() as usize, len)));
        self.files.lock().unwrap_or_else(|e| e.into_inner()).push((ptr.as_ptr() as usize, file, name));
        Ok(ptr)
    }

    /// # Safety
    /// As for [`Backend::unmap`].
    unsafe fn unmap(&self, ptr: NonNull<u8>, len: usize) {
        let addr = ptr.as_ptr() as usize;
        SHARED_REGIONS.with(|r| r.retain(|&(a, _)| a != addr));
        // SAFETY: the caller guarantees this is one whole mapping of ours, no longer used.
        unsafe { libc::munmap(ptr.as_ptr().cast(), len) };
        let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = files.iter().position(|(p, ..)| *p == addr) {
            let (_, _, name) = files.swap_remove(i);
            Self::release_name(name);
        }
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

    fn map(&self, len: usize, _prefault: bool) -> Result<NonNull<u8>, String> {
        let layout = Layout::from_size_align(len.max(1), 4096).map_err(|e| e.to_string())?;
        // SAFETY: non-zero size.
        NonNull::new(unsafe { alloc::alloc_zeroed(layout) }).ok_or_else(|| format!("the heap refused {len} bytes"))
    }

    /// # Safety
    /// As for [`Backend::unmap`].
    unsafe fn unmap(&self, ptr: NonNull<u8>, len: usize) {
        let layout = Layout::from_size_align(len.max(1), 4096).expect("layout was valid at map");
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

    fn map(&self, len: usize, prefault: bool) -> Result<NonNull<u8>, String> {
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

    fn alloc_block(&self, len: usize) -> Result<NonNull<u8>, String> {
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
        fn block_align(&self) -> usize {
            self.upstream.block_align()
        }

        /// # Safety
        /// As for [`Backend::zero`].
        unsafe fn zero(&self, ptr: NonNull<u8>, len: usize) {
            // SAFETY: forwarded with the caller's guarantee.
            unsafe { self.upstream.zero(ptr, len) }
        }

        /// # Safety
        /// As for [`Backend::copy`].
        unsafe fn copy(&self, dst: NonNull<u8>, src: NonNull<u8>, len: usize) {
            // SAFETY: forwarded with the caller's guarantee.
            unsafe { self.upstream.copy(dst, src, len) }
        }

        /// # Safety
        /// As for [`Backend::copy_to_host`].
        unsafe fn copy_to_host(&self, dst: NonNull<u8>, src: NonNull<u8>, len: usize) -> Result<(), String> {
            // SAFETY: forwarded with the caller's guarantee.
            unsafe { self.upstream.copy_to_host(dst, src, len) }
        }

        /// # Safety
        /// As for [`Backend::copy_from_host`].
        unsafe fn copy_from_host(&self, dst: NonNull<u8>, src: NonNull<u8>, len: usize) -> Result<(), String> {
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
}

impl LimitAdaptor {
    pub fn new(upstream: Arc<dyn Backend>, limit: usize) -> Self {
        LimitAdaptor { upstream, limit, held: AtomicUsize::new(0) }
    }

    /// Bytes currently held through this adaptor.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    fn reserve(&self, len: usize) -> Result<(), String> {
        let mut cur = self.held.load(Ordering::Relaxed);
        loop {
            let next = cur
                .checked_add(len)
                .filter(|n| *n <= self.limit)
                .ok_or_else(|| format!("limit of {} bytes reached ({} held, {} requested)", self.limit, cur, len))?;
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

    fn map(&self, len: usize, prefault_now: bool) -> Result<NonNull<u8>, String> {
        self.reserve(len)?;
        self.upstream.map(len, prefault_now).inspect_err(|_| {
            self.held.fetch_sub(len, Ordering::Relaxed);
        })
    }

    /// # Safety
    /// As for [`Backend::unmap`].
    unsafe fn unmap(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: forwarded with the caller's guarantee.
        unsafe { self.upstream.unmap(ptr, len) };
        self.held.fetch_sub(len, Ordering::Relaxed);
    }

    fn alloc_block(&self, len: usize) -> Result<NonNull<u8>, String> {
        self.reserve(len)?;
        self.upstream.alloc_block(len).inspect_err(|_| {
            self.held.fetch_sub(len, Ordering::Relaxed);
        })
    }

    /// # Safety
    /// As for [`Backend::free_block`].
    unsafe fn free_block(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: forwarded with the caller's guarantee.
        unsafe { self.upstream.free_block(ptr, len) };
        self.held.fetch_sub(len, Ordering::Relaxed);
    }

    fn host_accessible(&self) -> bool {
        self.upstream.host_accessible()
    }

    fn discard(&self, ptr: NonNull<u8>, len: usize) {
        self.upstream.discard(ptr, len);
    }

    fn discard_zeroes(&self) -> bool {
        self.upstream.discard_zeroes()
    }

    fn trim(&self) {
        self.upstream.trim();
    }

    fn populate(&self, ptr: NonNull<u8>, len: usize) {
        self.upstream.populate(ptr, len);
    }

    fn alloc_block_zeroed(&self, len: usize) -> Result<NonNull<u8>, String> {
        self.reserve(len)?;
        self.upstream.alloc_block_zeroed(len).inspect_err(|_| {
            self.held.fetch_sub(len, Ordering::Relaxed);
        })
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

    fn check(&self, what: &str, len: usize) -> Result<(), String> {
        let k = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        let hit = if self.every { k % self.nth == 0 } else { k == self.nth };
        if hit && self.armed.load(Ordering::Relaxed) {
            self.injected.fetch_add(1, Ordering::Relaxed);
            return Err(format!(
                "{what} of {len} bytes failed (injected at call {k}): {}",
                std::io::Error::from_raw_os_error(self.errno)
            ));
        }
        Ok(())
    }
}

impl Backend for FaultAdaptor {
    fn name(&self) -> &'static str {
        "fault-injection"
    }

    fn map(&self, len: usize, prefault_now: bool) -> Result<NonNull<u8>, String> {
        self.check("map", len)?;
        self.upstream.map(len, prefault_now)
    }

    /// # Safety
    /// As for [`Backend::unmap`].
    unsafe fn unmap(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: forwarded with the caller's guarantee.
        unsafe { self.upstream.unmap(ptr, len) }
    }

    fn alloc_block(&self, len: usize) -> Result<NonNull<u8>, String> {
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

    fn discard(&self, ptr: NonNull<u8>, len: usize) {
        self.upstream.discard(ptr, len);
    }

    forward_data_access!();
}

/// Rounds `n` up to a multiple of the system page size.
pub fn round_to_page(n: usize) -> usize {
    let p = page_size();
    n.div_ceil(p) * p
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
    #[cfg_attr(miri, ignore = "Miri maps no files")]
    fn regions_from_one_named_file_never_share_pages() {
        let named = std::env::temp_dir().join(format!("rustws-shared-{}.bin", std::process::id()));
        let (a, b) = (FileMappedMemory::new(&named), FileMappedMemory::new(&named));
        let len = round_to_page(1 << 16);
        let p = a.map(len, false).unwrap();
        let q = a.map(len, false).unwrap(); // a second region of the same backend
        let r = b.map(len, false).unwrap(); // a region of another workspace on the same path
                                            // SAFETY: three live mappings of `len` bytes each.
        unsafe {
            p.as_ptr().write_bytes(1, len);
            q.as_ptr().write_bytes(2, len);
            r.as_ptr().write_bytes(3, len);
            assert!(std::slice::from_raw_parts(p.as_ptr(), len).iter().all(|&x| x == 1));
            assert!(std::slice::from_raw_parts(q.as_ptr(), len).iter().all(|&x| x == 2));
            a.unmap(p, len);
            a.unmap(q, len);
            b.unmap(r, len);
        }
        // Released: the named file can be mapped again.
        let again = a.map(len, false).unwrap();
        // SAFETY: mapped above.
        unsafe { a.unmap(again, len) };
        assert_eq!(std::fs::metadata(&named).unwrap().len() as usize, len);
        let _ = std::fs::remove_file(named);
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri maps no files")]
    fn a_named_file_locked_by_another_process_is_left_alone() {
        let named = std::env::temp_dir().join(format!("rustws-locked-{}.bin", std::process::id()));
        std::fs::write(&named, b"held by another process").unwrap();
        // Another open file description holding the lock stands for another process.
        let other = OpenOptions::new().read(true).write(true).open(&named).unwrap();
        assert!(try_lock(&other).unwrap());
        let b = FileMappedMemory::new(&named);
        let len = round_to_page(1 << 16);
        let p = b.map(len, true).unwrap();
        // SAFETY: mapped above, `len` bytes.
        unsafe { p.as_ptr().write_bytes(9, len) };
        assert_eq!(std::fs::read(&named).unwrap(), b"held by another process");
        // SAFETY: mapped above.
        unsafe { b.unmap(p, len) };
        drop(other); // the lock goes with the last descriptor: the next region gets the file
        let q = b.map(len, false).unwrap();
        assert_eq!(std::fs::metadata(&named).unwrap().len() as usize, len);
        // SAFETY: mapped above.
        unsafe { b.unmap(q, len) };
        let _ = std::fs::remove_file(named);
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
        assert!(e.contains("No space left on device"), "{e}");
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
        assert!(lim.map(4096, false).unwrap_err().contains("limit of 8192"));
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
