//! How an adapter that may not take an item (`watermarks` at `high`, `with_demand` without
//! credit) asks its upstream to wake it when the upstream ends, without polling it.
//!
//! `Stream` has no way to ask for the end alone: polling may yield an item. So the adapter
//! reads the upstream's [`size_hint`](futures::Stream::size_hint) through
//! [`size_hint_watching_end`], which lends its waker to the thread for that call; an
//! upstream that can tell its end apart (a channel [`Receiver`](crate::channel::Receiver))
//! takes it in its `size_hint` ([`with_end_watcher`]) and wakes it when it ends. Adapters in
//! between (`map`, `filter`, ...) pass the call on as they compute their own hint, so the
//! channel is found under them. Upstreams that do not look cost nothing.

use std::cell::RefCell;
use std::task::Waker;

use futures::Stream;

thread_local! {
    /// The waker of the adapter reading a `size_hint` on this thread, if one does.
    static WATCHER: RefCell<Option<Waker>> = const { RefCell::new(None) };
}

/// Puts the watcher that was there back, even if the `size_hint` panics (user code).
struct Restore(Option<Waker>);

impl Drop for Restore {
    fn drop(&mut self) {
        let before = self.0.take();
        // A thread being torn down has no watcher to restore.
        let _ = WATCHER.try_with(|w| *w.borrow_mut() = before);
    }
}

/// `stream.size_hint()`, read while `waker` watches for the stream's end: an upstream that
/// can tell its end apart registers `waker` to be woken once it has ended (it may also be
/// woken sooner, spuriously).
pub(crate) fn size_hint_watching_end<S: Stream + ?Sized>(
    stream: &S,
    waker: &Waker,
) -> (usize, Option<usize>) {
    // A thread tearing down its locals watches nothing: the hint alone.
    let Ok(before) = WATCHER.try_with(|w| w.borrow_mut().replace(waker.clone())) else {
        return stream.size_hint();
    };
    let _restore = Restore(before);
    stream.size_hint()
}

/// In a `size_hint`: `f` with the waker of the adapter watching for the end through
/// [`size_hint_watching_end`], if one is (lent: `f` clones it only to keep it, and wakes
/// nothing while it is lent: what it returns is dropped after).
pub(crate) fn with_end_watcher<R>(f: impl FnOnce(&Waker) -> R) -> Option<R> {
    WATCHER
        .try_with(|w| w.borrow().as_ref().map(f))
        .ok()
        .flatten()
}
