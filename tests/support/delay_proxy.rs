//! A TCP proxy on loopback that adds one-way latency, for simulating a cross-region link
//! between a Redis client and a local `redis-server`.
//!
//! Self-contained (only `tokio` and `std`) so an example can include it with
//! `#[path = "../tests/support/delay_proxy.rs"] mod delay_proxy;`.
//!
//! Each direction of each connection is a reader task and a writer task joined by an
//! unbounded queue: the reader stamps every chunk it reads with
//! `deadline = now + delay` and the writer sleeps until that deadline before writing the
//! chunk. The latency is therefore a real one-way delay that keeps pipelined requests
//! pipelined (a burst of N requests arrives one delay later, not N delays later).
#![allow(dead_code)]

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

/// Largest chunk a reader task reads at once.
const CHUNK: usize = 16 * 1024;
/// Pause after a failed `accept` (e.g. out of file descriptors) before trying again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);

/// Normal forwarding with the configured delay.
const MODE_FORWARD: u8 = 0;
/// Existing connections are cut, new ones are closed at once.
const MODE_CUT: u8 = 1;
/// Connections stay open but nothing is delivered.
const MODE_BLACKHOLE: u8 = 2;

/// State shared by the handle, the accept loop and every connection task.
#[derive(Debug)]
struct Shared {
    /// One-way delay in nanoseconds.
    delay_nanos: AtomicU64,
    /// One of the `MODE_*` constants.
    mode: AtomicU8,
    /// Currently open client connections.
    connections: AtomicUsize,
    /// Bumped to close every existing connection.
    epoch: watch::Sender<u64>,
}

impl Shared {
    fn delay(&self) -> Duration {
        Duration::from_nanos(self.delay_nanos.load(Ordering::Relaxed))
    }

    fn mode(&self) -> u8 {
        self.mode.load(Ordering::SeqCst)
    }

    fn close_all(&self) {
        self.epoch
            .send_modify(|epoch| *epoch = epoch.wrapping_add(1));
    }
}

/// A loopback TCP proxy that forwards every connection to a target address with a
/// configurable one-way delay in each direction, and can simulate partitions
/// ([`cut`](Self::cut), [`blackhole`](Self::blackhole), [`heal`](Self::heal)).
///
/// Must be started inside a tokio runtime. Dropping the handle stops the accept loop and
/// every connection task (their sockets are closed).
#[derive(Debug)]
pub struct DelayProxy {
    addr: SocketAddr,
    target: SocketAddr,
    shared: Arc<Shared>,
    accept_task: JoinHandle<()>,
}

impl DelayProxy {
    /// Listen on 127.0.0.1:0 and forward every accepted connection to `target`
    /// (a "127.0.0.1:port" SocketAddr), adding `one_way` of latency in each direction.
    ///
    /// # Errors
    ///
    /// When the listening socket cannot be bound.
    pub async fn start(target: SocketAddr, one_way: Duration) -> io::Result<DelayProxy> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let (epoch, _) = watch::channel(0u64);
        let shared = Arc::new(Shared {
            delay_nanos: AtomicU64::new(duration_nanos(one_way)),
            mode: AtomicU8::new(MODE_FORWARD),
            connections: AtomicUsize::new(0),
            epoch,
        });
        let accept_task = tokio::spawn(accept_loop(listener, target, Arc::clone(&shared)));
        Ok(DelayProxy {
            addr,
            target,
            shared,
            accept_task,
        })
    }

    /// The address clients connect to (127.0.0.1 and the proxy's own port).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address every connection is forwarded to.
    pub fn target(&self) -> SocketAddr {
        self.target
    }

    /// The Redis URL of the proxy: `redis://127.0.0.1:<port>/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.addr.port())
    }

    /// Sets the one-way delay; it applies to bytes read after the call (bytes already in
    /// flight keep the deadline they were given).
    pub fn set_delay(&self, one_way: Duration) {
        self.shared
            .delay_nanos
            .store(duration_nanos(one_way), Ordering::Relaxed);
    }

    /// The current one-way delay.
    pub fn delay(&self) -> Duration {
        self.shared.delay()
    }

    /// Stop forwarding: existing connections are cut (both sockets closed), new ones are
    /// accepted and closed at once (so clients see a connection error, like a partition
    /// that resets). `heal()` resumes normal forwarding for new connections.
    pub fn cut(&self) {
        self.shared.mode.store(MODE_CUT, Ordering::SeqCst);
        self.shared.close_all();
    }

    /// Resumes normal forwarding for new connections. After [`blackhole`](Self::blackhole)
    /// the held-back bytes are dropped and the blackholed connections are closed; after
    /// [`cut`](Self::cut) the existing connections are already gone. Healing a proxy
    /// that forwards normally does nothing.
    pub fn heal(&self) {
        let previous = self.shared.mode.swap(MODE_FORWARD, Ordering::SeqCst);
        if previous != MODE_FORWARD {
            self.shared.close_all();
        }
    }

    /// Blackhole mode: keep connections open but forward nothing (bytes are read and held
    /// back, never delivered) until [`heal`](Self::heal), which drops the held bytes and
    /// closes those connections. New connections during blackhole are accepted and hang.
    pub fn blackhole(&self) {
        self.shared.mode.store(MODE_BLACKHOLE, Ordering::SeqCst);
    }

    /// The number of currently open client connections.
    pub fn connections(&self) -> usize {
        self.shared.connections.load(Ordering::SeqCst)
    }
}

impl Drop for DelayProxy {
    /// Stops the accept loop; the connection tasks it owns are aborted with it.
    fn drop(&mut self) {
        self.accept_task.abort();
        // Also ask every connection to close, in case the abort is delayed.
        self.shared.close_all();
    }
}

fn duration_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Accepts connections until aborted. The `JoinSet` owns every connection task, so
/// aborting this task (dropping the set) aborts them all.
async fn accept_loop(listener: TcpListener, target: SocketAddr, shared: Arc<Shared>) {
    let mut tasks = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => {
                    // Subscribe before reading the mode: a `cut` that lands after the
                    // mode check is then seen as an epoch change.
                    let epoch = shared.epoch.subscribe();
                    match shared.mode() {
                        MODE_CUT => drop(client),
                        mode => {
                            tasks.spawn(connection(
                                client,
                                target,
                                Arc::clone(&shared),
                                epoch,
                                mode == MODE_BLACKHOLE,
                            ));
                        }
                    }
                }
                Err(_) => tokio::time::sleep(ACCEPT_BACKOFF).await,
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
}

/// Decrements the connection counter when a connection task ends (or is aborted).
struct ConnectionGuard(Arc<Shared>);

impl ConnectionGuard {
    fn new(shared: &Arc<Shared>) -> ConnectionGuard {
        shared.connections.fetch_add(1, Ordering::SeqCst);
        ConnectionGuard(Arc::clone(shared))
    }
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Serves one client connection until it ends or the epoch changes (`cut`, `heal` after
/// a partition, or the proxy being dropped); returning closes every socket it owns.
async fn connection(
    client: TcpStream,
    target: SocketAddr,
    shared: Arc<Shared>,
    mut epoch: watch::Receiver<u64>,
    hang: bool,
) {
    let _guard = ConnectionGuard::new(&shared);
    let serve = async {
        if hang {
            swallow(client).await
        } else {
            forward(client, target, &shared).await
        }
    };
    tokio::select! {
        _ = serve => {}
        _ = epoch.changed() => {}
    }
}

/// Reads and discards everything the client sends, never answering (a blackholed
/// connection made during a partition).
async fn swallow(mut client: TcpStream) -> io::Result<()> {
    let mut buf = vec![0u8; CHUNK];
    while client.read(&mut buf).await? != 0 {}
    // The client closed its write half: keep the socket open, as a blackhole would.
    std::future::pending::<()>().await;
    Ok(())
}

/// Connects to `target` and pipes both directions with the configured delay.
async fn forward(client: TcpStream, target: SocketAddr, shared: &Shared) -> io::Result<()> {
    let upstream = TcpStream::connect(target).await?;
    client.set_nodelay(true)?;
    upstream.set_nodelay(true)?;
    let (client_read, client_write) = client.into_split();
    let (upstream_read, upstream_write) = upstream.into_split();
    // The first error in either direction ends both: all four halves are dropped and
    // both sockets closed.
    tokio::try_join!(
        pipe(client_read, upstream_write, shared),
        pipe(upstream_read, client_write, shared),
    )?;
    Ok(())
}

/// One direction: a reader stamping chunks with their delivery deadline and a writer
/// delivering them in order once due.
async fn pipe(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, shared: &Shared) -> io::Result<()> {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader = async move {
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = from.read(&mut buf).await?;
            if n == 0 {
                // EOF: dropping `tx` lets the writer drain and then shut down.
                return Ok::<(), io::Error>(());
            }
            if shared.mode() == MODE_BLACKHOLE {
                // Held back, never delivered.
                continue;
            }
            let deadline = Instant::now() + shared.delay();
            if tx.send((deadline, buf[..n].to_vec())).is_err() {
                return Ok(());
            }
        }
    };
    let writer = async move {
        while let Some((deadline, bytes)) = rx.recv().await {
            if deadline > Instant::now() {
                tokio::time::sleep_until(deadline).await;
            }
            if shared.mode() == MODE_BLACKHOLE {
                continue;
            }
            to.write_all(&bytes).await?;
        }
        if shared.mode() == MODE_BLACKHOLE {
            // Not even the EOF gets through a blackhole.
            std::future::pending::<()>().await;
        }
        to.shutdown().await
    };
    tokio::try_join!(reader, writer)?;
    Ok(())
}
