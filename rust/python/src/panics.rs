//! The panic hook of the extension: a panic in this library (a bug) reports its message and
//! location on standard error without taking a backtrace, whose symbolisation would allocate
//! megabytes where there may be none (memory exhaustion is when the extension works hardest);
//! PyO3 turns the panic into a Python exception as usual. Allocations themselves go through
//! `rustws_core::reserve::ReserveAllocator`, this module's `#[global_allocator]`.

use std::io::Write;

#[global_allocator]
static ALLOCATOR: rustws_core::reserve::ReserveAllocator = rustws_core::reserve::ReserveAllocator;

/// Reports a panic of this library on standard error: its location and message, formatted into
/// a buffer on the stack (nothing is allocated), and no backtrace.
fn report_panic(info: &std::panic::PanicHookInfo<'_>) {
    let mut buf = [0u8; 512];
    let mut out = std::io::Cursor::new(&mut buf[..]);
    let payload = info.payload();
    let message =
        payload.downcast_ref::<&str>().copied().or_else(|| payload.downcast_ref::<String>().map(String::as_str));
    let _ = match (info.location(), message) {
        (Some(at), Some(m)) => writeln!(out, "rustws panicked at {at}: {m}"),
        (Some(at), None) => writeln!(out, "rustws panicked at {at}"),
        (None, Some(m)) => writeln!(out, "rustws panicked: {m}"),
        (None, None) => writeln!(out, "rustws panicked"),
    };
    let n = out.position() as usize;
    // SAFETY: writes the first `n` bytes of `buf` to standard error; a failed write is ignored.
    unsafe { libc::write(2, buf.as_ptr().cast(), n) };
}

/// Installs the panic hook (see the module docs). Called when the module is imported.
pub(crate) fn install_panic_hook() {
    std::panic::set_hook(Box::new(report_panic));
}
