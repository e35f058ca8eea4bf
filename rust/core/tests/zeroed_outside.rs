//! Large zeroed requests outside the arena take no room until written. A test binary of its
//! own: whether `calloc` hands out fresh pages depends on the C heap's process-wide state (its
//! mapping threshold rises as other tests free large blocks, and then a recycled chunk is
//! cleared by writing it).
#![cfg(not(miri))]

mod common;

use std::ptr::NonNull;
use std::sync::Arc;

use common::fill;
use rustws_core::*;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// Pages of `[p, p + len)` resident now (its whole pages only).
fn resident_pages(p: NonNull<u8>, len: usize) -> usize {
    let page = rustws_core::backend::page_bytes();
    let (a, b) = ((p.as_ptr() as usize).next_multiple_of(page), (p.as_ptr() as usize + len) / page * page);
    let mut vec = vec![0u8; (b - a) / page];
    // SAFETY: whole pages of a live allocation of ours; `vec` has one byte per page.
    let rc = unsafe { libc::mincore(a as *mut libc::c_void, b - a, vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore");
    vec.iter().filter(|v| **v & 1 == 1).count()
}

/// A large zeroed request outside the arena takes no room until written, as `np.zeros` of a
/// fresh `calloc` does: a new block is the C heap's `calloc` (with a file-backed arena too), and
/// a block the cache serves again has its whole pages dropped rather than written; both read as
/// zeros.
#[test]
fn large_zeroed_blocks_outside_the_arena_are_not_written() {
    let len = 40 * MIB; // above ZERO_BY_DISCARD, below the huge requests' mappings of their own
    let file: Arc<dyn Backend> = Arc::new(FileMappedMemory::new(std::env::temp_dir()));
    for (name, backend) in [("anonymous", Arc::new(AnonymousMemory) as Arc<dyn Backend>), ("mmap-file", file)] {
        let config = WorkspaceConfiguration {
            initial_size: 64 * KIB as u64,
            policy_learning: LearningPolicy::None,
            policy_spill: SpillPolicy::External,
            ..Default::default()
        };
        let mut w = Workspace::with_backend(name, config, backend).unwrap();
        // ThreadSanitizer's allocator writes the blocks it hands out: there, what is resident
        // says nothing of what rustws wrote, and only the contents are checked.
        let counted = !cfg!(rustws_tsan);
        w.enter().unwrap();
        let fresh = w.alloc_zeroed(len).unwrap();
        assert!(!counted || resident_pages(fresh, len) < 16, "{name}: a fresh zeroed block was written");
        fill(fresh.as_ptr(), len, 0xAB);
        // SAFETY: live, freed once.
        unsafe { w.free(fresh) };
        w.exit().unwrap();
        w.enter().unwrap();
        let again = w.alloc_zeroed(len).unwrap();
        assert_eq!(again, fresh, "{name}: the cached block serves again");
        assert!(!counted || resident_pages(again, len) < 16, "{name}: a reused zeroed block was written");
        // SAFETY: `len` bytes of a live block of ours.
        let bytes = unsafe { std::slice::from_raw_parts(again.as_ptr(), len) };
        assert!(bytes.iter().all(|b| *b == 0), "{name}: not zero");
        // SAFETY: live, freed once.
        unsafe { w.free(again) };
        w.exit().unwrap();
    }
}

/// A large zeroed request carved from arena memory that served before makes no more of it
/// resident: the pages resident then are written, the others go back to the system (they read
/// as zeros), so that `np.zeros` of a large array, sparsely written each cycle, stays as small as
/// NumPy's fresh pages. Every byte reads zero, the ones an earlier block wrote included.
#[test]
fn large_zeroed_blocks_from_used_arena_memory_stay_as_resident_as_they_were() {
    let len = 16 * MIB;
    let config = WorkspaceConfiguration {
        initial_size: 64 * MIB as u64,
        policy_learning: LearningPolicy::None,
        ..Default::default()
    };
    let mut w = Workspace::new("sparing", config).unwrap();
    let counted = !cfg!(rustws_tsan);
    let page = rustws_core::backend::page_bytes();
    w.enter().unwrap();
    let first = w.alloc_zeroed(len).unwrap();
    let start = first.as_ptr() as usize;
    // SAFETY: whole pages inside the live block, whose bytes this test owns: small pages, so
    // that khugepaged makes no more of them resident meanwhile.
    unsafe { libc::madvise(start.next_multiple_of(page) as *mut libc::c_void, len - page, libc::MADV_NOHUGEPAGE) };
    fill(first.as_ptr(), len, 0xAB);
    // Pages the block no longer holds, as the system takes them back: all but the first MiB
    // and the last (a pre-faulted arena starts with every page resident).
    let gone = (start + MIB).next_multiple_of(page);
    // SAFETY: whole pages inside the live block, whose bytes this test owns.
    assert_eq!(unsafe { libc::madvise(gone as *mut libc::c_void, len - 2 * MIB, libc::MADV_DONTNEED) }, 0);
    let before = resident_pages(first, len);
    assert!(!counted || before <= (2 * MIB + page) / page + 1, "only the ends are resident: {before} pages");
    // SAFETY: live, freed once.
    unsafe { w.free(first) };
    w.exit().unwrap();
    w.enter().unwrap();
    let again = w.alloc_zeroed(len).unwrap();
    assert_eq!(again, first, "the arena serves the same memory again");
    let after = resident_pages(again, len);
    assert!(!counted || after <= before, "zeroing made more resident: {before} -> {after} pages");
    // SAFETY: `len` bytes of a live block of ours.
    let bytes = unsafe { std::slice::from_raw_parts(again.as_ptr(), len) };
    assert!(bytes.iter().all(|b| *b == 0), "not zero");
    // SAFETY: live, freed once.
    unsafe { w.free(again) };
    w.exit().unwrap();
}
