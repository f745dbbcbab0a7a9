//! `bulkhead_map_unordered`: map each item under a permit, yield in completion order.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Stream;
use futures::stream::{FusedStream, FuturesUnordered, StreamExt};
use pin_project::pin_project;

use crate::bulkhead::Bulkhead;
use crate::bulkhead::feed::Feed;

/// Stream of [`bulkhead_map_unordered`](crate::FlowStreamExt::bulkhead_map_unordered).
///
/// Pulls one item at a time, waits for a permit for it (backpressure: it never rejects),
/// maps it and runs the future with the permit held. The permit is returned the moment the
/// future completes, in the same poll, and every permit is returned if the stream is dropped
/// or a mapped future panics. Outputs come in completion order.
///
/// If the bulkhead is closed, the adapter stops pulling, yields what is in flight, then
/// ends; the one item it held waiting for a permit is dropped (counted as a `closed`
/// rejection).
#[pin_project]
#[must_use = "streams do nothing unless polled"]
pub struct BulkheadMapUnordered<St: Stream, F, Fut> {
    #[pin]
    feed: Feed<St>,
    f: F,
    running: FuturesUnordered<Fut>,
}

impl<St, F, Fut> BulkheadMapUnordered<St, F, Fut>
where
    St: Stream,
    F: FnMut(St::Item) -> Fut,
    Fut: Future,
{
    pub(crate) fn new(stream: St, bulkhead: &Bulkhead, f: F) -> Self {
        BulkheadMapUnordered {
            feed: Feed::new(stream, bulkhead),
            f,
            running: FuturesUnordered::new(),
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

impl<St, F, Fut> Stream for BulkheadMapUnordered<St, F, Fut>
where
    St: Stream,
    F: FnMut(St::Item) -> Fut,
    Fut: Future,
{
    type Item = Fut::Output;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Fut::Output>> {
        let mut this = self.project();
        // Start work while there is input and a permit for it.
        while let Some(item) = this.feed.as_mut().poll_start(cx, !this.running.is_empty()) {
            this.running.push((this.f)(item));
        }
        match this.running.poll_next_unpin(cx) {
            Poll::Ready(Some(out)) => {
                // The finished future's permit goes straight to the next item when nobody
                // else is waiting for it; otherwise it is returned at once.
                match this.feed.as_mut().poll_ready_item(cx) {
                    Some(item) if this.feed.may_keep() => this.running.push((this.f)(item)),
                    next => {
                        if let Some(item) = next {
                            this.feed.as_mut().put_back(item);
                        }
                        this.feed.as_mut().permits().release();
                    }
                }
                Poll::Ready(Some(out))
            }
            Poll::Ready(None) if this.feed.is_done() => Poll::Ready(None),
            _ => Poll::Pending,
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.feed.size_hint(self.running.len(), true)
    }
}

impl<St, F, Fut> FusedStream for BulkheadMapUnordered<St, F, Fut>
where
    St: Stream,
    F: FnMut(St::Item) -> Fut,
    Fut: Future,
{
    fn is_terminated(&self) -> bool {
        self.running.is_empty() && self.feed.is_done()
    }
}

impl<St, F, Fut> fmt::Debug for BulkheadMapUnordered<St, F, Fut>
where
    St: Stream + fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BulkheadMapUnordered")
            .field("stream", self.feed.inner())
            .field("running", &self.running.len())
            .finish_non_exhaustive()
    }
}
