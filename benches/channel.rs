//! Bounded channel throughput: `flowgate::channel` against tokio mpsc, flume, async-channel
//! and kanal, side by side; plus the cost of a `DropOldest` send into a slow consumer.
//!
//! # What is measured
//!
//! - **Transfer groups** (`channel_spsc_cap*`, `channel_mpsc_4to1_cap*`,
//!   `channel_mpmc_2to2_cap*`, capacities 1024 and 16): one iteration creates a fresh
//!   channel of `u64`, spawns the producer and consumer tasks with `tokio::spawn` on a
//!   2-worker multi-thread runtime (`CHANNEL_WORKERS` sets another count), moves
//!   [`ITEMS`] items through it (split evenly between the producers) and awaits every
//!   task. The consumers count and sum what they receive and the iteration asserts both
//!   totals, so a channel that loses or duplicates items fails instead of "winning".
//!   Throughput is reported per item. Every channel uses its plain awaiting send (flowgate
//!   under `Overflow::Backpressure`, the default).
//!   tokio mpsc is single-consumer, so it is not run in the MPMC groups (printed as n/a).
//! - **`channel_drop_oldest`**: a producer offers [`DROP_ITEMS`] items into a capacity-16
//!   channel that drops the oldest item when full, while a slow consumer task
//!   (`yield_now` after every item) drains it concurrently. The producer runs on the bench
//!   thread inside `block_on` (see `drop_oldest` for why). The measured time is its loop,
//!   so the throughput is items offered per second. flowgate (`Overflow::DropOldest`, dropped
//!   items counted through `on_drop`) runs against async-channel's `force_send`, which has
//!   the same drop-the-oldest semantics. Each iteration asserts the accounting
//!   (`sent == received + dropped`, `on_drop` calls `== dropped`); after the criterion run a
//!   separate one-shot run prints the exact counts.
//!
//! - **Steady-state groups** (`steady_{spsc,mpsc_4to1,mpmc_2to2}_cap{1024,16}_{task,block_on}`):
//!   the same transfers with 10^6 `u64` per round, long enough that the
//!   producers and consumers really run side by side on both workers for most of the round
//!   (10^4 items hide that: a good part of such an iteration is start-up and wind-down).
//!   Hand-timed, not criterion: per case, one fresh multi-thread runtime (2 workers
//!   unless `CHANNEL_WORKERS` says otherwise), a warm-up round of 10^5 items per channel,
//!   then 5 timed rounds in which the channels take turns, in an order rotated by one each
//!   round (so a change in the machine's load, or what the channel before leaves behind,
//!   such as kanal's spinning consumers, hits all of them alike); the median round is
//!   reported, with the slowest and fastest. A round is the wall time of the whole
//!   transfer, asserting count and sum like the criterion groups. Consumers run
//!   - `task`: as `tokio::spawn`ed tasks, like the producers;
//!   - `block_on`: each on its own plain thread in `futures::executor::block_on`, while the
//!     producers stay tasks: 3 busy threads on the 2 workers' cores (4 in MPMC), the layout
//!     of a sync consumer loop fed by async producers.
//!
//!   Then one PASS/FAIL line per case for issue 20's Must (flowgate's throughput at least
//!   tokio mpsc's, async-channel's and flume's; tokio only with one consumer), the aim in
//!   SPSC (within 1.5x of kanal, which is not cancel-safe) and the `support::summary` line.
//!   The verdicts read the median of the rounds' *paired* ratios (flowgate / peer within
//!   each round, where the two ran a few seconds apart at most), with their spread and the ratio of the
//!   two medians beside it; `CHANNEL_ROUNDS` sets the rounds (default 5). Ties within 5%
//!   are flagged, a shared machine is noisier than that. `CHANNEL_ONLY` (channel ids,
//!   comma-separated) runs flowgate against those peers only, for more rounds of one pair
//!   in the same time (kanal's rounds in `block_on` take seconds each); a Must whose peer
//!   was left out is not checked against it. flowgate also runs a second time in every
//!   round as if it were a peer (`flowgate_aa`, the A/A control): its paired ratio to
//!   flowgate, printed under each verdict, is the noise of that case in that run.
//!
//! After the criterion run, `main` reads criterion's medians back and prints, per group, the
//! throughput of every channel, the `flowgate / peer` time ratios (below 1.0: flowgate
//! faster) and a one-line verdict; then it runs the steady-state groups.
//!
//! # Running
//!
//! ```text
//! cargo bench --bench channel                      # everything, about 5 minutes
//! cargo bench --bench channel -- channel_spsc      # one scenario (other tables: stale/n/a)
//! cargo bench --bench channel -- steady_           # only the steady-state groups
//! CHANNEL_ROUNDS=11 cargo bench --bench channel -- steady_   # more rounds
//! CHANNEL_ONLY=flume,tokio_mpsc cargo bench --bench channel -- steady_spsc_cap16  # fewer peers
//! CHANNEL_WORKERS=4 cargo bench --bench channel -- steady_  # 4 tokio workers on the same cores
//! cargo bench --bench channel -- steady_spsc       # steady-state SPSC, both placements
//! ```
//!
//! Without `--bench` (as `cargo test --benches` runs it) the steady-state groups move
//! 10^4 items once each, without verdicts: a smoke test.

mod support;

#[path = "channel/steady.rs"]
mod steady;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput, criterion_group};
use flowgate::channel::{self, Sent};
use flowgate::{Dropped, Overflow};
use tokio::runtime::Runtime;

/// Items moved per iteration in the transfer groups (the same for every scenario).
const ITEMS: u64 = 10_000;
/// Items offered per iteration in the `DropOldest` group.
const DROP_ITEMS: u64 = 100_000;
/// Capacity of the `DropOldest` channel.
const DROP_CAP: usize = 16;
const CAPACITIES: [usize; 2] = [1024, 16];

const OURS: &str = "flowgate";
const PEERS: [&str; 4] = ["tokio_mpsc", "flume", "async_channel", "kanal"];

/// A transfer scenario: how many producer and consumer tasks share one channel.
#[derive(Clone, Copy)]
struct Scenario {
    name: &'static str,
    producers: u64,
    consumers: u64,
}

const SCENARIOS: [Scenario; 3] = [
    Scenario {
        name: "spsc",
        producers: 1,
        consumers: 1,
    },
    Scenario {
        name: "mpsc_4to1",
        producers: 4,
        consumers: 1,
    },
    Scenario {
        name: "mpmc_2to2",
        producers: 2,
        consumers: 2,
    },
];

impl Scenario {
    fn group(self, cap: usize) -> String {
        format!("channel_{}_cap{cap}", self.name)
    }
}

/// One bounded channel implementation, seen through the operations the benches need.
trait Chan: 'static {
    const ID: &'static str;
    type Tx: Clone + Send + Sync + 'static;
    type Rx: Send + 'static;
    fn bounded(cap: usize) -> (Self::Tx, Self::Rx);
    /// Send and wait for room; panics if the receivers are gone.
    fn send(tx: &Self::Tx, v: u64) -> impl Future<Output = ()> + Send;
    /// `None` once every sender is gone and the buffer is empty.
    fn recv(rx: &mut Self::Rx) -> impl Future<Output = Option<u64>> + Send;
    /// A second receiver on the same channel, if the channel is multi-consumer.
    fn clone_rx(rx: &Self::Rx) -> Option<Self::Rx>;
}

struct Flowgate;
impl Chan for Flowgate {
    const ID: &'static str = "flowgate";
    type Tx = channel::Sender<u64>;
    type Rx = channel::Receiver<u64>;
    fn bounded(cap: usize) -> (Self::Tx, Self::Rx) {
        channel::bounded(cap).expect("valid capacity")
    }
    async fn send(tx: &Self::Tx, v: u64) {
        // Under Backpressure every successful send must queue its item.
        let res = tx.send(v).await;
        assert!(
            matches!(res, Ok(Sent::Queued)),
            "flowgate send did not queue"
        );
    }
    async fn recv(rx: &mut Self::Rx) -> Option<u64> {
        rx.recv().await
    }
    fn clone_rx(rx: &Self::Rx) -> Option<Self::Rx> {
        Some(rx.clone())
    }
}

struct TokioMpsc;
impl Chan for TokioMpsc {
    const ID: &'static str = "tokio_mpsc";
    type Tx = tokio::sync::mpsc::Sender<u64>;
    type Rx = tokio::sync::mpsc::Receiver<u64>;
    fn bounded(cap: usize) -> (Self::Tx, Self::Rx) {
        tokio::sync::mpsc::channel(cap)
    }
    async fn send(tx: &Self::Tx, v: u64) {
        tx.send(v).await.expect("receiver alive");
    }
    async fn recv(rx: &mut Self::Rx) -> Option<u64> {
        rx.recv().await
    }
    fn clone_rx(_: &Self::Rx) -> Option<Self::Rx> {
        None
    }
}

struct Flume;
impl Chan for Flume {
    const ID: &'static str = "flume";
    type Tx = flume::Sender<u64>;
    type Rx = flume::Receiver<u64>;
    fn bounded(cap: usize) -> (Self::Tx, Self::Rx) {
        flume::bounded(cap)
    }
    async fn send(tx: &Self::Tx, v: u64) {
        tx.send_async(v).await.expect("receiver alive");
    }
    async fn recv(rx: &mut Self::Rx) -> Option<u64> {
        rx.recv_async().await.ok()
    }
    fn clone_rx(rx: &Self::Rx) -> Option<Self::Rx> {
        Some(rx.clone())
    }
}

struct AsyncChannel;
impl Chan for AsyncChannel {
    const ID: &'static str = "async_channel";
    type Tx = async_channel::Sender<u64>;
    type Rx = async_channel::Receiver<u64>;
    fn bounded(cap: usize) -> (Self::Tx, Self::Rx) {
        async_channel::bounded(cap)
    }
    async fn send(tx: &Self::Tx, v: u64) {
        tx.send(v).await.expect("receiver alive");
    }
    async fn recv(rx: &mut Self::Rx) -> Option<u64> {
        rx.recv().await.ok()
    }
    fn clone_rx(rx: &Self::Rx) -> Option<Self::Rx> {
        Some(rx.clone())
    }
}

struct Kanal;
impl Chan for Kanal {
    const ID: &'static str = "kanal";
    type Tx = kanal::AsyncSender<u64>;
    type Rx = kanal::AsyncReceiver<u64>;
    fn bounded(cap: usize) -> (Self::Tx, Self::Rx) {
        kanal::bounded_async(cap)
    }
    async fn send(tx: &Self::Tx, v: u64) {
        tx.send(v).await.expect("receiver alive");
    }
    async fn recv(rx: &mut Self::Rx) -> Option<u64> {
        rx.recv().await.ok()
    }
    fn clone_rx(rx: &Self::Rx) -> Option<Self::Rx> {
        Some(rx.clone())
    }
}

/// Worker threads of every group's runtime: 2 (one per core on the machine this was
/// written on), or `CHANNEL_WORKERS` (to measure another thread layout, such as more
/// workers than cores).
fn workers() -> usize {
    std::env::var("CHANNEL_WORKERS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(2)
}

/// The runtime every group uses: multi-thread, [`workers`] workers.
fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers())
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// Where the consumers of a transfer run.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Placement {
    /// `tokio::spawn`ed tasks on the runtime's workers, like the producers.
    Task,
    /// Each consumer on its own plain thread, in `futures::executor::block_on`: with the 2
    /// workers that run the producers, 3 busy threads (4 for MPMC) on the 2 cores.
    BlockOn,
}

impl Placement {
    fn label(self) -> &'static str {
        match self {
            Placement::Task => "task",
            Placement::BlockOn => "block_on",
        }
    }
}

/// A running consumer: (count, sum) of what it received once the channel is closed.
enum Consumer {
    Task(tokio::task::JoinHandle<(u64, u64)>),
    Thread(std::thread::JoinHandle<(u64, u64)>),
}

impl Consumer {
    fn start<C: Chan>(rx: C::Rx, at: Placement) -> Consumer {
        match at {
            Placement::Task => Consumer::Task(tokio::spawn(consume::<C>(rx))),
            Placement::BlockOn => Consumer::Thread(std::thread::spawn(move || {
                futures::executor::block_on(consume::<C>(rx))
            })),
        }
    }

    /// Joining a thread blocks, but only the bench thread's `block_on` (not a worker), and
    /// only once every producer is done.
    async fn finish(self) -> (u64, u64) {
        match self {
            Consumer::Task(task) => task.await.expect("consumer task"),
            Consumer::Thread(thread) => thread.join().expect("consumer thread"),
        }
    }
}

/// One transfer: fresh channel, start every consumer (at `at`) and spawn every producer
/// task, await everything, check that each of the `items` arrived exactly once.
async fn transfer<C: Chan>(cap: usize, s: Scenario, items: u64, at: Placement) {
    let (tx, rx) = C::bounded(cap);
    let per_producer = items / s.producers;

    let mut consumers = Vec::with_capacity(s.consumers as usize);
    for _ in 1..s.consumers {
        let rx = C::clone_rx(&rx).expect("multi-consumer channel");
        consumers.push(Consumer::start::<C>(rx, at));
    }
    consumers.push(Consumer::start::<C>(rx, at));

    let producers: Vec<_> = (0..s.producers)
        .map(|p| {
            let tx = tx.clone();
            tokio::spawn(async move {
                for v in p * per_producer..(p + 1) * per_producer {
                    C::send(&tx, v).await;
                }
            })
        })
        .collect();
    drop(tx);

    for p in producers {
        p.await.expect("producer task");
    }
    let (mut count, mut sum) = (0, 0);
    for c in consumers {
        let (n, s) = c.finish().await;
        count += n;
        sum += s;
    }
    assert_eq!(count, items, "{}: items received", C::ID);
    assert_eq!(sum, items * (items - 1) / 2, "{}: checksum", C::ID);
}

/// Receive until the channel is closed and drained; (count, sum) of the items.
async fn consume<C: Chan>(mut rx: C::Rx) -> (u64, u64) {
    let (mut count, mut sum) = (0u64, 0u64);
    while let Some(v) = C::recv(&mut rx).await {
        count += 1;
        sum += v;
    }
    (count, sum)
}

fn bench_transfer<C: Chan>(
    g: &mut BenchmarkGroup<'_, WallTime>,
    rt: &Runtime,
    cap: usize,
    s: Scenario,
) {
    g.bench_function(C::ID, |b| {
        b.to_async(rt)
            .iter(|| transfer::<C>(cap, s, ITEMS, Placement::Task))
    });
}

fn transfers(c: &mut Criterion) {
    for s in SCENARIOS {
        for cap in CAPACITIES {
            let rt = runtime();
            let mut g = c.benchmark_group(s.group(cap));
            g.throughput(Throughput::Elements(ITEMS));
            bench_transfer::<Flowgate>(&mut g, &rt, cap, s);
            if s.consumers == 1 {
                // tokio mpsc has a single receiver: skipped for MPMC (n/a in the tables).
                bench_transfer::<TokioMpsc>(&mut g, &rt, cap, s);
            }
            bench_transfer::<Flume>(&mut g, &rt, cap, s);
            bench_transfer::<AsyncChannel>(&mut g, &rt, cap, s);
            bench_transfer::<Kanal>(&mut g, &rt, cap, s);
            g.finish();
        }
    }
}

/// What one `DropOldest` run observed.
#[derive(Debug, Clone, Copy)]
struct DropRun {
    /// The producer's own time to offer every item.
    producer_time: Duration,
    sent: u64,
    received: u64,
    dropped: u64,
    /// Drops seen by the sender side: `on_drop` hook calls (flowgate) or dropped items
    /// returned by `force_send` (async-channel).
    hook_calls: u64,
    /// What `hook_calls` counts, for the one-shot report.
    hook_label: &'static str,
}

async fn drop_oldest_flowgate() -> DropRun {
    let hook_calls = Arc::new(AtomicU64::new(0));
    let hook = Arc::clone(&hook_calls);
    let (tx, mut rx) = channel::builder(DROP_CAP)
        .overflow(Overflow::DropOldest)
        .on_drop(move |_item: u64, _why: &Dropped| {
            hook.fetch_add(1, Ordering::Relaxed);
        })
        .name("bench")
        .build()
        .expect("valid config");

    // Slow consumer: yields to the scheduler after every item.
    let consumer = tokio::spawn(async move {
        let mut received = 0u64;
        while rx.recv().await.is_some() {
            received += 1;
            tokio::task::yield_now().await;
        }
        (received, rx.stats())
    });
    // The producer runs right here, on the `block_on` thread: see `drop_oldest`.
    let start = Instant::now();
    let mut dropped_oldest = 0u64;
    for v in 0..DROP_ITEMS {
        match tx.send(v).await {
            Ok(Sent::Queued) => {}
            Ok(Sent::DroppedOldest) => dropped_oldest += 1,
            Ok(Sent::DroppedNewest) => panic!("DropOldest dropped the newest item"),
            Err(_) => panic!("receiver gone"),
        }
    }
    let producer_time = start.elapsed();
    drop(tx);

    let (received, stats) = consumer.await.expect("consumer task");
    let run = DropRun {
        producer_time,
        sent: stats.sent,
        received,
        dropped: stats.dropped,
        hook_calls: hook_calls.load(Ordering::Relaxed),
        hook_label: "on_drop calls",
    };
    assert_eq!(
        run.sent, DROP_ITEMS,
        "flowgate: stats.sent counts every offer"
    );
    assert_eq!(stats.received, received, "flowgate: stats.received");
    assert_eq!(run.sent, run.received + run.dropped, "flowgate: accounting");
    assert_eq!(run.hook_calls, run.dropped, "flowgate: on_drop calls");
    assert_eq!(
        dropped_oldest, run.dropped,
        "flowgate: Sent::DroppedOldest results"
    );
    run
}

async fn drop_oldest_async_channel() -> DropRun {
    let (tx, rx) = async_channel::bounded::<u64>(DROP_CAP);
    let consumer = tokio::spawn(async move {
        let mut received = 0u64;
        while rx.recv().await.is_ok() {
            received += 1;
            tokio::task::yield_now().await;
        }
        received
    });
    let start = Instant::now();
    let mut evicted = 0u64;
    for v in 0..DROP_ITEMS {
        if tx.force_send(v).expect("receiver alive").is_some() {
            evicted += 1;
        }
    }
    let producer_time = start.elapsed();
    drop(tx);

    let received = consumer.await.expect("consumer task");
    let run = DropRun {
        producer_time,
        sent: DROP_ITEMS,
        received,
        dropped: evicted,
        hook_calls: evicted,
        hook_label: "force_send evictions",
    };
    assert_eq!(
        run.sent,
        run.received + run.dropped,
        "async_channel: accounting"
    );
    run
}

/// The `DropOldest` group. Unlike the transfer groups, the producer is not a spawned task: it
/// runs in the `block_on` future, on the bench thread, while the consumer is a task on a
/// worker. A producer that never waits (no send under `DropOldest` does) would otherwise wake
/// the consumer into its own worker's LIFO slot, which the other worker cannot steal, so the
/// consumer would only run after the producer finished and receive just the last 16 items.
/// Waking from outside the runtime's workers goes through the shared queue instead, so the
/// consumer really drains concurrently.
fn drop_oldest(c: &mut Criterion) {
    let rt = runtime();
    let mut g = c.benchmark_group("channel_drop_oldest");
    g.throughput(Throughput::Elements(DROP_ITEMS));
    // ~5-10 ms per iteration: a little more time so 20 samples fit.
    g.measurement_time(Duration::from_secs(3));
    g.bench_function(OURS, |b| {
        b.iter_custom(|iters| {
            (0..iters)
                .map(|_| rt.block_on(drop_oldest_flowgate()).producer_time)
                .sum()
        })
    });
    g.bench_function("async_channel_force_send", |b| {
        b.iter_custom(|iters| {
            (0..iters)
                .map(|_| rt.block_on(drop_oldest_async_channel()).producer_time)
                .sum()
        })
    });
    g.finish();
}

/// Which bench of `group` has the lowest median, and whether flowgate is at least as fast
/// as each of `key_peers`.
fn verdict(group: &str, ids: &[&str], key_peers: &[&str]) {
    let medians: Vec<(&str, f64)> = ids
        .iter()
        .filter_map(|id| support::median_ns(group, id).map(|m| (*id, m)))
        .collect();
    let Some(&(fastest, _)) = medians.iter().min_by(|a, b| a.1.total_cmp(&b.1)) else {
        println!("verdict {group}: no measurements");
        return;
    };
    let ours = support::median_ns(group, OURS);
    let against = |peer: &str| match (ours, support::median_ns(group, peer)) {
        (Some(o), Some(p)) => {
            let ratio = o / p;
            let cmp = if ratio <= 1.0 { ">=" } else { "<" };
            // Run-to-run noise on this 2-core box is a few percent: flag near-ties.
            let close = if (ratio - 1.0).abs() < 0.05 {
                ", within 5%: a tie"
            } else {
                ""
            };
            format!("flowgate {cmp} {peer} (time ratio {ratio:.3}{close})")
        }
        _ => format!("{peer} n/a"),
    };
    let vs: Vec<String> = key_peers.iter().map(|p| against(p)).collect();
    println!("verdict {group}: fastest = {fastest}; {}", vs.join("; "));
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20)
        .configure_from_args()
}

criterion_group! {
    name = benches;
    config = config();
    targets = transfers, drop_oldest
}

fn main() {
    let (filter, bench_mode) = support::filter_and_mode();
    if std::env::args().any(|a| a == "--list") {
        benches();
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();

    for s in SCENARIOS {
        for cap in CAPACITIES {
            let group = s.group(cap);
            let mut all = vec![OURS];
            all.extend(PEERS);
            support::print_throughput(&group, ITEMS, &all);
            if s.consumers == 1 {
                support::print_ratios(&group, OURS, &PEERS);
            } else {
                support::print_ratios(&group, OURS, &PEERS[1..]);
                println!("  {:<28} n/a (single consumer, not run for MPMC)", PEERS[0]);
            }
            verdict(&group, &all, &["tokio_mpsc", "async_channel"]);
        }
    }

    let drop_ids = [OURS, "async_channel_force_send"];
    support::print_throughput("channel_drop_oldest", DROP_ITEMS, &drop_ids);
    support::print_ratios("channel_drop_oldest", OURS, &drop_ids[1..]);
    verdict("channel_drop_oldest", &drop_ids, &drop_ids[1..]);

    // One-shot run for the exact accounting (the criterion iterations assert it too).
    let rt = runtime();
    for (id, run) in [
        (OURS, rt.block_on(drop_oldest_flowgate())),
        (
            "async_channel_force_send",
            rt.block_on(drop_oldest_async_channel()),
        ),
    ] {
        println!(
            "channel_drop_oldest one-shot {id}: cap {DROP_CAP}, offered {DROP_ITEMS} in {:?}: \
             sent {} = received {} + dropped {}; {} {} ok",
            run.producer_time, run.sent, run.received, run.dropped, run.hook_label, run.hook_calls
        );
    }

    steady::run(filter.as_deref(), bench_mode);
}
