//! Permits: a reserved slot, filled by a send that cannot fail.

use std::fmt;

use crate::channel::sender::Sender;
use crate::channel::shared::Shared;

/// A reserved slot in the channel, from [`Sender::reserve`] or [`Sender::try_reserve`].
///
/// Sending through it cannot fail and never waits. Dropping it unused returns the slot (to
/// the next waiting sender, if any). If every receiver is gone by the time it is used, the
/// item goes to the channel's `on_drop` hook ([`Dropped::Discarded`](crate::Dropped::Discarded))
/// and is counted as dropped.
#[must_use = "a permit holds a slot until it is used or dropped"]
pub struct Permit<'a, T> {
    shared: &'a Shared<T>,
}

impl<'a, T> Permit<'a, T> {
    pub(crate) fn new(shared: &'a Shared<T>) -> Permit<'a, T> {
        Permit { shared }
    }

    /// Fill the reserved slot with `item`.
    pub fn send(self, item: T) {
        let shared = self.shared;
        std::mem::forget(self);
        shared.send_reserved(item);
    }
}

impl<T> Drop for Permit<'_, T> {
    fn drop(&mut self) {
        self.shared.release();
    }
}

impl<T> fmt::Debug for Permit<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit").finish_non_exhaustive()
    }
}

/// A reserved slot that owns its [`Sender`] (`'static`), from [`Sender::reserve_owned`].
///
/// As [`Permit`]; [`send`](OwnedPermit::send) gives the sender back, and dropping the
/// permit unused returns the slot and drops the sender.
#[must_use = "a permit holds a slot until it is used or dropped"]
pub struct OwnedPermit<T> {
    sender: Option<Sender<T>>,
}

impl<T> OwnedPermit<T> {
    pub(crate) fn new(sender: Sender<T>) -> OwnedPermit<T> {
        OwnedPermit {
            sender: Some(sender),
        }
    }

    /// Fill the reserved slot with `item`; returns the sender.
    pub fn send(mut self, item: T) -> Sender<T> {
        let sender = self.sender.take().expect("permit holds its sender");
        sender.shared().send_reserved(item);
        sender
    }

    /// Give the slot back without sending; returns the sender.
    pub fn release(mut self) -> Sender<T> {
        let sender = self.sender.take().expect("permit holds its sender");
        sender.shared().release();
        sender
    }
}

impl<T> Drop for OwnedPermit<T> {
    fn drop(&mut self) {
        if let Some(sender) = &self.sender {
            sender.shared().release();
        }
    }
}

impl<T> fmt::Debug for OwnedPermit<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedPermit").finish_non_exhaustive()
    }
}
