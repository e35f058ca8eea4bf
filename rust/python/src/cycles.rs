//! The loop form of cycles: `for item in ws.cycles(iterable):` makes each iteration one cycle of
//! the workspace, a cycle of its own even beside an open one (an enclosing `with ws:`, another
//! loop over the workspace advanced in turn), as concurrent tasks' cycles are. Between two items
//! the cycle ends, the iterable makes the next item outside any cycle, and the next cycle begins
//! in the same scope, reopened in place wherever it lies in the stack: no scope is pushed or
//! popped per item, and NumPy's context variable is only read. Leaving the loop (exhausting it,
//! `break`, an exception) closes the open cycle: `break` and exceptions drop the iterator, and
//! dropping it closes it, on whatever thread it is dropped (a generator paused inside the loop
//! and finalised elsewhere).

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;

use crate::scope;
use crate::shared::ScopeState;
use crate::state::CoreState;

/// The iterator `Workspace.cycles(iterable)` returns.
#[pyclass(module = "rustws._rustws", frozen)]
pub(crate) struct Cycles {
    ws: Py<PyAny>,
    core: Arc<CoreState>,
    items: Py<pyo3::types::PyIterator>,
    /// Never held while Python runs (the iterable's next item, a report at a cycle end).
    loop_state: Mutex<LoopState>,
}

#[derive(Default)]
struct LoopState {
    /// The loop's scope, from the first item on.
    scope: Option<Arc<ScopeState>>,
    /// Whether an iteration's cycle is open.
    open: bool,
    /// Whether the iterable is exhausted (or failed), or the loop was left.
    done: bool,
}

impl Cycles {
    /// The loop over `iterable` of the workspace `ws`, whose state is `core`.
    pub(crate) fn new(ws: &Bound<'_, PyAny>, core: Arc<CoreState>, iterable: &Bound<'_, PyAny>) -> PyResult<Self> {
        let items = iterable.try_iter()?.unbind();
        Ok(Cycles { ws: ws.clone().unbind(), core, items, loop_state: Mutex::new(LoopState::default()) })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, LoopState> {
        self.loop_state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Leaves the loop: the open cycle closes (as a `with` exit), and the scope is forgotten.
    fn leave(&self, py: Python<'_>, clean: bool) -> PyResult<()> {
        let (scope, open) = {
            let mut s = self.state();
            s.done = true;
            (s.scope.take(), std::mem::take(&mut s.open))
        };
        let Some(scope) = scope else { return Ok(()) };
        let ws = self.ws.bind(py);
        let core = &self.core;
        if open {
            return core.exit_state(py, ws, &scope, clean);
        }
        core.forget_scope(&scope);
        Ok(())
    }
}

#[pymethods]
impl Cycles {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        let ending = {
            let mut s = self.state();
            if s.done {
                return Ok(None);
            }
            if std::mem::take(&mut s.open) {
                s.scope.clone()
            } else {
                None
            }
        };
        let ws = self.ws.bind(py).clone();
        let core = &self.core;
        if let Some(scope) = ending {
            core.end_iteration(py, &ws, &scope)?;
        }
        let item = match self.items.bind(py).clone().next() {
            Some(Ok(item)) => item,
            None => {
                self.leave(py, true)?;
                return Ok(None);
            }
            Some(Err(e)) => {
                self.leave(py, false)?;
                return Err(e);
            }
        };
        let kept = self.state().scope.clone();
        if let Some(scope) = kept {
            let in_stack = scope::in_stack(py, &scope)?;
            if core.begin_iteration(py, &scope, in_stack)? {
                self.state().open = true;
                return Ok(Some(item.unbind()));
            }
            // Something took the loop's scope out meanwhile: enter one anew.
            core.forget_scope(&scope);
            self.state().scope = None;
        }
        let scope = core.enter_scope(py, &ws, false)?;
        let mut s = self.state();
        s.scope = Some(scope);
        s.open = true;
        Ok(Some(item.unbind()))
    }

    /// Closes the open cycle now, as leaving the loop does.
    fn close_loop(&self, py: Python<'_>) -> PyResult<()> {
        self.leave(py, true)
    }
}

impl Drop for Cycles {
    fn drop(&mut self) {
        let s = self.loop_state.get_mut().unwrap_or_else(|e| e.into_inner());
        if s.open || s.scope.is_some() {
            // SAFETY: a pyclass is dropped by its type's deallocator, with the GIL held, on whatever
            // thread drops the last reference.
            let py = unsafe { Python::assume_attached() };
            // A loop left by an exception drops its iterator while that exception propagates:
            // the cycle's end runs Python (reports), which must not take the exception's place.
            let propagating = PyErr::take(py);
            if let Err(e) = self.leave(py, false) {
                e.write_unraisable(py, None);
            }
            if let Some(e) = propagating {
                e.restore(py);
            }
        }
    }
}
