//! A team's clients against a flowgate-protected server that crashes and comes back: four
//! hyper clients, each behind its own `RetryLayer` and `AdaptivePacer`, sharing one
//! `RetryBudget`, call a server limited by flowgate's `RateLimitLayer` (`429` with
//! `Retry-After` and the `RateLimit` fields) over real HTTP on 127.0.0.1; mid-run the
//! server dies (its listener and every connection dropped, its gate's state lost) and,
//! half a second later, starts again on the same port. Real time: what is asserted is
//! counts, which agree exactly, and bounds that hold however the scheduler runs.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use flowgate::Quota;
use flowgate::Rate;
use flowgate::gate::{Limit, MemoryGate};
use flowgate::http::{Constant, Policy, RateLimitLayer};
use flowgate::pace::AdaptivePacer;
use flowgate::retry::{Backoff, Jitter, RetryBudget, RetryInfo, RetryLayer, RetryPolicy, Stop};
use http::{Method, StatusCode};
use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt, service_fn};

use crate::raw_http::{hyper, request};
use crate::support::TestRecorder;

const MS: Duration = Duration::from_millis(1);
const CLIENTS: usize = 4;
const MAX_TOKENS: u32 = 100;
const RATIO: f64 = 0.1;
const ATTEMPTS: u32 = 5;

/// The server: flowgate's `RateLimitLayer` (20/s, burst 5, one key) around a `200`, on
/// `addr`; counts every request it read (`seen`) and every one it admitted.
#[derive(Clone, Default)]
struct Counts {
    seen: Arc<AtomicU64>,
    admitted: Arc<AtomicU64>,
}

/// Serve a fresh instance (a fresh gate: a restarted process keeps nothing) on `addr`
/// until the task is aborted, which drops the listener and every connection, as a crash
/// does. Binding retries briefly: the port was just released.
async fn serve(addr: SocketAddr, counts: Counts) -> (SocketAddr, JoinHandle<()>) {
    let quota = Quota::per_second(20).unwrap().burst(5).unwrap();
    let limit = RateLimitLayer::builder(MemoryGate::new(Limit::TokenBucket(quota)))
        .policy(Policy::new("all", quota, Constant::new("all")))
        .build()
        .unwrap();
    let admitted = counts.admitted.clone();
    let app = Router::new()
        .route(
            "/",
            get(move || {
                admitted.fetch_add(1, Ordering::SeqCst);
                async { "ok" }
            })
            .post(|| async { "ok" }),
        )
        .layer(limit);
    let mut bound = None;
    for _ in 0..50 {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => {
                bound = Some(l);
                break;
            }
            Err(_) => tokio::time::sleep(10 * MS).await,
        }
    }
    let listener = bound.expect("the port is free again");
    let addr = listener.local_addr().unwrap();
    let seen = counts.seen.clone();
    let task = tokio::spawn(async move {
        // Dropped with the task: every connection goes with it.
        let mut conns = tokio::task::JoinSet::new();
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let (app, seen) = (app.clone(), seen.clone());
            let svc = service_fn(move |req| {
                seen.fetch_add(1, Ordering::SeqCst);
                app.clone().oneshot(req)
            });
            conns.spawn(async move {
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), TowerToHyperService::new(svc))
                    .await;
            });
        }
    });
    (addr, task)
}

/// One request as its caller saw it: when it was given (since the start), whether an
/// attempt of it failed without an answer, why it stopped, after how many attempts, and
/// the final status (none for an error).
#[derive(Debug, Clone)]
struct Ended {
    at: Duration,
    unanswered: bool,
    stop: Stop,
    attempts: u32,
    status: Option<StatusCode>,
}

/// Set on a request's attempts (each a clone of it, extensions included) when one failed
/// without an answer.
#[derive(Clone, Default)]
struct Unanswered(Arc<AtomicBool>);

/// What every attempt came back as, seen by the client under the `RetryLayer`.
#[derive(Clone, Default)]
struct Sent {
    attempts: Arc<AtomicU64>,
    answered: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
}

/// Four clients sharing a budget, each a closed loop of `GET`s for 2.5 s; the server dies
/// at 0.8 s and is back at 1.3 s. Every request ends once, with a reason and its attempts,
/// and every count agrees: the attempts the callers were told of, the attempts metric, the
/// attempts the clients sent, the budget's retries made (`allowed − abandoned`); the server
/// read no request the clients did not send, and answered every one they got an answer to.
/// No retry storm: the shared budget allowed fewer retries than `max_tokens / 2` plus
/// `token_ratio` per success, whatever the outage cost, and no request made more than its
/// attempts. The outage was real (attempts failed without an answer) and ridden out: a
/// `GET` the dead server failed was retried into its second life and answered `200`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_sharing_a_budget_ride_out_a_server_restart() {
    const RUN: Duration = Duration::from_millis(2_500);
    const DOWN: Duration = Duration::from_millis(800);
    const UP: Duration = Duration::from_millis(1_300);

    let counts = Counts::default();
    let (addr, first) = serve("127.0.0.1:0".parse().unwrap(), counts.clone()).await;
    let url = format!("http://{addr}/");
    let recorder = TestRecorder::default();
    let budget = metrics::with_local_recorder(&recorder, || {
        RetryBudget::builder()
            .name("restart")
            .max_tokens(MAX_TOKENS)
            .token_ratio(RATIO)
            .build()
            .unwrap()
    });
    let sent = Sent::default();
    let ended: Arc<Mutex<Vec<Ended>>> = Arc::default();
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..CLIENTS {
        let name = format!("restart-{i}");
        let policy = metrics::with_local_recorder(&recorder, || {
            let pacer = AdaptivePacer::builder(Rate::per_second(200).unwrap())
                .name(name.as_str())
                .build()
                .unwrap();
            let backoff = Backoff::builder()
                .base(100 * MS)
                .jitter(Jitter::None)
                .max_attempts(ATTEMPTS)
                .max_retry_after(Duration::from_secs(2))
                .seed(i as u64)
                .build()
                .unwrap();
            RetryPolicy::builder(backoff)
                .name(name.as_str())
                .budget(budget.clone())
                .pacer(pacer)
                .attempt_timeout(Duration::from_secs(2))
                .build()
                .unwrap()
        });
        let (client, sent) = (hyper(), sent.clone());
        let counted = service_fn(move |req: http::Request<_>| {
            let (client, sent) = (client.clone(), sent.clone());
            sent.attempts.fetch_add(1, Ordering::SeqCst);
            let flag = req.extensions().get::<Unanswered>().cloned();
            async move {
                let res = client.request(req).await;
                if res.is_ok() {
                    sent.answered.fetch_add(1, Ordering::SeqCst);
                } else {
                    sent.failed.fetch_add(1, Ordering::SeqCst);
                    if let Some(flag) = flag {
                        flag.0.store(true, Ordering::SeqCst);
                    }
                }
                res
            }
        });
        let mut client = RetryLayer::new(policy).layer(counted);
        let (url, ended) = (url.clone(), ended.clone());
        tasks.push(tokio::spawn(async move {
            while start.elapsed() < RUN {
                let at = start.elapsed();
                let flag = Unanswered::default();
                let mut req = request(Method::GET, &url);
                req.extensions_mut().insert(flag.clone());
                let svc = client.ready().await.unwrap();
                let result = svc.call(req).await;
                let unanswered = flag.0.load(Ordering::SeqCst);
                let end = match result {
                    Ok(res) => {
                        let info = res.extensions().get::<RetryInfo>().cloned().unwrap();
                        let status = res.status();
                        let _ = res.into_body().collect().await;
                        Ended {
                            at,
                            unanswered,
                            stop: info.stop,
                            attempts: info.attempts,
                            status: Some(status),
                        }
                    }
                    Err(err) => Ended {
                        at,
                        unanswered,
                        stop: err.stop(),
                        attempts: err.attempts(),
                        status: None,
                    },
                };
                ended.lock().unwrap().push(end);
            }
        }));
    }

    tokio::time::sleep_until(start + DOWN).await;
    first.abort();
    let _ = first.await;
    let down_at = start.elapsed();
    tokio::time::sleep_until(start + UP).await;
    let (_, second) = serve(addr, counts.clone()).await;
    let up_at = start.elapsed();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("every client ends")
            .unwrap();
    }
    second.abort();

    let ended = ended.lock().unwrap().clone();
    let requests = ended.len() as u64;
    let told: u64 = ended.iter().map(|e| u64::from(e.attempts)).sum();
    let metric: u64 = (0..CLIENTS)
        .map(|i| {
            recorder.counter(&format!(
                "flowgate_retry_attempts_total{{name=restart-{i}}}"
            ))
        })
        .sum();
    let stops: u64 = (0..CLIENTS)
        .flat_map(|i| crate::journey::STOPS.map(|stop| (i, stop)))
        .map(|(i, stop)| {
            recorder.counter(&format!(
                "flowgate_retry_stopped_total{{name=restart-{i},stop={stop}}}"
            ))
        })
        .sum();
    let attempts = sent.attempts.load(Ordering::SeqCst);
    let (answered, failed) = (
        sent.answered.load(Ordering::SeqCst),
        sent.failed.load(Ordering::SeqCst),
    );
    let seen = counts.seen.load(Ordering::SeqCst);
    let stats = budget.stats();
    let successes = ended.iter().filter(|e| e.stop == Stop::Success).count();
    let report = format!(
        "{requests} requests, {attempts} attempts ({answered} answered, {failed} failed), \
         server read {seen}, admitted {}; budget {stats:?}, {successes} successes; \
         down at {down_at:?}, up at {up_at:?}",
        counts.admitted.load(Ordering::SeqCst)
    );
    eprintln!("{report}");

    // Every request accounted for, once.
    assert_eq!(stops, requests, "{report}");
    assert_eq!(told, attempts, "{report}");
    assert_eq!(metric, attempts, "{report}");
    assert_eq!(answered + failed, attempts, "{report}");
    assert_eq!(
        attempts,
        requests + stats.allowed - stats.abandoned,
        "{report}"
    );
    assert_eq!(stats.abandoned, 0, "{report}");
    // The server read nothing the clients did not send, and answered all they heard.
    assert!(answered <= seen && seen <= attempts, "{report}");
    // No retry storm.
    assert!(
        (stats.allowed as f64) < f64::from(MAX_TOKENS) / 2.0 + RATIO * successes as f64,
        "{report}"
    );
    assert!(
        ended.iter().all(|e| (1..=ATTEMPTS).contains(&e.attempts)),
        "{report}"
    );
    // Answers are the server's: a `200`, or a `429` the retries did not get past.
    for e in &ended {
        match (e.status, e.stop) {
            (Some(StatusCode::OK), Stop::Success) => {}
            (Some(StatusCode::TOO_MANY_REQUESTS), Stop::GaveUp(_) | Stop::Budget) => {}
            (None, Stop::GaveUp(_) | Stop::Budget | Stop::TimedOut) => {}
            other => panic!("{other:?} in {e:?}: {report}"),
        }
    }
    // The outage was real, and ridden out.
    assert!(failed > 0, "{report}");
    assert!(
        ended
            .iter()
            .any(|e| e.unanswered && e.at < up_at && e.stop == Stop::Success),
        "no GET the dead server failed was retried to a 200 after it came back: {report}"
    );
    assert!(
        ended
            .iter()
            .any(|e| e.at >= up_at && e.stop == Stop::Success),
        "{report}"
    );
}

/// A server that is down, then up on the same port: a `POST` whose connection was refused
/// never reached it, so a classifier that says so (`Outcome::Unsent`, from hyper-util's
/// `is_connect`) has it sent again, whatever the method, until the server is up; the
/// server reads it once. With the default classifier a refused `POST` is not sent again
/// (it cannot tell a connect error from a reset one).
#[tokio::test]
async fn a_post_refused_a_connection_is_sent_again_once_the_server_is_up() {
    use flowgate::retry::{HttpClassify, Outcome};
    use hyper::body::Incoming;
    use hyper_util::client::legacy::Error;

    let addr = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let url = format!("http://{addr}/");
    let recorder = TestRecorder::default();
    // No jitter: attempts at 0, 100, 300, 700 ms and 1.5 s; the server is up from 200 ms.
    let policy = metrics::with_local_recorder(&recorder, || {
        RetryPolicy::builder(crate::raw_http::backoff(5))
            .name("unsent")
            .build()
            .unwrap()
    });
    let unsent = |r: &Result<http::Response<Incoming>, Error>| match r {
        Ok(res) => HttpClassify::new().outcome(res.status(), res.headers()),
        Err(e) if e.is_connect() => Outcome::Unsent,
        Err(_) => Outcome::Retry,
    };
    let default = RetryLayer::new(policy.clone()).layer(hyper());
    let client = RetryLayer::new(policy).classify(unsent).layer(hyper());

    // Down: the default classifier does not send the `POST` again.
    let err = default
        .clone()
        .oneshot(request(Method::POST, &url))
        .await
        .unwrap_err();
    assert_eq!((err.stop(), err.attempts()), (Stop::NotRetryable, 1));

    let counts = Counts::default();
    let up = {
        let counts = counts.clone();
        tokio::spawn(async move {
            tokio::time::sleep(200 * MS).await;
            serve(addr, counts).await
        })
    };
    let start = Instant::now();
    let res = tokio::time::timeout(
        Duration::from_secs(10),
        client.oneshot(request(Method::POST, &url)),
    )
    .await
    .expect("answered")
    .unwrap();
    let (_, server) = up.await.unwrap();
    let info = res.extensions().get::<RetryInfo>().cloned().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(info.stop, Stop::Success);
    assert!(
        (2..=4).contains(&info.attempts),
        "{info:?} after {:?}",
        start.elapsed()
    );
    assert_eq!(
        counts.seen.load(Ordering::SeqCst),
        1,
        "the server read the POST once"
    );
    assert_eq!(
        recorder.counter("flowgate_retry_attempts_total{name=unsent}"),
        1 + u64::from(info.attempts)
    );
    server.abort();
}
