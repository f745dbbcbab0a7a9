//! User code that panics in the steps a demand primitive takes after its lock: a metrics
//! recorder or a waker. Each step must run even if one before it panics, or a gauge reads
//! wrong for good (a count lost) or a task waits for ever (a wake lost).

use std::future::Future;
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Wake, Waker};

use flowgate::FlowStreamExt;
use flowgate::demand::{CommitTracker, Demanded, Flow, Watermarks};
use futures::stream::Iter;
use futures::{FutureExt, StreamExt};

use super::levels;
use super::support::{TestRecorder, panicking_waker};

/// Whether it was woken.
#[derive(Default)]
struct Flag(AtomicBool);

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl Flag {
    fn woken(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Poll `fut` once with `waker`; whether it is pending.
fn pending<F: Future + ?Sized>(fut: Pin<&mut F>, waker: &Waker) -> bool {
    fut.poll(&mut Context::from_waker(waker)).is_pending()
}

/// Watermarks over `0..10` at levels `(1, 0)`, named `w`, recording into `recorder`.
fn named_watermarks(recorder: &TestRecorder) -> Watermarks<Iter<Range<i32>>> {
    metrics::with_local_recorder(recorder, || {
        Watermarks::builder(futures::stream::iter(0..10), levels(1, 0))
            .name("w")
            .build()
            .unwrap()
    })
}

/// Whether `f` panicked.
fn panics(f: impl FnOnce()) -> bool {
    catch_unwind(AssertUnwindSafe(f)).is_err()
}

/// `CommitToken::abandon` counts the offset given up, then moves
/// `flowgate_demand_commit_pending`: a recorder that panics on the count (user code) skipped
/// the gauge, which then read the offset pending for good.
#[test]
fn a_recorder_panicking_on_the_abandoned_count_still_moves_the_pending_gauge() {
    let recorder = TestRecorder::default();
    let tracker = metrics::with_local_recorder(&recorder, || {
        CommitTracker::builder().name("p0").build().unwrap()
    });
    let token = tracker.track(10).unwrap();
    let abandoned = "flowgate_demand_commit_abandoned_total{name=p0}";
    recorder.panic_once_on(abandoned);
    assert!(panics(|| token.abandon()));
    assert!(recorder.panicked_once(abandoned));
    assert_eq!((tracker.pending(), tracker.abandoned()), (0, 1));
    assert_eq!(
        recorder.gauge("flowgate_demand_commit_pending{name=p0}"),
        Some(0.0),
        "the gauge follows the tracker"
    );
}

/// The tracker wakes `until_ready` before it records its metrics: a waker that panics (user
/// code) skipped the count of the offset given up and the move of the pending gauge.
#[tokio::test]
async fn a_panicking_until_ready_waker_still_counts_the_offset_given_up() {
    let recorder = TestRecorder::default();
    let tracker = metrics::with_local_recorder(&recorder, || {
        CommitTracker::builder()
            .max_pending(1)
            .name("p0")
            .build()
            .unwrap()
    });
    let token = tracker.track(10).unwrap();
    let mut ready = pin!(tracker.until_ready());
    let waker = panicking_waker();
    assert!(pending(ready.as_mut(), &waker));
    assert!(panics(|| token.abandon()), "the waker's panic goes on");
    assert_eq!((tracker.pending(), tracker.abandoned()), (0, 1));
    assert_eq!(
        recorder.counter("flowgate_demand_commit_abandoned_total{name=p0}"),
        1
    );
    assert_eq!(
        recorder.gauge("flowgate_demand_commit_pending{name=p0}"),
        Some(0.0)
    );
}

/// The room a finished offset makes wakes every task in `until_ready`: one whose waker
/// panics (user code) kept the ones after it from being woken (tokio's `Notify` drops the
/// rest of its wakers unwoken), and they waited for ever with room to track.
#[test]
fn a_panicking_until_ready_waker_does_not_keep_the_others_waiting() {
    let tracker = CommitTracker::builder().max_pending(1).build().unwrap();
    let token = tracker.track(10).unwrap();
    let mut first = pin!(tracker.until_ready());
    let mut second = pin!(tracker.until_ready());
    let panicking = panicking_waker();
    let flag = Arc::new(Flag::default());
    let waker = Waker::from(flag.clone());
    assert!(pending(first.as_mut(), &panicking));
    assert!(pending(second.as_mut(), &waker));
    assert!(panics(|| token.done()), "the waker's panic goes on");
    assert!(flag.woken(), "the second waiter is woken for the room");
    assert!(!pending(second.as_mut(), &waker), "the room is there");
}

/// A ticket dropped moves `flowgate_demand_in_flight` and then, when the state flipped,
/// `flowgate_demand_paused`: a recorder that panics on the first (user code) skipped the
/// second, which then read paused while the signal said resumed.
#[tokio::test]
async fn a_recorder_panicking_on_the_in_flight_gauge_still_moves_the_paused_gauge() {
    let recorder = TestRecorder::default();
    let mut stream = named_watermarks(&recorder);
    let signal = stream.pause_signal();
    let (_, ticket) = stream.next().await.unwrap();
    assert!(signal.is_paused());
    recorder.panic_once_on("flowgate_demand_in_flight{name=w}");
    assert!(panics(|| drop(ticket)));
    assert!(recorder.panicked_once("flowgate_demand_in_flight{name=w}"));
    assert_eq!(signal.get(), Flow::Resumed);
    assert_eq!(
        recorder.gauge("flowgate_demand_paused{name=w}"),
        Some(0.0),
        "the paused gauge follows the signal"
    );
}

/// A ticket dropped at `high` wakes the wrapper, then moves the gauges: a wrapper's waker
/// that panics (user code) skipped both, which then read one item in flight and paused for
/// good, with nothing in flight.
#[tokio::test]
async fn a_panicking_wrapper_waker_still_moves_the_gauges() {
    let recorder = TestRecorder::default();
    let mut stream = named_watermarks(&recorder);
    let (_, ticket) = stream.next().await.unwrap();
    let waker = panicking_waker();
    assert!(
        pending(pin!(stream.next()), &waker),
        "the wrapper waits at high"
    );
    assert!(panics(|| drop(ticket)), "the waker's panic goes on");
    assert_eq!(stream.in_flight(), 0);
    assert_eq!(
        (
            recorder.gauge("flowgate_demand_in_flight{name=w}"),
            recorder.gauge("flowgate_demand_paused{name=w}")
        ),
        (Some(0.0), Some(0.0))
    );
}

/// A ticket dropped at `high` sends the resume to the `PauseSignal`s, then wakes the
/// wrapper: a signal waiter's waker that panics (user code) as the resume is sent kept the
/// wrapper from being woken, and it waited for ever with room to pull.
#[tokio::test]
async fn a_panicking_signal_waker_still_wakes_the_wrapper() {
    let mut stream = futures::stream::iter(0..10).watermarks(levels(1, 0));
    let (_, ticket) = stream.next().await.unwrap();
    let mut signal = stream.pause_signal();
    assert_eq!(signal.get(), Flow::Paused);
    let mut changed = pin!(signal.changed());
    let panicking = panicking_waker();
    assert!(pending(changed.as_mut(), &panicking));
    let wrapper = Arc::new(Flag::default());
    let waker = Waker::from(wrapper.clone());
    assert!(
        pending(pin!(stream.next()), &waker),
        "the wrapper waits at high"
    );
    assert!(panics(|| drop(ticket)), "the waker's panic goes on");
    assert!(wrapper.woken(), "the wrapper is woken to pull again");
    assert_eq!(stream.next().await.map(|(i, _)| i), Some(1));
}

/// A change of state wakes every task waiting in `PauseSignal::changed`: one whose waker
/// panics (user code) kept the ones behind it from being woken (a tokio `watch` stops at
/// the first waker that panics, and drops the rest unwoken), and they waited for ever
/// with a change to see. Many waiters, so that some are behind the panicking one whatever
/// the order they are woken in.
#[tokio::test]
async fn a_panicking_signal_waker_does_not_keep_the_other_signals_waiting() {
    let mut stream = futures::stream::iter(0..10).watermarks(levels(1, 0));
    let mut first = stream.pause_signal();
    let mut first_changed = pin!(first.changed());
    let panicking = panicking_waker();
    assert!(pending(first_changed.as_mut(), &panicking));
    let mut others: Vec<_> = (0..64).map(|_| stream.pause_signal()).collect();
    let mut waiting: Vec<_> = others.iter_mut().map(|s| Box::pin(s.changed())).collect();
    let flags: Vec<_> = (0..64).map(|_| Arc::new(Flag::default())).collect();
    for (changed, flag) in waiting.iter_mut().zip(&flags) {
        let waker = Waker::from(flag.clone());
        assert!(pending(changed.as_mut(), &waker));
    }
    assert!(
        panics(|| drop(stream.next().now_or_never())),
        "the waker's panic goes on"
    );
    let unwoken = flags.iter().filter(|f| !f.woken()).count();
    assert_eq!(unwoken, 0, "every other waiter is woken");
    for changed in waiting {
        assert!(changed.now_or_never().is_some(), "each sees a change");
    }
}

/// An item going out at `high` sends the pause to the `PauseSignal`s, then moves the
/// gauges: a signal waiter's waker that panics (user code) as the pause is sent skipped
/// them, and the ticket the panic dropped took its item back from the in-flight gauge, which
/// then read -1 (and the paused gauge -1) for good.
#[tokio::test]
async fn a_panicking_signal_waker_as_an_item_goes_out_leaves_the_gauges_right() {
    let recorder = TestRecorder::default();
    let mut stream = named_watermarks(&recorder);
    let mut signal = stream.pause_signal();
    let mut changed = pin!(signal.changed());
    let panicking = panicking_waker();
    assert!(pending(changed.as_mut(), &panicking));
    assert!(
        panics(|| drop(stream.next().now_or_never())),
        "the waker's panic goes on"
    );
    assert_eq!(stream.in_flight(), 0, "the ticket the panic dropped");
    assert_eq!(
        (
            recorder.gauge("flowgate_demand_in_flight{name=w}"),
            recorder.gauge("flowgate_demand_paused{name=w}")
        ),
        (Some(0.0), Some(0.0))
    );
    let (first, _ticket) = stream.next().await.unwrap();
    assert_eq!(first, 0, "0 was not lost");
}

/// A request that gives a stream waiting for credit some wakes it, then moves
/// `flowgate_demand_outstanding`: a stream's waker that panics (user code) skipped the
/// gauge, which then read the credit short by the request for good.
#[tokio::test]
async fn a_panicking_stream_waker_still_counts_the_credit_requested() {
    let recorder = TestRecorder::default();
    let (mut stream, demand) = metrics::with_local_recorder(&recorder, || {
        Demanded::builder(futures::stream::iter(0..10), 0)
            .name("d")
            .build()
            .unwrap()
    });
    let waker = panicking_waker();
    assert!(pending(pin!(stream.next()), &waker), "no credit");
    assert!(
        panics(|| demand.request(3).unwrap()),
        "the waker's panic goes on"
    );
    assert_eq!(demand.outstanding(), 3);
    assert_eq!(
        recorder.gauge("flowgate_demand_outstanding{name=d}"),
        Some(3.0)
    );
}
