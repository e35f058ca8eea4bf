//! The core's one error type. Each variant maps to exactly one Python exception class in the
//! bindings; messages name the workspace, the request and the limit where there is one.

use std::fmt;
use std::sync::Arc;

/// A workspace's name as errors carry it: cloning it never allocates, so that building an error
/// on an out-of-memory path cannot itself run out of memory.
pub type Name = Arc<str>;

/// Everything that can go wrong in the core.
#[derive(Debug, Clone, PartialEq)]
pub enum Error {
    /// A configuration field holds an invalid value or combination.
    InvalidConfig { field: &'static str, message: String },
    /// A request the workspace cannot serve under its limits and spill policy.
    OutOfMemory { workspace: Name, requested: u64, in_use: u64, limit: u64, reason: &'static str },
    /// The operating system (or an upstream backend) refused memory.
    SystemOutOfMemory { workspace: Name, requested: u64, detail: String },
    /// The workspace was destroyed.
    Destroyed { workspace: Name },
    /// An operation that needs an open cycle found none.
    NotOpen { workspace: Name, operation: &'static str },
    /// A backend cannot be used here (no driver, no device, bad ordinal).
    Unavailable { what: String },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidConfig { field, message } => write!(f, "invalid {field}: {message}"),
            Error::OutOfMemory { workspace, requested, in_use, limit, reason } => write!(
                f,
                "workspace {workspace:?} cannot allocate {requested} bytes: {in_use} bytes in use, limit {limit} bytes ({reason})"
            ),
            Error::SystemOutOfMemory { workspace, requested, detail } => write!(
                f,
                "workspace {workspace:?} cannot allocate {requested} bytes: the system refused memory ({detail})"
            ),
            Error::Destroyed { workspace } => write!(f, "workspace {workspace:?} was destroyed"),
            Error::NotOpen { workspace, operation } => {
                write!(f, "workspace {workspace:?} has no open cycle: {operation} needs one")
            }
            Error::Unavailable { what } => write!(f, "{what}"),
        }
    }
}

impl std::error::Error for Error {}
