//! Keyed token gates: one limit per key, in process or across a fleet through Redis.
//!
//! In-memory limits break the moment a service runs on more than one instance: ten instances
//! each allow the full quota. A [`RedisGate`] makes one limit hold across the whole fleet
//! by deciding atomically in Lua scripts (concurrent decisions share a script call) on the
//! Redis server's clock, and keeps working by a [`FailurePolicy`] the user chose when Redis
//! is slow or gone. A [`MemoryGate`] is the embedded default: same math, same decisions,
//! one process (but for what [`Limit`] lists: Redis rounds waits up to whole microseconds,
//! and starts its windows on the Unix epoch).
//!
//! Both implement [`Gate`]: [`check`](Gate::check) decides now (admitted and consumed, or
//! rejected with a `retry_after`), as a future because deciding may need I/O;
//! [`check_local`](Gate::check_local) is the same decision where it needs none (always on a
//! [`MemoryGate`], whose own `check` is synchronous). Both also decide several limits
//! all-or-nothing (`check_all`). The stream adapters [`gated`](crate::FlowStreamExt::gated)
//! (wait for admission: shaping) and [`gated_drop`](crate::FlowStreamExt::gated_drop) (drop
//! what is rejected: policing) work with either; [`Gated::builder`] adds a cost per item, a
//! drop hook and a name.
//!
//! The Lua scripts are in the crate's `lua/` folder, one per algorithm.
//!
//! # Shutdown
//!
//! A [`MemoryGate`] spawns nothing: dropping its last clone frees it, anywhere. A
//! [`RedisGate`] spawns one task, its batch driver (unless batching is off), on the runtime
//! that builds it (so `build` panics outside a runtime); the driver ends when the gate's
//! last clone is dropped and the batches it sent are answered. A caller that gives up after its request went to
//! Redis leaves the call to finish on its runtime (bounded by the gate's `timeout`, the
//! gate kept alive until then), so that what Redis decided is still counted, a rejection
//! still cached, a lease still kept. Dropping a gate needs no runtime (after its own runtime
//! shut down too), and nothing panics when a runtime shuts down under a gate: requests that
//! went to Redis and whose answer nothing was left to read are counted as `abandoned`
//! (Redis may have charged them), and callers still waiting are answered by the failure
//! policy; a gate whose runtime shut down starts its driver again on the next caller's
//! runtime ([`RedisGate`], *Runtime*). The limits outlive the application: they live in
//! Redis, and a gate built again over the same prefix (in this process or a new one) goes
//! on from them. Only the rejection cache and leased tokens are the gate's own: tokens it
//! leased and did not spend are lost with it (under-admission, never over-admission).

mod api;
#[cfg(feature = "redis")]
pub(crate) mod backend;
#[cfg(feature = "redis")]
mod batch;
mod error;
#[cfg(feature = "redis")]
pub(crate) mod finish;
mod gated;
#[cfg(feature = "redis")]
mod lease;
mod limit;
mod memory;
mod multi;
mod quotas;
#[cfg(feature = "redis")]
mod redis_all;
#[cfg(feature = "redis")]
mod redis_gate;
#[cfg(feature = "redis")]
mod reject_cache;
#[cfg(feature = "redis")]
pub(crate) mod scripts;
#[cfg(feature = "redis")]
mod slot;

pub use api::{Gate, GateFuture};
pub use error::GateError;
#[cfg(feature = "http")]
pub(crate) use error::MAX_KEY_LEN;
#[cfg(feature = "redis")]
pub(crate) use error::check_key;
pub use gated::{Gated, GatedBuilder, GatedDrop, KeyFn};
pub use limit::Limit;
#[cfg(feature = "redis")]
pub(crate) use memory::names::DECISIONS;
pub use memory::{MemoryGate, MemoryGateBuilder};
#[cfg(feature = "http")]
pub(crate) use quotas::Registration;
#[cfg(feature = "redis")]
pub use redis_gate::{FailurePolicy, RedisGate, RedisGateBuilder};

/// The Lua source of each algorithm, for tests and tools that call the scripts directly
/// (with an explicit `now` argument). Production code goes through [`RedisGate`].
#[cfg(feature = "redis")]
pub mod lua {
    pub use super::scripts::{
        FIXED_WINDOW, REGION_BUCKET, REGION_HOME, REGION_SHARE, SLIDING_LOG, SLIDING_WINDOW,
        TOKEN_BUCKET, TOKEN_BUCKET_ALL, TOKEN_BUCKET_LEASE, token_bucket_reply,
    };
}
