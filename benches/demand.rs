//! `prefetch` over an in-memory source against consuming the plain stream (criterion), and a
//! Redis Streams consumer through `prefetch(RedisStreamSource)` against a naive
//! one-entry-at-a-time loop (plain timing, on a private `redis-server`).
//!
//! # What is measured
//!
//! - **`demand_prefetch_memory`**: [`N`] `u64`s summed (each through `black_box`, so the
//!   sum is not folded into a formula), current-thread runtime:
//!   - `plain_stream`: `futures::stream::iter(0..N)`, the plain stream;
//!   - `prefetch_h{high}_l{low}`: `prefetch(IterSource::new(0..N), levels).items()`, the
//!     in-memory source (one `Vec` of `high − buffered` items per fetch);
//!   - `stream_source_h{high}_l{low}`: `prefetch(StreamSource::new(iter(0..N)), levels)`
//!     `.items()`, any stream turned into a batch source (polled item by item into each
//!     batch);
//!   - `plain_chunks_flattened_{k}`: `iter(0..N).chunks(k).flat_map(iter)`, a plain stream of
//!     the batches `prefetch(high, low)` fetches in steady state (`k = high − low`),
//!     flattened: what a batch source read without `prefetch` costs.
//! - **Redis Streams** (plain wall-clock timing): [`REDIS_ENTRIES`] entries are produced with
//!   pipelined `XADD`; each run then consumes all of them in its own consumer group, so both
//!   sides read every entry:
//!   (a) `prefetch(RedisStreamSource, 100, 20)` (`block` 1 ms): decode field `n`,
//!   `entry.ack.ack()`, and `flush_acks` at the end (acks travel in one `XACK` pipelined with
//!   each fetch);
//!   (b) naive: one `XREADGROUP … COUNT 1 … STREAMS key >` and one `XACK` per entry.
//!   Entries/s is entries ÷ time from the first read to the last ack confirmed; both groups
//!   are checked to have nothing pending afterwards. [`REDIS_REPS`] runs each, alternating,
//!   the median reported.
//!
//! After criterion, `main` prints throughput, time ratios of each `prefetch` row against the
//! plain stream and the chunked one, and PASS/FAIL lines for the issue's requirement,
//! **prefetch overhead ≤ 10 %** ([`MAX_OVERHEAD`]) against the plain stream, from this run's
//! medians: over `IterSource` (the in-memory source), over `StreamSource`, and for reference
//! against the chunked stream.
//!
//! The Redis part starts its own `redis-server` (free port on 127.0.0.1, `--save ""
//! --appendonly no`, own temp dir), killed and removed at the end, also on panic. Without
//! `redis-server` on `PATH` it prints one line and exits with status 1.
//!
//! # Running
//!
//! ```text
//! cargo bench --bench demand              # everything, about 40 s
//! cargo bench --bench demand -- prefetch  # criterion groups only
//! cargo bench --bench demand -- redis     # Redis Streams only
//! ```
//!
//! Without `--bench` (e.g. `cargo test --benches`) criterion runs each bench once and the
//! Redis part is a smoke run over [`REDIS_SMOKE_ENTRIES`] entries; no verdicts are printed.

mod support;

use std::hint::black_box;
use std::pin::pin;
use std::time::{Duration, Instant, SystemTime};

use criterion::{Criterion, Throughput, criterion_group};
use flowgate::demand::{IterSource, Levels, RedisStreamSource, StreamSource, prefetch};
use futures::{Stream, StreamExt};
use redis::aio::MultiplexedConnection;
use redis::streams::StreamReadReply;
use support::redis_server::PrivateRedis;
use tokio::runtime::Runtime;

/// Items per iteration of the in-memory groups.
const N: u64 = 100_000;
/// The prefetch watermarks under test (the first pair is the one the verdict uses).
const WATERMARKS: [(usize, usize); 2] = [(100, 20), (1_000, 200)];
/// The issue's requirement: prefetch at most 10 % slower than the plain stream.
const MAX_OVERHEAD: f64 = 1.10;

const MEMORY: &str = "demand_prefetch_memory";
const PLAIN: &str = "plain_stream";
const CHUNKS: &str = "plain_chunks_flattened";

/// Entries of the Redis Streams part (bench mode / smoke mode).
const REDIS_ENTRIES: u64 = 50_000;
const REDIS_SMOKE_ENTRIES: u64 = 2_000;
/// Runs of each Redis consumer (bench mode); the median is reported.
const REDIS_REPS: usize = 3;
const REDIS_HIGH: usize = 100;
const REDIS_LOW: usize = 20;
const STREAM_KEY: &str = "bench:demand";

fn prefetch_id(high: usize, low: usize) -> String {
    format!("prefetch_h{high}_l{low}")
}

fn stream_source_id(high: usize, low: usize) -> String {
    format!("stream_source_h{high}_l{low}")
}

fn chunks_id(high: usize, low: usize) -> String {
    format!("{CHUNKS}_{}", high - low)
}

fn current_thread() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// The prefetch levels `(high, low)`, valid by construction of [`WATERMARKS`].
fn levels(high: usize, low: usize) -> Levels {
    Levels::new(high, low).expect("valid levels")
}

/// `0 + 1 + … + (n − 1)`, what every in-memory run must sum to.
const fn expected_sum(n: u64) -> u64 {
    n * (n - 1) / 2
}

/// The consumer both sides share: sum every item, each through `black_box`.
async fn sum<S: Stream<Item = u64>>(stream: S) -> u64 {
    let mut stream = pin!(stream);
    let mut sum = 0u64;
    while let Some(x) = stream.next().await {
        sum = sum.wrapping_add(black_box(x));
    }
    sum
}

fn memory(c: &mut Criterion) {
    let rt = current_thread();
    let mut g = c.benchmark_group(MEMORY);
    g.throughput(Throughput::Elements(N));
    g.bench_function(PLAIN, |b| {
        b.to_async(&rt).iter(|| async {
            let s = sum(futures::stream::iter(0..black_box(N))).await;
            assert_eq!(s, expected_sum(N));
        })
    });
    for (high, low) in WATERMARKS {
        g.bench_function(prefetch_id(high, low), |b| {
            b.to_async(&rt).iter(|| async move {
                let source = IterSource::new(0..black_box(N));
                let stream = prefetch(source, levels(high, low)).items();
                let s = sum(stream).await;
                assert_eq!(s, expected_sum(N));
            })
        });
        g.bench_function(stream_source_id(high, low), |b| {
            b.to_async(&rt).iter(|| async move {
                let source = StreamSource::new(futures::stream::iter(0..black_box(N)));
                let stream = prefetch(source, levels(high, low)).items();
                let s = sum(stream).await;
                assert_eq!(s, expected_sum(N));
            })
        });
        g.bench_function(chunks_id(high, low), |b| {
            b.to_async(&rt).iter(|| async move {
                let stream = futures::stream::iter(0..black_box(N))
                    .chunks(high - low)
                    .flat_map(futures::stream::iter);
                let s = sum(stream).await;
                assert_eq!(s, expected_sum(N));
            })
        });
    }
    g.finish();
}

/// One verdict line: `ours / peer` median time of `group` against [`MAX_OVERHEAD`].
/// Only medians measured in this run (`since` its start) count.
fn verdict(what: &str, group: &str, ours: &str, peer: &str, since: SystemTime) -> Option<bool> {
    let (Some(t_ours), Some(t_peer)) = (
        support::median_ns_since(group, ours, since),
        support::median_ns_since(group, peer, since),
    ) else {
        println!("  n/a   {what:<46} (not measured in this run: filtered out?)");
        return None;
    };
    let ratio = t_ours / t_peer;
    let pass = ratio <= MAX_OVERHEAD;
    println!(
        "  {}  {what:<46} time ratio {ratio:.3} (overhead {:+.1} %, max {:+.0} %)",
        support::pass_fail(pass),
        (ratio - 1.0) * 100.0,
        (MAX_OVERHEAD - 1.0) * 100.0,
    );
    Some(pass)
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30)
        .configure_from_args()
}

criterion_group! {
    name = benches;
    config = config();
    targets = memory
}

// ---------------------------------------------------------------------------------------
// Redis Streams
// ---------------------------------------------------------------------------------------

async fn produce(con: &mut MultiplexedConnection, n: u64) {
    let mut i = 0;
    while i < n {
        let end = (i + 1_000).min(n);
        let mut pipe = redis::pipe();
        for j in i..end {
            pipe.cmd("XADD")
                .arg(STREAM_KEY)
                .arg("*")
                .arg("n")
                .arg(j)
                .arg("payload")
                .arg("0123456789abcdef")
                .ignore();
        }
        pipe.query_async::<()>(con).await.expect("XADD");
        i = end;
    }
}

/// Entries still pending in `group`.
async fn pending(con: &mut MultiplexedConnection, group: &str) -> u64 {
    let reply: (u64, redis::Value, redis::Value, redis::Value) = redis::cmd("XPENDING")
        .arg(STREAM_KEY)
        .arg(group)
        .query_async(con)
        .await
        .expect("XPENDING");
    reply.0
}

/// (a): `prefetch(RedisStreamSource, 100, 20)`, ack every entry, flush at the end.
async fn run_prefetch(server: &PrivateRedis, group: &str, n: u64) -> Duration {
    let source = RedisStreamSource::builder(server.connect().await, STREAM_KEY, group, "c")
        // Every entry is there before the run, so a read waits only after the last one: keep
        // that wait short, as `flush_acks` queues behind it on the same connection.
        .block(Duration::from_millis(1))
        .build()
        .await
        .expect("group");
    let mut stream = Box::pin(prefetch(source, levels(REDIS_HIGH, REDIS_LOW)));
    let start = Instant::now();
    let mut sum = 0u64;
    for _ in 0..n {
        let entry = stream.next().await.expect("endless").expect("XREADGROUP");
        sum += entry.get::<u64>("n").expect("field n");
        entry.ack.ack();
    }
    stream
        .as_mut()
        .get_pin_mut()
        .get_mut()
        .flush_acks()
        .await
        .expect("XACK");
    let elapsed = start.elapsed();
    assert_eq!(sum, expected_sum(n), "every entry exactly once");
    elapsed
}

/// (b): one `XREADGROUP COUNT 1` and one `XACK` per entry.
async fn run_naive(server: &PrivateRedis, group: &str, n: u64) -> Duration {
    let mut con = server.connect().await;
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(STREAM_KEY)
        .arg(group)
        .arg("0")
        .query_async(&mut con)
        .await
        .expect("XGROUP CREATE");
    let start = Instant::now();
    let mut sum = 0u64;
    for _ in 0..n {
        let reply: StreamReadReply = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(group)
            .arg("c")
            .arg("COUNT")
            .arg(1)
            .arg("STREAMS")
            .arg(STREAM_KEY)
            .arg(">")
            .query_async(&mut con)
            .await
            .expect("XREADGROUP");
        let entry = &reply.keys[0].ids[0];
        sum += entry.get::<u64>("n").expect("field n");
        let _: u64 = redis::cmd("XACK")
            .arg(STREAM_KEY)
            .arg(group)
            .arg(&entry.id)
            .query_async(&mut con)
            .await
            .expect("XACK");
    }
    let elapsed = start.elapsed();
    assert_eq!(sum, expected_sum(n), "every entry exactly once");
    elapsed
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn rate(n: u64, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

fn redis_streams(bench_mode: bool) {
    let (n, reps) = if bench_mode {
        (REDIS_ENTRIES, REDIS_REPS)
    } else {
        (REDIS_SMOKE_ENTRIES, 1)
    };
    println!(
        "\n== demand_redis_streams: {n} entries, {reps} run(s) each (alternating), median; \
         load average {}",
        support::load_average()
    );
    let server = PrivateRedis::start("demand", None);
    let rt = current_thread();
    rt.block_on(async {
        let mut con = server.connect().await;
        produce(&mut con, n).await;
        let (mut ours, mut naive) = (Vec::new(), Vec::new());
        for rep in 0..reps {
            let (g_ours, g_naive) = (format!("prefetch-{rep}"), format!("naive-{rep}"));
            ours.push(run_prefetch(&server, &g_ours, n).await);
            naive.push(run_naive(&server, &g_naive, n).await);
            for group in [&g_ours, &g_naive] {
                assert_eq!(pending(&mut con, group).await, 0, "{group}: all acked");
            }
        }
        let (t_ours, t_naive) = (median(ours.clone()), median(naive.clone()));
        let fmt = |v: &[Duration]| {
            v.iter()
                .map(|d| format!("{:.0}", rate(n, *d)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!(
            "  prefetch(RedisStreamSource, {REDIS_HIGH}, {REDIS_LOW}) + batched XACK \
             {:>10.0} entries/s   (runs: {})",
            rate(n, t_ours),
            fmt(&ours)
        );
        println!(
            "  naive XREADGROUP COUNT 1 + XACK per entry        {:>10.0} entries/s   (runs: {})",
            rate(n, t_naive),
            fmt(&naive)
        );
        println!(
            "  ratio prefetch / naive: {:.1}x the throughput; every group: 0 pending afterwards",
            t_naive.as_secs_f64() / t_ours.as_secs_f64()
        );
    });
    drop(server);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let bench_mode = args.iter().any(|a| a == "--bench");
    let filters: Vec<&str> = args
        .iter()
        .filter(|a| !a.starts_with('-'))
        .map(String::as_str)
        .collect();
    println!(
        "demand: {} CPUs, load average at start {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        support::load_average()
    );

    let started = SystemTime::now();
    benches();
    Criterion::default().configure_from_args().final_summary();
    if bench_mode {
        let mut rows = vec![PLAIN.to_string()];
        for (h, l) in WATERMARKS {
            rows.extend([prefetch_id(h, l), stream_source_id(h, l), chunks_id(h, l)]);
        }
        let rows: Vec<&str> = rows.iter().map(String::as_str).collect();
        support::print_throughput(MEMORY, N, &rows);
        for (h, l) in WATERMARKS {
            let peers = [PLAIN, &chunks_id(h, l)];
            support::print_ratios(MEMORY, &prefetch_id(h, l), &peers);
            support::print_ratios(MEMORY, &stream_source_id(h, l), &peers);
        }

        let (h, l) = WATERMARKS[0];
        println!(
            "\n== requirement of the issue: prefetch overhead ≤ {:.0} % vs the plain stream \
             (this run's medians, ratio = prefetch / plain time)",
            (MAX_OVERHEAD - 1.0) * 100.0
        );
        let results = [
            verdict(
                &format!("prefetch({h}, {l}) over IterSource vs iter"),
                MEMORY,
                &prefetch_id(h, l),
                PLAIN,
                started,
            ),
            verdict(
                &format!("prefetch({h}, {l}) over StreamSource vs iter"),
                MEMORY,
                &stream_source_id(h, l),
                PLAIN,
                started,
            ),
            verdict(
                &format!("prefetch({h}, {l}) over IterSource vs chunks"),
                MEMORY,
                &prefetch_id(h, l),
                &chunks_id(h, l),
                started,
            ),
        ];
        support::summary("checks", results);
    } else {
        println!("(no --bench: criterion smoke run, no verdicts)");
    }

    // Criterion filters its own groups; the Redis part runs unless a filter excludes it.
    if filters.is_empty() || filters.iter().any(|f| "demand_redis_streams".contains(f)) {
        redis_streams(bench_mode);
    }
    println!("\nload average at end: {}", support::load_average());
}
