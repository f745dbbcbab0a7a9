//! [`Deferred`]: the wakers collected under a lock, woken or dropped after it is released.
//!
//! A `Waker` is user code twice over: `wake` and `drop` both run the waker's vtable, which
//! may do anything, including touching the primitive again (a waker that owns a permit or a
//! sender releases or sends when it is dropped). So no code under a lock wakes or drops a
//! waker: every waker given up (to wake, replaced or removed) moves into a [`Deferred`],
//! which wakes and drops them when it is dropped, after the lock is released.
//!
//! Cloning a waker still happens under the lock (as in tokio's `Notify` and semaphore), and
//! only when the waker is not already stored (see `WaiterList::refresh`).

use std::fmt;
use std::panic::{self, AssertUnwindSafe};
use std::task::Waker;

/// How many wakers a [`Deferred`] holds without allocating.
///
/// Enough for the common operations: a push wakes one waiting future and one waiting
/// stream; a receive or a cancel drops its own waker and wakes a sender or another receiver;
/// a pacer wakes a new head and its watcher.
const INLINE: usize = 4;

/// Wakers collected under the lock: woken or dropped when this is dropped.
///
/// Declare it *before* taking the lock (`let mut out = Deferred::default();` then
/// `let mut st = self.lock();`): locals are dropped in reverse order, so the guard is
/// released first on every path, early returns included.
///
/// The first [`INLINE`] wakers are kept inline and only further ones spill into a vector
/// (as tokio's `WakeList`), so an operation that wakes or drops a few wakers does not
/// allocate.
#[derive(Default)]
pub(crate) struct Deferred {
    /// Wakers in the order they were given: to wake (`true`), or only to drop (`false`:
    /// replaced or removed from a queue). The first `len` slots are filled.
    inline: [Option<(Waker, bool)>; INLINE],
    len: usize,
    /// The wakers past the first [`INLINE`]: rare (closing, a batch freeing many slots).
    more: Vec<(Waker, bool)>,
}

impl Deferred {
    #[inline]
    fn push(&mut self, waker: Waker, wake: bool) {
        match self.inline.get_mut(self.len) {
            Some(slot) => {
                *slot = Some((waker, wake));
                self.len += 1;
            }
            None => self.more.push((waker, wake)),
        }
    }

    /// Wake `waker` once the lock is released.
    #[inline]
    pub(crate) fn wake(&mut self, waker: Waker) {
        self.push(waker, true);
    }

    /// Only drop `waker` (replaced or removed), once the lock is released.
    #[inline]
    pub(crate) fn discard(&mut self, waker: Waker) {
        self.push(waker, false);
    }

    /// How many wakers this holds (to wake or to drop).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len + self.more.len()
    }

    /// How many of the held wakers are to be woken.
    #[cfg(test)]
    pub(crate) fn to_wake(&self) -> usize {
        let inline = self.inline[..self.len].iter().flatten();
        inline.chain(&self.more).filter(|(_, wake)| *wake).count()
    }
}

impl Drop for Deferred {
    /// Wakes (or only drops) every waker in order. A waker that panics, woken or dropped,
    /// does not keep the ones after it from being woken (their tasks would wait for ever):
    /// each runs on its own, and the first panic is resumed once all have run (dropped
    /// instead if this runs while the thread already unwinds, which a resumed panic would
    /// abort).
    #[inline]
    fn drop(&mut self) {
        let mut first = None;
        let inline = self.inline[..self.len].iter_mut().filter_map(Option::take);
        for (w, wake) in inline.chain(self.more.drain(..)) {
            let ran = panic::catch_unwind(AssertUnwindSafe(|| {
                if wake {
                    w.wake();
                }
            }));
            if let Err(p) = ran {
                first.get_or_insert(p);
            }
        }
        if let Some(p) = first
            && !std::thread::panicking()
        {
            panic::resume_unwind(p);
        }
    }
}

impl fmt::Debug for Deferred {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Deferred")
            .field("wakers", &(self.len + self.more.len()))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::panic::{AssertUnwindSafe, catch_unwind};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Wake, Waker};

    use super::*;

    /// A waker that counts its wakes, and panics when woken if `panics`.
    struct Count {
        woken: AtomicUsize,
        panics: bool,
    }

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.woken.fetch_add(1, Ordering::SeqCst);
            assert!(!self.panics, "a waker panics");
        }
    }

    /// A waker whose drop panics.
    struct Bomb;

    impl Wake for Bomb {
        fn wake(self: Arc<Self>) {}
    }

    impl Drop for Bomb {
        fn drop(&mut self) {
            panic!("a waker's drop panics");
        }
    }

    /// A waker that panics when woken, or a discarded one whose drop panics, does not keep
    /// the wakers after it from being woken (their tasks would wait for ever), inline or
    /// spilled; the drop then resumes the panic.
    #[test]
    fn a_panicking_waker_does_not_keep_the_rest_from_being_woken() {
        for (at, woken_panics) in [
            (0, true),
            (INLINE - 1, true),
            (INLINE + 1, true),
            (1, false),
        ] {
            let counts: Vec<Arc<Count>> = (0..INLINE + 3)
                .map(|i| {
                    Arc::new(Count {
                        woken: AtomicUsize::new(0),
                        panics: woken_panics && i == at,
                    })
                })
                .collect();
            let mut out = Deferred::default();
            for (i, c) in counts.iter().enumerate() {
                if !woken_panics && i == at {
                    out.discard(Waker::from(Arc::new(Bomb)));
                }
                out.wake(Waker::from(c.clone()));
            }
            let unwound = catch_unwind(AssertUnwindSafe(|| drop(out)));
            assert!(unwound.is_err(), "the panic is resumed");
            let woken: Vec<usize> = counts
                .iter()
                .map(|c| c.woken.load(Ordering::SeqCst))
                .collect();
            assert_eq!(woken, [1; INLINE + 3], "panic at {at}: every waker woken");
            assert!(
                counts.iter().all(|c| Arc::strong_count(c) == 1),
                "every waker dropped"
            );
        }
    }
}
