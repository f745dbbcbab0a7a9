//! The gate under the Redis failures of issue 14, against real `redis-server` processes:
//! Redis refusing writes (OOM, a read-only replica, unmet `min-replicas-to-write`) under
//! every failure policy and on every path, corrupt values on one key, `check_all`'s
//! merging, limits, prefix and fallback, a full lease map, and a gate whose runtime shut
//! down.

use std::future::Future;
use std::time::{Duration, Instant};

use flowgate::gate::{FailurePolicy, GateError, Limit, MemoryGate, RedisGate};
use flowgate::{Decision, Quota, Rate};
use futures::future::join_all;
use redis::aio::{ConnectionManager, MultiplexedConnection};

use super::support::RedisServer;

/// How often a degraded gate tries Redis again.
const PROBE: Duration = Duration::from_millis(50);
/// The burst of the Redis gates' own limit.
const BURST: u32 = 100;
/// The burst of the fallback gate, and of the quotas given to `check_all`.
const SMALL: u32 = 3;

fn per_hour(n: u32) -> Quota {
    Quota::per_hour(n).unwrap()
}

/// `fut`, or a panic naming `what` once `secs` seconds have passed.
async fn bounded<T>(secs: u64, what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), fut)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {secs} s"))
}

fn query(server: &RedisServer, args: &[&str]) {
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    let _: redis::Value = server
        .query_blocking(&cmd)
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
}

// ----- Redis refusing writes -----

/// One way a server refuses writes, and how to make it accept them again.
enum Refusal {
    /// `maxmemory 1` under `noeviction`: OOM.
    OutOfMemory,
    /// A replica of `master`: READONLY.
    Replica { master: RedisServer },
    /// `min-replicas-to-write 1` with no replica: NOREPLICAS.
    NoReplicas,
}

impl Refusal {
    fn apply(&self, server: &RedisServer) {
        match self {
            Refusal::OutOfMemory => {
                query(server, &["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
                query(server, &["CONFIG", "SET", "maxmemory", "1"]);
            }
            Refusal::Replica { master } => {
                let port = master.port().to_string();
                query(server, &["REPLICAOF", "127.0.0.1", &port]);
            }
            Refusal::NoReplicas => query(server, &["CONFIG", "SET", "min-replicas-to-write", "1"]),
        }
    }

    fn lift(&self, server: &RedisServer) {
        match self {
            Refusal::OutOfMemory => query(server, &["CONFIG", "SET", "maxmemory", "0"]),
            Refusal::Replica { .. } => query(server, &["REPLICAOF", "NO", "ONE"]),
            Refusal::NoReplicas => query(server, &["CONFIG", "SET", "min-replicas-to-write", "0"]),
        }
    }
}

/// The four ways into Redis, each on a gate of its own so that each is the first to meet
/// the failure (its own classification is tested, not the degraded state another path
/// left behind).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Path {
    /// `check`, one script call per decision (`batch_size(1)`).
    Check,
    /// Concurrent `check`s sharing script calls (default batch size).
    Batched,
    /// `check` with leases of 5.
    Lease,
    /// `check_all` over two keys.
    All,
}

const PATHS: [Path; 4] = [Path::Check, Path::Batched, Path::Lease, Path::All];

#[derive(Debug, Clone, Copy, PartialEq)]
enum Policy {
    Error,
    Open,
    Closed,
    Fallback,
}

const POLICIES: [Policy; 4] = [
    Policy::Error,
    Policy::Open,
    Policy::Closed,
    Policy::Fallback,
];

impl Policy {
    fn make(self) -> FailurePolicy {
        match self {
            Policy::Error => FailurePolicy::Error,
            Policy::Open => FailurePolicy::Open,
            Policy::Closed => FailurePolicy::Closed,
            Policy::Fallback => {
                FailurePolicy::Fallback(MemoryGate::new(Limit::TokenBucket(per_hour(SMALL))))
            }
        }
    }
}

async fn path_gate(
    conn: &ConnectionManager,
    policy: Policy,
    path: Path,
) -> RedisGate<ConnectionManager> {
    let builder = RedisGate::builder(conn.clone(), Limit::TokenBucket(per_hour(BURST)))
        .prefix(format!("{policy:?}:{path:?}:"))
        .failure_policy(policy.make())
        .probe_interval(PROBE)
        // Generous: a slow CI machine must not turn a refusal into a timeout.
        .timeout(Duration::from_secs(1));
    let builder = match path {
        Path::Check | Path::All => builder.batch_size(1),
        Path::Batched => builder,
        Path::Lease => builder.lease(5),
    };
    builder.build().await.unwrap()
}

/// One outcome of a call on a path: for `check`, one decision; for `check_all`, one per
/// limit.
type Outcome = Result<Vec<Decision>, GateError>;

/// `n` calls for `key` on `path`: concurrent ones on the batched path, one after another
/// on the others.
async fn calls(
    gate: &RedisGate<ConnectionManager>,
    path: Path,
    key: &str,
    n: usize,
) -> Vec<Outcome> {
    let one = || async move { gate.check(key, 1).await.map(|d| vec![d]) };
    bounded(5, "calls", async {
        match path {
            Path::Batched => join_all((0..n).map(|_| one())).await,
            Path::Check | Path::Lease => {
                let mut out = Vec::with_capacity(n);
                for _ in 0..n {
                    out.push(one().await);
                }
                out
            }
            Path::All => {
                let (a, b) = (format!("{key}:a"), format!("{key}:b"));
                let limits = [(a.as_str(), per_hour(SMALL)), (b.as_str(), per_hour(SMALL))];
                let mut out = Vec::with_capacity(n);
                for _ in 0..n {
                    out.push(gate.check_all(&limits, 1).await);
                }
                out
            }
        }
    })
    .await
}

/// While Redis refuses writes, each call on `path` is decided by `policy`.
fn assert_policy_decides(policy: Policy, path: Path, outcomes: &[Outcome]) {
    let at = format!("{policy:?} on {path:?}");
    let mut admitted = 0;
    for outcome in outcomes {
        let decisions = match (policy, outcome) {
            (Policy::Error, Err(GateError::Backend(_) | GateError::Degraded { .. })) => continue,
            (_, Ok(ds)) if policy != Policy::Error => ds,
            (_, other) => panic!("{at}: {other:?}"),
        };
        let allowed = decisions[0].allowed;
        assert!(
            decisions.iter().all(|d| d.allowed == allowed),
            "{at}: not all or nothing: {decisions:?}"
        );
        admitted += usize::from(allowed);
        for d in decisions {
            match policy {
                Policy::Open => assert!(d.is_fail_open(), "{at}: {d:?}"),
                Policy::Closed => assert!(
                    d.is_fail_closed() && d.retry_after > Duration::ZERO && d.retry_after <= PROBE,
                    "{at}: retry_after is not the time until the next probe: {d:?}"
                ),
                // The memory gate's burst (its own limit, or the quota given to check_all).
                _ => assert_eq!(d.capacity, u64::from(SMALL), "{at}: {d:?}"),
            }
        }
    }
    if policy == Policy::Fallback {
        assert_eq!(admitted, SMALL as usize, "{at}: the memory gate's burst");
    }
}

/// Once Redis accepts writes again, `gate` returns to Redis by itself within a few probe
/// intervals: it stops being degraded after a probe, and then calls on `path` are decided
/// by Redis (healthy before and after them, so every one reached Redis and none failed).
async fn assert_recovers(gate: &RedisGate<ConnectionManager>, policy: Policy, path: Path) {
    let at = format!("{policy:?} on {path:?}");
    let started = Instant::now();
    for attempt in 0.. {
        assert!(
            started.elapsed() < 10 * PROBE,
            "{at}: not back on Redis after {:?}",
            started.elapsed()
        );
        let key = format!("{policy:?}:up{attempt}");
        if gate.is_degraded() {
            // Calls while degraded are the probes.
            let _ = calls(gate, path, &key, 1).await;
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        let n = if path == Path::Batched { 32 } else { 2 };
        let outcomes = calls(gate, path, &key, n).await;
        assert!(!gate.is_degraded(), "{at}: failed again: {outcomes:?}");
        for outcome in outcomes {
            let ds = outcome.unwrap_or_else(|e| panic!("{at}: {e}"));
            assert!(
                ds.iter().all(|d| d.allowed && d.capacity < u64::MAX),
                "{at}: {ds:?}"
            );
        }
        return;
    }
}

/// Under `refusal`, every policy applies on every path, and every gate recovers by itself
/// when the refusal is lifted.
///
/// Each gate has a prefix of its own, and its keys name its policy as well, so no two gates
/// share a bucket even on a path that would ignore the prefix.
async fn refusing_writes(refusal: Refusal) {
    let server = RedisServer::start();
    let conn = super::manager(&server).await;
    let mut gates = Vec::new();
    for policy in POLICIES {
        for path in PATHS {
            let gate = path_gate(&conn, policy, path).await;
            // Healthy, and on Redis, before.
            let before = calls(&gate, path, &format!("{policy:?}:before"), 1).await;
            assert!(
                before[0].as_ref().is_ok_and(|ds| ds[0].allowed),
                "{before:?}"
            );
            gates.push((policy, path, gate));
        }
    }
    refusal.apply(&server);
    for (policy, path, gate) in &gates {
        let n = if *path == Path::Batched { 32 } else { 5 };
        let outcomes = calls(gate, *path, &format!("{policy:?}:down"), n).await;
        assert_policy_decides(*policy, *path, &outcomes);
        assert!(gate.is_degraded(), "{policy:?} on {path:?}: not degraded");
    }
    refusal.lift(&server);
    for (policy, path, gate) in &gates {
        assert_recovers(gate, *policy, *path).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_out_of_memory_is_a_redis_failure_on_every_path_and_the_gate_recovers() {
    refusing_writes(Refusal::OutOfMemory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_replica_is_a_redis_failure_on_every_path_and_the_gate_recovers() {
    // The replica syncs at once (the default waits 5 s for more replicas).
    let master = RedisServer::start_with_args(&["--repl-diskless-sync-delay", "0"]);
    refusing_writes(Refusal::Replica { master }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unmet_min_replicas_is_a_redis_failure_on_every_path_and_the_gate_recovers() {
    refusing_writes(Refusal::NoReplicas).await;
}

// ----- corrupt values on one key -----

/// A packed token bucket state: a zero byte, then tat_us, frac, exp_us as little-endian
/// doubles (`lua/bucket_state.lua`).
fn packed(tat_us: f64, frac: f64, exp_us: f64) -> Vec<u8> {
    let mut v = vec![0u8];
    for x in [tat_us, frac, exp_us] {
        v.extend_from_slice(&x.to_le_bytes());
    }
    v
}

/// Values no token bucket script can read, by the key that holds them.
fn corrupt_values() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("garbage", b"garbage".to_vec()),
        ("twelve", b"12".to_vec()),
        ("short", b"\0abc".to_vec()),
        ("nan", packed(f64::NAN, 0.0, 0.0)),
        ("inf", packed(f64::INFINITY, 0.0, 0.0)),
        ("neginf", packed(f64::NEG_INFINITY, 0.0, 0.0)),
        ("far", packed(1e18, 0.0, 0.0)),
        ("nan-frac", packed(0.0, f64::NAN, 0.0)),
        ("inf-expiry", packed(0.0, 0.0, f64::INFINITY)),
    ]
}

/// A gate of a token bucket of `quota` over `prefix` and `path`, leasing 3 on the lease
/// path.
async fn bucket_on_path(
    conn: &MultiplexedConnection,
    quota: Quota,
    prefix: &str,
    path: Path,
) -> RedisGate<MultiplexedConnection> {
    let builder = RedisGate::builder(conn.clone(), Limit::TokenBucket(quota))
        .prefix(format!("{prefix}:{path:?}:"))
        .timeout(Duration::from_secs(2));
    match path {
        Path::Check | Path::All => builder.batch_size(1),
        Path::Batched => builder,
        Path::Lease => builder.lease(3).lease_ttl(Duration::from_secs(60)),
    }
    .build()
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_value_fails_only_its_key_on_every_path() {
    const GOOD_BURST: u32 = 5;
    const GOOD: usize = 7;
    const ROUNDS: usize = 5;
    let server = RedisServer::start();
    let conn = server.connect().await;
    let bad = corrupt_values();
    // 9 bad + 7 good keys, two callers each: 32 concurrent calls per round.
    let keys: Vec<String> = bad
        .iter()
        .map(|(k, _)| k.to_string())
        .chain((0..GOOD).map(|i| format!("good{i}")))
        .collect();
    let tenant = per_hour(1_000);
    for path in PATHS {
        let gate = bucket_on_path(&conn, per_hour(GOOD_BURST), "corrupt", path).await;
        for (key, value) in &bad {
            let set = redis::cmd("SET")
                .arg(gate.redis_key(key))
                .arg(value)
                .clone();
            let _: () = server.query_blocking(&set).unwrap();
        }
        let one = |key: &str| {
            let gate = gate.clone();
            let key = key.to_string();
            async move {
                match path {
                    // The bad keys' calls must charge nothing on the shared tenant layer.
                    Path::All => gate
                        .check_all(&[(&key, per_hour(GOOD_BURST)), ("tenant", tenant)], 1)
                        .await
                        .map(|ds| ds[0]),
                    _ => gate.check(&key, 1).await,
                }
            }
        };
        let mut admitted = vec![0u32; keys.len()];
        for round in 0..ROUNDS {
            let at = format!("{path:?}, round {round}");
            let batch = keys.iter().chain(&keys).map(|k| one(k));
            let outcomes = bounded(10, &at, join_all(batch)).await;
            for (i, outcome) in outcomes.iter().enumerate() {
                let k = i % keys.len();
                match (k < bad.len(), outcome) {
                    (true, Err(GateError::UnreadableKey(_))) => {}
                    (false, Ok(d)) => admitted[k] += u32::from(d.allowed),
                    (_, other) => panic!("{at}: {}: {other:?}", keys[k]),
                }
            }
            assert!(
                !gate.is_degraded(),
                "{at}: one corrupt key degraded the gate"
            );
        }
        assert_eq!(
            admitted[bad.len()..],
            [GOOD_BURST; GOOD],
            "{path:?}: every good key admitted exactly its burst"
        );
        if path == Path::All {
            let d = gate.check_all(&[("tenant", tenant)], 1).await.unwrap();
            let charged = 1 + GOOD as u64 * u64::from(GOOD_BURST);
            assert_eq!(
                d[0].remaining,
                1_000 - charged,
                "only the good calls charged"
            );
        }
    }
}

/// The windows' and the log's values out of the range any write puts in them (a negative or
/// infinite count, an index, start or time past 2^53, a count or cost past it) fail their
/// own key with `UnreadableKey`, as the docs' table says, and the gate stays healthy. They
/// were decided on garbage: a fixed window counting -5 admitted past its limit (15 in a
/// window of 10), one with an index ahead of every window kept counting in a key without a
/// TTL, a sliding window starting past 2^53 set its key a TTL of three million years,
/// and a huge log entry answered a `remaining` Redis sent as `i64::MIN`.
#[tokio::test]
async fn an_out_of_range_window_or_log_fails_only_its_key() {
    let server = RedisServer::start();
    let time: (u64, u64) = server.query_blocking(&redis::cmd("TIME")).unwrap();
    let now_us = time.0 * 1_000_000 + time.1;
    let hour_us = 3_600_000_000;
    let index = (now_us / hour_us).to_string();
    let start = (now_us / hour_us * hour_us).to_string();
    let huge = "99999999999999999999";
    let rate = Rate::per_hour(10).unwrap();
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    // (key, command, its arguments after the key)
    let cases = [
        (
            Limit::FixedWindow(rate),
            vec![
                ("negative", "HSET", s(&["w", &index, "n", "-5"])),
                ("infinite", "HSET", s(&["w", &index, "n", "1e400"])),
                ("fraction", "HSET", s(&["w", &index, "n", "0.5"])),
                ("far", "HSET", s(&["w", huge, "n", "1"])),
            ],
        ),
        (
            Limit::SlidingWindow(rate),
            vec![
                ("far", "SET", vec![format!("{huge} 0 0")]),
                ("count", "SET", vec![format!("{start} {huge} 0")]),
                ("previous", "SET", vec![format!("{start} 0 {huge}")]),
            ],
        ),
        (
            Limit::SlidingLog(rate),
            vec![
                ("far", "ZADD", s(&["1e300", "5:0:1"])),
                (
                    "fraction",
                    "ZADD",
                    vec![format!("{now_us}.5"), format!("{now_us}:0:1")],
                ),
                (
                    "cost",
                    "ZADD",
                    vec![now_us.to_string(), format!("{now_us}:0:{huge}")],
                ),
            ],
        ),
    ];
    for (limit, bad) in cases {
        let gate = RedisGate::builder(server.connect().await, limit)
            .prefix(format!("range:{}:", limit.name()))
            .timeout(Duration::from_secs(2))
            .build()
            .await
            .unwrap();
        for (key, command, args) in &bad {
            let mut cmd = redis::cmd(command);
            cmd.arg(gate.redis_key(key)).arg(args);
            let _: redis::Value = server.query_blocking(&cmd).unwrap();
            let at = format!("{}: {key}", limit.name());
            for _ in 0..3 {
                match gate.check(key, 1).await {
                    Err(GateError::UnreadableKey(_)) => {}
                    other => panic!("{at}: {other:?}"),
                }
            }
            assert!(!gate.is_degraded(), "{at}");
        }
        let d = gate.check("good", 1).await.unwrap();
        assert!(d.allowed && d.remaining == 9, "{}: {d:?}", limit.name());
    }
}

/// A bucket written before the Redis server's clock stepped back further than the
/// bucket's exact range (2^52 units of 1/count µs: 45 s at 100 million a second, a byte
/// rate of 100 MB/s) is decided, on every path: rejected until the clock is back where it
/// was, at the latest, never `UnreadableKey`. Read as a TAT "further ahead than any write
/// could have put it", it was called corrupt, and every request on the key failed until
/// its TTL (as far ahead as the TAT) ran out.
#[tokio::test]
async fn a_bucket_written_before_a_long_clock_step_back_is_decided_not_unreadable() {
    const RATE: u32 = 100_000_000;
    let server = RedisServer::start();
    let conn = server.connect().await;
    let quota = Quota::per_second(RATE).unwrap();
    for path in PATHS {
        let builder = RedisGate::builder(conn.clone(), Limit::TokenBucket(quota))
            .prefix(format!("stepped:{path:?}:"))
            .timeout(Duration::from_secs(2));
        let gate = match path {
            Path::Check | Path::All => builder.batch_size(1),
            Path::Batched => builder,
            Path::Lease => builder.lease(5).lease_ttl(Duration::from_secs(60)),
        }
        .build()
        .await
        .unwrap();
        // The whole burst taken at a clock 60 s ahead of the server's now, as that write
        // leaves the bucket (lua/bucket_state.lua): TAT one second later, expiry record
        // 2 s after the write, the TTL running 62 s on the stepped-back clock.
        let time: (u64, u64) = server.query_blocking(&redis::cmd("TIME")).unwrap();
        let written_at = (time.0 * 1_000_000 + time.1) as f64 + 60e6;
        let state = packed(written_at + 1e6, 0.0, written_at + 2e6);
        let set = redis::cmd("SET")
            .arg(gate.redis_key("k"))
            .arg(state)
            .arg("PX")
            .arg(62_000)
            .clone();
        let _: () = server.query_blocking(&set).unwrap();
        let decided = match path {
            Path::All => gate.check_all(&[("k", quota)], 1).await.map(|ds| ds[0]),
            _ => gate.check("k", 1).await,
        };
        let d = decided.unwrap_or_else(|e| panic!("{path:?}: {e}"));
        assert!(!d.allowed, "{path:?}: {d:?}");
        assert!(
            d.retry_after >= Duration::from_secs(40) && d.retry_after <= Duration::from_secs(61),
            "{path:?}: retry after {:?}",
            d.retry_after
        );
        assert!(!gate.is_degraded(), "{path:?}");
    }
}

/// A token bucket state holding a fraction (a TAT, a sub-microsecond part or an expiry
/// record that is not a whole number, which no write puts there) fails its key with
/// `UnreadableKey` on every path, as the docs' table says. It was decided as if it were a
/// state: admitted, the fraction carried into the next write and the reply.
#[tokio::test]
async fn a_token_bucket_state_holding_a_fraction_fails_only_its_key() {
    let server = RedisServer::start();
    let conn = server.connect().await;
    let quota = per_hour(5);
    let time: (u64, u64) = server.query_blocking(&redis::cmd("TIME")).unwrap();
    let now_us = (time.0 * 1_000_000 + time.1) as f64;
    let values = [
        ("tat", packed(now_us + 0.5, 0.0, 0.0)),
        ("tat-past", packed(1_000.5, 0.0, 0.0)),
        ("frac", packed(now_us, 0.5, 0.0)),
        ("expiry", packed(now_us, 0.0, now_us + 0.5)),
    ];
    for path in PATHS {
        let gate = bucket_on_path(&conn, quota, "fraction", path).await;
        for (key, value) in &values {
            let set = redis::cmd("SET")
                .arg(gate.redis_key(key))
                .arg(value)
                .arg("PX")
                .arg(60_000)
                .clone();
            let _: () = server.query_blocking(&set).unwrap();
            let decided = match path {
                Path::All => gate.check_all(&[(key, quota)], 1).await.map(|ds| ds[0]),
                _ => gate.check(key, 1).await,
            };
            assert!(
                matches!(decided, Err(GateError::UnreadableKey(_))),
                "{path:?}, {key}: {decided:?}"
            );
        }
        assert!(!gate.is_degraded(), "{path:?}");
    }
}

/// A sliding log whose newest entry lies ahead of the Redis clock (written before the clock
/// stepped back) decides at that entry's time, as the model does: an entry admitted then
/// counts until a window after it, and the key must last that long. Its TTL was set to one
/// window from the clock's now, so the key went (with every entry in it) as many seconds
/// early as the clock had stepped back, and the log admitted its whole limit again.
#[tokio::test]
async fn a_sliding_log_admitting_after_a_clock_step_back_lasts_as_long_as_its_entries() {
    let server = RedisServer::start();
    let gate = RedisGate::builder(
        server.connect().await,
        Limit::SlidingLog(Rate::per_minute(10).unwrap()),
    )
    .prefix("stepped-log:")
    .timeout(Duration::from_secs(2))
    .build()
    .await
    .unwrap();
    // An entry the log took 30 s ahead of the server's clock now.
    let time: (u64, u64) = server.query_blocking(&redis::cmd("TIME")).unwrap();
    let ahead = time.0 * 1_000_000 + time.1 + 30_000_000;
    let mut add = redis::cmd("ZADD");
    add.arg(gate.redis_key("k"))
        .arg(ahead)
        .arg(format!("{ahead}:0:1"));
    let _: i64 = server.query_blocking(&add).unwrap();
    let d = gate.check("k", 1).await.unwrap();
    assert!(d.allowed && d.remaining == 8, "{d:?}");
    let pttl: i64 = server
        .query_blocking(redis::cmd("PTTL").arg(gate.redis_key("k")))
        .unwrap();
    // Read a moment after the call: a little less than the key got.
    let lives = Duration::from_millis(u64::try_from(pttl).unwrap_or(0) + 1_000);
    assert!(
        lives >= d.reset_after,
        "the key expires in {pttl} ms, its entries count for {:?}",
        d.reset_after
    );
}

/// A fixed window counted ahead of the Redis clock (before the clock stepped back, or by a
/// gate of a longer window over the same prefix) rejects until its key expires, and says
/// so in `retry_after`. In the key's last millisecond (`PTTL` 0) that was zero: a client
/// told to retry after nothing asked again at once, and was rejected again, for as long
/// as that millisecond lasted.
#[tokio::test]
async fn a_fixed_window_counted_ahead_of_the_clock_never_rejects_with_a_zero_wait() {
    const LIMIT: u64 = 2;
    const HOUR_US: u64 = 3_600_000_000;
    let server = RedisServer::start();
    let mut con = server.connect().await;
    let gate = RedisGate::builder(
        con.clone(),
        Limit::FixedWindow(Rate::per_hour(LIMIT as u32).unwrap()),
    )
    .prefix("stepped-window:")
    // Every call to Redis, one request each.
    .batch_size(1)
    .reject_cache(0)
    .timeout(Duration::from_secs(2))
    .build()
    .await
    .unwrap();
    let mut waits = Vec::new();
    for attempt in 0..20 {
        let key = format!("k{attempt}");
        let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut con).await.unwrap();
        // The whole count, in the window after the clock's, for 2 ms more.
        let ahead = (secs * 1_000_000 + micros) / HOUR_US + 1;
        let redis_key = gate.redis_key(&key);
        let _: () = redis::pipe()
            .hset_multiple(&redis_key, &[("w", ahead), ("n", LIMIT)])
            .ignore()
            .pexpire(&redis_key, 2)
            .ignore()
            .query_async(&mut con)
            .await
            .unwrap();
        // Asked again and again until the key is gone.
        for _ in 0..10_000 {
            let d = gate.check(&key, 1).await.unwrap();
            if d.allowed {
                break;
            }
            waits.push(d.retry_after);
        }
    }
    assert!(!waits.is_empty(), "nothing was rejected");
    assert!(
        waits
            .iter()
            .all(|w| !w.is_zero() && *w <= Duration::from_millis(3)),
        "every rejection waits until the key is gone, 3 ms at most: {waits:?}"
    );
}

// ----- check_all -----

/// A gate with the default settings but `prefix`, on a new connection to `server`.
async fn default_gate(server: &RedisServer, prefix: &str) -> RedisGate<MultiplexedConnection> {
    RedisGate::builder(server.connect().await, super::quota(100))
        .prefix(prefix)
        .build()
        .await
        .unwrap()
}

#[tokio::test]
async fn check_all_charges_a_key_listed_twice_for_each_listing() {
    let server = RedisServer::start();
    let gate = default_gate(&server, "flowgate:").await;
    let one = per_hour(1);
    assert!(matches!(
        gate.check_all(&[("k1", one), ("k1", one)], 1).await,
        Err(GateError::Cost(flowgate::CostError::ExceedsCapacity {
            cost: 2,
            capacity: 1
        }))
    ));
    // Nothing was charged.
    assert!(gate.check_all(&[("k1", one)], 1).await.unwrap()[0].allowed);

    let two = per_hour(2);
    let both = gate
        .check_all(&[("k2", two), ("k2", two)], 1)
        .await
        .unwrap();
    assert_eq!(both.len(), 2);
    assert!(
        both.iter().all(|d| d.allowed && d.remaining == 0),
        "{both:?}"
    );
    let after = gate.check_all(&[("k2", two)], 1).await.unwrap();
    assert!(
        !after[0].allowed,
        "charged twice: the bucket is empty: {after:?}"
    );
}

#[tokio::test]
async fn check_all_refuses_conflicting_quotas_and_too_many_limits() {
    let server = RedisServer::start();
    let gate = default_gate(&server, "flowgate:").await;
    match gate
        .check_all(&[("k", per_hour(1)), ("k", per_hour(2))], 1)
        .await
    {
        Err(GateError::ConflictingQuotas { key }) => assert_eq!(key, "k"),
        other => panic!("{other:?}"),
    }
    let names: Vec<String> = (0..33).map(|i| format!("k{i}")).collect();
    let limits: Vec<(&str, Quota)> = names.iter().map(|k| (k.as_str(), per_hour(5))).collect();
    assert!(matches!(
        gate.check_all(&limits, 1).await,
        Err(GateError::TooManyLimits { given: 33, max: 32 })
    ));
    let all = gate.check_all(&limits[..32], 1).await.unwrap();
    assert!(
        all.len() == 32 && all.iter().all(|d| d.allowed),
        "32 is allowed"
    );
}

#[tokio::test]
async fn check_all_keys_get_the_gate_prefix() {
    let server = RedisServer::start();
    let gate = default_gate(&server, "pfx:").await;
    assert!(gate.check_all(&[("k", per_hour(5))], 1).await.unwrap()[0].allowed);
    let exists = |key: &str| -> bool {
        server
            .query_blocking(redis::cmd("EXISTS").arg(key))
            .unwrap()
    };
    assert!(exists("pfx:k"), "stored under the prefix");
    assert!(!exists("k"), "not without it");
}

/// On a gate whose own limit is not a token bucket, `check` and `check_all` on one key
/// meet in one Redis key (a `MemoryGate` keeps them apart, so this works in development):
/// the second is refused with `UnreadableKey`, whose hint sent the user looking for another
/// gate sharing the prefix, where there is none: it is this gate's `check_all`.
#[tokio::test]
async fn a_key_shared_by_check_and_check_all_of_one_gate_is_named_in_the_error() {
    let server = RedisServer::start();
    let limit = Limit::FixedWindow(flowgate::Rate::per_hour(5).unwrap());
    let gate = RedisGate::builder(server.connect().await, limit)
        .build()
        .await
        .unwrap();
    assert!(gate.check("user:7", 1).await.unwrap().allowed);
    let memory = MemoryGate::new(limit);
    assert!(memory.check("user:7", 1).unwrap().allowed);
    assert!(memory.check_all(&[("user:7", per_hour(5))], 1).unwrap()[0].allowed);
    match gate.check_all(&[("user:7", per_hour(5))], 1).await {
        Err(e @ GateError::UnreadableKey(_)) => {
            let hint = e.to_string();
            assert!(hint.contains("check_all"), "{hint}");
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn check_all_under_fallback_decides_all_or_nothing_in_memory() {
    let server = RedisServer::start();
    let fallback = MemoryGate::new(super::quota(100));
    let gate = RedisGate::builder(super::manager(&server).await, super::quota(100))
        .failure_policy(FailurePolicy::Fallback(fallback))
        .build()
        .await
        .unwrap();
    server.kill();
    let (ip, user) = (per_hour(5), per_hour(3));
    let layers = [("ip", ip), ("user", user)];
    for i in 0..3 {
        let ds = bounded(2, "check_all", gate.check_all(&layers, 1))
            .await
            .unwrap_or_else(|e| panic!("call {i}: {e}"));
        assert!(ds.iter().all(|d| d.allowed), "call {i}: {ds:?}");
        assert_eq!((ds[0].capacity, ds[1].capacity), (5, 3), "the quotas given");
    }
    assert!(gate.is_degraded());
    let ds = gate.check_all(&layers, 1).await.unwrap();
    assert!(
        ds.iter().all(|d| !d.allowed),
        "the user layer is empty: {ds:?}"
    );
    assert_eq!((ds[0].remaining, ds[1].remaining), (2, 0));
    // The rejection charged no layer: the IP layer still has 2.
    let ip_only = gate.check_all(&[("ip", ip)], 2).await.unwrap();
    assert!(
        ip_only[0].allowed && ip_only[0].remaining == 0,
        "{ip_only:?}"
    );
}

// ----- leases -----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_lease_map_admits_what_check_admits() {
    const KEYS: usize = 8;
    const KEY_BURST: u32 = 20;
    let server = RedisServer::start();
    let conn = server.connect().await;
    let limit = Limit::TokenBucket(per_hour(KEY_BURST));
    let leased = RedisGate::builder(conn.clone(), limit)
        .prefix("leased:")
        .lease(10)
        .lease_keys(2)
        .lease_ttl(Duration::from_secs(60))
        .build()
        .await
        .unwrap();
    let plain = RedisGate::builder(conn, limit)
        .prefix("plain:")
        .build()
        .await
        .unwrap();
    let keys: Vec<String> = (0..KEYS).map(|i| format!("k{i}")).collect();
    let mut admitted = [vec![0u32; KEYS], vec![0u32; KEYS]];
    // Round robin over the keys, twice the burst each: most keys find the map full.
    bounded(20, "rounds", async {
        for _ in 0..2 * KEY_BURST {
            for (i, key) in keys.iter().enumerate() {
                for (gate, count) in [&leased, &plain].into_iter().zip(&mut admitted) {
                    count[i] += u32::from(gate.check(key, 1).await.unwrap().allowed);
                }
            }
        }
    })
    .await;
    assert_eq!(admitted[1], vec![KEY_BURST; KEYS], "check admits the burst");
    assert_eq!(
        admitted[0], admitted[1],
        "leases under a full map admit what check admits"
    );
    assert!(leased.leased_keys() <= 2, "{}", leased.leased_keys());
}

#[tokio::test]
async fn a_lease_decision_reports_when_the_bucket_is_full_again() {
    let server = RedisServer::start();
    let gate = RedisGate::builder(server.connect().await, Limit::TokenBucket(per_hour(10)))
        .lease(5)
        .lease_ttl(Duration::from_secs(60))
        .build()
        .await
        .unwrap();
    // One token per 360 s: 5 debited in Redis are refilled 1800 s after the lease.
    let taken = gate.check("k", 1).await.unwrap();
    let spent = gate.check("k", 1).await.unwrap();
    assert!(taken.allowed && spent.allowed);
    assert_eq!(spent.remaining, 5 - 2, "the lease's remaining tokens");
    for d in [taken, spent] {
        assert!(
            d.reset_after > Duration::from_secs(1_790)
                && d.reset_after <= Duration::from_secs(1_800),
            "{d:?}"
        );
    }
}

#[tokio::test]
async fn the_last_token_of_a_lease_reports_when_the_bucket_is_full_again() {
    let server = RedisServer::start();
    let gate = RedisGate::builder(server.connect().await, Limit::TokenBucket(per_hour(10)))
        .lease(2)
        .lease_ttl(Duration::from_secs(60))
        .build()
        .await
        .unwrap();
    // One token per 360 s: 2 debited in Redis are refilled 720 s after the lease, whether
    // or not the last of them has been spent here.
    let taken = gate.check("k", 1).await.unwrap();
    let last = gate.check("k", 1).await.unwrap();
    assert!(taken.allowed && last.allowed);
    assert_eq!(last.remaining, 0, "the lease is used up");
    for d in [taken, last] {
        assert!(
            d.reset_after > Duration::from_secs(710) && d.reset_after <= Duration::from_secs(720),
            "{d:?}"
        );
    }
}

#[tokio::test]
async fn zero_lease_settings_are_config_errors() {
    let server = RedisServer::start();
    let conn = server.connect().await;
    let leased = || RedisGate::builder(conn.clone(), super::quota(10)).lease(5);
    let keys = leased().lease_keys(0).build().await.unwrap_err();
    assert_eq!(keys.field(), "gate.lease_keys");
    let ttl = leased()
        .lease_ttl(Duration::ZERO)
        .build()
        .await
        .unwrap_err();
    assert_eq!(ttl.field(), "gate.lease_ttl");
}

// ----- runtime loss -----

/// The test's runtime, which owns the connection (and drives it while the other builds),
/// and a gate built by `build` on another runtime that then shuts down (with it the gate's
/// batch driver).
fn gate_whose_runtime_shut_down(
    server: &RedisServer,
    build: impl FnOnce(
        redis::aio::MultiplexedConnection,
    ) -> flowgate::gate::RedisGateBuilder<redis::aio::MultiplexedConnection>,
) -> (
    tokio::runtime::Runtime,
    RedisGate<redis::aio::MultiplexedConnection>,
) {
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let conn = main.block_on(server.connect());
    let other = super::rt();
    let gate = other
        .block_on(build(conn).timeout(Duration::from_secs(2)).build())
        .unwrap();
    drop(other);
    (main, gate)
}

#[test]
fn a_gate_whose_runtime_shut_down_still_decides_every_call() {
    const KEYS: usize = 16;
    const KEY_BURST: u32 = 40;
    let server = RedisServer::start();
    let (main, gate) = gate_whose_runtime_shut_down(&server, |conn| {
        RedisGate::builder(conn, Limit::TokenBucket(per_hour(KEY_BURST)))
    });
    let keys: Vec<String> = (0..KEYS).map(|i| format!("k{i}")).collect();
    let calls = keys.iter().cycle().take(1_600).map(|k| gate.check(k, 1));
    let outcomes = main.block_on(bounded(20, "1600 calls", join_all(calls)));
    let mut admitted = vec![0u32; KEYS];
    for (i, outcome) in outcomes.iter().enumerate() {
        match outcome {
            Ok(d) => admitted[i % KEYS] += u32::from(d.allowed),
            Err(e) => panic!("call {i}: {e}"),
        }
    }
    assert_eq!(admitted, vec![KEY_BURST; KEYS], "exactly the burst per key");
    assert!(!gate.is_degraded());
}

/// A batch driver started again (its runtime shut down) is logged once, naming the gate,
/// as the gate's degraded and healthy transitions are: with several gates in a process, an
/// operator must tell which one lost its driver.
#[cfg(feature = "metrics")]
#[test]
fn a_restarted_batch_driver_is_logged_once_with_the_gates_name() {
    let (logs, _guard) = super::support::Logs::capture();
    let recorder = super::support::TestRecorder::default();
    let _metrics = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    // The callers run on this thread (`block_on`); the connection on the workers.
    let (main, gate) = gate_whose_runtime_shut_down(&server, |conn| {
        RedisGate::builder(conn, Limit::TokenBucket(per_hour(1_000))).name("orders")
    });
    // Concurrent calls: all but one go through the batch driver.
    for _ in 0..3 {
        let calls = (0..20).map(|_| gate.check("k", 1));
        let outcomes = main.block_on(bounded(20, "20 calls", join_all(calls)));
        assert!(outcomes.iter().all(|o| o.as_ref().is_ok_and(|d| d.allowed)));
    }
    assert_eq!(
        recorder.counter("flowgate_gate_driver_restarts_total{name=orders}"),
        1
    );
    // The warnings of the batch driver, each with its `gate` field.
    let warnings: Vec<_> = logs
        .events()
        .into_iter()
        .filter(|e| e.level == tracing::Level::WARN && e.target == "flowgate::gate::batch")
        .map(|e| e.field("gate").unwrap_or_default().to_owned())
        .collect();
    assert_eq!(warnings.len(), 1, "logged once: {warnings:?}");
    assert!(
        warnings[0].contains("orders"),
        "names the gate: {warnings:?}"
    );
}

/// A request refused with `UnreadableKey` (its key holds a value of another type, or one the
/// script cannot read) is counted under `outcome="unreadable_key"` on every path: it is
/// neither admitted nor rejected by its quota, and Redis did not fail, so no other count
/// shows that a key refuses every request made on it.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn a_request_refused_for_an_unreadable_key_is_counted_on_every_path() {
    let recorder = super::support::TestRecorder::default();
    // Current-thread runtime: the gates register their metrics with this thread's recorder.
    let _local = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    let conn = server.connect().await;
    for path in PATHS {
        let name = format!("unreadable-{path:?}");
        let builder = RedisGate::builder(conn.clone(), Limit::TokenBucket(per_hour(BURST)))
            .prefix(format!("unreadable:{path:?}:"))
            .name(name.clone())
            .timeout(Duration::from_secs(2));
        let gate = match path {
            Path::Check | Path::All => builder.batch_size(1),
            Path::Batched => builder,
            Path::Lease => builder.lease(3).lease_ttl(Duration::from_secs(60)),
        }
        .build()
        .await
        .unwrap();
        // One key of another type (WRONGTYPE), one holding garbage.
        let hash = redis::cmd("HSET")
            .arg(gate.redis_key("hash"))
            .arg("f")
            .arg("v")
            .clone();
        let _: () = server.query_blocking(&hash).unwrap();
        let garbage = redis::cmd("SET")
            .arg(gate.redis_key("garbage"))
            .arg("garbage")
            .clone();
        let _: () = server.query_blocking(&garbage).unwrap();
        let one = |key: &'static str| {
            let gate = gate.clone();
            async move {
                match path {
                    Path::All => gate
                        .check_all(&[(key, per_hour(BURST))], 1)
                        .await
                        .map(|ds| ds[0]),
                    _ => gate.check(key, 1).await,
                }
            }
        };
        let calls = ["hash", "garbage", "good"].into_iter().cycle().take(12);
        let outcomes = bounded(10, &name, join_all(calls.map(one))).await;
        let unreadable = outcomes
            .iter()
            .filter(|o| matches!(o, Err(GateError::UnreadableKey(_))))
            .count() as u64;
        assert_eq!(unreadable, 8, "{path:?}: {outcomes:?}");
        let count = |outcome: &str| {
            recorder.counter(&format!(
                "flowgate_gate_decisions_total{{name={name},outcome={outcome}}}"
            ))
        };
        assert_eq!(count("unreadable_key"), unreadable, "{path:?}");
        assert_eq!(count("allowed"), 4, "{path:?}: the good key's calls");
    }
}

// ----- probes -----

/// A probe taken by a caller that gives up before its request is sent (queued for a
/// batch behind a call in flight) is given back: the next caller probes Redis. It was spent
/// with nothing sent, and every caller was refused (`Degraded`) for one more probe interval.
#[tokio::test]
async fn a_probe_given_up_before_it_was_sent_is_taken_by_the_next_caller() {
    use futures::FutureExt;

    const TIMEOUT: Duration = Duration::from_millis(1_500);
    const EVERY: Duration = Duration::from_millis(300);
    let server = RedisServer::start();
    let gate = RedisGate::builder(
        server.connect_untimed().await,
        Limit::TokenBucket(per_hour(BURST)),
    )
    .timeout(TIMEOUT)
    .probe_interval(EVERY)
    .build()
    .await
    .unwrap();
    server.pause();
    // Redis does not answer: the gate degrades.
    let first = gate.check("k", 1).await;
    assert!(matches!(first, Err(GateError::Timeout(_))), "{first:?}");
    assert!(gate.is_degraded());
    // The next probe: a call of its own, unanswered for a whole timeout.
    tokio::time::sleep(EVERY + Duration::from_millis(50)).await;
    let probe = tokio::spawn({
        let gate = gate.clone();
        async move { gate.check("k", 1).await }
    });
    tokio::time::sleep(EVERY + Duration::from_millis(50)).await;
    assert!(!probe.is_finished());
    // The probe after it, queued for a batch behind that call, given up at once.
    assert!(gate.check("k", 1).now_or_never().is_none());
    // The batch driver finds its caller gone.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let next = gate.check("k", 1).await;
    assert!(
        !matches!(next, Err(GateError::Degraded { .. })),
        "the probe given up was lost: {next:?}"
    );
    assert!(matches!(probe.await.unwrap(), Err(GateError::Timeout(_))));
}
