//! The verdict on a decided request: what the gate's decisions come to ([`Verdict`]: pass
//! with the fields, or answer `429` / `503` / `400`), where it is put ([`Slots`]), and the
//! record and log of rejections.

use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::{Response, StatusCode};

use crate::decision::Decision;
use crate::error::CostError;
use crate::gate::GateError;
use crate::http::fields::{self, Fields};
use crate::http::problem::{self, QUOTA_EXCEEDED};
use crate::http::rate_limit::layer::{Keys, Outcome, Shared};

/// How often rejections are logged, at most.
const LOG_EVERY_MS: u64 = 60_000;

/// A verdict once put in its [`Slots`]: a byte, so that what returns it to the future's
/// match copies nothing (the whole verdict, 144 bytes, was copied on each step). A verdict
/// made at once ([`Shared::decide`]) returns not even that: [`Slots::answer`] tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ruling {
    /// Pass to the inner service, adding the fields put in [`Slots::fields`].
    Pass,
    /// Answer with the response put in [`Slots::answer`].
    Answer,
}

/// Where a verdict goes: the response future's own places for the fields of the inner
/// service's response and for the layer's answer.
pub(crate) struct Slots<'a> {
    pub(crate) fields: &'a mut Option<Fields>,
    pub(crate) answer: &'a mut Option<Response<Bytes>>,
}

/// What the layer does with a decided request.
pub(crate) enum Verdict {
    /// Pass to the inner service, adding these fields to its response.
    Pass(Option<Fields>),
    /// Answer with this response (429, 503).
    Answer(Response<Bytes>),
}

impl Verdict {
    /// Put the verdict in `slots`; what the future does next.
    pub(crate) fn put(self, slots: Slots<'_>) -> Ruling {
        match self {
            Verdict::Pass(fields) => {
                *slots.fields = fields;
                Ruling::Pass
            }
            Verdict::Answer(res) => {
                *slots.answer = Some(res);
                Ruling::Answer
            }
        }
    }
}

impl<G> Shared<G> {
    /// The `detail` of a `400` for a request the gate refused: its error, and for a cost
    /// above a burst, each policy of the request that can never admit it, with its own
    /// burst (the gate's error names one capacity, not whose: with several policies the
    /// client could not tell which to ask less of).
    fn bad_request_detail(&self, keys: &Keys, e: &GateError) -> String {
        let GateError::Cost(CostError::ExceedsCapacity { cost, .. }) = e else {
            return e.to_string();
        };
        let over: Vec<String> = keys
            .spans
            .iter()
            .map(|&(i, _, _)| &self.policies[i].policy)
            .filter(|p| p.quota.burst_size() < *cost)
            .map(|p| format!("{:?} (burst {})", p.name, p.quota.burst_size()))
            .collect();
        if over.is_empty() {
            return e.to_string();
        }
        format!(
            "cost {cost} exceeds the burst of {}: it could never be admitted",
            over.join(", ")
        )
    }

    /// What to do with a request the gate decided (or failed to).
    pub(crate) fn conclude(
        &self,
        keys: &Keys,
        decided: Result<&[Decision], &GateError>,
    ) -> Verdict {
        let decisions = match decided {
            Ok(d) if d.len() == keys.spans.len() => d,
            // The request itself cannot be decided: a client error, not the gate's. (A key
            // Redis holds a value of another type under is the server's: a gate error.)
            Err(e @ (GateError::Cost(_) | GateError::InvalidKey(_))) => {
                self.count(Outcome::BadRequest);
                if self.shadow {
                    return Verdict::Pass(None);
                }
                return Verdict::Answer(problem::bad_request(&self.bad_request_detail(keys, e)));
            }
            // A gate that answers the wrong number of decisions is as broken as one that
            // errs.
            Ok(_) | Err(_) => {
                let mut retry_after = 1;
                if let Err(e) = decided {
                    tracing::debug!(
                        layer = self.name.as_deref().unwrap_or(crate::metrics::DEFAULT_NAME),
                        error = %e,
                        "rate limit: gate error",
                    );
                    // A gate waiting to probe its backend says when it asks again.
                    if let Some(wait) = e.retry_after() {
                        retry_after = fields::ceil_secs(wait).max(1);
                    }
                }
                return self.unavailable(Outcome::GateError, retry_after);
            }
        };
        // The common case, one policy that admits: nothing blocked or violated to work out,
        // and the fields take one member, not the filtered zip below (measured with
        // callgrind: ~60 instructions a request fewer without fields, ~195 with them).
        if let ([(i, _, _)], [d]) = (&keys.spans[..], decisions)
            && d.allowed
            && d.capacity != u64::MAX
        {
            // Worked out only if a style is on (`Fields::new` looks at the styles first).
            let member = std::iter::once_with(|| {
                self.policies[*i].member(d.remaining, Some(fields::reset_secs(d)))
            });
            let all = self.policies.len() == 1;
            let fields = Fields::new(
                self.styles,
                member,
                self.all_policy.as_ref().filter(|_| all),
                false,
            );
            self.count(Outcome::Admitted);
            return Verdict::Pass(fields);
        }
        let allowed = decisions.iter().all(|d| d.allowed);
        if !allowed && decisions.iter().any(Decision::is_fail_closed) {
            // Refused by the gate's failure policy: the server could not decide, the client
            // is not over a quota. A 503 saying when the backend is asked again, like a gate
            // error; no fields (no quota stands behind it), no rejected key.
            let retry_after = decisions
                .iter()
                .filter(|d| d.is_fail_closed())
                .map(|d| fields::ceil_secs(d.retry_after))
                .fold(1, u64::max);
            return self.unavailable(Outcome::FailClosed, retry_after);
        }
        let fail_open = decisions.iter().any(Decision::is_fail_open);
        // The policies that blocked: a rejection with a retry_after of its own (the others
        // had room but were not charged). If none says so, all of them did.
        let blocked = |d: &Decision| !d.allowed && !d.retry_after.is_zero();
        let any_blocked = decisions.iter().any(blocked);
        let violated = |d: &Decision| !allowed && (blocked(d) || !any_blocked);
        let mut retry_after = 1u64;
        let mut violated_mask = 0u32;
        if !allowed {
            for (&(i, _, _), d) in keys.spans.iter().zip(decisions) {
                if violated(d) {
                    retry_after = retry_after.max(fields::ceil_secs(d.retry_after));
                    violated_mask |= 1 << i;
                }
            }
        }
        // The fields' members: every policy applied, but a fail-open decision.
        let members = keys
            .spans
            .iter()
            .zip(decisions)
            .filter(|(_, d)| d.capacity != u64::MAX)
            .map(|(&(i, _, _), d)| {
                let t = (allowed || violated(d)).then(|| fields::reset_secs(d));
                self.policies[i].member(d.remaining, t)
            });
        // Every policy applied and none failed open: the layer's `RateLimit-Policy`, as built.
        let all = !fail_open && keys.spans.len() == self.policies.len();
        let fields = Fields::new(
            self.styles,
            members,
            self.all_policy.as_ref().filter(|_| all),
            !allowed,
        );
        if allowed {
            self.count(if fail_open {
                Outcome::FailOpen
            } else {
                Outcome::Admitted
            });
            return Verdict::Pass(fields);
        }
        self.record_rejection(keys, violated_mask);
        if self.shadow {
            self.count(Outcome::ShadowRejected);
            return Verdict::Pass(fields);
        }
        self.count(Outcome::Rejected);
        let body = if violated_mask.is_power_of_two() {
            self.policies[violated_mask.trailing_zeros() as usize]
                .quota_exceeded
                .clone()
        } else {
            let names: Vec<&str> = self
                .policies
                .iter()
                .enumerate()
                .filter(|(i, _)| violated_mask & (1 << i) != 0)
                .map(|(_, e)| e.policy.name.as_str())
                .collect();
            problem::document(QUOTA_EXCEEDED, StatusCode::TOO_MANY_REQUESTS, &names)
        };
        let mut res = problem::response(
            StatusCode::TOO_MANY_REQUESTS,
            body,
            fields::integer_value(retry_after),
        );
        if let Some(fields) = fields {
            fields.write(res.headers_mut(), false);
        }
        Verdict::Answer(res)
    }

    /// The gate could not decide (`outcome`): `503` with `Retry-After: retry_after` seconds
    /// and the temporary-reduced-capacity problem body, no fields; passed in shadow mode.
    fn unavailable(&self, outcome: Outcome, retry_after: u64) -> Verdict {
        self.count(outcome);
        if self.shadow {
            return Verdict::Pass(None);
        }
        let mut res = problem::response(
            StatusCode::SERVICE_UNAVAILABLE,
            self.gate_error_body.clone(),
            fields::integer_value(retry_after),
        );
        // The service behind never ran: this says nothing of its capacity (an outer
        // `ShedLayer`'s adaptive limit ignores it).
        res.extensions_mut()
            .insert(crate::adaptive::Outcome::Ignored);
        Verdict::Answer(res)
    }

    /// Record the blocked keys in the top-N sketch; log at most once a minute.
    fn record_rejection(&self, keys: &Keys, violated_mask: u32) {
        let skip = self.prefix.len();
        for &(i, start, end) in &keys.spans {
            if violated_mask & (1 << i) != 0 {
                self.top.record(&keys.buf[start + skip..end]);
            }
        }
        self.since_log.fetch_add(1, Ordering::Relaxed);
        // The time-stamp counter: a flood of 429s reads it on each (the OS clock cost
        // ~35 ns a read here).
        let now_ms = u64::try_from(self.log_clock.now().as_millis()).unwrap_or(u64::MAX);
        let next = self.next_log_ms.load(Ordering::Relaxed);
        if now_ms >= next
            && self
                .next_log_ms
                .compare_exchange(
                    next,
                    now_ms.saturating_add(LOG_EVERY_MS),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            let since = self.since_log.swap(0, Ordering::Relaxed);
            // With their error bounds: when keys rotate, a count can be nearly all error.
            let top = self.top.top(5);
            tracing::warn!(
                layer = self.name.as_deref().unwrap_or(crate::metrics::DEFAULT_NAME),
                rejected = since,
                shadow = self.shadow,
                top = ?top,
                "rate limit: requests rejected",
            );
        }
    }
}
