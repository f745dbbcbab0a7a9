//! Handing the refreshing over between the processes of a region.

use std::sync::{Arc, Mutex, mpsc};
use std::task::Poll;
use std::time::Duration;

use flowgate::Quota;
use flowgate::region::QuotaAllocator;
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{Cmd, Pipeline, RedisFuture, Value};

use crate::support::RedisServer;

/// Told that a call is held, and told to go on.
type Hold = (mpsc::Sender<()>, mpsc::Receiver<()>);

/// A local connection whose calls, once sent, reach Redis even if their caller drops them
/// (as a command already written to the socket does), and that can hold the next lease
/// report on its caller's thread, in the middle of the refresher's run, until told to go on.
#[derive(Clone)]
struct Held {
    inner: MultiplexedConnection,
    next_report: Arc<Mutex<Option<Hold>>>,
}

impl Held {
    fn new(inner: MultiplexedConnection) -> Held {
        Held {
            inner,
            next_report: Arc::default(),
        }
    }

    /// Hold the next report: it says when it is held, and waits for `go`.
    fn hold_next_report(&self) -> (mpsc::Receiver<()>, mpsc::Sender<()>) {
        let (entered, held) = mpsc::channel();
        let (go, wait) = mpsc::channel();
        *self.next_report.lock().unwrap() = Some((entered, wait));
        (held, go)
    }
}

impl ConnectionLike for Held {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let is_report = cmd
            .args_iter()
            .any(|a| matches!(a, redis::Arg::Simple(b"report")));
        let hold = if is_report {
            self.next_report.lock().unwrap().take()
        } else {
            None
        };
        let (mut inner, cmd) = (self.inner.clone(), cmd.clone());
        Box::pin(async move {
            if let Some((entered, wait)) = hold {
                let _ = entered.send(());
                let _ = wait.recv();
            }
            let mut sent = Box::pin(async move { inner.req_packed_command(&cmd).await });
            // Sent now; its reply is read whatever becomes of the caller.
            match futures::poll!(sent.as_mut()) {
                Poll::Ready(reply) => reply,
                Poll::Pending => tokio::spawn(sent).await.unwrap(),
            }
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        self.inner.req_packed_commands(cmd, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.inner.get_db()
    }
}

/// The last handle of the refreshing process drops while its refresher, running on
/// another thread, is renewing the refresher lock: the lock is given up after that
/// renewal, so another process takes the refreshing at once. (It was given up at once, and
/// the renewal took it again for a process that had stopped: the region had no refreshing
/// process until the lock lapsed, two refresh intervals and a home timeout later.)
#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn a_process_that_stops_as_it_renews_the_lock_gives_it_up_for_good() {
    let server = RedisServer::start();
    let refresh = Duration::from_millis(500);
    // A lock of 2 × 500 + 250 ms.
    let held = |conn| Held::new(conn);
    let alloc =
        QuotaAllocator::builder(held(server.connect().await), Quota::per_second(50).unwrap())
            .name("stopped")
            .region(("eu", 1))
            .lease(Duration::from_secs(20))
            .refresh_every(refresh)
            .home_timeout(refresh / 2)
            .build()
            .unwrap();
    alloc.init_home().await.unwrap();
    let local = held(server.connect().await);
    let first = alloc.join("eu", local.clone()).await.unwrap();
    assert!(first.status().leader, "{}", first.status());
    let (entered, go) = local.hold_next_report();
    let entered = tokio::task::spawn_blocking(move || entered.recv_timeout(refresh * 4))
        .await
        .unwrap();
    assert!(entered.is_ok(), "no refresh");
    drop(first);
    tokio::time::sleep(Duration::from_millis(100)).await;
    go.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stopped = std::time::Instant::now();
    let second = alloc
        .join("eu", held(server.connect().await))
        .await
        .unwrap();
    while !second.status().leader {
        assert!(
            stopped.elapsed() < refresh,
            "a process that stopped holds the lock: no takeover after {:?}",
            stopped.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        second.refresh_now().await;
    }
    println!(
        "took over {:?} after: {}",
        stopped.elapsed(),
        second.status()
    );
}
