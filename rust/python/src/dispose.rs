//! Dispose scopes' bookkeeping, per thread: the counters behind `dispose_statistics()` (arrays
//! created, disposed, attached, detached and live, in and outside scopes) and the chain of open
//! dispose scopes that new `DeviceArray`s join. An array names the thread that created it; its
//! disposal or death counts there, on whatever thread it happens.

use std::cell::RefCell;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use pyo3::prelude::*;

/// The dispose counters of one thread (shared with the arrays it created, which count their
/// disposal there whatever thread disposes them).
#[derive(Default)]
pub(crate) struct DisposeCounters {
    created_in_scope: AtomicI64,
    created_outside_scope: AtomicI64,
    disposed_in_scope: AtomicI64,
    disposed_outside_scope: AtomicI64,
    attached: AtomicI64,
    detached: AtomicI64,
    live: AtomicI64,
}

/// Adds `by` to a counter. Every update happens with the GIL held (array creation, `dispose`,
/// deallocation, the statistics' setters), which orders them: a plain load and store do, without
/// the cost of a locked read-modify-write on every array.
fn bump(counter: &AtomicI64, by: i64) {
    counter.store(counter.load(Ordering::Relaxed) + by, Ordering::Relaxed);
}

struct DisposeThread {
    /// Names the thread in [`THREADS`] and in the arrays it creates.
    id: u64,
    counters: Arc<DisposeCounters>,
    /// Open dispose scopes, innermost last.
    chain: Vec<Py<PyAny>>,
}

/// Every live thread's counters, for arrays that die on a thread other than their creator's
/// (rare: an array only names its creator, so the common path takes no reference count).
static THREADS: Mutex<Vec<(u64, Weak<DisposeCounters>)>> = Mutex::new(Vec::new());
static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);

impl DisposeThread {
    fn new() -> Self {
        let id = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
        let counters = Arc::new(DisposeCounters::default());
        let mut threads = THREADS.lock().unwrap_or_else(|e| e.into_inner());
        threads.retain(|(_, w)| w.strong_count() > 0);
        threads.push((id, Arc::downgrade(&counters)));
        DisposeThread { id, counters, chain: Vec::new() }
    }
}

thread_local! {
    static DISPOSE: RefCell<DisposeThread> = RefCell::new(DisposeThread::new());
}

/// This thread's id and innermost scope.
pub(crate) fn state(py: Python<'_>) -> (u64, Option<Py<PyAny>>) {
    DISPOSE
        .try_with(|d| {
            let d = d.borrow();
            (d.id, d.chain.last().map(|s| s.clone_ref(py)))
        })
        .unwrap_or((0, None))
}

/// Runs `f` on the counters of thread `id` (nothing when that thread has ended).
fn with_counters(id: u64, f: impl FnOnce(&DisposeCounters)) {
    let mut f = Some(f);
    let mine = DISPOSE.try_with(|d| {
        let d = d.borrow();
        if d.id == id {
            if let Some(f) = f.take() {
                f(&d.counters);
            }
        }
    });
    let Some(f) = f else { return };
    if mine.is_err() || id == 0 {
        return;
    }
    let other =
        THREADS.lock().unwrap_or_else(|e| e.into_inner()).iter().find(|(t, _)| *t == id).and_then(|(_, w)| w.upgrade());
    if let Some(c) = other {
        f(&c);
    }
}

/// Runs `f` on this thread's counters, without taking a reference count.
fn with_my_counters(f: impl FnOnce(&DisposeCounters)) {
    let _ = DISPOSE.try_with(|d| f(&d.borrow().counters));
}

/// Counters of dispose scopes for one thread: arrays created in and outside scopes, disposed in
/// and outside scopes, attached to and detached from scopes, and live (created, not yet disposed
/// or freed). A live view: it keeps counting.
#[pyclass(module = "rustws._rustws")]
pub(crate) struct DisposeStatistics {
    counters: Arc<DisposeCounters>,
}

#[pymethods]
impl DisposeStatistics {
    #[getter]
    fn created_in_scope(&self) -> i64 {
        self.counters.created_in_scope.load(Ordering::Relaxed)
    }

    #[setter]
    fn set_created_in_scope(&self, value: i64) {
        self.counters.created_in_scope.store(value, Ordering::Relaxed)
    }

    #[getter]
    fn created_outside_scope(&self) -> i64 {
        self.counters.created_outside_scope.load(Ordering::Relaxed)
    }

    #[setter]
    fn set_created_outside_scope(&self, value: i64) {
        self.counters.created_outside_scope.store(value, Ordering::Relaxed)
    }

    #[getter]
    fn disposed_in_scope(&self) -> i64 {
        self.counters.disposed_in_scope.load(Ordering::Relaxed)
    }

    #[setter]
    fn set_disposed_in_scope(&self, value: i64) {
        self.counters.disposed_in_scope.store(value, Ordering::Relaxed)
    }

    #[getter]
    fn disposed_outside_scope(&self) -> i64 {
        self.counters.disposed_outside_scope.load(Ordering::Relaxed)
    }

    #[setter]
    fn set_disposed_outside_scope(&self, value: i64) {
        self.counters.disposed_outside_scope.store(value, Ordering::Relaxed)
    }

    #[getter]
    fn attached(&self) -> i64 {
        self.counters.attached.load(Ordering::Relaxed)
    }

    #[setter]
    fn set_attached(&self, value: i64) {
        self.counters.attached.store(value, Ordering::Relaxed)
    }

    #[getter]
    fn detached(&self) -> i64 {
        self.counters.detached.load(Ordering::Relaxed)
    }

    #[setter]
    fn set_detached(&self, value: i64) {
        self.counters.detached.store(value, Ordering::Relaxed)
    }

    #[getter]
    fn live(&self) -> i64 {
        self.counters.live.load(Ordering::Relaxed)
    }

    #[setter]
    fn set_live(&self, value: i64) {
        self.counters.live.store(value, Ordering::Relaxed)
    }

    /// Zeroes every counter but `live` (a state, not a count of events).
    fn reset(&self) {
        let c = &self.counters;
        for a in [
            &c.created_in_scope,
            &c.created_outside_scope,
            &c.disposed_in_scope,
            &c.disposed_outside_scope,
            &c.attached,
            &c.detached,
        ] {
            a.store(0, Ordering::Relaxed);
        }
    }

    fn __repr__(&self) -> String {
        let c = &self.counters;
        let g = |a: &AtomicI64| a.load(Ordering::Relaxed);
        format!(
            "DisposeStatistics(created_in_scope={}, created_outside_scope={}, disposed_in_scope={}, \
             disposed_outside_scope={}, attached={}, detached={}, live={})",
            g(&c.created_in_scope),
            g(&c.created_outside_scope),
            g(&c.disposed_in_scope),
            g(&c.disposed_outside_scope),
            g(&c.attached),
            g(&c.detached),
            g(&c.live)
        )
    }
}

/// This thread's dispose counters (a live view).
#[pyfunction]
pub(crate) fn dispose_statistics(py: Python<'_>) -> DisposeStatistics {
    let _ = py;
    let counters = DISPOSE.try_with(|d| d.borrow().counters.clone()).unwrap_or_default();
    DisposeStatistics { counters }
}

/// Makes `scope` this thread's innermost dispose scope.
#[pyfunction]
pub(crate) fn dispose_push(scope: Py<PyAny>) {
    let _ = DISPOSE.try_with(|d| d.borrow_mut().chain.push(scope));
}

/// Unlinks `scope` from this thread's chain, wherever it is; returns whether it was there.
#[pyfunction]
pub(crate) fn dispose_remove(scope: &Bound<'_, PyAny>) -> bool {
    let removed = DISPOSE.try_with(|d| {
        let mut d = d.borrow_mut();
        let at = d.chain.iter().position(|s| s.is(scope));
        at.map(|i| d.chain.remove(i))
    });
    // The scope object is released after the borrow ends (its finaliser could run Python).
    matches!(removed, Ok(Some(_)))
}

/// This thread's open dispose scopes, outermost first.
#[pyfunction]
pub(crate) fn dispose_chain(py: Python<'_>) -> Vec<Py<PyAny>> {
    DISPOSE.try_with(|d| d.borrow().chain.iter().map(|s| s.clone_ref(py)).collect()).unwrap_or_default()
}

/// Counts a new array of this thread, in a dispose scope or outside one.
pub(crate) fn count_created(scoped: bool) {
    with_my_counters(|c| {
        bump(&c.live, 1);
        bump(if scoped { &c.created_in_scope } else { &c.created_outside_scope }, 1);
    });
}

/// Counts the disposal of an array created by thread `thread`.
pub(crate) fn count_disposed(thread: u64, scoped: bool) {
    with_counters(thread, |c| {
        bump(&c.live, -1);
        bump(if scoped { &c.disposed_in_scope } else { &c.disposed_outside_scope }, 1);
    });
}

/// Counts the death of an undisposed array created by thread `thread`.
pub(crate) fn count_freed(thread: u64) {
    with_counters(thread, |c| bump(&c.live, -1));
}
