//! Stream-ordered releases of device blocks: a block a consumer used on another stream goes back
//! to its workspace only once that stream's work submitted before the release has completed, and
//! the arena may then hand it out at once, to any stream.
//!
//! No stream handle is kept past the call that named it, since its owner may destroy the stream
//! meanwhile (CuPy's `with Stream():`): a stream declared while valid is classified then
//! ([`ReleaseOrder::follow`]). Streams the legacy default stream orders are followed by an event
//! recorded on the legacy stream at release; a non-blocking stream can only be waited for by
//! synchronising the device at release. A stream named at the release itself (PyTorch's
//! allocator free) gets its event recorded there and then ([`ReleaseOrder::release_on`]).
//!
//! The device is a [`StreamOrder`] (the CUDA backend, or a stand-in in tests); where the memory
//! goes back is the caller's `free` function. Whether the calling thread may block on the driver
//! is a question only the bindings can answer (a thread holding Python's GIL must not), so they
//! pass it in as a function.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::BackendError;

/// What stream ordering needs of a device.
pub trait StreamOrder: Send + Sync {
    type Event: Send;
    /// Records an event on `stream` (DLPack numbering: 1 the legacy default stream, 2 the
    /// per-thread default, else a live stream handle) that completes when the work submitted to
    /// it so far has.
    fn record_release(&self, stream: usize) -> Result<Self::Event, BackendError>;
    fn is_complete(&self, event: &Self::Event) -> bool;
    /// Blocks until `event` completes.
    fn wait(&self, event: &Self::Event);
    fn destroy_event(&self, event: Self::Event);
    /// Blocks until all work on the device has completed.
    fn synchronize(&self) -> Result<(), BackendError>;
    /// Hands releases queued for the driver to it (where the calling thread may block).
    fn reclaim(&self) {}
}

/// The consumers' streams a block's release waits for, as classified while each was valid.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReleaseOrder {
    /// A consumer used a stream the legacy default stream orders: an event recorded on the legacy
    /// stream at release follows its work.
    legacy: bool,
    /// A consumer used a non-blocking stream (or one whose flags could not be read): only a
    /// device synchronisation at release waits for its work.
    device_sync: bool,
    /// Streams named by the release itself, valid while it runs: an event is recorded on each.
    now: Vec<usize>,
}

impl ReleaseOrder {
    /// A consumer uses `stream` (valid now): the release follows it, through the legacy stream
    /// where the legacy stream orders it (`ordered_by_legacy`), else by a device synchronisation.
    pub fn follow(&mut self, stream: usize, ordered_by_legacy: bool) {
        if stream == 1 {
            // The legacy stream orders itself, and the workspace's own work: nothing to follow.
        } else if ordered_by_legacy {
            self.legacy = true;
        } else {
            self.device_sync = true;
        }
    }

    /// The release itself runs on `stream`, valid until it returns: an event is recorded on it.
    /// False when there is no room to note it (the caller then waits for the device).
    #[must_use]
    pub fn release_on(&mut self, stream: usize) -> bool {
        if self.now.try_reserve(1).is_err() {
            return false;
        }
        self.now.push(stream);
        true
    }
}

/// A block released on other streams, waiting for their events.
struct Pending<E> {
    block: NonNull<u8>,
    events: Vec<E>,
}

/// The stream-ordered releases of one device workspace.
pub struct PendingReleases<D: StreamOrder> {
    device: Arc<D>,
    /// Gives a block back to its workspace.
    free: Box<dyn Fn(NonNull<u8>) + Send + Sync>,
    /// Whether the calling thread may block on the driver (the bindings' question).
    may_block: fn() -> bool,
    list: Mutex<Vec<Pending<D::Event>>>,
    /// Whether `list` holds anything: read without its lock on every allocation.
    any: AtomicBool,
}

// SAFETY: the pending blocks are plain addresses of the workspace's memory, owned by this list
// until `free` takes them; the list is behind a lock.
unsafe impl<D: StreamOrder> Send for PendingReleases<D> {}
// SAFETY: as above; every access to the list takes its lock.
unsafe impl<D: StreamOrder> Sync for PendingReleases<D> {}

impl<D: StreamOrder> PendingReleases<D> {
    pub fn new(device: Arc<D>, free: Box<dyn Fn(NonNull<u8>) + Send + Sync>, may_block: fn() -> bool) -> Self {
        PendingReleases { device, free, may_block, list: Mutex::new(Vec::new()), any: AtomicBool::new(false) }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Pending<D::Event>>> {
        self.list.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether releases are waiting.
    pub fn any(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }

    /// Releases `block` after the work `order` describes: at once when nothing must be waited
    /// for (or the device was synchronised), else once its events complete ([`Self::settle`]).
    /// A stream whose work cannot be followed (no event, no room to list the block) is waited for
    /// by synchronising the device.
    pub fn release(&self, block: NonNull<u8>, order: ReleaseOrder) {
        // A failed synchronisation leaves nothing to wait for (the context is broken).
        let synced = order.device_sync && self.device.synchronize().is_ok();
        if !synced {
            let streams = order.now.iter().copied().chain(order.legacy.then_some(1));
            let mut events = Vec::new();
            let mut followed = events.try_reserve(order.now.len() + 1).is_ok();
            for s in streams {
                match self.device.record_release(s) {
                    Ok(e) if followed => events.push(e),
                    Ok(e) => self.device.destroy_event(e),
                    Err(_) => followed = false,
                }
            }
            if followed && !events.is_empty() {
                let mut list = self.lock();
                if list.try_reserve(1).is_ok() {
                    list.push(Pending { block, events });
                    self.any.store(true, Ordering::Release);
                    return;
                }
                drop(list);
                followed = false;
            }
            for e in events {
                self.device.destroy_event(e);
            }
            if !followed {
                // The streams' work cannot be followed: wait for the device.
                let _ = self.device.synchronize();
            }
        }
        (self.free)(block);
    }

    /// Gives back every block whose events have completed (all of them when `wait`).
    pub fn settle(&self, wait: bool) {
        if !self.any() {
            return;
        }
        let done: Vec<Pending<D::Event>> = {
            let mut list = self.lock();
            let mut done = Vec::new();
            let mut i = 0;
            while i < list.len() {
                let passed = list[i].events.iter().all(|e| {
                    if wait {
                        self.device.wait(e);
                    }
                    self.device.is_complete(e)
                });
                // Out of room for the list of those done, a block waits for the next settle.
                if passed && done.try_reserve(1).is_ok() {
                    done.push(list.swap_remove(i));
                } else {
                    i += 1;
                }
            }
            self.any.store(!list.is_empty(), Ordering::Release);
            done
        };
        for r in done {
            for e in r.events {
                self.device.destroy_event(e);
            }
            (self.free)(r.block);
        }
    }
}

impl<D: StreamOrder> Drop for PendingReleases<D> {
    /// The workspace's last memory owner is gone: every release waits for its streams now, and
    /// the driver gets what it queued where the thread may block.
    fn drop(&mut self) {
        self.any.store(true, Ordering::Release);
        self.settle(true);
        if (self.may_block)() {
            self.device.reclaim();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A device whose streams complete when told, recording what was asked of it.
    #[derive(Default)]
    struct Device {
        /// Events recorded so far; an event completes once `completed` passes its number.
        recorded: AtomicUsize,
        completed: AtomicUsize,
        destroyed: AtomicUsize,
        syncs: AtomicUsize,
        reclaims: AtomicUsize,
        refuse_events: AtomicBool,
        streams: Mutex<Vec<usize>>,
    }

    impl StreamOrder for Device {
        type Event = usize;
        fn record_release(&self, stream: usize) -> Result<usize, BackendError> {
            if self.refuse_events.load(Ordering::Relaxed) {
                return Err(BackendError::refused("record an event", 0, "refused"));
            }
            self.streams.lock().unwrap().push(stream);
            Ok(self.recorded.fetch_add(1, Ordering::Relaxed) + 1)
        }
        fn is_complete(&self, e: &usize) -> bool {
            self.completed.load(Ordering::Relaxed) >= *e
        }
        fn wait(&self, e: &usize) {
            self.completed.fetch_max(*e, Ordering::Relaxed);
        }
        fn destroy_event(&self, _: usize) {
            self.destroyed.fetch_add(1, Ordering::Relaxed);
        }
        fn synchronize(&self) -> Result<(), BackendError> {
            self.syncs.fetch_add(1, Ordering::Relaxed);
            self.completed.store(usize::MAX, Ordering::Relaxed);
            Ok(())
        }
        fn reclaim(&self) {
            self.reclaims.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn setup(may_block: fn() -> bool) -> (Arc<Device>, Arc<Mutex<Vec<usize>>>, PendingReleases<Device>) {
        let device = Arc::new(Device::default());
        let freed = Arc::new(Mutex::new(Vec::new()));
        let sink = freed.clone();
        let free = Box::new(move |p: NonNull<u8>| sink.lock().unwrap().push(p.as_ptr() as usize));
        (device.clone(), freed, PendingReleases::new(device, free, may_block))
    }

    fn block(n: usize) -> NonNull<u8> {
        NonNull::new((n * 256) as *mut u8).unwrap()
    }

    #[test]
    fn a_block_used_on_no_other_stream_goes_back_at_once() {
        let (device, freed, pending) = setup(|| true);
        let mut order = ReleaseOrder::default();
        order.follow(1, true); // the legacy stream orders itself
        pending.release(block(1), order);
        assert_eq!(*freed.lock().unwrap(), [256]);
        assert!(!pending.any());
        assert_eq!(device.recorded.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_block_waits_for_the_streams_that_used_it() {
        let (device, freed, pending) = setup(|| true);
        let mut order = ReleaseOrder::default();
        order.follow(0x1000, true);
        assert!(order.release_on(0x2000));
        pending.release(block(1), order);
        assert!(pending.any() && freed.lock().unwrap().is_empty(), "its streams' work is pending");
        assert_eq!(*device.streams.lock().unwrap(), [0x2000, 1], "the named stream, then the legacy stream");
        pending.settle(false);
        assert!(freed.lock().unwrap().is_empty());
        device.completed.store(1, Ordering::Relaxed);
        pending.settle(false);
        assert!(freed.lock().unwrap().is_empty(), "one of two events completed");
        device.completed.store(2, Ordering::Relaxed);
        pending.settle(false);
        assert_eq!(*freed.lock().unwrap(), [256]);
        assert_eq!(device.destroyed.load(Ordering::Relaxed), 2);
        assert!(!pending.any());
    }

    #[test]
    fn a_non_blocking_stream_or_a_refused_event_waits_for_the_device() {
        let (device, freed, pending) = setup(|| true);
        let mut order = ReleaseOrder::default();
        order.follow(0x1000, false);
        pending.release(block(1), order);
        assert_eq!((device.syncs.load(Ordering::Relaxed), freed.lock().unwrap().len()), (1, 1));
        device.refuse_events.store(true, Ordering::Relaxed);
        let mut order = ReleaseOrder::default();
        order.follow(0x1000, true);
        pending.release(block(2), order);
        assert_eq!((device.syncs.load(Ordering::Relaxed), freed.lock().unwrap().len()), (2, 2));
        assert!(!pending.any());
    }

    #[test]
    fn waiting_settles_everything_and_dropping_waits_then_reclaims_where_it_may_block() {
        for may_block in [true, false] {
            let (device, freed, pending) = setup(if may_block { || true } else { || false });
            for n in 1..=3 {
                let mut order = ReleaseOrder::default();
                order.follow(0x1000, true);
                pending.release(block(n), order);
            }
            pending.settle(true);
            assert_eq!(freed.lock().unwrap().len(), 3);
            let mut order = ReleaseOrder::default();
            order.follow(0x1000, true);
            device.completed.store(0, Ordering::Relaxed);
            pending.release(block(4), order);
            drop(pending);
            assert_eq!(freed.lock().unwrap().len(), 4, "dropped: every release waited for");
            assert_eq!(device.reclaims.load(Ordering::Relaxed), usize::from(may_block));
        }
    }
}
