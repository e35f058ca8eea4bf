//! Values made once per process, in cells that a fork never leaves half made.
//!
//! PyO3's `PyOnceLock::get_or_init` marks its cell as being initialised, then lets go of the
//! GIL while it waits for it: another thread can run Python meanwhile, and an `os.fork()` there
//! gives the child a cell marked as being initialised by a thread the child does not have, which
//! every later use in the child waits for forever. Here a value is made with no cell held (the
//! making may run Python and let other threads run), then stored under the GIL, which a fork
//! cannot interleave with: two threads racing both make one, and the first stored wins. What
//! PyO3's and rust-numpy's own cells hold is made at import, in the module's init.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

/// `cell`'s value, made by `make` where there is none yet.
#[inline]
pub(crate) fn get_or_make<'a, T>(cell: &'a PyOnceLock<T>, py: Python<'_>, make: impl FnOnce() -> T) -> &'a T {
    match cell.get(py) {
        Some(v) => v,
        None => make_and_store(cell, py, || Ok::<T, std::convert::Infallible>(make())).unwrap_or_else(|e| match e {}),
    }
}

/// `cell`'s value, made by `make` where there is none yet; a failure stores nothing.
#[inline]
pub(crate) fn get_or_try_make<'a, T, E>(
    cell: &'a PyOnceLock<T>,
    py: Python<'_>,
    make: impl FnOnce() -> Result<T, E>,
) -> Result<&'a T, E> {
    match cell.get(py) {
        Some(v) => Ok(v),
        None => make_and_store(cell, py, make),
    }
}

#[cold]
#[inline(never)]
fn make_and_store<'a, T, E>(
    cell: &'a PyOnceLock<T>,
    py: Python<'_>,
    make: impl FnOnce() -> Result<T, E>,
) -> Result<&'a T, E> {
    let value = make()?;
    // Another thread's value, stored first, stays; ours is dropped here, with the GIL held.
    let _ = cell.set(py, value);
    match cell.get(py) {
        Some(v) => Ok(v),
        // `set` either stored the value or found one: the cell is never empty after it.
        None => unreachable!("a PyOnceLock is set after set"),
    }
}
