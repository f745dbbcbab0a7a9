//! A team's journey on Redis Cluster: slots moving between nodes, with every request
//! accounted for.

use std::time::{Duration, Instant};

use flowgate::Quota;
use flowgate::gate::{FailurePolicy, Limit, RedisGate, RedisGateBuilder};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;

use super::support::{RedisCluster, RedisServer};

fn per_hour(n: u32) -> Limit {
    Limit::TokenBucket(Quota::per_hour(n).unwrap())
}

/// A gate of `limit` over a connection that gives up on a node after 300 ms (as a service
/// would configure it), failing `Closed` within 500 ms and probing every 200 ms.
pub(super) async fn closed_gate(
    cluster: &RedisCluster,
    limit: Limit,
) -> RedisGateBuilder<ClusterConnection> {
    let client = ClusterClient::builder(cluster.seed_urls())
        .connection_timeout(Duration::from_millis(300))
        .response_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    RedisGate::builder(client.get_async_connection().await.unwrap(), limit)
        .failure_policy(FailurePolicy::Closed)
        .timeout(Duration::from_millis(500))
        .probe_interval(Duration::from_millis(200))
}

/// A gate of `limit` whose every failure is an error, over a connection with timeouts no
/// loaded machine reaches (every count is Redis's decision).
async fn exact_gate(cluster: &RedisCluster, limit: Limit) -> RedisGateBuilder<ClusterConnection> {
    let client = ClusterClient::builder(cluster.seed_urls())
        .connection_timeout(Duration::from_secs(10))
        .response_timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    RedisGate::builder(client.get_async_connection().await.unwrap(), limit)
        .failure_policy(FailurePolicy::Error)
        .timeout(Duration::from_secs(10))
}

/// A cluster-enabled node that owns no slot yet and has met the cluster.
fn join_new_node(cluster: &RedisCluster) -> RedisServer {
    // As the harness starts the cluster's own nodes.
    let args = "--cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 1000";
    let node = RedisServer::start_with_args(&args.split(' ').collect::<Vec<_>>());
    let seed = cluster.node(0);
    let () = node
        .query_blocking(
            redis::cmd("CLUSTER")
                .arg("MEET")
                .arg("127.0.0.1")
                .arg(seed.port()),
        )
        .unwrap();
    let want = cluster.nodes().len() + 1;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let known = cluster.nodes().iter().chain([&node]).all(|n| {
            let info: String = n
                .query_blocking(&redis::cmd("CLUSTER").arg("INFO").to_owned())
                .unwrap();
            info.contains(&format!("cluster_known_nodes:{want}"))
                && info.contains("cluster_state:ok")
        });
        if known {
            return node;
        }
        assert!(Instant::now() < deadline, "the new node never joined");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn my_id(node: &RedisServer) -> String {
    node.query_blocking(redis::cmd("CLUSTER").arg("MYID"))
        .unwrap()
}

fn keyslot(node: &RedisServer, key: &str) -> u16 {
    node.query_blocking(redis::cmd("CLUSTER").arg("KEYSLOT").arg(key))
        .unwrap()
}

/// Starts moving `slot` from `from` to `to` (IMPORTING / MIGRATING).
fn begin_migration(slot: u16, from: &RedisServer, to: &RedisServer) {
    let () = to
        .query_blocking(
            redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg("IMPORTING")
                .arg(my_id(from)),
        )
        .unwrap();
    let () = from
        .query_blocking(
            redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg("MIGRATING")
                .arg(my_id(to)),
        )
        .unwrap();
}

/// Moves `keys` (present on `from`) to `to` with MIGRATE.
fn migrate_keys(from: &RedisServer, to: &RedisServer, keys: &[String]) {
    let mut cmd = redis::cmd("MIGRATE");
    cmd.arg("127.0.0.1")
        .arg(to.port())
        .arg("")
        .arg(0)
        .arg(5000)
        .arg("KEYS");
    for k in keys {
        cmd.arg(k);
    }
    let _: redis::Value = from.query_blocking(&cmd).unwrap();
}

/// Ends the move of `slot`: `to` owns it, on every node.
fn end_migration(slot: u16, to: &RedisServer, all: &[&RedisServer]) {
    let id = my_id(to);
    for n in std::iter::once(to).chain(all.iter().copied()) {
        let _: redis::RedisResult<()> = n.query_blocking(
            redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg("NODE")
                .arg(&id),
        );
    }
}

/// A slot moving to a node that joined the cluster after the gate was built (scaling out:
/// `CLUSTER SETSLOT .. IMPORTING / MIGRATING`, `MIGRATE`, `SETSLOT .. NODE`) is decided by
/// Redis throughout, each key's bucket going with it: a new key of the slot (sent on by
/// `ASK`) and a key already moved are decided by the new node, and no call fails.
///
/// The new node has none of the gate's scripts, and is not in the client's map of the
/// cluster until it owns a slot: the `SCRIPT LOAD` the gate sent on `NOSCRIPT` went to
/// every node of that map but this one, and the script call sent again met `NOSCRIPT`
/// again. Every call on the slot failed until the move ended, and degraded the gate, whose
/// keys on every shard were then decided by the failure policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_moving_to_a_new_node_is_decided_by_redis_throughout() {
    let cluster = RedisCluster::start(3, 0);
    let gate = exact_gate(&cluster, per_hour(5))
        .await
        .build()
        .await
        .unwrap();
    let new = join_new_node(&cluster);
    // Two keys of one slot, charged 2 and 1 of their 5.
    let (moved, stays, fresh) = ("{t}:moved", "{t}:stays", "{t}:fresh");
    let mut admitted = std::collections::HashMap::<&str, u32>::new();
    let mut errors = Vec::new();
    let mut requests = 0;
    let mut check = async |key: &'static str, admitted: &mut std::collections::HashMap<_, _>| {
        requests += 1;
        match gate.check(key, 1).await {
            Ok(d) => *admitted.entry(key).or_default() += u32::from(d.allowed),
            Err(e) => errors.push(format!("{key}: {e}")),
        }
    };
    for key in [moved, moved, stays] {
        check(key, &mut admitted).await;
    }
    let from = cluster.node_for_key(&gate.redis_key(moved));
    let slot = keyslot(from, &gate.redis_key(moved));
    begin_migration(slot, from, &new);
    // Mid-move: a key still on the old node, a new key (`ASK`: created on the new node).
    check(stays, &mut admitted).await;
    check(fresh, &mut admitted).await;
    migrate_keys(from, &new, &[gate.redis_key(moved)]);
    // Moved (`ASK`): the new node decides on the bucket it received.
    check(moved, &mut admitted).await;
    let all: Vec<&RedisServer> = cluster.nodes().iter().collect();
    migrate_keys(from, &new, &[gate.redis_key(stays)]);
    end_migration(slot, &new, &all);
    // Moved for good (`MOVED`): each key admits what is left of its 5, and no more.
    for _ in 0..4 {
        for key in [moved, stays, fresh] {
            check(key, &mut admitted).await;
        }
    }
    assert_eq!(errors, Vec::<String>::new(), "every call decided by Redis");
    assert!(!gate.is_degraded());
    assert_eq!(
        [moved, stays, fresh].map(|k| admitted.get(k).copied().unwrap_or(0)),
        [5, 5, 5],
        "exactly the burst per key, the buckets moving with their keys"
    );
    let rejected = requests - admitted.values().sum::<u32>() - errors.len() as u32;
    // 7, 6 and 5 calls on the three keys.
    assert_eq!(
        rejected,
        2 + 1,
        "the calls past each burst: {requests} requests"
    );
    let on_new: i64 = new
        .query_blocking(redis::cmd("CLUSTER").arg("COUNTKEYSINSLOT").arg(slot))
        .unwrap();
    assert_eq!(on_new, 3, "the slot's keys are on the new node");
}

/// A master killed mid-run and its replica promoted, under `Closed`: every request is
/// answered within the timeout (by Redis, or rejected by the policy), each is counted once
/// (`allowed + rejected + policy == requests`), the failover shows as a failure and a
/// transition each way, and the new master goes on from the replicated bucket: no more
/// than the burst is admitted across the failover.
#[cfg(feature = "metrics")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_is_counted_and_its_replica_goes_on_from_the_bucket() {
    use super::support::TestRecorder;
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let cluster = RedisCluster::start(3, 1);
    let gate = closed_gate(&cluster, per_hour(20))
        .await
        .name("failover")
        .build()
        .await
        .unwrap();
    let outcome = |o: &str| {
        recorder.counter(&format!(
            "flowgate_gate_decisions_total{{name=failover,outcome={o}}}"
        ))
    };
    let key = "k";
    let (mut requests, mut by_redis, mut by_policy) = (0u64, 0u32, 0u64);
    for _ in 0..5 {
        requests += 1;
        by_redis += u32::from(gate.check(key, 1).await.unwrap().allowed);
    }
    // Replicated (asynchronously) before the kill.
    tokio::time::sleep(Duration::from_millis(500)).await;
    cluster.node_for_key(&gate.redis_key(key)).kill();
    let killed = Instant::now();
    let mut back = None;
    while killed.elapsed() < Duration::from_secs(60) {
        requests += 1;
        let d = gate.check(key, 1).await.unwrap();
        if d.capacity == u64::MAX {
            assert!(!d.allowed, "Closed rejects");
            by_policy += 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        by_redis += u32::from(d.allowed);
        back.get_or_insert(killed.elapsed());
        if !d.allowed {
            break;
        }
    }
    let back = back.expect("back on Redis within 60 s of the kill");
    eprintln!("cluster: back on Redis {back:?} after the master was killed");
    assert_eq!(by_redis, 20, "the burst, across the failover");
    let counted = outcome("allowed") + outcome("rejected") + outcome("policy");
    assert_eq!(counted, requests, "each request counted once");
    assert_eq!(outcome("policy"), by_policy);
    assert!(recorder.counter("flowgate_gate_failures_total{name=failover}") >= 1);
    assert!(recorder.counter("flowgate_gate_transitions_total{name=failover,to=degraded}") >= 1);
    assert!(recorder.counter("flowgate_gate_transitions_total{name=failover,to=healthy}") >= 1);
    assert_eq!(
        recorder.gauge("flowgate_gate_degraded{name=failover}"),
        Some(0.0)
    );
}

/// A master paused (connections open, nothing answered) past the timeout: every call on
/// its slot is answered by the policy within the timeout, also once its replica has taken
/// over (the client keeps sending the slot's calls to the old master, as the docs of
/// `RedisGateBuilder::cluster` say), and the gate is back on Redis soon after the old
/// master answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_master_keeps_its_slot_on_the_policy_until_it_answers() {
    let cluster = RedisCluster::start(3, 1);
    let gate = closed_gate(&cluster, per_hour(100))
        .await
        .build()
        .await
        .unwrap();
    let key = "k";
    assert!(gate.check(key, 1).await.unwrap().allowed);
    let victim = cluster.node_for_key(&gate.redis_key(key));
    victim.pause();
    let paused = Instant::now();
    // The replica takes over (3 masters answer again, the paused one not among them).
    while cluster.masters().len() < 3 {
        assert!(paused.elapsed() < Duration::from_secs(60), "no failover");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let promoted = Instant::now();
    while promoted.elapsed() < Duration::from_secs(3) {
        let d = gate.check(key, 1).await.unwrap();
        assert_eq!(
            (d.allowed, d.capacity),
            (false, u64::MAX),
            "decided by the policy"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    victim.resume();
    let resumed = Instant::now();
    loop {
        let d = gate.check(key, 1).await.unwrap();
        if d.capacity != u64::MAX && !gate.is_degraded() {
            break;
        }
        assert!(resumed.elapsed() < Duration::from_secs(30), "never back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Keys of one slot (a tenant's, under one hash tag) batched while that slot moves
/// between masters, one key moved already and the other not: each caller is decided as it
/// would be alone (`ASK` for the moved key, the old master for the other).
///
/// Batched, the two keys go in one script call, which neither master can run while the
/// slot is split between them (`TRYAGAIN`); redis-rs waits and sends it again until the
/// gate's timeout: every caller of the batch failed with `Timeout` after the whole timeout
/// (2 s here), and the gate degraded. The caller that found nothing in flight and called
/// alone was decided.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_of_a_moving_slot_batched_are_decided_as_alone() {
    let cluster = RedisCluster::start(3, 0);
    let gate = exact_gate(&cluster, per_hour(50))
        .await
        .timeout(Duration::from_secs(2))
        .build()
        .await
        .unwrap();
    let (moved, stays) = ("{t}:moved", "{t}:stays");
    for key in [moved, stays] {
        assert!(gate.check(key, 1).await.unwrap().allowed);
    }
    let from = cluster.node_for_key(&gate.redis_key(moved));
    let to = cluster
        .nodes()
        .iter()
        .find(|n| n.port() != from.port())
        .unwrap();
    let slot = keyslot(from, &gate.redis_key(moved));
    begin_migration(slot, from, to);
    migrate_keys(from, to, &[gate.redis_key(moved)]);
    let calls = (0..8).map(|i| gate.check([moved, stays][i % 2], 1));
    let got: Vec<String> = futures::future::join_all(calls)
        .await
        .into_iter()
        .map(|d| match d {
            Ok(d) => d.allowed.to_string(),
            Err(e) => e.to_string(),
        })
        .collect();
    assert_eq!(got, ["true"; 8], "each decided by Redis");
    assert!(!gate.is_degraded());
}

/// Two failovers of one shard: its master killed, restarted (a new process: no scripts,
/// its data synced from the replica that took over, now its master), then that one killed
/// in turn. The gate, whose scripts the twice-promoted node never had, is back on Redis
/// with the bucket where it was: exactly the burst is admitted across both failovers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_failovers_of_a_shard_keep_its_buckets_and_get_the_scripts_again() {
    let cluster = RedisCluster::start(3, 1);
    let gate = closed_gate(&cluster, per_hour(20))
        .await
        .build()
        .await
        .unwrap();
    let key = "k";
    let mut by_redis = 0;
    // Until Redis decides a request (not the policy): whether it was admitted.
    let decided = async || loop {
        let d = gate.check(key, 1).await.unwrap();
        if d.capacity != u64::MAX {
            return d.allowed;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for _ in 0..5 {
        by_redis += u32::from(decided().await);
    }
    for round in 0..2 {
        // Replicated (asynchronously) before the kill.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let master = cluster.node_for_key(&gate.redis_key(key));
        master.kill();
        let started = Instant::now();
        let back = tokio::time::timeout(Duration::from_secs(60), decided())
            .await
            .unwrap_or_else(|_| panic!("round {round}: never back on Redis"));
        eprintln!("round {round}: back on Redis in {:?}", started.elapsed());
        by_redis += u32::from(back);
        for _ in 0..4 {
            by_redis += u32::from(decided().await);
        }
        if round == 0 {
            // Back as a replica of the node that took over, synced from it.
            master.restart();
            cluster.wait_until_ok(Duration::from_secs(60));
        }
    }
    while decided().await {
        by_redis += 1;
    }
    assert_eq!(by_redis, 20, "the burst, across both failovers");
}
