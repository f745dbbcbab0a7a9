//! flowgate talking to flowgate over loopback: an axum service behind `RateLimitLayer` /
//! `ShedLayer` on a `MemoryGate`, called with `RetryLayer` around hyper's client. Paused
//! time on a current-thread runtime (the gate follows tokio's clock there), so waits are
//! asserted exactly; counts on both sides must agree. (`meet.rs` walks the shared-quota
//! journey; here the extremes: an hour's quota, a cost above the burst, a deadline, both
//! forms of `Retry-After`, shedding, cancellation, and a quota of a small burst.)

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::response::IntoResponse;
use axum::routing::get;
use flowgate::bulkhead::Bulkhead;
use flowgate::gate::{Limit, MemoryGate};
use flowgate::http::{Constant, Policy, RateLimitLayer, RequestInfo, ShedLayer};
use flowgate::pace::AdaptivePacer;
use flowgate::retry::{
    Backoff, BackoffBuilder, GiveUp, HttpClassify, Jitter, Retry, RetryBudget, RetryInfo,
    RetryLayer, RetryPolicy, Stop,
};
use flowgate::{Quota, Rate};
use http::{Method, StatusCode};
use hyper::body::Incoming;
use tokio::time::Instant;
use tower::{Layer, ServiceExt};

use crate::harness::Server;
use crate::raw_http::{Hyper, hyper, request};
use crate::support::TestRecorder;

const SECOND: Duration = Duration::from_secs(1);

fn attempts(recorder: &TestRecorder, name: &str) -> u64 {
    recorder.counter(&format!("flowgate_retry_attempts_total{{name={name}}}"))
}

fn stopped(recorder: &TestRecorder, name: &str, stop: &str) -> u64 {
    recorder.counter(&format!(
        "flowgate_retry_stopped_total{{name={name},stop={stop}}}"
    ))
}

/// An API of `quota` for everyone, on a `MemoryGate`, served on loopback.
async fn limited(quota: Quota) -> (Server, RateLimitLayer<MemoryGate>) {
    let limit = RateLimitLayer::builder(MemoryGate::new(Limit::TokenBucket(quota)))
        .policy(Policy::new("all", quota, Constant::new("all")))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(limit.clone());
    (Server::start(app).await, limit)
}

/// The polite client of these tests, named `c` in `recorder`: no jitter, 10 attempts, a
/// budget, and a pacer (ceiling 1 000/s) when `paced`.
fn polite(
    recorder: &TestRecorder,
    backoff: Backoff,
    paced: bool,
) -> (Retry<Hyper, HttpClassify>, RetryBudget) {
    let (budget, policy) = metrics::with_local_recorder(recorder, || {
        let budget = RetryBudget::builder().name("c").build().unwrap();
        let mut policy = RetryPolicy::builder(backoff)
            .name("c")
            .budget(budget.clone());
        if paced {
            let pacer = AdaptivePacer::builder(Rate::per_second(1000).unwrap());
            policy = policy.pacer(pacer.build().unwrap());
        }
        (budget, policy.build().unwrap())
    });
    (RetryLayer::new(policy).layer(hyper()), budget)
}

fn backoff() -> BackoffBuilder {
    Backoff::builder()
        .jitter(Jitter::None)
        .max_attempts(10)
        .seed(1)
}

/// The attempts and the stop of a response's `RetryInfo`.
/// A `GET` of `url` through `client`, answered.
async fn send(client: &Retry<Hyper, HttpClassify>, url: &str) -> http::Response<Incoming> {
    client
        .clone()
        .oneshot(request(Method::GET, url))
        .await
        .unwrap()
}

/// A server answering its `n`-th request to `/` (from 0) with `answer(n)`; how many
/// requests it answered.
async fn scripted(
    answer: impl Fn(u32) -> axum::response::Response + Clone + Send + Sync + 'static,
) -> (Server, Arc<AtomicU32>) {
    let calls = Arc::new(AtomicU32::new(0));
    let seen = calls.clone();
    let app = Router::new().route(
        "/",
        get(move || {
            let response = answer(seen.fetch_add(1, Ordering::Relaxed));
            async move { response }
        }),
    );
    (Server::start(app).await, calls)
}

fn info<B>(res: &http::Response<B>) -> (u32, Stop) {
    let info = res.extensions().get::<RetryInfo>().unwrap();
    (info.attempts, info.stop)
}

/// A quota of 1 an hour: the first request passes; the next is held by the pacer for the
/// client's `max_retry_after` (the fields said `r=0;t=3600`), sent, refused with
/// `Retry-After` of the rest of the hour, and given up at once (`HintTooLong`): the
/// client waits no hour, and every count agrees with the server's.
#[tokio::test(start_paused = true)]
async fn a_quota_of_one_an_hour_is_given_up_on_not_waited_for() {
    let (server, limit) = limited(Quota::new(Rate::per_hour(1).unwrap(), 1).unwrap()).await;
    let recorder = TestRecorder::default();
    let (client, budget) = polite(&recorder, backoff().build().unwrap(), true);
    let res = send(&client, &server.url("/")).await;
    assert_eq!((res.status(), info(&res).0), (StatusCode::OK, 1));
    for (i, left) in [(1, 3540), (2, 3480)] {
        let start = Instant::now();
        let res = send(&client, &server.url("/")).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS, "{i}");
        // The pacer's hold, bounded by `max_retry_after`: never the hour.
        assert!(
            start.elapsed() <= Duration::from_millis(60_010),
            "{i}: {:?}",
            start.elapsed()
        );
        let hint = Duration::from_secs(left);
        let stop = Stop::GaveUp(GiveUp::HintTooLong {
            hint,
            max: 60 * SECOND,
        });
        assert_eq!(info(&res), (1, stop), "{i}");
    }
    let s = limit.stats();
    assert_eq!((s.admitted, s.rejected), (1, 2));
    assert_eq!(attempts(&recorder, "c"), 3);
    assert_eq!(stopped(&recorder, "c", "gave_up"), 2);
    assert_eq!(budget.stats().allowed, 0);
}

/// A request costing more than the burst can never pass: `400`, not retried, counted as a
/// bad request by the server and as one fatal attempt by the client.
#[tokio::test(start_paused = true)]
async fn a_cost_above_the_burst_is_one_fatal_attempt() {
    let quota = Quota::new(Rate::per_second(2).unwrap(), 2).unwrap();
    let limit = RateLimitLayer::builder(MemoryGate::new(Limit::TokenBucket(quota)))
        .policy(Policy::new("all", quota, Constant::new("all")))
        .cost(|_: &RequestInfo<'_>| 5)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(limit.clone());
    let server = Server::start(app).await;
    let recorder = TestRecorder::default();
    let (client, budget) = polite(&recorder, backoff().build().unwrap(), true);
    let res = send(&client, &server.url("/")).await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(info(&res), (1, Stop::Fatal));
    let s = limit.stats();
    assert_eq!((s.admitted, s.rejected, s.bad_request), (0, 0, 1));
    assert_eq!(budget.stats().allowed, 0);
    assert_eq!(stopped(&recorder, "c", "fatal"), 1);
}

/// `Retry-After` as an HTTP-date (measured from the server's `Date`) is waited exactly,
/// a `408` with a problem body is retried after the backoff, and the counts agree.
#[tokio::test(start_paused = true)]
async fn both_forms_of_retry_after_and_a_408_are_read_as_written() {
    let (server, calls) = scripted(|n| {
        let date = httpdate::fmt_http_date(SystemTime::now() + 3 * SECOND);
        match n {
            0 => (StatusCode::SERVICE_UNAVAILABLE, [("retry-after", date)], "").into_response(),
            1 => (
                StatusCode::REQUEST_TIMEOUT,
                [("content-type", "application/problem+json")],
                "{}",
            )
                .into_response(),
            2 => (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "2")], "").into_response(),
            _ => "ok".into_response(),
        }
    })
    .await;
    let recorder = TestRecorder::default();
    let (client, budget) = polite(&recorder, backoff().build().unwrap(), true);
    let start = Instant::now();
    let res = send(&client, &server.url("/")).await;
    assert_eq!(res.status(), StatusCode::OK);
    // 3 s (the date), the backoff's 200 ms for its second retry, 2 s.
    assert_eq!(start.elapsed(), Duration::from_millis(5_200));
    assert_eq!(info(&res), (4, Stop::Success));
    assert_eq!(calls.load(Ordering::Relaxed), 4);
    assert_eq!(attempts(&recorder, "c"), 4);
    assert_eq!(budget.stats().allowed, 3);
}

/// A deadline that ends within the next `Retry-After`: the client gives up at once
/// instead of waiting for it, after the attempts that fit.
#[tokio::test(start_paused = true)]
async fn a_deadline_ending_within_the_wait_gives_up_without_waiting() {
    let (server, calls) =
        scripted(|_| (StatusCode::SERVICE_UNAVAILABLE, [("retry-after", "4")], "").into_response())
            .await;
    let recorder = TestRecorder::default();
    let (client, budget) = polite(
        &recorder,
        backoff().deadline(10 * SECOND).build().unwrap(),
        true,
    );
    let start = Instant::now();
    let res = send(&client, &server.url("/")).await;
    assert_eq!(start.elapsed(), 8 * SECOND);
    let i = info(&res);
    assert_eq!(i.0, 3);
    assert!(
        matches!(i.1, Stop::GaveUp(GiveUp::Deadline { .. })),
        "{i:?}"
    );
    assert_eq!(calls.load(Ordering::Relaxed), 3);
    assert_eq!(attempts(&recorder, "c"), 3);
    assert_eq!((budget.stats().allowed, budget.stats().abandoned), (2, 0));
}

/// A full `ShedLayer` answers `503` with its `Retry-After` (1.5 s sent as 2): the client
/// comes back every 2 s until the permit is free. Dropped during that wait, or during an
/// attempt, it leaks nothing: the retry is abandoned, the server's permit comes back, and
/// the next request goes at once on the pooled connection.
#[tokio::test(start_paused = true)]
async fn shedding_is_waited_out_and_a_cancelled_client_leaks_nothing() {
    let bulkhead = Bulkhead::builder(1).build().unwrap();
    let shed = ShedLayer::builder(bulkhead.clone())
        .retry_after(Duration::from_millis(1500))
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(5 * SECOND).await;
                "slow"
            }),
        )
        .route("/", get(|| async { "ok" }))
        .layer(shed.clone());
    let server = Server::start(app).await;
    let recorder = TestRecorder::default();
    let (client, budget) = polite(&recorder, backoff().build().unwrap(), true);
    // A request to `url` dropped after half a second.
    let cancelled = |client: &Retry<Hyper, HttpClassify>, url: &str| {
        let get = client.clone().oneshot(request(Method::GET, url));
        async move {
            let dropped = tokio::time::timeout(Duration::from_millis(500), get).await;
            assert!(dropped.is_err(), "answered within half a second");
        }
    };
    // Another caller holding the only permit for 5 s.
    let hold = || tokio::spawn(hyper().request(request(Method::GET, &server.url("/slow"))));
    let settle = || tokio::time::sleep(Duration::from_millis(10));
    let slow = hold();
    settle().await;
    let start = Instant::now();
    let res = send(&client, &server.url("/")).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(start.elapsed(), 6 * SECOND);
    assert_eq!(info(&res).0, 4);
    assert_eq!(shed.stats().normal.shed, 3);
    slow.await.unwrap().unwrap();
    // Dropped while waiting out a 503.
    let slow = hold();
    settle().await;
    cancelled(&client, &server.url("/")).await;
    assert_eq!(stopped(&recorder, "c", "cancelled"), 1);
    assert_eq!((budget.stats().allowed, budget.stats().abandoned), (4, 1));
    slow.await.unwrap().unwrap();
    // Dropped during an attempt: the server's permit comes back.
    cancelled(&client, &server.url("/slow")).await;
    settle().await;
    assert_eq!(bulkhead.in_flight(), 0);
    assert_eq!(stopped(&recorder, "c", "cancelled"), 2);
    let start = Instant::now();
    let res = send(&client, &server.url("/")).await;
    assert_eq!(
        (res.status(), start.elapsed()),
        (StatusCode::OK, Duration::ZERO)
    );
    // Everything the server admitted or shed was the client's, but for the two holds.
    let s = shed.stats().normal;
    assert_eq!(attempts(&recorder, "c") + 2, s.admitted + s.shed);
}

/// Eight tasks, five requests each, against a burst of 2 with no pacer: what the server
/// counted (admitted + rejected) is what the client sent, attempt for attempt.
#[tokio::test(start_paused = true)]
async fn every_attempt_the_client_counts_is_one_the_server_counted() {
    let (server, limit) = limited(Quota::new(Rate::per_second(2).unwrap(), 2).unwrap()).await;
    let recorder = TestRecorder::default();
    let (client, budget) = polite(&recorder, backoff().build().unwrap(), false);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let (client, url) = (client.clone(), server.url("/"));
        tasks.spawn(async move {
            let mut made = 0;
            for _ in 0..5 {
                let res = send(&client, &url).await;
                made += u64::from(info(&res).0);
            }
            made
        });
    }
    let mut made = 0;
    while let Some(m) = tasks.join_next().await {
        made += m.unwrap();
    }
    let s = limit.stats();
    assert_eq!(made, s.admitted + s.rejected);
    assert_eq!(attempts(&recorder, "c"), made);
    let b = budget.stats();
    assert_eq!(made, 40 + b.allowed - b.abandoned);
}

/// A quota of 10 a second with a burst of 1: the server admits 10 a second, and its
/// fields must say so well enough that the polite client, paced by them, gets most of it
/// (it got a tenth when `q` was the burst: `q=1;w=1`, its refill time rounded up to a
/// second).
#[tokio::test(start_paused = true)]
async fn a_small_burst_is_not_read_as_a_slow_rate() {
    for (rate, burst) in [
        (Rate::per_second(10).unwrap(), 1),
        (Rate::per_minute(600).unwrap(), 5),
        (Rate::per_second(3).unwrap(), 2),
    ] {
        let (server, limit) = limited(Quota::new(rate, burst).unwrap()).await;
        let recorder = TestRecorder::default();
        let (client, _) = polite(&recorder, backoff().build().unwrap(), true);
        let start = Instant::now();
        const RUN: Duration = Duration::from_secs(60);
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..4 {
            let (client, url) = (client.clone(), server.url("/"));
            tasks.spawn(async move {
                while start.elapsed() < RUN {
                    let _ = send(&client, &url).await;
                }
            });
        }
        while let Some(t) = tasks.join_next().await {
            t.unwrap();
        }
        let granted = f64::from(burst) + rate.per_second_f64() * RUN.as_secs_f64();
        let s = limit.stats();
        assert!(
            s.admitted as f64 >= 0.8 * granted,
            "{rate:?} burst {burst}: {s:?} of {granted} granted"
        );
        assert!(s.rejected <= 5, "{rate:?} burst {burst}: {s:?}");
    }
}
