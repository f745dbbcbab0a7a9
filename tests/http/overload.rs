//! The operator's journey: an axum API behind a `ShedLayer` over a bulkhead with a waiting
//! room, a wait timeout and a critical reserve, overloaded by real HTTP/1 clients on
//! 127.0.0.1. What the clients saw (each `200`, each `503` with its `Retry-After` and
//! problem document) is what the layer, the bulkhead and their metrics counted: clients
//! that hang up while they wait, a waiting room that fills, critical requests at the
//! reserve's edge pushing normal waiters out, the bulkhead resized and closed under
//! waiters, a streamed body holding its permit, and a `RateLimitLayer` inside the shed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::{get, post};
use bytes::Bytes;
use flowgate::Quota;
use flowgate::bulkhead::{Bulkhead, BulkheadStats};
use flowgate::gate::{Limit, MemoryGate};
use flowgate::http::{Class, ClassStats, Constant, Policy, RateLimitLayer, ShedLayer};
use http::StatusCode;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinHandle;

use crate::harness::{self, Answer, Server};
use crate::shed::{assert_going_away, assert_shed, eventually, totals};

const TIMEOUT: Duration = Duration::from_millis(1500);
const SOON: Duration = Duration::from_secs(5);

/// `/slow` and `/admin` (critical) wait for a permit of `release`; `/fast`, `/health`
/// (critical) and `/report` (sheddable) answer at once, `/jitter` within 15 ms; `/upload` reads its body; `/stream`
/// streams what the next channel of `streams` sends.
fn app(
    release: &Arc<Semaphore>,
    streams: mpsc::UnboundedReceiver<mpsc::Receiver<Bytes>>,
) -> Router {
    let slow = |release: Arc<Semaphore>, said: &'static str| {
        move || async move {
            release.acquire().await.unwrap().forget();
            said
        }
    };
    let streams = Arc::new(tokio::sync::Mutex::new(streams));
    Router::new()
        .route("/slow", get(slow(release.clone(), "slow")))
        .route("/admin", get(slow(release.clone(), "admin")))
        .route("/fast", get(|| async { "fast" }))
        .route(
            "/jitter",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..15))).await;
                "jitter"
            }),
        )
        .route("/health", get(|| async { "ok" }))
        .route("/report", get(|| async { "report" }))
        .route(
            "/upload",
            post(|body: Bytes| async move { body.len().to_string() }),
        )
        .route(
            "/stream",
            get(move || async move {
                let rx = streams.lock().await.recv().await.unwrap();
                Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
                    let chunk = rx.recv().await?;
                    Some((Ok::<_, std::convert::Infallible>(chunk), rx))
                }))
            }),
        )
}

fn class_of(path: &str) -> Class {
    match path {
        "/health" | "/admin" => Class::Critical,
        "/report" => Class::Sheddable,
        _ => Class::Normal,
    }
}

/// 4 permits, the last for critical work; a waiting room of 3; waits shed after
/// [`TIMEOUT`].
fn bulkhead() -> Bulkhead {
    Bulkhead::builder(4)
        .critical_reserve(1)
        .max_waiting(3)
        .wait_timeout(TIMEOUT)
        .name("api")
        .build()
        .unwrap()
}

/// The layer in the waiting mode, `Retry-After: 2`.
fn shed(bulkhead: &Bulkhead) -> ShedLayer {
    ShedLayer::builder(bulkhead.clone())
        .classify(|req| class_of(req.uri.path()))
        .wait(true)
        .retry_after(Duration::from_secs(2))
        .name("api")
        .build()
        .unwrap()
}

/// What the clients saw: `200`s and `503`s (each checked as the layer's: a shed, or the
/// going-away one of a closed bulkhead); other statuses are not counted here.
#[derive(Default)]
struct Seen {
    ok: AtomicU64,
    shed: AtomicU64,
    closed: AtomicU64,
}

impl Seen {
    fn saw(&self, a: &Answer) {
        match a.status {
            StatusCode::OK => {
                self.ok.fetch_add(1, Ordering::SeqCst);
            }
            StatusCode::SERVICE_UNAVAILABLE if a.headers.contains_key("retry-after") => {
                assert_shed(a, "2");
                self.shed.fetch_add(1, Ordering::SeqCst);
            }
            StatusCode::SERVICE_UNAVAILABLE => {
                assert_going_away(a);
                self.closed.fetch_add(1, Ordering::SeqCst);
            }
            _ => {}
        }
    }

    /// The `200`s and the shed `503`s.
    fn counts(&self) -> (u64, u64) {
        (
            self.ok.load(Ordering::SeqCst),
            self.shed.load(Ordering::SeqCst),
        )
    }

    /// The going-away `503`s.
    fn closed(&self) -> u64 {
        self.closed.load(Ordering::SeqCst)
    }
}

struct Clients {
    server: Server,
    client: hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Empty<Bytes>,
    >,
    seen: Arc<Seen>,
}

impl Clients {
    /// `GET path` on a task of its own; the answer is tallied.
    fn spawn(&self, path: &str) -> JoinHandle<Answer> {
        let (client, url, seen) = (
            self.client.clone(),
            self.server.url(path),
            self.seen.clone(),
        );
        tokio::spawn(async move {
            let a = harness::get(&client, &url, &[]).await;
            seen.saw(&a);
            a
        })
    }

    /// `GET path`, its answer tallied, and how long it took.
    async fn get(&self, path: &str) -> (Answer, Duration) {
        let started = Instant::now();
        let a = harness::get(&self.client, &self.server.url(path), &[]).await;
        self.seen.saw(&a);
        (a, started.elapsed())
    }

    /// A connection of its own with `head` (and `body`) written on it, and nothing read:
    /// dropped, it hangs up.
    async fn raw(&self, head: &str, body: &[u8]) -> TcpStream {
        let mut tcp = TcpStream::connect(self.server.addr).await.unwrap();
        tcp.write_all(head.as_bytes()).await.unwrap();
        tcp.write_all(body).await.unwrap();
        tcp
    }
}

/// The app behind `layer` on a server of its own, its clients, the semaphore that lets
/// slow requests end, and where `/stream` takes its chunks from.
async fn serve(
    layer: &ShedLayer,
) -> (
    Clients,
    Arc<Semaphore>,
    mpsc::UnboundedSender<mpsc::Receiver<Bytes>>,
) {
    serve_wrapped(|app| app.layer(layer.clone())).await
}

/// As [`serve`], the app in the layers `wrap` puts around it.
async fn serve_wrapped(
    wrap: impl FnOnce(Router) -> Router,
) -> (
    Clients,
    Arc<Semaphore>,
    mpsc::UnboundedSender<mpsc::Receiver<Bytes>>,
) {
    let release = Arc::new(Semaphore::new(0));
    let (streams_tx, streams) = mpsc::unbounded_channel();
    let server = Server::start(wrap(app(&release, streams))).await;
    let clients = Clients {
        server,
        client: harness::client(),
        seen: Arc::default(),
    };
    (clients, release, streams_tx)
}

/// A rate limit of `n` an hour, every request on one key.
pub(crate) fn rate_limit(n: u32) -> RateLimitLayer<MemoryGate> {
    let quota = Quota::per_hour(n).unwrap();
    RateLimitLayer::builder(MemoryGate::new(Limit::TokenBucket(quota)))
        .policy(Policy::new("all", quota, Constant::new("k")))
        .build()
        .unwrap()
}

fn counts(c: ClassStats) -> (u64, u64, u64) {
    (c.admitted, c.shed, c.cancelled)
}

/// The `api` bulkhead's metrics say what its `stats` say, every permit back and nobody
/// waiting.
#[cfg(feature = "metrics")]
fn assert_bulkhead_metrics(recorder: &crate::support::TestRecorder, b: &BulkheadStats) {
    use flowgate::bulkhead::AcquireError::*;
    for reason in [WaitingRoomFull, TimedOut, Closed, NoPermit] {
        let id = format!(
            "flowgate_bulkhead_rejected_total{{name=api,reason={}}}",
            reason.as_str()
        );
        assert_eq!(recorder.counter(&id), b.refused(reason), "{id}");
    }
    for gauge in ["in_flight", "waiting"] {
        let id = format!("flowgate_bulkhead_{gauge}{{name=api}}");
        assert_eq!(recorder.gauge(&id), Some(0.0), "{id}");
    }
}

/// The whole overload, one step after the other, with the clients' tally checked against
/// the layer's and the bulkhead's counts and metrics at the end.
#[cfg(feature = "metrics")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_api_counts_what_its_clients_saw() {
    let recorder = crate::support::TestRecorder::default();
    let bulkhead = metrics::with_local_recorder(&recorder, bulkhead);
    let layer = metrics::with_local_recorder(&recorder, || shed(&bulkhead));
    let (c, release, _streams) = serve(&layer).await;
    let waiting = |n: usize| bulkhead.waiting() == n;
    let in_flight = |n: usize| bulkhead.in_flight() == n;

    // The normal share (3) taken by slow requests.
    let mut slow: Vec<_> = (0..3).map(|_| c.spawn("/slow")).collect();
    eventually("3 slow in flight", SOON, || in_flight(3)).await;
    // A sheddable report never waits; a health check takes the reserve and gives it back.
    let (report, took) = c.get("/report").await;
    assert_eq!(report.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(took < TIMEOUT, "{took:?}");
    let (health, _) = c.get("/health").await;
    assert_eq!(health.status, StatusCode::OK);
    eventually("the reserve back", SOON, || in_flight(3)).await;

    // Two normal requests wait; a third client waits, then hangs up: its place is given
    // back and it is counted cancelled, once, by the layer and by the bulkhead.
    let mut waiters: Vec<_> = (0..2).map(|_| c.spawn("/fast")).collect();
    eventually("2 waiting", SOON, || waiting(2)).await;
    let hangs_up = c.raw("GET /fast HTTP/1.1\r\nhost: x\r\n\r\n", b"").await;
    eventually("3 waiting", SOON, || waiting(3)).await;
    drop(hangs_up);
    eventually("its place given back", SOON, || waiting(2)).await;
    eventually("counted cancelled", SOON, || {
        layer.stats().normal.cancelled == 1
    })
    .await;
    assert_eq!(bulkhead.stats().cancelled, 1);

    // The room full: the next normal request is shed at once, not after the timeout.
    waiters.push(c.spawn("/fast"));
    eventually("3 waiting", SOON, || waiting(3)).await;
    let (full, took) = c.get("/fast").await;
    assert_eq!(full.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(took < TIMEOUT, "{took:?}");

    // A slow critical request takes the reserve; the next critical one finds no permit
    // and a full room: it pushes the newest normal waiter out and waits in its place.
    let admin = c.spawn("/admin");
    eventually("the reserve taken", SOON, || in_flight(4)).await;
    let health = c.spawn("/health");
    let pushed = waiters.pop().unwrap().await.unwrap();
    assert_eq!(pushed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(bulkhead.waiting(), 3);

    // One slow request ends: its permit goes to the critical waiter, first.
    release.add_permits(1);
    let health = health.await.unwrap();
    assert_eq!(health.status, StatusCode::OK);
    assert_eq!(bulkhead.waiting(), 2, "the normal ones still wait");

    // Resized up while they wait: both are served at once, before their timeout.
    bulkhead.set_max_in_flight(8).unwrap();
    for w in waiters.drain(..) {
        assert_eq!(w.await.unwrap().status, StatusCode::OK);
    }
    release.add_permits(3);
    for s in slow.drain(..) {
        assert_eq!(s.await.unwrap().status, StatusCode::OK);
    }
    assert_eq!(admin.await.unwrap().status, StatusCode::OK);
    eventually("every permit back", SOON, || in_flight(0)).await;
    bulkhead.set_max_in_flight(4).unwrap();

    // No permit frees: a waiter is shed after the timeout.
    let slow: Vec<_> = (0..3).map(|_| c.spawn("/slow")).collect();
    eventually("3 slow in flight", SOON, || in_flight(3)).await;
    let (late, took) = c.get("/fast").await;
    assert_eq!(late.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(took >= TIMEOUT, "{took:?}");

    // Closed under a waiter: it is answered at once; the slow ones finish.
    let closed = c.spawn("/fast");
    eventually("1 waiting", SOON, || waiting(1)).await;
    let closing = Instant::now();
    bulkhead.close();
    assert_eq!(
        closed.await.unwrap().status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert!(closing.elapsed() < TIMEOUT);
    let (after, _) = c.get("/health").await;
    assert_eq!(after.status, StatusCode::SERVICE_UNAVAILABLE);
    release.add_permits(3);
    for s in slow {
        assert_eq!(s.await.unwrap().status, StatusCode::OK);
    }
    eventually("every permit back", SOON, || in_flight(0)).await;

    // The clients saw 11 answers of 200, 4 shed 503s (report, room full, pushed out, timed
    // out) and 2 going-away ones (closed out, closed).
    assert_eq!((c.seen.counts(), c.seen.closed()), ((11, 4), 2));
    let stats = layer.stats();
    assert_eq!(totals(&stats), (11, 4, 2, 1), "{stats:?}");
    assert_eq!(counts(stats.critical), (3, 0, 0), "{stats:?}");
    assert_eq!(counts(stats.normal), (8, 3, 1), "{stats:?}");
    assert_eq!(counts(stats.sheddable), (0, 1, 0), "{stats:?}");
    assert_eq!((stats.critical.closed, stats.normal.closed), (1, 1));
    let shed_total = |class: &str| {
        recorder.counter(&format!(
            "flowgate_http_shed_total{{class={class},name=api}}"
        ))
    };
    assert_eq!(
        (
            shed_total("critical"),
            shed_total("normal"),
            shed_total("sheddable")
        ),
        (0, 3, 1)
    );
    let closed_total = |class: &str| {
        recorder.counter(&format!(
            "flowgate_http_shed_closed_total{{class={class},name=api}}"
        ))
    };
    assert_eq!(
        (
            closed_total("critical"),
            closed_total("normal"),
            closed_total("sheddable")
        ),
        (1, 1, 0)
    );
    let b = bulkhead.stats();
    assert_eq!(
        (b.admitted, b.cancelled, b.in_flight, b.waiting),
        (11, 1, 0, 0),
        "{b:?}"
    );
    assert_eq!(
        (b.no_permit, b.waiting_room_full, b.timed_out, b.closed),
        (1, 2, 1, 2),
        "{b:?}"
    );
    assert_eq!(b.admitted_from_reserve, 3, "{b:?}");
    assert_bulkhead_metrics(&recorder, &b);
    assert_eq!(
        recorder
            .samples("flowgate_bulkhead_wait_seconds{name=api}")
            .len() as u64,
        b.waited
    );
}

/// A streamed response holds its permit until its last chunk is sent, not until its head:
/// a normal request waiting for that permit is served only then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_gets_a_streamed_bodys_permit_when_its_last_chunk_is_sent() {
    let bulkhead = bulkhead();
    let layer = shed(&bulkhead);
    let (c, release, streams) = serve(&layer).await;
    let slow: Vec<_> = (0..2).map(|_| c.spawn("/slow")).collect();
    let (tx, rx) = mpsc::channel(4);
    streams.send(rx).unwrap();
    tx.send(Bytes::from_static(b"first ")).await.unwrap();
    let req = http::Request::get(c.server.url("/stream"))
        .body(http_body_util::Empty::new())
        .unwrap();
    let res = c.client.request(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let mut body = res.into_body();
    let first = http_body_util::BodyExt::frame(&mut body)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.into_data().unwrap(), "first ");
    eventually("3 in flight", SOON, || bulkhead.in_flight() == 3).await;

    let waiter = c.spawn("/fast");
    eventually("1 waiting", SOON, || bulkhead.waiting() == 1).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        bulkhead.waiting(),
        1,
        "the head and a chunk sent: the permit is held"
    );
    assert!(!waiter.is_finished());
    tx.send(Bytes::from_static(b"last")).await.unwrap();
    drop(tx);
    let rest = http_body_util::BodyExt::collect(body)
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(rest, "last");
    let waiter = waiter.await.unwrap();
    assert_eq!(
        (waiter.status, &waiter.body[..]),
        (StatusCode::OK, &b"fast"[..])
    );
    release.add_permits(2);
    for s in slow {
        assert_eq!(s.await.unwrap().status, StatusCode::OK);
    }
    eventually("every permit back", SOON, || bulkhead.in_flight() == 0).await;
    let stats = layer.stats();
    assert_eq!(counts(stats.normal), (4, 0, 0), "{stats:?}");
    assert_eq!(bulkhead.stats().waited, 1);
}

/// A client that hangs up while its request waits gives its place back when the server
/// drops the request. Over HTTP/1, hyper sees the connection end only once it has read the
/// request's body: a `GET` or a small upload read whole is cancelled at once, while an
/// upload larger than hyper reads ahead keeps its place in the waiting room until it
/// times out (a `503` nobody reads, counted shed) or is served (counted admitted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_hanging_up_mid_upload_keeps_its_place_until_the_timeout() {
    let bulkhead = bulkhead();
    let layer = shed(&bulkhead);
    let (c, release, _streams) = serve(&layer).await;
    let slow: Vec<_> = (0..3).map(|_| c.spawn("/slow")).collect();
    eventually("3 slow in flight", SOON, || bulkhead.in_flight() == 3).await;

    let whole = "POST /upload HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\n";
    let small = c.raw(whole, b"hello").await;
    eventually("1 waiting", SOON, || bulkhead.waiting() == 1).await;
    drop(small);
    eventually("its place given back", SOON, || bulkhead.waiting() == 0).await;
    assert_eq!(counts(layer.stats().normal), (3, 0, 1));

    let part = "POST /upload HTTP/1.1\r\nhost: x\r\ncontent-length: 4194304\r\n\r\n";
    let big = c.raw(part, &vec![b'x'; 1 << 20]).await;
    eventually("1 waiting", SOON, || bulkhead.waiting() == 1).await;
    let hung_up = Instant::now();
    drop(big);
    tokio::time::sleep(TIMEOUT / 2).await;
    assert_eq!(bulkhead.waiting(), 1, "hyper has not seen the hang-up");
    // The bulkhead lets the waiter go as its timer fires; the layer counts its 503 next.
    eventually("shed after the timeout", TIMEOUT * 2, || {
        counts(layer.stats().normal) == (3, 1, 1)
    })
    .await;
    assert!(hung_up.elapsed() >= TIMEOUT / 2, "{:?}", hung_up.elapsed());
    assert_eq!(bulkhead.waiting(), 0);
    assert_eq!(bulkhead.stats().timed_out, 1);

    // Or it is served when a permit frees, its client long gone.
    let big = c.raw(part, &vec![b'x'; 1 << 20]).await;
    eventually("1 waiting", SOON, || bulkhead.waiting() == 1).await;
    drop(big);
    tokio::time::sleep(TIMEOUT / 4).await;
    assert_eq!(bulkhead.waiting(), 1, "hyper has not seen the hang-up");
    release.add_permits(1);
    eventually("admitted", SOON, || {
        counts(layer.stats().normal) == (4, 1, 1)
    })
    .await;
    assert_eq!(bulkhead.waiting(), 0);
    release.add_permits(2);
    for s in slow {
        assert_eq!(s.await.unwrap().status, StatusCode::OK);
    }
    eventually("every permit back", SOON, || bulkhead.in_flight() == 0).await;
}

/// A `RateLimitLayer` inside the `ShedLayer` (waiting mode): a request shed, at once or
/// after waiting, never reaches the rate limit and is not charged; every request the shed
/// admitted is decided by the rate limit once, its `429` holding a permit like any answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_inside_the_shed_charges_only_what_the_shed_admitted() {
    let bulkhead = bulkhead();
    let layer = shed(&bulkhead);
    let rate = rate_limit(5);
    let (c, release, _streams) =
        serve_wrapped(|app| app.layer(rate.clone()).layer(layer.clone())).await;
    let remaining = |a: &Answer| harness::field(&a.headers, "ratelimit");

    // 3 slow requests charged 3 of 5.
    let slow: Vec<_> = (0..3).map(|_| c.spawn("/slow")).collect();
    eventually("3 slow in flight", SOON, || bulkhead.in_flight() == 3).await;
    // Shed at once, and after the timeout: neither is charged, neither carries the fields.
    let (report, _) = c.get("/report").await;
    assert_eq!(report.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(remaining(&report), None);
    let (late, took) = c.get("/fast").await;
    assert_eq!(late.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(took >= TIMEOUT, "{took:?}");
    assert_eq!(remaining(&late), None);
    release.add_permits(3);
    for s in slow {
        assert_eq!(s.await.unwrap().status, StatusCode::OK);
    }
    // 2 left: two pass, the third is refused by the rate limit inside, with its fields.
    for _ in 0..2 {
        assert_eq!(c.get("/fast").await.0.status, StatusCode::OK);
    }
    let (refused, _) = c.get("/fast").await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS, "{refused:?}");
    assert!(remaining(&refused).is_some(), "{refused:?}");
    eventually("every permit back", SOON, || bulkhead.in_flight() == 0).await;

    let (s, sh) = (rate.stats(), layer.stats());
    assert_eq!(
        (s.admitted, s.rejected, harness::outcomes(&s)),
        (5, 1, 6),
        "{s:?}"
    );
    assert_eq!(
        (sh.admitted(), sh.shed(), sh.cancelled()),
        (6, 2, 0),
        "{sh:?}"
    );
    assert_eq!(c.seen.counts(), (5, 2));
}

/// Clients of every class at once over real connections, a tenth of them hanging up at a
/// random moment, while the bulkhead is resized again and again and closed at the end:
/// every request is counted once, and every answer a client read is among the counts.
#[cfg(feature = "metrics")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clients_hanging_up_under_resizes_leave_every_count_exact() {
    const N: usize = 600;
    let recorder = crate::support::TestRecorder::default();
    let bulkhead = metrics::with_local_recorder(&recorder, || {
        Bulkhead::builder(4)
            .critical_reserve(1)
            .max_waiting(6)
            .wait_timeout(Duration::from_millis(40))
            .name("api")
            .build()
            .unwrap()
    });
    let layer = metrics::with_local_recorder(&recorder, || shed(&bulkhead));
    let (c, _release, _streams) = serve(&layer).await;
    let c = Arc::new(c);
    let resizing = {
        let bulkhead = bulkhead.clone();
        tokio::spawn(async move {
            loop {
                bulkhead.set_max_in_flight(fastrand::usize(2..=8)).unwrap();
                tokio::time::sleep(Duration::from_millis(fastrand::u64(1..10))).await;
            }
        })
    };
    let hung_up = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..N)
        .map(|i| {
            let (c, hung_up) = (c.clone(), hung_up.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..300))).await;
                let path = ["/jitter", "/jitter", "/health", "/report"][i % 4];
                if i % 10 == 0 {
                    let head = format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n");
                    let tcp = c.raw(&head, b"").await;
                    tokio::time::sleep(Duration::from_millis(fastrand::u64(0..60))).await;
                    drop(tcp);
                    hung_up.fetch_add(1, Ordering::SeqCst);
                } else {
                    c.get(path).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    resizing.abort();
    bulkhead.close();
    // Every request a client read an answer to was counted; of those hung up, the ones
    // the server got before the client went counted too (a connection the kernel had not
    // handed to the server yet may never reach it).
    let (ok, shed) = c.seen.counts();
    let hung_up = hung_up.load(Ordering::SeqCst);
    assert_eq!(ok + shed + hung_up, N as u64);
    let total = |s: &flowgate::http::ShedStats| s.admitted() + s.shed() + s.cancelled();
    eventually("the requests that came ended", SOON, || {
        total(&layer.stats()) >= N as u64 - hung_up && bulkhead.in_flight() == 0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let s = layer.stats();
    assert!(total(&s) <= N as u64, "{s:?}");
    assert!(s.admitted() >= ok && s.shed() >= shed, "{s:?} {ok} {shed}");
    // Those of the hung-up clients: cancelled, or admitted or shed before the server saw
    // the client go.
    assert_eq!(
        (s.admitted() - ok) + (s.shed() - shed) + s.cancelled(),
        total(&s) - (N as u64 - hung_up),
        "{s:?}"
    );
    let b = bulkhead.stats();
    assert_eq!((b.in_flight, b.waiting), (0, 0), "{b:?}");
    assert_eq!(b.admitted, s.admitted(), "{b:?} {s:?}");
    // A future dropped before its first poll asked the bulkhead for nothing.
    assert!(b.acquisitions() <= total(&s), "{b:?} {s:?}");
    assert_eq!(b.no_permit, s.sheddable.shed, "{b:?} {s:?}");
    let shed_total: u64 = ["critical", "normal", "sheddable"]
        .iter()
        .map(|class| {
            recorder.counter(&format!(
                "flowgate_http_shed_total{{class={class},name=api}}"
            ))
        })
        .sum();
    assert_eq!(shed_total, s.shed());
    assert_bulkhead_metrics(&recorder, &b);
    assert!(s.shed() > 0 && s.admitted() > 0, "{s:?}");
}

/// The waiting mode's `build` asks for a bulkhead with a `wait_timeout`; one too long to
/// ever end (`Duration::MAX`) is taken as given, and a request then waits for as long as
/// the bulkhead stays saturated (ten years here), served when a permit frees.
#[tokio::test(start_paused = true)]
async fn a_wait_timeout_that_never_ends_lets_a_request_wait_as_long_as_it_takes() {
    let bulkhead = Bulkhead::builder(1)
        .wait_timeout(Duration::MAX)
        .build()
        .unwrap();
    let layer = ShedLayer::builder(bulkhead.clone())
        .wait(true)
        .build()
        .unwrap();
    let held = bulkhead.try_acquire_owned().unwrap();
    let svc = tower::Layer::layer(&layer, crate::shed::answers_ok());
    let mut waiting = Box::pin(tower::ServiceExt::oneshot(svc, crate::shed::request("/")));
    assert!(futures::poll!(waiting.as_mut()).is_pending());
    tokio::time::advance(Duration::from_secs(10 * 365 * 24 * 3600)).await;
    assert!(futures::poll!(waiting.as_mut()).is_pending());
    assert_eq!(bulkhead.waiting(), 1);
    drop(held);
    let res = waiting.await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(counts(layer.stats().normal), (1, 0, 0));
}

/// A `ShedLayer` over an adaptive bulkhead in front of handlers that time out, the
/// timeout answered `408 Request Timeout` as axum's documented `HandleErrorLayer` +
/// `timeout` recipe and tower-http's `TimeoutLayer::new` answer it: the server ran out of
/// time for requests it had whole, the back-pressure the limit is there to learn from (an
/// inner timeout's error is). Taken for a client's `4xx`, the 408s were ignored: with every
/// handler stuck the limit stayed at 50, learning nothing.
#[tokio::test(start_paused = true)]
async fn handler_timeouts_answered_408_cut_a_shed_layers_adaptive_limit() {
    use crate::contract::{Req, adaptive_shed, ok, twenty_answered};
    let (bulkhead, layer) = adaptive_shed();
    let before = bulkhead.max_in_flight();
    let svc = tower::Layer::layer(
        &layer,
        tower::service_fn(|_: Req| async {
            // The handler waits on a saturated database; the timeout answers for it.
            let stuck = std::future::pending::<()>();
            let timed_out = tokio::time::timeout(Duration::from_secs(1), stuck).await;
            assert!(timed_out.is_err());
            let mut res = ok();
            *res.status_mut() = StatusCode::REQUEST_TIMEOUT;
            Ok::<_, std::convert::Infallible>(res)
        }),
    );
    twenty_answered(&svc, "/", StatusCode::REQUEST_TIMEOUT).await;
    let stats = bulkhead.adaptive_stats().unwrap();
    assert_eq!((stats.back_pressure, stats.ignored), (20, 0), "{stats:?}");
    assert!(
        bulkhead.max_in_flight() < before,
        "the limit stayed at {before}"
    );
}

/// A `RateLimitLayer` outside the `ShedLayer` (waiting mode): each request is charged as
/// it passes the rate limit, before it waits; one shed after its wait gets the shed's
/// `503` (its `Retry-After`, the problem document) with the rate limit's `RateLimit` field
/// without `t` (not its refusal), and one whose client hangs up while it waits is admitted
/// to the rate limit, cancelled to the shed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_outside_the_shed_charges_each_request_before_it_waits() {
    let bulkhead = bulkhead();
    let layer = shed(&bulkhead);
    let rate = rate_limit(10);
    let (c, release, _streams) =
        serve_wrapped(|app| app.layer(layer.clone()).layer(rate.clone())).await;
    let slow: Vec<_> = (0..3).map(|_| c.spawn("/slow")).collect();
    eventually("3 slow in flight", SOON, || bulkhead.in_flight() == 3).await;

    let (late, took) = c.get("/fast").await;
    assert!(took >= TIMEOUT, "{took:?}");
    assert_eq!(late.status, StatusCode::SERVICE_UNAVAILABLE);
    let field = harness::field(&late.headers, "ratelimit").unwrap();
    assert_eq!(field, r#""all";r=6"#, "charged before it waited; no t");

    let hangs_up = c.raw("GET /fast HTTP/1.1\r\nhost: x\r\n\r\n", b"").await;
    eventually("1 waiting", SOON, || bulkhead.waiting() == 1).await;
    drop(hangs_up);
    eventually("its place given back", SOON, || bulkhead.waiting() == 0).await;
    release.add_permits(3);
    for s in slow {
        assert_eq!(s.await.unwrap().status, StatusCode::OK);
    }
    eventually("every permit back", SOON, || bulkhead.in_flight() == 0).await;
    let (s, sh) = (rate.stats(), layer.stats());
    assert_eq!((s.admitted, harness::outcomes(&s)), (5, 5), "{s:?}");
    assert_eq!(counts(sh.normal), (3, 1, 1), "{sh:?}");
    assert_eq!(c.seen.counts(), (3, 1));
}
