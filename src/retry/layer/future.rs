//! `RetryFuture`: the whole retry sequence of one request, in an explicit state machine;
//! and the [`RetryInfo`] it puts in the response's extensions.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::SystemTime;

use bytes::Buf;
use http::{Request, Response};
use http_body::Body;
use pin_project::{pin_project, pinned_drop};
use tokio::time::{Instant, Sleep};
use tower::Service;

use crate::pace::UntilReady;
use crate::retry::backoff::{GiveUp, Schedule};
use crate::retry::hint::ServerHint;
use crate::sync::{Arc, Panics};
use crate::time::capped;

use super::response::feed_hint;
use super::*;

/// The most body bytes read from a retried response (so that its connection can be
/// reused) before it is dropped instead.
const DRAIN_LIMIT: usize = 64 * 1024;
/// The most frames read from a retried response's body before it is dropped instead: a
/// body of endless empty frames (or trailers) adds no bytes, and must not be read for ever.
const DRAIN_FRAMES: u32 = 1024;

/// The state an attempt starts in once its service is ready: waiting for the pacer, or
/// sending at once.
pub(super) fn first_state<F, ResB>(policy: &RetryPolicy) -> State<F, ResB> {
    match policy.pacer() {
        Some(pacer) => State::Pace {
            wait: pacer.until_ready(1),
        },
        None => State::Send,
    }
}

/// What [`Retry`] did for a response: in the response's extensions.
///
/// # Examples
///
/// See [`RetryLayer`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryInfo {
    /// Attempts made, the first included.
    pub attempts: u32,
    /// Why the retries stopped (with this response).
    pub stop: Stop,
}

/// The response future of [`Retry`]: the whole retry sequence of one request.
///
/// It owns everything it needs (a ready clone of the inner service, the request, the
/// backoff schedule, a refused response's body while it is read) and keeps its states in an
/// explicit enum, with one timer reset for every timeout and wait: its own states allocate
/// nothing beyond the pacer's wait. What it sends and reads does: each attempt sends a
/// clone of the request (its headers, extensions and body are cloned, which allocates for
/// a request with any header), and a response's fields are parsed into a `ServerHint`
/// for the pacer (with one) and by [`HttpClassify`] for a `429` or `503`.
///
/// # Panics
///
/// When polled again after it completed; and when a wait (the pacer, a backoff, an attempt
/// timeout) starts outside a tokio runtime with timers enabled. A panic there, or in the
/// classifier or the inner service, is counted as a drop is (see Cancel safety; a retry
/// whose `call` panics was not sent).
///
/// # Cancel safety
///
/// Dropping it ends the request: it drops the attempt under way (and its response) or the
/// wait before the next one (with the refused response's body being read), and the request
/// is not sent again. Nothing is lost unseen: the budget and the pacer have heard of every
/// attempt that ended (an attempt dropped under way has no outcome, so neither hears of
/// it); the drop is counted once as a `cancelled` stop
/// (`flowgate_retry_stopped_total{stop="cancelled"}`); an attempt dropped under way was
/// sent and counts in `flowgate_retry_attempts_total` (not in the round-trip histogram);
/// a retry the budget allowed and the drop prevented (waiting for its `Retry-After` or
/// backoff, for the pacer, or for the inner service to be ready) is counted as
/// [`abandoned`](crate::retry::RetryBudgetStats::abandoned) (its token stays taken: the
/// attempt before it failed). Dropped after it completed, it counts nothing more.
#[pin_project(PinnedDrop)]
#[must_use = "futures do nothing unless polled"]
pub struct RetryFuture<S, C, B, ResB>
where
    S: Service<Request<B>>,
{
    pub(super) shared: Arc<Shared<C>>,
    /// A clone of the inner service, for this request's attempts.
    pub(super) service: S,
    /// The request; each attempt sends a clone.
    pub(super) request: Request<B>,
    /// Whether an [`Outcome::Retry`] may send this request again (its method).
    pub(super) retryable: bool,
    pub(super) schedule: Schedule,
    #[pin]
    pub(super) state: State<S::Future, ResB>,
    /// The attempt's timeout, or the wait before the next attempt: one timer, reset.
    #[pin]
    pub(super) sleep: Option<Sleep>,
}

#[pin_project(project = StateProj)]
pub(super) enum State<F, ResB> {
    /// The pacer would hold the first attempt past the backoff's deadline: none is sent.
    NotSent(GiveUp),
    /// Making the service ready for a retry (the caller made it ready for the first
    /// attempt), before the retry's turn of the pacer is taken: a turn is taken only for an
    /// attempt sent at once, never lost to a service that fails to get ready, nor kept while
    /// it is not (and then spent together with the turns of other such retries).
    Ready,
    /// Waiting for the adaptive pacer before an attempt, the service ready.
    Pace {
        #[pin]
        wait: UntilReady,
    },
    /// Sending: the service is ready, and the pacer's turn taken.
    Send,
    /// An attempt under way.
    Call {
        #[pin]
        fut: F,
        started: Instant,
    },
    /// Waiting before the next attempt, reading the last response's body meanwhile.
    Backoff {
        #[pin]
        drain: Option<ResB>,
        /// Bytes read from `drain`.
        drained: usize,
        /// Frames read from `drain`.
        frames: u32,
    },
    /// The attempt ended (its future is dropped), or the inner service failed to get ready
    /// for a retry: its outcome is being classified and reported, within one poll. Seen by
    /// a drop only when that poll panicked (the classifier, a metrics recorder, or a
    /// backoff's timer outside a runtime).
    Ended {
        /// Whether the budget allowed a retry (not yet sent). The schedule's attempts say
        /// no such thing: the schedule counts a retry it allows before the budget is asked,
        /// and the budget may refuse it.
        retry_allowed: bool,
    },
    /// The result was given out.
    Done,
}

#[pinned_drop]
impl<S, C, B, ResB> PinnedDrop for RetryFuture<S, C, B, ResB>
where
    S: Service<Request<B>>,
{
    fn drop(self: Pin<&mut Self>) {
        let policy = &self.shared.policy;
        match &self.state {
            // Completed: its stop was counted.
            State::Done => {}
            // Sent: counted as an attempt already; no outcome to report. (Or none was sent.)
            State::Call { .. } | State::NotSent(_) => policy.count_cancelled(false),
            // Unwinding from a panic after the attempt ended, before its stop was counted;
            // a retry the budget allowed by then was never sent.
            State::Ended { retry_allowed } => policy.count_cancelled(*retry_allowed),
            // Before an attempt: after the first, a retry the budget allowed.
            State::Ready | State::Pace { .. } | State::Send | State::Backoff { .. } => {
                policy.count_cancelled(self.schedule.attempts() > 1);
            }
        }
    }
}

/// Set `sleep` to end at `deadline`, creating the timer on first use.
fn arm(mut sleep: Pin<&mut Option<Sleep>>, deadline: Instant) {
    match sleep.as_mut().as_pin_mut() {
        Some(timer) => timer.reset(deadline),
        None => sleep.set(Some(tokio::time::sleep_until(deadline))),
    }
}

impl<S, C, B, ResB> Future for RetryFuture<S, C, B, ResB>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    C: Classify<Response<ResB>, S::Error>,
    B: Clone,
    ResB: Body,
{
    type Output = Result<Response<ResB>, RetryError<S::Error>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let policy = &this.shared.policy;
        loop {
            let (result, started) = match this.state.as_mut().project() {
                StateProj::NotSent(give_up) => {
                    let give_up = *give_up;
                    this.state.set(State::Done);
                    policy.count_stop(&Stop::GaveUp(give_up));
                    return Poll::Ready(Err(RetryError::NotSent(give_up)));
                }
                StateProj::Pace { wait } => {
                    // Cost 1 never exceeds a pacer's burst (at least 1): this cannot fail.
                    let _ = ready!(wait.poll(cx));
                    this.state.set(State::Send);
                    continue;
                }
                StateProj::Ready => {
                    if let Err(e) = ready!(this.service.poll_ready(cx)) {
                        // The downstream cannot take the request again: a stop like a
                        // fatal answer. (Only a retry makes the service ready here: the
                        // retry the budget allowed is never sent.) Ended first, with no
                        // retry pending: a metrics recorder panicking here must not get the
                        // retry abandoned again by the drop.
                        this.state.set(State::Ended {
                            retry_allowed: false,
                        });
                        policy.abandon_retry();
                        policy.count_stop(&Stop::Fatal);
                        this.state.set(State::Done);
                        return Poll::Ready(Err(RetryError::Inner {
                            error: e,
                            stop: Stop::Fatal,
                            attempts: this.schedule.attempts() - 1,
                        }));
                    }
                    // Ready: now the pacer's turn, used at once when it comes.
                    this.state.set(first_state(policy));
                    continue;
                }
                StateProj::Send => {
                    let req = this.request.clone();
                    // The round trip starts when the request is handed to the client.
                    let started = Instant::now();
                    let fut = this.service.call(req);
                    // Sent: counted now, so that one dropped under way counts too, and under
                    // way (`Call`) before its timer starts, which panics outside a runtime.
                    // A `call` that panics sent nothing: a retry then is abandoned.
                    policy.count_attempt();
                    this.state.set(State::Call { fut, started });
                    if let Some(limit) = policy.attempt_timeout() {
                        arm(this.sleep.as_mut(), started + capped(limit));
                    }
                    continue;
                }
                StateProj::Call { fut, started } => {
                    let started = *started;
                    match fut.poll(cx) {
                        Poll::Ready(result) => (Some(result), started),
                        Poll::Pending => {
                            // The timer was armed for this attempt when it has a timeout.
                            let timed_out = policy.attempt_timeout().is_some()
                                && this
                                    .sleep
                                    .as_mut()
                                    .as_pin_mut()
                                    .is_some_and(|t| t.poll(cx).is_ready());
                            if !timed_out {
                                return Poll::Pending;
                            }
                            (None, started)
                        }
                    }
                }
                StateProj::Backoff {
                    mut drain,
                    drained,
                    frames,
                } => {
                    // Read the refused response to its end while waiting: hyper's client
                    // reuses a connection only once its response was read.
                    if let Some(body) = drain.as_mut().as_pin_mut() {
                        let done = poll_drain(body, drained, frames, cx);
                        if done {
                            drain.set(None);
                        }
                    }
                    if let Some(timer) = this.sleep.as_mut().as_pin_mut() {
                        ready!(timer.poll(cx));
                    }
                    this.state.set(State::Ready);
                    continue;
                }
                StateProj::Ended { .. } | StateProj::Done => {
                    panic!("RetryFuture polled after completion")
                }
            };
            // The attempt is over: drop its future (a timed-out one is cancelled).
            this.state.set(State::Ended {
                retry_allowed: false,
            });
            let rtt = started.elapsed();
            let outcome = match &result {
                Some(result) => this.shared.classify.classify(result),
                None => Outcome::BackPressure { retry_after: None },
            };
            // Only a response can say the server refused the request without acting on
            // it: back-pressure from a timeout or an error is not that.
            let unanswered =
                matches!(outcome, Outcome::BackPressure { .. }) && !matches!(result, Some(Ok(_)));
            let not_resent = !*this.retryable && (outcome == Outcome::Retry || unanswered);
            // Each report runs whatever the one before did (user code runs in them: a
            // metrics recorder, a waiter's waker): the first panic goes on once the budget
            // and the pacer heard of the attempt (see `unheard.resume()` below).
            let mut unheard = Panics::new();
            if not_resent {
                // Not sent again (a `Retry`, a timeout, back-pressure without an answer);
                // the downstream failed all the same.
                if let Some(budget) = policy.budget() {
                    unheard.run(|| budget.on_failure());
                }
            }
            if let (Some(pacer), Some(Ok(res))) = (policy.pacer(), &result) {
                unheard.run(|| {
                    feed_hint(
                        pacer,
                        &ServerHint::from_headers(res.headers(), SystemTime::now()),
                        policy.backoff().max_retry_after(),
                    );
                });
            }
            policy.record(outcome, &mut unheard);
            let attempts = this.schedule.attempts();
            let next = match outcome {
                Outcome::Success => Err(Stop::Success),
                Outcome::Fatal => Err(Stop::Fatal),
                // A timed-out request may have been acted on: only a method safe to send
                // twice is sent again (the pacer still heard of the back-pressure).
                Outcome::BackPressure { .. } if result.is_none() && !*this.retryable => {
                    Err(Stop::TimedOut)
                }
                // A `Retry`, or back-pressure from an error (a client's own timeout): not
                // sent twice.
                Outcome::Retry | Outcome::BackPressure { .. } if not_resent => {
                    Err(Stop::NotRetryable)
                }
                // Never reached the server: sent again whatever the method.
                Outcome::Retry | Outcome::Unsent | Outcome::BackPressure { .. } => {
                    policy.next(this.schedule, outcome).map_err(|stop| {
                        if result.is_none() {
                            Stop::TimedOut
                        } else {
                            stop
                        }
                    })
                }
            };
            if next.is_ok()
                && let StateProj::Ended { retry_allowed } = this.state.as_mut().project()
            {
                *retry_allowed = true;
            }
            // After the budget heard of a failure (see `RetryPolicy::record_rtt`); a panic
            // here, the state `Ended`, abandons a retry the budget allowed. So does one of
            // the budget's or the pacer's recorder, caught and resumed here.
            policy.record_rtt(rtt);
            unheard.resume();
            let stop = match next {
                Ok(delay) => {
                    arm(this.sleep.as_mut(), Instant::now() + capped(delay));
                    let drain = match result {
                        Some(Ok(res)) => Some(res.into_body()),
                        _ => None,
                    };
                    this.state.set(State::Backoff {
                        drain,
                        drained: 0,
                        frames: 0,
                    });
                    continue;
                }
                Err(stop) => stop,
            };
            this.state.set(State::Done);
            policy.count_stop(&stop);
            return Poll::Ready(match result {
                Some(Ok(mut res)) => {
                    res.extensions_mut().insert(RetryInfo { attempts, stop });
                    Ok(res)
                }
                Some(Err(error)) => Err(RetryError::Inner {
                    error,
                    stop,
                    attempts,
                }),
                None => Err(RetryError::TimedOut { attempts }),
            });
        }
    }
}

/// Read `body` without keeping it, while it has frames ready; whether it is done with (its
/// end, an error, more than [`DRAIN_LIMIT`] bytes or [`DRAIN_FRAMES`] frames read).
fn poll_drain<ResB: Body>(
    mut body: Pin<&mut ResB>,
    drained: &mut usize,
    frames: &mut u32,
    cx: &mut Context<'_>,
) -> bool {
    loop {
        match body.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    *drained = drained.saturating_add(data.remaining());
                }
                *frames += 1;
                if *drained > DRAIN_LIMIT || *frames >= DRAIN_FRAMES {
                    return true;
                }
            }
            Poll::Ready(Some(Err(_)) | None) => return true,
            Poll::Pending => return false,
        }
    }
}

impl<S, C, B, ResB> fmt::Debug for RetryFuture<S, C, B, ResB>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::NotSent(_) => "not_sent",
            State::Ready => "ready",
            State::Pace { .. } => "pace",
            State::Send => "send",
            State::Call { .. } => "call",
            State::Backoff { .. } => "backoff",
            State::Ended { .. } => "ended",
            State::Done => "done",
        };
        f.debug_struct("RetryFuture")
            .field("method", self.request.method())
            .field("uri", self.request.uri())
            .field("attempts", &self.schedule.attempts())
            .field("state", &state)
            .finish_non_exhaustive()
    }
}
