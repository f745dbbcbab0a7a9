//! [`RedisStreamSourceBuilder`]: the settings of a [`RedisStreamSource`], their validation,
//! and the creation of its consumer group.

use std::fmt;
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::{RedisError, RedisResult};

use super::error::BuildError;
use super::fetch::RedisStreamSource;
use crate::error::{ConfigError, ConfigErrorKind};

/// Names of the Redis Streams metrics.
pub(super) mod names {
    pub(crate) const ACKED: &str = "flowgate_demand_acked_total";
    pub(crate) const CLAIMED: &str = "flowgate_demand_claimed_total";
    pub(crate) const GROUP_RECREATED: &str = "flowgate_demand_group_recreated_total";
    pub(crate) const STALE_ACKS: &str = "flowgate_demand_stale_acks_total";
    pub(crate) const UNSENT_ACKS: &str = "flowgate_demand_unsent_acks_total";
}

/// Where a consumer group starts reading when this source creates it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StartFrom {
    /// Every entry already in the stream (`0`).
    #[default]
    Beginning,
    /// Only entries added after the group is created (`$`).
    New,
}

impl StartFrom {
    /// The id `XGROUP CREATE` takes.
    fn id(self) -> &'static str {
        match self {
            StartFrom::Beginning => "0",
            StartFrom::New => "$",
        }
    }
}

/// The longest [`block`](RedisStreamSourceBuilder::block) accepted: one minute.
const MAX_BLOCK: Duration = Duration::from_secs(60);
/// The default [`max_count`](RedisStreamSourceBuilder::max_count).
const DEFAULT_MAX_COUNT: usize = 1_000;
/// The largest [`max_count`](RedisStreamSourceBuilder::max_count) accepted.
const MAX_MAX_COUNT: usize = 100_000;

/// The validated settings, shared by the source and its background task.
#[derive(Debug)]
pub(super) struct Config {
    pub(super) key: String,
    pub(super) group: String,
    pub(super) consumer: String,
    pub(super) block: Duration,
    pub(super) min_idle: Duration,
    pub(super) claim_every: Duration,
    pub(super) ack_interval: Duration,
    pub(super) max_count: usize,
    pub(super) recreate_from: StartFrom,
}

/// Builds a [`RedisStreamSource`]; from [`RedisStreamSource::builder`].
///
/// Every setting is checked by [`build`](Self::build), which returns a [`ConfigError`]
/// (inside [`BuildError::Config`]) naming the field, before anything is sent to Redis.
#[derive(Clone)]
pub struct RedisStreamSourceBuilder<C> {
    conn: C,
    key: String,
    group: String,
    consumer: String,
    block: Duration,
    min_idle: Duration,
    claim_every: Duration,
    ack_interval: Duration,
    max_count: usize,
    start: StartFrom,
    recreate_from: StartFrom,
    name: Option<String>,
}

/// Leaves the connection out, as [`RedisStreamSource`]'s `Debug` does: a connection may
/// print where Redis is and who logs in.
impl<C> fmt::Debug for RedisStreamSourceBuilder<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStreamSourceBuilder")
            .field("key", &self.key)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("block", &self.block)
            .field("min_idle", &self.min_idle)
            .field("claim_every", &self.claim_every)
            .field("ack_interval", &self.ack_interval)
            .field("max_count", &self.max_count)
            .field("start", &self.start)
            .field("recreate_from", &self.recreate_from)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl<C> RedisStreamSource<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// A builder for consumer `consumer` of group `group` on stream `key`. One live source
    /// per consumer name: a source built under the name of another that still holds entries
    /// recovers those entries too, and both process them (see [`RedisStreamSource`]).
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
            max_count: DEFAULT_MAX_COUNT,
            start: StartFrom::Beginning,
            recreate_from: StartFrom::New,
            name: None,
        }
    }
}

impl<C> RedisStreamSourceBuilder<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// How long a read waits for new entries (default 250 ms; `XREADGROUP BLOCK`), from
    /// 1 ms to 1 minute, and at most a third of [`min_idle`](Self::min_idle).
    ///
    /// Keep it below the connection's response timeout (redis-rs: 500 ms by default), or
    /// idle reads fail with a timeout — and an entry Redis hands out in a read the client has
    /// already abandoned stays pending until it is claimed after `min_idle`. Acks and
    /// keep-alives sent on the same connection wait behind a blocking read, hence the
    /// bounds.
    pub fn block(mut self, block: Duration) -> Self {
        self.block = crate::time::capped(block);
        self
    }

    /// Claim entries idle longer than this (default 30 s; at least 1 ms, and at least three
    /// times [`block`](Self::block)): entries of consumers that stopped, and entries this
    /// consumer received and dropped without acknowledging.
    ///
    /// While a source lives, its background task resets the idle time of the entries the
    /// application still holds, and of those acknowledged whose `XACK` is not sent yet,
    /// every `min_idle / 3` (more often when `block` is above a sixth of `min_idle`: an ack
    /// and the keep-alive after it can each wait a `block` behind a read; only while this
    /// consumer still owns them), so other consumers do not take them however long they
    /// wait in the `prefetch` buffer or take to process. A consumer whose runtime stalls
    /// for longer than `min_idle` may lose them to another (processed twice: at-least-once
    /// still holds).
    ///
    /// An entry is kept alive from when the source hands it out, which is when the fetch
    /// that brought it is polled after Redis answered: `prefetch` polls a fetch in progress
    /// only when the stream itself is polled. With a `low` watermark above 0 a fetch starts
    /// while the application still works through the buffer; if the application then goes
    /// longer than `min_idle` without polling the stream (one item at a time, each taking
    /// that long), the entries of that fetch may be claimed by another consumer and
    /// processed twice. Poll the stream while the work goes on (process items concurrently),
    /// or use a `low` of 0, so that a fetch starts only when the stream is waited on.
    pub fn min_idle(mut self, min_idle: Duration) -> Self {
        self.min_idle = crate::time::capped(min_idle);
        self
    }

    /// How often to look for entries to claim (default 5 s; at least 1 ms). Between two
    /// passes over the pending list there is always at least one read of new entries, so
    /// claims never starve them. A claim that fails (its error is the fetch's: a Redis
    /// older than 6.2 has no `XAUTOCLAIM`, an ACL may refuse it) is tried again this long
    /// after, where the pass stopped, with reads of new entries in between.
    pub fn claim_every(mut self, every: Duration) -> Self {
        self.claim_every = crate::time::capped(every);
        self
    }

    /// Acknowledgements are sent at most this long after the first one since the last send
    /// (default 100 ms; at least 1 ms): with the next fetch if one starts sooner, otherwise
    /// by a background task on the tokio runtime the source was built on, which also sends
    /// the acks that come after the source is dropped. A send waits behind a blocking read
    /// on the same multiplexed connection, so add up to `block`. The task sends them sooner
    /// when its keep-alive is due (see [`min_idle`](Self::min_idle)), which keeps an entry
    /// acknowledged but not sent yet from going idle for another consumer to claim, as it
    /// does the entries still held.
    pub fn ack_interval(mut self, interval: Duration) -> Self {
        self.ack_interval = crate::time::capped(interval);
        self
    }

    /// The most entries one fetch asks Redis for (default 1,000; from 1 to 100,000): the
    /// `COUNT` of `XREADGROUP` and `XAUTOCLAIM` is the demand
    /// ([`prefetch`](crate::demand::prefetch()) asks for `high − buffered`), capped at this.
    /// A `prefetch` fetches only when its buffer falls to `low`, so with a window (`high −
    /// low`) larger than this it holds at most `low + max_count` entries, not `high`: raise
    /// `max_count` (or `low`) to buffer more.
    pub fn max_count(mut self, max: usize) -> Self {
        self.max_count = max;
        self
    }

    /// Where the group starts when this source creates it at build (default
    /// [`StartFrom::Beginning`]).
    pub fn start_from(mut self, start: StartFrom) -> Self {
        self.start = start;
        self
    }

    /// Where the group starts when this source creates it again after it was lost
    /// (`NOGROUP`: the server restarted without its data, `XGROUP DESTROY`, the stream
    /// deleted); default [`StartFrom::New`] (`$`).
    ///
    /// With `New`, nothing already processed is delivered again after an `XGROUP DESTROY`,
    /// but entries a producer added between the loss and the re-creation are skipped. With
    /// `Beginning`, nothing in the stream is skipped, but after an `XGROUP DESTROY` every
    /// entry still in the stream is delivered again (at-least-once). See
    /// [`RedisStreamSource`] for what happens to acks of entries of the lost group.
    pub fn recreate_from(mut self, start: StartFrom) -> Self {
        self.recreate_from = start;
        self
    }

    /// The `name` label of this source's metrics.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Check every setting, create the group if needed (`XGROUP CREATE … MKSTREAM` from
    /// [`start_from`](Self::start_from)), and build the source.
    ///
    /// If this process built a source under the same stream, group and consumer name before
    /// (a consumer loop built again), the acks it queued and has not sent yet (its
    /// background task sends them up to `ack_interval` later) are sent first, over that
    /// source's connection: the new source recovers the entries still pending for the
    /// name, and would deliver those again. (A send that fails leaves them to that
    /// recovery: at-least-once.)
    ///
    /// # Errors
    ///
    /// - [`BuildError::Config`], before anything is sent to Redis, with the field:
    ///   `redis_stream.block` (below 1 ms, above 1 minute), `redis_stream.min_idle` (below
    ///   1 ms, or below three times `block`), `redis_stream.claim_every` and
    ///   `redis_stream.ack_interval` (below 1 ms), `redis_stream.max_count` (zero, above
    ///   100,000).
    /// - [`BuildError::Redis`] if the group cannot be created (other than "already exists",
    ///   `BUSYGROUP`).
    ///
    /// # Cancel safety
    ///
    /// Dropped before it returns, it builds nothing and starts no task; a group it created
    /// stays. Acks of the source built before under the same name that it was sending are
    /// queued again, for that source's background task (or the next `build` under the
    /// name) to send.
    pub async fn build(mut self) -> Result<RedisStreamSource<C>, BuildError> {
        let config = self.validate()?;
        create_group(&mut self.conn, &config.key, &config.group, self.start).await?;
        // The source built before under this name in this process (a consumer loop built
        // again after an error) may have acks queued that its background task sends only up
        // to `ack_interval` later: this one would recover their entries with the others
        // pending for the name, and deliver them again. Sent first (after a send of that
        // task in progress), over its own connection: a source of the same names on another
        // server sends them there. If that fails, they are recovered: at-least-once.
        if let Some(before) = super::ack::previous(&config) {
            before.flush().await;
        }
        Ok(RedisStreamSource::new(
            self.conn,
            config,
            self.name.as_deref(),
        ))
    }

    fn validate(&self) -> Result<Config, ConfigError> {
        let at_least_1ms = |field: &'static str, d: Duration| {
            if d < Duration::from_millis(1) {
                Err(ConfigError::new(
                    field,
                    ConfigErrorKind::Zero,
                    "must be at least 1 ms",
                ))
            } else {
                Ok(())
            }
        };
        at_least_1ms("redis_stream.block", self.block)?;
        at_least_1ms("redis_stream.min_idle", self.min_idle)?;
        at_least_1ms("redis_stream.claim_every", self.claim_every)?;
        at_least_1ms("redis_stream.ack_interval", self.ack_interval)?;
        if self.block > MAX_BLOCK {
            return Err(ConfigError::new(
                "redis_stream.block",
                ConfigErrorKind::TooLarge,
                format!("{:?} is above the maximum of {MAX_BLOCK:?}", self.block),
            ));
        }
        if self.min_idle < self.block.saturating_mul(3) {
            return Err(ConfigError::new(
                "redis_stream.min_idle",
                ConfigErrorKind::Inconsistent,
                format!(
                    "{:?} is below three times block ({:?}): held entries could go idle \
                     while a blocking read holds up their keep-alive",
                    self.min_idle, self.block
                ),
            ));
        }
        if self.max_count == 0 {
            return Err(ConfigError::zero("redis_stream.max_count"));
        }
        if self.max_count > MAX_MAX_COUNT {
            return Err(ConfigError::new(
                "redis_stream.max_count",
                ConfigErrorKind::TooLarge,
                format!("{} is above the maximum of {MAX_MAX_COUNT}", self.max_count),
            ));
        }
        Ok(Config {
            key: self.key.clone(),
            group: self.group.clone(),
            consumer: self.consumer.clone(),
            block: self.block,
            min_idle: self.min_idle,
            claim_every: self.claim_every,
            ack_interval: self.ack_interval,
            max_count: self.max_count,
            recreate_from: self.recreate_from,
        })
    }
}

/// `XGROUP CREATE key group <start> MKSTREAM`. Returns whether this call created the group:
/// `false` if it existed already (`BUSYGROUP`: created before, or by another consumer
/// first).
pub(super) async fn create_group<C: ConnectionLike>(
    conn: &mut C,
    key: &str,
    group: &str,
    start: StartFrom,
) -> RedisResult<bool> {
    let created: RedisResult<()> = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(key)
        .arg(group)
        .arg(start.id())
        .arg("MKSTREAM")
        .query_async(conn)
        .await;
    match created {
        Ok(()) => Ok(true),
        Err(e) if is_code(&e, "BUSYGROUP") => Ok(false),
        Err(e) => Err(e),
    }
}

/// Whether Redis answered with the error `code` (`NOGROUP`, `BUSYGROUP`).
pub(super) fn is_code(e: &RedisError, code: &str) -> bool {
    e.code() == Some(code)
}
