//! `watermarks`: pause and resume a source by the work in flight, with hysteresis.

use std::fmt;
use std::pin::Pin;
use std::sync::PoisonError;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use futures::Stream;
use futures::stream::FusedStream;
use pin_project::pin_project;
use tokio::time::{Instant, Sleep};

use crate::demand::Levels;
use crate::demand::early::Early;
use crate::demand::signal::{PauseSignal, Signal};
use crate::error::ConfigError;
use crate::metrics::{Gauge, Labels};
use crate::sync::{Arc, Mutex, MutexGuard, Panics};

/// The state a [`PauseSignal`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Flow {
    /// Pull from the source.
    Resumed,
    /// Stop pulling: work in flight reached the high watermark.
    Paused,
}

#[derive(Debug)]
struct State {
    in_flight: usize,
    paused: bool,
    last_change: Option<Instant>,
    /// The wrapper, waiting to resume.
    waker: Option<Waker>,
    /// The wrapper is gone: no timer is left to apply a change held back by `min_hold`, so
    /// every change applies as soon as it is due.
    wrapper_gone: bool,
}

fn flow_of(paused: bool) -> Flow {
    if paused { Flow::Paused } else { Flow::Resumed }
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    levels: Levels,
    min_hold: Duration,
    name: Option<String>,
    /// Moved after the lock is released, by each change seen under it
    /// ([`settle`](Shared::settle)): the recorder is user code, and `Gauge::add` commutes,
    /// so the gauges end at the state whatever order racing changes record in.
    in_flight_gauge: Gauge,
    paused_gauge: Gauge,
    /// `State::paused`, written under the lock, read by [`publish`](Shared::publish) after it
    /// was released.
    paused: AtomicBool,
    signal: Arc<Signal>,
}

impl Drop for Shared {
    /// The wrapper and every ticket are gone: no change can come to the signals.
    fn drop(&mut self) {
        self.signal.close();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Apply the hysteresis rule now. The caller holds the lock, so the signal is not sent
    /// nor the gauges moved here: the caller calls [`settle`](Shared::settle) once it has
    /// released the lock.
    fn evaluate(&self, st: &mut State, now: Instant) -> Evaluated {
        let want_pause = st.in_flight >= self.levels.high();
        let want_resume = st.in_flight <= self.levels.low();
        let change = (want_pause && !st.paused) || (want_resume && st.paused);
        if !change {
            return Evaluated::Unchanged;
        }
        if !st.wrapper_gone
            && let Some(last) = st.last_change
        {
            let allowed = last + self.min_hold;
            if now < allowed {
                return Evaluated::HeldUntil(allowed);
            }
        }
        st.paused = !st.paused;
        st.last_change = Some(now);
        self.paused.store(st.paused, Ordering::Release);
        Evaluated::Flipped
    }

    /// What a change made under the lock leaves to do once it is released, in this order:
    /// [`publish`](Shared::publish) a flip (it wakes the signal's waiters), wake the
    /// wrapper's `waker` (or only drop it: `wake` false), then move the gauges: `in_flight`
    /// by what the change added, `paused` by a flip to `paused`. Each step is user code (a
    /// waker, the metrics recorder) and each runs even if one before it panics: a skipped
    /// wake leaves the wrapper waiting for ever, a skipped gauge reads wrong for good. The
    /// first panic goes on once all have run.
    fn settle(
        &self,
        evaluated: Evaluated,
        paused: bool,
        in_flight: f64,
        waker: Option<Waker>,
        wake: bool,
    ) {
        let mut panics = Panics::new();
        if evaluated == Evaluated::Flipped {
            panics.run(|| self.publish());
        }
        if let Some(waker) = waker {
            panics.run(|| {
                if wake {
                    waker.wake();
                }
            });
        }
        panics.run(|| self.in_flight_gauge.add(in_flight));
        if evaluated == Evaluated::Flipped {
            panics.run(|| self.paused_gauge.add(if paused { 1.0 } else { -1.0 }));
        }
        panics.resume();
    }

    /// Send the pause state to the [`PauseSignal`]s; called without the lock, because
    /// sending wakes the tasks waiting in [`PauseSignal::changed`].
    ///
    /// It sends the latest state, not the one the caller computed: two callers that flipped
    /// it one after the other may publish in either order, and the signal's own lock orders
    /// their sends; the last one reads the last flip. A change undone at once may be skipped,
    /// as the signal keeps only its latest value anyway.
    fn publish(&self) {
        self.signal
            .send_with(|| flow_of(self.paused.load(Ordering::Acquire)));
    }

    /// The wrapper is gone (dropped, or taken apart with `into_inner`): nothing polls it
    /// to apply a change held back by `min_hold` any more. What is due applies now, and
    /// later what the tickets still out make due (a resume) applies when they are dropped.
    fn wrapper_gone(&self) {
        let mut st = self.lock();
        st.wrapper_gone = true;
        let evaluated = self.evaluate(&mut st, Instant::now());
        let paused = st.paused;
        let waker = st.waker.take();
        drop(st);
        // Outside the lock: sending wakes the signal's waiters, and a waker dropped may run
        // code of its own.
        self.settle(evaluated, paused, 0.0, waker, false);
    }

    fn done(&self) {
        let mut st = self.lock();
        st.in_flight -= 1;
        let evaluated = self.evaluate(&mut st, Instant::now());
        let paused = st.paused;
        let blocked = matches!(evaluated, Evaluated::HeldUntil(_));
        // Wake the wrapper if it may pull again (resumed, or below `high` while a pause is
        // held back by `min_hold`) or has a held-back change to apply with its timer.
        let waker = if blocked || (!st.paused && st.in_flight < self.levels.high()) {
            st.waker.take()
        } else {
            None
        };
        drop(st);
        // Outside the lock: a waker runs code of its own when woken.
        self.settle(evaluated, paused, -1.0, waker, true);
    }
}

/// What [`Shared::evaluate`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Evaluated {
    /// No change is due.
    Unchanged,
    /// The state flipped: [`publish`](Shared::publish) it once the lock is released.
    Flipped,
    /// A change is due but `min_hold` holds it back until then.
    HeldUntil(Instant),
}

/// The wrapper's share of the state: when the wrapper goes, it tells the state (see
/// [`Shared::wrapper_gone`]).
#[derive(Debug)]
struct Wrapper(Arc<Shared>);

impl std::ops::Deref for Wrapper {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

impl Drop for Wrapper {
    fn drop(&mut self) {
        self.0.wrapper_gone();
    }
}

/// One item's place in flight; dropping it marks the item done.
#[must_use = "the item counts as in flight until its ticket is dropped"]
pub struct Ticket {
    shared: Arc<Shared>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.shared.done();
    }
}

impl fmt::Debug for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ticket").finish_non_exhaustive()
    }
}

/// Stream of [`watermarks`](crate::FlowStreamExt::watermarks): each item comes with a
/// [`Ticket`]; in-flight = tickets alive.
///
/// When in-flight reaches `high` the state turns [`Flow::Paused`] and the wrapper stops
/// pulling upstream; when it falls to `low` it turns [`Flow::Resumed`]. Two changes are
/// never closer than `min_hold` (a change due earlier waits for it), so the signal does not
/// flap. The wrapper never has more than `high` items in flight: while a pause is held back
/// by `min_hold` it still stops pulling at `high` (and pulls again below it). The wrapper
/// must be polled for a change held back by `min_hold` to be applied on time (a consumer
/// loop awaiting `next()` does that). Once the wrapper is dropped (or taken apart with
/// [`into_inner`](Watermarks::into_inner)) with tickets still out, no timer is left to
/// apply a held-back change, so `min_hold` no longer holds: each change applies as soon as
/// it is due, and the signal turns resumed when the tickets bring the work down to `low`.
///
/// The end of the upstream needs no room: paused, the wrapper polls an upstream whose
/// [`size_hint`](Stream::size_hint) says no item is left (an iterator; a
/// [`Prefetch`](crate::demand::Prefetch) whose source has answered its end, with nothing
/// buffered; a channel [`Receiver`](crate::channel::Receiver) closed for sends, with
/// nothing left to come) for its end, so a source that ends with `high` items in flight ends the
/// stream (a consumer that keeps its tickets until the end gets it). Any other upstream is
/// not polled while paused. The `size_hint` is read when the wrapper is polled while
/// paused; a channel `Receiver` registers the wrapper then to be woken when it ends, so a
/// channel closed (or its last sender dropped) only after the wrapper paused ends the
/// stream too. Nothing else wakes the wrapper when its upstream's hint changes later: a
/// `Prefetch` whose source answers its end only after the wrapper paused (it learns it as
/// it is polled) is seen once the wrapper has room again, a ticket dropped (a consumer that
/// keeps every ticket until the end waits for ever there). An item such an upstream
/// yields all the same (a wrong `size_hint`) is held for room;
/// dropped (or taken apart with [`into_inner`](Watermarks::into_inner)) while it holds
/// it, the wrapper discards it, counted in `flowgate_demand_discarded_total`.
///
/// `stream.watermarks(levels)` has no `min_hold` and no name; set them with
/// [`Watermarks::builder`].
///
/// # Panics
///
/// With a non-zero `min_hold`, polling panics outside a tokio runtime with its time driver
/// enabled once a change is held back (the wrapper sets a tokio timer to apply it). With the
/// default `min_hold` of zero no timer is ever set.
#[pin_project]
#[must_use = "streams do nothing unless polled"]
pub struct Watermarks<S: Stream> {
    #[pin]
    stream: S,
    shared: Wrapper,
    timer: Option<Pin<Box<Sleep>>>,
    /// An item the upstream yielded while the wrapper was paused, polled for its end
    /// because its `size_hint` said no item was left: it waits here for room.
    early: Early<S::Item>,
}

impl<S: Stream> Watermarks<S> {
    /// A builder, to set `min_hold` and a name: `Watermarks::builder(stream, levels)` is
    /// [`stream.watermarks(levels)`](crate::FlowStreamExt::watermarks) with options.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use flowgate::demand::{Levels, Watermarks};
    /// use futures::StreamExt;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let mut stream = Watermarks::builder(futures::stream::iter(0..10), Levels::new(2, 0)?)
    ///     .min_hold(Duration::from_millis(100))
    ///     .name("orders")
    ///     .build()?;
    /// let signal = stream.pause_signal();
    /// let (_, a) = stream.next().await.unwrap();
    /// let (_, b) = stream.next().await.unwrap();
    /// assert!(signal.is_paused()); // 2 in flight: high
    /// drop((a, b));
    /// assert!(signal.is_paused()); // at low, but the resume waits for min_hold
    /// assert_eq!(stream.next().await.map(|(i, _)| i), Some(2)); // after 100 ms
    /// assert_eq!(stream.name(), Some("orders"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(stream: S, levels: Levels) -> WatermarksBuilder<S> {
        WatermarksBuilder {
            stream,
            levels,
            min_hold: Duration::ZERO,
            name: None,
        }
    }

    pub(crate) fn new(stream: S, levels: Levels, min_hold: Duration, name: Option<String>) -> Self {
        let labels = Labels::new(name.as_deref());
        Watermarks {
            stream,
            shared: Wrapper(Arc::new(Shared {
                state: Mutex::new(State {
                    in_flight: 0,
                    paused: false,
                    last_change: None,
                    waker: None,
                    wrapper_gone: false,
                }),
                levels,
                min_hold: crate::time::capped(min_hold),
                in_flight_gauge: labels.gauge(names::IN_FLIGHT, &[]),
                paused_gauge: labels.gauge(names::PAUSED, &[]),
                name,
                paused: AtomicBool::new(false),
                signal: Arc::new(Signal::new()),
            })),
            timer: None,
            early: Early::new(labels.counter(crate::demand::prefetch::names::DISCARDED, &[])),
        }
    }

    /// The `name` label of this stream's metrics, if it was given one.
    pub fn name(&self) -> Option<&str> {
        self.shared.name.as_deref()
    }

    /// The levels: pause at `high` in flight, resume at `low`.
    pub fn levels(&self) -> Levels {
        self.shared.levels
    }

    /// A signal that follows the pause state.
    pub fn pause_signal(&self) -> PauseSignal {
        Signal::subscribe(&self.shared.signal)
    }

    /// Items handed out whose tickets are still alive.
    pub fn in_flight(&self) -> usize {
        self.shared.lock().in_flight
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

    /// The inner stream. An item it yielded while the wrapper was paused although its
    /// `size_hint` said none was left (see [`Watermarks`]), held for room, is discarded
    /// (counted in `flowgate_demand_discarded_total`); [`into_parts`](Watermarks::into_parts)
    /// gives it back.
    pub fn into_inner(self) -> S {
        self.stream
    }

    /// The inner stream and the item the wrapper holds for it, if any: one the upstream
    /// yielded although its `size_hint` said none was left (see [`Watermarks`]), held for room, which
    /// comes before the stream's next.
    pub fn into_parts(self) -> (S, Option<S::Item>) {
        let mut early = self.early;
        (self.stream, early.take())
    }
}

/// Builds a [`Watermarks`] stream; from [`Watermarks::builder`].
#[derive(Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct WatermarksBuilder<S> {
    stream: S,
    levels: Levels,
    min_hold: Duration,
    name: Option<String>,
}

impl<S: Stream> WatermarksBuilder<S> {
    /// The shortest time between two changes of state (default zero; `Duration::MAX` holds
    /// for ever): a change due earlier waits until `min_hold` after the last one. It holds
    /// while the wrapper lives (its timer applies the held-back change); after, each change
    /// applies when it is due (see [`Watermarks`]).
    ///
    /// # Panics
    ///
    /// With a non-zero `min_hold`, polling the built stream panics outside a tokio runtime
    /// with its time driver enabled once a change is held back (the wrapper sets a tokio
    /// timer).
    pub fn min_hold(mut self, hold: Duration) -> Self {
        self.min_hold = hold;
        self
    }

    /// The `name` label of the in-flight and paused metrics (`flowgate_demand_in_flight`,
    /// `flowgate_demand_paused`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Build the stream.
    ///
    /// # Errors
    ///
    /// None today: the levels were checked by [`Levels::new`], and every `min_hold` is valid.
    /// The `Result` is the builder convention, and room for settings that can be wrong.
    pub fn build(self) -> Result<Watermarks<S>, ConfigError> {
        Ok(Watermarks::new(
            self.stream,
            self.levels,
            self.min_hold,
            self.name,
        ))
    }
}

/// Names of the watermark metrics.
pub(crate) mod names {
    pub(crate) const IN_FLIGHT: &str = "flowgate_demand_in_flight";
    pub(crate) const PAUSED: &str = "flowgate_demand_paused";
}

impl<S: Stream> Stream for Watermarks<S> {
    type Item = (S::Item, Ticket);

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let mut this = self.project();
        let mut st = this.shared.lock();
        let evaluated = this.shared.evaluate(&mut st, Instant::now());
        let paused = st.paused;
        // At `high` the wrapper stops pulling even while the pause itself is held back by
        // `min_hold`: in flight never exceeds `high`.
        let pending = st.paused || st.in_flight >= this.shared.levels.high();
        let old = if pending {
            st.waker.replace(cx.waker().clone())
        } else {
            None
        };
        drop(st);
        // Outside the lock: sending wakes the signal's waiters, dropping a waker may run code
        // of its own, and so may the timer (it drops the waker it held, or wakes ours).
        this.shared.settle(evaluated, paused, 0.0, old, false);
        if let Evaluated::HeldUntil(at) = evaluated {
            // A change is held back by `min_hold`: come back when it may happen.
            let timer = match this.timer {
                Some(t) => {
                    t.as_mut().reset(at);
                    t
                }
                None => this.timer.insert(Box::pin(tokio::time::sleep_until(at))),
            };
            if timer.as_mut().poll(cx).is_ready() {
                cx.waker().wake_by_ref();
            }
        }
        if pending {
            // The end needs no room (see `Early`): a source that ends with `high` items
            // in flight ends the stream.
            if this.early.poll_end(this.stream.as_mut(), cx) {
                return Poll::Ready(None);
            }
            return Poll::Pending;
        }
        if !this.early.is_held() {
            match ready!(this.stream.poll_next(cx)) {
                Some(item) => this.early.hold(item),
                None => return Poll::Ready(None),
            }
        }
        // The item stays held until it goes out with its ticket, and the ticket comes
        // first: if the recorder or a signal waiter's waker panics, dropping the ticket gives
        // the place back (once the gauges counted it), and the next poll yields the item.
        let mut st = this.shared.lock();
        st.in_flight += 1;
        let evaluated = this.shared.evaluate(&mut st, Instant::now());
        let paused = st.paused;
        drop(st);
        let ticket = Ticket {
            shared: Arc::clone(&this.shared.0),
        };
        this.shared.settle(evaluated, paused, 1.0, None, false);
        Poll::Ready(this.early.take().map(|item| (item, ticket)))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        // One output per inner item, and one for an item held for room (see `early`).
        self.early.size_hint(self.stream.size_hint())
    }
}

/// The inner stream's write half, untouched (only reading is counted).
impl<S, Item> futures::Sink<Item> for Watermarks<S>
where
    S: Stream + futures::Sink<Item>,
{
    type Error = S::Error;
    crate::ext::delegate_sink!(stream, Item);
}

impl<S: FusedStream> FusedStream for Watermarks<S> {
    fn is_terminated(&self) -> bool {
        !self.early.is_held() && self.stream.is_terminated()
    }
}

impl<S: Stream + fmt::Debug> fmt::Debug for Watermarks<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watermarks")
            .field("stream", &self.stream)
            .field("levels", &self.shared.levels)
            .field("name", &self.shared.name)
            .field("min_hold", &self.shared.min_hold)
            .finish()
    }
}
