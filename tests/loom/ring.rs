//! loom models of the channel's lock-free fast path (`src/channel/shared.rs`): the slot
//! count claimed by compare-and-swap, the ring, and the flags that send the slow cases to
//! the lock. (Under loom the ring is the real one, `src/channel/ring.rs`, on loom's atomics
//! and cells, so these models also explore its tickets and stamps.)

use std::sync::atomic::Ordering::SeqCst;

use flowgate::channel::{self, SendError, Sent};
use flowgate::{Dropped, Overflow};
use loom::future::block_on;
use loom::sync::Arc;
use loom::sync::atomic::AtomicUsize;
use loom::thread;

/// Lost wake: a receiver going to sleep (flag, fence, look again) races a lock-free push
/// (push, fence, read the flag). The receiver is woken or finds the item: it never hangs.
#[test]
fn a_push_racing_a_receiver_going_to_sleep_wakes_it() {
    loom::model(|| {
        let (tx, mut rx) = channel::bounded::<u32>(4).unwrap();
        let receiver = thread::spawn(move || block_on(rx.recv()));
        assert_eq!(tx.try_send(1), Ok(Sent::Queued));
        assert_eq!(receiver.join().unwrap(), Some(1));
    });
}

/// A send racing `close`: the claim and the close are ordered on one word, so the item is
/// either handed back or queued and received before the end; never lost, never after it.
#[test]
fn send_races_close() {
    loom::model(|| {
        let (tx, mut rx) = channel::bounded::<u32>(2).unwrap();
        let tx2 = tx.clone();
        let sender = thread::spawn(move || tx2.try_send(7));
        tx.close();
        let mut got = Vec::new();
        while let Some(x) = block_on(rx.recv()) {
            got.push(x);
        }
        match sender.join().unwrap() {
            Ok(Sent::Queued) => assert_eq!(got, [7]),
            Err(SendError::Closed(7)) => assert!(got.is_empty()),
            other => panic!("unexpected {other:?}"),
        }
        let s = rx.stats();
        assert_eq!((s.sent, s.received), (got.len() as u64, got.len() as u64));
    });
}

/// `DropOldest` on a full channel racing a receive: each item is received or dropped
/// (through the hook) exactly once, and the counts add up.
#[test]
fn drop_oldest_races_recv() {
    loom::model(|| {
        let dropped = Arc::new(AtomicUsize::new(0));
        let seen = dropped.clone();
        let (tx, mut rx) = channel::builder::<u32>(1)
            .overflow(Overflow::DropOldest)
            .on_drop(move |x, why: &Dropped| {
                assert_eq!((x, why.as_str()), (0, "oldest"));
                seen.fetch_add(1, SeqCst);
            })
            .build()
            .unwrap();
        assert_eq!(tx.try_send(0), Ok(Sent::Queued));
        let sender = thread::spawn(move || tx.try_send(1).unwrap());
        let first = rx.try_recv().ok();
        let sent = sender.join().unwrap();
        let mut got: Vec<u32> = first.into_iter().collect();
        while let Some(x) = block_on(rx.recv()) {
            got.push(x);
        }
        match sent {
            Sent::Queued => assert_eq!(got, [0, 1]),
            Sent::DroppedOldest => assert_eq!((got, dropped.load(SeqCst)), (vec![1], 1)),
            other => panic!("unexpected {other:?}"),
        }
        let s = rx.stats();
        assert_eq!(s.sent, s.received + s.dropped);
    });
}

/// Grant handoff: a sender queued on a full channel gets the slot a dropped permit frees
/// (the free sees `SEND_WAIT` and grants under the lock), or claims it itself if the
/// permit went first; a newcomer never takes it from a queued sender.
#[test]
fn a_released_permit_goes_to_the_waiting_sender() {
    loom::model(|| {
        let (tx, mut rx) = channel::bounded::<u32>(1).unwrap();
        let permit = tx.try_reserve().unwrap();
        let tx2 = tx.clone();
        let waiter = thread::spawn(move || block_on(tx2.send(2)).unwrap());
        drop(permit);
        waiter.join().unwrap();
        assert_eq!(tx.try_send(3), Err(SendError::Full(3)), "the slot is 2's");
        assert_eq!(block_on(rx.recv()), Some(2));
    });
}

/// The end of the stream: a receiver waiting on a closed channel for an outstanding permit
/// is woken when the permit is dropped on another thread (the free that leaves nothing
/// occupied wakes every receiver).
#[test]
fn the_last_released_slot_ends_the_stream() {
    loom::model(|| {
        let (tx, mut rx) = channel::bounded::<u32>(2).unwrap();
        let permit = block_on(tx.clone().reserve_owned()).unwrap();
        tx.close();
        let releaser = thread::spawn(move || drop(permit));
        assert_eq!(block_on(rx.recv()), None);
        releaser.join().unwrap();
    });
}

/// The ring's cells are reused lap after lap: a channel of two (two cells) is full, and a
/// sender's third item takes the first cell's next ticket once the receiver has popped it
/// (its claim, or its grant, comes after the free that follows the pop, so its push finds
/// the cell free: the push's wait for a pop's stamp is modelled in
/// `a_ticket_whose_claim_came_before_the_pop_of_its_cell_waits_for_it`), and the items come
/// out once each, in order. (`two_senders_one_slot` races two senders for tickets.)
#[test]
fn a_ticket_reuses_a_cell_being_popped() {
    loom::model(|| {
        let (tx, mut rx) = channel::bounded::<u32>(2).unwrap();
        assert_eq!(tx.try_send(1), Ok(Sent::Queued));
        assert_eq!(tx.try_send(2), Ok(Sent::Queued));
        let sender = thread::spawn(move || block_on(tx.send(3)).unwrap());
        let mut got = Vec::new();
        while let Some(x) = block_on(rx.recv()) {
            got.push(x);
        }
        sender.join().unwrap();
        assert_eq!(got, [1, 2, 3]);
    });
}

/// Lost wake through `recv_many`: a receiver waiting in `recv_many` (flag, fence, look
/// again, under the same lock as the batch receive) races a lock-free push. It is woken or
/// finds the item: it never hangs.
#[test]
fn a_push_racing_recv_many_going_to_sleep_wakes_it() {
    loom::model(|| {
        let (tx, mut rx) = channel::bounded::<u32>(4).unwrap();
        let receiver = thread::spawn(move || {
            let mut buf = Vec::new();
            let n = block_on(rx.recv_many(&mut buf, 4));
            (n, buf)
        });
        assert_eq!(tx.try_send(1), Ok(Sent::Queued));
        assert_eq!(receiver.join().unwrap(), (1, vec![1]));
    });
}

/// The end of the stream behind a receiver's batch: one receiver holds the slot of the
/// second item of its batch when the channel closes, and frees it (without the lock) when
/// it hands that item out; another receiver waiting in `recv_many` for the end is woken by
/// that free and gets 0, whichever of the close, the free and its polls comes first.
#[test]
fn a_batch_used_up_after_close_ends_the_other_receivers_wait() {
    loom::model(|| {
        let (tx, mut rx) = channel::bounded::<u32>(2).unwrap();
        assert_eq!(tx.try_send(1), Ok(Sent::Queued));
        assert_eq!(tx.try_send(2), Ok(Sent::Queued));
        // Alone, the receiver takes both items under one lock: 1 handed out, 2 held.
        assert_eq!(block_on(rx.recv()), Some(1));
        assert_eq!(rx.len(), 1, "2 is in its batch");
        let mut other = rx.clone();
        let waiter = thread::spawn(move || {
            let mut buf = Vec::new();
            block_on(other.recv_many(&mut buf, 4))
        });
        drop(tx);
        assert_eq!(block_on(rx.recv()), Some(2));
        assert_eq!(waiter.join().unwrap(), 0);
        assert_eq!(block_on(rx.recv()), None);
    });
}

/// A ticket whose claim came before the pop that freed its cell a lap ago: sender `late`
/// claims a slot of a channel of two (two cells) and only then takes its ticket, while the
/// other sender's two items take tickets 0 and 1, the second in the slot the receive of the
/// first freed. `late`'s ticket 2 is cell 0's next: its claim did not see that cell's pop
/// (the claim came first), so its push may find the old stamp and waits for the new one.
/// Every item arrives once, each sender's in order. (With one sender, as in
/// `a_ticket_reuses_a_cell_being_popped`, every claim comes after the free that makes room
/// for it, and a push never waits.) Two preemptions reach the wait and keep this model of
/// three threads to a few minutes in a debug build (three take over ten times as long), so
/// the bound is set here, whatever `LOOM_MAX_PREEMPTIONS` says.
#[test]
fn a_ticket_whose_claim_came_before_the_pop_of_its_cell_waits_for_it() {
    let mut model = loom::model::Builder::new();
    model.preemption_bound = Some(2);
    model.check(|| {
        let (tx, mut rx) = channel::bounded::<u32>(2).unwrap();
        let late = tx.clone();
        let late = thread::spawn(move || block_on(late.send(9)).unwrap());
        let early = thread::spawn(move || {
            for i in 1..=2 {
                block_on(tx.send(i)).unwrap();
            }
        });
        let mut got = Vec::new();
        while let Some(x) = block_on(rx.recv()) {
            got.push(x);
        }
        late.join().unwrap();
        early.join().unwrap();
        let ours: Vec<u32> = got.iter().copied().filter(|&x| x != 9).collect();
        assert_eq!((got.len(), ours), (3, vec![1, 2]));
    });
}
