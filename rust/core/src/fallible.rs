//! Heap allocation that refuses instead of aborting. Rust's `Box::new` and `Vec::push` end the
//! process when the allocator refuses; the workspace runs where memory is exhausted by design
//! (that is when it must say so), so what it allocates for itself on those paths it allocates
//! through these, and a refusal becomes an error like any other.

use std::alloc::{alloc, Layout};

/// `value` in a new box, or None when the allocator refuses.
pub(crate) fn try_box<T>(value: T) -> Option<Box<T>> {
    let layout = Layout::new::<T>();
    if layout.size() == 0 {
        return Some(Box::new(value));
    }
    // SAFETY: the layout has a non-zero size.
    let p = unsafe { alloc(layout) }.cast::<T>();
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` is a fresh allocation of `T`'s layout, written once before `Box` owns it; the
    // global allocator that made it is the one `Box` frees with.
    unsafe {
        p.write(value);
        Some(Box::from_raw(p))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_boxed_value_is_the_value() {
        let b = super::try_box([7u64; 100]).unwrap();
        assert!(b.iter().all(|&x| x == 7));
        assert_eq!(*super::try_box(()).unwrap(), ());
    }
}
