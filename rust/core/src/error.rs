//! The core's one error type, and the refusals of memory sources. Each [`Error`] variant maps to
//! exactly one Python exception class in the bindings.
//!
//! Errors travel on out-of-memory paths, so building, copying or passing one never allocates:
//! they carry numbers, `&'static str` and the workspace's name (an `Arc<str>`, which clones without
//! allocating). Messages are formatted only where they are shown ([`fmt::Display`] here, or the
//! bindings, which format them in Python where a failure to format is itself a `MemoryError`).
//! The one exception is [`Error::InvalidConfig`] and [`Error::Unavailable`]'s detail, made when a
//! configuration is validated or a device is probed, never on an allocation.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

/// A workspace's name as errors carry it: cloning it never allocates, so that building an error
/// on an out-of-memory path cannot itself run out of memory.
pub type Name = Arc<str>;

/// Why a memory source refused (see [`crate::Backend`]): what it was asked, for how many bytes,
/// and the cause, as numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendError {
    /// What was asked of the source: `"mmap"`, `"malloc"`, `"cuMemAlloc"` ...
    pub op: &'static str,
    /// The bytes asked for.
    pub bytes: usize,
    pub cause: Cause,
}

/// The cause of a [`BackendError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// The operating system refused, with this `errno`.
    Os(i32),
    /// The CUDA driver refused, with this `CUresult` (its name and description are static
    /// strings of the driver's).
    Driver { code: u32, name: &'static str, text: &'static str },
    /// A limit: `held` bytes are held through the source already, of `limit`.
    Limit { limit: usize, held: usize },
    /// The source itself refused the request, for the reason given.
    Refused(&'static str),
}

impl BackendError {
    pub const fn os(op: &'static str, bytes: usize, errno: i32) -> Self {
        BackendError { op, bytes, cause: Cause::Os(errno) }
    }

    /// The calling thread's `errno` as the cause.
    pub fn last_os(op: &'static str, bytes: usize) -> Self {
        Self::os(op, bytes, std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    }

    pub const fn refused(op: &'static str, bytes: usize, why: &'static str) -> Self {
        BackendError { op, bytes, cause: Cause::Refused(why) }
    }

    /// Whether a limit refused it (the workspace's `max_size`, or a limit adaptor's).
    pub fn is_limit(&self) -> bool {
        matches!(self.cause, Cause::Limit { .. })
    }
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} of {} bytes failed: ", self.op, self.bytes)?;
        match self.cause {
            Cause::Os(errno) => write!(f, "{}", std::io::Error::from_raw_os_error(errno)),
            Cause::Driver { code, name, text: "" } => write!(f, "{name} (CUDA error {code})"),
            Cause::Driver { code, name, text } => write!(f, "{name}: {text} (CUDA error {code})"),
            Cause::Limit { limit, held } => write!(f, "limit of {limit} bytes reached ({held} held)"),
            Cause::Refused(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for BackendError {}

/// A request the workspace refused under its own rules (its limit, its spill policy), with what
/// it held when it refused.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    pub workspace: Name,
    /// Bytes asked for (`u64::MAX` where the count itself overflowed).
    pub requested: u64,
    /// Requested bytes of live blocks, in the arena and outside it.
    pub in_use: u64,
    /// The limit: `max_size`, or the arena's capacity where there is none.
    pub limit: u64,
    /// Bytes the workspace held when it refused: arena regions, blocks outside the arena (live
    /// and cached) and huge mappings, all that `max_size` bounds.
    pub footprint: u64,
    /// Of `in_use`, the bytes of blocks that outlived their cycle (pinned).
    pub pinned: u64,
    /// Bytes the workspace kept for reuse (cached blocks and mappings) when it refused, after
    /// giving back what it could.
    pub cached: u64,
    /// The largest request the arena's free memory could still have served wherever its
    /// largest run between live blocks lies (a size class whose slot, header and filler fit the
    /// run; 0 without an arena).
    pub largest_free: u64,
    /// Bytes the live blocks take where they lie, as [`crate::placed_size`] counts a request's (a
    /// huge block's whole mapping).
    pub held: u64,
    /// Where the arena's last live block ends (0 without one): a request no free run served
    /// fits an arena of the same blocks past that point.
    pub live_end: u64,
    /// Bytes the limit still granted for new mappings and blocks.
    pub room: u64,
    pub reason: &'static str,
}

/// Everything that can go wrong in the core.
#[derive(Debug, Clone, PartialEq)]
pub enum Error {
    /// A configuration field holds an invalid value or combination.
    InvalidConfig { field: &'static str, message: String },
    /// A request the workspace cannot serve under its limits and spill policy.
    OutOfMemory(Refusal),
    /// The operating system (or an upstream backend) refused memory: `requested` bytes, while the
    /// workspace's live blocks held `in_use` requested bytes under `limit` (as in [`Refusal`]:
    /// `max_size`, or the arena's capacity where there is none).
    SystemOutOfMemory { workspace: Name, requested: u64, in_use: u64, limit: u64, cause: BackendError },
    /// The workspace was destroyed.
    Destroyed { workspace: Name },
    /// An operation that needs an open cycle found none.
    NotOpen { workspace: Name, operation: &'static str },
    /// A backend cannot be used here (no driver, no device, bad ordinal), or a device refused an
    /// operation (`cause`).
    Unavailable { what: Cow<'static, str>, cause: Option<BackendError> },
}

impl Error {
    /// The workspace `workspace` was destroyed.
    pub fn destroyed(workspace: &Name) -> Self {
        Error::Destroyed { workspace: workspace.clone() }
    }

    /// `operation` needs an open cycle of `workspace`, and none is open.
    pub fn not_open(workspace: &Name, operation: &'static str) -> Self {
        Error::NotOpen { workspace: workspace.clone(), operation }
    }

    /// The system (or a backend under the workspace) refused `requested` bytes for `cause`, with
    /// `in_use` bytes live under `limit`.
    pub fn system(workspace: &Name, requested: u64, in_use: u64, limit: u64, cause: BackendError) -> Self {
        Error::SystemOutOfMemory { workspace: workspace.clone(), requested, in_use, limit, cause }
    }

    /// A device that refused `cause` (a fill, a copy).
    pub fn device(what: &'static str, cause: BackendError) -> Self {
        Error::Unavailable { what: Cow::Borrowed(what), cause: Some(cause) }
    }

    /// A backend that cannot be used, for the reason given.
    pub fn unavailable(what: impl Into<Cow<'static, str>>) -> Self {
        Error::Unavailable { what: what.into(), cause: None }
    }

    /// Whether this is a refusal of memory (the workspace's or the system's).
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Error::OutOfMemory(_) | Error::SystemOutOfMemory { .. })
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidConfig { field, message } => write!(f, "invalid {field}: {message}"),
            Error::OutOfMemory(r) => write!(
                f,
                "workspace {:?} cannot allocate {} bytes: {} bytes in use, limit {} bytes ({})",
                r.workspace, r.requested, r.in_use, r.limit, r.reason
            ),
            Error::SystemOutOfMemory { workspace, requested, in_use, limit, cause } => write!(
                f,
                "workspace {workspace:?} cannot allocate {requested} bytes: {in_use} bytes in use, limit {limit} \
                 bytes (the system refused memory: {cause})"
            ),
            Error::Destroyed { workspace } => write!(f, "workspace {workspace:?} was destroyed"),
            Error::NotOpen { workspace, operation } => {
                write!(f, "workspace {workspace:?} has no open cycle: {operation} needs one")
            }
            Error::Unavailable { what, cause: None } => f.write_str(what),
            Error::Unavailable { what, cause: Some(c) } => write!(f, "{what}: {c}"),
        }
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_say_what_was_refused_and_why() {
        let e = BackendError::os("mmap", 4096, 12);
        assert_eq!(e.to_string(), format!("mmap of 4096 bytes failed: {}", std::io::Error::from_raw_os_error(12)));
        let l = BackendError { op: "map", bytes: 10, cause: Cause::Limit { limit: 64, held: 60 } };
        assert!(l.is_limit() && !e.is_limit());
        assert!(l.to_string().contains("limit of 64 bytes reached (60 held)"), "{l}");
        let r = Error::OutOfMemory(Refusal {
            workspace: Name::from("W"),
            requested: 100,
            in_use: 7,
            limit: 64,
            footprint: 64,
            pinned: 0,
            cached: 0,
            largest_free: 0,
            held: 64,
            live_end: 0,
            room: 0,
            reason: "max_size reached",
        });
        assert!(r.is_out_of_memory());
        assert_eq!(
            r.to_string(),
            "workspace \"W\" cannot allocate 100 bytes: 7 bytes in use, limit 64 bytes (max_size reached)"
        );
        let s = Error::system(&Name::from("W"), 100, 7, 64, BackendError::refused("mmap", 100, "no"));
        assert!(s.is_out_of_memory());
        assert_eq!(
            s.to_string(),
            "workspace \"W\" cannot allocate 100 bytes: 7 bytes in use, limit 64 bytes (the system refused memory: \
             mmap of 100 bytes failed: no)"
        );
        let d = Error::device("a copy on the device failed", BackendError::refused("copy", 8, "no"));
        assert_eq!(d.to_string(), "a copy on the device failed: copy of 8 bytes failed: no");
    }

    /// An error is moved and cloned on out-of-memory paths: none of its parts may need the heap.
    #[test]
    fn refusals_are_built_without_the_heap() {
        fn copy<T: Copy>() {}
        copy::<BackendError>();
        copy::<Cause>();
        // A name clones by reference count.
        let name = Name::from("W");
        let again = name.clone();
        assert!(Arc::ptr_eq(&name, &again));
    }
}
