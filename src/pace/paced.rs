//! `Paced`: an adapter's handle on a pacer, which leaves the line when dropped.

use std::task::{Context, Poll};

use crate::error::CostError;
use crate::pace::Pacer;
use crate::pace::until_ready::Wait;

/// A pacer plus one wait on it; dropping it gives up the place in line, so a dropped
/// adapter never blocks the other users of a shared pacer.
#[derive(Debug)]
pub(crate) struct Paced {
    pacer: Pacer,
    wait: Wait,
    /// The current item's units still to pay, and the chunk being paid (an item above the
    /// burst pays in chunks of at most the burst).
    owed: Option<(u32, u32)>,
}

impl Paced {
    pub(crate) fn new(pacer: Pacer) -> Paced {
        Paced {
            pacer,
            wait: Wait::new(),
            owed: None,
        }
    }

    pub(crate) fn pacer(&self) -> &Pacer {
        &self.pacer
    }

    /// Wait until an item of `cost()` units is paid for; `cost` is called only when the item
    /// starts to pay (once per item, however often it is polled). A cost above the burst is paid in
    /// successive chunks of half the burst, rounded up (so the rate holds in cost units); a
    /// cost of 0 passes at once. The wait in line is for the chunk, never for the whole cost:
    /// the pacer refuses a cost above the burst before queueing it, so a stalled item is
    /// timed (and stepped over) by its chunk, as guarantee (c) of [`Pacer`] needs.
    ///
    /// Half the burst, not all of it: a chunk of the whole burst is due only when the bucket
    /// is full, and a timer that ends late (up to 1 ms) finds it full still, the units of
    /// that lateness lost, chunk after chunk (an item of many bursts left 12 % late at
    /// 3 000/s). A chunk of half the burst is due with the other half still free for what
    /// the lateness brings: the next chunk is due that much sooner, as the schedule says.
    pub(crate) fn poll_admit(
        &mut self,
        cost: impl FnOnce() -> u32,
        cx: &mut Context<'_>,
    ) -> Poll<()> {
        let (mut owed, mut chunk) = self.owed.unwrap_or_else(|| {
            let cost = cost();
            (cost, cost)
        });
        while owed > 0 {
            chunk = chunk.min(owed);
            // Kept before each attempt: a chunk that passes as a metrics recorder panics
            // (the panic goes on from here) is through at the next poll, and only the
            // units after it are owed then.
            self.owed = Some((owed, chunk));
            match self.wait.poll_admit(self.pacer.inner(), chunk, cx) {
                Poll::Ready(Ok(())) => owed -= chunk,
                // Too big for the burst: ask again for half a burst (see above), keeping the
                // place in line.
                Poll::Ready(Err(CostError::ExceedsCapacity { capacity, .. })) => {
                    chunk = u32::try_from(capacity.div_ceil(2)).unwrap_or(u32::MAX);
                }
                // Only a zero cost is refused otherwise; `chunk` is at least 1 here.
                Poll::Ready(Err(_)) => owed -= chunk,
                Poll::Pending => return Poll::Pending,
            }
        }
        self.owed = None;
        Poll::Ready(())
    }

    pub(crate) fn is_waiting(&self) -> bool {
        self.wait.is_waiting()
    }

    /// Give up the place in line and the current item's units still owed (its holder will
    /// pay for no more items: a closed sink).
    pub(crate) fn leave(&mut self) {
        self.owed = None;
        self.wait.cancel(self.pacer.inner());
    }
}

impl Drop for Paced {
    fn drop(&mut self) {
        self.wait.cancel(self.pacer.inner());
    }
}
