//! A private `redis-server` process per test.

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::thread::sleep;
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redis::{
    AsyncConnectionConfig, ConnectionAddr, FromRedisValue, IntoConnectionInfo, RedisResult,
};

use super::TempDir;

/// The one-line panic message when `redis-server` is not on `PATH`.
pub const MISSING_REDIS: &str = "redis-server not found on PATH: the Redis tests need it (install it with: apt-get install -y redis-server)";

/// The one-line panic message when `redis-cli` (needed to create clusters) is not on `PATH`.
pub const MISSING_REDIS_CLI: &str = "redis-cli not found on PATH: the Redis cluster tests need it (install it with: apt-get install -y redis-tools)";

/// How long a (re)started server may take to answer PING.
const READY_DEADLINE: Duration = Duration::from_secs(10);
/// How many fresh ports / directories `start*` tries before giving up.
const START_ATTEMPTS: usize = 5;
/// Sleep between readiness polls.
const POLL: Duration = Duration::from_millis(10);
/// Timeouts of the blocking connections the harness itself uses.
const BLOCKING_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
const BLOCKING_IO_TIMEOUT: Duration = Duration::from_secs(2);
/// Lines of each log file quoted in failure messages.
const LOG_TAIL_LINES: usize = 30;

/// Where a server listens.
#[derive(Debug, Clone)]
enum Listen {
    /// 127.0.0.1:port (a cluster node also uses port + 10000 for its bus).
    Tcp(u16),
    /// A unix socket, no TCP listener.
    Unix(PathBuf),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Tcp,
    Unix,
    ClusterNode,
}

#[derive(Debug)]
struct State {
    /// The running (or paused) process; `None` after `kill`.
    child: Option<Child>,
    /// The pid of the current or most recent process.
    pid: u32,
    paused: bool,
}

/// A private `redis-server`: no persistence, its own temp dir, killed on drop.
///
/// The server listens on a free port of 127.0.0.1 ([`start`](Self::start)) or on a unix
/// socket in its temp dir ([`start_unix`](Self::start_unix)). It runs with
/// `--save "" --appendonly no --daemonize no`; `--dir` and `--logfile` point into its
/// temp dir.
///
/// The controls take `&self` (the process state sits behind a mutex), so a handle can be
/// shared with a task through an `Arc` that kills or pauses the server mid-test.
///
/// Setup and the controls are blocking (std sockets and sleeps, a few ms): they work in
/// sync tests, in `#[tokio::test]`, and with `tokio::time::pause()` in effect.
///
/// Dropping the handle resumes a paused process, kills it (SIGKILL), reaps it and removes
/// the temp dir, also while the test unwinds from a panic.
#[derive(Debug)]
pub struct RedisServer {
    listen: Listen,
    extra_args: Vec<String>,
    state: Mutex<State>,
    // Declared last: removed only after `Drop::drop` has killed the process.
    dir: TempDir,
}

impl RedisServer {
    /// Starts a server on a free TCP port of 127.0.0.1 and waits until it answers PING.
    ///
    /// # Panics
    ///
    /// With [`MISSING_REDIS`] when `redis-server` is not on `PATH`; with the server's log
    /// tail when it fails to start on 5 fresh ports in a row.
    pub fn start() -> RedisServer {
        Self::launch(Kind::Tcp, &[])
    }

    /// Like [`start`](Self::start), with extra `redis-server` arguments, e.g.
    /// `["--maxmemory", "1mb"]`. They are kept for [`restart`](Self::restart).
    ///
    /// # Panics
    ///
    /// As [`start`](Self::start).
    pub fn start_with_args(args: &[&str]) -> RedisServer {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        Self::launch(Kind::Tcp, &args)
    }

    /// Starts a server listening only on a unix socket in its temp dir.
    ///
    /// # Panics
    ///
    /// As [`start`](Self::start).
    pub fn start_unix() -> RedisServer {
        Self::launch(Kind::Unix, &[])
    }

    /// Starts a cluster-enabled node (no slots yet); used by `RedisCluster`.
    pub(super) fn start_cluster_node() -> RedisServer {
        let args = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "1000",
            // Replicas sync at once (the default waits 5 s for more replicas to join).
            "--repl-diskless-sync-delay",
            "0",
        ];
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        Self::launch(Kind::ClusterNode, &args)
    }

    fn launch(kind: Kind, extra_args: &[String]) -> RedisServer {
        let mut failures = Vec::new();
        for _ in 0..START_ATTEMPTS {
            let dir = TempDir::new("flowgate-redis");
            let listen = match kind {
                Kind::Tcp => Listen::Tcp(free_port(false)),
                Kind::ClusterNode => Listen::Tcp(free_port(true)),
                Kind::Unix => Listen::Unix(dir.path().join("redis.sock")),
            };
            let server = RedisServer {
                listen,
                extra_args: extra_args.to_vec(),
                state: Mutex::new(State {
                    child: None,
                    pid: 0,
                    paused: false,
                }),
                dir,
            };
            match server.spawn_and_wait() {
                Ok(()) => return server,
                // Most likely someone took the port between our probe and the bind: the
                // failed server is dropped (killed, dir removed) and we try a new port.
                Err(failure) => failures.push(failure),
            }
        }
        panic!(
            "redis-server failed to start {START_ATTEMPTS} times; last failure: {}",
            failures.last().map(String::as_str).unwrap_or("")
        );
    }

    /// The server's URL: `redis://127.0.0.1:PORT/` or `redis+unix:///path/to/redis.sock`.
    pub fn url(&self) -> String {
        match &self.listen {
            Listen::Tcp(port) => format!("redis://127.0.0.1:{port}/"),
            Listen::Unix(path) => format!("redis+unix://{}", path.display()),
        }
    }

    /// The TCP port.
    ///
    /// # Panics
    ///
    /// For a unix-socket server (see [`socket_path`](Self::socket_path)).
    pub fn port(&self) -> u16 {
        match &self.listen {
            Listen::Tcp(port) => *port,
            Listen::Unix(path) => panic!(
                "the unix-socket server at {} has no TCP port",
                path.display()
            ),
        }
    }

    /// `127.0.0.1:PORT`, the form `redis-cli --cluster` and `CLUSTER NODES` use.
    ///
    /// # Panics
    ///
    /// For a unix-socket server.
    pub fn host_port(&self) -> String {
        format!("127.0.0.1:{}", self.port())
    }

    /// The unix socket path, `None` for a TCP server.
    pub fn socket_path(&self) -> Option<&Path> {
        match &self.listen {
            Listen::Tcp(_) => None,
            Listen::Unix(path) => Some(path),
        }
    }

    /// The server's temp dir (its `--dir`, log files, `nodes.conf`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The pid of the current process, or of the last one after [`kill`](Self::kill).
    pub fn pid(&self) -> u32 {
        self.lock().pid
    }

    /// Whether the process is alive (paused counts as alive).
    pub fn is_running(&self) -> bool {
        let mut state = self.lock();
        match state.child.as_mut().map(Child::try_wait) {
            Some(Ok(None)) => true,
            Some(Ok(Some(_)) | Err(_)) | None => false,
        }
    }

    /// Whether the process is stopped by [`pause`](Self::pause).
    pub fn is_paused(&self) -> bool {
        self.lock().paused
    }

    /// SIGKILLs the process and waits for it to exit; its data is lost. Does nothing when
    /// the server is not running. A paused process is resumed first.
    pub fn kill(&self) {
        stop(&mut self.lock());
    }

    /// SIGSTOPs the process: connections stay open but nothing is answered, like a server
    /// stuck in a long GC pause or a network partition. Idempotent.
    ///
    /// # Panics
    ///
    /// When the server is not running or the signal cannot be sent.
    pub fn pause(&self) {
        let mut state = self.lock();
        assert!(
            state.child.is_some(),
            "cannot pause: redis-server is not running"
        );
        if !state.paused {
            signal(state.pid, "STOP").unwrap_or_else(|e| panic!("{e}"));
            state.paused = true;
        }
    }

    /// SIGCONTs a process stopped by [`pause`](Self::pause). Idempotent.
    ///
    /// # Panics
    ///
    /// When the signal cannot be sent.
    pub fn resume(&self) {
        let mut state = self.lock();
        if state.paused {
            if state.child.is_some() {
                signal(state.pid, "CONT").unwrap_or_else(|e| panic!("{e}"));
            }
            state.paused = false;
        }
    }

    /// Kills the process if it runs, then starts a new one on the same port / socket with
    /// the same arguments and empty data, and waits until it answers PING.
    ///
    /// A cluster node keeps its `nodes.conf`, so it rejoins the cluster with the same
    /// identity (and no keys).
    ///
    /// # Panics
    ///
    /// With the log tail when the new process does not answer PING in time (e.g. the port
    /// was taken meanwhile).
    pub fn restart(&self) {
        self.kill();
        let mut last = String::new();
        for _ in 0..3 {
            match self.spawn_and_wait() {
                Ok(()) => return,
                Err(failure) => last = failure,
            }
            sleep(Duration::from_millis(100));
        }
        panic!("redis-server failed to restart on {}: {last}", self.url());
    }

    /// A `ConnectionManager` that gives up fast (200 ms to connect or answer, one retry,
    /// 100 ms between retries): what the failure tests kill and pause servers under.
    #[cfg(feature = "redis")]
    pub async fn fast_failing_manager(&self) -> redis::aio::ConnectionManager {
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_millis(200)))
            .set_response_timeout(Some(Duration::from_millis(200)))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(100));
        redis::aio::ConnectionManager::new_with_config(self.client(), config)
            .await
            .unwrap()
    }

    /// A client for this server (the library's default timeouts).
    pub fn client(&self) -> redis::Client {
        let addr = match &self.listen {
            Listen::Tcp(port) => ConnectionAddr::Tcp("127.0.0.1".to_string(), *port),
            Listen::Unix(path) => ConnectionAddr::Unix(path.clone()),
        };
        let info = addr
            .into_connection_info()
            .unwrap_or_else(|e| panic!("bad connection info for {}: {e}", self.url()));
        redis::Client::open(info).unwrap_or_else(|e| panic!("bad client for {}: {e}", self.url()))
    }

    /// A new multiplexed connection (library defaults: 1 s connect, 500 ms response
    /// timeout).
    ///
    /// # Panics
    ///
    /// When the connection fails; see [`try_connect`](Self::try_connect).
    pub async fn connect(&self) -> MultiplexedConnection {
        self.try_connect()
            .await
            .unwrap_or_else(|e| panic!("cannot connect to {}: {e}", self.url()))
    }

    /// A new multiplexed connection, or the error (e.g. while the server is killed).
    pub async fn try_connect(&self) -> RedisResult<MultiplexedConnection> {
        self.client().get_multiplexed_async_connection().await
    }

    /// A new multiplexed connection with the given config.
    ///
    /// With `tokio::time::pause()`, pass
    /// `AsyncConnectionConfig::new().set_connection_timeout(None).set_response_timeout(None)`
    /// (or use [`connect_untimed`](Self::connect_untimed)): auto-advanced time would fire
    /// the library's timeouts.
    ///
    /// # Panics
    ///
    /// When the connection fails.
    pub async fn connect_with(&self, config: &AsyncConnectionConfig) -> MultiplexedConnection {
        self.client()
            .get_multiplexed_async_connection_with_config(config)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to {}: {e}", self.url()))
    }

    /// A new multiplexed connection without client-side timeouts, for tests under
    /// `tokio::time::pause()`.
    ///
    /// # Panics
    ///
    /// When the connection fails.
    pub async fn connect_untimed(&self) -> MultiplexedConnection {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(None)
            .set_response_timeout(None);
        self.connect_with(&config).await
    }

    /// Runs one command on a new blocking connection (1 s connect, 2 s I/O timeouts).
    /// Independent of any tokio runtime or paused clock.
    pub fn query_blocking<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> RedisResult<T> {
        let mut con = self
            .client()
            .get_connection_with_timeout(BLOCKING_CONNECT_TIMEOUT)?;
        con.set_read_timeout(Some(BLOCKING_IO_TIMEOUT))?;
        con.set_write_timeout(Some(BLOCKING_IO_TIMEOUT))?;
        cmd.query(&mut con)
    }

    /// The last lines of the server's log, stdout and stderr, for failure messages.
    pub fn log_tail(&self) -> String {
        let mut out = String::new();
        for name in ["redis.log", "stdout.log", "stderr.log"] {
            let text = std::fs::read(self.dir().join(name))
                .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
                .unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..];
            if !tail.is_empty() {
                out.push_str(&format!("--- {name} (last {} lines) ---\n", tail.len()));
                for line in tail {
                    out.push_str(line);
                    out.push('\n');
                }
            }
        }
        if out.is_empty() {
            out.push_str("(no log output)\n");
        }
        out
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn ping_ok(&self) -> bool {
        matches!(
            self.query_blocking::<String>(&redis::cmd("PING"))
                .as_deref(),
            Ok("PONG")
        )
    }

    /// Spawns a process (none may be running) and waits until it answers PING.
    /// On failure the process is gone and the error carries the log tail.
    fn spawn_and_wait(&self) -> Result<(), String> {
        let mut state = self.lock();
        debug_assert!(state.child.is_none(), "spawn_and_wait with a live child");
        self.remove_data();
        let child = self.spawn()?;
        state.pid = child.id();
        state.paused = false;
        let child = state.child.insert(child);
        let deadline = Instant::now() + READY_DEADLINE;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => {
                    state.child = None;
                    return Err(format!(
                        "redis-server on {} exited during startup ({status})\n{}",
                        self.url(),
                        self.log_tail()
                    ));
                }
                Ok(None) => {}
                Err(e) => {
                    stop(&mut state);
                    return Err(format!("cannot wait for redis-server: {e}"));
                }
            }
            if self.ping_ok() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                stop(&mut state);
                return Err(format!(
                    "redis-server on {} did not answer PING within {READY_DEADLINE:?}\n{}",
                    self.url(),
                    self.log_tail()
                ));
            }
            sleep(POLL);
        }
    }

    fn spawn(&self) -> Result<Child, String> {
        let dir = self.dir();
        let mut cmd = Command::new("redis-server");
        match &self.listen {
            Listen::Tcp(port) => {
                cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"]);
            }
            Listen::Unix(path) => {
                cmd.args(["--port", "0", "--unixsocket"])
                    .arg(path)
                    .args(["--unixsocketperm", "700"]);
            }
        }
        cmd.args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(dir)
            .arg("--logfile")
            .arg(dir.join("redis.log"))
            .args(&self.extra_args)
            .stdin(Stdio::null())
            .stdout(append(&dir.join("stdout.log"))?)
            .stderr(append(&dir.join("stderr.log"))?);
        match cmd.spawn() {
            Ok(child) => Ok(child),
            Err(e) if e.kind() == ErrorKind::NotFound => panic!("{MISSING_REDIS}"),
            Err(e) => Err(format!("cannot spawn redis-server: {e}")),
        }
    }

    /// Removes anything a new process could load data from (an RDB written by a replica's
    /// full sync, an AOF) and a stale socket. Keeps logs and `nodes.conf`.
    fn remove_data(&self) {
        let Ok(entries) = std::fs::read_dir(self.dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let path = entry.path();
            if name.ends_with(".rdb") || name.ends_with(".aof") || name == "redis.sock" {
                let _ = std::fs::remove_file(&path);
            } else if name == "appendonlydir" {
                let _ = std::fs::remove_dir_all(&path);
            }
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        stop(self.state.get_mut().unwrap_or_else(PoisonError::into_inner));
    }
}

/// Resumes (if paused), SIGKILLs and reaps the process. Never panics (runs in `Drop`).
fn stop(state: &mut State) {
    if let Some(mut child) = state.child.take() {
        if state.paused {
            let _ = signal(state.pid, "CONT");
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    state.paused = false;
}

/// Panics with `missing` (one line) when `bin` is not on `PATH`.
pub(super) fn require_binary(bin: &str, missing: &str) {
    let probe = Command::new(bin)
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if let Err(e) = probe
        && e.kind() == ErrorKind::NotFound
    {
        panic!("{missing}");
    }
}

/// Sends `SIG<sig>` with the `kill` utility (no unsafe, no libc).
fn signal(pid: u32, sig: &str) -> Result<(), String> {
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .stdin(Stdio::null())
        .status()
        .map_err(|e| format!("cannot run `kill -{sig} {pid}`: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("`kill -{sig} {pid}` failed ({status})"))
    }
}

fn append(path: &Path) -> Result<File, String> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))
}

/// A port of 127.0.0.1 that was free a moment ago. With `cluster_bus`, port + 10000 (the
/// cluster bus port, Redis' default offset) was free as well.
fn free_port(cluster_bus: bool) -> u16 {
    loop {
        let listener = TcpListener::bind("127.0.0.1:0")
            .unwrap_or_else(|e| panic!("cannot bind a free port on 127.0.0.1: {e}"));
        let port = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("cannot read the bound port: {e}"))
            .port();
        if !cluster_bus {
            return port;
        }
        let Some(bus) = port.checked_add(10000) else {
            continue;
        };
        if TcpListener::bind(("127.0.0.1", bus)).is_ok() {
            return port;
        }
    }
}
