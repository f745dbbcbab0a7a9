//! `TokenBucket::check` and `Keyed` over 10 000 keys, against governor's direct and keyed
//! limiters, side by side.
//!
//! Both sides read time from the same kind of fake clock (one shared atomic, advanced by a
//! fixed step per call), so the comparison is the decision itself, not the clock source.
//! Rate 1M/s (1 µs interval), burst 100, step 700 ns: a realistic mix of admissions and
//! rejections.
//!
//! The `*_real_clock` groups measure what users run instead: each side reads its own real
//! clock per decision (flowgate: [`flowgate::clock::Clock`], the CPU's time-stamp counter
//! through quanta, which is what `MemoryGate` reads outside a current-thread runtime;
//! governor: its default clock, also quanta), over 10 000 `String` keys
//! (`MemoryGate::check` against governor's keyed `check_key`), on one thread and with 8
//! threads contending for the same limiter (each thread runs its own share of the
//! iterations; the figure is the time for all of them, per decision). The direct flowgate
//! bucket reads the clock as its docs advise, `check_nanos(clock.now_nanos(), 1)`; the
//! group also runs it through a `Duration` (`flowgate_token_bucket_duration`:
//! `check(clock.now(), 1)`, a division by 10⁹ and a multiplication back per decision) and on
//! `std::time::Instant` (`flowgate_token_bucket_std_instant`), to show what those cost.
//! After the run, `main` prints the ratios.
//!
//! # Interleaved rounds (what the Musts are checked on)
//!
//! On a shared 2-core VM the machine's speed drifts by 10-30 % between the few seconds
//! criterion spends on one function and the next, which is as large as the differences
//! measured. So, run as a bench, `main` then measures the real-clock pairs (those the
//! filter matches) in [`AB_ROUNDS`] interleaved rounds: each round times [`AB_OPS`]
//! decisions of flowgate and of governor back to back (which goes first alternates), and
//! the ratio of the two is taken within the round; the median of the rounds' ratios is
//! printed with its spread (the lowest and highest round), and the PASS/FAIL line per Must
//! of issue 20 (flowgate ≤ governor) is read from it. The cases: the direct token bucket
//! (`Clock::counter()` + `Limiter::check_nanos(clock.now_nanos(), 1)`) against governor's
//! direct `check()`, and `MemoryGate::check` against governor's keyed `check_key` over
//! 10 000 keys on one thread and on 8 threads at once.
//! `LIMIT_AB_ROUNDS` / `LIMIT_AB_OPS` change the counts.
//!
//! The `limit_build` group times building (and dropping) a keyed limiter with its real
//! clock: `MemoryGate::new` against governor's `RateLimiter::keyed`, for code that makes
//! limiters at run time (one per tenant or per connection). On a virtual machine, reading
//! the CPU's features to choose a clock traps to the hypervisor, so a clock that is not
//! built once per process shows here (criterion runs outside any tokio runtime, so
//! `MemoryGate::new` reads the counter clock).

mod support;

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{Bencher, Criterion, Throughput, criterion_group};
use flowgate::Quota;
use flowgate::clock::Clock;
use flowgate::gate::{Limit, MemoryGate};
use flowgate::limit::{Keyed, Limiter, TokenBucket};
use governor::clock::FakeRelativeClock;

const STEP_NS: u64 = 700;
/// Interleaved rounds per real-clock pair (`LIMIT_AB_ROUNDS` overrides).
const AB_ROUNDS: usize = 21;
/// Decisions per side and round (`LIMIT_AB_OPS` overrides).
const AB_OPS: u64 = 2_000_000;
const KEYS: u64 = 10_000;

fn gov_quota() -> governor::Quota {
    governor::Quota::per_second(NonZeroU32::new(1_000_000).unwrap())
        .allow_burst(NonZeroU32::new(100).unwrap())
}

fn our_quota() -> Quota {
    Quota::per_second(1_000_000).unwrap().burst(100).unwrap()
}

/// A pseudo-random walk over the keys (same sequence for both sides).
fn key_order() -> Vec<u64> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    (0..65_536)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % KEYS
        })
        .collect()
}

fn direct(c: &mut Criterion) {
    let mut g = c.benchmark_group("limit_direct");
    g.throughput(Throughput::Elements(1));

    g.bench_function("flowgate_token_bucket", |b| {
        let clock = AtomicU64::new(0);
        let mut bucket = Limiter::new(TokenBucket::new(our_quota()));
        b.iter(|| {
            let now = clock.fetch_add(STEP_NS, Ordering::Relaxed) + STEP_NS;
            black_box(bucket.check(Duration::from_nanos(now), 1).unwrap().allowed)
        })
    });

    g.bench_function("governor_direct", |b| {
        let clock = FakeRelativeClock::default();
        let lim = governor::RateLimiter::direct_with_clock(gov_quota(), clock.clone());
        b.iter(|| {
            clock.advance(Duration::from_nanos(STEP_NS));
            black_box(lim.check().is_ok())
        })
    });
    g.finish();
}

fn keyed(c: &mut Criterion) {
    let order = key_order();
    let mut g = c.benchmark_group("limit_keyed_10k");
    g.throughput(Throughput::Elements(1));

    g.bench_function("flowgate_keyed", |b| {
        let clock = AtomicU64::new(0);
        let mut keyed = Keyed::new(TokenBucket::new(our_quota()), 2 * KEYS as usize).unwrap();
        let mut i = 0;
        b.iter(|| {
            let now = clock.fetch_add(STEP_NS, Ordering::Relaxed) + STEP_NS;
            let key = order[i & 0xFFFF];
            i += 1;
            black_box(
                keyed
                    .check(&key, Duration::from_nanos(now), 1)
                    .unwrap()
                    .allowed,
            )
        })
    });

    g.bench_function("governor_keyed_dashmap", |b| {
        let clock = FakeRelativeClock::default();
        let lim = governor::RateLimiter::dashmap_with_clock(gov_quota(), clock.clone());
        governor_keyed(b, &order, &clock, |k| lim.check_key(k).is_ok())
    });
    g.bench_function("governor_keyed_hashmap", |b| {
        let clock = FakeRelativeClock::default();
        let lim = governor::RateLimiter::hashmap_with_clock(gov_quota(), clock.clone());
        governor_keyed(b, &order, &clock, |k| lim.check_key(k).is_ok())
    });
    g.finish();
}

fn governor_keyed(
    b: &mut Bencher<'_>,
    order: &[u64],
    clock: &FakeRelativeClock,
    check: impl Fn(&u64) -> bool,
) {
    let mut i = 0;
    b.iter(|| {
        clock.advance(Duration::from_nanos(STEP_NS));
        let key = order[i & 0xFFFF];
        i += 1;
        black_box(check(&key))
    })
}

/// The 10 000 keys as strings (both sides key by `String`).
fn string_keys(order: &[u64]) -> Vec<String> {
    order.iter().map(|k| format!("client-{k}")).collect()
}

fn direct_real_clock(c: &mut Criterion) {
    let mut g = c.benchmark_group("limit_direct_real_clock");
    g.throughput(Throughput::Elements(1));
    g.bench_function("flowgate_token_bucket", |b| {
        let clock = Clock::counter();
        let mut bucket = Limiter::new(TokenBucket::new(our_quota()));
        b.iter(|| black_box(bucket.check_nanos(clock.now_nanos(), 1).unwrap().allowed))
    });
    g.bench_function("flowgate_token_bucket_duration", |b| {
        let clock = Clock::counter();
        let mut bucket = Limiter::new(TokenBucket::new(our_quota()));
        b.iter(|| black_box(bucket.check(clock.now(), 1).unwrap().allowed))
    });
    g.bench_function("flowgate_token_bucket_std_instant", |b| {
        let epoch = std::time::Instant::now();
        let mut bucket = Limiter::new(TokenBucket::new(our_quota()));
        b.iter(|| black_box(bucket.check(epoch.elapsed(), 1).unwrap().allowed))
    });
    g.bench_function("governor_direct", |b| {
        let lim = governor::RateLimiter::direct(gov_quota());
        b.iter(|| black_box(lim.check().is_ok()))
    });
    g.finish();
}

/// `check(key)` from `threads` threads at once, `iters` decisions in all.
fn contended(
    iters: u64,
    threads: u64,
    keys: &[String],
    check: impl Fn(&String) -> bool + Sync,
) -> Duration {
    let per = iters.div_ceil(threads);
    let start = std::time::Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let check = &check;
            s.spawn(move || {
                let first = (t as usize) * 4_099;
                for i in first..first + per as usize {
                    black_box(check(&keys[i & 0xFFFF]));
                }
            });
        }
    });
    start.elapsed()
}

fn keyed_real_clock(c: &mut Criterion) {
    let keys = string_keys(&key_order());
    for threads in [1u64, 8] {
        let mut g = c.benchmark_group(format!("limit_keyed_10k_real_clock_{threads}t"));
        g.throughput(Throughput::Elements(1));
        g.bench_function("flowgate_memory_gate", |b| {
            let gate = MemoryGate::new(Limit::TokenBucket(our_quota()));
            b.iter_custom(|iters| {
                contended(iters, threads, &keys, |k| {
                    gate.check(k, 1).is_ok_and(|d| d.allowed)
                })
            })
        });
        g.bench_function("governor_keyed", |b| {
            let lim = governor::RateLimiter::keyed(gov_quota());
            b.iter_custom(|iters| contended(iters, threads, &keys, |k| lim.check_key(k).is_ok()))
        });
        g.finish();
    }
}

fn build(c: &mut Criterion) {
    let mut g = c.benchmark_group("limit_build");
    g.throughput(Throughput::Elements(1));
    g.bench_function("flowgate_memory_gate", |b| {
        b.iter(|| black_box(MemoryGate::new(Limit::TokenBucket(our_quota()))))
    });
    g.bench_function("governor_keyed", |b| {
        b.iter(|| black_box(governor::RateLimiter::<String, _, _>::keyed(gov_quota())))
    });
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(50)
        .configure_from_args()
}

criterion_group! {
    name = benches;
    config = config();
    targets = direct, keyed, direct_real_clock, keyed_real_clock, build
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    support::print_ratios(
        "limit_direct",
        "flowgate_token_bucket",
        &["governor_direct"],
    );
    support::print_ratios(
        "limit_keyed_10k",
        "flowgate_keyed",
        &["governor_keyed_dashmap", "governor_keyed_hashmap"],
    );
    support::print_ratios(
        "limit_direct_real_clock",
        "flowgate_token_bucket",
        &["governor_direct", "flowgate_token_bucket_std_instant"],
    );
    for threads in [1, 8] {
        support::print_ratios(
            &format!("limit_keyed_10k_real_clock_{threads}t"),
            "flowgate_memory_gate",
            &["governor_keyed"],
        );
    }
    support::print_ratios("limit_build", "flowgate_memory_gate", &["governor_keyed"]);
    let (filter, bench_mode) = support::filter_and_mode();
    if !bench_mode {
        return;
    }
    // A pair runs when no filter is given or the filter matches one of its criterion ids.
    let wanted = |ids: &[&str]| {
        filter
            .as_deref()
            .is_none_or(|f| ids.iter().any(|id| id.contains(f)))
    };
    let env = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|&n| n > 0)
            .unwrap_or(default)
    };
    let rounds = env("LIMIT_AB_ROUNDS", AB_ROUNDS as u64) as usize;
    let ops = env("LIMIT_AB_OPS", AB_OPS);
    println!(
        "\n== interleaved rounds: {rounds} rounds of {ops} decisions per side, ratio = flowgate / governor within each round; load average {}",
        support::load_average()
    );
    let mut musts = Vec::new();
    if wanted(&[
        "limit_direct_real_clock/flowgate_token_bucket",
        "limit_direct_real_clock/governor_direct",
    ]) {
        let clock = Clock::counter();
        let mut bucket = Limiter::new(TokenBucket::new(our_quota()));
        let lim = governor::RateLimiter::direct(gov_quota());
        musts.push(interleaved(
            "direct token bucket, real clock",
            rounds,
            || {
                time_ops(ops, || {
                    black_box(bucket.check_nanos(clock.now_nanos(), 1).unwrap().allowed)
                })
            },
            || time_ops(ops, || black_box(lim.check().is_ok())),
        ));
    }
    let keys = string_keys(&key_order());
    for threads in [1u64, 8] {
        let group = format!("limit_keyed_10k_real_clock_{threads}t");
        if !wanted(&[
            &format!("{group}/flowgate_memory_gate"),
            &format!("{group}/governor_keyed"),
        ]) {
            continue;
        }
        let gate = MemoryGate::new(Limit::TokenBucket(our_quota()));
        let lim = governor::RateLimiter::keyed(gov_quota());
        musts.push(interleaved(
            &format!("MemoryGate::check, 10 000 keys, {threads} thread(s)"),
            rounds,
            || {
                contended(ops, threads, &keys, |k| {
                    gate.check(k, 1).is_ok_and(|d| d.allowed)
                })
            },
            || contended(ops, threads, &keys, |k| lim.check_key(k).is_ok()),
        ));
    }
    support::summary("issue 20 gate Musts", musts);
}

/// The time `ops` calls of `f` take.
fn time_ops(ops: u64, mut f: impl FnMut() -> bool) -> Duration {
    let start = std::time::Instant::now();
    for _ in 0..ops {
        f();
    }
    start.elapsed()
}

/// `rounds` rounds of `ours` and `peer` back to back (first alternating); prints the median
/// ratio ours / peer of the rounds, its spread and the Must line (ratio ≤ 1).
fn interleaved(
    what: &str,
    rounds: usize,
    mut ours: impl FnMut() -> Duration,
    mut peer: impl FnMut() -> Duration,
) -> Option<bool> {
    // One unmeasured round each: caches, branch predictors, the keys' first decisions.
    ours();
    peer();
    let mut ratios = Vec::with_capacity(rounds);
    let (mut a, mut b) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    for round in 0..rounds {
        let (x, y) = if round % 2 == 0 {
            let x = ours();
            (x, peer())
        } else {
            let y = peer();
            (ours(), y)
        };
        a.push(x.as_secs_f64());
        b.push(y.as_secs_f64());
        ratios.push(x.as_secs_f64() / y.as_secs_f64());
    }
    let (ratio, lo, hi) = support::median_spread(&ratios);
    let pass = ratio <= 1.0;
    println!(
        "{} {what}: median ratio {ratio:.3} (rounds {lo:.3} .. {hi:.3}); median round flowgate {:.1} ms, governor {:.1} ms (Must <= 1.0)",
        support::pass_fail(pass),
        support::median(&a) * 1e3,
        support::median(&b) * 1e3,
    );
    Some(pass)
}
