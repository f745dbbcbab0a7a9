//! `leaky_queue`: drain a bursty upstream into a bounded queue, release it at the rate.

use std::collections::VecDeque;
use std::fmt;
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use futures::Stream;
use futures::stream::{Fuse, FusedStream, StreamExt};
use pin_project::pin_project;

use crate::dropped::{Dropped, OnDrop, recorded_then};
use crate::error::ConfigError;
use crate::metrics::{Counter, Gauge, Labels};
use crate::overflow::Overflow;
use crate::pace::Pacer;
use crate::pace::paced::Paced;
use crate::pace::pacer::names;
use crate::sync::POLL_BUDGET;

/// The queue's metrics, labelled by the queue's name (by default its pacer's).
struct Metrics {
    depth: Gauge,
    /// Items the overflow policy dropped (never registered under `Backpressure`).
    dropped: Counter,
    /// Items still queued when the queue went away.
    closed: Counter,
}

impl Metrics {
    fn new(name: Option<&str>, overflow: Overflow) -> Metrics {
        let labels = Labels::new(name);
        let dropped = |policy: &'static str| labels.counter(names::DROPPED, &[("policy", policy)]);
        Metrics {
            depth: labels.gauge(names::QUEUE_DEPTH, &[]),
            // `Reject` cannot hand the item back from a stream: it drops the newest.
            dropped: match overflow {
                Overflow::Backpressure => Counter::default(),
                Overflow::DropOldest => dropped(Overflow::DropOldest.as_str()),
                Overflow::DropNewest | Overflow::Reject => dropped(Overflow::DropNewest.as_str()),
            },
            closed: dropped(names::CLOSED),
        }
    }
}

/// The queue, and the accounting of what it drops. Dropped itself (the stream dropped or
/// taken apart), it discards what is still queued: to the hook as
/// [`Dropped::Discarded`], counted as `closed`.
struct Queue<T> {
    items: VecDeque<T>,
    on_drop: Option<OnDrop<T>>,
    dropped: u64,
    metrics: Metrics,
}

impl<T> Queue<T> {
    /// The overflow policy drops `item`, for the reason `why` (`Newest` or `Oldest`).
    /// Counted before the hook runs: a hook that panics leaves the count right (and the
    /// depth gauge, which [`Filling`] sets).
    fn drop_item(&mut self, item: T, why: &Dropped) {
        self.dropped += 1;
        // A recorder that panics as the drop is counted keeps it from the hook no more than
        // a panicking hook keeps it from the count (see `recorded_then`).
        recorded_then(
            || self.metrics.dropped.increment(1),
            || self.hook(item, why),
        );
    }

    fn hook(&self, item: T, why: &Dropped) {
        if let Some(hook) = &self.on_drop {
            hook.call(item, why);
        }
    }
}

/// The queue while a poll fills it from upstream: the depth gauge is set when this is
/// dropped, on every way out of the fill, so an upstream or a drop hook that panics midway
/// leaves the gauge showing what is queued (once per poll, not per item).
struct Filling<'a, T>(&'a mut Queue<T>);

impl<T> Drop for Filling<'_, T> {
    fn drop(&mut self) {
        self.0.metrics.depth.set(self.0.items.len() as f64);
    }
}

impl<T> Drop for Queue<T> {
    fn drop(&mut self) {
        let left = self.items.len();
        let items = std::mem::take(&mut self.items);
        recorded_then(
            || {
                self.metrics.closed.increment(left as u64);
                self.metrics.depth.set(0.0);
            },
            || {
                for item in items {
                    self.hook(item, &Dropped::Discarded);
                }
            },
        );
    }
}

/// Stream of [`leaky_queue`](crate::FlowStreamExt::leaky_queue): the enforcing leaky bucket.
///
/// Upstream is drained eagerly into a queue of `capacity` items, and items leave the queue at
/// the pacer's rate. When the queue is full the [`Overflow`] policy applies:
/// `Backpressure` stops pulling upstream until there is room; `DropNewest` and `Reject`
/// drop the incoming item; `DropOldest` drops the oldest queued item to make room. (A stream
/// adapter cannot hand an item back, so `Reject` acts as `DropNewest`.) Every dropped item
/// goes to the [`on_drop`](LeakyQueueBuilder::on_drop) hook, if one is set, with its reason
/// ([`Dropped::Newest`] or [`Dropped::Oldest`]), and is counted in
/// [`dropped`](LeakyQueue::dropped) and the `flowgate_pace_dropped_total` metric under its
/// `policy` (`drop_newest`, `drop_oldest`). The items still queued when the stream is dropped
/// or taken apart with `into_inner` are discarded, whatever the policy: they go to the hook
/// too, as [`Dropped::Discarded`], and are counted under `policy="closed"`, as a channel
/// counts the items left when its last receiver goes.
///
/// Made by [`leaky_queue`](crate::FlowStreamExt::leaky_queue), or by
/// [`LeakyQueue::builder`] to give it a name or a hook.
///
/// # Metrics
///
/// `flowgate_pace_queue_depth` (gauge) and `flowgate_pace_dropped_total` (by `policy`),
/// labelled by the queue's [`name`](LeakyQueueBuilder::name), by default its pacer's name.
/// Queues sharing a pacer need names of their own to be told apart.
///
/// # Panics
///
/// An item that has to wait for the pacer sleeps on a tokio timer: polled outside a tokio
/// runtime with timers enabled, the stream panics unless the pacer admits each item at once.
///
/// A panic of the `on_drop` hook reaches the poll that dropped the item (the overflow
/// policy's), or the drop or `into_inner` that discards what is queued. Every item is
/// counted before the hook sees it; of those queued, the ones after the item the hook
/// panicked on are dropped without the hook.
///
/// # Examples
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use flowgate::pace::{LeakyQueue, Pacer};
/// use flowgate::{Dropped, Overflow, Rate};
/// use futures::StreamExt;
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let pacer = Pacer::builder(Rate::per_second(10)?).burst(1).build()?;
/// let lost = Arc::new(Mutex::new(Vec::new()));
/// let log = lost.clone();
/// let mut queue = LeakyQueue::builder(futures::stream::iter(0..10u32), pacer, 4)
///     .overflow(Overflow::DropNewest)
///     .name("ingest")
///     .on_drop(move |item: u32, why: &Dropped| log.lock().unwrap().push((item, why.as_str())))
///     .build()?;
/// assert_eq!(queue.name(), Some("ingest"));
/// assert_eq!(queue.next().await, Some(0)); // 0..4 were queued, 4..10 dropped (newest)
/// assert_eq!(queue.dropped(), 6);
/// drop(queue); // 1, 2 and 3 were still queued: discarded
/// let lost = lost.lock().unwrap();
/// assert!(lost[..6].iter().all(|&(_, why)| why == "newest"));
/// assert_eq!(lost[6..], [(1, "discarded"), (2, "discarded"), (3, "discarded")]);
/// # Ok(())
/// # }
/// ```
#[pin_project]
#[must_use = "streams do nothing unless polled"]
pub struct LeakyQueue<S: Stream> {
    #[pin]
    stream: Fuse<S>,
    queue: Queue<S::Item>,
    capacity: usize,
    overflow: Overflow,
    paced: Paced,
    /// The name of the queue's metrics, if it was given one.
    name: Option<String>,
}

impl<S: Stream> LeakyQueue<S> {
    pub(crate) fn new(
        stream: S,
        pacer: Pacer,
        capacity: NonZeroUsize,
        overflow: Overflow,
        name: Option<String>,
        on_drop: Option<OnDrop<S::Item>>,
    ) -> Self {
        let capacity = capacity.get();
        LeakyQueue {
            stream: stream.fuse(),
            queue: Queue {
                items: VecDeque::with_capacity(capacity.min(4096)),
                on_drop,
                dropped: 0,
                metrics: Metrics::new(name.as_deref().or(pacer.name()), overflow),
            },
            capacity,
            overflow,
            paced: Paced::new(pacer),
            name,
        }
    }

    /// A builder for a queue of `capacity` items in front of `pacer`, with a name and a drop
    /// hook; the overflow policy is [`Overflow::Backpressure`] unless set.
    pub fn builder(stream: S, pacer: Pacer, capacity: usize) -> LeakyQueueBuilder<S> {
        LeakyQueueBuilder {
            stream,
            pacer,
            capacity,
            overflow: Overflow::Backpressure,
            name: None,
            on_drop: None,
        }
    }

    /// The `name` label of this queue's metrics: the name it was built with, else its
    /// pacer's name.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref().or(self.paced.pacer().name())
    }

    /// Items dropped by the overflow policy so far (the items discarded when the queue goes
    /// away are dropped with it, after the last time this can be read).
    pub fn dropped(&self) -> u64 {
        self.queue.dropped
    }

    /// Items queued now.
    pub fn queued(&self) -> usize {
        self.queue.items.len()
    }

    /// The pacer.
    pub fn pacer(&self) -> &Pacer {
        self.paced.pacer()
    }

    /// The inner stream.
    pub fn get_ref(&self) -> &S {
        self.stream.get_ref()
    }

    /// The inner stream, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        self.stream.get_mut()
    }

    /// The inner stream, pinned.
    pub fn get_pin_mut(self: Pin<&mut Self>) -> Pin<&mut S> {
        self.project().stream.get_pin_mut()
    }

    /// The inner stream; queued items are dropped (passed to `on_drop` first).
    pub fn into_inner(self) -> S {
        self.stream.into_inner()
    }
}

impl<S: Stream> Stream for LeakyQueue<S> {
    type Item = S::Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        let mut this = self.project();
        let filling = Filling(&mut *this.queue);
        let queue = &mut *filling.0;
        // Drain upstream as far as the policy allows, within the budget (with a drop policy,
        // a full queue never stops the pulling).
        let mut budget = POLL_BUDGET;
        while !this.stream.is_done() {
            let full = queue.items.len() >= *this.capacity;
            if full && *this.overflow == Overflow::Backpressure {
                break;
            }
            if budget == 0 {
                // More may be ready: come back after the executor has run others.
                cx.waker().wake_by_ref();
                break;
            }
            budget -= 1;
            let Poll::Ready(Some(item)) = this.stream.as_mut().poll_next(cx) else {
                break;
            };
            if !full {
                queue.items.push_back(item);
                continue;
            }
            if *this.overflow == Overflow::DropOldest {
                let oldest = queue.items.pop_front().expect("the queue is full");
                queue.items.push_back(item);
                queue.drop_item(oldest, &Dropped::Oldest);
            } else {
                // `DropNewest`, and `Reject`, which cannot hand the item back from a stream.
                queue.drop_item(item, &Dropped::Newest);
            }
        }
        drop(filling);
        let depth = &this.queue.metrics.depth;
        let queue = &mut this.queue.items;
        if queue.is_empty() {
            return if this.stream.is_done() {
                Poll::Ready(None)
            } else {
                Poll::Pending
            };
        }
        ready!(this.paced.poll_admit(|| 1, cx));
        let item = queue.pop_front();
        depth.set(queue.len() as f64);
        Poll::Ready(item)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        // Queued items will be released unless dropped for a newer one; upstream items may be dropped.
        let (_, hi) = self.stream.size_hint();
        let queued = self.queue.items.len();
        let lo = if self.overflow == Overflow::Backpressure {
            queued.saturating_add(self.stream.size_hint().0)
        } else {
            usize::from(queued > 0)
        };
        (lo, hi.and_then(|h| h.checked_add(queued)))
    }
}

/// The inner stream's write half, untouched (only reading is paced).
impl<S, Item> futures::Sink<Item> for LeakyQueue<S>
where
    S: Stream + futures::Sink<Item>,
{
    type Error = S::Error;
    crate::ext::delegate_sink!(stream, Item);
}

impl<S: Stream> FusedStream for LeakyQueue<S> {
    fn is_terminated(&self) -> bool {
        self.queue.items.is_empty() && self.stream.is_done()
    }
}

impl<S: Stream + fmt::Debug> fmt::Debug for LeakyQueue<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeakyQueue")
            .field("stream", &self.stream)
            .field("name", &self.name)
            .field("queued", &self.queue.items.len())
            .field("capacity", &self.capacity)
            .field("overflow", &self.overflow)
            .field("dropped", &self.queue.dropped)
            .field("pacer", self.paced.pacer())
            .finish()
    }
}

/// Builds a [`LeakyQueue`]; from [`LeakyQueue::builder`].
#[must_use = "a builder does nothing until it is built"]
pub struct LeakyQueueBuilder<S: Stream> {
    stream: S,
    pacer: Pacer,
    capacity: usize,
    overflow: Overflow,
    name: Option<String>,
    on_drop: Option<OnDrop<S::Item>>,
}

impl<S: Stream> LeakyQueueBuilder<S> {
    /// What happens when the queue is full (default [`Overflow::Backpressure`]); see
    /// [`LeakyQueue`].
    pub fn overflow(mut self, overflow: Overflow) -> Self {
        self.overflow = overflow;
        self
    }

    /// The `name` label of this queue's metrics (default: its pacer's name). Give each queue
    /// that shares a pacer a name of its own, or they report under one label.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Call `hook` with every item the queue drops, and why: those the overflow policy drops
    /// ([`Dropped::Newest`], [`Dropped::Oldest`]), and those still queued when the stream is
    /// dropped or taken apart with `into_inner` ([`Dropped::Discarded`]: counted under
    /// `policy="closed"`, not as overflow drops). It runs in the task that polls or drops
    /// the stream.
    pub fn on_drop(mut self, hook: impl Fn(S::Item, &Dropped) + Send + Sync + 'static) -> Self {
        self.on_drop = Some(OnDrop::new(hook));
        self
    }

    /// Build the queue.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `pace.queue_capacity` if the capacity is zero.
    pub fn build(self) -> Result<LeakyQueue<S>, ConfigError> {
        let capacity = NonZeroUsize::new(self.capacity)
            .ok_or_else(|| ConfigError::zero("pace.queue_capacity"))?;
        Ok(LeakyQueue::new(
            self.stream,
            self.pacer,
            capacity,
            self.overflow,
            self.name,
            self.on_drop,
        ))
    }
}

impl<S: Stream + fmt::Debug> fmt::Debug for LeakyQueueBuilder<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeakyQueueBuilder")
            .field("stream", &self.stream)
            .field("pacer", &self.pacer)
            .field("capacity", &self.capacity)
            .field("overflow", &self.overflow)
            .field("name", &self.name)
            .field("on_drop", &self.on_drop.is_some())
            .finish()
    }
}
