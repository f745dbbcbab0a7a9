//! `sink.leaky_sink(rate)`: outbound calls at a constant rate.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use futures::Sink;
use pin_project::pin_project;

use crate::pace::Pacer;
use crate::pace::paced::Paced;

/// Sink of [`leaky_sink`](crate::FlowSinkExt::leaky_sink) and
/// [`leaky_sink_with`](crate::FlowSinkExt::leaky_sink_with): `poll_ready` asks the inner
/// sink for room, then waits for the pacer. The unit of rate is taken when the item can go
/// at once: an inner sink that stalls (a full buffer, a slow write) holds the item back
/// without spending the pacer's unit, so the item that waited for it does not leave with the
/// next one on its heels; the outflow into the inner sink keeps the rate and the burst.
/// While it waits for the pacer it holds the room the inner sink gave it.
///
/// A pacer admission taken by `poll_ready` but not used before the sink is dropped is not
/// given back (the unit of rate is spent; no item is lost).
///
/// The wait for the pacer lives in the sink, not in the `send` future: a `send` given up
/// while it waits (a timeout, a `select!`) leaves the sink in the pacer's line until the
/// sink is polled again, closed or dropped. Others stand behind it for at most the pacer's
/// stall grace (10 ms past its turn), then step over it; the next `poll_ready` takes its
/// place back, and the lateness it records runs from its old due time (the caller's gap
/// counts). `poll_close` leaves the line at once.
///
/// # Panics
///
/// `poll_ready` sleeps on a tokio timer when the item has to wait: outside a tokio runtime
/// with timers enabled it panics unless the pacer admits the item at once.
#[pin_project]
#[must_use = "sinks do nothing unless polled"]
pub struct LeakySink<Si> {
    #[pin]
    sink: Si,
    paced: Paced,
    admitted: bool,
}

impl<Si> LeakySink<Si> {
    pub(crate) fn new(sink: Si, pacer: Pacer) -> Self {
        LeakySink {
            sink,
            paced: Paced::new(pacer),
            admitted: false,
        }
    }

    /// The pacer.
    pub fn pacer(&self) -> &Pacer {
        self.paced.pacer()
    }

    /// The inner sink.
    pub fn get_ref(&self) -> &Si {
        &self.sink
    }

    /// The inner sink, mutably.
    pub fn get_mut(&mut self) -> &mut Si {
        &mut self.sink
    }

    /// The inner sink, pinned.
    pub fn get_pin_mut(self: Pin<&mut Self>) -> Pin<&mut Si> {
        self.project().sink
    }

    /// The inner sink.
    pub fn into_inner(self) -> Si {
        self.sink
    }
}

impl<Si: Sink<Item>, Item> Sink<Item> for LeakySink<Si> {
    type Error = Si::Error;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Si::Error>> {
        let mut this = self.project();
        if *this.admitted {
            return this.sink.poll_ready(cx);
        }
        // Room first, then the unit: a unit taken before an inner sink that stalls would be
        // spent while the item waits, and the next item's unit (the bucket refilled in the
        // stall) would let it through on that one's heels, above the burst.
        ready!(this.sink.as_mut().poll_ready(cx))?;
        ready!(this.paced.poll_admit(|| 1, cx));
        *this.admitted = true;
        Poll::Ready(Ok(()))
    }

    fn start_send(self: Pin<&mut Self>, item: Item) -> Result<(), Si::Error> {
        let this = self.project();
        *this.admitted = false;
        this.sink.start_send(item)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Si::Error>> {
        self.project().sink.poll_flush(cx)
    }

    /// Leaves the pacer's line (a send given up while it waited keeps the sink there), then
    /// closes the inner sink: a closed sink sends nothing more.
    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Si::Error>> {
        let this = self.project();
        this.paced.leave();
        this.sink.poll_close(cx)
    }
}

/// The inner sink's read half, untouched (only writing is paced).
impl<Si: futures::Stream> futures::Stream for LeakySink<Si> {
    type Item = Si::Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Si::Item>> {
        self.project().sink.poll_next(cx)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.sink.size_hint()
    }
}

impl<Si: futures::stream::FusedStream> futures::stream::FusedStream for LeakySink<Si> {
    fn is_terminated(&self) -> bool {
        self.sink.is_terminated()
    }
}

impl<Si: fmt::Debug> fmt::Debug for LeakySink<Si> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeakySink")
            .field("sink", &self.sink)
            .field("pacer", self.paced.pacer())
            .field("admitted", &self.admitted)
            .finish()
    }
}
