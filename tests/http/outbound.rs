//! The outbound side over HTTP: `RetryLayer` around `tower::service_fn` servers under paused
//! time (Retry-After, deadline, methods, timeouts, RTT per attempt, clone-after-ready, the
//! server's fields fed to the pacer), and 8 real hyper clients with their own
//! `AdaptivePacer`s against flowgate's `RateLimitLayer` over real HTTP and real time.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::routing::get as route_get;
use bytes::Bytes;
use flowgate::gate::{Limit, MemoryGate};
use flowgate::http::{Constant, Policy, RateLimitLayer};
use flowgate::pace::AdaptivePacer;
use flowgate::retry::{
    Backoff, GiveUp, HttpClassify, Jitter, Retry, RetryBudget, RetryError, RetryInfo, RetryLayer,
    RetryPolicy, Stop,
};
use flowgate::{Quota, Rate};
use http::header::RETRY_AFTER;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt, service_fn};

use crate::harness::Server;

const SECOND: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

/// A backoff without jitter (100 ms, 200 ms, ...), `attempts` attempts at most.
fn backoff(attempts: u32) -> Backoff {
    Backoff::builder()
        .jitter(Jitter::None)
        .max_attempts(attempts)
        .seed(1)
        .build()
        .unwrap()
}

fn policy(backoff: Backoff) -> RetryPolicy {
    RetryPolicy::builder(backoff).build().unwrap()
}

/// A response with `status`, `body`, and a `Retry-After` of `retry_after` seconds.
fn answer(status: u16, body: String, retry_after: Option<&'static str>) -> Response<String> {
    let mut res = Response::new(body);
    *res.status_mut() = StatusCode::from_u16(status).unwrap();
    if let Some(secs) = retry_after {
        res.headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from_static(secs));
    }
    res
}

fn request(method: Method) -> Request<String> {
    Request::builder()
        .method(method)
        .uri("/")
        .body(String::new())
        .unwrap()
}

/// `svc` behind a `RetryLayer` (3 attempts) with an adaptive pacer of `per_second`, which
/// it feeds the server's fields; the client and the pacer.
fn paced<S>(per_second: u32, svc: S) -> (Retry<S, HttpClassify>, AdaptivePacer) {
    let pacer = AdaptivePacer::builder(Rate::per_second(per_second).unwrap())
        .build()
        .unwrap();
    let policy = RetryPolicy::builder(backoff(3))
        .pacer(pacer.clone())
        .build()
        .unwrap();
    (RetryLayer::new(policy).layer(svc), pacer)
}

fn info<B>(res: &Response<B>) -> RetryInfo {
    res.extensions().get::<RetryInfo>().cloned().unwrap()
}

/// A server answering `status(n)` to its n-th call (from 1); counts its calls and when
/// each came (since `start`).
#[derive(Clone)]
struct Scripted {
    calls: Arc<AtomicU32>,
    times: Arc<Mutex<Vec<Duration>>>,
    start: Instant,
}

impl Scripted {
    fn new() -> Scripted {
        Scripted {
            calls: Arc::new(AtomicU32::new(0)),
            times: Arc::new(Mutex::new(Vec::new())),
            start: Instant::now(),
        }
    }

    fn calls(&self) -> u32 {
        self.calls.load(Ordering::SeqCst)
    }

    fn times(&self) -> Vec<Duration> {
        self.times.lock().unwrap().clone()
    }

    /// A `service_fn` answering `script(n)` to the n-th call.
    fn service(
        &self,
        script: impl Fn(u32) -> Response<String> + Clone + Send + 'static,
    ) -> impl Service<Request<String>, Response = Response<String>, Error = Infallible> + Clone
    {
        let this = self.clone();
        service_fn(move |_req: Request<String>| {
            let n = this.calls.fetch_add(1, Ordering::SeqCst) + 1;
            this.times.lock().unwrap().push(this.start.elapsed());
            let res = script(n);
            async move { Ok::<_, Infallible>(res) }
        })
    }
}

// ---- the layer, paused time ----

#[tokio::test(start_paused = true)]
async fn retries_a_503_after_its_retry_after() {
    let server = Scripted::new();
    let svc = server.service(|n| match n {
        1 => answer(503, "busy".into(), Some("3")),
        _ => answer(200, format!("answer {n}"), None),
    });
    let client = RetryLayer::new(policy(backoff(5))).layer(svc);
    let res = client.oneshot(request(Method::GET)).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // The second attempt came exactly when the server said, not after the 100 ms backoff.
    assert_eq!(server.times(), [Duration::ZERO, 3 * SECOND]);
    let info = info(&res);
    assert_eq!((info.attempts, info.stop), (2, Stop::Success));
    assert_eq!(res.into_body(), "answer 2");
}

#[tokio::test(start_paused = true)]
async fn gives_up_past_the_deadline_returning_the_last_429() {
    let server = Scripted::new();
    let svc = server.service(|n| answer(429, format!("refusal {n}"), Some("2")));
    let backoff = Backoff::builder()
        .max_attempts(10)
        .deadline(5 * SECOND)
        .seed(1)
        .build()
        .unwrap();
    let client = RetryLayer::new(policy(backoff)).layer(svc);
    let start = Instant::now();
    let res = client.oneshot(request(Method::GET)).await.unwrap();
    // Attempts at 0, 2 and 4 s; waiting 2 s more would reach the deadline of 5 s: give up
    // at once, with the last refusal (its Retry-After intact).
    assert_eq!(start.elapsed(), 4 * SECOND);
    assert_eq!(server.times(), [Duration::ZERO, 2 * SECOND, 4 * SECOND]);
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(res.headers()[RETRY_AFTER], "2");
    let info = info(&res);
    assert_eq!(info.attempts, 3);
    assert!(
        matches!(info.stop, Stop::GaveUp(GiveUp::Deadline { delay, .. }) if delay == 2 * SECOND),
        "{:?}",
        info.stop
    );
    assert_eq!(res.into_body(), "refusal 3");
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_past_the_deadline_gives_up_at_once() {
    let server = Scripted::new();
    let svc = server.service(|_| answer(503, String::new(), Some("60")));
    let backoff = Backoff::builder()
        .deadline(30 * SECOND)
        .max_retry_after(120 * SECOND)
        .build()
        .unwrap();
    let client = RetryLayer::new(policy(backoff)).layer(svc);
    let start = Instant::now();
    let res = client.oneshot(request(Method::GET)).await.unwrap();
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(server.calls(), 1);
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(matches!(
        info(&res).stop,
        Stop::GaveUp(GiveUp::Deadline { .. })
    ));
}

/// The pacer's wait counts against the backoff's deadline, as the backoff's delay does. A
/// pacer that another request's `Retry-After: 30` paused holds a new request with a 10 s
/// deadline: it ends at once, sending nothing (`RetryError::NotSent`); and a retry the
/// pacer would hold past the deadline is not waited for: the last answer is returned at
/// once. Both waited the pacer out, 30 s, and sent their requests 20 s past the deadline.
#[tokio::test(start_paused = true)]
async fn the_pacer_s_wait_counts_against_the_deadline() {
    let pacer = AdaptivePacer::builder(Rate::per_second(100).unwrap())
        .build()
        .unwrap();
    let server = Scripted::new();
    // While the first request's attempt is under way, another request's
    // `Retry-After: 30` pauses the pacer.
    let other = pacer.clone();
    let svc = server.service(move |n| match n {
        1 => {
            other.on_back_pressure(Some(30 * SECOND));
            answer(500, "oops".into(), None)
        }
        _ => answer(200, format!("answer {n}"), None),
    });
    let backoff = Backoff::builder()
        .jitter(Jitter::None)
        .max_attempts(5)
        .deadline(10 * SECOND)
        .build()
        .unwrap();
    let policy = RetryPolicy::builder(backoff)
        .pacer(pacer.clone())
        .build()
        .unwrap();
    let client = RetryLayer::new(policy).layer(svc);

    // A retry the paused pacer would hold past the deadline.
    let start = Instant::now();
    let res = client.clone().oneshot(request(Method::GET)).await.unwrap();
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(server.calls(), 1);
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let stop = info(&res).stop;
    assert!(
        matches!(stop, Stop::GaveUp(GiveUp::Deadline { delay, .. }) if delay >= 30 * SECOND),
        "{stop:?}"
    );

    // A first attempt the paused pacer would hold past the deadline: none is sent.
    let err = client.oneshot(request(Method::GET)).await.unwrap_err();
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(server.calls(), 1);
    assert!(
        matches!(err, RetryError::NotSent(GiveUp::Deadline { delay, .. }) if delay >= 30 * SECOND),
        "{err:?}"
    );
    assert!(
        err.to_string().starts_with("no attempt was sent: "),
        "{err}"
    );
}

/// Every hostile `Retry-After` on a `503` ends in a clear outcome, at once or after a
/// bounded wait, never a hang or a panic: far too large (delta-seconds past `u64::MAX`, a
/// date in the year 9999) gives up with `HintTooLong` without waiting, and pauses the pacer
/// no longer than `max_retry_after`; negative or malformed is ignored (the backoff's
/// delay); a date in the past retries at once; a date 30 s ahead is waited for. With
/// `max_retry_after(Duration::MAX)`, a deadline still gives up at once, and without one the
/// wait is honoured as configured, capped at a century, without a panic.
#[tokio::test(start_paused = true)]
async fn hostile_retry_after_values_have_a_clear_outcome() {
    let soon = httpdate::fmt_http_date(std::time::SystemTime::now() + 30 * SECOND);
    let cases: [(String, Option<Duration>); 6] = [
        ("99999999999999999999999999".into(), None),
        ("Fri, 31 Dec 9999 23:59:59 GMT".into(), None),
        ("-5".into(), Some(100 * MS)),
        ("1e3".into(), Some(100 * MS)),
        ("Thu, 01 Jan 1970 00:00:00 GMT".into(), Some(Duration::ZERO)),
        (soon, Some(30 * SECOND)),
    ];
    for (value, waits) in cases {
        let server = Scripted::new();
        let header = HeaderValue::from_str(&value).unwrap();
        let svc = server.service(move |n| {
            let mut res = answer(if n == 1 { 503 } else { 200 }, String::new(), None);
            res.headers_mut().insert(RETRY_AFTER, header.clone());
            res
        });
        let (client, pacer) = paced(100, svc);
        let start = Instant::now();
        let res = client.oneshot(request(Method::GET)).await.unwrap();
        let elapsed = start.elapsed();
        let stop = info(&res).stop;
        match waits {
            None => {
                assert_eq!(elapsed, Duration::ZERO, "{value}");
                assert!(
                    matches!(stop, Stop::GaveUp(GiveUp::HintTooLong { max, .. }) if max == 60 * SECOND),
                    "{value}: {stop:?}"
                );
                // The pacer pauses the next requests no longer than `max_retry_after`.
                let until = pacer.status().paused_until.expect("paused");
                assert!(until <= Instant::now() + 60 * SECOND, "{value}");
            }
            Some(wait) => {
                assert_eq!(stop, Stop::Success, "{value}");
                assert_eq!(server.calls(), 2, "{value}");
                // An HTTP-date has whole seconds: up to 1 s less than asked.
                assert!(
                    elapsed <= wait && elapsed + SECOND > wait,
                    "{value}: waited {elapsed:?}"
                );
            }
        }
    }

    // `max_retry_after(Duration::MAX)`: the hint is honoured, bounded by a deadline...
    let huge = "99999999999999999999999999";
    for deadline in [Some(3600 * SECOND), None] {
        let mut b = Backoff::builder()
            .max_retry_after(Duration::MAX)
            .jitter(Jitter::None);
        if let Some(d) = deadline {
            b = b.deadline(d);
        }
        let pacer = AdaptivePacer::builder(Rate::per_second(100).unwrap())
            .build()
            .unwrap();
        let policy = RetryPolicy::builder(b.build().unwrap())
            .pacer(pacer)
            .build()
            .unwrap();
        let server = Scripted::new();
        let svc = server
            .service(move |n| answer(if n == 1 { 503 } else { 200 }, String::new(), Some(huge)));
        let client = RetryLayer::new(policy).layer(svc);
        let start = Instant::now();
        let res = client.oneshot(request(Method::GET)).await.unwrap();
        let stop = info(&res).stop;
        match deadline {
            Some(_) => {
                assert_eq!(start.elapsed(), Duration::ZERO);
                assert!(
                    matches!(stop, Stop::GaveUp(GiveUp::Deadline { .. })),
                    "{stop:?}"
                );
            }
            // ...and without one, waited (a century at most), as configured.
            None => {
                assert_eq!(stop, Stop::Success);
                assert!(start.elapsed() >= 30 * 365 * 24 * 3600 * SECOND);
                assert!(start.elapsed() <= 101 * 365 * 24 * 3600 * SECOND);
            }
        }
    }
}

/// A request body that counts its live copies (the original and every clone).
struct Counted(Arc<AtomicUsize>);

impl Counted {
    fn new(live: &Arc<AtomicUsize>) -> Counted {
        live.fetch_add(1, Ordering::SeqCst);
        Counted(live.clone())
    }
}

impl Clone for Counted {
    fn clone(&self) -> Counted {
        Counted::new(&self.0)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Each attempt sends a clone of the request's body; none outlives its attempt, and the
/// original goes with the future: however the request ends (an answer after retries, the
/// attempts run out, a timed-out attempt, dropped in a backoff or under way), no copy is
/// left. At most two copies live at once: the original and the attempt's.
#[tokio::test(start_paused = true)]
async fn request_bodies_cloned_for_retries_are_all_dropped() {
    let live = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    // Answers 503 (`Retry-After: 1`) to the first `fail` calls, then 200; a call with
    // `hang` never answers. Holds the body until it answers.
    let server = |fail: u32, hang: bool| {
        let (live, most) = (live.clone(), most.clone());
        let calls = Arc::new(AtomicU32::new(0));
        service_fn(move |req: Request<Counted>| {
            most.fetch_max(live.load(Ordering::SeqCst), Ordering::SeqCst);
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                if hang {
                    std::future::pending::<()>().await;
                }
                tokio::time::sleep(10 * MS).await;
                drop(req);
                Ok::<_, Infallible>(if n <= fail {
                    answer(503, String::new(), Some("1"))
                } else {
                    answer(200, String::new(), None)
                })
            }
        })
    };
    let req = || Request::get("/").body(Counted::new(&live)).unwrap();
    let timed = RetryPolicy::builder(backoff(3))
        .attempt_timeout(SECOND)
        .build()
        .unwrap();

    let res = RetryLayer::new(policy(backoff(5)))
        .layer(server(2, false))
        .oneshot(req())
        .await
        .unwrap();
    assert_eq!(info(&res).attempts, 3);
    assert_eq!(live.load(Ordering::SeqCst), 0, "after retries");

    let res = RetryLayer::new(policy(backoff(3)))
        .layer(server(9, false))
        .oneshot(req())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(live.load(Ordering::SeqCst), 0, "after giving up");

    let err = RetryLayer::new(timed)
        .layer(server(0, true))
        .oneshot(req())
        .await
        .unwrap_err();
    assert!(
        matches!(err, RetryError::TimedOut { attempts: 3 }),
        "{err:?}"
    );
    assert_eq!(live.load(Ordering::SeqCst), 0, "after timed-out attempts");

    for (at, what) in [(500 * MS, "in a backoff"), (5 * MS, "under way")] {
        let fut = RetryLayer::new(policy(backoff(5)))
            .layer(server(9, false))
            .oneshot(req());
        assert!(tokio::time::timeout(at, fut).await.is_err());
        assert_eq!(live.load(Ordering::SeqCst), 0, "dropped {what}");
    }
    assert_eq!(most.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn does_not_retry_a_post_on_500_by_default() {
    let always_500 = |_| answer(500, String::new(), None);

    // POST: the 500 is final.
    let server = Scripted::new();
    let client = RetryLayer::new(policy(backoff(3))).layer(server.service(always_500));
    let res = client.oneshot(request(Method::POST)).await.unwrap();
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(server.calls(), 1);
    assert_eq!(info(&res).stop, Stop::NotRetryable);

    // GET, idempotent: retried until the attempts run out.
    let server = Scripted::new();
    let client = RetryLayer::new(policy(backoff(3))).layer(server.service(always_500));
    let res = client.oneshot(request(Method::GET)).await.unwrap();
    assert_eq!(server.calls(), 3);
    assert_eq!(
        info(&res).stop,
        Stop::GaveUp(GiveUp::Attempts { attempts: 3 })
    );

    // POST with every method allowed: retried.
    let server = Scripted::new();
    let client = RetryLayer::new(policy(backoff(3)))
        .retry_any_method()
        .layer(server.service(always_500));
    client.oneshot(request(Method::POST)).await.unwrap();
    assert_eq!(server.calls(), 3);

    // PATCH not in an explicit list: final; PATCH in it: retried.
    let server = Scripted::new();
    let client = RetryLayer::new(policy(backoff(3)))
        .retry_methods([Method::GET])
        .layer(server.service(always_500));
    client.oneshot(request(Method::PATCH)).await.unwrap();
    assert_eq!(server.calls(), 1);
    let server = Scripted::new();
    let client = RetryLayer::new(policy(backoff(3)))
        .retry_methods([Method::PATCH])
        .layer(server.service(always_500));
    client.oneshot(request(Method::PATCH)).await.unwrap();
    assert_eq!(server.calls(), 3);

    // POST on back-pressure: the server refused it without acting on it, so it is retried.
    let server = Scripted::new();
    let svc = server.service(|n| match n {
        1 => answer(429, String::new(), Some("1")),
        _ => answer(201, String::new(), None),
    });
    let client = RetryLayer::new(policy(backoff(3))).layer(svc);
    let res = client.oneshot(request(Method::POST)).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(server.calls(), 2);
}

#[tokio::test(start_paused = true)]
async fn other_4xx_are_fatal_and_5xx_retried_with_the_backoff() {
    let server = Scripted::new();
    let svc = server.service(|n| match n {
        1 => answer(502, String::new(), None),
        2 => answer(504, String::new(), None),
        _ => answer(404, String::new(), None),
    });
    let client = RetryLayer::new(policy(backoff(10))).layer(svc);
    let res = client.oneshot(request(Method::GET)).await.unwrap();
    assert_eq!(res.status(), StatusCode::NOT_FOUND);
    // No Retry-After: the backoff's delays, 100 ms then 200 ms (no jitter).
    assert_eq!(server.times(), [Duration::ZERO, 100 * MS, 300 * MS]);
    let info = info(&res);
    assert_eq!((info.attempts, info.stop), (3, Stop::Fatal));
}

#[derive(Debug, PartialEq)]
struct Refused(u32);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "connection refused ({})", self.0)
    }
}

impl std::error::Error for Refused {}

#[tokio::test(start_paused = true)]
async fn transport_errors_are_retried_and_the_last_one_returned() {
    let calls = Arc::new(AtomicU32::new(0));
    let flaky = {
        let calls = calls.clone();
        service_fn(move |_req: Request<String>| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                if n < 3 {
                    Err(Refused(n))
                } else {
                    Ok(Response::new(String::from("ok")))
                }
            }
        })
    };
    let client = RetryLayer::new(policy(backoff(5))).layer(flaky);
    let res = client.oneshot(request(Method::GET)).await.unwrap();
    assert_eq!(info(&res).attempts, 3);

    let calls = Arc::new(AtomicU32::new(0));
    let down = {
        let calls = calls.clone();
        service_fn(move |_req: Request<String>| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            async move { Err::<Response<String>, _>(Refused(n)) }
        })
    };
    let client = RetryLayer::new(policy(backoff(4))).layer(down);
    let err = client.oneshot(request(Method::GET)).await.unwrap_err();
    assert!(
        matches!(
            err,
            RetryError::Inner {
                error: Refused(4),
                stop: Stop::GaveUp(GiveUp::Attempts { attempts: 4 }),
                attempts: 4,
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "gave up after 4 attempts: connection refused (4)"
    );
}

#[tokio::test(start_paused = true)]
async fn a_timed_out_attempt_is_back_pressure_and_the_last_one_an_error() {
    let calls = Arc::new(AtomicU32::new(0));
    let hangs = {
        let calls = calls.clone();
        service_fn(move |_req: Request<String>| {
            calls.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<Result<Response<String>, Infallible>>()
        })
    };
    let policy = RetryPolicy::builder(backoff(2))
        .attempt_timeout(SECOND)
        .build()
        .unwrap();
    let client = RetryLayer::new(policy).layer(hangs);
    let start = Instant::now();
    let err = client.oneshot(request(Method::GET)).await.unwrap_err();
    assert!(
        matches!(err, RetryError::TimedOut { attempts: 2 }),
        "{err:?}"
    );
    // 1 s, the 100 ms backoff, 1 s.
    assert_eq!(start.elapsed(), 2100 * MS);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn a_post_is_not_sent_again_after_a_timeout_or_a_500_but_the_budget_hears_it() {
    let calls = Arc::new(AtomicU32::new(0));
    let hangs = {
        let calls = calls.clone();
        service_fn(move |_req: Request<String>| {
            calls.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<Result<Response<String>, Infallible>>()
        })
    };
    let pacer = AdaptivePacer::builder(Rate::per_second(100).unwrap())
        .build()
        .unwrap();
    let budget = RetryBudget::new(10, 0.1).unwrap();
    let policy = RetryPolicy::builder(backoff(5))
        .attempt_timeout(SECOND)
        .pacer(pacer.clone())
        .budget(budget.clone())
        .build()
        .unwrap();
    let client = RetryLayer::new(policy).layer(hangs);
    let err = client.oneshot(request(Method::POST)).await.unwrap_err();
    assert!(
        matches!(err, RetryError::TimedOut { attempts: 1 }),
        "{err:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // The timeout was back-pressure for the pacer all the same, and a failed attempt, not
    // retried, for the budget (as a POST's 500 is below).
    assert_eq!(pacer.status().cuts, 1);
    assert_eq!(budget.tokens(), 9.0);

    let server = Scripted::new();
    let budget = RetryBudget::new(10, 0.1).unwrap();
    let policy = RetryPolicy::builder(backoff(5))
        .budget(budget.clone())
        .build()
        .unwrap();
    let client =
        RetryLayer::new(policy).layer(server.service(|_| answer(500, String::new(), None)));
    client.oneshot(request(Method::POST)).await.unwrap();
    assert_eq!(server.calls(), 1);
    assert_eq!(budget.tokens(), 9.0);
}

/// A classifier that calls a transport error back-pressure (a client's own timeout, as
/// `Outcome::BackPressure`'s docs list "a timeout"): the POST may have been acted on, as
/// after the layer's own attempt timeout, so it is not sent again; a GET is.
#[tokio::test(start_paused = true)]
async fn a_post_is_not_sent_again_after_a_transport_error_classified_as_back_pressure() {
    let classify = |r: &Result<Response<String>, Refused>| match r {
        Ok(res) => flowgate::retry::HttpClassify::new().outcome(res.status(), res.headers()),
        Err(_) => flowgate::retry::Outcome::BackPressure { retry_after: None },
    };
    let timing_out = |calls: &Arc<AtomicU32>| {
        let calls = calls.clone();
        service_fn(move |_req: Request<String>| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                if n == 1 {
                    Err(Refused(n))
                } else {
                    Ok(answer(201, String::new(), None))
                }
            }
        })
    };
    let pacer = AdaptivePacer::builder(Rate::per_second(100).unwrap())
        .build()
        .unwrap();
    let budget = RetryBudget::new(10, 0.1).unwrap();
    let policy = RetryPolicy::builder(backoff(3))
        .pacer(pacer.clone())
        .budget(budget.clone())
        .build()
        .unwrap();

    let calls = Arc::new(AtomicU32::new(0));
    let client = RetryLayer::new(policy.clone())
        .classify(classify)
        .layer(timing_out(&calls));
    let err = client.oneshot(request(Method::POST)).await.unwrap_err();
    assert!(
        matches!(
            err,
            RetryError::Inner {
                error: Refused(1),
                stop: Stop::NotRetryable,
                attempts: 1,
            }
        ),
        "{err:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the POST was sent again");
    // Back-pressure for the pacer all the same, and a failed attempt for the budget.
    assert_eq!(pacer.status().cuts, 1);
    assert_eq!(budget.tokens(), 9.0);

    // A GET is sent again.
    let calls = Arc::new(AtomicU32::new(0));
    let client = RetryLayer::new(policy)
        .classify(classify)
        .layer(timing_out(&calls));
    let res = client.oneshot(request(Method::GET)).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn the_budget_stops_retries_and_returns_the_last_response() {
    let server = Scripted::new();
    let svc = server.service(|_| answer(502, String::new(), None));
    // 4 tokens: one failure leaves 3 (> 2: retry), the second leaves 2 (refused).
    let policy = RetryPolicy::builder(backoff(10))
        .budget(RetryBudget::new(4, 0.1).unwrap())
        .build()
        .unwrap();
    let client = RetryLayer::new(policy).layer(svc);
    let res = client.oneshot(request(Method::GET)).await.unwrap();
    assert_eq!(res.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(server.calls(), 2);
    assert_eq!(info(&res).stop, Stop::Budget);
}

#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn rtt_is_recorded_per_attempt_not_across_the_retries() {
    use crate::support::TestRecorder;

    // Attempts take 100, 200 and 300 ms; the first two answer 503 with `Retry-After: 1`;
    // a pacer at 1/s adds its own waits before the attempts.
    let calls = Arc::new(AtomicU32::new(0));
    let slow = {
        let calls = calls.clone();
        service_fn(move |_req: Request<String>| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                tokio::time::sleep(100 * MS * n).await;
                Ok::<_, Infallible>(if n < 3 {
                    answer(503, String::new(), Some("1"))
                } else {
                    answer(200, String::new(), None)
                })
            }
        })
    };
    let recorder = TestRecorder::default();
    let pacer = AdaptivePacer::builder(Rate::per_second(1).unwrap())
        .build()
        .unwrap();
    let policy = metrics::with_local_recorder(&recorder, || {
        RetryPolicy::builder(backoff(5))
            .pacer(pacer.clone())
            .name("rtt")
            .build()
            .unwrap()
    });
    let client = RetryLayer::new(policy).layer(slow);
    let start = Instant::now();
    let res = client.oneshot(request(Method::GET)).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let total = start.elapsed();

    let samples = recorder.samples("flowgate_retry_attempt_seconds{name=rtt}");
    assert_eq!(samples.len(), 3, "{samples:?}");
    for (sample, want) in samples.iter().zip([0.1, 0.2, 0.3]) {
        // Each attempt alone (timer granularity: 1 ms), never the sequence so far.
        assert!(
            (want..want + 0.002).contains(sample),
            "{samples:?} (total {total:?})"
        );
    }
    assert!(total >= 2 * SECOND + 600 * MS, "{total:?}");
    // The pacer heard of the back-pressure: paused twice (Retry-After), cut once (one
    // congestion epoch per pause).
    let status = pacer.status();
    assert_eq!(status.pauses, 2);
    assert!(status.cuts >= 1);
}

#[tokio::test(start_paused = true)]
async fn the_server_fields_reach_the_pacer_on_every_response() {
    let server = Scripted::new();
    let svc = server.service(|_| {
        let mut res = answer(200, String::new(), None);
        let h = res.headers_mut();
        h.insert(
            "ratelimit-policy",
            HeaderValue::from_static(r#""global";q=50;w=2"#),
        );
        h.insert("ratelimit", HeaderValue::from_static(r#""global";r=7;t=1"#));
        res
    });
    let (client, pacer) = paced(1000, svc);
    client.oneshot(request(Method::GET)).await.unwrap();
    let status = pacer.status();
    assert_eq!(status.server_policy, Some((50, 2 * SECOND)));
    assert_eq!(status.server_remaining, Some(7));
    // Never faster than the server's sustained 25/s.
    assert!(status.ceiling_per_second <= 25.0, "{status:?}");
    assert!(pacer.rate().per_second_f64() <= 25.0, "{status:?}");
}

/// A policy of zero quota (`q=0`: nothing may be sent until its reset) beside another
/// policy: the other policy still caps the rate (the slowest was the zero one, which the
/// pacer ignored, so no policy reached it), and the next request waits for the zero
/// policy's reset (its `t`, else its window), not one unit of the other policy.
#[tokio::test(start_paused = true)]
async fn a_zero_quota_policy_holds_the_pacer_and_keeps_the_other_policies_caps() {
    for (ratelimit, hold) in [
        (None, 60 * SECOND),
        (Some(r#""closed";r=0;t=30"#), 30 * SECOND),
    ] {
        let server = Scripted::new();
        let svc = server.service(move |_| {
            let mut res = answer(200, String::new(), None);
            let h = res.headers_mut();
            h.insert(
                "ratelimit-policy",
                HeaderValue::from_static(r#""closed";q=0;w=60, "sec";q=10;w=1"#),
            );
            if let Some(field) = ratelimit {
                h.insert("ratelimit", HeaderValue::from_static(field));
            }
            res
        });
        let (client, pacer) = paced(1000, svc);
        client.clone().oneshot(request(Method::GET)).await.unwrap();
        let status = pacer.status();
        assert_eq!(status.server_policy, Some((10, SECOND)), "{ratelimit:?}");
        assert!(
            status.ceiling_per_second <= 10.0,
            "{ratelimit:?}: {status:?}"
        );
        client.oneshot(request(Method::GET)).await.unwrap();
        let times = server.times();
        let waited = times[1] - times[0];
        assert!(
            (hold..hold + SECOND).contains(&waited),
            "{ratelimit:?}: the second request after {waited:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_above_max_retry_after_does_not_pause_the_next_requests_longer() {
    // A server that asks for a day with `Retry-After`, then answers.
    let server = Scripted::new();
    let svc = server.service(|n| match n {
        1 => answer(429, String::new(), Some("86400")),
        _ => answer(200, String::new(), None),
    });
    let pacer = AdaptivePacer::builder(Rate::per_second(100).unwrap())
        .build()
        .unwrap();
    let backoff = Backoff::builder()
        .max_retry_after(60 * SECOND)
        .seed(1)
        .build()
        .unwrap();
    let policy = RetryPolicy::builder(backoff)
        .pacer(pacer.clone())
        .build()
        .unwrap();
    let client = RetryLayer::new(policy).layer(svc);
    let res = client.clone().oneshot(request(Method::GET)).await.unwrap();
    assert!(matches!(
        info(&res).stop,
        Stop::GaveUp(GiveUp::HintTooLong { .. })
    ));
    // The hint was refused as too long to wait for, so no later request waits for it
    // either: the next one waits no more than `max_retry_after`.
    let start = Instant::now();
    let next = tokio::time::timeout(120 * SECOND, client.oneshot(request(Method::GET))).await;
    assert!(next.is_ok(), "waited {:?} for the pacer", start.elapsed());
    assert!(start.elapsed() <= 60 * SECOND, "{:?}", start.elapsed());
}

/// A client over a server that says nothing remains for a day (`RateLimit`'s
/// `r=0;t=86400`) on its first answer, with `status` (`429`: its `retry_delay` is refused as
/// too long; or a success), then answers without fields; its backoff honours server hints
/// up to `max_retry_after`. After that first request, the next three each wait at most
/// `longest` for the pacer.
async fn a_day_with_nothing_left(status: u16, max_retry_after: Duration, longest: Duration) {
    let server = Scripted::new();
    let svc = server.service(move |n| {
        let mut res = answer(200, String::new(), None);
        if n == 1 {
            *res.status_mut() = StatusCode::from_u16(status).unwrap();
            res.headers_mut().insert(
                "ratelimit",
                HeaderValue::from_static(r#""day";r=0;t=86400"#),
            );
        }
        res
    });
    let pacer = AdaptivePacer::builder(Rate::per_second(100).unwrap())
        .build()
        .unwrap();
    let backoff = Backoff::builder()
        .max_retry_after(max_retry_after)
        .seed(1)
        .build()
        .unwrap();
    let policy = RetryPolicy::builder(backoff)
        .pacer(pacer.clone())
        .build()
        .unwrap();
    let client = RetryLayer::new(policy).layer(svc);
    client.clone().oneshot(request(Method::GET)).await.unwrap();
    for i in 0..3 {
        let start = Instant::now();
        let next =
            tokio::time::timeout(1_200 * SECOND, client.clone().oneshot(request(Method::GET)))
                .await;
        assert!(next.is_ok(), "{status} {i}: waited {:?}", start.elapsed());
        assert!(
            start.elapsed() <= longest,
            "{status} {i}: {:?}",
            start.elapsed()
        );
    }
    assert_eq!(server.calls(), 4);
}

#[tokio::test(start_paused = true)]
async fn a_ratelimit_reset_above_max_retry_after_does_not_hold_the_next_requests_longer() {
    // No later request waits longer than `max_retry_after` for the pacer, as for a
    // `Retry-After` of a day (before: one request per 1 000 s for the whole day); within a
    // tick of tokio's timer (1 ms: the pacer's deadline is a few ns past).
    for status in [429, 200] {
        a_day_with_nothing_left(status, 60 * SECOND, 60 * SECOND + MS).await;
    }
}

/// `max_retry_after(Duration::ZERO)` honours no server hint (a `Retry-After` of a day gives
/// up at once and pauses nothing): a `RateLimit` allowance of nothing for a day, on a `429`
/// or a success, holds the next requests no longer either (it held them for the day).
#[tokio::test(start_paused = true)]
async fn a_zero_max_retry_after_holds_no_request_for_a_ratelimit_reset() {
    // A unit or two of the pacer's rate (100/s, cut once by the 429): not held.
    for status in [429, 200] {
        a_day_with_nothing_left(status, Duration::ZERO, SECOND).await;
    }
}

/// A refusal with both `Retry-After` and a `RateLimit` reset further out (a sliding window
/// says when its quota is full again in `t`, and when this request fits in `Retry-After`):
/// `Retry-After` takes precedence, as the draft requires and `ServerHint::retry_delay`
/// says, so the retry goes after `Retry-After`, not after `t`.
#[tokio::test(start_paused = true)]
async fn retry_after_takes_precedence_over_a_later_ratelimit_reset() {
    for status in [429, 503] {
        let server = Scripted::new();
        let svc = server.service(move |n| {
            if n > 1 {
                return answer(200, String::new(), None);
            }
            let mut res = answer(status, String::new(), Some("1"));
            res.headers_mut().insert(
                "ratelimit",
                HeaderValue::from_static(r#""window";r=0;t=30"#),
            );
            res
        });
        let (client, _pacer) = paced(100, svc);
        let res = client.oneshot(request(Method::GET)).await.unwrap();
        assert_eq!(info(&res).stop, Stop::Success, "{status}");
        let times = server.times();
        let waited = times[1] - times[0];
        // Within a tick of tokio's timer past `Retry-After: 1`.
        assert!(
            waited >= SECOND && waited <= SECOND + MS,
            "{status}: the retry after {waited:?}"
        );
    }
}

/// A body of one chunk that notes when it was read to its end.
struct Watched {
    chunk: Option<Bytes>,
    ended: Arc<std::sync::atomic::AtomicBool>,
}

impl http_body::Body for Watched {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        match self.chunk.take() {
            Some(chunk) => Poll::Ready(Some(Ok(http_body::Frame::data(chunk)))),
            None => {
                self.ended.store(true, Ordering::SeqCst);
                Poll::Ready(None)
            }
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_refused_response_is_read_to_its_end_while_waiting() {
    let ended: Vec<Arc<std::sync::atomic::AtomicBool>> = (0..2).map(|_| Arc::default()).collect();
    let calls = Arc::new(AtomicU32::new(0));
    let svc = {
        let (ended, calls) = (ended.clone(), calls.clone());
        service_fn(move |_req: Request<String>| {
            let n = calls.fetch_add(1, Ordering::SeqCst) as usize;
            let body = Watched {
                chunk: Some(Bytes::from_static(b"{\"title\": \"too many requests\"}")),
                ended: ended[n].clone(),
            };
            let mut res = Response::new(body);
            if n == 0 {
                *res.status_mut() = StatusCode::TOO_MANY_REQUESTS;
                res.headers_mut()
                    .insert(RETRY_AFTER, HeaderValue::from_static("1"));
            }
            async move { Ok::<_, Infallible>(res) }
        })
    };
    let client = RetryLayer::new(policy(backoff(3))).layer(svc);
    let res = client.oneshot(request(Method::GET)).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // The 429's body was read (its connection could go back to a pool); the answer's is
    // the caller's, untouched.
    assert!(ended[0].load(Ordering::SeqCst));
    assert!(!ended[1].load(Ordering::SeqCst));
}

/// A body that always has a frame ready, an empty one (or trailers), and never ends; it
/// counts the frames read and panics past 1 000 000, as a reader that never stops.
struct Endless {
    frames: Arc<AtomicUsize>,
    trailers: bool,
}

impl http_body::Body for Endless {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        let n = self.frames.fetch_add(1, Ordering::SeqCst);
        assert!(n < 1_000_000, "the refused body is read for ever");
        Poll::Ready(Some(Ok(if self.trailers {
            http_body::Frame::trailers(http::HeaderMap::new())
        } else {
            http_body::Frame::data(Bytes::new())
        })))
    }
}

/// The refused response's body is read during the wait, up to 64 KiB: a body that never
/// runs out of frames, but whose frames carry no bytes (empty data frames, trailers), must
/// not hold the reader (and the task polling it) for ever.
#[tokio::test(start_paused = true)]
async fn a_refused_body_of_endless_empty_frames_is_dropped_not_read_for_ever() {
    for trailers in [false, true] {
        let frames = Arc::new(AtomicUsize::new(0));
        let calls = Arc::new(AtomicU32::new(0));
        let svc = {
            let (frames, calls) = (frames.clone(), calls.clone());
            service_fn(move |_req: Request<String>| {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                let mut res = Response::new(Endless {
                    frames: frames.clone(),
                    trailers,
                });
                if n == 0 {
                    *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                    res.headers_mut()
                        .insert(RETRY_AFTER, HeaderValue::from_static("1"));
                }
                async move { Ok::<_, Infallible>(res) }
            })
        };
        let client = RetryLayer::new(policy(backoff(3))).layer(svc);
        let start = Instant::now();
        let res = client.oneshot(request(Method::GET)).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(start.elapsed(), SECOND);
        let read = frames.load(Ordering::SeqCst);
        assert!(read <= 1024, "{read} frames read (trailers: {trailers})");
    }
}

/// A service whose readiness belongs to one instance: `call` panics unless this very
/// instance was polled ready since its last call. Logs every `poll_ready` and `call` with
/// the instance's id.
struct Tracked {
    id: usize,
    ready: bool,
    ids: Arc<AtomicUsize>,
    log: Arc<Mutex<Vec<(&'static str, usize)>>>,
    calls: Arc<AtomicU32>,
}

impl Clone for Tracked {
    fn clone(&self) -> Tracked {
        Tracked {
            id: self.ids.fetch_add(1, Ordering::SeqCst),
            ready: false,
            ids: self.ids.clone(),
            log: self.log.clone(),
            calls: self.calls.clone(),
        }
    }
}

impl Service<Request<String>> for Tracked {
    type Response = Response<String>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<String>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.ready = true;
        self.log.lock().unwrap().push(("ready", self.id));
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _req: Request<String>) -> Self::Future {
        assert!(self.ready, "instance {} called without poll_ready", self.id);
        self.ready = false;
        self.log.lock().unwrap().push(("call", self.id));
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        Box::pin(async move {
            Ok(if n == 1 {
                answer(503, String::new(), Some("1"))
            } else {
                answer(200, String::new(), None)
            })
        })
    }
}

#[tokio::test(start_paused = true)]
async fn the_service_made_ready_goes_with_the_request() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let tracked = Tracked {
        id: 0,
        ready: false,
        ids: Arc::new(AtomicUsize::new(1)),
        log: log.clone(),
        calls: Arc::new(AtomicU32::new(0)),
    };
    let mut client = RetryLayer::new(policy(backoff(3))).layer(tracked);
    client.ready().await.unwrap();
    let fut = client.call(request(Method::GET));
    // The layer kept a fresh clone; instance 0, made ready by the caller, went with the
    // request.
    assert_eq!(client.get_ref().id, 1);
    assert!(!client.get_ref().ready);
    let res = fut.await.unwrap();
    assert_eq!(info(&res).attempts, 2);
    // The first attempt calls the instance the caller made ready; the retry makes it ready
    // again before calling it.
    assert_eq!(
        *log.lock().unwrap(),
        [("ready", 0), ("call", 0), ("ready", 0), ("call", 0)]
    );
}

/// The inner service failing to get ready for a retry ends the request with its error, and
/// the stop is counted (`fatal`: the downstream cannot take the request) like every other
/// way a request stops; it was not counted at all.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn an_inner_service_failing_ready_for_a_retry_is_a_counted_stop() {
    #[derive(Clone)]
    struct Fails(Arc<AtomicU32>);
    impl Service<Request<String>> for Fails {
        type Response = Response<String>;
        type Error = &'static str;
        type Future = std::future::Ready<Result<Response<String>, &'static str>>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), &'static str>> {
            // Ready for the first attempt only.
            Poll::Ready(match self.0.load(Ordering::SeqCst) {
                0 => Ok(()),
                _ => Err("connection pool closed"),
            })
        }
        fn call(&mut self, _req: Request<String>) -> Self::Future {
            self.0.fetch_add(1, Ordering::SeqCst);
            std::future::ready(Ok(answer(503, String::new(), None)))
        }
    }
    let recorder = crate::support::TestRecorder::default();
    let policy = metrics::with_local_recorder(&recorder, || {
        RetryPolicy::builder(backoff(3))
            .name("ready")
            .build()
            .unwrap()
    });
    let client = RetryLayer::new(policy).layer(Fails(Arc::new(AtomicU32::new(0))));
    let err = client.oneshot(request(Method::GET)).await.unwrap_err();
    assert!(
        matches!(
            err,
            RetryError::Inner {
                error: "connection pool closed",
                stop: Stop::Fatal,
                attempts: 1,
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        recorder.counter("flowgate_retry_stopped_total{name=ready,stop=fatal}"),
        1
    );
}

/// What the layer's docs say of `Retry::poll_ready`: the inner service failing to get
/// ready before any request is the caller's error (`fatal`, 0 attempts), and no request
/// began, so no stop or attempt is counted and the budget keeps its tokens.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn an_inner_service_failing_ready_before_any_request_is_counted_nowhere() {
    #[derive(Clone)]
    struct Closed;
    impl Service<Request<String>> for Closed {
        type Response = Response<String>;
        type Error = &'static str;
        type Future = std::future::Ready<Result<Response<String>, &'static str>>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), &'static str>> {
            Poll::Ready(Err("connection pool closed"))
        }
        fn call(&mut self, _req: Request<String>) -> Self::Future {
            unreachable!("never ready")
        }
    }
    let recorder = crate::support::TestRecorder::default();
    let (policy, budget) = metrics::with_local_recorder(&recorder, || {
        let budget = RetryBudget::new(10, 0.1).unwrap();
        let policy = RetryPolicy::builder(backoff(3))
            .budget(budget.clone())
            .name("closed")
            .build()
            .unwrap();
        (policy, budget)
    });
    let mut client = RetryLayer::new(policy).layer(Closed);
    for _ in 0..2 {
        let err = client.ready().await.err().unwrap();
        assert_eq!(
            (err.stop(), err.attempts(), err.inner()),
            (Stop::Fatal, 0, Some(&"connection pool closed"))
        );
    }
    for stop in ["success", "fatal", "gave_up", "budget", "cancelled"] {
        let id = format!("flowgate_retry_stopped_total{{name=closed,stop={stop}}}");
        assert_eq!(recorder.counter(&id), 0, "{id}");
    }
    assert_eq!(
        recorder.counter("flowgate_retry_attempts_total{name=closed}"),
        0
    );
    assert_eq!(budget.tokens(), 10.0);
}

/// A downstream whose readiness is shared by every clone: ready for its first `ready_for`
/// `poll_ready`s, then not ready (`poll_ready` is `Pending`, or `Err` with `fails`) until
/// [`open`](Stalls::open). Every call answers `500`; when each came is logged.
#[derive(Clone)]
struct Stalls {
    state: Arc<Mutex<StallState>>,
    ready_for: u32,
    fails: bool,
    start: Instant,
}

#[derive(Default)]
struct StallState {
    polls: u32,
    open: bool,
    wakers: Vec<std::task::Waker>,
    times: Vec<Duration>,
}

impl Stalls {
    fn new(ready_for: u32, fails: bool) -> Stalls {
        Stalls {
            state: Arc::default(),
            ready_for,
            fails,
            start: Instant::now(),
        }
    }

    fn open(&self) {
        let wakers = {
            let mut st = self.state.lock().unwrap();
            st.open = true;
            std::mem::take(&mut st.wakers)
        };
        wakers.into_iter().for_each(std::task::Waker::wake);
    }

    fn times(&self) -> Vec<Duration> {
        self.state.lock().unwrap().times.clone()
    }
}

impl Service<Request<String>> for Stalls {
    type Response = Response<String>;
    type Error = &'static str;
    type Future = std::future::Ready<Result<Response<String>, &'static str>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), &'static str>> {
        let mut st = self.state.lock().unwrap();
        st.polls += 1;
        if st.open || st.polls <= self.ready_for {
            Poll::Ready(Ok(()))
        } else if self.fails {
            Poll::Ready(Err("connection pool closed"))
        } else {
            st.wakers.push(cx.waker().clone());
            Poll::Pending
        }
    }

    fn call(&mut self, _req: Request<String>) -> Self::Future {
        let mut st = self.state.lock().unwrap();
        st.times.push(self.start.elapsed());
        std::future::ready(Ok(answer(500, String::new(), None)))
    }
}

/// A pacer of 1/s with the default burst (2), never adapted (a `500` tells it nothing).
fn steady_pacer() -> AdaptivePacer {
    let rate = Rate::per_second(1).unwrap();
    AdaptivePacer::builder(rate).floor(rate).build().unwrap()
}

/// The pacer spaces what the downstream receives, retries included: a retry's turn is
/// taken once the inner service is ready for it, so a downstream that was not ready for a
/// while (a full connection pool) receives the retries at the pacer's rate when it is
/// again. The turns were taken first: four retries whose turns passed while the service
/// was not ready were all sent in the same instant, twice the pacer's burst of 2.
#[tokio::test(start_paused = true)]
async fn retries_held_by_the_inner_service_s_readiness_keep_the_pacer_s_spacing() {
    let pacer = steady_pacer();
    let policy = RetryPolicy::builder(backoff(2))
        .pacer(pacer.clone())
        .build()
        .unwrap();
    // Ready for the four first attempts (made ready by `oneshot` at once), then not until
    // it is opened.
    let server = Stalls::new(4, false);
    let client = RetryLayer::new(policy).layer(server.clone());
    let requests: Vec<_> = (0..4)
        .map(|_| tokio::spawn(client.clone().oneshot(request(Method::GET))))
        .collect();
    tokio::time::sleep(20 * SECOND).await;
    server.open();
    for r in requests {
        let res = r.await.unwrap().unwrap();
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(info(&res).attempts, 2);
    }
    let times = server.times();
    assert_eq!(times.len(), 8, "{times:?}");
    // The pacer's guarantee (a), at the downstream: in any interval of `w`, at most
    // `burst + rate × w` requests.
    for i in 0..times.len() {
        for j in i..times.len() {
            let sent = (j - i + 1) as f64;
            let bound = 2.0 + (times[j] - times[i]).as_secs_f64();
            assert!(
                sent <= bound,
                "{sent} sent within {:?}: {times:?}",
                times[j] - times[i]
            );
        }
    }
}

/// A retry the inner service fails to get ready for (or is dropped waiting for) was never
/// sent, and takes no turn of the pacer from the requests after it. It took one: another
/// request sharing the 1/s pacer waited a second for the turn of a retry never sent.
#[tokio::test(start_paused = true)]
async fn a_retry_never_sent_takes_no_turn_of_the_pacer() {
    for fails in [true, false] {
        let pacer = steady_pacer();
        let policy = RetryPolicy::builder(backoff(2))
            .pacer(pacer.clone())
            .build()
            .unwrap();
        // Ready for the first attempt only: the retry, after 100 ms, fails to get ready
        // for it, or waits for ever (and is dropped at 500 ms).
        let server = Stalls::new(1, fails);
        let client = RetryLayer::new(policy.clone()).layer(server.clone());
        let start = Instant::now();
        let ended = tokio::time::timeout(500 * MS, client.oneshot(request(Method::GET))).await;
        match ended {
            Ok(Err(err)) => assert!(fails && err.stop() == Stop::Fatal, "{err:?}"),
            Ok(Ok(res)) => panic!("{:?}", res.status()),
            Err(_) => assert!(!fails, "dropped while the service was not ready"),
        }
        assert_eq!(server.times(), [Duration::ZERO]);
        // One unit of the burst of 2 was used, by the first attempt: another request
        // goes at once.
        let other = Scripted::new();
        let at = Instant::now();
        let res = RetryLayer::new(policy)
            .layer(other.service(|_| answer(200, String::new(), None)))
            .oneshot(request(Method::GET))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(
            at.elapsed(),
            Duration::ZERO,
            "fails: {fails}, started at {:?}",
            at - start
        );
    }
}

/// Ready for its first call only; for the next ones `poll_ready` is `Pending` for ever
/// (`fails: false`) or an error (`fails: true`). Every call answers `503` with
/// `Retry-After: 1`. (Used by tests that read metrics.)
#[cfg(feature = "metrics")]
#[derive(Clone)]
struct ReadyOnce {
    calls: Arc<AtomicU32>,
    fails: bool,
}

#[cfg(feature = "metrics")]
impl Service<Request<String>> for ReadyOnce {
    type Response = Response<String>;
    type Error = &'static str;
    type Future = std::future::Ready<Result<Response<String>, &'static str>>;
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), &'static str>> {
        match (self.calls.load(Ordering::SeqCst), self.fails) {
            (0, _) => Poll::Ready(Ok(())),
            (_, false) => Poll::Pending,
            (_, true) => Poll::Ready(Err("connection pool closed")),
        }
    }
    fn call(&mut self, _req: Request<String>) -> Self::Future {
        self.calls.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(answer(503, String::new(), Some("1"))))
    }
}

/// A `RetryFuture` dropped (by the caller's own timeout, a `select!`) while it waits for a
/// retry's `Retry-After`, while the pacer or the inner service holds the retry back, or
/// while an attempt is under way: each drop is counted once as a `cancelled` stop; a retry
/// the budget allowed but that was never sent is counted as abandoned (its token stays
/// taken: the attempt before it did fail); an attempt under way was sent, so it counts.
/// The retry the inner service refuses to get ready for is abandoned too.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn a_dropped_request_counts_the_drop_and_abandons_the_allowed_retry() {
    let recorder = crate::support::TestRecorder::default();
    let budget = metrics::with_local_recorder(&recorder, || {
        RetryBudget::builder()
            .name("drop")
            .max_tokens(20)
            .build()
            .unwrap()
    });
    let policy = |name: &str, pacer: Option<AdaptivePacer>| {
        metrics::with_local_recorder(&recorder, || {
            let mut b = RetryPolicy::builder(backoff(5))
                .name(name)
                .budget(budget.clone());
            if let Some(pacer) = pacer {
                b = b.pacer(pacer);
            }
            b.build().unwrap()
        })
    };
    let abandoned = || recorder.counter("flowgate_retry_budget_abandoned_total{name=drop}");
    let cancelled = |name: &str| {
        recorder.counter(&format!(
            "flowgate_retry_stopped_total{{name={name},stop=cancelled}}"
        ))
    };
    let attempts =
        |name: &str| recorder.counter(&format!("flowgate_retry_attempts_total{{name={name}}}"));

    // 1. Dropped half-way through the `Retry-After: 2` of a 503.
    let server = Scripted::new();
    let client = RetryLayer::new(policy("backoff", None))
        .layer(server.service(|_| answer(503, String::new(), Some("2"))));
    let dropped = tokio::time::timeout(SECOND, client.oneshot(request(Method::GET))).await;
    assert!(dropped.is_err(), "still waiting when dropped");
    assert_eq!(server.calls(), 1);
    assert_eq!(abandoned(), 1, "the allowed retry was never sent");
    assert_eq!(budget.tokens(), 19.0, "the 503 did fail");
    assert_eq!((attempts("backoff"), cancelled("backoff")), (1, 1));

    // 2. Dropped while the pacer (1/s, a burst of 2, one of them taken here) holds the
    //    retry after `Retry-After: 0` back.
    let pacer = AdaptivePacer::builder(Rate::per_second(1).unwrap())
        .build()
        .unwrap();
    pacer.until_ready(1).await.unwrap();
    let server = Scripted::new();
    let client = RetryLayer::new(policy("pace", Some(pacer)))
        .layer(server.service(|_| answer(503, String::new(), Some("0"))));
    let dropped = tokio::time::timeout(500 * MS, client.oneshot(request(Method::GET))).await;
    assert!(dropped.is_err());
    assert_eq!(server.calls(), 1);
    assert_eq!(abandoned(), 2);
    assert_eq!(budget.tokens(), 18.0);
    assert_eq!((attempts("pace"), cancelled("pace")), (1, 1));

    // 3. Dropped while the inner service is not ready for the retry.
    let calls = Arc::new(AtomicU32::new(0));
    let client = RetryLayer::new(policy("ready", None)).layer(ReadyOnce {
        calls: calls.clone(),
        fails: false,
    });
    let dropped = tokio::time::timeout(5 * SECOND, client.oneshot(request(Method::GET))).await;
    assert!(dropped.is_err());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(abandoned(), 3);
    assert_eq!((attempts("ready"), cancelled("ready")), (1, 1));

    // 4. The inner service fails to get ready for the retry: a `fatal` stop, not a drop,
    //    but the allowed retry was never sent either.
    let calls = Arc::new(AtomicU32::new(0));
    let client = RetryLayer::new(policy("ready_err", None)).layer(ReadyOnce {
        calls: calls.clone(),
        fails: true,
    });
    let err = client.oneshot(request(Method::GET)).await.unwrap_err();
    assert!(
        matches!(
            err,
            RetryError::Inner {
                error: "connection pool closed",
                stop: Stop::Fatal,
                attempts: 1,
            }
        ),
        "{err:?}"
    );
    assert_eq!(abandoned(), 4);
    assert_eq!((attempts("ready_err"), cancelled("ready_err")), (1, 0));
    assert_eq!(budget.tokens(), 16.0);

    // 5. Dropped during an attempt: it was sent; neither the budget nor the pacer hears of
    //    an outcome, and no retry was allowed.
    let hangs = service_fn(|_req: Request<String>| {
        std::future::pending::<Result<Response<String>, Infallible>>()
    });
    let client = RetryLayer::new(policy("call", None)).layer(hangs);
    let dropped = tokio::time::timeout(SECOND, client.oneshot(request(Method::GET))).await;
    assert!(dropped.is_err());
    assert_eq!((attempts("call"), cancelled("call")), (1, 1));
    assert!(
        recorder
            .samples("flowgate_retry_attempt_seconds{name=call}")
            .is_empty()
    );
    assert_eq!(abandoned(), 4);
    assert_eq!(budget.tokens(), 16.0);
    assert_eq!(
        recorder.counter("flowgate_retry_budget_retries_total{name=drop,outcome=allowed}"),
        4
    );

    // 6. Run to the end: nothing is counted as dropped or abandoned.
    let server = Scripted::new();
    let client = RetryLayer::new(policy("done", None)).layer(server.service(|n| match n {
        1 => answer(503, String::new(), Some("1")),
        _ => answer(200, String::new(), None),
    }));
    let res = client.oneshot(request(Method::GET)).await.unwrap();
    assert_eq!(info(&res).attempts, 2);
    drop(res);
    assert_eq!((attempts("done"), cancelled("done")), (2, 0));
    assert_eq!(abandoned(), 4);
    // The budget's own counts: 5 retries allowed, 4 of them never sent.
    let stats = budget.stats();
    assert_eq!((stats.allowed, stats.abandoned), (5, 4));
}

/// The stops a policy named `name` counted, by `stop`: those counted at least once.
#[cfg(feature = "metrics")]
fn stops(recorder: &crate::support::TestRecorder, name: &str) -> Vec<(&'static str, u64)> {
    crate::support::RETRY_STOPS
        .into_iter()
        .map(|stop| {
            let id = format!("flowgate_retry_stopped_total{{name={name},stop={stop}}}");
            (stop, recorder.counter(&id))
        })
        .filter(|&(_, n)| n > 0)
        .collect()
}

/// A classifier that panics ends the request with its panic, here on the second answer,
/// after a `503` whose retry the budget allowed and that was sent. As `retry()` counts it:
/// both attempts were sent, the operation counts one stop, `cancelled` (it ended before a
/// stop was decided), the allowed retry is not abandoned (it was sent), and the budget
/// heard of the `503` alone.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn a_panicking_classifier_counts_the_request_once_as_retry_does() {
    use flowgate::retry::{HttpClassify, Outcome, retry};
    use futures::FutureExt;
    use std::panic::AssertUnwindSafe;

    let recorder = crate::support::TestRecorder::default();
    let (budget, policy) = metrics::with_local_recorder(&recorder, || {
        let budget = RetryBudget::builder()
            .name("classify")
            .max_tokens(20)
            .build()
            .unwrap();
        let policy = |name: &str| {
            RetryPolicy::builder(backoff(5))
                .name(name)
                .budget(budget.clone())
                .build()
                .unwrap()
        };
        (budget.clone(), [policy("fn"), policy("layer")])
    });
    let [by_fn, by_layer] = policy;

    // retry(): the downstream answers 503, then 200, which the classifier panics on.
    let classify = |r: &Result<u16, Infallible>| match r {
        Ok(200) => panic!("the classifier panics"),
        _ => Outcome::BackPressure {
            retry_after: Some(SECOND),
        },
    };
    let op = |n: u32| async move { Ok::<_, Infallible>(if n == 1 { 503 } else { 200 }) };
    let panicked = AssertUnwindSafe(retry(&by_fn, classify, op))
        .catch_unwind()
        .await;
    assert!(panicked.is_err());

    // RetryLayer: the same through a classifier of responses.
    let server = Scripted::new();
    let client = RetryLayer::new(by_layer)
        .classify(|r: &Result<Response<String>, Infallible>| match r {
            Ok(res) if res.status() == StatusCode::OK => panic!("the classifier panics"),
            Ok(res) => HttpClassify::new().outcome(res.status(), res.headers()),
            Err(_) => Outcome::Retry,
        })
        .layer(server.service(|n| match n {
            1 => answer(503, String::new(), Some("1")),
            _ => answer(200, String::new(), None),
        }));
    let panicked = AssertUnwindSafe(client.oneshot(request(Method::GET)))
        .catch_unwind()
        .await;
    assert!(panicked.is_err());
    assert_eq!(server.calls(), 2);

    for name in ["fn", "layer"] {
        let attempts = format!("flowgate_retry_attempts_total{{name={name}}}");
        assert_eq!(recorder.counter(&attempts), 2, "{name}");
        assert_eq!(stops(&recorder, name), [("cancelled", 1)], "{name}");
    }
    let stats = budget.stats();
    assert_eq!((stats.allowed, stats.abandoned), (2, 0));
    assert_eq!(budget.tokens(), 18.0, "one token for each 503");
}

/// A request polled outside a tokio runtime panics when its first wait starts, as
/// documented: here the backoff after a `503`, which the budget allowed a retry for. The
/// retry was never sent: it is abandoned, and the request counts one stop, `cancelled`.
#[cfg(feature = "metrics")]
#[test]
fn a_request_that_panics_starting_its_backoff_abandons_the_allowed_retry() {
    use std::panic::AssertUnwindSafe;

    let recorder = crate::support::TestRecorder::default();
    let (budget, policy) = metrics::with_local_recorder(&recorder, || {
        let budget = RetryBudget::builder().name("arm").build().unwrap();
        let policy = RetryPolicy::builder(backoff(5))
            .name("arm")
            .budget(budget.clone())
            .build()
            .unwrap();
        (budget, policy)
    });
    let server = Scripted::new();
    let client =
        RetryLayer::new(policy).layer(server.service(|_| answer(503, String::new(), None)));
    let panicked = std::panic::catch_unwind(AssertUnwindSafe(|| {
        futures::executor::block_on(client.oneshot(request(Method::GET)))
    }));
    assert!(panicked.is_err(), "no runtime for the backoff's timer");
    assert_eq!(server.calls(), 1);
    let stats = budget.stats();
    assert_eq!((stats.allowed, stats.abandoned), (1, 1));
    assert_eq!(stops(&recorder, "arm"), [("cancelled", 1)]);
}

/// An inner service whose `call` panics for a retry (after a `503` with `Retry-After: 0`)
/// sent nothing: the retry the budget allowed is abandoned and not counted as an attempt,
/// so the attempts stay one more than the retries made (`allowed − abandoned`), and the
/// request counts one stop, `cancelled`.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn an_inner_service_panicking_in_call_for_a_retry_sends_no_attempt() {
    use futures::FutureExt;
    use std::panic::AssertUnwindSafe;

    let recorder = crate::support::TestRecorder::default();
    let (budget, policy) = metrics::with_local_recorder(&recorder, || {
        let budget = RetryBudget::builder().name("call").build().unwrap();
        let policy = RetryPolicy::builder(backoff(5))
            .name("call")
            .budget(budget.clone())
            .build()
            .unwrap();
        (budget, policy)
    });
    let server = Scripted::new();
    let client = RetryLayer::new(policy).layer(server.service(|n| match n {
        1 => answer(503, String::new(), Some("0")),
        _ => panic!("call panics"),
    }));
    let panicked = AssertUnwindSafe(client.oneshot(request(Method::GET)))
        .catch_unwind()
        .await;
    assert!(panicked.is_err());
    assert_eq!(server.calls(), 2, "the retry's call was made, and panicked");
    let stats = budget.stats();
    assert_eq!((stats.allowed, stats.abandoned), (1, 1));
    assert_eq!(
        recorder.counter("flowgate_retry_attempts_total{name=call}"),
        1,
        "1 + allowed - abandoned"
    );
    assert_eq!(stops(&recorder, "call"), [("cancelled", 1)]);
}

/// A metrics recorder that panics on the round-trip histogram must not keep a failed
/// attempt from the budget, as `retry()` keeps none (`tests/retry/call.rs`): here a `500`
/// and a `503`, each ending its request with the recorder's panic. Each takes its token,
/// and the retry it allowed, never sent, is abandoned. The histogram came before the
/// budget heard of the failure, so both tokens were kept.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn a_recorder_panicking_on_the_round_trip_still_tells_the_budget_of_a_failure() {
    use futures::FutureExt;
    use std::panic::AssertUnwindSafe;

    let recorder = crate::support::TestRecorder::default();
    let (budget, policy) = recorder.retry_policy("rtt", backoff(5));
    recorder.panic_on("flowgate_retry_attempt_seconds{name=rtt}", true);
    for status in [500, 503] {
        let server = Scripted::new();
        let client = RetryLayer::new(policy.clone())
            .layer(server.service(move |_| answer(status, String::new(), None)));
        let panicked = AssertUnwindSafe(client.oneshot(request(Method::GET)))
            .catch_unwind()
            .await;
        assert!(panicked.is_err(), "the recorder panicked on {status}");
        assert_eq!(server.calls(), 1, "{status}");
    }
    assert_eq!(budget.tokens(), 8.0, "a token for each failure");
    let stats = budget.stats();
    assert_eq!(
        (stats.allowed, stats.abandoned),
        (2, 2),
        "each failure allowed a retry the panic kept from being sent"
    );
    assert_eq!(stops(&recorder, "rtt"), [("cancelled", 2)]);
}

/// The same panic after the budget *refused* the retry (the schedule allowed one) abandons
/// nothing: no retry was allowed, so none can be abandoned, and `allowed − abandoned`
/// stays the retries made. `retry()` counts it so (`tests/retry/call.rs`).
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn a_recorder_panicking_after_the_budget_refused_abandons_no_retry() {
    use flowgate::retry::{Outcome, retry};
    use futures::FutureExt;
    use std::panic::AssertUnwindSafe;

    let recorder = crate::support::TestRecorder::default();
    let (budget, policy) = recorder.retry_policy("refused", backoff(5));
    // 10 tokens → 5: four retries allowed, then one refused; the next failure is refused.
    for _ in 0..5 {
        let _ = budget.try_retry();
    }
    let before = budget.stats();
    assert_eq!(
        (before.allowed, before.refused, before.abandoned),
        (4, 1, 0)
    );
    recorder.panic_on("flowgate_retry_attempt_seconds{name=refused}", true);

    let server = Scripted::new();
    let client =
        RetryLayer::new(policy.clone()).layer(server.service(|_| answer(503, String::new(), None)));
    let panicked = AssertUnwindSafe(client.oneshot(request(Method::GET)))
        .catch_unwind()
        .await;
    assert!(panicked.is_err(), "the recorder panicked");
    assert_eq!(server.calls(), 1);
    let classify = |_: &Result<u16, Infallible>| Outcome::BackPressure { retry_after: None };
    let panicked = AssertUnwindSafe(retry(&policy, classify, |_| async { Ok(503) }))
        .catch_unwind()
        .await;
    assert!(panicked.is_err(), "the recorder panicked");

    let stats = budget.stats();
    assert_eq!(
        (stats.allowed, stats.refused, stats.abandoned),
        (4, 3, 0),
        "both retries were refused: none allowed, none abandoned"
    );
    assert!(stats.abandoned <= stats.allowed);
    assert_eq!(stops(&recorder, "refused"), [("cancelled", 2)]);
}

/// A metrics recorder that panics on the abandoned-retry counter, when the inner service
/// fails to get ready for a retry: the request ends with the recorder's panic, and the
/// retry is abandoned once. (The drop the panic caused abandoned it again, and that
/// recorder call panicked too: in a task, unwinding, a panic in a drop aborts the process.)
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn a_recorder_panicking_on_an_abandoned_retry_counts_it_once() {
    use futures::FutureExt;
    use std::panic::AssertUnwindSafe;

    let recorder = crate::support::TestRecorder::default();
    let (budget, policy) = recorder.retry_policy("abandon", backoff(5));
    recorder.panic_on("flowgate_retry_budget_abandoned_total{name=abandon}", true);
    let calls = Arc::new(AtomicU32::new(0));
    let client = RetryLayer::new(policy).layer(ReadyOnce {
        calls: calls.clone(),
        fails: true,
    });
    let panicked = AssertUnwindSafe(client.oneshot(request(Method::GET)))
        .catch_unwind()
        .await;
    assert!(panicked.is_err(), "the recorder panicked");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let stats = budget.stats();
    assert_eq!((stats.allowed, stats.abandoned), (1, 1));
    assert_eq!(stops(&recorder, "abandon"), [("cancelled", 1)]);
}

#[test]
fn layer_types_are_clone_debug_send() {
    fn check<T: Clone + std::fmt::Debug + Send + Sync>(_: &T) {}
    let layer = RetryLayer::new(policy(backoff(3)));
    check(&layer);
    let svc = layer.layer(tower::service_fn(|_req: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    }));
    fn check_service<T: Clone + Send + Sync>(_: &T) {}
    check_service(&svc);
    let text = format!("{layer:?}");
    assert!(
        text.contains("RetryLayer") && text.contains("HttpClassify"),
        "{text}"
    );
}

// ---- real HTTP, real time ----

/// Per attempt, as the client saw it: when (since the start) and the status.
type Log = Arc<Mutex<Vec<(Duration, StatusCode)>>>;

/// 8 clients, each a hyper client behind a `RetryLayer` with its own `AdaptivePacer`
/// starting at 1 000/s, against flowgate's `RateLimitLayer` at 100/s (one key, burst 100)
/// on 127.0.0.1, for 8 s of real time, each client a closed loop of GETs.
///
/// After the first 2 s: fewer than 5 % of the attempts are `429`s and goodput is at least
/// 90 % of 100/s. The simulated run under paused time (`tests/outbound.rs`) holds the
/// issue's tighter figure (95 %); here the bound is looser because real time is noisy: the
/// scheduler, TCP connects after a retried response's connection is closed, and timer
/// granularity (1 ms) jitter when each client sends, and a slow CI machine (this one has
/// 2 cores shared with other builds) can stall the clients for tens of milliseconds, which
/// costs goodput that a simulation never loses.
///
/// A run the machine starved (other builds and tests share its 2 cores) can miss either
/// bound with nothing wrong in the pacer, so the test passes when one of up to three runs
/// holds both; a pacer that does not converge misses them in every run. Each run's figures
/// are printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_adaptive_clients_converge_on_a_real_server() {
    const RUNS: usize = 3;
    let mut reports = Vec::new();
    for _ in 0..RUNS {
        let (ratio, goodput, report) = converge_once().await;
        eprintln!("{report}");
        if ratio < 0.05 && goodput >= 90.0 {
            return;
        }
        reports.push(report);
    }
    panic!("in none of {RUNS} runs were 429s under 5 % and goodput at least 90/s: {reports:#?}");
}

/// One run of [`eight_adaptive_clients_converge_on_a_real_server`]: the 429 ratio and the
/// goodput (per second) after the warm-up, and a line saying both.
async fn converge_once() -> (f64, f64, String) {
    const CLIENTS: usize = 8;
    const RUN: Duration = Duration::from_secs(8);
    const WARMUP: Duration = Duration::from_secs(2);

    let quota = Quota::per_second(100).unwrap().burst(100).unwrap();
    let limit = RateLimitLayer::builder(MemoryGate::new(Limit::TokenBucket(quota)))
        .policy(Policy::new("global", quota, Constant::new("all")))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", route_get(|| async { "ok" }))
        .layer(limit);
    let server = Server::start(app).await;
    let url = server.url("/");

    let log: Log = Arc::default();
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..CLIENTS {
        let pacer = AdaptivePacer::builder(Rate::per_second(1000).unwrap())
            .name(format!("client-{i}"))
            .build()
            .unwrap();
        let backoff = Backoff::builder()
            .max_attempts(10)
            .deadline(5 * SECOND)
            .build()
            .unwrap();
        let policy = RetryPolicy::builder(backoff)
            .budget(RetryBudget::new(10, 0.1).unwrap())
            .pacer(pacer)
            .attempt_timeout(2 * SECOND)
            .build()
            .unwrap();
        let hyper = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
        let log = log.clone();
        // Log every attempt as it comes back.
        let logged = service_fn(move |req: Request<Empty<Bytes>>| {
            let (hyper, log) = (hyper.clone(), log.clone());
            async move {
                let res = hyper.request(req).await;
                if let Ok(res) = &res {
                    log.lock().unwrap().push((start.elapsed(), res.status()));
                }
                res
            }
        });
        let mut client = RetryLayer::new(policy).layer(logged);
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            while start.elapsed() < RUN {
                let req = Request::get(url.as_str()).body(Empty::new()).unwrap();
                let svc = client.ready().await.unwrap();
                if let Ok(res) = svc.call(req).await {
                    // Read the body: the connection goes back to the pool.
                    let _ = res.into_body().collect().await;
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }

    let log = log.lock().unwrap();
    let after: Vec<StatusCode> = log
        .iter()
        .filter(|(at, _)| *at >= WARMUP && *at < RUN)
        .map(|&(_, s)| s)
        .collect();
    let ok = after.iter().filter(|s| s.is_success()).count();
    let refused = after
        .iter()
        .filter(|&&s| s == StatusCode::TOO_MANY_REQUESTS)
        .count();
    let secs = (RUN - WARMUP).as_secs_f64();
    let goodput = ok as f64 / secs;
    let ratio = refused as f64 / after.len().max(1) as f64;
    let report = format!(
        "after {WARMUP:?}: {} attempts, {ok} ok ({goodput:.1}/s), {refused} 429s ({:.2} %); \
         in all {} attempts",
        after.len(),
        ratio * 100.0,
        log.len()
    );
    (ratio, goodput, report)
}

// ---- hostile fields, paused time ----

/// A field a broken or hostile server sends, with extreme but valid (or invalid) values.
fn hostile_field() -> impl proptest::strategy::Strategy<Value = (&'static str, String)> {
    use proptest::prelude::*;
    let huge = prop_oneof![
        Just("0".to_owned()),
        Just("1".to_owned()),
        Just("999999999999999".to_owned()),
        Just("18446744073709551615".to_owned()),
        Just("99999999999999999999999999".to_owned()),
        Just("-1".to_owned()),
        Just("0.5".to_owned()),
        any::<u32>().prop_map(|n| n.to_string()),
    ];
    prop_oneof![
        huge.clone().prop_map(|v| ("retry-after", v)),
        Just(("retry-after", "Fri, 31 Dec 9999 23:59:59 GMT".to_owned())),
        Just(("retry-after", "Thu, 01 Jan 1970 00:00:00 GMT".to_owned())),
        (huge.clone(), huge.clone()).prop_map(|(r, t)| ("ratelimit", format!("\"p\";r={r};t={t}"))),
        (huge.clone(), huge.clone())
            .prop_map(|(q, w)| ("ratelimit-policy", format!("\"p\";q={q};w={w}"))),
        huge.clone().prop_map(|v| ("x-ratelimit-remaining", v)),
        huge.prop_map(|v| ("x-ratelimit-reset", v)),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// Any of these fields on 429s, 503s and successes, through a `RetryLayer` with an
    /// `AdaptivePacer`: nothing panics or overflows (debug build), and every request ends
    /// within its attempts, each waiting at most the pacer's slowest unit (1 000 s) plus
    /// `max_retry_after` (60 s) plus the backoff's cap (10 s).
    #[test]
    fn hostile_fields_never_panic_and_every_request_ends(
        script in proptest::collection::vec(
            (proptest::sample::select(vec![200u16, 429, 503]), proptest::collection::vec(hostile_field(), 0..4)),
            1..8,
        ),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(async move {
            let server = Scripted::new();
            let script = Arc::new(script);
            let svc = server.service(move |n| {
                let (status, fields) = &script[(n as usize - 1) % script.len()];
                let mut res = answer(*status, String::new(), None);
                for (name, value) in fields {
                    res.headers_mut().append(*name, HeaderValue::from_str(value).unwrap());
                }
                res
            });
            let pacer = AdaptivePacer::builder(Rate::per_second(100).unwrap()).build().unwrap();
            let backoff = Backoff::builder().seed(1).build().unwrap();
            let policy = RetryPolicy::builder(backoff).pacer(pacer.clone()).build().unwrap();
            let client = RetryLayer::new(policy).layer(svc);
            let attempts = Backoff::DEFAULT_MAX_ATTEMPTS;
            let bound = (1_000 + 60 + 10) * SECOND * attempts;
            for _ in 0..3 {
                let start = Instant::now();
                let res = tokio::time::timeout(bound, client.clone().oneshot(request(Method::GET)))
                    .await
                    .expect("a request ends within its attempts' waits")
                    .unwrap();
                assert!(info(&res).attempts <= attempts);
                assert!(start.elapsed() <= bound);
                let status = pacer.status();
                assert!(status.rate_per_second.is_finite() && status.rate_per_second > 0.0);
                assert!(status.ceiling_per_second.is_finite());
            }
        });
    }
}

#[cfg(feature = "metrics")]
proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// Any script of answers (200, 500, 503 with `Retry-After: 0`, 404, no answer within
    /// the attempt timeout) to GETs and POSTs through a `RetryLayer` with a budget: every
    /// request counts exactly one stop, every call the server saw one attempt; the retries
    /// the budget allowed (less those abandoned, none here) are exactly the calls after the
    /// first of each request; and the budget's tokens follow the reference model of its
    /// answers (each failed attempt takes one token, retried or not; each success gives
    /// back the ratio; a fatal `404` neither).
    #[test]
    fn every_attempt_retry_and_stop_is_counted_once(
        script in proptest::collection::vec(0u8..5, 1..12),
        methods in proptest::collection::vec(proptest::bool::ANY, 1..6),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(async move {
            let recorder = crate::support::TestRecorder::default();
            let (budget, policy) = metrics::with_local_recorder(&recorder, || {
                let budget = RetryBudget::builder()
                    .max_tokens(10)
                    .token_ratio(0.5)
                    .name("n")
                    .build()
                    .unwrap();
                let policy = RetryPolicy::builder(backoff(4))
                    .attempt_timeout(SECOND)
                    .budget(budget.clone())
                    .name("n")
                    .build()
                    .unwrap();
                (budget, policy)
            });
            let kinds = Arc::new(Mutex::new(Vec::new()));
            let svc = {
                let (script, kinds) = (script.clone(), kinds.clone());
                let calls = Arc::new(AtomicU32::new(0));
                service_fn(move |_req: Request<String>| {
                    let n = calls.fetch_add(1, Ordering::SeqCst) as usize;
                    let kind = script[n % script.len()];
                    kinds.lock().unwrap().push(kind);
                    async move {
                        let status = match kind {
                            0 => 200,
                            1 => 500,
                            2 => 503,
                            3 => 404,
                            _ => std::future::pending().await,
                        };
                        Ok::<_, Infallible>(answer(status, String::new(), Some("0")))
                    }
                })
            };
            let client = RetryLayer::new(policy).layer(svc);
            let mut attempts = 0;
            for &post in &methods {
                let method = if post { Method::POST } else { Method::GET };
                attempts += match client.clone().oneshot(request(method)).await {
                    Ok(res) => info(&res).attempts,
                    Err(RetryError::TimedOut { attempts }) => attempts,
                    Err(e) => panic!("{e:?}"),
                };
            }
            let kinds = kinds.lock().unwrap().clone();
            let calls = kinds.len() as u64;
            assert_eq!(u64::from(attempts), calls);
            assert_eq!(recorder.counter("flowgate_retry_attempts_total{name=n}"), calls);
            let stops: u64 = ["success", "fatal", "gave_up", "budget", "timed_out", "not_retryable", "cancelled"]
                .iter()
                .map(|s| recorder.counter(&format!("flowgate_retry_stopped_total{{name=n,stop={s}}}")))
                .sum();
            assert_eq!(stops, methods.len() as u64);
            let stats = budget.stats();
            assert_eq!(stats.abandoned, 0);
            assert_eq!(stats.allowed, calls - methods.len() as u64);
            let mut model: u64 = 10_000;
            for kind in kinds {
                match kind {
                    0 => model = (model + 500).min(10_000),
                    3 => {}
                    _ => model = model.saturating_sub(1_000),
                }
            }
            assert_eq!(budget.tokens(), model as f64 / 1000.0);
        });
    }
}
