//! A private `redis-server` for the Redis benches: free port of 127.0.0.1, nothing saved to
//! disk, its own temp dir; killed and removed on drop, also when the bench panics.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redis::aio::MultiplexedConnection;

pub struct PrivateRedis {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl PrivateRedis {
    /// Start a server for bench `bench` and wait for PING (up to 5 tries, should the port be
    /// taken between the probe and the bind). `cpus`: run it under `taskset -c <cpus>`.
    /// Exits the process with 1 and one line when `redis-server` is not on `PATH`.
    pub fn start(bench: &str, cpus: Option<&str>) -> PrivateRedis {
        let mut last_failure = String::new();
        for attempt in 0..5 {
            let dir = std::env::temp_dir().join(format!(
                "flowgate-bench-{bench}-{}-{attempt}-{}",
                std::process::id(),
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.subsec_nanos())
                    .unwrap_or(0)
            ));
            std::fs::create_dir_all(&dir).expect("create the server's temp dir");
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("find a free port")
                .port();
            let mut command = match cpus {
                Some(cpus) => {
                    let mut c = Command::new("taskset");
                    c.args(["-c", cpus, "redis-server"]);
                    c
                }
                None => Command::new("redis-server"),
            };
            let spawned = command
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
                .arg("--dir")
                .arg(&dir)
                .arg("--logfile")
                .arg(dir.join("redis.log"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            let child = match spawned {
                Ok(child) => child,
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&dir);
                    if e.kind() == ErrorKind::NotFound {
                        eprintln!(
                            "redis-server not found on PATH: benches/{bench}.rs needs it (install it with: apt-get install -y redis-server)"
                        );
                    } else {
                        eprintln!("cannot run redis-server: {e}");
                    }
                    std::process::exit(1);
                }
            };
            let mut server = PrivateRedis { child, port, dir };
            match server.wait_ready(Duration::from_secs(10)) {
                Ok(()) => return server,
                Err(why) => last_failure = why,
            }
        }
        panic!("redis-server failed to start 5 times; last failure: {last_failure}");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).expect("valid url")
    }

    pub async fn connect(&self) -> MultiplexedConnection {
        self.client()
            .get_multiplexed_async_connection()
            .await
            .expect("connect to the private redis-server")
    }

    fn wait_ready(&mut self, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                let log = std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default();
                let tail: Vec<_> = log.lines().rev().take(5).collect();
                return Err(format!("exited with {status}: {}", tail.join(" | ")));
            }
            if ping(self.port) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Err(format!("no PONG within {within:?}"))
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn ping(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
    let mut buf = [0u8; 7];
    s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}
