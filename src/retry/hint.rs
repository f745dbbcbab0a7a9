//! `ServerHint`: what a server's response says about when and how fast to come back:
//! `Retry-After`, the IETF `RateLimit` / `RateLimit-Policy` fields, draft-03
//! `RateLimit-*` and `X-RateLimit-*`.

use std::convert::Infallible;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{
    HeaderMap, HeaderName,
    header::{DATE, RETRY_AFTER},
};
use sfv::visitor::{
    EntryVisitor, Ignored, InnerListVisitor, ItemVisitor, ListVisitor, ParameterVisitor,
};
use sfv::{BareItemFromInput, KeyRef, Parser};

use crate::http::fields::{
    RATELIMIT, RATELIMIT_LIMIT, RATELIMIT_POLICY, RATELIMIT_REMAINING, RATELIMIT_RESET,
    X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING, X_RATELIMIT_RESET,
};
use crate::rate::cmp_rate;

/// An `X-RateLimit-Reset` above this many seconds is a Unix time, not a delay.
const EPOCH_SECONDS_ABOVE: u64 = 1_000_000_000;
/// An `X-RateLimit-Reset` above this is a Unix time in milliseconds.
const EPOCH_MILLIS_ABOVE: u64 = 1_000_000_000_000;

/// One rate-limit policy as a server described it: its name, quota and window (from
/// `RateLimit-Policy`), and its current remaining and reset (from `RateLimit`). Any part
/// the server did not send, or sent malformed, is `None`.
///
/// The IETF fields name their policies; the draft-03 and `X-RateLimit-*` fields describe
/// one nameless policy.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct PolicyHint {
    /// The policy's name (the IETF fields' sf-String or token), if it has one.
    pub name: Option<String>,
    /// The quota: units allowed per window (`q`, `RateLimit-Limit`, `X-RateLimit-Limit`).
    pub quota: Option<u64>,
    /// The window (`w`, or the `w` parameter of a draft-03 `RateLimit-Limit`).
    pub window: Option<Duration>,
    /// The units left now (`r`, `RateLimit-Remaining`, `X-RateLimit-Remaining`).
    pub remaining: Option<u64>,
    /// The time until more quota is available (`t`, `RateLimit-Reset`,
    /// `X-RateLimit-Reset`).
    pub reset: Option<Duration>,
}

/// What a response says about coming back: the server's `Retry-After` and its rate-limit
/// policies, parsed from every common style of field.
///
/// [`from_headers`](ServerHint::from_headers) reads:
///
/// | field | parsed as |
/// |---|---|
/// | `Retry-After` | delta-seconds (saturating at `u64::MAX` seconds), or an HTTP-date relative to `now` (a date in the past, one before 1970 included, is zero); of several field lines, the first |
/// | `RateLimit-Policy`, `RateLimit` | the IETF fields (draft-ietf-httpapi-ratelimit-headers -10/-11): Structured Field Lists, `"name";q=100;w=60` and `"name";r=42;t=17`, matched by name; several field lines are one list |
/// | `RateLimit-Limit`, `-Remaining`, `-Reset` | draft-03: integers, the reset in seconds; the limit may carry `;w=` |
/// | `X-RateLimit-Limit`, `-Remaining`, `-Reset` | integers; a reset above 10⁹ is a Unix time in seconds (above 10¹² in milliseconds), converted with `now`; fractions allowed |
///
/// The same limit is often sent in several styles, so only one style of rate-limit fields
/// is used: the IETF fields when any is valid, else draft-03, else `X-RateLimit-*`.
///
/// Malformed fields are ignored, as the IETF draft requires: a field that does not parse
/// (a list with a syntax error, a negative or non-integer number) contributes nothing, and
/// a parameter of the wrong type is as if absent. No input panics. At most
/// [`MAX_POLICIES`](ServerHint::MAX_POLICIES) policies are kept, those with a current
/// remaining first: the first 16 list members of each IETF field that are policies (a
/// member that is not a name, or repeats a name, is skipped without using up a place).
///
/// The summaries ([`remaining`](ServerHint::remaining), [`reset`](ServerHint::reset),
/// [`quota`](ServerHint::quota), [`window`](ServerHint::window),
/// [`allowance`](ServerHint::allowance)) are those of the
/// [`most_restrictive`](ServerHint::most_restrictive) policy.
///
/// # Examples
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use flowgate::retry::ServerHint;
/// use http::HeaderMap;
///
/// let mut headers = HeaderMap::new();
/// headers.insert("retry-after", "20".parse()?);
/// headers.insert("ratelimit-policy", r#""permin";q=50;w=60, "perhr";q=1000;w=3600"#.parse()?);
/// headers.insert("ratelimit", r#""permin";r=0;t=20"#.parse()?);
/// let hint = ServerHint::from_headers(&headers, SystemTime::now());
/// assert_eq!(hint.retry_after, Some(Duration::from_secs(20)));
/// assert_eq!(hint.policy_names().collect::<Vec<_>>(), ["permin", "perhr"]);
/// assert_eq!(hint.allowance(), Some((0, Duration::from_secs(20))));
/// assert_eq!(hint.quota(), Some(50));
/// // The lowest sustained rate: 1000 per hour.
/// assert_eq!(hint.sustained_rate(), Some((1000, Duration::from_secs(3600))));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerHint {
    /// The server's `Retry-After`, an HTTP-date taken relative to the response's `Date`
    /// (else to the `now` given; see [`from_headers`](ServerHint::from_headers)), zero for
    /// a date in the past.
    pub retry_after: Option<Duration>,
    /// The policies described by the fields, in the order the server listed them (those
    /// with a current remaining first when there were too many; see
    /// [`MAX_POLICIES`](ServerHint::MAX_POLICIES)).
    pub policies: Vec<PolicyHint>,
}

impl ServerHint {
    /// The most policies kept from one response: 16.
    pub const MAX_POLICIES: usize = 16;

    /// Parse the hint of a response's `headers`. An HTTP-date (`Retry-After`) or a Unix
    /// time (`X-RateLimit-Reset`) is the server's clock: it is measured from the response's
    /// own `Date` when it has a valid one, so that a client clock skewed from the server's
    /// moves no hint (a client two minutes behind read `Retry-After` five seconds ahead
    /// as two minutes and five seconds), and from `now` otherwise (usually
    /// `SystemTime::now()` when the response arrives). `Date` has whole seconds and is
    /// written before the response travels: a hint measured from it is never shorter than
    /// the server meant, and up to a second plus the transit longer.
    ///
    /// Never fails and never panics: a malformed field is ignored (see the type's docs).
    pub fn from_headers(headers: &HeaderMap, now: SystemTime) -> ServerHint {
        // Read only for a dated hint (most responses have none), and once.
        let date = std::cell::OnceCell::new();
        let now = || {
            *date.get_or_init(|| {
                headers
                    .get(DATE)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| httpdate::parse_http_date(v).ok())
                    .unwrap_or(now)
            })
        };
        let retry_after = headers
            .get(RETRY_AFTER)
            .and_then(|v| retry_after(v.as_bytes(), &now));
        let mut policies = ietf(headers);
        if policies.is_empty() {
            policies.extend(draft_03(headers));
        }
        if policies.is_empty() {
            policies.extend(x_ratelimit(headers, &now));
        }
        ServerHint {
            retry_after,
            policies,
        }
    }

    /// Whether the response said nothing: no `Retry-After`, no policy.
    pub fn is_empty(&self) -> bool {
        self.retry_after.is_none() && self.policies.is_empty()
    }

    /// The names of the policies, in order (nameless ones skipped).
    pub fn policy_names(&self) -> impl Iterator<Item = &str> + '_ {
        self.policies.iter().filter_map(|p| p.name.as_deref())
    }

    /// The policy closest to refusing: among those with a current remaining, the lowest
    /// remaining (ties: the longest reset); without any remaining, the one with the lowest
    /// sustained rate (`quota / window`); else the first.
    pub fn most_restrictive(&self) -> Option<&PolicyHint> {
        let by_remaining = self
            .policies
            .iter()
            .filter_map(|p| p.remaining.map(|r| (r, p)))
            .min_by(|(ra, a), (rb, b)| ra.cmp(rb).then(b.reset.cmp(&a.reset)))
            .map(|(_, p)| p);
        by_remaining
            .or_else(|| self.slowest(0))
            .or_else(|| self.policies.first())
    }

    /// The remaining of the [`most_restrictive`](ServerHint::most_restrictive) policy.
    pub fn remaining(&self) -> Option<u64> {
        self.most_restrictive()?.remaining
    }

    /// The reset of the [`most_restrictive`](ServerHint::most_restrictive) policy.
    pub fn reset(&self) -> Option<Duration> {
        self.most_restrictive()?.reset
    }

    /// The quota of the [`most_restrictive`](ServerHint::most_restrictive) policy.
    pub fn quota(&self) -> Option<u64> {
        self.most_restrictive()?.quota
    }

    /// The window of the [`most_restrictive`](ServerHint::most_restrictive) policy.
    pub fn window(&self) -> Option<Duration> {
        self.most_restrictive()?.window
    }

    /// What the server allows now: `(remaining, reset)` of the
    /// [`most_restrictive`](ServerHint::most_restrictive) policy, both needed: no more
    /// than `remaining` units before `reset` has passed.
    pub fn allowance(&self) -> Option<(u64, Duration)> {
        let p = self.most_restrictive()?;
        Some((p.remaining?, p.reset?))
    }

    /// The server's sustained rate: `(quota, window)` of the policy with the lowest
    /// `quota / window`, among those with both (and a window above zero). For flowgate's
    /// own server layer, a token bucket's `w` is the time to refill it (in whole seconds)
    /// and `q` what refills in `w` (its burst, or more), so `q / w` is its rate.
    pub fn sustained_rate(&self) -> Option<(u64, Duration)> {
        let p = self.slowest(0)?;
        Some((p.quota?, p.window?))
    }

    /// [`sustained_rate`](ServerHint::sustained_rate) among the policies that allow
    /// something (a quota above zero): a zero quota is no rate but a refusal until its
    /// reset.
    pub(crate) fn sustained_rate_allowing(&self) -> Option<(u64, Duration)> {
        let p = self.slowest(1)?;
        Some((p.quota?, p.window?))
    }

    /// How long to wait before sending again, if the response says: the `Retry-After`
    /// (it takes precedence, as the draft requires), else the longest reset of a policy
    /// with nothing remaining.
    pub fn retry_delay(&self) -> Option<Duration> {
        self.retry_after.or_else(|| {
            self.policies
                .iter()
                .filter(|p| p.remaining == Some(0))
                .filter_map(|p| p.reset)
                .max()
        })
    }

    /// The policy with the lowest `quota / window`, among those of `min_quota` or more.
    fn slowest(&self, min_quota: u64) -> Option<&PolicyHint> {
        self.policies
            .iter()
            .filter_map(|p| match (p.quota, p.window) {
                (Some(q), Some(w)) if q >= min_quota && !w.is_zero() => Some((q, w.as_nanos(), p)),
                _ => None,
            })
            // q1 / w1 < q2 / w2  ⇔  q1 × w2 < q2 × w1, compared exactly.
            .min_by(|(qa, wa, _), (qb, wb, _)| cmp_rate(*qa, *wa, *qb, *wb))
            .map(|(_, _, p)| p)
    }
}

/// `Retry-After`: delta-seconds (saturating) or an HTTP-date.
fn retry_after(value: &[u8], now: &impl Fn() -> SystemTime) -> Option<Duration> {
    let value = value.trim_ascii();
    if value.is_empty() {
        return None;
    }
    if value.iter().all(u8::is_ascii_digit) {
        let secs = value.iter().fold(0u64, |acc, d| {
            acc.saturating_mul(10).saturating_add(u64::from(d - b'0'))
        });
        return Some(Duration::from_secs(secs));
    }
    match httpdate::parse_http_date(std::str::from_utf8(value).ok()?) {
        Ok(date) => Some(date.duration_since(now()).unwrap_or(Duration::ZERO)),
        // `httpdate` knows no year before 1970: such a date is in the past all the same.
        Err(_) => before_1970(value).then_some(Duration::ZERO),
    }
}

/// Whether `value` is an HTTP-date of a year before 1970, which `httpdate` refuses: an
/// IMF-fixdate or an asctime date (the forms with four-digit years; RFC 850's two digits
/// never mean one before 1970) that `httpdate` accepts 400 years later (the Gregorian
/// calendar repeats itself, weekdays and leap days included, every 400 years).
fn before_1970(value: &[u8]) -> bool {
    let digits = match value.len() {
        29 => 12..16, // `Sun, 06 Nov 1994 08:49:37 GMT`
        24 => 20..24, // `Sun Nov  6 08:49:37 1994`
        _ => return false,
    };
    if !value[digits.clone()].iter().all(u8::is_ascii_digit) {
        return false;
    }
    let year = value[digits.clone()]
        .iter()
        .fold(0u16, |acc, d| acc * 10 + u16::from(d - b'0'));
    if year >= 1970 {
        return false;
    }
    let mut later = year + (1970 - year).div_ceil(400) * 400;
    let mut shifted = value.to_vec();
    for slot in shifted[digits].iter_mut().rev() {
        *slot = b'0' + (later % 10) as u8;
        later /= 10;
    }
    std::str::from_utf8(&shifted).is_ok_and(|s| httpdate::parse_http_date(s).is_ok())
}

/// What one list member holds: its value and the parameters flowgate reads.
#[derive(Debug, Default)]
struct Member {
    /// The name (an sf-String or a token).
    name: Option<String>,
    /// The value when it is a non-negative Integer (draft-03 `RateLimit-Limit`).
    int: Option<u64>,
    /// An inner list, a value of another type, or (in a list of distinct names) a name
    /// seen before.
    other: bool,
    q: Option<u64>,
    w: Option<u64>,
    r: Option<u64>,
    t: Option<u64>,
}

/// A non-negative sf-Integer.
fn non_negative(value: &BareItemFromInput<'_>) -> Option<u64> {
    match value {
        BareItemFromInput::Integer(i) => u64::try_from(i64::from(*i)).ok(),
        _ => None,
    }
}

/// Collects the members of a list: at most `MAX_POLICIES`; later ones are still checked
/// for syntax, then ignored. With `named` (the IETF fields), only members that can be a
/// policy count: a member that is not a name, or repeats an earlier member's name, gives
/// its place back, so junk cannot crowd out the policies after it.
struct Members<'a> {
    out: &'a mut Vec<Member>,
    named: bool,
}

impl Members<'_> {
    /// Drop the last member when `named` and it cannot be a policy.
    fn drop_unnamed(&mut self) {
        if !self.named {
            return;
        }
        // A repeated name is `other` (see `Entry`).
        if self.out.last().is_some_and(|m| m.other || m.name.is_none()) {
            self.out.pop();
        }
    }
}

impl<'de> ListVisitor<'de> for Members<'_> {
    type Out = ();
    type Error = Infallible;

    fn entry(&mut self) -> Result<impl EntryVisitor<'de>, Self::Error> {
        self.drop_unnamed();
        if self.out.len() >= ServerHint::MAX_POLICIES {
            return Ok(None);
        }
        self.out.push(Member::default());
        let named = self.named;
        Ok(self.out.split_last_mut().map(|(member, earlier)| Entry {
            member,
            earlier: if named { earlier } else { &[] },
        }))
    }

    fn finish(mut self) -> Result<(), Self::Error> {
        self.drop_unnamed();
        Ok(())
    }
}

/// One member being parsed, and the members before it whose names it must not repeat: a
/// repeated name is `other`, without a copy of it (10 000 repeats allocate nothing).
struct Entry<'a> {
    member: &'a mut Member,
    earlier: &'a [Member],
}

impl<'de> EntryVisitor<'de> for Entry<'_> {
    type Error = Infallible;

    fn item(self) -> Result<impl ItemVisitor<'de>, Self::Error> {
        Ok(self)
    }

    fn inner_list(self) -> Result<impl InnerListVisitor<'de>, Self::Error> {
        self.member.other = true;
        Ok(Ignored)
    }
}

impl<'de> ItemVisitor<'de> for Entry<'_> {
    type Out = ();
    type Error = Infallible;

    fn bare_item(
        self,
        value: BareItemFromInput<'de>,
    ) -> Result<impl ParameterVisitor<'de, Out = ()>, Self::Error> {
        let member = self.member;
        let name = match &value {
            BareItemFromInput::String(s) => Some(s.as_str()),
            BareItemFromInput::Token(t) => Some(t.as_str()),
            _ => None,
        };
        match (name, &value) {
            (Some(name), _) if self.earlier.iter().all(|m| m.name.as_deref() != Some(name)) => {
                member.name = Some(name.to_owned());
            }
            (None, BareItemFromInput::Integer(_)) => match non_negative(&value) {
                Some(v) => member.int = Some(v),
                None => member.other = true,
            },
            // A repeated name, or a value of another type.
            _ => member.other = true,
        }
        Ok(Params(member))
    }
}

/// The parameters of one member; the last of a repeated key wins (RFC 9651), and a value
/// of the wrong type is as if absent.
struct Params<'a>(&'a mut Member);

impl<'de> ParameterVisitor<'de> for Params<'_> {
    type Out = ();
    type Error = Infallible;

    fn parameter(
        &mut self,
        key: &'de KeyRef,
        value: BareItemFromInput<'de>,
    ) -> Result<(), Self::Error> {
        let slot = match key.as_str() {
            "q" => &mut self.0.q,
            "w" => &mut self.0.w,
            "r" => &mut self.0.r,
            "t" => &mut self.0.t,
            _ => return Ok(()),
        };
        *slot = non_negative(&value);
        Ok(())
    }

    fn finish(self) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// Every line of the field `name` as one list (RFC 9651 §3.1: lines are joined with
/// commas); empty when the field is absent or malformed. With `named`, only distinct
/// names are kept (see [`Members`]).
fn list(headers: &HeaderMap, name: &HeaderName, named: bool) -> Vec<Member> {
    let mut lines = headers.get_all(name).iter();
    let Some(first) = lines.next() else {
        return Vec::new();
    };
    let mut joined;
    let input: &[u8] = match lines.next() {
        None => first.as_bytes(),
        Some(second) => {
            joined = first.as_bytes().to_vec();
            for line in std::iter::once(second).chain(lines) {
                joined.extend_from_slice(b", ");
                joined.extend_from_slice(line.as_bytes());
            }
            &joined
        }
    };
    let mut members = Vec::new();
    if Parser::new(input)
        .parse_list_with_visitor(Members {
            out: &mut members,
            named,
        })
        .is_err()
    {
        members.clear();
    }
    members
}

/// One sf-Item field that must be a non-negative Integer.
fn integer_item(headers: &HeaderMap, name: &HeaderName) -> Option<u64> {
    let mut lines = headers.get_all(name).iter();
    let value = lines.next()?;
    if lines.next().is_some() {
        return None; // several lines: not an Item
    }
    let mut out = None;
    Parser::new(value.as_bytes())
        .parse_item_with_visitor(|v: BareItemFromInput<'_>| {
            out = non_negative(&v);
            Ok::<_, Infallible>(Ignored)
        })
        .ok()?;
    out
}

/// One sf-Item field that must be a non-negative Integer or Decimal; in milliseconds.
fn number_item_millis(headers: &HeaderMap, name: &HeaderName) -> Option<u64> {
    let mut lines = headers.get_all(name).iter();
    let value = lines.next()?;
    if lines.next().is_some() {
        return None;
    }
    let mut out = None;
    Parser::new(value.as_bytes())
        .parse_item_with_visitor(|v: BareItemFromInput<'_>| {
            out = match v {
                BareItemFromInput::Integer(i) => u64::try_from(i64::from(i))
                    .ok()
                    .map(|s| s.saturating_mul(1000)),
                BareItemFromInput::Decimal(d) => {
                    u64::try_from(i64::from(d.as_integer_scaled_1000())).ok()
                }
                _ => None,
            };
            Ok::<_, Infallible>(Ignored)
        })
        .ok()?;
    out
}

/// The IETF fields: `RateLimit-Policy` members, with the `RateLimit` members matched by
/// name (a `RateLimit` member without a policy is a policy of its own).
fn ietf(headers: &HeaderMap) -> Vec<PolicyHint> {
    let mut policies: Vec<PolicyHint> = Vec::new();
    for m in list(headers, &RATELIMIT_POLICY, true) {
        let Some(name) = m.name.filter(|_| !m.other) else {
            continue;
        };
        if policies.iter().any(|p| p.name.as_deref() == Some(&name)) {
            continue; // a repeated name: the first one counts
        }
        policies.push(PolicyHint {
            name: Some(name),
            quota: m.q,
            window: m.w.filter(|&w| w > 0).map(Duration::from_secs),
            remaining: None,
            reset: None,
        });
    }
    let mut matched = vec![false; policies.len()];
    for m in list(headers, &RATELIMIT, true) {
        let Some(name) = m.name.filter(|_| !m.other) else {
            continue;
        };
        let reset = m.t.map(Duration::from_secs);
        match policies
            .iter()
            .position(|p| p.name.as_deref() == Some(&name))
        {
            Some(i) if i < matched.len() => {
                if !matched[i] {
                    matched[i] = true;
                    policies[i].remaining = m.r;
                    policies[i].reset = reset;
                }
            }
            Some(_) => {} // a repeated name among the RateLimit members
            None => policies.push(PolicyHint {
                name: Some(name),
                quota: None,
                window: None,
                remaining: m.r,
                reset,
            }),
        }
    }
    if policies.len() > ServerHint::MAX_POLICIES {
        // Keep the policies with a current remaining first, in their order.
        let mut extra = policies.len() - ServerHint::MAX_POLICIES;
        let mut i = policies.len();
        while extra > 0 && i > 0 {
            i -= 1;
            if policies[i].remaining.is_none() {
                policies.remove(i);
                extra -= 1;
            }
        }
        policies.truncate(ServerHint::MAX_POLICIES);
    }
    policies
}

/// Draft-03: `RateLimit-Limit` (`10` or `10, 10;w=1, 50;w=60`), `RateLimit-Remaining`,
/// `RateLimit-Reset` (seconds).
fn draft_03(headers: &HeaderMap) -> Option<PolicyHint> {
    let limit = list(headers, &RATELIMIT_LIMIT, false);
    let quota = limit.first().and_then(|m| m.int);
    // The window: `w` on the first member, else on a later member with the same quota.
    let window = limit
        .iter()
        .filter(|m| m.int == quota && quota.is_some())
        .find_map(|m| m.w.filter(|&w| w > 0))
        .map(Duration::from_secs);
    let remaining = integer_item(headers, &RATELIMIT_REMAINING);
    let reset = integer_item(headers, &RATELIMIT_RESET).map(Duration::from_secs);
    let hint = PolicyHint {
        name: None,
        quota,
        window,
        remaining,
        reset,
    };
    (hint != PolicyHint::default()).then_some(hint)
}

/// `X-RateLimit-Limit`, `-Remaining`, `-Reset` (seconds from now, or a Unix time).
fn x_ratelimit(headers: &HeaderMap, now: &impl Fn() -> SystemTime) -> Option<PolicyHint> {
    let quota = integer_item(headers, &X_RATELIMIT_LIMIT);
    let remaining = integer_item(headers, &X_RATELIMIT_REMAINING);
    let reset = number_item_millis(headers, &X_RATELIMIT_RESET).map(|millis| {
        // The number as written (the integer part).
        let written = millis / 1000;
        let at = if written > EPOCH_MILLIS_ABOVE {
            // A Unix time in milliseconds: the number written is the milliseconds.
            Some(UNIX_EPOCH.checked_add(Duration::from_millis(written)))
        } else if written > EPOCH_SECONDS_ABOVE {
            Some(UNIX_EPOCH.checked_add(Duration::from_millis(millis)))
        } else {
            None
        };
        match at {
            None => Duration::from_millis(millis),
            Some(at) => at
                .and_then(|at| at.duration_since(now()).ok())
                .unwrap_or(Duration::ZERO),
        }
    });
    let hint = PolicyHint {
        name: None,
        quota,
        window: None,
        remaining,
        reset,
    };
    (hint != PolicyHint::default()).then_some(hint)
}
