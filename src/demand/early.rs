//! `Early`: what `with_demand` and `watermarks` share to see their upstream's end while
//! they may not take an item (no credit, no room).

use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Stream;

use crate::metrics::Counter;

/// An item the upstream yielded while the adapter could not take one, held until it can.
///
/// The end of a stream needs no demand (Reactive Streams §2.9): while the adapter may not
/// take an item, an upstream whose `size_hint` says none is left (an iterator; a prefetch
/// that saw its source's end) is polled for its end, so an adapter whose credit or room was
/// used up by the last items ends instead of waiting for ever. The hint is read at that
/// poll, watching for the end (see [`crate::sync::size_hint_watching_end`]): a channel
/// receiver under it wakes the adapter when it ends later (a close while the adapter
/// waits); any other upstream whose hint changes while the adapter waits (a prefetch whose
/// source answers its end then) does not wake it, and its end is seen at the adapter's next
/// poll. An item such an upstream yields all the same (a wrong `size_hint`) is held here
/// until the adapter may take it.
///
/// Dropped while it holds one (the adapter dropped, or taken apart with `into_inner`), the
/// item is discarded: counted in `flowgate_demand_discarded_total` (the adapter's
/// `discarded`), then dropped.
#[derive(Debug)]
pub(crate) struct Early<T> {
    item: Option<T>,
    discarded: Counter,
}

impl<T> Drop for Early<T> {
    fn drop(&mut self) {
        if let Some(item) = self.item.take() {
            // Counted first: an item whose own drop panics is counted all the same.
            self.discarded.increment(1);
            drop(item);
        }
    }
}

impl<T> Early<T> {
    /// Nothing held; an item let go of is counted in `discarded`.
    pub(crate) fn new(discarded: Counter) -> Self {
        Early {
            item: None,
            discarded,
        }
    }

    /// While no item may be taken: polls `stream` for its end if it says none is left (and
    /// nothing is held yet); whether it ended.
    pub(crate) fn poll_end<S: Stream<Item = T>>(
        &mut self,
        stream: Pin<&mut S>,
        cx: &mut Context<'_>,
    ) -> bool {
        if self.item.is_some()
            || crate::sync::size_hint_watching_end(&*stream, cx.waker()).1 != Some(0)
        {
            return false;
        }
        match stream.poll_next(cx) {
            Poll::Ready(None) => true,
            Poll::Ready(Some(item)) => {
                self.item = Some(item);
                false
            }
            Poll::Pending => false,
        }
    }

    /// Hold `item` (nothing is held): an item taken from upstream stays here until the
    /// adapter hands it out, so that a panic on the way (user code: a metrics recorder)
    /// does not lose it.
    pub(crate) fn hold(&mut self, item: T) {
        debug_assert!(self.item.is_none(), "one item held at a time");
        self.item = Some(item);
    }

    /// The held item, to be yielded before the upstream's next.
    pub(crate) fn take(&mut self) -> Option<T> {
        self.item.take()
    }

    /// Whether an item is held.
    pub(crate) fn is_held(&self) -> bool {
        self.item.is_some()
    }

    /// The upstream's `size_hint` with the held item added.
    pub(crate) fn size_hint(&self, (lo, hi): (usize, Option<usize>)) -> (usize, Option<usize>) {
        let held = usize::from(self.is_held());
        (
            lo.saturating_add(held),
            hi.and_then(|hi| hi.checked_add(held)),
        )
    }
}
