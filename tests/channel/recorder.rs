//! A metrics recorder is user code, like a hook or a waker: one that panics must leave the
//! channel consistent and usable (as its docs promise of any panic). The panic reaches the
//! caller; the slots, the wakes and the counts must not depend on the recorder returning.
//! And one that reads the channel (an exporter taking a snapshot) must not deadlock: no
//! metric is recorded under the channel's lock.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::task::Poll;

use flowgate::Overflow;
use flowgate::channel::{self, Receiver, Sender, Sent};
use futures::executor::block_on;
use futures::{FutureExt, poll};

use super::support::TestRecorder;
use super::wakers::{counting, poll_with, watchdog};

const RECEIVED: &str = "flowgate_channel_received_total{name=panicky}";
const SENT: &str = "flowgate_channel_sent_total{name=panicky}";

/// A channel named `panicky` of `capacity` items, recording into `recorder`.
fn panicky(recorder: &TestRecorder, capacity: usize) -> (Sender<u32>, Receiver<u32>) {
    metrics::with_local_recorder(recorder, || {
        channel::builder(capacity).name("panicky").build().unwrap()
    })
}

/// Run `f` while every change to the metric `id` panics; says whether `f` panicked.
fn panicking<R>(recorder: &TestRecorder, id: &str, f: impl FnOnce() -> R) -> bool {
    recorder.panic_on(id, true);
    let unwound = catch_unwind(AssertUnwindSafe(f)).is_err();
    recorder.panic_on(id, false);
    unwound
}

/// The slot a receive frees is freed before the receive is recorded: the sender waiting
/// for it gets it. (It stayed occupied for ever: the sender waited for ever.)
#[tokio::test]
async fn a_recorder_panicking_on_a_receive_still_frees_its_slot() {
    let recorder = TestRecorder::default();
    let (tx, mut rx) = panicky(&recorder, 1);
    tx.try_send(1).unwrap();
    let mut send = pin!(tx.send(2));
    assert!(poll!(send.as_mut()).is_pending(), "full");
    assert!(panicking(&recorder, RECEIVED, || rx.try_recv()));
    assert_eq!(
        poll!(send.as_mut()),
        Poll::Ready(Ok(Sent::Queued)),
        "the freed slot went to the waiting sender"
    );
    assert_eq!(rx.try_recv(), Ok(1), "kept for the next receive");
    assert_eq!(rx.try_recv(), Ok(2));
    assert_eq!(tx.try_send(3), Ok(Sent::Queued));
}

/// A receiver that takes a batch knows the slots it holds before the receive is recorded:
/// handing the batch out frees them all. (They were never freed: the channel lost them.)
#[tokio::test]
async fn a_recorder_panicking_on_a_batch_leaves_its_slots_to_be_freed() {
    let recorder = TestRecorder::default();
    let (tx, mut rx) = panicky(&recorder, 4);
    for i in 0..4 {
        tx.try_send(i).unwrap();
    }
    // The lone receiver takes all four: 0 is handed out (kept when the panic comes), 1..4
    // are held.
    assert!(panicking(&recorder, RECEIVED, || rx.recv().now_or_never()));
    for i in 0..4 {
        assert_eq!(rx.recv().await, Some(i));
    }
    for i in 4..8 {
        assert_eq!(tx.try_send(i), Ok(Sent::Queued), "every slot is free again");
    }
    assert_eq!(tx.len(), 4);
}

/// The receiver waiting for an item is woken before the push is recorded. (It was never
/// woken: with no further send it waited for ever, the item in the channel.)
#[test]
fn a_recorder_panicking_on_a_send_still_wakes_the_waiting_receiver() {
    let recorder = TestRecorder::default();
    let (tx, mut rx) = panicky(&recorder, 4);
    let (waker, state) = counting();
    let mut recv = pin!(rx.recv());
    assert!(poll_with(recv.as_mut(), &waker).is_pending());
    assert!(panicking(&recorder, SENT, || tx.try_send(1)));
    assert_eq!(
        state.wakes.load(Ordering::SeqCst),
        1,
        "the receiver is woken"
    );
    assert_eq!(poll_with(recv.as_mut(), &waker), Poll::Ready(Some(1)));
}

/// An item sent through a permit after the last receiver went is discarded and counted
/// before the push is recorded. (It stayed in the channel: never counted as dropped,
/// `len()` 1 with no receiver left, dropped unseen with the channel.)
#[test]
fn a_recorder_panicking_on_a_permit_send_after_the_receivers_still_discards_it() {
    let recorder = TestRecorder::default();
    let (tx, rx) = panicky(&recorder, 2);
    let permit = tx.try_reserve().unwrap();
    drop(rx);
    assert!(panicking(&recorder, SENT, || permit.send(7)));
    assert_eq!((tx.len(), tx.stats().dropped), (0, 1), "discarded, counted");
    assert_eq!(
        recorder.counter("flowgate_channel_dropped_total{name=panicky,policy=closed}"),
        1
    );
}

/// A recorder that reads the channels' `len()` and `stats()` whenever a gauge moves, as an
/// exporter taking a snapshot does: both take the channel's lock. The depth gauge was set
/// under that lock by a send that found the channel full, one that waited or was let in,
/// every receive that took the lock, and a receiver dropped with part of a batch; and the
/// counters were counted there too. So the first of them deadlocked.
#[test]
fn a_recorder_that_reads_the_channel_does_not_deadlock() {
    let recorder = TestRecorder::default();
    let build = |name: &str, overflow| {
        metrics::with_local_recorder(&recorder, || {
            channel::builder(4)
                .overflow(overflow)
                .name(name)
                .build()
                .unwrap()
        })
    };
    let (tx, mut rx) = build("snapshots", Overflow::Backpressure);
    let (oldest, mut oldest_rx) = build("oldest", Overflow::DropOldest);
    let read: Arc<Mutex<Vec<Sender<u32>>>> = Arc::new(Mutex::new(vec![tx.clone(), oldest.clone()]));
    let exporter = read.clone();
    recorder.on_gauge(move || {
        for tx in &*exporter.lock().unwrap() {
            let _ = (tx.len(), tx.stats());
        }
    });
    // The comments say where each step moves the depth gauge (it calls the recorder only
    // when it moves).
    watchdog("a recorder reading the channel", move || {
        for i in 0..4 {
            assert_eq!(tx.try_send(i), Ok(Sent::Queued));
        }
        // Full: 4.
        assert!(tx.try_send(4).unwrap_err().is_full());
        // A receive: 3.
        assert_eq!(rx.try_recv(), Ok(0));
        assert_eq!(tx.try_send(4), Ok(Sent::Queued));
        // A send waits: 4.
        let mut send = Box::pin(tx.send(5));
        let (waker, _) = counting();
        assert!(poll_with(send.as_mut(), &waker).is_pending());
        // A batch of 1 to 4, 1 handed out, its slot granted to the send: 3.
        assert_eq!(block_on(rx.recv()), Some(1));
        // The send is let in: 4.
        let sent = poll_with(send.as_mut(), &waker);
        assert_eq!(sent, Poll::Ready(Ok(Sent::Queued)));
        assert_eq!(block_on(rx.recv()), Some(2));
        // Dropped with 3 and 4 of its batch, which go back: 3.
        let mut rx2 = rx.clone();
        drop(rx);
        // 0.
        let mut buf = Vec::new();
        assert_eq!(block_on(rx2.recv_many(&mut buf, 8)), 3);
        assert_eq!(buf, [3, 4, 5]);
        // Full, the oldest dropped: 4 (of the other channel).
        for i in 0..5 {
            assert!(oldest.try_send(i).unwrap().is_queued());
        }
        assert_eq!(oldest_rx.try_recv(), Ok(1));
        // 2 to 4 discarded.
        drop(oldest_rx);
    });
    // Dropped outside the exporter's lock: the last one takes the gauges back.
    drop(std::mem::take(&mut *read.lock().unwrap()));
    let id = |metric: &str, name: &str| format!("flowgate_channel_{metric}{{name={name}}}");
    assert_eq!(recorder.gauge(&id("depth", "snapshots")), Some(0.0));
    assert_eq!(recorder.counter(&id("sent_total", "snapshots")), 6);
    assert_eq!(recorder.counter(&id("received_total", "snapshots")), 6);
    assert_eq!(recorder.counter(&id("sent_total", "oldest")), 5);
    assert_eq!(recorder.counter(&id("received_total", "oldest")), 1);
    let dropped = |policy: &str| {
        recorder.counter(&format!(
            "flowgate_channel_dropped_total{{name=oldest,policy={policy}}}"
        ))
    };
    assert_eq!((dropped("drop_oldest"), dropped("closed")), (1, 3));
}

/// What a channel's `on_drop` hook saw: each item with its reason.
type Seen = Arc<Mutex<Vec<(u32, &'static str)>>>;

/// A channel named `panicky` of `capacity` items under `overflow`, recording into
/// `recorder`, whose `on_drop` hook logs every item it is handed.
fn hooked(
    recorder: &TestRecorder,
    capacity: usize,
    overflow: Overflow,
) -> (Sender<u32>, Receiver<u32>, Seen) {
    let seen = Seen::default();
    let log = seen.clone();
    let (tx, rx) = metrics::with_local_recorder(recorder, || {
        channel::builder(capacity)
            .overflow(overflow)
            .on_drop(move |item, why| log.lock().unwrap().push((item, why.as_str())))
            .name("panicky")
            .build()
            .unwrap()
    });
    (tx, rx, seen)
}

/// An item the channel drops is counted in `Stats::dropped` before the hook sees it, so
/// that a hook that panics leaves no item uncounted; the metrics are recorded in between.
/// A recorder that panics there (on any of the metrics a drop records) must not keep the
/// item from the hook: counted, it was dropped unseen, under `DropNewest`, under
/// `DropOldest`, by the last receiver's drop, and by a permit's send after it. The panic
/// still reaches the caller, once the item is with the hook.
#[test]
fn a_recorder_panicking_on_a_drop_still_hands_the_item_to_the_hook() {
    let recorder = TestRecorder::default();
    let dropped =
        |policy: &str| format!("flowgate_channel_dropped_total{{name=panicky,policy={policy}}}");
    const DEPTH: &str = "flowgate_channel_depth{name=panicky}";
    // A full channel of one item, 1 in it, sent 2: the item dropped, and the one kept.
    let (newest, oldest) = (dropped("drop_newest"), dropped("drop_oldest"));
    let policies = [
        (Overflow::DropNewest, vec![SENT, &newest], (2, "newest"), 1),
        (
            Overflow::DropOldest,
            vec![SENT, DEPTH, &oldest],
            (1, "oldest"),
            2,
        ),
    ];
    for (overflow, ids, lost, kept) in policies {
        for id in ids {
            let (tx, mut rx, seen) = hooked(&recorder, 1, overflow);
            tx.try_send(1).unwrap();
            assert!(panicking(&recorder, id, || tx.try_send(2)), "{id}");
            assert_eq!(*seen.lock().unwrap(), [lost], "{id}: to the hook");
            assert_eq!(tx.stats().dropped, 1, "{id}");
            assert_eq!(rx.try_recv(), Ok(kept), "{id}");
            assert_eq!(tx.try_send(3), Ok(Sent::Queued), "{id}: usable");
        }
    }
    let closed = dropped("closed");
    for id in [DEPTH, closed.as_str()] {
        let (tx, mut rx, seen) = hooked(&recorder, 4, Overflow::Backpressure);
        for i in 0..4 {
            tx.try_send(i).unwrap();
        }
        // A receive sets the depth gauge (3), which the drop sets to 0.
        assert_eq!(rx.try_recv(), Ok(0), "{id}");
        assert!(panicking(&recorder, id, move || drop(rx)), "{id}");
        let discarded = [(1, "discarded"), (2, "discarded"), (3, "discarded")];
        assert_eq!(*seen.lock().unwrap(), discarded, "{id}: to the hook");
        assert_eq!((tx.len(), tx.stats().dropped), (0, 3), "{id}");
    }
    for id in [SENT, closed.as_str()] {
        let (tx, rx, seen) = hooked(&recorder, 2, Overflow::Backpressure);
        let permit = tx.try_reserve().unwrap();
        drop(rx);
        assert!(panicking(&recorder, id, || permit.send(7)), "{id}");
        assert_eq!(
            *seen.lock().unwrap(),
            [(7, "discarded")],
            "{id}: to the hook"
        );
        assert_eq!((tx.len(), tx.stats().dropped), (0, 1), "{id}");
    }
}

/// A receive whose recording panics (user code) keeps the item it was handing out, which
/// the receiver's next receive hands out, whichever receive it was: one that takes a batch,
/// the last of a batch (its slots are freed and recorded), a `try_recv` of one item. A
/// receiver dropped before it hands the item out passes it to `on_drop`, counted as
/// dropped, also while other receivers remain. (The item was dropped with the panic,
/// counted as received.)
#[test]
fn a_recorder_panicking_on_a_receive_loses_no_item() {
    let recorder = TestRecorder::default();
    let log = Arc::new(Mutex::new(Vec::new()));
    let hook_log = log.clone();
    let (tx, mut rx) = metrics::with_local_recorder(&recorder, || {
        channel::builder(4)
            .name("panicky")
            .on_drop(move |x: u32, why: &flowgate::Dropped| {
                hook_log.lock().unwrap().push((x, why.as_str()))
            })
            .build()
            .unwrap()
    });
    for i in 0..3 {
        tx.try_send(i).unwrap();
    }
    // The lone receiver takes all three: 0 to hand out, 1 and 2 held.
    assert!(panicking(&recorder, RECEIVED, || block_on(rx.recv())));
    assert_eq!(block_on(rx.recv()), Some(0), "kept for the next receive");
    assert_eq!(rx.try_recv(), Ok(1));
    // The last of the batch: its slots are freed (and recorded) as it goes.
    assert!(panicking(&recorder, RECEIVED, || rx.try_recv()));
    assert_eq!(rx.try_recv(), Ok(2), "kept for the next receive");
    // One item, `try_recv` with no batch.
    tx.try_send(3).unwrap();
    assert!(panicking(&recorder, RECEIVED, || rx.try_recv()));
    assert_eq!(rx.len(), 1, "still to hand out");
    assert_eq!(rx.try_recv(), Ok(3), "kept for the next receive");
    let stats = tx.stats();
    assert_eq!((stats.sent, stats.received, stats.dropped), (4, 4, 0));
    // Dropped with such an item, while another receiver remains, then the last.
    let mut other = rx.clone();
    for i in 4..6 {
        tx.try_send(i).unwrap();
    }
    assert!(panicking(&recorder, RECEIVED, || rx.try_recv()));
    drop(rx);
    assert_eq!(*log.lock().unwrap(), [(4, "discarded")]);
    assert_eq!(other.try_recv(), Ok(5));
    assert!(panicking(&recorder, RECEIVED, || {
        tx.try_send(6).unwrap();
        other.try_recv()
    }));
    drop(other);
    assert_eq!(*log.lock().unwrap(), [(4, "discarded"), (6, "discarded")]);
    let stats = tx.stats();
    assert_eq!(
        (stats.sent, stats.received, stats.dropped, tx.len()),
        (7, 5, 2, 0)
    );
    assert_eq!(tx.try_send(7), Err(channel::SendError::Closed(7)));
}

/// Run `f` with the next change to the metric `id` panicking (that change records
/// nothing); says whether `f` panicked, once the panic came.
fn panicking_once<R>(recorder: &TestRecorder, id: &str, f: impl FnOnce() -> R) -> bool {
    recorder.panic_once_on(id);
    let unwound = catch_unwind(AssertUnwindSafe(f)).is_err();
    assert!(recorder.panicked_once(id), "{id}: the panic came");
    unwound
}

/// An operation that records several metrics records its counts even if the recorder
/// panics on another metric (user code): a skipped count is lost for good. (A receive
/// counts before it sets the depth gauge, rather than catch each step's panic on its hot
/// path.) One panic each, on the first of the metrics an operation records, or a receive's
/// depth, and the rest are there: a sampled send's depth, a receive's count,
/// `DropNewest`'s and `DropOldest`'s drops, and the send of an item discarded because the
/// receivers are gone.
#[test]
fn a_recorder_panicking_on_one_metric_still_records_the_others() {
    const DEPTH: &str = "flowgate_channel_depth{name=panicky}";
    let dropped =
        |policy: &str| format!("flowgate_channel_dropped_total{{name=panicky,policy={policy}}}");

    // The 17th send samples the depth gauge, after counting the send.
    let recorder = TestRecorder::default();
    let (tx, _rx) = panicky(&recorder, 32);
    for i in 0..16 {
        tx.try_send(i).unwrap();
    }
    assert!(panicking_once(&recorder, SENT, || tx.try_send(16)));
    assert_eq!(recorder.gauge(DEPTH), Some(17.0), "a sampled send's depth");

    // A receive counts the item, then sets the depth gauge: a panic on the gauge leaves
    // the count. (A send that finds the channel full sets the gauge to 1 first, so that the
    // receive moves it.)
    let recorder = TestRecorder::default();
    let (tx, mut rx) = panicky(&recorder, 1);
    tx.try_send(1).unwrap();
    assert!(tx.try_send(2).unwrap_err().is_full());
    assert!(panicking_once(&recorder, DEPTH, || rx.try_recv()));
    assert_eq!(rx.try_recv(), Ok(1));
    assert_eq!(recorder.counter(RECEIVED), 1, "a receive's count");

    // The drops count the send, then the drop.
    for (overflow, policy) in [
        (Overflow::DropNewest, "drop_newest"),
        (Overflow::DropOldest, "drop_oldest"),
    ] {
        let recorder = TestRecorder::default();
        let (tx, _rx, seen) = hooked(&recorder, 1, overflow);
        tx.try_send(1).unwrap();
        assert!(panicking_once(&recorder, SENT, || tx.try_send(2)));
        assert_eq!(seen.lock().unwrap().len(), 1, "{policy}");
        assert_eq!(recorder.counter(&dropped(policy)), 1, "{policy}'s count");
    }

    // A send after the receivers went counts the discard, then the send.
    let recorder = TestRecorder::default();
    let (tx, rx) = panicky(&recorder, 2);
    let permit = tx.try_reserve().unwrap();
    drop(rx);
    assert!(panicking_once(&recorder, &dropped("closed"), || permit.send(7)));
    assert_eq!(recorder.counter(SENT), 1, "the discarded item's send");
}

/// A receiver that uses up its batch frees the batch's slots (granted to a waiting sender,
/// whose waker is woken), then records the depth and the items received: a sender's waker
/// that panics (user code) skipped both, and the batch's items were never counted.
#[test]
fn a_panicking_sender_waker_still_counts_the_batch_used_up() {
    let recorder = TestRecorder::default();
    let (tx, mut rx) = panicky(&recorder, 2);
    for i in 0..2 {
        tx.try_send(i).unwrap();
    }
    // A batch of both: 0 handed out, 1 held; 2 takes the freed slot.
    assert_eq!(block_on(rx.recv()), Some(0));
    tx.try_send(2).unwrap();
    let mut send = pin!(tx.send(3));
    let waker = super::support::panicking_waker();
    assert!(poll_with(send.as_mut(), &waker).is_pending(), "full");
    assert!(catch_unwind(AssertUnwindSafe(|| rx.try_recv())).is_err());
    assert_eq!(rx.try_recv(), Ok(1), "kept for the next receive");
    assert_eq!(recorder.counter(RECEIVED), 2, "0 and 1");
    assert_eq!(
        recorder.gauge("flowgate_channel_depth{name=panicky}"),
        Some(1.0)
    );
}
