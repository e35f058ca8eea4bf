//! The loop form of cycles: `for item in ws.cycles(iterable):` makes each iteration one cycle of
//! the workspace. Between two items the cycle ends, the iterable makes the next item outside any
//! cycle, and the next cycle begins in the same scope, reopened in place: no scope is pushed or
//! popped per item, and NumPy's context variable is only read. Leaving the loop (exhausting it,
//! `break`, an exception) closes the open cycle: `break` and exceptions drop the iterator, and
//! dropping it closes it.

use std::sync::Arc;

use pyo3::prelude::*;

use crate::scope::{self, ScopeState};
use crate::WorkspaceCore;

/// The iterator `Workspace.cycles(iterable)` returns.
#[pyclass(module = "rustws._rustws", unsendable)]
pub(crate) struct Cycles {
    ws: Py<PyAny>,
    items: Py<pyo3::types::PyIterator>,
    /// The loop's scope, from the first item on.
    state: Option<Arc<ScopeState>>,
    /// Whether an iteration's cycle is open.
    open: bool,
    /// Whether the iterable is exhausted (or failed).
    done: bool,
}

impl Cycles {
    pub(crate) fn new(ws: &Bound<'_, WorkspaceCore>, iterable: &Bound<'_, PyAny>) -> PyResult<Self> {
        let items = iterable.try_iter()?.unbind();
        Ok(Cycles { ws: ws.clone().into_any().unbind(), items, state: None, open: false, done: false })
    }

    /// Leaves the loop: the open cycle closes (as a `with` exit), and the scope is forgotten.
    fn leave(&mut self, py: Python<'_>, clean: bool) -> PyResult<()> {
        self.done = true;
        let ws = self.ws.bind(py);
        let core = ws.cast::<WorkspaceCore>()?.get();
        let state = self.state.take();
        if std::mem::take(&mut self.open) {
            return core.exit_scope(py, ws, clean);
        }
        if let Some(state) = state {
            core.forget_scope(&state);
        }
        Ok(())
    }
}

#[pymethods]
impl Cycles {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        if self.done {
            return Ok(None);
        }
        let ws = self.ws.bind(py).clone();
        let core = ws.cast::<WorkspaceCore>()?.get();
        if self.open {
            let state = self.state.clone().expect("an open iteration has its scope");
            self.open = false;
            core.end_iteration(py, &ws, &state)?;
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
        if let Some(state) = self.state.clone() {
            let top = scope::is_top(py, &state)?;
            if core.begin_iteration(py, &state, top)? {
                self.open = true;
                return Ok(Some(item.unbind()));
            }
            // Something replaced the loop's scope meanwhile: enter one anew.
            core.forget_scope(&state);
            self.state = None;
        }
        self.state = Some(core.enter_scope(py, &ws)?);
        self.open = true;
        Ok(Some(item.unbind()))
    }

    /// Closes the open cycle now, as leaving the loop does.
    fn close_loop(&mut self, py: Python<'_>) -> PyResult<()> {
        self.leave(py, true)
    }
}

impl Drop for Cycles {
    fn drop(&mut self) {
        if self.open || self.state.is_some() {
            // SAFETY: a pyclass is dropped by its type's deallocator, with the GIL held.
            let py = unsafe { Python::assume_attached() };
            if let Err(e) = self.leave(py, false) {
                e.write_unraisable(py, None);
            }
        }
    }
}
