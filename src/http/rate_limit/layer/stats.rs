//! What the layer counts: [`RateLimitStats`], the [`Outcome`] of one request, and the
//! counting.

use crate::http::rate_limit::layer::Shared;

/// How many requests ended each way, from [`RateLimitLayer::stats`](crate::http::RateLimitLayer::stats).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RateLimitStats {
    /// Admitted by every policy that applied (or by none applying), or free (a cost of zero).
    pub admitted: u64,
    /// Refused with `429`.
    pub rejected: u64,
    /// Would have been refused; passed because the layer is in shadow mode.
    pub shadow_rejected: u64,
    /// The gate returned an error: answered `503` (passed in shadow mode).
    pub gate_error: u64,
    /// Admitted by the gate's fail-open policy (the backend could not decide).
    pub fail_open: u64,
    /// Refused by the gate's fail-closed policy (the backend could not decide): answered
    /// `503` (passed in shadow mode).
    pub fail_closed: u64,
    /// Refused with `400` because a policy with [`MissingKey::Refuse`](crate::http::MissingKey::Refuse) found no key
    /// (once per request, however many policies found none). In shadow mode the request
    /// passes, decided on the other policies that apply, and counted by that decision too.
    pub missing_key: u64,
    /// Refused with `400` because the request itself cannot be decided: its cost is above
    /// a policy's capacity (it could never pass), or a key is not one the gate takes (too
    /// long with the prefix and the policy's name before it). Passed in shadow mode.
    pub bad_request: u64,
    /// Given up before it was decided: its response future was dropped before the gate
    /// answered (the client went away during a remote gate's round trip, or before the
    /// future was first polled), or dropped after a metrics recorder panicked as its
    /// outcome was counted (the panic went to the caller, the request was not passed on),
    /// or the inner service's `Clone` panicked as `call` kept a clone of it (before the
    /// request had a response future; nothing was decided).
    /// Its cost may be charged all the same (see
    /// [`RateLimitFuture`](crate::http::RateLimitFuture)). A request dropped once passed
    /// on counts as decided (`admitted`, say).
    pub cancelled: u64,
}

/// The outcome of one request.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Outcome {
    Admitted,
    Rejected,
    ShadowRejected,
    GateError,
    FailOpen,
    FailClosed,
    MissingKey,
    BadRequest,
    Cancelled,
}

impl Outcome {
    pub(crate) const ALL: [Outcome; 9] = [
        Outcome::Admitted,
        Outcome::Rejected,
        Outcome::ShadowRejected,
        Outcome::GateError,
        Outcome::FailOpen,
        Outcome::FailClosed,
        Outcome::MissingKey,
        Outcome::BadRequest,
        Outcome::Cancelled,
    ];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::Admitted => "admitted",
            Outcome::Rejected => "rejected",
            Outcome::ShadowRejected => "shadow_rejected",
            Outcome::GateError => "gate_error",
            Outcome::FailOpen => "fail_open",
            Outcome::FailClosed => "fail_closed",
            Outcome::MissingKey => "missing_key",
            Outcome::BadRequest => "bad_request",
            Outcome::Cancelled => "cancelled",
        }
    }
}

impl<G> Shared<G> {
    pub(super) fn count(&self, outcome: Outcome) {
        // The recorder (user code) first: if it panics, the request is not counted here,
        // and its response future, dropped still holding it, counts it as cancelled (once).
        self.counters[outcome as usize].increment(1);
        self.counts.add(outcome as usize, 1);
    }

    pub(crate) fn stats(&self) -> RateLimitStats {
        let c = |o: Outcome| self.counts.get(o as usize);
        RateLimitStats {
            admitted: c(Outcome::Admitted),
            rejected: c(Outcome::Rejected),
            shadow_rejected: c(Outcome::ShadowRejected),
            gate_error: c(Outcome::GateError),
            fail_open: c(Outcome::FailOpen),
            fail_closed: c(Outcome::FailClosed),
            missing_key: c(Outcome::MissingKey),
            bad_request: c(Outcome::BadRequest),
            cancelled: c(Outcome::Cancelled),
        }
    }

    /// A request dropped before it was decided (or before its outcome was counted: a
    /// metrics recorder that panicked counting it).
    pub(crate) fn cancelled(&self) {
        // The request's last count: kept first, so that a recorder that panics (in a drop)
        // cannot lose it.
        let cancelled = Outcome::Cancelled as usize;
        self.counts.add(cancelled, 1);
        self.counters[cancelled].increment(1);
    }
}
