//! The cycle learner: how much memory one cycle needs, and when the arena is mapped, grown or
//! shrunk, under the learning and spill policies.
//!
//! A cycle's *need* is the peak of the slot bytes the cycle itself has live, plus the blocks of
//! earlier cycles it freed (state a loop replaces every cycle, live beside the new state until
//! then): blocks kept on (results a loop appends to a list) are not need, so they never grow or
//! remap the arena however many there are. The learning cycles of ND4J's policies, which size the
//! arena once, count what they leave live once more (the state the next cycle will replace).
//! ND4J's policies keep their meaning: `NONE` never learns; `FIRST_LOOP` learns the first
//! `cycles_before_initialization` cycles (at least one) and sizes the arena once; `OVER_TIME` does
//! the same, then grows after a cycle that spilled; so does `REALLOCATE`, whatever the learning
//! policy. The adaptive profile follows the largest need of the last [`NEED_WINDOW`] cycles: it
//! grows after a cycle that needed more, and shrinks once an outlier has left the window. An
//! outlier that recurs (the arena grows back to at least half the size it shrank from, within
//! twice the window: batches of changing sizes) is held longer, twice as long each time it comes
//! back, up to [`MAX_HOLD`] cycles, so that the arena is not remapped and faulted in again every
//! few cycles; a hold that runs out and is not followed by a recurrence is forgotten.
//!
//! Spills that happened while blocks of earlier cycles were in the arena are the arena's
//! fragmentation around kept memory, not need: they never grow it (the external block cache
//! serves them). Spills from an arena that held nothing kept, where a spilled request found as
//! many bytes free in the arena as it asked for (its free memory cut into runs too small), grow
//! it by what spilled and was outside at once (a temporary spilled again and again counts once);
//! where the arena was too small for the request itself, the cycle's need says how much it
//! lacked, under the adaptive profile (ND4J's policies grow by the spill, as they did).

use crate::backend::{round_to_page, HUGE_PAGE};
use crate::config::{AllocationPolicy, LearningPolicy, SpillPolicy, WorkspaceConfiguration};

/// Cycles whose needs the adaptive profile remembers: the arena follows their maximum.
pub const NEED_WINDOW: usize = 8;

/// The most cycles a recurring outlier's need is held after it last recurred.
pub const MAX_HOLD: u64 = 256;

/// A shrink this many cycles or fewer before a growth back was too early: the need recurs.
const REGROWN_WITHIN: u64 = 2 * NEED_WINDOW as u64;

/// Arenas at least this large are rounded to whole 2 MiB huge pages.
const HUGE_ROUND_THRESHOLD: usize = 64 << 20;

/// What one cycle showed, for the learner.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CycleFacts {
    /// Peak slot bytes the cycle itself had live, plus those of earlier blocks it freed.
    pub need: usize,
    /// Slot bytes of the cycle's blocks still live at its end (they escape it).
    pub escaped: usize,
    /// Slot bytes served outside an initialised arena, as many as were outside at once: the
    /// room the arena lacked.
    pub spilled: usize,
    /// Whether blocks of earlier cycles were in the arena when the cycle opened.
    pub kept_in_arena: bool,
    /// Whether a spill found as many bytes free in the arena as it asked for (counting only the
    /// cycle's own blocks in it, so that this errs towards true): the arena was cut into runs
    /// too small, not too small itself. Where it was too small, the cycle's own live bytes
    /// outgrew it, and `need` counts them.
    pub spilled_in_room: bool,
    /// Whether blocks pinned in the arena's current region at an earlier cycle's end still live
    /// at its end: a region replacing it would be added beside it until they die, which for
    /// results kept from cycle to cycle is never (state that each cycle replaces dies in the
    /// next one, and does not count).
    pub pinned_in_arena: bool,
}

/// What to do with the arena after a cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sizing {
    Keep,
    /// Map a region of `capacity` bytes; pre-fault the first `prefault` of them.
    Map {
        capacity: usize,
        prefault: usize,
    },
}

#[derive(Debug, Default, Clone)]
pub(crate) struct CycleLearner {
    pub cycles_learned: u64,
    /// The need the arena is sized after.
    pub need: usize,
    /// The adaptive profile's recent needs, by generation modulo the window.
    recent: [usize; NEED_WINDOW],
    /// Whether the arena was sized from what was learned (always for `NONE`).
    pub initialized: bool,
    /// The adaptive profile's last sizing: the need, the arena it left, and the target it
    /// computed (cycles that change neither skip the arithmetic).
    last: (usize, usize, usize),
    /// The adaptive profile's recurring outlier.
    hold: Hold,
}

/// A need the adaptive profile shrank away from and grew back to soon after: held, beside the
/// window, for `len` cycles after a cycle last needed as much.
#[derive(Debug, Default, Clone)]
struct Hold {
    need: usize,
    /// The generation up to which it is held.
    until: u64,
    /// How long it is held: doubled each time the need comes back too soon after a shrink.
    len: u64,
    /// The generation of the last shrink and the capacity it shrank from, until the next growth
    /// or until it is too long ago to count.
    shrunk: Option<(u64, usize)>,
}

/// Arena capacity for a need of `need` bytes under the allocation policy and limits.
pub(crate) fn capacity_for(c: &WorkspaceConfiguration, need: usize) -> usize {
    let base = need.max(c.initial_size as usize);
    let mut cap = match c.policy_allocation {
        AllocationPolicy::Overallocate => base.saturating_add((base as f64 * c.overallocation_limit) as usize),
        _ => base,
    };
    cap = cap.max(c.min_size as usize);
    cap = if cap >= HUGE_ROUND_THRESHOLD {
        cap.div_ceil(HUGE_PAGE).saturating_mul(HUGE_PAGE)
    } else {
        round_to_page(cap)
    };
    if c.temp_block_size > 0 {
        let g = c.temp_block_size as usize;
        cap = cap.div_ceil(g).saturating_mul(g);
    }
    if c.max_size > 0 {
        cap = cap.min(c.max_size as usize / crate::BLOCK_ALIGN * crate::BLOCK_ALIGN);
    }
    cap
}

/// A region to replace one of `current` bytes that stays mapped beside it: `target`, or twice
/// `current` where that is more, within `max_size`.
fn grown_beside(c: &WorkspaceConfiguration, target: usize, current: usize) -> usize {
    let doubled = round_to_page(current.saturating_mul(2));
    let cap = target.max(doubled);
    if c.max_size > 0 {
        cap.min(c.max_size as usize / crate::BLOCK_ALIGN * crate::BLOCK_ALIGN).max(target)
    } else {
        cap
    }
}

impl CycleLearner {
    pub fn new(config: &WorkspaceConfiguration) -> Self {
        CycleLearner { initialized: config.policy_learning == LearningPolicy::None, ..Default::default() }
    }

    /// The outermost cycle `generation` ended with `facts`, and the arena holds `current` bytes:
    /// what to do with it. `uses_arena`: false when the allocation or debug policy keeps every
    /// block outside an arena (the learner still learns, for the statistics).
    #[inline(always)]
    pub fn end_cycle(
        &mut self,
        c: &WorkspaceConfiguration,
        generation: u64,
        facts: CycleFacts,
        current: usize,
        uses_arena: bool,
    ) -> Sizing {
        // Spills from an arena holding nothing kept: it is too small for this cycle (or too
        // fragmented by it), by what spilled and was outside at once.
        let short = if facts.spilled > 0 && !facts.kept_in_arena && current > 0 {
            current.saturating_add(facts.spilled)
        } else {
            0
        };
        if c.policy_learning == LearningPolicy::Adaptive {
            // An arena too small for what the cycle had live at once grows to that need; one
            // whose free memory was cut too small for a request grows by what spilled.
            let need = if facts.spilled_in_room { facts.need.max(short) } else { facts.need };
            self.recent[(generation % NEED_WINDOW as u64) as usize] = need;
            self.cycles_learned += 1;
            self.initialized = true;
            let mut window = self.recent.iter().copied().max().unwrap_or(0);
            if self.hold.len > 0 {
                if need >= self.hold.need {
                    self.hold.until = generation + self.hold.len;
                }
                if generation < self.hold.until {
                    window = window.max(self.hold.need);
                }
            }
            self.need = window;
            if !uses_arena {
                return Sizing::Keep;
            }
            let target =
                if (self.last.0, self.last.1) == (window, current) { self.last.2 } else { capacity_for(c, window) };
            self.last = (window, current, target);
            // Shrink only well below the current size, so cycles that vary a little never remap; and
            // only a region no result kept from earlier cycles holds on to, which the smaller one
            // then replaces (results kept every cycle would leave one region behind per shrink).
            let shrink = !facts.pinned_in_arena && current > target.saturating_add(target / 10).max(round_to_page(1));
            if target > current {
                self.regrow(generation, target);
            } else if shrink {
                self.hold.shrunk = Some((generation, current));
            } else if self.hold.shrunk.is_some_and(|(at, _)| generation - at > REGROWN_WITHIN) {
                // The shrink stuck: whatever was held no longer recurs.
                self.hold = Hold::default();
            }
            if target > current && facts.pinned_in_arena {
                // The region it replaces stays beside it while what lives there lives (results
                // kept from earlier cycles): grown at least twofold, as a vector grows, so that a
                // need growing by steps retires regions adding up to the last one at most, not to
                // its square.
                return Sizing::Map { capacity: grown_beside(c, target, current), prefault: window };
            }
            if target > current || shrink {
                return Sizing::Map { capacity: target, prefault: window };
            }
            return Sizing::Keep;
        }
        if !self.initialized {
            // What a learning cycle leaves live stays beside the next cycle's blocks (state
            // replaced every cycle, as ND4J's first loop sees it): it counts once more.
            self.need = self.need.max(facts.need.saturating_add(facts.escaped));
            self.cycles_learned += 1;
            if self.cycles_learned < c.cycles_before_initialization.max(1) {
                return Sizing::Keep;
            }
            self.initialized = true;
            return self.grow_to(c, self.need, current, uses_arena);
        }
        let adapts = c.policy_spill == SpillPolicy::Reallocate
            || (c.policy_learning == LearningPolicy::OverTime && c.policy_spill != SpillPolicy::Fail);
        if adapts && facts.spilled > 0 {
            self.need = self.need.max(facts.need).max(short);
            return self.grow_to(c, self.need, current, uses_arena);
        }
        Sizing::Keep
    }

    /// The arena grows to `target` bytes at the end of cycle `generation`, for the need
    /// `self.need`: where it shrank from about that size a short while ago, the need recurs, and
    /// is held twice as long as before. A growth to less than that leaves the shrink on record:
    /// the need may come back by steps (a cycle needing a little more than the shrunk arena,
    /// then the outlier itself), and each step is a growth.
    fn regrow(&mut self, generation: u64, target: usize) {
        if let Some((at, from)) = self.hold.shrunk {
            if generation - at <= REGROWN_WITHIN && target.saturating_mul(2) >= from {
                self.hold.shrunk = None;
                self.hold.len = (self.hold.len * 2).clamp(REGROWN_WITHIN, MAX_HOLD);
                self.hold.need = self.need;
                self.hold.until = generation + self.hold.len;
            }
        }
    }

    /// A sizing could not be applied (the limit or the system refused the region): the next
    /// cycle end sizes again, from what it learned by then. The adaptive profile does so anyway.
    pub fn retry_later(&mut self, c: &WorkspaceConfiguration) {
        if c.policy_learning != LearningPolicy::Adaptive {
            self.initialized = false;
        }
    }

    /// Sizes the arena now from what was learned (or from the initial and minimum sizes).
    pub fn initialize(&mut self, c: &WorkspaceConfiguration, current: usize, uses_arena: bool) -> Sizing {
        self.initialized = true;
        self.grow_to(c, self.need, current, uses_arena)
    }

    fn grow_to(&self, c: &WorkspaceConfiguration, need: usize, current: usize, uses_arena: bool) -> Sizing {
        let capacity = capacity_for(c, need);
        if uses_arena && capacity > current {
            Sizing::Map { capacity, prefault: need }
        } else {
            Sizing::Keep
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(need: usize, escaped: usize, spilled: usize, kept_in_arena: bool) -> CycleFacts {
        CycleFacts { need, escaped, spilled, kept_in_arena, spilled_in_room: true, pinned_in_arena: false }
    }

    /// One expected step: the facts of a cycle, the arena it ended with, and the sizing wanted
    /// (as the need to map for, or `None` to keep).
    type Step = (CycleFacts, usize, Option<usize>);

    /// Runs `steps` through a learner over `c` (the arena is used) and checks every sizing.
    fn check(case: &str, c: WorkspaceConfiguration, steps: &[Step]) {
        let mut l = CycleLearner::new(&c);
        for (i, &(f, current, want)) in steps.iter().enumerate() {
            let got = l.end_cycle(&c, i as u64, f, current, true);
            let want = match want {
                Some(need) => Sizing::Map { capacity: capacity_for(&c, need), prefault: need },
                None => Sizing::Keep,
            };
            assert_eq!(got, want, "{case}: cycle {i} with {f:?} over {current} bytes");
        }
    }

    fn cfg(learning: LearningPolicy, spill: SpillPolicy) -> WorkspaceConfiguration {
        WorkspaceConfiguration { policy_learning: learning, policy_spill: spill, ..Default::default() }
    }

    #[test]
    fn the_policies_as_a_table() {
        use LearningPolicy::{FirstLoop, OverTime};
        use SpillPolicy::*;
        const M: usize = 1 << 20;
        let cases: Vec<(&str, WorkspaceConfiguration, Vec<Step>)> = vec![
            (
                "FIRST_LOOP sizes once from the first cycle, then never adapts",
                cfg(FirstLoop, External),
                vec![(facts(M, 0, 0, false), 0, Some(M)), (facts(3 * M, 0, M, false), 2 * M, None)],
            ),
            (
                "what a learning cycle leaves live counts once more",
                cfg(FirstLoop, External),
                vec![(facts(M, M / 2, 0, false), 0, Some(M + M / 2))],
            ),
            (
                "cycles_before_initialization learns that many cycles, and takes their largest need",
                WorkspaceConfiguration { cycles_before_initialization: 3, ..cfg(FirstLoop, External) },
                vec![
                    (facts(M, 0, 0, false), 0, None),
                    (facts(4 * M, 0, 0, false), 0, None),
                    (facts(2 * M, 0, 0, false), 0, Some(4 * M)),
                ],
            ),
            (
                "OVER_TIME grows after a spill from an arena that held nothing kept, by what spilled",
                cfg(OverTime, External),
                vec![(facts(M, 0, 0, false), 0, Some(M)), (facts(M, 0, M, false), 2 * M, Some(3 * M))],
            ),
            (
                "spills around kept blocks are fragmentation, not need: no growth beyond the need",
                cfg(OverTime, External),
                vec![(facts(M, 0, 0, false), 0, Some(M)), (facts(M, 0, M, true), 2 * M, None)],
            ),
            (
                "OVER_TIME with FAIL never adapts (a spill is an error there)",
                cfg(OverTime, Fail),
                vec![(facts(M, 0, 0, false), 0, Some(M)), (facts(M, 0, M, false), 2 * M, None)],
            ),
            (
                "REALLOCATE adapts whatever the learning policy",
                cfg(FirstLoop, Reallocate),
                vec![(facts(M, 0, 0, false), 0, Some(M)), (facts(2 * M, 0, M, false), 2 * M, Some(3 * M))],
            ),
            (
                "NONE never learns: initialised from the start, it grows only by REALLOCATE's spills",
                cfg(LearningPolicy::None, Reallocate),
                vec![(facts(M, 0, 0, false), 0, None), (facts(M, 0, M, false), 4 * M, Some(5 * M))],
            ),
            (
                "a cycle without spills never resizes an initialised arena",
                cfg(OverTime, Reallocate),
                vec![(facts(M, 0, 0, false), 0, Some(M)), (facts(8 * M, 0, 0, false), 2 * M, None)],
            ),
        ];
        for (case, c, steps) in cases {
            check(case, c, &steps);
        }
    }

    #[test]
    fn a_spill_from_an_arena_too_small_sizes_it_by_the_need_and_one_from_a_cut_up_arena_by_the_spill() {
        // An arena of 52 MiB, empty, and a cycle of one 61 MiB block: it spilled because the
        // arena is too small, and the cycle's need says by how much. Sized by the arena and the
        // spill together, as a cut-up arena is, it would hold 113 MiB for a 61 MiB cycle.
        const M: usize = 1 << 20;
        let c = cfg(LearningPolicy::Adaptive, SpillPolicy::External);
        let too_small = CycleFacts { spilled_in_room: false, ..facts(61 * M, 0, 61 * M, false) };
        let cut_up = CycleFacts { spilled_in_room: true, ..too_small };
        for (f, need) in [(too_small, 61 * M), (cut_up, 113 * M)] {
            let mut l = CycleLearner::new(&c);
            let got = l.end_cycle(&c, 0, f, 52 * M, true);
            assert_eq!(l.need, need, "{f:?}");
            assert_eq!(got, Sizing::Map { capacity: capacity_for(&c, need), prefault: need }, "{f:?}");
        }
    }

    /// Ends cycles `gens` needing `need(g)` each over an arena of `current` bytes, which each
    /// sizing resizes; returns the cycles that remapped it.
    fn drive(
        l: &mut CycleLearner,
        c: &WorkspaceConfiguration,
        gens: std::ops::Range<u64>,
        current: &mut usize,
        need: impl Fn(u64) -> usize,
    ) -> Vec<u64> {
        let mut remaps = Vec::new();
        for g in gens {
            if let Sizing::Map { capacity, .. } = l.end_cycle(c, g, facts(need(g), 0, 0, false), *current, true) {
                *current = capacity;
                remaps.push(g);
            }
        }
        remaps
    }

    #[test]
    fn an_outlier_that_recurs_is_held_longer_each_time_it_comes_back() {
        // Batches of changing sizes: a large one every 12 cycles, a gap longer than the window.
        // The arena shrinks after the first (a one-off outlier for all it knows) and grows back
        // at the second; from then on the need is held, and the arena is not remapped again.
        let c = cfg(LearningPolicy::Adaptive, SpillPolicy::External);
        let mut l = CycleLearner::new(&c);
        let mut current = 0;
        const M: usize = 1 << 20;
        let remaps = drive(&mut l, &c, 0..600, &mut current, |g| if g % 12 == 1 { 16 * M } else { M });
        assert!(remaps.len() <= 4 && remaps.iter().all(|&g| g < 40), "remapped at cycles {remaps:?}");
        assert_eq!(current, capacity_for(&c, 16 * M));
        // Once the outlier stops for good, the arena shrinks after the hold, at most MAX_HOLD cycles.
        let shrunk = drive(&mut l, &c, 600..600 + MAX_HOLD + NEED_WINDOW as u64 + 1, &mut current, |_| M);
        assert_eq!(current, capacity_for(&c, M), "shrunk back at {:?}", shrunk.first());
        // A hold that ran out with no recurrence is forgotten: a later one-off outlier shrinks
        // back once it has left the window, as the first one did.
        let g0 = 600 + MAX_HOLD + NEED_WINDOW as u64 + 1 + 2 * REGROWN_WITHIN;
        for g in g0 - 2 * REGROWN_WITHIN..g0 {
            l.end_cycle(&c, g, facts(M, 0, 0, false), current, true);
        }
        let mut caps = Vec::new();
        for g in g0..=g0 + NEED_WINDOW as u64 {
            let need = if g == g0 { 16 * M } else { M };
            if let Sizing::Map { capacity, .. } = l.end_cycle(&c, g, facts(need, 0, 0, false), current, true) {
                current = capacity;
            }
            caps.push(current);
        }
        assert_eq!(caps[0], capacity_for(&c, 16 * M));
        assert_eq!(current, capacity_for(&c, M), "a one-off outlier held: {caps:?}");
    }

    #[test]
    fn an_outlier_that_comes_back_by_steps_is_held_too() {
        // A training step of 11 cycles (layers forward, the loss, layers backward): one needs
        // 877 KiB, the one before it 394 KiB, the others 200 KiB. Shrunk once the outlier has
        // left the window, the arena grows back in two steps, and the second is the one that
        // reaches the size it shrank from: it is held from then on, not shrunk and grown back
        // every step (a region mapped and pre-faulted twice per training step).
        let c = cfg(LearningPolicy::Adaptive, SpillPolicy::External);
        let mut l = CycleLearner::new(&c);
        let mut current = 0;
        const K: usize = 1 << 10;
        let remaps = drive(&mut l, &c, 0..1100, &mut current, |g| match g % 11 {
            0 => 877 * K,
            10 => 394 * K,
            _ => 200 * K,
        });
        assert!(remaps.len() <= 6 && remaps.iter().all(|&g| g < 60), "remapped at cycles {remaps:?}");
        assert_eq!(current, capacity_for(&c, 877 * K));
    }

    #[test]
    fn the_adaptive_profile_follows_the_window() {
        let c = cfg(LearningPolicy::Adaptive, SpillPolicy::External);
        let mut l = CycleLearner::new(&c);
        let mut current = 0;
        let step = |l: &mut CycleLearner, g: u64, need: usize, current: &mut usize| {
            let s = l.end_cycle(&c, g, facts(need, 0, 0, false), *current, true);
            if let Sizing::Map { capacity, .. } = s {
                *current = capacity;
            }
            s
        };
        const M: usize = 1 << 20;
        assert_eq!(step(&mut l, 0, M, &mut current), Sizing::Map { capacity: capacity_for(&c, M), prefault: M });
        // An outlier grows it at once.
        assert!(matches!(step(&mut l, 1, 16 * M, &mut current), Sizing::Map { .. }));
        let grown = current;
        assert_eq!(grown, capacity_for(&c, 16 * M));
        // Small needs keep it while the outlier is in the window...
        for g in 2..=NEED_WINDOW as u64 {
            assert_eq!(step(&mut l, g, M, &mut current), Sizing::Keep, "cycle {g}");
        }
        // ...and shrink it once the outlier has left.
        assert_eq!(
            step(&mut l, NEED_WINDOW as u64 + 1, M, &mut current),
            Sizing::Map { capacity: capacity_for(&c, M), prefault: M }
        );
        // A need a little smaller (the arena within a tenth of its target) never remaps; a larger
        // one grows it at once.
        assert_eq!(step(&mut l, NEED_WINDOW as u64 + 2, M - M / 20, &mut current), Sizing::Keep);
        assert_eq!(l.need, M, "the window still holds the larger need");
        assert!(matches!(step(&mut l, NEED_WINDOW as u64 + 3, M + M / 4, &mut current), Sizing::Map { .. }));
    }

    /// A region that blocks kept from its cycles still live in is not shrunk: the smaller one
    /// would be added beside it, not replace it. It grows all the same (spills must stop).
    #[test]
    fn the_adaptive_profile_shrinks_no_region_live_blocks_hold() {
        let c = cfg(LearningPolicy::Adaptive, SpillPolicy::External);
        let mut l = CycleLearner::new(&c);
        const M: usize = 1 << 20;
        let pinned = |need| CycleFacts { pinned_in_arena: true, ..facts(need, 0, 0, true) };
        let grown = capacity_for(&c, 16 * M);
        assert_eq!(l.end_cycle(&c, 0, pinned(16 * M), 0, true), Sizing::Map { capacity: grown, prefault: 16 * M });
        for g in 1..3 * NEED_WINDOW as u64 {
            assert_eq!(l.end_cycle(&c, g, pinned(M), grown, true), Sizing::Keep, "cycle {g}");
        }
        // Once nothing live holds it, it shrinks.
        let free = facts(M, 0, 0, true);
        assert_eq!(
            l.end_cycle(&c, 3 * NEED_WINDOW as u64, free, grown, true),
            Sizing::Map { capacity: capacity_for(&c, M), prefault: M }
        );
        // It grows while held: at least twofold, the region it replaces staying beside it.
        let held = capacity_for(&c, M);
        assert_eq!(
            l.end_cycle(&c, 3 * NEED_WINDOW as u64 + 1, pinned(held), held, true),
            Sizing::Map { capacity: round_to_page(2 * held), prefault: held }
        );
        let big = capacity_for(&c, 32 * M);
        assert_eq!(
            l.end_cycle(&c, 3 * NEED_WINDOW as u64 + 2, pinned(32 * M), 2 * held, true),
            Sizing::Map { capacity: big, prefault: 32 * M },
            "more than twofold where the need is"
        );
    }

    #[test]
    fn capacity_follows_the_allocation_policy_and_the_limits() {
        const M: usize = 1 << 20;
        let over = WorkspaceConfiguration::default();
        assert_eq!(capacity_for(&over, 10 * M), round_to_page(13 * M));
        let strict = WorkspaceConfiguration { policy_allocation: AllocationPolicy::Strict, ..Default::default() };
        assert_eq!(capacity_for(&strict, 10 * M), 10 * M);
        // Large arenas are whole huge pages; the minimum and the initial size are floors.
        assert_eq!(capacity_for(&strict, 65 * M + 1) % HUGE_PAGE, 0);
        let floors = WorkspaceConfiguration { min_size: 8 * M as u64, ..strict.clone() };
        assert_eq!(capacity_for(&floors, M), 8 * M);
        let initial = WorkspaceConfiguration { initial_size: 3 * M as u64, ..strict.clone() };
        assert_eq!(capacity_for(&initial, M), 3 * M);
        // temp_block_size rounds it up; max_size caps it.
        let blocks = WorkspaceConfiguration { temp_block_size: 3 * M as u64, ..strict.clone() };
        assert_eq!(capacity_for(&blocks, 4 * M), 6 * M);
        let capped = WorkspaceConfiguration { max_size: 5 * M as u64, ..strict };
        assert_eq!(capacity_for(&capped, 9 * M), 5 * M);
    }

    #[test]
    fn a_sizing_that_could_not_be_applied_is_tried_again() {
        let c = cfg(LearningPolicy::FirstLoop, SpillPolicy::External);
        let mut l = CycleLearner::new(&c);
        assert!(matches!(l.end_cycle(&c, 0, facts(1 << 20, 0, 0, false), 0, true), Sizing::Map { .. }));
        l.retry_later(&c);
        assert!(!l.initialized);
        assert!(matches!(l.end_cycle(&c, 1, facts(1 << 20, 0, 0, false), 0, true), Sizing::Map { .. }));
        // Without an arena the learner learns, but maps nothing.
        let mut off = CycleLearner::new(&c);
        assert_eq!(off.end_cycle(&c, 0, facts(1 << 20, 0, 0, false), 0, false), Sizing::Keep);
        assert!(off.initialized && off.need == 1 << 20);
    }
}
