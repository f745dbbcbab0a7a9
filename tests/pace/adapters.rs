//! The adapters built on the pacer, at their edges: how often a cost closure runs, what
//! a sink sends after its inner sink stalled, pacing through the adapters after a long
//! idle spell and at 1M/s, a sink closed while it waited for the pacer.

use super::*;

use std::future::Future;
use std::pin::Pin;
use std::task::Context;

use futures::Sink;
use tokio::time::Sleep;

/// The cost closure is asked once per item: an item that waits for the pacer through
/// several polls is not weighed again at each (a closure that tallies what it weighs, as
/// a byte meter does, counts each item once).
#[tokio::test(start_paused = true)]
async fn a_cost_closure_runs_once_per_item() {
    let weighed = Arc::new(Mutex::new(Vec::new()));
    let tally = weighed.clone();
    let mut paced = futures::stream::iter(0..4u32).leaky_cost(pacer(10, 1), move |item| {
        tally.lock().unwrap().push(*item);
        1
    });
    // Each item but the first waits: poll it again while it does (a spurious wake, a
    // `select!` loop), then wait for it.
    for expect in 0..4 {
        let mut next = pin!(paced.next());
        let item = match poll!(next.as_mut()) {
            Poll::Ready(item) => item,
            Poll::Pending => {
                assert!(poll!(next.as_mut()).is_pending(), "{expect} still waits");
                next.await
            }
        };
        assert_eq!(item, Some(expect));
    }
    assert_eq!(
        *weighed.lock().unwrap(),
        [0, 1, 2, 3],
        "each item weighed once"
    );
}

/// A sink whose `poll_ready` is pending until a stall ends, logging when each item is
/// handed to it.
struct Stalling {
    sent: Arc<Mutex<Vec<Duration>>>,
    start: Instant,
    stall: Option<Pin<Box<Sleep>>>,
    /// The first item stalls the sink for this long.
    first_stalls: Duration,
}

impl Sink<u32> for Stalling {
    type Error = std::convert::Infallible;

    fn poll_ready(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if let Some(stall) = self.stall.as_mut() {
            if stall.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.stall = None;
        }
        Poll::Ready(Ok(()))
    }

    fn start_send(mut self: Pin<&mut Self>, _: u32) -> Result<(), Self::Error> {
        let mut sent = self.sent.lock().unwrap();
        sent.push(self.start.elapsed());
        let first = sent.len() == 1;
        drop(sent);
        if first {
            self.stall = Some(Box::pin(tokio::time::sleep(self.first_stalls)));
        }
        Ok(())
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn poll_close(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }
}

/// A `leaky_sink` whose inner sink stalled for a second (a full socket buffer, a slow
/// write) still hands items on at the rate: with a burst of 1 at 10/s, never two at once.
/// The item that waited for the inner sink goes when it has room, the next 100 ms later,
/// not with it (the pacer's unit for the stalled item is not taken while the inner sink
/// has no room for it, to let a second item through on its heels).
#[tokio::test(start_paused = true)]
async fn a_sink_whose_inner_sink_stalled_sends_no_more_than_the_burst_at_once() {
    let sent = Arc::new(Mutex::new(Vec::new()));
    let inner = Stalling {
        sent: sent.clone(),
        start: Instant::now(),
        stall: None,
        first_stalls: Duration::from_secs(1),
    };
    let mut sink = inner.leaky_sink_with(pacer(10, 1));
    for i in 0..4 {
        sink.send(i).await.unwrap();
    }
    let ms: Vec<u128> = sent
        .lock()
        .unwrap()
        .iter()
        .map(Duration::as_millis)
        .collect();
    assert_eq!(ms, [0, 1_000, 1_100, 1_200]);
}

/// 1/s with the default burst (2), through a `leaky` stream idle for an hour: the items
/// that then arrive together leave two at once (the burst), then one a second; the idle
/// hour earns no catch-up beyond the burst.
#[tokio::test(start_paused = true)]
async fn a_long_idle_stream_earns_no_more_than_the_burst() {
    let (tx, rx) = futures::channel::mpsc::unbounded::<u32>();
    let start = Instant::now();
    let pacer = Pacer::new(Rate::per_second(1).unwrap());
    let out = tokio::spawn(
        rx.leaky_with(pacer)
            .map(move |i| (i, start.elapsed().as_secs()))
            .collect::<Vec<_>>(),
    );
    tx.unbounded_send(0).unwrap();
    tokio::time::sleep(Duration::from_secs(3_600)).await;
    for i in 1..6 {
        tx.unbounded_send(i).unwrap();
    }
    drop(tx);
    let out = out.await.unwrap();
    assert_eq!(
        out,
        [
            (0, 0),
            (1, 3_600),
            (2, 3_600),
            (3, 3_601),
            (4, 3_602),
            (5, 3_603)
        ]
    );
}

/// 1M/s with the default burst (1 + 5 000), a million items through a `leaky` stream: the
/// last is due at (10^6 − 1 − 5 000) µs and leaves on the first 1 ms tick after, with no
/// drift over the million.
#[tokio::test(start_paused = true)]
async fn a_million_a_second_does_not_drift_over_a_million_items() {
    let rate = Rate::per_second(1_000_000).unwrap();
    let rel = releases(Pacer::new(rate), vec![1; 1_000_000]).await;
    assert_eq!(rel.len(), 1_000_000);
    let last = rel.last().unwrap().0;
    assert!(
        (994_999_000..=995_000_000).contains(&last),
        "last at {last} ns"
    );
    let ticks = rel.windows(2).filter(|w| w[1].0 != w[0].0).count();
    assert!(ticks <= 995, "one batch per 1 ms tick at most: {ticks}");
}

/// A `leaky` stream, a `leaky_queue` and a `leaky_sink` sharing one pacer (100/s, burst
/// 1): together one item every 10 ms exactly, served in turn (the `leaky` stream's second
/// item queued before the others came, so the lead never passes two turns).
#[tokio::test(start_paused = true)]
async fn adapters_sharing_a_pacer_take_turns_within_the_bound() {
    let pacer = pacer(100, 1);
    let start = Instant::now();
    let log = Arc::new(Mutex::new(Vec::new()));
    let record = |who: usize| {
        let log = log.clone();
        move |_| log.lock().unwrap().push((who, start.elapsed()))
    };
    let leaky = futures::stream::iter(0..20u32)
        .leaky_with(pacer.clone())
        .for_each({
            let record = record(0);
            move |i| {
                record(i);
                async {}
            }
        });
    let queue = futures::stream::iter(0..20u32)
        .leaky_queue(pacer.clone(), nz(4), Overflow::Backpressure)
        .for_each({
            let record = record(1);
            move |i| {
                record(i);
                async {}
            }
        });
    let sink = {
        let record = record(2);
        let mut sink = futures::sink::drain().leaky_sink_with(pacer.clone());
        async move {
            for i in 0..20u32 {
                sink.feed(i).await.unwrap();
                record(i);
            }
        }
    };
    futures::join!(leaky, queue, sink);
    let log = log.lock().unwrap();
    assert_eq!(log.len(), 60);
    for (n, &(_, at)) in log.iter().enumerate() {
        assert_eq!(at, Duration::from_millis(10 * n as u64), "release {n}");
    }
    let mut counts = [0i32; 3];
    for &(who, _) in log.iter() {
        counts[who] += 1;
        let (max, min) = (counts.iter().max().unwrap(), counts.iter().min().unwrap());
        assert!(max - min <= 2, "unfair prefix: {counts:?}");
    }
}

/// A `leaky_sink` whose send was given up while it waited for the pacer (a timeout), then
/// closed: a closed sink sends nothing more, so it leaves the pacer's line at once, as
/// its channel releases an unused slot on close. It stayed in line until dropped: a
/// stream sharing the pacer (10/s, burst 1) waited out the stall grace behind it, its
/// first item at 110 ms instead of 100 ms, and every later one 10 ms late with it.
#[tokio::test(start_paused = true)]
async fn a_closed_sink_leaves_the_pacers_line() {
    let pacer = pacer(10, 1);
    let start = Instant::now();
    let (tx, _rx) = flowgate::channel::bounded::<u32>(16).unwrap();
    let mut sink = tx.leaky_sink_with(pacer.clone());
    sink.send(0).await.unwrap();
    let given_up = tokio::time::timeout(Duration::from_millis(30), sink.send(1)).await;
    assert!(given_up.is_err(), "1 waits for the pacer until 100 ms");
    assert_eq!(pacer.waiting(), 1, "a send given up keeps the sink in line");
    sink.close().await.unwrap();
    assert_eq!(pacer.waiting(), 0, "a closed sink leaves the line");
    let at: Vec<Duration> = futures::stream::iter(0..3u32)
        .leaky_with(pacer.clone())
        .map(|_| start.elapsed())
        .collect()
        .await;
    assert_eq!(at, [100, 200, 300].map(Duration::from_millis));
    drop(sink);
}
