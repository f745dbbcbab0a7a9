//! `RedisStreamSource`: a Redis Streams consumer-group member as a `BatchSource`.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::PoisonError;
use std::task::{Context, Poll};
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::streams::{StreamAutoClaimReply, StreamId, StreamReadReply};
use redis::{FromRedisValue, RedisError, RedisResult, Value};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::demand::source::{BatchSource, Fetched};
use crate::metrics::{Counter, Labels};
use crate::sync::{Arc, Mutex};

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Names of the Redis Streams metrics.
pub(crate) mod names {
    pub(crate) const ACKED: &str = "flowgate_demand_acked_total";
    pub(crate) const CLAIMED: &str = "flowgate_demand_claimed_total";
}

/// Where a new consumer group starts reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StartFrom {
    /// Every entry already in the stream (`0`).
    #[default]
    Beginning,
    /// Only entries added after the group is created (`$`).
    New,
}

#[derive(Debug)]
struct Config {
    key: String,
    group: String,
    consumer: String,
    block: Duration,
    min_idle: Duration,
    claim_every: Duration,
    ack_interval: Duration,
}

/// What the source and its [`Ack`] handles share: the ids acknowledged and not sent yet,
/// and the ids handed out and not yet acknowledged or dropped.
#[derive(Debug)]
struct AckQueue {
    state: Mutex<AckState>,
    /// Wakes the background task: an ack, or a handle gone.
    wake: Notify,
    /// Held by whoever is sending queued acks (the background task, `flush_acks`), so that
    /// `flush_acks` returns only once acks the task took before it are in Redis too.
    sending: tokio::sync::Mutex<()>,
}

#[derive(Debug)]
struct AckState {
    /// Acknowledged by the application, waiting to be sent in one `XACK`.
    ids: Vec<String>,
    /// Delivered by this source and still held by the application (their `Ack` is alive):
    /// this consumer's own `XAUTOCLAIM` returns them too once idle, and must not deliver
    /// them a second time.
    held: HashSet<String>,
    /// The source plus its live `Ack`s; the background task stops once all are gone and every ack
    /// is sent.
    handles: usize,
}

impl AckQueue {
    fn new() -> Self {
        AckQueue {
            state: Mutex::new(AckState {
                ids: Vec::new(),
                held: HashSet::new(),
                handles: 1,
            }),
            wake: Notify::new(),
            sending: tokio::sync::Mutex::new(()),
        }
    }

    fn lock(&self) -> crate::sync::MutexGuard<'_, AckState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn take(&self) -> Vec<String> {
        std::mem::take(&mut self.lock().ids)
    }

    /// Ids whose send failed go back in the queue; the background task is told, so they
    /// leave within `ack_interval` even if no fetch comes.
    fn requeue(&self, ids: Vec<String>) {
        self.lock().ids.extend(ids);
        self.wake.notify_one();
    }

    /// A handle (the source or an `Ack`) is gone; `acked`: its id is done.
    fn release(&self, id: Option<String>, acked: bool) {
        let mut st = self.lock();
        if let Some(id) = id {
            st.held.remove(&id);
            if acked {
                st.ids.push(id);
            }
        }
        st.handles -= 1;
        drop(st);
        self.wake.notify_one();
    }
}

/// The acknowledgement handle of one entry. Call [`ack`](Ack::ack) once the entry's work is
/// done; acks are batched into one `XACK`, sent with the next fetch or by the source's
/// background task within [`ack_interval`](RedisStreamSourceBuilder::ack_interval) —
/// also after the source itself was dropped.
///
/// Dropping it without `ack` leaves the entry pending: it is redelivered to this consumer
/// after a restart, or claimed (by this consumer or another) once idle longer than
/// `min_idle` (at-least-once).
#[must_use = "an entry stays pending until it is acknowledged"]
pub struct Ack {
    /// `None` once acknowledged (then dropped).
    id: Option<String>,
    queue: Arc<AckQueue>,
}

impl Ack {
    fn new(id: String, queue: Arc<AckQueue>) -> Self {
        Ack {
            id: Some(id),
            queue,
        }
    }

    /// The entry is done: acknowledge it.
    pub fn ack(mut self) {
        self.queue.release(self.id.take(), true);
    }

    /// The entry id.
    pub fn id(&self) -> &str {
        self.id.as_deref().unwrap_or_default()
    }
}

impl Drop for Ack {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            self.queue.release(Some(id), false);
        }
    }
}

impl fmt::Debug for Ack {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ack").field("id", &self.id()).finish()
    }
}

/// One stream entry, with its acknowledgement handle.
#[derive(Debug)]
#[non_exhaustive]
pub struct StreamEntry {
    /// The entry id, e.g. `1700000000000-0`.
    pub id: String,
    /// The entry's fields (empty if the entry was deleted while pending).
    pub fields: HashMap<String, Value>,
    /// How this entry reached this consumer.
    pub origin: Origin,
    /// Acknowledge it when done.
    pub ack: Ack,
}

impl StreamEntry {
    /// A field, converted.
    ///
    /// # Errors
    ///
    /// A Redis type error if the field is missing or does not convert.
    pub fn get<T: FromRedisValue>(&self, field: &str) -> RedisResult<T> {
        let value = self.fields.get(field).cloned().unwrap_or(Value::Nil);
        Ok(T::from_redis_value(value)?)
    }
}

/// How an entry reached this consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Origin {
    /// Delivered to this consumer earlier and never acknowledged (recovered at start).
    OwnPending,
    /// A new entry (`>`).
    New,
    /// Claimed after it was idle longer than `min_idle`: from a dead consumer, or one this
    /// consumer received and dropped without acknowledging.
    Claimed,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    /// Draining this consumer's own pending entries, after this id.
    OwnPending(String),
    New,
}

struct Batch {
    ids: Vec<StreamId>,
    origin: Origin,
    /// For claims: the cursor for the next `XAUTOCLAIM`.
    cursor: Option<String>,
}

/// A member of a Redis Streams consumer group, as a [`BatchSource`]: each fetch asks for
/// exactly the demand (`XREADGROUP … COUNT n`).
///
/// - On start it first drains its **own pending entries** (id `0`: delivered to this consumer
///   name before and never acknowledged, e.g. before a crash), then reads new ones (`>`),
///   waiting up to `block` for them.
/// - Every `claim_every` it runs `XAUTOCLAIM` and takes over entries idle longer than
///   `min_idle` — those of consumers that stopped, and its own that the application dropped
///   without acknowledging — yielding them as [`Origin::Claimed`]. Entries a live consumer
///   handed out and the application still holds are kept from going idle (a keep-alive
///   script, see [`min_idle`](RedisStreamSourceBuilder::min_idle)), and are never delivered
///   twice by their own consumer.
/// - Each entry carries an [`Ack`]; acknowledged ids are sent in one `XACK`, pipelined with
///   the next fetch or by a background task within
///   [`ack_interval`](RedisStreamSourceBuilder::ack_interval), also after the source is
///   dropped. Nothing is acknowledged before the application says so: at-least-once.
///
/// The group is created (with `MKSTREAM`) if it does not exist. Works over any redis-rs
/// async connection that is `Clone` (`MultiplexedConnection`, `ConnectionManager`). Give the
/// source a connection of its own: a blocking read holds up every other command multiplexed
/// on the same connection for up to `block`. Use it with
/// [`prefetch`](crate::demand::prefetch).
///
/// Ids of claimed entries are older than the new ones already seen: track them apart (or
/// ack them directly) rather than in the same [`CommitTracker`](crate::demand::CommitTracker).
pub struct RedisStreamSource<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    conn: C,
    config: Arc<Config>,
    phase: Phase,
    acks: Arc<AckQueue>,
    fetch: Option<BoxFuture<RedisResult<Batch>>>,
    next_claim: Instant,
    claim_cursor: String,
    acked: Counter,
    claimed: Counter,
}

impl<C> fmt::Debug for RedisStreamSource<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStreamSource")
            .field("config", &self.config)
            .field("phase", &self.phase)
            .field("fetching", &self.fetch.is_some())
            .finish_non_exhaustive()
    }
}

/// Builds a [`RedisStreamSource`]; from [`RedisStreamSource::builder`].
#[derive(Debug, Clone)]
pub struct RedisStreamSourceBuilder<C> {
    conn: C,
    key: String,
    group: String,
    consumer: String,
    block: Duration,
    min_idle: Duration,
    claim_every: Duration,
    ack_interval: Duration,
    start: StartFrom,
    name: Option<String>,
}

impl<C> RedisStreamSourceBuilder<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// How long a read waits for new entries (default 250 ms; `XREADGROUP BLOCK`).
    ///
    /// Keep it below the connection's response timeout (redis-rs: 500 ms by default), or
    /// idle reads fail with a timeout — and an entry Redis hands out in a read the client has
    /// already abandoned stays pending until it is claimed after `min_idle`.
    pub fn block(mut self, block: Duration) -> Self {
        self.block = crate::time::capped(block);
        self
    }

    /// Claim entries idle longer than this (default 30 s): entries of consumers that
    /// stopped, and entries this consumer received and dropped without acknowledging.
    ///
    /// While a source lives, its background task resets the idle time of the entries the
    /// application still holds every `min_idle / 3` (only while this consumer still owns
    /// them), so other consumers do not take them however long they wait in the `prefetch`
    /// buffer or take to process. A consumer whose runtime stalls for longer than
    /// `min_idle` may lose them to another (processed twice: at-least-once still holds).
    pub fn min_idle(mut self, min_idle: Duration) -> Self {
        self.min_idle = crate::time::capped(min_idle);
        self
    }

    /// How often to look for entries to claim (default 5 s).
    pub fn claim_every(mut self, every: Duration) -> Self {
        self.claim_every = crate::time::capped(every);
        self
    }

    /// Acknowledgements are sent at most this long after the first one since the last send
    /// (default 100 ms): with the next fetch if one starts sooner, otherwise by a background
    /// task on the tokio runtime the source was built on, which also sends the acks that
    /// come after the source is dropped. A send waits behind a blocking read on the same
    /// multiplexed connection, so add up to `block`.
    pub fn ack_interval(mut self, interval: Duration) -> Self {
        self.ack_interval = crate::time::capped(interval);
        self
    }

    /// Where a group created by this source starts (default [`StartFrom::Beginning`]).
    pub fn start_from(mut self, start: StartFrom) -> Self {
        self.start = start;
        self
    }

    /// The `name` label of this source's metrics.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Create the group if needed and build the source.
    ///
    /// # Errors
    ///
    /// The Redis error if the group cannot be created (other than "already exists").
    pub async fn build(mut self) -> RedisResult<RedisStreamSource<C>> {
        let start = match self.start {
            StartFrom::Beginning => "0",
            StartFrom::New => "$",
        };
        let created: RedisResult<()> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.key)
            .arg(&self.group)
            .arg(start)
            .arg("MKSTREAM")
            .query_async(&mut self.conn)
            .await;
        if let Err(e) = created
            && e.code() != Some("BUSYGROUP")
        {
            return Err(e);
        }
        let labels = Labels::new(self.name.as_deref());
        let config = Arc::new(Config {
            key: self.key,
            group: self.group,
            consumer: self.consumer,
            block: self.block,
            min_idle: self.min_idle,
            claim_every: self.claim_every,
            ack_interval: self.ack_interval,
        });
        let acks = Arc::new(AckQueue::new());
        let acked = labels.counter(names::ACKED, &[]);
        // Without a tokio runtime there is no background task: acks travel with fetches and
        // `flush_acks` only.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(keep_in_background(
                acks.clone(),
                self.conn.clone(),
                config.clone(),
                acked.clone(),
            ));
        }
        Ok(RedisStreamSource {
            conn: self.conn,
            config,
            phase: Phase::OwnPending("0".into()),
            acks,
            fetch: None,
            next_claim: Instant::now() + self.claim_every,
            claim_cursor: "0-0".into(),
            acked,
            claimed: labels.counter(names::CLAIMED, &[]),
        })
    }
}

impl<C> RedisStreamSource<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// A builder for consumer `consumer` of group `group` on stream `key`.
    pub fn builder(
        conn: C,
        key: impl Into<String>,
        group: impl Into<String>,
        consumer: impl Into<String>,
    ) -> RedisStreamSourceBuilder<C> {
        RedisStreamSourceBuilder {
            conn,
            key: key.into(),
            group: group.into(),
            consumer: consumer.into(),
            block: Duration::from_millis(250),
            min_idle: Duration::from_secs(30),
            claim_every: Duration::from_secs(5),
            ack_interval: Duration::from_millis(100),
            start: StartFrom::Beginning,
            name: None,
        }
    }

    /// Send the acknowledgements collected so far now. When it returns, every ack made
    /// before the call has reached Redis, including those the background task was sending.
    ///
    /// # Errors
    ///
    /// The Redis error; the ids are queued again.
    pub async fn flush_acks(&mut self) -> RedisResult<usize> {
        // Waits for a send of the background task in progress: its acks come first.
        let _sending = self.acks.sending.lock().await;
        let ids = self.acks.take();
        if ids.is_empty() {
            return Ok(0);
        }
        match xack(&mut self.conn, &self.config, &ids).await {
            Ok(n) => {
                self.acked.increment(ids.len() as u64);
                Ok(n)
            }
            Err(e) => {
                self.acks.requeue(ids);
                Err(e)
            }
        }
    }

    /// Whether this source is still recovering its own pending entries.
    pub fn is_recovering(&self) -> bool {
        matches!(self.phase, Phase::OwnPending(_))
    }

    fn start_fetch(&mut self, max: usize) {
        let mut conn = self.conn.clone();
        let cfg = self.config.clone();
        let acks = self.acks.take();
        let claim = self.phase == Phase::New && Instant::now() >= self.next_claim;
        let phase = self.phase.clone();
        let cursor = self.claim_cursor.clone();
        let acked = self.acked.clone();
        let requeue = self.acks.clone();
        self.fetch = Some(Box::pin(async move {
            let mut pipe = redis::pipe();
            if !acks.is_empty() {
                pipe.cmd("XACK")
                    .arg(&cfg.key)
                    .arg(&cfg.group)
                    .arg(&acks)
                    .ignore();
            }
            let origin = if claim {
                pipe.cmd("XAUTOCLAIM")
                    .arg(&cfg.key)
                    .arg(&cfg.group)
                    .arg(&cfg.consumer)
                    .arg(cfg.min_idle.as_millis() as u64)
                    .arg(&cursor)
                    .arg("COUNT")
                    .arg(max);
                Origin::Claimed
            } else {
                let cmd = pipe
                    .cmd("XREADGROUP")
                    .arg("GROUP")
                    .arg(&cfg.group)
                    .arg(&cfg.consumer)
                    .arg("COUNT")
                    .arg(max);
                let id = match &phase {
                    Phase::OwnPending(after) => after.as_str(),
                    Phase::New => {
                        cmd.arg("BLOCK").arg(cfg.block.as_millis().max(1) as u64);
                        ">"
                    }
                };
                cmd.arg("STREAMS").arg(&cfg.key).arg(id);
                if matches!(phase, Phase::OwnPending(_)) {
                    Origin::OwnPending
                } else {
                    Origin::New
                }
            };
            let replies: Vec<Value> = match pipe.query_async(&mut conn).await {
                Ok(r) => r,
                Err(e) => {
                    requeue.requeue(acks);
                    return Err(e);
                }
            };
            acked.increment(acks.len() as u64);
            let reply = replies.into_iter().next().unwrap_or(Value::Nil);
            if claim {
                let r = StreamAutoClaimReply::from_redis_value(reply)?;
                Ok(Batch {
                    ids: r.claimed,
                    origin,
                    cursor: Some(r.next_stream_id),
                })
            } else {
                // A BLOCK that timed out replies nil.
                let r: Option<StreamReadReply> = FromRedisValue::from_redis_value(reply)?;
                let ids = r
                    .map(|r| r.keys.into_iter().flat_map(|k| k.ids).collect())
                    .unwrap_or_default();
                Ok(Batch {
                    ids,
                    origin,
                    cursor: None,
                })
            }
        }));
    }

    fn entries(&mut self, batch: Batch) -> Vec<StreamEntry> {
        match batch.origin {
            Origin::OwnPending => match batch.ids.last() {
                Some(last) => self.phase = Phase::OwnPending(last.id.clone()),
                None => self.phase = Phase::New,
            },
            Origin::Claimed => {
                let cursor = batch.cursor.unwrap_or_else(|| "0-0".into());
                // A full pass over the pending list: wait before the next one.
                if cursor == "0-0" {
                    self.next_claim = Instant::now() + self.config.claim_every;
                }
                self.claim_cursor = cursor;
            }
            Origin::New => {}
        }
        let mut st = self.acks.lock();
        let mut entries = Vec::with_capacity(batch.ids.len());
        for s in batch.ids {
            // A claim also returns idle entries this consumer still holds: they are with the
            // application already (the claim only reset their idle time).
            if !st.held.insert(s.id.clone()) {
                continue;
            }
            st.handles += 1;
            entries.push(StreamEntry {
                ack: Ack::new(s.id.clone(), self.acks.clone()),
                id: s.id,
                fields: s.map,
                origin: batch.origin,
            });
        }
        drop(st);
        if batch.origin == Origin::Claimed {
            self.claimed.increment(entries.len() as u64);
        }
        entries
    }
}

impl<C> BatchSource for RedisStreamSource<C>
where
    C: ConnectionLike + Clone + Send + Sync + Unpin + 'static,
{
    type Item = StreamEntry;
    type Error = RedisError;

    fn poll_fetch(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        max: usize,
    ) -> Fetched<StreamEntry, RedisError> {
        let this = self.get_mut();
        if this.fetch.is_none() {
            this.start_fetch(max.max(1));
        }
        let fetch = this.fetch.as_mut().expect("a fetch is in progress");
        let result = match fetch.as_mut().poll(cx) {
            Poll::Ready(r) => r,
            Poll::Pending => return Poll::Pending,
        };
        this.fetch = None;
        Poll::Ready(Some(result.map(|batch| this.entries(batch))))
    }
}

impl<C> Drop for RedisStreamSource<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Acks not sent yet, and those of entries still being worked on, are sent by the
    /// background task. Without one (no tokio runtime at build) they stay pending and are
    /// redelivered: never lost.
    fn drop(&mut self) {
        self.acks.release(None, false);
    }
}

/// `XACK key group ids…`.
async fn xack<C: ConnectionLike>(conn: &mut C, cfg: &Config, ids: &[String]) -> RedisResult<usize> {
    redis::cmd("XACK")
        .arg(&cfg.key)
        .arg(&cfg.group)
        .arg(ids)
        .query_async(conn)
        .await
}

/// `lua/stream_keepalive.lua`: resets the idle time of entries this consumer still owns.
const KEEPALIVE: &str = include_str!("../../lua/stream_keepalive.lua");

/// Ids per keep-alive script call, so one call never blocks Redis for long.
const KEEPALIVE_CHUNK: usize = 500;

/// The source's background task, on the tokio runtime it was built on:
///
/// - sends the queued acks `ack_interval` after the first one since the last send;
/// - every `min_idle / 3`, resets the idle time of the entries the application still holds
///   (`lua/stream_keepalive.lua`), so other consumers claim only entries of consumers that
///   stopped, or entries dropped without an ack;
///
/// until the source and every [`Ack`] are gone and nothing is left to send. A failed send is
/// retried after the next interval while any handle is alive; after that, the entries stay
/// pending and are redelivered (at-least-once).
async fn keep_in_background<C: ConnectionLike>(
    queue: Arc<AckQueue>,
    mut conn: C,
    cfg: Arc<Config>,
    acked: Counter,
) {
    let keepalive = redis::Script::new(KEEPALIVE);
    let every = (cfg.min_idle / 3).max(Duration::from_millis(1));
    let mut next_touch = Instant::now() + every;
    loop {
        let (idle, gone) = {
            let st = queue.lock();
            (st.ids.is_empty(), st.handles == 0)
        };
        if idle && gone {
            return;
        }
        if idle {
            // `notify_one` keeps a permit: a wake between the check and here is not lost.
            tokio::select! {
                () = queue.wake.notified() => {}
                () = tokio::time::sleep_until(next_touch) => {}
            }
        } else {
            tokio::time::sleep(cfg.ack_interval).await;
            let _sending = queue.sending.lock().await;
            let ids = queue.take();
            if !ids.is_empty() {
                match xack(&mut conn, &cfg, &ids).await {
                    Ok(_) => acked.increment(ids.len() as u64),
                    Err(_) if queue.lock().handles == 0 => return,
                    Err(_) => queue.requeue(ids),
                }
            }
        }
        if Instant::now() >= next_touch {
            let held: Vec<String> = queue.lock().held.iter().cloned().collect();
            for ids in held.chunks(KEEPALIVE_CHUNK) {
                let mut call = keepalive.key(&cfg.key);
                call.arg(&cfg.group).arg(&cfg.consumer).arg(ids);
                // A failed keep-alive is harmless: the next one comes `every` later, and at
                // worst an entry is claimed by another consumer (at-least-once).
                let _: RedisResult<u64> = call.invoke_async(&mut conn).await;
            }
            next_touch = Instant::now() + every;
        }
    }
}
