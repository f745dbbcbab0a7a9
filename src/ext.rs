//! `FlowStreamExt` and `FlowSinkExt`: every flowgate combinator, as a method.

use std::future::Future;
use std::num::NonZeroUsize;

use futures::{Sink, Stream};

use crate::bulkhead::{Bulkhead, BulkheadMap, BulkheadMapUnordered, BulkheadSpawnMap};
use crate::demand::{DemandHandle, Demanded, Levels, Watermarks};
use crate::gate::{Gate, Gated, GatedDrop};
use crate::overflow::Overflow;
use crate::pace::{Leaky, LeakyQueue, LeakySink, Pacer, UnitCost};
use crate::rate::Rate;

/// flowgate's stream combinators, for every [`Stream`].
///
/// In the [`prelude`](crate::prelude).
pub trait FlowStreamExt: Stream {
    /// Map each item to a future and run at most the bulkhead's
    /// [`max_in_flight`](Bulkhead::max_in_flight) of them at once (shared with everything
    /// else using `bulkhead`); outputs in input order, like `buffered`. Waits for permits,
    /// never sheds. Without a drop hook for the item it holds waiting for a permit: to see
    /// that item when it is discarded, build it with
    /// [`BulkheadMap::builder`]`(stream, bulkhead, f)`.
    ///
    /// See the [`bulkhead`](crate::bulkhead) module for when to use which adapter.
    ///
    /// # Examples
    ///
    /// ```
    /// use flowgate::prelude::*;
    /// use flowgate::bulkhead::Bulkhead;
    /// use futures::StreamExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let db = Bulkhead::new(4)?;
    /// let out: Vec<u32> = futures::stream::iter(1..=10)
    ///     .bulkhead_map(db.clone(), |x| async move { x * 10 })
    ///     .collect()
    ///     .await;
    /// assert_eq!(out, (1..=10).map(|x| x * 10).collect::<Vec<_>>());
    /// assert_eq!(db.in_flight(), 0);
    /// # Ok(())
    /// # }
    /// ```
    fn bulkhead_map<F, Fut>(self, bulkhead: Bulkhead, f: F) -> BulkheadMap<Self, F, Fut>
    where
        Self: Sized,
        F: FnMut(Self::Item) -> Fut,
        Fut: Future,
    {
        BulkheadMap::new(self, &bulkhead, f, None)
    }

    /// As [`bulkhead_map`](FlowStreamExt::bulkhead_map), with outputs in completion order,
    /// like `buffer_unordered`. A drop hook is set with
    /// [`BulkheadMapUnordered::builder`]`(stream, bulkhead, f)`.
    fn bulkhead_map_unordered<F, Fut>(
        self,
        bulkhead: Bulkhead,
        f: F,
    ) -> BulkheadMapUnordered<Self, F, Fut>
    where
        Self: Sized,
        F: FnMut(Self::Item) -> Fut,
        Fut: Future,
    {
        BulkheadMapUnordered::new(self, &bulkhead, f, None)
    }

    /// As [`bulkhead_map_unordered`](FlowStreamExt::bulkhead_map_unordered), but each mapped
    /// future runs on its own tokio task, so it keeps making progress (and returns its
    /// permit) while the consumer is busy. At most the bulkhead's `max_in_flight` of its
    /// tasks are outstanding (running, or finished with an output not yet taken), so a slow
    /// consumer slows the intake instead of piling up outputs (see [`BulkheadSpawnMap`]).
    /// A drop hook is set with [`BulkheadSpawnMap::builder`]`(stream, bulkhead, f)`.
    ///
    /// # Panics
    ///
    /// When polled outside a tokio runtime (it spawns tasks).
    fn bulkhead_spawn_map<F, Fut>(self, bulkhead: Bulkhead, f: F) -> BulkheadSpawnMap<Self, F, Fut>
    where
        Self: Sized,
        F: FnMut(Self::Item) -> Fut,
        Fut: Future + Send + 'static,
        Fut::Output: Send + 'static,
    {
        BulkheadSpawnMap::new(self, &bulkhead, f, None)
    }

    /// Release items at `rate` through a private [`Pacer`] with the default burst; the
    /// upstream is slowed to the rate (backpressure). Without a drop hook for the item it
    /// holds waiting for the pacer: to see that item when the stream is dropped, build it
    /// with [`Leaky::builder`]`(stream, pacer)`.
    ///
    /// # Panics
    ///
    /// When it has to wait outside a tokio runtime with its time driver enabled (it waits on
    /// tokio timers); an item the pacer admits at once needs no runtime.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use flowgate::prelude::*;
    /// use futures::StreamExt;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let start = tokio::time::Instant::now();
    /// let n = futures::stream::iter(0..100)
    ///     .leaky(Rate::per_second(50)?)
    ///     .count()
    ///     .await;
    /// assert_eq!(n, 100);
    /// // The default burst (1 + 50 × 5 ms = 2) goes at once, the other 98 at 50/s.
    /// assert_eq!(start.elapsed(), Duration::from_millis(1_960));
    /// # Ok(())
    /// # }
    /// ```
    fn leaky(self, rate: Rate) -> Leaky<Self, UnitCost<Self::Item>>
    where
        Self: Sized,
    {
        Leaky::new(self, Pacer::new(rate), crate::pace::unit_cost)
    }

    /// Release items through a shared `pacer` (one rate for many streams, FIFO across them).
    /// A drop hook is set with [`Leaky::builder`]`(stream, pacer)`.
    ///
    /// # Panics
    ///
    /// When it has to wait outside a tokio runtime with its time driver enabled (it waits on
    /// tokio timers); an item the pacer admits at once needs no runtime.
    fn leaky_with(self, pacer: Pacer) -> Leaky<Self, UnitCost<Self::Item>>
    where
        Self: Sized,
    {
        Leaky::new(self, pacer, crate::pace::unit_cost)
    }

    /// Release items through `pacer`, each costing `cost(&item)` units (a cost above the
    /// burst is paid in chunks; a cost of 0 is free). A drop hook is set with
    /// [`Leaky::builder`]`(stream, pacer).cost(cost)`.
    ///
    /// # Panics
    ///
    /// When it has to wait outside a tokio runtime with its time driver enabled (it waits on
    /// tokio timers); an item the pacer admits at once needs no runtime.
    fn leaky_cost<C>(self, pacer: Pacer, cost: C) -> Leaky<Self, C>
    where
        Self: Sized,
        C: FnMut(&Self::Item) -> u32,
    {
        Leaky::new(self, pacer, cost)
    }

    /// The enforcing leaky bucket: drain the upstream eagerly into a queue of `capacity`
    /// items and release them through `pacer`; `overflow` decides what happens when the
    /// queue is full (see [`LeakyQueue`]). Unnamed and without a drop hook: to set them,
    /// build it with [`LeakyQueue::builder`]`(stream, pacer, capacity)`.
    ///
    /// # Panics
    ///
    /// When it has to wait outside a tokio runtime with its time driver enabled (it waits on
    /// tokio timers); an item the pacer admits at once needs no runtime.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::num::NonZeroUsize;
    /// use flowgate::pace::Pacer;
    /// use flowgate::prelude::*;
    /// use futures::StreamExt;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pacer = Pacer::builder(Rate::per_second(100)?).burst(1).build()?;
    /// let capacity = NonZeroUsize::new(4).expect("4 is not zero");
    /// let out: Vec<u32> = futures::stream::iter(0..10)
    ///     .leaky_queue(pacer, capacity, Overflow::Backpressure)
    ///     .collect()
    ///     .await;
    /// assert_eq!(out, (0..10).collect::<Vec<_>>()); // backpressure loses nothing
    /// # Ok(())
    /// # }
    /// ```
    fn leaky_queue(
        self,
        pacer: Pacer,
        capacity: NonZeroUsize,
        overflow: Overflow,
    ) -> LeakyQueue<Self>
    where
        Self: Sized,
    {
        LeakyQueue::new(self, pacer, capacity, overflow, None, None)
    }

    /// Yield items only while credit remains: `initial` now, more through
    /// [`DemandHandle::request`]. Never more items than requested in total.
    ///
    /// Unnamed: to set the `name` label of its metrics, build it with
    /// [`Demanded::builder`]`(stream, initial).name(..)`.
    ///
    /// # Examples
    ///
    /// ```
    /// use flowgate::prelude::*;
    /// use futures::StreamExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let (mut stream, demand) = futures::stream::iter(0..100).with_demand(2);
    /// assert_eq!(stream.next().await, Some(0));
    /// assert_eq!(stream.next().await, Some(1));
    /// assert!(futures::poll!(stream.next()).is_pending()); // no credit left
    /// demand.request(1)?;
    /// assert_eq!(stream.next().await, Some(2));
    /// # Ok(())
    /// # }
    /// ```
    fn with_demand(self, initial: u64) -> (Demanded<Self>, DemandHandle)
    where
        Self: Sized,
    {
        Demanded::new(self, initial, None)
    }

    /// Pair each item with a [`Ticket`](crate::demand::Ticket) and pause pulling while
    /// `levels.high()` tickets are alive, until they fall to `levels.low()`; see
    /// [`Watermarks`].
    ///
    /// Unnamed and without `min_hold` (changes of state follow in-flight at once): to set
    /// them, build it with [`Watermarks::builder`]`(stream, levels).min_hold(..).name(..)`.
    /// No timer is ever set, so it needs no runtime.
    ///
    /// # Examples
    ///
    /// ```
    /// use flowgate::prelude::*;
    /// use flowgate::demand::Levels;
    /// use futures::StreamExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let mut stream = futures::stream::iter(0..10).watermarks(Levels::new(2, 0)?);
    /// let signal = stream.pause_signal();
    /// let (_, a) = stream.next().await.unwrap();
    /// let (_, b) = stream.next().await.unwrap();
    /// assert!(signal.is_paused()); // 2 tickets alive: high
    /// assert!(futures::poll!(stream.next()).is_pending());
    /// drop((a, b)); // done: down to low
    /// assert!(!signal.is_paused());
    /// assert_eq!(stream.next().await.map(|(i, _ticket)| i), Some(2));
    /// # Ok(())
    /// # }
    /// ```
    fn watermarks(self, levels: Levels) -> Watermarks<Self>
    where
        Self: Sized,
    {
        Watermarks::new(self, levels, std::time::Duration::ZERO, None)
    }

    /// Pass each item through `gate` under the key `key(&item)`, waiting `retry_after` when
    /// it is rejected (shaping): items leave at the rate the gate allows (at most its burst
    /// per 1 ms timer tick: see [`Gated`]). Each item costs 1.
    ///
    /// The key function returns anything that is `AsRef<str> + Send + 'static` (a
    /// `&'static str`, a `String`, an `Arc<str>`): flowgate allocates nothing for it. With an
    /// in-memory gate nothing is allocated per item at all. For a cost per item, a drop hook
    /// or a name, use [`Gated::builder`].
    ///
    /// # Panics
    ///
    /// When it has to wait outside a tokio runtime with its time driver enabled.
    ///
    /// # Examples
    ///
    /// ```
    /// use flowgate::gate::{Limit, MemoryGate};
    /// use flowgate::prelude::*;
    /// use futures::StreamExt;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(10)?));
    /// let start = tokio::time::Instant::now();
    /// let n = futures::stream::iter(0..20)
    ///     .gated(gate, |_: &u32| "tenant-a")
    ///     .count()
    ///     .await;
    /// assert_eq!(n, 20);
    /// assert_eq!(start.elapsed(), std::time::Duration::from_millis(1_000)); // 10 at once, 10 at 10/s
    /// # Ok(())
    /// # }
    /// ```
    fn gated<G, K, Key>(self, gate: G, key: K) -> Gated<Self, G, K>
    where
        Self: Sized,
        G: Gate + Clone + 'static,
        K: FnMut(&Self::Item) -> Key,
        Key: AsRef<str> + Send + 'static,
    {
        Gated::builder(self, gate, key).into_gated()
    }

    /// Pass each item through `gate` under the key `key(&item)`; drop it when rejected
    /// (policing). Each item costs 1. Dropped items are counted
    /// ([`Gated::dropped`]); to see them, give a hook to [`Gated::builder`]`(..)
    /// .drop_rejected(true).on_drop(..)`.
    ///
    /// # Examples
    ///
    /// ```
    /// use flowgate::gate::{Limit, MemoryGate};
    /// use flowgate::prelude::*;
    /// use futures::StreamExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(5)?));
    /// let mut passed = futures::stream::iter(0..20).gated_drop(gate, |_: &u32| "tenant-a");
    /// let mut n = 0;
    /// while passed.next().await.is_some() {
    ///     n += 1;
    /// }
    /// assert_eq!((n, passed.dropped()), (5, 15));
    /// # Ok(())
    /// # }
    /// ```
    fn gated_drop<G, K, Key>(self, gate: G, key: K) -> GatedDrop<Self, G, K>
    where
        Self: Sized,
        G: Gate + Clone + 'static,
        K: FnMut(&Self::Item) -> Key,
        Key: AsRef<str> + Send + 'static,
    {
        Gated::builder(self, gate, key)
            .drop_rejected(true)
            .into_gated()
    }
}

impl<S: Stream + ?Sized> FlowStreamExt for S {}

/// flowgate's sink combinators, for every [`Sink`].
///
/// In the [`prelude`](crate::prelude).
pub trait FlowSinkExt<Item>: Sink<Item> {
    /// Accept items at `rate` through a private [`Pacer`] with the default burst: each
    /// `poll_ready` asks the inner sink for room, then waits for the pacer (see
    /// [`LeakySink`]).
    ///
    /// The sink side of [`FlowStreamExt::leaky`]; its own name, so that a type that is both a
    /// `Stream` and a `Sink` (a `Framed`, a websocket) can call either with the prelude in
    /// scope.
    ///
    /// # Panics
    ///
    /// When it has to wait outside a tokio runtime with its time driver enabled (it waits on
    /// tokio timers); an item the pacer admits at once needs no runtime.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use flowgate::prelude::*;
    /// use futures::SinkExt;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let (tx, rx) = flowgate::channel::bounded::<u32>(16)?;
    /// let mut outbound = tx.leaky_sink(Rate::per_second(10)?);
    /// let start = tokio::time::Instant::now();
    /// for i in 0..4 {
    ///     outbound.send(i).await?;
    /// }
    /// // The default burst (1 + 10 × 5 ms = 2) goes at once, the other 2 at 10/s.
    /// assert_eq!(start.elapsed(), Duration::from_millis(200));
    /// # drop(rx);
    /// # Ok(())
    /// # }
    /// ```
    fn leaky_sink(self, rate: Rate) -> LeakySink<Self>
    where
        Self: Sized,
    {
        LeakySink::new(self, Pacer::new(rate))
    }

    /// As [`leaky_sink`](FlowSinkExt::leaky_sink), through a shared `pacer` (one rate for
    /// many sinks and streams, FIFO across them).
    ///
    /// # Panics
    ///
    /// When it has to wait outside a tokio runtime with its time driver enabled (it waits on
    /// tokio timers); an item the pacer admits at once needs no runtime.
    fn leaky_sink_with(self, pacer: Pacer) -> LeakySink<Self>
    where
        Self: Sized,
    {
        LeakySink::new(self, pacer)
    }
}

impl<Item, S: Sink<Item> + ?Sized> FlowSinkExt<Item> for S {}

/// The body of `impl Sink<$item> for Adapter<..>` on a stream adapter whose inner stream
/// (the pinned field `$field`) is also a sink: every call goes to it, so an adapter over a
/// duplex (a framed socket, a websocket) keeps its write half. Write `type Error` beside it.
macro_rules! delegate_sink {
    ($field:ident, $item:ty) => {
        fn poll_ready(
            self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), Self::Error>> {
            self.project().$field.poll_ready(cx)
        }

        fn start_send(self: std::pin::Pin<&mut Self>, item: $item) -> Result<(), Self::Error> {
            self.project().$field.start_send(item)
        }

        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), Self::Error>> {
            self.project().$field.poll_flush(cx)
        }

        fn poll_close(
            self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), Self::Error>> {
            self.project().$field.poll_close(cx)
        }
    };
}
pub(crate) use delegate_sink;
