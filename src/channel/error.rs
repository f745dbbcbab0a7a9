//! Errors and outcomes of channel operations.

use std::fmt;

/// What happened to an item a send call accepted.
///
/// Under [`Overflow::Backpressure`](crate::Overflow::Backpressure) and
/// [`Overflow::Reject`](crate::Overflow::Reject) an accepted item is always
/// [`Queued`](Sent::Queued). Under the drop policies the send never waits, and the outcome
/// says which item was dropped (named as the policies are: [`Overflow::DropNewest`] gives
/// `DroppedNewest`, [`Overflow::DropOldest`] gives `DroppedOldest`); the dropped item went
/// to the `on_drop` hook (if one is set) with the matching [`Dropped`] reason and was
/// counted in [`Stats::dropped`].
///
/// [`Overflow::DropNewest`]: crate::Overflow::DropNewest
/// [`Overflow::DropOldest`]: crate::Overflow::DropOldest
/// [`Dropped`]: crate::Dropped
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Sent {
    /// The item is in the buffer.
    Queued,
    /// The buffer was full: the item just sent was dropped (`Overflow::DropNewest`, or
    /// `DropOldest` when no slot holds a queued item to drop instead: every slot is
    /// reserved, by a permit or for a waiting `reserve`, or taken by a send still under way
    /// on another thread, whose item is not in the buffer yet). The hook saw it with
    /// [`Dropped::Newest`](crate::Dropped::Newest).
    DroppedNewest,
    /// The buffer was full: its oldest item was dropped (`Overflow::DropOldest`) and the item
    /// just sent was queued. The hook saw the old item with
    /// [`Dropped::Oldest`](crate::Dropped::Oldest).
    DroppedOldest,
}

impl Sent {
    /// Whether the item just sent is in the buffer.
    pub fn is_queued(self) -> bool {
        !matches!(self, Sent::DroppedNewest)
    }
}

/// A send that did not happen; the item is handed back.
#[derive(PartialEq, Eq, Clone, Copy)]
#[non_exhaustive]
pub enum SendError<T> {
    /// The buffer is full: under `Overflow::Reject`, or a `try_send` under
    /// `Overflow::Backpressure`.
    Full(T),
    /// The channel is closed: every receiver is gone, or `close()` was called; or this
    /// sender (or the sender it was cloned from) was closed as a `Sink` (`poll_close`).
    Closed(T),
}

impl<T> SendError<T> {
    /// The item that was not sent.
    pub fn into_inner(self) -> T {
        match self {
            SendError::Full(t) | SendError::Closed(t) => t,
        }
    }

    /// Whether the channel was full.
    pub fn is_full(&self) -> bool {
        matches!(self, SendError::Full(_))
    }

    /// Whether the channel was closed.
    pub fn is_closed(&self) -> bool {
        matches!(self, SendError::Closed(_))
    }
}

impl<T> fmt::Debug for SendError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SendError::Full(_) => f.write_str("Full(..)"),
            SendError::Closed(_) => f.write_str("Closed(..)"),
        }
    }
}

impl<T> fmt::Display for SendError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SendError::Full(_) => f.write_str("channel full"),
            SendError::Closed(_) => f.write_str("channel closed"),
        }
    }
}

impl<T> std::error::Error for SendError<T> {}

/// A slot that could not be reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReserveError {
    /// Every slot is taken by a buffered item or another permit (only from `try_reserve`).
    Full,
    /// The channel is closed, or this sender (or the sender it was cloned from) was closed
    /// as a `Sink` (`poll_close`).
    Closed,
}

impl fmt::Display for ReserveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReserveError::Full => f.write_str("channel full"),
            ReserveError::Closed => f.write_str("channel closed"),
        }
    }
}

impl std::error::Error for ReserveError {}

/// Why `try_recv` returned no item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TryRecvError {
    /// Nothing is buffered right now, but more may come: a sender remains, or (once the
    /// channel is closed) a permit (or a `Sink`'s `poll_ready` reservation) is outstanding,
    /// a send that took its slot before the close has not put its item in yet, or another
    /// receiver still holds items of a batch it may give back.
    Empty,
    /// Nothing is buffered and nothing more can come: every sender is gone or the channel
    /// was closed, and no slot is still taken (no permit outstanding, no send under way, no
    /// batch held by another receiver).
    Closed,
}

impl fmt::Display for TryRecvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TryRecvError::Empty => f.write_str("channel empty"),
            TryRecvError::Closed => f.write_str("channel closed and drained"),
        }
    }
}

impl std::error::Error for TryRecvError {}

/// Counts of one channel since it was built.
///
/// At any moment `sent == received + dropped + len()`; once the channel is drained,
/// `sent == received + dropped` exactly.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Stats {
    /// Items accepted by a send (queued, or dropped by the overflow policy). Items handed
    /// back in a [`SendError`] are not counted.
    pub sent: u64,
    /// Items handed out by receivers (an item of a receiver's batch counts once it is
    /// handed out: until then [`len`](crate::channel::Receiver::len) counts it).
    pub received: u64,
    /// Items dropped: by `DropNewest` / `DropOldest`, or left in the buffer (or sent through a
    /// permit, or by a send racing the last receiver's drop) after every receiver was gone.
    pub dropped: u64,
}
