//! `ServerHint::from_headers`: the IETF draft's own examples with exact values, every style
//! of field, several policies, HTTP-dates in the past and the future, malformed fields
//! ignored, no panic on any bytes, and a round trip against flowgate's own server layer.

use std::convert::Infallible;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use flowgate::gate::{Limit, MemoryGate};
use flowgate::http::{HeaderStyles, Policy, RateLimitLayer, RequestInfo};
use flowgate::retry::{PolicyHint, ServerHint};
use flowgate::{Quota, Rate};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::Empty;
use proptest::prelude::*;
use tower::{Layer, ServiceExt};

const S: Duration = Duration::from_secs(1);

/// The time of the draft's throttled-response example: Mon, 05 Aug 2019 09:27:00 GMT.
fn draft_now() -> SystemTime {
    httpdate::parse_http_date("Mon, 05 Aug 2019 09:27:00 GMT").unwrap()
}

/// Headers from `(name, value)` pairs, appended in order (a name may repeat).
fn headers(fields: &[(&str, &str)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for &(name, value) in fields {
        map.append(
            HeaderName::from_bytes(name.as_bytes()).unwrap(),
            HeaderValue::from_str(value).unwrap(),
        );
    }
    map
}

fn parse(fields: &[(&str, &str)]) -> ServerHint {
    ServerHint::from_headers(&headers(fields), draft_now())
}

fn policy(
    name: Option<&str>,
    quota: Option<u64>,
    window: Option<u64>,
    remaining: Option<u64>,
    reset: Option<u64>,
) -> PolicyHint {
    let mut p = PolicyHint::default();
    p.name = name.map(str::to_owned);
    p.quota = quota;
    p.window = window.map(Duration::from_secs);
    p.remaining = remaining;
    p.reset = reset.map(Duration::from_secs);
    p
}

#[test]
fn the_drafts_policy_examples() {
    let h = parse(&[(
        "ratelimit-policy",
        r#""burst";q=100;w=60,"daily";q=1000;w=86400"#,
    )]);
    assert_eq!(
        h.policies,
        [
            policy(Some("burst"), Some(100), Some(60), None, None),
            policy(Some("daily"), Some(1000), Some(86400), None, None),
        ]
    );
    assert_eq!(h.retry_after, None);
    // No remaining anywhere: the most restrictive is the slowest, 1000 per day.
    assert_eq!(h.quota(), Some(1000));
    assert_eq!(h.sustained_rate(), Some((1000, 86400 * S)));
    assert_eq!(h.allowance(), None);

    let h = parse(&[("ratelimit-policy", r#""default";q=100;w=10"#)]);
    assert_eq!(
        h.policies,
        [policy(Some("default"), Some(100), Some(10), None, None)]
    );

    let h = parse(&[(
        "ratelimit-policy",
        r#""permin";q=50;w=60,"perhr";q=1000;w=3600"#,
    )]);
    assert_eq!(h.policy_names().collect::<Vec<_>>(), ["permin", "perhr"]);
    assert_eq!(h.sustained_rate(), Some((1000, 3600 * S)));

    // Partition keys and quota units are read past.
    let h = parse(&[(
        "ratelimit-policy",
        r#""peruser";q=100;w=60;pk=:cHsdsRa894==:"#,
    )]);
    assert_eq!(
        h.policies,
        [policy(Some("peruser"), Some(100), Some(60), None, None)]
    );
    let h = parse(&[(
        "ratelimit-policy",
        r#""peruser";q=65535;qu="content-bytes";w=10;pk=:sdfjLJUOUH==:"#,
    )]);
    assert_eq!(
        h.policies,
        [policy(Some("peruser"), Some(65535), Some(10), None, None)]
    );
}

#[test]
fn the_drafts_ratelimit_examples() {
    let h = parse(&[("ratelimit", r#""default";r=50;t=30"#)]);
    assert_eq!(
        h.policies,
        [policy(Some("default"), None, None, Some(50), Some(30))]
    );
    assert_eq!(h.allowance(), Some((50, 30 * S)));
    assert_eq!((h.remaining(), h.reset()), (Some(50), Some(30 * S)));

    let h = parse(&[("ratelimit", r#""default";r=999;pk=:dHJpYWwxMjEzMjM=:"#)]);
    assert_eq!(
        h.policies,
        [policy(Some("default"), None, None, Some(999), None)]
    );
    assert_eq!(h.allowance(), None, "no reset: no allowance");

    let h = parse(&[(
        "ratelimit",
        r#""default";r=300000000;t=60;pk=:QXBwLTk5OQ==:"#,
    )]);
    assert_eq!(h.allowance(), Some((300_000_000, 60 * S)));

    // B.1.1: nothing left for 50 s.
    let h = parse(&[("ratelimit", r#""default";r=0;t=50"#)]);
    assert_eq!(h.retry_delay(), Some(50 * S));
    // B.1.2
    let h = parse(&[("ratelimit", r#""dayLimit";r=100;t=36000"#)]);
    assert_eq!(h.allowance(), Some((100, 36000 * S)));
}

#[test]
fn the_drafts_throttled_response_with_an_http_date() {
    // B.1.4: Retry-After and RateLimit reference the same moment.
    let h = parse(&[
        ("date", "Mon, 05 Aug 2019 09:27:00 GMT"),
        ("retry-after", "Mon, 05 Aug 2019 09:27:05 GMT"),
        ("ratelimit", r#""default";r=0;t=5"#),
    ]);
    assert_eq!(h.retry_after, Some(5 * S));
    assert_eq!(h.allowance(), Some((0, 5 * S)));
    assert_eq!(h.retry_delay(), Some(5 * S));
}

/// A client clock skewed from the server's moves no hint: an HTTP-date `Retry-After` and a
/// Unix-time `X-RateLimit-Reset` are measured from the response's `Date`. Before, they were
/// measured from the client's `now`: two minutes behind, `Retry-After` five seconds ahead
/// read as 125 s (past the retry layer's `max_retry_after`: the request stopped at once);
/// two minutes ahead, as 0 (a retry at once, into the same refusal).
#[test]
fn a_skewed_client_clock_reads_dated_hints_from_the_responses_date() {
    let fields = [
        ("date", "Mon, 05 Aug 2019 09:27:00 GMT"),
        ("retry-after", "Mon, 05 Aug 2019 09:27:05 GMT"),
        ("x-ratelimit-limit", "10"),
        ("x-ratelimit-reset", "1564997240"), // 09:27:20
    ];
    let skew = 120 * S;
    for now in [draft_now() - skew, draft_now(), draft_now() + skew] {
        let h = ServerHint::from_headers(&headers(&fields), now);
        assert_eq!(h.retry_after, Some(5 * S), "{now:?}");
        assert_eq!(h.reset(), Some(20 * S), "{now:?}");
    }
    // Without a valid `Date`, the caller's `now` it is.
    let undated = [("date", "yesterday"), fields[1]];
    let h = ServerHint::from_headers(&headers(&undated), draft_now() - skew);
    assert_eq!(h.retry_after, Some(125 * S));
}

#[test]
fn the_drafts_policies_with_limits() {
    // B.2.1
    let h = parse(&[
        ("ratelimit", r#""fixedwindow";r=99;t=50"#),
        ("ratelimit-policy", r#""fixedwindow";q=100;w=60"#),
    ]);
    assert_eq!(
        h.policies,
        [policy(
            Some("fixedwindow"),
            Some(100),
            Some(60),
            Some(99),
            Some(50)
        )]
    );
    assert_eq!(
        (h.quota(), h.window(), h.remaining(), h.reset()),
        (Some(100), Some(60 * S), Some(99), Some(50 * S))
    );
    // B.2.3: pushed back without Retry-After.
    let h = parse(&[
        ("ratelimit-policy", r#""dynamic";q=15;w=20"#),
        ("ratelimit", r#""dynamic";r=0;t=20"#),
    ]);
    assert_eq!(h.retry_after, None);
    assert_eq!(h.retry_delay(), Some(20 * S));
    // B.3: Retry-After takes precedence over the reset.
    let h = parse(&[
        ("retry-after", "20"),
        ("ratelimit-policy", r#""dynamic";q=100;w=60"#),
        ("ratelimit", r#""dynamic";r=15;t=40"#),
    ]);
    assert_eq!(h.retry_after, Some(20 * S));
    assert_eq!(h.retry_delay(), Some(20 * S));
    assert_eq!(h.allowance(), Some((15, 40 * S)));
    // B.3.1: token names, no remaining.
    let h = parse(&[
        ("ratelimit-policy", "quota;q=100;w=1"),
        ("ratelimit", "quota;t=1"),
    ]);
    assert_eq!(
        h.policies,
        [policy(Some("quota"), Some(100), Some(1), None, Some(1))]
    );
    // B.3.2: the closest limit is the daily one.
    let h = parse(&[
        (
            "ratelimit-policy",
            r#""hour";q=1000;w=3600, "day";q=5000;w=86400"#,
        ),
        ("ratelimit", r#""day";r=100;t=36000"#),
    ]);
    assert_eq!(
        h.most_restrictive(),
        Some(&policy(
            Some("day"),
            Some(5000),
            Some(86400),
            Some(100),
            Some(36000)
        ))
    );
    assert_eq!(h.quota(), Some(5000));
    assert_eq!(h.policies.len(), 2);
    // 8.5: a remaining / reset ratio far above the policy: both are there to see.
    let h = parse(&[
        ("ratelimit-policy", r#""somepolicy";q=10000;w=1000"#),
        ("ratelimit", r#""somepolicy";r=10000;t=10"#),
    ]);
    assert_eq!(h.allowance(), Some((10000, 10 * S)));
    assert_eq!(h.sustained_rate(), Some((10000, 1000 * S)));
}

#[test]
fn lists_split_over_several_lines_are_one_list() {
    // The draft's FAQ: two RateLimit-Policy lines.
    let h = parse(&[
        ("ratelimit-policy", r#""sliding";q=100;w=60;burst=1000"#),
        ("ratelimit-policy", r#""fixed";q=5000;w=3600;burst=0"#),
        ("ratelimit", r#""sliding";r=50;t=44"#),
    ]);
    assert_eq!(
        h.policies,
        [
            policy(Some("sliding"), Some(100), Some(60), Some(50), Some(44)),
            policy(Some("fixed"), Some(5000), Some(3600), None, None),
        ]
    );
    // A malformed line makes the whole field malformed.
    let h = parse(&[("ratelimit", r#""a";r=1"#), ("ratelimit", r#""b";r=2,"#)]);
    assert!(h.is_empty(), "{h:?}");
}

#[test]
fn several_policies_pick_the_most_restrictive() {
    let h = parse(&[
        (
            "ratelimit-policy",
            r#""a";q=10;w=1, "b";q=100;w=60, "c";q=1000;w=3600"#,
        ),
        ("ratelimit", r#""a";r=3;t=1, "b";r=3;t=40, "c";r=900;t=100"#),
    ]);
    // Lowest remaining (3), tie broken by the longest reset: "b".
    assert_eq!(h.most_restrictive().unwrap().name.as_deref(), Some("b"));
    assert_eq!(h.allowance(), Some((3, 40 * S)));
    assert_eq!((h.quota(), h.window()), (Some(100), Some(60 * S)));
    // The lowest sustained rate: 1000 per hour (0.28/s) < 100 per minute < 10 per second.
    assert_eq!(h.sustained_rate(), Some((1000, 3600 * S)));
    // A RateLimit member without a policy is a policy of its own.
    let h = parse(&[
        ("ratelimit-policy", r#""a";q=10;w=1"#),
        ("ratelimit", r#""z";r=0;t=9, "a";r=5;t=1"#),
    ]);
    assert_eq!(
        h.policies,
        [
            policy(Some("a"), Some(10), Some(1), Some(5), Some(1)),
            policy(Some("z"), None, None, Some(0), Some(9)),
        ]
    );
    assert_eq!(h.retry_delay(), Some(9 * S));
    // Repeated names: the first member counts.
    let h = parse(&[
        ("ratelimit-policy", r#""a";q=10;w=1, "a";q=99;w=99"#),
        ("ratelimit", r#""a";r=5;t=1, "a";r=0;t=99"#),
    ]);
    assert_eq!(
        h.policies,
        [policy(Some("a"), Some(10), Some(1), Some(5), Some(1))]
    );
}

#[test]
fn at_most_16_policies_are_kept_those_with_a_remaining_first() {
    let names: Vec<String> = (0..30).map(|i| format!("\"p{i}\";q=10;w=1")).collect();
    let current = r#""p29";r=0;t=5"#;
    let h = parse(&[
        ("ratelimit-policy", &names.join(", ")),
        ("ratelimit", current),
    ]);
    assert_eq!(h.policies.len(), ServerHint::MAX_POLICIES);
    // Only the first 16 policy members are read; p29's RateLimit member is kept as a
    // policy of its own, and kept in preference to policy-only ones.
    assert_eq!(h.allowance(), Some((0, 5 * S)));
    assert_eq!(h.policies.last().unwrap().name.as_deref(), Some("p29"));
    assert_eq!(h.policies[0].name.as_deref(), Some("p0"));
}

#[test]
fn members_that_are_not_policies_do_not_use_up_the_16() {
    // Sixteen members that are no policy (not a name, an inner list, a repeated name)
    // before a real one: the real one is still read.
    let p = r#""p";r=0;t=60"#;
    for junk in ["1", r#"("x" "y")"#, "?1", r#""a";r=5;t=1"#] {
        let field = format!("{}, {p}", vec![junk; 16].join(", "));
        let h = parse(&[("ratelimit", &field)]);
        assert_eq!(
            h.policies.last(),
            Some(&policy(Some("p"), None, None, Some(0), Some(60))),
            "{junk}"
        );
        assert_eq!(h.retry_delay(), Some(60 * S), "{junk}");
    }
    // The same in RateLimit-Policy: the policy after the junk keeps its quota.
    let field = format!("{}, \"p\";q=10;w=60", vec!["42;q=1"; 16].join(", "));
    let h = parse(&[("ratelimit-policy", &field), ("ratelimit", p)]);
    assert_eq!(
        h.policies,
        [policy(Some("p"), Some(10), Some(60), Some(0), Some(60))]
    );
    // Ten thousand repeats of one name over several lines: one policy, the first.
    let lines = vec![("ratelimit", r#""a";r=5;t=1, "a";r=0;t=9"#); 5_000];
    let h = parse(&lines);
    assert_eq!(
        h.policies,
        [policy(Some("a"), None, None, Some(5), Some(1))]
    );
}

/// The allocations `from_headers` makes for one `RateLimit` field.
fn allocations_for(field: &str) -> u64 {
    let map = headers(&[("ratelimit", field)]);
    let before = crate::alloc::allocations();
    let h = ServerHint::from_headers(&map, draft_now());
    let made = crate::alloc::allocations() - before;
    drop(h);
    made
}

#[test]
fn ten_thousand_members_allocate_no_more_than_the_16_kept() {
    // Repeats of one name, and members that are no policy: as much as one member.
    let one = allocations_for(r#""a";r=5;t=1"#);
    let repeated = vec![r#""a";r=5;t=1"#; 10_000].join(", ");
    assert_eq!(allocations_for(&repeated), one);
    let junk = format!(
        "\"a\";r=5;t=1, {}",
        vec!["1;r=2, (\"x\");t=3"; 5_000].join(", ")
    );
    assert_eq!(allocations_for(&junk), one);
    // Distinct names: as much as the 16 kept.
    let names = |n: usize| {
        (0..n)
            .map(|i| format!("\"p{i}\";r=1;t=1"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    assert_eq!(allocations_for(&names(10_000)), allocations_for(&names(16)));
}

#[test]
fn draft_03_fields() {
    let h = parse(&[
        ("ratelimit-limit", "10"),
        ("ratelimit-remaining", "4"),
        ("ratelimit-reset", "7"),
    ]);
    assert_eq!(h.policies, [policy(None, Some(10), None, Some(4), Some(7))]);
    assert_eq!(h.policy_names().count(), 0);
    // With quota policies: the window of the expiring limit.
    let h = parse(&[
        ("ratelimit-limit", "10, 10;w=1, 50;w=60"),
        ("ratelimit-remaining", "0"),
        ("ratelimit-reset", "1"),
    ]);
    assert_eq!(
        h.policies,
        [policy(None, Some(10), Some(1), Some(0), Some(1))]
    );
    assert_eq!(h.retry_delay(), Some(S));
    // A remaining alone is still a hint.
    let h = parse(&[("ratelimit-remaining", "3")]);
    assert_eq!(h.remaining(), Some(3));
}

#[test]
fn x_ratelimit_fields() {
    let now = draft_now();
    let epoch = now.duration_since(UNIX_EPOCH).unwrap().as_secs();
    let h = parse(&[
        ("x-ratelimit-limit", "60"),
        ("x-ratelimit-remaining", "0"),
        ("x-ratelimit-reset", "30"),
    ]);
    assert_eq!(
        h.policies,
        [policy(None, Some(60), None, Some(0), Some(30))]
    );
    // A Unix time in seconds (GitHub's form), in the future and in the past.
    let future = (epoch + 42).to_string();
    let h = parse(&[
        ("x-ratelimit-remaining", "1"),
        ("x-ratelimit-reset", &future),
    ]);
    assert_eq!(h.allowance(), Some((1, 42 * S)));
    let past = (epoch - 42).to_string();
    let h = parse(&[("x-ratelimit-reset", &past)]);
    assert_eq!(h.reset(), Some(Duration::ZERO));
    // A Unix time in milliseconds, and fractions.
    let millis = (epoch * 1000 + 1_500).to_string();
    let h = parse(&[("x-ratelimit-reset", &millis)]);
    assert_eq!(h.reset(), Some(Duration::from_millis(1_500)));
    let h = parse(&[("x-ratelimit-reset", "2.25")]);
    assert_eq!(h.reset(), Some(Duration::from_millis(2_250)));
    let fractional = format!("{}.5", epoch + 3);
    let h = parse(&[("x-ratelimit-reset", &fractional)]);
    assert_eq!(h.reset(), Some(Duration::from_millis(3_500)));
}

#[test]
fn one_style_is_used_the_ietf_fields_first() {
    let h = parse(&[
        ("ratelimit", r#""a";r=5;t=1"#),
        ("ratelimit-limit", "10"),
        ("ratelimit-remaining", "9"),
        ("x-ratelimit-remaining", "8"),
    ]);
    assert_eq!(
        h.policies,
        [policy(Some("a"), None, None, Some(5), Some(1))]
    );
    let h = parse(&[("ratelimit-remaining", "9"), ("x-ratelimit-remaining", "8")]);
    assert_eq!(h.remaining(), Some(9));
    // A malformed IETF field does not hide the others.
    let h = parse(&[("ratelimit", "\"a\";r=5;;"), ("x-ratelimit-remaining", "8")]);
    assert_eq!(h.remaining(), Some(8));
}

#[test]
fn retry_after_forms() {
    let now = draft_now();
    let one = |v: &str| ServerHint::from_headers(&headers(&[("retry-after", v)]), now).retry_after;
    assert_eq!(one("120"), Some(120 * S));
    assert_eq!(one("0"), Some(Duration::ZERO));
    assert_eq!(one(" 7 "), Some(7 * S));
    // Far too large: saturates instead of overflowing.
    assert_eq!(
        one("99999999999999999999999999"),
        Some(Duration::from_secs(u64::MAX))
    );
    // HTTP-dates: IMF-fixdate, and the obsolete RFC 850 and asctime forms.
    assert_eq!(one("Mon, 05 Aug 2019 09:28:00 GMT"), Some(60 * S));
    assert_eq!(one("Monday, 05-Aug-19 09:28:00 GMT"), Some(60 * S));
    assert_eq!(one("Mon Aug  5 09:28:00 2019"), Some(60 * S));
    // In the past: retry now.
    assert_eq!(one("Sun, 04 Aug 2019 09:27:00 GMT"), Some(Duration::ZERO));
    assert_eq!(one("Mon, 05 Aug 2019 09:27:00 GMT"), Some(Duration::ZERO));
    // Malformed: ignored.
    for bad in [
        "-5",
        "1.5",
        "soon",
        "",
        "5s",
        "Mon, 32 Aug 2019 09:28:00 GMT",
        "+3",
    ] {
        assert_eq!(one(bad), None, "{bad:?}");
    }
    // Several field lines (a singleton field sent twice): the first.
    let h = parse(&[("retry-after", "5"), ("retry-after", "3600")]);
    assert_eq!(h.retry_after, Some(5 * S));
    // Not UTF-8.
    let mut map = HeaderMap::new();
    map.insert("retry-after", HeaderValue::from_bytes(b"\xff\xfe").unwrap());
    assert_eq!(ServerHint::from_headers(&map, now).retry_after, None);
}

#[test]
fn malformed_fields_and_parameters_are_ignored() {
    // Syntax errors: the whole field is ignored.
    for bad in [
        r#""a";r=1,"#,
        r#""a";r=1 "b""#,
        r#""a;r=1"#,
        r#""a";R=1"#,
        "",
    ] {
        let h = parse(&[("ratelimit", bad)]);
        assert!(h.policies.is_empty(), "{bad:?}: {h:?}");
    }
    // Parameters of the wrong type are as if absent; unknown ones are read past.
    let h = parse(&[("ratelimit", r#""a";r=-1;t=x;acme-burst=5"#)]);
    assert_eq!(h.policies, [policy(Some("a"), None, None, None, None)]);
    let h = parse(&[("ratelimit", r#""a";r=1.5;t="3""#)]);
    assert_eq!(h.policies, [policy(Some("a"), None, None, None, None)]);
    // The last of a repeated parameter wins (RFC 9651).
    let h = parse(&[("ratelimit", r#""a";r=1;r=2;t=3;t=?1"#)]);
    assert_eq!(h.policies, [policy(Some("a"), None, None, Some(2), None)]);
    // Members that are not names: skipped, the rest kept.
    let h = parse(&[(
        "ratelimit-policy",
        r#"42;q=1, ("x" "y");q=2, :AQ==:;q=3, ?1;q=4, "ok";q=5"#,
    )]);
    assert_eq!(h.policies, [policy(Some("ok"), Some(5), None, None, None)]);
    // A zero window is no window.
    let h = parse(&[("ratelimit-policy", r#""a";q=5;w=0"#)]);
    assert_eq!(h.policies, [policy(Some("a"), Some(5), None, None, None)]);
    // Draft-03 and X- fields that are not single non-negative integers.
    let h = parse(&[
        ("ratelimit-remaining", "-1"),
        ("ratelimit-reset", "abc"),
        ("ratelimit-limit", "\"ten\""),
    ]);
    assert!(h.is_empty(), "{h:?}");
    let h = parse(&[
        ("x-ratelimit-remaining", "1, 2"),
        ("x-ratelimit-limit", "1e3"),
        ("x-ratelimit-reset", "-4"),
    ]);
    assert!(h.is_empty(), "{h:?}");
    assert!(ServerHint::from_headers(&HeaderMap::new(), SystemTime::now()).is_empty());
}

/// Every field the parser reads.
const FIELDS: [&str; 9] = [
    "retry-after",
    "ratelimit-policy",
    "ratelimit",
    "ratelimit-limit",
    "ratelimit-remaining",
    "ratelimit-reset",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
];

fn any_headers(values: Vec<(usize, Vec<u8>)>) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (i, bytes) in values {
        if let Ok(value) = HeaderValue::from_bytes(&bytes) {
            map.append(HeaderName::from_static(FIELDS[i % FIELDS.len()]), value);
        }
    }
    map
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    /// Arbitrary bytes in every field: no panic, and at most 16 policies.
    #[test]
    fn no_panic_on_any_bytes(
        values in proptest::collection::vec((0usize..9, proptest::collection::vec(any::<u8>(), 0..64)), 0..12),
        now in 0u64..=u64::from(u32::MAX) * 4,
    ) {
        let map = any_headers(values);
        let h = ServerHint::from_headers(&map, UNIX_EPOCH + Duration::from_secs(now));
        prop_assert!(h.policies.len() <= ServerHint::MAX_POLICIES);
        let _ = (h.allowance(), h.sustained_rate(), h.retry_delay(), h.quota(), h.window());
    }

    /// Bytes close to the fields' syntax, to reach deep into the parser: no panic, and a
    /// field that parses keeps its numbers.
    #[test]
    fn no_panic_on_near_valid_fields(
        values in proptest::collection::vec(
            (0usize..9, "[\"a-z0-9;=,:() .?*\\-]{0,48}"),
            0..12,
        ),
    ) {
        let values = values.into_iter().map(|(i, s)| (i, s.into_bytes())).collect();
        let map = any_headers(values);
        let h = ServerHint::from_headers(&map, SystemTime::now());
        prop_assert!(h.policies.len() <= ServerHint::MAX_POLICIES);
        let _ = (h.allowance(), h.sustained_rate(), h.retry_delay(), h.most_restrictive());
    }

    /// Any numbers written in the IETF syntax are read back exactly.
    #[test]
    fn ietf_numbers_round_trip(
        q in 0u64..=999_999_999_999_999,
        w in 1u64..=999_999_999_999_999,
        r in 0u64..=999_999_999_999_999,
        t in 0u64..=999_999_999_999_999,
    ) {
        let policy_field = format!("\"p\";q={q};w={w}");
        let limit_field = format!("\"p\";r={r};t={t}");
        let h = parse(&[("ratelimit-policy", &policy_field), ("ratelimit", &limit_field)]);
        prop_assert_eq!(h.policies, vec![policy(Some("p"), Some(q), Some(w), Some(r), Some(t))]);
    }
}

/// One `RateLimit` list member with valid syntax that may or may not be a policy: a name
/// from a small set (so names repeat) or another type, with parameters of any type.
fn member() -> impl Strategy<Value = String> {
    let value = prop_oneof![
        (0u64..=999_999_999_999_999).prop_map(|n| n.to_string()),
        (1u64..=999_999_999_999_999).prop_map(|n| format!("-{n}")),
        (0u64..=999_999_999_999, 0u16..1000).prop_map(|(i, f)| format!("{i}.{f}")),
        Just("?1".to_owned()),
        Just("\"s\"".to_owned()),
        Just("tok".to_owned()),
    ];
    let item = prop_oneof![
        4 => (0u8..6).prop_map(|n| format!("\"n{n}\"")),
        1 => (0u8..6).prop_map(|n| format!("n{n}")),
        1 => any::<u32>().prop_map(|n| n.to_string()),
        1 => Just(r#"("a" "b")"#.to_owned()),
        1 => Just("?0".to_owned()),
    ];
    let param = (
        prop_oneof![Just("r"), Just("t"), Just("q"), Just("w"), Just("x")],
        value,
    );
    (item, proptest::collection::vec(param, 0..4)).prop_map(|(item, params)| {
        let mut m = item;
        for (k, v) in params {
            m.push_str(&format!(";{k}={v}"));
        }
        m
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// Up to 300 members over several lines, names repeated, values of every type: at
    /// most 16 policies, no name twice, every number an sf-Integer; a policy with nothing
    /// remaining after fewer than 16 other names is kept, so its reset is waited for.
    #[test]
    fn long_lists_keep_distinct_policies_and_the_one_that_refuses(
        members in proptest::collection::vec(member(), 0..300),
        at in any::<prop::sample::Index>(),
        lines in 1usize..4,
        t in 0u64..=999_999_999_999_999,
    ) {
        let mut members = members;
        let at = at.index(members.len() + 1);
        members.insert(at, format!("\"z\";r=0;t={t}"));
        let per_line = members.len().div_ceil(lines);
        let fields: Vec<String> = members.chunks(per_line).map(|c| c.join(", ")).collect();
        let named: Vec<(&str, &str)> = fields.iter().map(|f| ("ratelimit", f.as_str())).collect();
        let h = parse(&named);
        prop_assert!(h.policies.len() <= ServerHint::MAX_POLICIES);
        let mut names: Vec<&str> = h.policy_names().collect();
        prop_assert_eq!(names.len(), h.policies.len());
        names.sort_unstable();
        names.dedup();
        prop_assert_eq!(names.len(), h.policies.len(), "{:?}", h);
        for p in &h.policies {
            for n in [p.remaining, p.quota].into_iter().flatten() {
                prop_assert!(n <= 999_999_999_999_999);
            }
            prop_assert!(p.reset.is_none_or(|r| r <= Duration::from_secs(999_999_999_999_999)));
        }
        // The names before `z` that are policies (a string or a token, first seen).
        let mut before: Vec<String> = Vec::new();
        for m in &members[..at] {
            let name = m.split(';').next().unwrap_or("").trim_matches('"');
            if name.starts_with('n') && !before.iter().any(|b| b == name) {
                before.push(name.to_owned());
            }
        }
        if before.len() < ServerHint::MAX_POLICIES {
            prop_assert!(h.policy_names().any(|n| n == "z"), "{:?}", h);
            prop_assert!(h.retry_delay() >= Some(Duration::from_secs(t)));
        }
    }

    /// Delta-seconds of any length, with whitespace: the number, saturated at `u64::MAX`.
    #[test]
    fn retry_after_delta_seconds_of_any_length(
        digits in "[0-9]{1,40}",
        pad in "[ \t]{0,3}",
    ) {
        let value = format!("{pad}{digits}{pad}");
        let expected = digits.parse::<u128>().map_or(u64::MAX, |n| u64::try_from(n).unwrap_or(u64::MAX));
        let h = parse(&[("retry-after", &value)]);
        prop_assert_eq!(h.retry_after, Some(Duration::from_secs(expected)));
    }

    /// Any HTTP-date from 1970 to 9999 against any `now`: the time until it, zero when past.
    #[test]
    fn retry_after_dates_from_1970_to_9999(
        date in 0u64..=253_402_300_799,
        now in 0u64..=253_402_300_799,
    ) {
        let date = UNIX_EPOCH + Duration::from_secs(date);
        let now = UNIX_EPOCH + Duration::from_secs(now);
        let h = ServerHint::from_headers(
            &headers(&[("retry-after", &httpdate::fmt_http_date(date))]),
            now,
        );
        prop_assert_eq!(h.retry_after, Some(date.duration_since(now).unwrap_or(Duration::ZERO)));
    }
}

/// The `x-client` header as the key.
fn by_client(req: &RequestInfo<'_>, key: &mut String) -> bool {
    match req.headers.get("x-client").and_then(|v| v.to_str().ok()) {
        Some(c) => {
            key.push_str(c);
            true
        }
        None => false,
    }
}

/// Send `n` requests through a `RateLimitLayer` writing `styles` over a gate of `quota`
/// (at the same instant, paused time), and the same requests to a twin gate: each
/// response's hint against the twin's decision.
async fn round_trip(quota: Quota, styles: HeaderStyles, n: usize) {
    let gate = MemoryGate::new(Limit::TokenBucket(quota));
    let twin = MemoryGate::new(Limit::TokenBucket(quota));
    let layer = RateLimitLayer::builder(gate)
        .policy(Policy::new("per-client", quota, by_client))
        .header_styles(styles)
        .build()
        .unwrap();
    let svc = layer.layer(tower::service_fn(|_req: Request<Empty<Bytes>>| async {
        Ok::<_, Infallible>(Response::new(Empty::<Bytes>::new()))
    }));
    let burst = u64::from(quota.burst_size());
    let rate = quota.rate();
    // `w`: the time to refill from empty, whole seconds rounded up.
    let w = (u128::from(burst) * u128::from(rate.period_nanos()))
        .div_ceil(u128::from(rate.count()) * 1_000_000_000) as u64;
    // `q`: what refills in `w` (at least the burst).
    let q = (u128::from(w) * 1_000_000_000 * u128::from(rate.count())
        / u128::from(rate.period_nanos())) as u64;
    let ceil = |d: Duration| d.as_nanos().div_ceil(1_000_000_000) as u64;
    for i in 0..n {
        let req = Request::get("/")
            .header("x-client", "c1")
            .body(Empty::new())
            .unwrap();
        let res = svc.clone().oneshot(req).await.unwrap();
        let hint = ServerHint::from_headers(res.headers(), SystemTime::now());
        let d = twin.check("c1", 1).unwrap();
        assert_eq!(res.status() == StatusCode::OK, d.allowed, "request {i}");
        let t = ceil(if d.allowed {
            d.reset_after
        } else {
            d.retry_after
        });
        let remaining = hint.remaining();
        assert_eq!(remaining, Some(d.remaining), "request {i}: {hint:?}");
        if styles.contains(HeaderStyles::X_RATELIMIT_EPOCH) {
            // A Unix time, whole seconds, read against the wall clock: within a second.
            let reset = hint.reset().unwrap();
            assert!(
                reset.abs_diff(Duration::from_secs(t)) <= S,
                "{reset:?} vs {t}"
            );
        } else {
            assert_eq!(hint.reset(), Some(Duration::from_secs(t)), "request {i}");
        }
        if styles.contains(HeaderStyles::IETF) {
            assert_eq!(hint.policy_names().collect::<Vec<_>>(), ["per-client"]);
            assert_eq!(hint.sustained_rate(), Some((q, Duration::from_secs(w))));
        } else {
            assert_eq!(hint.quota(), Some(q));
        }
        if d.allowed {
            assert_eq!(hint.retry_after, None);
        } else {
            // Retry-After: whole seconds rounded up, at least 1.
            assert_eq!(hint.retry_after, Some(Duration::from_secs(t.max(1))));
            assert_eq!(hint.retry_delay(), Some(Duration::from_secs(t.max(1))));
        }
    }
}

#[tokio::test(start_paused = true)]
async fn round_trip_against_flowgates_own_server_layer() {
    let per_minute = Quota::new(Rate::per_minute(60).unwrap(), 10).unwrap();
    round_trip(per_minute, HeaderStyles::IETF, 13).await;
    round_trip(per_minute, HeaderStyles::DRAFT_03, 13).await;
    round_trip(per_minute, HeaderStyles::X_RATELIMIT, 13).await;
    round_trip(per_minute, HeaderStyles::X_RATELIMIT_EPOCH, 13).await;
    round_trip(
        per_minute,
        HeaderStyles::IETF | HeaderStyles::DRAFT_03 | HeaderStyles::X_RATELIMIT,
        13,
    )
    .await;
    let fast = Quota::new(Rate::per_second(100).unwrap(), 5).unwrap();
    round_trip(fast, HeaderStyles::IETF, 8).await;
}

#[test]
fn public_types_are_send_sync_unpin() {
    fn check<T: Send + Sync + Unpin + 'static>() {}
    check::<ServerHint>();
    check::<PolicyHint>();
}

/// A `Retry-After` HTTP-date before 1970 (a server whose clock reads just before the
/// epoch, formatted in a zone behind UTC) is a date in the past: retry now, as the docs
/// say. `httpdate` knows no year before 1970, so it was ignored as malformed, and a
/// `RateLimit` reset then took its place: 60 s where the server said now.
#[test]
fn a_retry_after_date_before_1970_is_in_the_past() {
    let now = draft_now();
    let one = |v: &str| ServerHint::from_headers(&headers(&[("retry-after", v)]), now).retry_after;
    for past in [
        "Wed, 31 Dec 1969 23:59:59 GMT",
        "Wed Dec 31 23:59:59 1969",
        "Sat, 01 Jan 0000 00:00:00 GMT",
        "Thu, 29 Feb 1968 12:00:00 GMT",
    ] {
        assert_eq!(one(past), Some(Duration::ZERO), "{past:?}");
    }
    // Still malformed: a wrong weekday, a day the year does not have.
    for bad in [
        "Thu, 31 Dec 1969 23:59:59 GMT",
        "Thu, 29 Feb 1900 12:00:00 GMT",
        "Wed, 31 Dec 196x 23:59:59 GMT",
    ] {
        assert_eq!(one(bad), None, "{bad:?}");
    }
    let h = parse(&[
        ("retry-after", "Wed, 31 Dec 1969 23:59:59 GMT"),
        ("ratelimit", r#""p";r=0;t=60"#),
    ]);
    assert_eq!(h.retry_delay(), Some(Duration::ZERO));
}
