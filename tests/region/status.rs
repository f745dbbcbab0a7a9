//! What a process's [`RegionStatus`](flowgate::region::RegionStatus) says: whether the home
//! was reached, and what the refreshing process measured.

use std::time::Duration;

use flowgate::Quota;
use flowgate::region::QuotaAllocator;
use redis::aio::MultiplexedConnection;

use crate::support::RedisServer;

/// An allocator named `name` of 50 a second with one region, `eu`, homed on `server`: a
/// 30 s lease refreshed every 5 s (no background tick within a test).
async fn fifty_a_second(server: &RedisServer, name: &str) -> QuotaAllocator<MultiplexedConnection> {
    let alloc = QuotaAllocator::builder(server.connect().await, Quota::per_second(50).unwrap())
        .name(name)
        .region(("eu", 1))
        .lease(Duration::from_secs(30))
        .refresh_every(Duration::from_secs(5))
        .build()
        .unwrap();
    alloc.init_home().await.unwrap();
    alloc
}

/// A refresh that got a lease from the home but could not write it to the local Redis (its
/// lease record went back meanwhile: a restart that lost writes) did reach the home, and
/// the status says so. (It kept the "home unreachable" of the failed refresh before, with
/// the home answering.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refresh_that_reached_the_home_shows_it_though_the_local_write_failed() {
    // `first` refreshes, reaching the home through `proxy`.
    let pair = super::config::CutOff::start(
        "written",
        Duration::from_secs(30),
        Duration::from_secs(5),
        Duration::from_millis(500),
        Duration::ZERO,
    )
    .await;
    let (proxy, region, local) = (&pair.proxy, &pair.first, &pair.servers.1);
    assert!(region.status().home_reachable, "{}", region.status());
    // The home call times out (a round trip of 800 ms against a timeout of 500 ms).
    proxy.set_delay(Duration::from_millis(400));
    region.refresh_now().await;
    assert!(!region.status().home_reachable, "{}", region.status());
    // The home answers again, in 200 ms; meanwhile the local Redis loses the lease record.
    proxy.set_delay(Duration::from_millis(100));
    let refreshing = tokio::spawn({
        let region = region.clone();
        async move { region.refresh_now().await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let _: i64 = local
        .query_blocking(redis::cmd("DEL").arg("{flowgate:region:written:eu}:lease"))
        .unwrap();
    refreshing.await.unwrap();
    let status = region.status();
    assert_eq!(status.failures, 2, "the lease was not written: {status}");
    assert!(status.home_reachable, "the home answered: {status}");
}

/// A process that refreshed, then lost the refresher lock to another process (it lapsed:
/// the process stalled, say), shows no demand and no utilisation, as a process that never
/// refreshed and as its metrics: both are measured by the refreshing process. (It went on
/// showing what it had measured as the refreshing process, however long ago.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_that_no_longer_refreshes_shows_no_demand_of_its_own() {
    let server = RedisServer::start();
    let alloc = fifty_a_second(&server, "former").await;
    let first = alloc.join("eu", server.connect().await).await.unwrap();
    let second = alloc.join("eu", server.connect().await).await.unwrap();
    let gate = first.gate();
    for _ in 0..20 {
        gate.check("api", 1).await.unwrap();
    }
    first.refresh_now().await;
    let lead = first.status();
    assert!(lead.leader && lead.demand > 0, "{lead}");
    assert!(lead.utilisation > 0.0, "{lead}");
    // The lock lapses, and the other process takes it.
    let _: i64 = server
        .query_blocking(redis::cmd("DEL").arg("{flowgate:region:former:eu}:lock"))
        .unwrap();
    second.refresh_now().await;
    assert!(second.status().leader, "{}", second.status());
    first.refresh_now().await;
    let former = first.status();
    assert!(!former.leader, "{former}");
    assert_eq!(
        (former.demand, former.utilisation),
        (0, 0.0),
        "measured by the refreshing process, not this one: {former}"
    );
}

/// A refreshing process whose home calls fail twice in a row gives the refresher lock up
/// and stands down, leaving the refreshing to another process of the region: its status
/// no longer says it refreshes, and once another process has taken the lock, one process
/// of the region says so, not two. (It kept `leader: true` until its next refresh, a
/// refresh interval later: an operator, or anything picking the region's share from its
/// leader's status, saw two refreshing processes.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_that_stood_down_no_longer_says_it_refreshes() {
    // No background tick within the test: `refresh_now` only.
    let pair = super::config::CutOff::start(
        "stood-down",
        Duration::from_secs(30),
        Duration::from_secs(5),
        Duration::from_millis(500),
        Duration::ZERO,
    )
    .await;
    let (proxy, first, second) = (&pair.proxy, &pair.first, &pair.second);
    assert!(first.status().leader && !second.status().leader);
    // Its home calls time out (a round trip of 800 ms against a timeout of 500 ms).
    proxy.set_delay(Duration::from_millis(400));
    first.refresh_now().await;
    assert!(first.status().leader, "{}", first.status());
    first.refresh_now().await;
    let stood_down = first.status();
    assert_eq!(stood_down.failures, 2, "{stood_down}");
    assert!(
        !stood_down.leader,
        "the lock was given up after two failed home calls: {stood_down:?}"
    );
    second.refresh_now().await;
    assert!(second.status().leader, "{}", second.status());
    assert!(!first.status().leader, "{:?}", first.status());
}

/// A process that refreshed while the home was learning, then lost the refresher lock to
/// another process, no longer says the home is learning once it has stopped: it shows
/// what it knows, not the phase of a refresh long gone, as it shows no demand of its own.
/// (It said "home learning" for as long as it followed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_that_no_longer_refreshes_does_not_show_a_learning_phase_long_over() {
    let server = RedisServer::start();
    let lease = Duration::from_secs(2);
    let alloc = QuotaAllocator::builder(server.connect().await, Quota::per_second(50).unwrap())
        .name("learnt")
        .region(("eu", 1))
        .lease(lease)
        .refresh_every(Duration::from_millis(400))
        .home_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    // No `init_home`: the home learns for a lease length from the first refresh.
    let first = alloc.join("eu", server.connect().await).await.unwrap();
    let second = alloc.join("eu", server.connect().await).await.unwrap();
    assert!(
        first.status().leader && first.status().learning,
        "{}",
        first.status()
    );
    // The lock lapses, and the other process takes it.
    let _: i64 = server
        .query_blocking(redis::cmd("DEL").arg("{flowgate:region:learnt:eu}:lock"))
        .unwrap();
    second.refresh_now().await;
    first.refresh_now().await;
    assert!(second.status().leader && !first.status().leader);
    // The learning phase ends a lease after the first refresh; the refreshing process's
    // next grants say so.
    tokio::time::sleep(lease + Duration::from_millis(500)).await;
    let (lead, former) = (second.status(), first.status());
    assert!(lead.leader && !lead.learning, "{lead}");
    assert!(!former.learning, "the learning phase is over: {former}");
}

/// A refreshing process cut off from its local Redis (its refreshes fail there) no longer
/// says it refreshes once the refresher lock it took may have lapsed: another process of
/// the region takes the lock then, and one process says it refreshes, not two. (It said
/// `leader: true` for as long as its local Redis stayed away: the lock had lapsed to the
/// other process long before.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_cut_off_from_its_local_redis_no_longer_says_it_refreshes() {
    let home = RedisServer::start();
    let local = RedisServer::start();
    let local_addr = format!("127.0.0.1:{}", local.port()).parse().unwrap();
    let proxy = crate::support::DelayProxy::start(local_addr, Duration::ZERO)
        .await
        .unwrap();
    // A lock of 2 × 500 + 250 ms.
    let refresh = Duration::from_millis(500);
    let alloc = QuotaAllocator::builder(
        super::fleet::manager(&home.url()).await,
        Quota::per_second(50).unwrap(),
    )
    .name("cut-local")
    .region(("eu", 1))
    .lease(Duration::from_secs(10))
    .refresh_every(refresh)
    .home_timeout(refresh / 2)
    .build()
    .unwrap();
    alloc.init_home().await.unwrap();
    let first = alloc
        .join("eu", super::fleet::manager(&proxy.url()).await)
        .await
        .unwrap();
    let second = alloc
        .join("eu", super::fleet::manager(&local.url()).await)
        .await
        .unwrap();
    assert!(first.status().leader && !second.status().leader);
    proxy.cut();
    let cut = std::time::Instant::now();
    while !second.status().leader {
        assert!(
            cut.elapsed() < refresh * 10,
            "no takeover: {}",
            second.status()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Its own refreshes failed meanwhile (one more, now, to be sure).
    first.refresh_now().await;
    let former = first.status();
    assert!(former.failures >= 1, "{former:?}");
    assert!(
        !former.leader,
        "the lock lapsed to the other process {:?} after the cut: {former:?}",
        cut.elapsed()
    );
}

/// A home without state (a first start that [`QuotaAllocator::init_home`] did not start, or
/// a restart that lost its state) learns from its first refresh: its status says so before
/// that refresh too, as the docs of `AllocatorStatus::learning` say (it restarted without
/// state). It said `learning: false` until a refresh came, then `true`: an operator who
/// read the home after a restart saw one that had kept its state.
#[tokio::test]
async fn a_home_without_state_says_it_learns() {
    let server = RedisServer::start();
    let alloc = QuotaAllocator::builder(server.connect().await, Quota::per_second(50).unwrap())
        .name("stateless")
        .region(("eu", 1))
        .build()
        .unwrap();
    let status = alloc.status().await.unwrap();
    assert!(status.learning, "{status}");
    assert_eq!(status.held(), 0, "{status}");
    assert!(flowgate::region::model::Home::empty().learning(1_000_000));
    // Told this is a first start, it does not learn.
    assert!(alloc.init_home().await.unwrap());
    let status = alloc.status().await.unwrap();
    assert!(!status.learning, "{status}");
}

/// A `refresh_now` right after a refresh (here the one `join` makes) measures the few
/// milliseconds since: the requests admitted in them, a burst from the region's bucket, are
/// what the region admitted in its last interval, not a rate kept up for one. The
/// utilisation is still admitted ÷ share over the last interval: what the short window
/// admitted, and the rest of the interval at the utilisation measured before. (It read the
/// burst as a rate: the one request a share of 1 a second let through, admitted in about
/// 3 ms, read as 29499 % of the share; it is 20 % of the interval's 5.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refresh_right_after_a_refresh_reads_no_burst_as_utilisation() {
    let server = RedisServer::start();
    let alloc = fifty_a_second(&server, "burst").await;
    let region = alloc.join("eu", server.connect().await).await.unwrap();
    let (before, share) = (region.status().utilisation, region.status().share);
    let gate = region.gate();
    let mut admitted = 0;
    for _ in 0..20 {
        admitted += u32::from(gate.check("api", 1).await.unwrap().allowed);
    }
    assert!(admitted > 0);
    region.refresh_now().await;
    let after = region.status();
    assert!(after.leader, "{after}");
    // At most what was admitted over an interval's share (5 s of the share in force), and
    // the few milliseconds of the interval before.
    let most = f64::from(admitted) / (5.0 * share as f64) + 0.01;
    assert!(
        after.utilisation > before && after.utilisation <= most,
        "a burst read as a rate: {after} (before: {before}, share {share}, at most {most})"
    );
}

/// Found in review ("says the home is unreachable when it answered"): a status said "home
/// unreachable" whenever the last call to the home failed, though the home had answered
/// with an error (here its state unreadable; in a deploy, a quota of another period), and
/// before this process had called the home at all (its local Redis down at `join`). Now it
/// tells an error answer (the home's reply) from no answer, and both from no call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_tells_an_error_answer_from_an_unreachable_home() {
    use flowgate::region::HomeError;

    let server = RedisServer::start();
    let alloc = fifty_a_second(&server, "answered").await;
    let region = alloc.join("eu", server.connect().await).await.unwrap();
    let status = region.status();
    assert!(status.home_reachable, "{status}");
    // The home's state is unreadable: it answers every refresh with an error.
    let _: i64 = server
        .query_blocking(
            redis::cmd("HSET")
                .arg("{flowgate:region:answered}:home")
                .arg("meta")
                .arg("garbage"),
        )
        .unwrap();
    region.refresh_now().await;
    let status = region.status();
    assert_eq!(status.failures, 1, "{status}");
    assert!(status.home_reachable, "the home answered: {status}");
    assert!(
        matches!(&status.home_error, Some(HomeError::Refused(m)) if m.contains("unreadable")),
        "{status:?}"
    );
    let shown = status.to_string();
    assert!(
        shown.contains("home refused") && shown.contains("unreadable"),
        "{shown}"
    );
    assert!(!shown.contains("unreachable"), "{shown}");

    // A home that is down: no answer, shown as such, with why.
    let down = RedisServer::start();
    let lazy = QuotaAllocator::builder(
        down.fast_failing_manager().await,
        Quota::per_second(50).unwrap(),
    )
    .name("down")
    .region(("eu", 1))
    .lease(Duration::from_secs(30))
    .refresh_every(Duration::from_secs(5))
    .build()
    .unwrap();
    down.kill();
    let cut = lazy
        .join("eu", server.fast_failing_manager().await)
        .await
        .unwrap();
    let status = cut.status();
    assert!(!status.home_reachable, "{status}");
    assert!(
        matches!(
            status.home_error,
            Some(HomeError::Unreachable(_) | HomeError::Timeout(_))
        ),
        "{status:?}"
    );
    assert!(status.to_string().contains("home unreachable"), "{status}");

    // A process whose local Redis is down at `join` never called the home: it does not say
    // the home is unreachable.
    let local = RedisServer::start();
    let conn = local.connect().await;
    local.kill();
    let alone = alloc.join("eu", conn).await.unwrap();
    let status = alone.status();
    assert_eq!((status.refreshes, status.failures), (0, 1), "{status}");
    assert!(
        !status.home_reachable && status.home_error.is_none(),
        "{status:?}"
    );
    assert!(!status.to_string().contains("unreachable"), "{status}");
}
