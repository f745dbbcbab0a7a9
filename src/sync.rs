//! The synchronisation primitives the crate uses, swapped for loom's under
//! `--cfg flowgate_loom` so the concurrency models in `tests/loom.rs` can explore every
//! interleaving. (A crate-specific cfg name: a plain `--cfg loom` would also switch tokio's
//! internals, which do not build that way as a dependency.)

#[cfg(flowgate_loom)]
pub(crate) use loom::sync::atomic::{AtomicUsize, Ordering};
#[cfg(flowgate_loom)]
pub(crate) use loom::sync::{Arc, Mutex, MutexGuard};
#[cfg(not(flowgate_loom))]
pub(crate) use std::sync::atomic::{AtomicUsize, Ordering};
#[cfg(not(flowgate_loom))]
pub(crate) use std::sync::{Arc, Mutex, MutexGuard};
