//! rustws-core: workspaces for loops that allocate the same memory every iteration.
//!
//! A [`Workspace`] learns how much memory one cycle of a loop needs, then serves every later cycle
//! from one pre-faulted [`ArenaRegion`], under the policies of a [`WorkspaceConfiguration`]. Memory
//! is never handed out again while a block in it is live: blocks that outlive their cycle are
//! pinned and the allocator works around them. Memory comes from a [`Backend`] (anonymous memory,
//! a memory-mapped file, the heap, or an adaptor over one of them). This crate knows nothing of
//! Python; the bindings live in a separate crate.
//!
//! Where each concern lives: `workspace` (cycles, the allocation ladder and the limit), `regions`
//! (the current region and retired ones), `arena` (a region, its free lists by class and its walk),
//! `classes` (size classes), `learner` (how large the arena is, under the learning and spill
//! policies), `external` (blocks outside the arena, their table and cache), `huge` (huge requests'
//! own mappings), `accounts` (counters and statistics), `history` (the timeline a workspace records
//! on request), `replay` (a recorded loop under another configuration), `config` (the policies),
//! `backend` and `cuda` (memory sources and adaptors), `error`, `fallible` (allocation that refuses
//! instead of aborting), `lock` (the lock the bindings keep a workspace behind), `lot` (empty regions handed on between workspaces entered in turn), `reserve` (a global allocator with an emergency reserve), `sanitizer`
//! (AddressSanitizer's poisoning).

mod accounts;
mod arena;
pub mod backend;
pub mod classes;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
mod external;
mod fallible;
pub mod history;
mod huge;
mod learner;
pub mod lock;
pub mod lot;
mod regions;
pub mod release;
pub mod replay;
pub mod reserve;
mod sanitizer;
pub mod workspace;

pub use accounts::{placed_size, CycleReport, WorkspaceStats};
pub use arena::{slot_for, BlockKind, HEADER};
pub use backend::{AnonymousMemory, Backend, FileMappedMemory, HeapMemory, LimitAdaptor, OpaqueMemory, BLOCK_ALIGN};
pub use config::{
    parse_size, AllocationPolicy, DebugMode, LearningPolicy, LocationPolicy, MirroringPolicy, ResetPolicy, SpillPolicy,
    WorkspaceConfiguration, MAX_CYCLES_BEFORE_INITIALIZATION,
};
pub use error::{BackendError, Cause, Error, Refusal};
pub use huge::HUGE_BLOCK_MIN;
pub use learner::NEED_WINDOW;
pub use workspace::{BlockInfo, Workspace, PREFAULT_LIMIT};
