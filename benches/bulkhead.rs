//! `Bulkhead` permits against tokio's `Semaphore`, and the bulkhead stream adapters against
//! `futures`' `buffer_unordered` / `buffered`, side by side.
//!
//! # What is measured
//!
//! - **`bulkhead_acquire_uncontended`**: one task on a current-thread runtime does [`OPS`]
//!   `acquire().await` + drop pairs per iteration on a bulkhead (or semaphore) of 16 permits,
//!   so every acquisition takes the fast path. Throughput is per acquire/release pair.
//! - **`bulkhead_try_acquire_uncontended`**: the same with `try_acquire` (never waits).
//! - **`bulkhead_acquire_contended`**: 4 tasks share a bulkhead of 2 permits on a
//!   multi-thread runtime with 2 workers; each task does [`CONTENDED_OPS`] pairs and yields to the scheduler while
//!   holding its permit, so the other tasks really find no permit free and queue. Both sides
//!   do exactly the same work around the acquisition. Throughput is per pair (all tasks).
//! - **`bulkhead_map_unordered_c{64,8}`** / **`bulkhead_map_c{64,8}`**: [`ITEMS`] items through
//!   `bulkhead_map_unordered` (`bulkhead_map`) with a bulkhead of `c` permits, against
//!   `map(..).buffer_unordered(c)` (`buffered(c)`), mapping each item to a trivial
//!   `async move { x }` and counting the outputs (asserted). Current-thread runtime; the
//!   cost measured is the adapter itself. flowgate's adapters poll a fresh future in a slot
//!   of their own, so a future that is ready at once never touches their
//!   `FuturesUnordered` / `FuturesOrdered`.
//! - **`bulkhead_map_unordered_yield_c{64,8}`**: the same with futures that yield once
//!   (`yield_now().await` before returning), so both adapters run them through a
//!   `FuturesUnordered` (an extra check, not an issue requirement).
//!
//! After the run, `main` reads criterion's medians back, prints throughput and
//! `flowgate / peer` time ratios (below 1.0: flowgate faster), then one verdict line per
//! requirement of the bulkhead issue, computed from those medians:
//!
//! - acquire/release overhead against tokio's `Semaphore`: time ratio at most
//!   [`MAX_SEMAPHORE_RATIO`];
//! - adapter throughput at least [`MIN_MAP_THROUGHPUT`] of `buffer_unordered` (`buffered`),
//!   i.e. a time ratio at most `1 / MIN_MAP_THROUGHPUT`.
//!
//! # Running
//!
//! ```text
//! cargo bench --bench bulkhead                        # everything, about a minute
//! cargo bench --bench bulkhead -- bulkhead_map        # one family (other verdicts: n/a/stale)
//! ```

mod support;

use std::future::Future;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group};
use flowgate::FlowStreamExt;
use flowgate::bulkhead::Bulkhead;
use futures::StreamExt;
use tokio::runtime::Runtime;
use tokio::sync::Semaphore;

/// Acquire/release pairs per iteration, uncontended.
const OPS: u64 = 1_000;
/// Permits of the uncontended bulkhead / semaphore (never exhausted).
const UNCONTENDED_MAX_IN_FLIGHT: usize = 16;
/// Tasks, permits and pairs per task of the contended group.
const TASKS: u64 = 4;
const CONTENDED_MAX_IN_FLIGHT: usize = 2;
const CONTENDED_OPS: u64 = 1_000;
/// Items per iteration of the stream-adapter groups.
const ITEMS: u64 = 10_000;
const CONCURRENCY: [usize; 2] = [64, 8];

/// The issue's requirements.
const MAX_SEMAPHORE_RATIO: f64 = 1.25;
const MIN_MAP_THROUGHPUT: f64 = 0.9;

const UNCONTENDED: &str = "bulkhead_acquire_uncontended";
const TRY_UNCONTENDED: &str = "bulkhead_try_acquire_uncontended";
const CONTENDED: &str = "bulkhead_acquire_contended";
const OURS: &str = "flowgate";
const TOKIO: &str = "tokio_semaphore";

fn current_thread() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn multi_thread() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn map_unordered_group(c: usize) -> String {
    format!("bulkhead_map_unordered_c{c}")
}

fn map_unordered_yield_group(c: usize) -> String {
    format!("bulkhead_map_unordered_yield_c{c}")
}

fn map_group(c: usize) -> String {
    format!("bulkhead_map_c{c}")
}

fn uncontended(c: &mut Criterion) {
    let rt = current_thread();

    let mut g = c.benchmark_group(UNCONTENDED);
    g.throughput(Throughput::Elements(OPS));
    g.bench_function(OURS, |b| {
        let bh = &Bulkhead::new(UNCONTENDED_MAX_IN_FLIGHT).expect("valid max_in_flight");
        b.to_async(&rt).iter(|| async move {
            for _ in 0..OPS {
                let p = bh.acquire().await.expect("uncontended");
                drop(black_box(p));
            }
        })
    });
    g.bench_function(TOKIO, |b| {
        let sem = &Semaphore::new(UNCONTENDED_MAX_IN_FLIGHT);
        b.to_async(&rt).iter(|| async move {
            for _ in 0..OPS {
                let p = sem.acquire().await.expect("not closed");
                drop(black_box(p));
            }
        })
    });
    g.finish();

    let mut g = c.benchmark_group(TRY_UNCONTENDED);
    g.throughput(Throughput::Elements(OPS));
    g.bench_function(OURS, |b| {
        let bh = Bulkhead::new(UNCONTENDED_MAX_IN_FLIGHT).expect("valid max_in_flight");
        b.iter(|| {
            for _ in 0..OPS {
                drop(black_box(bh.try_acquire().expect("uncontended")));
            }
        })
    });
    g.bench_function(TOKIO, |b| {
        let sem = Semaphore::new(UNCONTENDED_MAX_IN_FLIGHT);
        b.iter(|| {
            for _ in 0..OPS {
                drop(black_box(sem.try_acquire().expect("uncontended")));
            }
        })
    });
    g.finish();
}

fn contended(c: &mut Criterion) {
    let rt = multi_thread();
    let mut g = c.benchmark_group(CONTENDED);
    g.throughput(Throughput::Elements(TASKS * CONTENDED_OPS));
    // The noisiest group (3 threads on 2 cores, work stealing): more time and samples.
    g.measurement_time(Duration::from_secs(4)).sample_size(30);
    g.bench_function(OURS, |b| {
        let bh = Bulkhead::new(CONTENDED_MAX_IN_FLIGHT).expect("valid max_in_flight");
        b.to_async(&rt).iter(|| {
            let bh = bh.clone();
            async move {
                let tasks: Vec<_> = (0..TASKS)
                    .map(|_| {
                        let bh = bh.clone();
                        tokio::spawn(async move {
                            for _ in 0..CONTENDED_OPS {
                                let p = bh.acquire().await.expect("unbounded room");
                                tokio::task::yield_now().await;
                                drop(black_box(p));
                            }
                        })
                    })
                    .collect();
                for t in tasks {
                    t.await.expect("task");
                }
                assert_eq!(bh.in_flight(), 0);
            }
        })
    });
    g.bench_function(TOKIO, |b| {
        let sem = Arc::new(Semaphore::new(CONTENDED_MAX_IN_FLIGHT));
        b.to_async(&rt).iter(|| {
            let sem = sem.clone();
            async move {
                let tasks: Vec<_> = (0..TASKS)
                    .map(|_| {
                        let sem = sem.clone();
                        tokio::spawn(async move {
                            for _ in 0..CONTENDED_OPS {
                                let p = sem.acquire().await.expect("not closed");
                                tokio::task::yield_now().await;
                                drop(black_box(p));
                            }
                        })
                    })
                    .collect();
                for t in tasks {
                    t.await.expect("task");
                }
                assert_eq!(sem.available_permits(), CONTENDED_MAX_IN_FLIGHT);
            }
        })
    });
    g.finish();
}

fn items() -> futures::stream::Iter<std::ops::Range<u64>> {
    futures::stream::iter(0..ITEMS)
}

/// A mapped future that is ready at its first poll.
async fn trivial(x: u64) -> u64 {
    black_box(x)
}

/// A mapped future that yields to the scheduler once before it is ready.
async fn yielding(x: u64) -> u64 {
    tokio::task::yield_now().await;
    black_box(x)
}

/// `bulkhead_map_unordered` against `buffer_unordered` at concurrency `n`, mapping with `f`.
fn unordered_group<Fut>(c: &mut Criterion, rt: &Runtime, group: String, n: usize, f: fn(u64) -> Fut)
where
    Fut: Future<Output = u64>,
{
    let mut g = c.benchmark_group(group);
    g.throughput(Throughput::Elements(ITEMS));
    g.bench_function(OURS, |b| {
        let bh = &Bulkhead::new(n).expect("valid max_in_flight");
        b.to_async(rt).iter(|| async move {
            let count = items().bulkhead_map_unordered(bh.clone(), f).count().await;
            assert_eq!(count as u64, ITEMS);
        })
    });
    g.bench_function("buffer_unordered", |b| {
        b.to_async(rt).iter(|| async move {
            let count = items().map(f).buffer_unordered(n).count().await;
            assert_eq!(count as u64, ITEMS);
        })
    });
    g.finish();
}

fn adapters(c: &mut Criterion) {
    let rt = current_thread();
    for n in CONCURRENCY {
        unordered_group(c, &rt, map_unordered_group(n), n, trivial);
        // Futures not ready at their first poll: flowgate's adapter then runs them through
        // its FuturesUnordered, as buffer_unordered does.
        unordered_group(c, &rt, map_unordered_yield_group(n), n, yielding);

        let mut g = c.benchmark_group(map_group(n));
        g.throughput(Throughput::Elements(ITEMS));
        g.bench_function(OURS, |b| {
            let bh = &Bulkhead::new(n).expect("valid max_in_flight");
            b.to_async(&rt).iter(|| async move {
                let count = items()
                    .bulkhead_map(bh.clone(), |x| async move { black_box(x) })
                    .count()
                    .await;
                assert_eq!(count as u64, ITEMS);
            })
        });
        g.bench_function("buffered", |b| {
            b.to_async(&rt).iter(|| async move {
                let count = items()
                    .map(|x| async move { black_box(x) })
                    .buffered(n)
                    .count()
                    .await;
                assert_eq!(count as u64, ITEMS);
            })
        });
        g.finish();
    }
}

/// One requirement line: the `ours / peer` time ratio of `group` against `max_ratio`.
/// Returns `None` when either side was not measured in this run.
fn verdict(what: &str, group: &str, peer: &str, max_ratio: f64) -> Option<bool> {
    let (Some(ours), Some(theirs)) = (
        support::median_ns(group, OURS),
        support::median_ns(group, peer),
    ) else {
        println!("  n/a   {what:<50} (not measured: filtered out?)");
        return None;
    };
    let ratio = ours / theirs;
    let pass = ratio <= max_ratio;
    println!(
        "  {}  {what:<50} time ratio {ratio:.3} (max {max_ratio:.3}), throughput {:.2}x {peer}",
        support::pass_fail(pass),
        theirs / ours,
    );
    Some(pass)
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(25)
        .configure_from_args()
}

criterion_group! {
    name = benches;
    config = config();
    targets = uncontended, contended, adapters
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();

    for (group, elements) in [
        (UNCONTENDED, OPS),
        (TRY_UNCONTENDED, OPS),
        (CONTENDED, TASKS * CONTENDED_OPS),
    ] {
        support::print_throughput(group, elements, &[OURS, TOKIO]);
        support::print_ratios(group, OURS, &[TOKIO]);
    }
    for n in CONCURRENCY {
        let (unordered, ordered) = (map_unordered_group(n), map_group(n));
        support::print_throughput(&unordered, ITEMS, &[OURS, "buffer_unordered"]);
        support::print_ratios(&unordered, OURS, &["buffer_unordered"]);
        let yielding = map_unordered_yield_group(n);
        support::print_throughput(&yielding, ITEMS, &[OURS, "buffer_unordered"]);
        support::print_ratios(&yielding, OURS, &["buffer_unordered"]);
        support::print_throughput(&ordered, ITEMS, &[OURS, "buffered"]);
        support::print_ratios(&ordered, OURS, &["buffered"]);
    }

    println!(
        "\n== requirements of the issue (from this run's medians; ratio = flowgate / peer time)"
    );
    let mut required = vec![
        verdict(
            "acquire+release uncontended vs Semaphore",
            UNCONTENDED,
            TOKIO,
            MAX_SEMAPHORE_RATIO,
        ),
        verdict(
            "try_acquire+release uncontended vs Semaphore",
            TRY_UNCONTENDED,
            TOKIO,
            MAX_SEMAPHORE_RATIO,
        ),
        verdict(
            "acquire+release contended vs Semaphore",
            CONTENDED,
            TOKIO,
            MAX_SEMAPHORE_RATIO,
        ),
    ];
    let max_map_ratio = 1.0 / MIN_MAP_THROUGHPUT;
    for n in CONCURRENCY {
        required.push(verdict(
            &format!("bulkhead_map_unordered c={n} vs buffer_unordered"),
            &map_unordered_group(n),
            "buffer_unordered",
            max_map_ratio,
        ));
    }
    support::summary("requirements", required);

    println!(
        "\n== extra, not in the issue: futures that yield once, and the ordered adapter, at the same bar"
    );
    let mut extra = Vec::new();
    for n in CONCURRENCY {
        extra.push(verdict(
            &format!("bulkhead_map_unordered yielding c={n}"),
            &map_unordered_yield_group(n),
            "buffer_unordered",
            max_map_ratio,
        ));
        extra.push(verdict(
            &format!("bulkhead_map c={n} vs buffered"),
            &map_group(n),
            "buffered",
            max_map_ratio,
        ));
    }
    support::summary("extra checks", extra);
}
