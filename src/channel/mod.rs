//! A bounded multi-producer, multi-consumer channel with overflow policies.
//!
//! The queue between pipeline stages. An unbounded queue is how a slow consumer becomes an
//! out-of-memory kill; this one is bounded and says exactly what happens when it is full,
//! according to its [`Overflow`](crate::Overflow) policy:
//!
//! | policy | full buffer | [`Sender::send`] returns |
//! |---|---|---|
//! | `Backpressure` (default) | the sender waits for a slot, FIFO | `Ok(Sent::Queued)` |
//! | `Reject` | the item is handed back | `Err(SendError::Full(item))` |
//! | `DropNewest` | the new item is dropped | `Ok(Sent::DroppedNewest)` |
//! | `DropOldest` | the oldest buffered item is dropped | `Ok(Sent::DroppedOldest)` (`Ok(Sent::DroppedNewest)` if no slot holds a queued item: all reserved, or sends under way) |
//!
//! Nothing disappears silently: a dropped item goes to the [`ChannelBuilder::on_drop`] hook
//! (if set) with its [`Dropped`](crate::Dropped) reason, is counted in [`Stats::dropped`] and
//! in the `flowgate_channel_dropped_total` metric (labelled by `policy`), and the send
//! outcome says what happened.
//!
//! # Shutdown
//!
//! - When every [`Sender`] is gone (or [`Sender::close`] / [`Receiver::close`] was called),
//!   no new item is accepted; receivers still get every buffered item, and the item of any
//!   outstanding [`Permit`], then `None`.
//! - When every [`Receiver`] is gone, sends fail and hand the item back; items still
//!   buffered go to `on_drop` ([`Dropped::Discarded`](crate::Dropped::Discarded)) and are
//!   counted as dropped, as do items sent through an outstanding permit, and those of sends
//!   that took their slot before the last receiver's drop and fill it as that drop runs.
//!
//! # Fairness
//!
//! Items are delivered in FIFO order. Senders waiting for space are served in FIFO order: a
//! freed slot is handed directly to the longest-waiting sender, so a newcomer never takes it.
//! Receivers waiting in [`Receiver::recv`] or [`Receiver::recv_many`] are woken in FIFO
//! order, one per item (a future dropped after its wake passes it on). Receivers polled as a
//! [`Stream`](futures::Stream) (or through [`Receiver::poll_recv`]) are all woken by each new
//! item, since a stream that stops being polled cannot pass a wake on; the ones that find
//! nothing wait again.
//!
//! # Locks
//!
//! No user code runs under the channel's lock but a waker's `clone` (made when a task
//! starts to wait, or waits with another waker, as in tokio's channels): wakers are woken
//! *and dropped*, items are passed to `on_drop`, and the metrics recorder (feature
//! `metrics`) is called, only after it is released, so a waker, hook or recorder may use
//! the channel (a waker that owns a permit, a recorder that reads [`Sender::len`] or
//! [`Sender::stats`], say); a waker's `clone` must not. The recorder
//! is called once the state it records is settled: a recorder that panics (the panic
//! reaches the caller) leaves no slot taken and no wake lost, and keeps no dropped item
//! from the `on_drop` hook (the panic goes on once the item is with the hook). Nor does it
//! lose the item a receive was handing out (nor does a waker that panics as the receive
//! wakes a sender): the item waits in the receiver until the receive is recorded, and its
//! next receive hands it out; a receiver dropped before that passes it to `on_drop`
//! ([`Dropped::Discarded`](crate::Dropped::Discarded)), counted as dropped (it left the
//! queue with its slot, and cannot go back). [`Receiver::recv_many`] moves its items into
//! the buffer first, and loses none.
//!
//! A send into a channel with a free slot and no sender waiting takes no lock: it claims the
//! slot with one compare-and-swap and pushes the item into a lock-free ring. The lock is
//! taken by receivers (once per batch; under `Backpressure` only, a batch is more than one
//! item: see [`Receiver::poll_recv`]), by sends that find the channel full or must wake a
//! waiting receiver, by waiting senders, and by closing.
//!
//! With the `metrics` feature, sends that take no lock (permits' included) update the depth
//! gauge every sixteenth of the capacity (rounded down to a power of two), but not more often
//! than every 16 items, rather than on every item (the update touches cache lines every
//! sender would contend on); receives, and sends that find the channel full, set it
//! exactly. At a capacity of 16 or less only those set it.
//!
//! The handles ([`Sender`], [`Receiver`], [`Permit`], [`OwnedPermit`]) are
//! [`UnwindSafe`](std::panic::UnwindSafe) and [`RefUnwindSafe`](std::panic::RefUnwindSafe)
//! for every item type: a panic, in an `on_drop` hook say, leaves the channel consistent and
//! usable.
//!
//! # Cancel safety
//!
//! No future leaks anything when dropped: a dropped `recv` loses no item, a dropped `send`
//! or `reserve` leaks no slot, and a wake-up or slot handed to a future that is then dropped
//! passes on to the next waiter. A dropped `send` drops the item it carries, though (it
//! never entered the channel, so no hook sees it and nothing counts it): where a `send`
//! may be cancelled (`select!`, a timeout) and the item must not be lost, `reserve` first,
//! then send through the [`Permit`], which cannot fail.
//!
//! # Metrics
//!
//! With the `metrics` feature, labelled by the channel's `name`:
//! `flowgate_channel_depth` (gauge), `flowgate_channel_sent_total`,
//! `flowgate_channel_received_total`, and `flowgate_channel_dropped_total` with a `policy`
//! label of `drop_newest`, `drop_oldest` or `closed`. A receiver takes a few items at a
//! time and hands them out one by one; `received_total` counts them when the last of such
//! a batch is handed out, so it may trail [`Stats::received`](crate::channel::Stats) (exact)
//! by a batch per receiver.
//!
//! # Examples
//!
//! ```
//! use futures::{SinkExt, StreamExt};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let (mut tx, rx) = flowgate::channel::bounded::<u32>(16)?;
//! let producer = tokio::spawn(async move {
//!     tx.send_all(&mut futures::stream::iter(0..100).map(Ok)).await
//! });
//! let doubled: Vec<u32> = rx.map(|x| x * 2).collect().await;
//! producer.await??;
//! assert_eq!(doubled.len(), 100);
//! assert_eq!(doubled[99], 198);
//! # Ok(())
//! # }
//! ```

mod builder;
mod error;
mod permit;
mod receiver;
// The crate's one module with `unsafe` code: see its docs.
#[allow(unsafe_code)]
mod ring;
mod sender;
mod shared;
mod spin;
mod wait;

pub use builder::ChannelBuilder;
pub use error::{ReserveError, SendError, Sent, Stats, TryRecvError};
pub use permit::{OwnedPermit, Permit};
pub use receiver::{Receiver, Recv, RecvMany};
pub use sender::{Closed, Reserve, ReserveOwned, Send, Sender};

use crate::error::ConfigError;

/// A bounded channel of `capacity` items with [`Overflow::Backpressure`](crate::Overflow).
///
/// # Errors
///
/// [`ConfigError`] on `channel.capacity` if `capacity` is zero or absurdly large (as
/// [`ChannelBuilder::build`]).
pub fn bounded<T>(capacity: usize) -> Result<(Sender<T>, Receiver<T>), ConfigError> {
    builder(capacity).build()
}

/// A builder for a channel of `capacity` items: policy, drop hook, name.
///
/// The capacity is checked by [`ChannelBuilder::build`].
///
/// # Examples
///
/// ```
/// use flowgate::channel::{self, Sent};
/// use flowgate::Overflow;
///
/// let (tx, mut rx) = channel::builder(1)
///     .overflow(Overflow::DropNewest)
///     .name("stage-a")
///     .build()?;
/// assert_eq!(tx.try_send(1)?, Sent::Queued);
/// assert_eq!(tx.try_send(2)?, Sent::DroppedNewest);
/// assert_eq!(rx.try_recv()?, 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn builder<T>(capacity: usize) -> ChannelBuilder<T> {
    ChannelBuilder::new(capacity)
}
