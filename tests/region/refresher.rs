//! The refresher and its metrics: a metrics recorder is user code (an exporter may read the
//! region while it records; one may panic), and every process shows the lease in use.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use flowgate::Quota;
use flowgate::region::{QuotaAllocator, Region};

use crate::support::{Logs, RedisServer, TestRecorder};

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
///
/// Counted, not timed: a refresh's home call has half a refresh interval (50 ms), which a
/// loaded machine may exceed, so a refresh may fail by itself and the refreshes come later.
/// A refresher whose task ended never refreshes again, and the generous deadline fails it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorder_that_panics_does_not_stop_the_refresher() {
    const DEADLINE: Duration = Duration::from_secs(60);
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
        assert!(start.elapsed() < DEADLINE, "no refresh");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    recorder.panic_on(granted, false);
    let counted = recorder.counter(granted);
    // Three more refreshes, each granted a fresh lease.
    let start = std::time::Instant::now();
    while recorder.counter(granted) - counted < 3 {
        assert!(
            start.elapsed() < DEADLINE,
            "{} refreshes in {DEADLINE:?} after the panic: {}",
            recorder.counter(granted) - counted,
            region.status()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let status = region.status();
    assert!(status.lease_left > Duration::from_secs(1), "{status}");
}

/// `flowgate_region_lease_age_seconds` is the age of the lease in use in every process of
/// the region, also in those that do not refresh. Here the refreshing process is cut off
/// from the home and hands the refreshing over; after that it shows the age of the lease the
/// other one keeps fresh (under a refresh interval). (It went on showing 2.0 s, the age its
/// own lease had reached at its last failed refresh, for as long as it lived.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_that_does_not_refresh_shows_the_age_of_the_lease_in_use() {
    let home = RedisServer::start();
    let local = RedisServer::start();
    let home_addr = format!("127.0.0.1:{}", home.port()).parse().unwrap();
    let proxy = crate::support::DelayProxy::start(home_addr, Duration::ZERO)
        .await
        .unwrap();
    let refresh = Duration::from_secs(1);
    let build = |conn| {
        QuotaAllocator::builder(conn, Quota::per_second(50).unwrap())
            .name("aged")
            .region(("eu", 1))
            .lease(Duration::from_secs(10))
            .refresh_every(refresh)
            .home_timeout(Duration::from_millis(300))
            .build()
            .unwrap()
    };
    let via_proxy = build(super::fleet::manager(&proxy.url()).await);
    let direct = build(super::fleet::manager(&home.url()).await);
    direct.init_home().await.unwrap();
    // Each process its own recorder, as each its own exporter.
    let (seen_first, seen_second) = (TestRecorder::default(), TestRecorder::default());
    let join = |alloc: &QuotaAllocator<redis::aio::ConnectionManager>, recorder| {
        let alloc = alloc.clone();
        let url = local.url();
        async move {
            let local = super::fleet::manager(&url).await;
            let _guard = metrics::set_default_local_recorder(recorder);
            alloc.join("eu", local).await.unwrap()
        }
    };
    let first = join(&via_proxy, &seen_first).await;
    let second = join(&direct, &seen_second).await;
    assert!(first.status().leader && !second.status().leader);
    proxy.cut();
    let cut = std::time::Instant::now();
    while !second.status().leader {
        assert!(cut.elapsed() < refresh * 5, "no takeover");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The first process ticks twice more, as a follower.
    tokio::time::sleep(refresh * 2 + Duration::from_millis(100)).await;
    let age = "flowgate_region_lease_age_seconds{name=aged,region=eu}";
    let (status, shown) = (second.status(), seen_first.gauge(age).unwrap());
    println!("after the handover: {status}; the first process shows a lease {shown} s old");
    assert!(
        status.home_reachable && status.lease_left > refresh * 8,
        "{status}"
    );
    assert!(
        shown < 1.5,
        "the lease in use is under {refresh:?} old; the first process shows {shown} s"
    );
    drop((first, second));
}

/// An outage of the local Redis logs a warning at the 1st, 2nd, 4th … failed refresh in a
/// row, and the first refresh that works again says so, once; a later outage counts from
/// one again. The count was the process's failures in all, so the first failure of a
/// second outage (the 6th in all) went unlogged, and no line said the refreshes worked
/// again: an operator saw a warning and never its end.
#[tokio::test]
async fn refresh_failures_are_logged_by_their_count_in_a_row_and_the_recovery_once() {
    // Every thread's region events, this allocator's only (the other tests run alongside).
    let all = Logs::global();
    let mine = || {
        all.events()
            .into_iter()
            .filter(|e| e.field("allocator") == Some("logs"))
            .collect::<Vec<_>>()
    };
    let with = |part: &str| {
        mine()
            .into_iter()
            .filter(|e| e.message.contains(part))
            .collect::<Vec<_>>()
    };
    let home = RedisServer::start();
    let local = RedisServer::start();
    let alloc = QuotaAllocator::builder(home.connect().await, Quota::per_second(50).unwrap())
        .name("logs")
        .region(("eu", 1))
        .lease(Duration::from_secs(3600))
        .refresh_every(Duration::from_secs(600))
        .local_timeout(Duration::from_millis(100))
        // Generous: on a loaded host a slow home call would be one more failure in a row.
        .home_timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    alloc.init_home().await.unwrap();
    let region = alloc.join("eu", local.connect().await).await.unwrap();
    let warnings = || with("lease refresh failed");
    let recoveries = || with("lease refresh works again");
    let counts = |w: Vec<crate::support::Logged>| {
        w.iter()
            .map(|e| e.field("failures").unwrap_or("?").to_owned())
            .collect::<Vec<_>>()
    };
    // Refreshed until one works (on a loaded host a refresh may fail by itself).
    let refreshed = || async {
        for _ in 0..20 {
            let before = region.status().refreshes;
            region.refresh_now().await;
            if region.status().refreshes > before {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("no refresh worked: {:?}", mine());
    };
    refreshed().await;
    let (warned, recovered) = (warnings().len(), recoveries().len());

    local.pause();
    for _ in 0..5 {
        region.refresh_now().await;
    }
    local.resume();
    let outage = counts(warnings()).split_off(warned);
    assert_eq!(outage, ["1", "2", "4"], "{:?}", mine());
    assert_eq!(recoveries().len(), recovered);
    refreshed().await;
    let back = recoveries().split_off(recovered);
    assert_eq!(back.len(), 1, "{:?}", mine());
    assert_eq!(back[0].level, tracing::Level::INFO);
    // The five of the outage (and any refresh after it that failed by itself).
    let failed: u32 = back[0].field("failed").unwrap().parse().unwrap();
    assert!(failed >= 5, "{failed}");

    // A second outage counts from one again.
    let warned = warnings().len();
    local.pause();
    region.refresh_now().await;
    local.resume();
    assert_eq!(counts(warnings()).split_off(warned), ["1"]);
}

/// An outage of the home, with two processes in the region taking turns at the refresher
/// lock (each gives it up after two failed home calls), logs a few warnings per process
/// (its 1st, 2nd, 4th, 8th … failure in a row) and no recovery until a refresh works. A
/// process that gave the lock up and found the other holding it took that for a refresh
/// that worked: it said "lease refresh works again" with the home still away, and counted
/// its failures from one again, so each turn logged its first two failures once more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_home_outage_logs_no_recovery_while_the_processes_take_turns_at_the_lock() {
    let all = Logs::global();
    let mine = |part: &str| {
        all.events()
            .into_iter()
            .filter(|e| e.field("allocator") == Some("turns") && e.message.contains(part))
            .collect::<Vec<_>>()
    };
    let home = RedisServer::start();
    let local = RedisServer::start();
    let refresh = Duration::from_millis(400);
    // The home on `home` (home timeout 200 ms), the region's Redis on `local`.
    let alloc = one_region(&home, "turns", Duration::from_secs(60), refresh).await;
    let first = alloc.join("eu", local.connect().await).await.unwrap();
    let second = alloc.join("eu", local.connect().await).await.unwrap();
    assert!(first.status().leader && !second.status().leader);
    let (warned, recovered) = (
        mine("lease refresh failed").len(),
        mine("lease refresh works again").len(),
    );
    home.pause();
    // 15 refresh intervals: each process fails at most 15 times in a row.
    tokio::time::sleep(refresh * 15).await;
    let warnings = mine("lease refresh failed").split_off(warned);
    let recoveries = mine("lease refresh works again").split_off(recovered);
    home.resume();
    assert!(
        recoveries.is_empty(),
        "a recovery logged with the home away: {recoveries:?}"
    );
    let counts: Vec<_> = warnings
        .iter()
        .map(|e| e.field("failures").unwrap_or("?").to_owned())
        .collect();
    assert!(
        !warnings.is_empty() && warnings.len() <= 8,
        "the 1st, 2nd, 4th and 8th failures in a row of each process, not {counts:?}"
    );
    drop((first, second));
}

/// One refresh of region `eu` of a new allocator `name` (the default local timeout, 50 ms)
/// while its local Redis is paused: the warnings it logs (the refresher's, and the local
/// backend's as it turns to its failure policy), and how long it took.
async fn refresh_against_a_paused_local(name: &str) -> (Vec<crate::support::Logged>, Duration) {
    let all = Logs::global();
    let home = RedisServer::start();
    let local = RedisServer::start();
    let alloc = QuotaAllocator::builder(home.connect().await, Quota::per_second(50).unwrap())
        .name(name)
        .region(("eu", 1))
        .lease(Duration::from_secs(3600))
        .refresh_every(Duration::from_secs(600))
        .home_timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    alloc.init_home().await.unwrap();
    // No timeout of the client's own (500 ms by default): the refresh's ends the call.
    let region = alloc
        .join("eu", local.connect_untimed().await)
        .await
        .unwrap();
    local.pause();
    let started = std::time::Instant::now();
    region.refresh_now().await;
    let took = started.elapsed();
    local.resume();
    let gate = format!("{name}/eu");
    let warned = all
        .events()
        .into_iter()
        .filter(|e| {
            e.field("allocator") == Some(name) && e.message.contains("refresh failed")
                || e.field("gate") == Some(&gate) && e.message.contains("redis failed")
        })
        .collect();
    (warned, took)
}

/// A refresh that fails on the local Redis says why in its warning's `error` field, as one
/// that fails on the home does (the module docs list the field). It logged `error=None`:
/// the local Redis's error went to a debug line only, and the warning an operator reads
/// did not say which Redis failed, nor how.
#[tokio::test]
async fn a_refresh_failed_on_the_local_redis_says_why() {
    let (warned, _) = refresh_against_a_paused_local("local-error").await;
    let warned: Vec<_> = warned
        .into_iter()
        .filter(|e| e.field("allocator").is_some())
        .collect();
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert_eq!(warned[0].field("redis"), Some("local"), "{warned:?}");
    let error = warned[0].field("error");
    assert!(
        error.is_some_and(|e| e.contains("rate limit backend")),
        "{warned:?}"
    );
}

/// A refresh's call to the local Redis is given the local timeout or 500 ms, whichever is
/// longer (a refresh is rare; a decision is not): one that times out says how long it
/// waited. It said the local timeout (`did not answer within 50ms`, the default) after
/// waiting 500 ms, in the refresher's warning and in the backend's: an operator read a
/// Redis ten times faster than it was.
#[tokio::test]
async fn a_refresh_timed_out_on_the_local_redis_says_how_long_it_waited() {
    let (warned, took) = refresh_against_a_paused_local("local-wait").await;
    assert!(took >= Duration::from_millis(500), "{took:?}");
    // The refresher's warning, and the backend's.
    assert_eq!(warned.len(), 2, "{warned:?}");
    for w in &warned {
        let error = w.field("error").unwrap_or_default();
        assert!(error.contains("within 500ms"), "{warned:?}");
    }
}

/// The processes of [`CutOff`](super::config::CutOff) (a lease of 30 s, a refresh every
/// 5 s, a home timeout of 500 ms) of allocator `name`, their metrics going to `recorder`.
async fn cut_off_recorded(name: &str, recorder: &TestRecorder) -> super::config::CutOff {
    let _guard = metrics::set_default_local_recorder(recorder);
    super::config::CutOff::start(
        name,
        Duration::from_secs(30),
        Duration::from_secs(5),
        Duration::from_millis(500),
        Duration::ZERO,
    )
    .await
}

/// A recorder that panics as a failed refresh is counted does not keep a process cut off
/// from the home at the refresher lock: after two failed home calls it gives the lock up
/// all the same, and a process of the region that reaches the home takes over. (The panic
/// came before the failed call was counted towards the two: the process never gave the
/// lock up, renewed it at each refresh, and the region's lease ran out with another
/// process able to renew it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorder_that_panics_on_a_failure_does_not_keep_the_lock_from_the_others() {
    use futures::FutureExt;
    use std::panic::AssertUnwindSafe;

    // `first` refreshes, reaching the home through `proxy`; both record to `recorder` (the
    // `failed` count of `second`, which reaches the home, never moves).
    let recorder = TestRecorder::default();
    let pair = cut_off_recorded("panics-failing", &recorder).await;
    let (proxy, first, second) = (&pair.proxy, &pair.first, &pair.second);
    assert!(first.status().leader && !second.status().leader);
    recorder.panic_on(
        "flowgate_region_refreshes_total{name=panics-failing,outcome=failed,region=eu}",
        true,
    );
    // Its home calls time out (a round trip of 800 ms against a timeout of 500 ms).
    proxy.set_delay(Duration::from_millis(400));
    for _ in 0..2 {
        let refreshed = AssertUnwindSafe(first.refresh_now()).catch_unwind().await;
        assert!(refreshed.is_err(), "the recorder panics");
    }
    assert_eq!(first.status().failures, 2, "{}", first.status());
    second.refresh_now().await;
    let taken = second.status();
    assert!(
        taken.leader,
        "the process cut off from the home kept the lock: {taken:?}"
    );
    assert!(!first.status().leader, "{:?}", first.status());
}

/// A recorder that panics as the refresher lock is given up after two failed home calls
/// (the backend's latency histogram, once the release script has run) neither loses the
/// failed refresh's count nor leaves the process saying it refreshes: the lock is given
/// up, and another process of the region takes over. (The panic skipped the count and the
/// stand-down: `failed` counted one of the two, and the process said it held the lock
/// until it would have lapsed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorder_that_panics_as_a_process_stands_down_loses_nothing() {
    use futures::FutureExt;
    use std::panic::AssertUnwindSafe;
    use std::sync::atomic::{AtomicBool, Ordering};

    const NAME: &str = "panics-standing-down";
    let home_degraded = format!("flowgate_gate_degraded{{name={NAME}}}");
    let local_timed = format!("flowgate_gate_redis_seconds{{name={NAME},region=eu}}");
    let failed = format!("flowgate_region_refreshes_total{{name={NAME},outcome=failed,region=eu}}");
    let recorder = TestRecorder::default();
    let pair = cut_off_recorded(NAME, &recorder).await;
    let (proxy, first, second) = (&pair.proxy, &pair.first, &pair.second);
    assert!(first.status().leader && !second.status().leader);
    // Armed, the home's failure arms the panic of the next call to the local Redis: the
    // release that follows the second failed home call (its report went before).
    let armed = Arc::new(AtomicBool::new(false));
    recorder.on_gauge({
        let (recorder, armed, local_timed) = (recorder.clone(), armed.clone(), local_timed.clone());
        let home_degraded = home_degraded.clone();
        move || {
            if armed.load(Ordering::SeqCst) && recorder.gauge(&home_degraded) == Some(1.0) {
                recorder.panic_on(&local_timed, true);
            }
        }
    });
    // Its home calls time out (a round trip of 800 ms against a timeout of 500 ms).
    proxy.set_delay(Duration::from_millis(400));
    first.refresh_now().await;
    assert_eq!(first.status().failures, 1, "{}", first.status());
    // The home answers the allocator again (its backend healthy), not a refresh: the
    // failures in a row stay at one.
    proxy.set_delay(Duration::ZERO);
    // The timed-out call's reply, still on its way through the proxy, arrives first.
    tokio::time::sleep(Duration::from_millis(500)).await;
    pair.via_proxy.status().await.unwrap();
    assert_eq!(recorder.gauge(&home_degraded), Some(0.0));
    proxy.set_delay(Duration::from_millis(400));
    armed.store(true, Ordering::SeqCst);
    let refreshed = AssertUnwindSafe(first.refresh_now()).catch_unwind().await;
    armed.store(false, Ordering::SeqCst);
    recorder.panic_on(&local_timed, false);
    assert!(refreshed.is_err(), "the recorder panics");
    let status = first.status();
    assert_eq!(status.failures, 2, "{status}");
    assert_eq!(
        recorder.counter(&failed),
        2,
        "both failed refreshes counted"
    );
    assert!(!status.leader, "it gave the lock up: {status}");
    second.refresh_now().await;
    let taken = second.status();
    assert!(taken.leader, "the other process takes the lock: {taken:?}");
}

/// A recorder that panics as a call to the local Redis is timed (the backend's latency
/// histogram: the panic comes after the call's script ran) does not keep the refresher lock
/// from the region's other processes: the refresh gives the lock up before the panic goes
/// on, and another process takes over. (The report had taken or renewed the lock before
/// the panic: the process held it for good and never wrote a lease, and the region fell
/// to its safe share with another process able to refresh.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorder_that_panics_in_a_redis_call_does_not_keep_the_lock_from_the_others() {
    use futures::FutureExt;
    use std::panic::AssertUnwindSafe;

    let server = RedisServer::start();
    // No background refresh within the test: `refresh_now` only.
    let alloc = one_region(
        &server,
        "panics-timing",
        Duration::from_secs(60),
        Duration::from_secs(10),
    )
    .await;
    let recorder = TestRecorder::default();
    let first = join_recorded(&alloc, &server, &recorder).await;
    let second = alloc.join("eu", server.connect().await).await.unwrap();
    assert!(first.status().leader && !second.status().leader);
    recorder.panic_on(
        "flowgate_gate_redis_seconds{name=panics-timing,region=eu}",
        true,
    );
    let refreshed = AssertUnwindSafe(first.refresh_now()).catch_unwind().await;
    assert!(refreshed.is_err(), "the recorder panics");
    second.refresh_now().await;
    let taken = second.status();
    assert!(
        taken.leader,
        "the process whose recorder panics kept the lock: {taken:?}"
    );
    assert!(!first.status().leader, "{:?}", first.status());
}

/// An allocator `name` as [`one_region`]'s, whose lease (60 s) is refreshed every 10 s: no
/// background refresh within a test, only `refresh_now`.
async fn quiet_region(server: &RedisServer, name: &str) -> QuotaAllocator<Conn> {
    one_region(
        server,
        name,
        Duration::from_secs(60),
        Duration::from_secs(10),
    )
    .await
}

/// `region.refresh_now()`, which a recorder is set to make panic: whether it panicked.
async fn refresh_panics(region: &Region<Conn>) -> bool {
    use futures::FutureExt;
    std::panic::AssertUnwindSafe(region.refresh_now())
        .catch_unwind()
        .await
        .is_err()
}

/// 20 requests through `region`'s gate: demand that grows its share at the next refresh
/// (the one after it, with none over at least half a refresh interval, shrinks it).
async fn demand(region: &Region<Conn>) {
    let gate = region.gate();
    for _ in 0..20 {
        gate.check("api", 1).await.unwrap();
    }
}

/// A recorder for [`a_recorder_that_panics_in_the_ack_still_counts_the_grant`]: the
/// `TestRecorder`'s, except that the home's latency histogram panics on the `left`-th call
/// timed once `left` is set (the home's script has run by then), and records nothing.
struct HomeCallPanics {
    inner: TestRecorder,
    left: Arc<std::sync::atomic::AtomicU32>,
}

struct Countdown(Arc<std::sync::atomic::AtomicU32>);

impl metrics::HistogramFn for Countdown {
    fn record(&self, _: f64) {
        use std::sync::atomic::Ordering;
        let left = self.0.load(Ordering::SeqCst);
        if left > 0 {
            self.0.store(left - 1, Ordering::SeqCst);
            assert!(left != 1, "the recorder panics as the home call is timed");
        }
    }
}

impl metrics::Recorder for HomeCallPanics {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(
        &self,
        key: &metrics::Key,
        meta: &metrics::Metadata<'_>,
    ) -> metrics::Counter {
        metrics::Recorder::register_counter(&self.inner, key, meta)
    }
    fn register_gauge(&self, key: &metrics::Key, meta: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Recorder::register_gauge(&self.inner, key, meta)
    }
    fn register_histogram(
        &self,
        key: &metrics::Key,
        meta: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        let home = key.name() == "flowgate_gate_redis_seconds"
            && !key.labels().any(|l| l.key() == "region");
        if home {
            metrics::Histogram::from_arc(Arc::new(Countdown(self.left.clone())))
        } else {
            metrics::Recorder::register_histogram(&self.inner, key, meta)
        }
    }
}

/// A recorder that panics as the ack of a shrunk share is timed (the home's latency
/// histogram, once the ack's script has run) still counts the refresh as granted and sets
/// the region's gauges to the lease it wrote: the panic goes on after them. (It skipped
/// `flowgate_region_refreshes_total{outcome="granted"}` and the gauges: the lease was
/// written and in force, and counted nowhere.)
#[tokio::test]
async fn a_recorder_that_panics_in_the_ack_still_counts_the_grant() {
    use std::sync::atomic::{AtomicU32, Ordering};

    const NAME: &str = "panics-acking";
    let granted =
        format!("flowgate_region_refreshes_total{{name={NAME},outcome=granted,region=eu}}");
    let share = format!("flowgate_region_share{{name={NAME},region=eu}}");
    let server = RedisServer::start();
    let recorder = TestRecorder::default();
    let left = Arc::new(AtomicU32::new(0));
    let panics = HomeCallPanics {
        inner: recorder.clone(),
        left: left.clone(),
    };
    let region = {
        let _guard = metrics::set_default_local_recorder(&panics);
        let alloc = quiet_region(&server, NAME).await;
        alloc.join("eu", server.connect().await).await.unwrap()
    };
    // Demand grows the share; none shrinks it again, and the shrink is acked at once.
    demand(&region).await;
    region.refresh_now().await;
    let grown = region.status();
    assert!(grown.share > 1, "{grown}");
    let counted = recorder.counter(&granted);
    // Half a refresh interval without demand: a shorter window only raises it.
    tokio::time::sleep(Duration::from_millis(5100)).await;
    // The refresh's home call is timed first, then the ack's.
    left.store(2, Ordering::SeqCst);
    assert!(
        refresh_panics(&region).await,
        "the recorder's panic goes on"
    );
    assert_eq!(left.load(Ordering::SeqCst), 0, "the ack was made");
    let shrunk = region.status();
    assert!(shrunk.share < grown.share, "{shrunk}");
    assert_eq!(shrunk.refreshes, grown.refreshes + 1, "{shrunk}");
    assert_eq!(
        recorder.counter(&granted),
        counted + 1,
        "the refresh that got a lease counted"
    );
    assert_eq!(recorder.gauge(&share), Some(shrunk.share as f64));
}

/// A recorder that panics as a process that does not refresh counts its follower refresh
/// still lets it show the lease in use (`flowgate_region_share`): the panic goes on after
/// the gauges. (It skipped them: the process showed the share of the lease before.)
#[tokio::test]
async fn a_recorder_that_panics_on_a_follower_refresh_still_shows_the_share() {
    const NAME: &str = "panics-following";
    let server = RedisServer::start();
    let alloc = quiet_region(&server, NAME).await;
    let leader = alloc.join("eu", server.connect().await).await.unwrap();
    let recorder = TestRecorder::default();
    let follower = join_recorded(&alloc, &server, &recorder).await;
    assert!(leader.status().leader && !follower.status().leader);
    let share = format!("flowgate_region_share{{name={NAME},region=eu}}");
    let shown = recorder.gauge(&share);
    // Demand grows the share the leader keeps.
    demand(&leader).await;
    leader.refresh_now().await;
    let grown = leader.status().share;
    assert!(Some(grown as f64) > shown, "{grown} {shown:?}");
    recorder.panic_on(
        &format!("flowgate_region_refreshes_total{{name={NAME},outcome=follower,region=eu}}"),
        true,
    );
    assert!(
        refresh_panics(&follower).await,
        "the recorder's panic goes on"
    );
    assert_eq!(follower.status().share, grown);
    assert_eq!(recorder.gauge(&share), Some(grown as f64));
}

/// A recorder that panics as a failed refresh is counted still shows the age of the lease
/// in use (`flowgate_region_lease_age_seconds`): the panic goes on after the gauges. (It
/// skipped them: the gauge stayed at the 0 of the last grant.)
#[tokio::test]
async fn a_recorder_that_panics_on_a_failed_refresh_still_shows_the_lease_age() {
    const NAME: &str = "panics-aging";
    let server = RedisServer::start();
    let alloc = quiet_region(&server, NAME).await;
    let recorder = TestRecorder::default();
    let region = join_recorded(&alloc, &server, &recorder).await;
    let age = format!("flowgate_region_lease_age_seconds{{name={NAME},region=eu}}");
    assert_eq!(recorder.gauge(&age), Some(0.0), "a lease just granted");
    recorder.panic_on(
        &format!("flowgate_region_refreshes_total{{name={NAME},outcome=failed,region=eu}}"),
        true,
    );
    // The refresh's first call, to the local Redis, times out (after 500 ms).
    server.pause();
    let panicked = refresh_panics(&region).await;
    server.resume();
    assert!(panicked, "the recorder's panic goes on");
    assert_eq!(region.status().failures, 1, "{}", region.status());
    let shown = recorder.gauge(&age).unwrap();
    assert!(
        shown >= 0.5,
        "the lease is 0.5 s old or more; shown {shown} s"
    );
}
