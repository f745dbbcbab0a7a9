//! [`RedisStreamSource`]: the fetch pipeline, and the re-creation of a lost group.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use redis::aio::ConnectionLike;
use redis::streams::{StreamAutoClaimReply, StreamId, StreamReadReply};
use redis::{FromRedisValue, RedisError, RedisResult, Value};
use tokio::time::Instant;

use super::ack::{Ack, AckQueue, Carried, xack_cmd};
use super::builder::{Config, create_group, is_code, names};
use super::entry::{Origin, StreamEntry};
use super::keepalive::keep_in_background;
use crate::demand::source::{BatchSource, Fetched};
use crate::metrics::{Counter, Labels};
use crate::sync::Arc;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    /// Draining this consumer's own pending entries, after this id.
    OwnPending(String),
    New,
}

/// What one fetch brought back.
enum Outcome {
    /// Entries (possibly none).
    Batch(Batch),
    /// Redis answered `NOGROUP`: the group was created again (`Ok(true)`), found created
    /// again by another consumer (`Ok(false)`), or could not be created (`Err`).
    GroupLost { created: RedisResult<bool> },
    /// After an `XACK` that failed, the queued acks went alone first, and Redis answered
    /// this error again: nothing was read.
    AcksRefused(RedisError),
}

struct Batch {
    ids: Vec<StreamId>,
    origin: Origin,
    /// For claims: the cursor for the next `XAUTOCLAIM`.
    cursor: Option<String>,
}

/// The source's own counters; acked and stale acks are counted by its [`AckQueue`].
struct Counters {
    claimed: Counter,
    recreated: Counter,
}

/// A member of a Redis Streams consumer group, as a [`BatchSource`]: each fetch asks for
/// exactly the demand (`XREADGROUP … COUNT n`), at most
/// [`max_count`](super::RedisStreamSourceBuilder::max_count) (1,000 by default) per fetch.
///
/// - On start it first drains its **own pending entries** (id `0`: delivered to this consumer
///   name before and never acknowledged, e.g. before a crash), then reads new ones (`>`),
///   waiting up to `block` for them.
/// - Every `claim_every` it runs `XAUTOCLAIM` and takes over entries idle longer than
///   `min_idle` — those of consumers that stopped, and its own that the application dropped
///   without acknowledging — yielding them as [`Origin::Claimed`]. (`XAUTOCLAIM` needs Redis
///   6.2 or later. A claim that fails is that fetch's error; the next is tried
///   `claim_every` later, and new entries are read meanwhile.) Entries a live consumer
///   handed out and the application still holds are kept from going idle (a keep-alive
///   script, see [`min_idle`](super::RedisStreamSourceBuilder::min_idle), which also says
///   what is not kept alive: the entries of a fetch the stream has not been polled for since
///   Redis answered), and are never delivered twice by their own consumer. After a full pass over the pending list, the
///   next fetch always reads new entries.
/// - Each entry carries an [`Ack`]; acknowledged ids are sent in one `XACK`, pipelined with
///   the next fetch or by a background task within
///   [`ack_interval`](super::RedisStreamSourceBuilder::ack_interval), also after the source
///   is dropped. Nothing is acknowledged before the application says so: at-least-once.
/// - An `XACK` that fails (refused: an ACL without `XACK`; or, sent on its own by
///   `flush_acks` or the background task, the connection failed) leaves its ids queued,
///   and from then on **no entry is read until an `XACK` goes through**: the next fetch
///   sends the queued acks alone first and, if Redis answers with an error again, returns
///   that error (e.g. `NOPERM`) instead of reading, and so does every fetch after it
///   (`prefetch` yields it and backs off). So the queue of acks stays bounded (at most the
///   entries already delivered) when `XACK` is refused for good while reads are allowed,
///   and the consumer sees why; once `XACK` is allowed again, the acks go and the reads go
///   on. The fetch whose own pipelined `XACK` is the one refused still delivers the
///   entries its read brought (Redis ran the read): one batch, handed out once and held
///   as any other, none lost, its acks queued behind the refused ones; the next fetch
///   sends the queued acks alone first, as above. A fetch whose whole round trip failed
///   (the connection broke, or its response timed out) hands out nothing and returns that
///   error; its acks are queued again, to go with the next fetch's read as before. What
///   Redis ran of it is as for a source dropped mid-fetch: entries its read handed out
///   stay pending for this consumer (claimed after `min_idle`, or recovered at its next
///   start), and acks that reached Redis are answered 0 when sent again (counted as
///   stale).
///
/// The group is created (with `MKSTREAM`) if it does not exist. Works over any redis-rs
/// async connection that is `Clone` (`MultiplexedConnection`, `ConnectionManager`; only the
/// latter reconnects after the server restarts). Give the source a connection of its own:
/// a blocking read holds up every other command multiplexed on the same connection for up
/// to `block`. Use it with [`prefetch`](crate::demand::prefetch()).
///
/// # A lost group
///
/// When Redis answers `NOGROUP` (the server restarted without its data, `XGROUP DESTROY`,
/// the stream deleted and perhaps re-created by a producer), the source creates the group
/// again with `MKSTREAM`, from
/// [`recreate_from`](super::RedisStreamSourceBuilder::recreate_from) (`$` by default),
/// treating `BUSYGROUP` (another consumer was first) as done; it logs a `tracing` warning,
/// counts it in `flowgate_demand_group_recreated_total`, and reads on: that fetch returns
/// an empty batch, not an error. If creating fails, the fetch returns that error and the
/// next fetch tries again; the lost group is forgotten all the same (what follows holds
/// for its entries either way).
///
/// Acks of entries delivered before the loss are never sent: the lost group's pending list
/// is gone, and in the new group the same id may be pending for another delivery (with
/// [`StartFrom::Beginning`](super::StartFrom::Beginning)), which such an ack would wrongly
/// acknowledge. Those queued at the time, and those made later through their [`Ack`], are
/// counted in `flowgate_demand_stale_acks_total` instead, so no ack is retried forever and
/// none lands twice. A loss this source does not see itself (another consumer re-created
/// the group before this source's next fetch) is not detected: its queued acks then go to
/// the new group, where Redis ignores the ids it does not hold (with the default `$`, all
/// of them).
///
/// `flowgate_demand_acked_total` counts what Redis acknowledged: the count each `XACK`
/// answers. The other ids sent are counted as stale: those no longer pending in the group
/// (claimed and acknowledged by another consumer meanwhile), and those sent while the
/// group was missing and this source had not noticed yet (`XACK` then answers 0). Acks
/// never sent are counted in `flowgate_demand_unsent_acks_total` (and logged) once the
/// source, its `Ack`s and its background task are all gone: those the task gave up on (an
/// `XACK` that failed with no handle left), those left queued when the runtime shut down,
/// or made without a runtime and never flushed. Their entries stay pending and are
/// delivered again. So every ack made is acked, stale, or unsent.
///
/// Ids of claimed entries are older than the new ones already seen: track them apart (or
/// ack them directly) rather than in the same [`CommitTracker`](crate::demand::CommitTracker).
///
/// # One live source per consumer name
///
/// Redis knows a consumer by its name alone, and a source knows only the entries it handed
/// out itself. At start a source recovers every entry pending for its name: those of a run
/// that crashed, but also those another live source of the same name still works on — in
/// this process (the consumer loop built again after an error while its workers still
/// hold entries of the old source) or in another (a new instance started under the name of
/// one still finishing its work). Both then process those entries at once, with no
/// `min_idle` in between. Give each live source a name of its own, and build a source under
/// a name again only once every entry of the one before is acknowledged or dropped (or use
/// a new name: what stays pending under the old one is claimed once idle longer than
/// `min_idle`). Acknowledged is enough: the acks the source before (built in this process)
/// queued and its background task has not sent yet are sent by
/// [`build`](super::RedisStreamSourceBuilder::build) before the new source recovers
/// anything. A fetch error needs no new source: `prefetch` yields it and the next fetch
/// tries again (after a server restart too, over a `ConnectionManager`).
pub struct RedisStreamSource<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    conn: C,
    config: Arc<Config>,
    phase: Phase,
    acks: Arc<AckQueue>,
    fetch: Option<BoxFuture<RedisResult<Outcome>>>,
    /// The fetch in progress took queued acks along (its `XACK` goes first in its pipeline).
    fetch_carries_acks: bool,
    /// The fetch in progress is a claim (`XAUTOCLAIM`).
    fetch_claims: bool,
    next_claim: Instant,
    claim_cursor: String,
    /// A claim pass ended: the next fetch reads new entries whatever `claim_every` says.
    read_due: bool,
    counters: Counters,
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

impl<C> RedisStreamSource<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// The source of a validated `config` whose group exists; starts the background task
    /// on the current tokio runtime, if any.
    pub(super) fn new(conn: C, config: Config, name: Option<&str>) -> Self {
        let labels = Labels::new(name);
        let counters = Counters {
            claimed: labels.counter(names::CLAIMED, &[]),
            recreated: labels.counter(names::GROUP_RECREATED, &[]),
        };
        let config = Arc::new(config);
        let acks = Arc::new(AckQueue::new(
            labels.counter(names::ACKED, &[]),
            labels.counter(names::STALE_ACKS, &[]),
            labels.counter(names::UNSENT_ACKS, &[]),
        ));
        acks.set_flusher(conn.clone(), config.clone());
        super::ack::register(&config, &acks);
        // Without a tokio runtime there is no background task: acks travel with fetches and
        // `flush_acks` only.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(keep_in_background(
                acks.clone(),
                conn.clone(),
                config.clone(),
            ));
        }
        RedisStreamSource {
            conn,
            next_claim: Instant::now() + config.claim_every,
            config,
            phase: Phase::OwnPending("0".into()),
            acks,
            fetch: None,
            fetch_carries_acks: false,
            fetch_claims: false,
            claim_cursor: "0-0".into(),
            read_due: false,
            counters,
        }
    }

    /// Send the acknowledgements collected so far now. When it returns, every ack made
    /// before the call has reached Redis, including those the background task was sending
    /// and those a fetch in progress took along: that fetch is finished first (up to
    /// `block` for a read of new entries), and what it brought is kept for the next
    /// [`poll_fetch`](BatchSource::poll_fetch).
    ///
    /// Returns how many ids Redis acknowledged in the `XACK` this call sent (the count it
    /// answers), counted in `flowgate_demand_acked_total`; the others sent (ids no longer
    /// pending in the group, or every one if the group is gone and no fetch has noticed it
    /// yet) are counted in `flowgate_demand_stale_acks_total`. The acks a fetch took along
    /// are counted the same way when it lands, not in the value returned.
    ///
    /// # Errors
    ///
    /// The Redis error; the ids are queued again, and the next fetch reads nothing unless
    /// they go through first (see [`RedisStreamSource`]). (A failed fetch that took acks
    /// along queues them again as well, and its error is kept for the next `poll_fetch`.)
    ///
    /// # Cancel safety
    ///
    /// Dropped while waiting for a fetch in progress or for the background task's send,
    /// nothing is lost (the fetch stays in progress). Dropped while its own `XACK` is on
    /// its way, the ids it took are queued again, for the next fetch, `flush_acks` or the
    /// background task to send (an `XACK` that had reached Redis already is then answered
    /// 0 for them: counted as stale).
    pub async fn flush_acks(&mut self) -> RedisResult<usize> {
        // A fetch in progress that took acks along lands first; its outcome waits for the
        // next `poll_fetch`.
        if self.fetch_carries_acks
            && let Some(fetch) = self.fetch.as_mut()
        {
            let outcome = fetch.await;
            self.fetch = Some(Box::pin(std::future::ready(outcome)));
            self.fetch_carries_acks = false;
        }
        // Waits for a send of the background task in progress: its acks come first.
        self.acks.send(&mut self.conn, &self.config).await
    }

    /// Whether this source is still recovering its own pending entries.
    pub fn is_recovering(&self) -> bool {
        matches!(self.phase, Phase::OwnPending(_))
    }

    /// The next fetch of at most `min(max, max_count)` entries, with the queued acks.
    fn start_fetch(&mut self, max: usize) -> BoxFuture<RedisResult<Outcome>> {
        let mut conn = self.conn.clone();
        let cfg = self.config.clone();
        // After an `XACK` that failed, the acks go alone, and nothing is read unless they
        // go through: refused for good (an ACL without `XACK`), they would otherwise be
        // joined in the queue by the acks of every entry read after (see
        // `AckQueue::refused`). They are taken once no send is in progress (the background
        // task's may hold them), so none is on its way when this fetch reads.
        let carried = if self.acks.failing() {
            None
        } else {
            Some(Carried::take(self.acks.clone()))
        };
        self.fetch_carries_acks = carried.as_ref().is_none_or(|c| !c.ids().is_empty());
        let claim = self.phase == Phase::New && !self.read_due && Instant::now() >= self.next_claim;
        self.fetch_claims = claim;
        let phase = self.phase.clone();
        let cursor = self.claim_cursor.clone();
        let queue = self.acks.clone();
        // Redis refuses a COUNT above i64::MAX; a large demand fills in several fetches.
        let count = max.clamp(1, cfg.max_count);
        Box::pin(async move {
            let carried = match carried {
                Some(carried) => carried,
                None => {
                    let refused = AckQueue::take_unsent(&queue).await;
                    if !refused.ids().is_empty()
                        && let Err(e) = refused.send(&mut conn, &cfg).await
                    {
                        return Ok(Outcome::AcksRefused(e));
                    }
                    // Those made meanwhile go with the read.
                    Carried::take(queue.clone())
                }
            };
            let mut pipe = redis::pipe();
            // Each reply on its own: an XACK that went through is not sent again because the
            // read after it failed.
            pipe.ignore_errors();
            if !carried.ids().is_empty() {
                pipe.add_command(xack_cmd(&cfg, carried.ids()));
            }
            let origin = if claim {
                pipe.cmd("XAUTOCLAIM")
                    .arg(&cfg.key)
                    .arg(&cfg.group)
                    .arg(&cfg.consumer)
                    .arg(cfg.min_idle.as_millis() as u64)
                    .arg(&cursor)
                    .arg("COUNT")
                    .arg(count);
                Origin::Claimed
            } else {
                let cmd = pipe
                    .cmd("XREADGROUP")
                    .arg("GROUP")
                    .arg(&cfg.group)
                    .arg(&cfg.consumer)
                    .arg("COUNT")
                    .arg(count);
                let id = match &phase {
                    Phase::OwnPending(after) => after.as_str(),
                    Phase::New => {
                        cmd.arg("BLOCK").arg(cfg.block.as_millis() as u64);
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
            let replies = pipe.query_async(&mut conn).await;
            let (acks, generation) = carried.landed();
            let mut replies: Vec<RedisResult<Value>> = match replies {
                Ok(r) => r,
                Err(e) => {
                    queue.requeue(acks, generation);
                    return Err(e);
                }
            };
            let reply = replies.pop().unwrap_or(Ok(Value::Nil));
            let lost = matches!(&reply, Err(e) if is_code(e, "NOGROUP"));
            if let Some(sent) = replies.pop() {
                // XACK on a missing group answers 0: those acks reached no group, and
                // count as stale.
                match sent.and_then(|n| usize::from_redis_value(n).map_err(RedisError::from)) {
                    Ok(n) => queue.sent(acks.len(), n),
                    Err(_) => queue.refused(acks, generation),
                }
            }
            if lost {
                // Whether or not creating it works, the group this source delivered from is
                // gone: its acks are forgotten now, before the group can exist again, so
                // that no send (`flush_acks`, which finishes this fetch and sends before the
                // outcome is read, or the background task) takes one to the new group; once
                // no send of them is on its way.
                queue.new_group().await;
                let created =
                    create_group(&mut conn, &cfg.key, &cfg.group, cfg.recreate_from).await;
                return Ok(Outcome::GroupLost { created });
            }
            let reply = match reply {
                // A blocking read ended early by the server (the stream key was deleted,
                // `CLIENT UNBLOCK … ERROR`): as if it timed out. If the group is gone, the
                // next read says so with `NOGROUP`.
                Err(e) if is_code(&e, "UNBLOCKED") => Value::Nil,
                reply => reply?,
            };
            if claim {
                let r = StreamAutoClaimReply::from_redis_value(reply)?;
                Ok(Outcome::Batch(Batch {
                    ids: r.claimed,
                    origin,
                    cursor: Some(r.next_stream_id),
                }))
            } else {
                // A BLOCK that timed out replies nil.
                let r: Option<StreamReadReply> = FromRedisValue::from_redis_value(reply)?;
                let ids = r
                    .map(|r| r.keys.into_iter().flat_map(|k| k.ids).collect())
                    .unwrap_or_default();
                Ok(Outcome::Batch(Batch {
                    ids,
                    origin,
                    cursor: None,
                }))
            }
        })
    }

    /// The group was lost (`NOGROUP`): start over in the group that is there again
    /// (`created`: `Ok`), or that the next fetch tries to create again (`Err`, returned).
    /// The acks and held ids of the lost group were forgotten by the fetch that met the
    /// loss, before it created the group again.
    ///
    /// The lost group is forgotten even when creating it again failed: its pending list is
    /// gone all the same, and the group the next fetch finds may be one another consumer
    /// created meanwhile, where an ack of an entry delivered before could acknowledge
    /// another delivery of the same id.
    fn group_lost(&mut self, created: RedisResult<bool>) -> RedisResult<()> {
        self.phase = Phase::New;
        self.claim_cursor = "0-0".into();
        self.read_due = false;
        self.next_claim = Instant::now() + self.config.claim_every;
        match created {
            Ok(created) => {
                self.counters.recreated.increment(1);
                tracing::warn!(
                    stream = %self.config.key,
                    group = %self.config.group,
                    consumer = %self.config.consumer,
                    created,
                    "redis stream consumer group was gone (NOGROUP): created it again; acks \
                     of entries delivered before are not sent"
                );
                Ok(())
            }
            Err(e) => {
                tracing::warn!(
                    stream = %self.config.key,
                    group = %self.config.group,
                    consumer = %self.config.consumer,
                    error = %e,
                    "redis stream consumer group was gone (NOGROUP) and could not be created \
                     again; acks of entries delivered before are not sent"
                );
                Err(e)
            }
        }
    }

    fn entries(&mut self, batch: Batch) -> Vec<StreamEntry> {
        match batch.origin {
            Origin::OwnPending => match batch.ids.last() {
                Some(last) => self.phase = Phase::OwnPending(last.id.clone()),
                None => self.phase = Phase::New,
            },
            Origin::Claimed => {
                let cursor = batch.cursor.unwrap_or_else(|| "0-0".into());
                // A full pass over the pending list: read new entries next, and wait before
                // the next pass.
                if cursor == "0-0" {
                    self.next_claim = Instant::now() + self.config.claim_every;
                    self.read_due = true;
                }
                self.claim_cursor = cursor;
            }
            Origin::New => self.read_due = false,
        }
        let mut st = self.acks.lock();
        let generation = st.generation;
        let mut entries = Vec::with_capacity(batch.ids.len());
        for s in batch.ids {
            // A claim also returns idle entries this consumer still holds: they are with the
            // application already (the claim only reset their idle time).
            if !st.held.insert(s.id.clone()) {
                continue;
            }
            st.handles += 1;
            entries.push(StreamEntry {
                ack: Ack::new(s.id.clone(), generation, self.acks.clone()),
                id: s.id,
                fields: s.map,
                origin: batch.origin,
            });
        }
        drop(st);
        if batch.origin == Origin::Claimed {
            self.counters.claimed.increment(entries.len() as u64);
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

    /// Fetches at most `min(max, max_count)` entries (none for a `max` of 0: an empty batch
    /// at once, nothing sent; a fetch in progress is finished with the `max` it started
    /// with). A fetch that finds the group lost creates it again and returns an empty
    /// batch (or the error, if creating it fails).
    /// After an `XACK` that failed, a fetch first sends the queued acks alone, and returns
    /// the error if Redis answers with one again, having read nothing.
    ///
    /// # Cancel safety
    ///
    /// A fetch in progress is kept across polls and finished by the next call; dropping the
    /// source mid-fetch may leave entries Redis handed out pending for this consumer: they
    /// are recovered at its next start, or claimed after `min_idle`. The acks the fetch
    /// took along are queued again for the background task (an `XACK` that had reached
    /// Redis already is then answered 0 for them: counted as stale). A fetch that met a lost
    /// group and still waits for a send on its way before it forgets the group forgets it
    /// when dropped: the acks made afterwards of entries the lost group delivered are
    /// counted as stale, not sent to a group another consumer creates again.
    fn poll_fetch(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        max: usize,
    ) -> Fetched<StreamEntry, RedisError> {
        let this = self.get_mut();
        let mut fetch = match this.fetch.take() {
            Some(fetch) => fetch,
            // Asked for nothing (`prefetch` never asks for 0): nothing is read (`COUNT` is
            // at least 1); the queued acks wait for the next fetch or the background task.
            None if max == 0 => return Poll::Ready(Some(Ok(Vec::new()))),
            None => this.start_fetch(max),
        };
        let result = match fetch.as_mut().poll(cx) {
            Poll::Ready(r) => r,
            Poll::Pending => {
                this.fetch = Some(fetch);
                return Poll::Pending;
            }
        };
        if result.is_err() && this.fetch_claims {
            // A failed claim waits `claim_every`, and new entries are read meanwhile: one
            // that keeps failing (`XAUTOCLAIM` refused) must not stop the reads.
            this.read_due = true;
            this.next_claim = Instant::now() + this.config.claim_every;
        }
        Poll::Ready(Some(result.and_then(|outcome| match outcome {
            Outcome::Batch(batch) => Ok(this.entries(batch)),
            Outcome::GroupLost { created } => this.group_lost(created).map(|()| Vec::new()),
            Outcome::AcksRefused(e) => Err(e),
        })))
    }
}

impl<C> Drop for RedisStreamSource<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Acks not sent yet, and those of entries still being worked on, are sent by the
    /// background task. Without one (no tokio runtime at build) their entries stay pending
    /// and are redelivered: never lost; the acks are counted in
    /// `flowgate_demand_unsent_acks_total` once the last `Ack` is gone.
    fn drop(&mut self) {
        // A fetch in progress first: the acks it took along go back to the queue while the
        // source still counts as a handle, so the background task is still there to send
        // them.
        drop(self.fetch.take());
        self.acks.release_source();
    }
}
