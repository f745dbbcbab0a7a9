//! `Backoff` / `Schedule`: every jitter within its formula over many seeded draws, the same
//! seed drawing the same delays, the deadline never passed, the server's hint winning but
//! bounded, attempts counted, no overflow for huge attempt numbers, and the configuration
//! checked.

use std::time::Duration;

use flowgate::ConfigErrorKind;
use flowgate::retry::{Backoff, GiveUp, Jitter, Schedule};
use proptest::prelude::*;
use tokio::time::Instant;

const MS: Duration = Duration::from_millis(1);

fn backoff(base: Duration, cap: Duration, jitter: Jitter, seed: u64) -> Backoff {
    Backoff::builder()
        .base(base)
        .cap(cap)
        .jitter(jitter)
        .max_attempts(u32::MAX)
        .seed(seed)
        .build()
        .unwrap()
}

/// `min(cap, base × 2^k)` in nanoseconds, computed in u128 (the reference).
fn exp(base: Duration, cap: Duration, k: u32) -> u128 {
    let doubled = if k >= 100 {
        u128::MAX
    } else {
        base.as_nanos().saturating_mul(1u128 << k)
    };
    doubled.min(cap.as_nanos())
}

/// The delays of the first `n` retries.
fn delays(schedule: &mut Schedule, n: usize) -> Vec<Duration> {
    (0..n).map(|_| schedule.next_delay(None).unwrap()).collect()
}

#[test]
fn no_jitter_doubles_up_to_the_cap() {
    let b = backoff(100 * MS, 1_000 * MS, Jitter::None, 0);
    let got = delays(&mut b.start(), 6);
    let want: Vec<Duration> = [100, 200, 400, 800, 1_000, 1_000]
        .iter()
        .map(|&ms| ms * MS)
        .collect();
    assert_eq!(got, want);
}

#[test]
fn full_jitter_stays_within_zero_and_exp() {
    let (base, cap) = (10 * MS, 5_000 * MS);
    let b = backoff(base, cap, Jitter::Full, 1);
    let mut low_half = 0;
    let mut total = 0;
    for _ in 0..200 {
        let mut s = b.start();
        for k in 0..12 {
            let d = s.next_delay(None).unwrap().as_nanos();
            let e = exp(base, cap, k);
            assert!(d <= e, "retry {k}: {d} > {e}");
            low_half += usize::from(d < e / 2);
            total += 1;
        }
    }
    // Uniform over [0, exp]: about half the draws land in the lower half (not the
    // [d, 2d) of a jitter that only adds).
    assert!(
        (total * 2 / 5..total * 3 / 5).contains(&low_half),
        "{low_half} of {total} in the lower half"
    );
}

#[test]
fn equal_jitter_stays_within_half_exp_and_exp() {
    let (base, cap) = (10 * MS, 5_000 * MS);
    let b = backoff(base, cap, Jitter::Equal, 2);
    let mut distinct = std::collections::HashSet::new();
    for _ in 0..200 {
        let mut s = b.start();
        for k in 0..12 {
            let d = s.next_delay(None).unwrap().as_nanos();
            let e = exp(base, cap, k);
            assert!(
                e / 2 <= d && d <= e,
                "retry {k}: {d} not in [{}, {e}]",
                e / 2
            );
            distinct.insert(d);
        }
    }
    assert!(
        distinct.len() > 1_000,
        "equal jitter draws: {}",
        distinct.len()
    );
}

#[test]
fn decorrelated_jitter_stays_within_base_and_three_times_the_previous() {
    let (base, cap) = (10 * MS, 5_000 * MS);
    let b = backoff(base, cap, Jitter::Decorrelated, 3);
    let mut reached_cap = false;
    for _ in 0..200 {
        let mut s = b.start();
        let mut prev = base;
        for _ in 0..20 {
            let d = s.next_delay(None).unwrap();
            assert!(d >= base && d <= cap, "{d:?} not in [{base:?}, {cap:?}]");
            assert!(d <= (prev * 3).min(cap), "{d:?} above 3 × {prev:?}");
            reached_cap |= d == cap;
            prev = d;
        }
    }
    assert!(reached_cap, "the cap bounds the decorrelated growth");
}

#[test]
fn the_same_seed_draws_the_same_delays() {
    for jitter in [Jitter::Full, Jitter::Equal, Jitter::Decorrelated] {
        let a = backoff(MS, 10_000 * MS, jitter, 42);
        let b = backoff(MS, 10_000 * MS, jitter, 42);
        // Schedule by schedule, in the order they were started; clones share the order.
        let a_clone = a.clone();
        let first = delays(&mut a.start(), 10);
        let second = delays(&mut a_clone.start(), 10);
        assert_eq!(first, delays(&mut b.start(), 10), "{jitter:?}");
        assert_eq!(second, delays(&mut b.clone().start(), 10), "{jitter:?}");
        // Two schedules of one backoff draw different delays (they are decorrelated).
        assert_ne!(first, second, "{jitter:?}");
        // Another seed, other delays.
        let c = backoff(MS, 10_000 * MS, jitter, 43);
        assert_ne!(first, delays(&mut c.start(), 10), "{jitter:?}");
    }
}

#[test]
fn unseeded_schedules_differ() {
    let b = Backoff::builder()
        .base(MS)
        .cap(Duration::from_secs(3600))
        .max_attempts(20)
        .build()
        .unwrap();
    assert_ne!(delays(&mut b.start(), 15), delays(&mut b.start(), 15));
}

#[test]
fn max_attempts_counts_the_first_attempt() {
    let b = Backoff::builder()
        .max_attempts(3)
        .jitter(Jitter::None)
        .build()
        .unwrap();
    let mut s = b.start();
    assert_eq!(s.attempts(), 1);
    assert_eq!(s.next_delay(None), Ok(100 * MS));
    assert_eq!(s.attempts(), 2);
    assert_eq!(s.next_delay(None), Ok(200 * MS));
    assert_eq!(s.attempts(), 3);
    let err = s.next_delay(None).unwrap_err();
    assert_eq!(err, GiveUp::Attempts { attempts: 3 });
    assert_eq!(err.to_string(), "gave up after 3 attempts");
    // Giving up is stable, and a hint does not buy another attempt.
    assert_eq!(
        s.next_delay(Some(MS)),
        Err(GiveUp::Attempts { attempts: 3 })
    );
    assert_eq!(s.attempts(), 3);
}

#[test]
fn huge_attempt_numbers_do_not_overflow() {
    for jitter in [
        Jitter::None,
        Jitter::Full,
        Jitter::Equal,
        Jitter::Decorrelated,
    ] {
        let cap = Duration::from_nanos(u64::MAX);
        let b = backoff(Duration::from_nanos(u64::MAX / 3), cap, jitter, 9);
        let mut s = b.start();
        for _ in 0..300 {
            assert!(s.next_delay(None).unwrap() <= cap);
        }
        assert_eq!(s.attempts(), 301);
    }
    // Far past 2^64 × base: the delay is the cap.
    let b = backoff(MS, Duration::from_secs(30), Jitter::None, 0);
    let mut s = b.start();
    let last = delays(&mut s, 1_000).pop().unwrap();
    assert_eq!(last, Duration::from_secs(30));
}

#[test]
fn a_hint_replaces_the_computed_delay() {
    let b = backoff(
        Duration::from_secs(1),
        Duration::from_secs(10),
        Jitter::None,
        0,
    );
    let mut s = b.start();
    // Shorter than the computed delay (1 s): the server knows best.
    assert_eq!(s.next_delay(Some(250 * MS)), Ok(250 * MS));
    // Longer than the cap (10 s): still honoured, up to max_retry_after (60 s).
    assert_eq!(
        s.next_delay(Some(Duration::from_secs(45))),
        Ok(Duration::from_secs(45))
    );
    // A zero hint: retry at once.
    assert_eq!(s.next_delay(Some(Duration::ZERO)), Ok(Duration::ZERO));
    // The computed progression went on underneath: the 4th retry is 8 s.
    assert_eq!(s.next_delay(None), Ok(Duration::from_secs(8)));
}

/// Clients refused together are told one `Retry-After`: with `retry_after_jitter` they
/// come back spread over the extra, never before the hint; without, all at once. The
/// draws do not depend on the hints (a schedule given hints and one given none draw the
/// same computed delays), and the extra counts against the deadline and not against
/// `max_retry_after`.
#[tokio::test(start_paused = true)]
async fn retry_after_jitter_spreads_clients_over_the_extra_never_before_the_hint() {
    let hint = Duration::from_secs(2);
    let spread = |extra: Duration| {
        let b = Backoff::builder()
            .retry_after_jitter(extra)
            .max_retry_after(hint)
            .seed(11)
            .build()
            .unwrap();
        assert_eq!(b.retry_after_jitter(), extra);
        (0..1000)
            .map(|_| b.start().next_delay(Some(hint)).unwrap())
            .collect::<Vec<_>>()
    };
    assert!(spread(Duration::ZERO).iter().all(|&d| d == hint));
    let spread_out = spread(Duration::from_secs(1));
    assert!(
        spread_out
            .iter()
            .all(|&d| d >= hint && d <= hint + Duration::from_secs(1))
    );
    // Spread over the second: every tenth of it has some of the 1000 clients.
    for tenth in 0..10u32 {
        let from = hint + Duration::from_millis(100) * tenth;
        let count = spread_out
            .iter()
            .filter(|&&d| d >= from && d < from + Duration::from_millis(100))
            .count();
        assert!((50..=150).contains(&count), "{tenth}: {count}");
    }

    // The computed delays do not depend on hints being given in between: the first
    // schedules of two backoffs of one seed, one given hints and the other none.
    let seeded = || {
        Backoff::builder()
            .retry_after_jitter(Duration::from_secs(1))
            .max_attempts(u32::MAX)
            .max_retry_after(hint)
            .seed(5)
            .build()
            .unwrap()
    };
    let (mut hinted, mut plain) = (seeded().start(), seeded().start());
    for _ in 0..20 {
        hinted.next_delay(Some(hint)).unwrap();
        plain.next_delay(None).unwrap();
    }
    assert_eq!(delays(&mut hinted, 10), delays(&mut plain, 10));

    // The deadline counts the extra: 2 s with up to 1 s more, a deadline at 2.5 s.
    let b = Backoff::builder()
        .retry_after_jitter(Duration::from_secs(1))
        .deadline(Duration::from_millis(2500))
        .seed(3)
        .build()
        .unwrap();
    let (mut waited, mut gave_up) = (0, 0);
    for _ in 0..200 {
        match b.start().next_delay(Some(hint)) {
            Ok(d) => {
                assert!(d < Duration::from_millis(2500), "{d:?}");
                waited += 1;
            }
            Err(GiveUp::Deadline { delay, .. }) => {
                assert!(delay >= Duration::from_millis(2500), "{delay:?}");
                gave_up += 1;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(waited > 50 && gave_up > 50, "{waited} / {gave_up}");

    // An extra past u64::MAX nanoseconds is refused.
    let err = Backoff::builder()
        .retry_after_jitter(Duration::MAX)
        .build()
        .unwrap_err();
    assert_eq!(err.field(), "backoff.retry_after_jitter");
    assert_eq!(err.kind(), ConfigErrorKind::TooLarge);
}

#[test]
fn a_hint_above_max_retry_after_gives_up() {
    let b = Backoff::builder()
        .max_retry_after(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut s = b.start();
    assert_eq!(
        s.next_delay(Some(Duration::from_secs(30))),
        Ok(Duration::from_secs(30))
    );
    let err = s.next_delay(Some(Duration::from_secs(31))).unwrap_err();
    assert_eq!(
        err,
        GiveUp::HintTooLong {
            hint: Duration::from_secs(31),
            max: Duration::from_secs(30)
        }
    );
    // The message names the setting that allows more, for a caller who wants to wait.
    assert_eq!(
        err.to_string(),
        "gave up: the server asked to wait 31s, longer than the 30s allowed by BackoffBuilder::max_retry_after"
    );
    assert_eq!(s.attempts(), 2, "giving up counts no attempt");
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_past_the_deadline_gives_up_at_once() {
    let b = Backoff::builder()
        .deadline(Duration::from_secs(10))
        .build()
        .unwrap();
    let mut s = b.start();
    tokio::time::sleep(Duration::from_secs(3)).await; // the first attempt
    let before = Instant::now();
    let err = s.next_delay(Some(Duration::from_secs(7))).unwrap_err();
    assert_eq!(Instant::now(), before, "nothing waited");
    assert_eq!(
        err,
        GiveUp::Deadline {
            elapsed: Duration::from_secs(3),
            deadline: Duration::from_secs(10),
            delay: Duration::from_secs(7),
        }
    );
    assert!(err.to_string().starts_with("gave up: waiting 7s after 3s"));
    // Just under the deadline is fine.
    assert_eq!(
        s.next_delay(Some(Duration::from_secs(6))),
        Ok(Duration::from_secs(6))
    );
    assert_eq!(s.remaining(), Some(Duration::from_secs(7)));
    assert_eq!(s.elapsed(), Duration::from_secs(3));
}

#[tokio::test(start_paused = true)]
async fn remaining_counts_down_to_zero() {
    let b = Backoff::builder()
        .deadline(Duration::from_secs(2))
        .build()
        .unwrap();
    let s = b.start();
    assert_eq!(s.remaining(), Some(Duration::from_secs(2)));
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(s.remaining(), Some(500 * MS));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(s.remaining(), Some(Duration::ZERO));
    assert_eq!(Backoff::default().start().remaining(), None);
}

/// Run one operation whose attempts take `attempt_ms[i]` each (bounded by the time left,
/// as a retry loop with a timeout does) and always fail; returns the total time and the
/// give-up reason.
async fn run_until_give_up(schedule: &mut Schedule, attempt_ms: &[u64]) -> (Duration, GiveUp) {
    let start = Instant::now();
    let mut i = 0;
    loop {
        let took = Duration::from_millis(attempt_ms[i % attempt_ms.len()]);
        let took = schedule.remaining().map_or(took, |left| took.min(left));
        tokio::time::sleep(took).await;
        i += 1;
        match schedule.next_delay(None) {
            Ok(delay) => {
                // The next attempt starts strictly before the deadline.
                if let Some(left) = schedule.remaining() {
                    assert!(delay < left, "waiting {delay:?} with {left:?} left");
                }
                tokio::time::sleep(delay).await;
            }
            Err(give_up) => return (start.elapsed(), give_up),
        }
    }
}

#[tokio::test(start_paused = true)]
async fn the_deadline_is_never_passed() {
    for (seed, jitter) in [
        (1, Jitter::Full),
        (2, Jitter::Equal),
        (3, Jitter::Decorrelated),
        (4, Jitter::None),
    ] {
        let deadline = Duration::from_secs(5);
        let b = Backoff::builder()
            .base(50 * MS)
            .cap(Duration::from_secs(2))
            .jitter(jitter)
            .max_attempts(1_000)
            .deadline(deadline)
            .seed(seed)
            .build()
            .unwrap();
        for op in 0..20u64 {
            let mut s = b.start();
            let (total, give_up) = run_until_give_up(&mut s, &[op * 37 % 400, 120, 900]).await;
            assert!(total <= deadline, "{jitter:?}: {total:?}");
            assert!(matches!(give_up, GiveUp::Deadline { .. }), "{give_up:?}");
            assert!(s.attempts() >= 2, "{jitter:?}: at least one retry fits");
        }
    }
}

#[test]
fn configuration_is_checked() {
    let err = Backoff::builder().base(Duration::ZERO).build().unwrap_err();
    assert_eq!(
        (err.field(), err.kind()),
        ("backoff.base", ConfigErrorKind::Zero)
    );
    let err = Backoff::builder()
        .base(Duration::from_secs(2))
        .cap(Duration::from_secs(1))
        .build()
        .unwrap_err();
    assert_eq!(
        (err.field(), err.kind()),
        ("backoff.cap", ConfigErrorKind::Inconsistent)
    );
    let err = Backoff::builder().cap(Duration::MAX).build().unwrap_err();
    assert_eq!(
        (err.field(), err.kind()),
        ("backoff.cap", ConfigErrorKind::TooLarge)
    );
    let err = Backoff::builder().max_attempts(0).build().unwrap_err();
    assert_eq!(err.field(), "backoff.max_attempts");
    let err = Backoff::builder()
        .deadline(Duration::ZERO)
        .build()
        .unwrap_err();
    assert_eq!(err.field(), "backoff.deadline");
    let b = Backoff::default();
    assert_eq!(
        (
            b.base(),
            b.cap(),
            b.jitter(),
            b.max_attempts(),
            b.deadline()
        ),
        (100 * MS, Duration::from_secs(10), Jitter::Full, 5, None)
    );
    assert_eq!(b.max_retry_after(), Duration::from_secs(60));
}

#[test]
fn public_types_are_send_sync_unpin() {
    fn check<T: Send + Sync + Unpin + 'static>() {}
    check::<Backoff>();
    check::<Schedule>();
    check::<GiveUp>();
    check::<Jitter>();
}

proptest! {
    /// Over any parameters: every delay is within its formula's bounds, and the same seed
    /// draws the same sequence.
    #[test]
    fn delays_stay_within_their_formula(
        base_ns in 1u64..=10_000_000_000,
        cap_factor in 1u64..=1_000_000,
        jitter in crate::support::jitters(),
        seed in any::<u64>(),
        retries in 1usize..80,
    ) {
        let base = Duration::from_nanos(base_ns);
        let cap = Duration::from_nanos(base_ns.saturating_mul(cap_factor));
        let b = backoff(base, cap, jitter, seed);
        let mut s = b.start();
        let mut prev = base.as_nanos();
        let got = delays(&mut s, retries);
        for (k, d) in got.iter().enumerate() {
            let d = d.as_nanos();
            let e = exp(base, cap, k as u32);
            match jitter {
                Jitter::None => prop_assert_eq!(d, e),
                Jitter::Full => prop_assert!(d <= e),
                Jitter::Equal => prop_assert!(e / 2 <= d && d <= e),
                _ => {
                    prop_assert!(base.as_nanos() <= d && d <= cap.as_nanos());
                    prop_assert!(d <= (prev * 3).max(base.as_nanos()));
                }
            }
            prev = d;
        }
        let again = backoff(base, cap, jitter, seed);
        prop_assert_eq!(got, delays(&mut again.start(), retries));
    }
}
