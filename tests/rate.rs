//! Value types: every `ConfigError` path, `Overflow`, `Decision`.

use std::time::Duration;

use flowgate::{ConfigErrorKind, Decision, Overflow, Quota, Rate};

#[test]
fn zero_counts_and_periods_are_config_errors() {
    for err in [
        Rate::per_second(0).unwrap_err(),
        Rate::per_minute(0).unwrap_err(),
        Rate::per_hour(0).unwrap_err(),
        Rate::per(0, Duration::from_secs(1)).unwrap_err(),
        Quota::per_second(0).unwrap_err(),
        Quota::per_minute(0).unwrap_err(),
        Quota::per_hour(0).unwrap_err(),
        Quota::per(0, Duration::from_secs(1)).unwrap_err(),
    ] {
        assert_eq!(err.field(), "rate.count");
        assert_eq!(err.kind(), ConfigErrorKind::Zero);
        assert_eq!(err.to_string(), "invalid rate.count: must be at least 1");
    }
    let err = Rate::per(1, Duration::ZERO).unwrap_err();
    assert_eq!(
        (err.field(), err.kind()),
        ("rate.period", ConfigErrorKind::Zero)
    );
    assert_eq!(
        err.to_string(),
        "invalid rate.period: must be at least 1 ns"
    );
}

#[test]
fn periods_beyond_u64_nanoseconds_are_too_large() {
    let err = Rate::per(1, Duration::MAX).unwrap_err();
    assert_eq!(
        (err.field(), err.kind()),
        ("rate.period", ConfigErrorKind::TooLarge)
    );
    assert!(
        err.reason()
            .contains("longer than the longest supported period")
    );
    // The longest valid period is accepted.
    assert!(Rate::per(u32::MAX, Duration::from_nanos(u64::MAX)).is_ok());
}

#[test]
fn zero_burst_is_a_config_error() {
    let rate = Rate::per_second(10).unwrap();
    for err in [
        Quota::new(rate, 0).unwrap_err(),
        Quota::from(rate).burst(0).unwrap_err(),
    ] {
        assert_eq!(
            (err.field(), err.kind()),
            ("quota.burst", ConfigErrorKind::Zero)
        );
    }
}

#[test]
fn quota_defaults_burst_to_the_count() {
    let q = Quota::per_minute(30).unwrap();
    assert_eq!(q.burst_size(), 30);
    assert_eq!(q.rate().period(), Duration::from_secs(60));
    let q = q.burst(1).unwrap();
    assert_eq!(q.burst_size(), 1);
    assert_eq!(format!("{q:?}"), "Quota(Rate(30/60s), burst 1)");
    assert_eq!(q.to_string(), "30 per 60s, burst 1");
}

#[test]
fn rate_accessors() {
    let r = Rate::per_second(1_000_000).unwrap();
    assert_eq!(r.interval(), Duration::from_micros(1));
    assert_eq!(r.per_second_f64(), 1_000_000.0);
    assert_eq!(
        Rate::per_hour(1).unwrap().period(),
        Duration::from_secs(3600)
    );
}

#[test]
fn overflow_policies() {
    let all = [
        Overflow::Backpressure,
        Overflow::Reject,
        Overflow::DropNewest,
        Overflow::DropOldest,
    ];
    let names: Vec<_> = all.iter().map(|o| o.to_string()).collect();
    assert_eq!(
        names,
        ["backpressure", "reject", "drop_newest", "drop_oldest"]
    );
    assert_eq!(all.iter().filter(|o| o.waits()).count(), 1);
    assert_eq!(all.iter().filter(|o| o.drops()).count(), 2);
}

#[test]
fn decision_headers() {
    let d = Decision::fail_open();
    assert!(d.is_allowed());
    assert_eq!(d.retry_after_secs(), None);
}

#[test]
fn public_types_are_send_sync_unpin() {
    fn check<T: Send + Sync + Unpin + 'static>() {}
    check::<Rate>();
    check::<Quota>();
    check::<Overflow>();
    check::<Decision>();
    check::<flowgate::ConfigError>();
    check::<flowgate::limit::KeyedError>();
    check::<flowgate::limit::TokenBucket>();
    check::<flowgate::limit::Limiter<flowgate::limit::TokenBucket>>();
    check::<flowgate::limit::TokenBucketState>();
    check::<flowgate::limit::SlidingLogState>();
    check::<flowgate::limit::FixedWindow>();
    check::<flowgate::limit::SlidingLog>();
    check::<flowgate::limit::SlidingWindow>();
    check::<flowgate::limit::Keyed<String, flowgate::limit::TokenBucket>>();
}
