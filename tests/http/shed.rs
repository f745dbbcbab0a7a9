//! `ShedLayer` against a real server and a real client: critical requests keep their reserve
//! while normal ones get `503`, the waiting mode, permits held by streamed bodies, and
//! tower's keep-alive / clone-after-ready rules.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use bytes::Bytes;
use flowgate::bulkhead::Bulkhead;
use flowgate::http::{Class, ResponseBody, ShedLayer};
use http::{Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Empty, Full};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tower::{Layer, Service, ServiceExt};

use crate::harness::{self, Answer, Server};

const TEMPORARY_REDUCED_CAPACITY: &str =
    "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity";

/// Polls `cond` every 5 ms until it holds; fails after `limit`.
pub(crate) async fn eventually(what: &str, limit: Duration, cond: impl Fn() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A layer's counts: admitted, shed, closed, cancelled (all classes).
pub(crate) fn totals(s: &flowgate::http::ShedStats) -> (u64, u64, u64, u64) {
    (s.admitted(), s.shed(), s.closed(), s.cancelled())
}

/// The `503` a shed request gets: `Retry-After: retry_after` and the problem document.
pub(crate) fn assert_shed(answer: &Answer, retry_after: &str) {
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
    assert_eq!(
        harness::field(&answer.headers, "retry-after").as_deref(),
        Some(retry_after)
    );
    assert_eq!(
        harness::field(&answer.headers, "content-type").as_deref(),
        Some("application/problem+json")
    );
    let doc: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
    assert_eq!(doc["type"], TEMPORARY_REDUCED_CAPACITY);
    assert_eq!(
        doc["title"],
        "Request cannot be satisfied due to temporary server capacity constraints"
    );
    assert_eq!(doc["status"], 503);
    assert_eq!(doc["violated-policies"], serde_json::json!([]));
}

/// `/slow` waits for a permit of `release` (normal); `/fast` (normal), `/health` (critical)
/// and `/report` (sheddable) answer at once.
fn app(release: &Arc<Semaphore>) -> Router {
    let release = release.clone();
    Router::new()
        .route(
            "/slow",
            get(move || {
                let release = release.clone();
                async move {
                    release.acquire().await.unwrap().forget();
                    "slow"
                }
            }),
        )
        .route("/fast", get(|| async { "fast" }))
        .route("/health", get(|| async { "ok" }))
        .route("/report", get(|| async { "report" }))
}

/// The routes' classes.
fn class_of(path: &str) -> Class {
    match path {
        "/health" => Class::Critical,
        "/report" => Class::Sheddable,
        _ => Class::Normal,
    }
}

fn layer(bulkhead: &Bulkhead) -> flowgate::http::ShedLayerBuilder {
    ShedLayer::builder(bulkhead.clone()).classify(|req| class_of(req.uri.path()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_bulkhead_passes_critical_requests_and_sheds_the_rest() {
    // 4 permits, the last one only for critical work: normal work may hold 3.
    let bulkhead = Bulkhead::builder(4).critical_reserve(1).build().unwrap();
    let layer = layer(&bulkhead)
        .retry_after(Duration::from_millis(1500))
        .build()
        .unwrap();
    let release = Arc::new(Semaphore::new(0));
    let server = Server::start(app(&release).layer(layer.clone())).await;
    let client = harness::client();

    let slow: Vec<_> = (0..3)
        .map(|_| {
            let (client, url) = (client.clone(), server.url("/slow"));
            tokio::spawn(async move { harness::get(&client, &url, &[]).await })
        })
        .collect();
    eventually("the slow requests", Duration::from_secs(5), || {
        bulkhead.in_flight() == 3
    })
    .await;

    for _ in 0..5 {
        let health = harness::get(&client, &server.url("/health"), &[]).await;
        assert_eq!(health.status, StatusCode::OK, "{health:?}");
        assert_eq!(&health.body[..], b"ok");
        // The reserve comes back when the response is sent.
        eventually("the reserve back", Duration::from_secs(1), || {
            bulkhead.in_flight() == 3
        })
        .await;
    }
    let normal = harness::get(&client, &server.url("/fast"), &[]).await;
    assert_shed(&normal, "2"); // 1.5 s, rounded up
    let report = harness::get(&client, &server.url("/report"), &[]).await;
    assert_shed(&report, "2");

    release.add_permits(3);
    for answer in slow {
        let answer = answer.await.unwrap();
        assert_eq!(answer.status, StatusCode::OK);
        assert_eq!(&answer.body[..], b"slow");
    }
    eventually("every permit back", Duration::from_secs(1), || {
        bulkhead.in_flight() == 0
    })
    .await;
    for path in ["/fast", "/report"] {
        let answer = harness::get(&client, &server.url(path), &[]).await;
        assert_eq!(
            answer.status,
            StatusCode::OK,
            "{path} once the bulkhead has room"
        );
    }

    let stats = layer.stats();
    assert_eq!((stats.critical.admitted, stats.critical.shed), (5, 0));
    assert_eq!((stats.normal.admitted, stats.normal.shed), (4, 1));
    assert_eq!((stats.sheddable.admitted, stats.sheddable.shed), (1, 1));
    assert_eq!((stats.admitted(), stats.shed()), (10, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_waiting_mode_admits_a_waiter_when_a_permit_frees_and_sheds_it_after_the_timeout() {
    let timeout = Duration::from_millis(1500);
    let bulkhead = Bulkhead::builder(1)
        .max_waiting(4)
        .wait_timeout(timeout)
        .build()
        .unwrap();
    let layer = layer(&bulkhead).wait(true).build().unwrap();
    let release = Arc::new(Semaphore::new(0));
    // route_layer: the layer wraps each matched route.
    let server = Server::start(app(&release).route_layer(layer.clone())).await;
    let client = harness::client();
    let spawn_get = |path: &str| {
        let (client, url) = (client.clone(), server.url(path));
        tokio::spawn(async move { harness::get(&client, &url, &[]).await })
    };

    // A permit frees while a normal request waits: the waiter gets it.
    let slow = spawn_get("/slow");
    eventually("the slow request", Duration::from_secs(5), || {
        bulkhead.in_flight() == 1
    })
    .await;
    let waiter = spawn_get("/fast");
    eventually("the waiter", Duration::from_secs(5), || {
        bulkhead.waiting() == 1
    })
    .await;
    // A sheddable request never waits, even with room to.
    let report = harness::get(&client, &server.url("/report"), &[]).await;
    assert_shed(&report, "1");
    assert_eq!(bulkhead.waiting(), 1);
    release.add_permits(1);
    let (slow, waiter) = (slow.await.unwrap(), waiter.await.unwrap());
    assert_eq!(
        (slow.status, &slow.body[..]),
        (StatusCode::OK, &b"slow"[..])
    );
    assert_eq!(
        (waiter.status, &waiter.body[..]),
        (StatusCode::OK, &b"fast"[..])
    );
    eventually("every permit back", Duration::from_secs(1), || {
        bulkhead.in_flight() == 0
    })
    .await;

    // No permit frees: the waiter is shed after the bulkhead's wait_timeout.
    let slow = spawn_get("/slow");
    eventually("the slow request", Duration::from_secs(5), || {
        bulkhead.in_flight() == 1
    })
    .await;
    let started = Instant::now();
    let late = harness::get(&client, &server.url("/fast"), &[]).await;
    assert!(started.elapsed() >= timeout, "{:?}", started.elapsed());
    assert_shed(&late, "1");
    assert_eq!(bulkhead.waiting(), 0);
    release.add_permits(1);
    assert_eq!(slow.await.unwrap().status, StatusCode::OK);

    let stats = layer.stats();
    assert_eq!((stats.normal.admitted, stats.normal.shed), (3, 1));
    assert_eq!((stats.sheddable.admitted, stats.sheddable.shed), (0, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_body_holds_its_permit_until_it_is_sent_or_dropped() {
    let bulkhead = Bulkhead::new(4).unwrap();
    let layer = ShedLayer::builder(bulkhead.clone()).build().unwrap();
    type Chunks = mpsc::Receiver<Bytes>;
    let next: Arc<std::sync::Mutex<Option<Chunks>>> = Arc::default();
    let slot = next.clone();
    let app = Router::new()
        .route(
            "/stream",
            get(move || {
                let rx = slot
                    .lock()
                    .unwrap()
                    .take()
                    .expect("a stream for each request");
                async move {
                    Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
                        let chunk = rx.recv().await?;
                        Some((Ok::<_, Infallible>(chunk), rx))
                    }))
                }
            }),
        )
        .layer(layer.clone());
    let server = Server::start(app).await;
    let client = harness::client();
    let request = || {
        Request::get(server.url("/stream"))
            .body(Empty::<Bytes>::new())
            .unwrap()
    };

    // Sent to the end: the permit is held until the last chunk.
    let (tx, rx) = mpsc::channel(4);
    next.lock().unwrap().replace(rx);
    tx.send(Bytes::from_static(b"first ")).await.unwrap();
    let res = client.request(request()).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let mut body = res.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(&first[..], b"first ");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(bulkhead.in_flight(), 1, "the body is not sent yet");
    tx.send(Bytes::from_static(b"last")).await.unwrap();
    drop(tx);
    let rest = body.collect().await.unwrap().to_bytes();
    assert_eq!(&rest[..], b"last");
    eventually("the permit back", Duration::from_secs(1), || {
        bulkhead.in_flight() == 0
    })
    .await;

    // Dropped by a client that went away: the permit comes back with the body.
    let (tx, rx) = mpsc::channel(4);
    next.lock().unwrap().replace(rx);
    tx.send(Bytes::from_static(b"first ")).await.unwrap();
    let res = client.request(request()).await.unwrap();
    let mut body = res.into_body();
    body.frame().await.unwrap().unwrap();
    assert_eq!(bulkhead.in_flight(), 1);
    drop(body); // the pooled client closes the connection
    let start = Instant::now();
    while bulkhead.in_flight() != 0 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "permit never came back"
        );
        // The server notices the closed connection when it writes; a dropped body also
        // drops the receiver, so a failed send is fine.
        let _ = tx.try_send(Bytes::from_static(b"more "));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(layer.stats().normal.admitted, 2);
}

/// A bare hyper server (no axum) serving `layer` around a `200 hi` service, one task per
/// connection.
async fn bare_server(layer: ShedLayer) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let hi = tower::service_fn(|_req: Request<hyper::body::Incoming>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"hi"))))
        });
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let svc = hyper_util::service::TowerToHyperService::new(layer.layer(hi));
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc),
            );
        }
    });
    (addr, task)
}

/// One keep-alive HTTP/1 connection.
async fn connect(addr: SocketAddr) -> hyper::client::conn::http1::SendRequest<Empty<Bytes>> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    send
}

async fn send(
    conn: &mut hyper::client::conn::http1::SendRequest<Empty<Bytes>>,
    addr: SocketAddr,
) -> (StatusCode, Bytes) {
    conn.ready().await.unwrap();
    let req = Request::get("/")
        .header(header::HOST, addr.to_string())
        .body(Empty::new())
        .unwrap();
    let res = conn.send_request(req).await.unwrap();
    let status = res.status();
    (status, res.into_body().collect().await.unwrap().to_bytes())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keep_alive_connections_hold_no_permit() {
    // One permit: if an idle connection kept one, the other connection would get 503s.
    let bulkhead = Bulkhead::new(1).unwrap();
    let layer = ShedLayer::builder(bulkhead.clone()).build().unwrap();
    let (addr, server) = bare_server(layer.clone()).await;
    let mut a = connect(addr).await;
    let mut b = connect(addr).await;
    for _ in 0..20 {
        for conn in [&mut a, &mut b] {
            let (status, body) = send(conn, addr).await;
            assert_eq!((status, &body[..]), (StatusCode::OK, &b"hi"[..]));
            eventually("the permit back", Duration::from_secs(1), || {
                bulkhead.in_flight() == 0
            })
            .await;
        }
    }
    let stats = layer.stats();
    assert_eq!((stats.normal.admitted, stats.normal.shed), (40, 0));
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_requests_over_few_keep_alive_connections_fit_one_permit_each() {
    // Each connection has one request at a time, so 4 permits serve 4 connections and none
    // is ever shed; in_flight is back to 0 at the end.
    let bulkhead = Bulkhead::new(4).unwrap();
    let layer = ShedLayer::builder(bulkhead.clone()).build().unwrap();
    let (addr, server) = bare_server(layer.clone()).await;
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let mut conn = connect(addr).await;
        tasks.push(tokio::spawn(async move {
            for _ in 0..50 {
                let (status, _) = send(&mut conn, addr).await;
                assert_eq!(status, StatusCode::OK);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    eventually("every permit back", Duration::from_secs(1), || {
        bulkhead.in_flight() == 0
    })
    .await;
    let stats = layer.stats();
    assert_eq!((stats.normal.admitted, stats.normal.shed), (200, 0));
    server.abort();
}

/// A service whose `poll_ready` reserves one of `slots` and whose `call` spends it, like
/// tower's `ConcurrencyLimit`: calling a clone that was not made ready panics.
struct Reserving {
    slots: Arc<Semaphore>,
    held: Option<OwnedSemaphorePermit>,
}

impl Clone for Reserving {
    fn clone(&self) -> Reserving {
        Reserving {
            slots: self.slots.clone(),
            held: None,
        }
    }
}

impl Service<Request<Empty<Bytes>>> for Reserving {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        if self.held.is_none() {
            let slot = self.slots.clone().try_acquire_owned();
            self.held = Some(slot.expect("a free slot: a ready clone was leaked"));
        }
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<Empty<Bytes>>) -> Self::Future {
        let slot = self
            .held
            .take()
            .expect("called a clone that was not made ready");
        Box::pin(async move {
            drop(slot);
            Ok(Response::new(Full::new(Bytes::from_static(b"reserved"))))
        })
    }
}

fn assert_send<T: Send>(_: &T) {}

#[tokio::test]
async fn the_service_made_ready_is_the_one_called() {
    let bulkhead = Bulkhead::new(1).unwrap();
    let slots = Arc::new(Semaphore::new(1));
    let mut svc = ShedLayer::builder(bulkhead.clone())
        .build()
        .unwrap()
        .layer(Reserving {
            slots: slots.clone(),
            held: None,
        });
    let req = || Request::get("/").body(Empty::new()).unwrap();
    for _ in 0..10 {
        let fut = svc.ready().await.unwrap().call(req());
        assert_send(&fut);
        let res = fut.await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert!(matches!(res.body(), ResponseBody::Held(..)));
        let body = res.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"reserved");
        assert_eq!(bulkhead.in_flight(), 0);
    }

    // Shed: the ready clone is dropped unused and gives its slot back.
    let held = bulkhead.try_acquire().unwrap();
    let res = svc.ready().await.unwrap().call(req()).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(slots.available_permits(), 1);
    drop(held);
    let res = svc.ready().await.unwrap().call(req()).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(bulkhead.in_flight(), 1, "held by the body until it is sent");
    drop(res);
    assert_eq!(bulkhead.in_flight(), 0);
}

#[cfg(feature = "metrics")]
#[tokio::test]
async fn shed_requests_are_counted_by_class() {
    let recorder = crate::support::TestRecorder::default();
    let bulkhead = Bulkhead::builder(2).critical_reserve(1).build().unwrap();
    let layer = metrics::with_local_recorder(&recorder, || {
        layer(&bulkhead).name("shed-metrics").build().unwrap()
    });
    let svc = layer.layer(tower::service_fn(|_req: Request<Empty<Bytes>>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    }));
    let call = |path: &'static str| {
        let svc = svc.clone();
        async move {
            let req = Request::get(path).body(Empty::new()).unwrap();
            svc.oneshot(req).await.unwrap()
        }
    };
    let held = bulkhead.try_acquire().unwrap(); // the normal share is taken
    assert_eq!(
        call("/fast").await.status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(
        call("/fast").await.status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(
        call("/report").await.status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(call("/health").await.status(), StatusCode::OK);
    drop(held);
    let id = |class: &str| format!("flowgate_http_shed_total{{class={class},name=shed-metrics}}");
    assert_eq!(recorder.counter(&id("normal")), 2);
    assert_eq!(recorder.counter(&id("sheddable")), 1);
    assert_eq!(recorder.counter(&id("critical")), 0);
    assert!(
        recorder.ids().contains(&id("critical")),
        "registered at build"
    );
    let stats = layer.stats();
    assert_eq!((stats.critical.admitted, stats.shed()), (1, 3));
}

/// A metrics recorder that panics (user code) as the layer counts a `503`: the panic
/// reaches whoever polls the response future, which is then dropped, and no `503` was
/// sent. The request was counted as shed all the same (counted before the recorder was
/// called), so the stats said one more `503` than `flowgate_http_shed_total` and the
/// client saw. Now it is counted once, as `cancelled`, as a rate-limit layer counts a
/// request whose recorder panicked; the next `503` is counted in both.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn a_recorder_that_panics_counting_a_503_counts_the_request_cancelled() {
    use futures::FutureExt;
    let recorder = crate::support::TestRecorder::default();
    let bulkhead = Bulkhead::new(1).unwrap();
    let layer = metrics::with_local_recorder(&recorder, || {
        layer(&bulkhead).name("shed-panics").build().unwrap()
    });
    let id = "flowgate_http_shed_total{class=normal,name=shed-panics}";
    let _held = bulkhead.try_acquire_owned().unwrap();
    let send = || {
        let fut = layer.layer(answers_ok()).oneshot(request("/fast"));
        std::panic::AssertUnwindSafe(fut).catch_unwind()
    };
    recorder.panic_on(id, true);
    assert!(
        send().await.is_err(),
        "the recorder's panic reached the caller"
    );
    recorder.panic_on(id, false);
    let counts = |c: flowgate::http::ClassStats| (c.admitted, c.shed, c.cancelled);
    assert_eq!(counts(layer.stats().normal), (0, 0, 1));
    assert_eq!(recorder.counter(id), 0);
    let res = send().await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(counts(layer.stats().normal), (0, 1, 1));
    assert_eq!(recorder.counter(id), 1);
}

/// A request that ends before it got a permit or a `503` (its client went away while it
/// waited in the bulkhead's waiting room, or before its future was polled) is counted as
/// `cancelled` in its class: `admitted + shed + cancelled` is every request the layer was
/// called with. It was counted nowhere, so an operator comparing the layer's counts with
/// the requests served could not tell the requests given up from lost ones. A request
/// admitted and then dropped is not cancelled: it counts as admitted.
#[tokio::test(start_paused = true)]
async fn requests_given_up_before_a_permit_are_counted_cancelled() {
    let bulkhead = Bulkhead::builder(2)
        .critical_reserve(1)
        .wait_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let layer = layer(&bulkhead).wait(true).build().unwrap();
    let mut svc = layer.layer(tower::service_fn(|_req: Request<Empty<Bytes>>| {
        std::future::pending::<Result<Response<Full<Bytes>>, Infallible>>()
    }));
    let req = |path: &str| Request::get(path).body(Empty::new()).unwrap();
    // Admitted, then dropped while the inner service runs: admitted, not cancelled.
    let mut admitted = Box::pin(svc.ready().await.unwrap().call(req("/fast")));
    assert!(futures::poll!(admitted.as_mut()).is_pending());
    drop(admitted);
    let _held = bulkhead.try_acquire_owned().unwrap(); // the normal share is taken
    // Waits in the room, then given up.
    let mut waiting = Box::pin(svc.ready().await.unwrap().call(req("/fast")));
    assert!(futures::poll!(waiting.as_mut()).is_pending());
    assert_eq!(bulkhead.waiting(), 1);
    drop(waiting);
    // Never polled.
    drop(svc.ready().await.unwrap().call(req("/fast")));
    drop(svc.ready().await.unwrap().call(req("/report")));
    let stats = layer.stats();
    let counts = |c: flowgate::http::ClassStats| (c.admitted, c.shed, c.cancelled);
    assert_eq!(counts(stats.normal), (1, 0, 2), "{stats:?}");
    assert_eq!(counts(stats.sheddable), (0, 0, 1), "{stats:?}");
    assert_eq!(counts(stats.critical), (0, 0, 0), "{stats:?}");
    assert_eq!(stats.cancelled(), 3);
}

/// A service that answers `200` at once.
pub(crate) fn answers_ok() -> impl Service<
    Request<Empty<Bytes>>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl Future + Send,
> + Clone {
    tower::service_fn(|_req: Request<Empty<Bytes>>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    })
}

pub(crate) fn request(path: &str) -> Request<Empty<Bytes>> {
    Request::get(path).body(Empty::new()).unwrap()
}

/// A bulkhead of 1 with a waiting room of `max_waiting` and a timeout of a minute, and a
/// layer over it in the waiting mode, classified by [`class_of`].
fn waiting_layer(max_waiting: usize) -> (Bulkhead, ShedLayer) {
    let bulkhead = Bulkhead::builder(1)
        .max_waiting(max_waiting)
        .wait_timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let layer = layer(&bulkhead).wait(true).build().unwrap();
    (bulkhead, layer)
}

/// A classifier that panics (user code, run in `call`) lets the panic go to the caller, and
/// the request it was called with is counted: as `cancelled`, in the default class
/// (`Normal`), as it ended with neither a permit nor a `503`. It was counted nowhere, so
/// `admitted + shed + cancelled` fell short of the requests the layer was called with.
/// The next request is classified and served as usual.
#[tokio::test]
async fn a_panicking_classifier_counts_its_request_cancelled() {
    let bulkhead = Bulkhead::new(2).unwrap();
    let layer = ShedLayer::builder(bulkhead.clone())
        .classify(|req| {
            assert_ne!(req.uri.path(), "/boom", "classifier bug");
            Class::Critical
        })
        .build()
        .unwrap();
    let mut svc = layer.layer(answers_ok());
    let ready = svc.ready().await.unwrap();
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        ready.call(request("/boom"))
    }));
    assert!(
        unwound.is_err(),
        "the classifier's panic goes to the caller"
    );
    let stats = layer.stats();
    assert_eq!(stats.normal.cancelled, 1, "{stats:?}");
    assert_eq!(stats.admitted() + stats.shed() + stats.cancelled(), 1);
    assert_eq!(bulkhead.in_flight(), 0);
    let res = svc
        .ready()
        .await
        .unwrap()
        .call(request("/ok"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    drop(res);
    let stats = layer.stats();
    assert_eq!((stats.critical.admitted, stats.cancelled()), (1, 1));
}

/// A service that answers `200` at once, whose `Clone` (`on_clone`) or `Drop` (user code
/// both) panics once, when `armed`.
pub(crate) struct Armed {
    pub(crate) armed: Arc<AtomicBool>,
    pub(crate) on_clone: bool,
}

impl Armed {
    /// Whether this is the armed call: disarms it.
    fn fires(&self, on_clone: bool) -> bool {
        self.on_clone == on_clone && self.armed.swap(false, Ordering::SeqCst)
    }
}

impl Clone for Armed {
    fn clone(&self) -> Self {
        assert!(!self.fires(true), "the service's clone panics");
        Armed {
            armed: self.armed.clone(),
            on_clone: self.on_clone,
        }
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        if !std::thread::panicking() && self.fires(false) {
            panic!("the service panics as it is dropped");
        }
    }
}

impl Service<Request<Empty<Bytes>>> for Armed {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<Full<Bytes>>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _req: Request<Empty<Bytes>>) -> Self::Future {
        std::future::ready(Ok(Response::new(Full::new(Bytes::new()))))
    }
}

/// The inner service's `Clone` (user code) runs in `call`, after the classifier, for the
/// clone that stays when the ready service goes with the request: if it panics, the panic
/// goes to the caller and the request is counted cancelled in its class, as it ended with
/// neither a permit nor a `503`. It was counted nowhere, so `admitted + shed + cancelled`
/// fell short of the requests the layer was called with. The next request is served.
#[tokio::test]
async fn an_inner_service_whose_clone_panics_counts_its_request_cancelled() {
    let bulkhead = Bulkhead::new(2).unwrap();
    let layer = ShedLayer::builder(bulkhead.clone())
        .classify(|_| Class::Critical)
        .build()
        .unwrap();
    let armed = Arc::new(AtomicBool::new(true));
    let mut svc = layer.layer(Armed {
        armed: armed.clone(),
        on_clone: true,
    });
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| svc.call(request("/"))));
    assert!(unwound.is_err(), "the clone's panic goes to the caller");
    let stats = layer.stats();
    assert_eq!(stats.critical.cancelled, 1, "{stats:?}");
    assert_eq!(stats.admitted() + stats.shed() + stats.cancelled(), 1);
    assert_eq!(bulkhead.in_flight(), 0);
    assert!(!armed.load(Ordering::SeqCst));
    let res = svc.call(request("/")).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    drop(res);
    let stats = layer.stats();
    assert_eq!((stats.critical.admitted, stats.cancelled()), (1, 1));
}

/// A refused request drops the ready inner service it held unused: user code (its
/// `Drop`). If that panics, the panic goes to the caller, no `503` is sent, and the request
/// is counted once, cancelled, as when a recorder panics counting its `503`. It was
/// counted twice: shed as its `503` was made, then cancelled as its future was dropped.
#[tokio::test]
async fn a_refused_requests_service_panicking_as_it_is_dropped_is_counted_once() {
    let bulkhead = Bulkhead::new(1).unwrap();
    let layer = ShedLayer::builder(bulkhead.clone()).build().unwrap();
    let armed = Arc::new(AtomicBool::new(false));
    let mut svc = layer.layer(Armed {
        armed: armed.clone(),
        on_clone: false,
    });
    let busy = bulkhead.try_acquire().unwrap();
    let refused = svc.call(request("/"));
    armed.store(true, Ordering::SeqCst);
    let unwound = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(refused)).await;
    assert!(unwound.is_err(), "the drop's panic goes to the caller");
    assert!(!armed.load(Ordering::SeqCst));
    let stats = layer.stats();
    assert_eq!(
        (stats.normal.shed, stats.normal.cancelled),
        (0, 1),
        "{stats:?}"
    );
    assert_eq!(stats.admitted() + stats.shed() + stats.cancelled(), 1);
    drop(busy);
    let res = svc.call(request("/")).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    drop(res);
    assert_eq!(layer.stats().normal.admitted, 1);
    assert_eq!(bulkhead.in_flight(), 0);
}

/// A closed bulkhead refuses every request with the layer's going-away `503` (counted as
/// closed, by class), the one waiting in the waiting room when it closes too (woken, not
/// left to its timeout), and the critical ones: the reserve is not a way past a close.
#[tokio::test(start_paused = true)]
async fn a_closed_bulkhead_sheds_every_request_and_its_waiters() {
    let (bulkhead, layer) = waiting_layer(usize::MAX);
    let mut svc = layer.layer(answers_ok());
    let held = bulkhead.try_acquire_owned().unwrap();
    let mut waiting = Box::pin(svc.ready().await.unwrap().call(request("/fast")));
    assert!(futures::poll!(waiting.as_mut()).is_pending());
    assert_eq!(bulkhead.waiting(), 1);
    bulkhead.close();
    let Poll::Ready(res) = futures::poll!(waiting.as_mut()) else {
        panic!("the close wakes the waiter and refuses it");
    };
    assert_eq!(res.unwrap().status(), StatusCode::SERVICE_UNAVAILABLE);
    drop(held);
    for path in ["/fast", "/health", "/report"] {
        let res = svc
            .ready()
            .await
            .unwrap()
            .call(request(path))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE, "{path}");
        assert!(res.headers().get(header::RETRY_AFTER).is_none(), "{path}");
        assert_eq!(res.headers()[header::CONNECTION], "close", "{path}");
    }
    let stats = layer.stats();
    let counts = |c: flowgate::http::ClassStats| (c.admitted, c.shed, c.closed, c.cancelled);
    assert_eq!(counts(stats.normal), (0, 0, 2, 0), "{stats:?}");
    assert_eq!(counts(stats.critical), (0, 0, 1, 0), "{stats:?}");
    assert_eq!(counts(stats.sheddable), (0, 0, 1, 0), "{stats:?}");
    assert_eq!(bulkhead.stats().closed, 4);
}

/// In the waiting mode, a critical request that finds the waiting room full pushes the
/// newest normal waiter out (answered `503`, counted shed), waits in its place and is
/// served first when a permit frees, ahead of an older normal waiter; a sheddable request
/// never queues.
#[tokio::test(start_paused = true)]
async fn a_waiting_critical_request_pushes_out_the_newest_normal_one_and_goes_first() {
    let (bulkhead, layer) = waiting_layer(2);
    let mut svc = layer.layer(answers_ok());
    let held = bulkhead.try_acquire_owned().unwrap();
    let mut older = Box::pin(svc.ready().await.unwrap().call(request("/fast")));
    let mut newer = Box::pin(svc.ready().await.unwrap().call(request("/fast")));
    assert!(futures::poll!(older.as_mut()).is_pending());
    assert!(futures::poll!(newer.as_mut()).is_pending());
    let report = svc
        .ready()
        .await
        .unwrap()
        .call(request("/report"))
        .await
        .unwrap();
    assert_eq!(report.status(), StatusCode::SERVICE_UNAVAILABLE);
    let mut critical = Box::pin(svc.ready().await.unwrap().call(request("/health")));
    assert!(futures::poll!(critical.as_mut()).is_pending());
    assert_eq!(bulkhead.waiting(), 2, "the room keeps its size");
    let Poll::Ready(pushed) = futures::poll!(newer.as_mut()) else {
        panic!("the newest normal waiter is pushed out at once");
    };
    assert_eq!(pushed.unwrap().status(), StatusCode::SERVICE_UNAVAILABLE);
    drop(held);
    assert!(
        futures::poll!(older.as_mut()).is_pending(),
        "critical first"
    );
    let Poll::Ready(served) = futures::poll!(critical.as_mut()) else {
        panic!("the freed permit goes to the critical waiter");
    };
    drop(served.unwrap());
    let Poll::Ready(served) = futures::poll!(older.as_mut()) else {
        panic!("then to the older normal waiter");
    };
    assert_eq!(served.unwrap().status(), StatusCode::OK);
    let stats = layer.stats();
    let counts = |c: flowgate::http::ClassStats| (c.admitted, c.shed, c.cancelled);
    assert_eq!(counts(stats.normal), (1, 1, 0), "{stats:?}");
    assert_eq!(counts(stats.critical), (1, 0, 0), "{stats:?}");
    assert_eq!(counts(stats.sheddable), (0, 1, 0), "{stats:?}");
    assert_eq!(bulkhead.stats().waiting_room_full, 1);
    assert_eq!(bulkhead.stats().no_permit, 1);
}

/// Requests of every class racing on two threads, some given up while they wait, some
/// while the inner service runs, with the bulkhead closed halfway: every request the layer
/// was called with ends counted once (`admitted + shed + cancelled`), the bulkhead's own
/// counts agree, and no permit is left out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_requests_and_a_close_are_each_counted_once() {
    const N: usize = 400;
    let bulkhead = Bulkhead::builder(3)
        .critical_reserve(1)
        .max_waiting(4)
        .wait_timeout(Duration::from_millis(2))
        .build()
        .unwrap();
    let layer = layer(&bulkhead).wait(true).build().unwrap();
    let svc = layer.layer(tower::service_fn(|_req: Request<Empty<Bytes>>| async {
        tokio::task::yield_now().await;
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    }));
    let mut tasks = Vec::new();
    for i in 0..N {
        let svc = svc.clone();
        let bulkhead = bulkhead.clone();
        tasks.push(tokio::spawn(async move {
            if i == N / 2 {
                bulkhead.close();
            }
            let path = ["/fast", "/health", "/report"][i % 3];
            let call = svc.oneshot(request(path));
            if i % 5 == 0 {
                // Given up at some point of its way.
                let _ =
                    tokio::time::timeout(Duration::from_micros(50 * (i % 7) as u64), call).await;
            } else {
                drop(call.await.unwrap());
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let stats = layer.stats();
    assert_eq!(
        stats.admitted() + stats.shed() + stats.closed() + stats.cancelled(),
        N as u64,
        "{stats:?}"
    );
    let b = bulkhead.stats();
    assert_eq!((b.in_flight, b.waiting), (0, 0), "{b:?}");
    assert_eq!(b.admitted, stats.admitted(), "{b:?} {stats:?}");
    // A waiter closed out or pushed out as it was given up: a refusal to the bulkhead,
    // cancelled to the layer (no `503` was sent).
    assert_eq!(b.acquisitions(), N as u64, "{b:?}");
    assert!(b.shed() >= stats.shed(), "{b:?} {stats:?}");
    assert!(b.closed >= stats.closed(), "{b:?} {stats:?}");
}

/// `GET /` on `conn`: the whole answer, headers included.
async fn answer(
    conn: &mut hyper::client::conn::http1::SendRequest<Empty<Bytes>>,
    addr: SocketAddr,
) -> Answer {
    conn.ready().await.unwrap();
    let req = Request::get("/")
        .header(header::HOST, addr.to_string())
        .body(Empty::new())
        .unwrap();
    let (parts, body) = conn.send_request(req).await.unwrap().into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

/// The `503` of a closed bulkhead (the server going away), as a client or a proxy reads it:
/// `Connection: close` on HTTP/1.1 (reconnect, and so go elsewhere behind a balancer), no
/// `Retry-After` (the server cannot say when it will serve again: the client's own backoff
/// decides), and a problem document of its own (`about:blank`, "Service Unavailable", a
/// `detail` saying so), not the `temporary-reduced-capacity` of a shed.
pub(crate) fn assert_going_away(answer: &Answer) {
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
    assert_eq!(
        harness::field(&answer.headers, "retry-after"),
        None,
        "{answer:?}"
    );
    assert_eq!(
        harness::field(&answer.headers, "content-type").as_deref(),
        Some("application/problem+json")
    );
    let doc: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
    assert_eq!(doc["type"], "about:blank", "{doc}");
    assert_eq!(doc["title"], "Service Unavailable", "{doc}");
    assert_eq!(doc["status"], 503, "{doc}");
    assert!(
        doc["detail"].as_str().unwrap().contains("shutting down"),
        "{doc}"
    );
}

/// A client on a keep-alive HTTP/1.1 connection tells a closed bulkhead (the server going
/// away) from a saturated one (busy): the busy `503` keeps the connection and says
/// `Retry-After` and `temporary-reduced-capacity`; the going-away one closes it
/// (`Connection: close`), sends no `Retry-After` and its own problem document. The layer
/// counts them apart (`closed`, not `shed`), in its stats and its metrics.
#[cfg(feature = "metrics")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_bulkhead_answers_going_away_not_busy() {
    let recorder = crate::support::TestRecorder::default();
    let bulkhead = Bulkhead::new(1).unwrap();
    let layer = metrics::with_local_recorder(&recorder, || {
        ShedLayer::builder(bulkhead.clone())
            .retry_after(Duration::from_secs(3))
            .name("going")
            .build()
            .unwrap()
    });
    let (addr, server) = bare_server(layer.clone()).await;
    let mut conn = connect(addr).await;

    // Busy: the one permit is held elsewhere.
    let held = bulkhead.try_acquire_owned().unwrap();
    let busy = answer(&mut conn, addr).await;
    assert_shed(&busy, "3");
    assert_eq!(harness::field(&busy.headers, "connection"), None);
    drop(held);
    let served = answer(&mut conn, addr).await;
    assert_eq!(
        served.status,
        StatusCode::OK,
        "the busy 503 kept the connection"
    );

    // Going away.
    bulkhead.close();
    let gone = answer(&mut conn, addr).await;
    assert_going_away(&gone);
    assert_eq!(
        harness::field(&gone.headers, "connection").as_deref(),
        Some("close")
    );
    eventually(
        "the server closes the connection",
        Duration::from_secs(5),
        || conn.is_closed(),
    )
    .await;

    let stats = layer.stats();
    let n = stats.normal;
    assert_eq!(
        (n.admitted, n.shed, n.closed, n.cancelled),
        (1, 1, 1, 0),
        "a closed refusal is no shed: {stats:?}"
    );
    assert_eq!((stats.shed(), stats.closed()), (1, 1));
    assert_eq!(
        recorder.counter("flowgate_http_shed_total{class=normal,name=going}"),
        1
    );
    assert_eq!(
        recorder.counter("flowgate_http_shed_closed_total{class=normal,name=going}"),
        1
    );
    let b = bulkhead.stats();
    assert_eq!((b.closed, b.no_permit, b.in_flight), (1, 1, 0), "{b:?}");
    server.abort();
}

/// What an adaptive bulkhead learns from the inner service's answers, over a real server
/// and client: a `500` or `502` is a served call (not a drop: a failing route must not cut
/// the limit every route is served under), a `503` is back-pressure; and an
/// [`Outcome`](flowgate::adaptive::Outcome) the handler put in the response's extensions wins
/// over the status, either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_in_the_response_extensions_classifies_it_for_the_adaptive_limit() {
    use axum::Extension;
    use flowgate::adaptive::{Aimd, Outcome};

    let bulkhead = Bulkhead::builder(64)
        .adaptive(Aimd::builder().initial(16).build().unwrap())
        .build()
        .unwrap();
    let layer = ShedLayer::builder(bulkhead.clone()).build().unwrap();
    let app = Router::new()
        .route("/bug", get(|| async { StatusCode::INTERNAL_SERVER_ERROR }))
        .route("/upstream-down", get(|| async { StatusCode::BAD_GATEWAY }))
        .route("/busy", get(|| async { StatusCode::SERVICE_UNAVAILABLE }))
        .route(
            "/upstream-overloaded",
            get(|| async { (Extension(Outcome::BackPressure), StatusCode::BAD_GATEWAY) }),
        )
        .route(
            "/failed-at-once",
            get(|| async {
                (
                    Extension(Outcome::Ignored),
                    StatusCode::INTERNAL_SERVER_ERROR,
                )
            }),
        )
        .route(
            "/maintenance-page",
            get(|| async { (Extension(Outcome::Ok), StatusCode::SERVICE_UNAVAILABLE) }),
        )
        .layer(layer.clone());
    let server = Server::start(app).await;
    let client = harness::client();
    let mut learnt = Vec::new();
    for (path, status) in [
        ("/bug", 500),
        ("/upstream-down", 502),
        ("/busy", 503),
        ("/upstream-overloaded", 502),
        ("/failed-at-once", 500),
        ("/maintenance-page", 503),
    ] {
        let before = bulkhead.adaptive_stats().unwrap();
        let res = harness::get(&client, &server.url(path), &[]).await;
        assert_eq!(res.status.as_u16(), status, "{path}");
        eventually("the permit back", Duration::from_secs(5), || {
            bulkhead.in_flight() == 0
        })
        .await;
        let after = bulkhead.adaptive_stats().unwrap();
        learnt.push((
            path,
            after.ok - before.ok,
            after.back_pressure - before.back_pressure,
            after.ignored - before.ignored,
        ));
    }
    assert_eq!(
        learnt,
        [
            ("/bug", 1, 0, 0),
            ("/upstream-down", 1, 0, 0),
            ("/busy", 0, 1, 0),
            ("/upstream-overloaded", 0, 1, 0),
            ("/failed-at-once", 0, 0, 1),
            ("/maintenance-page", 1, 0, 0),
        ]
    );
    assert_eq!(layer.stats().normal.admitted, 6);
}

/// A closed bulkhead's going-away `503` is the server shutting down, not overloaded: an
/// adaptive `ShedLayer` around the closed one does not read it as back-pressure (it is
/// marked `Outcome::Ignored`), so its limit is not cut as the server goes away.
#[tokio::test]
async fn an_outer_adaptive_limit_ignores_an_inner_going_away_503() {
    use flowgate::adaptive::Aimd;

    let outer = Bulkhead::builder(64)
        .adaptive(Aimd::builder().initial(16).build().unwrap())
        .build()
        .unwrap();
    let inner = Bulkhead::new(4).unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(ShedLayer::builder(inner.clone()).build().unwrap())
        .layer(ShedLayer::builder(outer.clone()).build().unwrap());
    let server = Server::start(app).await;
    let client = harness::client();
    inner.close();
    let before = outer.adaptive_stats().unwrap();
    let res = harness::get(&client, &server.url("/"), &[]).await;
    assert_eq!(res.status, StatusCode::SERVICE_UNAVAILABLE);
    eventually("the permit back", Duration::from_secs(5), || {
        outer.in_flight() == 0
    })
    .await;
    let after = outer.adaptive_stats().unwrap();
    assert_eq!(
        (
            after.ok - before.ok,
            after.back_pressure - before.back_pressure,
            after.ignored - before.ignored
        ),
        (0, 0, 1)
    );
}
