//! A Kafka-style consumer loop: a batch source read by demand (`prefetch`), a pool of workers
//! behind a bulkhead (`bulkhead_map_unordered`; simulated work of 1–4 ms that fails 5 % of
//! attempts and is retried once), and a `CommitTracker` that commits only the contiguous
//! prefix of finished offsets while work completes out of order. An item whose both attempts
//! failed (24 of the 10 000 in memory, 2 of the 1 000 on Redis) is dead-lettered and its
//! offset given up (`CommitToken::abandon`), so commits go on past it; the tracker is
//! bounded, and the source waits (`until_ready`) while it is full.
//!
//! - By default the source is in memory: a `BatchSource` over numbered offsets of one
//!   partition, returning at once at most what `prefetch` asks for.
//! - With `REDIS_URL` set, the source is a Redis Streams consumer group (`RedisStreamSource`)
//!   on a fresh stream key (deleted at the end): every entry is acked when done and the entry
//!   ids are the offsets. Consumer `c1` drops a few entries without acking them or finishing
//!   their tokens (as if their worker had crashed: the commits of `c1` stop there); consumer
//!   `c2` claims them once idle (`XAUTOCLAIM`) and finishes them: a redelivery,
//!   at-least-once.
//!
//! ```text
//! cargo run --example consumer_loop
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run --example consumer_loop
//! ```

#[path = "support/cli.rs"]
mod cli;
#[path = "support/redis_url.rs"]
mod redis_url;

use std::pin::{Pin, pin};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use flowgate::FlowStreamExt;
use flowgate::bulkhead::Bulkhead;
use flowgate::demand::{
    BatchSource, CommitTracker, Fetched, Levels, RedisStreamSource, StreamEntry, TrackError,
    prefetch,
};
use futures::StreamExt;
use tokio::time::{sleep, timeout};

type Error = Box<dyn std::error::Error>;

const WORKERS: usize = 32;
const FAIL_PERCENT: u64 = 5;
const MAX_ATTEMPTS: u64 = 2;

/// splitmix64 of `(key, attempt)`: the same "random" run every time.
fn mix(key: u64, attempt: u64) -> u64 {
    let mut z = key ^ attempt.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The simulated work for item `key`: 1–4 ms, retried on failure. Returns the retries used,
/// or `None` if every attempt failed.
async fn work(key: u64) -> Option<u64> {
    for attempt in 0..MAX_ATTEMPTS {
        let r = mix(key, attempt);
        sleep(Duration::from_micros(1_000 + r % 3_000)).await;
        if r % 100 >= FAIL_PERCENT {
            return Some(attempt);
        }
    }
    None
}

/// One partition of numbered offsets: each poll returns `max` of them (as a Kafka poll would).
struct Partition {
    next: u64,
    end: u64,
}

impl BatchSource for Partition {
    type Item = u64;
    type Error = std::convert::Infallible;

    fn poll_fetch(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        max: usize,
    ) -> Fetched<u64, Self::Error> {
        if self.next >= self.end {
            return Poll::Ready(None);
        }
        let n = (max as u64).min(self.end - self.next);
        self.next += n;
        Poll::Ready(Some(Ok((self.next - n..self.next).collect())))
    }
}

async fn in_memory() -> Result<(), Error> {
    const OFFSETS: u64 = 10_000;
    let tracker = CommitTracker::builder()
        .max_pending(4_096)
        .name("partition-0")
        .build()?;
    let source = Partition {
        next: 0,
        end: OFFSETS,
    };
    let t = tracker.clone();
    // Tokens are taken in offset order, as items leave the source (`then` runs one at a time),
    // and the source waits while the tracker is full; work completes in any order. The
    // partition cannot fail (`Error = Infallible`): `items()` yields the offsets themselves.
    let mut done = pin!(
        prefetch(source, Levels::new(256, 64)?)
            .items()
            .then(move |offset| {
                let t = t.clone();
                async move {
                    t.until_ready().await;
                    t.track(offset)
                }
            })
            .bulkhead_map_unordered(Bulkhead::new(WORKERS)?, |tracked| async move {
                let token = tracked?;
                let outcome = work(token.offset()).await;
                Ok::<_, TrackError>((token, outcome))
            })
    );
    let (mut processed, mut retries, mut dead_letters) = (0u64, 0, Vec::new());
    while let Some(finished) = done.next().await {
        let (token, outcome) = finished?;
        let Some(r) = outcome else {
            // Every attempt failed: hand the record to a dead-letter queue (a real consumer
            // produces it to a dead-letter topic first), then give the offset up so the
            // commits go on past it.
            dead_letters.push(token.offset());
            token.abandon();
            continue;
        };
        (processed, retries) = (processed + 1, retries + r);
        let offset = token.offset();
        token.done();
        if processed % 2_000 == 0 {
            println!(
                "processed {processed:>5}  (last finished {offset:>5})  committable {:?}  not yet committable {}",
                tracker.committable(),
                tracker.pending()
            );
        }
    }
    let committed = tracker.committable().map_or(0, |o| o + 1);
    println!(
        "\nin memory: {OFFSETS} offsets, processed {processed}, retries {retries}, \
         dead-lettered {} {dead_letters:?} (abandoned {})",
        dead_letters.len(),
        tracker.abandoned()
    );
    println!(
        "committed {committed} offsets (Kafka would commit next offset {committed}); redelivered 0"
    );
    Ok(())
}

/// `ms-seq` as one increasing number, for the `CommitTracker` (and back, for printing):
/// 44 bits of milliseconds (until the year 2527) and 20 of sequence, enough for the ids
/// `XADD *` makes (a sequence past a million within one millisecond would not fit).
fn offset_of(id: &str) -> u64 {
    let (ms, seq) = id.split_once('-').expect("a stream id");
    let (ms, seq): (u64, u64) = (ms.parse().expect("ms"), seq.parse().expect("seq"));
    assert!(
        ms < 1 << 44 && seq < 1 << 20,
        "stream id {id} does not fit this example's offsets"
    );
    (ms << 20) | seq
}

fn id_of(offset: Option<u64>) -> String {
    offset.map_or("none".into(), |o| format!("{}-{}", o >> 20, o & 0xF_FFFF))
}

async fn redis_streams(url: &str) -> Result<(), Error> {
    const ENTRIES: u64 = 1_000;
    let client = redis_url::client(url);
    let mut con = client
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| {
            eprintln!("cannot connect to Redis at REDIS_URL={url}: {e}");
            eprintln!(
                "start one: `redis-server --save \"\" --appendonly no &`, or unset REDIS_URL to \
             run on the in-memory source"
            );
            std::process::exit(1);
        });
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?;
    let key = format!(
        "flowgate:consumer_loop:{}:{}",
        std::process::id(),
        now.as_nanos()
    );
    let result = consume(&client, &mut con, &key, ENTRIES).await;
    // Delete the stream whatever happened; a failed run's own error is the one to report.
    match redis::cmd("DEL")
        .arg(&key)
        .query_async::<()>(&mut con)
        .await
    {
        Ok(()) => println!("deleted stream {key}"),
        Err(e) => eprintln!("could not delete stream {key}: {e}"),
    }
    result
}

/// Each source reads over a connection of its own (a clone of a `MultiplexedConnection`
/// shares its socket): a blocking read holds up every command behind it on its connection
/// for up to `block`, so the producer's `XADD`s and the final `XPENDING` on `con` never wait
/// behind one. A source's own acks and keep-alives do share its connection (see
/// `RedisStreamSourceBuilder::ack_interval`).
async fn consume(
    client: &redis::Client,
    con: &mut redis::aio::MultiplexedConnection,
    key: &str,
    entries: u64,
) -> Result<(), Error> {
    const GROUP: &str = "consumer-loop";
    let own = client.get_multiplexed_async_connection().await?;
    let c1 = RedisStreamSource::builder(own, key, GROUP, "c1")
        .block(Duration::from_millis(100))
        .build()
        .await?;
    let mut pipe = redis::pipe();
    for n in 0..entries {
        pipe.cmd("XADD").arg(key).arg("*").arg("n").arg(n).ignore();
    }
    pipe.query_async::<()>(con).await?;
    println!("produced {entries} entries on {key}");

    let tracker = CommitTracker::builder().name("c1").build()?;
    let t = tracker.clone();
    let mut done = pin!(
        prefetch(c1, Levels::new(64, 16)?)
            .then(move |r| {
                // Tracked as entries leave the source (in id order); a fetch error passes
                // through.
                let t = t.clone();
                async move {
                    let entry: StreamEntry = r?;
                    t.until_ready().await;
                    let token = t.track(offset_of(&entry.id))?;
                    Ok::<_, Error>((entry.get::<u64>("n")?, entry, token))
                }
            })
            .bulkhead_map_unordered(Bulkhead::new(WORKERS)?, |tracked| async move {
                let (n, entry, token) = tracked?;
                Ok::<_, Error>((entry, token, n, work(n).await))
            })
    );
    let (mut processed, mut crashed, mut dead_lettered) = (0u64, 0u64, 0u64);
    for i in 1..=entries {
        let (entry, token, n, outcome) = done.next().await.expect("endless")?;
        // Entries 17, 267, 517, 767: the worker "crashes" after the work, before the ack.
        if n % 250 == 17 {
            crashed += 1;
            // Ack and token dropped unfinished: pending in Redis (c2 claims it), and the
            // token holds the commits of c1 (counted in `dropped`).
            drop((entry, token));
            continue;
        }
        if outcome.is_none() {
            // Every attempt failed: dead-letter it (a real consumer would XADD it to a
            // dead-letter stream first), ack it and give the offset up.
            dead_lettered += 1;
            entry.ack.ack();
            token.abandon();
            continue;
        }
        processed += 1;
        entry.ack.ack();
        token.done();
        if i % 200 == 0 {
            println!(
                "c1: processed {processed:>4}  committable up to {}  not yet committable {}",
                id_of(tracker.committable()),
                tracker.pending()
            );
        }
    }
    done.as_mut()
        .get_pin_mut() // Then
        .get_pin_mut() // Prefetch
        .get_pin_mut() // RedisStreamSource
        .get_mut()
        .flush_acks()
        .await?;
    println!(
        "c1: stops with {crashed} entries unacked (tokens dropped: {}), {dead_lettered} \
         dead-lettered; it may commit up to {} only",
        tracker.dropped(),
        id_of(tracker.committable())
    );

    // A second consumer claims what c1 left pending once it has been idle for 200 ms.
    let own = client.get_multiplexed_async_connection().await?;
    let c2 = RedisStreamSource::builder(own, key, GROUP, "c2")
        .block(Duration::from_millis(50))
        .min_idle(Duration::from_millis(200))
        .claim_every(Duration::from_millis(50))
        .build()
        .await?;
    let mut stream = Box::pin(prefetch(c2, Levels::new(64, 16)?));
    let mut redelivered = 0u64;
    let deadline = Instant::now() + Duration::from_secs(5);
    while redelivered < crashed && Instant::now() < deadline {
        let Ok(Some(entry)) = timeout(Duration::from_millis(100), stream.next()).await else {
            continue;
        };
        let entry = entry?;
        let n: u64 = entry.get("n")?;
        while work(n ^ 0xC2).await.is_none() {}
        println!(
            "c2: {:?} entry {} (n = {n}) processed and acked",
            entry.origin, entry.id
        );
        entry.ack.ack();
        redelivered += 1;
    }
    stream.as_mut().get_pin_mut().get_mut().flush_acks().await?;
    type Summary = (u64, redis::Value, redis::Value, redis::Value);
    let (pending, ..): Summary = redis::cmd("XPENDING")
        .arg(key)
        .arg(GROUP)
        .query_async(con)
        .await?;
    println!(
        "\nredis: {entries} entries; processed and acked {} ({processed} by c1, {redelivered} \
     redelivered to c2), dead-lettered {dead_lettered}; still pending {pending}",
        processed + redelivered
    );
    Ok(())
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    cli::no_arguments(
        "usage: consumer_loop (no arguments; with REDIS_URL, it reads a Redis Streams group)",
    );
    let start = Instant::now();
    let result = match std::env::var("REDIS_URL") {
        Ok(url) => redis_streams(&url).await,
        Err(_) => in_memory().await,
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        return std::process::ExitCode::FAILURE;
    }
    println!("done in {:.2?}", start.elapsed());
    std::process::ExitCode::SUCCESS
}
