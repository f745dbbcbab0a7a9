//! Misbehaving downstreams as real servers on 127.0.0.1:0 (raw HTTP/1.1 over TCP, so they can
//! reset a connection mid-body or never answer), called by hyper's pooled client behind a
//! `RetryLayer`. Real time: only counts and lower bounds (a wait never ends early) are
//! asserted, and upper bounds as generous timeouts.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use flowgate::Rate;
use flowgate::pace::AdaptivePacer;
use flowgate::retry::{
    Backoff, GiveUp, HttpClassify, Retry, RetryError, RetryInfo, RetryLayer, RetryPolicy, Stop,
};
use http::{Method, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::time::Instant;
use tower::{Layer, ServiceExt};

use crate::raw_http::{Act, Hyper, RawServer, backoff, hyper, ok, request};

const SECOND: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

fn refuse(status: u16, retry_after: impl Into<String>) -> Act {
    Act::Answer {
        status,
        fields: vec![("retry-after", retry_after.into())],
        body: "busy",
    }
}

fn client(backoff: Backoff) -> Retry<Hyper, HttpClassify> {
    RetryLayer::new(RetryPolicy::builder(backoff).build().unwrap()).layer(hyper())
}

fn info(res: &Response<Incoming>) -> RetryInfo {
    res.extensions().get::<RetryInfo>().cloned().unwrap()
}

/// Writes a `Retry-After` HTTP-date when the refusal is sent.
type DateFn = Box<dyn Fn() -> String + Send + Sync>;

/// A generous bound on one request: none of these scenarios takes more than a few seconds.
async fn within<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(30 * SECOND, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: still running after 30 s"))
}

// ---- Retry-After, as delta-seconds and as HTTP-dates ----

/// `503` and `429` with `Retry-After: 1`: each retry comes no sooner than the server asked
/// (a wait never ends early, so the lower bound is exact), and the answer is the `200`.
#[tokio::test]
async fn retry_after_seconds_are_waited_for_between_real_requests() {
    let server = RawServer::start(|n| match n {
        1 => refuse(503, "1"),
        2 => refuse(429, "1"),
        _ => ok(),
    })
    .await;
    let res = within(
        "get",
        client(backoff(5)).oneshot(request(Method::GET, &server.url())),
    )
    .await
    .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(info(&res).attempts, 3);
    assert_eq!(info(&res).stop, Stop::Success);
    assert_eq!(server.calls(), 3);
    assert!(server.gap(0) >= SECOND, "{:?}", server.gap(0));
    assert!(server.gap(1) >= SECOND, "{:?}", server.gap(1));
}

/// `Retry-After` as an HTTP-date: one in the past retries at once, one 2 s ahead is waited
/// for (an HTTP-date has whole seconds: at least 1 s), a malformed one is ignored (the
/// backoff's 100 ms), and one ten years ahead gives up at once with `HintTooLong`, the
/// `429` as the answer.
#[tokio::test]
async fn retry_after_dates_past_future_malformed_and_absurd() {
    let year = 365 * 24 * 3600 * SECOND;
    let cases: Vec<(&str, DateFn, Option<Duration>)> = vec![
        (
            "past",
            Box::new(|| httpdate::fmt_http_date(SystemTime::now() - 3600 * SECOND)),
            Some(Duration::ZERO),
        ),
        (
            "2 s ahead",
            Box::new(|| httpdate::fmt_http_date(SystemTime::now() + 2 * SECOND)),
            Some(SECOND),
        ),
        (
            "malformed",
            Box::new(|| "Sun, 32 Foo 2026 25:61:61 GMT".to_owned()),
            Some(100 * MS),
        ),
        (
            "ten years ahead",
            Box::new(move || httpdate::fmt_http_date(SystemTime::now() + 10 * year)),
            None,
        ),
    ];
    for (what, date, waits) in cases {
        let date = Arc::new(date);
        let server = RawServer::start(move |n| match n {
            1 => refuse(429, date()),
            _ => ok(),
        })
        .await;
        let res = within(
            what,
            client(backoff(3)).oneshot(request(Method::GET, &server.url())),
        )
        .await
        .unwrap();
        match waits {
            Some(at_least) => {
                assert_eq!(res.status(), StatusCode::OK, "{what}");
                assert_eq!(server.calls(), 2, "{what}");
                assert!(server.gap(0) >= at_least, "{what}: {:?}", server.gap(0));
            }
            None => {
                assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS, "{what}");
                assert_eq!(server.calls(), 1, "{what}");
                let stop = info(&res).stop;
                assert!(
                    matches!(stop, Stop::GaveUp(GiveUp::HintTooLong { hint, max })
                        if hint > 9 * year && max == 60 * SECOND),
                    "{what}: {stop:?}"
                );
            }
        }
    }
}

/// A `Retry-After` that reaches the deadline gives up at once, without waiting for it.
#[tokio::test]
async fn a_retry_after_past_the_deadline_gives_up_at_once_on_a_real_server() {
    let server = RawServer::start(|n| match n {
        1 => refuse(503, "10"),
        _ => ok(),
    })
    .await;
    let backoff = Backoff::builder()
        .deadline(5 * SECOND)
        .seed(1)
        .build()
        .unwrap();
    let start = Instant::now();
    let res = within(
        "get",
        client(backoff).oneshot(request(Method::GET, &server.url())),
    )
    .await
    .unwrap();
    assert!(start.elapsed() < 5 * SECOND, "{:?}", start.elapsed());
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(matches!(
        info(&res).stop,
        Stop::GaveUp(GiveUp::Deadline { delay, .. }) if delay == 10 * SECOND
    ));
    assert_eq!(server.calls(), 1);
}

// ---- resets and silence ----

/// A connection reset before any answer: a `GET` is retried (up to its attempts), a `POST`
/// is not (it may have been acted on), and either way the error is the client's own.
#[tokio::test]
async fn a_reset_is_retried_for_a_get_and_not_for_a_post() {
    for (method, calls) in [(Method::GET, 3), (Method::PUT, 3), (Method::POST, 1)] {
        let server = RawServer::start(|_| Act::Reset).await;
        let err = within(
            method.as_str(),
            client(backoff(3)).oneshot(request(method.clone(), &server.url())),
        )
        .await
        .unwrap_err();
        assert!(matches!(err, RetryError::Inner { .. }), "{method}: {err:?}");
        let stop = match calls {
            1 => Stop::NotRetryable,
            _ => Stop::GaveUp(GiveUp::Attempts { attempts: 3 }),
        };
        assert_eq!(
            (err.stop(), err.attempts() as usize),
            (stop, calls),
            "{method}"
        );
        assert_eq!(server.calls(), calls, "{method}");
        assert!(server.seen().iter().all(|s| s.method == method.as_str()));
    }
}

/// A `503` whose body is cut by a reset is still a refusal: retried after its wait; the
/// reset body is dropped, not an error.
#[tokio::test]
async fn a_refusal_reset_mid_body_is_retried() {
    let server = RawServer::start(|n| match n {
        1 => Act::ResetMidBody { status: 503 },
        _ => ok(),
    })
    .await;
    let res = within(
        "get",
        client(backoff(3)).oneshot(request(Method::GET, &server.url())),
    )
    .await
    .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(info(&res).attempts, 2);
    assert_eq!(server.calls(), 2);
}

/// A `200` whose body is cut by a reset: the response was classified when its head came,
/// so it is the answer (one attempt), and the reset is the error its body gives.
#[tokio::test]
async fn a_success_reset_mid_body_is_the_answer_and_its_body_the_error() {
    let server = RawServer::start(|_| Act::ResetMidBody { status: 200 }).await;
    let res = within(
        "get",
        client(backoff(3)).oneshot(request(Method::GET, &server.url())),
    )
    .await
    .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(info(&res).attempts, 1);
    assert!(res.into_body().collect().await.is_err());
    assert_eq!(server.calls(), 1);
}

/// A server that never answers: with an attempt timeout, a `GET` is tried its attempts,
/// each timed out, and ends with `TimedOut`; a `POST` is tried once.
#[tokio::test]
async fn a_server_that_never_answers_ends_in_timed_out() {
    for (method, attempts) in [(Method::GET, 3), (Method::POST, 1)] {
        let server = RawServer::start(|_| Act::Hang).await;
        let policy = RetryPolicy::builder(backoff(3))
            .attempt_timeout(200 * MS)
            .build()
            .unwrap();
        let client = RetryLayer::new(policy).layer(hyper());
        let err = within(
            method.as_str(),
            client.oneshot(request(method.clone(), &server.url())),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(err, RetryError::TimedOut { attempts: a } if a == attempts),
            "{method}: {err:?}"
        );
        assert_eq!(server.calls(), attempts as usize, "{method}");
    }
}

// ---- RateLimit fields that lie ----

/// A server that sends its policy's window in milliseconds by mistake (`w=60000` meaning a
/// minute): to the client, 100 requests per 60 000 s, one per 600 s. Like an allowance
/// slower than one unit per `max_retry_after`, it holds no later request longer than a
/// `Retry-After` would (here 1 s), and the requests go on.
#[tokio::test]
async fn a_policy_slower_than_max_retry_after_holds_no_request_longer() {
    let server = RawServer::start(|_| Act::Answer {
        status: 200,
        fields: vec![("ratelimit-policy", r#""min";q=100;w=60000"#.to_owned())],
        body: "ok",
    })
    .await;
    let pacer = AdaptivePacer::builder(Rate::per_second(100).unwrap())
        .build()
        .unwrap();
    let backoff = Backoff::builder()
        .max_retry_after(SECOND)
        .seed(1)
        .build()
        .unwrap();
    let policy = RetryPolicy::builder(backoff)
        .pacer(pacer.clone())
        .build()
        .unwrap();
    let client = RetryLayer::new(policy).layer(hyper());
    for i in 0..4 {
        let res = within(
            &format!("request {i}"),
            client.clone().oneshot(request(Method::GET, &server.url())),
        )
        .await
        .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        let _ = res.into_body().collect().await;
    }
    assert_eq!(server.calls(), 4);
    // One unit per `max_retry_after` at the slowest, not one per 600 s.
    let status = pacer.status();
    assert!(status.ceiling_per_second >= 0.999, "{status:?}");
}
