//! Every way in and out of one channel at once, on a multi-thread runtime: producers
//! sending, reserving, feeding the `Sink` and trying; consumers receiving as futures, in
//! batches (`recv_many`) and as a `Stream`, some futures cancelled after their first poll,
//! and receivers replaced by clones mid-batch (the old one gives its batch back). Every
//! accepted item comes out exactly once, and the counts agree.

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

/// Whether a send was accepted (`Full` under `Reject` is not); the receivers outlive the
/// producers, so it is never `Closed`.
fn accepted_or_full(sent: Result<(), SendError<u64>>) -> bool {
    match sent {
        Ok(()) => true,
        Err(e) if e.is_full() => false,
        Err(e) => panic!("the receivers outlive the producers: {e}"),
    }
}

/// One producer; `way` picks how it sends. Returns the items the channel accepted.
async fn produce(mut tx: Sender<u64>, way: u64) -> Vec<u64> {
    let mut rng = Rng(way * 7919 + 11);
    let mut accepted = Vec::new();
    for i in 0..PER_PRODUCER {
        let item = way * PER_PRODUCER + i;
        // `Some(true)`: accepted (queued, or dropped by the policy); `Some(false)`: handed
        // back full (`Reject`); `None`: cancelled, never sent.
        let sent = match way % 4 {
            0 => {
                let mut send = pin!(tx.send(item));
                match poll!(send.as_mut()) {
                    Poll::Ready(r) => Some(accepted_or_full(r.map(drop))),
                    Poll::Pending if one_in(&mut rng, 3) => None,
                    Poll::Pending => Some(accepted_or_full(send.await.map(drop))),
                }
            }
            1 => {
                let mut reserve = pin!(tx.reserve());
                match poll!(reserve.as_mut()) {
                    Poll::Ready(permit) => {
                        permit.expect("open").send(item);
                        Some(true)
                    }
                    Poll::Pending if one_in(&mut rng, 3) => None,
                    Poll::Pending => {
                        reserve.await.expect("open").send(item);
                        Some(true)
                    }
                }
            }
            2 => {
                // A feed cancelled while waiting keeps the handle's place; the next feed
                // takes it.
                let mut feed = pin!(SinkExt::feed(&mut tx, item));
                match poll!(feed.as_mut()) {
                    Poll::Ready(r) => Some(accepted_or_full(r)),
                    Poll::Pending if one_in(&mut rng, 3) => None,
                    Poll::Pending => Some(accepted_or_full(feed.await)),
                }
            }
            _ => loop {
                match tx.try_send(item) {
                    Ok(_) => break Some(true),
                    Err(e) if e.is_full() => tokio::task::yield_now().await,
                    Err(e) => panic!("the receivers outlive the producers: {e}"),
                }
            },
        };
        if sent == Some(true) {
            accepted.push(item);
        }
        if one_in(&mut rng, 8) {
            tokio::task::yield_now().await;
        }
    }
    SinkExt::close(&mut tx).await.unwrap();
    accepted
}

/// One consumer; it receives in every way, and now and then swaps its receiver for a clone
/// (dropping the old one with whatever batch it holds).
async fn consume(mut rx: Receiver<u64>, seed: u64, cancelled: Arc<AtomicU64>) -> Vec<u64> {
    let mut rng = Rng(seed * 104_729 + 3);
    let mut got = Vec::new();
    let mut buf = Vec::new();
    loop {
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
    for overflow in [
        Overflow::Backpressure,
        Overflow::Reject,
        Overflow::DropNewest,
        Overflow::DropOldest,
    ] {
        for capacity in [1, 3, 16, 64] {
            run(overflow, capacity).await;
        }
    }
}

async fn run(overflow: Overflow, capacity: usize) {
    let dropped = Arc::new(Mutex::new(Vec::new()));
    let log = dropped.clone();
    let (tx, rx) = channel::builder::<u64>(capacity)
        .overflow(overflow)
        .on_drop(move |x, _| log.lock().unwrap().push(x))
        .build()
        .unwrap();
    let producers: Vec<_> = (0..4)
        .map(|way| tokio::spawn(produce(tx.clone(), way)))
        .collect();
    // Kept to read the stats at the end, detached so that it does not hold the channel open.
    let mut tx = tx;
    SinkExt::close(&mut tx).await.unwrap();
    let cancelled = Arc::new(AtomicU64::new(0));
    let consumers: Vec<_> = (0..3)
        .map(|c| tokio::spawn(consume(rx.clone(), c, cancelled.clone())))
        .collect();
    drop(rx);
    let mut accepted = HashSet::new();
    for p in producers {
        accepted.extend(p.await.unwrap());
    }
    let mut seen = HashSet::new();
    let mut received = 0u64;
    for c in consumers {
        for x in c.await.unwrap() {
            assert!(
                seen.insert(x),
                "{overflow} {capacity}: item {x} received twice"
            );
            received += 1;
        }
    }
    let dropped = dropped.lock().unwrap().clone();
    for x in &dropped {
        assert!(
            seen.insert(*x),
            "{overflow} {capacity}: item {x} received and dropped"
        );
    }
    assert_eq!(
        seen, accepted,
        "{overflow} {capacity}: every accepted item comes out once"
    );
    let s = tx.stats();
    assert_eq!(
        (s.sent, s.received, s.dropped),
        (accepted.len() as u64, received, dropped.len() as u64),
        "{overflow} {capacity}"
    );
    if !overflow.drops() {
        assert!(dropped.is_empty(), "{overflow} {capacity}");
    }
}
