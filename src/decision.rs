//! `Decision`: the answer of every limiter and gate.

use std::time::Duration;

/// The answer of a limiter or gate to one request.
///
/// It maps one to one onto HTTP: [`retry_after`](Decision::retry_after) is the
/// `Retry-After` header of a 429 response, and `capacity` / `remaining` / `reset_after` are
/// the quota, remaining units and reset time of the IETF `RateLimit` / `RateLimit-Policy` fields
/// (see [`Decision::ratelimit_header`]).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use flowgate::limit::{Limiter, TokenBucket};
/// use flowgate::Quota;
///
/// let mut bucket = Limiter::new(TokenBucket::new(Quota::per_second(2)?));
/// let d = bucket.check(Duration::ZERO, 2)?;
/// assert!(d.allowed);
/// assert_eq!((d.capacity, d.remaining), (2, 0));
/// assert_eq!(d.reset_after, Duration::from_secs(1)); // full again in 1 s
///
/// let d = bucket.check(Duration::ZERO, 1)?;
/// assert!(!d.allowed);
/// assert_eq!(d.retry_after, Duration::from_millis(500));
/// assert_eq!(d.retry_after_secs(), Some(1)); // for the Retry-After header, rounded up
/// assert_eq!(d.ratelimit_header("default"), "\"default\";r=0;t=1");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Decision {
    /// Whether the request was admitted (and its cost consumed).
    pub allowed: bool,
    /// The most units that can be admitted at once: the burst of a token bucket, the count
    /// of a window. The IETF fields call it the quota (`q`).
    pub capacity: u64,
    /// Units that could still be admitted right now, after this decision.
    pub remaining: u64,
    /// When rejected: how long until the same request would be admitted. Zero when allowed.
    ///
    /// In the decisions of an all-or-nothing `check_all`, how long until this limit would
    /// admit it: zero for a limit that had room but was not charged because another did
    /// not, so the request's wait is the longest `retry_after` of its decisions.
    pub retry_after: Duration,
    /// How long until the limiter is back to its full quota (neutral state).
    pub reset_after: Duration,
}

impl Decision {
    /// An admitting decision.
    pub(crate) fn allow(capacity: u64, remaining: u64, reset_after: Duration) -> Decision {
        Decision {
            allowed: true,
            capacity,
            remaining,
            retry_after: Duration::ZERO,
            reset_after,
        }
    }

    /// A rejecting decision.
    pub(crate) fn reject(
        capacity: u64,
        remaining: u64,
        retry_after: Duration,
        reset_after: Duration,
    ) -> Decision {
        Decision {
            allowed: false,
            capacity,
            remaining,
            retry_after,
            reset_after,
        }
    }

    /// A decision made by a gate's failure policy without its backend: admitted
    /// ([`FailurePolicy::Open`](crate::gate::FailurePolicy::Open)). No quota stands behind
    /// it: `capacity` and `remaining` are `u64::MAX` (see [`is_fail_open`](Self::is_fail_open)).
    pub fn fail_open() -> Decision {
        Decision::allow(u64::MAX, u64::MAX, Duration::ZERO)
    }

    /// A decision made by a gate's failure policy without its backend: rejected until the
    /// backend can be asked again, `retry_after` from now
    /// ([`FailurePolicy::Closed`](crate::gate::FailurePolicy::Closed)). No quota stands behind
    /// it: `capacity` is `u64::MAX`, `remaining` 0 (see [`is_fail_closed`](Self::is_fail_closed)).
    /// The `http` feature's layer answers it `503`, not `429`: the server could not decide,
    /// the client is not over a quota.
    pub fn fail_closed(retry_after: Duration) -> Decision {
        Decision::reject(u64::MAX, 0, retry_after, retry_after)
    }

    /// Whether this is a [`fail_open`](Self::fail_open) decision: admitted by a failure
    /// policy, no quota behind it.
    pub const fn is_fail_open(&self) -> bool {
        self.allowed && self.capacity == u64::MAX
    }

    /// Whether this is a [`fail_closed`](Self::fail_closed) decision: rejected by a failure
    /// policy, no quota behind it.
    pub const fn is_fail_closed(&self) -> bool {
        !self.allowed && self.capacity == u64::MAX
    }

    /// `allowed`, as a method.
    pub const fn is_allowed(&self) -> bool {
        self.allowed
    }

    /// The `Retry-After` header value in whole seconds (rounded up), or `None` when allowed.
    pub fn retry_after_secs(&self) -> Option<u64> {
        (!self.allowed).then(|| ceil_secs(self.retry_after))
    }

    /// One member of the IETF `RateLimit` field for this decision:
    /// `"<policy>";r=<remaining>;t=<seconds>`, with `t` in whole seconds, rounded up: the
    /// time until the quota is full again when admitted, and `retry_after` when rejected
    /// (the mapping the `http` module's layer uses; with feature `http`, its
    /// `RateLimitLayer` writes the whole fields, through a Structured Fields serializer).
    /// `"` and `\` in `policy` are escaped as an sf-String needs; a name outside printable
    /// ASCII gives no valid field. Numbers above the largest sf-Integer
    /// (999 999 999 999 999) are sent as that (a fail-open decision has no real remaining).
    pub fn ratelimit_header(&self, policy: &str) -> String {
        let t = ceil_secs(if self.allowed {
            self.reset_after
        } else {
            self.retry_after
        });
        let mut out = String::with_capacity(policy.len() + 24);
        out.push('"');
        for c in policy.chars() {
            if c == '"' || c == '\\' {
                out.push('\\');
            }
            out.push(c);
        }
        out.push_str("\";r=");
        out.push_str(&self.remaining.min(SF_INTEGER_MAX).to_string());
        out.push_str(";t=");
        out.push_str(&t.min(SF_INTEGER_MAX).to_string());
        out
    }
}

/// The largest Integer a Structured Field carries (RFC 9651).
pub(crate) const SF_INTEGER_MAX: u64 = 999_999_999_999_999;

/// Whole seconds, rounded up.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0))
}
