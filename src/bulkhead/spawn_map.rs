//! `bulkhead_spawn_map`: each mapped future on its own task, holding its permit.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Stream;
use futures::stream::{Fuse, FusedStream, FuturesUnordered, StreamExt};
use pin_project::pin_project;
use tokio::task::JoinHandle;

use crate::bulkhead::Bulkhead;
use crate::bulkhead::acquire::Permits;

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
/// still running; their permits are returned as they stop.
///
/// Must be polled inside a tokio runtime.
#[pin_project]
#[must_use = "streams do nothing unless polled"]
pub struct BulkheadSpawnMap<St: Stream, F, Fut: Future> {
    #[pin]
    stream: Fuse<St>,
    f: F,
    next: Option<St::Item>,
    #[pin]
    permits: Permits,
    running: FuturesUnordered<AbortOnDrop<Fut::Output>>,
}

impl<St, F, Fut> BulkheadSpawnMap<St, F, Fut>
where
    St: Stream,
    F: FnMut(St::Item) -> Fut,
    Fut: Future + Send + 'static,
    Fut::Output: Send + 'static,
{
    pub(crate) fn new(stream: St, bulkhead: &Bulkhead, f: F) -> Self {
        BulkheadSpawnMap {
            stream: stream.fuse(),
            f,
            next: None,
            permits: Permits::new(bulkhead.core().clone()),
            running: FuturesUnordered::new(),
        }
    }

    /// The inner stream.
    pub fn get_ref(&self) -> &St {
        self.stream.get_ref()
    }

    /// The inner stream, mutably.
    pub fn get_mut(&mut self) -> &mut St {
        self.stream.get_mut()
    }

    /// The inner stream, pinned.
    pub fn get_pin_mut(self: Pin<&mut Self>) -> Pin<&mut St> {
        self.project().stream.get_pin_mut()
    }

    /// The inner stream; tasks still running are aborted.
    pub fn into_inner(self) -> St {
        self.stream.into_inner()
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
        while !this.permits.is_closed() {
            if this.next.is_none() {
                match this.stream.as_mut().poll_next(cx) {
                    Poll::Ready(Some(item)) => *this.next = Some(item),
                    Poll::Ready(None) | Poll::Pending => break,
                }
            }
            match this
                .permits
                .as_mut()
                .poll_for_item(cx, !this.running.is_empty())
            {
                Poll::Ready(true) => {
                    let item = this.next.take().expect("an item is waiting");
                    let permit = this.permits.as_mut().into_owned();
                    let fut = (this.f)(item);
                    this.running.push(AbortOnDrop(tokio::spawn(async move {
                        let out = fut.await;
                        drop(permit);
                        out
                    })));
                }
                Poll::Ready(false) => *this.next = None,
                Poll::Pending => break,
            }
        }
        loop {
            return match this.running.poll_next_unpin(cx) {
                Poll::Ready(Some(Ok(out))) => Poll::Ready(Some(out)),
                Poll::Ready(Some(Err(e))) => match e.try_into_panic() {
                    Ok(panic) => std::panic::resume_unwind(panic),
                    // Cancelled: only when the runtime shuts down.
                    Err(_) => continue,
                },
                Poll::Ready(None)
                    if this.next.is_none()
                        && (this.stream.is_done() || this.permits.is_closed()) =>
                {
                    Poll::Ready(None)
                }
                _ => Poll::Pending,
            };
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        // Each task in flight and the held item yield one output; then the inner stream's.
        let extra = self.running.len() + usize::from(self.next.is_some());
        let (lo, hi) = if self.permits.is_closed() {
            (0, Some(0))
        } else {
            self.stream.size_hint()
        };
        (lo, hi.and_then(|h| h.checked_add(extra)))
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
        self.running.is_empty()
            && self.next.is_none()
            && (self.stream.is_done() || self.permits.is_closed())
    }
}

impl<St, F, Fut> fmt::Debug for BulkheadSpawnMap<St, F, Fut>
where
    St: Stream + fmt::Debug,
    Fut: Future,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BulkheadSpawnMap")
            .field("stream", &self.stream)
            .field("permits", &self.permits)
            .field("running", &self.running.len())
            .finish_non_exhaustive()
    }
}
