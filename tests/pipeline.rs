//! An internal pipeline built from flowgate's combinators alone: a producer task sending
//! into a bounded channel, the receiver paced by a leaky bucket, a bulkhead over the work,
//! and a slow sink. Every item carries a ledger entry: it ends in exactly one fate
//! (delivered, handed back, or seen by a drop hook), and an item dropped where nobody sees
//! it records `silent`. The stages' own counts (channel `Stats`, `LeakyQueue::dropped`,
//! `BulkheadStats`) must add up to the ledger exactly. Under paused time.

mod support;

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use flowgate::bulkhead::{Bulkhead, BulkheadMapUnordered};
use flowgate::channel::{self, Receiver, SendError, Sender};
use flowgate::demand::Levels;
use flowgate::pace::{Leaky, LeakyQueue, Pacer};
use flowgate::{Dropped, FlowSinkExt, FlowStreamExt, Overflow, Rate};
use futures::{FutureExt, Sink, SinkExt, Stream, StreamExt};
use tokio::time::{Instant, Sleep, advance, sleep};

/// Where each item ended, by id.
#[derive(Default)]
struct Ledger {
    fates: Mutex<BTreeMap<u32, Vec<String>>>,
}

impl Ledger {
    fn note(&self, id: u32, fate: String) {
        self.fates.lock().unwrap().entry(id).or_default().push(fate);
    }

    /// Every id in `0..produced` has exactly one fate; the count of each fate.
    fn settled(&self, produced: u32) -> BTreeMap<String, u64> {
        let fates = self.fates.lock().unwrap();
        let mut counts = BTreeMap::new();
        for id in 0..produced {
            let f = fates.get(&id).map(Vec::as_slice).unwrap_or_default();
            assert_eq!(f.len(), 1, "item {id} has fates {f:?}");
            *counts.entry(f[0].clone()).or_insert(0) += 1;
        }
        assert_eq!(fates.len(), produced as usize, "unknown ids: {fates:?}");
        counts
    }
}

/// Sum of the counts whose fate starts with `prefix`.
fn sum(counts: &BTreeMap<String, u64>, prefix: &str) -> u64 {
    counts
        .iter()
        .filter(|(k, _)| k.starts_with(prefix))
        .map(|(_, v)| v)
        .sum()
}

/// An item that records `silent` in its ledger if it is dropped before it is settled.
struct Item {
    id: u32,
    ledger: Arc<Ledger>,
    settled: bool,
}

impl Item {
    fn new(id: u32, ledger: &Arc<Ledger>) -> Item {
        Item {
            id,
            ledger: ledger.clone(),
            settled: false,
        }
    }

    fn settle(mut self, fate: impl Into<String>) {
        self.settled = true;
        self.ledger.note(self.id, fate.into());
    }
}

impl Drop for Item {
    fn drop(&mut self) {
        if !self.settled {
            self.ledger.note(self.id, "silent".into());
        }
    }
}

/// A drop hook settling each item as `stage:reason`.
fn hook(stage: &'static str) -> impl Fn(Item, &Dropped) + Send + Sync + 'static {
    move |item: Item, why: &Dropped| item.settle(format!("{stage}:{}", why.as_str()))
}

/// Work in flight inside the bulkhead: the item settles as `work:cancelled` if its future
/// is dropped (the user's item, in the user's future).
struct InFlight(Option<Item>);

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(item) = self.0.take() {
            item.settle("work:cancelled");
        }
    }
}

/// The guard is made when `f` maps the item, not when the future first runs: a future the
/// adapter made but had not polled yet is dropped with its item too.
fn work(item: Item, ms: u64) -> impl Future<Output = Item> + Send {
    let mut guard = InFlight(Some(item));
    async move {
        sleep(Duration::from_millis(ms)).await;
        guard.0.take().expect("held")
    }
}

/// A slow sink holding one item: `start_send` takes it, `poll_flush` delivers it after
/// `per_item` (flush means delivered), `poll_ready` flushes first. `fail_on`: the id whose
/// delivery fails (handed back in the error).
struct SlowSink {
    per_item: Duration,
    in_hand: Option<(Item, Pin<Box<Sleep>>)>,
    fail_on: Option<u32>,
    delivered: Arc<Mutex<Vec<(u32, Duration)>>>,
    start: Instant,
}

#[derive(Debug)]
struct Failed(u32);

impl SlowSink {
    fn new(per_item: Duration) -> SlowSink {
        SlowSink {
            per_item,
            in_hand: None,
            fail_on: None,
            delivered: Arc::default(),
            start: Instant::now(),
        }
    }

    fn delivered(&self) -> Vec<u32> {
        self.delivered.lock().unwrap().iter().map(|d| d.0).collect()
    }
}

impl Drop for SlowSink {
    fn drop(&mut self) {
        if let Some((item, _)) = self.in_hand.take() {
            item.settle("sink:in_hand");
        }
    }
}

impl Sink<Item> for SlowSink {
    type Error = Failed;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Failed>> {
        self.poll_flush(cx)
    }

    fn start_send(self: Pin<&mut Self>, item: Item) -> Result<(), Failed> {
        let this = self.get_mut();
        assert!(this.in_hand.is_none(), "start_send without poll_ready");
        this.in_hand = Some((item, Box::pin(sleep(this.per_item))));
        Ok(())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Failed>> {
        let this = self.get_mut();
        if let Some((_, timer)) = &mut this.in_hand {
            std::task::ready!(timer.as_mut().poll(cx));
            let (item, _) = this.in_hand.take().expect("in hand");
            let id = item.id;
            if this.fail_on == Some(id) {
                item.settle("sink:failed");
                return Poll::Ready(Err(Failed(id)));
            }
            this.delivered
                .lock()
                .unwrap()
                .push((id, this.start.elapsed()));
            item.settle("delivered");
        }
        Poll::Ready(Ok(()))
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Failed>> {
        self.poll_flush(cx)
    }
}

/// Produce `n` items in bursts of `burst`, `gap` apart; what a send hands back settles as
/// `producer:full` or `producer:closed`.
async fn produce(tx: Sender<Item>, ledger: Arc<Ledger>, n: u32, burst: u32, gap: Duration) {
    for id in 0..n {
        match tx.send(Item::new(id, &ledger)).await {
            Ok(_) => {}
            Err(e) => {
                let fate = if e.is_full() {
                    "producer:full"
                } else {
                    "producer:closed"
                };
                e.into_inner().settle(fate);
            }
        }
        if (id + 1) % burst == 0 {
            sleep(gap).await;
        }
    }
}

fn pacer(per_second: u32, burst: u32) -> Pacer {
    Pacer::builder(Rate::per_second(per_second).unwrap())
        .burst(burst)
        .build()
        .unwrap()
}

type Work = Pin<Box<dyn Future<Output = Item> + Send>>;
type Queue = LeakyQueue<Receiver<Item>>;
type Out = BulkheadMapUnordered<Queue, fn(Item) -> Work, Work>;

/// The consumer side: channel receiver → leaky queue (`queue_cap`, `queue_policy`) →
/// bulkhead of 3 (40 ms of work each) → the slow sink (10 ms per item).
fn consumer(
    rx: Receiver<Item>,
    pacer: Pacer,
    queue_cap: usize,
    queue_policy: Overflow,
    bulkhead: &Bulkhead,
) -> Pin<Box<Out>> {
    let queue = LeakyQueue::builder(rx, pacer, queue_cap)
        .overflow(queue_policy)
        .on_drop(hook("queue"))
        .build()
        .unwrap();
    let f: fn(Item) -> Work = |item| Box::pin(work(item, 40));
    Box::pin(
        BulkheadMapUnordered::builder(queue, bulkhead.clone(), f)
            .on_drop(hook("bulkhead"))
            .build()
            .unwrap(),
    )
}

/// The leaky queue under the bulkhead adapter.
fn queue(out: &Pin<Box<Out>>) -> &Queue {
    (**out).get_ref()
}

struct Run {
    counts: BTreeMap<String, u64>,
    channel: channel::Stats,
    queue_dropped: u64,
    admitted: u64,
    delivered: Vec<u32>,
}

/// The whole pipeline to its end: `n` items in bursts of 25 every 100 ms, a channel of 8,
/// pacing at 100/s, a queue of 4, a bulkhead of 3, a sink of 10 ms per item.
async fn run(n: u32, channel_policy: Overflow, queue_policy: Overflow) -> Run {
    let (ledger, producer, bulkhead, mut out, mut sink) =
        rig(n, channel_policy, queue_policy, 25, 100);
    assert!(drain(&mut out, &mut sink).await, "the pipeline hangs");
    producer.await.unwrap();
    SinkExt::close(&mut sink).await.unwrap();
    let queue_dropped = queue(&out).dropped();
    let channel = queue(&out).get_ref().stats();
    drop(out);
    let delivered = sink.delivered();
    drop(sink);
    Run {
        counts: ledger.settled(n),
        channel,
        queue_dropped,
        admitted: bulkhead.stats().admitted,
        delivered,
    }
}

const POLICIES: [Overflow; 4] = [
    Overflow::Backpressure,
    Overflow::Reject,
    Overflow::DropNewest,
    Overflow::DropOldest,
];

#[tokio::test(start_paused = true)]
async fn every_item_is_delivered_or_counted_where_it_was_dropped_under_every_policy() {
    let n = 300;
    for channel_policy in POLICIES {
        for queue_policy in POLICIES {
            let r = run(n, channel_policy, queue_policy).await;
            let c = &r.counts;
            let what = format!("{channel_policy}/{queue_policy}: {c:?} {:?}", r.channel);
            assert_eq!(sum(c, "silent"), 0, "{what}");
            // The producer: what the channel did not accept was handed back.
            let handed_back = sum(c, "producer:");
            assert_eq!(r.channel.sent, u64::from(n) - handed_back, "{what}");
            // The channel: its drops are the hook's, and the rest was received.
            assert_eq!(r.channel.dropped, sum(c, "channel:"), "{what}");
            assert_eq!(
                r.channel.sent,
                r.channel.received + r.channel.dropped,
                "{what}"
            );
            // The queue: its overflow drops; nothing was left in it at the end.
            assert_eq!(r.queue_dropped, sum(c, "queue:"), "{what}");
            assert_eq!(sum(c, "queue:discarded"), 0, "{what}");
            // The bulkhead: one admission per item that reached the sink.
            assert_eq!(sum(c, "bulkhead:"), 0, "{what}");
            assert_eq!(sum(c, "work:"), 0, "{what}");
            // A permit passed from a finished item to the next is no new admission.
            assert!(r.admitted <= r.delivered.len() as u64, "{what}");
            assert!(r.admitted > 0 || r.delivered.is_empty(), "{what}");
            assert_eq!(
                r.channel.received,
                r.queue_dropped + r.delivered.len() as u64,
                "{what}"
            );
            assert_eq!(
                c.get("delivered").copied().unwrap_or(0),
                r.delivered.len() as u64
            );
            // The policies: only a waiting one loses nothing.
            if channel_policy == Overflow::Backpressure {
                assert_eq!(handed_back + r.channel.dropped, 0, "{what}");
            } else {
                assert!(handed_back + r.channel.dropped > 0, "{what}");
            }
            if queue_policy == Overflow::Backpressure {
                assert_eq!(r.queue_dropped, 0, "{what}");
            }
            if (channel_policy, queue_policy) == (Overflow::Backpressure, Overflow::Backpressure) {
                assert_eq!(r.delivered.len() as u32, n, "{what}");
            }
        }
    }
}

/// The pipeline's parts: its ledger, the producer task, the bulkhead, the consumer side
/// and the sink.
type Rig = (
    Arc<Ledger>,
    tokio::task::JoinHandle<()>,
    Bulkhead,
    Pin<Box<Out>>,
    SlowSink,
);

/// A channel of 8 under `policy` whose drops settle as `channel:reason`.
fn counted_channel(policy: Overflow) -> (Sender<Item>, Receiver<Item>) {
    channel::builder(8)
        .overflow(policy)
        .on_drop(hook("channel"))
        .build()
        .unwrap()
}

/// The producer task sending `n` items in bursts of `burst` every `gap_ms` into a
/// [`counted_channel`] under `policy`: the ledger, the task and the receiver.
fn source(
    n: u32,
    policy: Overflow,
    burst: u32,
    gap_ms: u64,
) -> (Arc<Ledger>, tokio::task::JoinHandle<()>, Receiver<Item>) {
    let ledger = Arc::new(Ledger::default());
    let (tx, rx) = counted_channel(policy);
    let gap = Duration::from_millis(gap_ms);
    let producer = tokio::spawn(produce(tx, ledger.clone(), n, burst, gap));
    (ledger, producer, rx)
}

/// Start the pipeline: `n` items in bursts of `burst` every `gap_ms` into a channel of 8
/// under `channel_policy`; pacing at 100/s into a queue of 4 under `queue_policy`; a
/// bulkhead of 3 (40 ms of work each); a sink of 10 ms per item.
fn rig(n: u32, channel_policy: Overflow, queue_policy: Overflow, burst: u32, gap_ms: u64) -> Rig {
    let (ledger, producer, rx) = source(n, channel_policy, burst, gap_ms);
    let bulkhead = Bulkhead::new(3).unwrap();
    let out = consumer(rx, pacer(100, 2), 4, queue_policy, &bulkhead);
    let sink = SlowSink::new(Duration::from_millis(10));
    (ledger, producer, bulkhead, out, sink)
}

/// Drive `out` into `sink` to its end; false if it has not ended within a minute.
async fn drain(out: &mut (impl Stream<Item = Item> + Unpin), sink: &mut SlowSink) -> bool {
    tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(item) = out.next().await {
            sink.send(item).await.unwrap();
        }
    })
    .await
    .is_ok()
}

/// Drive `out` into `sink` for `ms` milliseconds.
async fn consume_for(out: &mut (impl Stream<Item = Item> + Unpin), sink: &mut SlowSink, ms: u64) {
    let _ = tokio::time::timeout(Duration::from_millis(ms), async {
        while let Some(item) = out.next().await {
            sink.send(item).await.unwrap();
        }
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_consumer_dropped_mid_stream_leaves_every_item_counted_in_its_stage() {
    for channel_policy in POLICIES {
        for queue_policy in POLICIES {
            let n = 200;
            let (ledger, producer, bulkhead, mut out, mut sink) =
                rig(n, channel_policy, queue_policy, 25, 100);
            // 335 ms: mid-burst, with work in flight, the queue full and the channel busy.
            consume_for(&mut out, &mut sink, 335).await;
            let channel = queue(&out).get_ref().stats();
            let queue_dropped = queue(&out).dropped();
            let queued = queue(&out).queued() as u64;
            let in_channel = queue(&out).get_ref().len() as u64;
            drop(out);
            assert_eq!(bulkhead.in_flight(), 0);
            drop(sink);
            // The producer finds the channel closed and ends; no hang.
            tokio::time::timeout(Duration::from_secs(60), producer)
                .await
                .expect("the producer ends")
                .unwrap();
            let c = ledger.settled(n);
            let what = format!("{channel_policy}/{queue_policy}: {c:?} {channel:?}");
            assert_eq!(sum(&c, "silent"), 0, "{what}");
            assert_eq!(sum(&c, "queue:discarded"), queued, "{what}");
            assert_eq!(
                sum(&c, "channel:discarded"),
                in_channel,
                "items in the channel at the drop: {what}"
            );
            assert_eq!(queue_dropped, sum(&c, "queue:") - queued, "{what}");
            assert!(sum(&c, "producer:closed") > 0, "{what}");
            assert!(sum(&c, "work:cancelled") > 0, "{what}");
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_producer_dropped_mid_stream_lets_everything_drain_and_end() {
    for channel_policy in POLICIES {
        let n = 200;
        let (ledger, producer, _, mut out, mut sink) =
            rig(n, channel_policy, Overflow::Backpressure, 25, 100);
        let aborter = tokio::spawn(async move {
            sleep(Duration::from_millis(250)).await;
            producer.abort();
            let _ = producer.await;
        });
        let drained = drain(&mut out, &mut sink).await;
        assert!(drained, "{channel_policy}: the pipeline hangs");
        aborter.await.unwrap();
        let channel = queue(&out).get_ref().stats();
        drop(out);
        drop(sink);
        let fates = ledger.fates.lock().unwrap();
        let produced = fates.keys().max().map_or(0, |m| m + 1);
        drop(fates);
        let c = ledger.settled(produced);
        let what = format!("{channel_policy}: {c:?} {channel:?}");
        // A `send` aborted while it waits drops its item unseen (documented: reserve first).
        let silent = sum(&c, "silent");
        if channel_policy == Overflow::Backpressure {
            assert!(silent <= 1, "{what}");
        } else {
            assert_eq!(silent, 0, "{what}");
        }
        assert_eq!(channel.sent, channel.received + channel.dropped, "{what}");
        assert_eq!(
            c.get("delivered").copied().unwrap_or(0),
            channel.received,
            "{what}"
        );
    }
}

/// The channel's `Sink` under `Reject`, paced by a `LeakySink`: a full channel fails
/// `send_all` with the item handed back; a second `send_all` goes on where it stopped.
#[tokio::test(start_paused = true)]
async fn a_sink_error_mid_way_hands_the_item_back_and_a_second_send_all_resumes() {
    let ledger = Arc::new(Ledger::default());
    let (tx, mut rx) = channel::builder(4)
        .overflow(Overflow::Reject)
        .on_drop(hook("channel"))
        .build()
        .unwrap();
    let mut sink = tx.leaky_sink_with(pacer(1000, 1));
    let n = 20u32;
    let mut items = futures::stream::iter((0..n).map(|id| Ok(Item::new(id, &ledger))));
    let mut back = Vec::new();
    loop {
        match sink.send_all(&mut items).await {
            Ok(()) => break,
            Err(SendError::Full(item)) => {
                back.push(item.id);
                item.settle("handed back");
                // Make room, then go on.
                while let Ok(item) = rx.try_recv() {
                    item.settle("delivered");
                }
            }
            Err(e) => panic!("{e:?}"),
        }
    }
    SinkExt::close(&mut sink).await.unwrap();
    drop(sink);
    while let Some(item) = rx.recv().await {
        item.settle("delivered");
    }
    let c = ledger.settled(n);
    assert_eq!(back, [4, 9, 14, 19]);
    assert_eq!(c.get("delivered"), Some(&16));
    assert_eq!(rx.stats().sent, 16);
}

/// The slow sink fails mid-way: the item is in the error, and the adapters upstream hold
/// theirs until the consumer decides; dropping them then counts each one.
#[tokio::test(start_paused = true)]
async fn a_failing_sink_mid_way_loses_no_item_upstream() {
    let n = 60;
    let (ledger, producer, _, mut out, mut sink) =
        rig(n, Overflow::Backpressure, Overflow::Backpressure, 20, 50);
    sink.fail_on = Some(17);
    let err = async {
        while let Some(item) = out.next().await {
            sink.send(item).await?;
        }
        Ok(())
    }
    .await;
    assert!(matches!(err, Err(Failed(17))));
    drop(out);
    drop(sink);
    producer.await.unwrap();
    let c = ledger.settled(n);
    assert_eq!(sum(&c, "silent"), 0, "{c:?}");
    assert_eq!(c.get("sink:failed"), Some(&1));
    assert_eq!(c.get("delivered"), Some(&17), "{c:?}");
}

/// Pacing at the extremes through the channel: 1/s with a burst of 1 releases item `i` at
/// exactly `i` seconds; 1M/s releases 200 000 items in exactly the schedule's time.
#[tokio::test(start_paused = true)]
async fn pacing_through_the_channel_is_exact_at_one_per_second() {
    let (tx, rx) = channel::bounded::<u32>(4).unwrap();
    let producer = tokio::spawn(async move {
        for i in 0..10 {
            tx.send(i).await.unwrap();
        }
    });
    let start = Instant::now();
    let at: Vec<(u32, Duration)> = Leaky::builder(rx, pacer(1, 1))
        .build()
        .unwrap()
        .map(|i| (i, start.elapsed()))
        .collect()
        .await;
    producer.await.unwrap();
    let want: Vec<(u32, Duration)> = (0..10)
        .map(|i| (i, Duration::from_secs(i.into())))
        .collect();
    assert_eq!(at, want);
}

#[tokio::test(start_paused = true)]
async fn pacing_through_the_channel_is_exact_at_a_million_per_second() {
    for queued in [false, true] {
        let n = 200_000u32;
        let (tx, rx) = channel::bounded::<u32>(1024).unwrap();
        let producer = tokio::spawn(async move {
            for i in 0..n {
                tx.send(i).await.unwrap();
            }
        });
        let p = Pacer::builder(Rate::per_second(1_000_000).unwrap())
            .build()
            .unwrap();
        let burst = 1 + 5_000; // 1 + ceil(1M × 5 ms)
        let start = Instant::now();
        let mut per_ms: BTreeMap<u128, u32> = BTreeMap::new();
        let mut next = 0;
        let mut paced: Pin<Box<dyn Stream<Item = u32>>> = if queued {
            Box::pin(LeakyQueue::builder(rx, p, 4096).build().unwrap())
        } else {
            Box::pin(Leaky::builder(rx, p).build().unwrap())
        };
        while let Some(i) = paced.next().await {
            assert_eq!(i, next);
            next += 1;
            *per_ms.entry(start.elapsed().as_millis()).or_default() += 1;
        }
        producer.await.unwrap();
        assert_eq!(next, n);
        // By the end of ms k at most burst + 1000·k left, and the run ends on the schedule.
        let mut total = 0;
        for (ms, count) in &per_ms {
            total += count;
            assert!(
                u128::from(total) <= burst + 1000 * ms,
                "queued {queued}: {total} by {ms} ms: {per_ms:?}"
            );
        }
        let last = *per_ms.keys().last().unwrap();
        assert_eq!(last, u128::from(n - 5_001).div_ceil(1000), "{per_ms:?}");
    }
}

/// The consumer dropped while the producer, a `LeakySink` over the channel's sender, waits
/// for a slot in the full channel: its `send_all` fails with the item handed back, and the
/// items in the channel are discarded, counted.
#[tokio::test(start_paused = true)]
async fn a_consumer_dropped_while_a_paced_producer_sink_waits_loses_nothing() {
    let ledger = Arc::new(Ledger::default());
    let (tx, mut rx) = counted_channel(Overflow::Backpressure);
    let n = 40u32;
    let source = ledger.clone();
    let producer = tokio::spawn(async move {
        let mut sink = tx.leaky_sink_with(pacer(10, 1));
        let mut items = futures::stream::iter((0..n).map(|id| Ok(Item::new(id, &source))));
        let err = sink.send_all(&mut items).await.unwrap_err();
        assert!(err.is_closed());
        err.into_inner().settle("producer:closed");
        while let Some(Ok(item)) = items.next().await {
            item.settle("never sent");
        }
    });
    for _ in 0..5 {
        rx.recv().await.unwrap().settle("delivered");
    }
    sleep(Duration::from_millis(1_050)).await;
    let in_channel = rx.len() as u64;
    drop(rx);
    producer.await.unwrap();
    let c = ledger.settled(n);
    assert_eq!(sum(&c, "silent"), 0, "{c:?}");
    assert_eq!(c.get("producer:closed"), Some(&1), "{c:?}");
    assert_eq!(sum(&c, "channel:discarded"), in_channel, "{c:?}");
    assert_eq!(in_channel, 8, "{c:?}"); // full: the producer waits for a slot
}

/// A clock jump (the runtime's clock advanced by an hour while items wait): the pacer
/// releases at most its burst at once, then keeps the rate; nothing is lost or doubled.
#[tokio::test(start_paused = true)]
async fn a_clock_jump_releases_at_most_the_burst_then_the_rate() {
    let (tx, rx) = channel::bounded::<u32>(64).unwrap();
    for i in 0..50 {
        tx.try_send(i).unwrap();
    }
    drop(tx);
    let start = Instant::now();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let consumer = tokio::spawn(async move {
        let mut paced = Leaky::builder(rx, pacer(10, 3)).build().unwrap();
        while let Some(i) = paced.next().await {
            log.lock().unwrap().push((i, start.elapsed()));
        }
    });
    sleep(Duration::from_millis(450)).await;
    let before = seen.lock().unwrap().len();
    // 3 at once, then one per 100 ms: 3 + 4 by 450 ms.
    assert_eq!(before, 7);
    advance(Duration::from_secs(3600)).await;
    tokio::task::yield_now().await;
    let after_jump = seen.lock().unwrap().len();
    assert!(after_jump - before <= 3, "{before} then {after_jump}");
    consumer.await.unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(
        seen.iter().map(|s| s.0).collect::<Vec<_>>(),
        (0..50).collect::<Vec<_>>()
    );
    // After the jump: the burst, then 100 ms apart.
    let jump = Duration::from_secs(3600);
    let after: Vec<Duration> = seen.iter().map(|s| s.1).filter(|t| *t >= jump).collect();
    for w in after.windows(4) {
        assert!(w[3] - w[0] >= Duration::from_millis(100), "{after:?}");
    }
}

/// Exact counts at 1/s: a producer at one item per 70 ms into a channel of 8 under
/// `DropNewest`, a `leaky` stream at 1/s (burst 1) holding the next item, a sink taking
/// each at once. At 10.52 s: 151 produced, 11 delivered, 1 held, 8 in the channel, 131
/// dropped; dropping the consumer then discards the held item and the channel's 8.
#[tokio::test(start_paused = true)]
async fn exact_counts_at_one_per_second_with_the_held_item_and_the_channel_discards() {
    let ledger = Arc::new(Ledger::default());
    let (tx, rx) = channel::builder(8)
        .overflow(Overflow::DropNewest)
        .on_drop(hook("channel"))
        .build()
        .unwrap();
    let produced = ledger.clone();
    let producer = tokio::spawn(async move {
        for id in 0.. {
            assert!(tx.send(Item::new(id, &produced)).await.is_ok());
            sleep(Duration::from_millis(70)).await;
        }
    });
    let mut paced = Leaky::builder(rx, pacer(1, 1))
        .on_drop(hook("leaky"))
        .build()
        .unwrap();
    let mut sink = SlowSink::new(Duration::ZERO);
    consume_for(&mut paced, &mut sink, 10_520).await;
    producer.abort();
    assert!(producer.await.unwrap_err().is_cancelled());
    let stats = paced.get_ref().stats();
    let in_channel = paced.get_ref().len() as u64;
    drop(paced);
    drop(sink);
    let c = ledger.settled(151);
    assert_eq!(c.get("delivered"), Some(&11), "{c:?}");
    assert_eq!(c.get("leaky:discarded"), Some(&1), "{c:?}");
    assert_eq!(
        (in_channel, c.get("channel:discarded")),
        (8, Some(&8)),
        "{c:?}"
    );
    assert_eq!(c.get("channel:newest"), Some(&131), "{c:?}");
    assert_eq!((stats.sent, stats.received, stats.dropped), (151, 12, 131));
}

/// A graceful stop mid-stream, from the consumer side (`Receiver::close`) or at the
/// bulkhead (`Bulkhead::close`). After the receiver's close the producer's sends fail with
/// the item handed back and everything the channel took is delivered. After the bulkhead's,
/// the adapter yields its work in flight and ends, discarding the one item it held; the
/// stages above keep theirs until the consumer is dropped, which discards them, counted.
/// Either way the pipeline ends.
#[tokio::test(start_paused = true)]
async fn a_close_mid_stream_ends_the_pipeline_and_counts_what_was_left() {
    for close_receiver in [true, false] {
        let n = 200;
        let (ledger, producer, bulkhead, mut out, mut sink) =
            rig(n, Overflow::Backpressure, Overflow::Backpressure, 25, 100);
        consume_for(&mut out, &mut sink, 335).await;
        if close_receiver {
            queue(&out).get_ref().close();
        } else {
            bulkhead.close();
        }
        assert!(drain(&mut out, &mut sink).await, "the pipeline hangs");
        assert_eq!(bulkhead.in_flight(), 0);
        let stats = queue(&out).get_ref().stats();
        drop(out);
        drop(sink);
        producer.await.unwrap();
        let c = ledger.settled(n);
        assert_eq!(sum(&c, "silent") + sum(&c, "work:"), 0, "{c:?}");
        if close_receiver {
            assert_eq!(c.get("delivered"), Some(&stats.sent), "{c:?} {stats:?}");
            assert_eq!(sum(&c, "producer:closed"), u64::from(n) - stats.sent);
        } else {
            assert!(sum(&c, "bulkhead:discarded") <= 1, "{c:?}");
        }
    }
}

/// The producer side as a `Sink`: a `LeakySink` over the channel's sender, closed with
/// `SinkExt::close` and kept alive. Closing detaches the sender, so the consumer ends.
#[tokio::test(start_paused = true)]
async fn a_producer_sink_closed_but_kept_alive_ends_the_pipeline() {
    let ledger = Arc::new(Ledger::default());
    let (tx, rx) = counted_channel(Overflow::Backpressure);
    let n = 50u32;
    let source = ledger.clone();
    let (closed_tx, closed_rx) = tokio::sync::oneshot::channel();
    let producer = tokio::spawn(async move {
        let mut sink = tx.leaky_sink_with(pacer(200, 2));
        let mut items = futures::stream::iter((0..n).map(|id| Ok(Item::new(id, &source))));
        sink.send_all(&mut items).await.unwrap();
        SinkExt::close(&mut sink).await.unwrap();
        closed_tx.send(()).unwrap();
        // Kept alive past the end of the pipeline.
        sleep(Duration::from_secs(3600)).await;
        drop(sink);
    });
    let bulkhead = Bulkhead::new(3).unwrap();
    let mut out = consumer(rx, pacer(100, 2), 4, Overflow::Backpressure, &bulkhead);
    let mut sink = SlowSink::new(Duration::from_millis(10));
    let start = Instant::now();
    while let Some(item) = out.next().await {
        sink.send(item).await.unwrap();
    }
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "{:?}",
        start.elapsed()
    );
    closed_rx.await.unwrap();
    producer.abort();
    drop(out);
    drop(sink);
    let c = ledger.settled(n);
    assert_eq!(c.get("delivered"), Some(&u64::from(n)), "{c:?}");
}

/// Demand on the consumer side: the receiver under `with_demand`, a window of 4 items
/// granted back one per delivery. Never more than 4 taken ahead of the sink, everything
/// delivered, and the stream ends once the producer is gone.
#[tokio::test(start_paused = true)]
async fn a_credit_window_from_the_sink_bounds_the_pipeline_and_it_still_ends() {
    let n = 100;
    let (ledger, producer, rx) = source(n, Overflow::Backpressure, 25, 100);
    let (demanded, demand) = rx.with_demand(4);
    let bulkhead = Bulkhead::new(3).unwrap();
    let f: fn(Item) -> Work = |item| Box::pin(work(item, 40));
    let paced = Leaky::builder(demanded, pacer(100, 2))
        .on_drop(hook("leaky"))
        .build()
        .unwrap();
    let mut out = Box::pin(
        BulkheadMapUnordered::builder(paced, bulkhead.clone(), f)
            .on_drop(hook("bulkhead"))
            .build()
            .unwrap(),
    );
    let mut sink = SlowSink::new(Duration::from_millis(10));
    let mut delivered = 0u64;
    let ended = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(item) = out.next().await {
            sink.send(item).await.unwrap();
            delivered += 1;
            // Taken from the channel: at most the window ahead of the sink.
            let received = (*out).get_ref().get_ref().get_ref().stats().received;
            assert!(
                received <= delivered + 4,
                "{received} taken, {delivered} delivered"
            );
            demand.request(1).unwrap();
        }
    })
    .await;
    assert!(ended.is_ok(), "the pipeline hangs");
    producer.await.unwrap();
    drop(out);
    drop(sink);
    let c = ledger.settled(n);
    assert_eq!(c.get("delivered"), Some(&u64::from(n)), "{c:?}");
}

/// A channel that drops or rejects (`DropNewest`, `Reject`) does so only when it is full:
/// `len()` at its capacity. A slow consumer takes items one by one while a producer sends
/// three per item taken; every send the channel refuses must find it full.
#[tokio::test]
async fn a_dropping_channel_refuses_items_only_when_it_is_full() {
    for policy in [Overflow::DropNewest, Overflow::Reject, Overflow::DropOldest] {
        let (tx, mut rx) = channel::builder::<u32>(8).overflow(policy).build().unwrap();
        let mut id = 0;
        for round in 0..12 {
            let len = rx.len();
            let got = rx.next().now_or_never();
            assert_eq!(got.is_some(), len > 0, "{policy}, round {round}");
            for _ in 0..3 {
                let before = tx.len();
                let refused = match tx.try_send(id) {
                    Ok(sent) => sent != channel::Sent::Queued,
                    Err(e) => {
                        assert!(e.is_full());
                        true
                    }
                };
                assert!(
                    !refused || before == 8,
                    "{policy}, round {round}: item {id} refused with {before} of 8 buffered"
                );
                id += 1;
            }
        }
    }
}

/// Watermarks on the consumer side: each item taken from the channel carries a ticket
/// through the pacer, the bulkhead and the sink. At most `high` are in flight; the consumer
/// dropped mid-stream with tickets in every stage lets go of them all (in flight back to
/// 0, resumed), and every item is counted where it was.
#[tokio::test(start_paused = true)]
async fn watermarks_bound_the_pipeline_and_a_dropped_consumer_gives_every_ticket_back() {
    let n = 100;
    let (ledger, producer, rx) = source(n, Overflow::Backpressure, 25, 100);
    let marked = rx.watermarks(Levels::new(5, 2).unwrap());
    let signal = marked.pause_signal();
    let bulkhead = Bulkhead::new(3).unwrap();
    let paced = Leaky::builder(marked, pacer(100, 2)).build().unwrap();
    let mut out = Box::pin(
        paced.bulkhead_map_unordered(bulkhead.clone(), |(item, ticket)| {
            let work = work(item, 40);
            async move { (work.await, ticket) }
        }),
    );
    let mut sink = SlowSink::new(Duration::from_millis(10));
    let _ = tokio::time::timeout(Duration::from_millis(335), async {
        while let Some((item, ticket)) = out.next().await {
            sink.send(item).await.unwrap();
            drop(ticket);
        }
    })
    .await;
    let in_flight = (*out).get_ref().get_ref().in_flight();
    assert!((1..=5).contains(&in_flight), "{in_flight}");
    drop(out);
    drop(sink);
    assert!(!signal.is_paused());
    producer.await.unwrap();
    let c = ledger.settled(n);
    // No hooks here: the bulkhead's held item and the leaky one are dropped with their
    // adapters (the adapters were built without one), the work in flight cancelled.
    assert_eq!(
        sum(&c, "channel:"),
        c.get("channel:discarded").copied().unwrap_or(0)
    );
    assert!(sum(&c, "silent") <= 2, "{c:?}");
    let delivered = c.get("delivered").copied().unwrap_or(0);
    assert!(delivered > 0, "{c:?}");
}
