//! The loop form of cycles: `for item in ws.cycles(iterable):` makes each iteration one cycle of
//! the workspace, a cycle of its own even beside an open one (an enclosing `with ws:`, another
//! loop over the workspace advanced in turn), as concurrent tasks' cycles are. Between two items
//! the cycle ends, the iterable makes the next item outside any cycle, and the next cycle begins
//! in the same scope, reopened in place wherever it lies in the stack: no scope is pushed or
//! popped per item, and NumPy's context variable is only read. Where taking the next item runs
//! no Python (a `range`, a list, a tuple), it is taken first, and the cycle's end and the next
//! cycle's open take the workspace's lock once; the loop's own state is touched only under the
//! GIL, so a boundary takes no other lock. Leaving the loop (exhausting it,
//! `break`, an exception) closes the open cycle: `break` and exceptions drop the iterator, and
//! dropping it closes it, on whatever thread it is dropped (a generator paused inside the loop
//! and finalised elsewhere).

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
    /// Touched under the GIL only: an iteration boundary takes no lock for it.
    loop_state: GilCell<LoopState>,
}

/// What an iteration boundary returns: the item (or the error), then what the loop keeps.
type Advanced = (PyResult<Option<Py<PyAny>>>, Option<Arc<ScopeState>>, bool, bool);

#[derive(Default)]
struct LoopState {
    /// The loop's scope, from the first item on (taken out while an iteration boundary runs).
    scope: Option<Arc<ScopeState>>,
    /// Whether an iteration's cycle is open.
    open: bool,
    /// Whether the iterable is exhausted (or failed), or the loop was left.
    done: bool,
    /// Whether `__next__` or `close_loop` is running (Python code they run, the iterable making
    /// its next item or a report, cannot re-enter them: a generator raises the same way).
    busy: bool,
}

impl Cycles {
    /// The loop over `iterable` of the workspace `ws`, whose state is `core`.
    pub(crate) fn new(ws: &Bound<'_, PyAny>, core: Arc<CoreState>, iterable: &Bound<'_, PyAny>) -> PyResult<Self> {
        let items = iterable.try_iter()?.unbind();
        Ok(Cycles { ws: ws.clone().unbind(), core, items, loop_state: GilCell::new(LoopState::default()) })
    }

    /// Marks the loop busy and takes out its scope and whether a cycle is open; an error when
    /// it already runs.
    fn enter(&self, py: Python<'_>) -> PyResult<(Option<Arc<ScopeState>>, bool, bool)> {
        let entered = self.loop_state.with(py, |s| {
            if s.busy {
                return None;
            }
            s.busy = true;
            Some((s.scope.take(), std::mem::take(&mut s.open), s.done))
        });
        entered.ok_or_else(|| PyValueError::new_err("a workspace's cycles loop is already running"))
    }

    /// Puts back what `enter` took (and what the iteration made), and clears `busy`.
    fn settle(&self, py: Python<'_>, scope: Option<Arc<ScopeState>>, open: bool, done: bool) {
        self.loop_state.with(py, |s| {
            s.scope = scope;
            s.open = open;
            s.done = done;
            s.busy = false;
        });
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

    /// One boundary: ends the open cycle, takes the next item, opens the next cycle. Returns the
    /// item, and what the loop keeps: its scope, whether a cycle is open, whether it is done.
    fn advance(&self, py: Python<'_>, scope: Option<Arc<ScopeState>>, open: bool) -> Advanced {
        let ws = self.ws.bind(py);
        let core = &self.core;
        let scope = match scope {
            Some(state) if open && self.next_runs_no_python(py) => return self.turn(py, state),
            scope => scope,
        };
        if let (Some(state), true) = (&scope, open) {
            if let Err(e) = core.end_iteration(py, ws, state) {
                return (Err(e), scope, false, false);
            }
        }
        let item = match self.items.bind(py).clone().next() {
            Some(Ok(item)) => item,
            None => return (self.leave(py, scope, false, true).map(|()| None), None, false, true),
            Some(Err(e)) => return (self.leave(py, scope, false, false).and(Err(e)), None, false, true),
        };
        if let Some(state) = scope {
            let reopened = scope::in_stack(py, &state).and_then(|here| core.begin_iteration(py, &state, here));
            match reopened {
                Ok(true) => return (Ok(Some(item.unbind())), Some(state), true, false),
                // Something took the loop's scope out meanwhile: enter one anew.
                Ok(false) => core.forget_scope(py, &state),
                Err(e) => return (Err(e), Some(state), false, false),
            }
        }
        match core.enter_scope(py, ws, false) {
            Ok(state) => (Ok(Some(item.unbind())), Some(state), true, false),
            Err(e) => (Err(e), None, false, false),
        }
    }

    /// Whether taking the next item runs no Python code (and so allocates no array): the
    /// iterable is a `range`, a list or a tuple.
    fn next_runs_no_python(&self, py: Python<'_>) -> bool {
        static PURE: PyOnceLock<[usize; 4]> = PyOnceLock::new();
        let pure = PURE.get_or_init(py, || {
            let kind = |obj: PyResult<Bound<'_, PyAny>>| {
                obj.and_then(|o| o.try_iter()).map(|it| it.get_type().as_ptr() as usize).unwrap_or(0)
            };
            [
                kind(pyo3::types::PyRange::new(py, 0, 1).map(Bound::into_any)),
                kind(py.eval(c"range(1 << 80)", None, None)),
                kind(Ok(pyo3::types::PyList::empty(py).into_any())),
                kind(Ok(pyo3::types::PyTuple::empty(py).into_any())),
            ]
        });
        // SAFETY: a live object's type, compared by address only.
        let kind = unsafe { pyo3::ffi::Py_TYPE(self.items.as_ptr()) } as usize;
        kind != 0 && pure.contains(&kind)
    }

    /// The boundary when taking the next item runs no Python: the item first, then the cycle
    /// ends and the next one opens in the same scope under one lock of the workspace.
    fn turn(&self, py: Python<'_>, state: Arc<ScopeState>) -> Advanced {
        let ws = self.ws.bind(py);
        let core = &self.core;
        let item = match self.items.bind(py).clone().next() {
            Some(Ok(item)) => item,
            ended => {
                // The last item: the cycle ends as it does after any iterable, then the loop.
                if let Err(e) = core.end_iteration(py, ws, &state) {
                    return (Err(e), Some(state), false, false);
                }
                return match ended {
                    Some(Err(e)) => (self.leave(py, Some(state), false, false).and(Err(e)), None, false, true),
                    _ => (self.leave(py, Some(state), false, true).map(|()| None), None, false, true),
                };
            }
        };
        match scope::in_stack(py, &state).and_then(|here| core.turn_iteration(py, ws, &state, here)) {
            Ok(true) => (Ok(Some(item.unbind())), Some(state), true, false),
            Ok(false) => {
                // Something took the loop's scope out meanwhile: enter one anew.
                core.forget_scope(py, &state);
                match core.enter_scope(py, ws, false) {
                    Ok(state) => (Ok(Some(item.unbind())), Some(state), true, false),
                    Err(e) => (Err(e), None, false, false),
                }
            }
            Err(e) => (Err(e), Some(state), false, false),
        }
    }
}

#[pymethods]
impl Cycles {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        let (scope, open, done) = self.enter(py)?;
        if done {
            self.settle(py, scope, open, true);
            return Ok(None);
        }
        let (result, scope, open, done) = self.advance(py, scope, open);
        self.settle(py, scope, open, done);
        result
    }

    /// Closes the open cycle now, as leaving the loop does.
    fn close_loop(&self, py: Python<'_>) -> PyResult<()> {
        let (scope, open, _) = self.enter(py)?;
        let left = self.leave(py, scope, open, true);
        self.settle(py, None, false, true);
        left
    }
}

impl Drop for Cycles {
    fn drop(&mut self) {
        let s = self.loop_state.get_mut();
        let (scope, open) = (s.scope.take(), std::mem::take(&mut s.open));
        if open || scope.is_some() {
            // SAFETY: a pyclass is dropped by its type's deallocator, with the GIL held, on whatever
            // thread drops the last reference.
            let py = unsafe { Python::assume_attached() };
            // A loop left by an exception drops its iterator while that exception propagates:
            // the cycle's end runs Python (reports), which must not take the exception's place.
            let propagating = PyErr::take(py);
            if let Err(e) = self.leave(py, scope, open, false) {
                e.write_unraisable(py, None);
            }
            if let Some(e) = propagating {
                e.restore(py);
            }
        }
    }
}
