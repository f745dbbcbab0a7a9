//! `Receiver`: the receiving half, its futures, and its `Stream` implementation.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Stream;
use futures::stream::FusedStream;

use crate::channel::error::{Stats, TryRecvError};
use crate::channel::shared::{BatchLen, Shared};
use crate::channel::spin::{Spin, may_spin_here, worth_spinning_for};
use crate::channel::wait::Waiting;
use crate::sync::Arc;

/// The receiving half of a bounded channel. Clone it for more consumers; each item goes to
/// exactly one receiver.
///
/// Implements [`Stream`] and [`FusedStream`]. When every sender is gone (or the channel was
/// closed), receivers still get every buffered item, then `None`. When the last receiver is
/// dropped, items still buffered are passed to the `on_drop` hook
/// ([`Dropped::Discarded`](crate::Dropped::Discarded)) and counted as dropped, and further
/// sends fail, handing their item back.
///
/// A receiver of a channel of at most 256 items that finds it empty and is not polled
/// inside a tokio task (a consumer loop in `futures::executor::block_on`, say) watches the
/// buffer for up to 60 µs before it waits, since in steady flow the next push is often
/// microseconds away: the thread then need not park and be woken for the item. Spins that
/// see nothing back off (after eight in a row, none for
/// the next 16 waits, then 32, up to 4096), so a receiver they do not help spends at most
/// 480 µs of CPU per 4096 waits on them. Inside a tokio task, and on the thread of a tokio
/// current-thread runtime (a `#[tokio::test]` body), a receiver never spins.
pub struct Receiver<T> {
    shared: Arc<Shared<T>>,
    waiting: Waiting,
    terminated: bool,
    /// Items taken in one batch and not yet yielded (they keep their channel slots).
    local: VecDeque<T>,
    /// `local.len()`, published for the channel's `len()`.
    batch_len: Arc<BatchLen>,
    /// The places in the queue of the batch's items after the first (see
    /// `Shared::poll_recv_batch`): one slot held for each, until the batch is used up.
    batch: Range<u64>,
    /// The short spin before waiting (see `poll_next_item`).
    spin: Spin,
}

impl<T> Receiver<T> {
    /// A new receiver of `shared`, counted as one.
    pub(crate) fn new(shared: Arc<Shared<T>>) -> Receiver<T> {
        let batch_len = shared.add_receiver();
        Receiver {
            shared,
            waiting: Waiting::default(),
            terminated: false,
            local: VecDeque::new(),
            batch_len,
            batch: 0..0,
            spin: Spin::default(),
        }
    }

    /// Receive the next item; `None` once the channel is closed and drained.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: a dropped `recv` future loses no item (an item is taken out of the
    /// buffer only by the poll that returns it), and a wake-up it had received passes on to
    /// another waiting receiver.
    pub fn recv(&mut self) -> Recv<'_, T> {
        Recv { receiver: self }
    }

    /// Receive an item if one is buffered, without waiting.
    ///
    /// # Errors
    ///
    /// [`TryRecvError::Empty`] when nothing is buffered, [`TryRecvError::Closed`] when
    /// nothing more can come.
    pub fn try_recv(&mut self) -> Result<T, TryRecvError> {
        match self.take_local() {
            Some(item) => Ok(item),
            None => self.shared.try_recv(&mut self.local, &self.batch_len),
        }
    }

    /// The next item of this receiver's batch; frees the batch's slots when it is used up,
    /// before the last item is handed out: a recorder or a waker that panics as they are
    /// freed (user code) leaves the item here, for the next receive, and does not take it
    /// with the panic. (It then holds no slot, as an item [`Shared::poll_recv_batch`] or
    /// [`Shared::try_recv`] left after such a panic.)
    fn take_local(&mut self) -> Option<T> {
        if self.local.len() == 1 {
            self.shared.release_held(std::mem::take(&mut self.batch));
        }
        let item = self.local.pop_front()?;
        self.batch_len.set(self.local.len());
        Some(item)
    }

    /// Wait for at least one item, then move up to `max` buffered items into `buf` (in
    /// one lock). Returns how many were moved: 0 only when the channel is closed and
    /// drained, or when `max` is 0.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe, as [`recv`](Receiver::recv).
    pub fn recv_many<'a>(&'a mut self, buf: &'a mut Vec<T>, max: usize) -> RecvMany<'a, T> {
        RecvMany {
            receiver: self,
            buf,
            max,
        }
    }

    /// Close the channel: further sends fail and waiting senders fail, but every item already
    /// buffered (or sent through an outstanding permit) can still be received.
    ///
    /// Takes `&self`, as [`Sender::close`](crate::channel::Sender::close) does: any handle
    /// may close the channel, even one shared with the task that drains it.
    ///
    /// # Examples
    ///
    /// ```
    /// use flowgate::channel::{self, SendError};
    ///
    /// let (tx, mut rx) = channel::bounded(4)?;
    /// tx.try_send(1)?;
    /// let closer = &rx;
    /// closer.close();
    /// assert_eq!(tx.try_send(2), Err(SendError::Closed(2)));
    /// assert_eq!(rx.try_recv()?, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn close(&self) {
        self.shared.close();
    }

    /// Poll for the next item, registering the task when none is there.
    ///
    /// To save locking, under [`Overflow::Backpressure`](crate::Overflow::Backpressure) a
    /// receiver takes up to 32 buffered items at once (at most the capacity, and at most its
    /// share of the queue — the items queued, those in receivers' batches left out, divided
    /// by the number of receivers, and at least one — so with several receivers none sits
    /// on items another one is idle for) and hands them out one by one; the batch keeps its
    /// slots in the channel until its last item is handed out (those of the items handed out
    /// before it too), so the bound holds, [`len`](Receiver::len) counts its items until
    /// they are handed out, and if the receiver is dropped first they go back to the front
    /// of the queue, in their places (behind items an earlier batch gave back, ahead of
    /// later ones), for the other receivers. So while a batch is being handed out, senders
    /// may wait (and `try_send` find the channel full) with fewer than `capacity` items
    /// buffered. Under the other policies a receiver takes one item at a time: they refuse
    /// or drop items only when the channel holds `capacity` items not yet handed out, and
    /// under `DropOldest` dropping the oldest item always finds the oldest one not yet
    /// handed out.
    ///
    /// A task waiting here is woken by every new item (not only by one item in turn, as a
    /// waiting [`recv`](Receiver::recv) is): a task that polls a receiver directly may stop
    /// polling without dropping anything, so it cannot pass a wake it does not use on to
    /// another receiver. (With one receiver this costs nothing; with several, an item may
    /// wake receivers that then find nothing.)
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<T>> {
        self.poll_next_item(cx, true)
    }

    /// As `poll_recv`; `stream`: polled without a future whose drop passes a wake on.
    fn poll_next_item(&mut self, cx: &mut Context<'_>, stream: bool) -> Poll<Option<T>> {
        if let Some(item) = self.take_local() {
            return Poll::Ready(Some(item));
        }
        // Nothing queued in a small channel: watch it for a moment before registering, as a
        // push is often a few microseconds away (a thread-parking executor need not park).
        // Never in a tokio task, nor on a current-thread runtime: see `channel::spin`. That
        // is checked first (a thread-local read), so a task receiver never reads the ring's
        // ends here.
        if !cfg!(flowgate_loom)
            && worth_spinning_for(self.shared.capacity())
            && may_spin_here()
            && !self.shared.has_queued_item()
        {
            let shared = &self.shared;
            self.spin
                .before_wait(|| shared.has_queued_item(), || shared.is_closed());
        }
        self.shared.poll_recv_batch(
            cx,
            &mut self.waiting,
            stream,
            &mut self.local,
            &self.batch_len,
            &mut self.batch,
        )
    }

    /// Whether the channel is closed for new sends.
    pub fn is_closed(&self) -> bool {
        self.shared.is_closed()
    }

    /// How many items are buffered: queued, or taken by a receiver in a batch and not yet
    /// handed out (see [`poll_recv`](Receiver::poll_recv)).
    ///
    /// While a receive hands an item out, it may read one more than the capacity per
    /// receiver doing so: see [`Sender::len`](crate::channel::Sender::len).
    pub fn len(&self) -> usize {
        self.shared.len()
    }

    /// Whether nothing is buffered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffer's capacity.
    pub fn capacity(&self) -> usize {
        self.shared.capacity()
    }

    /// The channel's counts so far.
    pub fn stats(&self) -> Stats {
        self.shared.stats()
    }

    /// The channel's name, if it was given one
    /// ([`ChannelBuilder::name`](crate::channel::ChannelBuilder::name)).
    pub fn name(&self) -> Option<&str> {
        self.shared.name()
    }
}

impl<T> Clone for Receiver<T> {
    fn clone(&self) -> Receiver<T> {
        Receiver::new(self.shared.clone())
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        self.shared.drop_receiver(
            &mut self.waiting,
            std::mem::take(&mut self.local),
            std::mem::take(&mut self.batch),
            &self.batch_len,
        );
    }
}

impl<T> fmt::Debug for Receiver<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Receiver")
            .field("channel", &*self.shared)
            .finish()
    }
}

// As the channel's state (see `Shared`): the batch in `local` holds items moved out of the
// queue, never lent out, so a panic cannot leave one observed half-updated through the
// receiver. Unwind-safe for every `T`, as tokio's receivers are.
impl<T> std::panic::RefUnwindSafe for Receiver<T> {}
impl<T> std::panic::UnwindSafe for Receiver<T> {}

// The receiver holds no pinned state.
impl<T> Unpin for Receiver<T> {}

impl<T> Stream for Receiver<T> {
    type Item = T;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let this = self.get_mut();
        if this.terminated {
            return Poll::Ready(None);
        }
        let next = this.poll_recv(cx);
        if let Poll::Ready(None) = next {
            this.terminated = true;
        }
        next
    }

    /// Lower bound: this receiver's own batch, plus the queue if it is the only receiver
    /// (other receivers may take all of the queue; dropping the oldest replaces a queued item,
    /// so the queue never shrinks but by a receive). A receiver cloned later shares the queue
    /// from then on. Upper bound: none while the channel is open; once it is closed for
    /// sends (every sender dropped, or [`Sender::close`](crate::channel::Sender::close)),
    /// the items still to come (queued, in batches, and those reserved permits or sends
    /// under way may still bring), so an adapter that may not take an item
    /// ([`with_demand`](crate::FlowStreamExt::with_demand) without credit,
    /// [`watermarks`](crate::FlowStreamExt::watermarks) at `high`) sees the end when none
    /// is left as it polls. Such an adapter does not poll the receiver while it waits, but
    /// reading this hint registers it to be woken when the channel is closed or ends (and
    /// when a receiver gives its batch back: woken while items are left to come, it reads
    /// the hint again), so an end that comes while it waits ends it too. The first reading
    /// by a task takes the channel's lock; readings by the task already registered do not,
    /// and nothing is done per item sent or received.
    fn size_hint(&self) -> (usize, Option<usize>) {
        if self.terminated {
            return (0, Some(0));
        }
        let lo = self.local.len() + self.shared.queued_for_sole_receiver();
        // Once closed, the count only falls, as items are handed out or permits and sends
        // given up; this receiver's batch and (alone) the queue stay in it until then.
        let hi = self.shared.most_to_come().map(|hi| hi.max(lo));
        if hi != Some(0) {
            // Woken (or dropped) here, once the lent watcher is given back.
            let _wake =
                crate::sync::with_end_watcher(|w| self.shared.watch_end(&self.batch_len, w));
        }
        (lo, hi)
    }
}

impl<T> FusedStream for Receiver<T> {
    fn is_terminated(&self) -> bool {
        self.terminated
    }
}

/// Future of [`Receiver::recv`].
///
/// Dropped before it completes, it loses no item: it holds none (a batch a poll took from
/// the channel stays with the receiver, for its next receive), and a wake-up meant for it
/// passes to the next waiting receiver.
#[must_use = "futures do nothing unless polled"]
pub struct Recv<'a, T> {
    receiver: &'a mut Receiver<T>,
}

impl<T> Future for Recv<'_, T> {
    type Output = Option<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        // A `Recv` passes a wake it will not use on when dropped: it waits as a future.
        self.get_mut().receiver.poll_next_item(cx, false)
    }
}

impl<T> Drop for Recv<'_, T> {
    fn drop(&mut self) {
        let receiver = &mut *self.receiver;
        receiver.shared.cancel_recv_wait(&mut receiver.waiting);
    }
}

impl<T> fmt::Debug for Recv<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Recv").finish_non_exhaustive()
    }
}

/// Future of [`Receiver::recv_many`].
///
/// Dropped before it completes, it loses no item: items are moved into `buf` only by the
/// poll that returns their count, and a wake-up meant for it passes to the next waiting
/// receiver.
#[must_use = "futures do nothing unless polled"]
pub struct RecvMany<'a, T> {
    receiver: &'a mut Receiver<T>,
    buf: &'a mut Vec<T>,
    max: usize,
}

impl<T> Future for RecvMany<'_, T> {
    type Output = usize;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<usize> {
        let this = self.get_mut();
        let receiver = &mut *this.receiver;
        if !receiver.local.is_empty() && this.max > 0 {
            let n = receiver.local.len().min(this.max);
            this.buf.extend(receiver.local.drain(..n));
            receiver.batch_len.set(receiver.local.len());
            if receiver.local.is_empty() {
                receiver
                    .shared
                    .release_held(std::mem::take(&mut receiver.batch));
            }
            return Poll::Ready(n);
        }
        receiver
            .shared
            .poll_recv_many(cx, &mut receiver.waiting, this.buf, this.max)
    }
}

impl<T> Drop for RecvMany<'_, T> {
    fn drop(&mut self) {
        let receiver = &mut *self.receiver;
        receiver.shared.cancel_recv_wait(&mut receiver.waiting);
    }
}

impl<T> fmt::Debug for RecvMany<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecvMany")
            .field("max", &self.max)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use futures::executor::block_on;

    use crate::channel;

    /// Items given back by a receiver dropped with part of a batch are queued: a receiver
    /// that finds only those does not watch the empty ring for them (up to 60 µs, as if
    /// the channel were empty) before it takes them. On a plain thread, where it may spin.
    #[test]
    fn a_receiver_does_not_spin_while_items_given_back_wait() {
        let (tx, mut a) = channel::bounded::<u32>(16).unwrap();
        for i in 0..3 {
            tx.try_send(i).unwrap();
        }
        assert_eq!(
            block_on(a.recv()),
            Some(0),
            "alone: takes 0 to 2, holds 1 and 2"
        );
        let mut b = a.clone();
        drop(a); // 1 and 2 go back; the ring is empty
        assert!(super::may_spin_here());
        assert_eq!(block_on(b.recv()), Some(1));
        assert!(!b.spin.has_missed(), "it spun for items already queued");
        assert_eq!(block_on(b.recv()), Some(2));
    }
}
