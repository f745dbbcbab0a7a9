//! [`with_reused`]: a thread's reused buffer, or a fresh one when it is in use.

use std::cell::RefCell;
use std::thread::LocalKey;

/// `f` of the thread's `local` value; of a fresh `T::default()` when `local` is already
/// borrowed (code that `f` calls decides another request on this thread): no panic, an
/// allocation at most. A panic in `f` releases the borrow as it unwinds.
pub(crate) fn with_reused<T: Default + 'static, R>(
    local: &'static LocalKey<RefCell<T>>,
    f: impl FnOnce(&mut T) -> R,
) -> R {
    local.with(|cell| match cell.try_borrow_mut() {
        Ok(mut value) => f(&mut value),
        Err(_) => f(&mut T::default()),
    })
}
