//! The Redis gate: limits at the edge of what its scripts compute exactly, costs above
//! them.

use std::time::Duration;

use flowgate::gate::{GateError, Limit, RedisGate};
use flowgate::{Quota, Rate};

use crate::support::RedisServer;

/// Periods: below a microsecond, not a whole number of them, and around the scripts'
/// 2^52 µs bound; counts and bursts of 1, 2 and `u32::MAX`.
fn limits() -> Vec<Limit> {
    let periods = [
        Duration::from_nanos(1),
        Duration::from_nanos(1_500),
        Duration::from_micros(1),
        Duration::from_secs(1),
        Duration::from_micros((1 << 52) - 1),
        Duration::from_micros(1 << 52),
        Duration::from_micros(u64::MAX / 1_000),
    ];
    let mut out = Vec::new();
    for count in [1, 2, u32::MAX] {
        for period in periods {
            let rate = Rate::per(count, period).unwrap();
            out.extend([
                Limit::FixedWindow(rate),
                Limit::SlidingLog(rate),
                Limit::SlidingWindow(rate),
            ]);
            for burst in [1, 2, u32::MAX] {
                out.push(Limit::TokenBucket(Quota::new(rate, burst).unwrap()));
            }
        }
    }
    out
}

/// Every limit is built or refused on `gate.limit`; a built one decides every cost it
/// can ever admit, and refuses the others with `GateError::Cost`: never a script
/// error from numbers too large for Lua.
#[tokio::test]
async fn the_redis_gate_decides_or_refuses_every_limit_and_cost() {
    let server = RedisServer::start();
    let (mut built_n, mut refused_n) = (0, 0);
    for (i, limit) in limits().into_iter().enumerate() {
        // Token buckets also with leases larger than any burst.
        let lease = if i % 2 == 0 { u32::MAX } else { 0 };
        let built = RedisGate::builder(server.connect().await, limit)
            .prefix(format!("bad{i}:"))
            .timeout(Duration::from_secs(30))
            .lease(if matches!(limit, Limit::TokenBucket(_)) {
                lease
            } else {
                0
            })
            .lease_ttl(Duration::MAX)
            .build()
            .await;
        let gate = match built {
            Ok(g) => g,
            Err(e) => {
                assert_eq!(e.field(), "gate.limit", "{limit:?}: {e}");
                refused_n += 1;
                continue;
            }
        };
        built_n += 1;
        let capacity = limit.capacity();
        let top = u32::try_from(capacity).unwrap_or(u32::MAX);
        for cost in [0, 1, top, top.saturating_add(1), u32::MAX, 1, 1] {
            match gate.check("k", cost).await {
                Ok(d) => {
                    assert!(cost > 0 && u64::from(cost) <= capacity, "{limit:?} {cost}");
                    assert!(d.remaining <= d.capacity, "{limit:?} {cost}: {d:?}");
                    assert!(d.allowed || !d.retry_after.is_zero(), "{limit:?}: {d:?}");
                }
                Err(GateError::Cost(_)) => {
                    assert!(cost == 0 || u64::from(cost) > capacity, "{limit:?} {cost}")
                }
                Err(e) => panic!("{limit:?}, cost {cost}: {e}"),
            }
        }
        if let Limit::TokenBucket(q) = limit {
            for cost in [1, q.burst_size(), u32::MAX] {
                match gate.check_all(&[("a", q), ("b", q)], cost).await {
                    Ok(ds) => assert!(ds.iter().all(|d| d.remaining <= d.capacity)),
                    Err(GateError::Cost(_)) => assert!(cost > q.burst_size()),
                    Err(e) => panic!("{limit:?} check_all, cost {cost}: {e}"),
                }
            }
        }
    }
    // Both kinds: the grid reaches past the bound on each side.
    assert!(
        built_n > 20 && refused_n > 20,
        "{built_n} built, {refused_n} refused"
    );
}
