//! The slot of the bulkhead stream adapters: one mapped future polled in place.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// Poll the future in `slot`: `Ready(Some(output))` once it completes (the slot is then
/// empty), `Ready(None)` if the slot is empty. If the poll panics, the slot is emptied while
/// the panic unwinds, so a future that panicked is never polled again (as
/// `FuturesUnordered` does).
pub(crate) fn poll_slot<F: Future>(
    slot: Pin<&mut Option<F>>,
    cx: &mut Context<'_>,
) -> Poll<Option<F::Output>> {
    /// Empties the slot when dropped while armed (`Some`): only on unwinding.
    struct Disarm<'a, F>(Option<Pin<&'a mut Option<F>>>);
    impl<F> Drop for Disarm<'_, F> {
        fn drop(&mut self) {
            if let Some(slot) = self.0.as_mut() {
                slot.set(None);
            }
        }
    }
    let mut guard = Disarm(Some(slot));
    let slot = guard.0.as_mut().expect("armed");
    let Some(fut) = slot.as_mut().as_pin_mut() else {
        guard.0 = None;
        return Poll::Ready(None);
    };
    let polled = fut.poll(cx);
    let mut slot = guard.0.take().expect("armed");
    match polled {
        Poll::Ready(out) => {
            slot.set(None);
            Poll::Ready(Some(out))
        }
        Poll::Pending => Poll::Pending,
    }
}
