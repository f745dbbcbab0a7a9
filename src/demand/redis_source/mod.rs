//! `RedisStreamSource`: a Redis Streams consumer-group member as a `BatchSource`.
//!
//! The parts, one per file:
//!
//! - `builder` — [`RedisStreamSourceBuilder`]: the settings, their validation
//!   ([`ConfigError`](crate::ConfigError) for every duration and count), and the group's
//!   first creation;
//! - `error` — [`BuildError`]: what `build` reports;
//! - `entry` — [`StreamEntry`] and [`Origin`]: what a fetch yields;
//! - `fetch` — [`RedisStreamSource`]: the fetch pipeline (`XACK` + `XREADGROUP` /
//!   `XAUTOCLAIM`, `COUNT` capped at [`max_count`](RedisStreamSourceBuilder::max_count)) and
//!   the re-creation of a lost group (`NOGROUP`); `XAUTOCLAIM` needs Redis 6.2 or later;
//! - `ack` — [`Ack`] and the queue it shares with the source: acknowledged ids waiting for
//!   one `XACK`, ids still held by the application, and the group generation they belong to;
//! - `keepalive` — the background task: sends acks within `ack_interval`, keeps held entries
//!   from going idle (`lua/stream_keepalive.lua`).
//!
//! # A lost group
//!
//! Redis answers `NOGROUP` when the group is gone: the server restarted without its data,
//! someone ran `XGROUP DESTROY`, or the stream was deleted (and perhaps re-created by a
//! producer). The source then creates the group again (`XGROUP CREATE … MKSTREAM` from
//! [`recreate_from`](RedisStreamSourceBuilder::recreate_from), `$` by default; `BUSYGROUP`,
//! another consumer was first, counts as done), logs it with `tracing::warn!`, counts it in
//! `flowgate_demand_group_recreated_total`, and goes on reading: the fetch that met
//! `NOGROUP` returns an empty batch, not an error (unless creating the group fails: then
//! that error, and the next fetch tries again; the lost group is forgotten either way).
//!
//! The pending list of the lost group is gone with it, so there is nothing left to
//! acknowledge for the entries delivered before: acks of such entries — queued at the time,
//! or made later through their [`Ack`] — are not sent — not to the new group either, where the
//! same id may be pending for another delivery — and are counted in
//! `flowgate_demand_stale_acks_total`. The entries themselves are not lost for the
//! application that holds them; whether the new group delivers them again depends on
//! `recreate_from` (with `$`, no; with [`StartFrom::Beginning`], yes: at-least-once).
//!
//! An ack sent before the source notices the loss (by `flush_acks` or the background task,
//! between the loss and the next fetch) reaches no group: `XACK` answers 0, not an error.
//! Every `XACK` is counted by what Redis answers: that many in
//! `flowgate_demand_acked_total`, the rest of the ids sent in
//! `flowgate_demand_stale_acks_total`. Acks never sent (the background task gave up on
//! them, or was gone) are counted in `flowgate_demand_unsent_acks_total` when the queue
//! goes with the source's last handle.

mod ack;
mod builder;
mod entry;
mod error;
mod fetch;
mod keepalive;

pub use ack::Ack;
pub use builder::{RedisStreamSourceBuilder, StartFrom};
pub use entry::{Origin, StreamEntry};
pub use error::BuildError;
pub use fetch::RedisStreamSource;
