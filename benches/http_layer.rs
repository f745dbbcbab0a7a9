//! What a rate-limit layer costs per request, in process: no sockets, no client, so the
//! figure is the layer's own CPU time and is not blurred by the loopback network that
//! dominates `benches/http.rs` on a 2-core machine.
//!
//! # What is measured
//!
//! An axum 0.8 `Router` with one route, `GET /` answering `"ok"`, called directly through
//! `tower::Service` (`ready().await` then `call(req).await`) on a current-thread tokio
//! runtime, one request after the other; each request is built fresh (`GET /` with an
//! `x-api-key: cold-<i % 16>` header) and its response dropped, in every variant alike.
//! Each router is prepared with `with_state(())` first, as `axum::serve` prepares it for
//! each connection (without it, axum would apply the layer anew on every request).
//! Variants, each `Router::layer(..)` over the same router, as in `benches/http.rs`:
//!
//! - `no limiter`: the router alone;
//! - `flowgate (memory)`: `RateLimitLayer` on `MemoryGate` with `.inner_body()` (axum's
//!   `Body` kept, as advised under axum), one policy keyed by the header, the default IETF
//!   fields on every response;
//! - `flowgate (no fields)`: the same with `HeaderStyles::NONE`;
//! - `tower_governor`: `GovernorLayer` (default settings: no header on success) keyed by
//!   the same header (each of its 429s builds a new quanta clock, whose `cpuid` traps to
//!   the hypervisor on a virtual machine: most of what its rejection path costs there);
//! - `tower_governor (headers)`: the same with `.use_headers()` (`x-ratelimit-limit` and
//!   `x-ratelimit-remaining` on every response: the work flowgate's default fields do);
//! - `no limiter (A/A)`: the router alone again, the A/A control: its difference to
//!   `no limiter` is what two identical variants read apart in this run;
//! - `clone-after-ready only`: a layer of this file ([`Deferred`]) that does the plumbing
//!   issue 17 prescribes for flowgate's layer and nothing else: `poll_ready` delegates,
//!   `call` swaps a clone of the ready inner service in (`mem::replace`) and the response
//!   future calls the ready one on its first poll. Its cost over `no limiter` is the floor
//!   any layer deciding in its response future pays; flowgate's cost over it is what its
//!   decision costs, set beside tower_governor's (which decides in `call` and needs no
//!   clone, so its whole cost over `no limiter` is its decision and its plumbing). Not
//!   printed with `LAYER_REJECT=1`, where flowgate answers without calling the inner
//!   service.
//! - `flowgate (around router)`: `flowgate (memory)`'s layer around the whole router
//!   (`layer.layer(router)`, served as axum serves any service, through
//!   `axum::ServiceExt::into_make_service`) instead of under `Router::layer`: without axum's
//!   boxing and per-request clone of a layered route (`pass-through only`, below).
//! - `pass-through only`: a layer of this file ([`PassThrough`]) whose `call` calls the
//!   inner service and returns its future: what axum charges for any layer under
//!   `Router::layer` (the layered route is boxed once more and cloned for each request).
//!   `clone-after-ready only` minus it is the clone after ready alone; the rest of that
//!   variant's cost is axum's, which every layer (tower_governor's too) pays.
//!
//! Quota 1 000 000/s with a burst of 1 000 000: nothing is rejected. With `LAYER_REJECT=1`,
//! the rejection path instead (as run B of `benches/http.rs`, where 90 % is rejected): quota
//! 1 per hour with a burst of 1 in every limiter, so each of the 16 keys is admitted once and
//! every later request gets the limiter's 429 (the `rejected` column counts them; `no
//! limiter` still answers `"ok"`). Each round runs every
//! variant once for [`REQUESTS`] requests, in an order rotated by one per round; the
//! median over [`ROUNDS`] rounds of ns per request is printed, and the overhead of each
//! layer over `no limiter` (its ns per request minus the router's), and the difference
//! between flowgate and tower_governor doing the same work (below 0: flowgate cheaper).
//! Allocations per request (the request's own included, counted by a global allocator
//! wrapper in every variant alike) are from the last round: they do not vary.
//!
//! ```text
//! cargo bench --all-features --bench http_layer
//! LAYER_REQUESTS=1000000 LAYER_ROUNDS=9 cargo bench --all-features --bench http_layer
//! LAYER_REJECT=1 cargo bench --all-features --bench http_layer
//! ```
//!
//! `LAYER_ONLY="flowgate (memory)"` runs one variant (to profile it).
//!
//! `LAYER_THREADS=2` sends from two threads at once, each with its own clone of the router
//! (clones share the limiter's state, as the connections of a multi-threaded server do) on
//! a current-thread runtime of its own: what the limiter's shared state costs when two
//! cores write it. ns/request is then the wall time over the requests of one thread.
//!
//! Without `--bench` (as `cargo test --benches` runs it) it runs 1 000 requests once: a
//! smoke test.

#[path = "support/http_keys.rs"]
mod http_keys;
mod support;

use std::future::Future;
use std::mem;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use flowgate::Quota;
use flowgate::gate::{Limit, MemoryGate};
use flowgate::http::{HeaderStyles, Policy, RateLimitLayer};
use http::{HeaderValue, Request};
use tower::{Layer, Service, ServiceExt};
use tower_governor::governor::GovernorConfigBuilder;

use crate::http_keys::{ApiKey, api_key};
use crate::support::alloc::{CountingAlloc, allocations};

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

/// A variant's service: a router (the layers under `Router::layer`) or a router inside
/// flowgate's layer (the layer around the whole router, as `axum::serve` takes it through
/// `axum::ServiceExt::into_make_service`).
#[derive(Clone)]
enum App {
    Routed(Router),
    Around(flowgate::http::RateLimit<Router, MemoryGate, flowgate::http::InnerBody>),
}

/// Requests per variant and round (`LAYER_REQUESTS` overrides).
const REQUESTS: usize = 300_000;
/// Rounds (`LAYER_ROUNDS` overrides).
const ROUNDS: usize = 7;

async fn ok() -> &'static str {
    "ok"
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok()?.parse().ok()
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (requests, rounds) = if full {
        (
            env_usize("LAYER_REQUESTS").unwrap_or(REQUESTS).max(1),
            env_usize("LAYER_ROUNDS").unwrap_or(ROUNDS).max(1),
        )
    } else {
        (1_000, 1)
    };
    // `LAYER_REJECT=1`: every limiter rejects all but each key's first request.
    let reject = std::env::var("LAYER_REJECT").is_ok_and(|v| v == "1");
    // `LAYER_THREADS=n`: n threads at once, each sending `requests`.
    let threads = env_usize("LAYER_THREADS").unwrap_or(1).max(1);
    println!(
        "benches/http_layer: axum Router called in process, {requests} requests per variant and thread, {threads} thread(s), {rounds} rounds, {}; load average {}",
        if reject {
            "quota 1/h burst 1 (all but each key's first request rejected)"
        } else {
            "quota 1 000 000/s burst 1 000 000 (nothing rejected)"
        },
        support::load_average()
    );
    let quota = if reject {
        Quota::per_hour(1).and_then(|q| q.burst(1))
    } else {
        Quota::per_second(1_000_000).and_then(|q| q.burst(1_000_000))
    }
    .expect("a valid quota");
    let base = Router::new().route("/", get(ok));
    let flowgate = |styles| {
        base.clone().layer(
            RateLimitLayer::builder(MemoryGate::new(Limit::TokenBucket(quota)))
                .inner_body()
                .policy(Policy::new("per-key", quota, api_key()))
                .header_styles(styles)
                .build()
                .expect("a valid layer"),
        )
    };
    // `use_headers` returns another builder (another middleware type): the two variants are
    // built apart.
    let governor = |headers: bool| {
        let mut builder = GovernorConfigBuilder::default();
        if reject {
            builder.period(Duration::from_secs(3600)).burst_size(1);
        } else {
            builder
                .period(Duration::from_micros(1))
                .burst_size(1_000_000);
        }
        macro_rules! layered {
            ($builder:expr) => {{
                let config = $builder.key_extractor(ApiKey).finish();
                base.clone().layer(tower_governor::GovernorLayer::new(
                    config.expect("a valid configuration"),
                ))
            }};
        }
        if headers {
            layered!(builder.use_headers())
        } else {
            layered!(builder)
        }
    };
    // `with_state(())` turns each route's handler (and the layers over it) into a service
    // once, as `axum::serve` does for every connection; a router called without it would
    // rebuild its routes, layers included, on every request.
    let apps = [
        ("no limiter", base.clone()),
        ("flowgate (memory)", flowgate(HeaderStyles::default())),
        ("flowgate (no fields)", flowgate(HeaderStyles::NONE)),
        ("tower_governor", governor(false)),
        ("tower_governor (headers)", governor(true)),
        // The router alone again: the A/A control (see the file's docs).
        ("no limiter (A/A)", base.clone()),
        ("clone-after-ready only", base.clone().layer(Deferred)),
        ("pass-through only", base.clone().layer(PassThrough)),
    ]
    .map(|(name, app)| (name, App::Routed(app.with_state(()))));
    let around = (
        "flowgate (around router)",
        App::Around(
            RateLimitLayer::builder(MemoryGate::new(Limit::TokenBucket(quota)))
                .inner_body()
                .policy(Policy::new("per-key", quota, api_key()))
                .build()
                .expect("a valid layer")
                .layer(base.clone().with_state(())),
        ),
    );
    let apps: Vec<(&str, App)> = apps.into_iter().chain([around]).collect();
    let keys: Vec<HeaderValue> = (0..16)
        .map(|i| HeaderValue::from_str(&format!("cold-{i}")).expect("a valid header value"))
        .collect();
    // `LAYER_ONLY=<variant>` runs one variant (for a profiler); the others show NaN.
    let only = std::env::var("LAYER_ONLY").ok();
    let n = apps.len();
    let mut ns: Vec<Vec<f64>> = vec![Vec::new(); n];
    let mut allocs: Vec<f64> = vec![f64::NAN; n];
    let mut rejected: Vec<f64> = vec![f64::NAN; n];
    for round in 0..rounds {
        for i in 0..n {
            let v = (i + round) % n;
            if only.as_deref().is_some_and(|o| o != apps[v].0) {
                continue;
            }
            // Each thread calls its own clone of the router (clones share the limiter's
            // state, as a multi-threaded server's connections do) on a runtime of its own.
            let start = Instant::now();
            let counted: Vec<(u64, usize)> = std::thread::scope(|scope| {
                let workers: Vec<_> = (0..threads)
                    .map(|_| {
                        let mut app = apps[v].1.clone();
                        let keys = &keys;
                        scope.spawn(move || run(&mut app, keys, requests))
                    })
                    .collect();
                workers
                    .into_iter()
                    .map(|w| w.join().expect("a bench thread panicked"))
                    .collect()
            });
            ns[v].push(start.elapsed().as_nanos() as f64 / requests as f64);
            // Allocations and refusals over every thread's requests.
            let sent = (requests * threads) as f64;
            allocs[v] = counted.iter().map(|&(a, _)| a as f64).sum::<f64>() / sent;
            rejected[v] = counted.iter().map(|&(_, r)| r as f64).sum::<f64>() / sent;
        }
    }
    let medians: Vec<f64> = ns.iter().map(|v| support::median(v)).collect();
    println!(
        "  variant                    ns/request   over no limiter   allocations/request   rejected"
    );
    for (i, (name, _)) in apps.iter().enumerate() {
        println!(
            "  {name:24} {:>10.0}   {:>+15.0}   {:>19.2}   {:>7.1}%",
            medians[i],
            medians[i] - medians[0],
            allocs[i],
            rejected[i] * 100.0
        );
    }
    let at = |name: &str| {
        let i = apps
            .iter()
            .position(|(n, _)| *n == name)
            .expect("a variant");
        medians[i]
    };
    let over = |name: &str| at(name) - at("no limiter");
    // Differences, not ratios: a layer that costs next to nothing makes a ratio of overheads
    // swing with the noise.
    println!(
        "  like for like, ns per request more than tower_governor: flowgate (memory) vs tower_governor (headers) {:+.0}; flowgate (no fields) vs tower_governor {:+.0}",
        over("flowgate (memory)") - over("tower_governor (headers)"),
        over("flowgate (no fields)") - over("tower_governor")
    );
    // On the rejection path flowgate never calls the inner service: set beside a layer that
    // does, its cost says nothing about its decision.
    if !reject {
        println!(
            "  the decision alone: flowgate (no fields) over clone-after-ready only {:+.0} ns (a layer deciding in its response future: its plumbing alone costs {:+.0}); tower_governor's decision and plumbing over no limiter {:+.0}",
            at("flowgate (no fields)") - at("clone-after-ready only"),
            over("clone-after-ready only"),
            over("tower_governor")
        );
        println!(
            "  of that plumbing: any layer under Router::layer (pass-through only) {:+.0} ns; the clone after ready on top of it {:+.0}",
            over("pass-through only"),
            at("clone-after-ready only") - at("pass-through only")
        );
    }
    println!(
        "  flowgate around the router instead of under Router::layer: {:+.0} ns per request",
        at("flowgate (around router)") - at("flowgate (memory)")
    );
    println!(
        "  A/A control, no limiter (A/A) minus no limiter: {:+.0} ns per request (the noise of the differences above in this run)",
        over("no limiter (A/A)")
    );
}

/// The plumbing of a layer that decides in its response future, without a decision: the
/// `clone-after-ready only` variant (see the file's docs).
#[derive(Clone, Copy, Debug)]
struct Deferred;

impl<S> Layer<S> for Deferred {
    type Service = DeferredService<S>;

    fn layer(&self, inner: S) -> DeferredService<S> {
        DeferredService { inner }
    }
}

/// The service of [`Deferred`].
#[derive(Clone, Debug)]
struct DeferredService<S> {
    inner: S,
}

impl<S, R> Service<R> for DeferredService<S>
where
    S: Service<R> + Clone,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = DeferredFuture<S, R>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: R) -> DeferredFuture<S, R> {
        let clone = self.inner.clone();
        let inner = mem::replace(&mut self.inner, clone);
        DeferredFuture::Start {
            inner,
            req: Some(req),
        }
    }
}

/// The response future of [`DeferredService`]: the ready service and the request, then the
/// inner future.
#[pin_project::pin_project(project = DeferredProj)]
enum DeferredFuture<S: Service<R>, R> {
    Start { inner: S, req: Option<R> },
    Call(#[pin] S::Future),
}

impl<S: Service<R>, R> Future for DeferredFuture<S, R> {
    type Output = Result<S::Response, S::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            let fut = match self.as_mut().project() {
                DeferredProj::Start { inner, req } => {
                    inner.call(req.take().expect("polled after the call"))
                }
                DeferredProj::Call(fut) => return fut.poll(cx),
            };
            self.set(DeferredFuture::Call(fut));
        }
    }
}

/// A layer that adds nothing: `call` calls the inner service and returns its future. Its
/// cost over `no limiter` is what axum charges for any layer under `Router::layer` (the
/// route boxed once more, and cloned per request): the `pass-through only` variant.
#[derive(Clone, Copy, Debug)]
struct PassThrough;

impl<S> Layer<S> for PassThrough {
    type Service = PassThroughService<S>;

    fn layer(&self, inner: S) -> PassThroughService<S> {
        PassThroughService { inner }
    }
}

/// The service of [`PassThrough`].
#[derive(Clone, Debug)]
struct PassThroughService<S> {
    inner: S,
}

impl<S: Service<R>, R> Service<R> for PassThroughService<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: R) -> S::Future {
        self.inner.call(req)
    }
}

/// `requests` requests through `app` on a current-thread runtime of this thread's own: the
/// allocations they made and how many were refused.
fn run(app: &mut App, keys: &[HeaderValue], requests: usize) -> (u64, usize) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        let allocated = allocations();
        let mut refused = 0usize;
        for j in 0..requests {
            let req = Request::builder()
                .uri("/")
                .header("x-api-key", keys[j % keys.len()].clone())
                .body(axum::body::Body::empty())
                .expect("a valid request");
            let res = match app {
                App::Routed(app) => {
                    let svc = <Router as ServiceExt<Request<axum::body::Body>>>::ready(app)
                        .await
                        .expect("the router is always ready");
                    svc.call(req).await.expect("infallible")
                }
                App::Around(app) => {
                    let svc = ServiceExt::<Request<axum::body::Body>>::ready(app)
                        .await
                        .expect("the router is always ready");
                    svc.call(req).await.expect("infallible")
                }
            };
            if res.status() == http::StatusCode::TOO_MANY_REQUESTS {
                refused += 1;
            } else {
                assert!(res.status().is_success(), "{}", res.status());
            }
        }
        (allocations() - allocated, refused)
    })
}
