//! The loop form of cycles: `for item in ws.cycles(iterable):` makes each iteration one cycle of
//! the workspace, a cycle of its own even beside an open one (an enclosing `with ws:`, another
//! loop over the workspace advanced in turn), as concurrent tasks' cycles are. Between two items
//! the cycle ends, the iterable makes the next item outside any cycle, and the next cycle begins
//! in the same scope, reopened in place wherever it lies in the stack: no scope is pushed or
//! popped per item, and NumPy's context variable is only read. Where taking the next item runs
//! no Python (a `range`), it is taken first, and the cycle's end and the next cycle's open take
//! the workspace's lock once; an item whose cycle could not open (the end before it raised) comes
//! with the next call. The loop's own state is touched only under the GIL, so a boundary takes no
//! other lock. Leaving the loop (exhausting it, `break`, an exception) closes the open cycle:
//! `break` and exceptions drop the iterator, and dropping it closes it, on whatever thread it is
//! dropped (a generator paused inside the loop and finalised elsewhere).

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use crate::scope;
use crate::shared::{GilCell, ScopeState};
use crate::state::CoreState;

/// The iterator `Workspace.cycles(iterable)` returns.
#[pyclass(module = "rustws._rustws", frozen)]
pub(crate) struct Cycles {
    ws: Py<PyAny>,
    core: Arc<CoreState>,
    items: Py<pyo3::types::PyIterator>,
    /// Whether taking the next item runs no Python (see [`runs_no_python`]): fixed by the
    /// iterator's type, so asked once.
    pure: bool,
    /// Touched under the GIL only: an iteration boundary takes no lock for it.
    loop_state: GilCell<LoopState>,
}

#[derive(Default)]
struct LoopState {
    /// What the calls in between keep (taken out while a call runs).
    kept: Kept,
    /// Whether `__next__` or `close_loop` is running (Python code they run, the iterable making
    /// its next item or a report, cannot re-enter them: a generator raises the same way).
    busy: bool,
}

/// What the loop keeps from one call to the next.
#[derive(Default)]
struct Kept {
    /// The loop's scope, from the first item on.
    scope: Option<Arc<ScopeState>>,
    /// Whether an iteration's cycle is open.
    open: bool,
    /// Whether the iterable is exhausted (or failed), or the loop was left.
    done: bool,
    /// An item taken whose cycle did not open (the end of the cycle before it raised): the next
    /// call opens its cycle and returns it, so that no item is lost.
    pending: Option<Py<PyAny>>,
}

/// What a call returns, and what the loop keeps.
type Step = (PyResult<Option<Py<PyAny>>>, Kept);

impl Cycles {
    /// The loop over `iterable` of the workspace `ws`, whose state is `core`.
    pub(crate) fn new(ws: &Bound<'_, PyAny>, core: Arc<CoreState>, iterable: &Bound<'_, PyAny>) -> PyResult<Self> {
        let items = iterable.try_iter()?;
        let pure = runs_no_python(&items);
        let loop_state = GilCell::new(LoopState::default());
        Ok(Cycles { ws: ws.clone().unbind(), core, items: items.unbind(), pure, loop_state })
    }

    /// Marks the loop busy and takes out what it keeps; an error when it already runs.
    fn enter(&self, py: Python<'_>) -> PyResult<Kept> {
        let entered = self.loop_state.with(py, |s| {
            if s.busy {
                return None;
            }
            s.busy = true;
            Some(std::mem::take(&mut s.kept))
        });
        entered.ok_or_else(|| PyValueError::new_err("a workspace's cycles loop is already running"))
    }

    /// Puts back what the loop keeps, and clears `busy`.
    fn settle(&self, py: Python<'_>, kept: Kept) {
        let old = self.loop_state.with(py, |s| {
            s.busy = false;
            std::mem::replace(&mut s.kept, kept)
        });
        drop(old); // empty (taken by `enter`); dropped outside all the same
    }

    /// Leaves the loop: the open cycle closes (as a `with` exit), and the scope is forgotten.
    fn leave(&self, py: Python<'_>, scope: Option<Arc<ScopeState>>, open: bool, clean: bool) -> PyResult<()> {
        let Some(scope) = scope else { return Ok(()) };
        let ws = self.ws.bind(py);
        if open {
            return self.core.exit_state(py, ws, &scope, clean);
        }
        self.core.forget_scope(py, &scope);
        Ok(())
    }

    /// One boundary: ends the open cycle, takes the next item, opens the next cycle.
    fn advance(&self, py: Python<'_>, mut k: Kept) -> Step {
        let ws = self.ws.bind(py);
        let item = match k.pending.take() {
            Some(item) => item.into_bound(py),
            None => {
                if let Some(state) = k.scope.take_if(|_| k.open) {
                    if self.pure {
                        return self.turn(py, state, k);
                    }
                    k.open = false;
                    // Levels nested in the cycle and still open end with it (an error finding them
                    // is the iterable's to see after the cycle ended).
                    let (_, orphans) = scope::in_stack(py, ws, &state).unwrap_or((false, 0));
                    let ended = self.core.end_iteration(py, ws, &state, orphans);
                    k.scope = Some(state);
                    if let Err(e) = ended {
                        return (Err(e), k);
                    }
                }
                match self.items.bind(py).clone().next() {
                    Some(Ok(item)) => item,
                    ended => return self.finish(py, ended, k),
                }
            }
        };
        self.open_with(py, item, k)
    }

    /// The iterable is exhausted (`None`) or failed: the loop is left.
    fn finish(&self, py: Python<'_>, ended: Option<PyResult<Bound<'_, PyAny>>>, mut k: Kept) -> Step {
        k.done = true;
        let scope = k.scope.take();
        let left = match ended {
            Some(Err(e)) => self.leave(py, scope, false, false).and(Err(e)),
            _ => self.leave(py, scope, false, true).map(|()| None),
        };
        (left, k)
    }

    /// Opens `item`'s cycle in the loop's scope, reopened in place (or a scope entered anew when
    /// something took it out meanwhile); on an error the item waits for the next call.
    fn open_with(&self, py: Python<'_>, item: Bound<'_, PyAny>, mut k: Kept) -> Step {
        let core = &self.core;
        if let Some(state) = k.scope.take() {
            let here = scope::in_stack(py, self.ws.bind(py), &state).map(|(here, _)| here);
            match here.and_then(|here| core.begin_iteration(py, &state, here)) {
                Ok(true) => {
                    k.scope = Some(state);
                    k.open = true;
                    return (Ok(Some(item.unbind())), k);
                }
                Ok(false) => core.forget_scope(py, &state),
                Err(e) => {
                    k.scope = Some(state);
                    k.pending = Some(item.unbind());
                    return (Err(e), k);
                }
            }
        }
        match core.enter_scope(py, self.ws.bind(py), false) {
            Ok(state) => {
                k.scope = Some(state);
                k.open = true;
                (Ok(Some(item.unbind())), k)
            }
            Err(e) => {
                k.pending = Some(item.unbind());
                (Err(e), k)
            }
        }
    }

    /// The boundary when taking the next item runs no Python: the item first, then the cycle
    /// ends and the next one opens in the same scope under one lock of the workspace.
    fn turn(&self, py: Python<'_>, state: Arc<ScopeState>, mut k: Kept) -> Step {
        let ws = self.ws.bind(py);
        let core = &self.core;
        k.open = false;
        // Where the loop's scope is, and the levels nested in its cycle that end with it.
        let found = scope::in_stack(py, ws, &state);
        let orphans = found.as_ref().map_or(0, |&(_, orphans)| orphans);
        let item = match self.items.bind(py).clone().next() {
            Some(Ok(item)) => item,
            ended => {
                // The last item: the cycle ends as it does after any iterable, then the loop.
                let end = core.end_iteration(py, ws, &state, orphans);
                k.scope = Some(state);
                if let Err(e) = end {
                    return (Err(e), k);
                }
                return self.finish(py, ended, k);
            }
        };
        let here = match found {
            Ok((here, _)) => here,
            Err(e) => {
                // The cycle still ends; the item waits for the next call.
                let end = core.end_iteration(py, ws, &state, 0);
                k.scope = Some(state);
                k.pending = Some(item.unbind());
                return (end.and(Err(e)), k);
            }
        };
        match core.turn_iteration(py, ws, &state, here, orphans) {
            Ok(true) => {
                k.scope = Some(state);
                k.open = true;
                (Ok(Some(item.unbind())), k)
            }
            Ok(false) => {
                // Something took the loop's scope out meanwhile: enter one anew.
                core.forget_scope(py, &state);
                self.open_with(py, item, k)
            }
            Err(e) => {
                // The cycle ended (its report raised, or the next one could not open).
                k.scope = Some(state);
                k.pending = Some(item.unbind());
                (Err(e), k)
            }
        }
    }
}

/// Whether taking the next item of `items` runs no Python code (and so allocates no array, and
/// frees nothing whose finaliser could): it is a `range`'s iterator. A list's or tuple's iterator
/// frees its sequence, and so maybe its items, when it is exhausted.
fn runs_no_python(items: &Bound<'_, pyo3::types::PyIterator>) -> bool {
    range_iterators(items.py()).contains(&(items.get_type().as_ptr() as usize))
}

/// The types of a `range`'s iterators (within a machine word, and past it), made with no Python
/// code run: `py.eval` would first make PyO3's interned names, in cells that a fork on another
/// thread meanwhile leaves half made in the child (see `once`).
fn range_iterators(py: Python<'_>) -> &'static [usize; 2] {
    static RANGES: PyOnceLock<[usize; 2]> = PyOnceLock::new();
    crate::once::get_or_make(&RANGES, py, || {
        let kind = |obj: PyResult<Bound<'_, PyAny>>| {
            obj.and_then(|o| o.try_iter()).map(|it| it.get_type().as_ptr() as usize).unwrap_or(0)
        };
        let range = py.get_type::<pyo3::types::PyRange>();
        [kind(range.call1((0,))), kind(range.call1((u64::MAX,)))]
    })
}

/// Makes what the loop form looks up once, at import (see `once`).
pub(crate) fn init(py: Python<'_>) {
    range_iterators(py);
}

#[pymethods]
impl Cycles {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        let k = self.enter(py)?;
        if k.done {
            self.settle(py, k);
            return Ok(None);
        }
        let (result, k) = self.advance(py, k);
        self.settle(py, k);
        result
    }

    /// Closes the open cycle now, as leaving the loop does.
    fn close_loop(&self, py: Python<'_>) -> PyResult<()> {
        let mut k = self.enter(py)?;
        let left = self.leave(py, k.scope.take(), std::mem::take(&mut k.open), true);
        k.done = true;
        let pending = k.pending.take();
        self.settle(py, k);
        drop(pending);
        left
    }
}

impl Drop for Cycles {
    fn drop(&mut self) {
        let k = std::mem::take(&mut self.loop_state.get_mut().kept);
        if k.open || k.scope.is_some() || k.pending.is_some() {
            // SAFETY: a pyclass is dropped by its type's deallocator, with the GIL held, on whatever
            // thread drops the last reference.
            let py = unsafe { Python::assume_attached() };
            // A loop left by an exception drops its iterator while that exception propagates:
            // the cycle's end runs Python (reports), which must not take the exception's place.
            let propagating = PyErr::take(py);
            if let Err(e) = self.leave(py, k.scope, k.open, false) {
                e.write_unraisable(py, None);
            }
            drop(k.pending);
            if let Some(e) = propagating {
                e.restore(py);
            }
        }
    }
}
