//! An HTTP API behind a `RateLimitLayer` on a `RedisGate`, one route per `FailurePolicy`,
//! while its Redis goes wrong under real traffic (killed, paused, restarted empty, out of
//! memory, asking for a password): what the clients see (statuses, `Retry-After`, the
//! fields, no request past the gate's timeout), what the operators see (the layer's and
//! the gate's counts agree with what the clients saw), and the gate back on Redis when
//! Redis is.
#![cfg(all(feature = "redis", feature = "metrics"))]

use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get as route_get;
use flowgate::Quota;
use flowgate::gate::{FailurePolicy, Limit, MemoryGate, RedisGate};
use flowgate::http::RateLimitLayer;
use http::StatusCode;
use redis::aio::ConnectionManager;

use crate::harness::{Answer, Server, client, get};
use crate::rate_limit::{per_client, quota};
use crate::support::{RedisServer, TestRecorder};

/// The gates' timeout.
const TIMEOUT: Duration = Duration::from_millis(250);
/// The gates' probe interval.
const PROBE: Duration = Duration::from_millis(400);
/// What a loopback request may take beyond the gate's timeout.
const SLACK: Duration = Duration::from_millis(250);
/// The failure policies, by route and metric name.
const POLICIES: [&str; 4] = ["open", "closed", "error", "fallback"];

fn policy(name: &str) -> FailurePolicy {
    match name {
        "open" => FailurePolicy::Open,
        "closed" => FailurePolicy::Closed,
        "error" => FailurePolicy::Error,
        _ => FailurePolicy::Fallback(MemoryGate::new(Limit::TokenBucket(
            Quota::per_second(1).unwrap(),
        ))),
    }
}

/// The burst of the API's policy (per client, per minute).
const BURST: u32 = 3;

/// The API: one route per failure policy, each over a gate of its own (named after the
/// policy) on one `ConnectionManager`, its metrics in `recorder`.
struct Api {
    redis: RedisServer,
    http: Server,
    recorder: TestRecorder,
    gates: Vec<RedisGate<ConnectionManager>>,
    layers: Vec<RateLimitLayer<RedisGate<ConnectionManager>>>,
    /// Every answer so far: its route, status and whether it carried the fields.
    log: std::cell::RefCell<Vec<(usize, StatusCode, bool)>>,
}

/// What one request on a route came to, as its client saw it.
struct Seen {
    route: usize,
    answer: Answer,
    took: Duration,
}

impl Api {
    /// Must run on a current-thread runtime with `recorder` its thread's local recorder.
    async fn start(redis: RedisServer, recorder: TestRecorder) -> Api {
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_millis(200)))
            .set_response_timeout(None)
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(100));
        let conn = ConnectionManager::new_with_config(redis.client(), config)
            .await
            .unwrap();
        Api::over(redis, recorder, conn).await
    }

    /// [`start`](Api::start) over `conn`.
    async fn over(redis: RedisServer, recorder: TestRecorder, conn: ConnectionManager) -> Api {
        let mut gates = Vec::new();
        let mut layers = Vec::new();
        let mut app = Router::new();
        for name in POLICIES {
            let gate = RedisGate::builder(
                conn.clone(),
                Limit::TokenBucket(Quota::per_second(1).unwrap()),
            )
            .prefix(format!("{name}:"))
            .name(name)
            .failure_policy(policy(name))
            .timeout(TIMEOUT)
            .probe_interval(PROBE)
            .build()
            .await
            .unwrap();
            let layer = RateLimitLayer::builder(gate.clone())
                .policy(per_client(quota(BURST, Duration::from_secs(60))))
                .name(name)
                .build()
                .unwrap();
            app = app.route(
                &format!("/{name}"),
                route_get(|| async { "ok" }).layer(layer.clone()),
            );
            gates.push(gate);
            layers.push(layer);
        }
        let http = Server::start(app).await;
        Api {
            redis,
            http,
            recorder,
            gates,
            layers,
            log: Default::default(),
        }
    }

    /// `n` requests at once on every route, each of client `tag-i` (a fresh key each: none
    /// is over its quota).
    async fn round(&self, tag: &str, n: usize) -> Vec<Seen> {
        self.requests(n, |i| format!("{tag}-{i}")).await
    }

    /// `n` requests at once on every route, the `i`-th of client `key(i)`.
    async fn requests(&self, n: usize, key: impl Fn(usize) -> String) -> Vec<Seen> {
        let client = client();
        let mut calls = Vec::new();
        for (route, name) in POLICIES.iter().enumerate() {
            for i in 0..n {
                let url = self.http.url(&format!("/{name}"));
                let key = key(i);
                let client = client.clone();
                calls.push(async move {
                    let started = Instant::now();
                    let answer = get(&client, &url, &[("x-client", &key)]).await;
                    Seen {
                        route,
                        answer,
                        took: started.elapsed(),
                    }
                });
            }
        }
        let seen = futures::future::join_all(calls).await;
        self.log.borrow_mut().extend(seen.iter().map(|s| {
            (
                s.route,
                s.answer.status,
                s.answer.headers.contains_key("ratelimit"),
            )
        }));
        seen
    }

    fn counter(&self, id: &str, name: &str, label: &str) -> u64 {
        let labels = match label {
            "" => format!("name={name}"),
            _ => format!("name={name},{label}"),
        };
        self.recorder.counter(&format!("{id}{{{labels}}}"))
    }

    fn degraded(&self, name: &str) -> Option<f64> {
        self.recorder
            .gauge(&format!("flowgate_gate_degraded{{name={name}}}"))
    }

    /// Polls every route until each is decided by Redis again; how long that took.
    async fn back_on_redis(&self, tag: &str) -> Duration {
        let started = Instant::now();
        let mut back = [false; 4];
        let mut n = 0;
        while !back.iter().all(|b| *b) {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "not back on Redis: {back:?}\n{}",
                self.redis.log_tail()
            );
            n += 1;
            for seen in self.round(&format!("{tag}-{n}"), 1).await {
                let on_redis = seen.answer.status == StatusCode::OK
                    && seen.answer.headers.contains_key("ratelimit")
                    && !self.gates[seen.route].is_degraded();
                back[seen.route] |= on_redis;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        started.elapsed()
    }

    /// `BURST + 2` requests at once on every route from one client, `key`; how many of them
    /// each route admitted (the others are `429`s).
    async fn admitted_of_one(&self, key: &str) -> [usize; 4] {
        let mut admitted = [0; 4];
        for s in self.requests(BURST as usize + 2, |_| key.to_owned()).await {
            match s.answer.status {
                StatusCode::OK => admitted[s.route] += 1,
                other => assert_eq!(other, StatusCode::TOO_MANY_REQUESTS, "{key}"),
            }
        }
        admitted
    }

    /// What the operator reads agrees with what the clients saw, for every route.
    fn assert_counts_agree(&self, outages: u64) {
        let log = self.log.borrow();
        for (route, name) in POLICIES.iter().enumerate() {
            let stats = self.layers[route].stats();
            let count = |f: &dyn Fn(StatusCode, bool) -> bool| {
                log.iter()
                    .filter(|&&(r, s, fields)| r == route && f(s, fields))
                    .count() as u64
            };
            let ok_with_fields = count(&|s, f| s == StatusCode::OK && f);
            let ok_without = count(&|s, f| s == StatusCode::OK && !f);
            let unavailable = count(&|s, _| s == StatusCode::SERVICE_UNAVAILABLE);
            let too_many = count(&|s, _| s == StatusCode::TOO_MANY_REQUESTS);
            assert_eq!(
                ok_with_fields + ok_without + unavailable + too_many,
                count(&|_, _| true),
                "{name}: other statuses"
            );
            assert_eq!(stats.admitted, ok_with_fields, "{name}: {stats:?}");
            assert_eq!(stats.fail_open, ok_without, "{name}: {stats:?}");
            assert_eq!(
                stats.fail_closed + stats.gate_error,
                unavailable,
                "{name}: {stats:?}"
            );
            assert_eq!(stats.rejected, too_many, "{name}: {stats:?}");
            assert_eq!(stats.cancelled, 0, "{name}: {stats:?}");
            // The gate's own counts.
            let decisions = |o: &str| {
                self.counter(
                    "flowgate_gate_decisions_total",
                    name,
                    &format!("outcome={o}"),
                )
            };
            let (allowed, rejected, by_policy) = (
                decisions("allowed"),
                decisions("rejected"),
                decisions("policy"),
            );
            let decided_by_policy = stats.fail_open + stats.fail_closed + stats.gate_error;
            match *name {
                "fallback" => assert_eq!(
                    (allowed + by_policy, rejected),
                    (stats.admitted, stats.rejected),
                    "{name}: by the policy: {by_policy}, {stats:?}"
                ),
                _ => assert_eq!(
                    (allowed, rejected, by_policy),
                    (stats.admitted, stats.rejected, decided_by_policy),
                    "{name}: {stats:?}"
                ),
            }
            let transitions = |to: &str| {
                self.counter("flowgate_gate_transitions_total", name, &format!("to={to}"))
            };
            assert_eq!(
                (transitions("degraded"), transitions("healthy")),
                (outages, outages),
                "{name}"
            );
            assert_eq!(self.degraded(name), Some(0.0), "{name}");
            // One latency sample per call to Redis, answered or failed.
            let failures = self.counter("flowgate_gate_failures_total", name, "");
            let samples = self
                .recorder
                .samples(&format!("flowgate_gate_redis_seconds{{name={name}}}"));
            assert_eq!(
                samples.len() as u64,
                allowed + rejected + failures,
                "{name}: {failures} failures"
            );
            let longest = samples.iter().copied().fold(0.0, f64::max);
            assert!(
                longest <= (TIMEOUT + SLACK).as_secs_f64(),
                "{name}: a call to Redis took {longest} s"
            );
        }
    }
}

/// What a request on `route` may answer while Redis fails (`Retry-After` at most the probe
/// interval, rounded up): the policy's promise, checked literally.
fn assert_policy_answer(seen: &Seen, context: &str) {
    let name = POLICIES[seen.route];
    let a = &seen.answer;
    assert!(
        seen.took <= TIMEOUT + SLACK,
        "{context} {name}: the request took {:?}",
        seen.took
    );
    let retry_after = || -> u64 {
        a.headers
            .get("retry-after")
            .unwrap_or_else(|| panic!("{context} {name}: no Retry-After: {a:?}"))
            .to_str()
            .unwrap()
            .parse()
            .unwrap()
    };
    let most = PROBE.as_secs_f64().ceil() as u64;
    match name {
        "open" => {
            assert_eq!(a.status, StatusCode::OK, "{context} {name}: {a:?}");
            assert!(!a.headers.contains_key("ratelimit"), "{context} {name}");
        }
        "closed" | "error" => {
            assert_eq!(
                a.status,
                StatusCode::SERVICE_UNAVAILABLE,
                "{context} {name}: {a:?}"
            );
            let r = retry_after();
            assert!((1..=most).contains(&r), "{context} {name}: Retry-After {r}");
            assert!(!a.headers.contains_key("ratelimit"), "{context} {name}");
            assert_eq!(
                a.headers.get("content-type").unwrap(),
                "application/problem+json",
                "{context} {name}"
            );
            let body = String::from_utf8_lossy(&a.body);
            assert!(
                body.contains("temporary-reduced-capacity"),
                "{context} {name}: {body}"
            );
        }
        _ => {
            // The in-memory gate decides: a real quota, with its fields.
            assert_eq!(a.status, StatusCode::OK, "{context} {name}: {a:?}");
            assert!(a.headers.contains_key("ratelimit"), "{context} {name}");
        }
    }
}

/// A fault applied while traffic runs: requests in rounds until `settle`, then rounds that
/// must all be answered by the policies; then `lift`, and every route back on Redis within
/// a probe interval (plus a timeout and slack).
async fn journey(
    api: &Api,
    tag: &str,
    emptied: bool,
    apply: impl FnOnce(&Api),
    lift: impl FnOnce(&Api),
) {
    journey_back_within(api, tag, emptied, apply, lift, PROBE + TIMEOUT + SLACK).await;
}

/// [`journey`], every route back on Redis within `back` of the fault's end.
async fn journey_back_within(
    api: &Api,
    tag: &str,
    emptied: bool,
    apply: impl FnOnce(&Api),
    lift: impl FnOnce(&Api),
    back: Duration,
) {
    // One client over its quota before the fault: after it, still over it, unless Redis
    // lost its keys (then a whole burst again, as documented).
    let hot = format!("{tag}-hot");
    let burst = BURST as usize;
    assert_eq!(api.admitted_of_one(&hot).await, [burst; 4], "{tag}");
    for s in &api.round(&format!("{tag}-before"), 4).await {
        assert_eq!(s.answer.status, StatusCode::OK, "{tag}: before the fault");
        assert!(s.answer.headers.contains_key("ratelimit"));
    }
    // The fault comes while a round is in flight; those requests may be answered either way,
    // late by as long as the fault took to apply (the runtime is blocked meanwhile).
    let meets = format!("{tag}-meets");
    let round = api.round(&meets, 16);
    tokio::pin!(round);
    let early = tokio::select! {
        biased;
        seen = &mut round => Some(seen),
        () = tokio::time::sleep(Duration::from_millis(2)) => None,
    };
    let applying = Instant::now();
    apply(api);
    let applied = applying.elapsed();
    let first = match early {
        Some(seen) => seen,
        None => round.await,
    };
    for s in &first {
        assert!(
            s.took <= TIMEOUT + SLACK + applied,
            "{tag}: took {:?} ({applied:?} to apply the fault)",
            s.took
        );
    }
    let started = Instant::now();
    let mut n = 0;
    while started.elapsed() < PROBE * 3 {
        n += 1;
        for s in api.round(&format!("{tag}-during-{n}"), 4).await {
            assert_policy_answer(&s, tag);
        }
        for name in POLICIES {
            assert_eq!(api.degraded(name), Some(1.0), "{tag} {name}");
        }
    }
    lift(api);
    let took = api.back_on_redis(tag).await;
    println!("{tag}: back on Redis after {took:?}");
    assert!(took <= back, "{tag}: back on Redis after {took:?}");
    let again = if emptied { burst } else { 0 };
    assert_eq!(api.admitted_of_one(&hot).await, [again; 4], "{tag}");
}

/// An API on a Redis of its own meets one fault ([`journey`]); then every count agrees.
async fn one_outage(tag: &str, emptied: bool, apply: impl FnOnce(&Api), lift: impl FnOnce(&Api)) {
    let recorder = TestRecorder::default();
    // Current-thread runtime: the gates and layers register with this thread's recorder.
    let _local = metrics::set_default_local_recorder(&recorder);
    let api = Api::start(RedisServer::start(), recorder.clone()).await;
    journey(&api, tag, emptied, apply, lift).await;
    api.assert_counts_agree(1);
}

/// Runs `args` on `con`.
fn run(con: &mut redis::Connection, args: &[&str]) {
    let mut cmd = redis::cmd(args[0]);
    for arg in &args[1..] {
        cmd.arg(*arg);
    }
    let _: redis::Value = cmd.query(con).unwrap_or_else(|e| panic!("{args:?}: {e}"));
}

/// Runs `args` on a connection of its own.
fn run_new(redis: &RedisServer, args: &[&str]) {
    run(&mut redis.client().get_connection().unwrap(), args);
}

/// Full under `noeviction`: every write refused with `OOM`.
fn out_of_memory(redis: &RedisServer) {
    run_new(redis, &["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    run_new(redis, &["CONFIG", "SET", "maxmemory", "1"]);
}

#[tokio::test]
async fn redis_paused_then_resumed() {
    one_outage("pause", false, |a| a.redis.pause(), |a| a.redis.resume()).await;
}

#[tokio::test]
async fn redis_killed_then_restarted_empty() {
    one_outage("kill", true, |a| a.redis.kill(), |a| a.redis.restart()).await;
}

#[tokio::test]
async fn redis_out_of_memory_then_given_memory() {
    let lift = |a: &Api| run_new(&a.redis, &["CONFIG", "SET", "maxmemory", "0"]);
    one_outage("oom", false, |a| out_of_memory(&a.redis), lift).await;
}

/// Restarted empty (no scripts: loaded again, then refused for memory).
#[tokio::test]
async fn redis_restarted_empty_and_out_of_memory_then_given_memory() {
    let apply = |a: &Api| {
        a.redis.restart();
        out_of_memory(&a.redis);
    };
    let lift = |a: &Api| run_new(&a.redis, &["CONFIG", "SET", "maxmemory", "0"]);
    one_outage("restart-oom", true, apply, lift).await;
}

/// `requirepass` set mid-traffic, the connections made before closed: the gate's
/// connection comes back and every call is refused with `NOAUTH`.
#[tokio::test]
async fn redis_asking_for_a_password_then_not() {
    let apply = |a: &Api| {
        let mut con = a.redis.client().get_connection().unwrap();
        run(&mut con, &["CONFIG", "SET", "requirepass", "s3cret"]);
        // Connections made before keep their login: close them (not this one).
        run(&mut con, &["CLIENT", "KILL", "TYPE", "normal"]);
    };
    let lift = |a: &Api| {
        let mut con = a.redis.client().get_connection().unwrap();
        run(&mut con, &["AUTH", "s3cret"]);
        run(&mut con, &["CONFIG", "SET", "requirepass", ""]);
    };
    one_outage("noauth", false, apply, lift).await;
}

/// As a user builds it: a `ConnectionManager` of redis-rs's defaults. It reconnects with
/// a backoff of its own, so the gate is back once that connection is and a probe is due.
#[tokio::test]
async fn redis_killed_then_restarted_under_a_default_connection_manager() {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let redis = RedisServer::start();
    let conn = ConnectionManager::new(redis.client()).await.unwrap();
    let api = Api::over(redis, recorder.clone(), conn).await;
    let back = Duration::from_secs(3);
    let (kill, restart) = (|a: &Api| a.redis.kill(), |a: &Api| a.redis.restart());
    journey_back_within(&api, "kill", true, kill, restart, back).await;
    let (pause, resume) = (|a: &Api| a.redis.pause(), |a: &Api| a.redis.resume());
    journey_back_within(&api, "pause", false, pause, resume, back).await;
    api.assert_counts_agree(2);
}

/// Clients that give up (a timeout of their own, shorter than the gate's) while Redis is
/// paused: every request the layer saw is counted once, each cancelled one as `cancelled`
/// and nowhere else; what the gate's policy decided agrees with the layer's counts, and
/// the gate is back on Redis after the pause.
#[tokio::test]
async fn clients_that_give_up_during_a_pause_are_counted_once() {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let api = Api::start(RedisServer::start(), recorder.clone()).await;
    let sent_before = api.round("before", 4).await.len() / POLICIES.len();
    api.redis.pause();
    let client = client();
    let mut calls = Vec::new();
    for name in POLICIES {
        for i in 0..16 {
            let url = api.http.url(&format!("/{name}"));
            let client = client.clone();
            calls.push(async move {
                let key = format!("gives-up-{i}");
                let headers = [("x-client", key.as_str())];
                let request = get(&client, &url, &headers);
                tokio::time::timeout(TIMEOUT / 5, request).await.is_err()
            });
        }
    }
    let gave_up = futures::future::join_all(calls).await;
    assert!(gave_up.iter().any(|g| *g), "no client gave up");
    // Every call to Redis made for them has timed out by now.
    tokio::time::sleep(TIMEOUT * 2).await;
    api.redis.resume();
    api.back_on_redis("after").await;
    let sent_after = api.log.borrow().len() / POLICIES.len() - sent_before;
    for (route, name) in POLICIES.iter().enumerate() {
        let stats = api.layers[route].stats();
        assert_eq!(
            crate::harness::outcomes(&stats),
            (sent_before + 16 + sent_after) as u64,
            "{name}: {stats:?}"
        );
        // Each client that gave up left its request (a hyper server drops it with the
        // connection): cancelled, and decided by nobody.
        let gave_up = gave_up[route * 16..][..16].iter().filter(|g| **g).count();
        assert_eq!(stats.cancelled, gave_up as u64, "{name}: {stats:?}");
        let decisions = |o: &str| {
            api.counter(
                "flowgate_gate_decisions_total",
                name,
                &format!("outcome={o}"),
            )
        };
        let (allowed, by_policy) = (decisions("allowed"), decisions("policy"));
        let decided_by_policy = stats.fail_open + stats.fail_closed + stats.gate_error;
        match *name {
            "fallback" => assert_eq!(allowed + by_policy, stats.admitted, "{name}: {stats:?}"),
            _ => assert_eq!(
                (allowed, by_policy),
                (stats.admitted, decided_by_policy),
                "{name}: {stats:?}"
            ),
        }
        // Their calls to Redis went on without them, and timed out: failed calls.
        let failures = api.counter("flowgate_gate_failures_total", name, "");
        assert!(
            failures >= gave_up as u64,
            "{name}: {failures} failed calls"
        );
    }
}
