//! tower's contract, layer by layer, under paused time: a response future dropped at each of
//! its await points, a response body dropped early or never polled, an inner service that
//! fails `poll_ready`, panics in `call` or returns a future that panics, `call` without
//! `poll_ready`, clones sharing their state, and the auto traits axum and hyper ask for.
//! After each, the bulkhead's permits, its waiting room, the layer's counts and the retry
//! budget are exactly what they were or what was used.

use std::convert::Infallible;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use flowgate::adaptive::Aimd;
use flowgate::bulkhead::Bulkhead;
use flowgate::gate::{Gate, Limit, MemoryGate};
use flowgate::http::{
    Class, Constant, Policy, RateLimitLayer, ResponseBody, Shed, ShedFuture, ShedLayer,
};
use flowgate::pace::AdaptivePacer;
use flowgate::retry::{Backoff, Jitter, RetryBudget, RetryLayer, RetryPolicy};
use flowgate::{Quota, Rate};
use futures::FutureExt;
use http::{Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Empty, Full};
use tokio::sync::Semaphore;
use tower::{Layer, Service, ServiceExt, service_fn};

use crate::harness::outcomes;

pub(crate) type Req = Request<Empty<Bytes>>;

fn req(path: &str) -> Req {
    Request::get(path).body(Empty::new()).unwrap()
}

pub(crate) fn ok() -> Response<Full<Bytes>> {
    Response::new(Full::new(Bytes::from_static(b"ok")))
}

/// A service that answers when `gate` gives a permit (one per request): the test decides
/// when each inner future ends.
fn gated(
    gate: &Arc<Semaphore>,
) -> impl Service<Req, Response = Response<Full<Bytes>>, Error = Infallible, Future: Send>
+ Clone
+ Send
+ Sync
+ 'static {
    let gate = gate.clone();
    service_fn(move |_req: Req| {
        let gate = gate.clone();
        async move {
            gate.acquire().await.unwrap().forget();
            Ok::<_, Infallible>(ok())
        }
    })
}

/// Poll `fut` once; it must be pending.
fn poll_once<F: Future + Unpin>(fut: &mut F) {
    let waker = futures::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    assert!(Pin::new(fut).poll(&mut cx).is_pending(), "still pending");
}

// ---- ShedLayer ----

#[tokio::test(start_paused = true)]
async fn a_shed_future_dropped_at_each_await_point_holds_nothing() {
    let bulkhead = Bulkhead::builder(1)
        .max_waiting(1)
        .wait_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let layer = ShedLayer::builder(bulkhead.clone())
        .wait(true)
        .build()
        .unwrap();
    let answer = Arc::new(Semaphore::new(0));
    let mut svc = layer.layer(gated(&answer));

    // Dropped before its first poll: nothing taken, nothing counted.
    let fut = svc.ready().await.unwrap().call(req("/"));
    drop(fut);
    assert_eq!((bulkhead.in_flight(), bulkhead.waiting()), (0, 0));

    // Dropped while the inner service runs: the permit is back.
    let mut running = Box::pin(svc.ready().await.unwrap().call(req("/")));
    poll_once(&mut running);
    assert_eq!(bulkhead.in_flight(), 1);

    // Dropped while waiting in the room: the place is given up.
    let mut waiting = Box::pin(svc.ready().await.unwrap().call(req("/")));
    poll_once(&mut waiting);
    assert_eq!(bulkhead.waiting(), 1);
    drop(waiting);
    assert_eq!((bulkhead.in_flight(), bulkhead.waiting()), (1, 0));
    drop(running);
    assert_eq!((bulkhead.in_flight(), bulkhead.waiting()), (0, 0));

    // A waiter granted the permit, dropped before it ran: the permit is not lost.
    let mut first = Box::pin(svc.ready().await.unwrap().call(req("/")));
    poll_once(&mut first);
    let mut second = Box::pin(svc.ready().await.unwrap().call(req("/")));
    poll_once(&mut second);
    drop(first); // hands the permit to `second`
    drop(second);
    assert_eq!((bulkhead.in_flight(), bulkhead.waiting()), (0, 0));

    // Every permit is there: a request now runs at once.
    answer.add_permits(1);
    let res = svc.ready().await.unwrap().call(req("/")).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    drop(res);
    assert_eq!(bulkhead.in_flight(), 0);
    let stats = layer.stats();
    assert_eq!(
        (stats.admitted(), stats.shed()),
        (3, 0),
        "`second` never ran"
    );
}

#[tokio::test(start_paused = true)]
async fn a_held_body_returns_its_permit_when_it_ends_or_is_dropped_unpolled() {
    let bulkhead = Bulkhead::new(1).unwrap();
    let svc = ShedLayer::builder(bulkhead.clone())
        .build()
        .unwrap()
        .layer(service_fn(|_req: Req| async { Ok::<_, Infallible>(ok()) }));

    // Never polled, dropped: back.
    let res = svc.clone().oneshot(req("/")).await.unwrap();
    assert_eq!(bulkhead.in_flight(), 1);
    drop(res);
    assert_eq!(bulkhead.in_flight(), 0);

    // Polled to its end and kept: back at the end, before the drop.
    let res = svc.clone().oneshot(req("/")).await.unwrap();
    let mut body = res.into_body();
    while let Some(frame) = body.frame().await {
        frame.unwrap();
    }
    assert!(body.is_end_stream());
    assert_eq!(bulkhead.in_flight(), 0);
    drop(body);
    assert_eq!(bulkhead.in_flight(), 0);
}

/// A service whose `call` panics, or whose future panics, or whose `poll_ready` fails, as
/// `mode` says.
#[derive(Clone, Copy)]
enum Faulty {
    PanicInCall,
    PanicInFuture,
    FailReady,
    FailFuture,
}

impl Service<Req> for Faulty {
    type Response = Response<Full<Bytes>>;
    type Error = &'static str;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, &'static str>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), &'static str>> {
        Poll::Ready(match self {
            Faulty::FailReady => Err("not ready"),
            _ => Ok(()),
        })
    }

    fn call(&mut self, _: Req) -> Self::Future {
        match *self {
            Faulty::PanicInCall => panic!("call panicked"),
            Faulty::PanicInFuture => Box::pin(async {
                tokio::task::yield_now().await;
                panic!("future panicked")
            }),
            Faulty::FailReady => unreachable!("never ready"),
            Faulty::FailFuture => Box::pin(async { Err("failed") }),
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_faulty_inner_service_leaves_every_permit_in_the_bulkhead() {
    let bulkhead = Bulkhead::builder(2)
        .adaptive(Aimd::builder().build().unwrap())
        .build()
        .unwrap();
    let layer = ShedLayer::builder(bulkhead.clone()).build().unwrap();
    for faulty in [Faulty::PanicInCall, Faulty::PanicInFuture] {
        let svc = layer.layer(faulty);
        let panicked = tokio::spawn(svc.oneshot(req("/"))).await.unwrap_err();
        assert!(panicked.is_panic());
        assert_eq!(bulkhead.in_flight(), 0);
    }
    let err = layer
        .layer(Faulty::FailReady)
        .oneshot(req("/"))
        .await
        .unwrap_err();
    assert_eq!(err, "not ready");
    let err = layer
        .layer(Faulty::FailFuture)
        .oneshot(req("/"))
        .await
        .unwrap_err();
    assert_eq!(err, "failed");
    assert_eq!(bulkhead.in_flight(), 0);
    // A served request: its sample is taken at the head, the body's drop adds none.
    let res = layer
        .layer(service_fn(|_: Req| async { Ok::<_, Infallible>(ok()) }))
        .oneshot(req("/"))
        .await
        .unwrap();
    assert_eq!(bulkhead.in_flight(), 1);
    drop(res);
    assert_eq!(bulkhead.in_flight(), 0);
    // Two panics (dropped permits: ignored samples), one error (back-pressure), one served;
    // a service that was never ready took no permit.
    let stats = bulkhead.adaptive_stats().unwrap();
    assert_eq!((stats.ok, stats.back_pressure, stats.ignored), (1, 1, 2));
    assert_eq!(layer.stats().normal.admitted, 4);
}

/// A `ShedLayer` over an adaptive bulkhead of 100 whose AIMD limit starts at 50.
pub(crate) fn adaptive_shed() -> (Bulkhead, ShedLayer) {
    let bulkhead = Bulkhead::builder(100)
        .adaptive(Aimd::builder().initial(50).build().unwrap())
        .build()
        .unwrap();
    let layer = ShedLayer::builder(bulkhead.clone()).build().unwrap();
    (bulkhead, layer)
}

/// Twenty requests for `path` through `svc`, 10 ms apart, each answered `status`.
pub(crate) async fn twenty_answered<S, B>(svc: &S, path: &str, status: StatusCode)
where
    S: Service<Req, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
{
    for _ in 0..20 {
        let res = svc.clone().oneshot(req(path)).await.unwrap();
        assert_eq!(res.status(), status);
        tokio::time::advance(Duration::from_millis(10)).await;
    }
}

/// A `ShedLayer` over an adaptive bulkhead in front of an app that answers `429` to one
/// client over its own quota (a login throttle, a rate-limit layer inside the shed one):
/// that is the client's quota, not the server's capacity, so the limit every other client
/// is served under stays where it was.
#[tokio::test(start_paused = true)]
async fn an_inner_429_does_not_cut_a_shed_layers_adaptive_limit() {
    let (bulkhead, layer) = adaptive_shed();
    let before = bulkhead.max_in_flight();
    let svc = layer.layer(service_fn(|req: Req| async move {
        let mut res = ok();
        if req.uri().path() == "/login" {
            *res.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        }
        Ok::<_, Infallible>(res)
    }));
    twenty_answered(&svc, "/login", StatusCode::TOO_MANY_REQUESTS).await;
    assert_eq!(
        bulkhead.max_in_flight(),
        before,
        "one client's 429s cut the limit of all"
    );
    let stats = bulkhead.adaptive_stats().unwrap();
    assert_eq!(stats.back_pressure, 0);
}

/// A gate that cannot decide: every call times out (a Redis gate under
/// `FailurePolicy::Error` while Redis is away).
#[derive(Debug)]
struct Undecided;

impl Undecided {
    fn timed_out<'a, T: Send + 'a>() -> flowgate::gate::GateFuture<'a, T> {
        Box::pin(async {
            Err(flowgate::gate::GateError::Timeout(Duration::from_millis(
                50,
            )))
        })
    }
}

impl Gate for Undecided {
    fn check<'a>(&'a self, _: &'a str, _: u32) -> flowgate::gate::GateFuture<'a> {
        Undecided::timed_out()
    }

    fn check_all<'a>(
        &'a self,
        _: &'a [(&'a str, Quota)],
        _: u32,
    ) -> flowgate::gate::GateFuture<'a, Vec<flowgate::Decision>> {
        Undecided::timed_out()
    }

    fn validate_quotas(&self, _: &[Quota]) -> Result<(), flowgate::ConfigError> {
        Ok(())
    }

    fn limit(&self) -> Limit {
        Limit::TokenBucket(Quota::per_second(1).unwrap())
    }
}

/// A `ShedLayer` over an adaptive bulkhead in front of a `RateLimitLayer` whose gate cannot
/// decide (Redis away): the rate-limit layer's own `503`s say nothing about the capacity of
/// the service behind it (the handler never ran), so they do not cut the limit every
/// client is served under, as a `503` from the handler does. They cut it from 50 to its
/// floor while Redis was away, to climb back for minutes once it returned.
#[tokio::test(start_paused = true)]
async fn a_rate_limit_layers_own_503_does_not_cut_a_shed_layers_adaptive_limit() {
    let (bulkhead, shed) = adaptive_shed();
    let before = bulkhead.max_in_flight();
    let limit = RateLimitLayer::builder(Undecided)
        .policy(Policy::new(
            "all",
            Quota::per_second(1).unwrap(),
            Constant::new("k"),
        ))
        .build()
        .unwrap();
    let svc = shed.layer(limit.layer(service_fn(|_: Req| async { Ok::<_, Infallible>(ok()) })));
    twenty_answered(&svc, "/", StatusCode::SERVICE_UNAVAILABLE).await;
    assert_eq!(limit.stats().gate_error, 20);
    assert_eq!(
        bulkhead.max_in_flight(),
        before,
        "the rate-limit layer's 503s cut the limit"
    );
    let stats = bulkhead.adaptive_stats().unwrap();
    assert_eq!((stats.back_pressure, stats.ignored), (0, 20), "{stats:?}");
}

#[tokio::test(start_paused = true)]
async fn a_shed_service_called_without_poll_ready_panics_without_leaking_a_permit() {
    /// Like tower's `ConcurrencyLimit`: calling it unready panics.
    #[derive(Clone, Default)]
    struct NeedsReady(bool);
    impl Service<Req> for NeedsReady {
        type Response = Response<Full<Bytes>>;
        type Error = Infallible;
        type Future = std::future::Ready<Result<Self::Response, Infallible>>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            self.0 = true;
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, _: Req) -> Self::Future {
            assert!(std::mem::take(&mut self.0), "called without poll_ready");
            std::future::ready(Ok(ok()))
        }
    }
    let bulkhead = Bulkhead::new(1).unwrap();
    let layer = ShedLayer::builder(bulkhead.clone()).build().unwrap();
    let mut svc = layer.layer(NeedsReady::default());
    let fut = svc.call(req("/")); // a contract violation: no poll_ready
    let panicked = AssertUnwindSafe(fut).catch_unwind().await;
    assert!(panicked.is_err());
    assert_eq!(bulkhead.in_flight(), 0);
    // Admitted before the call panicked: counted once, not also as cancelled.
    let normal = layer.stats().normal;
    assert_eq!((normal.admitted, normal.cancelled), (1, 0));
    let res = svc.ready().await.unwrap().call(req("/")).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn shed_clones_share_the_bulkhead_and_the_counts() {
    let bulkhead = Bulkhead::new(1).unwrap();
    let layer = ShedLayer::builder(bulkhead.clone())
        .classify(|_| Class::Sheddable)
        .build()
        .unwrap();
    let a = layer
        .clone()
        .layer(service_fn(|_: Req| async { Ok::<_, Infallible>(ok()) }));
    let b = a.clone();
    let held = a.clone().oneshot(req("/")).await.unwrap();
    let shed = b.clone().oneshot(req("/")).await.unwrap();
    assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE);
    drop(held);
    assert_eq!(b.stats(), layer.stats());
    assert_eq!((layer.stats().admitted(), layer.stats().shed()), (1, 1));
}

#[test]
fn shed_types_have_the_auto_traits_axum_and_hyper_ask_for() {
    fn send_sync_clone<T: Send + Sync + Clone + 'static>() {}
    fn send<T: Send + 'static>() {}
    fn send_sync<T: Send + Sync + 'static>() {}
    send_sync_clone::<ShedLayer>();
    send_sync_clone::<Shed<axum::routing::Route>>();
    send::<ShedFuture<axum::routing::Route, axum::body::Body>>();
    send::<ResponseBody<axum::body::Body>>();
    send_sync::<ResponseBody<Full<Bytes>>>();
}

// ---- RateLimitLayer ----

#[tokio::test(start_paused = true)]
async fn a_rate_limit_future_dropped_or_panicking_counts_what_it_decided() {
    let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(1).unwrap()));
    let layer = RateLimitLayer::builder(gate)
        .policy(Policy::new(
            "all",
            Quota::per_second(2).unwrap(),
            Constant::new("k"),
        ))
        .build()
        .unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let answer = Arc::new(Semaphore::new(0));
    let inner = {
        let (calls, answer) = (calls.clone(), answer.clone());
        service_fn(move |_: Req| {
            calls.fetch_add(1, Ordering::SeqCst);
            let answer = answer.clone();
            async move {
                answer.acquire().await.unwrap().forget();
                Ok::<_, Infallible>(ok())
            }
        })
    };
    let mut svc = layer.layer(inner);
    // Dropped before its first poll: not decided, not charged, not passed on.
    drop(svc.ready().await.unwrap().call(req("/")));
    assert_eq!(
        (layer.stats().admitted, calls.load(Ordering::SeqCst)),
        (0, 0)
    );
    // Dropped while the inner service runs: admitted once, charged once.
    let mut fut = Box::pin(svc.ready().await.unwrap().call(req("/")));
    poll_once(&mut fut);
    drop(fut);
    assert_eq!(
        (layer.stats().admitted, calls.load(Ordering::SeqCst)),
        (1, 1)
    );
    // The second token of the burst is still there; the third request is refused.
    answer.add_permits(1);
    let res = svc.ready().await.unwrap().call(req("/")).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let res = svc.ready().await.unwrap().call(req("/")).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!((layer.stats().admitted, layer.stats().rejected), (2, 1));

    // A panicking inner future: the decision stands, the layer stays usable.
    let panicking = layer.layer(Faulty::PanicInFuture);
    tokio::time::advance(Duration::from_secs(1)).await;
    let panicked = tokio::spawn(panicking.clone().oneshot(req("/")))
        .await
        .unwrap_err();
    assert!(panicked.is_panic());
    let err = layer
        .layer(Faulty::FailReady)
        .oneshot(req("/"))
        .await
        .unwrap_err();
    assert_eq!(err, "not ready");
    assert_eq!(layer.stats().admitted, 3);
}

// ---- RetryLayer ----

fn backoff(attempts: u32) -> Backoff {
    Backoff::builder()
        .jitter(Jitter::None)
        .max_attempts(attempts)
        .seed(1)
        .build()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_retry_future_dropped_at_each_await_point_sends_nothing_more() {
    let budget = RetryBudget::new(10, 0.1).unwrap();
    let policy = RetryPolicy::builder(backoff(5))
        .budget(budget.clone())
        .build()
        .unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let server = {
        let calls = calls.clone();
        service_fn(move |_: Request<String>| {
            calls.fetch_add(1, Ordering::SeqCst);
            async {
                let mut res = Response::new(String::new());
                *res.status_mut() = StatusCode::BAD_GATEWAY;
                Ok::<_, Infallible>(res)
            }
        })
    };
    let mut client = RetryLayer::new(policy).layer(server);
    let get = || {
        Request::builder()
            .method(Method::GET)
            .body(String::new())
            .unwrap()
    };
    // Polled once: the first attempt failed (one token), it waits 100 ms; dropped there.
    let mut fut = Box::pin(client.ready().await.unwrap().call(get()));
    poll_once(&mut fut);
    drop(fut);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(budget.tokens(), 9.0);
    tokio::time::advance(Duration::from_secs(10)).await;
    assert_eq!(calls.load(Ordering::SeqCst), 1, "never sent again");
}

#[test]
fn retry_types_have_the_auto_traits_a_client_asks_for() {
    fn send<T: Send + 'static>() {}
    fn send_sync_clone<T: Send + Sync + Clone + 'static>() {}
    type Client = hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        Full<Bytes>,
    >;
    send_sync_clone::<RetryLayer>();
    send_sync_clone::<flowgate::retry::Retry<Client>>();
    send::<
        flowgate::retry::RetryFuture<
            Client,
            flowgate::retry::HttpClassify,
            Full<Bytes>,
            hyper::body::Incoming,
        >,
    >();
}

#[tokio::test(start_paused = true)]
async fn a_retry_future_dropped_while_paced_leaves_no_reservation() {
    let pacer = AdaptivePacer::builder(Rate::per_second(1).unwrap())
        .build()
        .unwrap();
    let policy = RetryPolicy::builder(backoff(1))
        .pacer(pacer)
        .build()
        .unwrap();
    let server = service_fn(|_: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    });
    let client = RetryLayer::new(policy).layer(server);
    let get = || Request::get("/").body(String::new()).unwrap();
    let start = tokio::time::Instant::now();
    // The pacer's burst (1 + ⌈1/s × 5 ms⌉ = 2) passes at once.
    for _ in 0..2 {
        client.clone().oneshot(get()).await.unwrap();
    }
    assert_eq!(start.elapsed(), Duration::ZERO);
    // The next one waits for 1 s; dropped half way, it holds no turn.
    let mut paced = Box::pin(client.clone().oneshot(get()));
    poll_once(&mut paced);
    tokio::time::advance(Duration::from_millis(500)).await;
    drop(paced);
    client.clone().oneshot(get()).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_secs(1));
}

// ---- no busy self-wake ----

/// A waker that counts its wakes.
#[derive(Default)]
struct Wakes(AtomicU32);

impl futures::task::ArcWake for Wakes {
    fn wake_by_ref(this: &Arc<Self>) {
        this.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Poll `fut` with a waker counting its wakes; it must be pending.
fn poll_counted<F: Future + Unpin>(fut: &mut F, wakes: &Arc<Wakes>) {
    let waker = futures::task::waker(wakes.clone());
    let mut cx = Context::from_waker(&waker);
    assert!(Pin::new(fut).poll(&mut cx).is_pending(), "still pending");
}

/// A gate that decides as a `MemoryGate` does, the given time after it is asked (a remote
/// gate's round trip; zero: once its future is polled again): the rate-limit future waits
/// on the gate's future.
#[derive(Debug)]
struct Remote(MemoryGate, Duration);

impl Gate for Remote {
    fn check<'a>(&'a self, key: &'a str, cost: u32) -> flowgate::gate::GateFuture<'a> {
        Gate::check(&self.0, key, cost)
    }

    fn check_all<'a>(
        &'a self,
        limits: &'a [(&'a str, Quota)],
        cost: u32,
    ) -> flowgate::gate::GateFuture<'a, Vec<flowgate::Decision>> {
        Box::pin(async move {
            if self.1.is_zero() {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(self.1).await;
            }
            Gate::check_all(&self.0, limits, cost).await
        })
    }

    fn validate_quotas(&self, quotas: &[Quota]) -> Result<(), flowgate::ConfigError> {
        self.0.validate_quotas(quotas)
    }

    fn limit(&self) -> Limit {
        Gate::limit(&self.0)
    }
}

#[tokio::test(start_paused = true)]
async fn a_waiting_future_is_woken_by_what_it_waits_for_never_by_itself() {
    let answer = Arc::new(Semaphore::new(0));

    // RateLimitLayer, waiting on a remote gate: woken once, when the gate answers. Dropped
    // while it waits, nothing is charged nor passed on (the next request still finds the
    // one token).
    let gate = Remote(
        MemoryGate::new(Limit::TokenBucket(Quota::per_second(1).unwrap())),
        Duration::from_secs(1),
    );
    let layer = RateLimitLayer::builder(gate)
        .policy(Policy::new(
            "all",
            Quota::per_second(1).unwrap(),
            Constant::new("k"),
        ))
        .build()
        .unwrap();
    let mut svc = layer.layer(gated(&answer));
    let wakes = Arc::new(Wakes::default());
    let mut dropped = Box::pin(svc.ready().await.unwrap().call(req("/")));
    poll_counted(&mut dropped, &wakes);
    tokio::time::advance(Duration::from_millis(500)).await;
    drop(dropped);
    assert_eq!(wakes.0.load(Ordering::SeqCst), 0);
    let mut fut = Box::pin(svc.ready().await.unwrap().call(req("/")));
    poll_counted(&mut fut, &wakes);
    tokio::time::advance(Duration::from_millis(999)).await;
    assert_eq!(
        wakes.0.load(Ordering::SeqCst),
        0,
        "woken before the gate answered"
    );
    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
    poll_counted(&mut fut, &wakes); // admitted: the inner service waits for `answer`
    assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
    answer.add_permits(1);
    assert_eq!(fut.await.unwrap().status(), StatusCode::OK);
    assert_eq!((layer.stats().admitted, layer.stats().rejected), (1, 0));

    // ShedLayer, waiting in the room: woken once, when the permit frees.
    let bulkhead = Bulkhead::builder(1)
        .wait_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let layer = ShedLayer::builder(bulkhead.clone())
        .wait(true)
        .build()
        .unwrap();
    let mut svc = layer.layer(gated(&answer));
    let mut running = Box::pin(svc.ready().await.unwrap().call(req("/")));
    poll_once(&mut running);
    let wakes = Arc::new(Wakes::default());
    let mut waiting = Box::pin(svc.ready().await.unwrap().call(req("/")));
    poll_counted(&mut waiting, &wakes);
    tokio::time::advance(Duration::from_secs(2)).await;
    assert_eq!(
        wakes.0.load(Ordering::SeqCst),
        0,
        "woken before a permit freed"
    );
    drop(running);
    assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
    answer.add_permits(1);
    assert_eq!(waiting.await.unwrap().status(), StatusCode::OK);

    // RetryLayer, in its backoff: woken once, when the backoff ends.
    let policy = RetryPolicy::builder(backoff(2)).build().unwrap();
    let server = service_fn(|_: Request<String>| async {
        let mut res = Response::new(String::new());
        *res.status_mut() = StatusCode::BAD_GATEWAY;
        Ok::<_, Infallible>(res)
    });
    let mut client = RetryLayer::new(policy).layer(server);
    let wakes = Arc::new(Wakes::default());
    let get = Request::get("/").body(String::new()).unwrap();
    let mut fut = Box::pin(client.ready().await.unwrap().call(get));
    poll_counted(&mut fut, &wakes);
    tokio::time::advance(Duration::from_millis(99)).await;
    assert_eq!(
        wakes.0.load(Ordering::SeqCst),
        0,
        "woken before the backoff ended"
    );
    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
    assert_eq!(fut.await.unwrap().status(), StatusCode::BAD_GATEWAY);
}

#[tokio::test(start_paused = true)]
async fn a_shed_waiter_past_the_timeout_is_a_503_and_leaves_the_room() {
    let bulkhead = Bulkhead::builder(1)
        .max_waiting(1)
        .wait_timeout(Duration::from_millis(250))
        .build()
        .unwrap();
    let layer = ShedLayer::builder(bulkhead.clone())
        .wait(true)
        .build()
        .unwrap();
    let answer = Arc::new(Semaphore::new(0));
    let mut svc = layer.layer(gated(&answer));
    let mut running = Box::pin(svc.ready().await.unwrap().call(req("/")));
    poll_once(&mut running);
    let start = tokio::time::Instant::now();
    let res = svc.ready().await.unwrap().call(req("/")).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(start.elapsed(), Duration::from_millis(250));
    assert_eq!((bulkhead.in_flight(), bulkhead.waiting()), (1, 0));
    answer.add_permits(1);
    assert_eq!(running.await.unwrap().status(), StatusCode::OK);
    let stats = layer.stats();
    assert_eq!((stats.admitted(), stats.shed()), (1, 1));
}

/// A request whose rate-limit future is dropped before the gate answered (the client went
/// away during a remote gate's round trip, or before the future was polled) is counted as
/// `cancelled`, in `stats` and in `flowgate_http_decisions_total{outcome="cancelled"}`:
/// every request the layer's services were called with is counted under one outcome. It
/// was counted nowhere, so the outcomes fell short of the requests, and an operator could
/// not tell requests given up from lost ones. A request passed on and then dropped counts
/// as admitted only.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn a_rate_limited_request_dropped_before_the_gate_answered_counts_cancelled() {
    let recorder = crate::support::TestRecorder::default();
    let gate = Remote(
        MemoryGate::new(Limit::TokenBucket(Quota::per_second(1).unwrap())),
        Duration::from_secs(1),
    );
    let layer = metrics::with_local_recorder(&recorder, || {
        RateLimitLayer::builder(gate)
            .policy(Policy::new(
                "all",
                Quota::per_second(5).unwrap(),
                Constant::new("k"),
            ))
            .name("cancels")
            .build()
            .unwrap()
    });
    let answer = Arc::new(Semaphore::new(0));
    let mut svc = layer.layer(gated(&answer));
    // Waiting for the gate, then dropped.
    let mut waiting = Box::pin(svc.ready().await.unwrap().call(req("/")));
    poll_once(&mut waiting);
    tokio::time::advance(Duration::from_millis(500)).await;
    drop(waiting);
    // Never polled.
    drop(svc.ready().await.unwrap().call(req("/")));
    // Admitted, then dropped while the inner service runs: admitted only.
    let mut admitted = Box::pin(svc.ready().await.unwrap().call(req("/")));
    poll_once(&mut admitted);
    tokio::time::advance(Duration::from_secs(1)).await;
    poll_once(&mut admitted);
    drop(admitted);
    let stats = layer.stats();
    assert_eq!((stats.admitted, stats.cancelled), (1, 2), "{stats:?}");
    let metric = |o: &str| {
        recorder.counter(&format!(
            "flowgate_http_decisions_total{{name=cancels,outcome={o}}}"
        ))
    };
    assert_eq!((metric("admitted"), metric("cancelled")), (1, 2));
}

/// Through a gate's future, on four worker threads, a quarter of the requests dropped after
/// their first poll: each request counts under one outcome (`cancelled` exactly the ones
/// dropped; in shadow mode a request without a key counts `missing_key` and `admitted`, as
/// documented), and the top rejected keys add up to the rejections. (Coverage.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gate_futures_requests_count_once_with_drops_on_a_multi_thread_runtime() {
    use flowgate::http::{MissingKey, RequestInfo};
    for shadow in [false, true] {
        let gate = Remote(
            MemoryGate::new(Limit::TokenBucket(Quota::per_second(1).unwrap())),
            Duration::ZERO,
        );
        let key = |req: &RequestInfo<'_>, key: &mut String| {
            let p = req.uri.path();
            if p.len() > 2 {
                key.push_str(&p[1..3]);
                true
            } else {
                false
            }
        };
        let layer = RateLimitLayer::builder(gate)
            .policy(
                Policy::new("p", Quota::per_hour(3).unwrap(), key).missing_key(MissingKey::Refuse),
            )
            .shadow(shadow)
            .build()
            .unwrap();
        let tasks: Vec<_> = (0..8)
            .map(|t| {
                let svc = layer.layer(service_fn(|_: Req| async { Ok::<_, Infallible>(ok()) }));
                tokio::spawn(async move {
                    let mut dropped = 0u64;
                    for i in 0..200usize {
                        let path = if i % 11 == 0 {
                            "/".to_string()
                        } else {
                            format!("/k{}", (i + t) % 10)
                        };
                        let fut = svc.clone().oneshot(req(&path));
                        if i % 4 == 0 {
                            if fut.now_or_never().is_none() {
                                dropped += 1;
                            }
                        } else {
                            fut.await.unwrap();
                        }
                    }
                    dropped
                })
            })
            .collect();
        let mut dropped = 0;
        for t in tasks {
            dropped += t.await.unwrap();
        }
        let s = layer.stats();
        let sum = outcomes(&s);
        let extra = if shadow { s.missing_key } else { 0 };
        assert_eq!(sum - extra, 1600, "{s:?}");
        assert_eq!(s.cancelled, dropped);
        let top = layer.top_rejected(usize::MAX);
        assert_eq!(
            top.iter().map(|r| r.count).sum::<u64>(),
            s.rejected + s.shadow_rejected
        );
    }
}
