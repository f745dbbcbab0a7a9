//! [`Panics`]: a series of steps that must each run even if one before them panics.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

/// The first panic of a series of steps that must each run whatever the ones before did:
/// user code runs in them (a metrics recorder, a waker, a drop hook), and a step its panic
/// skipped would lose a permit, an item, a count or a change for good. Run each step with
/// [`run`](Self::run); [`resume`](Self::resume) once all have run goes on with the first
/// panic, unless the thread already unwinds from another one (the steps run by a drop during
/// that unwinding), where a second panic would abort the process: then it is dropped and the
/// first goes on. Later panics are dropped, as a second panic in one unwinding would be.
///
/// `pub` in this crate-private module, as a sealed type: [`Gate::check_local_held`]'s hidden
/// signature holds it, and no implementor outside the crate can name it.
///
/// [`Gate::check_local_held`]: crate::gate::Gate::check_local_held
#[must_use = "a caught panic is resumed once every step has run"]
#[derive(Debug, Default)]
#[allow(unreachable_pub)]
pub struct Panics(Option<Box<dyn Any + Send>>);

impl Panics {
    /// None caught yet.
    pub(crate) const fn new() -> Panics {
        Panics(None)
    }

    /// Run `f`, keeping its panic if it is the first.
    pub(crate) fn run(&mut self, f: impl FnOnce()) {
        if let Err(panic) = catch_unwind(AssertUnwindSafe(f)) {
            self.0.get_or_insert(panic);
        }
    }

    /// Go on with the first panic caught, if any (see the type).
    pub(crate) fn resume(self) {
        if let Some(panic) = self.0
            && !std::thread::panicking()
        {
            resume_unwind(panic);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_step_runs_and_the_first_panic_goes_on() {
        let mut ran = Vec::new();
        let caught = catch_unwind(AssertUnwindSafe(|| {
            let mut panics = Panics::new();
            panics.run(|| std::panic::panic_any("first"));
            panics.run(|| ran.push(2));
            panics.run(|| std::panic::panic_any("second"));
            panics.run(|| ran.push(4));
            panics.resume();
        }));
        assert_eq!(ran, [2, 4]);
        let payload = caught.expect_err("the first panic goes on");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"first"));
    }

    #[test]
    fn nothing_caught_resumes_nothing() {
        let mut panics = Panics::new();
        let mut ran = false;
        panics.run(|| ran = true);
        panics.resume();
        assert!(ran);
    }

    #[test]
    fn a_panic_caught_while_unwinding_is_dropped_not_a_second_panic() {
        struct Steps<'a>(&'a mut bool);
        impl Drop for Steps<'_> {
            fn drop(&mut self) {
                let mut panics = Panics::new();
                panics.run(|| std::panic::panic_any("during"));
                panics.run(|| *self.0 = true);
                // A resume here would abort the process.
                panics.resume();
            }
        }
        let mut ran = false;
        let caught = catch_unwind(AssertUnwindSafe(|| {
            let _steps = Steps(&mut ran);
            std::panic::panic_any("outer");
        }));
        assert_eq!(caught.unwrap_err().downcast_ref::<&str>(), Some(&"outer"));
        assert!(ran);
    }
}
