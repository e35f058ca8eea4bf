//! The loop form of cycles: `for item in ws.cycles(iterable):` makes each iteration one cycle of
//! the workspace. The scope (and so capture) is set up once for the whole loop; between two items
//! only the cycle ends and the next begins, which costs what the core's cycle end costs. Leaving
//! the loop (exhausting it, `break`, an exception) closes the open cycle and the scope: `break`
//! and exceptions drop the iterator, and dropping it closes them.

use pyo3::prelude::*;

use crate::{reclaim, to_py, WorkspaceCore};

/// The iterator `Workspace.cycles(iterable)` returns.
#[pyclass(module = "rustws._rustws", unsendable)]
pub(crate) struct Cycles {
    ws: Py<PyAny>,
    items: Py<PyAny>,
    /// Whether the loop's scope is open (from the first item on).
    open: bool,
    /// Whether the iterable is exhausted.
    done: bool,
}

impl Cycles {
    pub(crate) fn new(ws: &Bound<'_, WorkspaceCore>, iterable: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Cycles {
            ws: ws.clone().into_any().unbind(),
            items: iterable.try_iter()?.into_any().unbind(),
            open: false,
            done: false,
        })
    }

    fn close(&mut self, py: Python<'_>, clean: bool) -> PyResult<()> {
        if std::mem::take(&mut self.open) {
            let ws = self.ws.bind(py);
            ws.cast::<WorkspaceCore>()?.get().exit_scope(py, ws, clean)?;
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
            // One cycle ends and the next begins; the scope stays.
            let turned = {
                let mut w = core.shared.lock();
                w.close_cycle().and_then(|r| w.open_cycle().map(|()| r))
            };
            reclaim(&core.memory);
            let r = turned.map_err(|e| to_py(py, e))?;
            core.after_cycle(py, &ws, r, true)?;
        } else {
            core.enter_scope(py, &ws)?;
            self.open = true;
        }
        match self.items.bind(py).call_method0(pyo3::intern!(py, "__next__")) {
            Ok(item) => Ok(Some(item.unbind())),
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyStopIteration>(py) => {
                self.done = true;
                self.close(py, true)?;
                Ok(None)
            }
            Err(e) => {
                self.done = true;
                let _ = self.close(py, false);
                Err(e)
            }
        }
    }

    /// Closes the open cycle and the loop's scope now (as leaving the loop does).
    fn close_loop(&mut self, py: Python<'_>) -> PyResult<()> {
        self.done = true;
        self.close(py, true)
    }
}

impl Drop for Cycles {
    fn drop(&mut self) {
        if self.open {
            // SAFETY: a pyclass is dropped by its type's deallocator, with the GIL held.
            let py = unsafe { Python::assume_attached() };
            if let Err(e) = self.close(py, false) {
                e.write_unraisable(py, None);
            }
        }
    }
}
