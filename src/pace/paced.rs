//! `Paced`: an adapter's handle on a pacer, which leaves the line when dropped.

use std::task::{Context, Poll};

use crate::pace::Pacer;
use crate::pace::error::PaceError;
use crate::pace::until_ready::Wait;

/// A pacer plus one wait on it; dropping it gives up the place in line, so a dropped
/// adapter never blocks the other users of a shared pacer.
#[derive(Debug)]
pub(crate) struct Paced {
    pacer: Pacer,
    wait: Wait,
}

impl Paced {
    pub(crate) fn new(pacer: Pacer) -> Paced {
        Paced {
            pacer,
            wait: Wait::new(),
        }
    }

    pub(crate) fn pacer(&self) -> &Pacer {
        &self.pacer
    }

    /// Wait until `cost` (clamped to `1..=burst`) passes.
    pub(crate) fn poll_admit(&mut self, cost: u32, cx: &mut Context<'_>) -> Poll<()> {
        let mut cost = cost;
        loop {
            return match self.wait.poll_admit(self.pacer.inner(), cost, cx) {
                Poll::Ready(Ok(())) => Poll::Ready(()),
                Poll::Ready(Err(PaceError::InsufficientCapacity { burst, .. })) => {
                    cost = burst;
                    continue;
                }
                Poll::Ready(Err(_)) => {
                    cost = 1;
                    continue;
                }
                Poll::Pending => Poll::Pending,
            };
        }
    }

    pub(crate) fn is_waiting(&self) -> bool {
        self.wait.is_waiting()
    }
}

impl Drop for Paced {
    fn drop(&mut self) {
        self.wait.cancel(self.pacer.inner());
    }
}
