//! Bulkheads: concurrency caps per dependency, a bounded waiting room, load shedding, and a
//! reserve for critical work.
//!
//! A bulkhead of 50 in front of the payments API means the 51st call waits instead of piling
//! onto a saturated pool; when even the waiting room is full the call is shed early and
//! cheaply, while critical work keeps a reserved share. See [`Bulkhead`] for the semantics.
//!
//! # Stream adapters
//!
//! Through [`FlowStreamExt`](crate::FlowStreamExt), one bulkhead can be shared by many
//! streams; the adapters wait for permits (backpressure), they never shed, and each permit
//! is held exactly while its mapped future runs:
//!
//! | adapter | output order | where the futures run |
//! |---|---|---|
//! | [`bulkhead_map`](crate::FlowStreamExt::bulkhead_map) | input order (like `buffered`) | inside the stream's poll |
//! | [`bulkhead_map_unordered`](crate::FlowStreamExt::bulkhead_map_unordered) | completion order (like `buffer_unordered`) | inside the stream's poll |
//! | [`bulkhead_spawn_map`](crate::FlowStreamExt::bulkhead_spawn_map) | completion order | each on its own tokio task |
//!
//! **Which to use.** The first two drive the mapped futures only while the consumer polls
//! the stream. If the consumer does slow work between items, futures in flight stop making
//! progress and their permits sit idle while other callers of the dependency wait for them
//! (the hazard described in futures-rs issue 2387). Use `bulkhead_spawn_map` when the
//! consumer does real work per item or the permits are shared with other callers: each
//! mapped future runs on its own task, so it progresses and releases its permit regardless of
//! the consumer. Use the in-poll adapters for cheap consumers, non-`Send` futures, or when
//! spawning is not wanted.
//!
//! **Shutdown.** Each adapter pulls one item ahead and holds it while it waits for a permit.
//! If the bulkhead is closed, the adapter stops pulling, yields what is in flight, then
//! ends; the item it held is discarded (the bulkhead counts the refused wait as a `closed`
//! refusal in `flowgate_bulkhead_rejected_total`). Dropped, the adapter discards the item it
//! holds and drops the futures in flight (`bulkhead_map_unordered` drops its futures first,
//! the other two the item), then returns their permits; `bulkhead_spawn_map` aborts its
//! tasks instead, and each task's future and permit go when the runtime stops it, after
//! the drop. Outputs finished and not yet yielded are dropped with it,
//! uncounted (their work was done): those of `bulkhead_map` waiting behind an older future,
//! those of `bulkhead_spawn_map`'s finished tasks. A discarded item, either way, is counted
//! in `flowgate_bulkhead_discarded_total` and goes to the adapter's `on_drop` hook, as
//! [`Dropped::Discarded`](crate::Dropped::Discarded), if it was built with one
//! ([`BulkheadMap::builder`], [`BulkheadMapUnordered::builder`],
//! [`BulkheadSpawnMap::builder`]).
//!
//! **Memory.** Every adapter keeps at most the bulkhead's `max_in_flight` outputs: `bulkhead_map`
//! counts the futures in flight and the outputs waiting for their turn, `bulkhead_spawn_map`
//! the tasks running and the finished outputs the consumer has not taken yet (a slow
//! consumer slows the intake; it never makes finished outputs pile up), and
//! `bulkhead_map_unordered` yields each output in the poll in which its future completes.
//!
//! # Panics
//!
//! A panic of `f` (the closure that maps an item) leaves the adapter's poll (in
//! `bulkhead_map_unordered`, one that strikes as an output is on its way out leaves the
//! next poll: see there). The item went to `f` and is gone with it; the permit taken for
//! it is back in the bulkhead by then. A caller that catches the panic may poll on: the
//! items after it still come. (A panic of a mapped future: see each adapter.)
//!
//! `bulkhead_spawn_map` spawns tokio tasks, and an acquisition with a
//! [`wait_timeout`](BulkheadBuilder::wait_timeout) starts a tokio timer when it has to
//! wait (none for a timeout of `Duration::MAX`, which never ends): both panic outside a
//! tokio runtime (with timers enabled, for the timeout).

mod acquire;
mod adaptive;
mod core;
mod error;
mod feed;
mod handle;
mod map;
mod map_unordered;
mod slot;
mod spawn_map;
mod stats;

pub use acquire::{Acquire, AcquireOwned, BulkheadPermit, OwnedBulkheadPermit};
pub use adaptive::AdaptiveStats;
pub use error::{AcquireError, Priority};
pub use handle::{Bulkhead, BulkheadBuilder};
pub use map::{BulkheadMap, BulkheadMapBuilder};
pub use map_unordered::{BulkheadMapUnordered, BulkheadMapUnorderedBuilder};
pub use spawn_map::{BulkheadSpawnMap, BulkheadSpawnMapBuilder};
pub use stats::BulkheadStats;
