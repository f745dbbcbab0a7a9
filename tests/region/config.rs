//! Settings are validated with typed errors; the allocation policies' arithmetic.

use std::time::Duration;

use flowgate::region::{Allocation, QuotaAllocator, RegionSpec, SafeShare};
use flowgate::{ConfigErrorKind, Quota};
use proptest::prelude::*;

use crate::support::RedisServer;

async fn builder(
    server: &RedisServer,
) -> flowgate::region::QuotaAllocatorBuilder<redis::aio::MultiplexedConnection> {
    QuotaAllocator::builder(server.connect().await, Quota::per_second(100).unwrap())
}

#[tokio::test]
async fn bad_settings_are_typed_errors() {
    let server = RedisServer::start();
    let err = |r: Result<_, flowgate::ConfigError>| r.map(|_| ()).unwrap_err();
    let e = err(builder(&server).await.build());
    assert_eq!(
        (e.field(), e.kind()),
        ("region.regions", ConfigErrorKind::Zero)
    );
    let e = err(builder(&server)
        .await
        .region(("us", 1))
        .region(("us", 2))
        .build());
    assert_eq!(e.field(), "region.regions");
    assert!(e.to_string().contains("\"us\" is listed twice"), "{e}");
    let e = err(builder(&server).await.region(("", 1)).build());
    assert_eq!(e.field(), "region.regions");
    // Names are parts of Redis keys: "a:b" + "c" and "a" + "b:c" would share keys.
    let e = err(builder(&server).await.region(("b:c", 1)).build());
    assert_eq!(e.field(), "region.regions");
    let e = err(builder(&server).await.name("{a}").region(("b", 1)).build());
    assert_eq!(e.field(), "region.name");
    let e = err(builder(&server).await.region(("b", (1 << 20) + 1)).build());
    assert_eq!(
        (e.field(), e.kind()),
        ("region.regions", ConfigErrorKind::TooLarge)
    );
    let e = err(QuotaAllocator::builder(
        server.connect().await,
        Quota::per(40_000_000, Duration::from_secs(1)).unwrap(),
    )
    .region(("us", 1))
    .build());
    assert_eq!(
        (e.field(), e.kind()),
        ("region.quota", ConfigErrorKind::TooLarge)
    );
    let e = err(builder(&server)
        .await
        .region(RegionSpec::new("us", 1).safe_share(SafeShare::Units(60)))
        .region(RegionSpec::new("eu", 1).safe_share(SafeShare::Units(50)))
        .build());
    assert_eq!(
        (e.field(), e.kind()),
        ("region.safe_share", ConfigErrorKind::TooLarge)
    );
    let e = err(builder(&server)
        .await
        .region(("us", 0))
        .policy(Allocation::Static)
        .build());
    assert_eq!(
        (e.field(), e.kind()),
        ("region.regions", ConfigErrorKind::Zero)
    );
    let e = err(builder(&server)
        .await
        .region(("us", 1))
        .lease(Duration::ZERO)
        .build());
    assert_eq!(e.field(), "region.lease");
    let e = err(builder(&server)
        .await
        .region(("us", 1))
        .lease(Duration::from_secs(1))
        .refresh_every(Duration::from_millis(600))
        .build());
    assert_eq!(
        (e.field(), e.kind()),
        ("region.refresh", ConfigErrorKind::Inconsistent)
    );
    // 3 × 200 + 2 × 195 = 990 ms is shorter than the 1 s lease, but not by the margin
    // (1 % of the lease, at least 5 ms): the message must say what it asked for.
    let e = err(builder(&server)
        .await
        .region(("us", 1))
        .lease(Duration::from_secs(1))
        .refresh_every(Duration::from_millis(200))
        .home_timeout(Duration::from_millis(195))
        .build());
    assert_eq!(
        (e.field(), e.kind()),
        ("region.refresh", ConfigErrorKind::Inconsistent)
    );
    assert!(e.to_string().contains("margin (10ms)"), "{e}");
    builder(&server)
        .await
        .region(("us", 1))
        .lease(Duration::from_secs(1))
        .refresh_every(Duration::from_millis(200))
        .home_timeout(Duration::from_millis(190))
        .build()
        .unwrap();
    let e = err(builder(&server)
        .await
        .region(("us", 1))
        .refresh_every(Duration::from_millis(500))
        .home_timeout(Duration::from_millis(500))
        .build());
    assert_eq!(e.field(), "region.home_timeout");
    // The protocol counts in whole microseconds: a refresh under one would be a zero
    // retry_after for a region without a share (a caller told to come back at once), and a
    // home timeout under one can never be met.
    let e = err(builder(&server)
        .await
        .region(("us", 1))
        .refresh_every(Duration::from_nanos(500))
        .build());
    assert_eq!(
        (e.field(), e.kind()),
        ("region.refresh", ConfigErrorKind::Zero)
    );
    let e = err(builder(&server)
        .await
        .region(("us", 1))
        .refresh_every(Duration::from_millis(500))
        .home_timeout(Duration::from_nanos(999))
        .build());
    assert_eq!(
        (e.field(), e.kind()),
        ("region.home_timeout", ConfigErrorKind::Zero)
    );
    // Without an explicit home timeout, it follows a short refresh interval.
    builder(&server)
        .await
        .region(("us", 1))
        .refresh_every(Duration::from_millis(500))
        .build()
        .unwrap();
    for bad in [0.0, -1.0, 1.5, f64::NAN] {
        let e = err(builder(&server)
            .await
            .region(("us", 1))
            .smoothing(bad)
            .build());
        assert_eq!(e.field(), "region.smoothing");
    }
    let e = err(QuotaAllocator::builder(
        server.connect().await,
        Quota::per(1, Duration::from_nanos(1500)).unwrap(),
    )
    .region(("us", 1))
    .build());
    assert_eq!(e.field(), "region.quota");
    // A safe share by static weight is the region's weight of the capacity.
    let alloc = builder(&server)
        .await
        .region(("us", 3))
        .region(RegionSpec::new("eu", 1).safe_share(SafeShare::Units(5)))
        .safe_share(SafeShare::StaticWeight)
        .build()
        .unwrap();
    assert_eq!(alloc.safe_shares(), [("us", 75), ("eu", 5)]);
    // Joining a region that is not configured.
    let e = alloc
        .join("mars", server.connect().await)
        .await
        .unwrap_err();
    assert_eq!(e.field(), "region.name");
    assert!(e.to_string().contains("us, eu"), "{e}");
}

proptest! {
    /// Every policy: the parts never add up to more than the capacity; demand-driven parts
    /// never exceed a want; wants that fit are met.
    #[test]
    fn policies_never_give_more_than_the_capacity(
        capacity in 0u64..10_000,
        regions in prop::collection::vec((0u64..100, 0u64..5_000), 1..8),
    ) {
        let weights: Vec<u64> = regions.iter().map(|r| r.0).collect();
        let wants: Vec<u64> = regions.iter().map(|r| r.1).collect();
        for policy in [Allocation::Static, Allocation::FairShare, Allocation::ProportionalShare] {
            let parts = policy.divide(capacity, &weights, &wants);
            prop_assert_eq!(parts.len(), regions.len());
            prop_assert!(parts.iter().sum::<u64>() <= capacity, "{} {:?}", policy, parts);
            if policy != Allocation::Static {
                for (p, w) in parts.iter().zip(&wants) {
                    prop_assert!(p <= w);
                }
                if wants.iter().sum::<u64>() <= capacity {
                    prop_assert_eq!(&parts, &wants);
                }
            }
            // A split by weight (or by want, when the wants do not fit) leaves no unit of
            // the capacity to rounding.
            let by = if policy == Allocation::Static { &weights } else { &wants };
            let split = policy != Allocation::FairShare
                && by.iter().sum::<u64>() > 0
                && (policy == Allocation::Static || wants.iter().sum::<u64>() > capacity);
            if split {
                prop_assert_eq!(parts.iter().sum::<u64>(), capacity, "{} {:?}", policy, parts);
            }
        }
        // Max-min fairness: a region that got less than it wants got at least as much as
        // every other region (give or take the rounding unit).
        let fair = Allocation::FairShare.divide(capacity, &weights, &wants);
        for i in 0..fair.len() {
            if fair[i] < wants[i] {
                for j in 0..fair.len() {
                    prop_assert!(fair[i] + 1 >= fair[j], "{:?} wants {:?}", fair, wants);
                }
            }
        }
    }
}

/// A region's gate: bad requests are typed errors without a call; a dead local Redis is
/// decided by the gate's failure policy; one region alone gets the whole quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_gate_checks_its_input_and_follows_its_failure_policy() {
    let home = RedisServer::start();
    let local = RedisServer::start();
    let alloc = QuotaAllocator::builder(
        home.fast_failing_manager().await,
        Quota::per_second(100).unwrap().burst(10).unwrap(),
    )
    .name("solo")
    .region(("only", 1))
    // The background refresh (every second) stays out of the way of `refresh_now` here.
    .lease(Duration::from_secs(5))
    .refresh_every(Duration::from_secs(1))
    .home_timeout(Duration::from_millis(500))
    // Generous: a check that times out on a loaded machine leaves the gate degraded (until
    // its probe, a refresh interval later) and fails the checks after it. The dead local
    // Redis below refuses the connection at once.
    .local_timeout(Duration::from_secs(5))
    .build()
    .unwrap();
    assert!(alloc.init_home().await.unwrap());
    assert!(!alloc.init_home().await.unwrap(), "the home has state now");
    let region = alloc
        .join("only", local.fast_failing_manager().await)
        .await
        .unwrap();
    let gate = region.gate();
    assert!(matches!(
        gate.check("k", 0).await,
        Err(flowgate::gate::GateError::Cost(_))
    ));
    assert!(matches!(
        gate.check("k", 11).await,
        Err(flowgate::gate::GateError::Cost(_))
    ));
    assert!(matches!(
        gate.check("", 1).await,
        Err(flowgate::gate::GateError::InvalidKey(_))
    ));
    // No all-or-nothing `check_all`: what is built over the gate (an HTTP layer's
    // policies) is refused when built.
    let e =
        flowgate::gate::Gate::validate_quotas(&gate, &[Quota::per_second(1).unwrap()]).unwrap_err();
    assert_eq!(e.field(), "gate.check_all");
    // The first refresh reported no demand (a share of 1); the next one sees the rejected
    // requests and grants the whole quota.
    let mut admitted = 0;
    for _ in 0..40 {
        admitted += u32::from(gate.check("k", 1).await.unwrap().allowed);
    }
    assert_eq!(admitted, 1, "a share of 1 per second holds one request");
    // Refreshed until one is granted: on a loaded machine a home call may pass its 500 ms.
    let before = region.status().refreshes;
    let mut asked = std::time::Instant::now();
    for _ in 0..20 {
        asked = std::time::Instant::now();
        region.refresh_now().await;
        if region.status().refreshes > before {
            break;
        }
    }
    let status = region.status();
    let since = asked.elapsed();
    assert!(status.leader);
    assert_eq!(status.share, 100, "{status}");
    // The lease (5 s less its 1 % margin) counts from the start of the refresh.
    assert!(
        status.lease_left + since > Duration::from_millis(4900),
        "{status}, {since:?} after the refresh started"
    );
    let home_view = alloc.status().await.unwrap();
    assert_eq!(home_view.held(), 100, "{home_view}");
    // A bigger share brings no tokens with it: the bucket fills at the new rate (100/s),
    // its whole burst of 10 within 100 ms.
    let d = gate.check("k", 10).await.unwrap();
    assert!(!d.allowed, "tokens appeared with the share: {d:?}");
    assert!(d.retry_after <= Duration::from_millis(100), "{d:?}");
    tokio::time::sleep(Duration::from_millis(110)).await;
    let d = gate.check("k", 10).await.unwrap();
    assert!(d.allowed, "the bucket fills at the new share: {d:?}");
    assert_eq!(d.capacity, 10);
    // A bucket that is not one (written by something else): that key fails alone.
    let mut con = local.connect().await;
    let _: () = redis::cmd("SET")
        .arg("{flowgate:region:solo:only}:bucket:garbled")
        .arg("not a bucket")
        .query_async(&mut con)
        .await
        .unwrap();
    assert!(matches!(
        gate.check("garbled", 1).await,
        Err(flowgate::gate::GateError::UnreadableKey(_))
    ));
    assert!(gate.check("k", 1).await.is_ok(), "the gate stays healthy");
    // A reply that was in flight when the record went back (lost writes) is not written.
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(flowgate::gate::lua::REGION_SHARE)
        .arg(3)
        .arg("{t}:lease")
        .arg("{t}:demand")
        .arg("{t}:lock")
        .arg("apply")
        .arg("")
        .arg(&[9i64, 100, 1_000_000, 1 << 52, 0, 0, 0, 5][..]);
    let v: Vec<i64> = cmd.query_async(&mut con).await.unwrap();
    assert_eq!(
        v,
        [0, -1],
        "the record (none) is older than the seq read (5)"
    );
    local.kill();
    assert!(
        gate.check("k", 1).await.is_err(),
        "FailurePolicy::Error returns the error"
    );
    let closed = region.gate_with(flowgate::gate::FailurePolicy::Closed);
    let d = closed.check("k", 1).await.unwrap();
    assert!(d.is_fail_closed(), "{d:?}");
}

/// An allocator `name` of one region, `eu`, at 50/s (a 5 s lease refreshed every second),
/// its home started fresh and its local Redis both on `server`, and `eu` joined.
async fn eu_joined(
    server: &RedisServer,
    name: &str,
) -> flowgate::region::Region<redis::aio::MultiplexedConnection> {
    let alloc = QuotaAllocator::builder(server.connect().await, Quota::per_second(50).unwrap())
        .name(name)
        .region(("eu", 1))
        .lease(Duration::from_secs(5))
        .refresh_every(Duration::from_secs(1))
        .home_timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    alloc.init_home().await.unwrap();
    alloc.join("eu", server.connect().await).await.unwrap()
}

/// The region's metrics carry the allocator's name and the region, never a user key.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn region_metrics_are_labelled_by_allocator_and_region() {
    let recorder = crate::support::TestRecorder::default();
    let _guard = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    let region = eu_joined(&server, "metered").await;
    let gate = region.gate();
    for _ in 0..5 {
        gate.check("tenant-7", 1).await.unwrap();
    }
    region.refresh_now().await;
    let id = |m: &str| format!("{m}{{name=metered,region=eu}}");
    assert_eq!(recorder.gauge(&id("flowgate_region_share")), Some(50.0));
    assert!(recorder.gauge(&id("flowgate_region_demand")).unwrap() > 0.0);
    assert!(recorder.gauge(&id("flowgate_region_utilisation")).is_some());
    assert_eq!(
        recorder.gauge(&id("flowgate_region_lease_age_seconds")),
        Some(0.0)
    );
    assert_eq!(
        recorder.counter("flowgate_region_refreshes_total{name=metered,outcome=granted,region=eu}"),
        2
    );
    let decisions = |o: &str| {
        recorder.counter(&format!(
            "flowgate_gate_decisions_total{{name=metered,outcome={o},region=eu}}"
        ))
    };
    assert_eq!(decisions("allowed") + decisions("rejected"), 5);
    assert!(
        recorder.ids().iter().all(|id| !id.contains("tenant-7")),
        "a user key became a label"
    );
}

/// A region gate's check given up while its script call is in flight: the local Redis
/// decides (and charges) it all the same, and the decision is counted in
/// `flowgate_gate_decisions_total` when Redis answers, as a `RedisGate` counts the
/// decision of a caller that gave up. It was counted under no outcome at all.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn a_region_check_given_up_mid_call_is_still_counted() {
    let recorder = crate::support::TestRecorder::default();
    let _guard = metrics::set_default_local_recorder(&recorder);
    let home = RedisServer::start();
    let local = RedisServer::start();
    let alloc = QuotaAllocator::builder(home.connect().await, Quota::per_second(50).unwrap())
        .name("gaveup")
        .region(("eu", 1))
        .lease(Duration::from_secs(5))
        .refresh_every(Duration::from_secs(1))
        .home_timeout(Duration::from_millis(500))
        .local_timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    alloc.init_home().await.unwrap();
    // No client-side response timeout (redis-rs's is 500 ms): the call given up waits on the
    // paused server for as long as the pause lasts under load, and is then answered and
    // counted, bounded by the local timeout (60 s).
    let region = alloc
        .join("eu", local.connect_untimed().await)
        .await
        .unwrap();
    let gate = region.gate();
    let decisions = |o: &str| {
        recorder.counter(&format!(
            "flowgate_gate_decisions_total{{name=gaveup,outcome={o},region=eu}}"
        ))
    };
    assert!(gate.check("warm", 1).await.unwrap().allowed);
    assert_eq!(decisions("allowed"), 1);
    local.pause();
    let mut call = Box::pin(gate.check("k", 1));
    assert!(
        futures::poll!(call.as_mut()).is_pending(),
        "waits for redis"
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(call);
    local.resume();
    let mut con = local.connect().await;
    let charged: u64 = redis::cmd("EVAL")
        .arg("local n = 0 for _, k in ipairs(redis.call('KEYS', '*')) do if string.find(k, ':k', 1, true) then n = n + 1 end end return n")
        .arg(0)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(
        charged, 1,
        "the local redis charged the caller that gave up"
    );
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while decisions("allowed") < 2 && std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(
        decisions("allowed") + decisions("rejected"),
        2,
        "the decision of the caller that gave up is counted"
    );
}

/// A request a region's gate refuses with `UnreadableKey` (its bucket key holds a value the
/// script cannot read) is counted under `outcome="unreadable_key"`, as a `RedisGate` counts
/// it: it is neither admitted nor rejected by the share, and Redis did not fail, so no
/// other count shows that a key refuses every request made on it (before: counted nowhere).
#[cfg(feature = "metrics")]
#[tokio::test]
async fn a_request_refused_for_an_unreadable_key_is_counted() {
    let recorder = crate::support::TestRecorder::default();
    let _guard = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    let region = eu_joined(&server, "unreadable").await;
    let gate = region.gate();
    let hash = redis::cmd("HSET")
        .arg("{flowgate:region:unreadable:eu}:bucket:hash")
        .arg("f")
        .arg("v")
        .clone();
    let _: () = server.query_blocking(&hash).unwrap();
    let garbage = redis::cmd("SET")
        .arg("{flowgate:region:unreadable:eu}:bucket:garbage")
        .arg("not a bucket")
        .clone();
    let _: () = server.query_blocking(&garbage).unwrap();
    for key in ["hash", "garbage", "good"] {
        let r = gate.check(key, 1).await;
        if key == "good" {
            assert!(r.is_ok(), "{r:?}");
        } else {
            assert!(
                matches!(r, Err(flowgate::gate::GateError::UnreadableKey(_))),
                "{key}: {r:?}"
            );
        }
    }
    let decisions = |o: &str| {
        recorder.counter(&format!(
            "flowgate_gate_decisions_total{{name=unreadable,outcome={o},region=eu}}"
        ))
    };
    assert_eq!(decisions("unreadable_key"), 2);
    assert_eq!(decisions("allowed") + decisions("rejected"), 1);
    assert_eq!(decisions("policy"), 0);
}

/// A lease record the scripts cannot read fails every request of the region, and the error
/// names the key to delete, as `RegionGate`'s docs say: one of another type (a hash) as one
/// of the wrong bytes. (Of another type, the error was Redis's `WRONGTYPE Operation against
/// a key holding the wrong kind of value`, with no key.)
#[tokio::test]
async fn an_unreadable_lease_record_is_named_in_the_error() {
    let server = RedisServer::start();
    for what in ["bytes", "hash"] {
        // An allocator each: the first failure degrades the gate (then the requests until
        // its next probe fail without Redis's error).
        let name = format!("unnamed-{what}");
        let region = eu_joined(&server, &name).await;
        let record = format!("{{flowgate:region:{name}:eu}}:lease");
        let mut write = redis::cmd("DEL");
        write.arg(&record);
        let _: i64 = server.query_blocking(&write).unwrap();
        let write = if what == "bytes" {
            redis::cmd("SET").arg(&record).arg("not a lease").clone()
        } else {
            redis::cmd("HSET").arg(&record).arg("f").arg("v").clone()
        };
        let _: redis::Value = server.query_blocking(&write).unwrap();
        let r = region.gate().check("api", 1).await;
        assert!(
            r.as_ref().is_err_and(|e| e.to_string().contains(&record)),
            "a lease record of {what}: {r:?}"
        );
    }
}

/// A new key when the region's local Redis is full (`maxmemory` under `noeviction`): Redis
/// refuses every write, a new key's as a known one's, so the gate answers as its failure
/// policy says (a typed, transient `GateError::Backend` under `Error`, a rejection under
/// `Closed`), counted under `policy` and in `flowgate_gate_failures_total`. Once room frees
/// the next probe of the local Redis (a refresh interval at most) decides the new key again.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn a_new_key_on_a_full_local_redis_is_a_counted_typed_answer_until_room_frees() {
    let recorder = crate::support::TestRecorder::default();
    let _guard = metrics::set_default_local_recorder(&recorder);
    let home = RedisServer::start();
    let local = RedisServer::start();
    let refresh = Duration::from_millis(500);
    let alloc = QuotaAllocator::builder(home.connect().await, Quota::per_second(50).unwrap())
        .name("full")
        .region(("eu", 1))
        .lease(Duration::from_secs(10))
        .refresh_every(refresh)
        .home_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    alloc.init_home().await.unwrap();
    let region = alloc.join("eu", local.connect().await).await.unwrap();
    let gate = region.gate();
    let closed = region.gate_with(flowgate::gate::FailurePolicy::Closed);
    assert!(gate.check("known", 1).await.unwrap().allowed);
    let config = |name: &str, value: &str| {
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("SET").arg(name).arg(value);
        let _: () = local.query_blocking(&cmd).unwrap();
    };
    config("maxmemory-policy", "noeviction");
    config("maxmemory", "1");
    let is_backend = |r: Result<flowgate::Decision, flowgate::gate::GateError>| match r {
        Err(
            e
            @ (flowgate::gate::GateError::Backend(_) | flowgate::gate::GateError::Degraded { .. }),
        ) => e.is_transient(),
        _ => false,
    };
    assert!(is_backend(gate.check("new", 1).await));
    assert!(is_backend(gate.check("known", 1).await));
    let d = closed.check("new", 1).await.unwrap();
    assert!(!d.allowed && d.retry_after <= refresh, "{d:?}");
    let counter = |name: &str, labels: &str| recorder.counter(&format!("{name}{{{labels}}}"));
    assert_eq!(
        counter(
            "flowgate_gate_decisions_total",
            "name=full,outcome=policy,region=eu"
        ),
        3
    );
    assert!(counter("flowgate_gate_failures_total", "name=full,region=eu") >= 1);
    config("maxmemory", "0");
    let freed = std::time::Instant::now();
    let decided = loop {
        if let Ok(d) = gate.check("new", 1).await {
            break d;
        }
        assert!(
            freed.elapsed() < refresh * 3,
            "still failing {:?} after room freed",
            freed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(decided.allowed, "{decided:?}");
}

/// One process of a region refreshes at a time; when it stops it gives its lock up, and
/// another takes over at its next refresh (200 ms here), long before the lease runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_process_takes_over_the_refreshing() {
    let home = RedisServer::start();
    let local = RedisServer::start();
    let alloc = QuotaAllocator::builder(home.connect().await, Quota::per_second(50).unwrap())
        .name("takeover")
        .region(("eu", 1))
        .lease(Duration::from_secs(2))
        .refresh_every(Duration::from_millis(200))
        .home_timeout(Duration::from_millis(150))
        .build()
        .unwrap();
    alloc.init_home().await.unwrap();
    let first = alloc.join("eu", local.connect().await).await.unwrap();
    let second = alloc.join("eu", local.connect().await).await.unwrap();
    assert!(first.status().leader);
    assert!(!second.status().leader);
    // A process that does not refresh still shows the region's lease.
    second.refresh_now().await;
    let (lead, follow) = (first.status(), second.status());
    assert_eq!(follow.share, lead.share, "{follow}");
    assert!(follow.lease_left > Duration::from_millis(1000), "{follow}");
    drop(first);
    let stopped = std::time::Instant::now();
    while !second.status().leader {
        // Without the release it would wait for the lock to lapse (550 ms after its last
        // renewal).
        assert!(
            stopped.elapsed() < Duration::from_millis(400),
            "no takeover after {:?}",
            stopped.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = stopped.elapsed();
    tokio::time::sleep(Duration::from_millis(250)).await;
    let status = second.status();
    println!("took over after {took:?}: {status}");
    assert!(status.lease_left > Duration::from_millis(1500), "{status}");
}

/// A cost above the region's part of the burst cannot pass at its share now, but can at a
/// bigger share the home may grant: rejected, with the next refresh as the time to retry
/// (not a retry_after that would pass no sooner).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_above_the_regions_bucket_waits_for_a_bigger_share() {
    let server = RedisServer::start();
    let alloc = QuotaAllocator::builder(
        server.connect().await,
        Quota::per_second(100).unwrap().burst(10).unwrap(),
    )
    .name("grows")
    .region(("a", 1))
    .region(("b", 1))
    .lease(Duration::from_secs(5))
    .refresh_every(Duration::from_secs(1))
    .build()
    .unwrap();
    alloc.init_home().await.unwrap();
    let a = alloc.join("a", server.connect().await).await.unwrap();
    // No demand reported yet: a share of 1 per second, a bucket of one token.
    assert_eq!(a.status().share, 1);
    let gate = a.gate();
    let d = gate.check("k", 8).await.unwrap();
    assert!(!d.allowed);
    assert_eq!(d.capacity, 1, "a's part of the burst at its share");
    assert_eq!(d.retry_after, Duration::from_secs(1), "{d:?}");
}

/// A region whose callers wait the `retry_after` they are given (a shaping `gated` stream,
/// an HTTP client honouring `Retry-After`) gets the share its demand needs. Told to wait
/// until the next token at its share of 1 per second (1 s, longer than the refresh
/// interval), such a caller showed up in one refresh of five: the others measured a demand
/// of nothing, which replaced the average, and the share fell back to 1 before the caller
/// came back; the region admitted 1 per second for good with 99 of the quota unused
/// (with a quota per minute or per hour, a wait of a minute or an hour at a share of 1, the
/// same at the default settings).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_of_callers_that_wait_their_retry_after_gets_the_share_they_need() {
    use flowgate::FlowStreamExt;
    use futures::StreamExt;

    let server = RedisServer::start();
    let alloc = QuotaAllocator::builder(
        server.connect().await,
        Quota::per_second(100).unwrap().burst(10).unwrap(),
    )
    .name("polite")
    .region(("a", 1))
    .region(("b", 1))
    .lease(Duration::from_secs(1))
    .refresh_every(Duration::from_millis(200))
    .home_timeout(Duration::from_millis(150))
    .build()
    .unwrap();
    alloc.init_home().await.unwrap();
    let a = alloc.join("a", server.connect().await).await.unwrap();
    let _b = alloc.join("b", server.connect().await).await.unwrap();
    // No demand reported yet: a share of 1 per second.
    assert_eq!(a.status().share, 1);
    let items = futures::stream::iter(0u64..).gated(a.gate(), |_: &u64| "partner-api");
    let run = Duration::from_secs(4);
    let admitted = items.take_until(tokio::time::sleep(run)).count().await;
    // Growing by an eighth and more per refresh, the share reaches the quota within about
    // 1.5 s: at least a quarter of the 100 per second over the run.
    assert!(
        admitted >= 100,
        "admitted {admitted} in {run:?}: {}",
        a.status()
    );
}

/// A cost above every bucket the region can ever hold (its static share's part of the
/// burst; or, by demand, the quota less the others' safe shares) can never pass: the gate
/// says so with a cost error (as for a cost above the global burst), instead of a
/// `retry_after` after which it is refused again, for ever (a shaping `gated` stream would
/// wait on that item without end).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_above_every_bucket_the_region_can_hold_is_a_cost_error() {
    use flowgate::CostError;
    use flowgate::gate::GateError;

    let server = RedisServer::start();
    let quota = Quota::per_second(100).unwrap().burst(10).unwrap();
    // A static split: a's share is 50 for good, its bucket 5 tokens.
    let alloc = QuotaAllocator::builder(server.connect().await, quota)
        .name("halves")
        .region(("a", 1))
        .region(("b", 1))
        .policy(Allocation::Static)
        .lease(Duration::from_secs(5))
        .refresh_every(Duration::from_secs(1))
        .build()
        .unwrap();
    alloc.init_home().await.unwrap();
    let a = alloc.join("a", server.connect().await).await.unwrap();
    assert_eq!(a.status().share, 50);
    let gate = a.gate();
    match gate.check("k", 8).await {
        Err(GateError::Cost(CostError::ExceedsCapacity { cost, capacity })) => {
            assert_eq!((cost, capacity), (8, 5));
        }
        other => panic!("a cost the static share can never hold: {other:?}"),
    }
    assert!(gate.check("k", 5).await.unwrap().allowed);
    // By demand, b's safe share of 60 is never a's: a's share is at most 40, a bucket of 4.
    let alloc = QuotaAllocator::builder(server.connect().await, quota)
        .name("reserved")
        .region(("a", 1))
        .region(RegionSpec::new("b", 1).safe_share(SafeShare::Units(60)))
        .lease(Duration::from_secs(5))
        .refresh_every(Duration::from_secs(1))
        .build()
        .unwrap();
    alloc.init_home().await.unwrap();
    let a = alloc.join("a", server.connect().await).await.unwrap();
    let gate = a.gate();
    match gate.check("k", 5).await {
        Err(GateError::Cost(CostError::ExceedsCapacity { cost, capacity })) => {
            assert_eq!((cost, capacity), (5, 4));
        }
        other => panic!("a cost no share of a can hold: {other:?}"),
    }
    // 4 fits a share of 40: it waits for the share to grow.
    let d = gate.check("k", 4).await.unwrap();
    assert!(!d.allowed);
    assert_eq!(d.retry_after, Duration::from_secs(1), "{d:?}");
}

/// A global quota smaller than the number of regions (1 per second over three) is not
/// rounded away: a static split gives its unit to one region (ties to the first listed),
/// and proportional share gives the units of 2 per second to two of three regions that
/// want alike. Each part rounded down, every region got 0: every request of every region
/// was a cost error ("capacity 0") under the static split, and nothing was ever admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_smaller_than_the_regions_is_not_rounded_away() {
    let server = RedisServer::start();
    let alloc = QuotaAllocator::builder(server.connect().await, Quota::per_second(1).unwrap())
        .name("tiny")
        .region(("us", 1))
        .region(("eu", 1))
        .region(("ap", 1))
        .policy(Allocation::Static)
        .lease(Duration::from_secs(5))
        .refresh_every(Duration::from_secs(1))
        .build()
        .unwrap();
    assert!(alloc.init_home().await.unwrap());
    let mut shares = Vec::new();
    for name in ["us", "eu", "ap"] {
        let region = alloc.join(name, server.connect().await).await.unwrap();
        shares.push(region.status().share);
        if name == "us" {
            let d = region.gate().check("k", 1).await;
            assert!(d.as_ref().is_ok_and(|d| d.allowed), "{d:?}");
        }
    }
    assert_eq!(shares, [1, 0, 0]);
    assert_eq!(
        Allocation::Static.divide(1, &[1, 1, 1], &[0, 0, 0]),
        [1, 0, 0]
    );
    assert_eq!(
        Allocation::ProportionalShare.divide(2, &[1, 1, 1], &[5, 5, 5]),
        [1, 1, 0]
    );
}

/// A refreshing process that cannot reach the home gives its lock up after two failed
/// refreshes, and a process of the region that can reach it keeps the lease alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_cut_off_from_the_home_hands_the_refreshing_over() {
    let pair = CutOff::start(
        "cutoff",
        Duration::from_secs(2),
        Duration::from_millis(200),
        Duration::from_millis(100),
        Duration::ZERO,
    )
    .await;
    let (proxy, first, second) = (&pair.proxy, &pair.first, &pair.second);
    assert!(first.status().leader && !second.status().leader);
    proxy.cut();
    let cut = std::time::Instant::now();
    while !second.status().leader {
        assert!(cut.elapsed() < Duration::from_millis(1800), "no takeover");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let status = second.status();
    println!("took over {:?} after the cut: {status}", cut.elapsed());
    assert!(status.home_reachable, "{status}");
    assert!(status.lease_left > Duration::from_millis(1500), "{status}");
}

/// Two processes of region `eu` (the only one) with their own local connections: `first`
/// refreshes, reaching the home through `proxy` (to cut it off), `second` reaches the home
/// directly and joins `offset` after the first (its ticks come that much later).
pub(super) struct CutOff {
    // Dropped in this order: the processes before the servers.
    pub(super) first: flowgate::region::Region<redis::aio::ConnectionManager>,
    pub(super) second: flowgate::region::Region<redis::aio::ConnectionManager>,
    /// The allocator `first` joined from: its calls to the home go through `proxy`. (Read
    /// only by the refresher tests, which need the `metrics` feature.)
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(super) via_proxy: QuotaAllocator<redis::aio::ConnectionManager>,
    pub(super) proxy: crate::support::DelayProxy,
    /// The home and the local Redis.
    pub(super) servers: (RedisServer, RedisServer),
}

impl CutOff {
    pub(super) async fn start(
        name: &str,
        lease: Duration,
        refresh: Duration,
        home_timeout: Duration,
        offset: Duration,
    ) -> CutOff {
        let home = RedisServer::start();
        let local = RedisServer::start();
        let home_addr = format!("127.0.0.1:{}", home.port()).parse().unwrap();
        let proxy = crate::support::DelayProxy::start(home_addr, Duration::ZERO)
            .await
            .unwrap();
        let build = |conn| {
            QuotaAllocator::builder(conn, Quota::per_second(50).unwrap())
                .name(name)
                .region(("eu", 1))
                .lease(lease)
                .refresh_every(refresh)
                .home_timeout(home_timeout)
                // The tests probe the lease with a gate's checks: one that outlasted the
                // default 50 ms on a loaded machine was an error, and failed the test.
                .local_timeout(Duration::from_secs(1))
                .build()
                .unwrap()
        };
        let via_proxy = build(super::fleet::manager(&proxy.url()).await);
        let direct = build(super::fleet::manager(&home.url()).await);
        direct.init_home().await.unwrap();
        let first = via_proxy
            .join("eu", super::fleet::manager(&local.url()).await)
            .await
            .unwrap();
        tokio::time::sleep(offset).await;
        let second = direct
            .join("eu", super::fleet::manager(&local.url()).await)
            .await
            .unwrap();
        CutOff {
            first,
            second,
            via_proxy,
            proxy,
            servers: (home, local),
        }
    }
}

/// A region's lease record (share, bucket size `tau`, never expiring), as the home writes it.
fn lease_record(share: f64, tau: f64) -> Vec<u8> {
    [1.0f64, share, tau, 1e15]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect()
}

/// `SET` the lease record of the region whose keys are tagged `{tag}`.
fn set_lease(tag: &str, record: Vec<u8>) -> redis::Cmd {
    let mut c = redis::cmd("SET");
    c.arg(format!("{{{tag}}}:lease")).arg(record);
    c
}

/// The bucket script for the region tagged `{tag}` at `now` (µs), for `cost`: a period of
/// 1 s, the share from the lease record, a `retry_after` of 1 s, keys kept 10 s.
fn bucket_check(tag: &str, now: u64, cost: u32) -> redis::Cmd {
    let mut c = redis::cmd("EVAL");
    c.arg(flowgate::gate::lua::REGION_BUCKET).arg(3);
    for key in ["lease", "demand", "bucket"] {
        c.arg(format!("{{{tag}}}:{key}"));
    }
    c.arg(now)
        .arg(cost)
        .arg(1_000_000)
        .arg(0)
        .arg(0)
        .arg(1_000_000)
        .arg(10_000);
    c
}

/// The share script's `apply` for the region tagged `{tag}` at `now` (µs), as its refresher
/// runs it: lease `seq` at `share` per second with a bucket of `tau` units, ending at
/// `expires` (µs); a safe share of 0.
fn apply_lease(tag: &str, now: u64, seq: u64, share: f64, tau: f64, expires: u64) -> redis::Cmd {
    let mut c = redis::cmd("EVAL");
    c.arg(flowgate::gate::lua::REGION_SHARE).arg(3);
    for key in ["lease", "demand", "lock"] {
        c.arg(format!("{{{tag}}}:{key}"));
    }
    c.arg("apply")
        .arg(now)
        .arg(seq)
        .arg(share)
        .arg(tau)
        .arg(expires)
        .arg("0")
        .arg(0)
        .arg(0)
        .arg(0);
    c
}

/// Run `cmds` in order on `con`, each answered by a list of integers.
async fn run(con: &mut redis::aio::MultiplexedConnection, cmds: &[redis::Cmd]) -> Vec<Vec<i64>> {
    let mut out = Vec::new();
    for c in cmds {
        out.push(c.query_async(con).await.unwrap());
    }
    out
}

const NEVER: u64 = 1_000_000_000_000_000;

/// The bucket script on explicit time: a region whose share grows keeps the tokens it had
/// (at most its old bucket, refilled at the lower share), it does not gain the new bucket.
#[tokio::test]
async fn a_growing_share_brings_no_tokens() {
    let server = RedisServer::start();
    let mut con = server.connect().await;
    // Share 10 per second, a bucket of 10 tokens (a token is 1 000 000 units).
    let _: Vec<i64> = apply_lease("g", 500_000, 1, 10.0, 1e7, NEVER)
        .query_async(&mut con)
        .await
        .unwrap();
    let v: Vec<i64> = bucket_check("g", 1_000_000, 1)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(v[0], 1);
    // 1.05 s later the share is 90 per second with a bucket of 90: the old bucket was full
    // again after 0.1 s (10 tokens), and that is all the region has.
    let _: Vec<i64> = apply_lease("g", 2_050_000, 2, 90.0, 9e7, NEVER)
        .query_async(&mut con)
        .await
        .unwrap();
    let v: Vec<i64> = bucket_check("g", 2_050_000, 11)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(v[0], 0, "11 tokens appeared with the bigger share: {v:?}");
    let v: Vec<i64> = bucket_check("g", 2_050_000, 10)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(v[0], 1, "the 10 it had: {v:?}");
}

/// The bucket script on explicit time: a region at share 0 (closed, its lease expired, or
/// a region that joined while the others held the quota) holds no tokens, so when its share
/// grows it starts from none, refilling at the new share; it does not get a new, full
/// bucket (the tokens another region just spent would be spent again).
#[tokio::test]
async fn a_share_growing_from_zero_brings_no_tokens() {
    let server = RedisServer::start();
    let mut con = server.connect().await;
    // Share 0: the region's requests are rejected (they are its demand).
    let _: () = set_lease("z", lease_record(0.0, 0.0))
        .query_async(&mut con)
        .await
        .unwrap();
    let v: Vec<i64> = bucket_check("z", 1_000_000, 1)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(v[0], 0);
    // 10 ms later the share is 90 per second with a bucket of 90: the region had nothing at
    // share 0, so it has at most the 0.9 of a token refilled since, not 90 tokens.
    let _: () = set_lease("z", lease_record(90.0, 9e7))
        .query_async(&mut con)
        .await
        .unwrap();
    let v: Vec<i64> = bucket_check("z", 1_010_000, 90)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(v[0], 0, "90 tokens appeared with the share: {v:?}");
    let v: Vec<i64> = bucket_check("z", 1_010_000, 1)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(v[0], 0, "a token appeared with the share: {v:?}");
    // A token refills in 1/90 s at the new share.
    let v: Vec<i64> = bucket_check("z", 1_010_000 + 11_200, 1)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(v[0], 1, "the refill at the new share: {v:?}");
}

/// The bucket script on explicit time, the local Redis clock stepping back behind the
/// bucket's TAT: a rejection's `reset_after` is the time until the bucket is really full
/// again (as the token bucket's is), not one full bucket.
#[tokio::test]
async fn the_region_bucket_reports_the_real_reset_when_the_clock_steps_back() {
    let server = RedisServer::start();
    let mut con = server.connect().await;
    // Share 1 per second, a bucket of one token.
    let _: () = set_lease("b", lease_record(1.0, 1e6))
        .query_async(&mut con)
        .await
        .unwrap();
    let v: Vec<i64> = bucket_check("b", 10_000_000, 1)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(v, [1, 1, 0, 0, 1_000_000]);
    // 5 s back: the bucket is full again at 11 s, 6 s from now.
    let v: Vec<i64> = bucket_check("b", 5_000_000, 1)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(v, [0, 1, 0, 6_000_000, 6_000_000]);
}

/// The bucket script on explicit time: a bucket whose numbers lie past any a write puts
/// there (a TAT past 2^53 µs) is refused as unreadable for its own key, as a `RedisGate`'s
/// bucket is. It was decided: rejected with a `retry_after` Redis sent as `i64::MIN`, which
/// the gate reads as 0, so a caller that waits its `retry_after` asked again at once, for
/// ever.
#[tokio::test]
async fn a_region_bucket_past_exact_range_is_unreadable() {
    let server = RedisServer::start();
    let mut con = server.connect().await;
    // Share 1 per second, a bucket of one token.
    let _: () = set_lease("x", lease_record(1.0, 1e6))
        .query_async(&mut con)
        .await
        .unwrap();
    // tat_us, frac, count, tau, written_us: at the share in force, written at 10 s.
    let bucket: Vec<u8> = [1e300f64, 0.0, 1.0, 1e6, 10e6]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let _: () = redis::cmd("SET")
        .arg("{x}:bucket")
        .arg(bucket)
        .query_async(&mut con)
        .await
        .unwrap();
    let v: Vec<i64> = bucket_check("x", 10_000_000, 1)
        .query_async(&mut con)
        .await
        .unwrap();
    // KEY_CORRUPT (lua/prelude.lua).
    assert_eq!(v, [-(1i64 << 53) + 1, 0, 0, 0, 0]);
}

/// The bucket script on explicit time: a key first seen after the region's share grew has
/// been full since ever at the shares the region held, so it starts from the smaller bucket
/// and refills at the new share; it does not get a full new bucket (with many keys, each
/// would be a bucket of tokens the region that gave the share up may have just spent).
#[tokio::test]
async fn a_key_first_seen_after_a_share_grew_starts_from_the_smaller_bucket() {
    let server = RedisServer::start();
    let mut con = server.connect().await;
    let v = run(
        &mut con,
        &[
            apply_lease("n", 1_000_000, 1, 10.0, 1e7, NEVER),
            apply_lease("n", 2_000_000, 2, 90.0, 9e7, NEVER),
            bucket_check("n", 2_000_000, 11),
            bucket_check("n", 2_000_000, 10),
            bucket_check("n", 2_000_000, 1),
            // A second at 90 per second refills the bucket of 90.
            bucket_check("n", 3_000_000, 90),
        ],
    )
    .await;
    assert_eq!(v[1], [1, 90], "the lease applied");
    assert_eq!(v[2][0], 0, "11 tokens came with the bigger share: {v:?}");
    assert_eq!(v[3][0], 1, "the 10 of the bucket before: {v:?}");
    assert_eq!(v[4][0], 0, "a token more: {v:?}");
    assert_eq!(v[5][0], 1, "refilled at the new share: {v:?}");
}

/// The bucket script on explicit time: a share that dipped between two checks of a key (to
/// 0, or the lease ran out with a safe share of 0) and came back took the bucket's tokens
/// with it, as checks during the dip would have; the bucket refills from the dip's end. It
/// is not found full at the same share as if nothing had happened.
#[tokio::test]
async fn a_share_that_dipped_between_two_checks_took_the_tokens_with_it() {
    let server = RedisServer::start();
    let mut con = server.connect().await;
    // Share 90 at 1 s; a lease at 0 at 1.5 s, at 90 again at 1.6 s.
    let granted_zero = run(
        &mut con,
        &[
            apply_lease("d", 1_000_000, 1, 90.0, 9e7, NEVER),
            bucket_check("d", 1_000_000, 1),
            apply_lease("d", 1_500_000, 2, 0.0, 0.0, NEVER),
            apply_lease("d", 1_600_000, 3, 90.0, 9e7, NEVER),
            bucket_check("d", 1_700_000, 10),
            bucket_check("d", 1_700_000, 9),
        ],
    )
    .await;
    // Share 90 at 1 s until 1.5 s; the next lease (the same share) lands at 1.6 s.
    let ran_out = run(
        &mut con,
        &[
            apply_lease("e", 1_000_000, 1, 90.0, 9e7, 1_500_000),
            bucket_check("e", 1_000_000, 1),
            apply_lease("e", 1_600_000, 2, 90.0, 9e7, NEVER),
            bucket_check("e", 1_700_000, 10),
            bucket_check("e", 1_700_000, 9),
        ],
    )
    .await;
    for (what, v) in [("granted 0", &granted_zero), ("ran out", &ran_out)] {
        let n = v.len();
        assert_eq!(v[1][0], 1, "{what}: {v:?}");
        // 0.1 s at 90 per second since the dip: 9 tokens, not the 89 left before it.
        assert_eq!(v[n - 2][0], 0, "{what}: the tokens outlived the dip: {v:?}");
        assert_eq!(v[n - 1][0], 1, "{what}: refilled since the dip: {v:?}");
    }
}

/// The bucket script on explicit time: a region whose share moves a little at every refresh
/// (as demand-driven shares do) keeps what its past shares refilled, past the six changes the
/// lease record holds one by one. A key first seen after 30 s at 10 or 11 per second (after a
/// first lease at 1) has been full since ever at those shares: 100 tokens.
#[tokio::test]
async fn a_share_that_moves_at_every_refresh_keeps_its_refill() {
    let server = RedisServer::start();
    let mut con = server.connect().await;
    // A bucket of 10 tokens per unit of share: full from empty in 10 s at any share.
    let mut cmds = vec![apply_lease("m", 500_000, 1, 1.0, 1e7, NEVER)];
    for k in 0..31u64 {
        let share = if k % 2 == 0 { 10.0 } else { 11.0 };
        cmds.push(apply_lease(
            "m",
            (k + 1) * 1_000_000,
            k + 2,
            share,
            share * 1e7,
            NEVER,
        ));
    }
    cmds.push(bucket_check("m", 31_500_000, 90));
    let v = run(&mut con, &cmds).await;
    assert_eq!(v[31], [1, 10], "the last lease applied");
    assert_eq!(
        v[32][0], 1,
        "90 of the 100 tokens of a key full since ever were refused: {:?}",
        v[32]
    );
}

/// A bucket is kept in the local Redis until it would be full at any share, not only at the
/// share it was written at: a lease length plus the time a bucket takes to fill from empty
/// (the global burst over the rate; each region's bucket is its share's part of the burst).
/// Kept only until full at its own share plus a lease, a bucket drained just before its share
/// grew expired before the bigger bucket had refilled, and came back full at the new size:
/// the drained tokens spent twice.
#[tokio::test]
async fn a_bucket_is_kept_until_full_at_any_share() {
    let server = RedisServer::start();
    // 10 per second, bursts of 100: a bucket fills from empty in 10 s, at any share.
    let alloc = QuotaAllocator::builder(
        server.connect().await,
        Quota::per_second(10).unwrap().burst(100).unwrap(),
    )
    .name("kept")
    .region(("a", 1))
    .lease(Duration::from_secs(5))
    .refresh_every(Duration::from_secs(1))
    .build()
    .unwrap();
    alloc.init_home().await.unwrap();
    let a = alloc.join("a", server.connect().await).await.unwrap();
    assert!(a.gate().check("k", 1).await.unwrap().allowed);
    let mut con = server.connect().await;
    let ttl: i64 = redis::cmd("PTTL")
        .arg("{flowgate:region:kept:a}:bucket:k")
        .query_async(&mut con)
        .await
        .unwrap();
    // At its first share (1 per second, a bucket of 10) full again in 1 s; then kept a
    // lease (5 s) and a fill from empty (10 s).
    assert!(
        ttl > 15_000 && ttl <= 16_000,
        "kept {ttl} ms, not until full at any share"
    );
}

/// The home's state outlives a fleet that is idle for a while (every process stopped over a
/// night or a weekend, a redeploy of every region that takes minutes): a home whose state
/// expired cannot tell it from a restart that lost it, so the fleet's return would start a
/// learning phase, one lease length in which every region is held at its safe share (by
/// default nothing admitted anywhere), with the home Redis up all along.
#[tokio::test]
async fn the_homes_state_outlives_an_idle_fleet() {
    let server = RedisServer::start();
    let alloc = builder(&server)
        .await
        .name("idle")
        .region(("eu", 1))
        .build()
        .unwrap();
    alloc.init_home().await.unwrap();
    let region = alloc.join("eu", server.connect().await).await.unwrap();
    assert_eq!(region.status().refreshes, 1);
    drop(region);
    let mut con = server.connect().await;
    let ttl: i64 = redis::cmd("PTTL")
        .arg("{flowgate:region:idle}:home")
        .query_async(&mut con)
        .await
        .unwrap();
    let day = 24 * 3600 * 1000;
    assert!(
        ttl == -1 || ttl >= 7 * day - 60_000,
        "the home's state expires {ttl} ms after the last refresh: an idle fleet comes back to a learning home"
    );
}

/// A process alone in its region gives the refresher lock up after two failed calls to
/// the home, for the others to take; when none does (there is none), it refreshes again at
/// its next tick after the others had theirs, not after a lock's length: once the home
/// answers again, the region's lease is renewed within two refresh intervals, instead of
/// running out (every request rejected at a safe share of 0) with the home up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_alone_in_its_region_refreshes_again_as_soon_as_the_home_answers() {
    let home = RedisServer::start();
    let local = RedisServer::start();
    let refresh = Duration::from_millis(400);
    let alloc = builder(&home)
        .await
        .name("alone")
        .region(("eu", 1))
        .lease(Duration::from_secs(2))
        .refresh_every(refresh)
        .home_timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    alloc.init_home().await.unwrap();
    let region = alloc.join("eu", local.connect().await).await.unwrap();
    let config = |value: &str| {
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("SET").arg("maxmemory").arg(value);
        let _: () = home.query_blocking(&cmd).unwrap();
    };
    // The home refuses every refresh (a script that writes, with no room: OOM).
    config("1");
    let refused = std::time::Instant::now();
    while region.status().failures < 2 {
        assert!(
            refused.elapsed() < Duration::from_secs(2),
            "no failed refreshes"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The second failure gave the lock up: the home answers again.
    config("0");
    let back = std::time::Instant::now();
    let granted = region.status().refreshes;
    while region.status().refreshes == granted {
        assert!(
            back.elapsed() < refresh * 5 / 2,
            "no refresh {:?} after the home answered again: {}",
            back.elapsed(),
            region.status()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let status = region.status();
    println!(
        "refreshed {:?} after the home was back: {status}",
        back.elapsed()
    );
    assert!(status.leader && status.home_reachable, "{status}");
}

/// A refreshing process cut off from the home hands the refreshing over in time for the
/// process that takes it to renew the lease before it ends, with settings at the edge of
/// what `build` accepts (3 × refresh + 2 × home timeout + the margin just under the lease):
/// the region never falls to its safe share (0 here: every request rejected) while a process
/// of it can reach the home. The other process ticks 200 ms after the cut-off one, so that
/// it would find the lock still held at the tick before a third failed call released it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_outlives_the_handover_from_a_process_cut_off_from_the_home() {
    let lease = Duration::from_secs(1);
    let refresh = Duration::from_millis(290);
    // 3 × 290 + 2 × 40 + 10 = 960 ms, within the 1 s lease.
    let pair = CutOff::start(
        "handover",
        lease,
        refresh,
        Duration::from_millis(40),
        Duration::from_millis(200),
    )
    .await;
    let (proxy, first, second) = (&pair.proxy, &pair.first, &pair.second);
    assert!(first.status().leader && !second.status().leader);
    // Let the lease settle, then cut the leader off.
    tokio::time::sleep(lease).await;
    proxy.cut();
    let cut = std::time::Instant::now();
    let gate = second.gate();
    let mut took_over = None;
    while took_over.is_none_or(|at: Duration| cut.elapsed() < at + refresh) {
        assert!(cut.elapsed() < lease * 3, "no takeover");
        let d = gate.check("probe", 1).await.unwrap();
        assert!(
            d.capacity > 0,
            "the region fell to its safe share {:?} after the cut (its lease ran out before the takeover): {}, {}",
            cut.elapsed(),
            first.status(),
            second.status()
        );
        if took_over.is_none() && second.status().leader {
            took_over = Some(cut.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    println!("took over {took_over:?} after the cut: {}", second.status());
}

/// A process alone in its region whose home calls time out twice gives the refresher lock
/// up and leaves it to the others for a refresh interval; with none there, it refreshes
/// as that interval ends, not a whole tick later. Settings at the edge of what `build`
/// accepts (3 × refresh + 2 × home timeout + the margin just under the lease): once the home
/// answers again, the lease is renewed before it ends, so the region never falls to its
/// safe share (0 here: every request rejected) with the home up. (It skipped its next tick,
/// as the interval had not quite passed, and refreshed one tick later: four refresh
/// intervals after the lease was granted, after it had ended.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_alone_in_its_region_renews_its_lease_in_time_after_two_home_timeouts() {
    let home = RedisServer::start();
    let local = RedisServer::start();
    let home_addr = format!("127.0.0.1:{}", home.port()).parse().unwrap();
    let proxy = crate::support::DelayProxy::start(home_addr, Duration::ZERO)
        .await
        .unwrap();
    let lease = Duration::from_secs(2);
    let refresh = Duration::from_millis(590);
    let home_timeout = Duration::from_millis(80);
    // 3 × 590 + 2 × 80 + 20 = 1950 ms, within the 2 s lease.
    let build = |conn| {
        QuotaAllocator::builder(conn, Quota::per_second(50).unwrap())
            .name("alone-edge")
            .region(("eu", 1))
            .lease(lease)
            .refresh_every(refresh)
            .home_timeout(home_timeout)
            // As `CutOff`'s: a probe is not failed by a loaded machine.
            .local_timeout(Duration::from_secs(1))
            .build()
            .unwrap()
    };
    build(super::fleet::manager(&home.url()).await)
        .init_home()
        .await
        .unwrap();
    let alloc = build(super::fleet::manager(&proxy.url()).await);
    let region = alloc
        .join("eu", super::fleet::manager(&local.url()).await)
        .await
        .unwrap();
    assert!(region.status().leader, "{}", region.status());
    let granted = region.status().refreshes;
    // Every home call times out (a round trip of 400 ms against a timeout of 80 ms).
    proxy.set_delay(Duration::from_millis(200));
    let slow = std::time::Instant::now();
    while region.status().failures < 2 {
        assert!(slow.elapsed() < lease, "no failed refreshes");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The second failure gave the lock up: the home answers at once again.
    proxy.set_delay(Duration::ZERO);
    let back = std::time::Instant::now();
    let gate = region.gate();
    while region.status().refreshes == granted {
        assert!(
            back.elapsed() < lease,
            "no refresh {:?} after the home answered again: {}",
            back.elapsed(),
            region.status()
        );
        let d = gate.check("probe", 1).await.unwrap();
        assert!(
            d.capacity > 0,
            "the region fell to its safe share {:?} after the home answered again (its \
             lease ran out before it refreshed): {}",
            back.elapsed(),
            region.status()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let status = region.status();
    println!(
        "refreshed {:?} after the home was back: {status}",
        back.elapsed()
    );
    assert!(status.leader && status.home_reachable, "{status}");
    assert!(gate.check("probe", 1).await.unwrap().capacity > 0);
}

/// A refreshing process whose home call fails once and that then dies (no release: a
/// crash, a kill) renewed the refresher lock at that failed refresh, a refresh interval
/// after the lease in use was granted. The lock must still lapse in time for another
/// process's tick (within a refresh interval) and home call (within the home timeout) to
/// renew the lease before it ends, with settings at the edge of what `build` accepts. (It
/// lapsed two refresh intervals and a home timeout after that failed refresh, four refresh
/// intervals and two home timeouts after the grant: the lease ran out first, and the region
/// fell to its safe share, 0 here, with a process that could reach the home.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_outlives_the_death_of_a_refreshing_process_after_a_failed_refresh() {
    let lease = Duration::from_secs(2);
    let refresh = Duration::from_millis(590);
    // 3 × 590 + 2 × 80 + 20 = 1950 ms, within the 2 s lease.
    let CutOff {
        first,
        second,
        proxy,
        servers: _servers,
        ..
    } = CutOff::start(
        "crash",
        lease,
        refresh,
        Duration::from_millis(80),
        Duration::ZERO,
    )
    .await;
    assert!(first.status().leader && !second.status().leader);
    // The next home call of the refreshing process times out (a 400 ms round trip).
    proxy.set_delay(Duration::from_millis(200));
    let slow = std::time::Instant::now();
    while first.status().failures == 0 {
        assert!(slow.elapsed() < lease, "no failed refresh");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // It dies at once: dropped outside any runtime, it cannot give the lock up.
    std::thread::spawn(move || drop(first)).join().unwrap();
    let died = std::time::Instant::now();
    let gate = second.gate();
    let mut took_over = None;
    while took_over.is_none_or(|at: Duration| died.elapsed() < at + refresh) {
        assert!(
            died.elapsed() < lease * 2,
            "no takeover: {}",
            second.status()
        );
        let d = gate.check("probe", 1).await.unwrap();
        assert!(
            d.capacity > 0,
            "the region fell to its safe share {:?} after the refreshing process died (its \
             lease ran out before the takeover): {}",
            died.elapsed(),
            second.status()
        );
        if took_over.is_none() && second.status().refreshes > 0 {
            took_over = Some(died.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    println!(
        "took over {took_over:?} after the death: {}",
        second.status()
    );
}

/// A process that does not refresh shows whether the region's refreshing process reaches
/// the home (the lease in use was renewed within a refresh interval and the home timeout),
/// not the `false` it started with: it made no call to the home of its own, and its status
/// said "home unreachable" for as long as it followed, with the home up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_that_does_not_refresh_shows_whether_the_home_is_reached() {
    let server = RedisServer::start();
    let alloc = QuotaAllocator::builder(server.connect().await, Quota::per_second(50).unwrap())
        .name("reached")
        .region(("eu", 1))
        .lease(Duration::from_secs(10))
        .refresh_every(Duration::from_secs(2))
        .home_timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    alloc.init_home().await.unwrap();
    let first = alloc.join("eu", server.connect().await).await.unwrap();
    let second = alloc.join("eu", server.connect().await).await.unwrap();
    let (lead, follow) = (first.status(), second.status());
    assert!(lead.leader && lead.home_reachable, "{lead}");
    assert!(!follow.leader, "{follow}");
    assert!(follow.home_reachable, "{follow}");
    assert!(!follow.to_string().contains("home unreachable"), "{follow}");
}
