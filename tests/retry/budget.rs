//! `RetryBudget`: gRPC `retryThrottling` semantics checked against a reference model and
//! its formula, a rarely failing downstream never refused, and exact counts under
//! concurrency.

use flowgate::ConfigErrorKind;
use flowgate::retry::RetryBudget;
use proptest::prelude::*;

/// The retry loop of one request against a downstream whose attempts fail as `fails`
/// says; at most `max_attempts` attempts. Returns the retries made.
fn request(budget: &RetryBudget, max_attempts: u32, mut fails: impl FnMut() -> bool) -> u32 {
    let mut retries = 0;
    for attempt in 1..=max_attempts {
        if !fails() {
            budget.on_success();
            return retries;
        }
        if attempt == max_attempts {
            budget.on_failure();
        } else if budget.try_retry() {
            retries += 1;
        } else {
            return retries;
        }
    }
    retries
}

#[test]
fn a_downstream_failing_every_time_gets_the_formula_at_most() {
    for (max_tokens, ratio) in [(10, 0.1), (100, 0.5), (3, 1.0), (1000, 0.001)] {
        let budget = RetryBudget::new(max_tokens, ratio).unwrap();
        let n = 2_000;
        let retries: u32 = (0..n).map(|_| request(&budget, u32::MAX, || true)).sum();
        // No success ever, so the formula max_tokens / 2 + successes × ratio is
        // max_tokens / 2. Exactly: from max, each failure takes one token, and a retry
        // needs more than max / 2 left after its failure.
        let bound = f64::from(max_tokens) / 2.0;
        assert!(
            f64::from(retries) <= bound,
            "{max_tokens}: {retries} > {bound}"
        );
        let exact = (1..=max_tokens)
            .filter(|taken| 2 * (max_tokens - taken) > max_tokens)
            .count();
        assert_eq!(retries as usize, exact, "{max_tokens}/{ratio}");
        assert_eq!(budget.stats().allowed, u64::from(retries));
        assert_eq!(budget.tokens(), 0.0);
        assert!(!budget.would_allow());
        // With a last attempt that is not retried (max 4 attempts), fewer still.
        let budget = RetryBudget::new(max_tokens, ratio).unwrap();
        let retries: u32 = (0..n).map(|_| request(&budget, 4, || true)).sum();
        assert!(
            f64::from(retries) <= bound,
            "{max_tokens}: {retries} > {bound}"
        );
    }
}

#[test]
fn retries_never_exceed_half_the_tokens_plus_the_ratio_per_request() {
    // A downstream failing 70 % of attempts: the successes refill a little.
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut fails = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % 100 < 70
    };
    let (max_tokens, ratio) = (10, 0.1);
    let budget = RetryBudget::new(max_tokens, ratio).unwrap();
    for n in 1..=2_000u32 {
        request(&budget, 3, &mut fails);
        let allowed = budget.stats().allowed as f64;
        let bound = f64::from(max_tokens) / 2.0 + f64::from(n) * ratio;
        assert!(allowed <= bound, "after {n} requests: {allowed} > {bound}");
    }
    assert!(budget.stats().refused > 0, "the budget held the storm back");
}

#[test]
fn a_downstream_failing_5_percent_is_never_refused() {
    let budget = RetryBudget::new(10, 0.1).unwrap();
    // Every 20th attempt fails: 5 %.
    let mut attempt = 0u64;
    let retries: u32 = (0..10_000)
        .map(|_| {
            request(&budget, 3, || {
                attempt += 1;
                attempt.is_multiple_of(20)
            })
        })
        .sum();
    assert!(retries > 400, "{retries} retries");
    assert_eq!(budget.stats().refused, 0);
    // Randomly placed failures, 5 %, seeded: never refused either.
    let budget = RetryBudget::new(10, 0.1).unwrap();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut retries = 0;
    for _ in 0..10_000 {
        retries += request(&budget, 3, || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % 100 < 5
        });
    }
    assert!(retries > 400, "{retries} retries");
    assert_eq!(budget.stats().refused, 0);
}

#[test]
fn successes_refill_up_to_max_tokens() {
    let budget = RetryBudget::new(4, 0.25).unwrap();
    assert_eq!(budget.tokens(), 4.0);
    budget.on_success();
    assert_eq!(budget.tokens(), 4.0, "never above max_tokens");
    for _ in 0..6 {
        budget.on_failure();
    }
    assert_eq!(budget.tokens(), 0.0, "never below zero");
    for _ in 0..9 {
        budget.on_success();
    }
    assert_eq!(budget.tokens(), 2.25);
    assert!(!budget.would_allow(), "2.25 − 1 is not above 2");
    for _ in 0..4 {
        budget.on_success();
    }
    assert_eq!(budget.tokens(), 3.25);
    assert!(budget.would_allow());
    assert!(budget.try_retry());
    assert_eq!(budget.tokens(), 2.25);
}

#[test]
fn clones_share_one_budget_exactly_across_threads() {
    let budget = RetryBudget::new(1000, 0.1).unwrap();
    // 8 threads × 100 retries from 1000 tokens: the retries leaving more than 500 are
    // allowed, 499 of them, whoever asks.
    let handles: Vec<_> = (0..8)
        .map(|_| {
            let b = budget.clone();
            std::thread::spawn(move || (0..100).filter(|_| b.try_retry()).count())
        })
        .collect();
    let allowed: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert_eq!(allowed, 499);
    assert_eq!(budget.tokens(), 200.0);
    let stats = budget.stats();
    assert_eq!((stats.allowed, stats.refused), (499, 301));

    // Drained to 0, then 8 threads each give back 1 token per 10 successes and take it
    // again with a failure: never below 0, never near the cap, so nothing is lost.
    for _ in 0..200 {
        budget.on_failure();
    }
    assert_eq!(budget.tokens(), 0.0);
    let handles: Vec<_> = (0..8)
        .map(|_| {
            let b = budget.clone();
            std::thread::spawn(move || {
                for _ in 0..1_000 {
                    for _ in 0..10 {
                        b.on_success();
                    }
                    b.on_failure();
                }
                for _ in 0..10 {
                    b.on_success();
                }
            })
        })
        .collect();
    handles.into_iter().for_each(|h| h.join().unwrap());
    assert_eq!(budget.tokens(), 8.0);
}

#[test]
fn configuration_is_checked() {
    let err = RetryBudget::new(0, 0.1).unwrap_err();
    assert_eq!(
        (err.field(), err.kind()),
        ("retry_budget.max_tokens", ConfigErrorKind::Zero)
    );
    let err = RetryBudget::new(1001, 0.1).unwrap_err();
    assert_eq!(err.kind(), ConfigErrorKind::TooLarge);
    for bad in [0.0, -1.0, 0.0004, f64::NAN, f64::INFINITY] {
        let err = RetryBudget::new(10, bad).unwrap_err();
        assert_eq!(err.field(), "retry_budget.token_ratio", "{bad}");
    }
    let err = RetryBudget::new(10, 10.5).unwrap_err();
    assert_eq!(err.kind(), ConfigErrorKind::TooLarge);
    let b = RetryBudget::builder()
        .max_tokens(1000)
        .token_ratio(1000.0)
        .name("payments")
        .build()
        .unwrap();
    assert_eq!((b.max_tokens(), b.token_ratio()), (1000, 1000.0));
    assert_eq!(b.name(), Some("payments"));
    // Rounded to the thousandth.
    assert_eq!(RetryBudget::new(10, 0.0125).unwrap().token_ratio(), 0.013);
    let debug = format!("{b:?}");
    assert!(
        debug.contains("payments") && debug.contains("tokens: 1000.0"),
        "{debug}"
    );
}

/// A budget of 1 or 2 tokens could never allow a retry: the failure that asks takes a token,
/// and even from full no more than `max_tokens / 2` are left. It is refused when built, with
/// the bound, instead of a budget that refuses every retry of a downstream that never
/// fails otherwise.
#[test]
fn a_budget_too_small_to_ever_allow_a_retry_is_refused() {
    for max_tokens in [1, 2] {
        let err = RetryBudget::new(max_tokens, 0.1).unwrap_err();
        assert_eq!(
            (err.field(), err.kind()),
            ("retry_budget.max_tokens", ConfigErrorKind::Inconsistent),
            "{max_tokens}"
        );
        assert_eq!(
            err.to_string(),
            format!(
                "invalid retry_budget.max_tokens: {max_tokens} is below 3: no failure would \
                 leave more than max_tokens / 2 tokens, so every retry would be refused"
            )
        );
    }
    // 3 is the smallest that allows one: from full, a failure leaves 2, above 1.5.
    let budget = RetryBudget::new(3, 0.1).unwrap();
    assert!(budget.try_retry());
}

/// Two threads in lockstep, one taking a token (`on_failure`) while the other gives one
/// back (`on_success`), 200 000 rounds: after each round `flowgate_retry_budget_tokens`
/// reads the tokens left, whatever the order in which the threads showed their changes.
/// (Each set the count it had made at its own compare-and-swap, so a thread that made 4
/// could show it after the other showed 5.)
#[cfg(feature = "metrics")]
#[test]
fn the_tokens_gauge_ends_at_the_tokens_left_after_racing_threads() {
    const ROUNDS: usize = 200_000;
    let recorder = crate::support::TestRecorder::default();
    let budget = metrics::with_local_recorder(&recorder, || {
        RetryBudget::builder()
            .max_tokens(10)
            .token_ratio(1.0)
            .name("race")
            .build()
            .unwrap()
    });
    for _ in 0..5 {
        budget.on_failure();
    }
    let mut wrong = Vec::new();
    let theirs = budget.clone();
    crate::support::lockstep(
        ROUNDS,
        move |start| {
            start();
            theirs.on_success();
        },
        |start| {
            start();
            budget.on_failure();
        },
        |round| {
            let (tokens, shown) = (
                budget.tokens(),
                recorder.gauge("flowgate_retry_budget_tokens{name=race}"),
            );
            if shown != Some(tokens) {
                wrong.push((round, tokens, shown));
            }
        },
    );
    assert!(
        wrong.is_empty(),
        "{} of {ROUNDS} rounds ended with the gauge off the tokens left; the first (round, \
         tokens, shown): {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(5)]
    );
}

#[cfg(feature = "metrics")]
#[test]
fn metrics_count_allowed_refused_and_abandoned_retries() {
    let recorder = crate::support::TestRecorder::default();
    let budget = metrics::with_local_recorder(&recorder, || {
        RetryBudget::builder()
            .max_tokens(4)
            .name("api")
            .build()
            .unwrap()
    });
    let answers: Vec<bool> = (0..4).map(|_| budget.try_retry()).collect();
    assert_eq!(answers, [true, false, false, false]);
    assert_eq!(
        recorder.counter("flowgate_retry_budget_retries_total{name=api,outcome=allowed}"),
        1
    );
    assert_eq!(
        recorder.counter("flowgate_retry_budget_retries_total{name=api,outcome=refused}"),
        3
    );
    assert_eq!(
        recorder.gauge("flowgate_retry_budget_tokens{name=api}"),
        Some(0.0)
    );
    // The allowed retry was not made after all: counted, the token stays taken.
    budget.abandon_retry();
    assert_eq!(
        recorder.counter("flowgate_retry_budget_abandoned_total{name=api}"),
        1
    );
    let stats = budget.stats();
    assert_eq!((stats.allowed, stats.refused, stats.abandoned), (1, 3, 1));
    assert_eq!(budget.tokens(), 0.0);
}

/// A metrics recorder that panics as `try_retry` shows the tokens it took (the gauge, set
/// before the answer is counted) still leaves the failure's question counted: the token is
/// taken (the attempt failed), and the retry, whose answer the panic kept from the caller,
/// counts as refused, so `allowed + refused` stays the retries asked. The gauge's panic
/// skipped both counts: a token gone with no retry allowed or refused.
#[cfg(feature = "metrics")]
#[test]
fn a_recorder_panicking_on_the_tokens_gauge_leaves_the_retry_counted_refused() {
    let recorder = crate::support::TestRecorder::default();
    let budget = metrics::with_local_recorder(&recorder, || {
        RetryBudget::builder().name("gauge").build().unwrap()
    });
    let (tokens, allowed, refused) = (
        "flowgate_retry_budget_tokens{name=gauge}",
        "flowgate_retry_budget_retries_total{name=gauge,outcome=allowed}",
        "flowgate_retry_budget_retries_total{name=gauge,outcome=refused}",
    );
    // From full (a retry would be allowed), and from 6 tokens (one would be refused).
    for (before, answer) in [(10.0, true), (6.0, false)] {
        while budget.tokens() > before {
            budget.on_failure();
        }
        let stats = budget.stats();
        assert_eq!(budget.would_allow(), answer, "from {before}");
        recorder.panic_once_on(tokens);
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| budget.try_retry()));
        assert!(recorder.panicked_once(tokens), "from {before}");
        assert!(
            unwound.is_err(),
            "the recorder's panic goes on, from {before}"
        );
        assert_eq!(budget.tokens(), before - 1.0, "the failure took its token");
        let now = budget.stats();
        assert_eq!(
            (now.allowed - stats.allowed, now.refused - stats.refused),
            (0, 1),
            "from {before}: no answer reached the caller, so the retry was refused"
        );
    }
    assert_eq!(recorder.counter(allowed), 0);
    assert_eq!(recorder.counter(refused), 2);
}

#[test]
fn public_types_are_send_sync_unpin() {
    fn check<T: Send + Sync + Unpin + 'static>() {}
    check::<RetryBudget>();
}

proptest! {
    /// Any sequence of outcomes: the tokens follow the reference model exactly, and the
    /// allowed retries never exceed max_tokens / 2 + successes × ratio.
    #[test]
    fn tokens_follow_the_reference_model(
        max_tokens in 3u32..=50,
        ratio_milli in 1u64..=2_000,
        ops in proptest::collection::vec(0u8..3, 0..400),
    ) {
        let ratio_milli = ratio_milli.min(u64::from(max_tokens) * 1000);
        let budget = RetryBudget::new(max_tokens, ratio_milli as f64 / 1000.0).unwrap();
        let max = u64::from(max_tokens) * 1000;
        let mut model = max;
        let (mut successes, mut allowed) = (0u64, 0u64);
        for op in ops {
            match op {
                0 => {
                    budget.on_success();
                    successes += 1;
                    model = (model + ratio_milli).min(max);
                }
                1 => {
                    budget.on_failure();
                    model = model.saturating_sub(1000);
                }
                _ => {
                    model = model.saturating_sub(1000);
                    let want = model > max / 2;
                    prop_assert_eq!(budget.try_retry(), want);
                    allowed += u64::from(want);
                }
            }
            prop_assert_eq!(budget.tokens(), model as f64 / 1000.0);
        }
        prop_assert_eq!(budget.stats().allowed, allowed);
        let bound = u64::from(max_tokens) * 500 + successes * ratio_milli;
        prop_assert!(allowed * 1000 <= bound);
    }
}

/// A named budget at the default ratio (a tenth of a token a success) through a long run
/// of random failures and successes: `flowgate_retry_budget_tokens` reads the tokens left after
/// every call, not a sum of rounded changes drifting away from them, and reads 0 once the
/// budget is dropped. (A gauge moved by its changes adds up their rounding errors in the
/// recorder: 9.9 - 10 + 9.8 - 9.9 … is not 9.8 in `f64`.)
#[cfg(feature = "metrics")]
#[test]
fn the_tokens_gauge_reads_the_tokens_left_through_a_long_run_and_0_once_dropped() {
    let recorder = crate::support::TestRecorder::default();
    let budget = metrics::with_local_recorder(&recorder, || {
        RetryBudget::builder().name("drift").build().unwrap()
    });
    let id = "flowgate_retry_budget_tokens{name=drift}";
    let mut wrong = Vec::new();
    // One call in five fails, at random (a fixed seed): the tokens wander over the range.
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    for step in 0..20_000u32 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        if seed.is_multiple_of(5) {
            budget.on_failure();
        } else {
            budget.on_success();
        }
        let (tokens, shown) = (budget.tokens(), recorder.gauge(id));
        if shown != Some(tokens) {
            wrong.push((step, tokens, shown));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of 20 000 calls left the gauge off the tokens left; the first and last \
         (step, tokens, shown): {:?} {:?}",
        wrong.len(),
        wrong.first(),
        wrong.last()
    );
    drop(budget);
    assert_eq!(recorder.gauge(id), Some(0.0), "a dropped budget's gauge");
}
