//! Wakers whose own code misbehaves, as a task's waker is user code.

use std::sync::Arc;
use std::task::{Wake, Waker};

/// Panics when woken.
struct Panics;

impl Wake for Panics {
    fn wake(self: Arc<Self>) {
        panic!("the waker panics");
    }
}

/// A waker that panics when woken (by value or by reference).
pub fn panicking_waker() -> Waker {
    Waker::from(Arc::new(Panics))
}
