//! A team's walk through the channel, end to end, as a pipeline of two stages joined by one
//! bounded channel, under every policy and at capacities 1, 3 and 5 000 (a ring of linked
//! blocks): producers that `send_all` and `forward` into the `Sink`, send under a timeout
//! (`select!`), reserve under a timeout then send through the permit, and `try_send`; a slow
//! consumer taking the `Stream`; then a shutdown (the senders dropped with items queued,
//! `close()` then a drain, or the receiver dropped with items queued and senders waiting).
//! Paused tokio time: nothing depends on timing. Every item is one with a `Drop` side
//! effect, and ends exactly once: received, passed to `on_drop`, handed back in an error,
//! or dropped with a cancelled send; `Stats` and the metrics agree with what was seen.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flowgate::channel::{self, SendError, Sender};
use flowgate::{Dropped, Overflow};
use futures::{SinkExt, StreamExt};

/// How an item ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum End {
    Received,
    Hook(&'static str),
    Full,
    Closed,
    Cancelled,
}

/// The log of every item's end, by id, and how many items are alive.
#[derive(Default)]
struct Ledger {
    ends: Mutex<BTreeMap<u64, Vec<End>>>,
    alive: AtomicU64,
    made: AtomicU64,
}

impl Ledger {
    fn end(&self, id: u64, end: End) {
        self.ends.lock().unwrap().entry(id).or_default().push(end);
    }

    fn count(&self, pick: impl Fn(End) -> bool) -> u64 {
        let ends = self.ends.lock().unwrap();
        ends.values().flatten().filter(|e| pick(**e)).count() as u64
    }
}

/// An item that counts itself alive until dropped.
struct Item {
    id: u64,
    ledger: Arc<Ledger>,
}

impl Item {
    fn new(id: u64, ledger: &Arc<Ledger>) -> Item {
        ledger.alive.fetch_add(1, Ordering::SeqCst);
        ledger.made.fetch_add(1, Ordering::SeqCst);
        Item {
            id,
            ledger: ledger.clone(),
        }
    }
}

impl Drop for Item {
    fn drop(&mut self) {
        self.ledger.alive.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How the pipeline shuts down.
#[derive(Debug, Clone, Copy)]
enum Shutdown {
    /// Every producer finishes and drops its sender; the consumer drains to the end.
    SendersDone,
    /// The consumer closes the channel midway, then drains what is left.
    CloseThenDrain,
    /// The consumer drops the receiver midway, with items queued and senders waiting.
    ReceiverDropped,
}

const PER_PRODUCER: u64 = 60;

/// An item handed back in a send's error ends as `Full` or `Closed`.
fn hand_back(ledger: &Ledger, e: SendError<Item>) {
    let end = if e.is_full() { End::Full } else { End::Closed };
    let item = e.into_inner();
    ledger.end(item.id, end);
}

async fn producers(tx: Sender<Item>, ledger: Arc<Ledger>) {
    let mut tasks = Vec::new();
    // 0: `send_all` from a stream into a clone of the sender, as a Sink; 1: `forward` into
    // another clone (closing that handle at the end).
    for forward in [false, true] {
        let mut sink = tx.clone();
        let ledger = ledger.clone();
        tasks.push(tokio::spawn(async move {
            let base = if forward { PER_PRODUCER } else { 0 };
            let items: Vec<Item> = (base..base + PER_PRODUCER)
                .map(|i| Item::new(i, &ledger))
                .collect();
            let mut stream = futures::stream::iter(items).map(Ok);
            let sent = if forward {
                (&mut stream).forward(sink).await
            } else {
                sink.send_all(&mut stream).await
            };
            if let Err(e) = sent {
                hand_back(&ledger, e);
            }
            // Whatever the sink did not take was never offered: it ends as cancelled.
            while let Some(Ok(item)) = stream.next().await {
                ledger.end(item.id, End::Cancelled);
            }
        }));
    }
    // 2: `send` under a timeout: a send that times out drops its item (never sent).
    {
        let tx = tx.clone();
        let ledger = ledger.clone();
        tasks.push(tokio::spawn(async move {
            let base = 2 * PER_PRODUCER;
            for i in base..base + PER_PRODUCER {
                let item = Item::new(i, &ledger);
                tokio::select! {
                    sent = tx.send(item) => match sent {
                        Ok(sent) => {
                            let _ = sent;
                        }
                        Err(e) => hand_back(&ledger, e),
                    },
                    () = tokio::time::sleep(Duration::from_millis(3)) => {
                        ledger.end(i, End::Cancelled);
                    }
                }
            }
        }));
    }
    // 3: `reserve` under a timeout, then send through the permit: a timeout keeps the item.
    {
        let tx = tx.clone();
        let ledger = ledger.clone();
        tasks.push(tokio::spawn(async move {
            let base = 3 * PER_PRODUCER;
            for i in base..base + PER_PRODUCER {
                let item = Item::new(i, &ledger);
                match tokio::time::timeout(Duration::from_millis(2), tx.reserve()).await {
                    Ok(Ok(permit)) => permit.send(item),
                    Ok(Err(_)) => ledger.end(item.id, End::Closed),
                    Err(_) => ledger.end(item.id, End::Cancelled),
                }
            }
        }));
    }
    // 4: `try_send`, yielding between tries.
    {
        let tx = tx.clone();
        let ledger = ledger.clone();
        tasks.push(tokio::spawn(async move {
            let base = 4 * PER_PRODUCER;
            for i in base..base + PER_PRODUCER {
                if let Err(e) = tx.try_send(Item::new(i, &ledger)) {
                    hand_back(&ledger, e);
                }
                tokio::time::sleep(Duration::from_micros(700)).await;
            }
        }));
    }
    drop(tx);
    for task in tasks {
        task.await.unwrap();
    }
}

async fn walk(overflow: Overflow, capacity: usize, shutdown: Shutdown) {
    let ledger = Arc::new(Ledger::default());
    let hooked = ledger.clone();
    let build = || {
        channel::builder(capacity)
            .overflow(overflow)
            .name("walk")
            .on_drop(move |item: Item, why: &Dropped| hooked.end(item.id, End::Hook(why.as_str())))
            .build()
            .unwrap()
    };
    #[cfg(feature = "metrics")]
    let recorder = super::support::TestRecorder::default();
    #[cfg(feature = "metrics")]
    let (tx, mut rx) = metrics::with_local_recorder(&recorder, build);
    #[cfg(not(feature = "metrics"))]
    let (tx, mut rx) = build();
    // A sender to read the counts by once the receiver is gone: only when the receiver is
    // dropped midway (it would keep the channel open otherwise).
    let keep = matches!(shutdown, Shutdown::ReceiverDropped).then(|| tx.clone());
    let producing = tokio::spawn(producers(tx, ledger.clone()));
    let mut got = 0u64;
    let stop_at = 20;
    loop {
        assert!(rx.len() <= capacity, "{} items in {capacity}", rx.len());
        if got == stop_at {
            match shutdown {
                Shutdown::SendersDone => {}
                Shutdown::CloseThenDrain => rx.close(),
                Shutdown::ReceiverDropped => break,
            }
        }
        let Some(item) = rx.next().await else { break };
        ledger.end(item.id, End::Received);
        got += 1;
        // A slow consumer.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut stats = rx.stats();
    drop(rx);
    producing.await.unwrap();
    if let Some(tx) = keep {
        stats = tx.stats();
    }

    let ctx = format!("{overflow:?} cap {capacity} {shutdown:?}");
    // Every item ended once, and none is alive (no leak, no double drop).
    let made = ledger.made.load(Ordering::SeqCst);
    assert_eq!(made, 5 * PER_PRODUCER, "{ctx}");
    {
        let ends = ledger.ends.lock().unwrap();
        let missing: Vec<u64> = (0..made).filter(|i| !ends.contains_key(i)).collect();
        assert!(missing.is_empty(), "{ctx}: no end for {missing:?}");
        let twice: Vec<_> = ends.iter().filter(|(_, e)| e.len() != 1).collect();
        assert!(twice.is_empty(), "{ctx}: ended twice: {twice:?}");
    }
    assert_eq!(ledger.alive.load(Ordering::SeqCst), 0, "{ctx}: items alive");
    // Stats agree with what was seen.
    let received = ledger.count(|e| e == End::Received);
    let hooked = ledger.count(|e| matches!(e, End::Hook(_)));
    assert_eq!(stats.received, received, "{ctx}");
    assert_eq!(stats.dropped, hooked, "{ctx}");
    assert_eq!(stats.sent, received + hooked, "{ctx}: {stats:?}");
    match overflow {
        Overflow::Backpressure | Overflow::Reject => {
            let policy = ledger.count(|e| matches!(e, End::Hook("newest" | "oldest")));
            assert_eq!(policy, 0, "{ctx}");
        }
        Overflow::DropNewest | Overflow::DropOldest => {
            assert_eq!(ledger.count(|e| e == End::Full), 0, "{ctx}");
        }
    }
    if !matches!(shutdown, Shutdown::ReceiverDropped) {
        assert_eq!(ledger.count(|e| e == End::Hook("discarded")), 0, "{ctx}");
    }
    #[cfg(feature = "metrics")]
    {
        let counter = |m: &str| recorder.counter(m);
        assert_eq!(
            counter("flowgate_channel_sent_total{name=walk}"),
            stats.sent,
            "{ctx}"
        );
        assert_eq!(
            counter("flowgate_channel_received_total{name=walk}"),
            stats.received,
            "{ctx}"
        );
        let by = |p: &str| {
            counter(&format!(
                "flowgate_channel_dropped_total{{name=walk,policy={p}}}"
            ))
        };
        assert_eq!(
            by("drop_newest") + by("drop_oldest") + by("closed"),
            stats.dropped,
            "{ctx}"
        );
        assert_eq!(
            by("drop_newest"),
            ledger.count(|e| e == End::Hook("newest")),
            "{ctx}"
        );
        assert_eq!(
            by("drop_oldest"),
            ledger.count(|e| e == End::Hook("oldest")),
            "{ctx}"
        );
        assert_eq!(
            by("closed"),
            ledger.count(|e| e == End::Hook("discarded")),
            "{ctx}"
        );
        assert_eq!(
            recorder.gauge("flowgate_channel_depth{name=walk}"),
            Some(0.0),
            "{ctx}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_pipeline_walk_accounts_for_every_item_under_every_policy_and_shutdown() {
    for overflow in [
        Overflow::Backpressure,
        Overflow::Reject,
        Overflow::DropNewest,
        Overflow::DropOldest,
    ] {
        for capacity in [1, 3, 5_000] {
            for shutdown in [
                Shutdown::SendersDone,
                Shutdown::CloseThenDrain,
                Shutdown::ReceiverDropped,
            ] {
                // Paused time: a walk that hangs runs into this instead.
                let hour = Duration::from_secs(3600);
                tokio::time::timeout(hour, walk(overflow, capacity, shutdown))
                    .await
                    .unwrap_or_else(|_| panic!("{overflow:?} cap {capacity} {shutdown:?} hangs"));
            }
        }
    }
}

/// Zero-size items whose drop counts itself, through a channel of 1 item, of 5 000 (linked
/// blocks) and of the largest capacity, under every policy: each item is dropped once, by
/// the receiver that took it, the hook, or the last receiver's drop, and `Stats` agree.
#[test]
fn zero_size_items_with_a_drop_side_effect_are_each_dropped_once() {
    static DROPS: AtomicU64 = AtomicU64::new(0);
    struct Zst;
    impl Drop for Zst {
        fn drop(&mut self) {
            DROPS.fetch_add(1, Ordering::SeqCst);
        }
    }
    assert_eq!(std::mem::size_of::<Zst>(), 0);
    for overflow in [
        Overflow::Backpressure,
        Overflow::Reject,
        Overflow::DropNewest,
        Overflow::DropOldest,
    ] {
        for capacity in [1, 5_000, usize::MAX >> 2] {
            DROPS.store(0, Ordering::SeqCst);
            let hooked = Arc::new(AtomicU64::new(0));
            let seen = hooked.clone();
            let (tx, mut rx) = channel::builder(capacity)
                .overflow(overflow)
                .on_drop(move |_: Zst, _: &Dropped| {
                    seen.fetch_add(1, Ordering::SeqCst);
                })
                .build()
                .unwrap();
            let offered = 12_000u64;
            let mut handed_back = 0;
            for _ in 0..offered {
                if let Err(e) = tx.try_send(Zst) {
                    assert!(e.is_full());
                    handed_back += 1;
                }
            }
            let mut received = 0;
            for _ in 0..3 {
                if rx.try_recv().is_ok() {
                    received += 1;
                }
            }
            let left = rx.len() as u64;
            drop(rx);
            let stats = tx.stats();
            let ctx = format!("{overflow:?} cap {capacity}");
            assert_eq!(DROPS.load(Ordering::SeqCst), offered, "{ctx}");
            assert_eq!(stats.received, received, "{ctx}");
            assert_eq!(stats.sent, offered - handed_back, "{ctx}");
            assert_eq!(stats.dropped, hooked.load(Ordering::SeqCst), "{ctx}");
            assert_eq!(stats.sent, stats.received + stats.dropped, "{ctx}");
            assert!(left <= capacity as u64, "{ctx}");
            assert!(tx.try_send(Zst).unwrap_err().is_closed(), "{ctx}");
        }
    }
}
