//! Calls to Redis that outlive their caller.
//!
//! A caller that gives up (its future dropped) after its request went to Redis is charged
//! there all the same: the script runs, only its answer is thrown away. A call that a
//! caller makes itself (not through the batch driver) is wrapped in a [`Finish`], which
//! hands what is left of the call to the runtime instead of dropping it, so what Redis
//! decided is still counted, a rejection still cached and a lease still kept, exactly as if
//! the caller had stayed. The batch driver does the same for batched callers: it finishes
//! every batch it sent, and a decision no caller reads is counted when its answer is
//! dropped.
//!
//! What is left is bounded by the call's own timeout (every call goes through
//! [`Backend::eval`](super::backend::Backend::eval) with what is left of it), so a finished
//! call ends within the timeout of the call it finishes.
//!
//! When nothing can finish a call (no runtime, or its runtime shuts down first), its
//! requests are counted as `abandoned` by the [`Unread`](super::batch::Unread) it holds
//! while it waits for Redis: the batch driver's calls too.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A call to Redis, polled in place by its caller; dropped after its first poll and before
/// it ends, it is spawned on the current tokio runtime to finish there. Never polled, it is
/// dropped (nothing was sent).
///
/// Outside a runtime, or on one that is shutting down, nothing can finish it: it is dropped
/// where it is (and counts itself `abandoned` through its [`Unread`](super::batch::Unread)).
pub(crate) struct Finish<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    /// `None` once it has ended (or was handed to the runtime).
    call: Option<Pin<Box<F>>>,
    /// Polled at least once: its request may be on its way to Redis.
    started: bool,
}

impl<F> Finish<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    /// `call`, to be finished even if its caller gives up.
    pub(crate) fn new(call: F) -> Finish<F> {
        Finish {
            call: Some(Box::pin(call)),
            started: false,
        }
    }
}

impl<F> fmt::Debug for Finish<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Finish")
            .field("started", &self.started)
            .field("ended", &self.call.is_none())
            .finish()
    }
}

impl<F> Future for Finish<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        let call = this
            .call
            .as_mut()
            .expect("a Finish is not polled after it has ended");
        this.started = true;
        // A call that panics here has ended (the panic goes to its caller): nothing is left
        // to finish on the runtime, where its spent future would panic again.
        let polled = std::panic::catch_unwind(AssertUnwindSafe(|| call.as_mut().poll(cx)));
        let output = match polled {
            Ok(polled) => std::task::ready!(polled),
            Err(panic) => {
                this.call = None;
                std::panic::resume_unwind(panic);
            }
        };
        this.call = None;
        Poll::Ready(output)
    }
}

impl<F> Drop for Finish<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        let Some(call) = self.call.take() else {
            return;
        };
        if !self.started {
            return;
        }
        // On a runtime that is shutting down the task is dropped at once, as it would be here.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            drop(runtime.spawn(call));
        }
    }
}
