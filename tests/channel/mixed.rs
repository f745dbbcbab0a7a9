//! Every way in and out of one channel at once, on a multi-thread runtime: producers
//! sending, reserving, feeding the `Sink` and trying; consumers receiving as futures, in
//! batches (`recv_many`) and as a `Stream`, some futures cancelled after their first poll,
//! and receivers replaced by clones mid-batch (the old one gives its batch back). Every
//! accepted item comes out exactly once, and the counts agree; also while the consumers
//! quit mid-flow, dropping the last receiver under the producers.

use std::collections::HashSet;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;

use flowgate::Overflow;
use flowgate::channel::{self, Receiver, SendError, Sender};
use futures::{SinkExt, StreamExt, poll};

use super::Rng;

/// One chance in `n`.
fn one_in(rng: &mut Rng, n: u64) -> bool {
    rng.next().is_multiple_of(n)
}

const PER_PRODUCER: u64 = 2_000;

/// What became of one item a producer offered.
#[derive(Debug, PartialEq)]
enum Outcome {
    /// Accepted: queued, or dropped by the policy (and seen by the hook).
    Accepted,
    /// Handed back full (`Reject`).
    Full,
    /// Handed back closed: every receiver is gone.
    Closed,
    /// The future was dropped after its first poll: never sent.
    Cancelled,
}

fn outcome(sent: Result<(), SendError<u64>>) -> Outcome {
    match sent {
        Ok(()) => Outcome::Accepted,
        Err(e) if e.is_full() => Outcome::Full,
        Err(_) => Outcome::Closed,
    }
}

/// One producer; `way` picks how it sends. Returns the items the channel accepted. It stops
/// at the first item handed back closed, which only `receivers_may_go` allows.
async fn produce(mut tx: Sender<u64>, way: u64, receivers_may_go: bool) -> Vec<u64> {
    let mut rng = Rng(way * 7919 + 11);
    let mut accepted = Vec::new();
    for i in 0..PER_PRODUCER {
        let item = way * PER_PRODUCER + i;
        let sent = match way % 4 {
            0 => {
                let mut send = pin!(tx.send(item));
                match poll!(send.as_mut()) {
                    Poll::Ready(r) => outcome(r.map(drop)),
                    Poll::Pending if one_in(&mut rng, 3) => Outcome::Cancelled,
                    Poll::Pending => outcome(send.await.map(drop)),
                }
            }
            1 => {
                let mut reserve = pin!(tx.reserve());
                let permit = match poll!(reserve.as_mut()) {
                    Poll::Ready(permit) => Some(permit),
                    Poll::Pending if one_in(&mut rng, 3) => None,
                    Poll::Pending => Some(reserve.await),
                };
                match permit {
                    Some(Ok(permit)) => {
                        permit.send(item);
                        Outcome::Accepted
                    }
                    Some(Err(_)) => Outcome::Closed,
                    None => Outcome::Cancelled,
                }
            }
            2 => {
                // A feed cancelled while waiting keeps the handle's place; the next feed
                // takes it.
                let mut feed = pin!(SinkExt::feed(&mut tx, item));
                match poll!(feed.as_mut()) {
                    Poll::Ready(r) => outcome(r),
                    Poll::Pending if one_in(&mut rng, 3) => Outcome::Cancelled,
                    Poll::Pending => outcome(feed.await),
                }
            }
            _ => loop {
                match tx.try_send(item) {
                    Ok(_) => break Outcome::Accepted,
                    Err(e) if e.is_full() => tokio::task::yield_now().await,
                    Err(_) => break Outcome::Closed,
                }
            },
        };
        match sent {
            Outcome::Accepted => accepted.push(item),
            Outcome::Closed => {
                assert!(receivers_may_go, "the receivers outlive the producers");
                break;
            }
            Outcome::Full | Outcome::Cancelled => {}
        }
        if one_in(&mut rng, 8) {
            tokio::task::yield_now().await;
        }
    }
    SinkExt::close(&mut tx).await.unwrap();
    accepted
}

/// One consumer; it receives in every way, and now and then swaps its receiver for a clone
/// (dropping the old one with whatever batch it holds). With `quit_after`, it drops its
/// receiver once it has received that many items.
async fn consume(
    mut rx: Receiver<u64>,
    seed: u64,
    cancelled: Arc<AtomicU64>,
    quit_after: Option<usize>,
) -> Vec<u64> {
    let mut rng = Rng(seed * 104_729 + 3);
    let mut got = Vec::new();
    let mut buf = Vec::new();
    loop {
        if quit_after.is_some_and(|n| got.len() >= n) {
            return got;
        }
        if one_in(&mut rng, 5) {
            let next = rx.clone();
            drop(std::mem::replace(&mut rx, next));
        }
        let step = match rng.next() % 3 {
            0 => {
                let mut recv = pin!(rx.recv());
                match poll!(recv.as_mut()) {
                    Poll::Ready(next) => Some(next.map(|x| vec![x])),
                    Poll::Pending if one_in(&mut rng, 3) => None,
                    Poll::Pending => Some(recv.await.map(|x| vec![x])),
                }
            }
            1 => {
                let max = (rng.next() % 5) as usize + 1;
                let n = {
                    let mut many = pin!(rx.recv_many(&mut buf, max));
                    match poll!(many.as_mut()) {
                        Poll::Ready(n) => Some(n),
                        Poll::Pending if one_in(&mut rng, 3) => None,
                        Poll::Pending => Some(many.await),
                    }
                };
                n.map(|n| (n > 0).then(|| std::mem::take(&mut buf)))
            }
            _ => Some(rx.next().await.map(|x| vec![x])),
        };
        match step {
            None => {
                cancelled.fetch_add(1, Ordering::Relaxed);
                tokio::task::yield_now().await;
            }
            Some(Some(items)) => got.extend(items),
            Some(None) => return got,
        }
        if one_in(&mut rng, 8) {
            tokio::task::yield_now().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_way_in_and_out_at_once_accounts_for_every_item() {
    for overflow in POLICIES {
        for capacity in [1, 3, 16, 64] {
            run(overflow, capacity, false).await;
        }
    }
}

/// The same while the consumers quit one after the other, dropping their receivers (with
/// whatever batch each holds) in the middle of the flow: each accepted item is received or
/// goes to the hook once, and the producers, waiting, reserving or feeding, are let go with
/// their items handed back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receivers_going_mid_flow_lose_no_accepted_item() {
    for overflow in POLICIES {
        for capacity in [1, 3, 16, 64] {
            run(overflow, capacity, true).await;
        }
    }
}

const POLICIES: [Overflow; 4] = [
    Overflow::Backpressure,
    Overflow::Reject,
    Overflow::DropNewest,
    Overflow::DropOldest,
];

async fn run(overflow: Overflow, capacity: usize, receivers_go: bool) {
    let dropped = Arc::new(Mutex::new(Vec::new()));
    let log = dropped.clone();
    let (tx, rx) = channel::builder::<u64>(capacity)
        .overflow(overflow)
        .on_drop(move |x, _| log.lock().unwrap().push(x))
        .build()
        .unwrap();
    let producers: Vec<_> = (0..4)
        .map(|way| tokio::spawn(produce(tx.clone(), way, receivers_go)))
        .collect();
    // Kept to read the stats at the end, detached so that it does not hold the channel open.
    let mut tx = tx;
    SinkExt::close(&mut tx).await.unwrap();
    let cancelled = Arc::new(AtomicU64::new(0));
    let consumers: Vec<_> = (0..3u64)
        .map(|c| {
            let quit_after = receivers_go.then_some(500 + 700 * c as usize);
            tokio::spawn(consume(rx.clone(), c, cancelled.clone(), quit_after))
        })
        .collect();
    drop(rx);
    let mut accepted = HashSet::new();
    for p in producers {
        accepted.extend(p.await.unwrap());
    }
    let at = format!("{overflow} {capacity} (receivers go: {receivers_go})");
    let mut seen = HashSet::new();
    let mut received = 0u64;
    for c in consumers {
        for x in c.await.unwrap() {
            assert!(seen.insert(x), "{at}: item {x} received twice");
            received += 1;
        }
    }
    let dropped = dropped.lock().unwrap().clone();
    for x in &dropped {
        assert!(seen.insert(*x), "{at}: item {x} received and dropped");
    }
    assert_eq!(seen, accepted, "{at}: every accepted item comes out once");
    let s = tx.stats();
    assert_eq!(
        (s.sent, s.received, s.dropped),
        (accepted.len() as u64, received, dropped.len() as u64),
        "{at}"
    );
    if !overflow.drops() && !receivers_go {
        assert!(dropped.is_empty(), "{at}");
    }
}
