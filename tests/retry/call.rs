//! `retry`: what each outcome does, the budget, the deadline, the attempt timeout, and the
//! round-trip time of each attempt measured on its own.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use flowgate::Rate;
use flowgate::pace::AdaptivePacer;
use flowgate::retry::{
    Backoff, GiveUp, Jitter, Outcome, RetryBudget, RetryError, RetryPolicy, Stop, retry,
};
use tokio::time::Instant;

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// A status code as the downstream's answer: 200 success, 429/503 back-pressure with
/// `Retry-After: 2`, 500 retryable, anything else fatal.
fn classify(r: &Result<u16, &'static str>) -> Outcome {
    match r {
        Ok(200) => Outcome::Success,
        Ok(429 | 503) => Outcome::BackPressure {
            retry_after: Some(secs(2)),
        },
        Ok(500) | Err(_) => Outcome::Retry,
        Ok(_) => Outcome::Fatal,
    }
}

/// `retry` under `backoff` and `budget` against a downstream that always answers 500: how
/// it stopped, and how many calls it made.
async fn always_500(backoff: Backoff, budget: &RetryBudget) -> (Stop, u32) {
    let policy = RetryPolicy::builder(backoff)
        .budget(budget.clone())
        .build()
        .unwrap();
    let calls = AtomicU32::new(0);
    let done = retry(&policy, classify, |_| {
        calls.fetch_add(1, Ordering::Relaxed);
        async { Ok(500) }
    })
    .await;
    (done.stop, calls.load(Ordering::Relaxed))
}

fn per_second(rate: Rate) -> f64 {
    rate.count() as f64 * 1e9 / rate.period_nanos() as f64
}

fn backoff() -> Backoff {
    Backoff::builder()
        .base(Duration::from_millis(100))
        .jitter(Jitter::None)
        .max_attempts(5)
        .seed(1)
        .build()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn back_pressure_waits_what_the_server_said_then_succeeds() {
    let policy = RetryPolicy::builder(backoff()).build().unwrap();
    let start = Instant::now();
    let done = retry(&policy, classify, |attempt| async move {
        Ok(if attempt < 3 { 429 } else { 200 })
    })
    .await;
    assert_eq!(done.stop, Stop::Success);
    assert_eq!(done.attempts, 3);
    assert_eq!(start.elapsed(), secs(4));
    assert_eq!(done.into_result().unwrap(), 200);
}

#[tokio::test(start_paused = true)]
async fn a_transient_failure_waits_the_backoff_and_a_fatal_one_stops_at_once() {
    let policy = RetryPolicy::builder(backoff()).build().unwrap();
    let start = Instant::now();
    let done = retry(&policy, classify, |attempt| async move {
        Ok(if attempt < 3 { 500 } else { 200 })
    })
    .await;
    assert_eq!((done.attempts, done.stop), (3, Stop::Success));
    // No jitter: 100 ms, then 200 ms.
    assert_eq!(start.elapsed(), Duration::from_millis(300));

    let calls = AtomicU32::new(0);
    let done = retry(&policy, classify, |_| {
        calls.fetch_add(1, Ordering::Relaxed);
        async { Ok(404) }
    })
    .await;
    assert_eq!((done.attempts, done.stop), (1, Stop::Fatal));
    assert_eq!(calls.load(Ordering::Relaxed), 1);
    assert_eq!(done.result, Some(Ok(404)));
}

#[tokio::test(start_paused = true)]
async fn attempts_run_out_with_the_last_result() {
    let policy = RetryPolicy::builder(backoff()).build().unwrap();
    let done = retry(&policy, classify, |_| async { Err("reset") }).await;
    assert_eq!(done.attempts, 5);
    assert!(matches!(
        done.stop,
        Stop::GaveUp(GiveUp::Attempts { attempts: 5 })
    ));
    assert!(matches!(
        done.into_result(),
        Err(RetryError::Inner {
            error: "reset",
            stop: Stop::GaveUp(GiveUp::Attempts { attempts: 5 }),
            attempts: 5,
        })
    ));
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_past_the_deadline_gives_up_at_once() {
    let backoff = Backoff::builder()
        .deadline(secs(1))
        .max_attempts(10)
        .seed(3)
        .build()
        .unwrap();
    let policy = RetryPolicy::builder(backoff).build().unwrap();
    let start = Instant::now();
    // Retry-After: 2 s, the deadline 1 s away: no wait at all.
    let done = retry(&policy, classify, |_| async { Ok(503) }).await;
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(done.attempts, 1);
    assert!(matches!(done.stop, Stop::GaveUp(GiveUp::Deadline { .. })));
    assert_eq!(done.result, Some(Ok(503)));
}

/// The pacer's wait counts against the deadline, as the backoff's delay does: a first
/// attempt that a pacer paused by another caller's `Retry-After: 30` would hold past a 10 s
/// deadline is not made (the operation ends at once, `RetryError::NotSent`), and a retry
/// it would hold past it is not waited for (the last result stands). Both waited the pacer
/// out and attempted 20 s past the deadline.
#[tokio::test(start_paused = true)]
async fn the_pacer_s_wait_counts_against_the_deadline() {
    let pacer = AdaptivePacer::builder(Rate::per_second(100).unwrap())
        .build()
        .unwrap();
    let backoff = Backoff::builder()
        .base(Duration::from_millis(100))
        .jitter(Jitter::None)
        .max_attempts(5)
        .deadline(secs(10))
        .build()
        .unwrap();
    let policy = RetryPolicy::builder(backoff)
        .pacer(pacer.clone())
        .build()
        .unwrap();
    let calls = AtomicU32::new(0);
    let start = Instant::now();

    // A retry: while the first attempt is under way, another caller's `Retry-After: 30`
    // pauses the pacer.
    let done = retry(&policy, classify, |attempt| {
        calls.fetch_add(1, Ordering::Relaxed);
        if attempt == 1 {
            pacer.on_back_pressure(Some(secs(30)));
        }
        async move { Ok(if attempt == 1 { 500 } else { 200 }) }
    })
    .await;
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!((done.attempts, calls.load(Ordering::Relaxed)), (1, 1));
    assert!(
        matches!(done.stop, Stop::GaveUp(GiveUp::Deadline { delay, .. }) if delay >= secs(30)),
        "{:?}",
        done.stop
    );
    assert_eq!(done.result, Some(Ok(500)));

    // A first attempt: none is made.
    let done = retry(&policy, classify, |_| {
        calls.fetch_add(1, Ordering::Relaxed);
        async { Ok(200) }
    })
    .await;
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!((done.attempts, calls.load(Ordering::Relaxed)), (0, 1));
    assert!(done.result.is_none());
    let err = done.into_result().unwrap_err();
    assert!(
        matches!(err, RetryError::NotSent(GiveUp::Deadline { delay, .. }) if delay >= secs(30)),
        "{err:?}"
    );
    assert!(
        err.to_string().starts_with("no attempt was sent: "),
        "{err}"
    );

    // Without a deadline the pacer is waited for, as before.
    let policy = RetryPolicy::builder(Backoff::builder().build().unwrap())
        .pacer(pacer.clone())
        .build()
        .unwrap();
    let done = retry(&policy, classify, |_| async { Ok(200) }).await;
    assert_eq!((done.attempts, done.stop), (1, Stop::Success));
    assert!(start.elapsed() >= secs(30), "{:?}", start.elapsed());
}

#[tokio::test(start_paused = true)]
async fn the_budget_stops_a_retry_storm() {
    let budget = RetryBudget::new(10, 0.1).unwrap();
    let backoff = Backoff::builder()
        .max_attempts(100)
        .base(Duration::from_millis(1))
        .build()
        .unwrap();
    let (stop, calls) = always_500(backoff, &budget).await;
    assert_eq!(stop, Stop::Budget);
    // 10 tokens, retries need more than 5 left: 4 retries (9, 8, 7, 6), the 5th refused.
    assert_eq!(calls, 5);
    assert_eq!(budget.stats().allowed, 4);
    assert_eq!(budget.stats().refused, 1);
}

#[tokio::test(start_paused = true)]
async fn the_last_attempt_is_not_counted_as_a_retry_by_the_budget() {
    let budget = RetryBudget::new(10, 0.1).unwrap();
    let backoff = Backoff::builder()
        .max_attempts(3)
        .jitter(Jitter::None)
        .build()
        .unwrap();
    let (stop, calls) = always_500(backoff, &budget).await;
    assert_eq!(stop, Stop::GaveUp(GiveUp::Attempts { attempts: 3 }));
    // Three failures take three tokens, but only two retries were made.
    assert_eq!(calls, 3);
    assert_eq!(budget.tokens(), 7.0);
    assert_eq!(budget.stats().allowed, 2);
    assert_eq!(budget.stats().refused, 0);

    // Out of attempts with the budget at its threshold: the attempts ran out, the budget
    // refused nothing (no retry could have been made).
    let budget = RetryBudget::new(4, 0.1).unwrap();
    let backoff = Backoff::builder().max_attempts(2).build().unwrap();
    let (stop, _) = always_500(backoff, &budget).await;
    // 4 → 3 (> 2: one retry), 3 → 2 on the last attempt.
    assert_eq!(stop, Stop::GaveUp(GiveUp::Attempts { attempts: 2 }));
    assert_eq!(budget.tokens(), 2.0);
    assert_eq!((budget.stats().allowed, budget.stats().refused), (1, 0));
}

#[tokio::test(start_paused = true)]
async fn an_attempt_that_hangs_is_timed_out_and_counts_as_back_pressure() {
    let pacer = AdaptivePacer::builder(Rate::per_second(100).unwrap())
        .build()
        .unwrap();
    let policy = RetryPolicy::builder(backoff())
        .attempt_timeout(Duration::from_millis(250))
        .pacer(pacer.clone())
        .build()
        .unwrap();
    let before = pacer.rate();
    let start = Instant::now();
    let done: flowgate::retry::Retried<u16, &str> =
        retry(&policy, classify, |_| std::future::pending()).await;
    assert_eq!(done.stop, Stop::TimedOut);
    assert!(done.result.is_none());
    assert_eq!(done.attempts, 5);
    assert!(matches!(
        done.into_result(),
        Err(RetryError::TimedOut { attempts: 5 })
    ));
    // Five timeouts of 250 ms and backoffs of 100, 200, 400, 800 ms.
    assert!(start.elapsed() >= Duration::from_millis(5 * 250 + 1_500));
    assert!(
        per_second(pacer.rate()) < per_second(before),
        "the pacer slowed down on timeouts"
    );
}

/// The deadline is checked between attempts, and the attempt timeout bounds each attempt
/// on its own: an attempt started just before the deadline runs to its own timeout, past
/// the deadline (by less than one attempt timeout). Only a timeout around the whole
/// `retry` ends it by a given time.
#[tokio::test(start_paused = true)]
async fn the_attempt_timeout_bounds_each_attempt_not_the_operation_by_its_deadline() {
    let backoff = Backoff::builder()
        .base(secs(1))
        .jitter(Jitter::None)
        .max_attempts(100)
        .deadline(secs(10))
        .build()
        .unwrap();
    let policy = RetryPolicy::builder(backoff)
        .attempt_timeout(secs(5))
        .build()
        .unwrap();
    // Three quick 500s (waits of 1, 2, 4 s), then an attempt at 7 s that hangs.
    let hang = |attempt: u32| async move {
        if attempt < 4 {
            Ok(500)
        } else {
            std::future::pending().await
        }
    };
    let start = Instant::now();
    let done = retry(&policy, classify, hang).await;
    assert_eq!((done.stop, done.attempts), (Stop::TimedOut, 4));
    // 7 s + the attempt's 5 s: 2 s past the 10 s deadline.
    assert_eq!(start.elapsed(), secs(12));

    // A timeout around the whole operation ends it at the deadline.
    let start = Instant::now();
    let bounded = tokio::time::timeout(secs(10), retry(&policy, classify, hang)).await;
    assert!(bounded.is_err());
    assert_eq!(start.elapsed(), secs(10));
}

#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn each_attempt_s_round_trip_is_its_own() {
    use std::sync::Arc;

    let recorder = crate::support::TestRecorder::default();
    let policy = metrics::with_local_recorder(&recorder, || {
        RetryPolicy::builder(backoff()).name("rtt").build().unwrap()
    });
    let attempts = Arc::new(AtomicU32::new(0));
    let done = retry(&policy, classify, |_| {
        let attempts = Arc::clone(&attempts);
        async move {
            // Every attempt takes 50 ms; the wait between them (2 s) is not part of it.
            tokio::time::sleep(Duration::from_millis(50)).await;
            Ok(if attempts.fetch_add(1, Ordering::Relaxed) < 2 {
                429
            } else {
                200
            })
        }
    })
    .await;
    assert_eq!(done.stop, Stop::Success);
    let rtts = recorder.samples("flowgate_retry_attempt_seconds{name=rtt}");
    assert_eq!(rtts, vec![0.05, 0.05, 0.05]);
    assert_eq!(
        recorder.counter("flowgate_retry_attempts_total{name=rtt}"),
        3
    );
    assert_eq!(
        recorder.counter("flowgate_retry_stopped_total{name=rtt,stop=success}"),
        1
    );
}

#[test]
fn a_zero_attempt_timeout_is_a_config_error() {
    let err = RetryPolicy::builder(backoff())
        .attempt_timeout(Duration::ZERO)
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("attempt_timeout"), "{err}");
}

/// `retry` dropped at each point of an operation (here by an outer `tokio::time::timeout`,
/// as a caller's own deadline or a `select!` does): while its backoff waits, while the
/// pacer holds the retry back, and while an attempt is under way. Every drop is counted
/// once as a `cancelled` stop; a retry the budget allowed but that was never made is
/// counted as abandoned (its token stays taken: the attempt before it did fail); the
/// attempt under way was sent, so it counts as an attempt (with no outcome for the budget
/// or the pacer, and no round-trip time).
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn dropping_retry_counts_the_drop_and_abandons_the_allowed_retry() {
    let recorder = crate::support::TestRecorder::default();
    let (budget, policy, paced) = metrics::with_local_recorder(&recorder, || {
        let budget = RetryBudget::builder().name("drop").build().unwrap();
        let policy = RetryPolicy::builder(backoff())
            .name("drop")
            .budget(budget.clone())
            .build()
            .unwrap();
        // A pacer at 1/s (a burst of 2, one of them taken below): the retry after the
        // 100 ms backoff waits for it until 1 s.
        let pacer = AdaptivePacer::builder(Rate::per_second(1).unwrap())
            .build()
            .unwrap();
        let paced = RetryPolicy::builder(backoff())
            .name("paced")
            .budget(budget.clone())
            .pacer(pacer)
            .build()
            .unwrap();
        (budget, policy, paced)
    });
    paced.pacer().unwrap().until_ready(1).await.unwrap();
    let calls = AtomicU32::new(0);
    let failing = |_| {
        calls.fetch_add(1, Ordering::Relaxed);
        async { Ok(500) }
    };

    // 1. Dropped 50 ms into the 100 ms backoff after a 500: the retry was allowed, never made.
    let dropped =
        tokio::time::timeout(Duration::from_millis(50), retry(&policy, classify, failing)).await;
    assert!(dropped.is_err(), "still waiting when dropped");
    assert_eq!(calls.load(Ordering::Relaxed), 1);
    assert_eq!(
        recorder.counter("flowgate_retry_budget_abandoned_total{name=drop}"),
        1,
        "the allowed retry was never made"
    );
    // The first attempt did fail: its token stays taken.
    assert_eq!(budget.tokens(), 9.0);
    assert_eq!(
        recorder.counter("flowgate_retry_attempts_total{name=drop}"),
        1
    );
    assert_eq!(
        recorder.counter("flowgate_retry_stopped_total{name=drop,stop=cancelled}"),
        1
    );

    // 2. Dropped while the pacer holds the allowed retry back (at 500 ms, until 1 s).
    let dropped =
        tokio::time::timeout(Duration::from_millis(500), retry(&paced, classify, failing)).await;
    assert!(dropped.is_err());
    assert_eq!(calls.load(Ordering::Relaxed), 2);
    assert_eq!(
        recorder.counter("flowgate_retry_budget_abandoned_total{name=drop}"),
        2
    );
    assert_eq!(budget.tokens(), 8.0);
    assert_eq!(
        recorder.counter("flowgate_retry_attempts_total{name=paced}"),
        1
    );
    assert_eq!(
        recorder.counter("flowgate_retry_stopped_total{name=paced,stop=cancelled}"),
        1
    );

    // 3. Dropped during an attempt: it was made, its outcome is unknown.
    let dropped = tokio::time::timeout(
        Duration::from_millis(50),
        retry(&policy, classify, |_| {
            std::future::pending::<Result<u16, &str>>()
        }),
    )
    .await;
    assert!(dropped.is_err());
    assert_eq!(
        recorder.counter("flowgate_retry_attempts_total{name=drop}"),
        2,
        "the attempt under way was sent"
    );
    assert!(
        recorder
            .samples("flowgate_retry_attempt_seconds{name=drop}")
            .len()
            == 1,
        "no round trip for the attempt dropped under way"
    );
    assert_eq!(
        recorder.counter("flowgate_retry_stopped_total{name=drop,stop=cancelled}"),
        2
    );
    // Neither a failure nor a success for the budget, and no retry to abandon.
    assert_eq!(budget.tokens(), 8.0);
    assert_eq!(
        recorder.counter("flowgate_retry_budget_abandoned_total{name=drop}"),
        2
    );
    assert_eq!(
        recorder.counter("flowgate_retry_budget_retries_total{name=drop,outcome=allowed}"),
        2
    );

    // 4. Run to the end: no drop is counted, nothing is abandoned.
    let done = retry(&policy, classify, |attempt| async move {
        Ok(if attempt < 2 { 500 } else { 200 })
    })
    .await;
    assert_eq!((done.attempts, done.stop), (2, Stop::Success));
    assert_eq!(
        recorder.counter("flowgate_retry_stopped_total{name=drop,stop=cancelled}"),
        2
    );
    assert_eq!(
        recorder.counter("flowgate_retry_budget_abandoned_total{name=drop}"),
        2
    );
    assert_eq!(
        recorder.counter("flowgate_retry_attempts_total{name=drop}"),
        4
    );
    // The budget's own counts: 3 retries allowed, 2 of them never made.
    let stats = budget.stats();
    assert_eq!((stats.allowed, stats.abandoned), (3, 2));
}

/// An `op` that panics for a retry (after a `500`) before returning its future sent
/// nothing: the retry the budget allowed is abandoned and not counted as an attempt, so the
/// attempts stay one more than the retries made (`allowed − abandoned`), and the operation
/// counts one stop, `cancelled` (as `RetryLayer` counts an inner `call` that panics).
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn an_op_panicking_for_a_retry_sends_no_attempt() {
    use futures::FutureExt;
    use std::panic::AssertUnwindSafe;

    let recorder = crate::support::TestRecorder::default();
    let (budget, policy) = metrics::with_local_recorder(&recorder, || {
        let budget = RetryBudget::builder().name("op").build().unwrap();
        let policy = RetryPolicy::builder(backoff())
            .name("op")
            .budget(budget.clone())
            .build()
            .unwrap();
        (budget, policy)
    });
    let calls = AtomicU32::new(0);
    let panicked = AssertUnwindSafe(retry(&policy, classify, |attempt| {
        calls.fetch_add(1, Ordering::Relaxed);
        assert!(attempt < 2, "op panics for attempt {attempt}");
        async { Ok(500) }
    }))
    .catch_unwind()
    .await;
    assert!(panicked.is_err());
    assert_eq!(
        calls.load(Ordering::Relaxed),
        2,
        "the retry's op ran, and panicked"
    );
    let stats = budget.stats();
    assert_eq!((stats.allowed, stats.abandoned), (1, 1));
    assert_eq!(
        recorder.counter("flowgate_retry_attempts_total{name=op}"),
        1,
        "1 + allowed - abandoned"
    );
    assert_eq!(
        recorder.counter("flowgate_retry_stopped_total{name=op,stop=cancelled}"),
        1
    );
}

/// A server hint of `Duration::MAX` (what a saturated `Retry-After` parses to): over
/// `max_retry_after` it gives up at once; with `max_retry_after(Duration::MAX)` it is
/// waited (tokio caps a sleep at about 30 years), without a panic or an overflow, and the
/// pacer's pause is capped too.
#[tokio::test(start_paused = true)]
async fn a_hint_of_duration_max_gives_up_or_is_waited_without_a_panic() {
    let huge = |r: &Result<u16, &str>| match r {
        Ok(200) => Outcome::Success,
        _ => Outcome::BackPressure {
            retry_after: Some(Duration::MAX),
        },
    };
    let pacer = AdaptivePacer::builder(Rate::per_second(100).unwrap())
        .build()
        .unwrap();
    let policy = RetryPolicy::builder(backoff())
        .pacer(pacer.clone())
        .build()
        .unwrap();
    let start = Instant::now();
    let done = retry(&policy, huge, |_| async { Ok(503) }).await;
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert!(
        matches!(done.stop, Stop::GaveUp(GiveUp::HintTooLong { .. })),
        "{:?}",
        done.stop
    );

    let backoff = Backoff::builder()
        .max_retry_after(Duration::MAX)
        .seed(1)
        .build()
        .unwrap();
    let policy = RetryPolicy::builder(backoff).pacer(pacer).build().unwrap();
    let start = Instant::now();
    let done = retry(&policy, huge, |attempt| async move {
        Ok(if attempt < 2 { 503 } else { 200 })
    })
    .await;
    assert_eq!((done.attempts, done.stop), (2, Stop::Success));
    assert!(start.elapsed() >= secs(29 * 365 * 24 * 3600));
}

/// A metrics recorder is user code: one that panics when an attempt's round-trip time is
/// recorded must not cost the outcome's report to the budget and the pacer. The histogram
/// was recorded first, so its panic left a `429 Retry-After: 2` unheard (the pacer neither
/// paused nor cut: the next request went out at once) and a success unheard by the budget
/// (its token ratio not given back).
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn a_recorder_panicking_on_the_round_trip_still_reports_the_outcome() {
    use futures::FutureExt;
    use std::panic::AssertUnwindSafe;

    let recorder = crate::support::TestRecorder::default();
    let (budget, pacer, policy) = metrics::with_local_recorder(&recorder, || {
        let budget = RetryBudget::builder().name("rec").build().unwrap();
        let pacer = AdaptivePacer::builder(Rate::per_second(100).unwrap())
            .build()
            .unwrap();
        let policy = RetryPolicy::builder(backoff())
            .name("rec")
            .budget(budget.clone())
            .pacer(pacer.clone())
            .build()
            .unwrap();
        (budget, pacer, policy)
    });
    recorder.panic_on("flowgate_retry_attempt_seconds{name=rec}", true);

    budget.on_failure();
    let panicked = AssertUnwindSafe(retry(&policy, classify, |_| async { Ok(200) }))
        .catch_unwind()
        .await;
    assert!(panicked.is_err(), "the recorder panicked");
    assert_eq!(budget.tokens(), 9.1, "the success gave back 0.1");

    let panicked = AssertUnwindSafe(retry(&policy, classify, |_| async { Ok(429) }))
        .catch_unwind()
        .await;
    assert!(panicked.is_err(), "the recorder panicked");
    let status = pacer.status();
    assert_eq!((status.pauses, status.cuts), (1, 1), "{status:?}");
    assert!(
        !pacer.pacer().check(1).unwrap().allowed,
        "the pacer holds the next request for the Retry-After"
    );
}

/// A metrics recorder that panics on the round-trip histogram must not keep a failed
/// attempt from the budget either, as it no longer keeps a success (above): the budget
/// hears of a failure when the schedule is asked for the retry, and that came after the
/// histogram, so a `500` and a `429` each kept the token they owe. Now each takes its
/// token, and the retry it allowed, never sent (the panic ended the operation), is counted
/// abandoned.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn a_recorder_panicking_on_the_round_trip_still_tells_the_budget_of_a_failure() {
    use futures::FutureExt;
    use std::panic::AssertUnwindSafe;

    let recorder = crate::support::TestRecorder::default();
    let (budget, policy) = recorder.retry_policy("fail", backoff());
    recorder.panic_on("flowgate_retry_attempt_seconds{name=fail}", true);

    for status in [500, 429] {
        let panicked = AssertUnwindSafe(retry(&policy, classify, |_| async move { Ok(status) }))
            .catch_unwind()
            .await;
        assert!(panicked.is_err(), "the recorder panicked on {status}");
    }
    // A token for each failure; each allowed a retry the panic kept from being sent.
    let stats = budget.stats();
    assert_eq!(
        (budget.tokens(), stats.allowed, stats.abandoned),
        (8.0, 2, 2)
    );
}

/// A metrics recorder that panics as the pacer counts a back-pressure cut (the pacer's
/// metrics are user code) must not keep the failure from the budget: the pacer heard of the
/// attempt first, and its panic skipped the schedule, where the budget hears of a failure,
/// so a `429` kept the token it owes. It now takes its token, and the retry it allowed,
/// never sent, is counted abandoned.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn a_recorder_panicking_on_the_pacers_cut_still_tells_the_budget_of_a_failure() {
    use futures::FutureExt;
    use std::panic::AssertUnwindSafe;

    let recorder = crate::support::TestRecorder::default();
    let (budget, pacer, policy) = metrics::with_local_recorder(&recorder, || {
        let budget = RetryBudget::builder().name("cut").build().unwrap();
        let pacer = AdaptivePacer::builder(Rate::per_second(100).unwrap())
            .name("cut")
            .build()
            .unwrap();
        let policy = RetryPolicy::builder(backoff())
            .name("cut")
            .budget(budget.clone())
            .pacer(pacer.clone())
            .build()
            .unwrap();
        (budget, pacer, policy)
    });
    recorder.panic_on("flowgate_pace_adaptive_cuts_total{name=cut}", true);
    let panicked = AssertUnwindSafe(retry(&policy, classify, |_| async { Ok(429) }))
        .catch_unwind()
        .await;
    assert!(panicked.is_err(), "the recorder panicked");
    assert_eq!(pacer.status().cuts, 1, "the pacer cut its rate");
    let stats = budget.stats();
    assert_eq!(
        (budget.tokens(), stats.allowed, stats.abandoned),
        (9.0, 1, 1),
        "the failure took its token; the retry it allowed was never made"
    );
}

/// A metrics recorder that panics on the budget's `allowed` counter ends the operation
/// before the retry is sent, and before `retry()` knows it was allowed: the budget must not
/// count a retry allowed that was neither made nor abandoned (`allowed − abandoned` is the
/// retries made). The failure still takes its token, as one not retried does.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn a_recorder_panicking_on_an_allowed_retry_leaves_no_retry_unaccounted() {
    use futures::FutureExt;
    use std::panic::AssertUnwindSafe;

    let recorder = crate::support::TestRecorder::default();
    let (budget, policy) = recorder.retry_policy("allow", backoff());
    recorder.panic_on(
        "flowgate_retry_budget_retries_total{name=allow,outcome=allowed}",
        true,
    );
    let calls = AtomicU32::new(0);
    let panicked = AssertUnwindSafe(retry(&policy, classify, |_| {
        calls.fetch_add(1, Ordering::Relaxed);
        async { Ok(500) }
    }))
    .catch_unwind()
    .await;
    assert!(panicked.is_err(), "the recorder panicked");
    assert_eq!(calls.load(Ordering::Relaxed), 1, "no retry was made");
    let stats = budget.stats();
    assert_eq!(
        stats.allowed - stats.abandoned,
        0,
        "retries made: none ({stats:?})"
    );
    assert_eq!(budget.tokens(), 9.0, "the failure took its token");
}

/// A metrics recorder that panics as a dropped `retry()` counts the retry it abandons still
/// lets the drop be counted as a `cancelled` stop: each count runs, then the panic goes on.
/// (The abandoned count's panic skipped the stop: a drop counted nowhere.)
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn a_recorder_panicking_on_an_abandoned_retry_still_counts_the_cancelled_stop() {
    use futures::FutureExt;
    use std::panic::AssertUnwindSafe;

    let recorder = crate::support::TestRecorder::default();
    let (budget, policy) = recorder.retry_policy("abandon", backoff());
    let abandoned = "flowgate_retry_budget_abandoned_total{name=abandon}";
    let mut op = Box::pin(retry(&policy, classify, |_| async { Ok(500) }));
    // The first attempt failed: the retry is allowed, and waits for its 100 ms backoff.
    assert!((&mut op).now_or_never().is_none());
    recorder.panic_on(abandoned, true);
    let dropped = std::panic::catch_unwind(AssertUnwindSafe(|| drop(op)));
    recorder.panic_on(abandoned, false);
    assert!(dropped.is_err(), "the recorder's panic goes on");
    let stats = budget.stats();
    assert_eq!((stats.allowed, stats.abandoned), (1, 1));
    assert_eq!(
        recorder.counter("flowgate_retry_stopped_total{name=abandon,stop=cancelled}"),
        1,
        "the drop counted"
    );
}

/// A `Retry-After: 0` says "now": the retry goes at once, and the pacer hears of it as of
/// back-pressure without a hint (a cut), not as a pause. A zero pause paused nothing, yet
/// it was counted (`pauses`, `paused_until`) and took the pacer's burst, holding the next
/// requests to one at a time as a real pause does when it ends.
#[tokio::test(start_paused = true)]
async fn a_retry_after_of_zero_retries_at_once_without_pausing_the_pacer() {
    let pacer = || {
        AdaptivePacer::builder(Rate::per_second(1_000).unwrap())
            .build()
            .unwrap()
    };
    let (zero, none) = (pacer(), pacer());
    let policy = RetryPolicy::builder(backoff())
        .pacer(zero.clone())
        .build()
        .unwrap();
    let start = Instant::now();
    let done = retry(
        &policy,
        |r: &Result<u16, &str>| match r {
            Ok(200) => Outcome::Success,
            _ => Outcome::BackPressure {
                retry_after: Some(Duration::ZERO),
            },
        },
        |attempt| async move { Ok(if attempt == 1 { 429 } else { 200 }) },
    )
    .await;
    assert_eq!((done.attempts, done.stop), (2, Stop::Success));
    assert_eq!(start.elapsed(), Duration::ZERO);
    // The same attempts told to the other pacer, as back-pressure without a hint.
    let _ = none.until_ready(1).await;
    none.on_back_pressure(None);
    let _ = none.until_ready(1).await;
    none.on_success();
    let (z, n) = (zero.status(), none.status());
    assert_eq!((z.pauses, z.paused_until), (0, None), "{z:?}");
    assert_eq!(z, n);
    // The next ten requests pass alike, side by side.
    let ten = |pacer: AdaptivePacer| {
        tokio::spawn(async move {
            let mut times = Vec::new();
            for _ in 0..10 {
                let _ = pacer.until_ready(1).await;
                times.push(start.elapsed());
            }
            times
        })
    };
    let (z, n) = (ten(zero), ten(none));
    assert_eq!(z.await.unwrap(), n.await.unwrap());
}
