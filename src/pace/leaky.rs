//! `leaky`, `leaky_with`, `leaky_cost`: a stream released at a constant rate.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use futures::Stream;
use futures::stream::FusedStream;
use pin_project::pin_project;

use crate::dropped::{Dropped, Held, OnDrop};
use crate::error::ConfigError;
use crate::metrics::Labels;
use crate::pace::Pacer;
use crate::pace::paced::Paced;
use crate::pace::pacer::names;

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
/// successive chunks of half the burst (rounded up), so the rate holds in cost units, late
/// timers included; an item of cost 0 passes at once. An item of the whole burst, or within
/// `rate × 1 ms` of it, pays at once: it waits for a bucket that full, and what its timer's
/// lateness (up to 1 ms) would have added is lost, item after item, as for
/// [`Pacer::until_ready`] of the burst (see [`Pacer`]'s "Burst and precision"): items of 16
/// at 3 000/s, the default burst there, leave about 12 % slow. Give such items a burst of at
/// least their largest cost plus `rate × 1 ms` (19 there).
///
/// The item waiting for the pacer when the stream is dropped or taken apart with
/// [`into_inner`](Leaky::into_inner) is discarded: it goes to the
/// [`on_drop`](LeakyBuilder::on_drop) hook, if one is set, as [`Dropped::Discarded`], and is
/// counted as `flowgate_pace_dropped_total{policy="closed"}` under the pacer's name, as the
/// items left in a [`leaky_queue`](crate::FlowStreamExt::leaky_queue) are. An item dropped
/// partway through paying in chunks keeps the chunks it paid: taken from the bucket, they
/// are not given back, and stay counted in `flowgate_pace_released_total`.
///
/// Made by [`leaky`](crate::FlowStreamExt::leaky), [`leaky_with`](crate::FlowStreamExt::leaky_with)
/// and [`leaky_cost`](crate::FlowStreamExt::leaky_cost), or by [`Leaky::builder`] to give
/// it a hook.
///
/// # Panics
///
/// An item that has to wait sleeps on a tokio timer: polled outside a tokio runtime with
/// timers enabled, the stream panics unless the pacer admits each item at once.
///
/// # Examples
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use flowgate::pace::{Leaky, Pacer};
/// use flowgate::{Dropped, Rate};
/// use futures::StreamExt;
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let pacer = Pacer::builder(Rate::per_second(10)?).burst(1).build()?;
/// let lost = Arc::new(Mutex::new(Vec::new()));
/// let log = lost.clone();
/// let mut paced = Leaky::builder(futures::stream::iter(0..10u32), pacer)
///     .on_drop(move |item: u32, why: &Dropped| log.lock().unwrap().push((item, why.as_str())))
///     .build()?;
/// assert_eq!(paced.next().await, Some(0));
/// assert_eq!(futures::poll!(paced.next()), std::task::Poll::Pending); // 1 waits its turn
/// drop(paced);
/// assert_eq!(*lost.lock().unwrap(), [(1, "discarded")]);
/// # Ok(())
/// # }
/// ```
#[pin_project]
#[must_use = "streams do nothing unless polled"]
pub struct Leaky<S: Stream, C> {
    #[pin]
    stream: S,
    cost: C,
    held: Held<S::Item>,
    paced: Paced,
}

impl<S: Stream> Leaky<S, UnitCost<S::Item>> {
    /// A builder for a stream releasing the items of `stream` through `pacer`; each item
    /// costs 1 unless [`cost`](LeakyBuilder::cost) says otherwise, and no hook is set.
    ///
    /// # Examples
    ///
    /// Items of different weights, as [`leaky_cost`](crate::FlowStreamExt::leaky_cost)
    /// releases them, with a hook for the item waiting when the stream is dropped (see also
    /// the example on [`Leaky`]):
    ///
    /// ```
    /// use std::sync::atomic::{AtomicU32, Ordering};
    /// use std::sync::Arc;
    /// use flowgate::pace::{Leaky, Pacer};
    /// use flowgate::{Dropped, Rate};
    /// use futures::StreamExt;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pacer = Pacer::builder(Rate::per_second(100)?).burst(10).build()?;
    /// let lost = Arc::new(AtomicU32::new(0));
    /// let seen = lost.clone();
    /// let batches = futures::stream::iter([vec![0u8; 10], vec![0u8; 10]]);
    /// let mut paced = Leaky::builder(batches, pacer)
    ///     .cost(|batch: &Vec<u8>| batch.len() as u32) // a batch of 10 costs 10
    ///     .on_drop(move |batch: Vec<u8>, _: &Dropped| {
    ///         seen.fetch_add(batch.len() as u32, Ordering::Relaxed);
    ///     })
    ///     .build()?;
    /// assert_eq!(paced.next().await.map(|b| b.len()), Some(10)); // the burst
    /// assert!(futures::poll!(paced.next()).is_pending()); // the next 10 wait 100 ms
    /// drop(paced);
    /// assert_eq!(lost.load(Ordering::Relaxed), 10);
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(stream: S, pacer: Pacer) -> LeakyBuilder<S, UnitCost<S::Item>> {
        LeakyBuilder {
            stream,
            pacer,
            cost: unit_cost::<S::Item>,
            on_drop: None,
        }
    }
}

impl<S, C> Leaky<S, C>
where
    S: Stream,
    C: FnMut(&S::Item) -> u32,
{
    pub(crate) fn new(stream: S, pacer: Pacer, cost: C) -> Self {
        Leaky::with_hook(stream, pacer, cost, None)
    }

    fn with_hook(stream: S, pacer: Pacer, cost: C, on_drop: Option<OnDrop<S::Item>>) -> Self {
        // The item held when the stream goes away: counted as `closed`, as a
        // `leaky_queue`'s.
        let closed =
            Labels::new(pacer.name()).counter(names::DROPPED, &[("policy", names::CLOSED)]);
        Leaky {
            stream,
            cost,
            held: Held::new(on_drop, closed),
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

    /// The inner stream; an item waiting for the pacer is discarded (passed to `on_drop`
    /// first, as [`Dropped::Discarded`], and counted as `closed`).
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
        let held = &mut this.held.item;
        if held.is_none() {
            match ready!(this.stream.poll_next(cx)) {
                Some(item) => *held = Some(item),
                None => return Poll::Ready(None),
            }
        }
        let item = held.as_ref().expect("an item is held");
        let cost = this.cost;
        // Weighed once, when it starts to pay: not again at each poll while it waits.
        ready!(this.paced.poll_admit(|| cost(item), cx));
        Poll::Ready(held.take())
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        // Pacing delays items but never drops or adds any: the inner bounds plus the held one.
        let held = usize::from(self.held.item.is_some());
        let (lo, hi) = self.stream.size_hint();
        (
            lo.saturating_add(held),
            hi.and_then(|h| h.checked_add(held)),
        )
    }
}

/// The inner stream's write half, untouched (only reading is paced).
impl<S, C, Item> futures::Sink<Item> for Leaky<S, C>
where
    S: Stream + futures::Sink<Item>,
{
    type Error = S::Error;
    crate::ext::delegate_sink!(stream, Item);
}

impl<S, C> FusedStream for Leaky<S, C>
where
    S: FusedStream,
    C: FnMut(&S::Item) -> u32,
{
    fn is_terminated(&self) -> bool {
        self.held.item.is_none() && self.stream.is_terminated()
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
            .field("holding", &self.held.item.is_some())
            .field("waiting", &self.paced.is_waiting())
            .finish()
    }
}

/// Builds a [`Leaky`] stream; from [`Leaky::builder`].
#[must_use = "a builder does nothing until it is built"]
pub struct LeakyBuilder<S: Stream, C> {
    stream: S,
    pacer: Pacer,
    cost: C,
    on_drop: Option<OnDrop<S::Item>>,
}

impl<S: Stream, C> LeakyBuilder<S, C> {
    /// Each item costs `cost(&item)` units (default 1), as in
    /// [`leaky_cost`](crate::FlowStreamExt::leaky_cost): an item above the pacer's burst
    /// pays in chunks, an item of cost 0 passes at once. `cost` is called once per item,
    /// when it is pulled, however many polls it then waits.
    pub fn cost<C2>(self, cost: C2) -> LeakyBuilder<S, C2>
    where
        C2: FnMut(&S::Item) -> u32,
    {
        LeakyBuilder {
            stream: self.stream,
            pacer: self.pacer,
            cost,
            on_drop: self.on_drop,
        }
    }

    /// Call `hook` with the item waiting for the pacer when the stream is dropped or taken
    /// apart with `into_inner` ([`Dropped::Discarded`]). It runs in the task that drops the
    /// stream.
    pub fn on_drop(mut self, hook: impl Fn(S::Item, &Dropped) + Send + Sync + 'static) -> Self {
        self.on_drop = Some(OnDrop::new(hook));
        self
    }

    /// Build the stream.
    ///
    /// # Errors
    ///
    /// None today: every setting is valid by its type. `Result` like every builder, so a
    /// setting that needs checking can be added without breaking callers.
    pub fn build(self) -> Result<Leaky<S, C>, ConfigError>
    where
        C: FnMut(&S::Item) -> u32,
    {
        Ok(Leaky::with_hook(
            self.stream,
            self.pacer,
            self.cost,
            self.on_drop,
        ))
    }
}

impl<S: Stream + fmt::Debug, C> fmt::Debug for LeakyBuilder<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeakyBuilder")
            .field("stream", &self.stream)
            .field("pacer", &self.pacer)
            .field("on_drop", &self.on_drop.is_some())
            .finish_non_exhaustive()
    }
}
