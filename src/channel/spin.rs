//! A receiver's short, adaptive spin before it waits.
//!
//! A receiver that finds the channel empty registers its waker and returns `Pending`; if
//! its executor then parks the thread (a consumer loop in `block_on`), the next item costs
//! a futex wake and two context switches, tens of microseconds on a VM, even when the
//! producer pushes it a few microseconds later. That is the common case of a small channel
//! in steady flow: either its sender waits for room (the receiver frees a slot, the waiting
//! sender is let in and woken, and the receiver, having drained the rest, finds nothing
//! yet), or the receiver is the faster side and empties the ring between two pushes.
//!
//! So a receiver about to wait first watches the ring for up to [`SPIN`] and takes the item
//! if one comes, when all of these hold (checked in `Receiver::poll_next_item`):
//!
//! - the channel holds at most [`MAX_CAPACITY`] items: a small ring fills in a few
//!   microseconds, so its receiver would otherwise park every handful of items, while a
//!   large ring's receiver takes long batches between parks, and a spin that lets it take
//!   items one by one as they come costs more than the park it saves;
//! - nothing is queued (in the ring, or given back by a receiver dropped with part of a
//!   batch);
//! - the receiver is not polled inside a tokio task (spinning there would hold up a worker,
//!   maybe the very sender, woken onto this worker's queue), nor on the thread of a tokio
//!   current-thread runtime (a `#[tokio::test]` body: its senders run on that same thread,
//!   so no push can come while it spins): [`may_spin_here`];
//! - spinning has not been turned off for a while: [`MISSES`] fruitless spins in a row turn
//!   it off for the next `cooldown` waits, `cooldown` doubling with each such pause (from
//!   [`COOLDOWN_MIN`] to [`COOLDOWN_MAX`] waits) and coming back to its least with the next
//!   spin that sees an item.
//!
//! The cost is bounded: a receiver whose spins never pay spends at most [`MISSES`] ×
//! [`SPIN`] of CPU per [`COOLDOWN_MAX`] waits once it has backed off. Nothing the channel
//! promises depends on the spin: it only looks at what is queued, and then the receive goes
//! on as it would have. Under `--cfg flowgate_loom` the receiver never gets here, so the
//! models see the channel as before.
//!
//! Until 0.2.0 a receiver spun only when a sender that had waited for room was let in since
//! its last look. On an Intel Xeon VM the receiver was the faster side: the ring ran empty
//! with no sender waiting, so it never spun and parked for nearly every item. Spinning
//! whenever the small ring is empty (the back-off above bounds the cost) took capacity 16
//! `block_on` from 1 080–1 190 to 386–411 ns per item in SPSC, 890–920 to 350–400 in MPSC
//! 4→1 and 630 to 380–390 in MPMC 2→2.

use std::time::{Duration, Instant};

/// The longest a receiver spins before it waits. Long enough for a parked tokio worker on
/// an idle core to wake and run the sender: on a quiet 2-vCPU VM that took more than 20 µs
/// often enough that a 20 µs spin missed in streaks and SPSC capacity 16 `block_on` ran at
/// 900–5 400 ns per item; at 60 µs, 130–260 ns (MPSC 4→1 350–370 against 133–135; MPMC
/// 2→2 alike either way).
const SPIN: Duration = Duration::from_micros(60);
/// The largest capacity whose receiver spins. A park and a wake cost some 10–30 µs on a
/// VM; a receiver moves an item in about 50–100 ns, so a park per ring-full costs less than
/// the items' own handling from about 256 slots on (measured: capacity 16 gains up to
/// fourfold from the spin; capacity 1024 loses about 15 % against no spin in SPSC).
const MAX_CAPACITY: usize = 256;
/// Fruitless spins in a row that turn spinning off for a while.
const MISSES: u32 = 8;
/// Waits without spinning after the first pause.
const COOLDOWN_MIN: u32 = 16;
/// The most waits without spinning in one pause.
const COOLDOWN_MAX: u32 = 4096;
/// `spin_loop` hints between two looks at the clock.
const SPINS_PER_CLOCK_READ: u32 = 16;

/// Whether the receiver of a channel of `capacity` may spin: a small one only (see
/// [`MAX_CAPACITY`]).
pub(crate) fn worth_spinning_for(capacity: usize) -> bool {
    capacity <= MAX_CAPACITY
}

/// Whether a receiver polled on this thread may spin (see the module docs): not in a tokio
/// task, not on a tokio current-thread runtime's thread.
pub(crate) fn may_spin_here() -> bool {
    if tokio::task::try_id().is_some() {
        return false;
    }
    match tokio::runtime::Handle::try_current() {
        Ok(handle) => handle.runtime_flavor() != tokio::runtime::RuntimeFlavor::CurrentThread,
        Err(_) => true,
    }
}

/// A receiver's spin state (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct Spin {
    /// Waits left before the next spin.
    skip: u32,
    /// Waits to skip at the next pause.
    cooldown: u32,
    /// Fruitless spins in a row.
    misses: u32,
}

impl Default for Spin {
    fn default() -> Spin {
        Spin {
            skip: 0,
            cooldown: COOLDOWN_MIN,
            misses: 0,
        }
    }
}

impl Spin {
    /// The receiver found nothing and is about to wait: unless spinning is paused, spin up
    /// to [`SPIN`] until `ready()` (an item came) or `stop()` (none can come). Returns
    /// whether `ready()` became true.
    pub(crate) fn before_wait(
        &mut self,
        ready: impl Fn() -> bool,
        stop: impl Fn() -> bool,
    ) -> bool {
        if stop() {
            return false;
        }
        if self.skip > 0 {
            self.skip -= 1;
            return false;
        }
        let start = Instant::now();
        loop {
            for _ in 0..SPINS_PER_CLOCK_READ {
                if ready() {
                    self.cooldown = COOLDOWN_MIN;
                    self.misses = 0;
                    return true;
                }
                std::hint::spin_loop();
            }
            if stop() || start.elapsed() >= SPIN {
                break;
            }
        }
        self.misses += 1;
        if self.misses >= MISSES {
            self.misses = 0;
            self.skip = self.cooldown;
            self.cooldown = (self.cooldown * 2).min(COOLDOWN_MAX);
        }
        false
    }
}

/// For the receiver's tests: whether this receiver has spun in vain since its last spin
/// that saw an item.
#[cfg(test)]
impl Spin {
    pub(crate) fn has_missed(&self) -> bool {
        self.misses > 0 || self.skip > 0 || self.cooldown > COOLDOWN_MIN
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    /// Runs `before_wait` with a `ready` that never is, and says whether it spun.
    fn spun(spin: &mut Spin) -> bool {
        let looked = Cell::new(false);
        let came = spin.before_wait(
            || {
                looked.set(true);
                false
            },
            || false,
        );
        assert!(!came);
        looked.get()
    }

    #[test]
    fn fruitless_spins_pause_spinning_for_longer_and_longer() {
        let mut spin = Spin::default();
        let mut pauses = Vec::new();
        for _ in 0..12 {
            for _ in 0..MISSES {
                assert!(spun(&mut spin), "spins until MISSES misses in a row");
            }
            let mut skipped = 0;
            while !spun(&mut spin) {
                skipped += 1;
            }
            // That last call spun again: the first miss of the next round.
            spin.misses -= 1;
            pauses.push(skipped);
        }
        assert_eq!(
            pauses,
            [
                16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 4096, 4096, 4096
            ]
        );
    }

    #[test]
    fn a_spin_that_sees_an_item_resets_the_pause() {
        let mut spin = Spin::default();
        for _ in 0..3 * MISSES {
            spin.skip = 0;
            spun(&mut spin);
        }
        assert!(spin.cooldown > COOLDOWN_MIN);
        spin.skip = 0;
        spin.misses = MISSES - 1;
        assert!(spin.before_wait(|| true, || false));
        assert_eq!(
            (spin.cooldown, spin.misses, spin.skip),
            (COOLDOWN_MIN, 0, 0)
        );
    }

    #[test]
    fn a_closed_channel_is_never_spun_for() {
        let mut spin = Spin::default();
        let looked = Cell::new(false);
        assert!(!spin.before_wait(
            || {
                looked.set(true);
                false
            },
            || true
        ));
        assert!(!looked.get());
        assert_eq!((spin.misses, spin.skip), (0, 0));
    }

    #[test]
    fn never_in_a_tokio_task_nor_on_a_current_thread_runtime() {
        // A plain thread (`futures::executor::block_on`, say) may.
        assert!(may_spin_here());
        assert!(futures::executor::block_on(async { may_spin_here() }));
        // The thread of a current-thread runtime may not, in `block_on` or in a task.
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        assert!(!rt.block_on(async { may_spin_here() }));
        assert!(!rt.block_on(async { tokio::spawn(async { may_spin_here() }).await.unwrap() }));
        // A multi-thread runtime: its workers' tasks may not; `block_on` (a caller's thread,
        // the workers run the senders) may.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap();
        assert!(!rt.block_on(async { tokio::spawn(async { may_spin_here() }).await.unwrap() }));
        assert!(rt.block_on(async { may_spin_here() }));
    }

    #[test]
    fn only_a_small_channel_is_spun_for() {
        assert!(worth_spinning_for(1));
        assert!(worth_spinning_for(16));
        assert!(worth_spinning_for(256));
        assert!(!worth_spinning_for(257));
        assert!(!worth_spinning_for(1024));
    }
}
