//! The promises of the channel docs, checked at their edge values: `recv_many` with a
//! `max` of 0, the largest capacity, `size_hint` bounds across a close with a permit and a
//! sink's reservation outstanding, `try_recv`'s `Empty` / `Closed`, the `Stats` identity at
//! a capacity of 1 under every policy.

use std::pin::pin;
use std::task::Poll;

use flowgate::channel::{self, Sent, TryRecvError};
use flowgate::{ConfigErrorKind, Overflow};
use futures::{Sink, Stream, StreamExt, poll};

/// "0 only when the channel is closed and drained, or when `max` is 0": a `max` of 0
/// answers 0 at once, on an empty open channel (no wait) and on a full one (nothing moved).
#[tokio::test]
async fn recv_many_with_max_zero_answers_zero_at_once() {
    let (tx, mut rx) = channel::bounded::<u32>(4).unwrap();
    let mut buf = Vec::new();
    assert_eq!(poll!(pin!(rx.recv_many(&mut buf, 0))), Poll::Ready(0));
    for i in 0..3 {
        tx.try_send(i).unwrap();
    }
    assert_eq!(rx.recv().await, Some(0)); // a batch of 1 and 2 held by this receiver
    assert_eq!(poll!(pin!(rx.recv_many(&mut buf, 0))), Poll::Ready(0));
    assert!(buf.is_empty());
    assert_eq!(rx.len(), 2);
    assert_eq!(rx.recv_many(&mut buf, 8).await, 2);
    assert_eq!(buf, [1, 2]);
}

/// The largest capacity (`usize::MAX >> 2`) builds and works (its memory follows the items
/// queued, not the capacity); one more is `TooLarge`.
#[tokio::test]
async fn the_largest_capacity_builds_and_one_more_is_refused() {
    let max = usize::MAX >> 2;
    let (tx, mut rx) = channel::bounded::<u64>(max).unwrap();
    assert_eq!(tx.capacity(), max);
    for i in 0..10 {
        assert_eq!(tx.try_send(i), Ok(Sent::Queued));
    }
    let permit = tx.try_reserve().unwrap();
    permit.send(10);
    drop(tx);
    let got: Vec<u64> = (&mut rx).collect().await;
    assert_eq!(got, (0..=10).collect::<Vec<_>>());
    let err = channel::bounded::<u64>(max + 1).unwrap_err();
    assert_eq!(
        (err.field(), err.kind()),
        ("channel.capacity", ConfigErrorKind::TooLarge)
    );
}

/// Once closed, the upper bound counts the items still to come: queued, and those a permit
/// and a sink's reservation may still bring; the lower bound what is queued. `try_recv`
/// says `Empty` while a permit or a reservation may still bring an item, `Closed` after.
#[tokio::test]
async fn bounds_and_try_recv_across_a_close_with_reservations_outstanding() {
    let (tx, mut rx) = channel::bounded::<u32>(8).unwrap();
    let mut sink = tx.clone();
    tx.try_send(1).unwrap();
    tx.try_send(2).unwrap();
    let permit = tx.try_reserve().unwrap();
    let ready =
        std::future::poll_fn(|cx| Sink::<u32>::poll_ready(std::pin::Pin::new(&mut sink), cx));
    assert!(ready.await.is_ok(), "the sink reserves a slot");
    assert_eq!(rx.size_hint(), (2, None), "open: no upper bound");
    rx.close();
    assert_eq!(rx.size_hint(), (2, Some(4)));
    assert_eq!(rx.try_recv(), Ok(1));
    assert_eq!(rx.try_recv(), Ok(2));
    assert_eq!(
        rx.try_recv(),
        Err(TryRecvError::Empty),
        "a permit is outstanding"
    );
    assert_eq!(rx.size_hint(), (0, Some(2)));
    permit.send(3);
    assert_eq!(rx.size_hint(), (1, Some(2)));
    assert_eq!(rx.try_recv(), Ok(3));
    Sink::<u32>::start_send(std::pin::Pin::new(&mut sink), 4).unwrap();
    assert_eq!(rx.size_hint(), (1, Some(1)));
    assert_eq!(rx.try_recv(), Ok(4));
    assert_eq!(rx.try_recv(), Err(TryRecvError::Closed));
    assert_eq!(rx.next().await, None);
    assert_eq!(rx.size_hint(), (0, Some(0)));
}

/// "At any moment `sent == received + dropped + len()`": at a capacity of 1, under every
/// policy, after every send and receive (and with a permit taking the only slot).
#[tokio::test]
async fn stats_add_up_at_capacity_one_under_every_policy() {
    for policy in [
        Overflow::Backpressure,
        Overflow::Reject,
        Overflow::DropNewest,
        Overflow::DropOldest,
    ] {
        let (tx, mut rx) = channel::builder::<u32>(1).overflow(policy).build().unwrap();
        let check = |rx: &channel::Receiver<u32>, step: &str| {
            let s = rx.stats();
            assert_eq!(
                s.sent,
                s.received + s.dropped + rx.len() as u64,
                "{policy} after {step}: {s:?}, len {}",
                rx.len()
            );
        };
        for i in 0..3 {
            let _ = tx.try_send(i);
            check(&rx, "a send");
        }
        assert!(rx.try_recv().is_ok());
        check(&rx, "a receive");
        let permit = tx.try_reserve().unwrap();
        let outcome = tx.try_send(9);
        check(&rx, "a send with the slot reserved");
        match policy {
            Overflow::Backpressure | Overflow::Reject => assert!(outcome.unwrap_err().is_full()),
            _ => assert_eq!(outcome, Ok(Sent::DroppedNewest), "{policy}"),
        }
        permit.send(10);
        check(&rx, "a permit's send");
        assert_eq!(rx.try_recv(), Ok(10));
        drop(tx);
        assert_eq!(rx.try_recv(), Err(TryRecvError::Closed));
        check(&rx, "the end");
    }
}

/// The bound is exact on both sides of the ring's switch from a preallocated array
/// (capacities up to 4 096) to linked blocks (above): full at exactly `capacity` items,
/// FIFO, and under `DropOldest` the oldest goes, at 4 096 and 4 097.
#[tokio::test]
async fn the_bound_is_exact_on_both_sides_of_the_ring_switch() {
    for capacity in [4_096usize, 4_097] {
        let (tx, mut rx) = channel::bounded::<usize>(capacity).unwrap();
        for i in 0..capacity {
            assert_eq!(tx.try_send(i), Ok(Sent::Queued), "{capacity}: item {i}");
        }
        assert!(tx.try_send(capacity).unwrap_err().is_full(), "{capacity}");
        assert_eq!(rx.len(), capacity);
        let mut buf = Vec::new();
        while buf.len() < capacity {
            rx.recv_many(&mut buf, capacity).await;
        }
        assert_eq!(buf, (0..capacity).collect::<Vec<_>>(), "{capacity}");

        let (tx, mut rx) = channel::builder::<usize>(capacity)
            .overflow(Overflow::DropOldest)
            .build()
            .unwrap();
        for i in 0..capacity + 2 {
            tx.try_send(i).unwrap();
        }
        assert_eq!(rx.len(), capacity);
        assert_eq!(rx.stats().dropped, 2);
        assert_eq!(rx.recv().await, Some(2), "{capacity}: 0 and 1 dropped");
    }
}
