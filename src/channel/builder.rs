//! `Builder`: a channel with a policy, a drop hook and a name.

use std::fmt;

use crate::channel::receiver::Receiver;
use crate::channel::sender::Sender;
use crate::channel::shared::{OnDrop, Shared};
use crate::error::{ConfigError, ConfigErrorKind};
use crate::overflow::Overflow;
use crate::sync::Arc;

/// The largest capacity a channel accepts (`isize::MAX / 2`), far beyond any sane bound.
const MAX_CAPACITY: usize = usize::MAX >> 2;

/// Builds a bounded channel; from [`builder`](crate::channel::builder).
///
/// # Examples
///
/// ```
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use std::sync::Arc;
/// use flowgate::channel::{self, Sent};
/// use flowgate::Overflow;
///
/// let evicted = Arc::new(AtomicUsize::new(0));
/// let seen = evicted.clone();
/// let (tx, mut rx) = channel::builder(2)
///     .overflow(Overflow::DropOldest)
///     .on_drop(move |_item: u32| { seen.fetch_add(1, Ordering::Relaxed); })
///     .name("stage-a")
///     .build()?;
/// for i in 0..3 {
///     tx.try_send(i)?;
/// }
/// assert_eq!(tx.try_send(3)?, Sent::EvictedOldest);
/// assert_eq!(rx.try_recv()?, 2);
/// assert_eq!(evicted.load(Ordering::Relaxed), 2);
/// assert_eq!(rx.stats().dropped, 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Builder<T> {
    capacity: usize,
    overflow: Overflow,
    on_drop: Option<OnDrop<T>>,
    name: Option<String>,
}

impl<T> Builder<T> {
    pub(crate) fn new(capacity: usize) -> Builder<T> {
        Builder {
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

    /// Called with every item the channel drops: evicted or refused by a drop policy, or left
    /// over when the last receiver is gone. It runs on the task that caused the drop, outside
    /// the channel's lock; it should be quick and must not block.
    pub fn on_drop(mut self, hook: impl Fn(T) + Send + Sync + 'static) -> Self {
        self.on_drop = Some(Box::new(hook));
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

impl<T> fmt::Debug for Builder<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Builder")
            .field("capacity", &self.capacity)
            .field("overflow", &self.overflow)
            .field("on_drop", &self.on_drop.is_some())
            .field("name", &self.name)
            .finish()
    }
}
