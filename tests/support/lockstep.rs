//! Two threads in lockstep, for tests of state that racing threads update.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Runs `rounds` rounds in which `mine` (on this thread) and `theirs` (on a second thread)
/// act at the same moment, then `check(round)` runs on this thread with both done.
///
/// Each side is given `start`: it does its own set-up, calls `start()` (which spins until
/// the round begins, so that the two actions begin as close together as they can), then
/// acts. Spinning, not sleeping; the waiting thread yields now and then so the other can run
/// when the two share a core. A panic on the second thread fails the test at once (this one
/// stops waiting for it) and is resumed here.
pub fn lockstep<T>(
    rounds: usize,
    mut theirs: T,
    mut mine: impl FnMut(&dyn Fn()),
    mut check: impl FnMut(usize),
) where
    T: FnMut(&dyn Fn()) + Send + 'static,
{
    // Round r starts when `step` is 3r; each side adds one when it has acted, and this one
    // adds the third once `check` is done.
    let step = Arc::new(AtomicUsize::new(0));
    let gone = Arc::new(AtomicBool::new(false));
    let other = {
        let (step, gone) = (step.clone(), gone.clone());
        std::thread::spawn(move || {
            /// Marks the thread gone when it ends, panicking or not.
            struct Gone(Arc<AtomicBool>);
            impl Drop for Gone {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::Release);
                }
            }
            let _gone = Gone(gone);
            for round in 0..rounds {
                theirs(&|| {
                    wait_for(&step, 3 * round, None);
                });
                step.fetch_add(1, Ordering::AcqRel);
                wait_for(&step, 3 * round + 3, None);
            }
        })
    };
    let mut failed = false;
    for round in 0..rounds {
        mine(&|| {
            wait_for(&step, 3 * round, Some(&gone));
        });
        step.fetch_add(1, Ordering::AcqRel);
        if !wait_for(&step, 3 * round + 2, Some(&gone)) {
            failed = true;
            break;
        }
        check(round);
        step.fetch_add(1, Ordering::AcqRel);
    }
    if let Err(panic) = other.join() {
        std::panic::resume_unwind(panic);
    }
    assert!(!failed, "the second thread ended before its rounds did");
}

/// Spins until `step` reaches `n`; `false` if `gone` says the other thread ended first.
fn wait_for(step: &AtomicUsize, n: usize, gone: Option<&AtomicBool>) -> bool {
    let mut spins = 0u32;
    while step.load(Ordering::Acquire) < n {
        if gone.is_some_and(|g| g.load(Ordering::Acquire)) && step.load(Ordering::Acquire) < n {
            return false;
        }
        spins += 1;
        if spins.is_multiple_of(1024) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    true
}
