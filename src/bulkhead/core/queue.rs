//! The wait queues: one list per priority, each waiter's entry and verdict, and the ticket
//! an acquisition keeps while it waits.

use crate::bulkhead::error::Priority;
use crate::sync::{Arc, AtomicUsize, Deferred, Key, Ordering, WaiterList};

/// A waiter's entry: what it is, and where its verdict goes.
pub(super) struct Waiter {
    /// A waiting-room waiter (`true`), or a stream adapter's (outside the room, never shed).
    pub(super) bounded: bool,
    pub(super) verdict: Arc<Verdict>,
}

/// What the queue decided for a waiter, shared by its entry and its [`Ticket`]: written
/// under the lock as the entry leaves the queue, before the waiter is woken; read by the
/// waiter without the lock (a verdict, once written, never changes). An entry that left
/// the queue with its verdict still undecided was taken out by the close.
#[derive(Debug, Default)]
pub(crate) struct Verdict(AtomicUsize);

/// A verdict decided (undecided is 0 in a [`Verdict`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Decided {
    /// A permit, counted in flight in the waiter's name: the waiter owns it.
    Permit = 1,
    /// Shed for critical work: a refusal, counted when the waiter sees it.
    Shed = 2,
    /// A permit of the critical reserve (one normal work could not have taken): a
    /// `Permit`, counted in the stats' `admitted_from_reserve` too.
    ReservePermit = 3,
}

impl Verdict {
    pub(super) fn set(&self, decided: Decided) {
        self.0.store(decided as usize, Ordering::Release);
    }

    pub(super) fn get(&self) -> Option<Decided> {
        match self.0.load(Ordering::Acquire) {
            1 => Some(Decided::Permit),
            2 => Some(Decided::Shed),
            3 => Some(Decided::ReservePermit),
            _ => None,
        }
    }
}

/// The queues, one [`WaiterList`] per priority. A permit freed goes to the front of the
/// critical queue, else of the normal one; it is counted in flight in the waiter's name and
/// the waiter is *granted*: taken out of the queue, its verdict set to a permit, woken. A
/// shed waiter is taken out the same way with a refusal. Every operation on one waiter is
/// O(1), by its key.
#[derive(Default)]
pub(super) struct Waiters {
    pub(super) critical: WaiterList<Waiter>,
    pub(super) normal: WaiterList<Waiter>,
    /// Queued waiters of the stream adapters (normal priority): outside the waiting room.
    pub(super) unbounded: usize,
    /// Stream adapters that wait for their own work to end (every permit in flight is
    /// theirs, or they keep as many outputs as the limit) or for their upstream (see
    /// [`Core::park`](super::Core::park)): not waiters. Closing the bulkhead wakes them all
    /// (and empties the list); the limit growing wakes those whose entry says so (`true`:
    /// the former), which keep their places.
    pub(super) parked: WaiterList<bool>,
    /// The length last added to the `waiting` gauge (see [`Moves`](super::moves::Moves)).
    pub(super) published: usize,
}

impl Waiters {
    pub(super) fn len(&self) -> usize {
        self.critical.len() + self.normal.len()
    }

    /// Waiters in the waiting room (the adapters' waiters do not count).
    pub(super) fn room(&self) -> usize {
        self.len() - self.unbounded
    }

    pub(super) fn queue(&mut self, priority: Priority) -> &mut WaiterList<Waiter> {
        match priority {
            Priority::Critical => &mut self.critical,
            Priority::Normal => &mut self.normal,
        }
    }

    /// The queued waiter with this entry left the queue (granted, removed or shed).
    pub(super) fn left(&mut self, waiter: &Waiter) {
        if !waiter.bounded {
            self.unbounded -= 1;
        }
    }

    /// Sheds the newest normal waiter in the waiting room, for a critical one: it is granted
    /// a refusal (woken through `out`). Walks back over the adapters' waiters queued after
    /// it, never over the room's.
    pub(super) fn shed_newest_normal(&mut self, out: &mut Deferred) -> bool {
        let mut at = self.normal.back();
        while let Some(key) = at {
            if self.normal.get(key).is_some_and(|w| w.bounded) {
                return match self.normal.wake(key, out) {
                    Some(waiter) => {
                        waiter.verdict.set(Decided::Shed);
                        true
                    }
                    None => false,
                };
            }
            at = self.normal.prev(key);
        }
        false
    }

    /// Grant the front of `priority`'s queue (`reserve`: a permit of the critical reserve).
    pub(super) fn grant_front(&mut self, priority: Priority, reserve: bool, out: &mut Deferred) {
        let Some((_, waiter)) = self.queue(priority).wake_front(out) else {
            return;
        };
        waiter.verdict.set(if reserve {
            Decided::ReservePermit
        } else {
            Decided::Permit
        });
        self.left(&waiter);
    }
}

/// A waiting acquisition's place in the queue: its priority's list, its key there, and its
/// verdict. Kept until the acquisition has seen its verdict (or left the queue).
#[derive(Debug, Default)]
pub(crate) struct Ticket(pub(super) Option<(Priority, Key, Arc<Verdict>)>);

impl Ticket {
    /// Whether it holds a place in the queue (waiting, or decided and not seen yet).
    pub(crate) fn is_queued(&self) -> bool {
        self.0.is_some()
    }

    /// The verdict, if the queue decided one (read without the lock); the ticket is then
    /// spent.
    pub(super) fn decided(&mut self) -> Option<Decided> {
        let decided = self.0.as_ref()?.2.get()?;
        self.0 = None;
        Some(decided)
    }
}
