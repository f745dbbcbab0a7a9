//! `Sender`: the sending half, its futures, and its `Sink` implementation.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Sink;

use crate::channel::error::{ReserveError, SendError, Sent, Stats};
use crate::channel::permit::{OwnedPermit, Permit};
use crate::channel::shared::Shared;
use crate::channel::wait::Waiting;
use crate::overflow::Overflow;
use crate::sync::Arc;

/// The sending half of a bounded channel. Clone it for more producers.
///
/// What a send does when the buffer is full depends on the channel's [`Overflow`] policy:
/// under `Backpressure` [`send`](Sender::send) waits (FIFO among waiting senders), under
/// `Reject` it hands the item back, under the drop policies it never waits and reports the
/// drop in its [`Sent`] outcome.
///
/// `Sender` implements [`Sink`]. Under `Backpressure`, `poll_ready` waits for a slot and
/// reserves it, `start_send` fills it, and a slot reserved but never filled is released
/// when the sender is dropped or closed as a sink. Under the other policies `poll_ready`
/// reserves nothing and is ready at once, and `start_send` sends as
/// [`try_send`](Sender::try_send) does: under `Reject` it can fail with
/// [`SendError::Full`], handing the item back (which ends a `forward` or `send_all`). A
/// `poll_ready` left waiting (a `feed` or `SinkExt::send` future dropped, by a timeout say)
/// keeps this handle's place among the waiting senders, and the slot it is then given,
/// until `poll_ready` is called again (which takes it), or the handle is closed as a sink or
/// dropped: this handle's own [`send`](Sender::send), [`try_send`](Sender::try_send) and
/// [`reserve`](Sender::reserve) do not use that slot (at capacity 1, `send` and `reserve`
/// wait until then and `try_send` finds the channel full). Closing it as a sink
/// (`poll_close`) detaches this handle only (and the clones made of it afterwards, which are
/// closed too); the channel closes when the last sender is gone.
///
/// When the last `Sender` is dropped, receivers still get every buffered item, then `None`.
pub struct Sender<T> {
    shared: Arc<Shared<T>>,
    /// A slot reserved by `poll_ready`, not yet used by `start_send`.
    sink_reserved: bool,
    sink_waiting: Waiting,
    /// Closed as a sink: this handle no longer counts as a sender.
    detached: bool,
}

impl<T> Sender<T> {
    pub(crate) fn new(shared: Arc<Shared<T>>) -> Sender<T> {
        Sender {
            shared,
            sink_reserved: false,
            sink_waiting: Waiting::default(),
            detached: false,
        }
    }

    pub(crate) fn shared(&self) -> &Shared<T> {
        &self.shared
    }

    /// Send `item`, waiting for a slot under `Overflow::Backpressure`.
    ///
    /// Under the other policies this completes at once, like [`try_send`](Sender::try_send).
    ///
    /// # Errors
    ///
    /// [`SendError::Closed`] when the channel is closed; [`SendError::Full`] when the buffer
    /// is full under `Overflow::Reject`. Both hand the item back.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes leaks no slot and loses no other item; the
    /// item it carried is dropped with it (it was never in the channel). A slot that was
    /// already handed to this sender passes to the next waiting sender.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let (tx, mut rx) = flowgate::channel::bounded(8)?;
    /// tx.send("hello").await?;
    /// assert_eq!(rx.recv().await, Some("hello"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn send(&self, item: T) -> Send<'_, T> {
        Send {
            shared: &self.shared,
            waiting: Waiting::default(),
            item: Some(item),
            detached: self.detached,
        }
    }

    /// Send `item` without waiting.
    ///
    /// # Errors
    ///
    /// [`SendError::Full`] when the buffer is full under `Backpressure` or `Reject`;
    /// [`SendError::Closed`] when the channel is closed. Both hand the item back.
    pub fn try_send(&self, item: T) -> Result<Sent, SendError<T>> {
        if self.detached {
            return Err(SendError::Closed(item));
        }
        self.shared.try_send(item)
    }

    /// Wait for a slot and reserve it: sending through the [`Permit`] cannot fail.
    ///
    /// Reservations wait for a free slot under every policy (they never drop an item).
    ///
    /// # Errors
    ///
    /// [`ReserveError::Closed`] when the channel is closed.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: a dropped `reserve` future holds no slot, and a slot already handed to it
    /// passes to the next waiting sender.
    pub fn reserve(&self) -> Reserve<'_, T> {
        Reserve {
            shared: &self.shared,
            waiting: Waiting::default(),
            detached: self.detached,
        }
    }

    /// Reserve a slot without waiting.
    ///
    /// # Errors
    ///
    /// [`ReserveError::Full`] or [`ReserveError::Closed`].
    pub fn try_reserve(&self) -> Result<Permit<'_, T>, ReserveError> {
        if self.detached {
            return Err(ReserveError::Closed);
        }
        self.shared
            .try_reserve()
            .map(|()| Permit::new(&self.shared))
    }

    /// As [`reserve`](Sender::reserve), with a permit that owns its sender (`'static`).
    ///
    /// # Errors
    ///
    /// [`ReserveError::Closed`] when the channel is closed.
    ///
    /// # Cancel safety
    ///
    /// As [`reserve`](Sender::reserve); the sender is dropped with the future.
    pub fn reserve_owned(self) -> ReserveOwned<T> {
        ReserveOwned {
            sender: Some(self),
            waiting: Waiting::default(),
        }
    }

    /// Close the channel for every sender: further sends fail, waiting senders fail, and
    /// receivers drain what is buffered, then get `None`.
    ///
    /// This inherent method takes the place of [`SinkExt::close`](futures::SinkExt::close)
    /// in method calls (`tx.close()` closes the channel, for every sender, at once). To
    /// close only this handle as a `Sink` (the channel stays open while other senders
    /// live), write `SinkExt::close(&mut tx).await`, or drop it.
    pub fn close(&self) {
        self.shared.close();
    }

    /// Wait until the channel is closed (by `close()` or because every receiver is gone).
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe.
    pub fn closed(&self) -> Closed<'_, T> {
        Closed {
            shared: &self.shared,
            waiting: Waiting::default(),
        }
    }

    /// Whether this sender can send no more: the channel is closed, or this sender (or the
    /// sender it was cloned from) was closed as a `Sink` (`poll_close`, which leaves the
    /// channel open for the other senders; [`closed`](Sender::closed) still waits for the
    /// channel itself).
    pub fn is_closed(&self) -> bool {
        self.detached || self.shared.is_closed()
    }

    /// How many items are buffered: queued, or taken by a receiver in a batch and not yet
    /// handed out.
    ///
    /// An item a receive is handing out counts until the receive returns it, though its slot
    /// is freed first (so that a metrics recorder or a waker that panics as the receive is
    /// recorded and wakes a sender loses no slot: see the channel's
    /// [Locks](crate::channel#locks) section). A send that takes that slot meanwhile (from
    /// another thread, or from the recorder) makes `len()` read one more than the capacity
    /// per receiver handing out an item, for that moment.
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

    /// The channel's overflow policy.
    pub fn overflow(&self) -> Overflow {
        self.shared.overflow()
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

    fn release_sink_slot(&mut self) {
        if std::mem::take(&mut self.sink_reserved) {
            self.shared.release();
        }
        self.shared.cancel_send_wait(&mut self.sink_waiting);
    }
}

/// A clone of a sender closed as a `Sink` is closed too: it does not count as a sender, and
/// sends through it fail with `Closed`.
impl<T> Clone for Sender<T> {
    fn clone(&self) -> Sender<T> {
        let mut sender = Sender::new(self.shared.clone());
        if self.detached {
            sender.detached = true;
        } else {
            self.shared.add_sender();
        }
        sender
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        self.release_sink_slot();
        if !self.detached {
            self.shared.drop_sender();
        }
    }
}

impl<T> fmt::Debug for Sender<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sender")
            .field("channel", &*self.shared)
            .field("sink_reserved", &self.sink_reserved)
            .field("detached", &self.detached)
            .finish()
    }
}

/// The sender as a `Sink`. Under `DropNewest` / `DropOldest` a send that drops an item still
/// succeeds (a `Sink` error would end the sink): the drop is seen through the `on_drop` hook,
/// [`stats`](Sender::stats) and the metrics, not in the result of `start_send`.
impl<T> Sink<T> for Sender<T> {
    type Error = SendError<T>;

    /// Under `Backpressure`, waits for a slot and reserves it. Under the other policies
    /// (which never wait) and on a closed channel, ready at once: `start_send` then reports
    /// what happened.
    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        let this = self.get_mut();
        if this.sink_reserved || this.detached || !this.shared.overflow().waits() {
            return Poll::Ready(Ok(()));
        }
        match this.shared.poll_reserve(cx, &mut this.sink_waiting) {
            Poll::Ready(Ok(())) => {
                this.sink_reserved = true;
                Poll::Ready(Ok(()))
            }
            // `start_send` hands the item back in `SendError::Closed`.
            Poll::Ready(Err(_)) => Poll::Ready(Ok(())),
            Poll::Pending => Poll::Pending,
        }
    }

    /// Fills the slot `poll_ready` reserved, or (under the policies that never wait) sends
    /// as [`try_send`](Sender::try_send) does. With every receiver gone the item is handed
    /// back in [`SendError::Closed`], a reserved slot included (given up); only a send racing
    /// the last receiver's drop may find it gone after the item is in, and then the item goes
    /// to `on_drop` ([`Dropped::Discarded`](crate::Dropped::Discarded)), counted, as a
    /// permit's does.
    fn start_send(self: Pin<&mut Self>, item: T) -> Result<(), Self::Error> {
        let this = self.get_mut();
        if std::mem::take(&mut this.sink_reserved) {
            if this.shared.receivers_gone() {
                this.shared.release();
                return Err(SendError::Closed(item));
            }
            this.shared.send_reserved(item);
            return Ok(());
        }
        this.try_send(item).map(drop)
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    /// Releases an unused reservation and detaches this handle: it stops counting as a
    /// sender (the channel closes when no sender is left) and sends through it fail.
    fn poll_close(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        let this = self.get_mut();
        this.release_sink_slot();
        if !std::mem::replace(&mut this.detached, true) {
            this.shared.drop_sender();
        }
        Poll::Ready(Ok(()))
    }
}

/// Future of [`Sender::send`].
///
/// Dropped before it completes, it leaks no slot and loses no other item: the item it
/// carries is dropped with it (it was never in the channel), and a slot already handed to
/// it passes to the next waiting sender.
#[must_use = "futures do nothing unless polled"]
pub struct Send<'a, T> {
    shared: &'a Shared<T>,
    waiting: Waiting,
    item: Option<T>,
    detached: bool,
}

// The item is moved, never pinned.
impl<T> Unpin for Send<'_, T> {}

impl<T> Future for Send<'_, T> {
    type Output = Result<Sent, SendError<T>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if this.detached {
            let item = this.item.take().expect("polled after completion");
            return Poll::Ready(Err(SendError::Closed(item)));
        }
        this.shared.poll_send(cx, &mut this.waiting, &mut this.item)
    }
}

impl<T> Drop for Send<'_, T> {
    fn drop(&mut self) {
        self.shared.cancel_send_wait(&mut self.waiting);
    }
}

impl<T> fmt::Debug for Send<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Send")
            .field("waiting", &self.waiting.is_waiting())
            .finish_non_exhaustive()
    }
}

/// Future of [`Sender::reserve`].
///
/// Dropped before it completes, it holds no slot: a slot already handed to it passes to
/// the next waiting sender.
#[must_use = "futures do nothing unless polled"]
pub struct Reserve<'a, T> {
    shared: &'a Shared<T>,
    waiting: Waiting,
    detached: bool,
}

impl<'a, T> Future for Reserve<'a, T> {
    type Output = Result<Permit<'a, T>, ReserveError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if this.detached {
            return Poll::Ready(Err(ReserveError::Closed));
        }
        let shared = this.shared;
        shared
            .poll_reserve(cx, &mut this.waiting)
            .map_ok(|()| Permit::new(shared))
    }
}

impl<T> Drop for Reserve<'_, T> {
    fn drop(&mut self) {
        self.shared.cancel_send_wait(&mut self.waiting);
    }
}

impl<T> fmt::Debug for Reserve<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reserve")
            .field("waiting", &self.waiting.is_waiting())
            .finish_non_exhaustive()
    }
}

/// Future of [`Sender::reserve_owned`].
///
/// Dropped before it completes, it holds no slot (a slot already handed to it passes to the
/// next waiting sender), and the sender it owns is dropped with it.
#[must_use = "futures do nothing unless polled"]
pub struct ReserveOwned<T> {
    sender: Option<Sender<T>>,
    waiting: Waiting,
}

impl<T> Unpin for ReserveOwned<T> {}

impl<T> Future for ReserveOwned<T> {
    type Output = Result<OwnedPermit<T>, ReserveError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let sender = this.sender.as_ref().expect("polled after completion");
        if sender.detached {
            return Poll::Ready(Err(ReserveError::Closed));
        }
        match sender.shared.poll_reserve(cx, &mut this.waiting) {
            Poll::Ready(Ok(())) => {
                let sender = this.sender.take().expect("checked above");
                Poll::Ready(Ok(OwnedPermit::new(sender)))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T> Drop for ReserveOwned<T> {
    fn drop(&mut self) {
        if let Some(sender) = &self.sender {
            sender.shared.cancel_send_wait(&mut self.waiting);
        }
    }
}

impl<T> fmt::Debug for ReserveOwned<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReserveOwned")
            .field("waiting", &self.waiting.is_waiting())
            .finish_non_exhaustive()
    }
}

/// Future of [`Sender::closed`].
///
/// Dropped, it loses nothing: it only waits.
#[must_use = "futures do nothing unless polled"]
pub struct Closed<'a, T> {
    shared: &'a Shared<T>,
    waiting: Waiting,
}

impl<T> Future for Closed<'_, T> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        this.shared.poll_closed(cx, &mut this.waiting)
    }
}

impl<T> Drop for Closed<'_, T> {
    fn drop(&mut self) {
        self.shared.cancel_closed_wait(&mut self.waiting);
    }
}

impl<T> fmt::Debug for Closed<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Closed").finish_non_exhaustive()
    }
}
