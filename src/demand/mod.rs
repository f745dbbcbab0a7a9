//! Demand signalling: fetch only what downstream asked for, pause a source by watermarks,
//! commit only what is done.
//!
//! Rust streams pull one item at a time; batch sources (a Kafka poll, `XREADGROUP COUNT`)
//! need to know how much to fetch, and a consumer loop must pause its source when the stages
//! behind it saturate and commit only finished work. The pieces:
//!
//! - **Credit** — [`with_demand`](crate::FlowStreamExt::with_demand): the stream yields only
//!   while credit remains; [`DemandHandle::request`] adds credit from any task (Reactive
//!   Streams semantics: never more items than requested).
//! - **Levels** — [`Levels`]: the validated `(high, low)` pair that prefetch and watermarks
//!   both take, checked once so neither can fail.
//! - **Batch sources** — [`BatchSource`] and [`prefetch()`]: buffer at most `high` fetched
//!   items, refill at `low`, always asking for exactly `high − buffered`; [`IterSource`]
//!   (in memory) and [`StreamSource`] turn an iterator or a stream into a batch source. A
//!   fetch error is an `Err` item; over a source that cannot fail,
//!   [`Prefetch::items`] yields plain items.
//! - **Watermarks** — [`watermarks`](crate::FlowStreamExt::watermarks): every item comes with
//!   a [`Ticket`]; a [`PauseSignal`] turns [`Flow::Paused`] at `high` in flight and
//!   [`Flow::Resumed`] at `low`, never flapping faster than `min_hold`
//!   ([`Watermarks::builder`]).
//! - **Commits** — [`CommitTracker`]: the highest offset whose predecessors are all done or
//!   given up ([`CommitToken::abandon`]: skip / dead-letter); a token dropped unfinished holds
//!   the commit (redelivered after a restart). At most `max_pending` offsets wait to be
//!   committed; beyond, `track` refuses ([`TrackError`]) and `until_ready` waits.
//! - **Redis Streams** (feature `redis`) — `RedisStreamSource`: a consumer-group member as a
//!   `BatchSource` (`XREADGROUP COUNT <demand>`), recovering its own pending entries first,
//!   claiming idle entries of dead consumers, acking in batches, creating its group again
//!   when Redis lost it (`NOGROUP`); at-least-once.
//!
//! # Runtime
//!
//! Credit, prefetch, commits and watermarks without `min_hold` need no runtime. Timers are
//! tokio's: a [`Watermarks`] with a non-zero `min_hold` needs a tokio runtime with its time
//! driver, and panics when polled outside one once it holds a change back; a [`Prefetch`]
//! pausing after a failed fetch or an empty batch its source answered at once panics when
//! polled in a tokio runtime without its time driver (outside any tokio runtime it does
//! not pause). See their `# Panics` sections.
//!
//! # Shutdown
//!
//! Credit, prefetch, watermarks and commits spawn nothing. Dropped, a [`Prefetch`] hands its
//! buffered items to its `on_drop` hook ([`PrefetchBuilder::on_drop`]) and counts them as
//! discarded; a [`CommitToken`] dropped unfinished holds the commit back, so its offset is
//! delivered again after a restart.
//!
//! A `RedisStreamSource` spawns one background task on the runtime that builds it (none
//! outside a runtime): it sends the acks made within `ack_interval`, also those made after
//! the source itself is dropped, and keeps the entries still held from going idle. It ends
//! once the source and every `Ack` are gone and the acks are sent (or, with no handle left,
//! once an `XACK` failed). An entry is never lost: one dropped unacknowledged, or
//! acknowledged when the runtime shuts down before its `XACK` is sent, stays pending and is
//! delivered again (at the source's next start under the same consumer name, or claimed
//! after `min_idle`); such acks are counted in `flowgate_demand_unsent_acks_total`. To stop
//! without delivering again what was done: stop taking new entries, let the work in flight
//! finish and acknowledge, then call `flush_acks` (through [`Prefetch::get_mut`]) before the
//! runtime shuts down. Work that an adapter of the stream itself runs
//! ([`bulkhead_map_unordered`](crate::FlowStreamExt::bulkhead_map_unordered))
//! moves only while the stream is polled, and polling it pulls more from the source: close
//! its bulkhead ([`Bulkhead::close`](crate::bulkhead::Bulkhead::close)) and poll the stream
//! until it ends (the one item the adapter held waiting for a permit is discarded
//! unacknowledged, delivered again), then flush. A source
//! built again under the same name in the same process first sends what the one before
//! left queued.
//!
//! # Metrics
//!
//! Each piece can be named (the `name` label) by its builder: [`Demanded::builder`],
//! [`Prefetch::builder`], [`Watermarks::builder`], [`CommitTracker::builder`];
//! `with_demand`, `prefetch` and `watermarks` are the unnamed shorthands.
//!
//! `flowgate_demand_outstanding` (credit left, at most 2^32 a stream; [`UNBOUNDED`] counts 0),
//! `flowgate_demand_buffered` (prefetched: set when a batch lands, to what the buffer holds
//! with it, and to 0 when a poll finds the buffer empty; not per item handed out, which
//! keeps the hot path free of it, so in between it reads above [`Prefetch::buffered`] by the
//! items handed out since the last batch landed),
//! `flowgate_demand_in_flight` and `flowgate_demand_paused` (watermarks),
//! `flowgate_demand_commit_pending` (offsets not yet committable), all gauges;
//! `flowgate_demand_discarded_total` (prefetched items discarded: still buffered when their
//! stream was dropped or taken apart, see [`PrefetchBuilder::on_drop`]; and the item a
//! [`Demanded`] or [`Watermarks`] holds for credit or room, from an upstream whose
//! `size_hint` was wrong, when it is dropped or taken apart with `into_inner`),
//! `flowgate_demand_commit_abandoned_total` and `flowgate_demand_commit_dropped_total`
//! (tokens given up, tokens dropped unfinished), `flowgate_demand_acked_total`, `flowgate_demand_claimed_total`,
//! `flowgate_demand_group_recreated_total`, `flowgate_demand_stale_acks_total` and
//! `flowgate_demand_unsent_acks_total` (Redis Streams), all counters.

mod commit;
mod credit;
mod early;
mod error;
mod levels;
mod prefetch;
#[cfg(feature = "redis")]
mod redis_source;
mod signal;
mod source;
mod watermarks;

pub use commit::{CommitToken, CommitTracker, CommitTrackerBuilder, DEFAULT_MAX_PENDING};
pub use credit::{DemandHandle, Demanded, DemandedBuilder, UNBOUNDED};
pub use error::{RequestError, TrackError};
pub use levels::Levels;
pub use prefetch::{Items, Prefetch, PrefetchBuilder, Results, prefetch};
#[cfg(feature = "redis")]
pub use redis_source::{
    Ack, BuildError, Origin, RedisStreamSource, RedisStreamSourceBuilder, StartFrom, StreamEntry,
};
pub use signal::PauseSignal;
pub use source::{BatchSource, Fetched, IterSource, StreamSource};
pub use watermarks::{Flow, Ticket, Watermarks, WatermarksBuilder};
