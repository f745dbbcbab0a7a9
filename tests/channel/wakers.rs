//! Wakers and the channel lock: a waker whose drop uses the channel (it owns a permit or a
//! sender) must be dropped after the lock is released, on every path that gives a waker up
//! (tokio's `dropping_rx_drops_sender_wakers_outside_lock`); and a receiver polled as a
//! `Stream` that stops polling must not sit on the only wake while another receiver idles.
//!
//! The reproductions run on their own thread under a watchdog, so a deadlock fails the test
//! instead of hanging it.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use flowgate::channel::{self, OwnedPermit, Sender};
use futures::{FutureExt, Stream};

/// Run `body` on its own thread; fail (instead of hanging) if it has not finished in 10 s.
pub(super) fn watchdog(what: &'static str, body: impl FnOnce() + Send + 'static) {
    let (done, finished) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        body();
        let _ = done.send(());
    });
    match finished.recv_timeout(Duration::from_secs(10)) {
        Ok(()) | Err(RecvTimeoutError::Disconnected) => {
            if let Err(panic) = thread.join() {
                std::panic::resume_unwind(panic);
            }
        }
        Err(RecvTimeoutError::Timeout) => {
            panic!("{what}: deadlocked (user code run under the channel lock)")
        }
    }
}

/// A waker that counts its wakes and runs `on_drop` when its last clone is dropped.
#[derive(Default)]
pub(super) struct TestWaker {
    pub(super) wakes: AtomicU64,
    on_drop: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl Wake for TestWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.wakes.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for TestWaker {
    fn drop(&mut self) {
        let hook = self.on_drop.get_mut().unwrap().take();
        if let Some(hook) = hook {
            hook();
        }
    }
}

/// A waker whose drop runs `f` (which uses the channel).
fn reentrant(f: impl FnOnce() + Send + 'static) -> Waker {
    Waker::from(Arc::new(TestWaker {
        wakes: AtomicU64::new(0),
        on_drop: Mutex::new(Some(Box::new(f))),
    }))
}

/// A waker that only counts, and its counter.
pub(super) fn counting() -> (Waker, Arc<TestWaker>) {
    let state = Arc::new(TestWaker::default());
    (Waker::from(state.clone()), state)
}

pub(super) fn poll_with<F: Future + ?Sized>(fut: Pin<&mut F>, waker: &Waker) -> Poll<F::Output> {
    fut.poll(&mut Context::from_waker(waker))
}

/// Poll a receiver as a `Stream`.
fn poll_next_with(rx: &mut channel::Receiver<u32>, waker: &Waker) -> Poll<Option<u32>> {
    Pin::new(rx).poll_next(&mut Context::from_waker(waker))
}

/// A permit for one slot of `tx`'s channel.
fn permit(tx: &Sender<u32>) -> OwnedPermit<u32> {
    tx.clone().reserve_owned().now_or_never().unwrap().unwrap()
}

/// A full `bounded(1)` channel: the only slot is held by the returned permit.
fn full_by_permit() -> (Sender<u32>, channel::Receiver<u32>, OwnedPermit<u32>) {
    let (tx, rx) = channel::bounded::<u32>(1).unwrap();
    let permit = permit(&tx);
    (tx, rx, permit)
}

/// Poll `fut` (it must wait) with a waker whose drop runs `on_drop`, and drop our clone:
/// the channel's wait queue holds the last one.
fn wait_with_reentrant<F: Future + ?Sized>(
    fut: Pin<&mut F>,
    on_drop: impl FnOnce() + Send + 'static,
) {
    let waker = reentrant(on_drop);
    assert!(poll_with(fut, &waker).is_pending());
}

/// Poll `fut` again with another waker (it must still wait): the first waker is replaced,
/// and dropped. Returns the new waker and how often it was woken by then.
fn repoll<F: Future + ?Sized>(fut: Pin<&mut F>) -> (Waker, u64) {
    let (other, state) = counting();
    assert!(poll_with(fut, &other).is_pending());
    (other, state.wakes.load(Ordering::SeqCst))
}

/// Cancelled: the reserve future leaves the queue and drops the last clone of its waker.
#[test]
fn a_waker_dropped_by_a_cancelled_reserve_may_release_a_permit() {
    watchdog("reserve cancelled", || {
        let (tx, mut rx, permit) = full_by_permit();
        let mut reserve = Box::pin(tx.reserve());
        wait_with_reentrant(reserve.as_mut(), move || drop(permit));
        drop(reserve);
        assert!(tx.try_send(1).is_ok(), "the permit's slot came back");
        assert_eq!(rx.try_recv(), Ok(1));
    });
}

/// Polled again with another waker: the first one is replaced (and dropped).
#[test]
fn a_waker_replaced_by_reserve_may_release_a_permit() {
    watchdog("reserve re-polled", || {
        let (tx, mut rx, permit) = full_by_permit();
        let mut reserve = Box::pin(tx.reserve());
        wait_with_reentrant(reserve.as_mut(), move || drop(permit));
        let (other, wakes) = repoll(reserve.as_mut());
        assert_eq!(
            wakes, 1,
            "the released slot was handed to the waiting reserve"
        );
        let Poll::Ready(Ok(permit)) = poll_with(reserve.as_mut(), &other) else {
            panic!("the reserve holds the slot");
        };
        permit.send(2);
        assert_eq!(rx.try_recv(), Ok(2));
    });
}

#[test]
fn a_waker_dropped_by_a_cancelled_send_may_release_a_permit() {
    watchdog("send cancelled", || {
        let (tx, mut rx, permit) = full_by_permit();
        let mut send = Box::pin(tx.send(1));
        wait_with_reentrant(send.as_mut(), move || drop(permit));
        drop(send);
        assert!(tx.try_send(3).is_ok());
        assert_eq!(rx.try_recv(), Ok(3));
    });
}

#[test]
fn a_waker_replaced_by_send_may_release_a_permit() {
    watchdog("send re-polled", || {
        let (tx, mut rx, permit) = full_by_permit();
        let mut send = Box::pin(tx.send(1));
        wait_with_reentrant(send.as_mut(), move || drop(permit));
        let (other, wakes) = repoll(send.as_mut());
        assert_eq!(wakes, 1, "the released slot was handed to the waiting send");
        assert!(matches!(
            poll_with(send.as_mut(), &other),
            Poll::Ready(Ok(_))
        ));
        assert_eq!(rx.try_recv(), Ok(1));
    });
}

#[test]
fn a_waker_dropped_by_a_cancelled_recv_may_send_through_a_permit() {
    watchdog("recv cancelled", || {
        let (tx, mut rx) = channel::bounded::<u32>(2).unwrap();
        let permit = permit(&tx);
        let mut recv = Box::pin(rx.recv());
        wait_with_reentrant(recv.as_mut(), move || drop(permit.send(7)));
        drop(recv);
        assert_eq!(rx.try_recv(), Ok(7));
    });
}

#[test]
fn a_waker_replaced_by_recv_may_send_through_a_permit() {
    watchdog("recv re-polled", || {
        let (tx, mut rx) = channel::bounded::<u32>(2).unwrap();
        let permit = permit(&tx);
        let mut recv = Box::pin(rx.recv());
        wait_with_reentrant(recv.as_mut(), move || drop(permit.send(7)));
        let (other, wakes) = repoll(recv.as_mut());
        assert_eq!(wakes, 1, "woken for the item");
        assert_eq!(poll_with(recv.as_mut(), &other), Poll::Ready(Some(7)));
    });
}

#[test]
fn a_waker_dropped_with_a_stream_receiver_may_send_and_drop_a_sender() {
    watchdog("stream receiver dropped", || {
        let (tx, mut rx) = channel::bounded::<u32>(2).unwrap();
        let mut rx2 = rx.clone();
        let tx2 = tx.clone();
        let waker = reentrant(move || {
            tx2.try_send(9).unwrap();
            drop(tx2);
        });
        assert!(poll_next_with(&mut rx2, &waker).is_pending());
        drop(waker);
        drop(rx2);
        assert_eq!(rx.try_recv(), Ok(9));
    });
}

#[test]
fn a_waker_dropped_or_replaced_by_closed_may_release_a_permit() {
    watchdog("closed re-polled", || {
        let (tx, _rx, permit) = full_by_permit();
        let mut closed = Box::pin(tx.closed());
        wait_with_reentrant(closed.as_mut(), move || drop(permit));
        repoll(closed.as_mut());
        assert!(tx.try_send(1).is_ok(), "the first waker was dropped");
    });
    watchdog("closed cancelled", || {
        let (tx, _rx, permit) = full_by_permit();
        let mut closed = Box::pin(tx.closed());
        wait_with_reentrant(closed.as_mut(), move || drop(permit));
        drop(closed);
        assert!(tx.try_send(1).is_ok());
    });
}

/// Two receivers used as streams, both waiting; one item comes. The receiver it wakes first
/// stops polling (as the ordered `bulkhead_map` does at its limit): the other one must be
/// woken too and get the item.
#[test]
fn a_stream_receiver_that_stops_polling_does_not_keep_the_wake() {
    let (tx, mut r1) = channel::bounded::<u32>(8).unwrap();
    let mut r2 = r1.clone();
    let (w1, s1) = counting();
    let (w2, s2) = counting();
    assert!(poll_next_with(&mut r1, &w1).is_pending());
    assert!(poll_next_with(&mut r2, &w2).is_pending());
    tx.try_send(1).unwrap();
    let woken = |s: &TestWaker| s.wakes.load(Ordering::SeqCst);
    assert_eq!(woken(&s1), 1);
    assert_eq!(woken(&s2), 1, "the idle stream is woken too");
    // r1 never polls again; r2 gets the item.
    assert_eq!(
        poll_next_with(&mut r2, &w2),
        Poll::Ready(Some(1)),
        "the item is there for r2"
    );
    // A woken stream that finds nothing waits again and is woken by the next item.
    assert!(poll_next_with(&mut r1, &w1).is_pending());
    tx.try_send(2).unwrap();
    assert_eq!(woken(&s1), 2);
    assert_eq!(poll_next_with(&mut r1, &w1), Poll::Ready(Some(2)));
    // `recv()` futures still wake one at a time (a dropped one passes the wake on).
    let mut f1 = Box::pin(r1.recv());
    let mut f2 = Box::pin(r2.recv());
    assert!(poll_with(f1.as_mut(), &w1).is_pending());
    assert!(poll_with(f2.as_mut(), &w2).is_pending());
    tx.try_send(3).unwrap();
    assert_eq!((woken(&s1), woken(&s2)), (3, 1));
    drop(f1);
    assert_eq!(woken(&s2), 2, "the dropped future passed its wake on");
    assert_eq!(poll_with(f2.as_mut(), &w2), Poll::Ready(Some(3)));
}

/// The same with tasks and paused time: one stream consumer stalls after its first poll
/// (holding its receiver), and the one item sent must still reach the other consumer.
#[tokio::test(start_paused = true)]
async fn a_stalled_stream_consumer_does_not_starve_another() {
    use futures::StreamExt;
    let (tx, r1) = channel::bounded::<u32>(8).unwrap();
    let mut r2 = r1.clone();
    let stalled = tokio::spawn(async move {
        let mut r1 = r1;
        // Poll once (registering), then stop polling, holding the receiver.
        assert!(futures::poll!(r1.next()).is_pending());
        std::future::pending::<()>().await;
    });
    tokio::task::yield_now().await;
    let consumer = tokio::spawn(async move { r2.next().await });
    tokio::task::yield_now().await;
    tx.send(7).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(60), consumer)
        .await
        .expect("the idle consumer was never woken")
        .unwrap();
    assert_eq!(got, Some(7));
    stalled.abort();
}

/// A `recv()` or `recv_many()` future dropped before its first poll registered nothing, so
/// it must leave alone the wait the receiver registered when polled as a `Stream` (or
/// through `poll_recv`): that task is still owed a wake for the next item.
#[test]
fn an_unpolled_recv_dropped_keeps_the_streams_wait() {
    let (tx, mut rx) = channel::bounded::<u32>(8).unwrap();
    let (w, s) = counting();
    assert!(poll_next_with(&mut rx, &w).is_pending());
    drop(rx.recv());
    let mut buf = Vec::new();
    drop(rx.recv_many(&mut buf, 4));
    tx.try_send(1).unwrap();
    assert_eq!(
        s.wakes.load(Ordering::SeqCst),
        1,
        "the stream's wait was lost"
    );
    assert_eq!(poll_next_with(&mut rx, &w), Poll::Ready(Some(1)));
}
