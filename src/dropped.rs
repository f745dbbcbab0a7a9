//! `Dropped` and `OnDrop`: why an item was dropped, and the one hook signature that sees it.

use std::fmt;

use crate::decision::Decision;
use crate::gate::GateError;
use crate::metrics::Counter;
use crate::sync::Panics;
use std::sync::Arc;

/// Why an item was dropped: removed without being delivered.
///
/// Every component that can drop items (the [`channel`](crate::channel), the enforcing
/// [`leaky_queue`](crate::FlowStreamExt::leaky_queue), [`gated_drop`](crate::FlowStreamExt::gated_drop)
/// and [`gated`](crate::FlowStreamExt::gated)) passes each dropped item, with this reason, to
/// its `on_drop` hook (see [`OnDrop`]) and counts it in its `dropped` count. The adapters
/// that hold one item while they wait pass it to their hook too, as [`Dropped::Discarded`],
/// when they let go of it: [`leaky`](crate::FlowStreamExt::leaky) (hook from
/// [`Leaky::builder`](crate::pace::Leaky::builder); counted as
/// `flowgate_pace_dropped_total{policy="closed"}`) and the bulkhead adapters (hook from
/// [`BulkheadMap::builder`](crate::bulkhead::BulkheadMap::builder) and its siblings;
/// counted in `flowgate_bulkhead_discarded_total`, whether the bulkhead closed or the
/// adapter was dropped). A [`Prefetch`](crate::demand::Prefetch) does the same with every
/// item still buffered when it is dropped or taken apart (hook from
/// [`PrefetchBuilder::on_drop`](crate::demand::PrefetchBuilder::on_drop); counted in
/// `flowgate_demand_discarded_total`); [`Demanded`](crate::demand::Demanded) and
/// [`Watermarks`](crate::demand::Watermarks), which have no hook, count in it the item they
/// hold for credit or room (from an upstream whose `size_hint` was wrong) when they let go
/// of it, and `into_parts` hands it back. Nothing is dropped silently.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Dropped {
    /// The buffer was full under [`Overflow::DropNewest`](crate::Overflow::DropNewest): the
    /// incoming item was dropped. Also the reason under
    /// [`Overflow::Reject`](crate::Overflow::Reject) in a
    /// [`leaky_queue`](crate::FlowStreamExt::leaky_queue) (which has nobody to hand the item
    /// back to), and under [`Overflow::DropOldest`](crate::Overflow::DropOldest) in a channel
    /// whose every slot is reserved or taken by a send still under way (no queued item to
    /// drop instead).
    Newest,
    /// The buffer was full under [`Overflow::DropOldest`](crate::Overflow::DropOldest): the
    /// oldest buffered item was dropped to make room.
    Oldest,
    /// The item was still buffered or waiting when its holder was closed, dropped or taken
    /// apart (a receiver dropped, a stream adapter dropped with an item in hand).
    Discarded,
    /// A gate rejected it ([`gated_drop`](crate::FlowStreamExt::gated_drop)).
    Rejected(Decision),
    /// A gate could not decide it.
    GateError(GateError),
}

impl Dropped {
    /// A stable lowercase name (the `reason` label of `flowgate_gated_dropped_total`).
    pub fn as_str(&self) -> &'static str {
        match self {
            Dropped::Newest => "newest",
            Dropped::Oldest => "oldest",
            Dropped::Discarded => "discarded",
            Dropped::Rejected(_) => "rejected",
            Dropped::GateError(_) => "gate_error",
        }
    }
}

impl fmt::Display for Dropped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dropped::Newest => f.write_str("dropped: the buffer was full (drop newest)"),
            Dropped::Oldest => f.write_str("dropped to make room (drop oldest)"),
            Dropped::Discarded => f.write_str("discarded: its holder closed or went away"),
            Dropped::Rejected(d) => write!(f, "rejected: retry after {:?}", d.retry_after),
            Dropped::GateError(e) => write!(f, "the gate could not decide: {e}"),
        }
    }
}

/// The drop hook: one signature everywhere, `Fn(T, &Dropped) + Send + Sync + 'static`.
///
/// Shared components call it from whichever task dropped the item, never under a lock.
/// Build it from a closure with `OnDrop::new`, or pass the closure to a builder's `on_drop`.
///
/// # Panics
///
/// A hook that panics panics the operation that dropped the item (a send, a poll, the drop
/// of a receiver or a stream), as an item's panicking `Drop` would; nothing catches it. The
/// item is counted before the hook is called, and the component stays consistent and
/// usable. Where several items are dropped at once (the last receiver of a channel, a
/// `leaky_queue` dropped with items queued, a `prefetch` stream dropped with items
/// buffered), all of them are counted first; the items after the one whose hook panicked
/// are dropped without the hook.
///
/// While the thread already unwinds from another panic (a receiver, a stream or an adapter
/// dropped from the stack of a task that panicked), a hook's panic is caught and dropped,
/// as the metrics recorder's are: a second panic would abort the process. The first panic
/// goes on, and every item still reaches the hook.
///
/// # Examples
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::sync::Arc;
/// use flowgate::{Dropped, OnDrop};
///
/// let lost = Arc::new(AtomicU64::new(0));
/// let seen = lost.clone();
/// let hook = OnDrop::new(move |_item: u32, why: &Dropped| {
///     assert_eq!(why.as_str(), "newest");
///     seen.fetch_add(1, Ordering::Relaxed);
/// });
/// hook.call(7, &Dropped::Newest);
/// assert_eq!(lost.load(Ordering::Relaxed), 1);
/// ```
pub struct OnDrop<T>(Arc<Hook<T>>);

type Hook<T> = dyn Fn(T, &Dropped) + Send + Sync;

impl<T> OnDrop<T> {
    /// Wrap a hook.
    pub fn new(hook: impl Fn(T, &Dropped) + Send + Sync + 'static) -> OnDrop<T> {
        OnDrop(Arc::new(hook))
    }

    /// Call the hook with a dropped item and why it was dropped.
    ///
    /// # Panics
    ///
    /// When the hook panics, except while the thread already unwinds from another panic
    /// (see [`OnDrop`]).
    pub fn call(&self, item: T, why: &Dropped) {
        if std::thread::panicking() {
            // Dropped by an unwinding (a receiver, a stream, an adapter on the stack of a
            // panicking task): a second panic would abort the process.
            let hook = std::panic::AssertUnwindSafe(|| (self.0)(item, why));
            let _ = std::panic::catch_unwind(hook);
        } else {
            (self.0)(item, why)
        }
    }
}

impl<T> Clone for OnDrop<T> {
    fn clone(&self) -> OnDrop<T> {
        OnDrop(self.0.clone())
    }
}

impl<T> fmt::Debug for OnDrop<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OnDrop(..)")
    }
}

impl<T> std::panic::UnwindSafe for OnDrop<T> {}
impl<T> std::panic::RefUnwindSafe for OnDrop<T> {}

/// Record dropped items in the metrics (`record`: the metrics recorder, user code), then
/// hand them to the hook (`hand`). The items are counted already (in a `Stats`), or are
/// counted by `record`: a recorder that panics must not keep them from the hook, where they
/// are seen (dropped as its panic unwound, they went unseen). So its panic is caught, and
/// resumed once `hand` has run. Only on the paths that drop items.
pub(crate) fn recorded_then(record: impl FnOnce(), hand: impl FnOnce()) {
    let mut panics = Panics::new();
    panics.run(record);
    hand();
    panics.resume();
}

/// The one item an adapter holds while it waits (for a pacer, a permit), with what sees it
/// discarded: let go of by [`discard`](Held::discard) or when this is dropped (the adapter
/// dropped or taken apart), the item is counted, then handed to the hook as
/// [`Dropped::Discarded`]. A metrics recorder that panics as it is counted does not keep
/// it from the hook (see [`recorded_then`]).
pub(crate) struct Held<T> {
    pub(crate) item: Option<T>,
    on_drop: Option<OnDrop<T>>,
    /// Where a discarded item is counted.
    discarded: Counter,
}

impl<T> Held<T> {
    /// Nothing held yet.
    pub(crate) fn new(on_drop: Option<OnDrop<T>>, discarded: Counter) -> Held<T> {
        Held {
            item: None,
            on_drop,
            discarded,
        }
    }

    /// Discard the held item, if any: counted, then to the hook.
    pub(crate) fn discard(&mut self) {
        if let Some(item) = self.item.take() {
            recorded_then(
                || self.discarded.increment(1),
                || {
                    if let Some(hook) = &self.on_drop {
                        hook.call(item, &Dropped::Discarded);
                    }
                },
            );
        }
    }
}

impl<T> Drop for Held<T> {
    fn drop(&mut self) {
        self.discard();
    }
}

impl<T> fmt::Debug for Held<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Held")
            .field("holding", &self.item.is_some())
            .field("on_drop", &self.on_drop.is_some())
            .finish()
    }
}
