//! `watermarks`: pause and resume a source by the work in flight, with hysteresis.

use std::fmt;
use std::pin::Pin;
use std::sync::PoisonError;
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use futures::Stream;
use futures::stream::FusedStream;
use pin_project::pin_project;
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};

use crate::error::{ConfigError, ConfigErrorKind};
use crate::metrics::{Gauge, Labels};
use crate::sync::{Arc, Mutex};

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
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    high: usize,
    low: usize,
    min_hold: Duration,
    signal: watch::Sender<Flow>,
    in_flight: Gauge,
    paused: Gauge,
}

impl Shared {
    /// Apply the hysteresis rule now; returns when a blocked transition may happen.
    fn evaluate(&self, st: &mut State, now: Instant) -> Option<Instant> {
        let want_pause = st.in_flight >= self.high;
        let want_resume = st.in_flight <= self.low;
        let change = (want_pause && !st.paused) || (want_resume && st.paused);
        if !change {
            return None;
        }
        if let Some(last) = st.last_change {
            let allowed = last + self.min_hold;
            if now < allowed {
                return Some(allowed);
            }
        }
        st.paused = !st.paused;
        st.last_change = Some(now);
        self.paused.set(if st.paused { 1.0 } else { 0.0 });
        self.signal.send_replace(if st.paused {
            Flow::Paused
        } else {
            Flow::Resumed
        });
        if !st.paused
            && let Some(w) = st.waker.take()
        {
            w.wake();
        }
        None
    }

    fn done(&self) {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.in_flight -= 1;
        self.in_flight.set(st.in_flight as f64);
        let blocked = self.evaluate(&mut st, Instant::now());
        // Wake the wrapper if it may pull again (below `high` while a pause is held back by
        // `min_hold`) or has a held-back change to apply with its timer.
        if (blocked.is_some() || (!st.paused && st.in_flight < self.high))
            && let Some(w) = st.waker.take()
        {
            w.wake();
        }
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

/// Whether the source should be paused: a watch a consumer loop can await, to call
/// `consumer.pause()` / `resume()` on its source.
#[derive(Debug, Clone)]
pub struct PauseSignal {
    rx: watch::Receiver<Flow>,
}

impl PauseSignal {
    /// The current state.
    pub fn get(&self) -> Flow {
        *self.rx.borrow()
    }

    /// Whether the source should be paused now.
    pub fn is_paused(&self) -> bool {
        self.get() == Flow::Paused
    }

    /// Wait for the next change and return the new state. `None` once no change can come:
    /// the wrapper and every [`Ticket`] it handed out are gone.
    pub async fn changed(&mut self) -> Option<Flow> {
        self.rx.changed().await.ok()?;
        Some(*self.rx.borrow_and_update())
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
/// loop awaiting `next()` does that).
#[pin_project]
#[must_use = "streams do nothing unless polled"]
pub struct Watermarks<S> {
    #[pin]
    stream: S,
    shared: Arc<Shared>,
    timer: Option<Pin<Box<Sleep>>>,
}

impl<S: Stream> Watermarks<S> {
    pub(crate) fn new(stream: S, high: usize, low: usize) -> Result<Self, ConfigError> {
        if high == 0 {
            return Err(ConfigError::zero("watermarks.high"));
        }
        if low >= high {
            return Err(ConfigError::new(
                "watermarks.low",
                ConfigErrorKind::Inconsistent,
                format!("{low} must be below high ({high})"),
            ));
        }
        let (signal, _) = watch::channel(Flow::Resumed);
        let labels = Labels::new(None);
        Ok(Watermarks {
            stream,
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    in_flight: 0,
                    paused: false,
                    last_change: None,
                    waker: None,
                }),
                high,
                low,
                min_hold: Duration::ZERO,
                signal,
                in_flight: labels.gauge(names::IN_FLIGHT, &[]),
                paused: labels.gauge(names::PAUSED, &[]),
            }),
            timer: None,
        })
    }

    /// The shortest time between two changes of state (default zero). Call before the
    /// first poll.
    pub fn min_hold(mut self, hold: Duration) -> Self {
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            shared.min_hold = crate::time::capped(hold);
        }
        self
    }

    /// The `name` label of the in-flight and paused metrics. Call before the first poll.
    pub fn name(mut self, name: &str) -> Self {
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            let labels = Labels::new(Some(name));
            shared.in_flight = labels.gauge(names::IN_FLIGHT, &[]);
            shared.paused = labels.gauge(names::PAUSED, &[]);
        }
        self
    }

    /// A signal that follows the pause state.
    pub fn pause_signal(&self) -> PauseSignal {
        PauseSignal {
            rx: self.shared.signal.subscribe(),
        }
    }

    /// Items handed out whose tickets are still alive.
    pub fn in_flight(&self) -> usize {
        self.shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .in_flight
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

    /// The inner stream.
    pub fn into_inner(self) -> S {
        self.stream
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
        let this = self.project();
        {
            let mut st = this
                .shared
                .state
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if let Some(at) = this.shared.evaluate(&mut st, Instant::now()) {
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
            // At `high` the wrapper stops pulling even while the pause itself is held back
            // by `min_hold`: in flight never exceeds `high`.
            if st.paused || st.in_flight >= this.shared.high {
                st.waker = Some(cx.waker().clone());
                return Poll::Pending;
            }
        }
        let item = ready!(this.stream.poll_next(cx));
        Poll::Ready(item.map(|item| {
            let mut st = this
                .shared
                .state
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            st.in_flight += 1;
            this.shared.in_flight.set(st.in_flight as f64);
            this.shared.evaluate(&mut st, Instant::now());
            drop(st);
            (
                item,
                Ticket {
                    shared: this.shared.clone(),
                },
            )
        }))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        // One output per inner item.
        self.stream.size_hint()
    }
}

impl<S: FusedStream> FusedStream for Watermarks<S> {
    fn is_terminated(&self) -> bool {
        self.stream.is_terminated()
    }
}

impl<S: fmt::Debug> fmt::Debug for Watermarks<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watermarks")
            .field("stream", &self.stream)
            .field("high", &self.shared.high)
            .field("low", &self.shared.low)
            .field("min_hold", &self.shared.min_hold)
            .finish()
    }
}
