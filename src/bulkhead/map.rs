//! `bulkhead_map`: map each item under a permit, yield in input order.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use futures::Stream;
use futures::stream::{FusedStream, FuturesOrdered, StreamExt};
use pin_project::pin_project;

use crate::bulkhead::Bulkhead;
use crate::bulkhead::acquire::OwnedBulkheadPermit;
use crate::bulkhead::feed::Feed;
use crate::bulkhead::slot::{Panic, Queue, held_back, learn_ok, poll_slot};
use crate::dropped::{Dropped, OnDrop};
use crate::error::ConfigError;

/// A mapped future that returns its permit the moment it completes (or is dropped).
#[pin_project]
#[derive(Debug)]
pub(crate) struct Permitted<Fut> {
    #[pin]
    fut: Fut,
    permit: Held,
}

/// The permit of a mapped future, returned when the future completes or is dropped.
#[derive(Debug)]
struct Held(Option<OwnedBulkheadPermit>);

impl Drop for Held {
    /// Its return runs user code (a metrics recorder, a waker): see [`held_back`].
    fn drop(&mut self) {
        if let Some(permit) = self.0.take() {
            held_back(|| drop(permit));
        }
    }
}

/// The mapped futures behind the oldest; dropped, every one of them is (see [`Queue`]).
type Running<Fut> = Queue<FuturesOrdered<Caught<Permitted<Fut>>>>;

impl<Fut: Future> Future for Permitted<Fut> {
    type Output = Finished<Fut::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let out = ready!(this.fut.poll(cx));
        // Completed: an `Ok` sample on an adaptive bulkhead (dropped before: `Ignored`).
        let panic = this.permit.0.take().and_then(learn_ok);
        Poll::Ready((out, panic))
    }
}

/// A mapped future queued behind the oldest: a panic in it is caught and becomes its output,
/// so the ordered queue does not wait for an output that will never come (holding back
/// every later one for good). The future is dropped at once, its permit returned; the
/// adapter resumes the panic in the poll that would have yielded its output.
#[pin_project]
#[derive(Debug)]
struct Caught<Fut> {
    #[pin]
    fut: Fut,
}

impl<Fut: Future> Future for Caught<Fut> {
    type Output = Result<Fut::Output, Panic>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let fut = self.project().fut;
        match std::panic::catch_unwind(AssertUnwindSafe(|| fut.poll(cx))) {
            Ok(Poll::Ready(out)) => Poll::Ready(Ok(out)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(payload) => Poll::Ready(Err(Panic::new(payload))),
        }
    }
}

/// A finished future's output, with a panic of learning from it (see [`learn_ok`]).
type Finished<T> = (T, Option<Panic>);

/// An output, a panic of learning from its future kept in `later` for the next poll; or the
/// panic of a future behind the oldest, resumed now.
fn yielded<T>(out: Result<Finished<T>, Panic>, later: &mut Option<Panic>) -> Poll<Option<T>> {
    match out {
        Ok((out, panic)) => {
            *later = panic;
            Poll::Ready(Some(out))
        }
        Err(panic) => panic.resume(),
    }
}

/// Stream of [`bulkhead_map`](crate::FlowStreamExt::bulkhead_map).
///
/// As [`BulkheadMapUnordered`](crate::bulkhead::BulkheadMapUnordered), but outputs come in
/// input order (like `buffered`). A future that completes early returns its permit at once;
/// its output waits for the ones before it. At most the bulkhead's
/// [`max_in_flight`](crate::bulkhead::Bulkhead::max_in_flight) outputs are in flight or
/// waiting, so memory stays bounded while the head of the line is slow.
///
/// When nothing else is in flight, a new future runs in a slot inside the adapter and is
/// polled as soon as it is made (it is then the oldest, so its output goes first): a future
/// that is ready at once costs no allocation. Outputs of later futures that finish while the
/// slot's future still runs wait in a small queue behind it.
///
/// A mapped future that panics is dropped at once and its permit returned; the panic is
/// resumed by the poll that would have yielded its output, in input order. If the caller
/// catches it and polls on, the outputs after it still come. A panic of an adaptive
/// bulkhead's algorithm (or of a metrics recorder) learning from a finished future is
/// resumed by the poll after the one that yields that future's output.
///
/// The item it holds waiting for a permit when the bulkhead closes, or when the stream is
/// dropped, is discarded: to the [`on_drop`](BulkheadMapBuilder::on_drop) hook, if one is
/// set, as [`Dropped::Discarded`].
#[pin_project]
#[must_use = "streams do nothing unless polled"]
pub struct BulkheadMap<St: Stream, F, Fut: Future> {
    #[pin]
    feed: Feed<St>,
    f: F,
    /// The oldest future in flight, polled in place (filled only when nothing else runs).
    #[pin]
    slot: Option<Permitted<Fut>>,
    /// Outputs (or panics) of `running` that finished before the slot's future, in order.
    done: VecDeque<Result<Finished<Fut::Output>, Panic>>,
    running: Running<Fut>,
    /// A panic of the adaptive algorithm (or a metrics recorder) learning from a finished
    /// future, caught with its output; resumed by the poll after the one that yields it.
    panic: Option<Panic>,
}

impl<St, F, Fut> BulkheadMap<St, F, Fut>
where
    St: Stream,
    F: FnMut(St::Item) -> Fut,
    Fut: Future,
{
    /// A builder for the stream of [`bulkhead_map`](crate::FlowStreamExt::bulkhead_map), to give
    /// it an [`on_drop`](BulkheadMapBuilder::on_drop) hook.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use flowgate::bulkhead::{Bulkhead, BulkheadMap};
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
    ///     BulkheadMap::builder(items, db.clone(), |x| async move { x * 10 })
    ///         .on_drop(move |item: u32, why: &Dropped| log.lock().unwrap().push((item, why.as_str())))
    ///         .build()?,
    /// );
    /// assert!(futures::poll!(out.next()).is_pending()); // 0 waits for the permit `busy` holds
    /// db.close();
    /// assert_eq!(out.next().await, None);
    /// assert_eq!(*lost.lock().unwrap(), [(0, "discarded")]);
    /// drop(busy);
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(stream: St, bulkhead: Bulkhead, f: F) -> BulkheadMapBuilder<St, F> {
        BulkheadMapBuilder {
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
        BulkheadMap {
            feed: Feed::new(stream, bulkhead, on_drop),
            f,
            slot: None,
            done: VecDeque::new(),
            running: Queue(FuturesOrdered::new()),
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

impl<St: Stream, F, Fut: Future> BulkheadMap<St, F, Fut> {
    /// Outputs in flight or waiting their turn.
    fn queued(&self) -> usize {
        queued(&self.slot, &self.done, &self.running.0)
    }
}

/// Outputs in flight or waiting their turn: the slot's, the finished ones, the running ones.
fn queued<T, O, R: Future>(
    slot: &Option<T>,
    done: &VecDeque<O>,
    running: &FuturesOrdered<R>,
) -> usize {
    usize::from(slot.is_some()) + done.len() + running.len()
}

impl<St, F, Fut> Stream for BulkheadMap<St, F, Fut>
where
    St: Stream,
    F: FnMut(St::Item) -> Fut,
    Fut: Future,
{
    type Item = Fut::Output;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Fut::Output>> {
        let mut this = self.project();
        if let Some(panic) = this.panic.take() {
            panic.resume();
        }
        loop {
            // The slot holds the oldest output to come, then `done`, then `running`.
            match poll_slot(this.slot.as_mut(), cx) {
                Poll::Ready(Some(out)) => return yielded(Ok(out), this.panic),
                Poll::Ready(None) => {
                    if let Some(out) = this.done.pop_front() {
                        return yielded(out, this.panic);
                    }
                }
                Poll::Pending => {}
            }
            // Start work while there is input and a permit for it, with at most `max_in_flight`
            // outputs in flight or waiting their turn.
            let mut fresh = false;
            loop {
                let queued = queued(&this.slot, this.done, &this.running.0);
                if queued >= this.feed.max_in_flight() {
                    // As many outputs as the limit: its own work ending wakes it, and it is
                    // parked for the limit growing.
                    if this.feed.as_mut().park_while_full(cx, queued) {
                        break;
                    }
                    continue;
                }
                // The permit its own work holds for certain: the slot's (pending). Those in
                // `running` are not counted: a finished one returned its permit while its
                // output waits there behind an older one.
                let own = usize::from(this.slot.is_some());
                let Some(item) = this.feed.as_mut().poll_start(cx, own) else {
                    break;
                };
                // The permit is owned before `f` runs: if `f` panics, it is returned.
                let permit = this.feed.as_mut().into_owned();
                let fut = Permitted {
                    fut: (this.f)(item),
                    permit: Held(Some(permit)),
                };
                if queued == 0 {
                    this.slot.set(Some(fut));
                    fresh = true;
                    break;
                }
                this.running.0.push_back(Caught { fut });
            }
            if fresh {
                continue;
            }
            // The slot's future (if any) was polled above and is pending: outputs that finish
            // before it wait their turn, without polling it again.
            loop {
                match this.running.0.poll_next_unpin(cx) {
                    Poll::Ready(Some(out)) if this.slot.is_some() => this.done.push_back(out),
                    Poll::Ready(Some(out)) => return yielded(out, this.panic),
                    Poll::Ready(None) if this.slot.is_none() && this.feed.is_done() => {
                        return Poll::Ready(None);
                    }
                    _ => return Poll::Pending,
                }
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.feed.size_hint(self.queued(), true)
    }
}

impl<St, F, Fut> FusedStream for BulkheadMap<St, F, Fut>
where
    St: Stream,
    F: FnMut(St::Item) -> Fut,
    Fut: Future,
{
    fn is_terminated(&self) -> bool {
        self.queued() == 0 && self.feed.is_done() && self.panic.is_none()
    }
}

impl<St, F, Fut> fmt::Debug for BulkheadMap<St, F, Fut>
where
    St: Stream + fmt::Debug,
    Fut: Future,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.feed.debug(f, "BulkheadMap", self.queued())
    }
}

/// Builds a [`BulkheadMap`]; from [`BulkheadMap::builder`].
#[must_use = "a builder does nothing until it is built"]
pub struct BulkheadMapBuilder<St: Stream, F> {
    stream: St,
    bulkhead: Bulkhead,
    f: F,
    on_drop: Option<OnDrop<St::Item>>,
}

impl<St: Stream, F> BulkheadMapBuilder<St, F> {
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
    pub fn build<Fut>(self) -> Result<BulkheadMap<St, F, Fut>, ConfigError>
    where
        F: FnMut(St::Item) -> Fut,
        Fut: Future,
    {
        Ok(BulkheadMap::new(
            self.stream,
            &self.bulkhead,
            self.f,
            self.on_drop,
        ))
    }
}

impl<St: Stream + fmt::Debug, F> fmt::Debug for BulkheadMapBuilder<St, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BulkheadMapBuilder")
            .field("stream", &self.stream)
            .field("bulkhead", &self.bulkhead)
            .field("on_drop", &self.on_drop.is_some())
            .finish_non_exhaustive()
    }
}
