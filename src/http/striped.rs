//! Counts that every thread serving requests writes and that are read only now and then
//! (a layer's `stats`): one row of counters per stripe, each stripe on a cache line of its
//! own, and each thread writing the stripe it was given on its first count.
//!
//! One shared row was one cache line that every request on every core wrote: with two
//! server threads it went back and forth between them on each request (`perf` put most of
//! the time of the rate-limit layer's conclusion on that one `lock add`). Read, the stripes
//! are summed: a count is never lost, only read a moment late by a reader racing a writer,
//! as it was before.

use std::cell::Cell;
use std::fmt;
use std::num::NonZero;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;

/// At most this many stripes, however many cores there are (64 × 128 bytes a layer).
const MAX_STRIPES: usize = 64;

/// `N` counters, striped by thread.
pub(crate) struct Striped<const N: usize> {
    /// A power of two of them, so a thread's stripe is a mask away.
    stripes: Box<[CachePadded<[AtomicU64; N]>]>,
}

impl<const N: usize> Striped<N> {
    /// A stripe per core this process may run on (rounded up to a power of two, at most
    /// [`MAX_STRIPES`]), all counts zero.
    pub(crate) fn new() -> Striped<N> {
        let cores = std::thread::available_parallelism().map_or(1, NonZero::get);
        Striped::with_stripes(cores)
    }

    fn with_stripes(n: usize) -> Striped<N> {
        let n = n.clamp(1, MAX_STRIPES).next_power_of_two();
        Striped {
            stripes: (0..n)
                .map(|_| CachePadded::new(std::array::from_fn(|_| AtomicU64::new(0))))
                .collect(),
        }
    }

    /// Add `n` to counter `i` (in this thread's stripe).
    ///
    /// # Panics
    ///
    /// When `i` is not below `N` (a bug of the caller: the counters are indexed by an enum).
    #[inline]
    pub(crate) fn add(&self, i: usize, n: u64) {
        let stripe = &self.stripes[thread_stripe() & (self.stripes.len() - 1)];
        stripe[i].fetch_add(n, Ordering::Relaxed);
    }

    /// Counter `i`, all stripes together.
    pub(crate) fn get(&self, i: usize) -> u64 {
        self.stripes
            .iter()
            .map(|s| s[i].load(Ordering::Relaxed))
            .fold(0, u64::wrapping_add)
    }
}

impl<const N: usize> fmt::Debug for Striped<N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sums: Vec<u64> = (0..N).map(|i| self.get(i)).collect();
        f.debug_struct("Striped")
            .field("stripes", &self.stripes.len())
            .field("counts", &sums)
            .finish()
    }
}

/// This thread's stripe number: given on its first count, in the order threads first
/// count (so the first threads of a process each get a stripe of their own).
#[inline]
fn thread_stripe() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    STRIPE.with(|s| match s.get() {
        usize::MAX => {
            let n = NEXT.fetch_add(1, Ordering::Relaxed) % MAX_STRIPES;
            s.set(n);
            n
        }
        n => n,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_of_many_threads_add_up_exactly() {
        let counts = std::sync::Arc::new(Striped::<3>::with_stripes(4));
        let threads: Vec<_> = (0..8u64)
            .map(|t| {
                let counts = counts.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        counts.add(0, 1);
                        counts.add(2, t);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(counts.get(0), 8000);
        assert_eq!(counts.get(1), 0);
        assert_eq!(counts.get(2), 1000 * (0..8).sum::<u64>());
    }

    #[test]
    fn stripes_are_a_power_of_two_within_bounds() {
        for (asked, got) in [(0, 1), (1, 1), (3, 4), (64, 64), (1000, 64)] {
            assert_eq!(
                Striped::<1>::with_stripes(asked).stripes.len(),
                got,
                "{asked}"
            );
        }
    }

    #[test]
    fn threads_get_stripes_of_their_own_and_keep_them() {
        let a = thread_stripe();
        assert_eq!(a, thread_stripe(), "a thread keeps its stripe");
        assert!(a < MAX_STRIPES);
        // Given in turn: four threads in a row cannot all land on one stripe.
        let others: Vec<usize> = (0..4)
            .map(|_| std::thread::spawn(thread_stripe).join().unwrap())
            .collect();
        assert!(others.iter().any(|&s| s != others[0]), "{others:?}");
    }

    #[test]
    fn debug_shows_the_sums() {
        let counts = Striped::<2>::with_stripes(2);
        counts.add(1, 5);
        let shown = format!("{counts:?}");
        assert!(shown.contains("counts: [0, 5]"), "{shown}");
    }
}
