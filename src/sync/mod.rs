//! The synchronisation primitives the crate uses, swapped for loom's under
//! `--cfg flowgate_loom` so the concurrency models in `tests/loom.rs` can explore every
//! interleaving. (A crate-specific cfg name: a plain `--cfg loom` would also switch tokio's
//! internals, which do not build that way as a dependency.)
//!
//! Beside them, the waiting machinery every primitive shares: [`WaiterList`] (one FIFO list
//! of waiting tasks with O(1) cancellation) and [`Deferred`] (the wakers collected under a
//! lock, woken after it is released); [`Panics`] (steps that each run even if one before
//! them panics); [`size_hint_watching_end`], how an adapter that may not take an item asks
//! its upstream to wake it at its end; [`with_reused`], a thread's reused buffer; and
//! [`POLL_BUDGET`], how much an adapter does in one poll before it yields.

mod deferred;
mod end_watch;
#[cfg(flowgate_loom)]
#[doc(hidden)]
pub mod loom_models;
mod panics;
#[cfg(feature = "http")]
mod reused;
mod waiters;

pub(crate) use deferred::Deferred;
pub(crate) use end_watch::{size_hint_watching_end, with_end_watcher};
pub(crate) use panics::Panics;
#[cfg(feature = "http")]
pub(crate) use reused::with_reused;
pub(crate) use waiters::{Cancelled, Key, Status, WaiterList, WakerId};

/// The most upstream items an adapter pulls (or drops) in one poll before it wakes itself
/// and returns `Pending`: an upstream that is always ready must not keep `poll_next` from
/// returning (`leaky_queue` with a drop policy, `gated` / `gated_drop` dropping every item).
pub(crate) const POLL_BUDGET: usize = 128;

#[cfg(flowgate_loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, AtomicUsize, Ordering, fence};
#[cfg(flowgate_loom)]
pub(crate) use loom::sync::{Arc, Mutex, MutexGuard};
#[cfg(not(flowgate_loom))]
pub(crate) use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering, fence};
#[cfg(not(flowgate_loom))]
pub(crate) use std::sync::{Arc, Mutex, MutexGuard};
