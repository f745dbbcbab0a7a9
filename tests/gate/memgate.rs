//! A team's journey with the embedded `MemoryGate` behind an API: many distinct client keys,
//! several quotas per key through `check_all`, tokio's paused time with long jumps, and
//! decisions checked against a token bucket written the obvious way.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use flowgate::clock::Clock;
use flowgate::gate::{GateError, Limit, MemoryGate};
use flowgate::{CostError, Decision, Quota, Rate};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// A continuous token bucket: the level in units of `1 / period` token, refilled by
/// `count` units a nanosecond, capped at `burst` tokens.
#[derive(Debug, Clone)]
struct Model {
    count: u128,
    period: u128,
    cap: u128,
    level: u128,
    last: u128,
}

impl Model {
    fn new(q: Quota) -> Model {
        let period = u128::from(q.rate().period_nanos());
        let cap = u128::from(q.burst_size()) * period;
        Model {
            count: u128::from(q.rate().count()),
            period,
            cap,
            level: cap,
            last: 0,
        }
    }

    /// (allowed, remaining, retry_after, reset_after) of a request of `cost` at `now` ns.
    fn check(&mut self, now: u128, cost: u32) -> (bool, u64, Duration, Duration) {
        let gap = now.saturating_sub(self.last);
        self.level = (self.level + gap * self.count).min(self.cap);
        self.last = self.last.max(now);
        let need = u128::from(cost) * self.period;
        let ceil = |units: u128| {
            let ns = units.div_ceil(self.count);
            Duration::new((ns / 1_000_000_000) as u64, (ns % 1_000_000_000) as u32)
        };
        let allowed = self.level >= need;
        if allowed {
            self.level -= need;
        }
        let remaining = (self.level / self.period) as u64;
        let retry = if allowed {
            Duration::ZERO
        } else {
            ceil(need - self.level)
        };
        (allowed, remaining, retry, ceil(self.cap - self.level))
    }
}

/// A current-thread runtime with tokio's time paused: a gate built in it reads that time.
fn paused() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap()
}

fn parts(d: &Decision) -> (bool, u64, Duration, Duration) {
    (d.allowed, d.remaining, d.retry_after, d.reset_after)
}

#[derive(Debug, Clone)]
enum Step {
    /// Time passes (ns).
    Advance(u64),
    /// `check` on key `k` at cost `c`.
    Check(u8, u32),
    /// `check_all` on key `k` alone, with the gate's quota, at cost `c`.
    CheckAll(u8, u32),
    /// `check_all` on two keys.
    Pair(u8, u8, u32),
    Sweep,
}

/// Costs at the edges: 0, 1, the burst, one past it, `u32::MAX`, and between.
fn cost(burst: u32) -> impl Strategy<Value = u32> {
    prop_oneof![
        1 => Just(0u32),
        4 => 1..=burst,
        2 => Just(burst),
        1 => Just(burst + 1),
        1 => Just(u32::MAX),
    ]
}

fn steps(burst: u32) -> impl Strategy<Value = Vec<Step>> {
    let step = prop_oneof![
        // Within a bucket's refill, a bucket's worth, and days to centuries (past the ~584
        // years of u64 nanoseconds too).
        4 => (0u64..3_000_000_000).prop_map(Step::Advance),
        1 => prop_oneof![
            Just(86_400_000_000_000u64),
            Just(10 * 365 * 86_400_000_000_000u64),
            Just(u64::MAX / 2),
        ]
        .prop_map(Step::Advance),
        6 => (0u8..12, cost(burst)).prop_map(|(k, c)| Step::Check(k, c)),
        3 => (0u8..12, cost(burst)).prop_map(|(k, c)| Step::CheckAll(k, c)),
        2 => (0u8..12, 0u8..12, cost(burst)).prop_map(|(a, b, c)| Step::Pair(a, b, c)),
        1 => Just(Step::Sweep),
    ];
    prop::collection::vec(step, 1..80)
}

/// Whether `err` is the refusal of a small gate's full shard (only a gate of 16 keys may).
fn full(max_keys: usize, err: Option<&GateError>) -> bool {
    max_keys == 16 && matches!(err, Some(GateError::KeyspaceFull { max_keys: 16 }))
}

/// The expected error of a cost outside `1..=burst`.
fn cost_error(cost: u32, burst: u32) -> Option<CostError> {
    match cost {
        0 => Some(CostError::Zero),
        c if c > burst => Some(CostError::ExceedsCapacity {
            cost: c,
            capacity: u64::from(burst),
        }),
        _ => None,
    }
}

/// One random journey on a fresh gate under tokio's paused time: every decision of
/// `check`, of `check_all` on one key and on two is the model's, to the nanosecond, after
/// sweeps and jumps of up to centuries; costs of 0 and past the burst are typed errors that
/// charge nothing.
///
/// With `max_keys` of 16 (a key a shard) new keys meet full shards: refused with
/// `KeyspaceFull` (nothing charged) or admitted by evicting a key back to full, which then
/// starts afresh exactly as the model's full bucket does.
fn journey(
    count: u32,
    period_ns: u64,
    burst: u32,
    max_keys: usize,
    steps: &[Step],
) -> Result<(), TestCaseError> {
    paused().block_on(async {
        let q = Quota::new(
            Rate::per(count, Duration::from_nanos(period_ns)).unwrap(),
            burst,
        )
        .unwrap();
        let gate = MemoryGate::builder(Limit::TokenBucket(q))
            .clock(Clock::tokio())
            .max_keys(max_keys)
            .build()
            .unwrap();
        // The gate's own buckets, and check_all's (apart).
        let mut own: HashMap<u8, Model> = HashMap::new();
        let mut all: HashMap<u8, Model> = HashMap::new();
        let mut now: u128 = 0;
        let key = |k: u8| format!("client-{k}");
        for (i, step) in steps.iter().enumerate() {
            match *step {
                Step::Advance(ns) => {
                    tokio::time::advance(Duration::from_nanos(ns)).await;
                    now += u128::from(ns);
                }
                Step::Sweep => {
                    gate.sweep();
                }
                Step::Check(k, c) | Step::CheckAll(k, c) => {
                    let name = key(k);
                    let (got, models) = match *step {
                        Step::Check(..) => (gate.check(&name, c), &mut own),
                        _ => {
                            let got = gate.check_all(&[(name.as_str(), q)], c);
                            if let Ok(d) = &got {
                                prop_assert_eq!(d.len(), 1);
                            }
                            (got.map(|d| d[0]), &mut all)
                        }
                    };
                    if full(max_keys, got.as_ref().err()) {
                        continue;
                    }
                    match cost_error(c, burst) {
                        Some(e) => prop_assert!(
                            matches!(got, Err(GateError::Cost(g)) if g == e),
                            "step {}: {:?}",
                            i,
                            got
                        ),
                        None => {
                            let want = models
                                .entry(k)
                                .or_insert_with(|| Model::new(q))
                                .check(now, c);
                            let got = got.unwrap();
                            prop_assert_eq!(parts(&got), want, "step {}: {:?}", i, step);
                            prop_assert_eq!(got.capacity, u64::from(burst));
                        }
                    }
                }
                Step::Pair(a, b, c) => {
                    let (na, nb) = (key(a), key(b));
                    let got = gate.check_all(&[(na.as_str(), q), (nb.as_str(), q)], c);
                    if full(max_keys, got.as_ref().err()) {
                        continue;
                    }
                    // One key twice: one bucket charged twice the cost.
                    let total = if a == b {
                        u64::from(c) * 2
                    } else {
                        u64::from(c)
                    };
                    if c == 0 || total > u64::from(burst) {
                        prop_assert!(
                            matches!(got, Err(GateError::Cost(_))),
                            "step {}: {:?}",
                            i,
                            got
                        );
                        continue;
                    }
                    let got = got.unwrap();
                    prop_assert_eq!(got.len(), 2);
                    if a == b {
                        let want = all
                            .entry(a)
                            .or_insert_with(|| Model::new(q))
                            .check(now, total as u32);
                        prop_assert_eq!(parts(&got[0]), want, "step {}", i);
                        prop_assert_eq!(got[0], got[1]);
                        continue;
                    }
                    // Decided on copies: charged only if both have room.
                    let mut ma = all.get(&a).cloned().unwrap_or_else(|| Model::new(q));
                    let mut mb = all.get(&b).cloned().unwrap_or_else(|| Model::new(q));
                    let (wa, wb) = (ma.check(now, c), mb.check(now, c));
                    if wa.0 && wb.0 {
                        all.insert(a, ma);
                        all.insert(b, mb);
                        prop_assert_eq!(parts(&got[0]), wa, "step {}", i);
                        prop_assert_eq!(parts(&got[1]), wb, "step {}", i);
                    } else {
                        prop_assert!(!got[0].allowed && !got[1].allowed, "step {}", i);
                        for (d, w, k) in [(&got[0], wa, a), (&got[1], wb, b)] {
                            let untouched =
                                all.entry(k).or_insert_with(|| Model::new(q)).check(now, 0);
                            if w.0 {
                                // Had room: no wait of its own, what it has left.
                                prop_assert_eq!(d.retry_after, Duration::ZERO, "step {}", i);
                                prop_assert_eq!(d.remaining, untouched.1, "step {}", i);
                                prop_assert_eq!(d.reset_after, untouched.3, "step {}", i);
                            } else {
                                prop_assert_eq!(parts(d), w, "step {}", i);
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    })
}

#[test]
fn memory_gate_decisions_match_a_reference_bucket_under_paused_time() {
    let mut runner = TestRunner::new(Config::with_cases(512));
    let limits = (
        1u32..=20,
        prop_oneof![
            Just(1_000_000_000u64),
            Just(1_000u64),
            1..5_000_000_000u64,
            Just(86_400_000_000_000)
        ],
        1u32..=20,
        prop_oneof![Just(16usize), Just(100_000)],
    );
    runner
        .run(
            &limits.prop_flat_map(|(n, p, b, m)| (Just(n), Just(p), Just(b), Just(m), steps(b))),
            |(n, p, b, m, steps)| journey(n, p, b, m, &steps),
        )
        .unwrap();
}

/// Eight threads run `check_all` on the same four buckets, each naming them in its own
/// order (and subsets of them): nothing deadlocks, and each bucket is charged exactly the
/// cost of the admitted requests that name it, never one refused.
#[test]
fn check_all_in_every_order_from_many_threads_charges_exactly_what_was_admitted() {
    let burst = 20_000u32;
    // A burst a year: nothing refills while the test runs.
    let q = |i: u32| {
        let rate = Rate::per(burst + i, Duration::from_secs(365 * 86_400)).unwrap();
        Quota::new(rate, burst + i).unwrap()
    };
    let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(1).unwrap()));
    let keys = ["ip:10.0.0.1", "user:7", "tenant:acme", "route:/login"];
    let quotas = [q(0), q(1), q(2), q(3)];
    let charged: [AtomicU64; 4] = Default::default();
    std::thread::scope(|s| {
        for t in 0..8usize {
            let (gate, charged) = (&gate, &charged);
            s.spawn(move || {
                for i in 0..3_000usize {
                    // A permutation per thread and round, and a subset of 2 to 4 of it.
                    let mut order = [0usize, 1, 2, 3];
                    order.rotate_left((t + i) % 4);
                    if (t + i / 4) % 2 == 1 {
                        order.reverse();
                    }
                    let take = 2 + (t + i) % 3;
                    let limits: Vec<(&str, Quota)> = order[..take]
                        .iter()
                        .map(|&k| (keys[k], quotas[k]))
                        .collect();
                    let cost = 1 + (i % 3) as u32;
                    let d = gate.check_all(&limits, cost).unwrap();
                    assert!(d.iter().all(|x| x.allowed == d[0].allowed), "{d:?}");
                    if d[0].allowed {
                        for &k in &order[..take] {
                            charged[k].fetch_add(u64::from(cost), Ordering::Relaxed);
                        }
                    }
                }
            });
        }
    });
    for (k, key) in keys.iter().enumerate() {
        let charged = charged[k].load(Ordering::Relaxed);
        let full = u64::from(quotas[k].burst_size());
        assert!(charged <= full, "{key}: {charged} charged of {full}");
        let probe = gate.check_all(&[(key, quotas[k])], 1).unwrap()[0];
        let left = full - charged;
        assert_eq!(
            (probe.allowed, probe.remaining + u64::from(probe.allowed)),
            (left > 0, left),
            "{key}: {charged} charged"
        );
    }
}

/// A day of distinct clients at a gate of 1 600 keys: it never holds more, a key is refused
/// only with `KeyspaceFull` (never a wrong decision), a busy key in the flood is never
/// evicted (no fresh burst for it), and the idle keys are all reclaimed by a sweep.
#[tokio::test(start_paused = true)]
async fn a_flood_of_distinct_keys_stays_bounded_and_never_resets_a_busy_key() {
    // 100 a second, bursts of 200: a key charged 1 is back to full 10 ms later.
    let q = Quota::per_second(100).unwrap().burst(200).unwrap();
    let gate = MemoryGate::builder(Limit::TokenBucket(q))
        .max_keys(1_600)
        .build()
        .unwrap();
    // A heavy client halfway through its burst, back every 10 000 clients (0.5 s) for 50:
    // its decisions are the model's, so it was never evicted and started afresh.
    let mut heavy = Model::new(q);
    let mut now = 0u128;
    for _ in 0..100 {
        assert!(gate.check("heavy", 1).unwrap().allowed);
        heavy.check(now, 1);
    }
    let (mut admitted, mut full) = (0u64, 0u64);
    for i in 0..200_000u64 {
        match gate.check(&format!("client-{i}"), 1) {
            Ok(d) => {
                assert!(d.allowed && d.remaining == 199, "client-{i}: {d:?}");
                admitted += 1;
            }
            Err(GateError::KeyspaceFull { max_keys: 1_600 }) => full += 1,
            Err(e) => panic!("client-{i}: {e}"),
        }
        if i % 1_000 == 0 {
            assert!(gate.len() <= 1_600, "{} keys held", gate.len());
        }
        if i % 10_000 == 5_000 {
            let d = gate.check("heavy", 50).unwrap();
            assert_eq!(parts(&d), heavy.check(now, 50), "heavy at client {i}");
        }
        // 50 µs a client: 20 000 a second, 200 in each key's 10 ms.
        tokio::time::advance(Duration::from_micros(50)).await;
        now += 50_000;
    }
    assert!(admitted > 190_000, "{admitted} admitted, {full} refused");
    assert!(gate.len() <= 1_600);
    tokio::time::advance(Duration::from_secs(3)).await;
    gate.sweep();
    assert_eq!(gate.len(), 0, "idle keys reclaimed");
}

/// A heavy client in the middle of its burst, its shard then flooded with new keys: it is
/// never evicted to make room (its next request sees what it had left, not a fresh burst);
/// the new keys are refused with `KeyspaceFull` instead.
#[tokio::test(start_paused = true)]
async fn a_key_busy_mid_burst_is_never_evicted_for_a_new_one() {
    let q = Quota::per_hour(10).unwrap();
    // 16 shards of one key.
    let gate = MemoryGate::builder(Limit::TokenBucket(q))
        .max_keys(16)
        .build()
        .unwrap();
    assert_eq!(gate.check("heavy", 6).unwrap().remaining, 4);
    let refused = (0..1_000)
        .filter(|i| {
            matches!(
                gate.check(&format!("new-{i}"), 1),
                Err(GateError::KeyspaceFull { .. })
            )
        })
        .count();
    assert!(refused > 900, "{refused}");
    let d = gate.check("heavy", 4).unwrap();
    assert!(d.allowed && d.remaining == 0, "{d:?}");
    assert!(!gate.check("heavy", 1).unwrap().allowed);
}

/// A limit changed at runtime (the same key given with another quota) is another bucket
/// on a `MemoryGate`, which starts full, as its docs say; the old bucket keeps its charges
/// and is used again when the old quota comes back.
#[test]
fn a_key_given_another_quota_is_another_bucket_that_starts_full() {
    let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(1).unwrap()));
    let old = Quota::per_hour(5).unwrap();
    let new = Quota::per_hour(8).unwrap();
    assert_eq!(
        gate.check_all(&[("user:7", old)], 5).unwrap()[0].remaining,
        0
    );
    let d = gate.check_all(&[("user:7", new)], 1).unwrap()[0];
    assert!(d.allowed && d.remaining == 7, "{d:?}");
    assert!(!gate.check_all(&[("user:7", old)], 1).unwrap()[0].allowed);
}

/// A gate of every window algorithm, its keys evicted as they go neutral (16 keys, a key a
/// shard) or held (100 000), under paused time: each decision is that of the key's own
/// limiter given the same times, so an evicted key starts afresh only where its own state
/// had nothing left to remember.
#[test]
fn window_gates_decide_as_each_keys_own_limiter_through_evictions() {
    use flowgate::limit::{Algorithm, FixedWindow, Limiter, SlidingLog, SlidingWindow};

    fn run<A: Algorithm + Clone>(
        limit: Limit,
        algorithm: A,
        max_keys: usize,
        steps: &[(u64, u8, u32)],
    ) -> Result<(), TestCaseError> {
        paused().block_on(async {
            let gate = MemoryGate::builder(limit)
                .max_keys(max_keys)
                .build()
                .unwrap();
            let mut models: HashMap<u8, Limiter<A>> = HashMap::new();
            let mut now = Duration::ZERO;
            for (i, &(gap, k, cost)) in steps.iter().enumerate() {
                tokio::time::advance(Duration::from_nanos(gap)).await;
                now += Duration::from_nanos(gap);
                let got = gate.check(&format!("k{k}"), cost);
                if full(max_keys, got.as_ref().err()) {
                    continue;
                }
                let model = models
                    .entry(k)
                    .or_insert_with(|| Limiter::new(algorithm.clone()));
                match (got, model.check(now, cost)) {
                    (Ok(g), Ok(w)) => prop_assert_eq!(g, w, "step {} {:?} {:?}", i, limit, steps),
                    (Err(GateError::Cost(g)), Err(w)) => prop_assert_eq!(g, w),
                    (g, w) => prop_assert!(false, "step {}: {:?} vs {:?}", i, g, w),
                }
                if i % 7 == 0 {
                    gate.sweep();
                }
            }
            Ok(())
        })
    }

    let mut runner = TestRunner::new(Config::with_cases(256));
    let step = (
        prop_oneof![3 => 0u64..400_000_000, 1 => Just(0u64), 1 => Just(86_400_000_000_000)],
        0u8..12,
        prop_oneof![1 => Just(0u32), 6 => 1u32..=6, 1 => Just(u32::MAX)],
    );
    runner
        .run(
            &(
                1u32..=5,
                1u64..2_000_000_000,
                prop_oneof![Just(16usize), Just(100_000)],
                prop::collection::vec(step, 1..100),
            ),
            |(n, p, max_keys, steps)| {
                let rate = Rate::per(n, Duration::from_nanos(p)).unwrap();
                let (fw, sw, sl) = (Limit::FixedWindow, Limit::SlidingWindow, Limit::SlidingLog);
                run(fw(rate), FixedWindow::new(rate), max_keys, &steps)?;
                run(sw(rate), SlidingWindow::new(rate), max_keys, &steps)?;
                run(sl(rate), SlidingLog::new(rate), max_keys, &steps)
            },
        )
        .unwrap();
}

/// Eight threads spend the bursts of 64 heavy clients while a flood of new keys fills
/// their shards and another thread sweeps: no heavy client is evicted mid-burst, so each
/// is admitted exactly its burst in all (nothing refills within the test), never a fresh
/// one on top.
#[test]
fn concurrent_floods_and_sweeps_never_hand_out_a_second_burst() {
    // 50 a year: no token comes back while the test runs; a flood key, charged once, is
    // busy as long.
    let q = Quota::new(
        Rate::per(50, Duration::from_secs(365 * 86_400)).unwrap(),
        50,
    )
    .unwrap();
    let gate = MemoryGate::builder(Limit::TokenBucket(q))
        .max_keys(1_024)
        .build()
        .unwrap();
    let admitted: Vec<AtomicU64> = (0..64).map(|_| AtomicU64::new(0)).collect();
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let (gate, admitted, done) = (&gate, &admitted, &done);
        s.spawn(move || {
            while !done.load(Ordering::Relaxed) {
                gate.sweep();
            }
        });
        let workers: Vec<_> = (0..8)
            .map(|t| {
                s.spawn(move || {
                    for i in 0..4_000usize {
                        let heavy = (i * 7 + t) % 64;
                        match gate.check(&format!("heavy-{heavy}"), 1) {
                            Ok(d) if d.allowed => {
                                admitted[heavy].fetch_add(1, Ordering::Relaxed);
                            }
                            Ok(_) | Err(GateError::KeyspaceFull { .. }) => {}
                            Err(e) => panic!("{e}"),
                        }
                        let _ = gate.check(&format!("flood-{t}-{i}"), 1);
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
    });
    let full_bursts = admitted
        .iter()
        .filter(|n| n.load(Ordering::Relaxed) == 50)
        .count();
    assert!(full_bursts > 0, "no heavy client spent its burst");
    for (k, n) in admitted.iter().enumerate() {
        let n = n.load(Ordering::Relaxed);
        assert!(n <= 50, "heavy-{k}: {n} admitted of a burst of 50");
        if n > 0 {
            // Held all along: what it has left is the burst less what it was admitted.
            let d = gate.check(&format!("heavy-{k}"), 1).unwrap();
            assert_eq!(u64::from(d.allowed) + d.remaining, 50 - n, "heavy-{k}");
        }
    }
}

/// What the gate's metrics and `Debug` say of a day's traffic is true: each request decided
/// is counted once under its outcome (a `check_all` of three limits is one request), and
/// a request refused for what it asks is not a decision; `Debug` names the gate, its limit
/// and its bound.
#[cfg(feature = "metrics")]
#[test]
fn metrics_and_debug_say_what_the_gate_did() {
    let recorder = super::support::TestRecorder::default();
    let q = Quota::per_hour(2).unwrap();
    let gate = metrics::with_local_recorder(&recorder, || {
        MemoryGate::builder(Limit::TokenBucket(q))
            .name("api")
            .max_keys(100)
            .build()
            .unwrap()
    });
    let count = |outcome: &str| {
        recorder.counter(&format!(
            "flowgate_gate_decisions_total{{name=api,outcome={outcome}}}"
        ))
    };
    let limits = [("ip:1", q), ("user:1", q), ("tenant:1", q)];
    for _ in 0..3 {
        let _ = gate.check_all(&limits, 1).unwrap();
        let _ = gate.check("k", 1).unwrap();
    }
    // Refused for what they ask: not decisions.
    assert!(gate.check("k", 0).is_err());
    assert!(gate.check("", 1).is_err());
    assert!(gate.check_all(&limits, 3).is_err());
    assert!(gate.check_all(&[], 1).is_err());
    assert_eq!((count("allowed"), count("rejected")), (4, 2));
    assert_eq!(count("keyspace_full"), 0);
    let debug = format!("{gate:?}");
    for part in ["MemoryGate", "\"api\"", "max_keys: 112", "TokenBucket"] {
        assert!(debug.contains(part), "{part} not in {debug}");
    }
}
