//! The gate under what operators do to a running Redis: connections the server closes
//! (an idle `timeout`, `CLIENT KILL`), `SCRIPT FLUSH`, ACLs that deny, a busy script; and
//! the sliding log's own script kept short.

use std::time::Duration;

use flowgate::gate::{FailurePolicy, Limit, RedisGate};
use flowgate::{Quota, Rate};
use redis::aio::ConnectionManager;

use super::support::RedisServer;

fn run(server: &RedisServer, args: &[&str]) {
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    let _: redis::Value = server
        .query_blocking(&cmd)
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
}

/// A gate failing closed, over a `ConnectionManager` with the library's defaults, that
/// would stay degraded for a minute after a failure. Its timeout leaves a loaded machine
/// room to reconnect within one call.
async fn closed_gate(server: &RedisServer) -> RedisGate<ConnectionManager> {
    let conn = ConnectionManager::new(server.client()).await.unwrap();
    RedisGate::builder(conn, Limit::TokenBucket(Quota::per_hour(100).unwrap()))
        .failure_policy(FailurePolicy::Closed)
        .timeout(Duration::from_secs(1))
        .probe_interval(Duration::from_secs(60))
        .build()
        .await
        .unwrap()
}

/// Once the server has closed the gate's connection, the call that finds it closed is
/// decided by the policy, but the next ones go to Redis over the new connection the
/// `ConnectionManager` makes at once: they are not refused for a probe interval (a minute
/// here, 1 s by default) while Redis answers.
async fn assert_back_at_once(gate: &RedisGate<ConnectionManager>, what: &str) {
    let _ = gate.check("k", 1).await.unwrap();
    let mut decided = Vec::new();
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let d = gate.check("k", 1).await.unwrap();
        decided.push((d.allowed, gate.is_degraded()));
        if d.allowed && !gate.is_degraded() {
            return;
        }
    }
    panic!("{what}: still refused after the connection was replaced: {decided:?}");
}

#[tokio::test]
async fn a_connection_closed_by_an_idle_timeout_does_not_degrade_the_gate_for_a_probe_interval() {
    let server = RedisServer::start();
    let gate = closed_gate(&server).await;
    assert!(gate.check("k", 1).await.unwrap().allowed);
    run(&server, &["CONFIG", "SET", "timeout", "1"]);
    // Redis closes idle connections once a second, after at least `timeout` of idleness.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    run(&server, &["CONFIG", "SET", "timeout", "0"]);
    assert_back_at_once(&gate, "idle timeout").await;
}

#[tokio::test]
async fn a_killed_client_connection_does_not_degrade_the_gate_for_a_probe_interval() {
    let server = RedisServer::start();
    let gate = closed_gate(&server).await;
    assert!(gate.check("k", 1).await.unwrap().allowed);
    run(&server, &["CLIENT", "KILL", "TYPE", "normal"]);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_back_at_once(&gate, "CLIENT KILL").await;
}

/// A batch of requests on one sliding-log key reads the key's log once, not once per
/// request: 128 concurrent callers on a key holding 3 000 live entries are decided by
/// Redis within the gate's timeout. Read once per request, the batch kept Redis's
/// one thread busy for over a second (20 s at 30 000 entries: every other client of the
/// server was answered `BUSY`), and the healthy Redis read as failing.
#[tokio::test]
async fn a_batch_on_one_sliding_log_key_reads_its_log_once() {
    let server = RedisServer::start();
    let conn = server.connect().await;
    let gate = RedisGate::builder(
        conn.clone(),
        Limit::SlidingLog(flowgate::Rate::per_minute(100_000).unwrap()),
    )
    // Room for a loaded machine: the batch takes a few ms read once, seconds read per
    // request.
    .timeout(Duration::from_millis(500))
    .build()
    .await
    .unwrap();
    // 3 000 entries admitted over the last 30 s, as the script writes them.
    let mut con = conn;
    let (secs, _): (u64, u64) = redis::cmd("TIME").query_async(&mut con).await.unwrap();
    let now_us = secs * 1_000_000;
    let mut add = redis::cmd("ZADD");
    add.arg(gate.redis_key("hot"));
    for i in 0..3_000u64 {
        let t = now_us - 30_000_000 + i * 10_000;
        add.arg(t).arg(format!("{t}:{i}:1"));
    }
    let _: u64 = add.query_async(&mut con).await.unwrap();
    let calls = (0..128).map(|_| gate.check("hot", 1));
    let decided = futures::future::join_all(calls).await;
    let failed: Vec<_> = decided.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        failed.is_empty() && !gate.is_degraded(),
        "{} of 128 calls failed, the first: {:?}",
        failed.len(),
        failed.first().map(|e| e.to_string())
    );
    let remaining: Vec<u64> = decided
        .iter()
        .map(|r| r.as_ref().unwrap().remaining)
        .collect();
    let mut sorted = remaining.clone();
    sorted.sort_unstable();
    let expected: Vec<u64> = (100_000 - 3_000 - 128..100_000 - 3_000).collect();
    assert_eq!(sorted, expected, "each caller was charged once");
}

/// The sliding log decides a batch with repeated keys and mixed costs as the model decides
/// the same requests one after another, at one time and across expiries (the log of each key
/// is read once per call and kept up to date as the call admits).
#[tokio::test]
async fn a_sliding_log_batch_with_repeated_keys_matches_the_model_request_by_request() {
    use flowgate::limit::{Limiter, SlidingLog};

    let server = RedisServer::start();
    let mut con = server.connect().await;
    let script = redis::Script::new(flowgate::gate::lua::SLIDING_LOG);
    let rate = flowgate::Rate::per_second(7).unwrap();
    let mut models: Vec<_> = (0..4)
        .map(|_| Limiter::new(SlidingLog::new(rate)))
        .collect();
    let mut x = 987_654_321u64;
    for now_ms in [10_000u64, 10_000, 10_400, 10_999, 11_000, 11_700, 13_000] {
        let trace: Vec<(usize, u32)> = (0..40)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x % 4) as usize, (x % 3) as u32 + 1)
            })
            .collect();
        let mut inv = script.prepare_invoke();
        for (k, _) in &trace {
            inv.key(format!("log{k}"));
        }
        inv.arg(7).arg(1_000_000).arg(now_ms * 1_000);
        for (_, c) in &trace {
            inv.arg(*c);
        }
        let r: Vec<i64> = inv.invoke_async(&mut con).await.unwrap();
        for (i, (k, c)) in trace.iter().enumerate() {
            let want = models[*k].check(Duration::from_millis(now_ms), *c).unwrap();
            let got = &r[i * 5..i * 5 + 5];
            let got = (
                got[0] == 1,
                got[1] as u64,
                got[2] as u64,
                got[3] as u64,
                got[4] as u64,
            );
            assert_eq!(
                got,
                super::model_reply(&want),
                "at {now_ms} ms, request {i}"
            );
        }
    }
}

/// `SCRIPT FLUSH` while the gate runs: every path (alone, batched, leased, `check_all`)
/// loads its script again and is decided by Redis, charged once, and the gate never
/// degrades.
#[tokio::test]
async fn a_script_flush_is_recovered_on_every_path_without_degrading() {
    let server = RedisServer::start();
    for lease in [0, 5] {
        let conn = ConnectionManager::new(server.client()).await.unwrap();
        let gate = RedisGate::builder(conn, Limit::TokenBucket(Quota::per_hour(100).unwrap()))
            .prefix(format!("lease{lease}:"))
            .lease(lease)
            // Not a test of timeouts: a loaded host may take longer than the default 50 ms.
            .timeout(Duration::from_secs(5))
            .build()
            .await
            .unwrap();
        run(&server, &["SCRIPT", "FLUSH"]);
        assert!(gate.check("alone", 1).await.unwrap().allowed);
        run(&server, &["SCRIPT", "FLUSH"]);
        let batch = futures::future::join_all((0..20).map(|_| gate.check("batched", 1))).await;
        assert!(batch.iter().all(|d| d.as_ref().unwrap().allowed));
        run(&server, &["SCRIPT", "FLUSH"]);
        let q = Quota::per_hour(5).unwrap();
        let all = gate.check_all(&[("a", q), ("b", q)], 1).await.unwrap();
        assert!(all.iter().all(|d| d.allowed));
        assert!(!gate.is_degraded(), "lease {lease}");
    }
}

/// A Redis that refuses `SCRIPT LOAD` (renamed away, as some hosted Redis do) and starts
/// with none of the gate's scripts: every call meets `NOSCRIPT`, the load fails, and the
/// call goes with its script's source (`EVAL`), for every limit and path, batched, leased
/// and `check_all` included; the gate never degrades, and each request is charged once.
#[tokio::test]
async fn a_redis_refusing_script_load_is_sent_each_scripts_source() {
    let server = RedisServer::start_with_args(&["--rename-command", "SCRIPT", "NOT-SCRIPT"]);
    let rate = Rate::per_hour(3).unwrap();
    let limits = [
        Limit::TokenBucket(Quota::per_hour(3).unwrap()),
        Limit::FixedWindow(rate),
        Limit::SlidingLog(rate),
        Limit::SlidingWindow(rate),
    ];
    for (i, limit) in limits.into_iter().enumerate() {
        let conn = ConnectionManager::new(server.client()).await.unwrap();
        let gate = RedisGate::builder(conn, limit)
            .prefix(format!("limit{i}:"))
            .timeout(Duration::from_secs(5))
            .build()
            .await
            .unwrap();
        let alone = [gate.check("alone", 1).await.unwrap().allowed];
        let batch = futures::future::join_all((0..4).map(|_| gate.check("batched", 1))).await;
        let batch: Vec<bool> = batch.into_iter().map(|d| d.unwrap().allowed).collect();
        assert_eq!(alone, [true], "limit {i}");
        assert_eq!(batch, [true, true, true, false], "limit {i}: 3 an hour");
        if i == 0 {
            let q = Quota::per_hour(1).unwrap();
            let all = gate.check_all(&[("a", q), ("b", q)], 1).await.unwrap();
            assert!(all.iter().all(|d| d.allowed));
            let again = gate.check_all(&[("a", q), ("b", q)], 1).await.unwrap();
            assert!(again.iter().all(|d| !d.allowed));
        }
        assert!(!gate.is_degraded(), "limit {i}");
    }
    let conn = ConnectionManager::new(server.client()).await.unwrap();
    let leased = RedisGate::builder(conn, Limit::TokenBucket(Quota::per_hour(3).unwrap()))
        .prefix("leased:")
        .lease(2)
        .timeout(Duration::from_secs(5))
        .build()
        .await
        .unwrap();
    let mut taken = Vec::new();
    for _ in 0..4 {
        taken.push(leased.check("k", 1).await.unwrap().allowed);
    }
    assert_eq!(taken, [true, true, true, false], "leased: 3 an hour");
    assert!(!leased.is_degraded());
    let loaded: redis::RedisResult<Vec<bool>> = server.query_blocking(
        redis::cmd("NOT-SCRIPT")
            .arg("EXISTS")
            .arg(redis::Script::new(flowgate::gate::lua::TOKEN_BUCKET_ALL).get_hash()),
    );
    assert_eq!(loaded.unwrap(), [true], "EVAL left it in the script cache");
}

/// After `SCRIPT FLUSH` (as after a restart: the server has none of the gate's scripts),
/// the call that meets `NOSCRIPT` forgets what the gate held on the old server's word and
/// loads every script of the gate again, not only its own. Loaded one by one, on first use,
/// the first `check_all` after it met `NOSCRIPT` too, read that as Redis having lost its
/// keys once more, and forgot the lease and the rejection the gate had taken from the
/// server since: four tokens debited in Redis thrown away, a rejection sent to Redis again.
#[tokio::test]
async fn after_a_script_flush_the_first_check_all_keeps_what_the_gate_took_since() {
    let server = RedisServer::start();
    let q = Quota::per_hour(5).unwrap();
    for lease in [0, 10] {
        let gate = RedisGate::builder(server.connect().await, Limit::TokenBucket(q))
            .prefix(format!("lease{lease}:"))
            .lease(lease)
            .lease_ttl(Duration::from_secs(600))
            .build()
            .await
            .unwrap();
        run(&server, &["SCRIPT", "FLUSH"]);
        // Loaded again by the first call: with leases, the whole bucket is leased (one
        // token spent, four kept); without, the bucket is spent and then rejects (cached).
        let first = if lease == 0 { 5 } else { 1 };
        assert!(gate.check("k", first).await.unwrap().allowed);
        if lease == 0 {
            assert!(!gate.check("k", 1).await.unwrap().allowed);
            assert_eq!(gate.cached_rejections(), 1);
        } else {
            assert_eq!(gate.leased_keys(), 1);
        }
        assert!(gate.check_all(&[("a", q), ("b", q)], 1).await.unwrap()[0].allowed);
        assert_eq!(
            (gate.leased_keys(), gate.cached_rejections()),
            (usize::from(lease > 0), usize::from(lease == 0)),
            "lease {lease}: what the gate took since the flush is kept"
        );
        if lease > 0 {
            let mut admitted = 0;
            for _ in 0..8 {
                admitted += u32::from(gate.check("k", 1).await.unwrap().allowed);
            }
            assert_eq!(admitted, 4, "the four tokens leased, then nothing");
        }
    }
}

/// An ACL that denies the script, and a script of someone else's that keeps Redis busy:
/// Redis failures whose error carries the server's words, decided by the policy, and the
/// gate is back on Redis by itself once the cause is gone.
#[tokio::test]
async fn denied_and_busy_are_redis_failures_that_say_so_and_recover() {
    let server = RedisServer::start();
    let conn = ConnectionManager::new(server.client()).await.unwrap();
    let gate = RedisGate::builder(conn, Limit::TokenBucket(Quota::per_hour(100).unwrap()))
        .probe_interval(Duration::from_millis(100))
        .timeout(Duration::from_secs(1))
        .build()
        .await
        .unwrap();
    let back = || async {
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if gate.check("k", 1).await.is_ok() && !gate.is_degraded() {
                return;
            }
        }
        panic!("not back on Redis");
    };
    run(&server, &["ACL", "SETUSER", "default", "-evalsha"]);
    let e = gate.check("k", 1).await.unwrap_err().to_string();
    assert!(e.contains("evalsha") && gate.is_degraded(), "{e}");
    run(&server, &["ACL", "SETUSER", "default", "+evalsha"]);
    back().await;

    run(&server, &["CONFIG", "SET", "busy-reply-threshold", "50"]);
    let client = server.client();
    let busy = std::thread::spawn(move || {
        let mut c = client.get_connection().unwrap();
        let _: redis::RedisResult<redis::Value> = redis::cmd("EVAL")
            .arg("while true do end")
            .arg(0)
            .query(&mut c);
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let e = gate.check("k", 1).await.unwrap_err().to_string();
    assert!(e.contains("BUSY") && gate.is_degraded(), "{e}");
    let mut c = server.client().get_connection().unwrap();
    let _: redis::Value = redis::cmd("SCRIPT").arg("KILL").query(&mut c).unwrap();
    busy.join().unwrap();
    back().await;
}

/// `SCRIPT LOAD` calls the server has run since its stats were last reset (`INFO
/// commandstats`: `script|load` on Redis 7, every `SCRIPT` subcommand together before).
fn script_loads(server: &RedisServer) -> u64 {
    calls(server, &["script|load", "script"])
}

/// The calls of the commands `names` (as `INFO commandstats` names them) the server has run
/// since its stats were last reset.
fn calls(server: &RedisServer, names: &[&str]) -> u64 {
    let info: String = server
        .query_blocking(redis::cmd("INFO").arg("commandstats"))
        .unwrap();
    info.lines()
        .filter(|l| {
            let name = l.strip_prefix("cmdstat_").and_then(|l| l.split(':').next());
            name.is_some_and(|name| names.contains(&name))
        })
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// After `SCRIPT FLUSH`, many calls in flight meet `NOSCRIPT` at once: each loads its own
/// script again and goes on, and the gate's other scripts are loaded again by one task at
/// a time. Each call that met `NOSCRIPT` spawned a task of its own to load them: 200 calls
/// at once, 200 tasks and 200 more `SCRIPT LOAD`s of a script of several kilobytes, on a
/// Redis just restarted or flushed.
#[tokio::test]
async fn calls_meeting_noscript_at_once_load_the_other_scripts_again_once() {
    const CALLS: u64 = 200;
    let server = RedisServer::start();
    let gate = RedisGate::builder(
        server.connect().await,
        Limit::TokenBucket(Quota::per_hour(1_000).unwrap()),
    )
    // One script call per request: every one of them meets NOSCRIPT.
    .batch_size(1)
    .timeout(Duration::from_secs(5))
    .build()
    .await
    .unwrap();
    run(&server, &["SCRIPT", "FLUSH"]);
    run(&server, &["CONFIG", "RESETSTAT"]);
    let keys: Vec<String> = (0..CALLS).map(|i| format!("k{i}")).collect();
    let decided = futures::future::join_all(keys.iter().map(|k| gate.check(k, 1))).await;
    assert!(decided.iter().all(|d| d.as_ref().unwrap().allowed));
    assert!(!gate.is_degraded());
    // The loads of the other scripts end within the timeout.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let loads = script_loads(&server);
    let others = loads.saturating_sub(CALLS);
    assert!(
        others <= 10,
        "{loads} SCRIPT LOADs for {CALLS} calls: the other scripts were loaded {others} times"
    );
}

/// Calls that meet `NOSCRIPT` from one `SCRIPT FLUSH` let go once of what the gate held on
/// the old server's word: the first to meet it forgets, loads its script again and takes a
/// lease from the server as it is now; the second, sent before that, keeps that lease.
/// Each call forgot on its own: the second threw away the lease the first had just taken
/// (nine tokens debited in Redis, lost).
#[tokio::test]
async fn calls_meeting_noscript_from_one_flush_forget_once() {
    let server = RedisServer::start();
    let gate = RedisGate::builder(
        server.connect().await,
        Limit::TokenBucket(Quota::per_hour(10).unwrap()),
    )
    .lease(10)
    .lease_ttl(Duration::from_secs(600))
    .timeout(Duration::from_secs(5))
    .build()
    .await
    .unwrap();
    run(&server, &["SCRIPT", "FLUSH"]);
    // Both sent before either is answered: each meets NOSCRIPT.
    let mut a = Box::pin(gate.check("a", 1));
    assert!(futures::poll!(a.as_mut()).is_pending());
    let mut b = Box::pin(gate.check("b", 1));
    assert!(futures::poll!(b.as_mut()).is_pending());
    // `a` first: it forgets, loads its script and takes a lease (one token spent, nine kept).
    assert!(a.await.unwrap().allowed);
    assert_eq!(gate.leased_keys(), 1);
    // Then `b`, whose NOSCRIPT came from the same flush.
    assert!(b.await.unwrap().allowed);
    assert_eq!(
        gate.leased_keys(),
        2,
        "a's lease, taken after the flush, is kept"
    );
    for _ in 0..9 {
        assert!(gate.check("a", 1).await.unwrap().allowed);
    }
    assert!(!gate.check("a", 1).await.unwrap().allowed);
}

/// A rejection Redis made before it lost its keys and its scripts (`FLUSHALL` with `SCRIPT
/// FLUSH`, as the gate's docs ask), read by its caller only after the gate forgot what it
/// held on the old server's word (another call met `NOSCRIPT` first), is not cached: the
/// new server admits the key. It was cached after the gate forgot, and refused the key for
/// an hour.
#[tokio::test]
async fn a_rejection_read_after_the_gate_forgot_the_old_server_is_not_cached() {
    let server = RedisServer::start();
    let gate = RedisGate::builder(
        server.connect().await,
        Limit::TokenBucket(Quota::per_hour(1).unwrap()),
    )
    .batch_size(1)
    .timeout(Duration::from_secs(5))
    .build()
    .await
    .unwrap();
    assert!(gate.check("k", 1).await.unwrap().allowed);
    run(&server, &["CONFIG", "RESETSTAT"]);
    // Rejected by the old server; its caller reads the answer later.
    let mut late = Box::pin(gate.check("k", 1));
    assert!(futures::poll!(late.as_mut()).is_pending());
    for _ in 0..1_000 {
        if calls(&server, &["evalsha"]) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(calls(&server, &["evalsha"]), 1, "decided by the old server");
    run(&server, &["FLUSHALL"]);
    run(&server, &["SCRIPT", "FLUSH"]);
    // Another call meets NOSCRIPT: the gate forgets what it held on the old server's word.
    assert!(gate.check("other", 1).await.unwrap().allowed);
    assert!(!late.await.unwrap().allowed);
    assert_eq!(
        gate.cached_rejections(),
        0,
        "the old server's rejection is not cached"
    );
    assert!(
        gate.check("k", 1).await.unwrap().allowed,
        "the new server admits the key"
    );
}
