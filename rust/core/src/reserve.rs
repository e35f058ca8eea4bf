//! A global allocator for programs that must outlive memory exhaustion: the system's, with a small
//! emergency reserve for the moment the system refuses. Rust ends the process when an allocation
//! fails; a library that runs where memory is exhausted by design (that is when a workspace must
//! say so) cannot let the few small allocations on the way to that error (an error's state, a
//! message, a panic's payload) end it. They are served from the reserve instead (1 MiB in the
//! binary's zero-initialised data: address space the process holds from its start), and the
//! reserve is refilled as they are freed. Larger requests, or a reserve in use up, still fail as
//! before. The Python extension installs it as its `#[global_allocator]`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Bytes of the reserve.
const RESERVE: usize = 1 << 20;
/// Chunks are powers of two from `1 << MIN_SHIFT` to `1 << MAX_SHIFT` bytes.
const MIN_SHIFT: usize = 4;
const MAX_SHIFT: usize = 14;
const CLASSES: usize = MAX_SHIFT - MIN_SHIFT + 1;

/// The reserve's memory, aligned for any chunk (each chunk is aligned to its size).
#[repr(C, align(16384))]
struct Memory(UnsafeCell<[u8; RESERVE]>);

/// The reserve's state: a bump offset and a free list per chunk size (through the chunks' first
/// words), behind a spin lock (the reserve serves only while the system refuses: never a hot path).
struct Reserve {
    memory: Memory,
    busy: AtomicBool,
    state: UnsafeCell<State>,
    /// Bytes of live chunks.
    live: AtomicUsize,
    /// Chunks ever served.
    served: AtomicUsize,
}

struct State {
    bump: usize,
    /// The first free chunk of each class (null: none).
    free: [*mut u8; CLASSES],
}

// SAFETY: `memory` and `state` are reached only under `busy` (and chunks by their single owner).
unsafe impl Sync for Reserve {}

static RESERVE_POOL: Reserve = Reserve {
    memory: Memory(UnsafeCell::new([0; RESERVE])),
    busy: AtomicBool::new(false),
    state: UnsafeCell::new(State { bump: 0, free: [std::ptr::null_mut(); CLASSES] }),
    live: AtomicUsize::new(0),
    served: AtomicUsize::new(0),
};

/// Chunks of the reserve served so far. A caller that makes objects that live on (a workspace)
/// compares it before and after: objects made while the system refused do not keep the reserve,
/// which is for the allocations on the way to an error.
pub fn served() -> usize {
    RESERVE_POOL.served.load(Ordering::Relaxed)
}

/// Bytes of the reserve's chunks in use now.
pub fn in_use() -> usize {
    RESERVE_POOL.live.load(Ordering::Relaxed)
}

impl Reserve {
    fn base(&self) -> *mut u8 {
        self.memory.0.get().cast()
    }

    fn contains(&self, p: *mut u8) -> bool {
        let base = self.base() as usize;
        (base..base + RESERVE).contains(&(p as usize))
    }

    /// The size class of a layout, if the reserve serves it.
    fn class(layout: Layout) -> Option<usize> {
        let size = layout.size().max(layout.align()).max(1 << MIN_SHIFT).checked_next_power_of_two()?;
        let shift = size.trailing_zeros() as usize;
        (shift <= MAX_SHIFT).then(|| shift - MIN_SHIFT)
    }

    fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        while self.busy.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            std::hint::spin_loop();
        }
        // SAFETY: `busy` is held: this is the only reference to the state.
        let r = f(unsafe { &mut *self.state.get() });
        self.busy.store(false, Ordering::Release);
        r
    }

    fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(class) = Self::class(layout) else { return std::ptr::null_mut() };
        let size = 1usize << (class + MIN_SHIFT);
        let base = self.base();
        let at = self.with(|s| {
            let head = s.free[class];
            if !head.is_null() {
                // SAFETY: a free chunk of this class: its first word links the next one.
                s.free[class] = unsafe { head.cast::<*mut u8>().read() };
                return head;
            }
            let off = s.bump.next_multiple_of(size);
            if off + size > RESERVE {
                return std::ptr::null_mut();
            }
            s.bump = off + size;
            base.wrapping_add(off)
        });
        if !at.is_null() {
            self.live.fetch_add(size, Ordering::Relaxed);
            self.served.fetch_add(1, Ordering::Relaxed);
        }
        at
    }

    /// # Safety
    /// `p` is a chunk of this reserve served for `layout`, given back once.
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        let class = Self::class(layout).expect("served by the reserve");
        self.live.fetch_sub(1 << (class + MIN_SHIFT), Ordering::Relaxed);
        self.with(|s| {
            // SAFETY: the chunk is ours again and at least a word long, aligned to its size.
            unsafe { p.cast::<*mut u8>().write(s.free[class]) };
            s.free[class] = p;
        });
    }
}

/// The global allocator of this extension (see the module docs).
pub struct ReserveAllocator;

// SAFETY: every block comes from `System` or from the reserve, and goes back to where it came
// from (the reserve's address range tells them apart); both honour the layout's size and
// alignment (reserve chunks are powers of two at least as large as both).
unsafe impl GlobalAlloc for ReserveAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc(layout) };
        if p.is_null() {
            RESERVE_POOL.alloc(layout)
        } else {
            p
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            return p;
        }
        let p = RESERVE_POOL.alloc(layout);
        if !p.is_null() {
            // SAFETY: a chunk of at least `layout.size()` bytes, ours.
            unsafe { p.write_bytes(0, layout.size()) };
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        if RESERVE_POOL.contains(p) {
            // SAFETY: a chunk of the reserve, served for this layout.
            unsafe { RESERVE_POOL.dealloc(p, layout) }
        } else {
            // SAFETY: a block of `System` with this layout.
            unsafe { System.dealloc(p, layout) }
        }
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !RESERVE_POOL.contains(p) {
            // SAFETY: a block of `System` with this layout; the caller's new size.
            let q = unsafe { System.realloc(p, layout, new_size) };
            if !q.is_null() {
                return q;
            }
        }
        // A chunk of the reserve, or a system block the system would not grow: moved.
        // SAFETY: the caller guarantees a non-zero size valid with the alignment.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        // SAFETY: a valid layout.
        let q = unsafe { self.alloc(new_layout) };
        if !q.is_null() {
            // SAFETY: both blocks are live and distinct; the smaller size is copied.
            unsafe {
                std::ptr::copy_nonoverlapping(p, q, layout.size().min(new_size));
                self.dealloc(p, layout);
            }
        }
        q
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_aligned_reused_and_given_back() {
        let l = Layout::from_size_align(100, 8).unwrap();
        let a = RESERVE_POOL.alloc(l);
        let b = RESERVE_POOL.alloc(Layout::from_size_align(4096, 4096).unwrap());
        assert!(!a.is_null() && !b.is_null() && a != b);
        assert_eq!(a as usize % 128, 0);
        assert_eq!(b as usize % 4096, 0);
        // SAFETY: chunks served just above.
        unsafe {
            RESERVE_POOL.dealloc(a, l);
            assert_eq!(RESERVE_POOL.alloc(l), a, "a freed chunk serves the next request of its size");
            RESERVE_POOL.dealloc(a, l);
            RESERVE_POOL.dealloc(b, Layout::from_size_align(4096, 4096).unwrap());
        }
        assert!(RESERVE_POOL.alloc(Layout::from_size_align(1 << 20, 8).unwrap()).is_null(), "too large");
    }
}
