//! A deploy that adds or removes a region runs processes that list different regions
//! against one home: the bound holds across them.

use std::time::Duration;

use flowgate::Quota;
use flowgate::region::{Allocation, QuotaAllocator, Region};

use crate::support::RedisServer;

/// Found in review ("the held sum counts only the listed regions"): in a rolling deploy
/// that adds `ap` (safe shares 0, static weights 50 / 30 / 20 of 300), the processes not
/// yet deployed list `us` and `eu` only, and granted those two what `ap` held: shares of
/// 187 + 112 + 60 = 359 per second against a global 300.
#[tokio::test]
async fn processes_that_do_not_list_a_region_leave_its_lease_alone() {
    let server = RedisServer::start();
    let quota = Quota::per_second(300).unwrap();
    let deployed = QuotaAllocator::builder(server.connect().await, quota)
        .name("deploy")
        .policy(Allocation::Static)
        .region(("us", 50))
        .region(("eu", 30))
        .region(("ap", 20))
        .build()
        .unwrap();
    let not_yet = QuotaAllocator::builder(server.connect().await, quota)
        .name("deploy")
        .policy(Allocation::Static)
        .region(("us", 50))
        .region(("eu", 30))
        .build()
        .unwrap();
    assert!(deployed.init_home().await.unwrap());
    let ap = deployed.join("ap", server.connect().await).await.unwrap();
    assert_eq!(ap.status().share, 60);
    let us = not_yet.join("us", server.connect().await).await.unwrap();
    let eu = not_yet.join("eu", server.connect().await).await.unwrap();
    let within_bound = || {
        let shares = [&ap, &us, &eu].map(|r| r.status().share);
        assert!(
            shares.iter().sum::<u64>() <= 300,
            "ap, us, eu admit at {shares:?} per second, more than 300 between them"
        );
    };
    within_bound();
    for _ in 0..2 {
        for region in [&us, &eu, &ap] {
            region.refresh_now().await;
            within_bound();
        }
    }
    // The deployed processes see what the others were granted.
    let held = deployed.status().await.unwrap().held();
    assert!(held <= 300, "the home holds {held}");
}

/// Every region asks for much more than the quota: rejected checks count as demand.
async fn want_more<C>(region: &flowgate::region::Region<C>)
where
    C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
{
    let gate = region.gate();
    for n in 0..50 {
        let _ = gate.check(&format!("k{n}"), 1).await.unwrap();
    }
    region.refresh_now().await;
}

type Conn = redis::aio::MultiplexedConnection;
type Allocator = QuotaAllocator<Conn>;

/// Two allocators over one fresh home and the same 300/s, written per second and per
/// minute; the home started by the one per second, and `us` joined from it.
async fn us_per_second() -> (RedisServer, Allocator, Allocator, Region<Conn>) {
    let server = RedisServer::start();
    let build = |conn, quota| {
        QuotaAllocator::builder(conn, quota)
            .name("period")
            .region(("us", 1))
            .region(("eu", 1))
            .lease(Duration::from_secs(1))
            .refresh_every(Duration::from_millis(200))
            .build()
            .unwrap()
    };
    let per_second = build(server.connect().await, Quota::per_second(300).unwrap());
    let per_minute = build(server.connect().await, Quota::per_minute(18_000).unwrap());
    assert!(per_second.init_home().await.unwrap());
    let us = per_second.join("us", server.connect().await).await.unwrap();
    (server, per_second, per_minute, us)
}

/// Found in review ("the home divides units of whichever period its caller has"): the
/// same global quota of 300/s written as `per_second(300)` in the processes not yet
/// deployed and as `per_minute(18000)` in the deployed ones. The home holds shares as bare
/// numbers of units per period: the per-minute process read us's 299 per second as 299 of
/// its 18 000 per minute, and granted eu 13 630 per minute (227/s) on top: 526/s between
/// them.
#[tokio::test]
async fn a_deploy_that_writes_the_quota_per_another_period_keeps_the_bound() {
    let (server, _per_second, per_minute, us) = us_per_second().await;
    let eu = per_minute.join("eu", server.connect().await).await.unwrap();
    for _ in 0..3 {
        for region in [&us, &eu] {
            want_more(region).await;
            let (us_s, eu_m) = (us.status().share, eu.status().share);
            // Per second: us's share per second, eu's per minute over 60.
            assert!(
                us_s * 60 + eu_m <= 300 * 60,
                "us admits at {us_s}/s and eu at {eu_m}/min: {}/s between them, more than 300",
                us_s as f64 + eu_m as f64 / 60.0
            );
        }
    }
    // Refused by the home while us holds a grant per second: a failed refresh, shown as
    // the home's answer.
    let st = eu.status();
    assert!(st.failures > 0 && st.home_reachable, "{st:?}");
    assert!(
        matches!(&st.home_error, Some(flowgate::region::HomeError::Refused(m)) if m.contains("holds shares per")),
        "{st:?}"
    );
    assert!(st.to_string().contains("home refused"), "{st}");
    // Once the last process per second has stopped and its lease ended, the home divides
    // per minute.
    assert!(us.leave().await);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    want_more(&eu).await;
    let st = eu.status();
    assert!(
        st.home_reachable && st.share > 0 && st.share <= 18_000,
        "{st:?}"
    );
}

/// A rolling deploy that lowers the global quota (300/s to 200/s, the period kept): while
/// processes of both run, the regions admit at most the larger; once every process runs
/// the new one, at most the new one, at the home and in the regions.
#[tokio::test]
async fn a_deploy_that_lowers_the_quota_keeps_the_larger_bound_then_the_new_one() {
    let server = RedisServer::start();
    let build = |conn, rate| {
        QuotaAllocator::builder(conn, Quota::per_second(rate).unwrap())
            .name("lower")
            .region(("us", 1))
            .region(("eu", 1))
            .build()
            .unwrap()
    };
    let old = build(server.connect().await, 300);
    let new = build(server.connect().await, 200);
    assert!(old.init_home().await.unwrap());
    let us = old.join("us", server.connect().await).await.unwrap();
    let eu = old.join("eu", server.connect().await).await.unwrap();
    for _ in 0..3 {
        for region in [&us, &eu] {
            want_more(region).await;
        }
    }
    let shares = |a: &flowgate::region::Region<_>, b: &flowgate::region::Region<_>| {
        a.status().share + b.status().share
    };
    assert_eq!(shares(&us, &eu), 300, "{} / {}", us.status(), eu.status());
    assert!(eu.leave().await);
    let eu = new.join("eu", server.connect().await).await.unwrap();
    for _ in 0..2 {
        for region in [&us, &eu] {
            want_more(region).await;
            assert!(shares(&us, &eu) <= 300, "{} / {}", us.status(), eu.status());
        }
    }
    assert!(us.leave().await);
    let us = new.join("us", server.connect().await).await.unwrap();
    for _ in 0..3 {
        for region in [&eu, &us] {
            want_more(region).await;
            assert!(shares(&us, &eu) <= 300, "{} / {}", us.status(), eu.status());
        }
    }
    assert!(shares(&us, &eu) <= 200, "{} / {}", us.status(), eu.status());
    let held = new.status().await.unwrap().held();
    assert!(held <= 200, "the home holds {held}");
}

/// Found in review: `QuotaAllocator::status` of a process whose quota has another period
/// than the home's shares read them in its own ("300 of 18000 per 60s held" for 300 per
/// second). It is refused, as that process's refreshes are.
#[tokio::test]
async fn the_status_of_a_process_of_another_period_is_refused() {
    let (_server, per_second, per_minute, us) = us_per_second().await;
    want_more(&us).await;
    assert!(per_second.status().await.unwrap().held() > 0);
    let status = per_minute.status().await;
    assert!(
        status
            .as_ref()
            .is_err_and(|e| e.to_string().contains("per 1000000 us")),
        "{status:?}"
    );
}
