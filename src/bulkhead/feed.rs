//! `Feed`: the input side shared by the bulkhead stream adapters.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Stream;
use futures::stream::{Fuse, StreamExt};
use pin_project::pin_project;

use crate::adaptive::Outcome;
use crate::bulkhead::Bulkhead;
use crate::bulkhead::acquire::{OwnedBulkheadPermit, Permits};
use crate::bulkhead::adaptive::Grant;
use crate::bulkhead::core::Core;
use crate::dropped::{Held, OnDrop};
use crate::sync::Arc;

/// The upstream, the one item pulled and waiting for a permit, and the permits held: what
/// every bulkhead adapter needs before it can start a mapped future.
#[pin_project]
#[derive(Debug)]
pub(crate) struct Feed<St: Stream> {
    #[pin]
    stream: Fuse<St>,
    next: Held<St::Item>,
    #[pin]
    permits: Permits,
}

impl<St: Stream> Feed<St> {
    pub(crate) fn new(stream: St, bulkhead: &Bulkhead, on_drop: Option<OnDrop<St::Item>>) -> Self {
        Feed {
            stream: stream.fuse(),
            next: Held::new(on_drop, bulkhead.core().discarded_counter()),
            permits: Permits::new(bulkhead.core().clone()),
        }
    }

    /// The next input item together with a permit for it (now held), or `None` when no work
    /// can start now. `own`: how many permits the adapter's own work in flight holds for
    /// certain (see [`Permits::poll_for_item`]). If the bulkhead is closed, the held item is
    /// discarded (to the hook, as [`Dropped::Discarded`](crate::Dropped::Discarded)). Waiting on the upstream, the
    /// adapter is parked too (for the close only), so that closing the bulkhead wakes it: it
    /// then pulls nothing more and ends after its work in flight, without waiting for an
    /// item that it would leave there.
    pub(crate) fn poll_start(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        own: usize,
    ) -> Option<St::Item> {
        let mut this = self.project();
        if this.permits.is_closed() {
            return None;
        }
        let next = &mut this.next.item;
        if next.is_none() {
            // Closed: pull nothing more (an item would only be discarded).
            if this.permits.as_mut().see_closed() {
                return None;
            }
            match this.stream.as_mut().poll_next(cx) {
                Poll::Ready(Some(item)) => *next = Some(item),
                Poll::Ready(None) => return None,
                Poll::Pending => {
                    // Parked unless closed meanwhile (then seen now).
                    if !this.permits.as_mut().park(cx, false, |_| true) {
                        this.permits.as_mut().see_closed();
                    }
                    return None;
                }
            }
        }
        match this.permits.poll_for_item(cx, own) {
            Poll::Ready(true) => next.take(),
            Poll::Ready(false) => {
                this.next.discard();
                None
            }
            Poll::Pending => None,
        }
    }

    /// With `outstanding` outputs (or tasks) kept, as many as the limit: parked, so that the
    /// limit growing wakes it (its own work ending does anyway). False if the limit grew
    /// past `outstanding` meanwhile: more can start now.
    pub(crate) fn park_while_full(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        outstanding: usize,
    ) -> bool {
        let full = |core: &Core| core.max_in_flight() as usize <= outstanding;
        self.as_mut().permits().park(cx, true, full) || self.max_in_flight() <= outstanding
    }

    /// Pull the next input item if it is ready now, without a permit (to pass a finished
    /// future's permit on to it); nothing once the bulkhead is closed.
    pub(crate) fn poll_ready_item(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Option<St::Item> {
        let mut this = self.project();
        let next = &mut this.next.item;
        if next.is_none()
            && !this.stream.is_done()
            && !this.permits.as_mut().see_closed()
            && let Poll::Ready(Some(item)) = this.stream.as_mut().poll_next(cx)
        {
            *next = Some(item);
        }
        next.take()
    }

    /// Keep `item` for later (no permit for it yet).
    pub(crate) fn put_back(self: Pin<&mut Self>, item: St::Item) {
        self.project().next.item = Some(item);
    }

    /// Whether nothing more can start: the upstream ended (or the bulkhead closed) and no
    /// item is held.
    pub(crate) fn is_done(&self) -> bool {
        self.next.item.is_none() && (self.stream.is_done() || self.permits.is_closed())
    }

    /// Bounds on the outputs still to come, given `running` outputs in flight; `sure`:
    /// whether the running ones count for the lower bound.
    pub(crate) fn size_hint(&self, running: usize, sure: bool) -> (usize, Option<usize>) {
        // Each future in flight and the held item yield one output; then the inner stream's.
        let extra = running + usize::from(self.next.item.is_some());
        // Once the bulkhead is closed no new work starts (even before the adapter has seen
        // the refusal): nothing more comes from the inner stream.
        let (lo, hi) = if self.permits.is_closed() || self.permits.bulkhead_closed() {
            (0, Some(0))
        } else {
            self.stream.size_hint()
        };
        let lo = if sure { lo.saturating_add(running) } else { lo };
        (lo, hi.and_then(|h| h.checked_add(extra)))
    }

    pub(crate) fn permits(self: Pin<&mut Self>) -> Pin<&mut Permits> {
        self.project().permits
    }

    pub(crate) fn into_owned(self: Pin<&mut Self>) -> OwnedBulkheadPermit {
        self.permits().into_owned()
    }

    /// The grant of a unit of work starting now, with the bulkhead owed its sample (adaptive
    /// bulkheads only).
    #[inline]
    pub(crate) fn start(&self) -> Option<(Grant, Arc<Core>)> {
        self.permits.sample()
    }

    /// Feed the sample of a unit of work that ended now.
    pub(crate) fn record(&self, grant: Grant, outcome: Outcome) {
        self.permits.record(grant, outcome);
    }

    pub(crate) fn may_keep(&self) -> bool {
        self.permits.may_keep()
    }

    pub(crate) fn max_in_flight(&self) -> usize {
        self.permits.max_in_flight()
    }

    pub(crate) fn get_ref(&self) -> &St {
        self.stream.get_ref()
    }

    pub(crate) fn get_mut(&mut self) -> &mut St {
        self.stream.get_mut()
    }

    pub(crate) fn get_pin_mut(self: Pin<&mut Self>) -> Pin<&mut St> {
        self.project().stream.get_pin_mut()
    }

    /// The inner stream; the held item is discarded (to the hook).
    pub(crate) fn into_inner(self) -> St {
        self.stream.into_inner()
    }

    /// An adapter's `Debug`: its inner stream, then `running` (its outputs to come), the
    /// item it holds waiting for a permit, the permits it holds, and its bulkhead.
    pub(crate) fn debug(
        &self,
        f: &mut fmt::Formatter<'_>,
        name: &str,
        running: usize,
    ) -> fmt::Result
    where
        St: fmt::Debug,
    {
        let mut d = f.debug_struct(name);
        d.field("stream", &self.stream)
            .field("running", &running)
            .field("holding", &self.next.item.is_some());
        self.permits.debug_fields(&mut d);
        d.finish_non_exhaustive()
    }
}
