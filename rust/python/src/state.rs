//! What a workspace's Python object holds ([`CoreState`]): the core behind its lock and NumPy
//! memory handler ([`Shared`]), where its memory comes from ([`Memory`]), and the scopes it has
//! open; and what it does with them: open and close its cycles and scopes (`with ws:` and the
//! loop form), report what they refused and what escaped them, and make its arrays and blocks.
//! The Python class (`WorkspaceCore`, in `workspace`) and the loop form (`cycles`) build on it.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use pyo3::prelude::*;

use crate::calls::{self, Arg};
use crate::devarray::DeviceSide;
use crate::device::{reclaim, Block, Memory};
use crate::errors::{self, to_py};
use crate::shared::{GilCell, ScopeState, Shared};
use crate::{arrays, scope};

/// What a workspace's Python object holds.
pub(crate) struct CoreState {
    pub(crate) shared: Arc<Shared>,
    pub(crate) capsule: Py<PyAny>,
    /// `use_cycle_detector`: report arrays that outlive their cycle.
    pub(crate) cycle_detector: bool,
    /// Where the memory comes from (and the CUDA device, for device workspaces).
    pub(crate) memory: Arc<Memory>,
    /// Set once for device workspaces: their `empty` / `zeros` return `DeviceArray`s.
    pub(crate) device: std::sync::OnceLock<DeviceSide>,
    /// The states of this workspace's open scopes (`with ws:`), innermost last: an exit that
    /// runs where its scope is not in the stack closes one through them. Touched under the GIL
    /// only: entering and leaving a scope takes no lock for it.
    pub(crate) open_scopes: GilCell<Vec<Arc<ScopeState>>>,
}

impl CoreState {
    /// A new ndarray over this workspace's memory (refused for device memory).
    pub(crate) fn new_array<'py>(
        &self,
        py: Python<'py>,
        shape: &Bound<'py, PyAny>,
        dtype: Option<&Bound<'py, PyAny>>,
        order: &str,
        zeroed: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        arrays::new_array(py, &self.shared, self.capsule.bind(py), self.shared.bypass, shape, dtype, order, zeroed)
    }

    /// A new block of `nbytes` from this workspace, zero-filled when `zeroed`.
    pub(crate) fn new_block(&self, py: Python<'_>, nbytes: usize, zeroed: bool) -> PyResult<Block> {
        Block::new_py(py, &self.memory, nbytes, zeroed)
    }

    /// Whether a scope of this workspace opened now pushes a capture handler.
    pub(crate) fn installs_handler(&self) -> bool {
        self.shared.installs_handler()
    }

    /// Opens a scope of this workspace in this thread's or task's stack: a cycle of its own, or
    /// (`with ws:` inside an open `with ws:` here, `nests`) a level nested in this stack's open
    /// cycle. The loop form always opens a cycle of its own: each iteration is one.
    pub(crate) fn enter_scope(&self, py: Python<'_>, me: &Bound<'_, PyAny>, nests: bool) -> PyResult<Arc<ScopeState>> {
        self.enter_level(py, me, nests, Arc::clone)
    }

    /// `with ws:`: [`CoreState::enter_scope`], keeping nothing but the open scopes' entry.
    pub(crate) fn enter_with(&self, py: Python<'_>, me: &Bound<'_, PyAny>) -> PyResult<()> {
        self.enter_level(py, me, true, |_| ())
    }

    /// Opens the scope and lists it among the open scopes; returns what `keep` takes of it.
    fn enter_level<K>(
        &self,
        py: Python<'_>,
        me: &Bound<'_, PyAny>,
        nests: bool,
        keep: impl FnOnce(&Arc<ScopeState>) -> K,
    ) -> PyResult<K> {
        let task = scope::current_task(py);
        // A level open here whose cycle ended under it (`ScopeState::is_orphaned`) does not
        // count: this one opens a cycle.
        let nested = nests && scope::is_open_here(py, me, task)?;
        // The guard is dropped before any Python runs: building an exception can run the GC,
        // which may free this workspace's arrays and take the lock again.
        let entered = {
            let mut ws = self.shared.lock();
            if nested {
                ws.nest()
            } else {
                ws.open_cycle()
            }
        };
        entered.map_err(|e| to_py(py, e))?;
        let undo = |e: PyErr| {
            let mut ws = self.shared.lock();
            let _ = if nested { ws.unnest() } else { ws.close_cycle().map(drop) };
            e
        };
        let installs = self.installs_handler();
        // The node the last `with` of this workspace left here, reopened in place; else a new one.
        let reopened = if nests { scope::reopen(py, me, installs, !nested, task).map_err(undo)? } else { None };
        let state = match reopened {
            Some(state) => state,
            None => {
                let how = if installs {
                    scope::Install::Capture(self.shared.clone(), self.capsule.bind(py))
                } else {
                    scope::Install::Keep
                };
                // Entered for the loop form (`nests` false), it is the loop's to end and exit.
                let state = ScopeState::new(!nested, task, !nests);
                scope::push(py, me, me, how, state.clone()).map_err(undo)?;
                state
            }
        };
        let kept = keep(&state);
        self.remember_scope(py, state).map_err(undo)?;
        Ok(kept)
    }

    /// Lists `state` among the open scopes (room first: none is a `MemoryError`, and nothing is
    /// left half done).
    fn remember_scope(&self, py: Python<'_>, state: Arc<ScopeState>) -> PyResult<()> {
        let refused = self.open_scopes.with(py, |open| {
            if open.try_reserve(1).is_err() {
                return Some(state);
            }
            open.push(state);
            None
        });
        if let Some(state) = refused {
            state.close();
            return Err(errors::no_memory(py));
        }
        Ok(())
    }

    /// The loop form's end of an iteration: closes `state`'s cycle and leaves its node in place
    /// for the next iteration.
    /// `orphans`: levels of this workspace nested in the cycle and still open, which end with it
    /// (see `scope::in_stack`).
    pub(crate) fn end_iteration(
        &self,
        py: Python<'_>,
        me: &Bound<'_, PyAny>,
        state: &ScopeState,
        orphans: u32,
    ) -> PyResult<()> {
        state.close();
        self.end_level(py, me, state, true, orphans)
    }

    /// Ends what `state` opened in the core (its cycle, or its nested level), then reports
    /// refused requests and escaped arrays (see `after_cycle`); nothing once destroyed.
    /// `orphans`: levels nested in `state`'s cycle that end with it, taken off the nesting first.
    fn end_level(
        &self,
        py: Python<'_>,
        me: &Bound<'_, PyAny>,
        state: &ScopeState,
        clean: bool,
        orphans: u32,
    ) -> PyResult<()> {
        if self.shared.is_destroyed() {
            return Ok(());
        }
        let ended = {
            let mut ws = self.shared.lock();
            unnest(&mut ws, orphans);
            if state.opened_cycle() {
                ws.close_cycle()
            } else if state.is_orphaned() {
                // Its cycle ended under it (see `exit_level`): its exit only unwinds.
                Ok(rustws_core::CycleReport::default())
            } else {
                ws.unnest().map(|()| rustws_core::CycleReport::default())
            }
        };
        reclaim(py, &self.memory);
        let r = ended.map_err(|e| to_py(py, e))?;
        self.after_cycle(py, me, r, clean)
    }

    /// The loop form's next iteration in the scope of `state`, reopened in place (a cycle of its
    /// own); false when its node is no longer in this stack (then a scope is entered anew).
    pub(crate) fn begin_iteration(&self, py: Python<'_>, state: &ScopeState, in_stack: bool) -> PyResult<bool> {
        if !in_stack {
            return Ok(false);
        }
        let opened = self.shared.lock().open_cycle();
        opened.map_err(|e| to_py(py, e))?;
        state.reopen(true);
        Ok(true)
    }

    /// The loop form's boundary when its next item is already taken: ends `state`'s cycle and
    /// opens the next one in place (false when its node is no longer in this stack, `in_stack`;
    /// then the cycle has ended and a scope is entered anew). With nothing to report, the end
    /// and the open take one lock of the workspace; otherwise they are `end_iteration` and
    /// `begin_iteration`.
    pub(crate) fn turn_iteration(
        &self,
        py: Python<'_>,
        me: &Bound<'_, PyAny>,
        state: &ScopeState,
        in_stack: bool,
        orphans: u32,
    ) -> PyResult<bool> {
        if !in_stack || !state.opened_cycle() || self.shared.is_destroyed() {
            self.end_iteration(py, me, state, orphans)?;
            return self.begin_iteration(py, state, in_stack);
        }
        state.close();
        let (ended, opened) = {
            let mut ws = self.shared.lock();
            unnest(&mut ws, orphans);
            let ended = ws.close_cycle();
            let quiet = matches!(&ended, Ok(r) if !self.reports(r));
            let opened = if quiet { Some(ws.reopen_cycle()) } else { None };
            (ended, opened)
        };
        reclaim(py, &self.memory);
        if let Some(opened) = opened {
            opened.map_err(|e| to_py(py, e))?;
            state.reopen(true);
            return Ok(true);
        }
        let r = ended.map_err(|e| to_py(py, e))?;
        self.after_cycle(py, me, r, true)?;
        self.begin_iteration(py, state, true)
    }

    /// Whether a cycle's end has something to report: refused requests, (with the cycle
    /// detector) arrays that outlived it, or anything while the cycles are observed.
    fn reports(&self, r: &rustws_core::CycleReport) -> bool {
        self.shared.has_failures.load(Ordering::Relaxed)
            || self.leaked(r)
            || self.shared.observed.load(Ordering::Relaxed)
    }

    fn leaked(&self, r: &rustws_core::CycleReport) -> bool {
        r.completed && r.escaped_blocks > 0 && self.cycle_detector
    }

    /// Drops `state` from the open scopes (its node stays, closed, until settled).
    pub(crate) fn forget_scope(&self, py: Python<'_>, state: &Arc<ScopeState>) {
        let gone =
            self.open_scopes.with(py, |open| open.iter().rposition(|s| Arc::ptr_eq(s, state)).map(|i| open.remove(i)));
        drop(gone); // outside: dropping the last reference frees the state
    }

    /// Reports refused requests and escaped arrays through `_after_cycle`, when there are any, and
    /// every exit while the cycles are observed (with whether it closed a cycle).
    pub(crate) fn after_cycle(
        &self,
        py: Python<'_>,
        me: &Bound<'_, PyAny>,
        r: rustws_core::CycleReport,
        clean: bool,
    ) -> PyResult<()> {
        if self.reports(&r) {
            let leaked = self.leaked(&r);
            let names = calls::names(py)?;
            let args = [
                Arg::Bool(leaked && clean),
                Arg::Int(r.escaped_blocks),
                Arg::Int(r.escaped_bytes),
                Arg::Bool(r.completed),
            ];
            calls::call_method(me, &names.after_cycle, &args)?;
        }
        Ok(())
    }

    /// Closes this workspace's innermost scope here (see `__exit__`).
    pub(crate) fn exit_scope(&self, py: Python<'_>, me: &Bound<'_, PyAny>, clean: bool) -> PyResult<()> {
        match scope::pop(py, me, None)? {
            scope::Popped::Innermost(state) => self.exit_level(py, me, &state, 0, None, clean),
            scope::Popped::Unlinked(state, innermost, orphans) => {
                self.exit_level(py, me, &state, orphans, Some(innermost), clean)
            }
            scope::Popped::NotHere => {
                // Not in this stack. The scope whose entering frame runs this exit is its owner's
                // (a generator or coroutine finalised on another thread or outside its task): it
                // closes. Any other exit from elsewhere changes nothing.
                // Copied out first: telling the entering frame can make a frame object, and so
                // run the GC and any Python it finalises.
                let open = self.open_scopes.with(py, |open| {
                    let mut copy = Vec::new();
                    copy.try_reserve(open.len()).ok()?;
                    copy.extend(open.iter().cloned());
                    Some(copy)
                });
                let open = open.ok_or_else(|| errors::no_memory(py))?;
                let owned = crate::shared::entered_here(&open);
                let any_open = !open.is_empty();
                let what = scope::describe(me);
                match owned {
                    Some(at) => {
                        let state = open[at].clone();
                        // Levels nested in its cycle on its own thread end with the cycle, as
                        // where it is unlinked there: their exits only unwind.
                        let orphans = crate::shared::orphan_nested_after(&open, at);
                        state.close();
                        self.exit_level(py, me, &state, orphans, None, clean)
                    }
                    None if any_open => Err(errors::new(
                        py,
                        errors::Class::Scope,
                        &format!(
                            "{what} exited on another thread or task than the one that entered it; nothing changed"
                        ),
                    )),
                    None => Err(errors::new(py, errors::Class::Scope, &format!("{what} is not open (exited twice?)"))),
                }
            }
        }
    }

    /// The loop form leaves the scope of `state`, wherever it runs (its iterator dropped on another
    /// thread closes it all the same).
    pub(crate) fn exit_state(
        &self,
        py: Python<'_>,
        me: &Bound<'_, PyAny>,
        state: &Arc<ScopeState>,
        clean: bool,
    ) -> PyResult<()> {
        match scope::pop(py, me, Some(state))? {
            scope::Popped::Innermost(_) => self.exit_level(py, me, state, 0, None, clean),
            scope::Popped::Unlinked(_, innermost, orphans) => {
                self.exit_level(py, me, state, orphans, Some(innermost), clean)
            }
            scope::Popped::NotHere => {
                // Closed from elsewhere: levels nested in its cycle on its own thread end with it.
                let orphans = self.open_scopes.with(py, |open| {
                    open.iter()
                        .rposition(|s| Arc::ptr_eq(s, state))
                        .map_or(0, |at| crate::shared::orphan_nested_after(open, at))
                });
                state.close();
                self.exit_level(py, me, state, orphans, None, clean)
            }
        }
    }

    /// After a scope left the stack (or was closed from elsewhere): it leaves the open scopes, its
    /// level ends, and an exit out of order warns.
    /// `orphans`: how many levels of this workspace nested in its cycle ended with it (their exits
    /// will only unwind); `unlinked_under`: the scope it was unlinked from under.
    fn exit_level(
        &self,
        py: Python<'_>,
        me: &Bound<'_, PyAny>,
        state: &Arc<ScopeState>,
        orphans: u32,
        unlinked_under: Option<String>,
        clean: bool,
    ) -> PyResult<()> {
        self.forget_scope(py, state);
        self.end_level(py, me, state, clean, orphans)?;
        if let Some(innermost) = unlinked_under {
            scope::warn_unlinked(py, &scope::describe(me), &innermost)?;
        }
        Ok(())
    }
}

/// Takes `levels` nested levels off the workspace's nesting: those of scopes whose cycle ends
/// under them (none are left once every cycle closed: nothing to undo then).
fn unnest(ws: &mut rustws_core::Workspace, levels: u32) {
    for _ in 0..levels {
        let _ = ws.unnest();
    }
}
