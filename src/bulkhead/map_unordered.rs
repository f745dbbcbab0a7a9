//! `bulkhead_map_unordered`: map each item under a permit, yield in completion order.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Stream;
use futures::stream::{Fuse, FusedStream, FuturesUnordered, StreamExt};
use pin_project::pin_project;

use crate::bulkhead::Bulkhead;
use crate::bulkhead::acquire::Permits;

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
    stream: Fuse<St>,
    f: F,
    next: Option<St::Item>,
    #[pin]
    permits: Permits,
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

    /// The inner stream; futures in flight are dropped and their permits returned.
    pub fn into_inner(self) -> St {
        self.stream.into_inner()
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
                    this.running.push((this.f)(item));
                }
                Poll::Ready(false) => *this.next = None,
                Poll::Pending => break,
            }
        }
        match this.running.poll_next_unpin(cx) {
            Poll::Ready(Some(out)) => {
                // The finished future's permit goes straight to the next item when nobody
                // else is waiting for it; otherwise it is returned at once.
                if this.next.is_none()
                    && !this.stream.is_done()
                    && let Poll::Ready(Some(item)) = this.stream.as_mut().poll_next(cx)
                {
                    *this.next = Some(item);
                }
                match this.next.take() {
                    Some(item) if this.permits.may_keep() => this.running.push((this.f)(item)),
                    next => {
                        *this.next = next;
                        this.permits.release();
                    }
                }
                Poll::Ready(Some(out))
            }
            Poll::Ready(None)
                if this.next.is_none() && (this.stream.is_done() || this.permits.is_closed()) =>
            {
                Poll::Ready(None)
            }
            _ => Poll::Pending,
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        // Each future in flight and the held item yield one output; then the inner stream's.
        let extra = self.running.len() + usize::from(self.next.is_some());
        let (lo, hi) = if self.permits.is_closed() {
            (0, Some(0))
        } else {
            self.stream.size_hint()
        };
        (
            lo.saturating_add(self.running.len()),
            hi.and_then(|h| h.checked_add(extra)),
        )
    }
}

impl<St, F, Fut> FusedStream for BulkheadMapUnordered<St, F, Fut>
where
    St: Stream,
    F: FnMut(St::Item) -> Fut,
    Fut: Future,
{
    fn is_terminated(&self) -> bool {
        self.running.is_empty()
            && self.next.is_none()
            && (self.stream.is_done() || self.permits.is_closed())
    }
}

impl<St, F, Fut> fmt::Debug for BulkheadMapUnordered<St, F, Fut>
where
    St: Stream + fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BulkheadMapUnordered")
            .field("stream", &self.stream)
            .field("permits", &self.permits)
            .field("running", &self.running.len())
            .finish_non_exhaustive()
    }
}
