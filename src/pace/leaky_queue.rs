//! `leaky_queue`: drain a bursty upstream into a bounded queue, release it at the rate.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use futures::Stream;
use futures::stream::{Fuse, FusedStream, StreamExt};
use pin_project::pin_project;

use crate::error::ConfigError;
use crate::metrics::{Counter, Gauge, Labels};
use crate::overflow::Overflow;
use crate::pace::Pacer;
use crate::pace::paced::Paced;
use crate::pace::pacer::names;

type OnDrop<T> = Box<dyn FnMut(T) + Send>;

/// Stream of [`leaky_queue`](crate::FlowStreamExt::leaky_queue): the enforcing leaky bucket.
///
/// Upstream is drained eagerly into a queue of `capacity` items, and items leave the queue at
/// the pacer's rate. When the queue is full the [`Overflow`] policy applies:
/// `Backpressure` stops pulling upstream until there is room; `DropNewest` and `Reject`
/// refuse the incoming item; `DropOldest` evicts the oldest queued item. (A stream adapter
/// cannot hand an item back, so `Reject` acts as `DropNewest`.) Every dropped item goes to
/// the [`on_drop`](LeakyQueue::on_drop) hook, if set, and is counted in
/// [`dropped`](LeakyQueue::dropped) and the `flowgate_pace_dropped_total` metric.
#[pin_project]
#[must_use = "streams do nothing unless polled"]
pub struct LeakyQueue<S: Stream> {
    #[pin]
    stream: Fuse<S>,
    queue: VecDeque<S::Item>,
    capacity: usize,
    overflow: Overflow,
    on_drop: Option<OnDrop<S::Item>>,
    dropped: u64,
    paced: Paced,
    depth: Gauge,
    dropped_metric: Counter,
}

impl<S: Stream> LeakyQueue<S> {
    pub(crate) fn new(
        stream: S,
        pacer: Pacer,
        capacity: usize,
        overflow: Overflow,
    ) -> Result<Self, ConfigError> {
        if capacity == 0 {
            return Err(ConfigError::zero("pace.queue_capacity"));
        }
        let labels = Labels::new(pacer.name());
        let policy = if overflow == Overflow::DropOldest {
            Overflow::DropOldest
        } else {
            Overflow::DropNewest
        };
        Ok(LeakyQueue {
            stream: stream.fuse(),
            queue: VecDeque::with_capacity(capacity.min(4096)),
            capacity,
            overflow,
            on_drop: None,
            dropped: 0,
            depth: labels.gauge(names::QUEUE_DEPTH, &[]),
            dropped_metric: labels.counter(names::DROPPED, &[("policy", policy.as_str())]),
            paced: Paced::new(pacer),
        })
    }

    /// Call `hook` with every item the overflow policy drops.
    pub fn on_drop(mut self, hook: impl FnMut(S::Item) + Send + 'static) -> Self {
        self.on_drop = Some(Box::new(hook));
        self
    }

    /// Items dropped by the overflow policy so far.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Items queued now.
    pub fn queued(&self) -> usize {
        self.queue.len()
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
    pub fn into_inner(mut self) -> S {
        let queued: Vec<_> = self.queue.drain(..).collect();
        for item in queued {
            self.dropped += 1;
            self.dropped_metric.increment(1);
            if let Some(hook) = &mut self.on_drop {
                hook(item);
            }
        }
        self.stream.into_inner()
    }
}

impl<S: Stream> Stream for LeakyQueue<S> {
    type Item = S::Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        let mut this = self.project();
        // Drain upstream as far as the policy allows.
        while !this.stream.is_done() {
            let full = this.queue.len() >= *this.capacity;
            if full && *this.overflow == Overflow::Backpressure {
                break;
            }
            let Poll::Ready(Some(item)) = this.stream.as_mut().poll_next(cx) else {
                break;
            };
            if !full {
                this.queue.push_back(item);
                continue;
            }
            let victim = if *this.overflow == Overflow::DropOldest {
                let oldest = this.queue.pop_front().expect("the queue is full");
                this.queue.push_back(item);
                oldest
            } else {
                item
            };
            *this.dropped += 1;
            this.dropped_metric.increment(1);
            if let Some(hook) = this.on_drop.as_mut() {
                hook(victim);
            }
        }
        this.depth.set(this.queue.len() as f64);
        if this.queue.is_empty() {
            return if this.stream.is_done() {
                Poll::Ready(None)
            } else {
                Poll::Pending
            };
        }
        ready!(this.paced.poll_admit(1, cx));
        let item = this.queue.pop_front();
        this.depth.set(this.queue.len() as f64);
        Poll::Ready(item)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        // Queued items will be released unless evicted; upstream items may be dropped.
        let (_, hi) = self.stream.size_hint();
        let lo = if self.overflow == Overflow::Backpressure {
            self.queue.len().saturating_add(self.stream.size_hint().0)
        } else {
            usize::from(!self.queue.is_empty())
        };
        (lo, hi.and_then(|h| h.checked_add(self.queue.len())))
    }
}

impl<S: Stream> FusedStream for LeakyQueue<S> {
    fn is_terminated(&self) -> bool {
        self.queue.is_empty() && self.stream.is_done()
    }
}

impl<S: Stream + fmt::Debug> fmt::Debug for LeakyQueue<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeakyQueue")
            .field("stream", &self.stream)
            .field("queued", &self.queue.len())
            .field("capacity", &self.capacity)
            .field("overflow", &self.overflow)
            .field("dropped", &self.dropped)
            .field("pacer", self.paced.pacer())
            .finish()
    }
}
