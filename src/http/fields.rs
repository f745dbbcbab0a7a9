//! The rate-limit header fields: IETF `RateLimit-Policy` / `RateLimit`
//! (draft-ietf-httpapi-ratelimit-headers, -10/-11 syntax), draft-03 `RateLimit-Limit` /
//! `-Remaining` / `-Reset` and legacy `X-RateLimit-*`, all written with the `sfv` Structured
//! Fields serializers.

use std::fmt;
use std::ops::{BitOr, BitOrAssign};
use std::time::{SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, HeaderValue};
use sfv::{Integer, ItemSerializer, ListSerializer, StringRef, key_ref};

use crate::decision::Decision;
use crate::gate::Limit;

/// `RateLimit-Policy` (IETF).
pub(crate) const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (IETF).
pub(crate) const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("ratelimit-limit");
const RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("ratelimit-remaining");
const RATELIMIT_RESET: HeaderName = HeaderName::from_static("ratelimit-reset");
const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// Which rate-limit header fields a [`RateLimitLayer`](crate::http::RateLimitLayer)
/// writes; combine styles with `|`.
///
/// | style | fields | values |
/// |---|---|---|
/// | [`IETF`](HeaderStyles::IETF) (default) | `RateLimit-Policy`, `RateLimit` | one list member per policy: `"per-ip";q=100;w=60`, `"per-ip";r=42;t=17` |
/// | [`DRAFT_03`](HeaderStyles::DRAFT_03) | `RateLimit-Limit`, `-Remaining`, `-Reset` | integers of one policy (the lowest remaining); reset in seconds from now |
/// | [`X_RATELIMIT`](HeaderStyles::X_RATELIMIT) | `X-RateLimit-Limit`, `-Remaining`, `-Reset` | the same integers |
/// | [`X_RATELIMIT_EPOCH`](HeaderStyles::X_RATELIMIT_EPOCH) | `X-RateLimit-Limit`, `-Remaining`, `-Reset` | the same, reset as a Unix time in seconds (GitHub's form) |
///
/// `X_RATELIMIT` and `X_RATELIMIT_EPOCH` exclude each other (one `X-RateLimit-Reset`).
///
/// # Examples
///
/// ```
/// use flowgate::http::HeaderStyles;
///
/// let styles = HeaderStyles::IETF | HeaderStyles::X_RATELIMIT;
/// assert!(styles.contains(HeaderStyles::IETF));
/// assert!(!styles.contains(HeaderStyles::DRAFT_03));
/// assert_eq!(HeaderStyles::default(), HeaderStyles::IETF);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct HeaderStyles(u8);

impl HeaderStyles {
    /// No rate-limit fields (the status, `Retry-After` and problem body only).
    pub const NONE: HeaderStyles = HeaderStyles(0);
    /// `RateLimit-Policy` and `RateLimit`, draft-ietf-httpapi-ratelimit-headers -10/-11.
    pub const IETF: HeaderStyles = HeaderStyles(1);
    /// `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset` (draft-03 and earlier).
    pub const DRAFT_03: HeaderStyles = HeaderStyles(2);
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset` (seconds from now).
    pub const X_RATELIMIT: HeaderStyles = HeaderStyles(4);
    /// `X-RateLimit-*` with the reset as a Unix time in seconds.
    pub const X_RATELIMIT_EPOCH: HeaderStyles = HeaderStyles(8);

    /// Whether every style of `other` is in `self`.
    pub const fn contains(self, other: HeaderStyles) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether no style is selected.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl Default for HeaderStyles {
    /// [`HeaderStyles::IETF`].
    fn default() -> HeaderStyles {
        HeaderStyles::IETF
    }
}

impl BitOr for HeaderStyles {
    type Output = HeaderStyles;

    fn bitor(self, rhs: HeaderStyles) -> HeaderStyles {
        HeaderStyles(self.0 | rhs.0)
    }
}

impl BitOrAssign for HeaderStyles {
    fn bitor_assign(&mut self, rhs: HeaderStyles) {
        self.0 |= rhs.0;
    }
}

impl fmt::Debug for HeaderStyles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (HeaderStyles::IETF, "IETF"),
            (HeaderStyles::DRAFT_03, "DRAFT_03"),
            (HeaderStyles::X_RATELIMIT, "X_RATELIMIT"),
            (HeaderStyles::X_RATELIMIT_EPOCH, "X_RATELIMIT_EPOCH"),
        ];
        let mut first = true;
        for (style, name) in names {
            if self.contains(style) {
                if !first {
                    f.write_str(" | ")?;
                }
                f.write_str(name)?;
                first = false;
            }
        }
        if first {
            f.write_str("NONE")?;
        }
        Ok(())
    }
}

pub(crate) use crate::decision::ceil_secs;

/// The `q` and `w` of a limit (see the table in the module docs of
/// [`http`](crate::http)): `q` is the capacity; `w` is the period of a window, and for a
/// token bucket the time to refill from empty to full, so that `q / w` is the sustained
/// rate (rounded so that it errs low). `w` is at least 1.
pub(crate) fn policy_params(limit: &Limit) -> (u64, u64) {
    let rate = limit.rate();
    let q = limit.capacity();
    let w_nanos = match limit {
        Limit::TokenBucket(quota) => {
            u128::from(quota.burst_size()) * u128::from(rate.period_nanos())
                / u128::from(rate.count())
        }
        _ => u128::from(rate.period_nanos()),
    };
    let w = w_nanos.div_ceil(1_000_000_000);
    (q, u64::try_from(w).unwrap_or(u64::MAX).max(1))
}

/// The `t` of a decision: time to full when admitted, time until the same request would
/// be admitted when rejected; whole seconds rounded up.
pub(crate) fn reset_secs(d: &Decision) -> u64 {
    ceil_secs(if d.allowed {
        d.reset_after
    } else {
        d.retry_after
    })
}

/// An sf-Integer, clamped to the largest one Structured Fields can carry.
fn integer(v: u64) -> Integer {
    Integer::try_from(v).unwrap_or(Integer::MAX)
}

/// A single-integer field value (`42`), written by the sf serializer.
fn integer_value(v: u64) -> HeaderValue {
    let text = ItemSerializer::new().bare_item(integer(v)).finish();
    HeaderValue::try_from(text).expect("an sf-Integer is a valid field value")
}

/// Whether `name` can be a policy name: a non-empty sf-String (printable ASCII).
pub(crate) fn valid_name(name: &str) -> bool {
    !name.is_empty() && StringRef::from_str(name).is_ok()
}

/// One policy as the fields show it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Member<'a> {
    /// The policy name (a valid sf-String, checked when the layer is built).
    pub(crate) name: &'a str,
    /// The quota (`q`).
    pub(crate) q: u64,
    /// The window (`w`), seconds.
    pub(crate) w: u64,
    /// Remaining (`r`).
    pub(crate) r: u64,
    /// Reset (`t`), seconds; `None` on the members of a 429 that did not block.
    pub(crate) t: Option<u64>,
}

/// `RateLimit-Policy`: `"name";q=..;w=..` per member; `None` for no members.
pub(crate) fn policy_field(members: &[Member<'_>]) -> Option<HeaderValue> {
    let mut ser = ListSerializer::new();
    for m in members {
        let Ok(name) = StringRef::from_str(m.name) else {
            continue;
        };
        let _ = ser
            .bare_item(name)
            .parameter(key_ref("q"), integer(m.q))
            .parameter(key_ref("w"), integer(m.w));
    }
    ser.finish()
        .map(|text| HeaderValue::try_from(text).expect("sf is visible ASCII"))
}

/// `RateLimit`: `"name";r=..;t=..` per member (`t` only where known); `None` for no
/// members.
pub(crate) fn ratelimit_field(members: &[Member<'_>]) -> Option<HeaderValue> {
    let mut ser = ListSerializer::new();
    for m in members {
        let Ok(name) = StringRef::from_str(m.name) else {
            continue;
        };
        let p = ser.bare_item(name).parameter(key_ref("r"), integer(m.r));
        if let Some(t) = m.t {
            let _ = p.parameter(key_ref("t"), integer(t));
        }
    }
    ser.finish()
        .map(|text| HeaderValue::try_from(text).expect("sf is visible ASCII"))
}

/// The header fields of one response, computed when the request was decided and written
/// onto the response (the inner service's or the layer's own).
#[derive(Debug, Default)]
pub(crate) struct Fields {
    policy: Option<HeaderValue>,
    ratelimit: Option<HeaderValue>,
    draft03: Option<[HeaderValue; 3]>,
    x: Option<[HeaderValue; 3]>,
}

impl Fields {
    /// The fields of `styles` for `members` (the policies applied to this request, in
    /// order). `all_policy` is the `RateLimit-Policy` value of all the layer's policies,
    /// serialized once, used when `members` are all of them.
    pub(crate) fn new(
        styles: HeaderStyles,
        members: &[Member<'_>],
        all_policy: Option<&HeaderValue>,
    ) -> Fields {
        let mut fields = Fields::default();
        if members.is_empty() {
            return fields;
        }
        if styles.contains(HeaderStyles::IETF) {
            fields.policy = match all_policy {
                Some(v) => Some(v.clone()),
                None => policy_field(members),
            };
            fields.ratelimit = ratelimit_field(members);
        }
        let single = styles.contains(HeaderStyles::DRAFT_03)
            || styles.contains(HeaderStyles::X_RATELIMIT)
            || styles.contains(HeaderStyles::X_RATELIMIT_EPOCH);
        if single {
            // The member with the lowest remaining (ties: the later reset), among those
            // that carry a reset (on a 429, the ones that blocked).
            let chosen = members
                .iter()
                .filter(|m| m.t.is_some())
                .min_by(|a, b| a.r.cmp(&b.r).then(b.t.cmp(&a.t)))
                .unwrap_or(&members[0]);
            let t = chosen.t.unwrap_or(0);
            let values = |reset: u64| {
                [
                    integer_value(chosen.q),
                    integer_value(chosen.r),
                    integer_value(reset),
                ]
            };
            if styles.contains(HeaderStyles::DRAFT_03) {
                fields.draft03 = Some(values(t));
            }
            if styles.contains(HeaderStyles::X_RATELIMIT) {
                fields.x = Some(values(t));
            } else if styles.contains(HeaderStyles::X_RATELIMIT_EPOCH) {
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_secs();
                fields.x = Some(values(now.saturating_add(t)));
            }
        }
        fields
    }

    /// Write the fields onto `headers`. The IETF list fields are appended (an inner layer's
    /// members stay: several field lines form one list); the single-integer styles replace.
    pub(crate) fn write(self, headers: &mut HeaderMap) {
        if let Some(v) = self.policy {
            headers.append(RATELIMIT_POLICY, v);
        }
        if let Some(v) = self.ratelimit {
            headers.append(RATELIMIT, v);
        }
        if let Some([l, r, t]) = self.draft03 {
            headers.insert(RATELIMIT_LIMIT, l);
            headers.insert(RATELIMIT_REMAINING, r);
            headers.insert(RATELIMIT_RESET, t);
        }
        if let Some([l, r, t]) = self.x {
            headers.insert(X_RATELIMIT_LIMIT, l);
            headers.insert(X_RATELIMIT_REMAINING, r);
            headers.insert(X_RATELIMIT_RESET, t);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{Quota, Rate};

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn q_and_w_per_algorithm() {
        // Token bucket: q = burst; w = time to refill from empty (burst × period / count).
        let tb = Limit::TokenBucket(Quota::per_second(10).unwrap().burst(100).unwrap());
        assert_eq!(policy_params(&tb), (100, 10));
        // Rounded up: 10 per 3 s, burst 5 → 1.5 s → 2; q/w errs low (2.5/s shown, 3.3/s real).
        let tb = Limit::TokenBucket(Quota::new(Rate::per(10, secs(3)).unwrap(), 5).unwrap());
        assert_eq!(policy_params(&tb), (5, 2));
        // A refill under a second still says w=1 (w > 0).
        let tb = Limit::TokenBucket(Quota::per_second(1000).unwrap());
        assert_eq!(policy_params(&tb), (1000, 1));
        for window in [
            Limit::FixedWindow(Rate::per(100, secs(60)).unwrap()),
            Limit::SlidingLog(Rate::per(100, secs(60)).unwrap()),
            Limit::SlidingWindow(Rate::per(100, secs(60)).unwrap()),
        ] {
            assert_eq!(policy_params(&window), (100, 60));
        }
        let fw = Limit::FixedWindow(Rate::per(5, Duration::from_millis(1500)).unwrap());
        assert_eq!(policy_params(&fw), (5, 2));
    }

    #[test]
    fn t_is_time_to_full_when_admitted_and_retry_after_when_rejected() {
        let ok = Decision::allow(10, 9, Duration::from_millis(100));
        assert_eq!(reset_secs(&ok), 1);
        let no = Decision::reject(10, 0, Duration::from_millis(2001), secs(30));
        assert_eq!(reset_secs(&no), 3);
    }

    #[test]
    fn lists_parse_back() {
        let members = [
            Member {
                name: "per-ip",
                q: 100,
                w: 60,
                r: 42,
                t: Some(17),
            },
            Member {
                name: "per \"user\"",
                q: 10,
                w: 1,
                r: 0,
                t: None,
            },
        ];
        let policy = policy_field(&members).unwrap();
        assert_eq!(
            policy.to_str().unwrap(),
            r#""per-ip";q=100;w=60, "per \"user\"";q=10;w=1"#
        );
        let rl = ratelimit_field(&members).unwrap();
        assert_eq!(
            rl.to_str().unwrap(),
            r#""per-ip";r=42;t=17, "per \"user\"";r=0"#
        );
        let list: sfv::List = sfv::Parser::new(rl.to_str().unwrap()).parse().unwrap();
        assert_eq!(list.len(), 2);
        assert!(policy_field(&[]).is_none());
    }

    #[test]
    fn huge_values_are_clamped_to_sf_integers() {
        assert_eq!(integer_value(u64::MAX).to_str().unwrap(), "999999999999999");
        assert_eq!(integer_value(7).to_str().unwrap(), "7");
    }

    #[test]
    fn single_styles_take_the_lowest_remaining() {
        let members = [
            Member {
                name: "a",
                q: 100,
                w: 60,
                r: 5,
                t: Some(3),
            },
            Member {
                name: "b",
                q: 10,
                w: 1,
                r: 2,
                t: Some(1),
            },
        ];
        let mut h = HeaderMap::new();
        Fields::new(
            HeaderStyles::DRAFT_03 | HeaderStyles::X_RATELIMIT,
            &members,
            None,
        )
        .write(&mut h);
        assert_eq!(h["ratelimit-limit"], "10");
        assert_eq!(h["ratelimit-remaining"], "2");
        assert_eq!(h["ratelimit-reset"], "1");
        assert_eq!(h["x-ratelimit-reset"], "1");
        assert!(h.get("ratelimit").is_none());
        assert_eq!(
            format!("{:?}", HeaderStyles::DRAFT_03 | HeaderStyles::IETF),
            "IETF | DRAFT_03"
        );
    }

    #[test]
    fn names_must_be_sf_strings() {
        assert!(valid_name("per-ip"));
        assert!(!valid_name(""));
        assert!(!valid_name("é"));
        assert!(!valid_name("tab\t"));
    }
}
