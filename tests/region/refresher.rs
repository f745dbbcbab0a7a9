//! The refresher and its metrics: a metrics recorder is user code (an exporter may read the
//! region while it records; one may panic), and every process shows the lease in use.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use flowgate::Quota;
use flowgate::region::{QuotaAllocator, Region};

use crate::support::{RedisServer, TestRecorder};

type Conn = redis::aio::MultiplexedConnection;

/// An allocator `name` of one region `eu` at 50/s, home and local on `server`.
async fn one_region(
    server: &RedisServer,
    name: &str,
    lease: Duration,
    refresh: Duration,
) -> QuotaAllocator<Conn> {
    let alloc = QuotaAllocator::builder(server.connect().await, Quota::per_second(50).unwrap())
        .name(name)
        .region(("eu", 1))
        .lease(lease)
        .refresh_every(refresh)
        .home_timeout(refresh / 2)
        .build()
        .unwrap();
    alloc.init_home().await.unwrap();
    alloc
}

/// Join `eu` with its metrics going to `recorder`.
async fn join_recorded(
    alloc: &QuotaAllocator<Conn>,
    server: &RedisServer,
    recorder: &TestRecorder,
) -> Region<Conn> {
    let local = server.connect().await;
    // The handles are registered as `join` starts, on this thread.
    let _guard = metrics::set_default_local_recorder(recorder);
    alloc.join("eu", local).await.unwrap()
}

/// A recorder that reads the region's status whenever a gauge moves (an exporter
/// snapshotting it, say) takes the status lock. The refresher moved its gauges under it, so
/// the first refresh after the hook was set deadlocked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_refresher_records_outside_the_status_lock() {
    use std::sync::mpsc::RecvTimeoutError;

    let recorder = TestRecorder::default();
    let server = RedisServer::start();
    // No background refresh within the test: only `refresh_now` below, on its own thread.
    let alloc = one_region(
        &server,
        "exported",
        Duration::from_secs(60),
        Duration::from_secs(10),
    )
    .await;
    let region = join_recorded(&alloc, &server, &recorder).await;
    // Demand, so that the next refresh moves the gauges.
    let gate = region.gate();
    for _ in 0..5 {
        gate.check("api", 1).await.unwrap();
    }
    let exporter: Arc<OnceLock<Region<Conn>>> = Arc::default();
    let reads = exporter.clone();
    recorder.on_gauge(move || {
        if let Some(region) = reads.get() {
            let _ = region.status();
        }
    });
    assert!(exporter.set(region.clone()).is_ok());
    // On a thread of its own, so a deadlock fails the test instead of hanging it.
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(region.refresh_now());
        let _ = done.send(region.status().refreshes);
    });
    let refreshed =
        tokio::task::spawn_blocking(move || finished.recv_timeout(Duration::from_secs(5)))
            .await
            .unwrap();
    match refreshed {
        Ok(refreshes) => assert!(refreshes >= 2, "{refreshes} refreshes"),
        Err(RecvTimeoutError::Timeout) => {
            panic!("deadlocked: a gauge moved under the status lock")
        }
        Err(RecvTimeoutError::Disconnected) => panic!("the refresh's thread panicked"),
    }
    let share = recorder.gauge("flowgate_region_share{name=exported,region=eu}");
    assert!(share > Some(1.0), "the share follows the demand: {share:?}");
}

/// A recorder that panics as a refresh is counted: the refresher goes on at its next tick.
/// (The panic ended its task: the process never refreshed again, and its region fell to its
/// safe share when the lease ran out.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorder_that_panics_does_not_stop_the_refresher() {
    let recorder = TestRecorder::default();
    let server = RedisServer::start();
    let refresh = Duration::from_millis(100);
    let alloc = one_region(&server, "panicky", Duration::from_secs(2), refresh).await;
    let region = join_recorded(&alloc, &server, &recorder).await;
    let granted = "flowgate_region_refreshes_total{name=panicky,outcome=granted,region=eu}";
    let before = region.status().refreshes;
    recorder.panic_on(granted, true);
    // A refresh ran into the panic (it counts itself in the status first).
    let start = std::time::Instant::now();
    while region.status().refreshes == before {
        assert!(start.elapsed() < refresh * 20, "no refresh");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    recorder.panic_on(granted, false);
    let counted = recorder.counter(granted);
    tokio::time::sleep(refresh * 10).await;
    let status = region.status();
    let after = recorder.counter(granted) - counted;
    assert!(
        after >= 3,
        "{after} refreshes in the 10 intervals after the panic: {status}"
    );
    assert!(status.lease_left > Duration::from_secs(1), "{status}");
}
