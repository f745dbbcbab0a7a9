//! Recording the channel's metrics: the changes made under the lock, recorded after it
//! ([`Moves`]), and the depth gauge, set exactly or sampled.

use super::*;
use crate::sync::Panics;

/// The metric changes made under the channel's lock, recorded after it: a metrics recorder
/// is user code, and one that reads the channel (an exporter taking `len()` or `stats()`)
/// takes the lock again. Declare it after the [`Deferred`] and before the lock's guard
/// (`let mut out = ..; let mut moves = Moves::new(self); let mut st = self.lock();`): it is
/// dropped, and records, once the guard is released and the state settled, and before the
/// wakers run, which a recorder that panics does not keep from running (`Deferred` wakes
/// them as the panic unwinds). Counters add up in any order; the depth gauge is read when
/// it is set, after the lock (see [`publish_depth`](Shared::publish_depth)).
pub(super) struct Moves<'a, T> {
    shared: &'a Shared<T>,
    sent: u64,
    received: u64,
    /// Set the depth gauge.
    depth: bool,
}

impl<'a, T> Moves<'a, T> {
    pub(super) fn new(shared: &'a Shared<T>) -> Moves<'a, T> {
        Moves {
            shared,
            sent: 0,
            received: 0,
            depth: false,
        }
    }

    /// An item was pushed: count it, and set the depth gauge.
    pub(super) fn pushed(&mut self) {
        self.sent += 1;
        self.depth = true;
    }

    /// `n` items were received (their slots freed): count them, and set the depth gauge.
    pub(super) fn received(&mut self, n: usize) {
        self.received += n as u64;
        self.depth = true;
    }

    /// Set the depth gauge.
    pub(super) fn depth(&mut self) {
        self.depth = true;
    }
}

impl<T> Drop for Moves<'_, T> {
    /// The counts first, then the depth: a recorder that panics on the depth (user code)
    /// has every count recorded; one that panics on a count leaves the depth gauge as it
    /// was, until the channel's next change (one operation counts sends or receives, not
    /// both). No `catch_unwind` here: this is every receive's and most sends' path, where
    /// one per step cost a channel of two senders and two receivers a fifth of its
    /// throughput.
    fn drop(&mut self) {
        let metrics = &self.shared.metrics;
        if self.sent > 0 {
            metrics.sent.increment(self.sent);
        }
        if self.received > 0 {
            metrics.received.increment(self.received);
        }
        if self.depth {
            self.shared.set_depth();
        }
    }
}

/// The most times one update sets the depth gauge (see `Shared::publish_depth`).
const DEPTH_SETS: usize = 4;

impl<T> Shared<T> {
    /// The depth gauge: queued items and the slots receivers' batches hold.
    #[inline]
    pub(super) fn set_depth(&self) {
        // Without the feature the gauge is empty: skip reading the ring.
        if cfg!(feature = "metrics") {
            self.publish_depth(self.depth());
        }
    }

    /// What the depth gauge shows: queued items and the slots receivers' batches hold.
    #[inline]
    fn depth(&self) -> usize {
        self.ring.len() + self.depth_extra.load(Ordering::Relaxed)
    }

    /// Set the depth gauge to `depth`, read by [`depth`](Shared::depth) before, and look
    /// again: another update may have read and set a later depth between the read and the
    /// set (a sender preempted there, while a receive emptied the channel), and this one's
    /// value, set last, would stay until the next update — for good in a channel gone idle.
    /// So the update sets again until the depth it looks at after setting is the one it
    /// set. Whichever update sets last then sets the depth as it was after every change an
    /// update was made for (the gauge's swap orders the sets, and each set sees the changes
    /// before the sets ahead of it). Usually one more read of what the first one read. At
    /// most [`DEPTH_SETS`] sets: a depth still moving then is a channel in use, whose next
    /// receive or sampled send sets it again (a busy channel must not hold a sender here).
    #[inline]
    fn publish_depth(&self, mut depth: usize) {
        for _ in 0..DEPTH_SETS {
            self.metrics.depth.set(depth as f64);
            let now = self.depth();
            if now == depth {
                return;
            }
            depth = now;
        }
    }

    /// Record a push in the metrics; `depth`: update the depth gauge too. Only once the
    /// item is settled (the receivers it concerns woken, or it discarded): a recorder is
    /// user code, and one that panics must cost neither a wake nor the discard.
    ///
    /// A sampled send sets the depth even if the recorder panics as it counts the send (a
    /// depth skipped stays on the gauge of a channel gone idle); the other sends record one
    /// metric, with nothing after it to skip.
    #[inline]
    pub(super) fn record_push(&self, depth: bool) {
        if depth {
            let mut panics = Panics::new();
            panics.run(|| self.metrics.sent.increment(1));
            panics.run(|| self.set_depth());
            panics.resume();
        } else {
            self.metrics.sent.increment(1);
        }
    }

    /// Whether a send that claimed the slot after `occupied` others updates the depth
    /// gauge. The fast path samples it at every sixteenth of the capacity, and not more
    /// often than every 16 items (`depth_mask`): a gauge update reads the ring's two ends
    /// and swaps the gauge's word, cache lines every sender and receiver would contend on.
    /// Not when the channel was empty: the receiver that emptied it set the gauge. Receives
    /// and sends that find the channel full set it exactly, so the gauge lags the truth by
    /// less than one sampling step.
    #[inline]
    pub(super) fn samples_depth(&self, occupied: usize) -> bool {
        occupied != 0 && occupied & self.depth_mask == 0
    }
}

#[cfg(all(test, feature = "metrics"))]
mod tests {
    use super::*;

    /// A gauge update reads the depth, then sets it, without the lock (a sampled send,
    /// a batch used up) or beside setters that hold it (receives): one preempted between
    /// the two steps sets what it read after a receive has set the depth since. Here it
    /// read 40 before the receives took every item, and set it after them: the gauge must
    /// not keep showing 40 items in an empty, idle channel (nothing sets it again until
    /// the next receive or sampled send).
    #[test]
    fn a_depth_read_before_a_receive_and_set_after_it_does_not_stay_on_the_gauge() {
        let shared = Shared::<u32>::new(64, Overflow::Backpressure, None, Some("depth".into()));
        for i in 0..40 {
            shared.try_send(i).unwrap();
        }
        let stale = shared.depth();
        assert_eq!(stale, 40);
        let (mut local, batch_len) = (VecDeque::new(), BatchLen::default());
        for i in 0..40 {
            assert_eq!(shared.try_recv(&mut local, &batch_len), Ok(i));
        }
        assert_eq!(shared.metrics.depth.value(), 0.0, "the receives set it");
        shared.publish_depth(stale);
        assert_eq!(shared.metrics.depth.value(), 0.0, "an empty channel");
    }
}
