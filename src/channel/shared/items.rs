//! Items: pushing one into a claimed slot (waking a receiver, or discarding it when every
//! receiver is gone), popping the oldest in its place in the queue, and dropping items
//! through the `on_drop` hook.

use super::*;
use crate::dropped::recorded_then;
use crate::sync::Panics;

impl<T> Shared<T> {
    /// Push an item into a slot claimed for it. Returns the `rx` flags seen after the push
    /// (the fence pairs with the one in [`queued_or_flag`](Shared::queued_or_flag) and in
    /// [`drop_receiver`](Shared::drop_receiver)).
    #[inline]
    fn push_claimed(&self, item: T) -> usize {
        self.ring.push(item);
        fence(Ordering::SeqCst);
        self.hot.rx.load(Ordering::Relaxed)
    }

    /// Push an item into a slot claimed for it, without the lock. `depth`: update the depth
    /// gauge.
    #[inline]
    pub(super) fn enqueue(&self, item: T, depth: bool) {
        let rx = self.push_claimed(item);
        if rx != 0 {
            self.after_push(rx, depth);
        } else {
            self.record_push(depth);
        }
    }

    /// A push found a receiver waiting, or every receiver gone: wake it, or drop what is
    /// left (the push recorded with the discards, before the hook runs); then record it.
    #[cold]
    fn after_push(&self, rx: usize, depth: bool) {
        let mut out = Deferred::default();
        let mut st = self.lock();
        if rx & RX_GONE != 0 {
            self.discard_rest(st, 1);
        } else {
            self.wake_for_item(&mut st, &mut out);
            drop(st);
            // `out` wakes the receivers even if the recorder panics.
            self.record_push(depth);
        }
    }

    /// Push an item into a slot claimed for it, under the lock (the channel is open, so
    /// receivers are not gone).
    pub(super) fn enqueue_locked(
        &self,
        st: &mut State<T>,
        item: T,
        out: &mut Deferred,
        moves: &mut Moves<'_, T>,
    ) {
        if self.push_claimed(item) & RECV_WAIT != 0 {
            self.wake_for_item(st, out);
        }
        moves.pushed();
    }

    /// The oldest queued item (under the lock).
    pub(super) fn pop_oldest(&self, st: &mut State<T>) -> Option<T> {
        self.pop_oldest_placed(st).map(|(_, item)| item)
    }

    /// The oldest queued item with its place in the queue (under the lock).
    pub(super) fn pop_oldest_placed(&self, st: &mut State<T>) -> Option<(u64, T)> {
        match st.stash.pop_front() {
            Some(placed) => {
                self.depth_extra.fetch_sub(1, Ordering::Relaxed);
                self.stashed.fetch_sub(1, Ordering::Relaxed);
                Some(placed)
            }
            None => {
                let item = self.ring.pop(&mut st.popper)?;
                let place = st.ring_taken;
                st.ring_taken += 1;
                Some((place, item))
            }
        }
    }

    /// The place in the queue of the oldest queued item (if any: else of the next one).
    pub(super) fn oldest_place(st: &State<T>) -> u64 {
        st.stash.front().map_or(st.ring_taken, |(place, _)| *place)
    }

    /// Pass an item dropped by the channel (counted in `Stats` already) to the hook with
    /// `why`, once `record` recorded the drop in the metrics (a recorder that panics does
    /// not keep it from the hook: see [`recorded_then`]). Called without the lock.
    pub(super) fn dropped(&self, item: T, why: Dropped, record: impl FnOnce()) {
        recorded_then(record, || {
            if let Some(hook) = &self.on_drop {
                hook.call(item, &why);
            }
        });
    }

    /// Every receiver is gone: drop what is queued through `on_drop` (`Discarded`), after
    /// releasing the lock. Every item is counted (in `stats` and the metric) before the
    /// hook sees the first: a hook that panics leaves none uncounted (the items after it
    /// are dropped as the panic unwinds, without the hook). A metrics recorder that panics
    /// keeps none from the hook: its panic goes on once they are all with it (see
    /// [`recorded_then`]). `pushed`: items the caller pushed, recorded in `sent_total` with
    /// them.
    pub(super) fn discard_rest(&self, mut st: MutexGuard<'_, State<T>>, pushed: u64) {
        let mut left: Vec<T> = st.stash.drain(..).map(|(_, item)| item).collect();
        while let Some(item) = self.ring.pop(&mut st.popper) {
            left.push(item);
        }
        st.dropped += left.len() as u64;
        self.depth_extra.store(0, Ordering::Relaxed);
        self.stashed.store(0, Ordering::Relaxed);
        drop(st);
        let n = left.len() as u64;
        // Each metric even if the recorder panics on one before it.
        let record = || {
            let mut panics = Panics::new();
            panics.run(|| self.metrics.dropped_closed.increment(n));
            panics.run(|| self.metrics.sent.increment(pushed));
            panics.run(|| self.set_depth());
            panics.resume();
        };
        recorded_then(record, || {
            if let Some(hook) = &self.on_drop {
                for item in left {
                    hook.call(item, &Dropped::Discarded);
                }
            }
        });
    }
}
