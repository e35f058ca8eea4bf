//! Residency: what the arena keeps resident. In a binary of its own, so that no other test's
//! memory moves the process's resident size while it is measured. Not built for the sanitizers
//! (`scripts/sanitizers.sh`): their shadow memory and allocators' caches are part of the resident
//! size, and their allocators take no `mallopt`.
#![cfg(not(any(rustws_asan, rustws_tsan)))]

mod common;

use common::{fill, intact};
use rustws_core::*;

fn cfg() -> WorkspaceConfiguration {
    WorkspaceConfiguration::default()
}

/// Held by each test while it runs: the tests of one binary run on parallel threads, and one
/// test's memory would move the resident size another measures.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn alone() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// Resident bytes of this process, from /proc (Linux).
fn resident_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

const MIB: usize = 1 << 20;

#[test]
fn a_retired_region_keeps_only_pages_under_live_blocks() {
    let _alone = alone();
    // REALLOCATE growth retires the old arena; one small pinned block must not keep it resident.
    let c = WorkspaceConfiguration {
        initial_size: 32 * MIB as u64,
        policy_learning: LearningPolicy::None,
        policy_spill: SpillPolicy::Reallocate,
        ..cfg()
    };
    let mut w = Workspace::new("RET", c).unwrap();
    w.enter().unwrap();
    let pinned = w.alloc(100).unwrap();
    fill(pinned.as_ptr(), 100, 4);
    let used = w.alloc(30 * MIB).unwrap();
    // SAFETY: a live block of 30 MiB: every page of it becomes resident.
    unsafe { used.as_ptr().write_bytes(1, 30 * MIB) };
    // SAFETY: live, freed once.
    unsafe { w.free(used) };
    w.exit().unwrap();
    // The C heap's free memory (other tests' blocks) goes back now, not when the growth below
    // returns it ahead of the workspace's first large block outside the arena.
    // SAFETY: a plain glibc call without preconditions.
    unsafe { libc::malloc_trim(0) };
    let before = resident_bytes();
    w.enter().unwrap();
    let big = w.alloc(50 * MIB).unwrap(); // spills; the arena grows at the cycle end
                                          // SAFETY: live, freed once.
    unsafe { w.free(big) };
    w.exit().unwrap();
    w.enter().unwrap(); // the next cycle pre-faults what the grown arena learned
    let after = resident_bytes();
    w.exit().unwrap();
    let s = w.stats();
    assert!(s.capacity_bytes as usize > (41 + 50) * MIB, "old and new regions are both mapped: {s:?}");
    // The new arena pre-faults the ~50 MiB the cycle needed (+50), and the old one gave back
    // its 30 MiB of touched pages but the one under the pinned block (-30): about +20 in all,
    // where keeping the old pages would make it +50.
    let grown = after as isize - before as isize;
    assert!(grown < 30 * MIB as isize, "retired region still resident: grew by {} MiB", grown >> 20);
    assert!(grown > 10 * MIB as isize, "the learned part of the new arena is pre-faulted: {} MiB", grown >> 20);
    assert!(intact(pinned.as_ptr(), 100, 4));
    // SAFETY: live, freed once.
    unsafe { w.free(pinned) };
    assert!(w.stats().capacity_bytes < s.capacity_bytes, "the retired region goes with its last block");
}

#[test]
fn a_destroyed_file_backed_workspace_keeps_only_pages_under_live_blocks() {
    let _alone = alone();
    // A memory-mapped arena whose pages were all written, destroyed while one small result lives:
    // its region stays mapped for that block, and gives the rest back (file pages too), as an
    // anonymous one does.
    for location in [LocationPolicy::Ram, LocationPolicy::Mmap] {
        let dir = std::env::temp_dir();
        let c = WorkspaceConfiguration {
            initial_size: 32 * MIB as u64,
            policy_learning: LearningPolicy::None,
            policy_location: location,
            temp_file_path: (location == LocationPolicy::Mmap).then(|| dir.clone()),
            ..cfg()
        };
        // SAFETY: a plain glibc call without preconditions.
        unsafe { libc::malloc_trim(0) };
        let before = resident_bytes();
        let mut w = Workspace::new("FILE", c).unwrap();
        w.enter().unwrap();
        let used = w.alloc(30 * MIB).unwrap();
        // SAFETY: a live block of 30 MiB: every page of it becomes resident.
        unsafe { used.as_ptr().write_bytes(1, 30 * MIB) };
        let kept = w.alloc(100).unwrap();
        fill(kept.as_ptr(), 100, 9);
        // SAFETY: live, freed once.
        unsafe { w.free(used) };
        w.exit().unwrap();
        w.destroy();
        let grown = resident_bytes() as isize - before as isize;
        // Kept, the region's 30 MiB would stay.
        assert!(grown < 8 * MIB as isize, "{location}: {} MiB resident for a 100-byte block", grown >> 20);
        assert!(intact(kept.as_ptr(), 100, 9), "{location}: the kept block changed");
        // SAFETY: live, freed once.
        unsafe { w.free(kept) };
    }
}

#[test]
fn a_huge_zeroed_request_is_not_written_and_does_not_grow_the_arena() {
    let _alone = alone();
    let mut w = Workspace::new("HUGE", WorkspaceConfiguration::adaptive()).unwrap();
    for _ in 0..3 {
        w.enter().unwrap();
        let small = w.alloc(MIB).unwrap();
        // SAFETY: live, freed once below.
        unsafe { w.free(small) };
        w.exit().unwrap();
    }
    let cap = w.stats().capacity_bytes;
    let before = resident_bytes();
    for _ in 0..3 {
        w.enter().unwrap();
        let z = w.alloc_zeroed(1 << 30).unwrap();
        // SAFETY: a live zeroed block of 1 GiB: it reads as zero; one page is written.
        unsafe {
            assert_eq!(*z.as_ptr().add((1 << 30) - 1), 0);
            *z.as_ptr().add(12345) = 7;
            w.free(z);
        }
        w.exit().unwrap();
    }
    let grown = resident_bytes() as isize - before as isize;
    assert!(grown < 16 * MIB as isize, "a zeroed 1 GiB request made {} MiB resident", grown >> 20);
    assert_eq!(w.stats().capacity_bytes, cap, "a huge request does not resize the arena");
    assert!(w.learned_need() < 4 * MIB, "huge blocks are not part of the learned need");
}

#[test]
fn a_destroyed_workspace_returns_pages_as_its_blocks_die() {
    let _alone = alone();
    let mut w = Workspace::new("GONE", WorkspaceConfiguration::adaptive()).unwrap();
    let mut blocks = Vec::new();
    for _ in 0..2 {
        w.enter().unwrap();
        for b in blocks.drain(..) {
            // SAFETY: live blocks of the previous cycle, freed once.
            unsafe { w.free(b) };
        }
        for _ in 0..64 {
            let b = w.alloc(MIB).unwrap();
            // SAFETY: a live block of 1 MiB.
            unsafe { b.as_ptr().write_bytes(3, MIB) };
            blocks.push(b);
        }
        w.exit().unwrap();
    }
    let keep = blocks.pop().unwrap();
    w.destroy();
    let before = resident_bytes();
    for b in blocks.drain(..) {
        // SAFETY: live blocks, freed once, after the workspace was destroyed.
        unsafe { w.free(b) };
    }
    let shrunk = before as isize - resident_bytes() as isize;
    assert!(shrunk > 48 * MIB as isize, "freed blocks of a destroyed workspace stayed resident: {} MiB", shrunk >> 20);
    // SAFETY: live, freed once.
    unsafe { w.free(keep) };
}

/// The flags (`VmFlags` of `/proc/self/smaps`) of each mapping that overlaps `[addr, addr + len)`.
fn vm_flags(addr: usize, len: usize) -> Vec<String> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut out = Vec::new();
    let mut overlaps = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-').filter(|(a, _)| !a.is_empty() && !a.ends_with(':')) {
            if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                overlaps = a < addr + len && addr < b;
                continue;
            }
        }
        if overlaps && first == "VmFlags:" {
            out.push(line.to_string());
        }
    }
    out
}

/// The current arena region: its address and its length as mapped.
fn region(w: &Workspace) -> (usize, usize) {
    let segments = w.segments().unwrap();
    let r = segments.iter().find(|s| s.kind == history::SegmentKind::Region).expect("an arena region");
    (r.address, r.size)
}

/// `count` new blocks of `size` bytes, each written whole (resident).
fn written(w: &mut Workspace, count: usize, size: usize) -> Vec<std::ptr::NonNull<u8>> {
    let blocks: Vec<_> = (0..count).map(|_| w.alloc(size).unwrap()).collect();
    for &b in &blocks {
        // SAFETY: a live block of `size` bytes.
        unsafe { b.as_ptr().write_bytes(5, size) };
    }
    blocks
}

/// While it lives, the C heap keeps what is freed (no trim, no mappings of its own), as it does
/// for blocks under its thresholds; its default values come back as it drops (fixed from then on,
/// where glibc's would move with the frees it sees).
struct CHeapKeepsFreed;

impl CHeapKeepsFreed {
    fn new() -> Self {
        // SAFETY: plain glibc calls without preconditions.
        unsafe {
            assert_eq!(libc::mallopt(libc::M_MMAP_THRESHOLD, 16 << 20), 1);
            assert_eq!(libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30), 1);
        }
        CHeapKeepsFreed
    }
}

impl Drop for CHeapKeepsFreed {
    fn drop(&mut self) {
        // SAFETY: as above.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 128 << 10);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 128 << 10);
        }
    }
}

/// Two tasks in turn: the first opens a cycle, makes `count` temporaries of `size` bytes
/// (written whole), frees them and closes its cycle while the second's cycle stays open.
fn one_step_beside_another(w: &mut Workspace, count: usize, size: usize) {
    w.open_cycle().unwrap();
    let blocks = written(w, count, size);
    for b in blocks {
        // SAFETY: live, freed once.
        unsafe { w.free(b) };
    }
    w.close_cycle().unwrap();
}

#[test]
fn a_region_with_room_to_grow_takes_huge_pages_only_where_it_serves_4_mib_or_more() {
    let _alone = alone();
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    if thp.is_empty() || thp.contains("[never]") {
        eprintln!("skipped: this kernel gives no transparent huge pages, so no advice shows");
        return;
    }
    let mut w = Workspace::new("ROOM", WorkspaceConfiguration::adaptive()).unwrap();
    // Cycles that overlap for good (asyncio tasks in turn): the arena maps room to grow.
    w.open_cycle().unwrap();
    one_step_beside_another(&mut w, 12, 256 << 10);
    let (at, mapped) = region(&w);
    let capacity = w.stats().capacity_bytes as usize;
    assert!(capacity < 4 * MIB && mapped >= 4 * MIB, "a region under 4 MiB with room past it: {capacity} of {mapped}");
    // A region that serves under 4 MiB takes no huge page (a 2 MiB page straddling its end would
    // make resident what no block uses), in what it serves and in its room alike.
    let flags = vm_flags(at, mapped);
    assert!(!flags.is_empty() && flags.iter().all(|f| !f.contains(" hg")), "huge-page advice under 4 MiB: {flags:?}");
    // Grown where it lies past 4 MiB: huge pages for what it serves, none for its room.
    one_step_beside_another(&mut w, 20, 256 << 10);
    let grown = w.stats().capacity_bytes as usize;
    assert_eq!(region(&w), (at, mapped), "grown where it lies");
    assert!(grown >= 4 * MIB && grown < mapped, "grown past 4 MiB within its room: {grown} of {mapped}");
    assert!(vm_flags(at, grown).iter().all(|f| f.contains(" hg")), "{:?}", vm_flags(at, grown));
    let room = vm_flags(at + grown, mapped - grown);
    assert!(room.iter().all(|f| !f.contains(" hg")), "huge-page advice in the room to grow: {room:?}");
    w.close_cycle().unwrap();
}

#[test]
fn blocks_the_arena_supersedes_give_their_pages_back_as_they_are_freed() {
    let _alone = alone();
    let kept = CHeapKeepsFreed::new();
    let mut w = Workspace::new("SUPERSEDED", WorkspaceConfiguration::adaptive()).unwrap();
    // Two tasks' first cycles, each holding temporaries, outside any arena yet.
    w.open_cycle().unwrap();
    w.open_cycle().unwrap();
    let held = written(&mut w, 32, 256 << 10);
    // One closes beside the other: the arena, sized now, serves these sizes from here on.
    w.close_cycle().unwrap();
    assert!(w.stats().capacity_bytes >= 8 * MIB as u64, "{:?}", w.stats());
    let before = resident_bytes();
    for b in held {
        // SAFETY: live, freed once.
        unsafe { w.free(b) };
    }
    let given = before as isize - resident_bytes() as isize;
    w.close_cycle().unwrap();
    drop(kept);
    assert_eq!(w.external_cached_bytes(), 0, "blocks the arena supersedes are not cached");
    assert!(given >= 6 * MIB as isize, "8 MiB of superseded blocks gave back {} MiB", given >> 20);
}

#[test]
fn a_first_cycles_cached_blocks_give_their_pages_back_as_the_arena_takes_over() {
    let _alone = alone();
    // The C heap keeps what is freed, as in the test above; and the process's return of the C
    // heap's free memory (at most once a second) has just run, as it may have for another
    // workspace a moment before: the arena's takeover cannot count on it.
    let kept = CHeapKeepsFreed::new();
    AnonymousMemory.trim();
    let mut w = Workspace::new("TAKEOVER", WorkspaceConfiguration::adaptive()).unwrap();
    w.enter().unwrap();
    let blocks = written(&mut w, 32, 256 << 10);
    for b in blocks {
        // SAFETY: live, freed once: cached for the cycle's next requests of its class.
        unsafe { w.free(b) };
    }
    assert!(w.external_cached_bytes() >= 8 * MIB, "the first cycle caches its blocks");
    let before = resident_bytes();
    w.exit().unwrap(); // the arena is mapped (pre-faulted as the next cycle opens)
    let given = before as isize - resident_bytes() as isize;
    drop(kept);
    assert!(w.stats().capacity_bytes >= 8 * MIB as u64 && w.external_cached_bytes() == 0, "{:?}", w.stats());
    assert!(given >= 6 * MIB as isize, "8 MiB of cached blocks gave back {} MiB", given >> 20);
}
