//! Adaptive concurrency limits: a [`Bulkhead`](crate::bulkhead::Bulkhead) whose
//! `max_in_flight` follows the downstream, learnt from each call's round-trip time and
//! outcome.
//!
//! # Fixed or adaptive?
//!
//! A **fixed** `max_in_flight` is predictable and costs nothing: use it when the capacity
//! is known and stable (a pool of 20 database connections, a licence for 8 sessions), or
//! measured once with the [`knee`] finder (set it at 60–70 % of the knee). Use an
//! **adaptive** limit when the capacity moves (autoscaled or shared downstreams, deploys,
//! noisy neighbours) or nobody can measure it: the bulkhead then probes for the knee where
//! latency starts to climb, backs off when the downstream pushes back, and follows a
//! capacity drop within seconds. It cannot tell a slower downstream from a queue it built
//! itself for sure, and it needs traffic to learn: a caller that never uses its limit
//! leaves it where it is.
//!
//! # How it fits together
//!
//! An [`AdaptiveLimit`] is a pure state machine: one [`Sample`] in (the call's round-trip
//! time from the permit's grant, never the wait for it; the calls in flight when it
//! started; its [`Outcome`]; `now`), the new limit out. Give one to
//! [`BulkheadBuilder::adaptive`](crate::bulkhead::BulkheadBuilder::adaptive): every permit
//! then ends with [`BulkheadPermit::record`](crate::bulkhead::BulkheadPermit::record) (or
//! completes in [`Bulkhead::run`](crate::bulkhead::Bulkhead::run), a stream adapter, or the
//! HTTP `ShedLayer`), and a permit dropped without an outcome is ignored.
//!
//! A call ends when the code that awaits it sees it finish. The in-poll stream adapters
//! ([`bulkhead_map`](crate::FlowStreamExt::bulkhead_map),
//! [`bulkhead_map_unordered`](crate::FlowStreamExt::bulkhead_map_unordered)) drive their
//! futures only while the consumer polls the stream, so a call's round trip there runs
//! from the grant to the poll that finds its future finished: time the consumer spent
//! elsewhere (its own work between items) counts in, and a latency-based limit
//! ([`Probe`], [`Gradient2`], [`Vegas`]) may read it as a slower downstream and lower
//! the limit. [`bulkhead_spawn_map`](crate::FlowStreamExt::bulkhead_spawn_map) runs each
//! future on its own task and measures the call alone: use it (or keep the consumer's
//! work between polls short) with a latency-based limit.
//!
//! | algorithm | signal | moves | use it when |
//! |---|---|---|---|
//! | [`Probe`] (the default) | throughput (calls in flight / mean RTT per window) of the held level against one step above or below; the RTT's recent minimum; back-pressure | ×2 per window in slow start, then holds a level and tries ±1 step (a 32nd above 32) every 8 windows, keeping the step when it pays; ×0.9 on back-pressure or an RTT far above the minimum | in doubt |
//! | [`Aimd`] | back-pressure and timeouts only | +1 per call, ×0.9 | the downstream says clearly when it is full (429/503) and latency says little |
//! | [`Gradient2`] | long-term against short-term RTT | per call, smoothed | Netflix's behaviour is wanted (with its creep and timeout failures fixed; the queue it allows is `sqrt(L)`, where Netflix's default is 4) |
//! | [`Vegas`] | queue estimate from the no-load RTT | per call, log10 steps | low latency matters more than the last bit of throughput |
//!
//! [`sim`] is a deterministic simulated downstream (paused tokio time) to try them on.
//!
//! # Examples
//!
//! ```
//! use flowgate::adaptive::{Outcome, Probe};
//! use flowgate::bulkhead::Bulkhead;
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let api = Bulkhead::builder(1_000).adaptive(Probe::default()).name("api").build()?;
//! let permit = api.acquire().await?;
//! // ... call the downstream; it answered 200:
//! permit.record(Outcome::Ok);
//! assert_eq!(api.adaptive_stats().map(|s| s.ok), Some(1));
//! # Ok(())
//! # }
//! ```

mod aimd;
mod common;
mod gradient2;
pub mod knee;
mod probe;
mod sample;
pub mod sim;
mod vegas;

pub use aimd::{Aimd, AimdBuilder};
pub use gradient2::{Gradient2, Gradient2Builder};
pub use probe::{Probe, ProbeBuilder};
pub use sample::{AdaptiveLimit, Outcome, RttEstimates, Sample};
pub use vegas::{Vegas, VegasBuilder};
