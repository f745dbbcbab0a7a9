//! Graceful shutdown of an axum service behind a `ShedLayer` (waiting room) and a
//! `RateLimitLayer` over a `MemoryGate`, under steady load from real HTTP/1 clients on
//! 127.0.0.1: the operator closes the bulkhead, then starts axum's graceful shutdown. The
//! waiters get their going-away `503` at once, the requests in flight finish, what the clients saw is
//! what the layer and the bulkhead counted, no permit is left out, an adaptive bulkhead
//! learns nothing from the refusals, and nothing is left running on the runtime.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use flowgate::adaptive::Aimd;
use flowgate::bulkhead::Bulkhead;
use flowgate::http::ShedLayer;
use http::StatusCode;
use http_body_util::{BodyExt, Empty};

use crate::harness::{self, Answer};
use crate::shed::{assert_going_away, eventually, totals};

const CLIENTS: usize = 12;
const SOON: Duration = Duration::from_secs(5);

/// What the clients saw, all of them together.
#[derive(Default)]
struct Seen {
    ok: AtomicU64,
    shed: AtomicU64,
    other: AtomicU64,
    /// Requests that got no answer (the connection refused or closed before one).
    failed: AtomicU64,
    /// The longest a `503` took to come.
    slowest_503_ms: AtomicU64,
}

fn alive() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

/// `app` served by axum on 127.0.0.1:0 until the sender is used (or dropped), then shut
/// down gracefully: its address, the sender, the server's task.
async fn serve(
    app: Router,
) -> (
    std::net::SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop_rx.await;
            })
            .await
            .unwrap();
    });
    (addr, stop_tx, server)
}

/// The journey over `bulkhead`, with `rate_limit` inside the shed: load, close, graceful
/// shutdown, and the counts after. The requests served.
async fn journey(bulkhead: Bulkhead, rate_limit: impl FnOnce(Router) -> Router) -> u64 {
    let layer = ShedLayer::builder(bulkhead.clone())
        .wait(true)
        .name("api")
        .build()
        .unwrap();
    let app = rate_limit(Router::new().route(
        "/work",
        get(|| async {
            tokio::time::sleep(Duration::from_millis(fastrand::u64(5..25))).await;
            "done"
        }),
    ))
    .layer(layer.clone());
    let (addr, stop_tx, server) = serve(app).await;
    let url = format!("http://{addr}/work");

    let seen = Arc::new(Seen::default());
    let done = Arc::new(AtomicBool::new(false));
    let load: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (seen, done, url) = (seen.clone(), done.clone(), url.clone());
            tokio::spawn(async move {
                let client = harness::client();
                while !done.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    let req = http::Request::get(&url).body(Empty::new()).unwrap();
                    let Ok(res) = client.request(req).await else {
                        seen.failed.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        continue;
                    };
                    let (parts, body) = res.into_parts();
                    let Ok(body) = body.collect().await else {
                        seen.failed.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    let answer = Answer {
                        status: parts.status,
                        headers: parts.headers,
                        body: body.to_bytes(),
                    };
                    match answer.status {
                        StatusCode::OK => seen.ok.fetch_add(1, Ordering::Relaxed),
                        StatusCode::SERVICE_UNAVAILABLE => {
                            assert_going_away(&answer);
                            let ms = started.elapsed().as_millis() as u64;
                            seen.slowest_503_ms.fetch_max(ms, Ordering::Relaxed);
                            seen.shed.fetch_add(1, Ordering::Relaxed)
                        }
                        _ => seen.other.fetch_add(1, Ordering::Relaxed),
                    };
                }
            })
        })
        .collect();

    // Steady load: every permit busy and a queue in the waiting room.
    eventually("a queue", SOON, || bulkhead.waiting() >= 3).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        seen.shed.load(Ordering::Relaxed),
        0,
        "nothing shed before the close"
    );

    // SIGTERM: close the bulkhead, then start axum's graceful shutdown.
    bulkhead.close();
    let closed = Instant::now();
    eventually("the waiting room empty", Duration::from_millis(200), || {
        bulkhead.waiting() == 0
    })
    .await;
    // A request after the close, on a fresh connection: a clear 503, at once.
    let late = harness::get(&harness::client(), &url, &[]).await;
    assert_going_away(&late);
    stop_tx.send(()).unwrap();
    tokio::time::timeout(SOON, server)
        .await
        .expect("graceful shutdown ends once the requests in flight are answered")
        .unwrap();
    let took = closed.elapsed();
    done.store(true, Ordering::Relaxed);
    for l in load {
        tokio::time::timeout(SOON, l).await.unwrap().unwrap();
    }
    assert!(took < Duration::from_secs(2), "the shutdown took {took:?}");
    let slowest = seen.slowest_503_ms.load(Ordering::Relaxed);
    assert!(slowest < 1000, "a 503 took {slowest} ms");

    // What the clients saw is what was counted; every permit back.
    let ok = seen.ok.load(Ordering::Relaxed);
    let shed = seen.shed.load(Ordering::Relaxed) + 1; // the late one
    assert_eq!(seen.other.load(Ordering::Relaxed), 0);
    assert!(ok > 0 && shed > 1, "{ok} ok, {shed} shed");
    let stats = layer.stats();
    assert_eq!(totals(&stats), (ok, 0, shed, 0), "{stats:?}");
    let b = bulkhead.stats();
    assert_eq!((b.admitted, b.closed, b.cancelled), (ok, shed, 0), "{b:?}");
    assert_eq!(b.shed(), 0, "{b:?}");
    assert_eq!((b.in_flight, b.waiting), (0, 0), "{b:?}");
    assert!(b.waited > 0, "{b:?}");

    // A second close is harmless; a later acquisition is still refused, and counted.
    bulkhead.close();
    assert!(bulkhead.is_closed());
    assert!(bulkhead.try_acquire().is_err());
    let again = bulkhead.stats();
    assert_eq!((again.admitted, again.closed), (ok, shed + 1));
    assert_eq!((again.in_flight, again.waiting), (0, 0));

    // An adaptive bulkhead learnt from each admitted request once, and from no refusal.
    if let Some(a) = bulkhead.adaptive_stats() {
        assert_eq!(a.back_pressure, 0, "{a:?}");
        assert_eq!(a.ok + a.ignored, ok, "{a:?}");
    }

    ok
}

/// Nothing the service started is left on the runtime: no more tasks alive than `before`.
async fn all_ended(before: usize) {
    eventually("every task ended", SOON, || alive() <= before).await;
}

/// A generous limit over a `MemoryGate`, inside the shed.
fn memory(app: Router) -> Router {
    app.layer(crate::overload::rate_limit(1_000_000))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_under_load() {
    let bulkhead = Bulkhead::builder(4)
        .max_waiting(64)
        .wait_timeout(Duration::from_secs(10))
        .name("api")
        .build()
        .unwrap();
    let before = alive();
    journey(bulkhead, memory).await;
    all_ended(before).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_under_load_adaptive() {
    let bulkhead = Bulkhead::builder(8)
        .max_waiting(64)
        .wait_timeout(Duration::from_secs(10))
        .adaptive(Aimd::builder().initial(4).build().unwrap())
        .name("api")
        .build()
        .unwrap();
    let max_before = bulkhead.max_in_flight();
    assert_eq!(max_before, 4);
    let before = alive();
    journey(bulkhead, memory).await;
    all_ended(before).await;
}

/// The same over a `RedisGate` with batching and leases: its batch driver and its Redis
/// connection end with the service.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_under_load_redis() {
    use flowgate::Quota;
    use flowgate::gate::{Limit, RedisGate};
    use flowgate::http::{Constant, Policy, RateLimitLayer};

    let redis = crate::support::RedisServer::start();
    let before = alive();
    let quota = Quota::per_hour(1_000_000).unwrap();
    let gate = RedisGate::builder(
        redis.fast_failing_manager().await,
        Limit::TokenBucket(quota),
    )
    .lease(16)
    .build()
    .await
    .unwrap();
    let limit = RateLimitLayer::builder(gate)
        .policy(Policy::new("all", quota, Constant::new("k")))
        .build()
        .unwrap();
    let bulkhead = Bulkhead::builder(4)
        .max_waiting(64)
        .wait_timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let layer = limit.clone();
    let ok = journey(bulkhead, move |app| app.layer(layer)).await;
    let stats = limit.stats();
    assert_eq!((stats.admitted, stats.fail_open), (ok, 0), "{stats:?}");
    drop(limit);
    all_ended(before).await;
}

/// The journey over HTTP/2 (h2c, prior knowledge: axum's server, hyper-util's auto builder
/// underneath) on one connection, as a gRPC-style or proxy client uses it: 3 streams in
/// flight (one of them streaming its body), 5 in the waiting room. The operator closes the
/// bulkhead: the 5 waiters get the going-away `503` at once (no `Connection` field over
/// HTTP/2, no `Retry-After`). Then axum's graceful shutdown: the server sends `GOAWAY`,
/// after which the client's new streams fail (they are not served, nor answered a 503);
/// the 3 in flight finish on the same connection, the streamed one holding its permit
/// until its last frame is sent; the server ends, every permit is back, and what the
/// client saw is what the layer and the bulkhead counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_graceful_shutdown_under_load_sends_goaway_and_answers_everyone() {
    use axum::body::Body;
    use bytes::Bytes;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use tokio::sync::{Semaphore, mpsc};

    const IN_FLIGHT: usize = 3;
    const WAITING: usize = 5;
    let bulkhead = Bulkhead::builder(IN_FLIGHT)
        .max_waiting(64)
        .wait_timeout(Duration::from_secs(60))
        .name("h2")
        .build()
        .unwrap();
    let layer = ShedLayer::builder(bulkhead.clone())
        .wait(true)
        .name("h2")
        .build()
        .unwrap();
    let release = Arc::new(Semaphore::new(0));
    let (frames_tx, frames_rx) = mpsc::channel::<Bytes>(4);
    let frames_rx = Arc::new(tokio::sync::Mutex::new(Some(frames_rx)));
    let app = Router::new()
        .route(
            "/work",
            get({
                let release = release.clone();
                move || async move {
                    release.acquire().await.unwrap().forget();
                    "done"
                }
            }),
        )
        .route(
            "/stream",
            get(move || async move {
                let rx = frames_rx.lock().await.take().unwrap();
                let frames = futures::stream::unfold(rx, |mut rx| async move {
                    rx.recv().await.map(|b| (Ok::<_, std::io::Error>(b), rx))
                });
                Body::from_stream(frames)
            }),
        )
        .layer(layer.clone());
    let (addr, stop_tx, server) = serve(app).await;

    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    let conn = tokio::spawn(conn);
    let get = |path: &str| {
        let mut send = send.clone();
        let req = http::Request::get(format!("http://{addr}{path}"))
            .body(Empty::<Bytes>::new())
            .unwrap();
        async move {
            send.ready().await?;
            send.send_request(req).await
        }
    };
    let answer = |res: http::Response<hyper::body::Incoming>| async move {
        let (parts, body) = res.into_parts();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.unwrap().to_bytes(),
        }
    };

    // Under load: 3 streams hold the permits (the streamed one's head is out, its body not),
    // 5 wait.
    let streamed = get("/stream").await.unwrap();
    assert_eq!(streamed.status(), StatusCode::OK);
    let mut streamed = streamed.into_body();
    let in_flight: Vec<_> = (1..IN_FLIGHT).map(|_| tokio::spawn(get("/work"))).collect();
    eventually("every permit taken", SOON, || {
        bulkhead.in_flight() == IN_FLIGHT
    })
    .await;
    let waiting: Vec<_> = (0..WAITING).map(|_| tokio::spawn(get("/work"))).collect();
    eventually("the waiting room full", SOON, || {
        bulkhead.waiting() == WAITING
    })
    .await;

    // SIGTERM: close the bulkhead; the waiters are answered at once.
    bulkhead.close();
    let joined = |task: tokio::task::JoinHandle<Result<_, hyper::Error>>| async move {
        answer(
            tokio::time::timeout(SOON, task)
                .await
                .unwrap()
                .unwrap()
                .unwrap(),
        )
        .await
    };
    for w in waiting {
        let gone = joined(w).await;
        assert_going_away(&gone);
        assert_eq!(harness::field(&gone.headers, "connection"), None, "HTTP/2");
    }
    assert_eq!((bulkhead.in_flight(), bulkhead.waiting()), (IN_FLIGHT, 0));

    // Graceful shutdown: `GOAWAY`. Until the client has it, a new stream is refused by the
    // closed bulkhead; after, it fails without an answer.
    stop_tx.send(()).unwrap();
    let mut refused_before_goaway = 0u64;
    let deadline = Instant::now() + SOON;
    loop {
        assert!(Instant::now() < deadline, "no GOAWAY reached the client");
        match tokio::time::timeout(SOON, get("/work"))
            .await
            .expect("a new stream is answered or fails")
        {
            Ok(res) => {
                assert_going_away(&answer(res).await);
                refused_before_goaway += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(_) => break,
        }
    }

    // The requests in flight finish on the same connection, and the server waits for them.
    assert!(
        !server.is_finished(),
        "the graceful shutdown waits for the streams in flight"
    );
    assert_eq!(bulkhead.in_flight(), IN_FLIGHT);
    release.add_permits(IN_FLIGHT - 1);
    for r in in_flight {
        let done = joined(r).await;
        assert_eq!(
            (done.status, &done.body[..]),
            (StatusCode::OK, &b"done"[..])
        );
    }
    eventually("the plain requests' permits back", SOON, || {
        bulkhead.in_flight() == 1
    })
    .await;
    // The streamed body holds its permit until its last frame is sent.
    frames_tx.send(Bytes::from_static(b"first ")).await.unwrap();
    let first = streamed
        .frame()
        .await
        .unwrap()
        .unwrap()
        .into_data()
        .unwrap();
    assert_eq!(&first[..], b"first ");
    assert_eq!(bulkhead.in_flight(), 1, "the body is not sent yet");
    frames_tx.send(Bytes::from_static(b"last")).await.unwrap();
    drop(frames_tx);
    let rest = streamed.collect().await.unwrap().to_bytes();
    assert_eq!(&rest[..], b"last");

    tokio::time::timeout(SOON, server)
        .await
        .expect("graceful shutdown ends once the streams in flight are answered")
        .unwrap();
    tokio::time::timeout(SOON, conn)
        .await
        .expect("the server closed the connection")
        .unwrap()
        .unwrap();

    // Every permit back; what the client saw is what was counted.
    let closed = WAITING as u64 + refused_before_goaway;
    let stats = layer.stats();
    assert_eq!(
        totals(&stats),
        (IN_FLIGHT as u64, 0, closed, 0),
        "{stats:?}"
    );
    let b = bulkhead.stats();
    assert_eq!((b.in_flight, b.waiting), (0, 0), "{b:?}");
    assert_eq!(
        (b.admitted, b.closed, b.cancelled),
        (IN_FLIGHT as u64, closed, 0),
        "{b:?}"
    );
    assert_eq!(b.shed(), 0, "{b:?}");
    assert_eq!(
        b.waited, 0,
        "the waiters were closed out, none admitted: {b:?}"
    );
}
