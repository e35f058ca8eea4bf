//! Huge blocks: requests far larger than a cycle's usual footprint get a lazily faulted mapping of
//! their own rather than sizing the arena after them (a 3.6 GB `np.empty` of which one corner is
//! used costs that corner). Freed mappings are kept for reuse while requests of a fitting size
//! recur from one pass of a loop to the next (a cycle, or a nested level inside one), and
//! released when they stop. A size not yet used in two passes in a row goes back to the system
//! as it is freed, as NumPy's own would: kept, its pages would stay resident beside whatever the
//! rest of a long cycle touches next (a cycle that frees two 128 MiB blocks and then fills a
//! lazily faulted 256 MiB one would peak 256 MiB above NumPy).

use std::ptr::NonNull;

use crate::arena::HEADER;
use crate::backend::{Backend, HUGE_PAGE};
use crate::sanitizer::{poison, unpoison};

/// Requests at least this large, and at least half the learned need, are huge.
pub const HUGE_BLOCK_MIN: usize = 64 << 20;

/// Huge mappings kept for reuse once freed, at most.
const CACHED_MAPPINGS: usize = 8;

/// A cached mapping unused for this many cycles is released.
const CACHE_CYCLES: u64 = 2;

/// Sizes of huge mappings in use lately that the cache remembers.
const SEEN: usize = 8;

/// A freed huge mapping kept for reuse.
#[derive(Debug, Clone, Copy)]
struct CachedMapping {
    at: NonNull<u8>,
    len: usize,
    /// The generation of its last use.
    used: u64,
    /// When it was freed, in the order of frees (the latest is the warmest).
    freed: u64,
}

/// The first and the last of a run of passes (or cycles) in a row.
#[derive(Debug, Default, Clone, Copy)]
struct Run {
    first: u64,
    last: u64,
}

impl Run {
    fn starting(at: u64) -> Self {
        Run { first: at, last: at }
    }

    /// A use at `at`: the run goes on, or starts anew after a gap.
    fn note(&mut self, at: u64) {
        if self.last + 1 < at {
            self.first = at;
        }
        self.last = at;
    }

    /// Whether the run spans two in a row, the last of them `now` or the one before.
    fn recurs(&self, now: u64) -> bool {
        self.first < self.last && now <= self.last + 1
    }
}

/// A size of huge mapping in use lately (the last one's length), with the runs of passes and of
/// cycles that used a mapping of about this length. Either run counts: a loop of nested levels
/// inside one cycle recurs by passes, a loop whose cycles hold nested levels of their own (each
/// ending a pass) by cycles.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    len: usize,
    passes: Run,
    cycles: Run,
}

/// Whether mappings of `a` and `b` bytes serve the same requests: a quarter apart at most.
fn alike(a: usize, b: usize) -> bool {
    a.abs_diff(b) <= a.min(b) / 4
}

/// The first bytes of a huge block that always fault in small pages.
const SMALL_HEAD: usize = 256 << 10;

/// Advises small pages for the head of a fresh huge mapping: its header and the first
/// [`SMALL_HEAD`] bytes of its block, up to the next huge-page boundary; huge pages stay advised
/// behind. The header alone, the first rows of a 3.6 GB `np.empty` or one early element of a
/// lazily zeroed `np.zeros` then fault in 4 KiB, not in 2 MiB that the system zeroes first,
/// however the mapping lies against huge-page boundaries. NumPy's own large arrays keep small
/// pages in front of their first boundary (0 to 2 MiB, by chance); these keep 256 KiB to
/// 2.25 MiB, which a fresh block used whole faults in one 4 KiB page at a time.
pub(crate) fn spare_head(backend: &dyn Backend, at: NonNull<u8>, len: usize) {
    let start = at.as_ptr() as usize;
    let head_end = (start + HEADER + SMALL_HEAD).next_multiple_of(HUGE_PAGE).min(start + len);
    backend.huge_pages(at, head_end - start, false);
}

/// Live huge mappings the cache knows by place, at most.
const LIVE: usize = 8;

/// Pages of a live mapping looked at to tell whether it was written yet.
const SAMPLES: usize = 8;

/// Whether the mapping of `len` bytes at `at` has at most one of [`SAMPLES`] pages spread over
/// it resident (its first pages, which the header and the first rows touch, left out). False
/// where the system cannot say.
fn unwritten(at: usize, len: usize) -> bool {
    let page = crate::backend::page_bytes();
    let end = (at + len) / page * page;
    let Some(last) = end.checked_sub(page).filter(|&last| last >= at) else { return false };
    let from = (at + HUGE_PAGE).next_multiple_of(page).min(last);
    let step = ((end - from) / SAMPLES / page).max(1) * page;
    let mut resident = 0;
    for k in 0..SAMPLES {
        let p = from + k * step;
        if p + page > end {
            break;
        }
        let sample = NonNull::new(p as *mut u8).expect("inside a mapping");
        let known = crate::backend::resident_runs(sample, page, |_, _, r| resident += usize::from(r));
        if !known {
            return false;
        }
    }
    resident <= 1
}

/// The freed huge mappings of a workspace, and the length of the live ones.
#[derive(Debug, Default)]
pub(crate) struct HugeCache {
    cached: Vec<CachedMapping>,
    /// Total length of the live huge mappings.
    pub live_len: usize,
    /// The live huge mappings, start and length (`(0, 0)`: an empty slot); beyond [`LIVE`] of
    /// them, the others go unlisted.
    live: [(usize, usize); LIVE],
    /// The sizes in use lately (`len == 0`: an empty slot).
    seen: [Seen; SEEN],
    /// Passes ended so far: cycles, and nested levels left inside them.
    passes: u64,
    /// Mappings put in the cache so far.
    puts: u64,
}

impl HugeCache {
    /// A pass of the loop ended: a cycle, or a nested level inside one (a loop of `with ws:`
    /// inside an outer one).
    pub fn end_pass(&mut self) {
        self.passes += 1;
    }

    /// A mapping of `len` bytes is put to use in the current pass, in cycle `generation`.
    pub fn note_use(&mut self, len: usize, generation: u64) {
        let pass = self.passes;
        let closest =
            self.seen.iter_mut().filter(|s| s.len != 0 && alike(s.len, len)).min_by_key(|s| s.len.abs_diff(len));
        if let Some(s) = closest {
            s.passes.note(pass);
            s.cycles.note(generation);
            s.len = len;
            return;
        }
        let slot =
            self.seen.iter_mut().min_by_key(|s| if s.len == 0 { 0 } else { s.passes.last + 1 }).expect("SEEN > 0");
        *slot = Seen { len, passes: Run::starting(pass), cycles: Run::starting(generation) };
    }

    /// Whether mappings of `len` bytes were used in two passes or two cycles in a row, the last
    /// of them the current one or the one before.
    fn recurs(&self, len: usize, generation: u64) -> bool {
        self.seen
            .iter()
            .any(|s| s.len != 0 && alike(s.len, len) && (s.passes.recurs(self.passes) || s.cycles.recurs(generation)))
    }

    /// A mapping of `len` bytes at `at` was handed out.
    pub fn note_live(&mut self, at: NonNull<u8>, len: usize) {
        self.live_len += len;
        if let Some(slot) = self.live.iter_mut().find(|s| s.1 == 0) {
            *slot = (at.as_ptr() as usize, len);
        }
    }

    /// The live mapping of `len` bytes at `at` was freed.
    pub fn note_dead(&mut self, at: NonNull<u8>, len: usize) {
        self.live_len -= len;
        if let Some(slot) = self.live.iter_mut().find(|s| s.0 == at.as_ptr() as usize) {
            *slot = (0, 0);
        }
    }

    /// Whether a live mapping of a size alike to `len` is still unwritten: its pages not
    /// resident, as a fresh mapping's (or a reused one given back to zeros) are until the caller
    /// writes them. Sampled at a few pages; false where the system cannot say.
    fn beside_unwritten(&self, len: usize) -> bool {
        self.live.iter().any(|&(at, live)| live != 0 && alike(live, len) && unwritten(at, live))
    }

    /// A freed mapping: kept for reuse where its size recurs from pass to pass, else released
    /// now. `generation`: the cycle, for [`HugeCache::release_stale`].
    ///
    /// A mapping freed beside a live one of its size that nobody wrote yet (`a = np.empty(n)`
    /// rebinding `a`, then `a[:] = ...`) is kept with its pages given back: NumPy's own would
    /// unmap it before the new one's pages fault in, and kept resident it would double the
    /// peak. Freed beside a written one (`u = t + 1`, then `t` freed and its mapping taken by
    /// the next temporary), it keeps its pages, which the next request of its size writes.
    ///
    /// # Safety
    /// As for [`HugeCache::put`].
    pub unsafe fn put_or_release(&mut self, backend: &dyn Backend, at: NonNull<u8>, len: usize, generation: u64) {
        if self.recurs(len, generation) {
            if self.beside_unwritten(len) {
                // A refusal (locked memory) leaves the pages resident, as they were.
                backend.discard(at, len);
            }
            // SAFETY: forwarded.
            unsafe { self.put(backend, at, len, generation) };
        } else {
            // SAFETY: the caller gives the mapping up.
            unsafe { backend.unmap(at, len) };
        }
    }

    /// A cached mapping for a request of `len` bytes (at most a quarter larger), taken out of
    /// the cache: of those that fit, the last freed. Its pages are the likeliest to be resident
    /// still: a zeroed request reused a mapping by dropping its pages, and a loop's result written
    /// last was freed last (taking an emptier one would fault in a second copy beside it).
    /// `least`: the fewest bytes that serve the request (a mapping made at the request's own
    /// size under `max_size` is shorter than its class's `len`).
    pub fn take(&mut self, len: usize, least: usize) -> Option<(NonNull<u8>, usize)> {
        let fits = |m: &CachedMapping| m.len >= least.min(len) && m.len <= len + len / 4;
        let i = (0..self.cached.len()).filter(|&i| fits(&self.cached[i])).max_by_key(|&i| self.cached[i].freed)?;
        let m = self.cached.swap_remove(i);
        unpoison(m.at.as_ptr(), m.len);
        Some((m.at, m.len))
    }

    /// Keeps a freed mapping for reuse (the oldest one goes when the cache is full).
    ///
    /// # Safety
    /// `at` and `len` describe a mapping of `backend` that nothing uses any more.
    pub unsafe fn put(&mut self, backend: &dyn Backend, at: NonNull<u8>, len: usize, generation: u64) {
        if self.cached.len() >= CACHED_MAPPINGS {
            let oldest =
                (0..self.cached.len()).min_by_key(|&i| (self.cached[i].used, self.cached[i].freed)).expect("not empty");
            let m = self.cached.swap_remove(oldest);
            unpoison(m.at.as_ptr(), m.len);
            // SAFETY: a cached mapping is owned by the cache alone.
            unsafe { backend.unmap(m.at, m.len) };
        }
        // Pushing into reserved room never allocates: the cache never holds more than its limit.
        if self.cached.try_reserve(1).is_ok() {
            // The header stays readable (frees look at it); the data is no one's.
            poison(at.as_ptr().wrapping_add(HEADER), len - HEADER);
            self.puts += 1;
            self.cached.push(CachedMapping { at, len, used: generation, freed: self.puts });
        } else {
            // SAFETY: the caller gives the mapping up.
            unsafe { backend.unmap(at, len) };
        }
    }

    /// Releases the mappings unused since `generation - CACHE_CYCLES`, and those too small for
    /// any request of `least` bytes or more, the least a request takes to be huge: once a
    /// cycle's need has grown, requests of their size are served by the arena, and they would
    /// stay resident beside it unused.
    #[inline]
    pub fn release_unused(&mut self, backend: &dyn Backend, generation: u64, least: usize) {
        if !self.cached.is_empty() {
            let least = least.saturating_add(HEADER);
            self.release(backend, |m| m.used + CACHE_CYCLES <= generation || m.len < least);
        }
    }

    /// Releases every cached mapping.
    pub fn release_all(&mut self, backend: &dyn Backend) {
        self.release(backend, |_| true);
    }

    #[inline(never)]
    fn release(&mut self, backend: &dyn Backend, which: impl Fn(&CachedMapping) -> bool) {
        let mut i = 0;
        while i < self.cached.len() {
            if which(&self.cached[i]) {
                let m = self.cached.swap_remove(i);
                unpoison(m.at.as_ptr(), m.len);
                // SAFETY: a cached mapping is owned by the cache alone; released once, here.
                unsafe { backend.unmap(m.at, m.len) };
            } else {
                i += 1;
            }
        }
    }

    /// The cached mappings: start and length.
    pub fn each_cached(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.cached.iter().map(|m| (m.at.as_ptr() as usize, m.len))
    }

    /// The number and total length of the cached mappings.
    pub fn cached(&self) -> (usize, usize) {
        (self.cached.len(), self.cached.iter().map(|m| m.len).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::HeapMemory;

    fn mapping(len: usize) -> NonNull<u8> {
        HeapMemory.map(len, false).expect("memory for a test mapping")
    }

    #[test]
    fn a_cached_mapping_serves_requests_up_to_a_quarter_smaller() {
        let mut c = HugeCache::default();
        let at = mapping(8192);
        // SAFETY: a mapping of HeapMemory that nothing uses.
        unsafe { c.put(&HeapMemory, at, 8192, 0) };
        assert_eq!(c.cached(), (1, 8192));
        assert_eq!(c.take(4096, 4096), None, "half the size: mapped anew, the cache stays");
        assert_eq!(c.take(8193, 8193), None, "larger: never");
        assert_eq!(c.take(7000, 7000), Some((at, 8192)));
        assert_eq!(c.cached(), (0, 0));
        // SAFETY: taken back out of the cache: ours to give up again.
        unsafe { c.put(&HeapMemory, at, 8192, 0) };
        c.release_all(&HeapMemory);
        assert_eq!(c.cached(), (0, 0));
    }

    #[test]
    fn a_freed_mapping_is_kept_only_where_its_size_recurs_from_cycle_to_cycle() {
        let mut c = HugeCache::default();
        // Passes without cycles: levels left inside one cycle (generation 0).
        let put = |c: &mut HugeCache, len: usize| {
            c.note_use(len, 0);
            // SAFETY: a fresh mapping that nothing uses.
            unsafe { c.put_or_release(&HeapMemory, mapping(len), len, 0) };
        };
        put(&mut c, 8192);
        put(&mut c, 8192);
        assert_eq!(c.cached(), (0, 0), "a size used in one pass only goes back as it is freed");
        c.end_pass();
        put(&mut c, 9000);
        assert_eq!(c.cached(), (1, 9000), "used again in the next pass (a quarter apart at most): kept");
        put(&mut c, 20_000);
        assert_eq!(c.cached(), (1, 9000), "another size, once: released");
        c.release_all(&HeapMemory);
        c.end_pass();
        c.end_pass();
        put(&mut c, 9000);
        assert_eq!(c.cached(), (0, 0), "every other pass is no run: it starts anew");
        c.end_pass();
        put(&mut c, 8192);
        assert_eq!(c.cached(), (1, 8192));
        c.release_all(&HeapMemory);
        // Sizes that drift a little each pass stay one run (the size remembered follows them),
        // and a use counts for the closest of two sizes it is alike to.
        let mut c = HugeCache::default();
        for len in [8192, 10_000, 12_500, 15_600] {
            c.end_pass();
            put(&mut c, len);
        }
        assert_eq!(c.cached(), (3, 10_000 + 12_500 + 15_600), "kept from the second pass on");
        c.release_all(&HeapMemory);
        let mut c = HugeCache::default();
        c.note_use(8192, 0);
        c.note_use(11_000, 0);
        c.end_pass();
        c.note_use(10_500, 0);
        let s = |len: usize| c.seen.iter().find(|s| s.len == len).copied();
        assert!(s(8192).is_some_and(|s| s.passes.last == 0), "not the closer one");
        assert!(s(10_500).is_some_and(|s| s.passes.recurs(1)), "the closer one went on");
        // A loop whose cycles each end passes of their own (nested levels) recurs by cycles.
        let mut c = HugeCache::default();
        for cycle in 0..3 {
            c.end_pass(); // a nested level left
            c.note_use(8192, cycle);
            // SAFETY: a fresh mapping that nothing uses.
            unsafe { c.put_or_release(&HeapMemory, mapping(8192), 8192, cycle) };
            c.end_pass(); // the cycle's close
        }
        assert_eq!(c.cached().0, 2, "kept from the second cycle on");
        c.release_all(&HeapMemory);
        let mut c = HugeCache::default();
        for i in 0..=SEEN {
            c.note_use(65_536 << i, 0);
            c.end_pass();
        }
        assert!(!c.seen.iter().any(|s| s.len == 65_536), "the least recently used size is forgotten");
        assert!(c.seen.iter().any(|s| s.len == 65_536 << SEEN));
    }

    #[test]
    fn of_mappings_of_one_size_the_last_freed_is_taken_first() {
        let mut c = HugeCache::default();
        let (first, last) = (mapping(8192), mapping(8192));
        // SAFETY: fresh mappings that nothing uses.
        unsafe {
            c.put(&HeapMemory, first, 8192, 0);
            c.put(&HeapMemory, last, 8192, 0);
        }
        assert_eq!(c.take(8000, 8000), Some((last, 8192)), "the warmest");
        // SAFETY: taken back out of the cache: ours to give up again, after `first`.
        unsafe { c.put(&HeapMemory, last, 8192, 0) };
        let other = c.take(8000, 8000).map(|(at, _)| at);
        assert_eq!(other, Some(last));
        assert_eq!(c.take(8000, 8000), Some((first, 8192)));
        // SAFETY: taken out of the cache: ours to give up.
        unsafe {
            HeapMemory.unmap(first, 8192);
            HeapMemory.unmap(last, 8192);
        }
    }

    #[test]
    fn the_cache_holds_few_mappings_and_releases_the_unused() {
        let mut c = HugeCache::default();
        for g in 0..(CACHED_MAPPINGS as u64 + 2) {
            // SAFETY: fresh mappings that nothing uses.
            unsafe { c.put(&HeapMemory, mapping(4096), 4096, g) };
        }
        assert_eq!(c.cached().0, CACHED_MAPPINGS, "the oldest went back when it was full");
        let newest = CACHED_MAPPINGS as u64 + 1;
        c.release_unused(&HeapMemory, newest + CACHE_CYCLES - 1, 0);
        assert_eq!(c.cached().0, 1, "only the newest was used within the last cycles");
        c.release_unused(&HeapMemory, newest + CACHE_CYCLES, 0);
        assert_eq!(c.cached(), (0, 0));
    }
}
