//! `retry`'s error says why the retries stopped and how many attempts were made, for each
//! stop: the attempts used up, the deadline, the budget, a fatal error, a timeout.

use std::time::Duration;

use flowgate::retry::{
    Backoff, GiveUp, Jitter, Outcome, RetryBudget, RetryError, RetryPolicy, Stop, retry,
};

const MS: Duration = Duration::from_millis(1);

/// An error is retried, except `"bad"`, which is fatal.
fn classify(r: &Result<u16, &'static str>) -> Outcome {
    match r {
        Ok(_) => Outcome::Success,
        Err("bad") => Outcome::Fatal,
        Err(_) => Outcome::Retry,
    }
}

/// No jitter: 100 ms, 200 ms, 400 ms, ...; at most `attempts` attempts.
fn backoff(attempts: u32) -> Backoff {
    Backoff::builder()
        .base(100 * MS)
        .jitter(Jitter::None)
        .max_attempts(attempts)
        .seed(1)
        .build()
        .unwrap()
}

/// `retry` with `policy` of an operation that always fails with `error`: its error.
async fn fail(policy: &RetryPolicy, error: &'static str) -> RetryError<&'static str> {
    retry(policy, classify, |_| async move { Err::<u16, _>(error) })
        .await
        .into_result()
        .unwrap_err()
}

#[tokio::test(start_paused = true)]
async fn attempts_used_up() {
    let policy = RetryPolicy::builder(backoff(5)).build().unwrap();
    let err = fail(&policy, "reset").await;
    assert_eq!(err.stop(), Stop::GaveUp(GiveUp::Attempts { attempts: 5 }));
    assert_eq!(err.attempts(), 5);
    assert_eq!(err.to_string(), "gave up after 5 attempts: reset");
    assert_eq!(err.inner(), Some(&"reset"));
    assert_eq!(err.into_inner(), Some("reset"));
}

#[tokio::test(start_paused = true)]
async fn deadline_reached() {
    // Attempts at 0 and 100 ms; the next would start at 300 ms, past the deadline.
    let backoff = Backoff::builder()
        .base(100 * MS)
        .jitter(Jitter::None)
        .deadline(250 * MS)
        .seed(1)
        .build()
        .unwrap();
    let policy = RetryPolicy::builder(backoff).build().unwrap();
    let err = fail(&policy, "reset").await;
    assert_eq!(
        err.stop(),
        Stop::GaveUp(GiveUp::Deadline {
            elapsed: 100 * MS,
            deadline: 250 * MS,
            delay: 200 * MS,
        })
    );
    assert_eq!(err.attempts(), 2);
    assert_eq!(
        err.to_string(),
        "gave up: waiting 200ms after 100ms would reach the deadline of 250ms (2 attempts): reset"
    );
    assert_eq!(err.into_inner(), Some("reset"));
}

#[tokio::test(start_paused = true)]
async fn budget_empty() {
    // 3 tokens: the first failure leaves 2 (a retry), the second 1 (no more).
    let budget = RetryBudget::new(3, 0.1).unwrap();
    let policy = RetryPolicy::builder(backoff(5))
        .budget(budget)
        .build()
        .unwrap();
    let err = fail(&policy, "reset").await;
    assert_eq!(err.stop(), Stop::Budget);
    assert_eq!(err.attempts(), 2);
    assert_eq!(
        err.to_string(),
        "retry budget exhausted (2 attempts): reset"
    );
    assert_eq!(err.into_inner(), Some("reset"));
}

#[tokio::test(start_paused = true)]
async fn classified_fatal() {
    let policy = RetryPolicy::builder(backoff(5)).build().unwrap();
    let err = fail(&policy, "bad").await;
    assert_eq!(err.stop(), Stop::Fatal);
    assert_eq!(err.attempts(), 1);
    assert_eq!(err.to_string(), "fatal, not retried (1 attempt): bad");
    assert_eq!(err.into_inner(), Some("bad"));
}

#[tokio::test(start_paused = true)]
async fn last_attempt_timed_out() {
    let policy = RetryPolicy::builder(backoff(2))
        .attempt_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let err = retry(&policy, classify, |_| {
        std::future::pending::<Result<u16, &str>>()
    })
    .await
    .into_result()
    .unwrap_err();
    assert_eq!(err.stop(), Stop::TimedOut);
    assert_eq!(err.attempts(), 2);
    assert_eq!(err.to_string(), "the last of 2 attempts timed out");
    assert_eq!(err.into_inner(), None);
}

/// The reasons read the same in the error, in `Retried` and in `Stop`'s own `Display`.
#[test]
fn stops_display_in_lowercase_without_a_period() {
    for stop in [
        Stop::Success,
        Stop::Fatal,
        Stop::GaveUp(GiveUp::Attempts { attempts: 3 }),
        Stop::Budget,
        Stop::TimedOut,
        Stop::NotRetryable,
    ] {
        let s = stop.to_string();
        assert!(!s.is_empty() && !s.ends_with('.'), "{s:?}");
        assert_eq!(s, s.to_lowercase(), "{s:?}");
    }
}

/// What anyhow's `{:#}` and eyre print: each error of the `source()` chain, joined by `: `.
fn report(err: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![err.to_string()];
    let mut cur = err.source();
    while let Some(e) = cur {
        parts.push(e.to_string());
        cur = e.source();
    }
    parts.join(": ")
}

/// The connection failed, because of a [`Root`].
#[derive(Debug)]
struct Connect(Root);

#[derive(Debug)]
struct Root;

impl std::fmt::Display for Connect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connect failed")
    }
}

impl std::error::Error for Connect {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

impl std::fmt::Display for Root {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection refused")
    }
}

impl std::error::Error for Root {}

/// The last attempt's error (with a cause of its own) and the reason are each printed once
/// by a reporter that walks `source()`, and the chain still reaches the root cause; the
/// error itself is `inner()`. No attempt sent, or the last one timed out: once too.
#[tokio::test(start_paused = true)]
async fn a_reporter_walking_the_chain_prints_each_message_once() {
    let policy = RetryPolicy::builder(backoff(2)).build().unwrap();
    let err = retry(
        &policy,
        |_: &Result<(), Connect>| Outcome::Retry,
        |_| async { Err(Connect(Root)) },
    )
    .await
    .into_result()
    .unwrap_err();
    assert_eq!(err.to_string(), "gave up after 2 attempts: connect failed");
    assert_eq!(
        report(&err),
        "gave up after 2 attempts: connect failed: connection refused",
        "{err:?}"
    );
    let root = std::error::Error::source(&err).expect("the root cause");
    assert!(root.is::<Root>(), "{root:?}");
    assert!(err.inner().is_some());

    let not_sent = RetryError::<Connect>::NotSent(GiveUp::Attempts { attempts: 0 });
    assert_eq!(report(&not_sent), not_sent.to_string());
    let timed_out = RetryError::<Connect>::TimedOut { attempts: 1 };
    assert_eq!(report(&timed_out), "the only attempt timed out");
}
