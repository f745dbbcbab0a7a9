//! What a bounded buffer does when it is full.

use std::fmt;

/// The policy a bounded buffer applies to an item that arrives while it is full.
///
/// The bounded buffers of items in flowgate take one of these: channels
/// ([`ChannelBuilder::overflow`](crate::channel::ChannelBuilder::overflow)) and pacing queues
/// ([`leaky_queue`](crate::FlowStreamExt::leaky_queue)). A bulkhead's waiting room holds
/// callers, not items, and does not: a caller that finds it full is shed at once with an
/// error.
/// Whatever the policy, nothing disappears silently: a dropped item is handed to the
/// buffer's `on_drop` hook (when one is set), counted in its metrics, and reported in the
/// result of the call that caused the drop where that call has one (a channel's `send` and
/// `try_send`; not `Sink::start_send`, whose only error would end the sink).
///
/// | policy | full buffer, new item | caller waits? |
/// |---|---|---|
/// | [`Backpressure`](Overflow::Backpressure) | the sender waits for space | yes |
/// | [`Reject`](Overflow::Reject) | the item is handed back in an error (a `leaky_queue`, which has no caller to hand it to, drops it as `DropNewest` does) | no |
/// | [`DropNewest`](Overflow::DropNewest) | the incoming item is dropped | no |
/// | [`DropOldest`](Overflow::DropOldest) | the oldest buffered item is dropped, the new one is queued | no |
///
/// # Examples
///
/// ```
/// use flowgate::Overflow;
///
/// assert_eq!(Overflow::default(), Overflow::Backpressure);
/// assert!(!Overflow::DropOldest.waits());
/// assert_eq!(Overflow::DropOldest.as_str(), "drop_oldest");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Overflow {
    /// Wait until there is space. The only policy under which a send can wait (a
    /// channel's [`reserve`](crate::channel::Sender::reserve) waits for a slot under every
    /// policy: a reservation never drops an item).
    #[default]
    Backpressure,
    /// Refuse the new item and hand it back to the caller (a
    /// [`leaky_queue`](crate::FlowStreamExt::leaky_queue) drops it instead: see
    /// [`LeakyQueue`](crate::pace::LeakyQueue)).
    Reject,
    /// Drop the incoming item; the buffer keeps what it has.
    DropNewest,
    /// Drop the oldest buffered item to make room for the incoming one.
    DropOldest,
}

impl Overflow {
    /// A stable lowercase name, used as the `policy` label of drop metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            Overflow::Backpressure => "backpressure",
            Overflow::Reject => "reject",
            Overflow::DropNewest => "drop_newest",
            Overflow::DropOldest => "drop_oldest",
        }
    }

    /// Whether a send may wait under this policy (only [`Overflow::Backpressure`];
    /// reservations wait under every policy).
    pub const fn waits(self) -> bool {
        matches!(self, Overflow::Backpressure)
    }

    /// Whether this policy can drop items (the two drop policies).
    pub const fn drops(self) -> bool {
        matches!(self, Overflow::DropNewest | Overflow::DropOldest)
    }
}

impl fmt::Display for Overflow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
