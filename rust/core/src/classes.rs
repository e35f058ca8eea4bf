//! Size classes: every request is rounded up to the data size of its class, so that a freed block
//! serves the next request of its class exactly (LIFO free lists, as tcmalloc's and mimalloc's).
//!
//! Sizes up to 1 KiB go in 64-byte steps (16 classes); above, each doubling holds 8 classes, so a
//! block is at most 12.5% larger than its request and powers of two are classes of their own (a
//! 1 MiB array takes exactly 1 MiB). Every class size is a multiple of 64. The classes reach
//! [`MAX_CLASS_SIZE`]; nothing larger can be mapped anyway.

/// Number of size classes.
pub const CLASSES: usize = 16 + (MAX_EXP - 10) * 8;

/// Sizes up to `2^MAX_EXP` bytes have a class (256 TiB, more than any mapping can hold).
const MAX_EXP: usize = 48;

/// The largest size with a class.
pub const MAX_CLASS_SIZE: usize = 1 << MAX_EXP;

/// The first class of 128 KiB or more. In an arena, blocks of these classes start their data on a
/// 4 KiB boundary ([`crate::arena`]): large arrays whose addresses differ by a few cache lines
/// modulo 4 KiB make the CPU take loads from one for stores to another (4K aliasing), which costs
/// a loop over them 10-15%; at 128 KiB and more the padding costs at most 3%.
pub const PAGE_ALIGNED_FROM: usize = 16 + (17 - 11) * 8 + 7;
/// The first class (4 KiB) whose blocks an arena starts at least [`COLOUR_MIN`] bytes into a
/// page, up to [`PAGE_ALIGNED_FROM`]: a vector that a BLAS or SIMD kernel writes while it reads
/// rows of a large array (which start on a page, or 16 bytes into one where the C heap maps it)
/// then takes stores that the loads of the next rows do not alias 4 KiB apart.
pub const COLOURED_FROM: usize = 16 + 8 + 7;
/// The size of class [`COLOURED_FROM`].
pub const COLOURED_SIZE: usize = class_size_of(COLOURED_FROM);
/// How far into a page the data of blocks from [`COLOURED_FROM`] on starts, at least.
pub const COLOUR_MIN: usize = 512;
const _: () = assert!(COLOURED_SIZE == 4 << 10 && class_size_of(COLOURED_FROM - 1) < 4 << 10);
/// The size of class [`PAGE_ALIGNED_FROM`].
pub const PAGE_ALIGNED_SIZE: usize = class_size_of(PAGE_ALIGNED_FROM);
const _: () = assert!(PAGE_ALIGNED_SIZE == 128 << 10 && class_size_of(PAGE_ALIGNED_FROM - 1) < 128 << 10);

/// The class of a request of `size` bytes (0 counts as 1); None above [`MAX_CLASS_SIZE`].
#[inline(always)]
pub fn class_of(size: usize) -> Option<usize> {
    if size <= 1024 {
        return Some(size.max(1).div_ceil(64) - 1);
    }
    if size > MAX_CLASS_SIZE {
        return None;
    }
    let s = size - 1;
    // 2^(e-1) <= s < 2^e, with e >= 11 here.
    let e = usize::BITS as usize - s.leading_zeros() as usize;
    let m = (s >> (e - 4)) & 7;
    Some(16 + (e - 11) * 8 + m)
}

/// The data size of class `c` (the largest request it serves).
#[inline(always)]
pub fn class_size(c: usize) -> usize {
    CLASS_SIZES[c]
}

const fn class_size_of(c: usize) -> usize {
    if c < 16 {
        return (c + 1) * 64;
    }
    let e = (c - 16) / 8 + 11;
    let m = (c - 16) % 8;
    (9 + m) << (e - 4)
}

/// Every class's size, computed at compile time: the hot path reads one entry.
static CLASS_SIZES: [usize; CLASSES] = {
    let mut t = [0; CLASSES];
    let mut c = 0;
    while c < CLASSES {
        t[c] = class_size_of(c);
        c += 1;
    }
    t
};

/// The largest class whose size is at most `size` (for blocks whose size is not a class size:
/// they serve the requests of that class and below). None below 64 bytes.
#[inline]
pub fn floor_class(size: usize) -> Option<usize> {
    let c = class_of(size.min(MAX_CLASS_SIZE))?;
    if class_size(c) <= size {
        Some(c)
    } else {
        c.checked_sub(1)
    }
}

/// A set of classes, one bit each: which free lists hold something.
#[derive(Debug, Clone, Default)]
pub struct ClassSet {
    words: [u64; CLASSES.div_ceil(64)],
}

impl ClassSet {
    #[inline]
    pub fn insert(&mut self, c: usize) {
        self.words[c / 64] |= 1 << (c % 64);
    }

    #[inline]
    pub fn remove(&mut self, c: usize) {
        self.words[c / 64] &= !(1 << (c % 64));
    }

    #[inline]
    pub fn contains(&self, c: usize) -> bool {
        self.words[c / 64] & (1 << (c % 64)) != 0
    }

    /// The smallest member at or above `c`.
    pub fn next_from(&self, c: usize) -> Option<usize> {
        let mut w = c / 64;
        let mut bits = self.words.get(w)? & (!0u64 << (c % 64));
        loop {
            if bits != 0 {
                return Some(w * 64 + bits.trailing_zeros() as usize);
            }
            w += 1;
            bits = *self.words.get(w)?;
        }
    }

    /// The members, largest first.
    pub fn iter_desc(&self) -> impl Iterator<Item = usize> + '_ {
        self.words.iter().enumerate().rev().flat_map(|(w, &bits)| {
            let mut b = bits;
            std::iter::from_fn(move || {
                if b == 0 {
                    return None;
                }
                let top = 63 - b.leading_zeros() as usize;
                b &= !(1 << top);
                Some(w * 64 + top)
            })
        })
    }

    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    pub fn clear(&mut self) {
        self.words = Default::default();
    }

    /// Empties the set, calling `f` with each member first (in no promised order): a plain loop
    /// over the words, as cheap as the set is sparse.
    #[inline]
    pub fn drain(&mut self, mut f: impl FnMut(usize)) {
        for (w, word) in self.words.iter_mut().enumerate() {
            let mut bits = std::mem::take(word);
            while bits != 0 {
                f(w * 64 + bits.trailing_zeros() as usize);
                bits &= bits - 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_cover_every_size_with_at_most_an_eighth_to_spare() {
        let mut prev = 0;
        for c in 0..CLASSES {
            let s = class_size(c);
            assert!(s > prev && s % 64 == 0, "class {c}: {s} after {prev}");
            assert_eq!(class_of(s), Some(c), "class {c}'s size maps back to it");
            assert_eq!(class_of(prev + 1), Some(c), "the first size above class {} is class {c}", c.wrapping_sub(1));
            if s > 1024 {
                assert!((s - prev) * 8 <= prev + 64, "class {c} is more than an eighth above the previous one");
            }
            prev = s;
        }
        assert_eq!(prev, MAX_CLASS_SIZE);
        assert_eq!(class_of(MAX_CLASS_SIZE + 1), None);
        for p in 6..MAX_EXP {
            assert_eq!(class_size(class_of(1 << p).unwrap()), 1 << p, "2^{p} is a class of its own");
        }
        assert_eq!(class_of(0), Some(0));
    }

    #[test]
    fn floor_classes_never_exceed_the_size() {
        for size in [64, 65, 1000, 1024, 1100, 4096, 5000, (1 << 20) + 64, 3 << 30] {
            let c = floor_class(size).unwrap();
            assert!(class_size(c) <= size && (c + 1 == CLASSES || class_size(c + 1) > size), "{size}");
        }
        assert_eq!(floor_class(63), None);
    }

    #[test]
    fn class_sets_find_members_in_order() {
        let mut s = ClassSet::default();
        assert!(s.is_empty() && s.next_from(0).is_none());
        for c in [3, 64, 65, 200, CLASSES - 1] {
            s.insert(c);
        }
        assert_eq!(s.next_from(0), Some(3));
        assert_eq!(s.next_from(4), Some(64));
        assert_eq!(s.next_from(66), Some(200));
        assert_eq!(s.next_from(CLASSES - 1), Some(CLASSES - 1));
        assert_eq!(s.iter_desc().collect::<Vec<_>>(), vec![CLASSES - 1, 200, 65, 64, 3]);
        s.remove(64);
        assert!(!s.contains(64) && s.contains(65));
        let mut drained = Vec::new();
        s.drain(|c| drained.push(c));
        drained.sort_unstable();
        assert_eq!(drained, vec![3, 65, 200, CLASSES - 1]);
        assert!(s.is_empty());
        s.insert(7);
        s.clear();
        assert!(s.is_empty());
    }
}
