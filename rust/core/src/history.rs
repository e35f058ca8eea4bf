//! What a workspace did, as a timeline: its blocks handed out and freed, the mappings it took
//! from the system and gave back, its refusals and its cycles. A [`Recorder`] sits in the
//! workspace's [`crate::LimitAdaptor`], the one door every mapping passes, so segments are seen
//! where they are made; the workspace adds its blocks, refusals and cycle ends. Off by default,
//! and then each allocation pays one test of a flag the workspace holds itself.
//!
//! Events go to a ring of `max_entries` reserved when recording starts: recording never
//! allocates on the way (a full ring drops its oldest event and counts it), so it stays on where
//! memory runs out, and the refusal is the last event it shows.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Instant;

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Action {
    /// A block was handed out: `addr` its data, `size` the bytes asked for.
    Alloc,
    /// A block was freed (its memory may serve the next request at once).
    Free,
    /// A mapping or block was taken from the system: `addr` its start, `size` its length.
    SegmentAlloc,
    /// A mapping or block went back to the system.
    SegmentFree,
    /// A request of `size` bytes was refused; `extra` is what the limit still granted.
    Oom,
    /// A cycle opened (`cycle` its number); `size` is the bytes live then.
    CycleOpen,
    /// A cycle closed; `size` is its peak bytes, `extra` its spills.
    CycleClose,
}

impl Action {
    /// Every action, in the order of their numbers (`action as u8`).
    pub const ALL: [Action; 7] = [
        Action::Alloc,
        Action::Free,
        Action::SegmentAlloc,
        Action::SegmentFree,
        Action::Oom,
        Action::CycleOpen,
        Action::CycleClose,
    ];

    /// The name PyTorch's memory snapshots give the action (cycles have none there).
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::Free => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::Oom => "oom",
            Action::CycleOpen => "cycle_open",
            Action::CycleClose => "cycle_close",
        }
    }
}

/// One event of the timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    pub action: Action,
    pub addr: usize,
    pub size: usize,
    /// The cycle it happened in (cycles completed before it).
    pub cycle: u64,
    /// Nanoseconds since the first event of the process.
    pub time_ns: u64,
    /// What the binding recorded about the caller (a stack's id; 0: nothing).
    pub context: u32,
    /// Where an allocated block lives ([`crate::BlockKind`] as a number; 0 for other events).
    pub kind: u8,
    /// See [`Action`].
    pub extra: u64,
}

/// The ring of events.
#[derive(Debug)]
pub struct History {
    events: VecDeque<Event>,
    max: usize,
    /// Events dropped because the ring was full.
    pub dropped: u64,
}

impl History {
    /// A ring of `max` events (at least one), its room reserved now; `None` where the system has
    /// no room for it.
    pub fn new(max: usize) -> Option<Self> {
        let max = max.max(1);
        let mut events = VecDeque::new();
        events.try_reserve_exact(max).ok()?;
        Some(History { events, max, dropped: 0 })
    }

    /// Adds an event, dropping the oldest when full: never allocates.
    pub fn push(&mut self, e: Event) {
        if self.events.len() >= self.max {
            self.events.pop_front();
            self.dropped += 1;
        }
        self.events.push_back(e);
    }

    pub fn events(&self) -> impl ExactSizeIterator<Item = &Event> {
        self.events.iter()
    }

    pub fn len(&self) -> usize {
        self.events.len()
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }
}

/// The ring size workspaces made from now on record into (0: they do not record).
static NEW_WORKSPACES: AtomicUsize = AtomicUsize::new(0);

/// Workspaces made from now on record their history into rings of `max_entries` events from the
/// start (their first mappings included); `None`: they do not record.
pub fn record_new_workspaces(max_entries: Option<usize>) {
    NEW_WORKSPACES.store(max_entries.map_or(0, |m| m.max(1)), Ordering::Relaxed);
}

/// The ring size a workspace made now records into, if it records.
pub fn new_workspace_ring() -> Option<usize> {
    Some(NEW_WORKSPACES.load(Ordering::Relaxed)).filter(|&m| m > 0)
}

/// Nanoseconds since the first call in the process.
pub fn now_ns() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    let start = START.get_or_init(Instant::now);
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// A workspace's recorder: its history while recording is on, the cycle it is in and the caller's
/// context for the next allocation. Shared between the workspace and its limit adaptor.
#[derive(Debug, Default)]
pub struct Recorder {
    on: AtomicBool,
    cycle: AtomicU64,
    context: AtomicU32,
    history: Mutex<Option<History>>,
}

impl Recorder {
    /// Whether events are recorded.
    #[inline]
    pub fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    fn history(&self) -> MutexGuard<'_, Option<History>> {
        self.history.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts recording into a ring of `max_entries` (the events so far are kept where the ring
    /// keeps its size), or stops and drops the history (`None`). `false` where the system had no
    /// room for the ring.
    pub fn set(&self, max_entries: Option<usize>) -> bool {
        let mut h = self.history();
        match max_entries {
            None => {
                self.on.store(false, Ordering::Relaxed);
                *h = None;
            }
            Some(max) if h.as_ref().is_some_and(|h| h.max == max.max(1)) => self.on.store(true, Ordering::Relaxed),
            Some(max) => {
                let Some(mut fresh) = History::new(max) else { return false };
                if let Some(old) = h.take() {
                    for e in old.events() {
                        fresh.push(*e);
                    }
                    fresh.dropped += old.dropped;
                }
                *h = Some(fresh);
                self.on.store(true, Ordering::Relaxed);
            }
        }
        true
    }

    /// Records an event of the cycle the workspace is in, with the pending context for blocks.
    pub fn record(&self, action: Action, addr: usize, size: usize, kind: u8, extra: u64) {
        if !self.is_on() {
            return;
        }
        let context = if action == Action::Alloc { self.context.swap(0, Ordering::Relaxed) } else { 0 };
        let cycle = self.cycle.load(Ordering::Relaxed);
        let e = Event { action, addr, size, cycle, time_ns: now_ns(), context, kind, extra };
        if let Some(h) = self.history().as_mut() {
            h.push(e);
        }
    }

    /// The cycle events are recorded in from now on.
    pub fn set_cycle(&self, cycle: u64) {
        self.cycle.store(cycle, Ordering::Relaxed);
    }

    /// The context the next allocation is recorded with (the caller's stack, as the binding
    /// numbers them).
    pub fn set_context(&self, context: u32) {
        self.context.store(context, Ordering::Relaxed);
    }

    /// A copy of the recorded events `pick` keeps (oldest first); `None` where the system had no
    /// room for the copy.
    pub fn select(&self, pick: impl Fn(&Event) -> bool) -> Option<Vec<Event>> {
        let h = self.history();
        let mut out = Vec::new();
        if let Some(h) = h.as_ref() {
            for e in h.events().filter(|e| pick(e)) {
                out.try_reserve(1).ok()?;
                out.push(*e);
            }
        }
        Some(out)
    }

    /// A copy of the events recorded (oldest first) and how many were dropped; `None` where the
    /// system had no room for the copy.
    pub fn events(&self) -> Option<(Vec<Event>, u64)> {
        let h = self.history();
        let Some(h) = h.as_ref() else { return Some((Vec::new(), 0)) };
        let mut out = Vec::new();
        out.try_reserve_exact(h.len()).ok()?;
        out.extend(h.events().copied());
        Some((out, h.dropped))
    }
}

/// A mapping or block of a workspace's memory at one moment, and the live blocks in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    pub kind: SegmentKind,
    /// Where it starts and its length (what the system handed out).
    pub address: usize,
    pub size: usize,
    /// Its live blocks, by address.
    pub blocks: Vec<LiveBlock>,
}

/// What a segment is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum SegmentKind {
    /// The current arena region.
    Region,
    /// A region replaced by a larger one (or by `destroy`), kept while blocks in it live.
    Retired,
    /// A block of its own outside the arena (live or cached).
    External,
    /// A huge request's mapping (live or cached).
    Huge,
}

impl SegmentKind {
    /// Every kind, in the order of their numbers (`kind as u8`).
    pub const ALL: [SegmentKind; 4] =
        [SegmentKind::Region, SegmentKind::Retired, SegmentKind::External, SegmentKind::Huge];

    pub fn name(self) -> &'static str {
        match self {
            SegmentKind::Region => "arena",
            SegmentKind::Retired => "retired arena",
            SegmentKind::External => "external",
            SegmentKind::Huge => "huge",
        }
    }
}

/// A live block in a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveBlock {
    /// Its data.
    pub addr: usize,
    /// Bytes it occupies from `addr` (its size class, or its block's length).
    pub size: usize,
    /// Bytes asked for.
    pub requested: usize,
    /// Whether it outlived the cycle it was made in (pinned).
    pub pinned: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tables_of_actions_and_kinds_follow_their_numbers() {
        assert!(Action::ALL.iter().enumerate().all(|(i, a)| *a as usize == i));
        assert!(SegmentKind::ALL.iter().enumerate().all(|(i, k)| *k as usize == i));
    }

    #[test]
    fn a_full_ring_drops_its_oldest_events() {
        let r = Recorder::default();
        r.record(Action::Alloc, 1, 1, 0, 0);
        assert_eq!(r.events().unwrap().0.len(), 0, "off: nothing recorded");
        assert!(r.set(Some(3)));
        r.set_cycle(7);
        for addr in 1..=5 {
            r.set_context(addr as u32 * 10);
            r.record(Action::Alloc, addr, 8, 1, 0);
        }
        let (events, dropped) = r.events().unwrap();
        assert_eq!(dropped, 2);
        assert_eq!(events.iter().map(|e| e.addr).collect::<Vec<_>>(), [3, 4, 5]);
        assert!(events.iter().all(|e| e.cycle == 7 && e.context == e.addr as u32 * 10));
        assert!(events.windows(2).all(|w| w[0].time_ns <= w[1].time_ns));
        r.record(Action::Free, 5, 8, 0, 0);
        assert_eq!(r.events().unwrap().0.last().unwrap().context, 0, "contexts are for allocations");
        assert!(r.set(Some(10)), "a larger ring keeps what was recorded");
        assert_eq!(r.events().unwrap().0.len(), 3);
        assert!(r.set(None));
        assert!(!r.is_on() && r.events().unwrap().0.is_empty());
    }
}
