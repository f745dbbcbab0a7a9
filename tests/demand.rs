//! Demand signalling: credit, prefetch, watermarks and commits, against simple models.

mod support;

use std::collections::{BTreeSet, VecDeque};
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use flowgate::demand::{
    BatchSource, CommitToken, CommitTracker, Flow, IterSource, Levels, Prefetch, RequestError,
    StreamSource, Ticket, TrackError, UNBOUNDED, Watermarks, prefetch,
};
use flowgate::{ConfigErrorKind, FlowStreamExt};
use futures::{StreamExt, poll};
use proptest::prelude::*;
use tokio::time::advance;

/// Levels the test knows to be valid.
fn levels(high: usize, low: usize) -> Levels {
    Levels::new(high, low).unwrap()
}

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
            let mut stream = pin!(prefetch(source, levels(high, low)));
            let mut out = Vec::new();
            let mut pauses = take_pauses.into_iter();
            while let Some(item) = stream.next().await {
                out.push(item.unwrap());
                *consumed.lock().unwrap() += 1;
                prop_assert!(stream.queued() <= high);
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
    let items: Vec<u32> = prefetch(IterSource::new(restarting), levels(2, 0))
        .items()
        .take(10) // bounded, should the source go on after its end
        .collect()
        .await;
    assert_eq!(items, [0, 1, 2]);
}

#[tokio::test]
async fn a_stream_source_does_not_poll_its_stream_after_the_end() {
    // `unfold` panics if polled after it returned `None`; a short batch must not lead to it.
    let s = futures::stream::unfold(0u32, |n| async move { (n < 3).then_some((n, n + 1)) });
    let items: Vec<u32> = prefetch(StreamSource::new(s), levels(8, 0))
        .items()
        .collect()
        .await;
    assert_eq!(items, [0, 1, 2]);
}

/// The most items one fetch of an `IterSource` or a `StreamSource` takes, as their docs say.
const ONE_FETCH: usize = 1024;

/// `0..n` handing out its items one by one, counting them in `pulled`; it panics if asked
/// again after its end.
fn counted(n: u64, pulled: &Arc<AtomicU64>) -> impl Iterator<Item = u64> + use<> {
    let pulled = Arc::clone(pulled);
    let mut ended = false;
    std::iter::from_fn(move || {
        assert!(!ended, "asked again after its end");
        let i = pulled.fetch_add(1, Ordering::Relaxed);
        ended = i >= n;
        (!ended).then_some(i)
    })
}

/// The first item of `prefetch(source, high = usize::MAX)`, and how many items the source
/// had handed out by then.
async fn first_of_unbounded<S>(source: S, pulled: &AtomicU64) -> (Option<u64>, u64)
where
    S: BatchSource<Item = u64, Error = std::convert::Infallible>,
{
    let mut items = pin!(prefetch(source, levels(usize::MAX, 0)).items());
    let first = items.next().await;
    (first, pulled.load(Ordering::Relaxed))
}

/// Checks that `prefetch(source, high)` yields exactly `0..n`.
async fn all_of<S>(source: S, n: u64, high: usize)
where
    S: BatchSource<Item = u64, Error = std::convert::Infallible>,
{
    let items: Vec<u64> = prefetch(source, levels(high, 0)).items().collect().await;
    assert_eq!(items, (0..n).collect::<Vec<_>>(), "n {n}, high {high}");
}

#[tokio::test]
async fn one_fetch_of_an_in_memory_source_is_bounded_whatever_high_is() {
    // `high` of `usize::MAX` over a million ready items: the first item comes after one
    // bounded fetch, not after the whole source was read into one batch (over an endless
    // source, never: one poll that does not return, memory without a bound).
    const N: u64 = 1_000_000;
    let pulled = Arc::new(AtomicU64::new(0));
    let first = first_of_unbounded(IterSource::new(counted(N, &pulled)), &pulled).await;
    assert_eq!(first, (Some(0), ONE_FETCH as u64), "IterSource");
    let pulled = Arc::new(AtomicU64::new(0));
    let stream = futures::stream::iter(counted(N, &pulled));
    let first = first_of_unbounded(StreamSource::new(stream), &pulled).await;
    assert_eq!(first, (Some(0), ONE_FETCH as u64), "StreamSource");
}

#[tokio::test]
async fn in_memory_sources_in_bounded_fetches_deliver_everything_and_end_once() {
    // Around the fetch size: one short, exact, one over, several fetches and an exact
    // multiple (the fetch after the last full one takes nothing and ends the source).
    let one = ONE_FETCH as u64;
    for n in [0, 1, one - 1, one, one + 1, 2 * one, 3 * one + 7] {
        for high in [usize::MAX, 3 * ONE_FETCH, 1500, 7] {
            let pulled = Arc::new(AtomicU64::new(0));
            all_of(IterSource::new(counted(n, &pulled)), n, high).await;
            let pulled = Arc::new(AtomicU64::new(0));
            let stream = futures::stream::iter(counted(n, &pulled));
            all_of(StreamSource::new(stream), n, high).await;
        }
    }
}

#[test]
fn a_fetch_asked_for_more_than_it_takes_returns_what_it_took() {
    // Straight through `poll_fetch`: asked for `usize::MAX`, a fetch returns `ONE_FETCH`
    // items; asked for fewer, exactly those.
    let cx = &mut Context::from_waker(Waker::noop());
    let mut source = IterSource::new(0..5_000u32);
    let Poll::Ready(Some(Ok(batch))) = Pin::new(&mut source).poll_fetch(cx, usize::MAX) else {
        panic!("an IterSource is always ready");
    };
    assert_eq!((batch.len(), batch.last()), (ONE_FETCH, Some(&1023)));
    let Poll::Ready(Some(Ok(batch))) = Pin::new(&mut source).poll_fetch(cx, 3) else {
        panic!("an IterSource is always ready");
    };
    assert_eq!(batch, [1024, 1025, 1026]);
    let mut source = StreamSource::new(futures::stream::iter(0..5_000u32));
    let Poll::Ready(Some(Ok(batch))) = Pin::new(&mut source).poll_fetch(cx, usize::MAX) else {
        panic!("a ready stream's fetch is ready");
    };
    assert_eq!(batch.len(), ONE_FETCH);
}

/// `max` 0 breaks `poll_fetch`'s contract (`max >= 1`; `prefetch` never asks for 0), but
/// must not pass for the end of the source: a caller that stops at `None` would lose every
/// item left. An in-memory source asked for 0 items answers an empty batch, takes nothing,
/// and still gives every item afterwards.
#[test]
fn a_fetch_asked_for_0_items_answers_an_empty_batch_not_the_end() {
    let cx = &mut Context::from_waker(Waker::noop());
    let mut source = IterSource::new(0..3u32);
    for _ in 0..2 {
        let fetched = Pin::new(&mut source).poll_fetch(cx, 0);
        assert!(
            matches!(&fetched, Poll::Ready(Some(Ok(b))) if b.is_empty()),
            "asked for 0: {fetched:?}"
        );
    }
    assert_eq!(source.size_hint(), (3, Some(3)), "nothing taken");
    let Poll::Ready(Some(Ok(batch))) = Pin::new(&mut source).poll_fetch(cx, 5) else {
        panic!("an IterSource is always ready");
    };
    assert_eq!(batch, [0, 1, 2]);
    let mut source = StreamSource::new(futures::stream::iter(0..3u32));
    let fetched = Pin::new(&mut source).poll_fetch(cx, 0);
    assert!(
        matches!(&fetched, Poll::Ready(Some(Ok(b))) if b.is_empty()),
        "asked for 0: {fetched:?}"
    );
    let Poll::Ready(Some(Ok(batch))) = Pin::new(&mut source).poll_fetch(cx, 5) else {
        panic!("a ready stream's fetch is ready");
    };
    assert_eq!(batch, [0, 1, 2]);
}

#[test]
fn a_stream_source_batch_keeps_no_room_for_items_that_were_not_ready() {
    // A prefetch in its steady state (a burst filled it, then items trickle in about as fast
    // as they are consumed) fetches at each poll from `low`, and each fetch takes the one item
    // that is ready: the buffer holds up to `low + 1` such batches, each kept whole until it
    // is drained. A batch that keeps room for `max` items makes that `(low + 1) * (high - low)`
    // slots for `high` items: 64 MiB for `Levels::new(1024, 512)` over 256-byte items. At
    // most twice what it holds, it keeps the prefetch within twice `high`.
    let cx = &mut Context::from_waker(Waker::noop());
    let (tx, rx) = futures::channel::mpsc::unbounded::<[u8; 256]>();
    let mut source = StreamSource::new(rx);
    for ready in [1, 3, 100, 511] {
        for _ in 0..ready {
            tx.unbounded_send([0; 256]).unwrap();
        }
        let Poll::Ready(Some(Ok(batch))) = Pin::new(&mut source).poll_fetch(cx, 512) else {
            panic!("a fetch with items ready is ready");
        };
        assert_eq!(batch.len(), ready);
        assert!(
            batch.capacity() <= 2 * ready,
            "{ready} items ready: the batch keeps room for {}",
            batch.capacity()
        );
    }
}

#[tokio::test]
async fn an_infallible_prefetch_yields_plain_items_and_keeps_its_buffer() {
    use futures::Stream;
    use futures::stream::FusedStream;
    let mut stream = prefetch(IterSource::new(0..10u32), levels(4, 1));
    assert_eq!(stream.levels(), levels(4, 1));
    // Part consumed through the `Result` stream, the rest as plain items: `items()` keeps the
    // fetched batch and the fetch state.
    assert_eq!(stream.next().await, Some(Ok(0)));
    assert_eq!(stream.queued(), 3);
    let mut items = stream.items();
    assert_eq!(items.queued(), 3);
    // 3 buffered, and at most the 6 the source says it has left.
    assert_eq!(items.size_hint(), (3, Some(9)));
    let rest: Vec<u32> = (&mut items).collect().await;
    assert_eq!(rest, (1..10).collect::<Vec<_>>());
    assert_eq!(items.size_hint(), (0, Some(0)));
    assert!(items.is_terminated());
    assert_eq!(items.next().await, None);
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
    let mut stream = pin!(prefetch(source, levels(10, 3)));
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
    let out: Vec<Result<u32, &str>> = prefetch(source, levels(4, 0)).collect().await;
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
    assert_eq!(demand.request(0), Err(RequestError::Zero));
    assert_eq!(demand.outstanding(), 0, "a refused request adds no credit");
    demand.request(UNBOUNDED).unwrap();
    demand.request(5).unwrap();
    assert_eq!(demand.outstanding(), UNBOUNDED);
    let source = || StreamSource::new(futures::stream::iter(0..1));
    let e = Levels::new(0, 0).unwrap_err();
    assert_eq!(
        (e.field(), e.kind()),
        ("levels.high", ConfigErrorKind::Zero)
    );
    let e = Levels::new(4, 4).unwrap_err();
    assert_eq!(
        (e.field(), e.kind()),
        ("levels.low", ConfigErrorKind::Inconsistent)
    );
    let e = Levels::new(2, 2).unwrap_err();
    assert_eq!(e.field(), "levels.low");
    let e = Prefetch::builder(source(), levels(4, 1))
        .retry_backoff(Duration::from_secs(2), Duration::from_secs(1))
        .build()
        .err()
        .unwrap();
    assert_eq!(
        (e.field(), e.kind()),
        ("prefetch.retry_backoff", ConfigErrorKind::Inconsistent)
    );
    let tracker = CommitTracker::new();
    let _t = tracker.track(5).unwrap();
    assert_eq!(
        tracker.track(5).err(),
        Some(TrackError::OutOfOrder { offset: 5, last: 5 })
    );
}

#[tokio::test]
async fn unbounded_demand_yields_everything() {
    let (s, _demand) = futures::stream::iter(0..1000).with_demand(UNBOUNDED);
    assert_eq!(s.count().await, 1000);
}

/// Credit used up by the last items of a source that has ended (a prefetch drained to the
/// end, an iterator: their `size_hint` says no item is left) ends the stream: the end needs
/// no demand (Reactive Streams §2.9: completion comes with or without a request), and
/// `collect` over exactly the credit's worth of items returns instead of waiting for ever.
#[tokio::test(start_paused = true)]
async fn credit_used_up_by_the_last_items_of_an_ended_source_ends_the_stream() {
    let (stream, demand) = futures::stream::iter(0..3).with_demand(3);
    let all = tokio::time::timeout(Duration::from_secs(5), stream.collect::<Vec<_>>()).await;
    assert_eq!(all.ok(), Some(vec![0, 1, 2]), "the stream ended");
    assert_eq!(demand.outstanding(), 0);

    let source = prefetch(IterSource::new(0..4u32), levels(8, 2)).items();
    let (mut stream, demand) = source.with_demand(4);
    for i in 0..4 {
        assert_eq!(stream.next().await, Some(i));
    }
    assert_eq!(poll!(stream.next()), Poll::Ready(None));
    assert!(futures::stream::FusedStream::is_terminated(&stream));
    assert_eq!(demand.outstanding(), 0);

    // A source that may have more (no upper bound) is not polled without credit.
    let (tx, rx) = flowgate::channel::bounded::<u32>(4).unwrap();
    tx.try_send(1).unwrap();
    let (mut stream, demand) = rx.with_demand(1);
    assert_eq!(stream.next().await, Some(1));
    tx.try_send(2).unwrap();
    assert!(poll!(stream.next()).is_pending(), "no credit for 2");
    assert_eq!(tx.len(), 1, "2 was not taken");
    demand.request(1).unwrap();
    assert_eq!(stream.next().await, Some(2));

    // An upstream whose `size_hint` says none is left but yields one anyway: the item waits
    // for credit, never more items than requested.
    struct Wrong(u32);
    impl futures::Stream for Wrong {
        type Item = u32;
        fn poll_next(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<u32>> {
            self.0 += 1;
            Poll::Ready((self.0 <= 2).then_some(self.0))
        }
        fn size_hint(&self) -> (usize, Option<usize>) {
            (0, Some(0))
        }
    }
    let (mut stream, demand) = Wrong(0).with_demand(0);
    assert!(poll!(stream.next()).is_pending(), "no credit");
    assert_eq!(futures::Stream::size_hint(&stream), (0, Some(1)));
    demand.request(5).unwrap();
    assert_eq!(stream.collect::<Vec<_>>().await, [1, 2]);
    assert_eq!(demand.outstanding(), 3);

    // Unwrapped while it holds one, the item is given back with the stream.
    let (mut stream, _demand) = Wrong(0).with_demand(0);
    assert!(poll!(stream.next()).is_pending(), "no credit");
    let (rest, held) = stream.into_parts();
    assert_eq!(held, Some(1), "the held item comes back");
    assert_eq!(rest.0, 1);
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
    let stream = Watermarks::builder(futures::stream::iter(0..100), levels(3, 1))
        .min_hold(Duration::from_millis(100))
        .build()
        .unwrap();
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
    let stream = Watermarks::builder(futures::stream::iter(0..10_000), levels(high, 1))
        .min_hold(Duration::from_secs(1))
        .build()
        .unwrap();
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
    let stream = Watermarks::builder(futures::stream::iter(0..10), levels(1, 0))
        .min_hold(Duration::MAX)
        .build()
        .unwrap();
    let signal = stream.pause_signal();
    let mut stream = pin!(stream);
    let (_, t) = stream.next().await.unwrap();
    assert!(signal.is_paused());
    drop(t);
    advance(Duration::from_secs(86_400)).await;
    assert!(poll!(stream.next()).is_pending(), "the resume is held back");
    assert!(signal.is_paused());
}

/// A resume held back by `min_hold` is applied by the wrapper's timer; with the wrapper
/// dropped (its consumer loop ended, the tickets still out) the tickets apply it: once the
/// work in flight is down to `low` the signal says resumed, and the signal closes after the
/// last ticket.
#[tokio::test(start_paused = true)]
async fn a_resume_held_back_when_the_wrapper_is_dropped_is_applied_by_the_tickets() {
    let mut stream = Watermarks::builder(futures::stream::iter(0..10), levels(3, 1))
        .min_hold(Duration::from_millis(100))
        .build()
        .unwrap();
    let mut signal = stream.pause_signal();
    let mut tickets = Vec::new();
    for _ in 0..3 {
        tickets.push(stream.next().await.unwrap().1);
    }
    assert_eq!(signal.changed().await, Some(Flow::Paused));
    drop(stream);
    tickets.truncate(1);
    advance(Duration::from_millis(200)).await;
    assert!(!signal.is_paused(), "1 in flight = low, past min_hold");
    assert_eq!(signal.changed().await, Some(Flow::Resumed));
    drop(tickets);
    assert_eq!(signal.changed().await, None, "no change can come");
    assert!(!signal.is_paused());
}

/// A prefetch knows its source has nothing left when the source says so (`BatchSource::
/// size_hint`: an `IterSource` over a range, a `StreamSource` over a stream that knows its
/// length), before the fetch after its last item: with `low` 0 it starts that fetch only
/// once the buffer is empty, so `with_demand` and `watermarks` over it, with credit or room
/// used up exactly by the last items, waited for one more unit that nothing would give.
#[tokio::test(start_paused = true)]
async fn a_prefetch_over_a_source_that_says_it_is_done_ends_what_is_built_on_it() {
    let five = Duration::from_secs(5);
    let items = prefetch(IterSource::new(0..3u32), levels(3, 0)).items();
    let (stream, _demand) = items.with_demand(3);
    let all = tokio::time::timeout(five, stream.collect::<Vec<_>>()).await;
    assert_eq!(all.ok(), Some(vec![0, 1, 2]), "with_demand ended");

    let stream = futures::stream::iter(0..3u32);
    let items = prefetch(StreamSource::new(stream), levels(3, 0)).items();
    let all = tokio::time::timeout(five, items.watermarks(levels(3, 0)).collect::<Vec<_>>());
    assert_eq!(all.await.map(|v| v.len()).ok(), Some(3), "watermarks ended");

    // The hint: what is buffered, and at most what the source may still give.
    let mut items = prefetch(IterSource::new(0..10u32), levels(4, 1)).items();
    assert_eq!(items.next().await, Some(0));
    assert_eq!(futures::Stream::size_hint(&items), (3, Some(9)));
}

/// A source that ends with `high` items in flight ends the stream: the wrapper, paused at
/// `high`, polls an upstream whose `size_hint` says no item is left for its end, so a
/// consumer that keeps its tickets until the end (`collect`) gets it instead of waiting for
/// ever; an upstream that may have more is not polled.
#[tokio::test(start_paused = true)]
async fn a_source_that_ends_with_high_items_in_flight_ends_the_stream() {
    let stream = futures::stream::iter(0..2).watermarks(levels(2, 0));
    let all = tokio::time::timeout(Duration::from_secs(5), stream.collect::<Vec<_>>()).await;
    assert_eq!(all.map(|v| v.len()).ok(), Some(2), "the stream ended");

    let (tx, rx) = flowgate::channel::bounded::<u32>(4).unwrap();
    tx.try_send(1).unwrap();
    let mut stream = rx.watermarks(levels(1, 0));
    let (_, ticket) = stream.next().await.unwrap();
    tx.try_send(2).unwrap();
    assert!(poll!(stream.next()).is_pending(), "paused at high");
    assert_eq!(tx.len(), 1, "2 was not taken");
    drop(ticket);
    assert_eq!(stream.next().await.map(|(i, _)| i), Some(2));

    // An upstream whose `size_hint` says none is left but yields one anyway: the item waits
    // for room, never more than `high` in flight.
    struct Wrong(u32);
    impl futures::Stream for Wrong {
        type Item = u32;
        fn poll_next(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<u32>> {
            self.0 += 1;
            Poll::Ready((self.0 <= 2).then_some(self.0))
        }
        fn size_hint(&self) -> (usize, Option<usize>) {
            (0, Some(0))
        }
    }
    let mut stream = Wrong(0).watermarks(levels(1, 0));
    let (first, ticket) = stream.next().await.unwrap();
    assert_eq!(first, 1);
    assert!(poll!(stream.next()).is_pending(), "paused at high");
    assert_eq!(stream.in_flight(), 1);
    assert_eq!(futures::Stream::size_hint(&stream), (1, Some(1)));
    drop(ticket);
    assert_eq!(stream.next().await.map(|(i, _)| i), Some(2));

    // Unwrapped while it holds one, the item is given back with the stream.
    let mut stream = Wrong(0).watermarks(levels(1, 0));
    let (_, ticket) = stream.next().await.unwrap();
    assert!(poll!(stream.next()).is_pending(), "paused at high");
    drop(ticket);
    let (rest, held) = stream.into_parts();
    assert_eq!(held, Some(2), "the held item comes back");
    assert_eq!(rest.0, 2);
}

/// A channel closed for sends (every sender dropped, or `Sender::close`) knows the most
/// items still to come: its `size_hint` says so, so `with_demand` and `watermarks` over it
/// see its end when the credit or the room was used up by its last items. Before, its
/// upper bound stayed unknown, and the stream waited for ever: `collect` over a channel
/// whose producers finished, with exactly the credit's (or `high`'s) worth of items, never
/// returned, as it did for an iterator before the end needed no demand.
#[tokio::test(start_paused = true)]
async fn a_closed_channel_ends_what_is_built_on_it_without_more_credit_or_room() {
    let five = Duration::from_secs(5);
    let (tx, rx) = flowgate::channel::bounded::<u32>(4).unwrap();
    for i in 0..3 {
        tx.try_send(i).unwrap();
    }
    assert_eq!(futures::Stream::size_hint(&rx), (3, None), "senders remain");
    drop(tx);
    assert_eq!(futures::Stream::size_hint(&rx), (3, Some(3)), "closed");
    let (stream, _demand) = rx.with_demand(3);
    let all = tokio::time::timeout(five, stream.collect::<Vec<_>>()).await;
    assert_eq!(all.ok(), Some(vec![0, 1, 2]), "with_demand ended");

    let (tx, rx) = flowgate::channel::bounded::<u32>(4).unwrap();
    tx.try_send(1).unwrap();
    tx.try_send(2).unwrap();
    tx.close();
    let all = tokio::time::timeout(five, rx.watermarks(levels(2, 0)).collect::<Vec<_>>());
    assert_eq!(all.await.map(|v| v.len()).ok(), Some(2), "watermarks ended");

    // A permit reserved before the close can still send: it counts as to come.
    let (tx, rx) = flowgate::channel::bounded::<u32>(4).unwrap();
    tx.try_send(1).unwrap();
    let permit = tx.reserve().await.unwrap();
    tx.close();
    assert_eq!(futures::Stream::size_hint(&rx), (1, Some(2)));
    let (mut stream, _demand) = rx.with_demand(1);
    assert_eq!(stream.next().await, Some(1));
    assert!(
        poll!(stream.next()).is_pending(),
        "the permit may still send"
    );
    drop(permit);
    assert_eq!(stream.next().await, None);
}

/// What the stream sees of a channel that closes while it waits: paused at `high` (or
/// without credit) the stream does not poll the channel, but reading its `size_hint` there
/// registered it to be woken at the end, so the close (the last sender dropped) wakes it,
/// and its next poll ends it, without a ticket dropped or more credit. (Before, the close
/// woke nothing and the end was seen only at the next poll a ticket or a request made.)
#[test]
fn a_channel_closed_while_the_stream_waits_wakes_it_and_ends_it() {
    let (waker, woken) = counting_waker();
    let mut cx = Context::from_waker(&waker);
    let woken = move || woken.load(Ordering::SeqCst);

    let (tx, rx) = flowgate::channel::bounded::<u32>(4).unwrap();
    tx.try_send(1).unwrap();
    let mut stream = rx.watermarks(levels(1, 0));
    let Poll::Ready(Some((1, ticket))) = stream.poll_next_unpin(&mut cx) else {
        panic!("1 was queued");
    };
    assert!(stream.poll_next_unpin(&mut cx).is_pending(), "paused, open");
    assert_eq!(woken(), 0);
    drop(tx);
    assert_eq!(futures::Stream::size_hint(stream.get_ref()), (0, Some(0)));
    assert_eq!(woken(), 1, "the close wakes the stream");
    assert!(matches!(stream.poll_next_unpin(&mut cx), Poll::Ready(None)));
    assert_eq!(stream.in_flight(), 1, "the end took no room");
    drop(ticket);

    let (tx, rx) = flowgate::channel::bounded::<u32>(4).unwrap();
    tx.try_send(1).unwrap();
    let (mut stream, demand) = rx.with_demand(1);
    assert_eq!(stream.poll_next_unpin(&mut cx), Poll::Ready(Some(1)));
    assert!(
        stream.poll_next_unpin(&mut cx).is_pending(),
        "no credit, open"
    );
    let before = woken();
    drop(tx);
    assert_eq!(woken(), before + 1, "the close wakes the stream");
    assert_eq!(stream.poll_next_unpin(&mut cx), Poll::Ready(None));
    assert_eq!(demand.outstanding(), 0, "the end used no credit");

    // Woken by the close, a stream whose channel still holds an item watches again: the
    // item waits for room, and the end comes after it.
    let (tx, rx) = flowgate::channel::bounded::<u32>(4).unwrap();
    tx.try_send(1).unwrap();
    let mut stream = rx.watermarks(levels(1, 0));
    let Poll::Ready(Some((1, ticket))) = stream.poll_next_unpin(&mut cx) else {
        panic!("1 was queued");
    };
    assert!(stream.poll_next_unpin(&mut cx).is_pending());
    tx.try_send(2).unwrap();
    let before = woken();
    drop(tx);
    assert_eq!(woken(), before + 1, "the close wakes the stream");
    assert!(
        stream.poll_next_unpin(&mut cx).is_pending(),
        "2 waits for room"
    );
    drop(ticket);
    let Poll::Ready(Some((2, ticket))) = stream.poll_next_unpin(&mut cx) else {
        panic!("2 comes with room");
    };
    assert!(matches!(stream.poll_next_unpin(&mut cx), Poll::Ready(None)));
    drop(ticket);
}

/// A channel that ends only after the stream built on it stopped pulling (paused at
/// `high`, or without credit) ends that stream: a consumer that keeps every ticket (or asks
/// for no more credit) until the end gets it. The producer drops its last sender (or closes
/// the channel) a second after its items were taken, another receiver takes the last item
/// of a closed channel, a permit reserved before the close is dropped unused: each is an
/// end the stream is woken for, with nothing but the channel to wake it.
#[tokio::test(start_paused = true)]
async fn a_channel_that_ends_while_the_stream_waits_wakes_it() {
    /// What `stream` ends with, run on a task of its own, if it ends within 5 s (a
    /// `timeout` around the stream itself would poll it once more as it expires, and see
    /// the end then).
    async fn ends<T: Send + 'static>(
        stream: impl std::future::Future<Output = T> + Send + 'static,
    ) -> Option<T> {
        let task = tokio::spawn(stream);
        let done = tokio::time::timeout(Duration::from_secs(5), task).await;
        done.ok().map(Result::unwrap)
    }
    for close in [false, true] {
        let (tx, rx) = flowgate::channel::bounded::<u32>(4).unwrap();
        tx.try_send(1).unwrap();
        tx.try_send(2).unwrap();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if close {
                tx.close();
                // A sender still alive: the close alone is the end.
                std::future::pending::<()>().await;
            }
        });
        let all = ends(rx.watermarks(levels(2, 0)).collect::<Vec<_>>()).await;
        assert_eq!(all.map(|v| v.len()), Some(2), "close: {close}");
    }

    let (tx, rx) = flowgate::channel::bounded::<u32>(4).unwrap();
    tx.try_send(1).unwrap();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        drop(tx);
    });
    let (stream, demand) = rx.with_demand(1);
    let all = ends(stream.collect::<Vec<_>>()).await;
    assert_eq!(all, Some(vec![1]), "with_demand ended");
    drop(demand);

    // Closed with an item left, which another receiver takes: that is the end.
    let (tx, rx) = flowgate::channel::bounded::<u32>(4).unwrap();
    let mut other = rx.clone();
    tx.try_send(1).unwrap();
    let consumer = ends(rx.watermarks(levels(1, 0)).collect::<Vec<_>>());
    let taker = async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        tx.try_send(2).unwrap();
        drop(tx);
        tokio::time::sleep(Duration::from_secs(1)).await;
        other.recv().await
    };
    let (all, taken) = tokio::join!(consumer, taker);
    assert_eq!(taken, Some(2));
    assert_eq!(all.map(|v| v.len()), Some(1), "the other's take ends it");

    // A permit reserved before the close and dropped unused after it.
    let (tx, rx) = flowgate::channel::bounded::<u32>(4).unwrap();
    tx.try_send(1).unwrap();
    let permit = tx.reserve().await.unwrap();
    tx.close();
    let consumer = ends(rx.watermarks(levels(1, 0)).collect::<Vec<_>>());
    let release = async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        drop(permit);
    };
    let (all, ()) = tokio::join!(consumer, release);
    assert_eq!(all.map(|v| v.len()), Some(1), "ended by the permit's drop");
}

/// Kafka commits the next offset to read: `committable() + 1`, as the tracker's docs say.
/// An offset of `u64::MAX` has no next one, and the tracker took it: the sum then
/// overflowed (a panic in a debug build; 0 in a release build, a commit that delivers the
/// whole partition again). `track` refuses it with a typed error, tracking nothing, so the
/// sum the docs give never overflows.
#[test]
fn an_offset_with_no_next_one_is_refused_so_the_commit_never_overflows() {
    let tracker = CommitTracker::new();
    tracker.track(u64::MAX - 1).unwrap().done();
    assert_eq!(tracker.committable().map(|o| o + 1), Some(u64::MAX));
    let refused = tracker.track(u64::MAX);
    let message = refused.as_ref().err().map(ToString::to_string);
    assert!(
        matches!(refused, Err(TrackError::NoNextOffset { offset: u64::MAX })),
        "u64::MAX has no next offset to commit"
    );
    assert!(
        message.is_some_and(|m| m.contains(&u64::MAX.to_string())),
        "the error names the offset"
    );
    drop(refused);
    assert_eq!(
        (tracker.pending(), tracker.dropped()),
        (0, 0),
        "nothing tracked"
    );
    assert_eq!(tracker.committable().map(|o| o + 1), Some(u64::MAX));
    // A fresh tracker too: not a matter of order.
    assert!(CommitTracker::new().track(u64::MAX).is_err());
}

fn counting_waker() -> (Waker, Arc<AtomicU64>) {
    struct Count(Arc<AtomicU64>);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let n = Arc::new(AtomicU64::new(0));
    (Arc::new(Count(n.clone())).into(), n)
}

#[tokio::test]
async fn watermarks_without_min_hold_follow_in_flight_at_once() {
    let mut stream = pin!(futures::stream::iter(0..10).watermarks(levels(2, 0)));
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

/// A waker with code of its own that takes the watermarks' lock: woken, it drops the ticket
/// it was given.
#[derive(Default)]
struct DropsTicket(Mutex<Option<Ticket>>);

impl DropsTicket {
    fn give(&self, ticket: Ticket) {
        *self.0.lock().unwrap() = Some(ticket);
    }
}

impl Wake for DropsTicket {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let ticket = self.0.lock().unwrap().take();
        drop(ticket);
    }
}

/// Runs `f` on a thread of its own and fails if it has not finished within 10 s, so that a
/// deadlock fails the test instead of hanging it.
fn with_watchdog(f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(10)) {
        Ok(()) => thread.join().unwrap(),
        Err(RecvTimeoutError::Disconnected) => {
            std::panic::resume_unwind(thread.join().unwrap_err())
        }
        Err(RecvTimeoutError::Timeout) => panic!("deadlock: a waker ran under the lock"),
    }
}

#[test]
fn pause_signal_waiters_are_woken_outside_the_lock() {
    with_watchdog(|| {
        block_on(async {
            let hold = Duration::from_millis(100);
            let mut stream = pin!(
                Watermarks::builder(futures::stream::iter(0..10), levels(3, 1))
                    .min_hold(hold)
                    .build()
                    .unwrap()
            );
            let mut signal = stream.pause_signal();
            let wake = Arc::new(DropsTicket::default());
            let waker = Waker::from(wake.clone());
            let mut cx = Context::from_waker(&waker);

            // The pause, sent as the item at `high` is handed out.
            let (_, a) = stream.next().await.unwrap();
            let (_, b) = stream.next().await.unwrap();
            let mut changed = Box::pin(signal.changed());
            assert!(changed.as_mut().poll(&mut cx).is_pending());
            wake.give(a);
            let (_, c) = stream.next().await.unwrap();
            assert_eq!(changed.await, Some(Flow::Paused));
            assert_eq!(stream.in_flight(), 2, "the waker dropped its ticket");

            // The resume, sent as a ticket is dropped.
            advance(hold).await;
            let mut changed = Box::pin(signal.changed());
            assert!(changed.as_mut().poll(&mut cx).is_pending());
            wake.give(c);
            drop(b);
            assert_eq!(changed.await, Some(Flow::Resumed));
            assert_eq!(stream.in_flight(), 0);

            // A pause held back by `min_hold`, sent when the wrapper is polled after it.
            let mut tickets = Vec::new();
            for _ in 0..3 {
                tickets.push(stream.next().await.unwrap().1);
            }
            assert!(!signal.is_paused(), "held back by min_hold");
            let mut changed = Box::pin(signal.changed());
            assert!(changed.as_mut().poll(&mut cx).is_pending());
            wake.give(tickets.remove(0));
            advance(hold).await;
            assert!(poll!(stream.next()).is_pending());
            assert_eq!(changed.await, Some(Flow::Paused));
            assert_eq!(stream.in_flight(), 2);
        });
    });
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
                    Err(TrackError::PendingFull { offset, oldest, max_pending: m }) => {
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
        Some(TrackError::PendingFull {
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

/// The message of a refused `track` counts the offset the commits wait for among the pending
/// ones: with `max_pending` 2 and offsets 1 and 2 pending, it said "2 offsets are pending
/// behind unfinished offset 1", where only offset 2 is behind it.
#[test]
fn a_full_tracker_says_how_many_offsets_it_holds_counting_the_oldest() {
    let tracker = CommitTracker::builder().max_pending(2).build().unwrap();
    let _a = tracker.track(1).unwrap();
    let _b = tracker.track(2).unwrap();
    let e = tracker.track(3).unwrap_err();
    assert_eq!(
        e.to_string(),
        "offset 3 not tracked: the tracker holds its 2 pending offsets, from unfinished \
         offset 1 on"
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

/// The tracker's metrics are recorded after its state is settled and its lock released, so
/// a recorder that panics (user code, like a hook) neither leaves an abandoned offset at the
/// head of `pending` (committable, but not committed past) nor skips waking `until_ready`
/// when the abandon made room: the waiter would wait for ever.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn a_panicking_recorder_leaves_the_tracker_settled_and_wakes_until_ready() {
    let recorder = support::TestRecorder::default();
    let tracker = metrics::with_local_recorder(&recorder, || {
        CommitTracker::builder().max_pending(1).build().unwrap()
    });
    let a = tracker.track(10).unwrap();
    let mut ready = pin!(tracker.until_ready());
    assert!(poll!(ready.as_mut()).is_pending(), "full");
    assert!(
        recorder.armed_while(|| a.abandon()),
        "the recorder's panic reached the caller"
    );
    assert_eq!(
        (
            tracker.committable(),
            tracker.pending(),
            tracker.abandoned()
        ),
        (Some(10), 0, 1)
    );
    assert!(
        poll!(ready.as_mut()).is_ready(),
        "the room the abandon made is announced"
    );
    tracker.track(11).unwrap().done();
    assert_eq!(tracker.committable(), Some(11));
}

/// A recorder that panics (user code) as `track` records the new offset in
/// `flowgate_demand_commit_pending` leaves the offset tracked with no token to finish it: it
/// holds the commits for good, as a token dropped unfinished does, and must be counted as
/// one, so that `dropped()` tells why the commits stopped.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn a_panicking_recorder_in_track_counts_the_offset_it_holds_as_dropped() {
    let recorder = support::TestRecorder::default();
    let tracker = metrics::with_local_recorder(&recorder, CommitTracker::new);
    tracker.track(9).unwrap().done();
    assert!(
        recorder.armed_while(|| drop(tracker.track(10))),
        "the recorder's panic reached the caller"
    );
    tracker.track(11).unwrap().done();
    assert_eq!(
        (tracker.committable(), tracker.pending(), tracker.dropped()),
        (Some(9), 2, 1),
        "offset 10 holds the commits, counted as a token dropped unfinished"
    );
}

/// The watermarks' gauges are recorded after their lock is released, and after the wrapper
/// is woken: a recorder that panics (user code) as a ticket is dropped neither leaves the
/// state paused with nothing in flight nor loses the wake of the wrapper waiting at `high`,
/// which would then wait for ever.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn a_panicking_recorder_leaves_the_watermarks_resumed_and_wakes_the_wrapper() {
    let recorder = support::TestRecorder::default();
    let mut stream = metrics::with_local_recorder(&recorder, || {
        futures::stream::iter(0..10).watermarks(levels(1, 0))
    });
    let signal = stream.pause_signal();
    let (_, ticket) = stream.next().await.unwrap();
    assert!(signal.is_paused());
    let next = tokio::spawn(async move { stream.next().await.map(|(i, _)| i) });
    tokio::task::yield_now().await; // the wrapper waits at high
    assert!(
        recorder.armed_while(|| drop(ticket)),
        "the recorder's panic reached the caller"
    );
    assert_eq!(signal.get(), Flow::Resumed, "nothing in flight: resumed");
    let next = tokio::time::timeout(Duration::from_secs(10), next).await;
    assert_eq!(next.expect("the wrapper was never woken").unwrap(), Some(1));
}

/// A recorder that panics (user code) as the watermarks count an item going out (its
/// ticket made, `flowgate_demand_in_flight` moved) loses no item: it stays with the
/// wrapper, whose next poll yields it (the ticket the panic dropped gave its place back).
/// The item, already taken from upstream, was dropped with the panic, counted nowhere.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn a_panicking_recorder_as_an_item_leaves_the_watermarks_loses_no_item() {
    use futures::FutureExt;
    let recorder = support::TestRecorder::default();
    let mut stream = metrics::with_local_recorder(&recorder, || {
        futures::stream::iter(0..3).watermarks(levels(2, 0))
    });
    assert!(
        recorder.armed_while(|| {
            let _ = stream.next().now_or_never();
        }),
        "the recorder's panic reached the caller"
    );
    assert_eq!(
        stream.in_flight(),
        0,
        "the ticket the panic dropped gave its place back"
    );
    let (first, ticket) = stream.next().await.unwrap();
    assert_eq!(first, 0, "0 was not lost");
    assert_eq!(stream.in_flight(), 1);
    drop(ticket);
    let rest: Vec<i32> = stream.map(|(i, _)| i).collect().await;
    assert_eq!(rest, [1, 2]);
}

/// A recorder that panics (user code) as a `with_demand` stream uses a unit of credit for
/// an item (`flowgate_demand_outstanding` moved) loses no item: it stays with the stream,
/// paid for, and the next poll yields it without using another unit. The item, already
/// taken from upstream, was dropped with the panic, counted nowhere.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn a_panicking_recorder_as_credit_is_used_loses_no_item() {
    use futures::FutureExt;
    let recorder = support::TestRecorder::default();
    let (mut stream, demand) =
        metrics::with_local_recorder(&recorder, || futures::stream::iter(0..3).with_demand(2));
    assert!(
        recorder.armed_while(|| {
            let _ = stream.next().now_or_never();
        }),
        "the recorder's panic reached the caller"
    );
    assert_eq!(stream.next().await, Some(0), "0 was not lost");
    assert_eq!(stream.next().await, Some(1));
    assert_eq!(demand.outstanding(), 0, "one unit of credit for each item");
    assert_eq!(stream.next().now_or_never(), None, "no credit left for 2");
}

/// A `with_demand` stream waiting for credit is woken by the request that gives it some
/// before the `flowgate_demand_outstanding` gauge is moved: a recorder that panics (user
/// code) as a request is recorded must not lose the wake. Lost, the stream would wait for
/// ever with credit to spend, since only a request that finds no credit left wakes it.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn a_panicking_recorder_on_a_request_still_wakes_the_stream_waiting_for_credit() {
    let recorder = support::TestRecorder::default();
    let (mut stream, demand) =
        metrics::with_local_recorder(&recorder, || futures::stream::iter(0..10).with_demand(0));
    let next = tokio::spawn(async move { stream.next().await });
    tokio::task::yield_now().await; // the stream waits for credit
    assert!(
        recorder.armed_while(|| demand.request(1).unwrap()),
        "the recorder's panic reached the caller"
    );
    assert_eq!(demand.outstanding(), 1, "the credit was added");
    let next = tokio::time::timeout(Duration::from_secs(10), next).await;
    assert_eq!(
        next.expect("the stream was never woken for its credit")
            .unwrap(),
        Some(0)
    );
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
async fn a_min_hold_from_the_builder_holds_the_first_resume() {
    let mut stream = Watermarks::builder(futures::stream::iter(0..10), levels(1, 0))
        .min_hold(Duration::from_millis(100))
        .build()
        .unwrap();
    let signal = stream.pause_signal();
    let (_, ticket) = stream.next().await.unwrap();
    assert!(signal.is_paused());
    drop(ticket);
    assert!(signal.is_paused(), "the resume waits for min_hold");
    assert!(poll!(stream.next()).is_pending());
    advance(Duration::from_millis(100)).await;
    assert_eq!(stream.next().await.map(|(i, _)| i), Some(1));
}

#[test]
fn the_watermarks_shorthand_and_builder_agree() {
    let stream = futures::stream::iter(0..10).watermarks(levels(2, 0));
    assert_eq!((stream.name(), stream.levels()), (None, levels(2, 0)));
    let named = Watermarks::builder(futures::stream::iter(0..10), levels(5, 3))
        .name(String::from("wm"))
        .build()
        .unwrap();
    assert_eq!((named.name(), named.levels()), (Some("wm"), levels(5, 3)));
    assert_eq!(named.in_flight(), 0);
}

#[cfg(feature = "metrics")]
#[tokio::test]
async fn a_named_watermarks_reports_under_its_name() {
    let recorder = support::TestRecorder::default();
    let mut stream = metrics::with_local_recorder(&recorder, || {
        Watermarks::builder(futures::stream::iter(0..10), levels(2, 0))
            .name("wm")
            .build()
            .unwrap()
    });
    let (_, a) = stream.next().await.unwrap();
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
                .build()
                .unwrap(),
            Prefetch::builder(IterSource::new(0..10), levels(4, 1))
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

/// The credit a `with_demand` stream takes for an item that never comes (the stream ended)
/// goes back to the handle; the `flowgate_demand_outstanding` gauge must say so too.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn the_outstanding_gauge_follows_credit_given_back_at_the_end() {
    use flowgate::demand::Demanded;
    let recorder = support::TestRecorder::default();
    let (mut credit, demand) = metrics::with_local_recorder(&recorder, || {
        Demanded::builder(futures::stream::iter(0..2), 5)
            .name("ends")
            .build()
            .unwrap()
    });
    assert_eq!(credit.by_ref().collect::<Vec<_>>().await, [0, 1]);
    assert_eq!(
        demand.outstanding(),
        3,
        "the unit taken for the end came back"
    );
    assert_eq!(
        recorder.gauge("flowgate_demand_outstanding{name=ends}"),
        Some(3.0),
        "the gauge shows the credit left"
    );
}

/// Unlimited credit is no count: a stream with [`UNBOUNDED`] credit (from the start or from a
/// request) must leave the `flowgate_demand_outstanding` series it shares with other
/// streams exact. It added `u64::MAX` to it, in which an `f64` cannot hold the others'
/// few units, and took it back when dropped: the series read 0 with 4 units left.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn unbounded_credit_leaves_a_shared_outstanding_gauge_exact() {
    use flowgate::demand::{Demanded, UNBOUNDED};
    let recorder = support::TestRecorder::default();
    let ((mut limited, _demand), (unlimited, _), (lifted, lift)) =
        metrics::with_local_recorder(&recorder, || {
            let stream = || futures::stream::iter(0..10);
            (
                Demanded::builder(stream(), 5).build().unwrap(),
                Demanded::builder(stream(), UNBOUNDED).build().unwrap(),
                Demanded::builder(stream(), 2).build().unwrap(),
            )
        });
    let gauge = "flowgate_demand_outstanding{name=default}";
    assert_eq!(
        recorder.gauge(gauge),
        Some(7.0),
        "5 + 2, the unbounded none"
    );
    lift.request(UNBOUNDED).unwrap();
    assert_eq!(
        recorder.gauge(gauge),
        Some(5.0),
        "the lifted stream's 2 left it"
    );
    assert_eq!(limited.next().await, Some(0));
    assert_eq!(recorder.gauge(gauge), Some(4.0));
    drop((unlimited, lifted));
    assert_eq!(
        recorder.gauge(gauge),
        Some(4.0),
        "the limited stream's credit"
    );
}

/// Credit finite but too large for an `f64` sum to hold beside a few units (`i64::MAX`, the
/// Reactive Streams "effectively unbounded") counts at most 2^32 in the shared
/// `flowgate_demand_outstanding` series, which stays exact: it read 9.2e18 for 7 + 2^63 − 1
/// and 0 with 7 units left once the large stream dropped.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn huge_finite_credit_leaves_a_shared_outstanding_gauge_exact() {
    use flowgate::demand::Demanded;
    let recorder = support::TestRecorder::default();
    let ((_small, _), (mut huge, _)) = metrics::with_local_recorder(&recorder, || {
        let stream = || futures::stream::iter(0..10);
        (
            Demanded::builder(stream(), 7).build().unwrap(),
            Demanded::builder(stream(), i64::MAX as u64)
                .build()
                .unwrap(),
        )
    });
    let gauge = "flowgate_demand_outstanding{name=default}";
    let cap = (1u64 << 32) as f64;
    assert_eq!(recorder.gauge(gauge), Some(7.0 + cap));
    assert_eq!(huge.next().await, Some(0), "a unit of the huge credit");
    assert_eq!(recorder.gauge(gauge), Some(7.0 + cap), "still over the cap");
    drop(huge);
    assert_eq!(
        recorder.gauge(gauge),
        Some(7.0),
        "the small stream's credit"
    );
}

/// A `with_demand` stream waiting on its upstream has yielded nothing for the credit it is
/// about to use: `outstanding` still counts that unit, and the stream dropped there (or taken
/// apart by `into_inner`) leaves the credit at exactly requested − yielded.
#[tokio::test]
async fn credit_for_an_item_not_yet_come_stays_outstanding_when_the_stream_waits_or_goes() {
    let (tx, rx) = futures::channel::mpsc::unbounded::<u32>();
    let (mut stream, demand) = rx.with_demand(2);
    tx.unbounded_send(0).unwrap();
    assert_eq!(stream.next().await, Some(0));
    assert!(
        poll!(stream.next()).is_pending(),
        "upstream has nothing yet"
    );
    assert_eq!(
        demand.outstanding(),
        1,
        "requested 2, yielded 1, waiting on upstream"
    );
    drop(stream);
    assert_eq!(demand.outstanding(), 1, "dropped while waiting on upstream");

    let (tx, rx) = futures::channel::mpsc::unbounded::<u32>();
    let (mut stream, demand) = rx.with_demand(1);
    assert!(
        poll!(stream.next()).is_pending(),
        "upstream has nothing yet"
    );
    let mut inner = stream.into_inner();
    tx.unbounded_send(7).unwrap();
    assert_eq!(
        inner.next().await,
        Some(7),
        "the item comes past the credit"
    );
    assert_eq!(
        demand.outstanding(),
        1,
        "taken apart while waiting: nothing came through the credit"
    );
}

/// The `flowgate_demand_outstanding` gauge of a `with_demand` stream dropped while it waits on
/// its upstream shows the credit left: requested − yielded.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn the_outstanding_gauge_keeps_the_unit_of_a_stream_dropped_while_waiting() {
    use flowgate::demand::Demanded;
    let recorder = support::TestRecorder::default();
    let (tx, rx) = futures::channel::mpsc::unbounded::<u32>();
    let (mut credit, demand) = metrics::with_local_recorder(&recorder, || {
        Demanded::builder(rx, 3).name("waits").build().unwrap()
    });
    let gauge = "flowgate_demand_outstanding{name=waits}";
    tx.unbounded_send(0).unwrap();
    assert_eq!(credit.next().await, Some(0));
    assert!(
        poll!(credit.next()).is_pending(),
        "upstream has nothing yet"
    );
    assert_eq!(recorder.gauge(gauge), Some(2.0), "waiting: 2 left");
    drop(credit);
    assert_eq!(demand.outstanding(), 2);
    assert_eq!(
        recorder.gauge(gauge),
        Some(2.0),
        "dropped while waiting: 2 left"
    );
}

/// Requests from two threads race each other: once both are done, the
/// `flowgate_demand_outstanding` gauge reads the credit left, whatever the order in which
/// the threads recorded their changes.
#[cfg(feature = "metrics")]
#[test]
fn the_outstanding_gauge_ends_at_the_credit_left_after_racing_requests() {
    use flowgate::demand::Demanded;
    const ROUNDS: usize = 200_000;
    let recorder = support::TestRecorder::default();
    let (_stream, demand) = metrics::with_local_recorder(&recorder, || {
        Demanded::builder(futures::stream::iter(0..1), 0)
            .name("race")
            .build()
            .unwrap()
    });
    let gauge = "flowgate_demand_outstanding{name=race}";
    let mut wrong = Vec::new();
    let theirs = demand.clone();
    support::lockstep(
        ROUNDS,
        move |start| {
            start();
            theirs.request(1).unwrap();
        },
        |start| {
            start();
            demand.request(1).unwrap();
        },
        |round| {
            let (credit, shown) = (demand.outstanding(), recorder.gauge(gauge));
            if shown != Some(credit as f64) {
                wrong.push((round, credit, shown));
            }
        },
    );
    assert_eq!(demand.outstanding(), 2 * ROUNDS as u64);
    assert!(
        wrong.is_empty(),
        "{} of {ROUNDS} rounds ended with the gauge off the credit left; the first (round, \
         credit, gauge): {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(3)]
    );
}

/// `flowgate_demand_buffered` is set when a batch lands. A consumer that has drained the
/// buffer and waits on a slow fetch, or a stream that has ended, must not keep showing the
/// batch that landed last: whenever `poll_next` returns `Pending` or `None`, nothing is
/// buffered.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn the_buffered_gauge_reads_zero_when_the_stream_starves_or_ends() {
    let recorder = support::TestRecorder::default();
    let (tx, rx) = futures::channel::mpsc::unbounded();
    for i in 0..4u32 {
        tx.unbounded_send(i).unwrap();
    }
    let mut stream = metrics::with_local_recorder(&recorder, || {
        Prefetch::builder(StreamSource::new(rx), levels(4, 1))
            .name("starved")
            .build()
            .unwrap()
            .items()
    });
    let gauge = "flowgate_demand_buffered{name=starved}";
    let mut got = Vec::new();
    for _ in 0..4 {
        got.push(stream.next().await.unwrap());
    }
    assert_eq!(got, [0, 1, 2, 3]);
    assert!(
        poll!(stream.next()).is_pending(),
        "the refill waits on the source"
    );
    assert_eq!(stream.queued(), 0);
    assert_eq!(
        recorder.gauge(gauge),
        Some(0.0),
        "starved: nothing buffered"
    );
    drop(tx);
    assert_eq!(stream.next().await, None);
    assert_eq!(recorder.gauge(gauge), Some(0.0), "ended: nothing buffered");
}

/// A `Prefetch` dropped with items buffered takes its share of `flowgate_demand_buffered`
/// back (the items are gone with it), and leaves the share of another stream of the same
/// name in place.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn a_dropped_prefetch_takes_its_buffered_gauge_back() {
    let recorder = support::TestRecorder::default();
    let build = || {
        metrics::with_local_recorder(&recorder, || {
            Prefetch::builder(IterSource::new(0..10u32), levels(4, 1))
                .name("dropped")
                .build()
                .unwrap()
                .items()
        })
    };
    let (mut a, mut b) = (build(), build());
    let gauge = "flowgate_demand_buffered{name=dropped}";
    assert_eq!(a.next().await, Some(0));
    assert_eq!(b.next().await, Some(0));
    assert_eq!(recorder.gauge(gauge), Some(8.0), "two batches of 4 landed");
    drop(a);
    assert_eq!(recorder.gauge(gauge), Some(4.0), "b's batch is left");
    let _ = b.into_inner(); // taken apart: its buffered items are discarded
    assert_eq!(recorder.gauge(gauge), Some(0.0));
}

/// Two trackers of one name report into one series: the pending gauge is the sum of their
/// pending offsets (neither overwrites the other's), and a tracker gone takes its share back.
#[cfg(feature = "metrics")]
#[test]
fn trackers_sharing_a_name_sum_their_pending_offsets() {
    let recorder = support::TestRecorder::default();
    let build = || {
        metrics::with_local_recorder(&recorder, || {
            CommitTracker::builder().name("p0").build().unwrap()
        })
    };
    let (a, b) = (build(), build());
    let gauge = "flowgate_demand_commit_pending{name=p0}";
    let a1 = a.track(1).unwrap();
    let a2 = a.track(2).unwrap();
    let b1 = b.track(1).unwrap();
    assert_eq!(recorder.gauge(gauge), Some(3.0));
    a2.done();
    assert_eq!(recorder.gauge(gauge), Some(3.0), "2 waits behind 1");
    a1.done();
    assert_eq!(recorder.gauge(gauge), Some(1.0), "b's offset is left");
    b1.abandon();
    assert_eq!(recorder.gauge(gauge), Some(0.0));
    let b2 = b.track(2).unwrap();
    drop(b);
    assert_eq!(recorder.gauge(gauge), Some(1.0), "its token keeps b alive");
    drop(b2);
    assert_eq!(
        recorder.gauge(gauge),
        Some(0.0),
        "b gone: its share is taken back"
    );
}

/// A fetch error is yielded after the buffered items, from an empty buffer: the
/// `flowgate_demand_buffered` gauge must not keep showing the batch that landed last while
/// the consumer handles the error (or stops on it).
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn the_buffered_gauge_reads_zero_when_a_fetch_error_is_yielded() {
    struct Failing(u32);
    impl BatchSource for Failing {
        type Item = u32;
        type Error = &'static str;
        fn poll_fetch(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            max: usize,
        ) -> flowgate::demand::Fetched<u32, &'static str> {
            self.0 += 1;
            Poll::Ready(match self.0 {
                1 => Some(Ok(vec![7; max])),
                _ => Some(Err("broker down")),
            })
        }
    }
    let recorder = support::TestRecorder::default();
    let mut stream = metrics::with_local_recorder(&recorder, || {
        Prefetch::builder(Failing(0), levels(4, 1))
            .name("failing")
            .build()
            .unwrap()
    });
    let gauge = "flowgate_demand_buffered{name=failing}";
    for _ in 0..4 {
        assert_eq!(stream.next().await, Some(Ok(7)));
    }
    assert_eq!(stream.next().await, Some(Err("broker down")));
    assert_eq!(stream.queued(), 0);
    assert_eq!(
        recorder.gauge(gauge),
        Some(0.0),
        "the error came from an empty buffer"
    );
}

#[test]
fn prefetch_builder_validates_everything() {
    let source = || IterSource::new(0..1);
    // The levels are checked by `Levels::new` (see `bad_requests_and_configs_are_typed_errors`);
    // the builder checks the rest.
    let e = Prefetch::builder(source(), levels(4, 1))
        .retry_backoff(Duration::from_secs(2), Duration::from_secs(1))
        .build()
        .err()
        .unwrap();
    assert_eq!(e.field(), "prefetch.retry_backoff");
}

#[cfg(feature = "redis")]
#[path = "demand/redis_streams.rs"]
mod redis_streams;

#[cfg(feature = "metrics")]
#[path = "demand/panics.rs"]
mod panics;

#[cfg(all(feature = "redis", feature = "metrics"))]
#[path = "demand/journey.rs"]
mod journey;

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
    send_sync::<RequestError>();
    send_sync::<TrackError>();
    send_sync::<Levels>();
    send_sync::<Prefetch<IterSource<std::ops::Range<u32>>, flowgate::demand::Items>>();
    send_sync::<flowgate::demand::WatermarksBuilder<Items>>();
    fn unpin<T: Unpin>() {}
    unpin::<Prefetch<IterSource<std::ops::Range<u32>>>>();
    unpin::<Prefetch<IterSource<std::ops::Range<u32>>, flowgate::demand::Items>>();
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

/// A source with nothing new answers at once with an empty batch (a non-blocking poll of a
/// queue or a paged API); after `ready_at` it has one item, then ends. Counts its fetches
/// and refuses to be spun on.
struct EmptyUntil {
    origin: tokio::time::Instant,
    ready_at: Duration,
    served: bool,
    fetches: Arc<Mutex<u32>>,
}

impl BatchSource for EmptyUntil {
    type Item = u32;
    type Error = std::convert::Infallible;

    fn poll_fetch(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        _max: usize,
    ) -> Poll<Option<Result<Vec<u32>, std::convert::Infallible>>> {
        let mut fetches = self.fetches.lock().unwrap();
        *fetches += 1;
        assert!(
            *fetches < 1_000,
            "fetched {fetches} times: spun on an empty source"
        );
        drop(fetches);
        if self.served {
            return Poll::Ready(None);
        }
        if self.origin.elapsed() < self.ready_at {
            return Poll::Ready(Some(Ok(Vec::new())));
        }
        self.served = true;
        Poll::Ready(Some(Ok(vec![7])))
    }
}

/// An empty batch from a source that answered at once waits the retry backoff before the
/// next fetch (10 ms, doubling): a loop over an idle non-blocking source does not spin (in
/// paused time it would keep the clock from ever moving).
#[tokio::test(start_paused = true)]
async fn an_empty_batch_answered_at_once_backs_off_before_the_next_fetch() {
    let fetches = Arc::new(Mutex::new(0));
    let origin = tokio::time::Instant::now();
    let source = EmptyUntil {
        origin,
        ready_at: Duration::from_millis(500),
        served: false,
        fetches: fetches.clone(),
    };
    let consumer = tokio::spawn(async move {
        let items: Vec<u32> = prefetch(source, levels(4, 0)).items().collect().await;
        (items, origin.elapsed())
    });
    let (items, at) = consumer
        .await
        .expect("the consumer spun on the empty source");
    assert_eq!(items, [7]);
    // Fetches at 0, 10, 30, 70, 150, 310 ms (empty), 630 ms (the item), then the end.
    assert_eq!(at, Duration::from_millis(630));
    assert_eq!(*fetches.lock().unwrap(), 8);
}

/// A source that waited (a blocking poll that timed out) and then answered empty is asked
/// again at once: it paced itself.
struct BlockingEmpty {
    wait: Pin<Box<tokio::time::Sleep>>,
    empty: u32,
}

impl BatchSource for BlockingEmpty {
    type Item = u32;
    type Error = std::convert::Infallible;

    fn poll_fetch(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        _max: usize,
    ) -> Poll<Option<Result<Vec<u32>, std::convert::Infallible>>> {
        if self.empty == u32::MAX {
            return Poll::Ready(None);
        }
        std::task::ready!(self.wait.as_mut().poll(cx));
        let next = tokio::time::Instant::now() + Duration::from_millis(100);
        self.wait.as_mut().reset(next);
        if self.empty > 0 {
            self.empty -= 1;
            return Poll::Ready(Some(Ok(Vec::new())));
        }
        self.empty = u32::MAX;
        Poll::Ready(Some(Ok(vec![1])))
    }
}

#[tokio::test(start_paused = true)]
async fn an_empty_batch_after_a_wait_is_fetched_again_at_once() {
    let origin = tokio::time::Instant::now();
    let source = BlockingEmpty {
        wait: Box::pin(tokio::time::sleep(Duration::from_millis(100))),
        empty: 5,
    };
    let items: Vec<u32> = prefetch(source, levels(4, 0)).items().collect().await;
    assert_eq!(items, [1]);
    // Five empty answers after 100 ms each, the item after the sixth wait: no backoff on top.
    assert_eq!(origin.elapsed(), Duration::from_millis(600));
}

/// A source that keeps a fetch in progress across polls, as `RedisStreamSource` does: the
/// batch it returns is as large as the `max` that fetch started with, whatever `max` the
/// call that finishes it passes. It answers every other poll, yields `next..end`, then ends.
struct KeepsItsFetch {
    started: Option<usize>,
    polls: u32,
    next: u32,
    end: u32,
}

impl BatchSource for KeepsItsFetch {
    type Item = u32;
    type Error = std::convert::Infallible;

    fn poll_fetch(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        max: usize,
    ) -> Poll<Option<Result<Vec<u32>, std::convert::Infallible>>> {
        if self.next == self.end {
            return Poll::Ready(None);
        }
        let max = *self.started.get_or_insert(max);
        self.polls += 1;
        if self.polls % 2 == 1 {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        self.started = None;
        let from = self.next;
        self.next = (from + max as u32).min(self.end);
        Poll::Ready(Some(Ok((from..self.next).collect())))
    }
}

/// A source may answer with more than `max` items: one taken out of a stream with
/// `into_inner` while a fetch was in progress (it started that fetch for the old stream's
/// `high`) and put behind a stream of a smaller `high`. Every item is yielded, in order:
/// none is lost with a panic, none is cut off.
#[tokio::test]
async fn a_batch_larger_than_asked_for_is_kept_whole() {
    let source = KeepsItsFetch {
        started: None,
        polls: 0,
        next: 0,
        end: 20,
    };
    let mut wide = prefetch(source, levels(8, 0)).items();
    assert!(poll!(wide.next()).is_pending(), "a fetch of 8 in progress");
    let mut narrow = prefetch(wide.into_inner(), levels(2, 0)).items();
    assert_eq!(narrow.next().await, Some(0));
    assert_eq!(
        narrow.queued(),
        7,
        "the 8 fetched for the wide stream, all kept: above `high` until consumed"
    );
    let rest: Vec<u32> = narrow.collect().await;
    assert_eq!(rest, (1..20).collect::<Vec<_>>());
}

/// `0, 1, 2, …` in batches of at most `chunk` items, never ending: a prefetch over it holds
/// a batch being handed out and batches queued behind it.
#[cfg(feature = "metrics")]
struct Chunks {
    next: u32,
    chunk: usize,
}

#[cfg(feature = "metrics")]
impl BatchSource for Chunks {
    type Item = u32;
    type Error = std::convert::Infallible;

    fn poll_fetch(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        max: usize,
    ) -> Poll<Option<Result<Vec<u32>, std::convert::Infallible>>> {
        let from = self.next;
        self.next += max.min(self.chunk) as u32;
        Poll::Ready(Some(Ok((from..self.next).collect())))
    }
}

/// The items a `Prefetch` lets go of, as its `on_drop` hook saw them.
#[cfg(feature = "metrics")]
type Seen = Arc<Mutex<Vec<(u32, &'static str)>>>;

/// A prefetch over `Chunks` of 3 with levels (8, 6), named `name`, with a hook that records
/// what it sees in `seen` (none if `seen` is `None`), built under `recorder`; two items
/// taken: 2 is left in the current batch and 3, 4, 5 are queued behind it.
#[cfg(feature = "metrics")]
async fn holding_2_to_5(
    recorder: &support::TestRecorder,
    name: &str,
    seen: Option<Seen>,
) -> Prefetch<Chunks, flowgate::demand::Items> {
    let mut stream = metrics::with_local_recorder(recorder, || {
        let builder = Prefetch::builder(Chunks { next: 0, chunk: 3 }, levels(8, 6)).name(name);
        match seen {
            Some(seen) => builder.on_drop(move |item: u32, why: &flowgate::Dropped| {
                seen.lock().unwrap().push((item, why.as_str()))
            }),
            None => builder,
        }
        .build()
        .unwrap()
        .items()
    });
    assert_eq!(stream.next().await, Some(0));
    assert_eq!(stream.next().await, Some(1));
    assert_eq!(stream.queued(), 4, "2, then 3..6 queued");
    stream
}

#[cfg(feature = "metrics")]
fn discarded(item: u32) -> (u32, &'static str) {
    (item, "discarded")
}

/// A metrics recorder panicking as a dropped `Prefetch` counts its buffered items keeps
/// none of them from the hook: the panic goes on once the hook has them all.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn a_recorder_panicking_as_a_dropped_prefetch_counts_its_items_keeps_none_from_the_hook() {
    let recorder = support::TestRecorder::default();
    let seen = Seen::default();
    let stream = holding_2_to_5(&recorder, "panicky", Some(seen.clone())).await;
    recorder.panic_on("flowgate_demand_discarded_total{name=panicky}", true);
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(stream)));
    assert!(unwound.is_err(), "the recorder's panic goes on");
    assert_eq!(
        *seen.lock().unwrap(),
        (2..6).map(discarded).collect::<Vec<_>>(),
        "every buffered item reaches the hook"
    );
}

/// Items still buffered when a `Prefetch` is dropped go to its `on_drop` hook, every one, in
/// the order the stream would have yielded them (the current batch, then the queued ones),
/// and are counted in `flowgate_demand_discarded_total`; the buffered gauge reads 0.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn a_dropped_prefetch_passes_its_buffered_items_to_the_hook_and_counts_them() {
    let recorder = support::TestRecorder::default();
    let seen = Seen::default();
    let stream = holding_2_to_5(&recorder, "dropped", Some(seen.clone())).await;
    assert_eq!(
        recorder.counter("flowgate_demand_discarded_total{name=dropped}"),
        0
    );
    drop(stream);
    assert_eq!(
        *seen.lock().unwrap(),
        (2..6).map(discarded).collect::<Vec<_>>()
    );
    assert_eq!(
        recorder.counter("flowgate_demand_discarded_total{name=dropped}"),
        4
    );
    assert_eq!(
        recorder.gauge("flowgate_demand_buffered{name=dropped}"),
        Some(0.0)
    );
}

/// `into_inner` discards the buffered items as a drop does (to the hook, counted), and hands
/// back the source where its last fetch left it.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn into_inner_passes_the_buffered_items_to_the_hook_and_counts_them() {
    let recorder = support::TestRecorder::default();
    let seen = Seen::default();
    let stream = holding_2_to_5(&recorder, "taken-apart", Some(seen.clone())).await;
    let source = stream.into_inner();
    assert_eq!(source.next, 6, "the source goes on after what was fetched");
    assert_eq!(
        *seen.lock().unwrap(),
        (2..6).map(discarded).collect::<Vec<_>>()
    );
    assert_eq!(
        recorder.counter("flowgate_demand_discarded_total{name=taken-apart}"),
        4
    );
}

/// Without a hook the discarded items are counted all the same; a stream that held nothing
/// counts nothing.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn items_discarded_without_a_hook_are_counted() {
    let recorder = support::TestRecorder::default();
    drop(holding_2_to_5(&recorder, "no-hook", None).await);
    assert_eq!(
        recorder.counter("flowgate_demand_discarded_total{name=no-hook}"),
        4
    );
    let mut drained = metrics::with_local_recorder(&recorder, || {
        Prefetch::builder(IterSource::new(0..3u32), levels(4, 1))
            .name("drained")
            .build()
            .unwrap()
            .items()
    });
    assert_eq!((&mut drained).collect::<Vec<_>>().await, [0, 1, 2]);
    drop(drained);
    assert_eq!(
        recorder.counter("flowgate_demand_discarded_total{name=drained}"),
        0
    );
}

/// A hook that panics on the second item panics the drop; every item was counted before
/// the hook saw the first, the gauge reads 0, and the items after the panic are dropped
/// (not leaked) without the hook.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn a_panicking_hook_leaves_every_discarded_item_counted() {
    let recorder = support::TestRecorder::default();
    let alive = Arc::new(());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let hook_seen = seen.clone();
    let mut stream = metrics::with_local_recorder(&recorder, || {
        let alive = alive.clone();
        let source = IterSource::new((0..10u32).map(move |i| (i, alive.clone())));
        Prefetch::builder(source, levels(6, 1))
            .name("panicky")
            .on_drop(move |(item, _): (u32, Arc<()>), _: &flowgate::Dropped| {
                hook_seen.lock().unwrap().push(item);
                assert_ne!(item, 2, "the hook panics on 2");
            })
            .build()
            .unwrap()
            .items()
    });
    assert_eq!(stream.next().await.map(|(i, _)| i), Some(0));
    assert_eq!(
        Arc::strong_count(&alive),
        7,
        "1..6 buffered, the source's, ours"
    );
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(stream)));
    assert!(unwound.is_err(), "the hook's panic reached the drop");
    assert_eq!(*seen.lock().unwrap(), [1, 2]);
    assert_eq!(
        recorder.counter("flowgate_demand_discarded_total{name=panicky}"),
        5,
        "all 5 counted before the hook ran"
    );
    assert_eq!(
        recorder.gauge("flowgate_demand_buffered{name=panicky}"),
        Some(0.0)
    );
    assert_eq!(Arc::strong_count(&alive), 1, "3, 4, 5 dropped, not leaked");
}

/// A source that fails at once until another task restores it (a reconnect task, say), then
/// yields one item and ends; it gives up after 1 000 fetches so a test that spins ends.
struct DownUntilRestored {
    restored: Arc<std::sync::atomic::AtomicBool>,
    fetches: u32,
    served: bool,
}

impl BatchSource for DownUntilRestored {
    type Item = u32;
    type Error = &'static str;

    fn poll_fetch(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        _max: usize,
    ) -> Poll<Option<Result<Vec<u32>, &'static str>>> {
        self.fetches += 1;
        if self.served || self.fetches >= 1_000 {
            return Poll::Ready(None);
        }
        if !self.restored.load(std::sync::atomic::Ordering::SeqCst) {
            return Poll::Ready(Some(Err("down")));
        }
        self.served = true;
        Poll::Ready(Some(Ok(vec![7])))
    }
}

/// With a zero retry backoff a failed fetch is retried at once, but after yielding to the
/// executor, as after an empty batch: a consumer that logs errors and goes on must let the
/// runtime's other tasks run (here the one that restores the source).
#[tokio::test]
async fn a_failed_fetch_without_backoff_is_retried_after_yielding_to_the_executor() {
    let restored = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let restorer = tokio::spawn({
        let restored = restored.clone();
        async move { restored.store(true, std::sync::atomic::Ordering::SeqCst) }
    });
    let source = DownUntilRestored {
        restored,
        fetches: 0,
        served: false,
    };
    let mut stream = Prefetch::builder(source, levels(4, 0))
        .retry_backoff(Duration::ZERO, Duration::ZERO)
        .build()
        .unwrap();
    let (mut items, mut errors) = (Vec::new(), 0);
    while let Some(next) = stream.next().await {
        match next {
            Ok(item) => items.push(item),
            Err(_) => errors += 1,
        }
    }
    restorer.await.unwrap();
    assert_eq!(
        (items, errors),
        (vec![7], 1),
        "the consumer never let the restoring task run"
    );
}

/// A worker that panics drops its commit token unfinished, the case the token is documented
/// for; with a metrics recorder that panics on every call, the token's drop panicked while
/// the worker's panic unwound, and the process aborted. The recorder's panic is dropped
/// instead, and the offset holds the commit as documented.
#[cfg(feature = "metrics")]
#[test]
fn a_panicking_recorder_does_not_abort_a_token_dropped_by_unwinding() {
    let recorder = support::TestRecorder::default();
    let tracker = metrics::with_local_recorder(&recorder, || {
        CommitTracker::builder().name("p0").build().unwrap()
    });
    let token = tracker.track(7).unwrap();
    let ids = [
        "flowgate_demand_commit_dropped_total{name=p0}",
        "flowgate_demand_commit_pending{name=p0}",
    ];
    for id in ids {
        recorder.panic_on(id, true);
    }
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _token = token;
        panic!("the worker failed");
    }));
    for id in ids {
        recorder.panic_on(id, false);
    }
    let first = unwound.expect_err("the worker panicked");
    assert_eq!(first.downcast_ref::<&str>(), Some(&"the worker failed"));
    assert_eq!((tracker.dropped(), tracker.committable()), (1, None));
    assert_eq!(tracker.pending(), 1);
}

/// An upstream whose `size_hint` says no item is left, but which yields two anyway: polled
/// for its end by `with_demand` without credit, or by `watermarks` when paused, its item is
/// held for credit or room.
#[cfg(feature = "metrics")]
struct WrongHint(u32);

#[cfg(feature = "metrics")]
impl futures::Stream for WrongHint {
    type Item = u32;
    fn poll_next(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<u32>> {
        self.0 += 1;
        Poll::Ready((self.0 <= 2).then_some(self.0))
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(0))
    }
}

/// "Nothing is dropped silently": the item `with_demand` holds for credit, or `watermarks`
/// for room (one a wrong `size_hint` let through), is counted in
/// `flowgate_demand_discarded_total` when the stream lets go of it (dropped, or taken apart
/// with `into_inner`), as `Prefetch` counts its buffered items; one `into_parts` hands back
/// is not. It was dropped without a trace.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn an_item_held_for_credit_or_room_is_counted_when_let_go_of() {
    let recorder = support::TestRecorder::default();
    let count =
        |name: &str| recorder.counter(&format!("flowgate_demand_discarded_total{{name={name}}}"));
    let demanded = |name: &'static str| {
        metrics::with_local_recorder(&recorder, || {
            flowgate::demand::Demanded::builder(WrongHint(0), 0)
                .name(name)
                .build()
                .unwrap()
        })
    };
    let paused = |name: &'static str| {
        metrics::with_local_recorder(&recorder, || {
            Watermarks::builder(WrongHint(0), levels(1, 0))
                .name(format!("room-{name}"))
                .build()
                .unwrap()
        })
    };
    // Each way of letting go, for both: dropped, `into_inner` (counted), `into_parts` (the
    // item handed back, not counted).
    for (name, end) in [("dropped", 0), ("into-inner", 1), ("into-parts", 2)] {
        let (mut credit, _demand) = demanded(name);
        assert!(poll!(credit.next()).is_pending(), "no credit");
        let mut room = paused(name);
        let (first, _ticket) = room.next().await.unwrap();
        assert_eq!(first, 1);
        assert!(poll!(room.next()).is_pending(), "paused at high");
        assert_eq!(
            [
                futures::Stream::size_hint(&credit),
                futures::Stream::size_hint(&room)
            ],
            [(0, Some(1)), (1, Some(1))],
            "one held each"
        );
        match end {
            0 => drop((credit, room)),
            1 => assert_eq!((credit.into_inner().0, room.into_inner().0), (1, 2)),
            _ => assert_eq!(
                (credit.into_parts().1, room.into_parts().1),
                (Some(1), Some(2)),
                "handed back"
            ),
        }
        let counted = u64::from(end < 2);
        assert_eq!(count(name), counted, "with_demand, {name}");
        assert_eq!(
            count(&format!("room-{name}")),
            counted,
            "watermarks, {name}"
        );
    }
}

/// A consumer loop on a multi-thread runtime: `prefetch` → `watermarks` → one task per
/// record, finishing in any order on any thread, some records given up. Every offset comes
/// once, in-flight never passes `high`, the commit ends at the last offset with nothing
/// pending, and the signal ends resumed with nothing in flight.
#[test]
fn a_consumer_loop_across_threads_commits_everything_in_order() {
    const N: u64 = 5_000;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .build()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        rt.block_on(async {
            let tracker = CommitTracker::builder().max_pending(64).build().unwrap();
            let mut stream = pin!(
                prefetch(IterSource::new(0..N), levels(32, 8))
                    .items()
                    .watermarks(levels(16, 4))
            );
            let signal = stream.pause_signal();
            let now = Arc::new(AtomicU64::new(0));
            let most = Arc::new(AtomicU64::new(0));
            let mut tasks = Vec::new();
            while let Some((offset, ticket)) = stream.next().await {
                tracker.until_ready().await;
                let token = tracker.track(offset).unwrap();
                let (now, most) = (now.clone(), most.clone());
                tasks.push(tokio::spawn(async move {
                    most.fetch_max(now.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
                    for _ in 0..offset % 7 {
                        tokio::task::yield_now().await;
                    }
                    now.fetch_sub(1, Ordering::SeqCst);
                    if offset % 97 == 0 {
                        token.abandon();
                    } else {
                        token.done();
                    }
                    drop(ticket);
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
            let seen = (
                tracker.committable(),
                tracker.pending(),
                tracker.abandoned(),
                most.load(Ordering::SeqCst) <= 16,
                stream.in_flight(),
                signal.get(),
            );
            tx.send(seen).unwrap();
        });
    });
    let seen = rx.recv_timeout(Duration::from_secs(60)).expect("no hang");
    assert_eq!(
        seen,
        (Some(N - 1), 0, N.div_ceil(97), true, 0, Flow::Resumed)
    );
}

/// Downstream stops asking (no credit) with a resume held back by `min_hold`: the wrapper,
/// not polled, cannot apply it then, but nothing is stuck: asked again, the stream waits out
/// the hold, resumes and goes on to the end, with nothing left in flight.
#[tokio::test(start_paused = true)]
async fn watermarks_behind_with_demand_resume_when_downstream_asks_again() {
    let hold = Duration::from_millis(100);
    let room = Watermarks::builder(futures::stream::iter(0..6u32), levels(2, 0))
        .min_hold(hold)
        .build()
        .unwrap();
    let signal = room.pause_signal();
    let (mut stream, demand) = room.with_demand(2);
    let (_, a) = stream.next().await.unwrap();
    let (_, b) = stream.next().await.unwrap();
    assert!(signal.is_paused());
    assert!(poll!(stream.next()).is_pending(), "no credit");
    drop((a, b));
    advance(hold / 2).await;
    assert!(signal.is_paused(), "the resume waits for min_hold");
    demand.request(UNBOUNDED).unwrap();
    let start = tokio::time::Instant::now();
    let rest: Vec<u32> = (&mut stream).map(|(i, _ticket)| i).collect().await;
    assert_eq!(rest, [2, 3, 4, 5]);
    assert!(start.elapsed() <= hold, "waited {:?}", start.elapsed());
    assert_eq!(stream.get_ref().in_flight(), 0);
    assert!(!signal.is_paused());
}
