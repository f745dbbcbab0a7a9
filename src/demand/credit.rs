//! `with_demand`: a stream that yields only what was requested.

use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, ready};

use futures::Stream;
use futures::stream::FusedStream;
use futures::task::AtomicWaker;
use pin_project::pin_project;

use crate::demand::early::Early;
use crate::demand::error::RequestError;
use crate::error::ConfigError;
use crate::metrics::{Gauge, Labels};
use crate::sync::{Arc, Panics};

/// Credit meaning "no limit".
pub const UNBOUNDED: u64 = u64::MAX;

#[derive(Debug)]
struct Credit {
    remaining: AtomicU64,
    waker: AtomicWaker,
    /// `remaining`, moved by the same amounts ([`Gauge::add`]: changes commute).
    outstanding: Gauge,
    name: Option<String>,
}

/// The most credit a stream counts for in the `flowgate_demand_outstanding` gauge: 2^32,
/// so that an `f64` sum of a million streams' credit stays exact to the unit.
const COUNTED_MAX: u64 = 1 << 32;

/// What credit `n` counts for in the `flowgate_demand_outstanding` gauge: unlimited credit
/// ([`UNBOUNDED`]) is no count and counts 0, and finite credit counts at most
/// [`COUNTED_MAX`] (as `u64::MAX` or `i64::MAX`, it would leave an `f64` sum with other
/// streams' credit no room for their units).
fn counted(n: u64) -> u64 {
    if n == UNBOUNDED {
        0
    } else {
        n.min(COUNTED_MAX)
    }
}

impl Credit {
    /// Whether a unit is left.
    fn available(&self) -> bool {
        self.remaining.load(Ordering::Acquire) > 0
    }

    /// Use one unit, for an item that came. Only the [`Demanded`] stream uses credit, and it
    /// saw [`available`](Credit::available) before polling upstream; requests since then only
    /// added to it, so the unit is still there.
    fn take(&self) {
        let used = self
            .remaining
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n != UNBOUNDED && n > 0).then(|| n - 1)
            });
        if let Ok(n) = used {
            self.outstanding
                .add(counted(n - 1) as f64 - counted(n) as f64);
        }
    }
}

/// The credit handle of a [`Demanded`] stream: `request(n)` lets `n` more items through.
///
/// Clone it and send it to any task.
#[derive(Clone, Debug)]
pub struct DemandHandle {
    credit: Arc<Credit>,
}

impl DemandHandle {
    /// Allow `n` more items (additive, saturating at [`UNBOUNDED`]); wakes the stream.
    /// `request(UNBOUNDED)` lifts the limit for good.
    ///
    /// # Errors
    ///
    /// [`RequestError::Zero`] for `n == 0` (Reactive Streams rule 3.9); no credit is added.
    pub fn request(&self, n: u64) -> Result<(), RequestError> {
        if n == 0 {
            return Err(RequestError::Zero);
        }
        let before = self
            .credit
            .remaining
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| {
                Some(c.saturating_add(n))
            })
            .unwrap_or_else(|c| c);
        // Woken first, and each step even if the other panics (the waker and the metrics
        // recorder are user code): a lost wake leaves the stream waiting with credit (only a
        // request that finds no credit left wakes it), a lost move the gauge wrong for good.
        let mut panics = Panics::new();
        if before == 0 {
            panics.run(|| self.credit.waker.wake());
        }
        // The gauge moves by what this request changed, not to a value read back: changes
        // recorded by racing requests and the stream then add up to the credit left, in
        // whatever order the threads record them.
        let after = before.saturating_add(n);
        panics.run(|| {
            self.credit
                .outstanding
                .add(counted(after) as f64 - counted(before) as f64);
        });
        panics.resume();
        Ok(())
    }

    /// Credit not yet used: requested − yielded ([`UNBOUNDED`] when unlimited). A unit is
    /// used when the stream yields its item, so one the stream is waiting on upstream for
    /// still counts here.
    pub fn outstanding(&self) -> u64 {
        self.credit.remaining.load(Ordering::Acquire)
    }

    /// The `name` label of the stream's metrics, if it was given one.
    pub fn name(&self) -> Option<&str> {
        self.credit.name.as_deref()
    }
}

/// Stream of [`with_demand`](crate::FlowStreamExt::with_demand): yields an item only while
/// credit remains, and never more items than were requested in total.
///
/// The upstream is not polled while there is no credit (except for its end, below), so
/// nothing is pulled from it ahead of demand. An upstream that buffers still fetches by its
/// own bounds once polled: over a [`Prefetch`](crate::demand::Prefetch), one unit of credit
/// lets it fetch up to its `high` (its levels, not the credit, bound what is fetched). A unit of credit is used when its item comes: while
/// the stream waits on its upstream the unit stays in [`DemandHandle::outstanding`], and a
/// stream that is dropped there, taken apart by [`into_inner`](Demanded::into_inner), or
/// whose upstream ends uses nothing. Every item uses a unit, an `Err` item of a fallible
/// stream too.
///
/// The end of the upstream needs no credit (Reactive Streams §2.9): without credit, an
/// upstream whose [`size_hint`](Stream::size_hint) says no item is left (an iterator; a
/// [`Prefetch`](crate::demand::Prefetch) whose source has answered its end, with nothing
/// buffered; a channel [`Receiver`](crate::channel::Receiver) closed for sends, with
/// nothing left to come) is polled for its end, so credit used up by the last items ends the stream
/// instead of leaving it pending. Any other upstream is not polled without credit: its end
/// is seen with the next unit of credit. (A `Prefetch` learns the end from a fetch, which
/// it starts when its buffer falls to `low`: with a `low` of 0, not before its last item
/// was taken.) The `size_hint` is read when the stream is polled without credit; a channel
/// `Receiver` registers the stream then to be woken when it ends, so a channel closed (or
/// its last sender dropped) after the stream ran out of credit ends it without more credit.
/// Nothing else wakes the stream when its upstream's hint changes later: any other
/// upstream's end is seen at the next poll, with the next unit of credit (a `Prefetch`
/// whose source answers its end then, too). An item such an upstream yields all the
/// same (a wrong `size_hint`) is held for credit; dropped (or taken apart with
/// [`into_inner`](Demanded::into_inner)) while it holds it, the stream discards it,
/// counted in `flowgate_demand_discarded_total`.
///
/// Without credit and with every [`DemandHandle`] dropped, nothing can ask for more: the
/// stream then stays pending for ever (no demand is a valid state, as in Reactive Streams;
/// the stream cannot tell it from a slow downstream). Keep a handle while more may be asked
/// for, or end the stream yourself.
#[pin_project]
#[must_use = "streams do nothing unless polled"]
pub struct Demanded<S: Stream> {
    #[pin]
    stream: S,
    credit: Arc<Credit>,
    done: bool,
    /// The held item's unit of credit is used already (its recording panicked).
    paid: bool,
    /// An item the upstream yielded without credit, polled for its end because its
    /// `size_hint` said no item was left: it waits here for credit. (Any item taken from
    /// upstream is held here until its unit of credit is used.)
    early: Early<S::Item>,
}

impl<S: Stream> Demanded<S> {
    /// A builder, to give the stream a name: `Demanded::builder(stream, initial)` is
    /// [`stream.with_demand(initial)`](crate::FlowStreamExt::with_demand) with options.
    ///
    /// # Examples
    ///
    /// ```
    /// use flowgate::demand::Demanded;
    /// use futures::StreamExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let (mut stream, demand) = Demanded::builder(futures::stream::iter(0..100), 1)
    ///     .name("orders")
    ///     .build()?;
    /// assert_eq!(stream.next().await, Some(0));
    /// assert_eq!(demand.name(), Some("orders"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(stream: S, initial: u64) -> DemandedBuilder<S> {
        DemandedBuilder {
            stream,
            initial,
            name: None,
        }
    }

    pub(crate) fn new(
        stream: S,
        initial: u64,
        name: Option<String>,
    ) -> (Demanded<S>, DemandHandle) {
        let labels = Labels::new(name.as_deref());
        let outstanding = labels.gauge(names::OUTSTANDING, &[]);
        let discarded = labels.counter(crate::demand::prefetch::names::DISCARDED, &[]);
        outstanding.set(counted(initial) as f64);
        let credit = Arc::new(Credit {
            remaining: AtomicU64::new(initial),
            waker: AtomicWaker::new(),
            outstanding,
            name,
        });
        (
            Demanded {
                stream,
                credit: credit.clone(),
                done: false,
                paid: false,
                early: Early::new(discarded),
            },
            DemandHandle { credit },
        )
    }

    /// The `name` label of this stream's metrics, if it was given one.
    pub fn name(&self) -> Option<&str> {
        self.credit.name.as_deref()
    }

    /// A handle to add credit.
    pub fn handle(&self) -> DemandHandle {
        DemandHandle {
            credit: self.credit.clone(),
        }
    }

    /// The inner stream.
    pub fn get_ref(&self) -> &S {
        &self.stream
    }

    /// The inner stream, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.stream
    }

    /// The inner stream, pinned.
    pub fn get_pin_mut(self: Pin<&mut Self>) -> Pin<&mut S> {
        self.project().stream
    }

    /// The inner stream. An item it yielded without credit although its `size_hint` said
    /// none was left (see [`Demanded`]), held for credit, is discarded (counted in
    /// `flowgate_demand_discarded_total`); [`into_parts`](Demanded::into_parts) gives it
    /// back.
    pub fn into_inner(self) -> S {
        self.stream
    }

    /// The inner stream and the item the wrapper holds for it, if any: one the upstream
    /// yielded although its `size_hint` said none was left (see [`Demanded`]), held for credit, which
    /// comes before the stream's next.
    pub fn into_parts(self) -> (S, Option<S::Item>) {
        let mut early = self.early;
        (self.stream, early.take())
    }
}

/// Builds a [`Demanded`] stream and its [`DemandHandle`]; from [`Demanded::builder`].
#[derive(Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct DemandedBuilder<S> {
    stream: S,
    initial: u64,
    name: Option<String>,
}

impl<S: Stream> DemandedBuilder<S> {
    /// The `name` label of the stream's metrics (`flowgate_demand_outstanding`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Build the stream and its credit handle.
    ///
    /// # Errors
    ///
    /// None today: every `initial` credit is valid (zero waits for the first request,
    /// [`UNBOUNDED`] lets everything through). The `Result` is the builder convention, and
    /// room for settings that can be wrong.
    pub fn build(self) -> Result<(Demanded<S>, DemandHandle), ConfigError> {
        Ok(Demanded::new(self.stream, self.initial, self.name))
    }
}

/// Names of the demand metrics.
pub(crate) mod names {
    pub(crate) const OUTSTANDING: &str = "flowgate_demand_outstanding";
}

impl<S: Stream> Stream for Demanded<S> {
    type Item = S::Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        let mut this = self.project();
        if *this.done {
            return Poll::Ready(None);
        }
        if !*this.paid && !this.credit.available() {
            this.credit.waker.register(cx.waker());
            // A request may have landed between the check and the registration.
            if !this.credit.available() {
                // The end needs no credit (see `Early`).
                if this.early.poll_end(this.stream.as_mut(), cx) {
                    *this.done = true;
                    return Poll::Ready(None);
                }
                return Poll::Pending;
            }
        }
        // The credit is used when the item comes, not before: a stream dropped (or taken
        // apart) while it waits here, or whose upstream ends, leaves the credit as it was.
        if !this.early.is_held() {
            match ready!(this.stream.poll_next(cx)) {
                Some(item) => this.early.hold(item),
                None => {
                    *this.done = true;
                    return Poll::Ready(None);
                }
            }
        }
        // The item stays held until its unit of credit is used: if the recorder panics
        // there, the next poll yields it, paid for already.
        if !*this.paid {
            *this.paid = true;
            this.credit.take();
        }
        *this.paid = false;
        Poll::Ready(this.early.take())
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        // Credit only grows from outside (`request`), and only this stream uses it, so the
        // credit now is a floor on what it will let through: the lower bound is the inner
        // stream's, capped by it. The credit is no ceiling — any handle may raise it after
        // this call — so the upper bound is the inner stream's.
        if self.done {
            return (0, Some(0));
        }
        let credit = self.credit.remaining.load(Ordering::Acquire);
        let cap = usize::try_from(credit).unwrap_or(usize::MAX);
        // An item held for credit (see `early`) comes before the inner stream's.
        let (lo, hi) = self.early.size_hint(self.stream.size_hint());
        (lo.min(cap), hi)
    }
}

/// The inner stream's write half, untouched (only reading takes credit).
impl<S, Item> futures::Sink<Item> for Demanded<S>
where
    S: Stream + futures::Sink<Item>,
{
    type Error = S::Error;
    crate::ext::delegate_sink!(stream, Item);
}

impl<S: Stream> FusedStream for Demanded<S> {
    fn is_terminated(&self) -> bool {
        self.done
    }
}

impl<S: Stream + fmt::Debug> fmt::Debug for Demanded<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Demanded")
            .field("stream", &self.stream)
            .field("name", &self.credit.name)
            .field("credit", &self.credit.remaining.load(Ordering::Relaxed))
            .finish()
    }
}
