//! `UntilReady`: the future of `Pacer::until_ready`.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::time::Sleep;

use crate::error::CostError;
use crate::pace::Pacer;
use crate::pace::pacer::{Admit, Inner, Ticket};

/// Waits for admission through a pacer, keeping its place in line and its timer.
///
/// Shared by [`UntilReady`] and the pacing adapters: one `Sleep`, allocated on the first
/// wait and reset after that (boxed, so the adapters stay `Unpin` when their inner is).
#[derive(Debug)]
pub(crate) struct Wait {
    ticket: Ticket,
    timer: Option<Pin<Box<Sleep>>>,
}

impl Wait {
    pub(crate) fn new() -> Wait {
        Wait {
            ticket: Ticket::default(),
            timer: None,
        }
    }

    /// Poll until `cost` passes through `pacer`.
    pub(crate) fn poll_admit(
        &mut self,
        pacer: &Inner,
        cost: u32,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), CostError>> {
        if self.ticket.take_passed() {
            // Passed at the last poll, which a metrics recorder's panic cut short.
            return Poll::Ready(Ok(()));
        }
        loop {
            match pacer.admit(cx, cost, &mut self.ticket)? {
                Admit::Now => return Poll::Ready(Ok(())),
                Admit::Queued(None) => return Poll::Pending,
                Admit::Queued(Some(due)) | Admit::At(due) => {
                    let timer = match &mut self.timer {
                        Some(timer) => {
                            timer.as_mut().reset(due);
                            timer
                        }
                        None => self.timer.insert(Box::pin(tokio::time::sleep_until(due))),
                    };
                    if timer.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    // Already due: the next attempt is admitted (or, watching a first waiter
                    // that let its turn pass, steps over it).
                }
            }
        }
    }

    /// Whether this wait holds a place in line.
    pub(crate) fn is_waiting(&self) -> bool {
        self.ticket.is_waiting()
    }

    /// Leave the line (on drop or when the caller gives up).
    pub(crate) fn cancel(&mut self, pacer: &Inner) {
        pacer.leave(&mut self.ticket);
    }
}

/// Future of [`Pacer::until_ready`](crate::pace::Pacer::until_ready).
///
/// Owns a handle to the pacer (`'static`: it can be spawned or stored). Dropping it gives
/// up its place in line and holds no reservation: nothing is lost.
#[must_use = "futures do nothing unless polled"]
pub struct UntilReady {
    pacer: Pacer,
    cost: u32,
    wait: Wait,
}

impl UntilReady {
    pub(crate) fn new(pacer: Pacer, cost: u32) -> UntilReady {
        UntilReady {
            pacer,
            cost,
            wait: Wait::new(),
        }
    }
}

impl Future for UntilReady {
    type Output = Result<(), CostError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let polled = this.wait.poll_admit(this.pacer.inner(), this.cost, cx);
        if let Poll::Ready(Err(_)) = polled {
            // Refused (the burst was lowered below the cost while it waited): a wait that
            // can never pass gives up its place at once.
            this.wait.cancel(this.pacer.inner());
        }
        polled
    }
}

impl Drop for UntilReady {
    fn drop(&mut self) {
        self.wait.cancel(self.pacer.inner());
    }
}

impl fmt::Debug for UntilReady {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UntilReady")
            .field("cost", &self.cost)
            .finish_non_exhaustive()
    }
}
