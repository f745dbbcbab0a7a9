//! The public API as a user meets it: the prelude alone reaches every adapter, even on a type
//! that is both a `Stream` and a `Sink` (a `Framed`, a websocket), and the handles users
//! share across tasks and panics have the auto traits they need.

use std::panic::{RefUnwindSafe, UnwindSafe};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use flowgate::prelude::*;
use futures::{Sink, SinkExt, Stream, StreamExt};

/// Both a `Stream` and a `Sink`: yields 1, 2, 3, ... up to `end`; records what it is sent.
#[derive(Debug, Default)]
struct Duplex {
    next: u32,
    end: u32,
    sent: Vec<u32>,
    closed: bool,
}

impl Duplex {
    fn upto(end: u32) -> Duplex {
        Duplex {
            end,
            ..Duplex::default()
        }
    }
}

impl Stream for Duplex {
    type Item = u32;

    fn poll_next(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<u32>> {
        if self.next == self.end {
            return Poll::Ready(None);
        }
        self.next += 1;
        Poll::Ready(Some(self.next))
    }
}

impl Sink<u32> for Duplex {
    type Error = std::convert::Infallible;

    fn poll_ready(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn start_send(mut self: Pin<&mut Self>, item: u32) -> Result<(), Self::Error> {
        self.sent.push(item);
        Ok(())
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn poll_close(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.closed = true;
        Poll::Ready(Ok(()))
    }
}

/// Every stream and sink adapter is called on a `Duplex` with nothing but the prelude
/// imported: a method name shared by `FlowStreamExt` and `FlowSinkExt` would not compile
/// (E0034). Each adapter also runs, so the test checks what it yields.
#[tokio::test(start_paused = true)]
async fn a_stream_that_is_also_a_sink_reaches_every_adapter_through_the_prelude() {
    let rate = Rate::per_second(1_000).unwrap();
    let pacer = Pacer::new(rate);
    let bulkhead = Bulkhead::new(2).unwrap();
    let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(3).unwrap()));
    let twice = |x: u32| async move { x * 2 };

    let ordered: Vec<u32> = Duplex::upto(4)
        .bulkhead_map(bulkhead.clone(), twice)
        .collect()
        .await;
    assert_eq!(ordered, [2, 4, 6, 8]);
    let mut unordered: Vec<u32> = Duplex::upto(4)
        .bulkhead_map_unordered(bulkhead.clone(), twice)
        .collect()
        .await;
    unordered.sort_unstable();
    assert_eq!(unordered, [2, 4, 6, 8]);
    let spawned: Vec<u32> = Duplex::upto(4)
        .bulkhead_spawn_map(bulkhead.clone(), twice)
        .collect()
        .await;
    assert_eq!(spawned.len(), 4);

    let start = tokio::time::Instant::now();
    let slow = Rate::per_second(10).unwrap();
    assert_eq!(Duplex::upto(4).leaky(slow).count().await, 4);
    assert_eq!(start.elapsed(), Duration::from_millis(200)); // a burst of 2, then 10/s
    assert_eq!(Duplex::upto(3).leaky_with(pacer.clone()).count().await, 3);
    let costed = Duplex::upto(3).leaky_cost(pacer.clone(), |_| 1);
    assert_eq!(costed.count().await, 3);
    let queued =
        Duplex::upto(3).leaky_queue(pacer.clone(), 8.try_into().unwrap(), Overflow::DropNewest);
    assert_eq!(queued.count().await, 3);

    // Two items of credit: two come, then the stream waits for more.
    let (demanded, handle) = Duplex::upto(10).with_demand(2);
    let mut demanded = std::pin::pin!(demanded);
    assert_eq!(demanded.next().await, Some(1));
    assert_eq!(demanded.next().await, Some(2));
    assert!(futures::poll!(demanded.next()).is_pending());
    assert_eq!(handle.outstanding(), 0);
    let levels = Levels::new(4, 2).unwrap();
    let tickets: Vec<_> = Duplex::upto(3).watermarks(levels).collect().await;
    assert_eq!(tickets.len(), 3);

    // Three per second on one key: the shaping adapter delays the fourth, the policing one
    // drops it.
    let policed = Duplex::upto(4)
        .gated_drop(gate.clone(), |_: &u32| "k")
        .count()
        .await;
    assert_eq!(policed, 3);
    let start = tokio::time::Instant::now();
    let shaped = Duplex::upto(2).gated(gate, |_: &u32| "k").count().await;
    assert_eq!(shaped, 2);
    assert!(start.elapsed() >= Duration::from_millis(333));

    let mut sink = Duplex::default().leaky_sink(rate);
    sink.send(7).await.unwrap();
    assert_eq!(sink.get_ref().sent, [7]);
    let mut sink = Duplex::default().leaky_sink_with(pacer);
    sink.send(8).await.unwrap();
    assert_eq!(sink.get_ref().sent, [8]);
}

fn shared<T: Send + Sync + Unpin + UnwindSafe + RefUnwindSafe + Clone + 'static>() {}
fn sendable<T: Send + 'static>() {}

/// The handles a pipeline shares between tasks (and across `catch_unwind`) are cheap to
/// clone, `Send + Sync + Unpin + 'static` and unwind safe, as tokio's are.
#[test]
fn shared_handles_have_the_auto_traits_users_need() {
    shared::<Bulkhead>();
    shared::<Pacer>();
    shared::<MemoryGate>();
    shared::<flowgate::channel::Sender<std::cell::Cell<u8>>>();
    shared::<flowgate::OnDrop<String>>();
    shared::<Levels>();
    shared::<Quota>();
    shared::<Decision>();
    sendable::<flowgate::channel::Receiver<std::cell::Cell<u8>>>();
    sendable::<flowgate::Dropped>();
    sendable::<flowgate::CostError>();
    #[cfg(feature = "redis")]
    {
        // Unwind safety follows the connection type (redis-rs's are not), as for RedisGate.
        fn connected<T: Send + Sync + Unpin + Clone + 'static>() {}
        type Conn = redis::aio::ConnectionManager;
        connected::<flowgate::region::QuotaAllocator<Conn>>();
        connected::<flowgate::region::Region<Conn>>();
        connected::<flowgate::region::RegionGate<Conn>>();
        connected::<flowgate::gate::RedisGate<Conn>>();
        shared::<flowgate::region::RegionStatus>();
        shared::<flowgate::region::AllocatorStatus>();
    }
}

/// A duration that must not be zero says so in words an operator can act on, as the
/// durations checked elsewhere do ("must be longer than zero"), not with the count
/// message "must be at least 1" (1 what?).
#[test]
fn a_zero_duration_is_rejected_in_words_that_fit_a_duration() {
    let backoff = flowgate::retry::Backoff::builder().build().unwrap();
    let err = flowgate::retry::RetryPolicy::builder(backoff)
        .attempt_timeout(Duration::ZERO)
        .build()
        .unwrap_err();
    assert_eq!(err.field(), "retry_policy.attempt_timeout");
    assert_eq!(err.kind(), flowgate::ConfigErrorKind::Zero);
    assert_eq!(
        err.to_string(),
        "invalid retry_policy.attempt_timeout: must be longer than zero"
    );
}

/// A builder's `Debug` says no more about its Redis connection than the value it builds:
/// `RedisGate`, `QuotaAllocator` and `RedisStreamSource` leave the connection out, so that
/// a builder logged with `?` does not print where Redis is and who logs in (a
/// `ConnectionManager` prints its client: host, port and user name).
#[cfg(feature = "redis")]
#[tokio::test]
async fn builders_do_not_print_the_redis_connection() {
    let client =
        redis::Client::open("redis://ops-user:hunter2@redis-7.internal.example:6390/").unwrap();
    let conn = redis::aio::ConnectionManager::new_lazy_with_config(
        client,
        redis::aio::ConnectionManagerConfig::new(),
    )
    .unwrap();
    assert!(
        format!("{conn:?}").contains("redis-7.internal.example"),
        "the connection itself names its server"
    );
    let quota = Quota::per_second(10).unwrap();
    let printed = [
        format!(
            "{:?}",
            RedisGate::builder(conn.clone(), Limit::TokenBucket(quota))
        ),
        format!(
            "{:?}",
            flowgate::region::QuotaAllocator::builder(conn.clone(), quota)
        ),
        format!(
            "{:?}",
            flowgate::demand::RedisStreamSource::builder(conn, "orders", "billing", "worker-1")
        ),
    ];
    for debug in printed {
        for secret in ["redis-7.internal.example", "6390", "ops-user", "hunter2"] {
            assert!(!debug.contains(secret), "{secret:?} in {debug}");
        }
    }
}

/// Writes through `adapter` and closes it, then reads it to its end; the inner duplex got
/// the writes and the close, and the reads came through.
async fn write_then_read<A>(mut adapter: A, inner: impl Fn(&A) -> &Duplex) -> Vec<u32>
where
    A: Sink<u32, Error = std::convert::Infallible> + Stream<Item = u32> + Unpin,
{
    adapter.send(7).await.unwrap();
    adapter.send(8).await.unwrap();
    adapter.close().await.unwrap();
    assert_eq!(inner(&adapter).sent, [7, 8]);
    assert!(inner(&adapter).closed);
    let mut read = Vec::new();
    while let Some(item) = adapter.next().await {
        read.push(item);
    }
    read
}

/// The stream adapters over a duplex keep its write half (and `leaky_sink` its read half):
/// pacing, gating or counting the reads of a socket does not take away writing to it.
#[tokio::test(start_paused = true)]
async fn adapters_over_a_duplex_keep_its_other_half() {
    let rate = Rate::per_second(1_000).unwrap();
    let read = |items: Vec<u32>| items == [1, 2, 3];
    let leaky = Duplex::upto(3).leaky(rate);
    assert!(read(write_then_read(leaky, |a| a.get_ref()).await));
    let capacity = std::num::NonZeroUsize::new(4).unwrap();
    let queue = Duplex::upto(3).leaky_queue(Pacer::new(rate), capacity, Overflow::Backpressure);
    assert!(read(write_then_read(queue, |a| a.get_ref()).await));
    let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(100).unwrap()));
    let gated = Duplex::upto(3).gated(gate, |_: &u32| "k");
    assert!(read(write_then_read(gated, |a| a.get_ref()).await));
    // Credit for the 3 items and for the end (the duplex does not say it has no more).
    let (demanded, _demand) = Duplex::upto(3).with_demand(4);
    assert!(read(write_then_read(demanded, |a| a.get_ref()).await));
    let sink = Duplex::upto(3).leaky_sink(rate);
    assert!(read(write_then_read(sink, |a| a.get_ref()).await));
    // `watermarks` yields each item with its ticket: written to, then read.
    let mut marks = Duplex::upto(3).watermarks(flowgate::demand::Levels::new(8, 0).unwrap());
    marks.send(7).await.unwrap();
    marks.close().await.unwrap();
    assert_eq!(
        (&marks.get_ref().sent[..], marks.get_ref().closed),
        (&[7][..], true)
    );
    let read: Vec<u32> = marks.map(|(item, _ticket)| item).collect().await;
    assert_eq!(read, [1, 2, 3]);
}
