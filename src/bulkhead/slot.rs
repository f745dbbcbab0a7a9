//! The slot of the bulkhead stream adapters: one mapped future polled in place.

use std::any::Any;
use std::cell::RefCell;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Mutex, PoisonError};
use std::task::{Context, Poll, ready};

use pin_project::{pin_project, pinned_drop};

use crate::adaptive::Outcome;
use crate::bulkhead::acquire::OwnedBulkheadPermit;
use crate::bulkhead::adaptive::Grant;
use crate::bulkhead::core::Core;
use crate::sync::Arc;

/// A mapped future with its grant and its bulkhead (adaptive bulkheads only), answered with
/// its output and grant, so the adapter can feed the sample when it completes. Dropped
/// before it completes (the adapter dropped, or the future panicked), the call is an
/// [`Outcome::Ignored`] sample, as a permit dropped without `record` is.
#[pin_project(PinnedDrop)]
#[derive(Debug)]
pub(crate) struct Timed<Fut> {
    #[pin]
    fut: Fut,
    sample: Option<(Grant, Arc<Core>)>,
}

impl<Fut> Timed<Fut> {
    /// The future `make` answers, with `sample`, the grant of the unit of work it starts:
    /// if `make` (an adapter's `f`, user code) panics, that grant is an
    /// [`Outcome::Ignored`] sample as the panic unwinds, as the grant of a future dropped
    /// before it completes is.
    pub(crate) fn start(
        sample: Option<(Grant, Arc<Core>)>,
        make: impl FnOnce() -> Fut,
    ) -> Timed<Fut> {
        /// The grant of a future being made: ignored if dropped, when `make` panicked.
        struct Unmade(Option<(Grant, Arc<Core>)>);
        impl Drop for Unmade {
            fn drop(&mut self) {
                ignored(self.0.take());
            }
        }
        let mut unmade = Unmade(sample);
        let fut = make();
        Timed {
            fut,
            sample: unmade.0.take(),
        }
    }
}

/// Feed the [`Outcome::Ignored`] sample of a unit of work that ended without finishing, if
/// the bulkhead is adaptive. It runs user code (a metrics recorder): see [`held_back`].
fn ignored(sample: Option<(Grant, Arc<Core>)>) {
    if let Some((grant, core)) = sample {
        held_back(|| core.record(grant, Outcome::Ignored));
    }
}

impl<Fut: Future> Future for Timed<Fut> {
    type Output = (Fut::Output, Option<Grant>);

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let out = ready!(this.fut.poll(cx));
        Poll::Ready((out, this.sample.take().map(|(grant, _)| grant)))
    }
}

#[pinned_drop]
impl<Fut> PinnedDrop for Timed<Fut> {
    fn drop(self: Pin<&mut Self>) {
        ignored(self.project().sample.take());
    }
}

thread_local! {
    /// While a [`Queue`] drops its futures (`Some`): the first panic their drops raised.
    static HELD_PANIC: RefCell<Option<Option<Box<dyn Any + Send>>>> = const { RefCell::new(None) };
}

/// Run `f`, user code run by the drop of a future in flight (its permit's return, its
/// `Ignored` sample: a metrics recorder, a waker). Its panic is held back while a [`Queue`]
/// drops its futures, resumed at once anywhere else, unless the thread already unwinds (the
/// future dropped by that unwinding): a second panic there would abort the process, so it
/// is dropped and the first one goes on.
pub(crate) fn held_back(f: impl FnOnce()) {
    let Err(payload) = std::panic::catch_unwind(AssertUnwindSafe(f)) else {
        return;
    };
    let resume = HELD_PANIC.with(|held| match &mut *held.borrow_mut() {
        Some(first) => {
            first.get_or_insert(payload);
            None
        }
        None => Some(payload),
    });
    if let Some(payload) = resume
        && !std::thread::panicking()
    {
        std::panic::resume_unwind(payload);
    }
}

/// The futures in flight behind an adapter's slot (a `FuturesOrdered` or
/// `FuturesUnordered`). Those leak every future still queued when the drop of one panics
/// (on purpose), and all those futures own with them; so while it is dropped the futures'
/// drops hold their panics back (see [`held_back`]), resumed once every future is dropped
/// (unless the thread is already unwinding).
pub(crate) struct Queue<Q: Default>(pub(crate) Q);

impl<Q: Default> Drop for Queue<Q> {
    fn drop(&mut self) {
        let outer = HELD_PANIC.with(|held| held.borrow_mut().replace(None));
        let queue = std::mem::take(&mut self.0);
        let dropped = std::panic::catch_unwind(AssertUnwindSafe(|| drop(queue)));
        let held = HELD_PANIC.with(|held| std::mem::replace(&mut *held.borrow_mut(), outer));
        if let Some(payload) = dropped.err().or(held.flatten())
            && !std::thread::panicking()
        {
            std::panic::resume_unwind(payload);
        }
    }
}

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

/// Record a finished call's `Ok` sample on an adaptive bulkhead with its output in hand: the
/// algorithm and a metrics recorder are user code, so a panic there is caught (the permit is
/// returned as it unwinds), to be resumed once the output is out.
pub(crate) fn learn_ok(permit: OwnedBulkheadPermit) -> Option<Panic> {
    std::panic::catch_unwind(AssertUnwindSafe(|| permit.record(Outcome::Ok)))
        .err()
        .map(Panic::new)
}

/// A panic caught in an adapter, kept to be resumed by a later poll: a mapped future's that
/// was not the oldest (the ordered adapter), or user code's that ran while an output was on
/// its way out (the unordered adapter). (In a `Mutex` only so the adapter stays `Sync`: the
/// payload is `Send` alone.)
pub(crate) struct Panic(Mutex<Box<dyn Any + Send>>);

impl Panic {
    pub(crate) fn new(payload: Box<dyn Any + Send>) -> Panic {
        Panic(Mutex::new(payload))
    }

    pub(crate) fn resume(self) -> ! {
        std::panic::resume_unwind(self.0.into_inner().unwrap_or_else(PoisonError::into_inner))
    }
}

impl fmt::Debug for Panic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Panic(..)")
    }
}
