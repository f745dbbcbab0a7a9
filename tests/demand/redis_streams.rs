//! The Redis Streams consumer-group source against real `redis-server` processes from the
//! harness (part of the `demand` test binary).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flowgate::demand::{
    Origin, Prefetch, RedisStreamSource, RedisStreamSourceBuilder, StartFrom, StreamEntry, prefetch,
};
use futures::StreamExt;
use redis::aio::MultiplexedConnection;

use super::levels;
use super::support::RedisServer;

pub(super) const KEY: &str = "orders";
pub(super) const GROUP: &str = "billing";

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

async fn source(server: &RedisServer, consumer: &str) -> RedisStreamSource<MultiplexedConnection> {
    RedisStreamSource::builder(server.connect().await, KEY, GROUP, consumer)
        .block(Duration::from_millis(50))
        .min_idle(Duration::from_millis(300))
        .claim_every(Duration::from_millis(100))
        .build()
        .await
        .unwrap()
}

pub(super) async fn pending(con: &mut MultiplexedConnection) -> u64 {
    let summary: redis::Value = redis::cmd("XPENDING")
        .arg(KEY)
        .arg(GROUP)
        .query_async(con)
        .await
        .unwrap();
    match summary {
        redis::Value::Array(v) => redis::FromRedisValue::from_redis_value(v[0].clone()).unwrap(),
        other => panic!("unexpected XPENDING reply {other:?}"),
    }
}

/// A source behind `prefetch`, as the tests hold it.
type Prefetched<C> = Pin<Box<Prefetch<RedisStreamSource<C>>>>;

/// Sends the acks collected so far (`flush_acks`); returns how many Redis acknowledged.
async fn flush<C>(stream: &mut Prefetched<C>) -> usize
where
    C: redis::aio::ConnectionLike + Clone + Send + Sync + Unpin + 'static,
{
    stream
        .as_mut()
        .get_mut()
        .get_mut()
        .flush_acks()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_processes_everything_at_least_once_when_a_consumer_dies() {
    const N: u32 = 10_000;
    let (server, mut con) = with_entries(N).await;
    let seen: Arc<Mutex<HashMap<u32, u32>>> = Default::default();
    let acked: Arc<Mutex<std::collections::HashSet<u32>>> = Default::default();

    // Consumer c processes some entries, then dies holding 100 it never acknowledged.
    {
        let mut stream = Box::pin(prefetch(source(&server, "c").await, levels(100, 20)));
        for _ in 0..1_000 {
            let e = stream.next().await.unwrap().unwrap();
            let n: u32 = e.get("n").unwrap();
            *seen.lock().unwrap().entry(n).or_default() += 1;
            e.ack.ack();
            acked.lock().unwrap().insert(n);
        }
        flush(&mut stream).await;
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
            let mut stream = Box::pin(prefetch(server_src, levels(100, 20)));
            let mut claimed = 0;
            while let Some(e) = next_until(&mut stream, &done).await {
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
            flush(&mut stream).await;
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

/// The next entry, polling for one every 100 ms until `done`.
async fn next_until<S>(stream: &mut S, done: &AtomicBool) -> Option<StreamEntry>
where
    S: futures::Stream<Item = redis::RedisResult<StreamEntry>> + Unpin,
{
    while !done.load(Ordering::SeqCst) {
        if let Ok(Some(e)) = tokio::time::timeout(Duration::from_millis(100), stream.next()).await {
            return Some(e.unwrap());
        }
    }
    None
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
    let mut stream = Box::pin(prefetch(source(&server, "solo").await, levels(5, 0)));
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
    let mut a = Box::pin(prefetch(source(&server, "a").await, levels(5, 0)));
    let held = take(&mut a, 5).await;
    let mut b = Box::pin(prefetch(source(&server, "b").await, levels(5, 0)));
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_ack_interval_lets_no_other_consumer_take_what_a_live_consumer_holds_or_acked() {
    let (server, mut con) = with_entries(6).await;
    // min_idle 300 ms: a's keep-alive is due every 100 ms, whatever its ack interval.
    let src = RedisStreamSource::builder(server.connect().await, KEY, GROUP, "a")
        .block(Duration::from_millis(50))
        .min_idle(Duration::from_millis(300))
        .claim_every(Duration::from_millis(100))
        .ack_interval(Duration::from_secs(2))
        .build()
        .await
        .unwrap();
    let mut a = Box::pin(prefetch(src, levels(6, 0)));
    let mut held = take(&mut a, 6).await;
    // One is done: its ack may wait up to 2 s; the other five are still being worked on.
    let acked = held.pop().unwrap();
    let acked_id = acked.id.clone();
    acked.ack.ack();
    let mut b = Box::pin(prefetch(source(&server, "b").await, levels(5, 0)));
    let started = tokio::time::Instant::now();
    while started.elapsed() < Duration::from_millis(1_200) {
        if let Some(e) = next(&mut b).await {
            let what = if e.id == acked_id { "acked" } else { "holds" };
            panic!("b took {} ({:?}) while a {what} it", e.id, e.origin);
        }
    }
    for e in held {
        e.ack.ack();
    }
    assert_eq!(drained(&mut con).await, 0);
}

#[tokio::test]
async fn acks_after_the_source_is_dropped_still_reach_redis() {
    let (server, mut con) = with_entries(10).await;
    let mut stream = Box::pin(prefetch(source(&server, "e").await, levels(5, 0)));
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

/// A stream over 10 entries whose second fetch is in progress, having taken along the acks
/// of the 5 entries the first one delivered; and their ids.
async fn fetching_with_5_acks(
    server: &RedisServer,
    consumer: &str,
) -> (Prefetched<MultiplexedConnection>, Vec<String>) {
    let mut stream = Box::pin(prefetch(source(server, consumer).await, levels(5, 0)));
    let mut acked = Vec::new();
    for e in take(&mut stream, 5).await {
        acked.push(e.id.clone());
        e.ack.ack();
    }
    assert!(futures::poll!(stream.next()).is_pending());
    (stream, acked)
}

/// `XPENDING key group - + 100`: the entries still pending.
fn pending_list() -> redis::Cmd {
    let mut cmd = redis::cmd("XPENDING");
    cmd.arg(KEY).arg(GROUP).arg("-").arg("+").arg(100);
    cmd
}

/// The ids of a [`pending_list`] reply.
fn ids(list: Vec<(String, String, u64, u64)>) -> Vec<String> {
    list.into_iter().map(|p| p.0).collect()
}

#[tokio::test]
async fn acks_taken_by_a_fetch_in_progress_when_the_source_is_dropped_still_reach_redis() {
    let (server, mut con) = with_entries(10).await;
    // The next fetch takes the 5 queued acks along; then shutdown drops the stream before
    // Redis answered.
    let (stream, acked) = fetching_with_5_acks(&server, "f").await;
    drop(stream);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let still = ids(pending_list().query_async(&mut con).await.unwrap());
    assert!(
        acked.iter().all(|id| !still.contains(id)),
        "acked {acked:?}, still pending {still:?}"
    );
}

/// `flush_acks` returns once every ack made before it is in Redis, those a fetch in progress
/// took along too: a consumer that stops, flushes and exits must not leave them pending
/// (checked on a blocking connection at once, before this runtime's connection task runs
/// again, as after an exit).
#[tokio::test]
async fn flush_acks_waits_for_the_acks_a_fetch_in_progress_took_along() {
    let (server, _con) = with_entries(10).await;
    // The next fetch takes the 5 queued acks along; the loop stops and flushes.
    let (mut stream, acked) = fetching_with_5_acks(&server, "g").await;
    flush(&mut stream).await;
    let still = ids(server.query_blocking(&pending_list()).unwrap());
    assert!(
        acked.iter().all(|id| !still.contains(id)),
        "flush_acks returned, but acked {acked:?} are still pending: {still:?}"
    );
}

/// A consumer loop that stops and builds its source again at once under the same name (after
/// an error, or a restart of the loop within the process), every entry of the old source
/// acknowledged first, as the docs ask: the new source must not deliver again what was
/// acknowledged, only because the old source's background task had not sent the `XACK` yet
/// (it waits up to `ack_interval`, 30 s here).
#[tokio::test]
async fn a_source_built_again_at_once_under_the_same_name_does_not_redeliver_what_was_acked() {
    let (server, _con) = with_entries(10).await;
    let build = || async {
        RedisStreamSource::builder(server.connect().await, KEY, GROUP, "again")
            .block(Duration::from_millis(50))
            .ack_interval(Duration::from_secs(30))
            .build()
            .await
            .unwrap()
    };
    let mut stream = Box::pin(prefetch(build().await, levels(5, 0)));
    for e in take(&mut stream, 5).await {
        e.ack.ack();
    }
    drop(stream);
    let mut stream = Box::pin(prefetch(build().await, levels(5, 0)));
    let e = next(&mut stream).await.expect("the next entry");
    assert_eq!(
        (e.origin, e.get::<u32>("n").unwrap()),
        (Origin::New, 5),
        "an entry acknowledged through the source before was delivered again"
    );
}

/// Two sources of the same stream, group and consumer name on two servers (one process
/// consuming two shards): building the second sends the first's queued acks to the first
/// server, over its own connection, not to the second.
#[tokio::test]
async fn acks_left_queued_go_to_their_own_server_when_a_source_of_the_same_name_is_built() {
    let (first, mut con) = with_entries(10).await;
    let (second, _con) = with_entries(10).await;
    let build = |conn| async move {
        RedisStreamSource::builder(conn, KEY, GROUP, "shard")
            .block(Duration::from_millis(50))
            .ack_interval(Duration::from_secs(30))
            .build()
            .await
            .unwrap()
    };
    let mut stream = Box::pin(prefetch(build(first.connect().await).await, levels(5, 0)));
    for e in take(&mut stream, 5).await {
        e.ack.ack();
    }
    let other = build(second.connect().await).await;
    assert_eq!(
        pending(&mut con).await,
        0,
        "the acks reached the first server"
    );
    drop((stream, other));
}

/// The background task of a source ends once the source and every `Ack` are gone and the
/// acks are sent, with none left to send and with some (sent first); a source dropped
/// where there is no runtime (its own gone) does not panic.
#[test]
fn the_background_task_ends_with_the_last_handle_and_a_source_drops_outside_any_runtime() {
    let server = RedisServer::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let held = rt.block_on(async {
        let mut con = server.connect().await;
        drop(source(&server, "setup").await);
        produce(&mut con, 20).await;
        let metrics = tokio::runtime::Handle::current().metrics();
        // Counted once the setup source's tasks have ended: one of them ending later would
        // pass for a task of a source below (on a loaded host the check then read the
        // pending entries before the acks were sent).
        let mut before = metrics.num_alive_tasks();
        let settle = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = metrics.num_alive_tasks();
            if now == before || tokio::time::Instant::now() > settle {
                break;
            }
            before = now;
        }
        let alive_until = |n: usize| {
            let metrics = metrics.clone();
            async move {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                // At most `n`: a task alive before (a connection's driver) may end meanwhile.
                while metrics.num_alive_tasks() > n && tokio::time::Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                metrics.num_alive_tasks()
            }
        };
        for acked in [false, true] {
            let src = source(&server, if acked { "t1" } else { "t0" }).await;
            let mut stream = Box::pin(prefetch(src, levels(5, 0)));
            let entries = take(&mut stream, 5).await;
            drop(stream);
            for e in entries {
                if acked {
                    e.ack.ack();
                }
            }
            // The source's connection task and its background task, until both end.
            let alive = alive_until(before).await;
            assert!(
                alive <= before,
                "acked: {acked}: {alive} tasks alive, {before} before"
            );
        }
        assert_eq!(
            pending(&mut con).await,
            5,
            "the 5 acked are sent, not the others"
        );
        let mut stream = Box::pin(prefetch(source(&server, "u").await, levels(5, 0)));
        let held = take(&mut stream, 5).await;
        (stream, held)
    });
    drop(rt);
    drop(held);
}

#[tokio::test]
async fn a_restarted_consumer_recovers_its_own_pending_entries_first() {
    let (server, _con) = with_entries(200).await;
    let mut first = Vec::new();
    {
        let mut stream = Box::pin(prefetch(source(&server, "d").await, levels(50, 0)));
        for _ in 0..50 {
            let e = stream.next().await.unwrap().unwrap();
            assert_eq!(e.origin, Origin::New);
            first.push(e.id.clone());
        }
    } // dropped without acknowledging anything
    let src = source(&server, "d").await;
    assert!(src.is_recovering());
    let mut stream = Box::pin(prefetch(src, levels(50, 0)));
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
/// background task waits 30 s, and its keep-alive is due every `min_idle / 3` = 30 s), so
/// the tests know where each ack goes.
fn lost_group_builder<C>(conn: C, consumer: &str) -> RedisStreamSourceBuilder<C>
where
    C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
{
    RedisStreamSource::builder(conn, KEY, GROUP, consumer)
        .block(Duration::from_millis(50))
        .min_idle(Duration::from_secs(90))
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

/// How each lost-group test ends: the last acks are sent, nothing is left pending, and
/// the source created the group again exactly once.
async fn recovered_once<C>(
    stream: &mut Prefetched<C>,
    con: &mut MultiplexedConnection,
    counters: &Counters,
) where
    C: redis::aio::ConnectionLike + Clone + Send + Sync + Unpin + 'static,
{
    flush(stream).await;
    assert_eq!(drained(con).await, 0, "nothing left pending");
    assert_eq!(counters.get("group_recreated").unwrap_or(1), 1);
}

/// `XGROUP DESTROY`: the group is lost.
async fn destroy_group(con: &mut MultiplexedConnection) {
    let _: () = redis::cmd("XGROUP")
        .arg(&["DESTROY", KEY, GROUP])
        .query_async(con)
        .await
        .unwrap();
}

/// A source of `counters` (from `lost_group_builder`) took the 10 entries produced, acked
/// 6 and sent them; then its group was destroyed. Returns the 4 entries it still holds.
async fn destroyed_holding_four(
    counters: &Counters,
) -> (
    RedisServer,
    MultiplexedConnection,
    Prefetched<MultiplexedConnection>,
    Vec<StreamEntry>,
) {
    let server = RedisServer::start();
    let mut con = server.connect().await;
    let source = counters.build(lost_group_builder(server.connect().await, "r"));
    produce(&mut con, 10).await;
    let mut stream = Box::pin(prefetch(source, levels(10, 0)));
    let mut first = take(&mut stream, 10).await;
    let held = first.split_off(6);
    for e in first {
        e.ack.ack();
    }
    assert_eq!(flush(&mut stream).await, 6);
    destroy_group(&mut con).await;
    (server, con, stream, held)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destroyed_group_is_created_again_and_no_ack_of_the_old_one_is_sent() {
    let counters = Counters::new("destroyed");
    let (server, mut con, mut stream, held) = destroyed_holding_four(&counters).await;
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
    recovered_once(&mut stream, &mut con, &counters).await;
    // Sent: the 6 before the loss and the 20 new ones, each once; none of the old group.
    assert_eq!(counters.get("acked").unwrap_or(26), 6 + 20);
    assert_eq!(
        counters.get("stale_acks").unwrap_or(4),
        4,
        "old acks not sent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_sent_before_the_loss_is_noticed_count_as_stale_not_acked() {
    let counters = Counters::new("unnoticed");
    let (server, mut con, mut stream, held) = destroyed_holding_four(&counters).await;
    // Sent before any fetch meets NOGROUP: XACK answers 0, not an error.
    for e in held {
        e.ack.ack();
    }
    assert_eq!(flush(&mut stream).await, 0, "the group is gone");
    assert_eq!(
        counters.get("acked").unwrap_or(6),
        6,
        "only what Redis acknowledged"
    );
    assert_eq!(counters.get("stale_acks").unwrap_or(4), 4);

    until_group_recreated(&server, &mut stream).await;
    recovered_once(&mut stream, &mut con, &counters).await;
    assert_eq!(
        (
            counters.get("acked").unwrap_or(6),
            counters.get("stale_acks").unwrap_or(4)
        ),
        (6, 4),
        "counted once, not again when the fetch notices the loss"
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
    let mut stream = Box::pin(prefetch(source, levels(5, 0)));
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
    recovered_once(&mut stream, &mut con, &counters).await;
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
    let mut stream = Box::pin(prefetch(source, levels(5, 0)));
    for e in take(&mut stream, 5).await {
        e.ack.ack();
    }
    flush(&mut stream).await;

    server.restart();
    assert!(!group_exists(&server), "the restarted server is empty");
    until_group_recreated(&server, &mut stream).await;
    let mut con = server.connect().await;
    produce(&mut con, 10).await;
    take_produced(&mut stream, 10).await;
    recovered_once(&mut stream, &mut con, &counters).await;
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
    let mut stream = Box::pin(prefetch(source, levels(usize::MAX, 0)));
    let first = next(&mut stream)
        .await
        .expect("COUNT is capped: Redis accepts it");
    assert_eq!(stream.queued(), 2, "one fetch brought max_count entries");
    let mut all = vec![first];
    all.extend(take(&mut stream, 9).await);
    for e in all {
        e.ack.ack();
    }
    assert_eq!(drained(&mut con).await, 0);
}

/// `max` 0 breaks `poll_fetch`'s contract (`prefetch` never asks for 0): a fetch asked for
/// 0 entries reads none (it read one, above `max`); it answers an empty batch, and the
/// entries wait for the next fetch.
#[tokio::test]
async fn a_fetch_asked_for_0_entries_reads_none() {
    use flowgate::demand::BatchSource;
    async fn fetched<S: BatchSource<Error = redis::RedisError> + Unpin>(
        s: &mut S,
        max: usize,
    ) -> usize {
        let batch = futures::future::poll_fn(|cx| Pin::new(&mut *s).poll_fetch(cx, max)).await;
        batch.unwrap().unwrap().len()
    }
    let (server, mut con) = with_entries(2).await;
    let mut source = source(&server, "zero").await;
    assert_eq!(
        fetched(&mut source, 1).await,
        0,
        "its own pending entries first: none"
    );
    assert_eq!(fetched(&mut source, 0).await, 0, "asked for 0");
    assert_eq!(pending(&mut con).await, 0, "nothing read");
    let mut stream = Box::pin(prefetch(source, levels(2, 0)));
    for e in take(&mut stream, 2).await {
        e.ack.ack();
    }
    assert_eq!(flush(&mut stream).await, 2);
}

/// `consumer` is delivered all `n` entries and goes away without acknowledging any; then
/// entry `deleted` (an index) is removed from the stream (`XDEL`) while it is pending for
/// it. The ids delivered, in order.
async fn held_then_deleted(
    server: &RedisServer,
    con: &mut MultiplexedConnection,
    consumer: &str,
    n: usize,
    deleted: usize,
) -> Vec<String> {
    let ids: Vec<String> = {
        let mut stream = Box::pin(prefetch(source(server, consumer).await, levels(n, 0)));
        take(&mut stream, n)
            .await
            .into_iter()
            .map(|e| e.id)
            .collect()
    };
    let removed: u64 = redis::cmd("XDEL")
        .arg(KEY)
        .arg(&ids[deleted])
        .query_async(con)
        .await
        .unwrap();
    assert_eq!(removed, 1);
    ids
}

#[tokio::test]
async fn a_deleted_entry_in_its_own_pending_list_is_recovered_without_fields() {
    let (server, mut con) = with_entries(5).await;
    // The entry is deleted (XDEL, or trimmed) while it is pending for "d".
    let ids = held_then_deleted(&server, &mut con, "d", 5, 2).await;
    let mut stream = Box::pin(prefetch(source(&server, "d").await, levels(5, 0)));
    let again = take(&mut stream, 5).await;
    let got: Vec<&str> = again.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(got, ids.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(again.iter().all(|e| e.origin == Origin::OwnPending));
    assert!(again[2].fields.is_empty(), "{:?}", again[2].fields);
    assert_eq!(again[1].get::<u32>("n").unwrap(), 1);
    for e in again {
        e.ack.ack();
    }
    flush(&mut stream).await;
    assert_eq!(pending(&mut con).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loss_seen_by_a_fetch_whose_group_creation_fails_still_keeps_old_acks_out() {
    let server = RedisServer::start();
    let mut con = server.connect().await;
    // The source's own user, so that creating the group can be refused to it later.
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "src", "on", ">pw", "~*", "&*", "+@all"])
        .query_async(&mut con)
        .await
        .unwrap();
    let url = format!("redis://src:pw@127.0.0.1:{}/", server.port());
    let src_conn = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let counters = Counters::new("create_refused");
    let source = counters.build(lost_group_builder(src_conn, "r"));
    produce(&mut con, 1).await;
    let mut stream = Box::pin(prefetch(source, levels(1, 0)));
    let held = take(&mut stream, 1).await.pop().unwrap();

    // The group is lost, and the source may not create it again.
    destroy_group(&mut con).await;
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "src", "-xgroup"])
        .query_async(&mut con)
        .await
        .unwrap();
    let met = tokio::time::timeout(Duration::from_secs(5), stream.next())
        .await
        .expect("the fetch that meets NOGROUP answers");
    let err = met.unwrap().expect_err("creating the group was refused");
    assert_eq!(err.code(), Some("NOPERM"), "{err}");

    // Someone else creates the group again from the beginning, and another consumer is
    // handed the same id.
    let _: () = redis::cmd("XGROUP")
        .arg(&["CREATE", KEY, GROUP, "0"])
        .query_async(&mut con)
        .await
        .unwrap();
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg(&["GROUP", GROUP, "other", "COUNT", "1", "STREAMS", KEY, ">"])
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(pending(&mut con).await, 1);

    // The ack of the entry of the lost group must not acknowledge the other delivery.
    held.ack.ack();
    assert_eq!(
        flush(&mut stream).await,
        0,
        "no ack of the lost group is sent"
    );
    assert_eq!(pending(&mut con).await, 1, "the other consumer's delivery");
    assert_eq!(counters.get("stale_acks").unwrap_or(1), 1);
}

/// Waits (up to 5 s) until a client of `server` is blocked (a blocking read waits there).
async fn until_blocked(server: &RedisServer) {
    for _ in 0..500 {
        let info: String = server
            .query_blocking(redis::cmd("INFO").arg("clients"))
            .unwrap();
        if info.lines().any(|l| l.trim() == "blocked_clients:1") {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no blocking read reached the server within 5 s");
}

/// `flush_acks` finishes a fetch in progress first. When that fetch met `NOGROUP` (and
/// found the group created again by another consumer), the acks still queued belong to
/// the lost group: sending them to the new one would acknowledge another consumer's
/// delivery of the same id, which would then never be redelivered if it crashed.
#[tokio::test]
async fn flush_acks_after_a_fetch_that_met_a_lost_group_sends_no_ack_of_it() {
    let server = RedisServer::start();
    let mut con = server.connect().await;
    // Reads block for 10 s (no client-side timeout), so the group can be lost under one;
    // the background task waits 30 s: only `flush_acks` sends acks here.
    let source = RedisStreamSource::builder(server.connect_untimed().await, KEY, GROUP, "a")
        .block(Duration::from_secs(10))
        .min_idle(Duration::from_secs(90))
        .claim_every(Duration::from_secs(60))
        .ack_interval(Duration::from_secs(30))
        .build()
        .await
        .unwrap();
    produce(&mut con, 4).await;
    let mut stream = Box::pin(prefetch(source, levels(4, 0)));
    let mut held = take(&mut stream, 4).await.into_iter();
    // The next fetch takes the first ack along and blocks in Redis.
    held.next().unwrap().ack.ack();
    assert!(futures::poll!(stream.next()).is_pending());
    until_blocked(&server).await;
    let second = held.next().unwrap();
    let second_id = second.id.clone();
    second.ack.ack();

    // The group is lost under the read (which answers NOGROUP); another consumer creates
    // it again from the beginning and is handed the same entries.
    destroy_group(&mut con).await;
    let _: () = redis::cmd("XGROUP")
        .arg(&["CREATE", KEY, GROUP, "0"])
        .query_async(&mut con)
        .await
        .unwrap();
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg(&["GROUP", GROUP, "b", "COUNT", "10", "STREAMS", KEY, ">"])
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(pending(&mut con).await, 4);

    assert_eq!(
        flush(&mut stream).await,
        0,
        "no ack of the lost group is sent"
    );
    let still = ids(pending_list().query_async(&mut con).await.unwrap());
    assert!(
        still.contains(&second_id),
        "{second_id}, acked in the lost group, acknowledged the other consumer's delivery"
    );
    assert_eq!(still.len(), 4);
}

#[tokio::test]
async fn a_deleted_entry_pending_for_a_dead_consumer_is_skipped_by_the_claim() {
    let (server, mut con) = with_entries(3).await;
    // "dead" crashed with nothing acknowledged.
    let ids = held_then_deleted(&server, &mut con, "dead", 3, 1).await;
    // min_idle 300 ms: the dead consumer's entries are idle after that.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let mut alive = Box::pin(prefetch(source(&server, "alive").await, levels(3, 0)));
    let mut claimed = Vec::new();
    while let Some(e) = next(&mut alive).await {
        assert_eq!(e.origin, Origin::Claimed);
        claimed.push(e);
    }
    let got: Vec<&str> = claimed.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(got, [ids[0].as_str(), ids[2].as_str()]);
    for e in claimed {
        e.ack.ack();
    }
    flush(&mut alive).await;
    assert_eq!(
        pending(&mut con).await,
        0,
        "the deleted one left the pending list"
    );
}

/// `connected_clients` of the server's `INFO`, this query's own connection included.
#[cfg(feature = "metrics")]
fn connected_clients(server: &RedisServer) -> u64 {
    let info: String = server
        .query_blocking(redis::cmd("INFO").arg("clients"))
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("connected_clients in INFO")
}

/// An ack is counted after the queue's lock is released and its handle counted out: a
/// metrics recorder that panics (user code) as a stale ack is counted must not leave the
/// background task waiting for a handle that is gone — it would never end, and keep the
/// source's connection open.
#[cfg(feature = "metrics")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorder_panicking_on_a_stale_ack_lets_the_background_task_end() {
    let server = RedisServer::start();
    let mut con = server.connect().await;
    let recorder = crate::support::TestRecorder::default();
    let builder = lost_group_builder(server.connect().await, "p");
    let source = metrics::with_local_recorder(&recorder, || {
        tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(builder.build()))
    })
    .unwrap();
    produce(&mut con, 2).await;
    let mut stream = Box::pin(prefetch(source, levels(2, 0)));
    let mut held = take(&mut stream, 2).await;
    destroy_group(&mut con).await;
    until_group_recreated(&server, &mut stream).await;
    let open = connected_clients(&server);
    let stale = held.pop().unwrap();
    assert!(
        recorder.armed_while(|| stale.ack.ack()),
        "the recorder's panic reached the caller"
    );
    drop((held, stream)); // every handle gone: the task ends, the connection closes
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while connected_clients(&server) >= open && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        connected_clients(&server),
        open - 1,
        "the source's connection is still open: its background task never ended"
    );
}

/// A metrics recorder that panics (user code) as the background task counts what its
/// `XACK` acknowledged does not end the task: the acks made after it are still sent within
/// `ack_interval`, also once the source is gone. The panic ended the task: those acks went
/// only with a fetch or `flush_acks`, those made after the source was dropped never (their
/// entries stayed pending, to be delivered again), and held entries were no longer kept
/// alive (claimed by other consumers while still being worked on).
#[cfg(feature = "metrics")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorder_panicking_in_the_background_task_does_not_end_it() {
    let server = RedisServer::start();
    let mut con = server.connect().await;
    let counters = Counters::new("bg");
    let recorder = &counters.recorder;
    let source = counters.build(
        RedisStreamSource::builder(server.connect().await, KEY, GROUP, "bg")
            .block(Duration::from_millis(50))
            .min_idle(Duration::from_millis(300))
            .ack_interval(Duration::from_millis(10)),
    );
    produce(&mut con, 2).await;
    let mut stream = Box::pin(prefetch(source, levels(2, 0)));
    let mut held = take(&mut stream, 2).await;
    // The source goes: the acks are the background task's to send.
    drop(stream);
    let acked = "flowgate_demand_acked_total{name=bg}";
    recorder.panic_once_on(acked);
    held.pop().unwrap().ack.ack();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !recorder.panicked_once(acked) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(recorder.panicked_once(acked), "the task counted its XACK");
    held.pop().unwrap().ack.ack();
    assert_eq!(
        drained(&mut con).await,
        0,
        "the ack made after the panic is still sent by the background task"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_consumer_reading_on_keeps_well_over_500_held_entries_from_other_consumers() {
    const HELD: usize = 1_500;
    let (server, mut con) = with_entries(HELD as u32).await;
    // min_idle at its least, three times block: the keep-alive runs every 100 ms, and a
    // read in progress holds up a command sent behind it on the connection by 100 ms.
    let src = RedisStreamSource::builder(server.connect().await, KEY, GROUP, "a")
        .block(Duration::from_millis(100))
        .min_idle(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    let mut a = Box::pin(prefetch(src, levels(HELD, 0)));
    let held = take(&mut a, HELD).await;
    // a's loop waits for more: one blocking read after another, while the work goes on.
    let reading = tokio::spawn(async move {
        loop {
            if let Some(e) = a.next().await {
                panic!("a got {:?} again", e.map(|e| e.id));
            }
        }
    });
    let mut b = Box::pin(prefetch(source(&server, "b").await, levels(HELD, 0)));
    let mut taken = Vec::new();
    let started = tokio::time::Instant::now();
    while started.elapsed() < Duration::from_millis(2_000) {
        taken.extend(next(&mut b).await);
    }
    reading.abort();
    assert_eq!(taken.len(), 0, "b took entries a holds");
    for e in held {
        e.ack.ack();
    }
    assert_eq!(drained(&mut con).await, 0);
}

/// A connection to Redis on which the source's background task is held up: its `XACK`s
/// (single commands; a fetch sends its acks in its pipeline) wait while the test holds them,
/// so that one is in flight at a chosen moment; and its `XACK`s and keep-alives (the
/// pipelines that start with `SCRIPT LOAD`) each take `behind` longer, as behind a blocking
/// read of the source. Everything else goes to Redis at once.
#[derive(Clone)]
struct Interposed {
    conn: MultiplexedConnection,
    /// `true` while `XACK`s are held.
    hold: Arc<tokio::sync::watch::Sender<bool>>,
    /// `XACK`s held now.
    waiting: Arc<AtomicUsize>,
    /// `XACK`s Redis has answered.
    answered: Arc<AtomicUsize>,
    behind: Duration,
}

impl Interposed {
    fn new(conn: MultiplexedConnection, behind: Duration) -> Self {
        Interposed {
            conn,
            hold: Arc::new(tokio::sync::watch::Sender::new(false)),
            waiting: Arc::new(AtomicUsize::new(0)),
            answered: Arc::new(AtomicUsize::new(0)),
            behind,
        }
    }

    fn hold(&self, hold: bool) {
        self.hold.send_replace(hold);
    }

    /// Waits (up to 5 s) until an `XACK` is held.
    async fn until_one_held(&self) {
        for _ in 0..500 {
            if self.waiting.load(Ordering::SeqCst) > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no XACK was sent within 5 s");
    }

    /// Lets the `XACK`s held go, and waits (up to 5 s) until Redis has answered them.
    async fn release(&self) {
        let answered = self.answered.load(Ordering::SeqCst) + self.waiting.load(Ordering::SeqCst);
        self.hold(false);
        for _ in 0..500 {
            if self.answered.load(Ordering::SeqCst) >= answered {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the XACKs let go were not answered within 5 s");
    }
}

/// Whether `cmd` is the command `name`.
fn is_cmd(cmd: &redis::Cmd, name: &str) -> bool {
    matches!(
        cmd.args_iter().next(),
        Some(redis::Arg::Simple(n)) if n.eq_ignore_ascii_case(name.as_bytes())
    )
}

impl redis::aio::ConnectionLike for Interposed {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        Box::pin(async move {
            if is_cmd(cmd, "XACK") {
                let mut held = self.hold.subscribe();
                self.waiting.fetch_add(1, Ordering::SeqCst);
                let _ = held.wait_for(|hold| !hold).await;
                self.waiting.fetch_sub(1, Ordering::SeqCst);
                tokio::time::sleep(self.behind).await;
                let reply = self.conn.req_packed_command(cmd).await;
                self.answered.fetch_add(1, Ordering::SeqCst);
                return reply;
            }
            self.conn.req_packed_command(cmd).await
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        Box::pin(async move {
            if pipeline
                .cmd_iter()
                .next()
                .is_some_and(|c| is_cmd(c, "SCRIPT"))
            {
                tokio::time::sleep(self.behind).await;
            }
            self.conn.req_packed_commands(pipeline, offset, count).await
        })
    }

    fn get_db(&self) -> i64 {
        self.conn.get_db()
    }
}

/// A source on an [`Interposed`] connection (its background task sends each ack within
/// 1 ms; no keep-alive for 30 s) that creates its group again from `recreate_from`, behind
/// `prefetch` and handed the 2 entries produced; the first is acked and its `XACK` held on
/// its way, then the group is lost. Returns the connection, the stream, and the entry
/// still held.
async fn lost_with_an_ack_on_its_way(
    server: &RedisServer,
    con: &mut MultiplexedConnection,
    recreate_from: StartFrom,
) -> (Interposed, Prefetched<Interposed>, StreamEntry) {
    let conn = Interposed::new(server.connect().await, Duration::ZERO);
    let source = RedisStreamSource::builder(conn.clone(), KEY, GROUP, "a")
        .block(Duration::from_millis(50))
        .min_idle(Duration::from_secs(90))
        .claim_every(Duration::from_secs(60))
        .ack_interval(Duration::from_millis(1))
        .recreate_from(recreate_from)
        .build()
        .await
        .unwrap();
    produce(con, 2).await;
    let mut stream = Box::pin(prefetch(source, levels(2, 0)));
    let mut held = take(&mut stream, 2).await.into_iter();
    conn.hold(true);
    held.next().unwrap().ack.ack();
    conn.until_one_held().await;
    destroy_group(con).await;
    (conn, stream, held.next().unwrap())
}

/// The background task took an ack of the group before it was lost, and its `XACK` is
/// still on its way when a fetch meets `NOGROUP`: the group must not be created again
/// before that `XACK` is done, or it acknowledges the new group's delivery of the same id
/// (here to this very consumer, with `recreate_from(Beginning)`), which then is never
/// delivered again if its consumer crashes before it is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_on_its_way_when_the_group_is_lost_does_not_reach_the_group_created_again() {
    let server = RedisServer::start();
    let mut con = server.connect().await;
    let (conn, mut stream, _held) =
        lost_with_an_ack_on_its_way(&server, &mut con, StartFrom::Beginning).await;
    // The next fetch meets NOGROUP. (Not `next`'s 700 ms: up to 500 ms of waiting below
    // and the release come before it can end, which on a loaded host left it too little.)
    let fetching = tokio::spawn(async move {
        let e = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .ok()
            .flatten()
            .map(Result::unwrap);
        (stream, e)
    });
    // Give a group created again the time to deliver the entries anew.
    for _ in 0..50 {
        if group_exists(&server) && pending(&mut con).await == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    conn.release().await;
    let (_stream, again) = fetching.await.unwrap();
    let again = again.expect("the new group delivers the entries again");
    // Both entries are pending in the new group until acked.
    assert_eq!(
        pending(&mut con).await,
        2,
        "the XACK of the lost group acknowledged a delivery of the new one"
    );
    drop(again);
}

/// The source is dropped while its fetch, which met `NOGROUP`, waits for the background
/// task's `XACK` on its way before it forgets the lost group: the group is forgotten all
/// the same, so an entry of the lost group acknowledged afterwards is not sent to the
/// group another consumer creates again (here with `start_from(Beginning)`, which delivers
/// the same ids anew), where it would acknowledge that consumer's delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_dropped_while_it_forgets_a_lost_group_sends_none_of_its_acks_to_the_next() {
    let server = RedisServer::start();
    let mut con = server.connect().await;
    let (conn, mut stream, held) =
        lost_with_an_ack_on_its_way(&server, &mut con, StartFrom::Beginning).await;
    // The next fetch meets NOGROUP and waits for the XACK held on its way.
    let waited = tokio::time::timeout(Duration::from_millis(500), stream.next()).await;
    assert!(waited.is_err(), "the fetch waits for the XACK on its way");
    assert!(
        !group_exists(&server),
        "not created again while the XACK is on its way"
    );
    drop(stream);
    // That XACK reaches no group.
    conn.release().await;
    // Another consumer creates the group again and is delivered both entries anew.
    let mut other = Box::pin(prefetch(source(&server, "b").await, levels(2, 0)));
    let again = take(&mut other, 2).await;
    assert_eq!(pending(&mut con).await, 2);
    // The entry of the lost group still held is acknowledged: its ack must not be sent.
    held.ack.ack();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        pending(&mut con).await,
        2,
        "an ack of the lost group acknowledged the new group's delivery"
    );
    drop(again);
}

/// `flush_acks` given up (a shutdown under a timeout) while its `XACK` is on its way: the
/// ids it took are queued again, as a fetch's are, so the next send acknowledges them. They
/// left the queue and were neither sent nor counted, and their entries, no longer held,
/// went idle for another consumer to claim and process again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_acks_given_up_with_its_xack_on_its_way_loses_no_ack() {
    let server = RedisServer::start();
    let mut con = server.connect().await;
    let conn = Interposed::new(server.connect().await, Duration::ZERO);
    let source = lost_group_builder(conn.clone(), "a").build().await.unwrap();
    produce(&mut con, 2).await;
    let mut stream = Box::pin(prefetch(source, levels(2, 0)));
    let held = take(&mut stream, 2).await;
    conn.hold(true);
    for entry in held {
        entry.ack.ack();
    }
    let given_up = tokio::time::timeout(Duration::from_millis(200), flush(&mut stream)).await;
    assert!(given_up.is_err(), "the XACK is held on its way");
    conn.hold(false);
    assert_eq!(
        flush(&mut stream).await,
        2,
        "the acks given up are sent again"
    );
    assert_eq!(pending(&mut con).await, 0);
}

/// `min_idle` at its least, three times `block`: when the keep-alive is due with acks
/// queued, the background task sends the `XACK` first, and each of the two can wait a whole
/// `block` behind a read of the source on the same connection. Held entries must still be
/// touched before they are `min_idle` idle, for another consumer to claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_entries_never_go_min_idle_idle_when_acks_and_keep_alives_each_wait_a_block() {
    const HELD: u32 = 100;
    let (server, mut con) = with_entries(HELD).await;
    // Long enough that the margin the keep-alive keeps (block / 2) covers the scheduling
    // delays of a loaded machine.
    let block = Duration::from_millis(300);
    let min_idle = block * 3;
    let conn = Interposed::new(server.connect().await, block);
    // Acks leave only when the keep-alive is due.
    let src = RedisStreamSource::builder(conn, KEY, GROUP, "a")
        .block(block)
        .min_idle(min_idle)
        .ack_interval(Duration::from_secs(10))
        .build()
        .await
        .unwrap();
    let mut a = Box::pin(prefetch(src, levels(HELD as usize, 0)));
    let mut held = take(&mut a, HELD as usize).await;
    // One entry done every 25 ms: acks are always queued when the keep-alive is due.
    let acking = tokio::spawn(async move {
        while let Some(e) = held.pop() {
            e.ack.ack();
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    });
    // What another consumer's XAUTOCLAIM with this min_idle would take from a.
    let mut idle = redis::cmd("XPENDING");
    idle.arg(KEY)
        .arg(GROUP)
        .arg("IDLE")
        .arg(min_idle.as_millis() as u64)
        .arg("-")
        .arg("+")
        .arg(10)
        .arg("a");
    while !acking.is_finished() {
        let claimable = ids(idle.query_async(&mut con).await.unwrap());
        assert!(
            claimable.is_empty(),
            "{claimable:?} went {min_idle:?} idle while a held them"
        );
    }
    acking.await.unwrap();
}

/// A fetch that meets `NOGROUP` while the background task's `XACK` is on its way waits for
/// that send before it creates the group again. If the stream is then not polled (the
/// application works on what it holds, or stops and flushes), `flush_acks` must still
/// return: it cannot wait behind a fetch that nobody polls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_acks_returns_while_a_fetch_that_met_a_lost_group_is_not_polled() {
    let server = RedisServer::start();
    let mut con = server.connect().await;
    let (conn, mut stream, _held) =
        lost_with_an_ack_on_its_way(&server, &mut con, StartFrom::New).await;
    // The next fetch meets NOGROUP and waits for that XACK; then the stream is not polled.
    let polled = tokio::time::timeout(Duration::from_millis(300), stream.next()).await;
    assert!(polled.is_err(), "the fetch waits for the XACK on its way");
    conn.release().await;
    let flushed = tokio::time::timeout(
        Duration::from_secs(5),
        stream.as_mut().get_mut().get_mut().flush_acks(),
    )
    .await;
    assert!(
        flushed.is_ok(),
        "flush_acks waited for the fetch in progress, which nobody polls"
    );
    // Polled again, the fetch creates the group again.
    until_group_recreated(&server, &mut stream).await;
}

/// A claim that fails for good (`XAUTOCLAIM` refused: a server older than 6.2, an ACL
/// without it) is the fetch's error, and reads of new entries go on between claims: the
/// consumer keeps consuming. (It tried the claim again on every fetch: once `claim_every`
/// had passed, no new entry was read again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_keeps_failing_lets_reads_of_new_entries_go_on() {
    let (server, mut con) = with_entries(0).await;
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "default", "-xautoclaim"])
        .query_async(&mut con)
        .await
        .unwrap();
    // A claim every 100 ms.
    let mut stream = Box::pin(prefetch(source(&server, "c").await, levels(5, 0)));
    let mut errors = 0;
    let started = tokio::time::Instant::now();
    for round in 0..8 {
        // Past `claim_every`: a claim is due before the next read.
        tokio::time::sleep(Duration::from_millis(150)).await;
        produce(&mut con, 2).await;
        let mut taken = 0;
        while taken < 2 {
            match tokio::time::timeout(Duration::from_secs(2), stream.next()).await {
                Ok(Some(Ok(e))) => {
                    e.ack.ack();
                    taken += 1;
                }
                Ok(Some(Err(e))) => {
                    assert_eq!(e.code(), Some("NOPERM"), "{e}");
                    errors += 1;
                    assert!(
                        errors <= 20,
                        "round {round}: {errors} failed claims and no new entry read"
                    );
                }
                _ => panic!(
                    "round {round}: no new entry read in 2 s while claims fail ({errors} errors)"
                ),
            }
        }
    }
    assert!(errors >= 1, "the failed claim is the fetch's error");
    // One failed claim per `claim_every` at most, not one per fetch.
    let passes = started.elapsed().as_millis() / 100 + 1;
    assert!(
        errors as u128 <= passes,
        "{errors} errors in {passes} claim periods"
    );
}

/// `XACK` refused for good while reads are still allowed (an ACL without `XACK`): every ack
/// goes back to the queue, and the source must not go on reading entries whose acks can
/// only pile up there. Once an `XACK` failed, the next fetch sends the queued acks alone
/// first and returns Redis's refusal instead of reading; once `XACK` is allowed again, the
/// acks go through and the reads go on. (The fetch pipeline ignored the `XACK`'s error and
/// read on: the queue grew by every entry delivered, and the consumer never saw an error.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_xack_stops_the_reads_with_its_error_instead_of_queueing_acks_for_ever() {
    const N: u32 = 500;
    const HIGH: usize = 10;
    let (server, mut con) = with_entries(N).await;
    let mut stream = Box::pin(prefetch(source(&server, "c").await, levels(HIGH, 0)));
    let acl = |rule: &'static str| redis::cmd("ACL").arg(&["SETUSER", "default", rule]).clone();
    let _: () = acl("-xack").query_async(&mut con).await.unwrap();
    let mut read = 0;
    let refused = loop {
        match tokio::time::timeout(Duration::from_secs(5), stream.next()).await {
            Ok(Some(Ok(e))) => {
                e.ack.ack();
                read += 1;
                if read == N {
                    panic!("all {N} entries read while every XACK was refused, no error");
                }
            }
            Ok(Some(Err(e))) => break e,
            _ => panic!("no entry and no error within 5 s ({read} read)"),
        }
    };
    assert_eq!(refused.code(), Some("NOPERM"), "{refused}");
    // At most the batches read before the refusal was seen (one carrying the failed
    // XACK, one more if the background task's send failed meanwhile).
    assert!(
        read <= 3 * HIGH as u32,
        "{read} entries read while every XACK was refused"
    );
    // While XACK stays refused, no entry is read: each fetch is the refusal again.
    for _ in 0..3 {
        match tokio::time::timeout(Duration::from_secs(5), stream.next()).await {
            Ok(Some(Err(e))) => assert_eq!(e.code(), Some("NOPERM"), "{e}"),
            Ok(Some(Ok(e))) => panic!("entry {} read while XACK is refused", e.id),
            _ => panic!("no error within 5 s"),
        }
    }
    assert_eq!(
        pending(&mut con).await,
        u64::from(read),
        "nothing was acked"
    );
    // XACK allowed again: the queued acks go through, and the rest is read.
    let _: () = acl("+xack").query_async(&mut con).await.unwrap();
    while read < N {
        match tokio::time::timeout(Duration::from_secs(5), stream.next()).await {
            Ok(Some(Ok(e))) => {
                e.ack.ack();
                read += 1;
            }
            Ok(Some(Err(e))) => panic!("{e} after XACK was allowed again"),
            _ => panic!("no entry within 5 s after XACK was allowed again ({read} read)"),
        }
    }
    flush(&mut stream).await;
    assert_eq!(pending(&mut con).await, 0, "every ack went through");
}

/// Every ack is acked, stale or unsent: the background task gives up on acks whose `XACK`
/// is refused once every handle is gone (nothing left to wait for), and those are counted
/// in `flowgate_demand_unsent_acks_total`. Their entries stay pending (delivered again:
/// at-least-once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_the_background_task_gives_up_on_are_counted_as_unsent() {
    let counters = Counters::new("given_up");
    let (server, mut con) = with_entries(3).await;
    let source = counters.build(
        RedisStreamSource::builder(server.connect().await, KEY, GROUP, "g")
            .block(Duration::from_millis(50))
            .min_idle(Duration::from_secs(90))
            .ack_interval(Duration::from_millis(5)),
    );
    let mut stream = Box::pin(prefetch(source, levels(3, 0)));
    let held = take(&mut stream, 3).await;
    drop(stream);
    let acl = |rule: &'static str| redis::cmd("ACL").arg(&["SETUSER", "default", rule]).clone();
    let _: () = acl("-xack").query_async(&mut con).await.unwrap();
    for e in held {
        e.ack.ack();
    }
    // The task sends, is refused, finds no handle left and ends.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while counters.get("unsent_acks").unwrap_or(3) < 3 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _: () = acl("+xack").query_async(&mut con).await.unwrap();
    let counted = ["acked", "stale_acks", "unsent_acks"].map(|m| counters.get(m));
    if let [Some(acked), Some(stale), Some(unsent)] = counted {
        assert_eq!((acked, stale, unsent), (0, 0, 3), "the 3 acks given up");
    }
    assert_eq!(pending(&mut con).await, 3, "left pending: delivered again");
}

/// The journey under a server that stops answering (SIGSTOP: a long GC pause, a partition)
/// with entries held and acks queued: every fetch meanwhile fails with the connection's
/// timeout (none hangs, none delivers), and once the server answers again every entry is
/// processed (the reads Redis ran for fetches the client had given up on leave entries
/// pending for this consumer: it claims them once idle), every ack counted as acked or
/// stale, and nothing is left pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_server_under_the_source_loses_no_entry_and_no_ack() {
    const N: u32 = 20;
    let server = RedisServer::start();
    let counters = Counters::new("paused");
    let mut con = server.connect().await;
    let source = counters.build(
        RedisStreamSource::builder(server.connect().await, KEY, GROUP, "p")
            .block(Duration::from_millis(50))
            .min_idle(Duration::from_millis(300))
            .claim_every(Duration::from_millis(100)),
    );
    produce(&mut con, N).await;
    let mut stream = Box::pin(
        Prefetch::builder(source, levels(4, 0))
            .retry_backoff(Duration::from_millis(10), Duration::from_millis(50))
            .build()
            .unwrap(),
    );
    let mut seen: HashMap<u32, u32> = HashMap::new();
    let mut acks = 0u64;
    let mut held = take(&mut stream, 4).await;
    for e in held.drain(..2) {
        *seen.entry(e.get("n").unwrap()).or_default() += 1;
        e.ack.ack();
        acks += 1;
    }

    server.pause();
    let mut errors = 0;
    let until = tokio::time::Instant::now() + Duration::from_millis(1_500);
    while tokio::time::Instant::now() < until {
        match tokio::time::timeout(Duration::from_secs(2), stream.next()).await {
            Ok(Some(Err(e))) => {
                assert!(
                    e.is_timeout() || e.is_io_error(),
                    "why the fetch failed: {e}"
                );
                errors += 1;
            }
            Ok(Some(Ok(e))) => panic!("a paused server delivered {}", e.id),
            Ok(None) => panic!("the stream ended"),
            Err(_) => panic!("a fetch hung on the paused server"),
        }
    }
    assert!(
        errors >= 1,
        "the fetches failed while the server was paused"
    );
    server.resume();

    for e in held {
        *seen.entry(e.get("n").unwrap()).or_default() += 1;
        e.ack.ack();
        acks += 1;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while seen.len() < N as usize && tokio::time::Instant::now() < deadline {
        if let Some(e) = next_ok(&mut stream).await {
            *seen.entry(e.get("n").unwrap()).or_default() += 1;
            e.ack.ack();
            acks += 1;
        }
    }
    let mut values: Vec<u32> = seen.keys().copied().collect();
    values.sort_unstable();
    assert_eq!(values, (0..N).collect::<Vec<_>>(), "every entry processed");
    flush(&mut stream).await;
    assert_eq!(drained(&mut con).await, 0, "nothing left pending");
    let counted = ["acked", "stale_acks", "unsent_acks"].map(|m| counters.get(m));
    if let [Some(acked), Some(stale), Some(unsent)] = counted {
        assert_eq!(acked + stale, acks, "every ack made is acked or stale");
        assert_eq!(unsent, 0);
        // An `XACK` Redis ran after the client gave up on its answer is sent again and
        // answered 0: stale, not acked (see `flush_acks`).
        assert!(acked <= acks, "acked {acked} of {acks}");
    }
}

/// `ms-seq` as one increasing number, for a `CommitTracker`.
pub(super) fn offset_of(id: &str) -> u64 {
    let (ms, seq) = id.split_once('-').unwrap();
    (ms.parse::<u64>().unwrap() << 20) | seq.parse::<u64>().unwrap()
}

/// The consumer loop of the module's docs shut down with work in flight (close the
/// bulkhead, poll the stream to its end, flush the acks), then started again under the same
/// name: what the first run finished is acknowledged in Redis and never delivered again;
/// what it fetched and did not finish (still buffered, or held waiting for a permit) is
/// recovered first, each once; the rest comes new; nothing is lost. The commits of the
/// first run never pass an offset it did not finish.
#[tokio::test]
async fn a_consumer_loop_shut_down_with_work_in_flight_and_started_again_loses_nothing() {
    use flowgate::FlowStreamExt;
    use flowgate::bulkhead::Bulkhead;
    use flowgate::demand::{CommitToken, CommitTracker};
    use std::collections::BTreeSet;
    const N: u32 = 30;
    let (server, mut con) = with_entries(N).await;
    let bulkhead = Bulkhead::new(3).unwrap();
    let tracker = CommitTracker::new();
    let tracked = Arc::new(Mutex::new(Vec::new()));
    let (t, log) = (tracker.clone(), tracked.clone());
    let mut stream = Box::pin(
        prefetch(source(&server, "c").await, levels(8, 2))
            .then(move |r| {
                let (t, log) = (t.clone(), log.clone());
                async move {
                    let e = r.unwrap();
                    let token = t.track(offset_of(&e.id)).unwrap();
                    log.lock().unwrap().push(token.offset());
                    (e, token)
                }
            })
            .bulkhead_map_unordered(bulkhead.clone(), |(e, token)| async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                (e, token)
            }),
    );
    let mut processed = BTreeSet::new();
    let mut finished = BTreeSet::new();
    let mut finish = |(e, token): (StreamEntry, CommitToken)| {
        assert!(
            processed.insert(e.get::<u32>("n").unwrap()),
            "processed twice"
        );
        finished.insert(token.offset());
        e.ack.ack();
        token.done();
    };
    for _ in 0..10 {
        finish(stream.next().await.unwrap());
    }
    bulkhead.close();
    while let Some(out) = tokio::time::timeout(Duration::from_secs(2), stream.next())
        .await
        .expect("the loop ends once its bulkhead is closed")
    {
        finish(out);
    }
    stream
        .as_mut()
        .get_pin_mut()
        .get_pin_mut()
        .get_pin_mut()
        .get_mut()
        .flush_acks()
        .await
        .unwrap();
    drop(stream);
    let committable = tracker.committable();
    for offset in tracked.lock().unwrap().iter() {
        if Some(*offset) <= committable {
            assert!(
                finished.contains(offset),
                "committed past unfinished {offset}"
            );
        }
    }
    let unfinished = tracked.lock().unwrap().len() - finished.len();
    assert_eq!(
        tracker.dropped(),
        unfinished as u64,
        "tokens dropped unfinished"
    );
    let left = pending(&mut con).await;

    let mut stream = Box::pin(prefetch(source(&server, "c").await, levels(8, 2)));
    let mut recovered = BTreeSet::new();
    let mut fresh = BTreeSet::new();
    while (processed.len() + recovered.len() + fresh.len()) < N as usize {
        let e = next(&mut stream)
            .await
            .unwrap_or_else(|| panic!("lost: {processed:?} {recovered:?} {fresh:?}"));
        let n: u32 = e.get("n").unwrap();
        assert!(
            !processed.contains(&n),
            "{n} was finished and acknowledged before"
        );
        let set = match e.origin {
            Origin::OwnPending => &mut recovered,
            Origin::New => &mut fresh,
            Origin::Claimed => panic!("nothing to claim: {n}"),
        };
        assert!(set.insert(n), "{n} delivered twice");
        e.ack.ack();
    }
    assert_eq!(
        recovered.len() as u64,
        left,
        "what was pending is recovered"
    );
    assert!(recovered.is_disjoint(&fresh));
    assert!(next(&mut stream).await.is_none(), "nothing more");
    flush(&mut stream).await;
    assert_eq!(drained(&mut con).await, 0, "every entry acknowledged once");
}

/// What the group journey records: per entry, how often it was processed, and every
/// entry a slow consumer got new (no other consumer may process those while it lives).
#[derive(Default)]
struct GroupLog {
    seen: HashMap<u32, u32>,
    acks_made: u64,
    slow_new: Vec<u32>,
}

/// A consumer-group journey: consumers `a` (fast), `slow` (each entry takes longer than
/// `min_idle`) and `doomed` (its task aborted mid-run holding entries) share a stream; `late`
/// joins half-way. Every entry is processed at least once, Redis ends with nothing pending,
/// and the counters agree with Redis: `acked` sums to the entries produced (each left the
/// pending list once), every ack made is acked, stale or unsent, and none is unsent. The
/// entries the live slow consumer held are never claimed by another.
#[cfg(feature = "metrics")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_with_a_dead_a_slow_and_a_late_consumer_acks_every_entry_exactly_once() {
    const N: u32 = 2_000;
    let (server, mut con) = with_entries(N).await;
    let log: Arc<Mutex<GroupLog>> = Default::default();
    let done = Arc::new(AtomicBool::new(false));
    let names = ["a", "slow", "doomed", "late"];
    let counters: Vec<Arc<Counters>> = names.iter().map(|n| Arc::new(Counters::new(n))).collect();
    let spawn = |i: usize| {
        let (log, done, counters) = (log.clone(), done.clone(), counters[i].clone());
        let name = names[i];
        let builder = RedisStreamSource::builder(
            tokio::task::block_in_place(|| {
                tokio::runtime::Handle::current().block_on(server.connect())
            }),
            KEY,
            GROUP,
            name,
        )
        .block(Duration::from_millis(50))
        .min_idle(Duration::from_millis(300))
        .claim_every(Duration::from_millis(100));
        let source = counters.build(builder);
        tokio::spawn(async move {
            let slow = name == "slow";
            let mut stream = Box::pin(prefetch(
                source,
                if slow { levels(3, 0) } else { levels(50, 10) },
            ));
            while let Some(e) = next_until(&mut stream, &done).await {
                let n: u32 = e.get("n").unwrap();
                if slow {
                    if e.origin == Origin::New {
                        log.lock().unwrap().slow_new.push(n);
                    }
                    tokio::time::sleep(Duration::from_millis(450)).await;
                } else {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                {
                    let mut log = log.lock().unwrap();
                    *log.seen.entry(n).or_default() += 1;
                    log.acks_made += 1;
                    if log.seen.len() == N as usize {
                        done.store(true, Ordering::SeqCst);
                    }
                }
                e.ack.ack();
            }
            flush(&mut stream).await;
        })
    };
    let a = spawn(0);
    let slow = spawn(1);
    let doomed = spawn(2);
    tokio::time::sleep(Duration::from_millis(150)).await;
    doomed.abort();
    let _ = doomed.await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let late = spawn(3);
    let finished = tokio::time::timeout(Duration::from_secs(60), async {
        for t in [a, slow, late] {
            t.await.unwrap();
        }
    })
    .await;
    let left = drained(&mut con).await;
    let log = std::mem::take(&mut *log.lock().unwrap());
    assert!(
        finished.is_ok(),
        "timeout: {} of {N} processed, {left} pending",
        log.seen.len()
    );
    assert_eq!(log.seen.len(), N as usize, "every entry processed");
    assert_eq!(left, 0, "nothing pending in Redis");
    for n in &log.slow_new {
        assert_eq!(
            log.seen[n], 1,
            "{n}, held by the live slow consumer, processed again"
        );
    }
    // The background task of the aborted consumer sends its acks after it is gone.
    let sum = |m: &str| counters.iter().map(|c| c.get(m).unwrap()).sum::<u64>();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while sum("acked") + sum("stale_acks") + sum("unsent_acks") < log.acks_made
        && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // No entry was processed twice: the slow one's held entries were kept alive, and
    // only what the doomed one dropped unacknowledged was claimed.
    assert_eq!(
        log.acks_made,
        u64::from(N),
        "each entry processed exactly once"
    );
    assert_eq!(sum("unsent_acks"), 0);
    assert_eq!(
        sum("acked") + sum("stale_acks"),
        log.acks_made,
        "every ack made is acked or stale"
    );
    // Acks a fetch of the doomed one carried when its task was aborted are sent again by
    // its background task: Redis, which had them already, answers 0, and they count as
    // stale (the fetch's cancel safety says so), so `acked` may fall short of what Redis
    // acknowledged by those, never above it.
    assert!(sum("acked") <= u64::from(N));
    assert_eq!(
        sum("acked") + counters[2].get("stale_acks").unwrap(),
        u64::from(N),
        "only the aborted fetch's acks count as stale"
    );
    for (c, name) in counters.iter().zip(names) {
        assert!(c.get("acked").unwrap() > 0, "{name} did some work");
    }
}

/// The stream trimmed (`XTRIM MAXLEN 0`) under entries a live consumer holds: their acks
/// are counted (acked, or stale if Redis dropped them from the pending list), nothing stays
/// pending, and the consumer reads on.
#[cfg(feature = "metrics")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_trimmed_under_held_entries_leaves_nothing_pending_and_reads_on() {
    let (server, mut con) = with_entries(10).await;
    let counters = Counters::new("trimmed");
    let builder = RedisStreamSource::builder(server.connect().await, KEY, GROUP, "t")
        .block(Duration::from_millis(50))
        .min_idle(Duration::from_millis(300))
        .claim_every(Duration::from_millis(100));
    let mut stream = Box::pin(prefetch(counters.build(builder), levels(5, 0)));
    let held = take(&mut stream, 5).await;
    let _: u64 = redis::cmd("XTRIM")
        .arg(KEY)
        .arg("MAXLEN")
        .arg(0)
        .query_async(&mut con)
        .await
        .unwrap();
    // Past a few keep-alives and claim passes.
    tokio::time::sleep(Duration::from_millis(700)).await;
    for e in held {
        e.ack.ack();
    }
    produce(&mut con, 3).await;
    let mut fresh = 0;
    while let Some(e) = next(&mut stream).await {
        assert_eq!(e.origin, Origin::New, "{}", e.id);
        fresh += 1;
        e.ack.ack();
    }
    assert_eq!(fresh, 3);
    flush(&mut stream).await;
    let (acked, stale) = (
        counters.get("acked").unwrap(),
        counters.get("stale_acks").unwrap(),
    );
    assert_eq!(
        acked + stale,
        8,
        "every ack counted ({acked} acked, {stale} stale)"
    );
    assert_eq!(drained(&mut con).await, 0);
}

/// A consumer whose handler panics mid-batch: its task ends, the entries it held and its
/// buffer go back to the pending list unacknowledged, and another consumer claims and
/// finishes them; what it acknowledged before the panic reaches Redis, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_of_a_consumer_whose_handler_panics_are_claimed_by_another() {
    const N: u32 = 40;
    let (server, mut con) = with_entries(N).await;
    let doomed = source(&server, "p").await;
    let before = tokio::spawn(async move {
        let mut stream = Box::pin(prefetch(doomed, levels(10, 2)));
        loop {
            let e = stream.next().await.unwrap().unwrap();
            let n: u32 = e.get("n").unwrap();
            assert!(n != 15, "handler fails on {n}");
            e.ack.ack();
        }
    });
    assert!(before.await.unwrap_err().is_panic());
    let mut stream = Box::pin(prefetch(source(&server, "q").await, levels(10, 2)));
    let mut seen = std::collections::BTreeSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while seen.len() < (N - 15) as usize && tokio::time::Instant::now() < deadline {
        if let Some(e) = next(&mut stream).await {
            let n: u32 = e.get("n").unwrap();
            assert!(n >= 15, "{n} was acknowledged before the panic");
            assert!(seen.insert(n), "{n} twice");
            e.ack.ack();
        }
    }
    assert_eq!(seen.len(), (N - 15) as usize, "{seen:?}");
    flush(&mut stream).await;
    assert_eq!(drained(&mut con).await, 0);
}
