//! The layers over HTTP/2 (h2c, prior knowledge) with a real server (axum's, hyper-util's
//! auto builder) and a real HTTP/2 client: many streams on one connection, a stream reset
//! while it waits for a permit or while its body is sent, inner errors and panics.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use bytes::Bytes;
use flowgate::Quota;
use flowgate::bulkhead::Bulkhead;
use flowgate::gate::{Limit, MemoryGate};
use flowgate::http::{PeerIp, Policy, RateLimitLayer, ShedLayer};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::sync::{Semaphore, mpsc};

use crate::harness::Server;

/// Polls `cond` every 5 ms until it holds; fails after `limit`.
async fn eventually(what: &str, limit: Duration, cond: impl Fn() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// One HTTP/2 connection (h2c, prior knowledge) to `addr`.
async fn connect(addr: SocketAddr) -> SendRequest<Empty<Bytes>> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    send
}

fn request(addr: SocketAddr, method: Method, path: &str) -> Request<Empty<Bytes>> {
    Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .body(Empty::new())
        .unwrap()
}

/// `/slow` waits for a permit of `release`; `/fast` answers at once.
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_many_streams_on_one_connection_take_one_permit_each() {
    let bulkhead = Bulkhead::new(3).unwrap();
    let layer = ShedLayer::builder(bulkhead.clone()).build().unwrap();
    let release = Arc::new(Semaphore::new(0));
    let server = Server::start(app(&release).layer(layer.clone())).await;
    let conn = connect(server.addr).await;
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let mut conn = conn.clone();
        let req = request(server.addr, Method::GET, "/slow");
        tasks.push(tokio::spawn(async move {
            conn.ready().await.unwrap();
            let res = conn.send_request(req).await.unwrap();
            let status = res.status();
            res.into_body().collect().await.unwrap();
            status
        }));
    }
    eventually("17 shed", Duration::from_secs(5), || {
        layer.stats().normal.shed == 17
    })
    .await;
    assert_eq!(bulkhead.in_flight(), 3);
    release.add_permits(3);
    let mut ok = 0;
    for t in tasks {
        match t.await.unwrap() {
            StatusCode::OK => ok += 1,
            s => assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE),
        }
    }
    assert_eq!(ok, 3);
    eventually("permits back", Duration::from_secs(5), || {
        bulkhead.in_flight() == 0
    })
    .await;
    assert_eq!(layer.stats().normal.admitted, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_a_stream_reset_while_waiting_gives_up_its_place() {
    let bulkhead = Bulkhead::builder(1)
        .max_waiting(4)
        .wait_timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let layer = ShedLayer::builder(bulkhead.clone())
        .wait(true)
        .build()
        .unwrap();
    let release = Arc::new(Semaphore::new(0));
    let server = Server::start(app(&release).layer(layer.clone())).await;
    let conn = connect(server.addr).await;

    let mut c = conn.clone();
    let req = request(server.addr, Method::GET, "/slow");
    let slow = tokio::spawn(async move {
        c.ready().await.unwrap();
        let res = c.send_request(req).await.unwrap();
        (
            res.status(),
            res.into_body().collect().await.unwrap().to_bytes(),
        )
    });
    eventually("slow admitted", Duration::from_secs(5), || {
        bulkhead.in_flight() == 1
    })
    .await;

    // Waiters that the client cancels (RST_STREAM), on the same connection.
    let mut waiters = Vec::new();
    for _ in 0..3 {
        let mut c = conn.clone();
        let req = request(server.addr, Method::GET, "/fast");
        waiters.push(tokio::spawn(async move {
            c.ready().await.unwrap();
            c.send_request(req).await
        }));
    }
    eventually("3 waiting", Duration::from_secs(5), || {
        bulkhead.waiting() == 3
    })
    .await;
    for w in &waiters {
        w.abort();
    }
    eventually("the places given up", Duration::from_secs(5), || {
        bulkhead.waiting() == 0
    })
    .await;

    release.add_permits(1);
    let (status, body) = slow.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(&body[..], b"slow");
    eventually("permit back", Duration::from_secs(5), || {
        bulkhead.in_flight() == 0
    })
    .await;
    let mut c = conn.clone();
    c.ready().await.unwrap();
    let res = c
        .send_request(request(server.addr, Method::GET, "/fast"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    res.into_body().collect().await.unwrap();
    eventually("permit back", Duration::from_secs(5), || {
        bulkhead.in_flight() == 0
    })
    .await;
    let stats = layer.stats();
    assert_eq!((stats.normal.admitted, stats.normal.shed), (2, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_a_stream_reset_mid_body_returns_the_permit_on_a_live_connection() {
    let bulkhead = Bulkhead::new(2).unwrap();
    let layer = ShedLayer::builder(bulkhead.clone()).build().unwrap();
    type Chunks = mpsc::Receiver<Bytes>;
    let next: Arc<std::sync::Mutex<Option<Chunks>>> = Arc::default();
    let slot = next.clone();
    let app = Router::new()
        .route(
            "/stream",
            get(move || {
                let rx = slot.lock().unwrap().take().unwrap();
                async move {
                    Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
                        let chunk = rx.recv().await?;
                        Some((Ok::<_, Infallible>(chunk), rx))
                    }))
                }
            }),
        )
        .route(
            "/big",
            get(|| async {
                // Chunk by chunk: one chunk more than the client's window is not taken yet.
                let chunk = Bytes::from(vec![b'x'; 64 << 10]);
                Body::from_stream(futures::stream::iter(
                    (0..64).map(move |_| Ok::<_, Infallible>(chunk.clone())),
                ))
            }),
        )
        .route("/one", get(|| async { vec![b'x'; 4 << 20] }))
        .route("/fast", get(|| async { "fast" }))
        .layer(layer.clone());
    let server = Server::start(app).await;
    let mut conn = connect(server.addr).await;

    // A body of one frame: taken whole by the server, its permit is back though the client
    // has read nothing (as `ShedLayer` documents).
    conn.ready().await.unwrap();
    let unread = conn
        .send_request(request(server.addr, Method::GET, "/one"))
        .await
        .unwrap();
    eventually(
        "permit back once the frame is taken",
        Duration::from_secs(5),
        || bulkhead.in_flight() == 0,
    )
    .await;
    drop(unread);

    let (tx, rx) = mpsc::channel(4);
    next.lock().unwrap().replace(rx);
    tx.send(Bytes::from_static(b"first ")).await.unwrap();
    conn.ready().await.unwrap();
    let res = conn
        .send_request(request(server.addr, Method::GET, "/stream"))
        .await
        .unwrap();
    let mut body = res.into_body();
    body.frame().await.unwrap().unwrap();
    assert_eq!(bulkhead.in_flight(), 1);
    drop(body); // RST_STREAM; the connection stays
    eventually("permit back after a reset", Duration::from_secs(5), || {
        bulkhead.in_flight() == 0
    })
    .await;

    // A client that stops reading a big body: held (flow control) until it resets.
    conn.ready().await.unwrap();
    let res = conn
        .send_request(request(server.addr, Method::GET, "/big"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(bulkhead.in_flight(), 1, "a body not sent holds its permit");
    drop(res);
    eventually("permit back after a reset", Duration::from_secs(5), || {
        bulkhead.in_flight() == 0
    })
    .await;

    conn.ready().await.unwrap();
    let res = conn
        .send_request(request(server.addr, Method::GET, "/fast"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    drop(tx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_inner_errors_and_panics_lose_no_permit() {
    let bulkhead = Bulkhead::new(2).unwrap();
    let layer = ShedLayer::builder(bulkhead.clone()).build().unwrap();
    let app = Router::new()
        .route(
            "/panic",
            get(|| async {
                if true {
                    panic!("handler panics");
                }
                "never"
            }),
        )
        .route("/one", get(|| async { vec![b'x'; 4 << 20] }))
        .route("/fast", get(|| async { "fast" }))
        .layer(layer.clone());
    let server = Server::start(app).await;
    let mut conn = connect(server.addr).await;

    // A body of one frame: taken whole by the server, its permit is back though the client
    // has read nothing (as `ShedLayer` documents).
    conn.ready().await.unwrap();
    let unread = conn
        .send_request(request(server.addr, Method::GET, "/one"))
        .await
        .unwrap();
    eventually(
        "permit back once the frame is taken",
        Duration::from_secs(5),
        || bulkhead.in_flight() == 0,
    )
    .await;
    drop(unread);
    for _ in 0..3 {
        conn.ready().await.unwrap();
        let res = conn
            .send_request(request(server.addr, Method::GET, "/panic"))
            .await;
        assert!(res.is_err(), "{res:?}");
    }
    eventually("permits back", Duration::from_secs(5), || {
        bulkhead.in_flight() == 0
    })
    .await;
    let mut conn = connect(server.addr).await;
    conn.ready().await.unwrap();
    let res = conn
        .send_request(request(server.addr, Method::GET, "/fast"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_rate_limit_fields_on_head_and_429() {
    let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(1).unwrap()));
    let peer = PeerIp::from_extension(|c: &ConnectInfo<SocketAddr>| c.0);
    let layer = RateLimitLayer::builder(gate)
        .policy(Policy::new(
            "per-ip",
            Quota::per_minute(2).unwrap().burst(2).unwrap(),
            peer,
        ))
        .inner_body()
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "hi" }))
        .layer(layer.clone());
    let server = Server::start(app).await;
    let mut conn = connect(server.addr).await;
    let mut statuses = Vec::new();
    for method in [Method::HEAD, Method::GET, Method::HEAD] {
        conn.ready().await.unwrap();
        let res = conn
            .send_request(request(server.addr, method, "/"))
            .await
            .unwrap();
        let (parts, body) = res.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        statuses.push(parts.status);
        assert!(parts.headers.contains_key("ratelimit"), "{parts:?}");
        assert!(parts.headers.contains_key("ratelimit-policy"), "{parts:?}");
        if parts.status == StatusCode::TOO_MANY_REQUESTS {
            assert!(parts.headers.contains_key("retry-after"));
            assert!(body.is_empty(), "HEAD has no body");
        }
    }
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    let stats = layer.stats();
    assert_eq!((stats.admitted, stats.rejected), (2, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_unmatched_routes_are_charged_under_layer_only() {
    let make = || {
        let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(1).unwrap()));
        let peer = PeerIp::from_extension(|c: &ConnectInfo<SocketAddr>| c.0);
        RateLimitLayer::builder(gate)
            .policy(Policy::new(
                "per-ip",
                Quota::per_minute(100).unwrap().burst(100).unwrap(),
                peer,
            ))
            .inner_body()
            .build()
            .unwrap()
    };
    let not_modified = || async {
        (
            StatusCode::NOT_MODIFIED,
            [(http::header::ETAG, "\"v1\"")],
            "",
        )
    };
    let routed = make();
    let everything = make();
    let a = Server::start(
        Router::new()
            .route("/", get(not_modified))
            .route_layer(routed.clone()),
    )
    .await;
    let b = Server::start(
        Router::new()
            .route("/", get(not_modified))
            .layer(everything.clone()),
    )
    .await;
    let mut statuses = Vec::new();
    for server in [&a, &b] {
        let mut conn = connect(server.addr).await;
        for (method, path) in [
            (Method::GET, "/"),
            (Method::GET, "/nowhere"),
            (Method::POST, "/"),
        ] {
            conn.ready().await.unwrap();
            let res = conn
                .send_request(request(server.addr, method, path))
                .await
                .unwrap();
            statuses.push((res.status(), res.headers().contains_key("ratelimit")));
        }
    }
    // route_layer: a 404 never reaches the layer; a 405 does (axum layers a matched path's
    // method router whole). layer: every request, with its fields. A 304 carries them.
    let ok = |s| (s, true);
    assert_eq!(
        statuses,
        [
            ok(StatusCode::NOT_MODIFIED),
            (StatusCode::NOT_FOUND, false),
            ok(StatusCode::METHOD_NOT_ALLOWED),
            ok(StatusCode::NOT_MODIFIED),
            ok(StatusCode::NOT_FOUND),
            ok(StatusCode::METHOD_NOT_ALLOWED),
        ]
    );
    assert_eq!(routed.stats().admitted, 2);
    assert_eq!(everything.stats().admitted, 3);
}

/// Around the whole router (`layer.layer(router)`, served as axum serves any service, which
/// spares each request axum's boxing and clone of a layered route): the peer's address
/// reaches the layer through `ConnectInfo`, and every request is decided, an unmatched
/// path's too, with its fields.
#[tokio::test]
async fn around_the_router_the_layer_keys_by_peer_and_decides_every_path() {
    use tower::Layer;
    let layer = RateLimitLayer::builder(MemoryGate::new(Limit::TokenBucket(
        Quota::per_second(1).unwrap(),
    )))
    .policy(Policy::new(
        "per-ip",
        Quota::per_hour(3).unwrap().burst(3).unwrap(),
        PeerIp::from_extension(|c: &ConnectInfo<SocketAddr>| c.0),
    ))
    .inner_body()
    .build()
    .unwrap();
    let app = Router::new().route("/", get(|| async { "ok" }));
    let server = Server::start_service(layer.layer(app)).await;
    let client = crate::harness::client();
    let mut seen = Vec::new();
    for path in ["/", "/nowhere", "/", "/"] {
        let res = crate::harness::get(&client, &server.url(path), &[]).await;
        seen.push((res.status, res.headers.contains_key("ratelimit")));
    }
    assert_eq!(
        seen,
        [
            (StatusCode::OK, true),
            (StatusCode::NOT_FOUND, true),
            (StatusCode::OK, true),
            (StatusCode::TOO_MANY_REQUESTS, true),
        ]
    );
    let stats = layer.stats();
    assert_eq!(
        (stats.admitted, stats.rejected, stats.missing_key),
        (3, 1, 0)
    );
    let top = layer.top_rejected(1);
    assert_eq!(top.len(), 1);
    assert!(
        format!("{top:?}").contains("127.0.0.1"),
        "keyed by the peer's address: {top:?}"
    );
}

/// `ShedLayer` around the whole router sheds every request, an unmatched path's too, as
/// under `Router::layer`.
#[tokio::test]
async fn around_the_router_the_shed_layer_sheds_every_path() {
    use tower::{Layer, ServiceExt};
    let bulkhead = Bulkhead::builder(1).build().unwrap();
    let layer = ShedLayer::builder(bulkhead.clone()).build().unwrap();
    let app = layer.layer(Router::new().route("/", get(|| async { "ok" })));
    let get_ = |path: &str| Request::get(path).body(Body::empty()).unwrap();
    let held = bulkhead.try_acquire_owned().unwrap();
    for path in ["/", "/nowhere"] {
        let res = app.clone().oneshot(get_(path)).await.unwrap();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE, "{path}");
    }
    drop(held);
    let res = app.clone().oneshot(get_("/")).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // The permit stays with the response's body until it is dropped.
    drop(res);
    let res = app.oneshot(get_("/nowhere")).await.unwrap();
    assert_eq!(res.status(), StatusCode::NOT_FOUND);
    assert_eq!(layer.stats().normal.shed, 2);
    assert_eq!(layer.stats().normal.admitted, 2);
}

#[tokio::test]
async fn a_waiter_granted_a_permit_then_reset_hands_it_on() {
    use std::future::Future;
    use tower::{Layer, Service};
    let bulkhead = Bulkhead::builder(1)
        .max_waiting(4)
        .wait_timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let layer = ShedLayer::builder(bulkhead.clone())
        .wait(true)
        .build()
        .unwrap();
    let mut svc = layer.layer(tower::service_fn(|_r: Request<Empty<Bytes>>| async {
        Ok::<_, Infallible>(http::Response::new(Empty::<Bytes>::new()))
    }));
    let held = bulkhead.try_acquire_owned().unwrap();
    let mut fut = Box::pin(svc.call(Request::new(Empty::new())));
    let waker = futures::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(fut.as_mut().poll(&mut cx).is_pending());
    assert_eq!(bulkhead.waiting(), 1);
    drop(held); // handed to the waiter
    drop(fut); // reset before it runs
    assert_eq!(bulkhead.in_flight(), 0);
    assert_eq!(bulkhead.waiting(), 0);
    assert!(bulkhead.try_acquire_owned().is_ok());
    let stats = layer.stats();
    assert_eq!((stats.normal.admitted, stats.normal.shed), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_a_waiter_past_the_timeout_is_shed_and_head_gets_no_body() {
    let bulkhead = Bulkhead::builder(1)
        .max_waiting(4)
        .wait_timeout(Duration::from_millis(50))
        .build()
        .unwrap();
    let layer = ShedLayer::builder(bulkhead.clone())
        .wait(true)
        .build()
        .unwrap();
    let release = Arc::new(Semaphore::new(0));
    let server = Server::start(app(&release).layer(layer.clone())).await;
    let conn = connect(server.addr).await;
    let mut c = conn.clone();
    let req = request(server.addr, Method::GET, "/slow");
    let slow = tokio::spawn(async move {
        c.ready().await.unwrap();
        c.send_request(req).await.unwrap().status()
    });
    eventually("slow admitted", Duration::from_secs(5), || {
        bulkhead.in_flight() == 1
    })
    .await;
    let mut c = conn.clone();
    c.ready().await.unwrap();
    let res = c
        .send_request(request(server.addr, Method::HEAD, "/fast"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["retry-after"], "1");
    assert!(
        res.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .is_empty()
    );
    release.add_permits(1);
    assert_eq!(slow.await.unwrap(), StatusCode::OK);
    let stats = layer.stats();
    assert_eq!((stats.normal.admitted, stats.normal.shed), (1, 1));
    assert_eq!(bulkhead.waiting(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_proxy_header_lines_are_walked_from_the_last() {
    use flowgate::http::{ClientIp, ForwardedHeader};
    let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(1).unwrap()));
    let mut layers = Vec::new();
    for (source, name) in [
        (ForwardedHeader::XForwardedFor, "x-forwarded-for"),
        (ForwardedHeader::Forwarded, "forwarded"),
    ] {
        let ip = ClientIp::builder(source)
            .peer(PeerIp::from_extension(|c: &ConnectInfo<SocketAddr>| c.0))
            .trust("127.0.0.0/8")
            .build()
            .unwrap();
        let layer = RateLimitLayer::builder(gate.clone())
            .policy(Policy::new(
                name,
                Quota::per_minute(1).unwrap().burst(1).unwrap(),
                ip,
            ))
            .top_rejected(8)
            .inner_body()
            .build()
            .unwrap();
        layers.push((layer, name));
    }
    for (layer, name) in layers {
        let server = Server::start(
            Router::new()
                .route("/", get(|| async { "hi" }))
                .layer(layer.clone()),
        )
        .await;
        let mut conn = connect(server.addr).await;
        let lines: &[&str] = if name == "forwarded" {
            &[
                "for=6.6.6.6",
                "for=\"[2001:db8::7%25eth0]:4711\";proto=http, for=127.0.0.9",
            ]
        } else {
            &["6.6.6.6", "[2001:db8::7%eth0]:4711, 127.0.0.9"]
        };
        for _ in 0..2 {
            let mut req = request(server.addr, Method::GET, "/");
            for l in lines {
                req.headers_mut().append(name, l.parse().unwrap());
            }
            conn.ready().await.unwrap();
            conn.send_request(req).await.unwrap();
        }
        let top = layer.top_rejected(4);
        assert_eq!(top.len(), 1, "{name}: {top:?}");
        assert_eq!(top[0].key, format!("{name}:2001:db8::7"), "{top:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn h2_a_burst_of_streams_in_wait_mode_is_each_admitted_or_shed_once() {
    use flowgate::http::Class;
    let bulkhead = Bulkhead::builder(2)
        .critical_reserve(1)
        .max_waiting(3)
        .wait_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let layer = ShedLayer::builder(bulkhead.clone())
        .classify(|req| match req.uri.query() {
            Some("c") => Class::Critical,
            Some("s") => Class::Sheddable,
            _ => Class::Normal,
        })
        .wait(true)
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/work",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(20)).await;
                "done"
            }),
        )
        .layer(layer.clone());
    let server = Server::start(app).await;
    let conn = connect(server.addr).await;
    let mut tasks = Vec::new();
    for i in 0..60 {
        let mut c = conn.clone();
        let q = ["c", "n", "s"][i % 3];
        let req = request(server.addr, Method::GET, &format!("/work?{q}"));
        tasks.push(tokio::spawn(async move {
            c.ready().await.unwrap();
            let res = c.send_request(req).await.unwrap();
            let s = res.status();
            res.into_body().collect().await.unwrap();
            s
        }));
    }
    let (mut ok, mut shed) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            StatusCode::OK => ok += 1,
            StatusCode::SERVICE_UNAVAILABLE => shed += 1,
            s => panic!("{s}"),
        }
    }
    let stats = layer.stats();
    assert_eq!((stats.admitted(), stats.shed()), (ok, shed));
    assert_eq!(ok + shed, 60);
    eventually("all back", Duration::from_secs(5), || {
        bulkhead.in_flight() == 0 && bulkhead.waiting() == 0
    })
    .await;
}
