//! [`WarnOnce`]: a warning an extractor says once, for itself and all its clones.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether an extractor (or a clone of it) has said its warning yet.
#[derive(Clone, Debug, Default)]
pub(crate) struct WarnOnce(Arc<AtomicBool>);

impl WarnOnce {
    /// Whether this is the first time: the caller then says it. Read before it is swapped:
    /// once it happened, a flood of requests that would warn (the usual case) writes no
    /// shared line.
    #[inline]
    pub(crate) fn first(&self) -> bool {
        !self.0.load(Ordering::Relaxed) && !self.0.swap(true, Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_first_call_of_an_extractor_and_its_clones_is_first() {
        let once = WarnOnce::default();
        let clone = once.clone();
        assert!(clone.first());
        assert!(!once.first());
        assert!(!clone.first());
        assert!(
            WarnOnce::default().first(),
            "another extractor says its own"
        );
    }
}
