//! The lot: empty arena regions that workspaces entered in turn hand on to each other.
//!
//! A program that enters several workspaces one after another (one per layer of a network, as
//! DL4J code ported to Python may) would otherwise keep one arena resident per workspace while
//! the others run, where a plain process serves every layer from the same freed heap memory.
//! So a workspace whose cycles alternate with another's on its thread parks its region here once
//! the region holds no live block and no cycle of its own is open, and the next workspace that
//! opens takes over the region parked last that it fits in (one mapping up to four times its
//! need), pages resident and all, instead of mapping and pre-faulting one of its own. A region
//! changes hands only empty: blocks carry their region's owner and id in their headers, and the
//! new owner gives it its own.
//!
//! The lot holds at most [`LOT_MAX`] regions (the oldest goes back to the system when one more
//! is parked), a region nobody took for two turns of the workspaces in turn goes back (they
//! need fewer than were made before they were found to be in turn), and those a workspace parked
//! go back when it is dropped or destroyed. A turn is the parks and takes between two takes of
//! one workspace, the longest seen lately and [`LOT_AGE`] at least: a region the wide layers of
//! a backward pass need at once waits out the narrow forward pass between, however many layers
//! it has. Parks and takes only try its lock: a lot another thread is using is passed by. A
//! workspace going away, and a look at what the lot holds, wait for it a bounded while.

use crate::arena::ArenaRegion;
use crate::lock::SpinLock;

/// The most regions the lot keeps.
pub(crate) const LOT_MAX: usize = 4;

/// Parks and takes after which a region nobody took goes back to the system, at least (see
/// [`Lot::age`]).
pub(crate) const LOT_AGE: u64 = 8;

/// The longest turn counted, in parks and takes: a workspace that takes a region rarely (a
/// validation loop's, every thousand steps) keeps none parked that long for it.
const TURN_MAX: u64 = 256;

/// Parks and takes for which the widest need a region was taken for keeps regions taken for
/// narrower ones that wide (see [`take`]).
pub(crate) const WIDE_FOR: u64 = 64;

/// A parked region, the token of the workspace that parked it, and when.
struct Parked {
    region: ArenaRegion,
    by: u64,
    at: u64,
}

struct Lot {
    parked: Vec<Parked>,
    /// Parks and takes so far.
    events: u64,
    /// The widest need a region was asked for, and the count of events until which it holds.
    wide: (usize, u64),
    /// The longest turn seen lately (events between two takes of one workspace), and the count
    /// of events until which it holds (two such turns).
    turn: (u64, u64),
}

impl Lot {
    /// Counts a park or take, and moves the regions that have waited too long to `gone`
    /// (room for [`LOT_MAX`] of them reserved): two turns, or [`LOT_AGE`] events.
    fn age(&mut self, gone: &mut Vec<Parked>) {
        self.events += 1;
        let wait = LOT_AGE.max(self.turn.0.saturating_mul(2));
        let mut i = 0;
        while i < self.parked.len() {
            if self.events - self.parked[i].at > wait && gone.len() < gone.capacity() {
                gone.push(self.parked.remove(i));
            } else {
                i += 1;
            }
        }
    }
}

static LOT: SpinLock<Lot> = SpinLock::new(Lot { parked: Vec::new(), events: 0, wide: (0, 0), turn: (0, 0) });

/// The lot's lock where waiting for it is worth a little: it is held for a few list operations
/// at a time, but a child forked while another thread held it finds it held for good, and must
/// not hang for it (the lot just stays out of its reach).
fn lock_briefly() -> Option<crate::lock::SpinGuard<'static, Lot>> {
    for _ in 0..1000 {
        if let Some(lot) = LOT.try_lock() {
            return Some(lot);
        }
        std::thread::yield_now();
    }
    None
}

/// Room for the regions a park or take sends back to the system, made before the lot's lock is
/// taken (none where the system has none: nothing then ages out).
fn room_for_gone() -> Vec<Parked> {
    let mut gone = Vec::new();
    let _ = gone.try_reserve_exact(LOT_MAX);
    gone
}

/// Parks `region`, empty, rewound and mapped through the bare memory source (no workspace's
/// limit counts it), on behalf of workspace `by`. Gives it back where the lot is busy or has no
/// room for its entry.
#[must_use = "a region not parked is the caller's still"]
pub(crate) fn park(region: ArenaRegion, by: u64) -> Option<ArenaRegion> {
    debug_assert_eq!(region.live_blocks(), 0);
    let mut gone = room_for_gone();
    let Some(mut lot) = LOT.try_lock() else { return Some(region) };
    let room = LOT_MAX.saturating_sub(lot.parked.len());
    if lot.parked.try_reserve_exact(room).is_err() {
        return Some(region);
    }
    lot.age(&mut gone);
    let oldest = (lot.parked.len() >= LOT_MAX).then(|| lot.parked.remove(0));
    let at = lot.events;
    lot.parked.push(Parked { region, by, at });
    drop(lot);
    // Unmapped outside the lock.
    drop((oldest, gone));
    None
}

/// Takes a parked region that can serve `capacity` bytes in place: one mapping at least that
/// much and at most `max_mapped` bytes, the one parked last (its pages are the warmest, and
/// those parked before it age out where fewer regions serve than were parked). Returns it with
/// what it should serve from now on: `capacity`, or the widest need any region was asked for
/// within the last [`WIDE_FOR`] parks and takes, if that is more (layers of different widths
/// hand regions on without giving back pages that the next wider one faults in again; once the
/// widest stops asking, regions shrink to what is still asked for). `last_take` is the taker's
/// own record of the events counted at its last take (0: none), which this one updates.
pub(crate) fn take(capacity: usize, max_mapped: usize, last_take: &mut u64) -> Option<(ArenaRegion, usize)> {
    let mut gone = room_for_gone();
    let mut lot = LOT.try_lock()?;
    if capacity >= lot.wide.0 || lot.events > lot.wide.1 {
        lot.wide = (capacity, lot.events + WIDE_FOR);
    }
    let events = lot.events;
    let turn = events.wrapping_sub(*last_take);
    if *last_take > 0 && turn <= TURN_MAX && (turn >= lot.turn.0 || events > lot.turn.1) {
        lot.turn = (turn, events + 2 * turn);
    }
    *last_take = events.max(1);
    let serve = lot.wide.0.max(capacity);
    let fits = |p: &&Parked| (capacity..=max_mapped).contains(&p.region.mapped());
    let parked = &lot.parked;
    let pick = parked.iter().filter(fits).max_by_key(|p| p.at);
    let at = pick.and_then(|pick| parked.iter().position(|p| std::ptr::eq(p, pick)));
    let taken = at.map(|at| (lot.parked.remove(at).region, serve));
    lot.age(&mut gone);
    drop(lot);
    // Unmapped outside the lock.
    drop(gone);
    taken
}

/// Returns to the system the regions workspace `by` parked (it is going away, and nothing else
/// is known to want them). Where it parked some and that leaves the lot empty, the widest need
/// and the longest turn seen go too: they were the workspaces' that are going away, not those
/// that come next (a workspace that parked nothing, dropped while the others in turn hold their
/// regions, leaves them be).
pub(crate) fn evict(by: u64) {
    let gone: Vec<Parked> = {
        let mut gone = room_for_gone();
        let Some(mut lot) = lock_briefly() else { return };
        let mut i = 0;
        while i < lot.parked.len() {
            if lot.parked[i].by == by && gone.len() < gone.capacity() {
                gone.push(lot.parked.remove(i));
            } else {
                i += 1;
            }
        }
        if !gone.is_empty() && lot.parked.is_empty() {
            (lot.wide, lot.turn) = ((0, 0), (0, 0));
        }
        gone
    };
    // Unmapped outside the lock.
    drop(gone);
}

/// Regions in the lot, and the bytes they serve (none where it cannot be reached).
pub fn parked() -> (usize, usize) {
    let Some(lot) = lock_briefly() else { return (0, 0) };
    (lot.parked.len(), lot.parked.iter().map(|p| p.region.capacity()).sum())
}
