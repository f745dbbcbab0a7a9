//! Receiver batches: `len()` / `is_empty()` count them, `DropOldest` drops the oldest item
//! not yet handed to a consumer (a model-based property test), and a receiver's
//! `size_hint` counts only what it will get.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use flowgate::channel::{self, Permit, ReserveError, Sent};
use flowgate::{Dropped, Overflow};
use futures::{FutureExt, Stream, StreamExt};
use proptest::prelude::*;

/// tokio's `test_rx_len_when_consuming_all_messages`: from capacity 16 up a receiver takes
/// batches, and `len()` must still count what it has not handed out.
#[tokio::test]
async fn len_counts_items_in_receiver_batches() {
    let (tx, mut rx) = channel::bounded(100).unwrap();
    for i in 0..100 {
        tx.send(i).await.unwrap();
        assert_eq!(rx.len(), i + 1);
    }
    drop(tx);
    for i in (0..100).rev() {
        assert!(rx.recv().await.is_some());
        assert_eq!(rx.len(), i);
        assert_eq!(rx.is_empty(), i == 0);
    }

    // The reproduction: two sends, one recv.
    let (tx, mut rx) = channel::bounded::<u32>(16).unwrap();
    tx.try_send(1).unwrap();
    tx.try_send(2).unwrap();
    assert_eq!(rx.recv().await, Some(1));
    assert!(!rx.is_empty(), "2 is in the receiver's batch");
    assert_eq!((rx.len(), tx.len()), (1, 1));
    assert_eq!(rx.try_recv(), Ok(2));
    assert!(rx.is_empty() && tx.is_empty());

    // A batch given back by a dropped receiver, or drained by recv_many, stays counted once.
    for i in 0..8 {
        tx.try_send(i).unwrap();
    }
    let mut rx2 = rx.clone();
    assert_eq!(rx2.recv().await, Some(0)); // its half of the 8: 1, 2 and 3 are held
    assert_eq!(tx.len(), 7);
    drop(rx2);
    assert_eq!(tx.len(), 7);
    assert_eq!(rx.recv().await, Some(1)); // the only receiver now: takes 1 to 7
    let mut buf = Vec::new();
    assert_eq!(rx.recv_many(&mut buf, 3).await, 3, "from the batch first");
    assert_eq!(tx.len(), 3);
    assert_eq!(rx.recv_many(&mut buf, 8).await, 3, "the rest of the batch");
    assert_eq!(buf, [2, 3, 4, 5, 6, 7]);
    assert!(tx.is_empty());
}

/// The reproduction: capacity 16 (batches of up to 16 under the other policies).
#[tokio::test]
async fn drop_oldest_drops_the_oldest_item_not_yet_handed_out() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let hook_log = log.clone();
    let (tx, mut rx) = channel::builder::<u32>(16)
        .overflow(Overflow::DropOldest)
        .on_drop(move |x, why: &Dropped| hook_log.lock().unwrap().push((x, why.as_str())))
        .build()
        .unwrap();
    for i in 0..16 {
        tx.try_send(i).unwrap();
    }
    assert_eq!(rx.recv().await, Some(0));
    assert_eq!(tx.try_send(16), Ok(Sent::Queued));
    assert_eq!(tx.try_send(17), Ok(Sent::DroppedOldest));
    let dropped = log.lock().unwrap().clone();
    assert_eq!(dropped, [(1, "oldest")], "1 was the oldest not handed out");
    assert_eq!(rx.recv().await, Some(2));
}

/// `size_hint`'s lower bound is what this receiver will get for sure: its own batch, and
/// the queue only while no other receiver can take from it.
#[tokio::test]
async fn size_hint_does_not_count_items_cloned_receivers_will_take() {
    let (tx, mut rx) = channel::bounded::<u32>(16).unwrap(); // a receiver of two takes at most half the queue
    for i in 0..4 {
        tx.try_send(i).unwrap();
    }
    assert_eq!(rx.size_hint(), (4, None), "the only receiver");
    let mut rx2 = rx.clone();
    assert_eq!(rx.size_hint(), (0, None), "rx2 may take all of it");
    let mut taken = 0;
    while rx2.try_recv().is_ok() {
        taken += 1;
    }
    assert_eq!((taken, rx.len()), (4, 0), "and it did");

    for i in 0..4 {
        tx.try_send(i).unwrap();
    }
    assert_eq!(rx.next().await, Some(0)); // its share: a batch of 2, 1 is held
    assert_eq!(rx.size_hint(), (1, None), "its own batch");
    assert_eq!(rx2.size_hint(), (0, None));
    drop(rx2);
    assert_eq!(rx.size_hint(), (3, None), "alone again: batch + queue");
    drop(tx);
    assert_eq!(rx.by_ref().count().await, 3);
    assert_eq!(rx.size_hint(), (0, Some(0)));
}

/// One step of the model test.
#[derive(Debug, Clone)]
enum Op {
    Send,
    /// `recv()` on receiver `i` (modulo the receivers alive), polled once.
    Recv(usize),
    /// The receiver as a `Stream`, polled once.
    Next(usize),
    TryRecv(usize),
    RecvMany(usize, usize),
    Reserve,
    PermitSend,
    PermitDrop,
    Clone(usize),
    DropReceiver(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => Just(Op::Send),
        2 => (0..4usize).prop_map(Op::Recv),
        2 => (0..4usize).prop_map(Op::Next),
        1 => (0..4usize).prop_map(Op::TryRecv),
        1 => (0..4usize, 1..6usize).prop_map(|(i, n)| Op::RecvMany(i, n)),
        1 => Just(Op::Reserve),
        1 => Just(Op::PermitSend),
        1 => Just(Op::PermitDrop),
        1 => (0..4usize).prop_map(Op::Clone),
        1 => (0..4usize).prop_map(Op::DropReceiver),
    ]
}

/// The reference: items not yet handed to a consumer, oldest first, and what was dropped.
#[derive(Default)]
struct Model {
    queue: VecDeque<u32>,
    reserved: usize,
    sent: u64,
    received: u64,
    dropped_oldest: Vec<u32>,
    dropped_newest: u64,
    /// Every item dropped, in order, with its reason: what the `on_drop` hook must have seen.
    hook: Vec<(u32, &'static str)>,
}

impl Model {
    fn send(&mut self, cap: usize, item: u32) -> Sent {
        self.sent += 1;
        if self.queue.len() + self.reserved < cap {
            self.queue.push_back(item);
            Sent::Queued
        } else if let Some(oldest) = self.queue.pop_front() {
            self.dropped_oldest.push(oldest);
            self.hook.push((oldest, "oldest"));
            self.queue.push_back(item);
            Sent::DroppedOldest
        } else {
            self.dropped_newest += 1;
            self.hook.push((item, "newest"));
            Sent::DroppedNewest
        }
    }

    /// A consumer got `got`; it must be the oldest item not yet handed out.
    fn handed_out(&mut self, got: Option<u32>) -> Result<(), TestCaseError> {
        prop_assert_eq!(got, self.queue.pop_front(), "handed out in order");
        if got.is_some() {
            self.received += 1;
        }
        Ok(())
    }
}

fn run_model(cap: usize, ops: Vec<Op>) -> Result<(), TestCaseError> {
    #[cfg(feature = "metrics")]
    let recorder = crate::support::TestRecorder::default();
    let hook = Arc::new(Mutex::new(Vec::new()));
    let hook_log = hook.clone();
    let build = || {
        channel::builder::<u32>(cap)
            .overflow(Overflow::DropOldest)
            .on_drop(move |x, why: &Dropped| hook_log.lock().unwrap().push((x, why.as_str())))
            .name("model")
            .build()
            .unwrap()
    };
    #[cfg(feature = "metrics")]
    let (tx, rx) = metrics::with_local_recorder(&recorder, build);
    #[cfg(not(feature = "metrics"))]
    let (tx, rx) = build();

    let mut m = Model::default();
    let mut rxs = vec![rx];
    let mut permits: VecDeque<Permit<'_, u32>> = VecDeque::new();
    let mut next = 0u32;
    for op in ops {
        let n = rxs.len();
        match op {
            Op::Send => {
                prop_assert_eq!(tx.try_send(next), Ok(m.send(cap, next)));
                next += 1;
            }
            Op::Recv(i) => m.handed_out(rxs[i % n].recv().now_or_never().flatten())?,
            Op::Next(i) => m.handed_out(rxs[i % n].next().now_or_never().flatten())?,
            Op::TryRecv(i) => m.handed_out(rxs[i % n].try_recv().ok())?,
            Op::RecvMany(i, limit) => {
                let mut buf = Vec::new();
                let got = rxs[i % n].recv_many(&mut buf, limit).now_or_never();
                prop_assert_eq!(got.unwrap_or(0), buf.len());
                prop_assert_eq!(buf.len(), limit.min(m.queue.len()), "takes what is there");
                for x in buf {
                    m.handed_out(Some(x))?;
                }
            }
            Op::Reserve => match tx.try_reserve() {
                Ok(p) => {
                    prop_assert!(m.queue.len() + m.reserved < cap, "reserved a free slot");
                    m.reserved += 1;
                    permits.push_back(p);
                }
                Err(e) => {
                    prop_assert_eq!(e, ReserveError::Full);
                    prop_assert_eq!(m.queue.len() + m.reserved, cap, "full");
                }
            },
            Op::PermitSend => {
                if let Some(p) = permits.pop_front() {
                    p.send(next);
                    m.reserved -= 1;
                    m.sent += 1;
                    m.queue.push_back(next);
                    next += 1;
                }
            }
            Op::PermitDrop => {
                if permits.pop_front().is_some() {
                    m.reserved -= 1;
                }
            }
            Op::Clone(i) if n < 4 => rxs.push(rxs[i % n].clone()),
            Op::DropReceiver(i) if n > 1 => drop(rxs.remove(i % n)),
            Op::Clone(_) | Op::DropReceiver(_) => {}
        }
        // After every step: the counts, the hook and the metrics agree with the model.
        prop_assert_eq!(tx.len(), m.queue.len(), "len counts what is not handed out");
        let s = tx.stats();
        let dropped = m.dropped_oldest.len() as u64 + m.dropped_newest;
        prop_assert_eq!(
            (s.sent, s.received, s.dropped),
            (m.sent, m.received, dropped)
        );
        prop_assert_eq!(
            &*hook.lock().unwrap(),
            &m.hook,
            "every drop reaches on_drop"
        );
        #[cfg(feature = "metrics")]
        {
            let id = |policy: &str| {
                format!("flowgate_channel_dropped_total{{name=model,policy={policy}}}")
            };
            prop_assert_eq!(
                recorder.counter(&id("drop_oldest")),
                m.dropped_oldest.len() as u64
            );
            prop_assert_eq!(recorder.counter(&id("drop_newest")), m.dropped_newest);
        }
    }
    // The end: what is left is dropped with the last receiver, and all adds up.
    drop(permits);
    drop(rxs);
    let s = tx.stats();
    prop_assert_eq!(s.sent, s.received + s.dropped);
    let mut all_dropped = m.hook.clone();
    all_dropped.extend(m.queue.iter().map(|&x| (x, "discarded")));
    prop_assert_eq!(&*hook.lock().unwrap(), &all_dropped);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random sends, receives (as future, stream, `try_recv`, `recv_many`), permits and
    /// receivers cloned and dropped, against a `VecDeque` of the items not yet handed out:
    /// every drop of the oldest takes the oldest of those, and every dropped item reaches the hook,
    /// `Stats::dropped` and the `drop_oldest` counter. Capacities from 16 up are where
    /// receivers take batches under the other policies.
    #[test]
    fn drop_oldest_matches_the_model(cap in 1usize..48, ops in proptest::collection::vec(op(), 1..80)) {
        run_model(cap, ops)?;
    }
}

/// `Stats`' docs: "at any moment `sent == received + dropped + len()`". A receiver's batch
/// is counted by `len()` (not handed out yet), so it must not be counted as received too.
#[tokio::test]
async fn stats_add_up_with_len_while_a_receiver_holds_a_batch() {
    let (tx, mut rx) = channel::bounded::<u32>(16).unwrap();
    for i in 0..5 {
        tx.try_send(i).unwrap();
    }
    assert_eq!(rx.recv().await, Some(0)); // 1 to 4 are in its batch
    let s = tx.stats();
    assert_eq!(tx.len(), 4);
    assert_eq!(s.sent, 5);
    assert_eq!(
        s.sent,
        s.received + s.dropped + tx.len() as u64,
        "{s:?} with len {}",
        tx.len()
    );
    assert_eq!(s.received, 1, "only one item was handed out");
    assert_eq!(rx.try_recv(), Ok(1));
    let s = tx.stats();
    assert_eq!((s.sent, s.received, tx.len()), (5, 2, 3));
}

/// "Items are delivered in FIFO order": items that receivers dropped with part of a batch
/// give back return to their place in the queue, whichever receiver is dropped first, and
/// a batch taken from what was given back does not run past an item another receiver
/// still holds.
#[tokio::test]
async fn items_given_back_by_dropped_receivers_keep_their_order() {
    // Three receivers: each takes at most a third of what is queued.
    let (tx, mut a) = channel::bounded::<u32>(8).unwrap();
    let mut b = a.clone();
    let mut c = a.clone();
    for i in 0..8 {
        tx.try_send(i).unwrap();
    }
    assert_eq!(a.recv().await, Some(0)); // 1 is in a's batch
    assert_eq!(b.recv().await, Some(2)); // 3 is in b's batch
    drop(a); // 1 goes back first
    drop(b); // then 3, which is newer
    drop(tx);
    let rest: Vec<u32> = c.by_ref().collect().await;
    assert_eq!(rest, [1, 3, 4, 5, 6, 7]);

    // Four receivers; a receiver taking from what a dropped one gave back stops at an item
    // a third one still holds.
    let (tx, mut a) = channel::bounded::<u32>(16).unwrap();
    let (mut b, mut c, mut d) = (a.clone(), a.clone(), a.clone());
    for i in 0..16 {
        tx.try_send(i).unwrap();
    }
    assert_eq!(a.recv().await, Some(0)); // 1, 2 and 3 are in a's batch
    assert_eq!(b.recv().await, Some(4)); // 5 and 6 in b's
    drop(a);
    assert_eq!(c.recv().await, Some(1)); // 2 and 3; not 7: 5 and 6 come first
    drop(b);
    drop(c);
    drop(tx);
    let rest: Vec<u32> = d.by_ref().collect().await;
    assert_eq!(rest, [2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]);
}

/// `poll_recv`'s docs: a receiver's share is of what is queued, divided among the receivers;
/// the items another receiver holds in its batch are not queued, and do not make the share
/// larger.
#[tokio::test]
async fn a_share_is_of_what_is_queued_not_of_what_other_batches_hold() {
    let (tx, mut a) = channel::bounded::<u32>(16).unwrap();
    let mut b = a.clone();
    for i in 0..8 {
        tx.try_send(i).unwrap();
    }
    assert_eq!(
        a.recv().await,
        Some(0),
        "a takes 0 to 3: half of the 8 queued"
    );
    assert_eq!(a.len(), 7, "1 to 3 in a's batch, 4 to 7 queued");
    assert_eq!(
        b.recv().await,
        Some(4),
        "b takes half of the 4 queued: 4 and 5"
    );
    let from_a: Vec<u32> = std::iter::from_fn(|| a.try_recv().ok()).collect();
    assert_eq!(
        from_a,
        [1, 2, 3, 6, 7],
        "5 is in b's batch; 6 was left queued"
    );
    assert_eq!(b.try_recv(), Ok(5));
}
