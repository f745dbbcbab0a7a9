//! loom models of the slots granted to queued senders (`src/channel/shared.rs`, `free_locked`
//! and `cancel_send_wait`): a grant is made under the lock to the first queued sender and
//! stays in its name until it claims it, gives it up, or the channel closes. Whichever comes
//! first, the slot is never lost: given up, it goes to the next queued sender (or back to the
//! count); at the close, it is void and the count lets the receivers see the end.

use std::pin::pin;
use std::task::Poll;

use flowgate::channel::{self, SendError, Sent};
use futures::poll;
use loom::future::block_on;
use loom::thread;

/// Two senders queued on a full channel of one, the first of which polls once and gives up,
/// racing the receive that frees the slot. Granted to the first, the slot passes to the
/// second when the first gives it up; so the second is never left waiting for a slot that
/// nobody holds (loom reports the hang), and the slot is free again at the end.
#[test]
fn a_grant_given_up_passes_to_the_next_queued_sender() {
    loom::model(|| {
        let (tx, mut rx) = channel::bounded::<u32>(1).unwrap();
        assert_eq!(tx.try_send(0), Ok(Sent::Queued));
        let (quits, waits) = (tx.clone(), tx.clone());
        let quitter = thread::spawn(move || {
            block_on(async {
                let mut send = pin!(quits.send(1));
                matches!(poll!(send.as_mut()), Poll::Ready(Ok(_)))
            })
        });
        let waiter = thread::spawn(move || block_on(waits.send(2)).unwrap());
        assert_eq!(block_on(rx.recv()), Some(0));
        // 1 went in only if its one poll found the slot free: then before 2, which waited.
        if quitter.join().unwrap() {
            assert_eq!(block_on(rx.recv()), Some(1));
        }
        assert_eq!(block_on(rx.recv()), Some(2));
        assert_eq!(waiter.join().unwrap(), Sent::Queued);
        assert_eq!(tx.try_send(3), Ok(Sent::Queued), "the slot is free again");
        assert_eq!(block_on(rx.recv()), Some(3));
    });
}

/// A sender queued on a full channel of one, granted the slot a receive frees, racing a
/// close: it claims the grant before the close (its item is received before the end) or
/// finds the channel closed (the item is handed back, and the close voided the grant, so
/// the receiver still sees the end instead of waiting for the slot for ever).
#[test]
fn a_close_voids_a_grant_not_yet_claimed() {
    loom::model(|| {
        let (tx, mut rx) = channel::bounded::<u32>(1).unwrap();
        assert_eq!(tx.try_send(0), Ok(Sent::Queued));
        let waits = tx.clone();
        let waiter = thread::spawn(move || block_on(waits.send(1)));
        let closer = thread::spawn(move || tx.close());
        let mut got = Vec::new();
        while let Some(x) = block_on(rx.recv()) {
            got.push(x);
        }
        match waiter.join().unwrap() {
            Ok(Sent::Queued) => assert_eq!(got, [0, 1]),
            Err(SendError::Closed(1)) => assert_eq!(got, [0]),
            other => panic!("unexpected {other:?}"),
        }
        closer.join().unwrap();
        let s = rx.stats();
        assert_eq!((s.sent, s.received), (got.len() as u64, got.len() as u64));
    });
}

/// A `reserve` queued on a full channel of one and dropped (a timeout, a `select!`), racing
/// the receive that grants it the slot: the grant it gives up goes back to the count, so a
/// later send finds the slot free.
#[test]
fn a_dropped_reserve_gives_its_grant_back() {
    loom::model(|| {
        let (tx, mut rx) = channel::bounded::<u32>(1).unwrap();
        assert_eq!(tx.try_send(0), Ok(Sent::Queued));
        let reserves = tx.clone();
        let quitter = thread::spawn(move || {
            block_on(async {
                let mut reserve = pin!(reserves.reserve());
                // A permit got at once is dropped too: its slot is released.
                poll!(reserve.as_mut()).is_ready()
            })
        });
        assert_eq!(block_on(rx.recv()), Some(0));
        quitter.join().unwrap();
        assert_eq!(tx.try_send(1), Ok(Sent::Queued), "the slot is free again");
        assert_eq!(block_on(rx.recv()), Some(1));
    });
}
