use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Wake, Waker};

use super::*;

/// A waker that counts its wakes.
struct Count(AtomicUsize);

impl Wake for Count {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn counting() -> (Arc<Count>, Waker) {
    let c = Arc::new(Count(AtomicUsize::new(0)));
    (c.clone(), Waker::from(c))
}

fn woken(c: &Count) -> usize {
    c.0.load(Ordering::SeqCst)
}

fn values<T: Copy>(list: &WaiterList<T>) -> Vec<T> {
    list.iter().map(|(_, v)| *v).collect()
}

#[test]
fn fifo_grant_and_claim() {
    let (c, w) = counting();
    let mut list = WaiterList::new();
    let keys: Vec<Key> = (0..4).map(|i| list.push_back(&w, i)).collect();
    assert_eq!(values(&list), [0, 1, 2, 3]);
    let mut out = Deferred::default();
    assert_eq!(list.grant_front(&mut out), Some(keys[0]));
    assert_eq!(list.status(keys[0]), Status::Granted);
    assert_eq!((list.len(), list.granted()), (3, 1));
    // Nothing is woken under the "lock": only when `out` goes.
    assert_eq!(woken(&c), 0);
    drop(out);
    assert_eq!(woken(&c), 1);
    assert_eq!(list.claim(keys[0]), Some(0));
    assert_eq!(list.status(keys[0]), Status::Gone);
    assert_eq!(list.claim(keys[0]), None);
    let mut out = Deferred::default();
    assert_eq!(list.wake_front(&mut out), Some((keys[1], 1)));
    assert_eq!(values(&list), [2, 3]);
    assert_eq!(list.front(), Some(keys[2]));
    assert_eq!(list.back(), Some(keys[3]));
    assert_eq!(list.prev(keys[3]), Some(keys[2]));
    assert_eq!(list.prev(keys[2]), None);
}

#[test]
fn cancel_anywhere_keeps_order() {
    let (_, w) = counting();
    let mut list = WaiterList::new();
    let keys: Vec<Key> = (0..5).map(|i| list.push_back(&w, i)).collect();
    let mut out = Deferred::default();
    assert_eq!(list.cancel(keys[2], &mut out), Cancelled::Waiting(2));
    assert_eq!(list.cancel(keys[0], &mut out), Cancelled::Waiting(0));
    assert_eq!(list.cancel(keys[4], &mut out), Cancelled::Waiting(4));
    assert_eq!(list.cancel(keys[4], &mut out), Cancelled::Gone);
    assert_eq!(
        (out.len(), out.to_wake()),
        (3, 0),
        "cancelled wakers are only dropped"
    );
    assert_eq!(values(&list), [1, 3]);
    assert_eq!(list.len(), 2);
    // The freed slots are reused; the stale keys still match nothing.
    let k = list.push_back(&w, 9);
    assert_eq!(values(&list), [1, 3, 9]);
    assert_ne!(k, keys[4]);
    for stale in [keys[0], keys[2], keys[4]] {
        assert_eq!(list.status(stale), Status::Gone);
        assert_eq!(list.cancel(stale, &mut out), Cancelled::Gone);
        assert!(!list.grant(stale, &mut out));
        assert_eq!(list.get(stale), None);
    }
    assert_eq!(values(&list), [1, 3, 9]);
    assert_eq!(list.entries.len(), 5, "bounded: slots are reused");
}

#[test]
fn cancel_passing_on_hands_the_wake_to_the_next() {
    let (a, wa) = counting();
    let (b, wb) = counting();
    let mut list = WaiterList::new();
    let ka = list.push_back(&wa, 'a');
    let kb = list.push_back(&wb, 'b');
    let mut out = Deferred::default();
    list.grant_front(&mut out);
    drop(out);
    assert_eq!((woken(&a), woken(&b)), (1, 0));
    // `a` was woken but gives up: `b` gets the grant.
    let mut out = Deferred::default();
    assert_eq!(
        list.cancel_passing_on(ka, &mut out),
        (Cancelled::Granted('a'), Some(kb))
    );
    drop(out);
    assert_eq!((woken(&a), woken(&b)), (1, 1));
    assert_eq!(list.status(kb), Status::Granted);
    // A waiting one that gives up passes nothing on.
    let (c, wc) = counting();
    let kc = list.push_back(&wc, 'c');
    let (_, wd) = counting();
    let kd = list.push_back(&wd, 'd');
    let mut out = Deferred::default();
    assert_eq!(
        list.cancel_passing_on(kc, &mut out),
        (Cancelled::Waiting('c'), None)
    );
    drop(out);
    assert_eq!(woken(&c), 0);
    assert_eq!(list.status(kd), Status::Waiting);
}

#[test]
fn register_refreshes_only_a_new_waker() {
    let (a, wa) = counting();
    let (b, wb) = counting();
    let mut list = WaiterList::new();
    let mut key = None;
    let mut out = Deferred::default();
    assert_eq!(
        list.register(&mut key, &wa, || 1, &mut out),
        Status::Waiting
    );
    assert_eq!(
        list.register(&mut key, &wa, || 2, &mut out),
        Status::Waiting
    );
    assert_eq!(out.len(), 0, "the same waker is kept, not cloned again");
    assert_eq!(
        list.register(&mut key, &wb, || 3, &mut out),
        Status::Waiting
    );
    assert_eq!(
        (out.len(), out.to_wake()),
        (1, 0),
        "the old waker is dropped later"
    );
    drop(out);
    assert_eq!(list.len(), 1);
    assert_eq!(list.get(key.unwrap()), Some(&1));
    let mut out = Deferred::default();
    list.grant_front(&mut out);
    drop(out);
    assert_eq!(
        (woken(&a), woken(&b)),
        (0, 1),
        "the refreshed waker is the one woken"
    );
    let mut out = Deferred::default();
    assert_eq!(
        list.register(&mut key, &wa, || 4, &mut out),
        Status::Granted
    );
    // Popped (gone): registering again queues anew at the back.
    let k = key.unwrap();
    assert_eq!(list.claim(k), Some(1));
    assert_eq!(
        list.register(&mut key, &wa, || 5, &mut out),
        Status::Waiting
    );
    assert_ne!(key, Some(k));
    assert_eq!(values(&list), [5]);
}

/// The waker of tokio's `block_on`, whose clones carry another vtable than itself (in
/// an optimized build, where its vtable, a constant, is inlined in several places): a
/// waiter polled again with it keeps its stored clone (nothing cloned under the lock,
/// nothing to drop after it), though `will_wake` between the two is false there;
/// another task's waker still replaces it.
#[test]
fn a_block_on_waker_polled_again_is_not_cloned_again() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut list = WaiterList::new();
    let mut key = None;
    let mut out = Deferred::default();
    let stored = rt.block_on(async {
        for _ in 0..4 {
            let status = std::future::poll_fn(|cx| {
                std::task::Poll::Ready(list.register(&mut key, cx.waker(), || (), &mut out))
            })
            .await;
            assert_eq!(status, Status::Waiting);
        }
        std::future::poll_fn(|cx| std::task::Poll::Ready(cx.waker().clone())).await
    });
    assert_eq!((list.len(), out.len()), (1, 0), "the stored waker is kept");
    // A clone of the stored one is the same task too (`will_wake`).
    list.register(&mut key, &stored, || (), &mut out);
    assert_eq!(out.len(), 0);
    let (other, w) = counting();
    list.register(&mut key, &w, || (), &mut out);
    assert_eq!(out.len(), 1, "another task's waker replaces it");
    list.wake_all(&mut out);
    drop(out);
    assert_eq!(woken(&other), 1);
}

#[test]
fn notify_wakes_and_keeps_the_place() {
    let (a, wa) = counting();
    let mut list = WaiterList::new();
    let k = list.push_back(&wa, ());
    let mut out = Deferred::default();
    assert!(list.notify(k, &mut out));
    drop(out);
    assert_eq!(woken(&a), 1);
    assert_eq!(list.status(k), Status::Waiting);
    let mut out = Deferred::default();
    list.wake_all(&mut out);
    assert_eq!(list.len(), 0);
    assert!(!list.notify(k, &mut out));
    drop(out);
    assert_eq!(woken(&a), 2);
}

/// Issue 20: cancelling one of 40,000 waiters is O(1). Cancelled from the back (the
/// worst case for a front-to-back scan), then in a scattered order: the slots visited
/// stay a small constant per cancel, so the total is linear.
#[test]
fn cancelling_40_000_waiters_is_linear() {
    const N: usize = 40_000;
    let (_, w) = counting();
    for order in ["back to front", "scattered"] {
        let mut list = WaiterList::new();
        let keys: Vec<Key> = (0..N).map(|i| list.push_back(&w, i)).collect();
        let mut order_keys = keys.clone();
        if order == "back to front" {
            order_keys.reverse();
        } else {
            // A fixed permutation: i * 7919 mod N (7919 is prime, coprime with N).
            order_keys = (0..N).map(|i| keys[i * 7919 % N]).collect();
        }
        let before = list.steps();
        let mut out = Deferred::default();
        for (i, k) in order_keys.into_iter().enumerate() {
            assert!(matches!(list.cancel(k, &mut out), Cancelled::Waiting(_)));
            if i % 64 == 0 {
                out = Deferred::default();
            }
        }
        let per_cancel = (list.steps() - before) as f64 / N as f64;
        assert!(list.is_empty());
        // A linear scan would visit N / 2 slots per cancel on average (20,000).
        assert!(
            per_cancel <= 8.0,
            "{order}: {per_cancel} slots visited per cancel"
        );
    }
}
