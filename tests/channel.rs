//! The bounded channel: order, shutdown, policies, permits, Sink/Stream, cancel safety, and
//! a stress test that accounts for every item. Receiver batches (`len`, `DropOldest`,
//! `size_hint`) are tested in `channel/batches.rs`, wakers and the lock in `channel/wakers.rs`,
//! a metrics recorder that panics in `channel/recorder.rs`.

mod support;

#[path = "channel/accounting.rs"]
mod accounting;
#[path = "channel/batches.rs"]
mod batches;
#[path = "channel/claims.rs"]
mod claims;
#[path = "channel/mixed.rs"]
mod mixed;
#[cfg(feature = "metrics")]
#[path = "channel/recorder.rs"]
mod recorder;
#[path = "channel/wakers.rs"]
mod wakers;
#[path = "channel/walk.rs"]
mod walk;

use std::collections::HashSet;
use std::panic::{RefUnwindSafe, UnwindSafe};
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;

use flowgate::channel::{self, ReserveError, SendError, Sent, TryRecvError};
use flowgate::{ConfigErrorKind, Dropped, Overflow};
use futures::{FutureExt, SinkExt, StreamExt, poll};

#[tokio::test]
async fn fifo_single_producer() {
    let (tx, mut rx) = channel::bounded(4).unwrap();
    let producer = tokio::spawn(async move {
        for i in 0..1000u32 {
            tx.send(i).await.unwrap();
        }
    });
    for i in 0..1000u32 {
        assert_eq!(rx.recv().await, Some(i));
    }
    producer.await.unwrap();
    assert_eq!(rx.recv().await, None);
}

#[test]
fn zero_capacity_is_a_config_error() {
    let err = channel::bounded::<u8>(0).unwrap_err();
    assert_eq!(
        (err.field(), err.kind()),
        ("channel.capacity", ConfigErrorKind::Zero)
    );
    let err = channel::bounded::<u8>(usize::MAX).unwrap_err();
    assert_eq!(err.kind(), ConfigErrorKind::TooLarge);
}

#[tokio::test]
async fn dropping_senders_drains_then_ends() {
    let (tx, mut rx) = channel::bounded(8).unwrap();
    let tx2 = tx.clone();
    tx.send(1).await.unwrap();
    tx2.send(2).await.unwrap();
    drop(tx);
    assert!(!rx.is_closed());
    drop(tx2);
    assert!(rx.is_closed());
    assert_eq!(rx.recv().await, Some(1));
    assert_eq!(rx.recv().await, Some(2));
    assert_eq!(rx.recv().await, None);
    assert_eq!(rx.try_recv(), Err(TryRecvError::Closed));
}

#[tokio::test]
async fn receiver_close_refuses_sends_but_drains() {
    let (tx, mut rx) = channel::bounded(8).unwrap();
    tx.send(1).await.unwrap();
    rx.close();
    assert_eq!(tx.send(2).await, Err(SendError::Closed(2)));
    assert_eq!(tx.try_send(3).unwrap_err().into_inner(), 3);
    assert_eq!(rx.recv().await, Some(1));
    assert_eq!(rx.recv().await, None);
}

#[tokio::test]
async fn sender_close_wakes_waiting_senders_and_receivers() {
    let (tx, mut rx) = channel::bounded(1).unwrap();
    tx.send(1).await.unwrap();
    let mut blocked = pin!(tx.send(2));
    assert!(poll!(blocked.as_mut()).is_pending());
    tx.close();
    assert_eq!(blocked.await, Err(SendError::Closed(2)));
    assert_eq!(rx.recv().await, Some(1));
    assert_eq!(rx.recv().await, None);
}

#[tokio::test]
async fn dropping_every_receiver_fails_sends_and_drops_the_buffer_observably() {
    let dropped = Arc::new(Mutex::new(Vec::new()));
    let seen = dropped.clone();
    let (tx, rx) = channel::builder(4)
        .on_drop(move |x: u32, why: &Dropped| seen.lock().unwrap().push((x, why.as_str())))
        .build()
        .unwrap();
    tx.send(1).await.unwrap();
    tx.send(2).await.unwrap();
    let rx2 = rx.clone();
    drop(rx);
    tx.send(3).await.unwrap();
    let closed = tx.closed();
    drop(rx2);
    closed.await;
    assert_eq!(
        *dropped.lock().unwrap(),
        [(1, "discarded"), (2, "discarded"), (3, "discarded")]
    );
    assert_eq!(tx.send(4).await, Err(SendError::Closed(4)));
    let stats = tx.stats();
    assert_eq!((stats.sent, stats.received, stats.dropped), (3, 0, 3));
}

#[tokio::test]
async fn backpressure_waits_for_space() {
    let (tx, mut rx) = channel::bounded(2).unwrap();
    assert_eq!(tx.send(1).await, Ok(Sent::Queued));
    assert_eq!(tx.send(2).await, Ok(Sent::Queued));
    assert_eq!(tx.try_send(3), Err(SendError::Full(3)));
    let mut third = pin!(tx.send(3));
    assert!(poll!(third.as_mut()).is_pending());
    assert_eq!(rx.recv().await, Some(1));
    assert_eq!(third.await, Ok(Sent::Queued));
    assert_eq!(rx.recv().await, Some(2));
    assert_eq!(rx.recv().await, Some(3));
}

#[tokio::test]
async fn reject_hands_the_item_back() {
    let (tx, mut rx) = channel::builder(1)
        .overflow(Overflow::Reject)
        .build()
        .unwrap();
    tx.send("a").await.unwrap();
    let err = tx.send("b").await.unwrap_err();
    assert!(err.is_full());
    assert_eq!(err.to_string(), "channel full");
    assert_eq!(err.into_inner(), "b");
    assert_eq!(rx.recv().await, Some("a"));
    assert_eq!(tx.stats().dropped, 0);
}

/// A hook that records each dropped item, and each reason (`Dropped::as_str`) in a second log.
#[allow(clippy::type_complexity)]
fn recording_hook() -> (
    Arc<Mutex<Vec<u32>>>,
    Arc<Mutex<Vec<&'static str>>>,
    impl Fn(u32, &Dropped) + Send + Sync + 'static,
) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let reasons = Arc::new(Mutex::new(Vec::new()));
    let (sink, why_sink) = (log.clone(), reasons.clone());
    (log, reasons, move |x, why: &Dropped| {
        sink.lock().unwrap().push(x);
        why_sink.lock().unwrap().push(why.as_str());
    })
}

#[tokio::test]
async fn drop_newest_drops_the_incoming_item() {
    let (log, reasons, hook) = recording_hook();
    let (tx, mut rx) = channel::builder(2)
        .overflow(Overflow::DropNewest)
        .on_drop(hook)
        .build()
        .unwrap();
    let outcomes: Vec<Sent> = [
        tx.send(1).await.unwrap(),
        tx.send(2).await.unwrap(),
        tx.send(3).await.unwrap(),
        tx.send(4).await.unwrap(),
    ]
    .into();
    assert_eq!(
        outcomes,
        [
            Sent::Queued,
            Sent::Queued,
            Sent::DroppedNewest,
            Sent::DroppedNewest
        ]
    );
    assert!(!Sent::DroppedNewest.is_queued());
    assert_eq!(*log.lock().unwrap(), [3, 4]);
    assert_eq!(*reasons.lock().unwrap(), ["newest", "newest"]);
    assert_eq!(rx.recv().await, Some(1));
    assert_eq!(rx.recv().await, Some(2));
    let stats = rx.stats();
    assert_eq!((stats.sent, stats.received, stats.dropped), (4, 2, 2));
}

#[tokio::test]
async fn drop_oldest_drops_the_oldest_item() {
    let (log, reasons, hook) = recording_hook();
    let (tx, mut rx) = channel::builder(2)
        .overflow(Overflow::DropOldest)
        .on_drop(hook)
        .build()
        .unwrap();
    for i in 1..=5 {
        let sent = tx.send(i).await.unwrap();
        assert_eq!(
            sent,
            if i <= 2 {
                Sent::Queued
            } else {
                Sent::DroppedOldest
            }
        );
    }
    assert!(Sent::DroppedOldest.is_queued());
    assert_eq!(*log.lock().unwrap(), [1, 2, 3]);
    assert_eq!(*reasons.lock().unwrap(), ["oldest", "oldest", "oldest"]);
    assert_eq!(rx.recv().await, Some(4));
    assert_eq!(rx.recv().await, Some(5));
    let stats = rx.stats();
    assert_eq!((stats.sent, stats.received, stats.dropped), (5, 2, 3));
}

#[tokio::test]
async fn drop_oldest_with_every_slot_reserved_drops_the_newest() {
    let (log, reasons, hook) = recording_hook();
    let (tx, _rx) = channel::builder(1)
        .overflow(Overflow::DropOldest)
        .on_drop(hook)
        .build()
        .unwrap();
    let permit = tx.reserve().await.unwrap();
    assert_eq!(tx.send(7).await, Ok(Sent::DroppedNewest));
    drop(permit);
    assert_eq!(*log.lock().unwrap(), [7]);
    assert_eq!(*reasons.lock().unwrap(), ["newest"]);
}

#[tokio::test]
async fn permits_reserve_slots_and_return_them_when_dropped() {
    let (tx, mut rx) = channel::bounded(2).unwrap();
    let p1 = tx.reserve().await.unwrap();
    let p2 = tx.try_reserve().unwrap();
    assert_eq!(tx.try_reserve().unwrap_err(), ReserveError::Full);
    assert_eq!(tx.try_send(0), Err(SendError::Full(0)));
    drop(p1);
    let p3 = tx.try_reserve().unwrap();
    p2.send(2);
    p3.send(3);
    assert_eq!(rx.recv().await, Some(2));
    assert_eq!(rx.recv().await, Some(3));

    let owned = tx.clone().reserve_owned().await.unwrap();
    let tx2 = owned.send(4);
    assert_eq!(rx.recv().await, Some(4));
    let owned = tx2.reserve_owned().await.unwrap();
    drop(owned.release());
    assert_eq!(tx.try_reserve().map(drop), Ok(()));
}

#[tokio::test]
async fn an_outstanding_permit_holds_the_receiver_open_after_close() {
    let (tx, mut rx) = channel::bounded::<u32>(2).unwrap();
    let permit = tx.clone().reserve_owned().await.unwrap();
    drop(tx);
    {
        let mut next = pin!(rx.recv());
        assert!(poll!(next.as_mut()).is_pending());
        drop(permit.send(9));
        assert_eq!(next.await, Some(9));
    }
    assert_eq!(rx.recv().await, None);
}

#[tokio::test]
async fn a_dropped_send_future_leaks_no_slot() {
    let (tx, mut rx) = channel::bounded(1).unwrap();
    tx.send(1).await.unwrap();
    {
        let mut waiting = pin!(tx.send(2));
        assert!(poll!(waiting.as_mut()).is_pending());
    }
    assert_eq!(rx.recv().await, Some(1));
    assert_eq!(tx.try_send(3), Ok(Sent::Queued));
}

#[tokio::test]
async fn a_slot_granted_to_a_dropped_sender_passes_to_the_next() {
    let (tx, mut rx) = channel::bounded(1).unwrap();
    tx.send(0).await.unwrap();
    let mut a = Box::pin(tx.send(1));
    let mut b = Box::pin(tx.send(2));
    assert!(poll!(a.as_mut()).is_pending());
    assert!(poll!(b.as_mut()).is_pending());
    assert_eq!(rx.recv().await, Some(0)); // the freed slot is granted to `a`
    drop(a);
    assert_eq!(b.await, Ok(Sent::Queued));
    assert_eq!(rx.recv().await, Some(2));
    assert!(rx.is_empty());
}

#[tokio::test]
async fn waiting_senders_are_served_fifo_and_newcomers_do_not_barge() {
    let (tx, mut rx) = channel::bounded(1).unwrap();
    tx.send(0).await.unwrap();
    let mut waiting: Vec<_> = (1..=3).map(|i| Box::pin(tx.send(i))).collect();
    for w in &mut waiting {
        assert!(poll!(w.as_mut()).is_pending());
    }
    assert_eq!(rx.recv().await, Some(0));
    // The freed slot belongs to the first waiter, not to a newcomer.
    assert_eq!(tx.try_send(99), Err(SendError::Full(99)));
    let mut got = Vec::new();
    for w in waiting {
        w.await.unwrap();
        got.push(rx.recv().await.unwrap());
    }
    assert_eq!(got, [1, 2, 3]);
}

#[tokio::test]
async fn a_dropped_recv_future_loses_no_item() {
    let (tx, mut rx) = channel::bounded(4).unwrap();
    let mut rx2 = rx.clone();
    {
        let mut r = pin!(rx.recv());
        assert!(poll!(r.as_mut()).is_pending());
        let mut r2 = pin!(rx2.recv());
        assert!(poll!(r2.as_mut()).is_pending());
        tx.send(1).await.unwrap(); // wakes the first receiver, which is then dropped
    }
    // The item is still there for anyone.
    assert_eq!(rx2.recv().await, Some(1));
}

#[tokio::test]
async fn recv_many_takes_a_batch() {
    let (tx, mut rx) = channel::bounded(8).unwrap();
    for i in 0..5 {
        tx.send(i).await.unwrap();
    }
    let mut buf = Vec::new();
    assert_eq!(rx.recv_many(&mut buf, 3).await, 3);
    assert_eq!(rx.recv_many(&mut buf, 10).await, 2);
    assert_eq!(buf, [0, 1, 2, 3, 4]);
    assert_eq!(rx.recv_many(&mut buf, 0).await, 0);
    drop(tx);
    assert_eq!(rx.recv_many(&mut buf, 10).await, 0);
}

#[tokio::test]
async fn recv_many_wakes_blocked_senders_for_every_freed_slot() {
    let (tx, mut rx) = channel::bounded(2).unwrap();
    tx.send(0).await.unwrap();
    tx.send(1).await.unwrap();
    let mut a = Box::pin(tx.send(2));
    let mut b = Box::pin(tx.send(3));
    assert!(poll!(a.as_mut()).is_pending());
    assert!(poll!(b.as_mut()).is_pending());
    let mut buf = Vec::new();
    assert_eq!(rx.recv_many(&mut buf, 2).await, 2);
    assert!(a.await.is_ok() && b.await.is_ok());
    assert_eq!(rx.recv_many(&mut buf, 2).await, 2);
    assert_eq!(buf, [0, 1, 2, 3]);
}

#[tokio::test]
async fn stream_forward_into_sink_and_map_the_receiver() {
    let (tx, rx) = channel::bounded(3).unwrap();
    let forward = tokio::spawn(futures::stream::iter(0..50u32).map(Ok).forward(tx));
    let out: Vec<u32> = rx.map(|x| x + 1).collect().await;
    forward.await.unwrap().unwrap();
    assert_eq!(out, (1..=50).collect::<Vec<_>>());
}

#[tokio::test]
async fn a_sink_slot_reserved_but_unused_is_released_on_drop() {
    let (mut tx, mut rx) = channel::bounded::<u32>(1).unwrap();
    let tx2 = tx.clone();
    // poll_ready reserves the only slot.
    futures::future::poll_fn(|cx| tx.poll_ready_unpin(cx))
        .await
        .unwrap();
    assert_eq!(tx2.try_send(1), Err(SendError::Full(1)));
    drop(tx);
    assert_eq!(tx2.try_send(1), Ok(Sent::Queued));
    assert_eq!(rx.recv().await, Some(1));
}

#[tokio::test]
async fn sink_close_detaches_only_this_sender() {
    let (mut tx, mut rx) = channel::bounded::<u32>(4).unwrap();
    let tx2 = tx.clone();
    tx.send(1).now_or_never().unwrap().unwrap();
    SinkExt::close(&mut tx).await.unwrap();
    assert!(tx.is_closed());
    assert!(!tx2.is_closed());
    // `Debug` says which handle is closed: the channel itself is not.
    assert!(format!("{tx:?}").contains("detached: true"), "{tx:?}");
    assert!(format!("{tx2:?}").contains("detached: false"), "{tx2:?}");
    tx2.send(2).await.unwrap();
    drop(tx2);
    assert_eq!(rx.recv().await, Some(1));
    assert_eq!(rx.recv().await, Some(2));
    assert_eq!(rx.recv().await, None);
}

/// Closing is a property of the handle, and its clones inherit it (as a clone of a closed
/// `PollSender` or of a disconnected `futures` sender is closed): a clone of a sender closed
/// as a `Sink` is closed too, and does not count as a sender either.
#[tokio::test]
async fn a_clone_of_a_sink_closed_sender_is_closed_too() {
    let (mut tx, mut rx) = channel::bounded::<u32>(4).unwrap();
    let other = tx.clone();
    SinkExt::close(&mut tx).await.unwrap();
    let clone = tx.clone();
    assert!(clone.is_closed());
    assert_eq!(clone.try_send(1), Err(SendError::Closed(1)));
    assert_eq!(clone.send(2).await, Err(SendError::Closed(2)));
    assert_eq!(clone.try_reserve().unwrap_err(), ReserveError::Closed);
    assert_eq!(clone.reserve().await.unwrap_err(), ReserveError::Closed);
    let mut sink = clone.clone();
    assert_eq!(SinkExt::send(&mut sink, 3).await, Err(SendError::Closed(3)));
    // Only `other` keeps the channel open.
    assert!(!other.is_closed());
    other.send(4).await.unwrap();
    drop(other);
    assert_eq!(rx.recv().await, Some(4));
    assert_eq!(rx.recv().await, None);
    assert!(clone.is_closed());
    drop((tx, clone, sink));
}

#[tokio::test]
async fn sink_under_reject_hands_the_item_back() {
    let (mut tx, _rx) = channel::builder(1)
        .overflow(Overflow::Reject)
        .build()
        .unwrap();
    SinkExt::send(&mut tx, 1u32).await.unwrap();
    assert_eq!(SinkExt::send(&mut tx, 2).await, Err(SendError::Full(2)));
}

#[tokio::test]
async fn closed_resolves_when_receivers_are_gone() {
    let (tx, rx) = channel::bounded::<u8>(1).unwrap();
    let mut closed = pin!(tx.closed());
    assert_eq!(poll!(closed.as_mut()), Poll::Pending);
    drop(rx);
    closed.await;
    assert!(tx.is_closed());
}

#[test]
fn public_types_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<channel::Sender<Vec<u8>>>();
    send_sync::<channel::Receiver<Vec<u8>>>();
    send_sync::<channel::Permit<'static, Vec<u8>>>();
    send_sync::<channel::OwnedPermit<Vec<u8>>>();
    send_sync::<channel::Send<'static, Vec<u8>>>();
    send_sync::<channel::Reserve<'static, Vec<u8>>>();
    send_sync::<channel::ReserveOwned<Vec<u8>>>();
    send_sync::<channel::Recv<'static, Vec<u8>>>();
    send_sync::<channel::ChannelBuilder<Vec<u8>>>();
    send_sync::<SendError<Vec<u8>>>();
    fn unpin<T: Unpin>() {}
    unpin::<channel::Receiver<std::marker::PhantomPinned>>();
    unpin::<channel::Send<'static, std::marker::PhantomPinned>>();
}

/// Channel handles are unwind-safe for any item type, as tokio's are: no user code runs
/// under the channel's lock, so a panic (in a hook, say) leaves it consistent.
#[test]
fn handles_are_unwind_safe() {
    fn unwind_safe<T: UnwindSafe + RefUnwindSafe>() {}
    // `Cell` is not `RefUnwindSafe`: the channel only moves its items, never shares them.
    type Item = std::cell::Cell<u8>;
    unwind_safe::<channel::Sender<Item>>();
    unwind_safe::<channel::Receiver<Item>>();
    unwind_safe::<channel::Permit<'static, Item>>();
    unwind_safe::<channel::OwnedPermit<Item>>();
    unwind_safe::<channel::ChannelBuilder<Item>>();
    unwind_safe::<channel::Reserve<'static, Item>>();
    unwind_safe::<channel::ReserveOwned<Item>>();
    unwind_safe::<channel::Closed<'static, Item>>();
}

/// A panic in the drop hook unwinds through `try_send` (`catch_unwind` takes the handles by
/// reference, which needs `RefUnwindSafe`) and leaves the channel consistent and usable.
#[test]
fn a_panicking_hook_leaves_the_channel_usable() {
    let (tx, mut rx) = channel::builder::<u32>(1)
        .overflow(Overflow::DropNewest)
        .on_drop(|x, _: &Dropped| {
            if x == 2 {
                panic!("hook panics on {x}");
            }
        })
        .build()
        .unwrap();
    assert_eq!(tx.try_send(1), Ok(Sent::Queued));
    let unwound = std::panic::catch_unwind(|| tx.try_send(2));
    assert!(unwound.is_err(), "the hook's panic reached the caller");
    assert_eq!(tx.try_send(3), Ok(Sent::DroppedNewest));
    assert_eq!(rx.try_recv(), Ok(1));
    assert_eq!(tx.try_send(4), Ok(Sent::Queued));
    let recv_again = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rx.try_recv()));
    assert_eq!(recv_again.unwrap(), Ok(4));
    let stats = tx.stats();
    assert_eq!((stats.sent, stats.received, stats.dropped), (4, 2, 2));
}

/// A receiver dropped while its thread unwinds from another panic (a handler that panicked
/// with the receiver on its stack) hands its buffered items to the hook; a hook that panics
/// then must not abort the process (a second panic during unwinding does): its panic is
/// dropped, the first goes on, and every item still reaches the hook and is counted.
#[test]
fn a_hook_panicking_while_the_thread_unwinds_does_not_abort() {
    let calls = Arc::new(AtomicU64::new(0));
    let seen = calls.clone();
    let (tx, rx) = channel::builder::<u32>(3)
        .on_drop(move |x, _: &Dropped| {
            seen.fetch_add(1, Ordering::Relaxed);
            panic!("hook panics on {x}");
        })
        .build()
        .unwrap();
    for i in 0..3 {
        assert_eq!(tx.try_send(i), Ok(Sent::Queued));
    }
    let handler = std::thread::spawn(move || {
        let _rx = rx;
        panic!("the handler panics");
    });
    let first = handler.join().expect_err("the handler's panic goes on");
    assert_eq!(first.downcast_ref::<&str>(), Some(&"the handler panics"));
    assert_eq!(
        calls.load(Ordering::Relaxed),
        3,
        "every item reached the hook"
    );
    assert_eq!(tx.stats().dropped, 3);
}

/// The last receiver dropped with items buffered passes each to the hook; a hook that panics
/// on the first must not make the rest uncounted: `stats().dropped` and the `closed` drop
/// metric both count every buffered item (the hook's panic reaches the code that dropped
/// the receiver, and the items after it are dropped without the hook), and a sender waiting
/// for a slot is still woken with `Closed`.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn a_hook_panicking_on_the_receivers_drop_leaves_every_item_counted() {
    let recorder = support::TestRecorder::default();
    let calls = Arc::new(AtomicU64::new(0));
    let seen = calls.clone();
    let (tx, rx) = metrics::with_local_recorder(&recorder, || {
        channel::builder::<u32>(3)
            .name("panicky")
            .on_drop(move |x, why: &Dropped| {
                assert_eq!(why.as_str(), "discarded");
                if seen.fetch_add(1, Ordering::Relaxed) == 0 {
                    panic!("hook panics on {x}");
                }
            })
            .build()
            .unwrap()
    });
    for i in 0..3 {
        assert_eq!(tx.try_send(i), Ok(Sent::Queued));
    }
    let mut waiting = pin!(tx.send(3));
    assert!(poll!(waiting.as_mut()).is_pending(), "the channel is full");
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(rx)));
    assert!(unwound.is_err(), "the hook's panic reached the caller");
    assert_eq!(
        calls.load(Ordering::Relaxed),
        1,
        "the hook saw the first item"
    );
    assert_eq!(waiting.await, Err(SendError::Closed(3)));
    let stats = tx.stats();
    assert_eq!((stats.sent, stats.received, stats.dropped), (3, 0, 3));
    assert_eq!(
        recorder.counter("flowgate_channel_dropped_total{name=panicky,policy=closed}"),
        3,
        "every discarded item is counted, not only those the hook saw"
    );
    assert_eq!(
        recorder.gauge("flowgate_channel_depth{name=panicky}"),
        Some(0.0)
    );
    assert_eq!(tx.try_send(4), Err(SendError::Closed(4)));
}

#[tokio::test]
async fn receiver_close_takes_a_shared_reference() {
    let (tx, rx) = channel::bounded::<u32>(4).unwrap();
    tx.try_send(1).unwrap();
    let rx = Arc::new(rx);
    let closer = Arc::clone(&rx);
    tokio::spawn(async move { closer.close() }).await.unwrap();
    assert!(tx.is_closed());
    assert_eq!(tx.try_send(2), Err(SendError::Closed(2)));
    let mut rx = Arc::into_inner(rx).unwrap();
    assert_eq!(rx.recv().await, Some(1));
    assert_eq!(rx.recv().await, None);
}

#[test]
fn both_handles_read_the_name() {
    let (tx, rx) = channel::builder::<u32>(1)
        .name(String::from("stage-a"))
        .build()
        .unwrap();
    assert_eq!((tx.name(), rx.name()), (Some("stage-a"), Some("stage-a")));
    let (tx, rx) = channel::bounded::<u32>(1).unwrap();
    assert_eq!((tx.name(), rx.name()), (None, None));
}

/// xorshift, one per task.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Many producers and consumers on two worker threads; a third of the sends and receives
/// are cancelled after their first poll. Every item is accounted for exactly once.
async fn stress(overflow: Overflow, capacity: usize) {
    const PRODUCERS: u64 = 6;
    const CONSUMERS: u64 = 4;
    const PER_PRODUCER: u64 = 3_000;
    let dropped = Arc::new(Mutex::new(Vec::new()));
    let hook_log = dropped.clone();
    let (tx, rx) = channel::builder(capacity)
        .overflow(overflow)
        .on_drop(move |x: u64, why: &Dropped| {
            // Receivers outlive the producers: only the policy drops items.
            let expected: &[&str] = match overflow {
                Overflow::DropNewest => &["newest"],
                Overflow::DropOldest => &["oldest", "newest"],
                _ => &[],
            };
            assert!(
                expected.contains(&why.as_str()),
                "{overflow:?} dropped with {why}"
            );
            hook_log.lock().unwrap().push(x)
        })
        .build()
        .unwrap();
    let cancelled_recvs = Arc::new(AtomicU64::new(0));
    let mut producers = Vec::new();
    for p in 0..PRODUCERS {
        let tx = tx.clone();
        producers.push(tokio::spawn(async move {
            let mut rng = Rng(p * 7919 + 1);
            let mut accepted = Vec::new();
            for i in 0..PER_PRODUCER {
                let item = p * PER_PRODUCER + i;
                let mut send = pin!(tx.send(item));
                let result = match poll!(send.as_mut()) {
                    Poll::Ready(r) => Some(r),
                    Poll::Pending if rng.next().is_multiple_of(3) => None, // cancelled: never sent
                    Poll::Pending => Some(send.await),
                };
                if let Some(r) = result {
                    r.expect("the receivers outlive the producers");
                    accepted.push(item);
                }
                if rng.next().is_multiple_of(8) {
                    tokio::task::yield_now().await;
                }
            }
            accepted
        }));
    }
    drop(tx);
    let mut consumers = Vec::new();
    for c in 0..CONSUMERS {
        let mut rx = rx.clone();
        let cancelled = cancelled_recvs.clone();
        consumers.push(tokio::spawn(async move {
            let mut rng = Rng(c * 104_729 + 3);
            let mut got = Vec::new();
            loop {
                let next = {
                    let mut recv = pin!(rx.recv());
                    match poll!(recv.as_mut()) {
                        Poll::Ready(next) => Some(next),
                        Poll::Pending if rng.next().is_multiple_of(3) => None,
                        Poll::Pending => Some(recv.await),
                    }
                };
                let Some(next) = next else {
                    // Cancelled after its first poll.
                    cancelled.fetch_add(1, Ordering::Relaxed);
                    tokio::task::yield_now().await;
                    continue;
                };
                match next {
                    Some(x) => got.push(x),
                    None => break (got, rx.stats()),
                }
            }
        }));
    }
    drop(rx);
    let mut accepted = HashSet::new();
    for p in producers {
        accepted.extend(p.await.unwrap());
    }
    let mut received = Vec::new();
    let mut stats = None;
    for c in consumers {
        let (got, s) = c.await.unwrap();
        received.extend(got);
        stats = Some(s);
    }
    let stats = stats.unwrap();
    let dropped = dropped.lock().unwrap().clone();
    let mut seen = HashSet::new();
    for x in received.iter().chain(&dropped) {
        assert!(seen.insert(*x), "item {x} delivered or dropped twice");
    }
    assert_eq!(seen, accepted, "every accepted item is received or dropped");
    // The channel's own counts agree: sent == received + dropped, exactly.
    assert_eq!(stats.sent, accepted.len() as u64);
    assert_eq!(stats.received, received.len() as u64);
    assert_eq!(stats.dropped, dropped.len() as u64);
    assert_eq!(stats.sent, stats.received + stats.dropped);
    if !overflow.drops() {
        assert!(dropped.is_empty());
    }
    assert!(
        accepted.len() < (PRODUCERS * PER_PRODUCER) as usize || overflow.drops() || capacity > 8,
        "some sends were cancelled"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_backpressure_with_cancellation() {
    stress(Overflow::Backpressure, 8).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_drop_oldest_with_cancellation() {
    stress(Overflow::DropOldest, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_with_receiver_batches() {
    // Capacity 64: receivers take batches of up to 32.
    stress(Overflow::Backpressure, 64).await;
    stress(Overflow::DropOldest, 64).await;
}

#[tokio::test]
async fn a_receiver_batch_keeps_its_slots_until_handed_out_and_goes_back_on_drop() {
    let (tx, mut rx) = channel::bounded(4).unwrap();
    let mut rx2 = rx.clone(); // two receivers: each takes at most half of what is queued
    for i in 0..4 {
        tx.try_send(i).unwrap();
    }
    assert_eq!(rx.recv().await, Some(0)); // took 0 and 1; 1 still holds its slot
    assert_eq!(tx.try_send(4), Ok(Sent::Queued), "the slot of 0 is free");
    assert_eq!(
        tx.try_send(5),
        Err(SendError::Full(5)),
        "1 still holds its slot"
    );
    drop(rx); // 1 goes back to the front of the queue
    assert_eq!(rx2.recv().await, Some(1)); // the only receiver now: takes 1 to 4
    assert_eq!(rx2.recv().await, Some(2));
    let stats = rx2.stats();
    assert_eq!(
        (stats.received, rx2.len()),
        (3, 2),
        "0, 1 and 2 handed out, counted once each; 3 and 4 still in the batch"
    );
    drop(tx);
    let mut rest = Vec::new();
    while let Some(x) = rx2.recv().await {
        rest.push(x);
    }
    assert_eq!(rest, [3, 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_drop_newest_with_cancellation() {
    stress(Overflow::DropNewest, 4).await;
}

#[cfg(feature = "metrics")]
#[tokio::test]
async fn metrics_count_by_name_and_policy() {
    let recorder = support::TestRecorder::default();
    let (tx, mut rx) = metrics::with_local_recorder(&recorder, || {
        channel::builder(2)
            .overflow(Overflow::DropOldest)
            .name("stage-a")
            .build()
            .unwrap()
    });
    for i in 0..5u32 {
        tx.send(i).await.unwrap();
    }
    assert_eq!(rx.recv().await, Some(3));
    let id = |m: &str| format!("{m}{{name=stage-a}}");
    assert_eq!(recorder.counter(&id("flowgate_channel_sent_total")), 5);
    assert_eq!(recorder.counter(&id("flowgate_channel_received_total")), 1);
    assert_eq!(recorder.gauge(&id("flowgate_channel_depth")), Some(1.0));
    assert_eq!(
        recorder.counter("flowgate_channel_dropped_total{name=stage-a,policy=drop_oldest}"),
        3
    );
    // A lone receiver takes a batch; only what it hands out counts as received.
    let (tx2, mut rx2) = metrics::with_local_recorder(&recorder, || {
        channel::builder(64).name("stage-b").build().unwrap()
    });
    for i in 0..8u32 {
        tx2.try_send(i).unwrap();
    }
    assert_eq!(rx2.recv().await, Some(0));
    assert_eq!(rx2.recv().await, Some(1));
    drop(rx2); // gives back 2..8, then drops them as the last receiver
    assert_eq!(
        recorder.counter("flowgate_channel_received_total{name=stage-b}"),
        2
    );
    assert_eq!(tx2.stats().received, 2);
    drop(rx); // the last receiver: the buffered item is dropped, labelled `closed`
    assert_eq!(
        recorder.counter("flowgate_channel_dropped_total{name=stage-a,policy=closed}"),
        1
    );
    assert_eq!(recorder.gauge(&id("flowgate_channel_depth")), Some(0.0));
}

/// The depth gauge on the lock-free path: sampled every 16 items (at every sixteenth of
/// larger capacities), never by a send into an empty channel, exact once the channel is
/// full and on every receive. Regression: with a capacity of 16 every send updated it,
/// two cache lines all senders fought over (a third of an MPSC send's cost).
#[cfg(feature = "metrics")]
#[tokio::test]
async fn the_depth_gauge_is_sampled_every_16_sends_and_exact_when_full() {
    let recorder = support::TestRecorder::default();
    let (tx, mut rx) = metrics::with_local_recorder(&recorder, || {
        channel::builder(64).name("sampled").build().unwrap()
    });
    let depth = || recorder.gauge("flowgate_channel_depth{name=sampled}");
    for i in 0..16u32 {
        tx.try_send(i).unwrap();
    }
    assert_eq!(depth(), Some(0.0), "no sample before the 17th item");
    tx.try_send(16).unwrap();
    assert_eq!(depth(), Some(17.0), "sampled at 16 occupied");
    for i in 17..64u32 {
        tx.try_send(i).unwrap();
    }
    assert_eq!(depth(), Some(49.0), "the last sample, at 48 occupied");
    assert!(tx.try_send(64).is_err());
    assert_eq!(
        depth(),
        Some(64.0),
        "a send that finds it full sets it exactly"
    );
    assert_eq!(rx.recv().await, Some(0));
    assert!(depth().unwrap() <= 63.0, "a receive sets it: {:?}", depth());
}

#[tokio::test]
async fn with_several_receivers_none_sits_on_items_another_is_idle_for() {
    let (tx, mut r1) = channel::bounded::<u32>(64).unwrap();
    let mut r2 = r1.clone();
    for i in 0..8 {
        tx.try_send(i).unwrap();
    }
    // r1 takes at most its share (half) of the queue into its batch.
    assert_eq!(r1.recv().await, Some(0));
    // 1..4 in r1's batch, 4..8 queued: all of them still buffered.
    assert_eq!(r1.len(), 7);
    let mut got = Vec::new();
    while let Ok(x) = r2.try_recv() {
        got.push(x);
    }
    assert_eq!(got, [4, 5, 6, 7], "the rest is there for the idle receiver");
}

#[tokio::test]
async fn a_receiver_never_sees_the_end_while_another_holds_items_of_a_batch() {
    let (tx, mut r1) = channel::bounded::<u32>(16).unwrap();
    tx.try_send(0).unwrap();
    tx.try_send(1).unwrap();
    drop(tx);
    assert_eq!(r1.recv().await, Some(0)); // alone: takes both, holds 1
    let mut r2 = r1.clone();
    assert!(poll!(r2.recv()).is_pending(), "1 may still come back");
    drop(r1); // gives 1 back
    assert_eq!(r2.recv().await, Some(1));
    assert_eq!(r2.recv().await, None);
    // A batch used up ends the stream for the others too.
    let (tx, mut r1) = channel::bounded::<u32>(16).unwrap();
    tx.try_send(0).unwrap();
    tx.try_send(1).unwrap();
    drop(tx);
    assert_eq!(r1.recv().await, Some(0));
    let mut r2 = r1.clone();
    let mut end = Box::pin(r2.recv());
    assert!(poll!(end.as_mut()).is_pending());
    assert_eq!(r1.recv().await, Some(1));
    assert_eq!(end.await, None, "woken when the batch was used up");
}

/// A waker that counts its wakes.
fn counting_waker() -> (std::task::Waker, Arc<AtomicU64>) {
    struct Count(Arc<AtomicU64>);
    impl std::task::Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let n = Arc::new(AtomicU64::new(0));
    (Arc::new(Count(n.clone())).into(), n)
}

/// The module docs: "Receivers waiting in `recv` or `recv_many` are woken in FIFO order,
/// one per item".
#[test]
fn waiting_recv_futures_are_woken_fifo_one_per_item() {
    let (tx, mut a) = channel::bounded::<u32>(4).unwrap();
    let mut b = a.clone();
    let mut c = a.clone();
    let (wa, na) = counting_waker();
    let (wb, nb) = counting_waker();
    let (wc, nc) = counting_waker();
    let mut buf = Vec::new();
    let mut fa = Box::pin(a.recv());
    let mut fb = Box::pin(b.recv_many(&mut buf, 4));
    let mut fc = Box::pin(c.recv());
    use std::future::Future;
    use std::task::Context;
    assert!(fa.as_mut().poll(&mut Context::from_waker(&wa)).is_pending());
    assert!(fb.as_mut().poll(&mut Context::from_waker(&wb)).is_pending());
    assert!(fc.as_mut().poll(&mut Context::from_waker(&wc)).is_pending());
    tx.try_send(1).unwrap();
    let woken = |n: &Arc<AtomicU64>| n.load(Ordering::SeqCst);
    assert_eq!(
        (woken(&na), woken(&nb), woken(&nc)),
        (1, 0, 0),
        "the first waiter only"
    );
    tx.try_send(2).unwrap();
    assert_eq!(
        (woken(&na), woken(&nb), woken(&nc)),
        (1, 1, 0),
        "then the second"
    );
    tx.try_send(3).unwrap();
    assert_eq!(
        (woken(&na), woken(&nb), woken(&nc)),
        (1, 1, 1),
        "then the third"
    );
}

/// `Stats::sent`: "Items handed back in a [`SendError`] are not counted", and
/// `sent == received + dropped + len()` at any moment.
#[tokio::test]
async fn items_handed_back_are_not_counted_as_sent() {
    let (tx, mut rx) = channel::builder(1)
        .overflow(Overflow::Reject)
        .build()
        .unwrap();
    tx.try_send(1u32).unwrap();
    assert_eq!(tx.try_send(2), Err(SendError::Full(2)));
    assert_eq!(tx.send(3).await, Err(SendError::Full(3)));
    let s = tx.stats();
    assert_eq!((s.sent, s.received, s.dropped, tx.len()), (1, 0, 0, 1));
    rx.close();
    assert_eq!(tx.try_send(4), Err(SendError::Closed(4)));
    assert_eq!(rx.recv().await, Some(1));
    let s = tx.stats();
    assert_eq!((s.sent, s.received, s.dropped, tx.len()), (1, 1, 0, 0));
}

/// `Sender::reserve`: "Reservations wait for a free slot under every policy (they never drop
/// an item)"; `ReserveError::Full` comes only from `try_reserve`.
#[tokio::test]
async fn reserve_waits_for_a_slot_under_every_policy() {
    for policy in [
        Overflow::Backpressure,
        Overflow::Reject,
        Overflow::DropNewest,
        Overflow::DropOldest,
    ] {
        let (tx, mut rx) = channel::builder(1).overflow(policy).build().unwrap();
        tx.try_send(1u32).unwrap();
        assert_eq!(
            tx.try_reserve().unwrap_err(),
            ReserveError::Full,
            "{policy}"
        );
        let mut reserve = pin!(tx.reserve());
        assert!(poll!(reserve.as_mut()).is_pending(), "{policy}");
        assert_eq!(rx.recv().await, Some(1));
        let permit = reserve.await.unwrap();
        permit.send(2);
        assert_eq!(rx.recv().await, Some(2), "{policy}");
        assert_eq!(tx.stats().dropped, 0, "{policy}");
    }
}

/// `Sender::closed`: "Wait until the channel is closed (by `close()` or because every
/// receiver is gone)": the `close()` half.
#[tokio::test]
async fn closed_resolves_when_any_handle_closes_the_channel() {
    let (tx, rx) = channel::bounded::<u8>(1).unwrap();
    let tx2 = tx.clone();
    let mut closed = pin!(tx.closed());
    assert_eq!(poll!(closed.as_mut()), Poll::Pending);
    rx.close();
    closed.await;
    let mut closed = pin!(tx2.closed());
    assert_eq!(poll!(closed.as_mut()), Poll::Ready(()));
}

/// `Sender`'s docs: a `poll_ready` left waiting (a `feed` future dropped) keeps this handle's
/// place, and the slot it is then given, until `poll_ready` is called again; this handle's
/// own `try_send` does not use that slot, nor does any other sender; dropping the handle
/// gives it back.
#[tokio::test]
async fn a_sink_slot_granted_to_an_abandoned_poll_ready_waits_for_its_handle() {
    let (mut tx, mut rx) = channel::bounded::<u32>(1).unwrap();
    let tx2 = tx.clone();
    tx2.try_send(0).unwrap();
    {
        let mut feed = pin!(SinkExt::feed(&mut tx, 1));
        assert!(poll!(feed.as_mut()).is_pending());
    }
    assert_eq!(rx.recv().await, Some(0)); // the freed slot goes to tx's sink wait
    assert_eq!(tx2.try_send(9), Err(SendError::Full(9)), "another sender");
    assert_eq!(
        tx.try_send(9),
        Err(SendError::Full(9)),
        "this handle's try_send"
    );
    SinkExt::send(&mut tx, 1).await.unwrap();
    assert_eq!(rx.recv().await, Some(1));
    // Once more, and this time the handle is dropped: the slot comes back.
    tx2.try_send(2).unwrap();
    {
        let mut feed = pin!(SinkExt::feed(&mut tx, 3));
        assert!(poll!(feed.as_mut()).is_pending());
    }
    assert_eq!(rx.recv().await, Some(2));
    assert_eq!(tx2.try_send(9), Err(SendError::Full(9)));
    drop(tx);
    assert_eq!(tx2.try_send(4), Ok(Sent::Queued));
    assert_eq!(rx.recv().await, Some(4));
}

/// The module's "Shutdown": "When every Receiver is gone, sends fail and hand the item
/// back" — under every policy, a full buffer included (a drop policy must not report
/// the item dropped, nor a reservation succeed).
#[tokio::test]
async fn with_every_receiver_gone_sends_hand_the_item_back_under_every_policy() {
    for policy in [
        Overflow::Backpressure,
        Overflow::Reject,
        Overflow::DropNewest,
        Overflow::DropOldest,
    ] {
        for fill in [0, 1] {
            let (mut tx, rx) = channel::builder(1).overflow(policy).build().unwrap();
            for i in 0..fill {
                tx.try_send(i).unwrap();
            }
            drop(rx);
            assert_eq!(tx.try_send(7), Err(SendError::Closed(7)), "{policy} {fill}");
            assert_eq!(
                tx.send(8).await,
                Err(SendError::Closed(8)),
                "{policy} {fill}"
            );
            assert_eq!(tx.reserve().await.unwrap_err(), ReserveError::Closed);
            assert_eq!(tx.try_reserve().unwrap_err(), ReserveError::Closed);
            assert_eq!(SinkExt::send(&mut tx, 9).await, Err(SendError::Closed(9)));
            let s = tx.stats();
            assert_eq!((s.sent, s.dropped), (fill, fill), "{policy} {fill}");
        }
    }
}

/// The same for a `Sink` whose `poll_ready` reserved its slot before the last receiver
/// went: `start_send` hands the item back in `Closed` (as a send that finds the receivers
/// gone does) and gives the slot up, rather than accepting it and passing it straight to
/// `on_drop` as a permit's send must.
#[tokio::test]
async fn a_sink_reservation_made_before_the_receivers_went_hands_the_item_back() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let seen = log.clone();
    let (mut tx, rx) = channel::builder::<u32>(2)
        .on_drop(move |item, why: &Dropped| seen.lock().unwrap().push((item, why.as_str())))
        .build()
        .unwrap();
    futures::future::poll_fn(|cx| tx.poll_ready_unpin(cx))
        .await
        .unwrap();
    drop(rx);
    assert_eq!(tx.start_send_unpin(1), Err(SendError::Closed(1)));
    assert!(log.lock().unwrap().is_empty(), "{:?}", log.lock().unwrap());
    let s = tx.stats();
    assert_eq!((s.sent, s.dropped), (0, 0));
    // Nothing is reserved any more, and the handle fails as every send does.
    assert_eq!(SinkExt::send(&mut tx, 2).await, Err(SendError::Closed(2)));
}
