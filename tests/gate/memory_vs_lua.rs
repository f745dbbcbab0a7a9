//! `MemoryGate` against the Lua script of the same limit, on the same trace: a gate on a
//! paused tokio clock, the script on logical time (an explicit `now`) whose windows start
//! where the gate's do. Several keys, costs of 0 and above the capacity (refused by both
//! gates before any script runs), equal times and long jumps; every field of every
//! decision the same, the waits in the script's whole microseconds.

use flowgate::clock::Clock;

use super::*;

/// A step: the gap before it (µs), the key (of 3), the cost.
type Step = (u64, u8, u32);

fn steps(max_cost: u32) -> impl Strategy<Value = Vec<Step>> {
    let gap = prop_oneof![2 => Just(0u64), 6 => 0u64..400_000, 1 => 0u64..20_000_000];
    prop::collection::vec((gap, 0u8..3, 0..=max_cost), 1..100)
}

/// The script of `limit` and its parameters (after the keys, before `now`).
fn script_of(limit: Limit) -> (&'static str, Vec<u64>) {
    let r = limit.rate();
    let mut params = vec![u64::from(r.count()), r.period_nanos() / 1_000];
    let source = match limit {
        Limit::TokenBucket(q) => {
            params.push(u64::from(q.burst_size()));
            lua::TOKEN_BUCKET
        }
        Limit::FixedWindow(_) => lua::FIXED_WINDOW,
        Limit::SlidingLog(_) => lua::SLIDING_LOG,
        Limit::SlidingWindow(_) => lua::SLIDING_WINDOW,
        _ => unreachable!("the four limits"),
    };
    (source, params)
}

/// `trace` through a `MemoryGate` of `limit` (on paused time) and through its script
/// (through `redis`): the same answers.
fn agree(
    redis: &tokio::runtime::Runtime,
    con: &mut MultiplexedConnection,
    case: u64,
    limit: Limit,
    trace: &[Step],
) -> Result<(), TestCaseError> {
    let (source, params) = script_of(limit);
    let script = redis::Script::new(source);
    // Paused time for the gate's clock alone: a runtime that waits on Redis would move
    // its paused time on by itself.
    let mut paused = tokio::runtime::Builder::new_current_thread();
    let clock = paused.enable_time().start_paused(true).build().unwrap();
    let gate = clock.block_on(async {
        MemoryGate::builder(limit)
            .clock(Clock::tokio())
            .build()
            .unwrap()
    });
    // Redis-like times (µs since the epoch) at a window boundary, as the gate's start is.
    let period_us = limit.rate().period_nanos() / 1_000;
    let mut now_us = 1_700_000_000_000_000 / period_us * period_us;
    for &(gap, key, cost) in trace {
        now_us += gap;
        let key = format!("{}:{case}:{key}", limit.name());
        let got = clock.block_on(async {
            tokio::time::advance(Duration::from_micros(gap)).await;
            gate.check(&key, cost)
        });
        let capacity = limit.capacity();
        if cost == 0 || u64::from(cost) > capacity {
            let refused = if cost == 0 {
                CostError::Zero
            } else {
                CostError::ExceedsCapacity { cost, capacity }
            };
            prop_assert!(
                matches!(got, Err(GateError::Cost(e)) if e == refused),
                "{:?}: cost {} gave {:?}",
                limit,
                cost,
                got
            );
            continue;
        }
        let want = redis.block_on(run_script(con, &script, &key, &params, now_us, cost));
        prop_assert_eq!(
            model_reply(&got.unwrap()),
            want,
            "{:?}: {} at {} µs",
            limit,
            cost,
            now_us
        );
    }
    Ok(())
}

#[test]
fn the_memory_gate_decides_as_the_script_of_its_limit() {
    on_random_limits(24, steps(14), |rt, mut con, case, rate, burst, trace| {
        let limits = [
            Limit::TokenBucket(Quota::new(rate, burst).unwrap()),
            Limit::FixedWindow(rate),
            Limit::SlidingLog(rate),
            Limit::SlidingWindow(rate),
        ];
        for limit in limits {
            agree(rt, &mut con, case, limit, &trace)?;
        }
        Ok(())
    });
}

/// Limits at the edges of what the Redis gate accepts (`burst` or `count` × period in µs
/// just below 2^52, a count of `u32::MAX`, a period of 1 µs or of 142 years), as
/// (count, period in µs, burst).
const EDGES: [(u32, u64, u32); 6] = [
    (u32::MAX, 1_048_575, u32::MAX),
    (1, (1 << 52) - 1, 1),
    (7, (1 << 52) / 7 - 1, 7),
    (1_000_000, 1, 1_000_000),
    (3, 1_000_000, 1_500_000_000),
    (1_000, 4_503_599_627, 1),
];

/// A step at the edges: shares (in millionths) of the period to wait and to step back, and
/// of the capacity to cost.
type Shares = (u64, u64, u64);

fn shares() -> impl Strategy<Value = Vec<Shares>> {
    let share = || {
        prop_oneof![
            Just(0u64),
            Just(1_000_000u64),
            0u64..=1_000_000,
            0u64..=1_000
        ]
    };
    let back = prop_oneof![3 => Just(0u64), 1 => share()];
    prop::collection::vec((share(), back, share()), 1..40)
}

/// The runtime that talks to Redis, the case's number (for keys of its own), its steps.
type EdgeCase<'a> = (&'a tokio::runtime::Runtime, u64, &'a [Shares]);

/// A case's steps through the script of `limit` and through `algorithm`, its model: the
/// same.
fn edge_trace<A: Algorithm>(
    (rt, case, steps): EdgeCase<'_>,
    con: &mut MultiplexedConnection,
    limit: Limit,
    algorithm: A,
) -> Result<(), TestCaseError> {
    let key = &format!("edge:{}:{case}", limit.name());
    let (source, params) = script_of(limit);
    let script = redis::Script::new(source);
    let period_us = u128::from(limit.rate().period_nanos() / 1_000);
    let part = |share: u64, of: u128| u64::try_from(of * u128::from(share) / 1_000_000).unwrap();
    let mut model = Limiter::new(algorithm);
    let mut clock_us = 1_700_000_000_000_000u64;
    for &(gap, back, cost) in steps {
        clock_us += part(gap, period_us);
        let now_us = clock_us - part(back, period_us).min(clock_us / 2);
        let cost = u32::try_from(part(cost, u128::from(model.capacity())).max(1)).unwrap();
        let d = model.check(Duration::from_micros(now_us), cost).unwrap();
        let got = rt.block_on(run_script(con, &script, key, &params, now_us, cost));
        let want = model_reply(&d);
        // A bucket further ahead of the clock (stepped back) than exact arithmetic reaches
        // (2^52 units of 1/count µs) rejects with its waits counted as if the clock had
        // stepped back only that far, as `RedisGate` documents: never longer.
        let beyond = |reset_us: u64| (u128::from(reset_us) + 1) * u128::from(params[0]) > 1 << 52;
        if matches!(limit, Limit::TokenBucket(_)) && !d.allowed && beyond(want.4) {
            prop_assert!(
                !got.0 && got.2 == want.2,
                "{:?}: {:?} for {:?}",
                limit,
                got,
                want
            );
            prop_assert!(
                got.3 <= want.3 && got.4 <= want.4,
                "{:?} waits longer than {:?}",
                got,
                want
            );
            continue;
        }
        prop_assert_eq!(got, want, "{:?}: {} at {} µs", limit, cost, now_us);
    }
    Ok(())
}

/// Each script against its model at the edges of exact arithmetic in doubles: costs up to
/// the capacity, gaps from nothing to a whole period, the clock now and then stepping back.
#[test]
fn the_scripts_match_the_models_at_the_edges_of_exact_arithmetic() {
    let server = RedisServer::start();
    let rt = rt();
    let con = rt.block_on(server.connect());
    let mut runner = TestRunner::new(Config::with_cases(16));
    let case = std::sync::atomic::AtomicU64::new(0);
    for &(count, period_us, burst) in &EDGES {
        let rate = Rate::per(count, Duration::from_micros(period_us)).unwrap();
        let quota = Quota::new(rate, burst).unwrap();
        runner
            .run(&shares(), |steps| {
                let case = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let con = &mut con.clone();
                let at = (&rt, case, &steps[..]);
                edge_trace(at, con, Limit::TokenBucket(quota), TokenBucket::new(quota))?;
                edge_trace(at, con, Limit::FixedWindow(rate), FixedWindow::new(rate))?;
                edge_trace(at, con, Limit::SlidingLog(rate), SlidingLog::new(rate))?;
                edge_trace(
                    at,
                    con,
                    Limit::SlidingWindow(rate),
                    SlidingWindow::new(rate),
                )
            })
            .unwrap();
    }
}
