//! `ChannelBuilder`: a channel with a policy, a drop hook and a name.

use std::fmt;

use crate::channel::receiver::Receiver;
use crate::channel::sender::Sender;
use crate::channel::shared::Shared;
use crate::dropped::{Dropped, OnDrop};
use crate::error::{ConfigError, ConfigErrorKind};
use crate::overflow::Overflow;
use crate::sync::Arc;

/// The largest capacity a channel accepts (`isize::MAX / 2`), far beyond any sane bound.
const MAX_CAPACITY: usize = usize::MAX >> 2;

/// Builds a bounded channel; from [`builder`](crate::channel::builder()).
///
/// # Examples
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use flowgate::channel::{self, Sent};
/// use flowgate::{Dropped, Overflow};
///
/// let log = Arc::new(Mutex::new(Vec::new()));
/// let seen = log.clone();
/// let (tx, mut rx) = channel::builder(2)
///     .overflow(Overflow::DropOldest)
///     .on_drop(move |item: u32, why: &Dropped| seen.lock().unwrap().push((item, why.as_str())))
///     .name("stage-a")
///     .build()?;
/// for i in 0..3 {
///     tx.try_send(i)?;
/// }
/// assert_eq!(tx.try_send(3)?, Sent::DroppedOldest);
/// assert_eq!(rx.try_recv()?, 2);
/// assert_eq!(*log.lock().unwrap(), [(0, "oldest"), (1, "oldest")]);
/// assert_eq!(rx.stats().dropped, 2);
/// assert_eq!(rx.name(), Some("stage-a"));
///
/// // Item 3 is still buffered when the last receiver goes: discarded, and counted.
/// drop(rx);
/// assert_eq!(log.lock().unwrap()[2], (3, "discarded"));
/// assert_eq!(tx.stats().dropped, 3);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct ChannelBuilder<T> {
    capacity: usize,
    overflow: Overflow,
    on_drop: Option<OnDrop<T>>,
    name: Option<String>,
}

impl<T> ChannelBuilder<T> {
    pub(crate) fn new(capacity: usize) -> ChannelBuilder<T> {
        ChannelBuilder {
            capacity,
            overflow: Overflow::Backpressure,
            on_drop: None,
            name: None,
        }
    }

    /// What a send does when the buffer is full (default [`Overflow::Backpressure`]).
    pub fn overflow(mut self, overflow: Overflow) -> Self {
        self.overflow = overflow;
        self
    }

    /// Called with every item the channel drops, and why ([`Dropped`]):
    ///
    /// - [`Dropped::Newest`]: the item just sent, refused by a full buffer under
    ///   [`Overflow::DropNewest`] (or under [`Overflow::DropOldest`] when no slot holds a
    ///   queued item to drop instead: every slot is reserved, or taken by a send still
    ///   under way on another thread);
    /// - [`Dropped::Oldest`]: the oldest buffered item, dropped under
    ///   [`Overflow::DropOldest`] to make room;
    /// - [`Dropped::Discarded`]: an item left over when the channel ended: still buffered
    ///   when the last receiver was dropped, or sent after that through a permit (or by a
    ///   send, a `Sink`'s included, that took its slot before that drop and filled it as
    ///   the drop ran).
    ///
    /// It runs on the task that caused the drop, outside the channel's lock; it should be
    /// quick and must not block.
    pub fn on_drop(mut self, hook: impl Fn(T, &Dropped) + Send + Sync + 'static) -> Self {
        self.on_drop = Some(OnDrop::new(hook));
        self
    }

    /// The `name` label of this channel's metrics.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Build the channel.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `channel.capacity` if the capacity is zero or absurdly large.
    pub fn build(self) -> Result<(Sender<T>, Receiver<T>), ConfigError> {
        if self.capacity == 0 {
            return Err(ConfigError::zero("channel.capacity"));
        }
        if self.capacity > MAX_CAPACITY {
            return Err(ConfigError::new(
                "channel.capacity",
                ConfigErrorKind::TooLarge,
                format!("{} is above the maximum {MAX_CAPACITY}", self.capacity),
            ));
        }
        let shared = Arc::new(Shared::new(
            self.capacity,
            self.overflow,
            self.on_drop,
            self.name,
        ));
        Ok((Sender::new(shared.clone()), Receiver::new(shared)))
    }
}

impl<T> fmt::Debug for ChannelBuilder<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChannelBuilder")
            .field("capacity", &self.capacity)
            .field("overflow", &self.overflow)
            .field("on_drop", &self.on_drop.is_some())
            .field("name", &self.name)
            .finish()
    }
}
