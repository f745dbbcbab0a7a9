//! loom models of the channel core and the bulkhead's queue: every interleaving of two or
//! three threads.
//!
//! Run with `RUSTFLAGS="--cfg flowgate_loom" cargo test --release --no-default-features --test loom`.
#![cfg(flowgate_loom)]

use std::pin::{Pin, pin};
use std::task::{Context, Poll};

use flowgate::Dropped;
use flowgate::channel::{self, SendError};
use futures::{Stream, StreamExt, poll};
use loom::future::block_on;
use loom::thread;

#[path = "loom/bulkhead.rs"]
mod bulkhead;
#[path = "loom/grants.rs"]
mod grants;
#[path = "loom/ring.rs"]
mod ring;
#[path = "loom/waiters.rs"]
mod waiters;

/// Two producers into a buffer of one: both items arrive, none twice, nobody hangs.
#[test]
fn two_senders_one_slot() {
    loom::model(|| {
        let (tx, mut rx) = channel::bounded::<u32>(1).unwrap();
        let tx2 = tx.clone();
        let a = thread::spawn(move || block_on(tx.send(1)).unwrap());
        let b = thread::spawn(move || block_on(tx2.send(2)).unwrap());
        let mut got = vec![block_on(rx.recv()).unwrap(), block_on(rx.recv()).unwrap()];
        a.join().unwrap();
        b.join().unwrap();
        got.sort();
        assert_eq!(got, [1, 2]);
        assert_eq!(block_on(rx.recv()), None);
    });
}

/// A send racing the last receiver's drop: the item is received, handed back, or dropped
/// through the hook with the buffer; never lost.
#[test]
fn send_races_receiver_drop() {
    loom::model(|| {
        let dropped = loom::sync::Arc::new(loom::sync::atomic::AtomicUsize::new(0));
        let seen = dropped.clone();
        let (tx, rx) = channel::builder::<u32>(1)
            .on_drop(move |_, why: &Dropped| {
                // The channel ended with the item in it: discarded, never "newest"/"oldest".
                assert!(matches!(why, Dropped::Discarded), "dropped with {why}");
                seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            })
            .build()
            .unwrap();
        let sender = thread::spawn(move || block_on(tx.send(7)));
        drop(rx);
        let outcome = sender.join().unwrap();
        let handed_back = matches!(outcome, Err(SendError::Closed(7)));
        let in_hook = dropped.load(std::sync::atomic::Ordering::SeqCst) == 1;
        assert!(
            handed_back ^ in_hook,
            "exactly one of: handed back, dropped through the hook"
        );
    });
}

/// A waiting send cancelled while a receiver frees its slot: the slot is not leaked.
#[test]
fn cancelled_send_races_recv() {
    loom::model(|| {
        let (tx, mut rx) = channel::bounded::<u32>(1).unwrap();
        block_on(tx.send(1)).unwrap();
        let tx2 = tx.clone();
        let canceller = thread::spawn(move || {
            block_on(async {
                let mut send = pin!(tx2.send(2));
                // Poll once (it may complete if the slot was already freed), then cancel.
                matches!(poll!(send.as_mut()), Poll::Ready(Ok(_)))
            })
        });
        assert_eq!(block_on(rx.recv()), Some(1));
        let sent = canceller.join().unwrap();
        if sent {
            assert_eq!(block_on(rx.recv()), Some(2));
        }
        // Whatever happened, the one slot is free again.
        assert!(tx.try_send(3).is_ok());
        assert_eq!(block_on(rx.recv()), Some(3));
    });
}

/// Two receivers and one sender that closes: both receivers end, the item goes to one.
#[test]
fn close_wakes_every_receiver() {
    loom::model(|| {
        let (tx, mut rx) = channel::bounded::<u32>(2).unwrap();
        let mut rx2 = rx.clone();
        let r = thread::spawn(move || {
            let mut n = 0;
            while block_on(rx2.recv()).is_some() {
                n += 1;
            }
            n
        });
        block_on(tx.send(1)).unwrap();
        drop(tx);
        let mut n = 0;
        while block_on(rx.recv()).is_some() {
            n += 1;
        }
        assert_eq!(n + r.join().unwrap(), 1);
    });
}

/// Two receivers used as streams; one polls once and then stops (keeping its receiver). The
/// item sent still reaches the other: a stream cannot pass a wake it does not use on, so a
/// new item wakes every waiting stream.
#[test]
fn a_stream_that_stops_polling_does_not_keep_the_wake() {
    loom::model(|| {
        let (tx, mut r1) = channel::bounded::<u32>(2).unwrap();
        let mut r2 = r1.clone();
        let stalled = thread::spawn(move || {
            let waker = futures::task::noop_waker();
            let first = Pin::new(&mut r1).poll_next(&mut Context::from_waker(&waker));
            (first, r1)
        });
        let consumer = thread::spawn(move || block_on(r2.next()));
        block_on(tx.send(7)).unwrap();
        let (first, _r1) = stalled.join().unwrap();
        if first == Poll::Ready(Some(7)) {
            // The stalled stream took it: the consumer ends with the channel.
            drop(tx);
            assert_eq!(consumer.join().unwrap(), None);
        } else {
            assert_eq!(consumer.join().unwrap(), Some(7));
        }
    });
}

/// A `recv` future polled once and dropped, racing a send, while another receiver waits: a
/// send wakes one waiting future; if that was the dropped one, its drop passes the wake on,
/// so the item reaches the other receiver (or the dropped one took it in its poll).
#[test]
fn a_dropped_recv_passes_its_wake_on() {
    loom::model(|| {
        let (tx, mut r1) = channel::bounded::<u32>(2).unwrap();
        let mut r2 = r1.clone();
        let consumer = thread::spawn(move || block_on(r2.recv()));
        let sender = thread::spawn(move || {
            tx.try_send(7).unwrap();
            tx
        });
        let first = {
            let waker = futures::task::noop_waker();
            let mut recv = pin!(r1.recv());
            recv.as_mut().poll(&mut Context::from_waker(&waker))
        };
        let tx = sender.join().unwrap();
        if first == Poll::Ready(Some(7)) {
            drop(tx);
            assert_eq!(consumer.join().unwrap(), None);
        } else {
            assert_eq!(consumer.join().unwrap(), Some(7));
        }
    });
}

/// A receiver dropped with part of its batch, while another receiver waits: the items go
/// back to the queue and wake the waiting one, which gets them in order.
#[test]
fn a_batch_given_back_wakes_the_waiting_receiver() {
    loom::model(|| {
        let (tx, mut r1) = channel::bounded::<u32>(4).unwrap();
        for i in 1..=3 {
            tx.try_send(i).unwrap();
        }
        // Alone, the receiver takes all three under one lock: 1 handed out, 2 and 3 held.
        assert_eq!(block_on(r1.recv()), Some(1));
        assert_eq!(r1.len(), 2);
        let mut r2 = r1.clone();
        let consumer = thread::spawn(move || {
            let first = block_on(r2.recv());
            (first, block_on(r2.recv()))
        });
        drop(r1);
        assert_eq!(consumer.join().unwrap(), (Some(2), Some(3)));
        drop(tx);
    });
}
