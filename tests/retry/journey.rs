//! A team's polite outbound client against misbehaving downstreams: `RetryLayer` (backoff,
//! budget, adaptive pacer, metrics) around hyper's pooled client, against real servers on
//! 127.0.0.1 (raw HTTP/1.1 over TCP, so they can refuse, reset, stall a body or answer
//! with any field). Real time: counts are asserted exactly, waits by lower bounds (a wait
//! never ends early) and generous upper bounds. What the client says it did (its answer,
//! its error, its metrics, its budget) is checked against what the server saw.

use std::time::Duration;

use flowgate::Rate;
use flowgate::pace::AdaptivePacer;
use flowgate::retry::{
    Backoff, GiveUp, HttpClassify, Retry, RetryBudget, RetryError, RetryInfo, RetryLayer,
    RetryPolicy, Stop,
};
use http::{Method, Response, StatusCode};
use hyper::body::Incoming;
use tokio::time::Instant;
use tower::{Layer, ServiceExt};

use crate::raw_http::{Act, Hyper, RawServer, answer, backoff, hyper, ok, request};
use crate::support::TestRecorder;

const SECOND: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

/// A client over hyper with a budget of `tokens` and a policy over `backoff`, both named
/// `name` and recorded by `recorder`.
fn client(
    recorder: &TestRecorder,
    name: &str,
    tokens: u32,
    backoff: Backoff,
) -> (Retry<Hyper, HttpClassify>, RetryBudget) {
    let (budget, policy) = metrics::with_local_recorder(recorder, || {
        let budget = RetryBudget::builder()
            .name(name)
            .max_tokens(tokens)
            .build()
            .unwrap();
        let policy = RetryPolicy::builder(backoff)
            .name(name)
            .budget(budget.clone())
            .build()
            .unwrap();
        (budget, policy)
    });
    (RetryLayer::new(policy).layer(hyper()), budget)
}

fn info(res: &Response<Incoming>) -> RetryInfo {
    res.extensions().get::<RetryInfo>().cloned().unwrap()
}

fn attempts(recorder: &TestRecorder, name: &str) -> u64 {
    recorder.counter(&format!("flowgate_retry_attempts_total{{name={name}}}"))
}

fn stopped(recorder: &TestRecorder, name: &str, stop: &str) -> u64 {
    recorder.counter(&format!(
        "flowgate_retry_stopped_total{{name={name},stop={stop}}}"
    ))
}

/// Every `stop` label of `flowgate_retry_stopped_total`.
pub(crate) use crate::support::RETRY_STOPS as STOPS;

/// A generous bound on one scenario.
async fn within<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(30 * SECOND, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: still running after 30 s"))
}

/// `n` concurrent `GET`s to `server` through `client`, each ending with a response of
/// `status` and `stop`: the attempts they made together.
async fn concurrently(
    client: &Retry<Hyper, HttpClassify>,
    n: usize,
    server: &RawServer,
    status: StatusCode,
    stop: Stop,
) -> u32 {
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let client = client.clone();
        let url = server.url();
        tasks.spawn(async move { client.oneshot(request(Method::GET, &url)).await });
    }
    let mut made = 0;
    while let Some(res) = tasks.join_next().await {
        let res = res.unwrap().unwrap();
        assert_eq!(res.status(), status);
        let info = info(&res);
        assert_eq!(info.stop, stop);
        made += info.attempts;
    }
    made
}

/// Whether `err`'s source chain holds an I/O error of `kind`.
fn caused_by(err: &(dyn std::error::Error + 'static), kind: std::io::ErrorKind) -> bool {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == kind)
        {
            return true;
        }
        cur = e.source();
    }
    false
}

/// A server that accepts, then resets every connection without answering: a `GET` is
/// tried its attempts, and the error says so; the server saw each attempt, and the
/// metrics count the same.
#[tokio::test]
async fn a_server_that_resets_every_connection() {
    let server = RawServer::start(|_| Act::Reset).await;
    let recorder = TestRecorder::default();
    let (client, _) = client(&recorder, "reset", 10, backoff(4));
    let err = within("get", client.oneshot(request(Method::GET, &server.url())))
        .await
        .unwrap_err();
    assert_eq!(
        (err.stop(), err.attempts()),
        (Stop::GaveUp(GiveUp::Attempts { attempts: 4 }), 4)
    );
    assert!(
        err.to_string().starts_with("gave up after 4 attempts: "),
        "{err}"
    );
    assert_eq!(server.calls(), 4);
    assert_eq!(attempts(&recorder, "reset"), 4);
    assert_eq!(stopped(&recorder, "reset", "gave_up"), 1);
}

/// Connection refused (nothing listens): a `GET` is tried its attempts and gives up, a
/// `POST` once (documented: a transport error is retried for the idempotent methods only);
/// the caller's error says why it stopped, after how many attempts, and its source chain
/// reaches the refusal. Each attempt counts once in the metrics, and in the budget.
#[tokio::test]
async fn connection_refused() {
    let refused = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        format!("http://{addr}/")
    };
    let recorder = TestRecorder::default();
    for (method, tries, stop) in [
        (
            Method::GET,
            3,
            Stop::GaveUp(GiveUp::Attempts { attempts: 3 }),
        ),
        (Method::POST, 1, Stop::NotRetryable),
    ] {
        let name = method.as_str().to_lowercase();
        let (client, budget) = client(&recorder, &name, 10, backoff(3));
        let err = within(&name, client.oneshot(request(method.clone(), &refused)))
            .await
            .unwrap_err();
        assert_eq!((err.stop(), err.attempts()), (stop, tries), "{method}");
        assert!(matches!(err, RetryError::Inner { .. }), "{method}: {err:?}");
        assert!(
            caused_by(&err, std::io::ErrorKind::ConnectionRefused),
            "{method}: {err:?}"
        );
        assert_eq!(attempts(&recorder, &name), u64::from(tries), "{method}");
        assert_eq!(budget.tokens(), 10.0 - f64::from(tries), "{method}");
        let stop_label = if tries == 1 {
            "not_retryable"
        } else {
            "gave_up"
        };
        assert_eq!(stopped(&recorder, &name, stop_label), 1, "{method}");
    }
}

/// A burst of `503`s with `Retry-After: 1` to eight concurrent `GET`s sharing a budget and
/// an adaptive pacer, then recovery: every request ends with the `200` after two attempts,
/// each retry no sooner than the server asked; the attempts the server saw, the metrics
/// (attempts, round trips, the pacer's releases), the `RetryInfo`s and the budget's
/// retries made (`allowed − abandoned`) all agree; the burst is one congestion epoch for
/// the pacer's pauses (one per refusal).
#[tokio::test]
async fn a_503_burst_then_recovery_every_count_agrees_with_the_server() {
    let server = RawServer::start(|n| match n {
        1..=8 => answer(503, &[("retry-after", "1")]),
        _ => ok(),
    })
    .await;
    let recorder = TestRecorder::default();
    let (budget, pacer, policy) = metrics::with_local_recorder(&recorder, || {
        let budget = RetryBudget::builder()
            .name("burst")
            .max_tokens(20)
            .build()
            .unwrap();
        let pacer = AdaptivePacer::builder(Rate::per_second(1_000).unwrap())
            .name("burst")
            .build()
            .unwrap();
        let policy = RetryPolicy::builder(backoff(5))
            .name("burst")
            .budget(budget.clone())
            .pacer(pacer.clone())
            .build()
            .unwrap();
        (budget, pacer, policy)
    });
    let client = RetryLayer::new(policy).layer(hyper());
    let made = concurrently(&client, 8, &server, StatusCode::OK, Stop::Success).await;
    assert_eq!(made, 16);
    assert_eq!(server.calls(), 16);
    assert_eq!(attempts(&recorder, "burst"), 16);
    assert_eq!(
        recorder
            .samples("flowgate_retry_attempt_seconds{name=burst}")
            .len(),
        16
    );
    assert_eq!(
        recorder.counter("flowgate_pace_released_total{name=burst}"),
        16
    );
    assert_eq!(stopped(&recorder, "burst", "success"), 8);
    let stats = budget.stats();
    assert_eq!(stats.allowed - stats.abandoned, 8, "{stats:?}");
    // A cut per congestion epoch: the first refusals' one, and one more for each first
    // attempt the pause held (the pacer's burst is 6) until the server refused it too
    // (each refusal pauses every request, the retries behind it included).
    let status = pacer.status();
    assert_eq!(status.pauses, 8, "{status:?}");
    assert!((1..=3).contains(&status.cuts), "{status:?}");
    // Each retry came a second or more after the first refusal.
    let seen = server.seen();
    let first = seen[0].at;
    assert!(
        seen[8..].iter().all(|s| s.at - first >= SECOND - 20 * MS),
        "{seen:?}"
    );
}

/// Fifty concurrent `GET`s against a downstream that fails every attempt (`500`): the
/// budget's promise holds across them (at most `max_tokens / 2` retries with no success:
/// 4 of 10 tokens), so the server sees 54 requests, the metrics count 54 attempts, and
/// every request ends with the `500`, the budget or the attempts named as the reason.
#[tokio::test]
async fn a_failing_downstream_gets_no_more_retries_than_the_budget_promises() {
    let server = RawServer::start(|_| answer(500, &[])).await;
    let recorder = TestRecorder::default();
    let (client, budget) = client(&recorder, "storm", 10, backoff(3));
    let made = concurrently(
        &client,
        50,
        &server,
        StatusCode::INTERNAL_SERVER_ERROR,
        Stop::Budget,
    )
    .await;
    assert_eq!(made, 54);
    assert_eq!(server.calls(), 54);
    assert_eq!(attempts(&recorder, "storm"), 54);
    assert_eq!(stopped(&recorder, "storm", "budget"), 50);
    let stats = budget.stats();
    assert_eq!((stats.allowed, stats.refused, stats.abandoned), (4, 50, 0));
    assert_eq!(budget.tokens(), 0.0);
}

/// A `503` whose body stalls after ten bytes: the refusal is retried when its
/// `Retry-After` has passed, not held by the body that never ends; the stalled body is
/// dropped with its connection.
#[tokio::test]
async fn a_refusal_whose_body_stalls_does_not_hold_the_retry() {
    let server = RawServer::start(|n| match n {
        1 => Act::StallBody {
            status: 503,
            fields: vec![("retry-after", "1".to_owned())],
        },
        _ => ok(),
    })
    .await;
    let recorder = TestRecorder::default();
    let (client, _) = client(&recorder, "stall", 10, backoff(3));
    let start = Instant::now();
    let res = within("get", client.oneshot(request(Method::GET, &server.url())))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(info(&res).attempts, 2);
    assert!(start.elapsed() >= SECOND, "{:?}", start.elapsed());
    assert!(start.elapsed() < 5 * SECOND, "{:?}", start.elapsed());
    assert_eq!(server.calls(), 2);
}

/// Dropped mid-backoff (the caller's own timeout, during a `Retry-After: 2`): nothing is
/// sent afterwards; the one attempt counts once, the drop once (`cancelled`), the allowed
/// retry as abandoned, and its token stays taken.
#[tokio::test]
async fn dropped_mid_backoff_sends_nothing_more_and_loses_no_count() {
    let server = RawServer::start(|_| answer(503, &[("retry-after", "2")])).await;
    let recorder = TestRecorder::default();
    let (client, budget) = client(&recorder, "drop", 10, backoff(5));
    let dropped = tokio::time::timeout(
        500 * MS,
        client.oneshot(request(Method::GET, &server.url())),
    )
    .await;
    assert!(dropped.is_err(), "still waiting when dropped");
    tokio::time::sleep(2500 * MS).await;
    assert_eq!(server.calls(), 1, "nothing sent after the drop");
    assert_eq!(attempts(&recorder, "drop"), 1);
    assert_eq!(stopped(&recorder, "drop", "cancelled"), 1);
    let stats = budget.stats();
    assert_eq!((stats.allowed, stats.abandoned), (1, 1));
    assert_eq!(budget.tokens(), 9.0);
}

/// A `429` without `Retry-After` whose `RateLimit` fields say nothing is left until a reset
/// 1 s away: the retry waits for the reset, and after it the server's `200` is the answer.
/// The pacer heard the fields of both responses.
#[tokio::test]
async fn a_429_with_ratelimit_fields_waits_the_reset_then_recovers() {
    let server = RawServer::start(|n| match n {
        1 => answer(
            429,
            &[
                ("ratelimit-policy", r#""p";q=5;w=1"#),
                ("ratelimit", r#""p";r=0;t=1"#),
            ],
        ),
        _ => Act::Answer {
            status: 200,
            fields: vec![
                ("ratelimit-policy", r#""p";q=5;w=1"#.to_owned()),
                ("ratelimit", r#""p";r=4;t=1"#.to_owned()),
            ],
            body: "ok",
        },
    })
    .await;
    let pacer = AdaptivePacer::builder(Rate::per_second(100).unwrap())
        .build()
        .unwrap();
    let policy = RetryPolicy::builder(backoff(3))
        .pacer(pacer.clone())
        .build()
        .unwrap();
    let client = RetryLayer::new(policy).layer(hyper());
    let start = Instant::now();
    let res = within("get", client.oneshot(request(Method::GET, &server.url())))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(info(&res).attempts, 2);
    let seen = server.seen();
    assert!(seen[1].at - seen[0].at >= SECOND - 20 * MS, "{seen:?}");
    assert!(start.elapsed() < 5 * SECOND);
    let status = pacer.status();
    assert_eq!(status.server_remaining, Some(4), "{status:?}");
    assert_eq!(status.server_policy, Some((5, SECOND)), "{status:?}");
    assert!(status.ceiling_per_second <= 5.0, "{status:?}");
}

/// A `POST`: retried after a `503` (documented: back-pressure in a response refused it
/// without acting on it), not after a `500` or a reset (it may have been acted on).
#[tokio::test]
async fn a_post_is_retried_after_a_503_only() {
    let recorder = TestRecorder::default();
    for (first, tries, stop) in [
        (answer(503, &[("retry-after", "0")]), 2, Stop::Success),
        (answer(500, &[]), 1, Stop::NotRetryable),
    ] {
        let server = RawServer::start(move |n| match n {
            1 => first.clone(),
            _ => ok(),
        })
        .await;
        let (client, _) = client(&recorder, "post", 10, backoff(3));
        let res = within("post", client.oneshot(request(Method::POST, &server.url())))
            .await
            .unwrap();
        let info = info(&res);
        assert_eq!((info.attempts, info.stop), (tries, stop));
        assert_eq!(server.calls(), tries as usize);
        assert!(server.seen().iter().all(|s| s.method == "POST"));
    }
}

/// Refusals with a short body are read during the wait, so hyper's pool reuses their
/// connection (documented on `RetryLayer`): five `503`s and the `200` on one connection.
#[tokio::test]
async fn refusals_do_not_cost_a_connection_each() {
    for retry_after in ["1", "0"] {
        let server = RawServer::start(move |n| match n {
            1..=4 => answer(503, &[("retry-after", retry_after)]),
            _ => ok(),
        })
        .await;
        let recorder = TestRecorder::default();
        let (client, _) = client(&recorder, "pool", 10, backoff(5));
        let res = within("get", client.oneshot(request(Method::GET, &server.url())))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(server.calls(), 5);
        assert_eq!(server.connections(), 1, "Retry-After: {retry_after}");
    }
}

/// 300 concurrent `GET`s and `POST`s on four threads sharing a budget and an adaptive
/// pacer, against a server answering `503` (`Retry-After: 0`), `500` and `200` by turns:
/// every count agrees with the server's: the attempts it read, the attempts metric, the
/// pacer's releases and the attempts the callers were told of; one stop per request; and
/// the attempts beyond the first of each request are the budget's retries made
/// (`allowed − abandoned`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_hundred_requests_on_four_threads_every_count_agrees() {
    let server = RawServer::start(|n| match n % 3 {
        0 => answer(503, &[("retry-after", "0")]),
        1 => answer(500, &[]),
        _ => ok(),
    })
    .await;
    let recorder = TestRecorder::default();
    let (budget, policy) = metrics::with_local_recorder(&recorder, || {
        let budget = RetryBudget::builder()
            .name("many")
            .max_tokens(100)
            .build()
            .unwrap();
        let pacer = AdaptivePacer::builder(Rate::per_second(2_000).unwrap())
            .name("many")
            .build()
            .unwrap();
        let policy = RetryPolicy::builder(backoff(4))
            .name("many")
            .budget(budget.clone())
            .pacer(pacer)
            .build()
            .unwrap();
        (budget, policy)
    });
    let client = RetryLayer::new(policy).layer(hyper());
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..300 {
        let client = client.clone();
        let url = server.url();
        let method = if i % 2 == 0 {
            Method::GET
        } else {
            Method::POST
        };
        tasks.spawn(async move { client.oneshot(request(method, &url)).await });
    }
    let mut told = 0;
    while let Some(res) = tasks.join_next().await {
        told += match res.unwrap() {
            Ok(res) => info(&res).attempts,
            Err(err) => err.attempts(),
        };
    }
    let made = attempts(&recorder, "many");
    assert_eq!(server.calls() as u64, made);
    assert_eq!(u64::from(told), made);
    assert_eq!(
        recorder.counter("flowgate_pace_released_total{name=many}"),
        made
    );
    let stops: u64 = STOPS
        .iter()
        .map(|stop| stopped(&recorder, "many", stop))
        .sum();
    assert_eq!(stops, 300);
    let stats = budget.stats();
    assert_eq!(made, 300 + stats.allowed - stats.abandoned, "{stats:?}");
}
