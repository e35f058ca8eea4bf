//! The Python stacks allocations are recorded with (`rustws.memory.record_history(stacks=
//! "python")`). Each distinct stack is numbered once; a recorded allocation carries its number,
//! and a snapshot turns numbers into frames. Off, asking costs one flag test.
//!
//! A stack is read through the frames' C API (no Python code runs): each frame's code object and
//! the offset of its current instruction, turned into a line only when a snapshot asks. The
//! cyclic garbage collector is held off while frame objects are made: a collection there could
//! run finalizers that free arrays of the workspace about to be locked. Where the GIL is not
//! held, or memory runs out, the allocation is recorded without a stack.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use pyo3::ffi;
use pyo3::prelude::*;

/// Frames kept of a stack, innermost first.
const DEPTH: usize = 64;

/// Distinct stacks numbered at most, until recording stops; allocations made at others are
/// recorded without a stack.
const MOST_STACKS: usize = 1 << 16;

static ON: AtomicBool = AtomicBool::new(false);

/// A stack: each frame's code object (its address) and the byte offset of its instruction.
type Key = Vec<(usize, i32)>;

extern "C" {
    /// Public C API of CPython 3.9+ and 3.11+ (outside the limited API's headers; exported by
    /// each interpreter 3.11 to 3.13): the calling frame (a new reference, or NULL) and the byte
    /// offset of a frame's last instruction (-1 before the first).
    fn PyFrame_GetBack(frame: *mut ffi::PyFrameObject) -> *mut ffi::PyFrameObject;
    fn PyFrame_GetLasti(frame: *mut ffi::PyFrameObject) -> std::ffi::c_int;
}

#[derive(Default)]
struct Table {
    ids: HashMap<Key, u32>,
    stacks: Vec<Key>,
    /// The code objects the stacks name, kept alive so that an address keeps naming its code.
    code: HashMap<usize, Py<PyAny>>,
}

static TABLE: Mutex<Option<Table>> = Mutex::new(None);

/// Records stacks from now on (or stops). Numbers given out stay valid until [`clear`].
pub(crate) fn set(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// Forgets every stack (the histories that numbered them were dropped) and the code objects
/// they kept alive.
pub(crate) fn clear() {
    let dropped = TABLE.lock().unwrap_or_else(|e| e.into_inner()).take();
    // The code objects go with the GIL held (the caller's), after the lock.
    drop(dropped);
}

pub(crate) fn is_on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// The number of the calling Python stack; 0 when stacks are not recorded, the GIL is not held
/// or memory ran out.
#[inline]
pub(crate) fn context() -> u32 {
    if !ON.load(Ordering::Relaxed) {
        return 0;
    }
    capture().unwrap_or(0)
}

#[cold]
fn capture() -> Option<u32> {
    if !crate::threadstate::holds_gil() {
        return None;
    }
    // SAFETY: the GIL is held (checked above).
    let py = unsafe { Python::assume_attached() };
    let mut key = Key::new();
    key.try_reserve_exact(DEPTH).ok()?;
    let mut codes: Vec<Bound<'_, PyAny>> = Vec::new();
    codes.try_reserve_exact(DEPTH).ok()?;
    // An exception the caller has set stays set: it is put aside while the frames are read.
    let (mut kind, mut value, mut trace) = (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: GIL held; takes the error indicator's references, restored below.
    unsafe { ffi::PyErr_Fetch(&mut kind, &mut value, &mut trace) };
    // SAFETY: GIL held; returns whether the collector was enabled.
    let collecting = unsafe { ffi::PyGC_Disable() } != 0;
    // SAFETY: GIL held; a borrowed reference (or NULL), made a strong one here.
    let mut frame = unsafe { Bound::from_borrowed_ptr_or_opt(py, ffi::PyEval_GetFrame().cast()) };
    while let Some(f) = frame {
        if key.len() == DEPTH {
            break;
        }
        // SAFETY: `f` is a frame object; the calls need only the GIL; the code and the calling
        // frame are new references (or NULL).
        let (code, lasti, back) = unsafe {
            let fp = f.as_ptr().cast::<ffi::PyFrameObject>();
            (
                Bound::<PyAny>::from_owned_ptr_or_opt(py, ffi::PyFrame_GetCode(fp).cast()),
                PyFrame_GetLasti(fp),
                Bound::<PyAny>::from_owned_ptr_or_opt(py, PyFrame_GetBack(fp).cast()),
            )
        };
        let Some(code) = code else { break };
        key.push((code.as_ptr() as usize, lasti));
        codes.push(code);
        frame = back;
    }
    if collecting {
        // SAFETY: GIL held; the collector goes back on as it was.
        unsafe { ffi::PyGC_Enable() };
    }
    // SAFETY: GIL held; an error the reads left is dropped, and the caller's is put back with the
    // references taken above.
    unsafe {
        ffi::PyErr_Clear();
        ffi::PyErr_Restore(kind, value, trace);
    }
    let mut table = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    let table = table.get_or_insert_with(Table::default);
    if let Some(&id) = table.ids.get(&key) {
        return Some(id);
    }
    if table.stacks.len() >= MOST_STACKS {
        return None;
    }
    let id = u32::try_from(table.stacks.len() + 1).ok()?;
    table.ids.try_reserve(1).ok()?;
    table.stacks.try_reserve(1).ok()?;
    table.code.try_reserve(codes.len()).ok()?;
    let mut copy = Key::new();
    copy.try_reserve_exact(key.len()).ok()?;
    copy.extend_from_slice(&key);
    for c in codes {
        table.code.entry(c.as_ptr() as usize).or_insert_with(|| c.unbind());
    }
    table.stacks.push(copy);
    table.ids.insert(key, id);
    Some(id)
}

/// The frames of stack `id` as `(code object, byte offset of its instruction)`, innermost first;
/// empty for 0 or an unknown number. `None` where the system had no room for the list.
pub(crate) fn frames(py: Python<'_>, id: u32) -> Option<Vec<(Py<PyAny>, i32)>> {
    let table = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    let mut out = Vec::new();
    let Some(t) = table.as_ref() else { return Some(out) };
    let Some(stack) = id.checked_sub(1).and_then(|i| t.stacks.get(i as usize)) else { return Some(out) };
    out.try_reserve_exact(stack.len()).ok()?;
    out.extend(stack.iter().filter_map(|(c, lasti)| t.code.get(c).map(|code| (code.clone_ref(py), *lasti))));
    Some(out)
}
