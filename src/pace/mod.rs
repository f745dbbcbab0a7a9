//! Leaky-bucket pacing: a constant outflow to fragile downstreams, exact from 1/s to 1M/s.
//!
//! A payment gateway with a hard TPS cap, a legacy database, a third-party API with a strict
//! contract: they need a smooth, constant outflow however bursty the input. A [`Pacer`] is a
//! shared leaky bucket; the adapters in [`FlowStreamExt`](crate::FlowStreamExt) and
//! [`FlowSinkExt`](crate::FlowSinkExt) put streams and sinks behind one:
//!
//! | adapter | what it does |
//! |---|---|
//! | `stream.leaky(rate)` | releases items at `rate` (a private pacer); slows the upstream down |
//! | `stream.leaky_with(pacer)` | the same through a shared pacer (fair, FIFO across streams) |
//! | `stream.leaky_cost(pacer, \|item\| cost)` | items of different weights ([`Leaky::builder`] adds a cost and an `on_drop` hook to any of these three) |
//! | `stream.leaky_queue(pacer, capacity, overflow)` | drains upstream into a bounded queue, releases at the rate, applies the overflow policy when full ([`LeakyQueue::builder`] adds a name and an `on_drop` hook) |
//! | `sink.leaky_sink(rate)` | outbound calls at `rate` |
//! | `sink.leaky_sink_with(pacer)` | the same through a shared pacer |
//! | `AdaptivePacer::pacer()` with any of the above | the same at a rate that follows the server's feedback: pauses on `Retry-After`, cuts on 429/503, climbs back, obeys the `RateLimit` fields ([`AdaptivePacer`]) |
//!
//! The pacer itself speaks the crate's verbs: [`Pacer::check`] decides now (a
//! [`Decision`](crate::Decision), never waiting), [`Pacer::until_ready`] waits until the
//! cost passes. A cost of zero, or above the burst, is a [`CostError`](crate::CostError).
//!
//! # Precision
//!
//! Scheduling follows the exact GCRA schedule (item `i` is due at `T0 + i/rate`, integer
//! time) and never sleeps per item: one timer wake releases every item that is due, up to
//! the burst, so timer error never accumulates. Above the timer's resolution (1 ms) items
//! leave in small on-time batches. See [`Pacer`] for the guarantees and the default burst.
//!
//! # Runtime
//!
//! A wait for the pacer sleeps on a tokio timer, so [`Pacer::until_ready`] and the adapters
//! must be polled inside a tokio runtime with timers enabled whenever they have to wait
//! (they panic otherwise). [`Pacer::check`] never waits and needs no runtime. Under
//! `tokio::time::pause()` time is virtual and every schedule deterministic, but a wait
//! still ends on the timer's next 1 ms tick, as in real time: a unit due at 333.3 ms
//! leaves at 334 ms (the schedule itself stays exact, so the next is due at 666.7 ms).
//!
//! # Metrics
//!
//! Labelled by the pacer's `name`: `flowgate_pace_released_total` (units of cost released:
//! items under a unit cost, the costs summed under `leaky_cost`; a unit counts when the
//! pacer lets it through, taking it from the bucket, so an item above the burst counts
//! chunk by chunk as it pays),
//! `flowgate_pace_lateness_seconds` (how late waiting items were released, a histogram:
//! from the item's due time to the poll that let it through, so a waiter polled late — a
//! busy executor, or a `LeakySink` whose send was given up and resumed later — counts that
//! gap too).
//! A `leaky_queue` reports `flowgate_pace_queue_depth` and `flowgate_pace_dropped_total`
//! (`policy` = `drop_newest`, `drop_oldest`, or `closed` for the items discarded when the
//! queue goes away) under its own [`name`](LeakyQueueBuilder::name), by default its pacer's.
//! A `leaky` stream dropped or taken apart with an item waiting for the pacer counts that
//! item as `flowgate_pace_dropped_total{policy="closed"}` under its pacer's name. If the
//! item was partway through paying in chunks, the chunks it paid stay counted as released:
//! the bucket spent them (the pacer gives no units back, so they hold the rate for the
//! pacer's other users as any release does), though the item never left; the dropped count
//! is in items, the released one in units.
//! An [`AdaptivePacer`] adds `flowgate_pace_adaptive_rate` (gauge, per second),
//! `flowgate_pace_adaptive_pauses_total` and `flowgate_pace_adaptive_cuts_total`.

mod adaptive;
mod leaky;
mod leaky_queue;
mod leaky_sink;
mod paced;
mod pacer;
mod until_ready;

pub use adaptive::{AdaptivePacer, AdaptivePacerBuilder, AdaptiveStatus, Phase};
pub(crate) use leaky::unit_cost;
pub use leaky::{Leaky, LeakyBuilder, UnitCost};
pub use leaky_queue::{LeakyQueue, LeakyQueueBuilder};
pub use leaky_sink::LeakySink;
pub use pacer::{Pacer, PacerBuilder};
pub use until_ready::UntilReady;
