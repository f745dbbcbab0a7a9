//! A deploy that adds or removes a region runs processes that list different regions
//! against one home: the bound holds across them.

use flowgate::Quota;
use flowgate::region::{Allocation, QuotaAllocator};

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
