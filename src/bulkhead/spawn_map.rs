//! `bulkhead_spawn_map`: each mapped future on its own task, holding its permit.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Stream;
use futures::stream::{FusedStream, FuturesUnordered, StreamExt};
use pin_project::pin_project;
use tokio::task::JoinHandle;

use crate::bulkhead::Bulkhead;
use crate::bulkhead::feed::Feed;
use crate::bulkhead::slot::{Panic, learn_ok};
use crate::dropped::{Dropped, OnDrop};
use crate::error::ConfigError;

/// A task handle that aborts the task when dropped.
#[derive(Debug)]
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Future for AbortOnDrop<T> {
    type Output = Result<T, tokio::task::JoinError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0).poll(cx)
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Stream of [`bulkhead_spawn_map`](crate::FlowStreamExt::bulkhead_spawn_map).
///
/// Like [`BulkheadMapUnordered`](crate::bulkhead::BulkheadMapUnordered), but each mapped
/// future runs on its own tokio task together with its permit, so it makes progress and
/// returns its permit even while the consumer of this stream is busy elsewhere. Outputs come
/// in completion order. A panic in a mapped future is resumed in the consumer's poll (its
/// permit was already returned when the task unwound). Dropping the stream aborts the tasks
/// still running; their permits are returned as they stop. The item it holds waiting for a
/// permit when the bulkhead closes, or when the stream is dropped, is discarded: to the
/// [`on_drop`](BulkheadSpawnMapBuilder::on_drop) hook, if one is set, as
/// [`Dropped::Discarded`].
///
/// # Memory bound
///
/// A task returns its permit the moment its future ends, before the consumer takes its
/// output, so permits never sit idle behind a slow consumer. What the adapter keeps is
/// bounded instead: it spawns only while fewer than the bulkhead's
/// [`max_in_flight`](Bulkhead::max_in_flight) of its tasks are outstanding — running, or
/// finished with an output the consumer has not taken yet. So at most `max_in_flight`
/// finished outputs ever wait for the consumer, however slow it is; a slow consumer slows
/// the intake, and memory stays at most `max_in_flight` tasks and their outputs. (After
/// [`set_max_in_flight`](Bulkhead::set_max_in_flight) lowers the cap, no new task starts
/// until the outstanding ones are below the new cap.)
///
/// # Panics
///
/// Panics if polled outside a tokio runtime: each mapped future is spawned with
/// [`tokio::spawn`]. A panic in a mapped future is resumed by the poll that would have
/// yielded its output. A panic of an adaptive bulkhead's algorithm (or of a metrics
/// recorder) learning from a finished future, in its task, is resumed by the poll after the
/// one that yields that future's output.
#[pin_project]
#[must_use = "streams do nothing unless polled"]
pub struct BulkheadSpawnMap<St: Stream, F, Fut: Future> {
    #[pin]
    feed: Feed<St>,
    f: F,
    /// Each task's output, with a panic of learning from it (see [`learn_ok`]).
    running: FuturesUnordered<AbortOnDrop<(Fut::Output, Option<Panic>)>>,
    /// A panic of the adaptive algorithm (or a metrics recorder) learning from a finished
    /// task, caught there with its output; resumed by the poll after the one that yields it.
    panic: Option<Panic>,
}

impl<St, F, Fut> BulkheadSpawnMap<St, F, Fut>
where
    St: Stream,
    F: FnMut(St::Item) -> Fut,
    Fut: Future + Send + 'static,
    Fut::Output: Send + 'static,
{
    /// A builder for the stream of [`bulkhead_spawn_map`](crate::FlowStreamExt::bulkhead_spawn_map), to give
    /// it an [`on_drop`](BulkheadSpawnMapBuilder::on_drop) hook.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use flowgate::bulkhead::{Bulkhead, BulkheadSpawnMap};
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
    ///     BulkheadSpawnMap::builder(items, db.clone(), |x| async move { x * 10 })
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
    pub fn builder(stream: St, bulkhead: Bulkhead, f: F) -> BulkheadSpawnMapBuilder<St, F> {
        BulkheadSpawnMapBuilder {
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
        BulkheadSpawnMap {
            feed: Feed::new(stream, bulkhead, on_drop),
            f,
            running: FuturesUnordered::new(),
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

    /// The inner stream; tasks still running are aborted. The stream is `!Unpin` (its wait
    /// is pinned), so only one never polled can be taken apart: it holds no item yet.
    pub fn into_inner(self) -> St {
        self.feed.into_inner()
    }
}

impl<St, F, Fut> Stream for BulkheadSpawnMap<St, F, Fut>
where
    St: Stream,
    F: FnMut(St::Item) -> Fut,
    Fut: Future + Send + 'static,
    Fut::Output: Send + 'static,
{
    type Item = Fut::Output;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Fut::Output>> {
        let mut this = self.project();
        // A panic kept from the poll that yielded the output it was learning from.
        if let Some(panic) = this.panic.take() {
            panic.resume();
        }
        // `running` holds every task whose output the consumer has not taken, finished or
        // not: keeping it under `max_in_flight` bounds the finished outputs waiting (see the
        // type's docs). Which of them still hold their permits is not known here (a task
        // returns its permit as its future ends): none is counted as certain, so the wait
        // for a permit is always in the queue.
        loop {
            if this.running.len() >= this.feed.max_in_flight() {
                // Its tasks finishing wake it (their outputs are taken below), and it is
                // parked for the limit growing.
                if this.feed.as_mut().park_while_full(cx, this.running.len()) {
                    break;
                }
                continue;
            }
            let Some(item) = this.feed.as_mut().poll_start(cx, 0) else {
                break;
            };
            let permit = this.feed.as_mut().into_owned();
            let fut = (this.f)(item);
            this.running.push(AbortOnDrop(tokio::spawn(async move {
                let out = fut.await;
                (out, learn_ok(permit))
            })));
        }
        loop {
            return match this.running.poll_next_unpin(cx) {
                Poll::Ready(Some(Ok((out, panic)))) => {
                    *this.panic = panic;
                    Poll::Ready(Some(out))
                }
                Poll::Ready(Some(Err(e))) => match e.try_into_panic() {
                    Ok(panic) => std::panic::resume_unwind(panic),
                    // Cancelled: only when the runtime shuts down.
                    Err(_) => continue,
                },
                Poll::Ready(None) if this.feed.is_done() => Poll::Ready(None),
                _ => Poll::Pending,
            };
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        // A task in flight can be cancelled by a runtime shutdown: not counted as sure.
        self.feed.size_hint(self.running.len(), false)
    }
}

impl<St, F, Fut> FusedStream for BulkheadSpawnMap<St, F, Fut>
where
    St: Stream,
    F: FnMut(St::Item) -> Fut,
    Fut: Future + Send + 'static,
    Fut::Output: Send + 'static,
{
    fn is_terminated(&self) -> bool {
        self.running.is_empty() && self.feed.is_done() && self.panic.is_none()
    }
}

impl<St, F, Fut> fmt::Debug for BulkheadSpawnMap<St, F, Fut>
where
    St: Stream + fmt::Debug,
    Fut: Future,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.feed.debug(f, "BulkheadSpawnMap", self.running.len())
    }
}

/// Builds a [`BulkheadSpawnMap`]; from [`BulkheadSpawnMap::builder`].
#[must_use = "a builder does nothing until it is built"]
pub struct BulkheadSpawnMapBuilder<St: Stream, F> {
    stream: St,
    bulkhead: Bulkhead,
    f: F,
    on_drop: Option<OnDrop<St::Item>>,
}

impl<St: Stream, F> BulkheadSpawnMapBuilder<St, F> {
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
    pub fn build<Fut>(self) -> Result<BulkheadSpawnMap<St, F, Fut>, ConfigError>
    where
        F: FnMut(St::Item) -> Fut,
        Fut: Future + Send + 'static,
        Fut::Output: Send + 'static,
    {
        Ok(BulkheadSpawnMap::new(
            self.stream,
            &self.bulkhead,
            self.f,
            self.on_drop,
        ))
    }
}

impl<St: Stream + fmt::Debug, F> fmt::Debug for BulkheadSpawnMapBuilder<St, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BulkheadSpawnMapBuilder")
            .field("stream", &self.stream)
            .field("bulkhead", &self.bulkhead)
            .field("on_drop", &self.on_drop.is_some())
            .finish_non_exhaustive()
    }
}
