//! Demand signalling: credit, prefetch, watermarks and commits, against simple models.

mod support;

use std::collections::{BTreeSet, VecDeque};
use std::pin::{Pin, pin};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use flowgate::demand::{
    BatchSource, CommitToken, CommitTracker, DemandError, Flow, IterSource, StreamSource,
    UNBOUNDED, prefetch,
};
use flowgate::{ConfigErrorKind, FlowStreamExt};
use futures::{StreamExt, poll};
use proptest::prelude::*;
use tokio::time::advance;

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap()
        .block_on(f)
}

#[derive(Debug, Clone)]
enum Op {
    Request(u64),
    Pull,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![(1u64..5).prop_map(Op::Request), Just(Op::Pull)]
}

/// A source that records every `max` it is asked for, with the buffer at that moment.
struct Recording {
    next: u32,
    end: u32,
    /// Items handed to the consumer so far (shared with the test).
    consumed: Arc<Mutex<usize>>,
    fetched: usize,
    /// `(max, buffered, first poll of this fetch)`.
    asks: Arc<Mutex<Vec<(usize, usize, bool)>>>,
    pending_every: u32,
    /// The last poll returned `Pending`: complete this one.
    was_pending: bool,
    /// Return `max` items per fetch (else about half of it).
    full_batches: bool,
}

impl BatchSource for Recording {
    type Item = u32;
    type Error = ();

    fn poll_fetch(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        max: usize,
    ) -> Poll<Option<Result<Vec<u32>, ()>>> {
        let buffered = self.fetched - *self.consumed.lock().unwrap();
        let first = !self.was_pending;
        self.asks.lock().unwrap().push((max, buffered, first));
        if self.next >= self.end {
            return Poll::Ready(None);
        }
        if !self.was_pending && self.pending_every > 0 && self.next % self.pending_every == 1 {
            // Pretend to be slow once in a while: pending, then ready on the next poll.
            self.was_pending = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        self.was_pending = false;
        let part = if self.full_batches { max } else { max / 2 + 1 };
        let n = max.min((self.end - self.next) as usize).min(part);
        let batch: Vec<u32> = (self.next..self.next + n as u32).collect();
        self.next += n as u32;
        self.fetched += n;
        Poll::Ready(Some(Ok(batch)))
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn with_demand_never_yields_more_than_requested(
        initial in 0u64..4,
        ops in prop::collection::vec(op(), 1..100),
        available in 0usize..60,
    ) {
        block_on(async {
            let (mut stream, demand) = futures::stream::iter(0..available).with_demand(initial);
            let mut requested = initial;
            let mut yielded = 0u64;
            for op in ops {
                match op {
                    Op::Request(n) => {
                        demand.request(n).unwrap();
                        requested += n;
                    }
                    Op::Pull => {
                        if let Poll::Ready(Some(_)) = poll!(stream.next()) {
                            yielded += 1;
                        }
                    }
                }
                prop_assert!(yielded <= requested);
                prop_assert_eq!(demand.outstanding(), requested - yielded);
            }
            // Draining gives exactly min(requested, available).
            while let Poll::Ready(Some(_)) = poll!(stream.next()) {
                yielded += 1;
            }
            prop_assert_eq!(yielded, requested.min(available as u64));
            Ok(())
        })?;
    }

    #[test]
    fn prefetch_asks_for_exactly_high_minus_buffered(
        high in 1usize..20,
        low_frac in 0usize..100,
        end in 0u32..200,
        pending_every in 0u32..7,
        take_pauses in prop::collection::vec(0u8..3, 0..50),
    ) {
        let low = high * low_frac / 100 % high;
        let consumed = Arc::new(Mutex::new(0));
        let asks = Arc::new(Mutex::new(Vec::new()));
        let source = Recording {
            next: 0,
            end,
            consumed: consumed.clone(),
            fetched: 0,
            asks: asks.clone(),
            pending_every,
            was_pending: false,
            full_batches: false,
        };
        let out = block_on(async {
            let mut stream = pin!(prefetch(source, high, low).unwrap());
            let mut out = Vec::new();
            let mut pauses = take_pauses.into_iter();
            while let Some(item) = stream.next().await {
                out.push(item.unwrap());
                *consumed.lock().unwrap() += 1;
                prop_assert!(flowgate::demand::Prefetch::buffered(&stream) <= high);
                if pauses.next() == Some(0) {
                    tokio::task::yield_now().await;
                }
            }
            Ok(out)
        })?;
        prop_assert_eq!(out, (0..end).collect::<Vec<_>>());
        for &(max, buffered, first) in asks.lock().unwrap().iter() {
            // Never more than there is room for; exactly the room when the fetch starts
            // (while a fetch is in progress the consumer may drain more).
            prop_assert!(max <= high - buffered, "asked for {} with {} buffered", max, buffered);
            if first {
                prop_assert_eq!(max, high - buffered);
                prop_assert!(buffered <= low, "refilled above low");
            }
        }
    }

    #[test]
    fn commit_tracker_matches_a_model(
        gaps in prop::collection::vec(1u64..4, 1..60),
        order in prop::collection::vec(any::<prop::sample::Index>(), 0..60),
    ) {
        let tracker = CommitTracker::new();
        let mut offsets = Vec::new();
        let mut tokens = Vec::new();
        let mut offset = 0;
        for g in gaps {
            offset += g;
            offsets.push(offset);
            tokens.push(Some(tracker.track(offset).unwrap()));
        }
        let mut done = BTreeSet::new();
        for idx in order {
            let i = idx.index(tokens.len());
            if let Some(t) = tokens[i].take() {
                t.done();
                done.insert(offsets[i]);
            }
            // Model: the last offset of the longest all-done prefix.
            let model = offsets.iter().take_while(|o| done.contains(o)).last().copied();
            prop_assert_eq!(tracker.committable(), model);
        }
    }
}

/// A source that fails its first `failures` fetches, then yields `0..4` and fails once more,
/// then ends; it records the (paused) time of every fetch.
struct Flaky {
    failures: u32,
    served: bool,
    failed_after: bool,
    at: Arc<Mutex<Vec<Duration>>>,
    origin: tokio::time::Instant,
}

impl BatchSource for Flaky {
    type Item = u32;
    type Error = &'static str;

    fn poll_fetch(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        _max: usize,
    ) -> Poll<Option<Result<Vec<u32>, &'static str>>> {
        let elapsed = self.origin.elapsed();
        self.at.lock().unwrap().push(elapsed);
        if self.failures > 0 {
            self.failures -= 1;
            return Poll::Ready(Some(Err("down")));
        }
        if !self.served {
            self.served = true;
            return Poll::Ready(Some(Ok((0..4).collect())));
        }
        if !self.failed_after {
            self.failed_after = true;
            return Poll::Ready(Some(Err("down again")));
        }
        Poll::Ready(None)
    }
}

#[tokio::test]
async fn an_iter_source_ends_at_the_first_none() {
    // Yields 0, 1, 2, then None, then would start again: not fused.
    let mut n = 0u32;
    let restarting = std::iter::from_fn(move || {
        n += 1;
        (!n.is_multiple_of(4)).then(|| n % 4 - 1)
    });
    let items: Vec<u32> = prefetch(IterSource::new(restarting), 2, 0)
        .unwrap()
        .map(Result::unwrap)
        .take(10) // bounded, should the source go on after its end
        .collect()
        .await;
    assert_eq!(items, [0, 1, 2]);
}

#[tokio::test]
async fn a_stream_source_does_not_poll_its_stream_after_the_end() {
    // `unfold` panics if polled after it returned `None`; a short batch must not lead to it.
    let s = futures::stream::unfold(0u32, |n| async move { (n < 3).then_some((n, n + 1)) });
    let items: Vec<u32> = prefetch(StreamSource::new(s), 8, 0)
        .unwrap()
        .map(Result::unwrap)
        .collect()
        .await;
    assert_eq!(items, [0, 1, 2]);
}

#[tokio::test]
async fn prefetch_refills_exactly_when_the_buffer_falls_to_low() {
    let consumed = Arc::new(Mutex::new(0));
    let asks = Arc::new(Mutex::new(Vec::new()));
    let source = Recording {
        next: 0,
        end: 100,
        consumed: consumed.clone(),
        fetched: 0,
        asks: asks.clone(),
        pending_every: 0,
        was_pending: false,
        full_batches: true,
    };
    let mut stream = pin!(prefetch(source, 10, 3).unwrap());
    let mut out = Vec::new();
    while let Some(item) = stream.next().await {
        out.push(item.unwrap());
        *consumed.lock().unwrap() += 1;
    }
    assert_eq!(out, (0..100).collect::<Vec<_>>());
    // The first fetch fills the buffer; every later one starts with exactly `low` buffered
    // (not above: too early; not below: too late) and asks for `high − low`; the last ask
    // finds the source at its end.
    let asks = asks.lock().unwrap().clone();
    let mut expected = vec![(10, 0, true)];
    expected.extend(std::iter::repeat_n((7, 3, true), 14));
    assert_eq!(asks, expected);
}

#[tokio::test(start_paused = true)]
async fn a_failed_fetch_is_yielded_and_the_next_one_waits_with_backoff() {
    let at = Arc::new(Mutex::new(Vec::new()));
    let source = Flaky {
        failures: 3,
        served: false,
        failed_after: false,
        at: at.clone(),
        origin: tokio::time::Instant::now(),
    };
    let out: Vec<Result<u32, &str>> = prefetch(source, 4, 0).unwrap().collect().await;
    assert_eq!(
        out,
        [
            Err("down"),
            Err("down"),
            Err("down"),
            Ok(0),
            Ok(1),
            Ok(2),
            Ok(3),
            Err("down again"),
        ]
    );
    let ms = |v: u64| Duration::from_millis(v);
    // 10 ms, then doubling while it keeps failing; a success starts over at 10 ms.
    assert_eq!(
        *at.lock().unwrap(),
        [ms(0), ms(10), ms(30), ms(70), ms(70), ms(80)]
    );
}

#[test]
fn bad_requests_and_configs_are_typed_errors() {
    let (_s, demand) = futures::stream::iter(0..1).with_demand(0);
    assert_eq!(demand.request(0), Err(DemandError::ZeroRequest));
    demand.request(UNBOUNDED).unwrap();
    demand.request(5).unwrap();
    assert_eq!(demand.outstanding(), UNBOUNDED);
    let source = || StreamSource::new(futures::stream::iter(0..1));
    assert_eq!(
        prefetch(source(), 0, 0).err().unwrap().field(),
        "prefetch.high"
    );
    let e = prefetch(source(), 4, 4).err().unwrap();
    assert_eq!(
        (e.field(), e.kind()),
        ("prefetch.low", ConfigErrorKind::Inconsistent)
    );
    let e = prefetch(source(), 4, 1)
        .unwrap()
        .retry_backoff(Duration::from_secs(2), Duration::from_secs(1))
        .err()
        .unwrap();
    assert_eq!(
        (e.field(), e.kind()),
        ("prefetch.retry_backoff", ConfigErrorKind::Inconsistent)
    );
    let e = futures::stream::iter(0..1).watermarks(2, 2).err().unwrap();
    assert_eq!(e.field(), "watermarks.low");
    let tracker = CommitTracker::new();
    let _t = tracker.track(5).unwrap();
    assert_eq!(
        tracker.track(5).err(),
        Some(DemandError::OffsetOutOfOrder { offset: 5, last: 5 })
    );
}

#[tokio::test]
async fn unbounded_demand_yields_everything() {
    let (s, _demand) = futures::stream::iter(0..1000).with_demand(UNBOUNDED);
    assert_eq!(s.count().await, 1000);
}

#[tokio::test]
async fn a_request_from_another_task_wakes_the_stream() {
    let (mut s, demand) = futures::stream::iter(0..10).with_demand(0);
    let t = tokio::spawn(async move {
        tokio::task::yield_now().await;
        demand.request(3).unwrap();
    });
    assert_eq!(s.next().await, Some(0));
    t.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn watermarks_pause_at_high_and_resume_at_low_with_min_hold() {
    let stream = futures::stream::iter(0..100)
        .watermarks(3, 1)
        .unwrap()
        .min_hold(Duration::from_millis(100));
    let mut signal = stream.pause_signal();
    let mut stream = pin!(stream);
    let mut tickets = VecDeque::new();
    for i in 0..3 {
        let (item, t) = stream.next().await.unwrap();
        assert_eq!(item, i);
        tickets.push_back(t);
    }
    assert_eq!(signal.get(), Flow::Paused, "3 in flight = high");
    assert!(
        poll!(stream.next()).is_pending(),
        "paused: upstream not pulled"
    );
    drop(tickets.pop_front());
    assert!(signal.is_paused(), "2 in flight: above low, still paused");
    drop(tickets.pop_front());
    // 1 in flight = low, but the pause began less than min_hold ago: held back.
    assert!(signal.is_paused());
    assert!(poll!(stream.next()).is_pending());
    advance(Duration::from_millis(100)).await;
    let (item, t) = stream.next().await.unwrap(); // the wrapper applied the resume
    assert_eq!(item, 3);
    assert_eq!(signal.changed().await, Some(Flow::Resumed));
    tickets.push_back(t);
    // 2 in flight; one more reaches high again, but min_hold keeps it resumed for now.
    let (_, t) = stream.next().await.unwrap();
    tickets.push_back(t);
    assert_eq!(stream.in_flight(), 3);
    assert!(!signal.is_paused(), "no flapping faster than min_hold");
    assert!(
        poll!(stream.next()).is_pending(),
        "at high: not pulled, although the pause is held back"
    );
    advance(Duration::from_millis(100)).await;
    assert!(poll!(stream.next()).is_pending(), "now paused");
    assert!(signal.is_paused());
}

#[tokio::test(start_paused = true)]
async fn in_flight_never_exceeds_high_while_a_pause_is_held_back() {
    let high = 3;
    let stream = futures::stream::iter(0..10_000)
        .watermarks(high, 1)
        .unwrap()
        .min_hold(Duration::from_secs(1));
    let signal = stream.pause_signal();
    let mut stream = pin!(stream);
    let mut tickets = VecDeque::new();
    for _ in 0..high {
        tickets.push_back(stream.next().await.unwrap().1);
    }
    assert!(signal.is_paused());
    // Down to low, then the held-back resume applies: resumed, and a pause is now held back
    // for a second.
    tickets.truncate(1);
    advance(Duration::from_secs(1)).await;
    let mut pull_all = async |tickets: &mut VecDeque<_>| {
        let mut pulled = 0;
        while let Poll::Ready(next) = poll!(stream.next()) {
            tickets.push_back(next.unwrap().1);
            pulled += 1;
            assert!(
                stream.in_flight() <= high,
                "{} in flight",
                stream.in_flight()
            );
        }
        pulled
    };
    assert_eq!(
        pull_all(&mut tickets).await,
        2,
        "from 1 in flight up to high"
    );
    tickets.pop_front();
    assert_eq!(
        pull_all(&mut tickets).await,
        1,
        "one done: one more, up to high"
    );
    assert_eq!(stream.in_flight(), high);
    assert!(
        !signal.is_paused(),
        "the pause is still held back by min_hold"
    );
    advance(Duration::from_secs(1)).await;
    assert!(poll!(stream.next()).is_pending());
    assert!(signal.is_paused());
}

#[tokio::test(start_paused = true)]
async fn a_min_hold_of_duration_max_holds_forever_without_panicking() {
    let stream = futures::stream::iter(0..10)
        .watermarks(1, 0)
        .unwrap()
        .min_hold(Duration::MAX);
    let signal = stream.pause_signal();
    let mut stream = pin!(stream);
    let (_, t) = stream.next().await.unwrap();
    assert!(signal.is_paused());
    drop(t);
    advance(Duration::from_secs(86_400)).await;
    assert!(poll!(stream.next()).is_pending(), "the resume is held back");
    assert!(signal.is_paused());
}

#[tokio::test]
async fn watermarks_without_min_hold_follow_in_flight_at_once() {
    let mut stream = pin!(futures::stream::iter(0..10).watermarks(2, 0).unwrap());
    let signal = stream.pause_signal();
    let (_, a) = stream.next().await.unwrap();
    let (_, b) = stream.next().await.unwrap();
    assert!(signal.is_paused());
    drop(a);
    assert!(signal.is_paused(), "1 > low");
    drop(b);
    assert!(!signal.is_paused());
    assert_eq!(stream.next().await.map(|(i, _)| i), Some(2));
}

/// What happened to a tracked offset, in the model of the commit property test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    InFlight,
    Done,
    Abandoned,
    Dropped,
}

#[derive(Debug, Clone)]
enum CommitOp {
    /// Track the offset this far above the last one.
    Track(u64),
    Finish(prop::sample::Index, Fate),
}

fn commit_op() -> impl Strategy<Value = CommitOp> {
    let finish = |fate| any::<prop::sample::Index>().prop_map(move |i| CommitOp::Finish(i, fate));
    prop_oneof![
        4 => (1u64..4).prop_map(CommitOp::Track),
        3 => finish(Fate::Done),
        2 => finish(Fate::Abandoned),
        1 => finish(Fate::Dropped),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn the_commit_never_passes_an_unfinished_offset_and_pending_stays_bounded(
        max_pending in 1usize..10,
        ops in prop::collection::vec(commit_op(), 1..200),
    ) {
        let tracker = CommitTracker::builder().max_pending(max_pending).build().unwrap();
        let mut last = 0u64;
        // Every offset tracked, in order: its token while alive, and its fate.
        let mut tracked: Vec<(u64, Option<CommitToken>, Fate)> = Vec::new();
        for op in ops {
            match op {
                CommitOp::Track(gap) => match tracker.track(last + gap) {
                    Ok(token) => {
                        last += gap;
                        tracked.push((last, Some(token), Fate::InFlight));
                    }
                    Err(DemandError::PendingFull { offset, oldest, max_pending: m }) => {
                        prop_assert_eq!((offset, m), (last + gap, max_pending));
                        prop_assert_eq!(tracker.pending(), max_pending, "refused below the bound");
                        let first_pending = tracked
                            .iter()
                            .find(|(_, _, f)| !matches!(f, Fate::Done | Fate::Abandoned))
                            .map(|&(o, ..)| o);
                        prop_assert_eq!(Some(oldest), first_pending);
                    }
                    Err(e) => prop_assert!(false, "unexpected {e}"),
                },
                CommitOp::Finish(idx, fate) => {
                    if tracked.is_empty() {
                        continue;
                    }
                    let at = idx.index(tracked.len());
                    let entry = &mut tracked[at];
                    if let Some(token) = entry.1.take() {
                        match fate {
                            Fate::Done => token.done(),
                            Fate::Abandoned => token.abandon(),
                            Fate::Dropped | Fate::InFlight => drop(token),
                        }
                        entry.2 = fate;
                    }
                }
            }
            let committed = tracker.committable();
            // Never past an offset neither processed nor abandoned.
            for &(offset, _, fate) in &tracked {
                if matches!(fate, Fate::InFlight | Fate::Dropped) {
                    prop_assert!(
                        committed.is_none_or(|c| c < offset),
                        "committable {:?} passes {} ({:?})", committed, offset, fate
                    );
                }
            }
            // And as far as the finished prefix goes.
            let prefix = tracked
                .iter()
                .take_while(|(_, _, f)| matches!(f, Fate::Done | Fate::Abandoned))
                .count();
            let model = prefix.checked_sub(1).map(|i| tracked[i].0);
            prop_assert_eq!(committed, model, "commits stopped short of the finished prefix");
            prop_assert!(tracker.pending() <= max_pending);
            prop_assert_eq!(tracker.pending(), tracked.len() - prefix);
            let count = |f| tracked.iter().filter(|e| e.2 == f).count() as u64;
            prop_assert_eq!(tracker.abandoned(), count(Fate::Abandoned));
            prop_assert_eq!(tracker.dropped(), count(Fate::Dropped));
        }
    }
}

#[test]
fn commits_continue_past_an_abandoned_offset() {
    let tracker = CommitTracker::new();
    let tokens: Vec<_> = (1..=1_000).map(|o| tracker.track(o).unwrap()).collect();
    for token in tokens {
        // Every tenth item fails for good: dead-lettered, then given up.
        if token.offset() % 10 == 3 {
            token.abandon();
        } else {
            token.done();
        }
    }
    assert_eq!(tracker.committable(), Some(1_000));
    assert_eq!(tracker.pending(), 0);
    assert_eq!(tracker.abandoned(), 100);
    // And later offsets keep committing.
    tracker.track(1_001).unwrap().done();
    assert_eq!(tracker.committable(), Some(1_001));
}

#[test]
fn a_dropped_token_holds_the_commit_and_is_counted() {
    let tracker = CommitTracker::builder().max_pending(3).build().unwrap();
    tracker.track(1).unwrap().done();
    drop(tracker.track(2).unwrap()); // a worker that crashed
    tracker.track(3).unwrap().done();
    tracker.track(4).unwrap().done();
    assert_eq!(
        tracker.committable(),
        Some(1),
        "2 is redelivered after a restart"
    );
    assert_eq!(tracker.dropped(), 1);
    assert_eq!(tracker.pending(), 3);
    // Full: refused (not tracked), with the offset the commits wait for.
    assert_eq!(
        tracker.track(5).err(),
        Some(DemandError::PendingFull {
            offset: 5,
            oldest: 2,
            max_pending: 3
        })
    );
    assert_eq!(tracker.pending(), 3);
    let e = CommitTracker::builder().max_pending(0).build().unwrap_err();
    assert_eq!(
        (e.field(), e.kind()),
        ("commit.max_pending", ConfigErrorKind::Zero)
    );
}

#[tokio::test]
async fn until_ready_waits_for_room_in_a_full_tracker() {
    let tracker = CommitTracker::builder().max_pending(2).build().unwrap();
    let a = tracker.track(10).unwrap();
    let b = tracker.track(11).unwrap();
    let mut ready = pin!(tracker.until_ready());
    assert!(poll!(ready.as_mut()).is_pending(), "full");
    b.done(); // behind 10: still full
    assert!(poll!(ready.as_mut()).is_pending());
    let t = tokio::spawn(async move {
        tokio::task::yield_now().await;
        a.abandon();
    });
    ready.await;
    t.await.unwrap();
    assert_eq!(tracker.committable(), Some(11));
    tracker.track(12).unwrap().done();
    assert_eq!(tracker.committable(), Some(12));
}

#[tokio::test]
async fn the_size_hint_of_with_demand_holds_after_a_request_raises_the_credit() {
    let (mut stream, demand) = futures::stream::iter(0..10).with_demand(2);
    let (lo, hi) = futures::Stream::size_hint(&stream);
    assert_eq!(lo, 2, "the credit now is a floor");
    demand.request(5).unwrap();
    let mut yielded = 0;
    while let Poll::Ready(Some(_)) = poll!(stream.next()) {
        yielded += 1;
    }
    assert_eq!(yielded, 7);
    assert!(
        hi.is_none_or(|hi| yielded <= hi),
        "size_hint said at most {hi:?}, {yielded} came"
    );
    assert_eq!(hi, Some(10), "the inner stream's bound");
}

#[tokio::test(start_paused = true)]
async fn a_min_hold_set_while_a_ticket_is_alive_takes_effect() {
    let mut stream = futures::stream::iter(0..10).watermarks(1, 0).unwrap();
    let signal = stream.pause_signal();
    let (_, ticket) = stream.next().await.unwrap();
    assert!(signal.is_paused());
    let mut stream = stream.min_hold(Duration::from_millis(100));
    drop(ticket);
    assert!(signal.is_paused(), "the resume waits for min_hold");
    assert!(poll!(stream.next()).is_pending());
    advance(Duration::from_millis(100)).await;
    assert_eq!(stream.next().await.map(|(i, _)| i), Some(1));
}

#[cfg(feature = "metrics")]
#[tokio::test]
async fn a_name_set_while_a_ticket_is_alive_takes_effect() {
    let recorder = support::TestRecorder::default();
    let stream = futures::stream::iter(0..10).watermarks(2, 0).unwrap();
    let mut stream = metrics::with_local_recorder(&recorder, || stream);
    let (_, a) = stream.next().await.unwrap();
    let mut stream = metrics::with_local_recorder(&recorder, || stream.name("wm"));
    let id = |m: &str| format!("{m}{{name=wm}}");
    assert_eq!(recorder.gauge(&id("flowgate_demand_in_flight")), Some(1.0));
    assert_eq!(recorder.gauge(&id("flowgate_demand_paused")), Some(0.0));
    let (_, b) = stream.next().await.unwrap();
    assert_eq!(recorder.gauge(&id("flowgate_demand_in_flight")), Some(2.0));
    assert_eq!(recorder.gauge(&id("flowgate_demand_paused")), Some(1.0));
    drop((a, b));
    assert_eq!(recorder.gauge(&id("flowgate_demand_in_flight")), Some(0.0));
    assert_eq!(recorder.gauge(&id("flowgate_demand_paused")), Some(0.0));
}

#[cfg(feature = "metrics")]
#[tokio::test]
async fn named_with_demand_and_prefetch_report_under_their_names() {
    use flowgate::demand::{Demanded, Prefetch};
    let recorder = support::TestRecorder::default();
    let ((mut credit, demand), mut fetched) = metrics::with_local_recorder(&recorder, || {
        (
            Demanded::builder(futures::stream::iter(0..10), 3)
                .name("credit-a")
                .build(),
            Prefetch::builder(IterSource::new(0..10), 4, 1)
                .name("prefetch-a")
                .build()
                .unwrap(),
        )
    });
    assert_eq!(
        (credit.name(), demand.name()),
        (Some("credit-a"), Some("credit-a"))
    );
    assert_eq!(fetched.name(), Some("prefetch-a"));
    let outstanding = "flowgate_demand_outstanding{name=credit-a}";
    assert_eq!(recorder.gauge(outstanding), Some(3.0));
    assert_eq!(credit.next().await, Some(0));
    assert_eq!(recorder.gauge(outstanding), Some(2.0));
    demand.request(5).unwrap();
    assert_eq!(recorder.gauge(outstanding), Some(7.0));
    assert_eq!(fetched.next().await.map(Result::unwrap), Some(0));
    assert_eq!(
        recorder.gauge("flowgate_demand_buffered{name=prefetch-a}"),
        Some(4.0),
        "a batch of high landed"
    );
    assert_eq!(
        recorder.gauge("flowgate_demand_outstanding{name=default}"),
        None
    );
    assert_eq!(
        recorder.gauge("flowgate_demand_buffered{name=default}"),
        None
    );
}

#[test]
fn prefetch_builder_validates_everything() {
    use flowgate::demand::Prefetch;
    let source = || IterSource::new(0..1);
    let e = Prefetch::builder(source(), 0, 0).build().err().unwrap();
    assert_eq!(e.field(), "prefetch.high");
    let e = Prefetch::builder(source(), 4, 4).build().err().unwrap();
    assert_eq!(e.field(), "prefetch.low");
    let e = Prefetch::builder(source(), 4, 1)
        .retry_backoff(Duration::from_secs(2), Duration::from_secs(1))
        .build()
        .err()
        .unwrap();
    assert_eq!(e.field(), "prefetch.retry_backoff");
}

#[cfg(feature = "redis")]
mod redis_streams {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use flowgate::demand::{
        Origin, RedisStreamSource, RedisStreamSourceBuilder, StreamEntry, prefetch,
    };
    use futures::StreamExt;
    use redis::aio::MultiplexedConnection;

    use super::support::RedisServer;

    const KEY: &str = "orders";
    const GROUP: &str = "billing";

    async fn produce<C: redis::aio::ConnectionLike>(con: &mut C, n: u32) {
        for chunk in (0..n).collect::<Vec<_>>().chunks(1_000) {
            let mut pipe = redis::pipe();
            for i in chunk {
                pipe.cmd("XADD").arg(KEY).arg("*").arg("n").arg(*i).ignore();
            }
            pipe.query_async::<()>(con).await.unwrap();
        }
    }

    /// A private server whose stream holds `n` entries, produced after the group was
    /// created, so every entry goes through it.
    async fn with_entries(n: u32) -> (RedisServer, MultiplexedConnection) {
        let server = RedisServer::start();
        let mut con = server.connect().await;
        drop(source(&server, "setup").await);
        produce(&mut con, n).await;
        (server, con)
    }

    async fn source(
        server: &RedisServer,
        consumer: &str,
    ) -> RedisStreamSource<MultiplexedConnection> {
        RedisStreamSource::builder(server.connect().await, KEY, GROUP, consumer)
            .block(Duration::from_millis(50))
            .min_idle(Duration::from_millis(300))
            .claim_every(Duration::from_millis(100))
            .build()
            .await
            .unwrap()
    }

    async fn pending(con: &mut MultiplexedConnection) -> u64 {
        let summary: redis::Value = redis::cmd("XPENDING")
            .arg(KEY)
            .arg(GROUP)
            .query_async(con)
            .await
            .unwrap();
        match summary {
            redis::Value::Array(v) => {
                redis::FromRedisValue::from_redis_value(v[0].clone()).unwrap()
            }
            other => panic!("unexpected XPENDING reply {other:?}"),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_group_processes_everything_at_least_once_when_a_consumer_dies() {
        const N: u32 = 10_000;
        let (server, mut con) = with_entries(N).await;
        let seen: Arc<Mutex<HashMap<u32, u32>>> = Default::default();
        let acked: Arc<Mutex<std::collections::HashSet<u32>>> = Default::default();

        // Consumer c processes some entries, then dies holding 100 it never acknowledged.
        {
            let mut stream = Box::pin(prefetch(source(&server, "c").await, 100, 20).unwrap());
            for _ in 0..1_000 {
                let e = stream.next().await.unwrap().unwrap();
                let n: u32 = e.get("n").unwrap();
                *seen.lock().unwrap().entry(n).or_default() += 1;
                e.ack.ack();
                acked.lock().unwrap().insert(n);
            }
            stream
                .as_mut()
                .get_mut()
                .get_mut()
                .flush_acks()
                .await
                .unwrap();
            for _ in 0..100 {
                let e = stream.next().await.unwrap().unwrap();
                *seen.lock().unwrap().entry(e.get("n").unwrap()).or_default() += 1;
                drop(e.ack); // crash: never acknowledged
            }
        }

        let done = Arc::new(AtomicBool::new(false));
        let mut survivors = Vec::new();
        for name in ["a", "b"] {
            let (seen, acked, done) = (seen.clone(), acked.clone(), done.clone());
            let server_src = source(&server, name).await;
            survivors.push(tokio::spawn(async move {
                let mut stream = Box::pin(prefetch(server_src, 100, 20).unwrap());
                let mut claimed = 0;
                while !done.load(Ordering::SeqCst) {
                    let Ok(Some(e)) =
                        tokio::time::timeout(Duration::from_millis(100), stream.next()).await
                    else {
                        continue;
                    };
                    let e = e.unwrap();
                    claimed += usize::from(e.origin == Origin::Claimed);
                    let n: u32 = e.get("n").unwrap();
                    *seen.lock().unwrap().entry(n).or_default() += 1;
                    e.ack.ack();
                    let mut acked = acked.lock().unwrap();
                    acked.insert(n);
                    if acked.len() == N as usize {
                        done.store(true, Ordering::SeqCst);
                    }
                }
                stream
                    .as_mut()
                    .get_mut()
                    .get_mut()
                    .flush_acks()
                    .await
                    .unwrap();
                claimed
            }));
        }
        let all = tokio::time::timeout(Duration::from_secs(60), async {
            let mut claimed = 0;
            for s in survivors {
                claimed += s.await.unwrap();
            }
            claimed
        })
        .await;
        if all.is_err() {
            let acked_n = acked.lock().unwrap().len();
            let left = pending(&mut con).await;
            panic!("timeout: {acked_n} of {N} acked, {left} pending");
        }
        let all = all.unwrap();
        {
            let seen = seen.lock().unwrap();
            assert_eq!(seen.len(), N as usize, "every entry was processed");
            assert!(seen.values().all(|&c| c >= 1));
        }
        assert!(
            all >= 100,
            "the dead consumer's 100 entries were claimed ({all})"
        );
        assert_eq!(
            pending(&mut con).await,
            0,
            "nothing left pending: acked == produced"
        );
    }

    /// The next `n` entries.
    async fn take<S>(stream: &mut S, n: usize) -> Vec<StreamEntry>
    where
        S: futures::Stream<Item = redis::RedisResult<StreamEntry>> + Unpin,
    {
        stream.take(n).map(Result::unwrap).collect().await
    }

    /// The next entry within 700 ms.
    async fn next<S>(stream: &mut S) -> Option<StreamEntry>
    where
        S: futures::Stream<Item = redis::RedisResult<StreamEntry>> + Unpin,
    {
        let next = tokio::time::timeout(Duration::from_millis(700), stream.next()).await;
        next.ok().flatten().map(Result::unwrap)
    }

    /// Waits (up to 5 s) until nothing is pending in the group; returns what is left.
    async fn drained(con: &mut MultiplexedConnection) -> u64 {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let left = pending(con).await;
            if left == 0 || tokio::time::Instant::now() >= deadline {
                return left;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test]
    async fn a_consumer_never_redelivers_what_it_holds_and_reclaims_what_it_dropped() {
        let (server, mut con) = with_entries(20).await;
        // min_idle 300 ms, a claim every 100 ms: held entries go idle while we sleep.
        let mut stream = Box::pin(prefetch(source(&server, "solo").await, 5, 0).unwrap());
        let mut held = take(&mut stream, 5).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        while held.len() < 20 {
            let e = next(&mut stream)
                .await
                .expect("the 15 other entries arrive");
            assert!(
                held.iter().all(|h| h.id != e.id),
                "{} delivered again while held ({:?})",
                e.id,
                e.origin
            );
            held.push(e);
        }
        assert!(
            next(&mut stream).await.is_none(),
            "nothing more: all 20 held"
        );
        // Dropped without an ack: claimed back once idle, by this same consumer.
        let dropped = held.swap_remove(3);
        let id = dropped.id.clone();
        drop(dropped);
        let again = next(&mut stream)
            .await
            .expect("the dropped entry comes back");
        assert_eq!(
            (again.id.as_str(), again.origin),
            (id.as_str(), Origin::Claimed)
        );
        held.push(again);
        // Acks leave without a fetch: the background flusher sends them.
        for e in held {
            e.ack.ack();
        }
        assert_eq!(
            drained(&mut con).await,
            0,
            "all acked without another fetch"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_live_consumer_keeps_the_entries_it_holds_from_other_consumers() {
        let (server, mut con) = with_entries(5).await;
        // min_idle 300 ms: a's keep-alive runs every 100 ms; b claims every 100 ms.
        let mut a = Box::pin(prefetch(source(&server, "a").await, 5, 0).unwrap());
        let held = take(&mut a, 5).await;
        let mut b = Box::pin(prefetch(source(&server, "b").await, 5, 0).unwrap());
        let started = tokio::time::Instant::now();
        while started.elapsed() < Duration::from_millis(1_200) {
            if let Some(e) = next(&mut b).await {
                panic!("b took {} ({:?}) while a holds it", e.id, e.origin);
            }
        }
        // Another consumer claimed one meanwhile (as if a had stalled): a's keep-alive
        // leaves it with that consumer.
        let _: redis::Value = redis::cmd("XCLAIM")
            .arg(KEY)
            .arg(GROUP)
            .arg("intruder")
            .arg(0)
            .arg(&held[0].id)
            .arg("JUSTID")
            .query_async(&mut con)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(400)).await;
        let owner: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
            .arg(KEY)
            .arg(GROUP)
            .arg(&held[0].id)
            .arg(&held[0].id)
            .arg(1)
            .query_async(&mut con)
            .await
            .unwrap();
        assert_eq!(owner[0].1, "intruder", "the keep-alive never steals");
        // a lets go of them without an ack (say its work failed): b takes them over.
        drop(held);
        let mut claimed = 0;
        while claimed < 5 {
            let e = next(&mut b).await.expect("a's dropped entries are claimed");
            assert_eq!(e.origin, Origin::Claimed);
            e.ack.ack();
            claimed += 1;
        }
        assert_eq!(drained(&mut con).await, 0);
    }

    #[tokio::test]
    async fn acks_after_the_source_is_dropped_still_reach_redis() {
        let (server, mut con) = with_entries(10).await;
        let mut stream = Box::pin(prefetch(source(&server, "e").await, 5, 0).unwrap());
        let entries = take(&mut stream, 5).await;
        drop(stream); // shutdown: stop fetching, let the workers finish
        assert_eq!(pending(&mut con).await, 5);
        for e in entries {
            e.ack.ack();
        }
        assert_eq!(
            drained(&mut con).await,
            0,
            "acked after the drop, still sent"
        );
    }

    #[tokio::test]
    async fn a_restarted_consumer_recovers_its_own_pending_entries_first() {
        let (server, _con) = with_entries(200).await;
        let mut first = Vec::new();
        {
            let mut stream = Box::pin(prefetch(source(&server, "d").await, 50, 0).unwrap());
            for _ in 0..50 {
                let e = stream.next().await.unwrap().unwrap();
                assert_eq!(e.origin, Origin::New);
                first.push(e.id.clone());
            }
        } // dropped without acknowledging anything
        let src = source(&server, "d").await;
        assert!(src.is_recovering());
        let mut stream = Box::pin(prefetch(src, 50, 0).unwrap());
        let mut again = Vec::new();
        for _ in 0..50 {
            let e = stream.next().await.unwrap().unwrap();
            assert_eq!(e.origin, Origin::OwnPending);
            again.push(e.id.clone());
            e.ack.ack();
        }
        assert_eq!(
            again, first,
            "its own pending entries come back first, in order"
        );
        let e = stream.next().await.unwrap().unwrap();
        assert_eq!(e.origin, Origin::New);
        assert_eq!(e.get::<u32>("n").unwrap(), 50);
    }

    /// Counters of one source, read from a test recorder (`None` without `metrics`).
    struct Counters {
        #[cfg(feature = "metrics")]
        recorder: super::support::TestRecorder,
        name: &'static str,
    }

    impl Counters {
        fn new(name: &'static str) -> Self {
            Counters {
                #[cfg(feature = "metrics")]
                recorder: Default::default(),
                name,
            }
        }

        /// Builds the source with its metrics registered in this recorder. Needs a
        /// multi-thread runtime (the build runs in `block_in_place`).
        fn build<C>(&self, builder: RedisStreamSourceBuilder<C>) -> RedisStreamSource<C>
        where
            C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
        {
            let builder = builder.name(self.name);
            let build = || {
                tokio::task::block_in_place(|| {
                    tokio::runtime::Handle::current().block_on(builder.build())
                })
            };
            #[cfg(feature = "metrics")]
            let source = metrics::with_local_recorder(&self.recorder, build);
            #[cfg(not(feature = "metrics"))]
            let source = build();
            source.unwrap()
        }

        /// A counter of this source; `None` without the `metrics` feature.
        fn get(&self, metric: &str) -> Option<u64> {
            #[cfg(feature = "metrics")]
            return Some(self.recorder.counter(&format!(
                "flowgate_demand_{metric}_total{{name={}}}",
                self.name
            )));
            #[cfg(not(feature = "metrics"))]
            {
                let _ = (metric, self.name);
                None
            }
        }
    }

    /// A builder with short timings; acks leave only with a fetch or `flush_acks` (the
    /// background task waits 30 s), so the tests know where each ack goes.
    fn lost_group_builder<C>(conn: C, consumer: &str) -> RedisStreamSourceBuilder<C>
    where
        C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
    {
        RedisStreamSource::builder(conn, KEY, GROUP, consumer)
            .block(Duration::from_millis(50))
            .min_idle(Duration::from_secs(3))
            .claim_every(Duration::from_secs(1))
            .ack_interval(Duration::from_secs(30))
    }

    /// The next entry within 700 ms, skipping fetch errors (a restarting server).
    async fn next_ok<S>(stream: &mut S) -> Option<StreamEntry>
    where
        S: futures::Stream<Item = redis::RedisResult<StreamEntry>> + Unpin,
    {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(700);
        loop {
            match tokio::time::timeout_at(deadline, stream.next()).await {
                Ok(Some(Ok(e))) => return Some(e),
                Ok(Some(Err(_))) => continue,
                Ok(None) | Err(_) => return None,
            }
        }
    }

    /// Whether the group exists (on a fresh blocking connection: the server may have
    /// restarted).
    fn group_exists(server: &RedisServer) -> bool {
        let groups: redis::RedisResult<Vec<redis::Value>> =
            server.query_blocking(redis::cmd("XINFO").arg("GROUPS").arg(KEY));
        groups.is_ok_and(|g| !g.is_empty())
    }

    /// Polls the stream (no entry may come) until the source has created its group again;
    /// at most 10 rounds of 700 ms.
    async fn until_group_recreated<S>(server: &RedisServer, stream: &mut S)
    where
        S: futures::Stream<Item = redis::RedisResult<StreamEntry>> + Unpin,
    {
        for _ in 0..10 {
            if let Some(e) = next_ok(stream).await {
                panic!("nothing to deliver while the group is lost, got {}", e.id);
            }
            if group_exists(server) {
                return;
            }
        }
        panic!("the source did not create its lost group again within 7 s");
    }

    /// Takes `n` entries (each within 700 ms, fetch errors skipped) and checks they are the
    /// `n` produced after the group came back, each exactly once; acks them all.
    async fn take_produced<S>(stream: &mut S, n: u32)
    where
        S: futures::Stream<Item = redis::RedisResult<StreamEntry>> + Unpin,
    {
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..n {
            let e = next_ok(stream)
                .await
                .unwrap_or_else(|| panic!("only {} of {n} entries arrived", seen.len()));
            assert_eq!(e.origin, Origin::New);
            let value: u32 = e.get("n").unwrap();
            assert!(seen.insert(value), "entry {value} delivered twice");
            e.ack.ack();
        }
        assert_eq!(
            seen,
            (0..n).collect(),
            "every entry produced after it came back"
        );
        assert!(next_ok(stream).await.is_none(), "nothing delivered twice");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_destroyed_group_is_created_again_and_no_ack_of_the_old_one_is_sent() {
        let server = RedisServer::start();
        let mut con = server.connect().await;
        let counters = Counters::new("destroyed");
        let source = counters.build(lost_group_builder(server.connect().await, "r"));
        produce(&mut con, 10).await;
        let mut stream = Box::pin(prefetch(source, 10, 0).unwrap());
        let mut first = take(&mut stream, 10).await;
        let held = first.split_off(6);
        for e in first {
            e.ack.ack();
        }
        let source = stream.as_mut().get_mut().get_mut();
        assert_eq!(source.flush_acks().await.unwrap(), 6);

        let _: () = redis::cmd("XGROUP")
            .arg("DESTROY")
            .arg(KEY)
            .arg(GROUP)
            .query_async(&mut con)
            .await
            .unwrap();
        let mut held = held.into_iter();
        // Two acks queued while the group is gone: they ride on the fetch that meets NOGROUP.
        for e in held.by_ref().take(2) {
            e.ack.ack();
        }
        until_group_recreated(&server, &mut stream).await;
        // Two acks of entries of the lost group, made after the new group exists.
        for e in held {
            e.ack.ack();
        }
        produce(&mut con, 20).await;
        take_produced(&mut stream, 20).await;
        let source = stream.as_mut().get_mut().get_mut();
        source.flush_acks().await.unwrap();
        assert_eq!(drained(&mut con).await, 0, "nothing left pending");
        assert_eq!(counters.get("group_recreated").unwrap_or(1), 1);
        // Sent: the 6 before the loss and the 20 new ones, each once; none of the old group.
        assert_eq!(counters.get("acked").unwrap_or(26), 6 + 20);
        assert_eq!(
            counters.get("stale_acks").unwrap_or(4),
            4,
            "old acks not sent"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_deleted_stream_refilled_by_a_producer_is_consumed_again() {
        let server = RedisServer::start();
        let mut con = server.connect().await;
        let counters = Counters::new("deleted");
        // From the beginning: entries a producer adds before the source sees the loss are
        // not skipped.
        let builder = lost_group_builder(server.connect().await, "r")
            .recreate_from(flowgate::demand::StartFrom::Beginning);
        let source = counters.build(builder);
        produce(&mut con, 5).await;
        let mut stream = Box::pin(prefetch(source, 5, 0).unwrap());
        for e in take(&mut stream, 5).await {
            e.ack.ack();
        }
        // The source is not polled: the producer re-creates the stream (without the
        // group) before the source's next fetch.
        let _: () = redis::cmd("DEL")
            .arg(KEY)
            .query_async(&mut con)
            .await
            .unwrap();
        produce(&mut con, 10).await;
        take_produced(&mut stream, 10).await;
        assert!(group_exists(&server));
        let source = stream.as_mut().get_mut().get_mut();
        source.flush_acks().await.unwrap();
        assert_eq!(drained(&mut con).await, 0, "nothing left pending");
        assert_eq!(counters.get("group_recreated").unwrap_or(1), 1);
        assert_eq!(counters.get("acked").unwrap_or(10), 10);
        assert_eq!(counters.get("stale_acks").unwrap_or(5), 5);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn consumption_resumes_after_the_server_restarts_empty() {
        let server = RedisServer::start();
        let counters = Counters::new("restarted");
        // A connection manager reconnects after the restart.
        let conn = server.client().get_connection_manager().await.unwrap();
        let source = counters.build(lost_group_builder(conn.clone(), "r"));
        let mut producer = conn;
        produce(&mut producer, 5).await;
        let mut stream = Box::pin(prefetch(source, 5, 0).unwrap());
        for e in take(&mut stream, 5).await {
            e.ack.ack();
        }
        let source = stream.as_mut().get_mut().get_mut();
        source.flush_acks().await.unwrap();

        server.restart();
        assert!(!group_exists(&server), "the restarted server is empty");
        until_group_recreated(&server, &mut stream).await;
        let mut con = server.connect().await;
        produce(&mut con, 10).await;
        take_produced(&mut stream, 10).await;
        let source = stream.as_mut().get_mut().get_mut();
        source.flush_acks().await.unwrap();
        assert_eq!(drained(&mut con).await, 0, "nothing left pending");
        assert_eq!(counters.get("group_recreated").unwrap_or(1), 1);
    }

    #[tokio::test]
    async fn zero_durations_and_absurd_counts_are_config_errors() {
        use flowgate::ConfigErrorKind::{Inconsistent, TooLarge, Zero};
        let server = RedisServer::start();
        let conn = server.connect().await;
        let builder = || RedisStreamSource::builder(conn.clone(), KEY, GROUP, "c");
        let ms = Duration::from_millis;
        let cases = [
            (builder().block(Duration::ZERO), "redis_stream.block", Zero),
            (
                builder().block(Duration::from_micros(500)),
                "redis_stream.block",
                Zero,
            ),
            (
                builder().block(Duration::MAX),
                "redis_stream.block",
                TooLarge,
            ),
            (
                builder().min_idle(Duration::ZERO),
                "redis_stream.min_idle",
                Zero,
            ),
            (
                builder().block(ms(250)).min_idle(ms(500)),
                "redis_stream.min_idle",
                Inconsistent,
            ),
            (
                builder().claim_every(Duration::ZERO),
                "redis_stream.claim_every",
                Zero,
            ),
            (
                builder().ack_interval(Duration::ZERO),
                "redis_stream.ack_interval",
                Zero,
            ),
            (builder().max_count(0), "redis_stream.max_count", Zero),
            (
                builder().max_count(usize::MAX),
                "redis_stream.max_count",
                TooLarge,
            ),
        ];
        for (builder, field, kind) in cases {
            let err = builder.build().await.unwrap_err();
            let config = err
                .config()
                .unwrap_or_else(|| panic!("{err}: not a config error"));
            assert_eq!((config.field(), config.kind()), (field, kind), "{err}");
            let text = err.to_string();
            assert!(
                text.starts_with("invalid ") && !text.ends_with('.'),
                "{text}"
            );
            assert!(std::error::Error::source(&err).is_some());
        }
        let exists: u64 = server
            .query_blocking(redis::cmd("EXISTS").arg(KEY))
            .unwrap();
        assert_eq!(exists, 0, "a rejected build sends nothing to Redis");
    }

    #[tokio::test]
    async fn an_unbounded_prefetch_window_asks_redis_for_at_most_max_count() {
        let (server, mut con) = with_entries(0).await;
        let source = RedisStreamSource::builder(server.connect().await, KEY, GROUP, "c")
            .block(Duration::from_millis(50))
            .max_count(3)
            .build()
            .await
            .unwrap();
        produce(&mut con, 10).await;
        let mut stream = Box::pin(prefetch(source, usize::MAX, 0).unwrap());
        let first = next(&mut stream)
            .await
            .expect("COUNT is capped: Redis accepts it");
        assert_eq!(
            flowgate::demand::Prefetch::buffered(&stream),
            2,
            "one fetch brought max_count entries"
        );
        let mut all = vec![first];
        all.extend(take(&mut stream, 9).await);
        for e in all {
            e.ack.ack();
        }
        assert_eq!(drained(&mut con).await, 0);
    }
}

#[test]
fn public_types_are_send_and_sync() {
    use flowgate::demand::{
        CommitToken, DemandHandle, Demanded, PauseSignal, Prefetch, Ticket, Watermarks,
    };
    type Items = futures::stream::Iter<std::ops::Range<u32>>;
    fn send_sync<T: Send + Sync>() {}
    send_sync::<DemandHandle>();
    send_sync::<Demanded<Items>>();
    send_sync::<Prefetch<IterSource<std::ops::Range<u32>>>>();
    send_sync::<Prefetch<StreamSource<Items>>>();
    send_sync::<Watermarks<Items>>();
    send_sync::<Ticket>();
    send_sync::<PauseSignal>();
    send_sync::<CommitTracker>();
    send_sync::<CommitToken>();
    send_sync::<flowgate::demand::CommitTrackerBuilder>();
    send_sync::<flowgate::demand::DemandedBuilder<Items>>();
    send_sync::<flowgate::demand::PrefetchBuilder<IterSource<std::ops::Range<u32>>>>();
    send_sync::<DemandError>();
    fn unpin<T: Unpin>() {}
    unpin::<Prefetch<IterSource<std::ops::Range<u32>>>>();
    unpin::<Demanded<Items>>();
    #[cfg(feature = "redis")]
    {
        use flowgate::demand::{Ack, RedisStreamSource, StreamEntry};
        use redis::aio::MultiplexedConnection;
        // Send (a consumer loop can be spawned), not Sync: a fetch in flight is a boxed
        // `Send` future, and a source is polled by one task anyway.
        fn send<T: Send>() {}
        send::<RedisStreamSource<MultiplexedConnection>>();
        send::<Prefetch<RedisStreamSource<MultiplexedConnection>>>();
        send_sync::<StreamEntry>();
        send_sync::<Ack>();
    }
}
