//! `leaky`, `leaky_with`, `leaky_cost`: a stream released at a constant rate.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use futures::Stream;
use futures::stream::FusedStream;
use pin_project::pin_project;

use crate::pace::Pacer;
use crate::pace::paced::Paced;

/// The cost function of [`leaky`](crate::FlowStreamExt::leaky) and
/// [`leaky_with`](crate::FlowStreamExt::leaky_with): every item costs 1.
pub type UnitCost<T> = fn(&T) -> u32;

pub(crate) fn unit_cost<T>(_: &T) -> u32 {
    1
}

/// Stream of [`leaky`](crate::FlowStreamExt::leaky),
/// [`leaky_with`](crate::FlowStreamExt::leaky_with) and
/// [`leaky_cost`](crate::FlowStreamExt::leaky_cost).
///
/// Pulls one item, waits until its cost passes the pacer, yields it. It holds at most one
/// item; upstream is not polled while that item waits, so a fast upstream is slowed down
/// (backpressure). See [`leaky_queue`](crate::FlowStreamExt::leaky_queue) to drain a bursty
/// upstream eagerly instead. An item whose cost is above the pacer's burst pays it in
/// successive chunks of at most the burst, so the rate holds in cost units; an item of cost
/// 0 passes at once.
///
/// # Panics
///
/// An item that has to wait sleeps on a tokio timer: polled outside a tokio runtime with
/// timers enabled, the stream panics unless the pacer admits each item at once.
#[pin_project]
#[must_use = "streams do nothing unless polled"]
pub struct Leaky<S: Stream, C> {
    #[pin]
    stream: S,
    cost: C,
    item: Option<S::Item>,
    paced: Paced,
}

impl<S, C> Leaky<S, C>
where
    S: Stream,
    C: FnMut(&S::Item) -> u32,
{
    pub(crate) fn new(stream: S, pacer: Pacer, cost: C) -> Self {
        Leaky {
            stream,
            cost,
            item: None,
            paced: Paced::new(pacer),
        }
    }

    /// The pacer.
    pub fn pacer(&self) -> &Pacer {
        self.paced.pacer()
    }

    /// The inner stream.
    pub fn get_ref(&self) -> &S {
        &self.stream
    }

    /// The inner stream, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.stream
    }

    /// The inner stream, pinned.
    pub fn get_pin_mut(self: Pin<&mut Self>) -> Pin<&mut S> {
        self.project().stream
    }

    /// The inner stream; an item waiting for the pacer is dropped.
    pub fn into_inner(self) -> S {
        self.stream
    }
}

impl<S, C> Stream for Leaky<S, C>
where
    S: Stream,
    C: FnMut(&S::Item) -> u32,
{
    type Item = S::Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        let this = self.project();
        if this.item.is_none() {
            match ready!(this.stream.poll_next(cx)) {
                Some(item) => *this.item = Some(item),
                None => return Poll::Ready(None),
            }
        }
        let cost = (this.cost)(this.item.as_ref().expect("an item is held"));
        ready!(this.paced.poll_admit(cost, cx));
        Poll::Ready(this.item.take())
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        // Pacing delays items but never drops or adds any: the inner bounds plus the held one.
        let held = usize::from(self.item.is_some());
        let (lo, hi) = self.stream.size_hint();
        (
            lo.saturating_add(held),
            hi.and_then(|h| h.checked_add(held)),
        )
    }
}

impl<S, C> FusedStream for Leaky<S, C>
where
    S: FusedStream,
    C: FnMut(&S::Item) -> u32,
{
    fn is_terminated(&self) -> bool {
        self.item.is_none() && self.stream.is_terminated()
    }
}

impl<S, C> fmt::Debug for Leaky<S, C>
where
    S: Stream + fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leaky")
            .field("stream", &self.stream)
            .field("pacer", self.paced.pacer())
            .field("holding", &self.item.is_some())
            .field("waiting", &self.paced.is_waiting())
            .finish()
    }
}
