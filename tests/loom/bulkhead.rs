//! loom models of the bulkhead's queue (`src/bulkhead/core.rs`): a freed permit is granted
//! under the lock to the first waiter, whose verdict says so before it is woken, and which
//! takes it without the lock. Whatever races the grant (the waiter giving up, the close, a
//! critical waiter shedding it), the permit is never lost and nobody waits for ever (loom
//! reports a wait nobody can end as a deadlock).

use std::pin::pin;
use std::task::Poll;

use flowgate::bulkhead::{AcquireError, Bulkhead, Priority};
use futures::poll;
use loom::future::block_on;
use loom::thread;

/// The bulkhead is whole again: nothing in flight, nobody waiting, and its one permit free.
fn whole(bh: &Bulkhead) {
    assert_eq!(bh.in_flight(), 0, "a permit is lost");
    assert_eq!(bh.waiting(), 0);
    let p = bh.try_acquire().expect("the permit is free again");
    drop(p);
}

/// A waiter polled once, then dropped, racing the release that grants it the permit: the
/// grant it gave up goes back (or to nobody waiting), never lost.
#[test]
fn a_grant_given_up_comes_back() {
    loom::model(|| {
        let bh = Bulkhead::new(1).unwrap();
        let held = bh.try_acquire_owned().unwrap();
        let quits = bh.clone();
        let quitter = thread::spawn(move || {
            block_on(async {
                let mut acquire = pin!(quits.acquire());
                matches!(poll!(acquire.as_mut()), Poll::Ready(Ok(_)))
            })
        });
        drop(held);
        quitter.join().unwrap();
        whole(&bh);
    });
}

/// Two waiters, one permit released: each gets it in turn, nobody waits for ever.
#[test]
fn two_waiters_share_one_permit() {
    loom::model(|| {
        let bh = Bulkhead::new(1).unwrap();
        let held = bh.try_acquire_owned().unwrap();
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let bh = bh.clone();
                thread::spawn(move || drop(block_on(bh.acquire()).unwrap()))
            })
            .collect();
        drop(held);
        for w in waiters {
            w.join().unwrap();
        }
        whole(&bh);
    });
}

/// A waiter racing the release that grants it the permit and the close: it gets the permit
/// (granted before the close: a grant stays valid) or is refused `Closed`; the permit is
/// back either way.
#[test]
fn a_close_races_a_grant() {
    loom::model(|| {
        let bh = Bulkhead::new(1).unwrap();
        let held = bh.try_acquire_owned().unwrap();
        let waits = bh.clone();
        let waiter = thread::spawn(move || match block_on(waits.acquire()) {
            Ok(p) => drop(p),
            Err(why) => assert_eq!(why, AcquireError::Closed),
        });
        let closes = bh.clone();
        let closer = thread::spawn(move || closes.close());
        drop(held);
        waiter.join().unwrap();
        closer.join().unwrap();
        assert_eq!(bh.in_flight(), 0, "a permit is lost");
        assert_eq!(bh.waiting(), 0);
    });
}

/// A normal waiter in a waiting room of one, shed by a critical waiter while the release
/// grants the permit: the normal one gets the permit or is refused `WaitingRoomFull`; the
/// critical one always gets it; the permit is back at the end.
#[test]
fn a_shed_races_a_grant() {
    loom::model(|| {
        let bh = Bulkhead::builder(1).max_waiting(1).build().unwrap();
        let held = bh.try_acquire_owned().unwrap();
        let normal = bh.clone();
        let first = thread::spawn(move || match block_on(normal.acquire()) {
            Ok(p) => drop(p),
            Err(why) => assert_eq!(why, AcquireError::WaitingRoomFull),
        });
        let critical = bh.clone();
        let second = thread::spawn(move || {
            drop(block_on(critical.acquire_with(Priority::Critical)).unwrap());
        });
        drop(held);
        first.join().unwrap();
        second.join().unwrap();
        whole(&bh);
    });
}
