//! `bulkhead_map_unordered`: map each item under a permit, yield in completion order.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Stream;
use futures::stream::{FusedStream, FuturesUnordered, StreamExt};
use pin_project::pin_project;

use crate::adaptive::Outcome;
use crate::bulkhead::Bulkhead;
use crate::bulkhead::feed::Feed;
use crate::bulkhead::slot::{Panic, Queue, Timed, poll_slot};
use crate::dropped::{Dropped, OnDrop};
use crate::error::ConfigError;

/// Stream of [`bulkhead_map_unordered`](crate::FlowStreamExt::bulkhead_map_unordered).
///
/// Pulls one item at a time, waits for a permit for it (backpressure: it never sheds),
/// maps it and runs the future with the permit held. The permit is returned the moment the
/// future completes, in the same poll; if a mapped future or `f` panics, the permit of that
/// work is returned before the panic leaves the poll; and every permit is returned if the
/// stream is dropped. Outputs come in completion order.
///
/// One mapped future at a time runs in a slot inside the adapter and is polled as soon as it
/// is made; only while that slot is taken do new futures go into a `FuturesUnordered`. A
/// future that completes at once (a cache hit, an already-ready result) therefore costs no
/// allocation. The slot's future is polled on every wake-up of the adapter, as in `select!`.
/// One exception: when a future finishes and the next item is ready, the permit goes
/// straight to that item's future as the finished one's output is yielded, and that future
/// is first polled by the next poll (until the consumer polls again, it holds its permit
/// unstarted). If `f` or the upstream panics there, or an adaptive bulkhead's algorithm (or a
/// metrics recorder) learning from the finished future, the finished output is yielded all
/// the same and the panic is resumed by the next poll.
///
/// If the bulkhead is closed, the adapter stops pulling, yields what is in flight, then
/// ends; the one item it held waiting for a permit is discarded: to the
/// [`on_drop`](BulkheadMapUnorderedBuilder::on_drop) hook, if one is set, as
/// [`Dropped::Discarded`] (the bulkhead counts the refused wait as a `closed` refusal in
/// `flowgate_bulkhead_rejected_total`). So is the item it holds when it is dropped.
#[pin_project]
#[must_use = "streams do nothing unless polled"]
pub struct BulkheadMapUnordered<St: Stream, F, Fut> {
    // Fields drop in this order: the futures in flight before `feed`, which holds their
    // permits, so a future's own drop still runs under its permit.
    /// The first future in flight, polled in place.
    #[pin]
    slot: Option<Timed<Fut>>,
    /// The others; dropped, every one of them is (see [`Queue`]).
    running: Queue<FuturesUnordered<Timed<Fut>>>,
    #[pin]
    feed: Feed<St>,
    f: F,
    /// A panic of `f`, the upstream or the adaptive algorithm (or a metrics recorder), caught
    /// while a finished output was being yielded; resumed by the next poll.
    panic: Option<Panic>,
}

impl<St, F, Fut> BulkheadMapUnordered<St, F, Fut>
where
    St: Stream,
    F: FnMut(St::Item) -> Fut,
    Fut: Future,
{
    /// A builder for the stream of [`bulkhead_map_unordered`](crate::FlowStreamExt::bulkhead_map_unordered), to give
    /// it an [`on_drop`](BulkheadMapUnorderedBuilder::on_drop) hook.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use flowgate::bulkhead::{Bulkhead, BulkheadMapUnordered};
    /// use flowgate::Dropped;
    /// use futures::StreamExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let db = Bulkhead::new(1)?;
    /// let busy = db.acquire().await?;
    /// let lost = Arc::new(Mutex::new(Vec::new()));
    /// let log = lost.clone();
    /// let items = futures::stream::iter(0..3u32);
    /// let mut out = Box::pin(
    ///     BulkheadMapUnordered::builder(items, db.clone(), |x| async move { x * 10 })
    ///         .on_drop(move |item: u32, why: &Dropped| log.lock().unwrap().push((item, why.as_str())))
    ///         .build()?,
    /// );
    /// assert!(futures::poll!(out.next()).is_pending()); // 0 waits for the permit `busy` holds
    /// drop(out); // dropped with 0 in hand
    /// assert_eq!(*lost.lock().unwrap(), [(0, "discarded")]);
    /// drop(busy);
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(stream: St, bulkhead: Bulkhead, f: F) -> BulkheadMapUnorderedBuilder<St, F> {
        BulkheadMapUnorderedBuilder {
            stream,
            bulkhead,
            f,
            on_drop: None,
        }
    }

    pub(crate) fn new(
        stream: St,
        bulkhead: &Bulkhead,
        f: F,
        on_drop: Option<OnDrop<St::Item>>,
    ) -> Self {
        BulkheadMapUnordered {
            slot: None,
            running: Queue(FuturesUnordered::new()),
            feed: Feed::new(stream, bulkhead, on_drop),
            f,
            panic: None,
        }
    }

    /// The inner stream.
    pub fn get_ref(&self) -> &St {
        self.feed.get_ref()
    }

    /// The inner stream, mutably.
    pub fn get_mut(&mut self) -> &mut St {
        self.feed.get_mut()
    }

    /// The inner stream, pinned.
    pub fn get_pin_mut(self: Pin<&mut Self>) -> Pin<&mut St> {
        self.project().feed.get_pin_mut()
    }

    /// The inner stream; futures in flight are dropped and their permits returned. The
    /// stream is `!Unpin` (its wait is pinned), so only one never polled can be taken apart:
    /// it holds no item yet.
    pub fn into_inner(self) -> St {
        self.feed.into_inner()
    }
}

impl<St: Stream, F, Fut> BulkheadMapUnordered<St, F, Fut> {
    /// Mapped futures in flight.
    fn in_flight(&self) -> usize {
        self.running.0.len() + usize::from(self.slot.is_some())
    }
}

impl<St, F, Fut> Stream for BulkheadMapUnordered<St, F, Fut>
where
    St: Stream,
    F: FnMut(St::Item) -> Fut,
    Fut: Future,
{
    type Item = Fut::Output;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Fut::Output>> {
        // However the poll ends, a panic's unwinding too, the permits held match the futures
        // in flight: the permit of work that is gone (a future or `f` that panicked) goes
        // back before the poll ends, not on the next one.
        let mut settled = Settled(self);
        let mut this = settled.0.as_mut().project();
        // A panic kept from the poll that yielded the output before it.
        if let Some(panic) = this.panic.take() {
            panic.resume();
        }
        let (out, grant) = loop {
            if let Poll::Ready(Some(out)) = poll_slot(this.slot.as_mut(), cx) {
                break out;
            }
            // Start work while there is input and a permit for it; a new future that lands
            // in the free slot is polled at once.
            let was_free = this.slot.is_none();
            while let Some(item) = {
                let own = usize::from(this.slot.is_some()) + this.running.0.len();
                this.feed.as_mut().poll_start(cx, own)
            } {
                let fut = Timed::start(this.feed.start(), || (this.f)(item));
                if place(this.slot.as_mut(), &mut this.running.0, fut) {
                    break;
                }
            }
            if was_free && this.slot.is_some() {
                continue;
            }
            match this.running.0.poll_next_unpin(cx) {
                Poll::Ready(Some(out)) => break out,
                Poll::Ready(None) if this.slot.is_none() && this.feed.is_done() => {
                    return Poll::Ready(None);
                }
                _ => return Poll::Pending,
            }
        };
        // Completed: an `Ok` sample on an adaptive bulkhead. Then the finished future's
        // permit goes straight to the next item when that item is ready and nobody else is
        // waiting for the permit; otherwise it is returned at once. Both run user code (the
        // algorithm, a metrics recorder, the upstream, `f`) with `out` in hand: a panic there
        // is kept for the next poll, so that `out` is not lost with it (a permit it leaves
        // held is returned as the poll ends).
        let handed = std::panic::catch_unwind(AssertUnwindSafe(|| {
            if let Some(grant) = grant {
                this.feed.record(grant, Outcome::Ok);
            }
            match this.feed.as_mut().poll_ready_item(cx) {
                Some(item) if this.feed.may_keep() => {
                    let fut = Timed::start(this.feed.start(), || (this.f)(item));
                    place(this.slot.as_mut(), &mut this.running.0, fut);
                }
                next => {
                    if let Some(item) = next {
                        this.feed.as_mut().put_back(item);
                    }
                    this.feed.as_mut().permits().release();
                }
            }
        }));
        if let Err(payload) = handed {
            *this.panic = Some(Panic::new(payload));
        }
        Poll::Ready(Some(out))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.feed.size_hint(self.in_flight(), true)
    }
}

/// The adapter during a poll: when dropped, as the poll ends or unwinds, it returns the
/// permits held beyond one per future in flight (those of a future or an `f` call that
/// panicked, or of a finished future whose permit was to pass to an item `f` panicked on).
struct Settled<'a, St: Stream, F, Fut>(Pin<&'a mut BulkheadMapUnordered<St, F, Fut>>);

impl<St: Stream, F, Fut> Drop for Settled<'_, St, F, Fut> {
    fn drop(&mut self) {
        let in_flight = self.0.in_flight();
        self.0.as_mut().project().feed.permits().settle(in_flight);
    }
}

/// Put a new future in the slot if it is free (true), else with the others.
fn place<Fut>(
    mut slot: Pin<&mut Option<Fut>>,
    running: &mut FuturesUnordered<Fut>,
    fut: Fut,
) -> bool {
    if slot.is_none() {
        slot.set(Some(fut));
        true
    } else {
        running.push(fut);
        false
    }
}

impl<St, F, Fut> FusedStream for BulkheadMapUnordered<St, F, Fut>
where
    St: Stream,
    F: FnMut(St::Item) -> Fut,
    Fut: Future,
{
    fn is_terminated(&self) -> bool {
        self.in_flight() == 0 && self.feed.is_done() && self.panic.is_none()
    }
}

impl<St, F, Fut> fmt::Debug for BulkheadMapUnordered<St, F, Fut>
where
    St: Stream + fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.feed.debug(f, "BulkheadMapUnordered", self.in_flight())
    }
}

/// Builds a [`BulkheadMapUnordered`]; from [`BulkheadMapUnordered::builder`].
#[must_use = "a builder does nothing until it is built"]
pub struct BulkheadMapUnorderedBuilder<St: Stream, F> {
    stream: St,
    bulkhead: Bulkhead,
    f: F,
    on_drop: Option<OnDrop<St::Item>>,
}

impl<St: Stream, F> BulkheadMapUnorderedBuilder<St, F> {
    /// Call `hook` with the item the stream holds waiting for a permit when it lets go of it
    /// ([`Dropped::Discarded`]): when the bulkhead is closed, and when the stream is dropped.
    /// It runs in the task that polls or drops the stream.
    pub fn on_drop(mut self, hook: impl Fn(St::Item, &Dropped) + Send + Sync + 'static) -> Self {
        self.on_drop = Some(OnDrop::new(hook));
        self
    }

    /// Build the stream.
    ///
    /// # Errors
    ///
    /// None today: every setting is valid by its type. `Result` like every builder, so a
    /// setting that needs checking can be added without breaking callers.
    pub fn build<Fut>(self) -> Result<BulkheadMapUnordered<St, F, Fut>, ConfigError>
    where
        F: FnMut(St::Item) -> Fut,
        Fut: Future,
    {
        Ok(BulkheadMapUnordered::new(
            self.stream,
            &self.bulkhead,
            self.f,
            self.on_drop,
        ))
    }
}

impl<St: Stream + fmt::Debug, F> fmt::Debug for BulkheadMapUnorderedBuilder<St, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BulkheadMapUnorderedBuilder")
            .field("stream", &self.stream)
            .field("bulkhead", &self.bulkhead)
            .field("on_drop", &self.on_drop.is_some())
            .finish_non_exhaustive()
    }
}
