//! [`SpinLock`]: the lock around a workspace shared by the bindings' entry points.
//!
//! Every captured allocation and free takes a workspace's lock once, and almost never finds it
//! taken (each thread or task mostly has a workspace of its own). What such a lock costs is then
//! its read-modify-write instructions: a futex mutex takes one to lock and one more to unlock
//! (the unlock must see whether anyone sleeps), about 13 ns together on the machines this
//! project measures on, as much as the allocation it guards. This lock takes one: it locks with a
//! compare-and-swap and unlocks with a plain release store. Nobody sleeps on it to be woken, so
//! a thread that finds it taken spins briefly, then yields, then sleeps in growing steps (up to a
//! quarter of a millisecond) until it is free: a holder that maps or pre-faults memory for
//! milliseconds costs waiters no CPU worth counting, and one that holds it for nanoseconds costs
//! them a few spins. It is not fair: contention is rare by design (a workspace per thread or task),
//! and under the GIL only code that released it can hold the lock at the same time.
//!
//! Nothing is poisoned: a panic while it is held releases it (the guard's `Drop`), as the
//! workspace's counters are updated only after the operations they count succeed.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A mutual-exclusion lock with a one-instruction unlock; see the module docs.
pub struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the value is reached only through a guard, and at most one guard exists at a time
// (`lock` sets `locked` with a compare-and-swap; the guard's drop clears it): the lock hands a
// `T` from thread to thread, which needs `T: Send`, and never shares one `&T` between threads.
unsafe impl<T: Send> Send for SpinLock<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SpinLock<T> {}

/// Exclusive access to a [`SpinLock`]'s value; unlocks when dropped.
pub struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
}

// SAFETY: a shared guard gives out `&T` only, so sharing it between threads needs `T: Sync`, as
// for `std::sync::MutexGuard` (without this, the guard would be `Sync` whenever `T: Send`, from
// its `&SpinLock<T>`).
unsafe impl<T: Sync> Sync for SpinGuard<'_, T> {}

impl<T> SpinLock<T> {
    pub const fn new(value: T) -> Self {
        SpinLock { locked: AtomicBool::new(false), value: UnsafeCell::new(value) }
    }

    /// Locks, waiting while another thread holds it.
    #[inline]
    pub fn lock(&self) -> SpinGuard<'_, T> {
        if self.locked.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            self.wait();
        }
        SpinGuard { lock: self }
    }

    /// Locks when free now; `None` when another thread holds it.
    pub fn try_lock(&self) -> Option<SpinGuard<'_, T>> {
        self.locked
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
            .then_some(SpinGuard { lock: self })
    }

    /// Waits until it can lock: spins (reading only, so that waiters do not fight over the cache
    /// line), then yields, then sleeps from 32 µs up to 256 µs at a time (a waiter may hold the
    /// GIL: it is never late by much more than that).
    #[cold]
    fn wait(&self) {
        let mut rounds = 0u32;
        loop {
            while self.locked.load(Ordering::Relaxed) {
                rounds = rounds.saturating_add(1);
                if rounds <= 64 {
                    std::hint::spin_loop();
                } else if rounds <= 128 {
                    std::thread::yield_now();
                } else {
                    let step = (rounds - 128).min(4);
                    std::thread::sleep(Duration::from_micros(16 << step));
                }
            }
            if self.locked.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                return;
            }
        }
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for SpinLock<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.try_lock() {
            Some(g) => f.debug_struct("SpinLock").field("value", &*g).finish(),
            None => f.write_str("SpinLock { <locked> }"),
        }
    }
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this guard holds the lock, so no other reference to the value exists.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this guard holds the lock, and `&mut self` makes this the only reference.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.lock.locked.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn excludes_other_threads() {
        // Increments that are not atomic: any two guards at once would lose some.
        let threads = 4;
        let per_thread = if cfg!(miri) { 50 } else { 20_000 };
        let lock = Arc::new(SpinLock::new((0u64, 0u64)));
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let lock = lock.clone();
                std::thread::spawn(move || {
                    for _ in 0..per_thread {
                        let mut g = lock.lock();
                        let v = g.0;
                        std::hint::black_box(&mut g.1);
                        g.0 = v + 1;
                        g.1 += 2;
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let total = threads * per_thread;
        assert_eq!(*lock.lock(), (total, 2 * total));
    }

    #[test]
    fn a_waiter_gets_the_lock_after_a_long_hold() {
        let lock = Arc::new(SpinLock::new(0u32));
        let g = lock.lock();
        let waiter = {
            let lock = lock.clone();
            std::thread::spawn(move || *lock.lock() + 1)
        };
        std::thread::sleep(Duration::from_millis(if cfg!(miri) { 1 } else { 20 }));
        assert!(lock.try_lock().is_none(), "held: no second guard");
        drop(g);
        assert_eq!(waiter.join().unwrap(), 1);
        assert!(lock.try_lock().is_some(), "free again once the waiter's guard dropped");
    }

    #[test]
    fn a_panic_while_held_releases_it() {
        let lock = Arc::new(SpinLock::new(7u8));
        let l = lock.clone();
        let r = std::thread::spawn(move || {
            let _g = l.lock();
            panic!("inside");
        })
        .join();
        assert!(r.is_err());
        assert_eq!(*lock.lock(), 7);
        assert_eq!(format!("{:?}", lock), "SpinLock { value: 7 }");
    }
}
