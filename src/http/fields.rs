//! The rate-limit header fields: IETF `RateLimit-Policy` / `RateLimit`
//! (draft-ietf-httpapi-ratelimit-headers, -10/-11 syntax), draft-03 `RateLimit-Limit` /
//! `-Remaining` / `-Reset` and legacy `X-RateLimit-*`, all written with the `sfv` Structured
//! Fields serializers.

use std::cell::RefCell;
use std::collections::HashSet;
use std::convert::Infallible;
use std::fmt;
use std::ops::{BitOr, BitOrAssign};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::BytesMut;
use http::{HeaderMap, HeaderName, HeaderValue};
use sfv::visitor::{
    EntryVisitor, Ignored, InnerListVisitor, ItemVisitor, ListVisitor, ParameterVisitor,
};
use sfv::{
    BareItemFromInput, Integer, ItemSerializer, KeyRef, ListSerializer, ParameterSerializer,
    Parser, StringRef, key_ref,
};

use crate::decision::{Decision, SF_INTEGER_MAX};
use crate::gate::Limit;
use crate::sync::with_reused;

/// `RateLimit-Policy` (IETF).
pub(crate) const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (IETF).
pub(crate) const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
/// The draft-03 and legacy single-integer fields.
pub(crate) const RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("ratelimit-limit");
pub(crate) const RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("ratelimit-remaining");
pub(crate) const RATELIMIT_RESET: HeaderName = HeaderName::from_static("ratelimit-reset");
pub(crate) const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
pub(crate) const X_RATELIMIT_REMAINING: HeaderName =
    HeaderName::from_static("x-ratelimit-remaining");
pub(crate) const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// Which rate-limit header fields a [`RateLimitLayer`](crate::http::RateLimitLayer)
/// writes; combine styles with `|`.
///
/// | style | fields | values |
/// |---|---|---|
/// | [`IETF`](HeaderStyles::IETF) (default) | `RateLimit-Policy`, `RateLimit` | one list member per policy: `"per-ip";q=100;w=60`, `"per-ip";r=42;t=17` |
/// | [`DRAFT_03`](HeaderStyles::DRAFT_03) | `RateLimit-Limit`, `-Remaining`, `-Reset` | integers of one policy (the lowest remaining; on a 429, of the policies that blocked, the one that resets last, never before `Retry-After`); reset in seconds from now |
/// | [`X_RATELIMIT`](HeaderStyles::X_RATELIMIT) | `X-RateLimit-Limit`, `-Remaining`, `-Reset` | the same integers |
/// | [`X_RATELIMIT_EPOCH`](HeaderStyles::X_RATELIMIT_EPOCH) | `X-RateLimit-Limit`, `-Remaining`, `-Reset` | the same, reset as a Unix time in seconds (GitHub's form), the current second rounded up: never before the reset in seconds from now |
///
/// `X_RATELIMIT` and `X_RATELIMIT_EPOCH` exclude each other (one `X-RateLimit-Reset`).
///
/// Layers stacked (a site-wide layer around a route's) add their IETF members to the one
/// list (an outer layer's without `t` on an inner refusal, as a layer lists its own
/// policies that did not block); of the single integers, an outer layer writes none on an
/// inner refusal (the inner layer's stay), and keeps those an inner one wrote with a
/// lower remaining (ties: the later reset), as one layer chooses among its policies. An
/// inner refusal is a `429`, or a `503` with `Retry-After` (a
/// [`ShedLayer`](crate::http::ShedLayer)'s, an inner layer's gate error): the outer
/// layer's fields never contradict its `Retry-After`.
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
/// [`http`](crate::http)): for a window, `q` is the capacity and `w` the period; for a
/// token bucket `w` is the time to refill from empty to full, rounded up to a whole
/// second, and `q` what the bucket admits in `w` from full (its rate over `w`, rounded
/// down: the burst, or more when the refill takes less than `w`), so that `q / w` is the
/// sustained rate, erring low by less than one unit per `w`. (The burst over a refill
/// rounded up erred by up to the whole rate: 10/s with a burst of 1 showed `q=1;w=1`.)
/// `w` is at least 1.
pub(crate) fn policy_params(limit: &Limit) -> (u64, u64) {
    let rate = limit.rate();
    let w_nanos = match limit {
        Limit::TokenBucket(quota) => {
            // Rounded up here too: cut to whole nanoseconds first, a refill just over a
            // whole second was that second, and `q / w` above the rate.
            let units = u128::from(quota.burst_size()) * u128::from(rate.period_nanos());
            units.div_ceil(u128::from(rate.count()))
        }
        _ => u128::from(rate.period_nanos()),
    };
    let w = w_nanos.div_ceil(1_000_000_000).max(1);
    let q = match limit {
        // What refills in `w`, rounded down: at least the burst, which refills within it.
        Limit::TokenBucket(_) => {
            let refilled =
                w * 1_000_000_000 * u128::from(rate.count()) / u128::from(rate.period_nanos());
            u64::try_from(refilled)
                .unwrap_or(u64::MAX)
                .max(limit.capacity())
        }
        _ => limit.capacity(),
    };
    (q, u64::try_from(w).unwrap_or(u64::MAX))
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

/// The Unix time, in whole seconds, of a reset `t` seconds after `now` (the time since the
/// Unix epoch): the current second rounded up, then `t`, so that it is never before
/// `now + t`, the moment the relative fields and `Retry-After` name (rounded down, it
/// was up to a second before it, and a client that waited until then met another `429`).
fn epoch_reset(now: Duration, t: u64) -> u64 {
    ceil_secs(now).saturating_add(t)
}

/// An sf-Integer, clamped to the largest one Structured Fields can carry.
fn integer(v: u64) -> Integer {
    Integer::try_from(v).unwrap_or(Integer::MAX)
}

/// Below this, an integer field value is a slice of [`SMALL_DIGITS`]: every `Retry-After`
/// up to 2 h 46 min.
const SMALL: u64 = 10_000;

/// The length of [`SMALL_DIGITS`]: 10 numbers of one digit, 90 of two, 900 of three, 9 000
/// of four.
const SMALL_DIGITS_LEN: usize = 10 + 90 * 2 + 900 * 3 + 9_000 * 4;

/// The decimal digits of 0 to 9 999, back to back (38 890 bytes).
static SMALL_DIGITS: &str = match std::str::from_utf8(&small_digits()) {
    Ok(digits) => digits,
    Err(_) => panic!("decimal digits are ASCII"),
};

const fn small_digits() -> [u8; SMALL_DIGITS_LEN] {
    let mut out = [0u8; SMALL_DIGITS_LEN];
    let mut n = 0;
    while n < SMALL as usize {
        let at = small_start(n);
        let mut rest = n;
        let mut i = small_len(n);
        while i > 0 {
            i -= 1;
            out[at + i] = b'0' + (rest % 10) as u8;
            rest /= 10;
        }
        n += 1;
    }
    out
}

/// Where `n` (below 10 000) starts in [`SMALL_DIGITS`]: after every shorter number, then
/// after the numbers of its own length below it.
const fn small_start(n: usize) -> usize {
    match small_len(n) {
        1 => n,
        2 => 10 + (n - 10) * 2,
        3 => 190 + (n - 100) * 3,
        _ => 2_890 + (n - 1_000) * 4,
    }
}

/// How many digits `n` (below 10 000) has.
const fn small_len(n: usize) -> usize {
    if n < 10 {
        1
    } else if n < 100 {
        2
    } else if n < 1000 {
        3
    } else {
        4
    }
}

/// A single-integer field value (`42`), clamped to the largest sf-Integer. Below 10 000 it
/// is a slice of [`SMALL_DIGITS`]: no allocation, and a clone copies no reference count.
/// Above, `HeaderValue`'s `From<u64>`, which allocates each value twice (~350 instructions
/// of a 429 under callgrind).
pub(crate) fn integer_value(v: u64) -> HeaderValue {
    if v >= SMALL {
        return HeaderValue::from(v.min(SF_INTEGER_MAX));
    }
    let n = v as usize;
    let start = small_start(n);
    HeaderValue::from_static(&SMALL_DIGITS[start..start + small_len(n)])
}

/// `v` as an sf-Integer (decimal digits, clamped to the largest one): what sfv writes
/// for it.
fn sf_digits(buf: &mut itoa::Buffer, v: u64) -> &str {
    buf.format(v.min(SF_INTEGER_MAX))
}

/// Whether `name` can be a policy name: a non-empty sf-String (printable ASCII).
pub(crate) fn valid_name(name: &str) -> bool {
    !name.is_empty() && StringRef::from_str(name).is_ok()
}

/// What the fields show of one policy that does not change from a request to the next,
/// serialized once (by sfv) when the layer is built.
#[derive(Debug, Clone)]
pub(crate) struct PolicyParts {
    /// The name as an sf-String: `"per-ip"` (quotes, `"` and `\` escaped).
    name: Box<[u8]>,
    /// Its member of `RateLimit-Policy`: `"per-ip";q=100;w=60`.
    policy: Box<[u8]>,
    /// The quota (`q`).
    q: u64,
}

impl PolicyParts {
    /// The parts of the policy `name` with quota `q` and window `w` (seconds); `None` when
    /// `name` is not an sf-String (see [`valid_name`]).
    pub(crate) fn new(name: &str, q: u64, w: u64) -> Option<PolicyParts> {
        let name = StringRef::from_str(name).ok()?;
        let item = ItemSerializer::new().bare_item(name).finish();
        let mut policy = ListSerializer::new();
        let _ = policy
            .bare_item(name)
            .parameter(key_ref("q"), integer(q))
            .parameter(key_ref("w"), integer(w));
        Some(PolicyParts {
            name: item.into_bytes().into_boxed_slice(),
            policy: policy.finish()?.into_bytes().into_boxed_slice(),
            q,
        })
    }
}

/// One policy as the fields show it for one request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Member<'a> {
    /// The policy's name, quota and window, serialized.
    pub(crate) parts: &'a PolicyParts,
    /// Remaining (`r`).
    pub(crate) r: u64,
    /// Reset (`t`), seconds; `None` on the members of a 429 that did not block.
    pub(crate) t: Option<u64>,
}

/// The size of the chunks field values are written into (see [`ValueBuf`]).
const VALUE_CHUNK: usize = 1024;

thread_local! {
    /// The thread's chunk of field values: each value is split off it, so a value costs a
    /// reference count on its chunk instead of an allocation of its own (a chunk serves
    /// about thirty values; a new one is allocated when less than an eighth is left; a
    /// value longer than the rest grows it as `BytesMut` grows, so the chunk a thread keeps
    /// is at most about twice its longest value, which the layer's policy names bound).
    /// A chunk is freed when the last value in it is dropped: a value kept past its
    /// response (a cache of header values) keeps its whole chunk.
    static VALUES: RefCell<BytesMut> = RefCell::new(BytesMut::new());
}

/// A field value being written into the thread's chunk.
struct ValueBuf<'a>(&'a mut BytesMut);

impl ValueBuf<'_> {
    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }
}

/// A list field value written by `write`; `None` when `write` writes nothing (no members).
fn list_value(write: impl FnOnce(&mut ValueBuf<'_>)) -> Option<HeaderValue> {
    let value = |chunk: &mut BytesMut| {
        // Empty after every split; cleared so a value cut short (a panic) cannot lead the next.
        chunk.clear();
        if chunk.capacity() < VALUE_CHUNK / 8 {
            chunk.reserve(VALUE_CHUNK);
        }
        write(&mut ValueBuf(chunk));
        let bytes = chunk.split().freeze();
        // Valid by construction (sfv's serializations joined by `, `, `;r=` and digits);
        // `from_maybe_shared` checks it again (a scan of a few dozen bytes).
        (!bytes.is_empty())
            .then(|| HeaderValue::from_maybe_shared(bytes).expect("sf is visible ASCII"))
    };
    // Nothing re-enters while a value is written, so the thread's chunk is always free.
    with_reused(&VALUES, value)
}

/// The most distinct `RateLimit-Policy` values kept for the life of the process (see
/// [`static_value`]).
const MAX_STATIC_VALUES: usize = 1024;

/// The interned `RateLimit-Policy` values (see [`static_value`]).
static STATIC_VALUES: OnceLock<Mutex<HashSet<&'static str>>> = OnceLock::new();

/// `value` as a `HeaderValue` over a `&'static str`, so that the layer's clone of it on
/// every response is a copy, not a reference count (an atomic increment, and a decrement
/// when the response is sent). Values are interned: building a layer again with the same
/// policies adds nothing; past [`MAX_STATIC_VALUES`] distinct values (layers built from
/// ever new policy names), a shared value, as before, so the memory kept is bounded.
pub(crate) fn static_value(value: &HeaderValue) -> HeaderValue {
    let Ok(text) = value.to_str() else {
        return value.clone();
    };
    let mut values = STATIC_VALUES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let kept = match values.get(text) {
        Some(&kept) => kept,
        None if values.len() < MAX_STATIC_VALUES => {
            let kept: &'static str = Box::leak(text.to_owned().into_boxed_str());
            values.insert(kept);
            kept
        }
        // Past the bound: a copy of its exact length (not a slice that would keep the
        // chunk it was written in for the layer's life).
        None => return HeaderValue::from_bytes(value.as_bytes()).unwrap_or_else(|_| value.clone()),
    };
    HeaderValue::from_static(kept)
}

/// `RateLimit-Policy`: `"name";q=..;w=..` per member (sfv's serialization of each, made
/// once, joined as an sf-List); `None` for no members. The layer keeps the value of all its
/// policies as a [`static_value`].
pub(crate) fn policy_field<'a>(members: impl Iterator<Item = Member<'a>>) -> Option<HeaderValue> {
    list_value(|w| {
        for (i, m) in members.enumerate() {
            if i > 0 {
                w.put(b", ");
            }
            w.put(&m.parts.policy);
        }
    })
}

/// `RateLimit`: `"name";r=..;t=..` per member (`t` only where known); `None` for no
/// members. The name as sfv serialized it, then the parameters: the same bytes as sfv's
/// `ListSerializer` (a unit test compares them).
pub(crate) fn ratelimit_field<'a>(
    members: impl Iterator<Item = Member<'a>>,
) -> Option<HeaderValue> {
    list_value(|w| {
        let mut digits = itoa::Buffer::new();
        for (i, m) in members.enumerate() {
            if i > 0 {
                w.put(b", ");
            }
            w.put(&m.parts.name);
            w.put(b";r=");
            w.put(sf_digits(&mut digits, m.r).as_bytes());
            if let Some(t) = m.t {
                w.put(b";t=");
                w.put(sf_digits(&mut digits, t).as_bytes());
            }
        }
    })
}

/// `value`, a [`ratelimit_field`], without its members' `t` (parsed and written again with
/// sfv): what a layer that passed a request adds to an inner refusal (`429`, `503`), whose
/// `Retry-After` the time to full of a policy that did not block can be later than. `None`
/// if it does not parse (it always does: this module wrote it).
fn without_resets(value: &HeaderValue) -> Option<HeaderValue> {
    /// The list being written again.
    struct Members<'s>(&'s mut ListSerializer<String>);
    /// One member's parameters, `t` left out.
    struct Params<'s>(Option<ParameterSerializer<&'s mut String>>);

    impl<'de> ListVisitor<'de> for Members<'_> {
        type Out = ();
        type Error = Infallible;

        fn entry(&mut self) -> Result<impl EntryVisitor<'de>, Infallible> {
            Ok(Members(&mut *self.0))
        }

        fn finish(self) -> Result<(), Infallible> {
            Ok(())
        }
    }

    impl<'de> EntryVisitor<'de> for Members<'_> {
        type Error = Infallible;

        fn item(self) -> Result<impl ItemVisitor<'de>, Infallible> {
            Ok(self)
        }

        fn inner_list(self) -> Result<impl InnerListVisitor<'de>, Infallible> {
            Ok(Ignored)
        }
    }

    impl<'de> ItemVisitor<'de> for Members<'_> {
        type Out = ();
        type Error = Infallible;

        fn bare_item(
            self,
            value: BareItemFromInput<'de>,
        ) -> Result<impl ParameterVisitor<'de, Out = ()>, Infallible> {
            Ok(Params(Some(self.0.bare_item(&value))))
        }
    }

    impl<'de> ParameterVisitor<'de> for Params<'_> {
        type Out = ();
        type Error = Infallible;

        fn parameter(
            &mut self,
            key: &'de KeyRef,
            value: BareItemFromInput<'de>,
        ) -> Result<(), Infallible> {
            if key.as_str() != "t" {
                self.0 = self.0.take().map(|p| p.parameter(key, &value));
            }
            Ok(())
        }

        fn finish(self) -> Result<(), Infallible> {
            Ok(())
        }
    }

    let mut list = ListSerializer::new();
    Parser::new(value.as_bytes())
        .parse_list_with_visitor(Members(&mut list))
        .ok()?;
    HeaderValue::from_str(&list.finish()?).ok()
}

/// The header fields of one response, computed when the request was decided and written
/// onto the response (the inner service's or the layer's own).
#[derive(Debug, Default)]
pub(crate) struct Fields {
    policy: Option<HeaderValue>,
    ratelimit: Option<HeaderValue>,
    /// The single-integer styles, boxed: rarely used, and `Fields` is moved with every
    /// response future.
    single: Option<Box<Single>>,
}

/// The values of the single-integer styles.
#[derive(Debug, Default)]
struct Single {
    /// Limit, remaining, reset of `RateLimit-Limit` / `-Remaining` / `-Reset`.
    draft03: Option<[u64; 3]>,
    /// The same of `X-RateLimit-*`.
    x: Option<[u64; 3]>,
}

impl Fields {
    /// The fields of `styles` for `members` (the policies applied to this request, in
    /// order); `None` when there is nothing to write (no style, or no member), so that a
    /// response future carries nothing for it. `all_policy` is the `RateLimit-Policy` value
    /// of all the layer's policies, serialized once, used when `members` are all of them.
    /// `rejected`: the request is refused (or would be, in shadow mode), and the members
    /// that carry a reset are the policies that blocked it.
    pub(crate) fn new<'a, I>(
        styles: HeaderStyles,
        members: I,
        all_policy: Option<&HeaderValue>,
        rejected: bool,
    ) -> Option<Fields>
    where
        I: Iterator<Item = Member<'a>> + Clone,
    {
        if styles.is_empty() {
            // Nothing to write: not even the members are worked out.
            return None;
        }
        let first = members.clone().next()?;
        let mut fields = Fields::default();
        if styles.contains(HeaderStyles::IETF) {
            fields.policy = match all_policy {
                Some(v) => Some(v.clone()),
                None => policy_field(members.clone()),
            };
            fields.ratelimit = ratelimit_field(members.clone());
        }
        let single = styles.contains(HeaderStyles::DRAFT_03)
            || styles.contains(HeaderStyles::X_RATELIMIT)
            || styles.contains(HeaderStyles::X_RATELIMIT_EPOCH);
        if single {
            // Among the members that carry a reset: the one with the lowest remaining (ties:
            // the later reset); on a rejection, of the policies that blocked, the one that
            // resets last (ties: the lowest remaining). A blocked member's reset is its
            // `retry_after` (see `reset_secs`), so that one's is `Retry-After`; the lowest
            // remaining's can be far earlier.
            let with_t = members.filter(|m| m.t.is_some());
            let chosen = if rejected {
                with_t.max_by(|a, b| a.t.cmp(&b.t).then(b.r.cmp(&a.r)))
            } else {
                with_t.min_by(|a, b| a.r.cmp(&b.r).then(b.t.cmp(&a.t)))
            }
            .unwrap_or(first);
            let t = chosen.t.unwrap_or(0);
            let values = |reset: u64| [chosen.parts.q, chosen.r, reset];
            let mut single = Single::default();
            if styles.contains(HeaderStyles::DRAFT_03) {
                single.draft03 = Some(values(t));
            }
            if styles.contains(HeaderStyles::X_RATELIMIT) {
                single.x = Some(values(t));
            } else if styles.contains(HeaderStyles::X_RATELIMIT_EPOCH) {
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default();
                single.x = Some(values(epoch_reset(now, t)));
            }
            fields.single = Some(Box::new(single));
        }
        Some(fields)
    }

    /// Write the fields onto `headers`. The IETF list fields are appended (an inner layer's
    /// members stay: several field lines form one list); on an inner refusal (a `429`, or a
    /// `503` with `Retry-After`: `inner_rejected`) these members carry no `t`, as a layer's
    /// own `429` lists its policies that did not block. The single-integer styles carry one
    /// policy: on an inner refusal none of this layer's are written (those of the policy
    /// that blocked it stay, if its layer wrote them: a passing policy's reset can be
    /// before `Retry-After`); else, where an inner layer (or the service) wrote them
    /// already, its integers stay if their remaining is lower (ties: the later reset), the
    /// rule among one layer's policies, and these replace them if not.
    pub(crate) fn write(self, headers: &mut HeaderMap, inner_rejected: bool) {
        if let Some(v) = self.policy {
            headers.append(RATELIMIT_POLICY, v);
        }
        if let Some(v) = self.ratelimit {
            // On an inner refusal this layer's policies did not block it: no `t`, as on its own.
            let v = match inner_rejected {
                true => without_resets(&v).unwrap_or(v),
                false => v,
            };
            headers.append(RATELIMIT, v);
        }
        let Some(single) = self.single else {
            return;
        };
        if let Some(values) = single.draft03 {
            let names = [RATELIMIT_LIMIT, RATELIMIT_REMAINING, RATELIMIT_RESET];
            put_single(headers, names, values, inner_rejected);
        }
        if let Some(values) = single.x {
            let names = [X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING, X_RATELIMIT_RESET];
            put_single(headers, names, values, inner_rejected);
        }
    }
}

/// One policy's limit, remaining and reset as the single-integer fields `names`, unless
/// `headers` hold integers of their own there that win, or are of an inner refusal (see
/// [`Fields::write`]).
fn put_single(
    headers: &mut HeaderMap,
    [limit, remaining, reset]: [HeaderName; 3],
    [l, r, t]: [u64; 3],
    inner_rejected: bool,
) {
    if inner_rejected {
        // Not this policy's refusal: its reset (a time to full) can be before Retry-After.
        return;
    }
    let int = |name: &HeaderName| headers.get(name)?.to_str().ok()?.parse::<u64>().ok();
    if let Some(inner_r) = int(&remaining) {
        let inner_t = int(&reset).unwrap_or(0);
        if inner_r < r || (inner_r == r && inner_t >= t) {
            return;
        }
    }
    headers.insert(limit, integer_value(l));
    headers.insert(remaining, integer_value(r));
    headers.insert(reset, integer_value(t));
}

#[cfg(test)]
mod tests;
