//! HTTP: server hints of any shape, key extractors, `TopRejected`, the rate-limit and
//! shed layers built with extreme settings.

use std::convert::Infallible;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use flowgate::bulkhead::Bulkhead;
use flowgate::gate::{Limit, MemoryGate};
use flowgate::http::{
    ClientIp, Constant, ForwardedHeader, Header, HeaderStyles, Policy, RateLimitLayer, RequestInfo,
    ShedLayer, TopRejected,
};
use flowgate::retry::ServerHint;
use flowgate::{Decision, Quota};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::Full;
use proptest::prelude::*;
use tower::{Layer, ServiceExt, service_fn};

use super::{any_duration, any_key, any_quota, any_u32, any_usize, paused, sane_config_error};

/// Field values of every shape: numbers far past u64, negatives, decimals, dates, lists.
fn any_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(b"".to_vec()),
        Just(b"0".to_vec()),
        Just(b"18446744073709551615".to_vec()),
        Just(b"18446744073709551616".to_vec()),
        Just(b"99999999999999999999999999999999999999".to_vec()),
        Just(b"-1".to_vec()),
        Just(b"1.5".to_vec()),
        Just(b"999999999999.999".to_vec()),
        Just(b"Sun, 06 Nov 1994 08:49:37 GMT".to_vec()),
        Just(b"Fri, 31 Dec 9999 23:59:59 GMT".to_vec()),
        Just(b"Thu, 01 Jan 1004 00:00:00 GMT".to_vec()),
        Just(b"Sun Nov  6 08:49:37 0001".to_vec()),
        Just(b"\"p\";q=999999999999999;w=999999999999999".to_vec()),
        Just(b"\"p\";r=999999999999999;t=999999999999999".to_vec()),
        Just(b"\"p\";q=0;w=0, \"q\";q=1;w=1".to_vec()),
        Just(b"p;r=-5;t=-5, p;r=1".to_vec()),
        Just(vec![b'a'; 10_000]),
        Just(
            (0..40)
                .map(|i| format!("p{i};r={i}"))
                .collect::<Vec<_>>()
                .join(", ")
                .into_bytes()
        ),
        prop::collection::vec(0x20u8..0x7f, 0..60),
        "[0-9]{1,40}".prop_map(String::into_bytes),
    ]
}

fn headers(fields: &[(usize, Vec<u8>)]) -> HeaderMap {
    const NAMES: [&str; 9] = [
        "retry-after",
        "ratelimit",
        "ratelimit-policy",
        "ratelimit-limit",
        "ratelimit-remaining",
        "ratelimit-reset",
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
    ];
    let mut map = HeaderMap::new();
    for (i, value) in fields {
        if let Ok(v) = HeaderValue::from_bytes(value) {
            map.append(HeaderName::from_static(NAMES[i % NAMES.len()]), v);
        }
    }
    map
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn server_hints_of_any_shape(
        fields in prop::collection::vec((0..9usize, any_value()), 0..8),
        now_secs in prop_oneof![Just(0u64), Just(1_000_000_000), Just(253_402_300_799), any::<u32>().prop_map(u64::from)],
    ) {
        let now = UNIX_EPOCH + Duration::from_secs(now_secs);
        let hint = ServerHint::from_headers(&headers(&fields), now);
        prop_assert!(hint.policies.len() <= 2 * ServerHint::MAX_POLICIES);
        let _ = (
            hint.most_restrictive(),
            hint.remaining(),
            hint.reset(),
            hint.quota(),
            hint.window(),
            hint.allowance(),
            hint.sustained_rate(),
            hint.retry_delay(),
            hint.policy_names().count(),
            hint.is_empty(),
        );
        let _ = SystemTime::now();
    }

    #[test]
    fn key_extractors_refuse_bad_names(name in "\\PC{0,20}", cidr in "\\PC{0,45}") {
        if let Err(e) = Header::new(&name) {
            sane_config_error(&e);
        }
        match ClientIp::builder(ForwardedHeader::XForwardedFor).trust(&cidr).build() {
            Ok(ip) => prop_assert_eq!(ip.trusted().len(), 1),
            Err(e) => sane_config_error(&e),
        }
    }

    #[test]
    fn top_rejected_takes_any_capacity_and_key(capacity in any_usize(), keys in prop::collection::vec(any_key(), 0..20)) {
        match TopRejected::new(capacity) {
            Ok(top) => {
                for k in &keys {
                    top.record(k);
                }
                prop_assert!(top.len() <= capacity);
                for r in top.top(usize::MAX) {
                    prop_assert!(r.key.len() <= TopRejected::MAX_KEY_LEN);
                }
            }
            Err(e) => {
                sane_config_error(&e);
                prop_assert!(capacity == 0 || capacity > TopRejected::MAX_CAPACITY);
            }
        }
    }

    #[test]
    fn rate_limit_layer_answers_bad_keys_and_costs(
        quota in any_quota(),
        prefix in prop_oneof![Just(String::new()), Just("x".repeat(509)), Just("x".repeat(510)), "[a-z:]{0,8}"],
        policy in prop_oneof![Just("p".to_string()), Just(String::new()), Just("a:b".to_string()), Just("p".repeat(600)), "\\PC{0,8}"],
        top in any_usize(),
        key in any_key(),
        cost in any_u32(),
        styles in prop_oneof![
            Just(HeaderStyles::IETF),
            Just(HeaderStyles::NONE),
            Just(HeaderStyles::IETF | HeaderStyles::DRAFT_03 | HeaderStyles::X_RATELIMIT),
            Just(HeaderStyles::X_RATELIMIT_EPOCH),
        ],
        twice in any::<bool>(),
    ) {
        let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(1).unwrap()));
        let built = RateLimitLayer::builder(gate)
            .policy(Policy::new(policy.clone(), quota, Constant::new(key.clone())))
            .cost(move |_: &RequestInfo<'_>| cost)
            .key_prefix(prefix.clone())
            .top_rejected(top)
            .header_styles(styles)
            .build();
        let layer = match built {
            Ok(l) => l,
            Err(e) => {
                sane_config_error(&e);
                return Ok(());
            }
        };
        let status = paused().block_on(async {
            let svc = layer.layer(service_fn(|_req: Request<Full<Bytes>>| async {
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
            }));
            // Twice: the second request of a full bucket is rejected, with its fields (a
            // window of up to 584 years, a reset as far).
            let first = svc
                .clone()
                .oneshot(Request::get("/").body(Full::default()).unwrap())
                .await
                .unwrap()
                .status();
            if twice {
                let again = svc
                    .oneshot(Request::get("/").body(Full::default()).unwrap())
                    .await
                    .unwrap()
                    .status();
                assert!(again.is_success() || again.is_client_error(), "{again}");
            }
            first
        });
        // The gate key is `<prefix><policy>:<key>`: a request whose gate key is too
        // long, or whose cost is above the burst, can never be decided (400); a cost
        // of 0 passes free.
        let gate_key = prefix.len() + policy.len() + 1 + key.len();
        if cost == 0 {
            prop_assert_eq!(status, StatusCode::OK);
        } else if gate_key > 512 || u64::from(cost) > u64::from(quota.burst_size()) {
            prop_assert_eq!(status, StatusCode::BAD_REQUEST);
        } else if key.is_empty() {
            prop_assert!(status == StatusCode::OK || status == StatusCode::BAD_REQUEST, "{status}");
        } else {
            prop_assert_eq!(status, StatusCode::OK);
        }
    }

    #[test]
    fn shed_layer_takes_any_retry_after(retry_after in any_duration(), wait in any::<bool>()) {
        let bulkhead = Bulkhead::builder(1).wait_timeout(Duration::from_millis(1)).build().unwrap();
        match ShedLayer::builder(bulkhead.clone()).retry_after(retry_after).wait(wait).build() {
            Ok(layer) => {
                prop_assert!(!retry_after.is_zero());
                let status = paused().block_on(async {
                    let _held = bulkhead.try_acquire().unwrap();
                    let svc = layer.layer(service_fn(|_req: Request<Full<Bytes>>| async {
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                    }));
                    let res = svc.oneshot(Request::get("/").body(Full::default()).unwrap()).await.unwrap();
                    let after = res.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
                    (res.status(), after)
                });
                prop_assert_eq!(status.0, StatusCode::SERVICE_UNAVAILABLE);
                let secs: u64 = status.1.unwrap().parse().unwrap();
                prop_assert!(secs >= 1);
            }
            Err(e) => {
                sane_config_error(&e);
                prop_assert!(retry_after.is_zero());
            }
        }
    }

    #[test]
    fn decision_fields_of_any_policy_name(name in "\\PC{0,20}", d in any_duration()) {
        let header = Decision::fail_closed(d).ratelimit_header(&name);
        prop_assert!(header.starts_with('"'));
    }
}
