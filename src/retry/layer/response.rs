//! Reading a response: what it means for the request ([`HttpClassify`], the default
//! classifier) and what its fields tell the pacer (`feed_hint`).

use std::cmp::Reverse;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, Response, StatusCode};

use crate::retry::hint::{PolicyHint, ServerHint};
use crate::sync::Panics;

use super::*;

/// The default classifier of a [`RetryLayer`]: what an HTTP response (or a transport
/// error) means for the request.
///
/// | result | [`Outcome`] |
/// |---|---|
/// | `1xx`, `2xx`, `3xx` | [`Success`](Outcome::Success) |
/// | `429 Too Many Requests`, `503 Service Unavailable` | [`BackPressure`](Outcome::BackPressure), with the server's [`retry_delay`](ServerHint::retry_delay): its `Retry-After`, else the reset of a `RateLimit` policy with nothing remaining |
/// | `408 Request Timeout`, `500`, `502`, `504` | [`Retry`](Outcome::Retry) |
/// | any other `4xx` or `5xx` | [`Fatal`](Outcome::Fatal) |
/// | a transport error (`Err`) | [`Retry`](Outcome::Retry), even a connect error: the error type is any type, so this classifier cannot tell one that never reached the server ([`Unsent`](Outcome::Unsent): see [`RetryLayer`]) |
///
/// The layer retries a [`Retry`](Outcome::Retry) only for the methods it is told are safe
/// to send twice (by default the idempotent ones; see [`RetryLayer::retry_methods`]), so a
/// `POST` that met a `500` is not sent again. Back-pressure in a response is retried for
/// every method: a `429` or `503` refuses the request without acting on it (a custom
/// classifier's back-pressure for an error, such as a client's own timeout, is not: it
/// is retried as a `Retry` is).
///
/// A custom classifier is any `Fn(&Result<Response<B>, E>) -> Outcome` (see
/// [`RetryLayer::classify`]); it can fall back to this one through
/// [`HttpClassify::outcome`].
///
/// # Examples
///
/// ```
/// use flowgate::retry::{HttpClassify, Outcome};
/// use http::{HeaderMap, StatusCode};
///
/// let mut headers = HeaderMap::new();
/// headers.insert("retry-after", "3".parse()?);
/// let classify = HttpClassify::new();
/// assert_eq!(
///     classify.outcome(StatusCode::TOO_MANY_REQUESTS, &headers),
///     Outcome::BackPressure { retry_after: Some(std::time::Duration::from_secs(3)) },
/// );
/// assert_eq!(classify.outcome(StatusCode::BAD_GATEWAY, &headers), Outcome::Retry);
/// assert_eq!(classify.outcome(StatusCode::NOT_FOUND, &headers), Outcome::Fatal);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HttpClassify {}

impl HttpClassify {
    /// The default classifier.
    pub fn new() -> HttpClassify {
        HttpClassify {}
    }

    /// The outcome of a response with `status` and `headers` (see the table of the type).
    /// A `Retry-After` given as an HTTP-date is measured from the response's `Date`, else
    /// from `SystemTime::now()` ([`ServerHint::from_headers`]).
    pub fn outcome(&self, status: StatusCode, headers: &HeaderMap) -> Outcome {
        match status.as_u16() {
            429 | 503 => Outcome::BackPressure {
                retry_after: ServerHint::from_headers(headers, SystemTime::now()).retry_delay(),
            },
            408 | 500 | 502 | 504 => Outcome::Retry,
            400.. => Outcome::Fatal,
            _ => Outcome::Success,
        }
    }
}

impl<B, E> Classify<Response<B>, E> for HttpClassify {
    fn classify(&self, result: &Result<Response<B>, E>) -> Outcome {
        match result {
            Ok(res) => self.outcome(res.status(), res.headers()),
            Err(_) => Outcome::Retry,
        }
    }
}

/// Tell `pacer` what a response's fields say: the server's sustained rate
/// (`RateLimit-Policy`'s `q` within `w`, the slowest of the policies that allow anything)
/// and its allowance (`RateLimit`'s `r` within `t`), each when the server sent it, the
/// allowance with its own policy's `q` and `w` (which tracking steers it by). A policy of
/// zero quota allows nothing until its reset (its `t`, else its window `w`): an allowance
/// of nothing, which wins over the reported one unless that has nothing left for longer
/// (the rule of [`most_restrictive`](ServerHint::most_restrictive)). A `Retry-After` in the
/// same response takes precedence over the reset, as the draft requires: the allowance ends
/// no later. Call it before reporting the response's outcome, as [`AdaptivePacer`] asks.
///
/// `max_wait` is the longest server hint honoured (the backoff's
/// [`max_retry_after`](crate::retry::BackoffBuilder::max_retry_after)): an allowance
/// slower than one unit per `max_wait` (`r=0;t=86400`) is taken as one unit per `max_wait`,
/// so it holds no later request longer than a `Retry-After` would (a zero `max_wait`, which
/// honours no hint, holds none: the allowance's remaining is still reported). So is a
/// policy slower than that (`q=1;w=86400`, or a window sent in milliseconds by mistake,
/// `q=100;w=60000`): its window is shortened to `q × max_wait`, its quota kept (a zero
/// `max_wait` gives the pacer no policy).
pub(crate) fn feed_hint(pacer: &AdaptivePacer, hint: &ServerHint, max_wait: Duration) {
    // Each field reaches the pacer whatever the other did (user code runs as it takes
    // one: a waiter's waker, a metrics recorder); the first panic goes on after both.
    let mut panics = Panics::new();
    if let Some((quota, window)) = hint.sustained_rate_allowing() {
        // One unit per `max_wait` at the slowest: the pacer keeps a policy until another
        // one comes, so a slower one would hold every later request past any hint honoured.
        let units = u32::try_from(quota).unwrap_or(u32::MAX);
        panics.run(|| pacer.on_policy(quota, window.min(max_wait.saturating_mul(units))));
    }
    // Of the policy closest to refusing, steered by its own quota (the sustained rate
    // above may be another policy's); a zero quota refills nothing, whatever its window.
    let own = |p: &PolicyHint| match (p.quota, p.window) {
        (Some(0), _) => Some((0, Duration::ZERO)),
        (Some(q), Some(w)) => Some((q, w)),
        _ => None,
    };
    let reported = hint
        .most_restrictive()
        .and_then(|p| Some((p.remaining?, p.reset?, own(p))));
    let closed = hint
        .policies
        .iter()
        .filter(|p| p.quota == Some(0))
        .filter_map(|p| p.reset.or(p.window))
        .max()
        .map(|reset| (0, reset, Some((0, Duration::ZERO))));
    let allowance = reported
        .into_iter()
        .chain(closed)
        .min_by_key(|&(remaining, reset, _)| (remaining, Reverse(reset)));
    if let Some((remaining, reset, of)) = allowance {
        // `Retry-After` takes precedence over a reset (the draft): a sliding window's `t`
        // is when it is full again, its `Retry-After` when the next request fits.
        let reset = hint.retry_after.map_or(reset, |after| reset.min(after));
        // `max(r, 1) / t` is the pacer's cap (see `on_allowance`): at least `1 / max_wait`.
        // A zero `max_wait` honours no hint: a zero reset, which holds nothing.
        let units = u32::try_from(remaining.max(1)).unwrap_or(u32::MAX);
        let reset = reset.min(max_wait.saturating_mul(units));
        panics.run(|| pacer.on_allowance_of(remaining, reset, of));
    }
    panics.resume();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_classify_as_documented() {
        let c = HttpClassify::new();
        let none = HeaderMap::new();
        for (status, want) in [
            (200, Outcome::Success),
            (204, Outcome::Success),
            (301, Outcome::Success),
            (429, Outcome::BackPressure { retry_after: None }),
            (503, Outcome::BackPressure { retry_after: None }),
            (408, Outcome::Retry),
            (500, Outcome::Retry),
            (502, Outcome::Retry),
            (504, Outcome::Retry),
            (400, Outcome::Fatal),
            (404, Outcome::Fatal),
            (501, Outcome::Fatal),
        ] {
            let status = StatusCode::from_u16(status).unwrap();
            assert_eq!(c.outcome(status, &none), want, "{status}");
        }
        let err: Result<Response<()>, ()> = Err(());
        assert_eq!(c.classify(&err), Outcome::Retry);
    }
}
