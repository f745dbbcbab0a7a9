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
