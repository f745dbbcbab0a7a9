//! `bulkhead_map`: map each item under a permit, yield in input order.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use futures::Stream;
use futures::stream::{FusedStream, FuturesOrdered, StreamExt};
use pin_project::pin_project;

use crate::bulkhead::Bulkhead;
use crate::bulkhead::acquire::OwnedBulkheadPermit;
use crate::bulkhead::feed::Feed;

/// A mapped future that returns its permit the moment it completes (or is dropped).
#[pin_project]
#[derive(Debug)]
pub(crate) struct Permitted<Fut> {
    #[pin]
    fut: Fut,
    permit: Option<OwnedBulkheadPermit>,
}

impl<Fut: Future> Future for Permitted<Fut> {
    type Output = Fut::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Fut::Output> {
        let this = self.project();
        let out = ready!(this.fut.poll(cx));
        this.permit.take();
        Poll::Ready(out)
    }
}

/// Stream of [`bulkhead_map`](crate::FlowStreamExt::bulkhead_map).
///
/// As [`BulkheadMapUnordered`](crate::bulkhead::BulkheadMapUnordered), but outputs come in
/// input order (like `buffered`). A future that completes early returns its permit at once;
/// its output waits for the ones before it. At most `limit()` outputs are in flight or
/// waiting, so memory stays bounded while the head of the line is slow.
#[pin_project]
#[must_use = "streams do nothing unless polled"]
pub struct BulkheadMap<St: Stream, F, Fut: Future> {
    #[pin]
    feed: Feed<St>,
    f: F,
    running: FuturesOrdered<Permitted<Fut>>,
}

impl<St, F, Fut> BulkheadMap<St, F, Fut>
where
    St: Stream,
    F: FnMut(St::Item) -> Fut,
    Fut: Future,
{
    pub(crate) fn new(stream: St, bulkhead: &Bulkhead, f: F) -> Self {
        BulkheadMap {
            feed: Feed::new(stream, bulkhead),
            f,
            running: FuturesOrdered::new(),
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

    /// The inner stream; futures in flight are dropped and their permits returned.
    pub fn into_inner(self) -> St {
        self.feed.into_inner()
    }
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
        // Start work while there is input and a permit for it, with at most `limit` outputs
        // in flight or waiting their turn.
        while this.running.len() < this.feed.limit() {
            let Some(item) = this.feed.as_mut().poll_start(cx, !this.running.is_empty()) else {
                break;
            };
            let permit = Some(this.feed.as_mut().into_owned());
            this.running.push_back(Permitted {
                fut: (this.f)(item),
                permit,
            });
        }
        match this.running.poll_next_unpin(cx) {
            Poll::Ready(Some(out)) => Poll::Ready(Some(out)),
            Poll::Ready(None) if this.feed.is_done() => Poll::Ready(None),
            _ => Poll::Pending,
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.feed.size_hint(self.running.len(), true)
    }
}

impl<St, F, Fut> FusedStream for BulkheadMap<St, F, Fut>
where
    St: Stream,
    F: FnMut(St::Item) -> Fut,
    Fut: Future,
{
    fn is_terminated(&self) -> bool {
        self.running.is_empty() && self.feed.is_done()
    }
}

impl<St, F, Fut> fmt::Debug for BulkheadMap<St, F, Fut>
where
    St: Stream + fmt::Debug,
    Fut: Future,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BulkheadMap")
            .field("stream", self.feed.inner())
            .field("running", &self.running.len())
            .finish_non_exhaustive()
    }
}
