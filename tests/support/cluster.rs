//! A private Redis Cluster per test.

use std::io::ErrorKind;
use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use redis::Value;

use super::server::require_binary;
use super::{MISSING_REDIS, MISSING_REDIS_CLI, RedisServer};

/// How long a new cluster may take to report `cluster_state:ok` everywhere.
const READY_DEADLINE: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(50);

/// A private Redis Cluster of `masters * (1 + replicas_per_master)` [`RedisServer`] nodes.
///
/// Each node is cluster-enabled (`--cluster-node-timeout 1000`, so a paused or killed
/// master with replicas fails over in ~1-2 s), runs in its own temp dir and has the usual
/// controls (`kill`, `pause`, `resume`, `restart`). Dropping the cluster drops every node,
/// which kills it and removes its temp dir.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
    masters: usize,
    replicas_per_master: usize,
}

impl RedisCluster {
    /// Starts the nodes, joins them with `redis-cli --cluster create ... --cluster-yes`
    /// and waits (up to 30 s) until every node reports `cluster_state:ok` and every
    /// replica is linked to its master.
    ///
    /// # Panics
    ///
    /// When `masters < 3` (Redis Cluster's minimum); with [`MISSING_REDIS`]
    /// or [`MISSING_REDIS_CLI`] when a binary is not on `PATH`; with `redis-cli`'s output
    /// when the create fails; when the cluster is not ok in time.
    pub fn start(masters: usize, replicas_per_master: usize) -> RedisCluster {
        assert!(
            masters >= 3,
            "a Redis Cluster needs at least 3 masters (redis-cli --cluster create refuses fewer), got {masters}"
        );
        // Check both binaries up front: one clear line instead of one panic per node.
        require_binary("redis-server", MISSING_REDIS);
        require_binary("redis-cli", MISSING_REDIS_CLI);
        let total = masters * (1 + replicas_per_master);
        // Start the nodes in parallel: each start is mostly waiting for the first PING.
        let nodes: Vec<RedisServer> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..total)
                .map(|_| scope.spawn(RedisServer::start_cluster_node))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        });
        let cluster = RedisCluster {
            nodes,
            masters,
            replicas_per_master,
        };
        cluster.create();
        cluster.wait_until_ok(READY_DEADLINE);
        cluster
    }

    fn create(&self) {
        let mut cmd = Command::new("redis-cli");
        cmd.args(["--cluster", "create"]);
        for node in &self.nodes {
            cmd.arg(node.host_port());
        }
        cmd.args([
            "--cluster-replicas",
            &self.replicas_per_master.to_string(),
            "--cluster-yes",
        ])
        .stdin(Stdio::null());
        let output = match cmd.output() {
            Ok(output) => output,
            Err(e) if e.kind() == ErrorKind::NotFound => panic!("{MISSING_REDIS_CLI}"),
            Err(e) => panic!("cannot run redis-cli: {e}"),
        };
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        if !output.status.success() || stdout.contains("[ERR]") {
            panic!(
                "redis-cli --cluster create failed ({}):\n{stdout}{stderr}",
                output.status
            );
        }
    }

    /// Every node, masters and replicas, in start order (roles can change by failover).
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// Node `i` in start order.
    ///
    /// # Panics
    ///
    /// When `i` is out of range.
    pub fn node(&self, i: usize) -> &RedisServer {
        &self.nodes[i]
    }

    /// The number of masters the cluster was created with.
    pub fn master_count(&self) -> usize {
        self.masters
    }

    /// The number of replicas per master the cluster was created with.
    pub fn replicas_per_master(&self) -> usize {
        self.replicas_per_master
    }

    /// `redis://127.0.0.1:PORT/` of every node, for `redis::cluster::ClusterClient::new`.
    pub fn seed_urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The running, unpaused nodes whose current role is master.
    pub fn masters(&self) -> Vec<&RedisServer> {
        self.nodes_with_role("role:master")
    }

    /// The running, unpaused nodes whose current role is replica.
    pub fn replicas(&self) -> Vec<&RedisServer> {
        self.nodes_with_role("role:slave")
    }

    fn nodes_with_role(&self, role: &str) -> Vec<&RedisServer> {
        self.reachable()
            .filter(|n| {
                n.query_blocking::<String>(redis::cmd("INFO").arg("replication"))
                    .is_ok_and(|info| info.lines().any(|l| l.trim() == role))
            })
            .collect()
    }

    /// The master that currently serves `key`'s hash slot (per `CLUSTER SLOTS` on the
    /// first reachable node).
    ///
    /// # Panics
    ///
    /// When no node is reachable or no node serves the slot.
    pub fn node_for_key(&self, key: &str) -> &RedisServer {
        let probe = self
            .reachable()
            .next()
            .expect("no running, unpaused cluster node");
        let slot: i64 = probe
            .query_blocking(redis::cmd("CLUSTER").arg("KEYSLOT").arg(key))
            .unwrap_or_else(|e| panic!("CLUSTER KEYSLOT failed: {e}"));
        let ranges: Vec<Vec<Value>> = probe
            .query_blocking(redis::cmd("CLUSTER").arg("SLOTS"))
            .unwrap_or_else(|e| panic!("CLUSTER SLOTS failed: {e}"));
        // Each range: [start, end, [ip, port, id, ..] (master), replicas..].
        let port = ranges
            .iter()
            .find_map(|range| match range.as_slice() {
                [Value::Int(start), Value::Int(end), Value::Array(master), ..]
                    if (*start..=*end).contains(&slot) =>
                {
                    match master.get(1) {
                        Some(Value::Int(port)) => u16::try_from(*port).ok(),
                        _ => None,
                    }
                }
                _ => None,
            })
            .unwrap_or_else(|| panic!("no node serves slot {slot} (key {key:?})"));
        self.nodes
            .iter()
            .find(|n| n.port() == port)
            .unwrap_or_else(|| panic!("slot {slot} is served by unknown port {port}"))
    }

    /// Waits until every running, unpaused node reports `cluster_state:ok`, knows every
    /// node, and (for replicas) has `master_link_status:up`. Use after a restart or a
    /// failover.
    ///
    /// # Panics
    ///
    /// With each lagging node's status when `timeout` passes.
    pub fn wait_until_ok(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let lagging: Vec<String> = self
                .reachable()
                .filter_map(|n| {
                    self.node_problem(n)
                        .map(|p| format!("{}: {p}", n.host_port()))
                })
                .collect();
            if lagging.is_empty() {
                return;
            }
            if Instant::now() >= deadline {
                panic!(
                    "Redis Cluster not ok after {timeout:?}: {}",
                    lagging.join("; ")
                );
            }
            sleep(POLL);
        }
    }

    fn node_problem(&self, node: &RedisServer) -> Option<String> {
        let info: String = match node.query_blocking(redis::cmd("CLUSTER").arg("INFO")) {
            Ok(info) => info,
            Err(e) => return Some(format!("CLUSTER INFO failed: {e}")),
        };
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.trim().strip_prefix(name)?.strip_prefix(':'))
                .unwrap_or("?")
                .to_string()
        };
        if field("cluster_state") != "ok" {
            return Some(format!("cluster_state:{}", field("cluster_state")));
        }
        let known = field("cluster_known_nodes");
        if known != self.nodes.len().to_string() {
            return Some(format!("knows {known} of {} nodes", self.nodes.len()));
        }
        let replication: String = match node.query_blocking(redis::cmd("INFO").arg("replication")) {
            Ok(info) => info,
            Err(e) => return Some(format!("INFO replication failed: {e}")),
        };
        let is_replica = replication.lines().any(|l| l.trim() == "role:slave");
        if is_replica
            && !replication
                .lines()
                .any(|l| l.trim() == "master_link_status:up")
        {
            return Some("replica not linked to its master yet".to_string());
        }
        None
    }

    fn reachable(&self) -> impl Iterator<Item = &RedisServer> {
        self.nodes
            .iter()
            .filter(|n| n.is_running() && !n.is_paused())
    }
}
