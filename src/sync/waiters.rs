//! [`WaiterList`]: one FIFO list of waiting tasks, shared by every primitive that queues
//! (the bulkhead, the pacer, the channel).
//!
//! # Semantics
//!
//! A waiter is an entry with a waker and a value of the user's (its cost, its priority, a
//! verdict). It is known by the [`Key`] [`push_back`](WaiterList::push_back) or
//! [`register`](WaiterList::register) returns, which its future keeps. An entry is in one of
//! three states ([`Status`]):
//!
//! - **waiting**: linked in the FIFO list, with its waker;
//! - **granted**: taken out of the list and woken by [`grant`](WaiterList::grant) or
//!   [`grant_front`](WaiterList::grant_front); it keeps its value (what it was granted: a
//!   permit, a verdict) until its owner [`claim`](WaiterList::claim)s it or cancels;
//! - **gone**: the slot was freed (claimed, cancelled, popped, or the list woke everyone).
//!   A gone key is stale: every operation on it is a no-op that says so.
//!
//! [`cancel`](WaiterList::cancel) removes an entry in any state and says which state it was
//! in; `cancel_passing_on` (tests and loom models only) also hands the wake on: a
//! waiter that was granted (woken) and then gave up without claiming would otherwise
//! swallow that wake, so the next waiter is granted in its place.
//!
//! # Fairness
//!
//! Strict FIFO: [`push_back`](WaiterList::push_back) appends, the grant and pop operations
//! take the front. Refreshing a waiter's waker keeps its place. The users build their
//! policies on top (the bulkhead keeps one list per priority and sheds from the back; the
//! pacer steps over a stalled front).
//!
//! # Wakers and locks
//!
//! The list lives under its user's lock, so it never wakes or drops a waker itself: every
//! waker it gives up goes to the caller's [`Deferred`], woken (grant, pop) or only dropped
//! (replaced, cancelled) after the lock is released. A waker is cloned under the lock only
//! when it is new: neither the waker the stored clone was made from ([`WakerId`]) nor one
//! `will_wake` says is equivalent to the stored clone.
//!
//! # Complexity and memory
//!
//! Entries live in a slab (a `Vec` of slots with a free list) and are linked into the FIFO
//! list by slot index, in both directions. Every operation on one waiter (push, grant,
//! claim, cancel, refresh, status) is O(1); the walks ([`iter`](WaiterList::iter),
//! [`wake_all`](WaiterList::wake_all)) are linear in what they visit. Freed slots are reused
//! (the most recently freed first), so memory is bounded by the most waiters ever present
//! at once.
//!
//! # Stale keys (ABA)
//!
//! Each slot carries a generation, bumped every time the slot is freed, and a [`Key`] holds
//! the slot's index and generation. A stale key (its entry gone, its slot perhaps reused
//! for someone else) never matches a live entry, so it can never cancel, grant or claim
//! another waiter's entry. The generation is 64 bits: it does not wrap in practice.

use std::fmt;
use std::task::Waker;

use crate::sync::Deferred;

/// "No slot": the end of the FIFO list or of the free list.
const NIL: u32 = u32::MAX;

/// A waiter's handle: its slot and the slot's generation when it was registered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    index: u32,
    generation: u64,
}

/// Where a waiter stands (see the [module docs](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    /// In the FIFO list, with its waker.
    Waiting,
    /// Out of the list and woken, holding its value until claimed.
    Granted,
    /// Freed (or the key was never this list's): a stale key.
    Gone,
}

/// What [`WaiterList::cancel`] found, with the entry's value.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Cancelled<T> {
    /// It was waiting: it left the list; its waker is dropped after the lock.
    Waiting(T),
    /// It had been granted and not claimed: whatever it was granted is now the caller's to
    /// pass on (or `cancel_passing_on` did so).
    Granted(T),
    /// Nothing: the key was stale.
    Gone,
}

/// The addresses a waker is made of (its data and its vtable), to tell that a waiter is
/// polled with the very waker its stored one was cloned from. `will_wake` against the
/// stored clone cannot always say so: a clone may carry another vtable than the waker it was
/// cloned from (the waker of tokio's `block_on` does).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WakerId(usize, usize);

impl WakerId {
    #[inline]
    pub(crate) fn of(waker: &Waker) -> Self {
        WakerId(
            waker.data().addr(),
            std::ptr::from_ref(waker.vtable()).addr(),
        )
    }

    /// A clone of `waker` to store, and the id to keep with it: `waker`'s when the clone
    /// shares its data (which the clone then holds alive, so no other task's waker can take
    /// that address while it is stored), else the clone's own (as `will_wake` would).
    #[inline]
    pub(crate) fn store(waker: &Waker) -> (Waker, Self) {
        let clone = waker.clone();
        let id = if clone.data() == waker.data() {
            WakerId::of(waker)
        } else {
            WakerId::of(&clone)
        };
        (clone, id)
    }
}

enum Slot<T> {
    Free {
        next: u32,
    },
    Waiting {
        waker: Waker,
        /// The waker `waker` was cloned from (see [`WakerId::store`]).
        from: WakerId,
        value: T,
        prev: u32,
        next: u32,
    },
    Granted {
        value: T,
    },
}

struct Entry<T> {
    generation: u64,
    slot: Slot<T>,
}

/// Waiting tasks in FIFO order, with O(1) cancellation by [`Key`] (see the
/// [module docs](self)).
pub(crate) struct WaiterList<T> {
    entries: Vec<Entry<T>>,
    head: u32,
    tail: u32,
    /// The first free slot; free slots are chained through `Slot::Free::next`.
    free: u32,
    waiting: usize,
    granted: usize,
    /// Slots visited, for the tests that prove the operations O(1).
    #[cfg(test)]
    steps: std::cell::Cell<usize>,
}

impl<T> Default for WaiterList<T> {
    fn default() -> Self {
        WaiterList::new()
    }
}

impl<T> fmt::Debug for WaiterList<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WaiterList")
            .field("waiting", &self.waiting)
            .field("granted", &self.granted)
            .field("slots", &self.entries.len())
            .finish()
    }
}

impl<T> WaiterList<T> {
    /// An empty list; allocates nothing until the first waiter.
    pub(crate) const fn new() -> Self {
        WaiterList {
            entries: Vec::new(),
            head: NIL,
            tail: NIL,
            free: NIL,
            waiting: 0,
            granted: 0,
            #[cfg(test)]
            steps: std::cell::Cell::new(0),
        }
    }

    #[inline]
    fn step(&self) {
        #[cfg(test)]
        self.steps.set(self.steps.get() + 1);
    }

    /// Slots visited so far.
    #[cfg(test)]
    pub(crate) fn steps(&self) -> usize {
        self.steps.get()
    }

    /// How many waiters are waiting (in the FIFO list).
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.waiting
    }

    /// Whether nobody waits (granted entries not yet claimed do not count).
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.waiting == 0
    }

    /// How many entries were granted and are not yet claimed or cancelled.
    #[inline]
    pub(crate) fn granted(&self) -> usize {
        self.granted
    }

    /// The live entry of `key`, if the key is not stale.
    #[inline]
    fn entry(&self, key: Key) -> Option<&Slot<T>> {
        self.step();
        let e = self.entries.get(key.index as usize)?;
        (e.generation == key.generation && !matches!(e.slot, Slot::Free { .. })).then_some(&e.slot)
    }

    #[inline]
    fn entry_mut(&mut self, key: Key) -> Option<&mut Slot<T>> {
        self.step();
        let e = self.entries.get_mut(key.index as usize)?;
        (e.generation == key.generation && !matches!(e.slot, Slot::Free { .. }))
            .then_some(&mut e.slot)
    }

    #[inline]
    fn key_of(&self, index: u32) -> Option<Key> {
        (index != NIL).then(|| Key {
            index,
            generation: self.entries[index as usize].generation,
        })
    }

    /// Where `key` stands.
    #[inline]
    pub(crate) fn status(&self, key: Key) -> Status {
        match self.entry(key) {
            Some(Slot::Waiting { .. }) => Status::Waiting,
            Some(Slot::Granted { .. }) => Status::Granted,
            _ => Status::Gone,
        }
    }

    /// The value of a waiting or granted entry.
    #[inline]
    pub(crate) fn get(&self, key: Key) -> Option<&T> {
        match self.entry(key)? {
            Slot::Waiting { value, .. } | Slot::Granted { value } => Some(value),
            Slot::Free { .. } => None,
        }
    }

    /// The value of a waiting or granted entry, mutably.
    #[inline]
    pub(crate) fn get_mut(&mut self, key: Key) -> Option<&mut T> {
        match self.entry_mut(key)? {
            Slot::Waiting { value, .. } | Slot::Granted { value } => Some(value),
            Slot::Free { .. } => None,
        }
    }

    /// The first waiter.
    #[inline]
    pub(crate) fn front(&self) -> Option<Key> {
        self.key_of(self.head)
    }

    /// The last waiter.
    #[inline]
    pub(crate) fn back(&self) -> Option<Key> {
        self.key_of(self.tail)
    }

    /// The waiter before `key` in the list (towards the front); `None` at the front, or if
    /// `key` is not waiting.
    #[inline]
    pub(crate) fn prev(&self, key: Key) -> Option<Key> {
        match self.entry(key)? {
            Slot::Waiting { prev, .. } => self.key_of(*prev),
            _ => None,
        }
    }

    /// The waiters from front to back, with their values.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (Key, &T)> {
        let mut at = self.head;
        std::iter::from_fn(move || {
            let key = self.key_of(at)?;
            self.step();
            match &self.entries[at as usize].slot {
                Slot::Waiting { value, next, .. } => {
                    at = *next;
                    Some((key, value))
                }
                _ => unreachable!("only waiting entries are linked"),
            }
        })
    }

    /// A slot for `slot`: a freed one if any, else a new one.
    fn alloc(&mut self, slot: Slot<T>) -> u32 {
        self.step();
        if self.free != NIL {
            let index = self.free;
            let e = &mut self.entries[index as usize];
            match std::mem::replace(&mut e.slot, slot) {
                Slot::Free { next } => self.free = next,
                _ => unreachable!("the free list holds free slots"),
            }
            index
        } else {
            let index = u32::try_from(self.entries.len())
                .ok()
                .filter(|&i| i != NIL)
                .expect("fewer than 2^32 - 1 waiters at once");
            self.entries.push(Entry {
                generation: 0,
                slot,
            });
            index
        }
    }

    /// Free the slot `index` (its keys go stale) and return what it held.
    fn release(&mut self, index: u32) -> Slot<T> {
        self.step();
        let e = &mut self.entries[index as usize];
        e.generation += 1;
        let old = std::mem::replace(&mut e.slot, Slot::Free { next: self.free });
        self.free = index;
        old
    }

    /// Unlink the waiting entry `index` from the FIFO list (its slot still says waiting).
    fn unlink(&mut self, index: u32) {
        self.step();
        let Slot::Waiting { prev, next, .. } = self.entries[index as usize].slot else {
            unreachable!("only waiting entries are linked")
        };
        match prev {
            NIL => self.head = next,
            p => self.set_next(p, next),
        }
        match next {
            NIL => self.tail = prev,
            n => self.set_prev(n, prev),
        }
        self.waiting -= 1;
    }

    fn set_next(&mut self, index: u32, to: u32) {
        self.step();
        if let Slot::Waiting { next, .. } = &mut self.entries[index as usize].slot {
            *next = to;
        }
    }

    fn set_prev(&mut self, index: u32, to: u32) {
        self.step();
        if let Slot::Waiting { prev, .. } = &mut self.entries[index as usize].slot {
            *prev = to;
        }
    }

    /// Add a waiter at the back; its waker is cloned.
    pub(crate) fn push_back(&mut self, waker: &Waker, value: T) -> Key {
        let prev = self.tail;
        let (waker, from) = WakerId::store(waker);
        let index = self.alloc(Slot::Waiting {
            waker,
            from,
            value,
            prev,
            next: NIL,
        });
        match prev {
            NIL => self.head = index,
            p => self.set_next(p, index),
        }
        self.tail = index;
        self.waiting += 1;
        Key {
            index,
            generation: self.entries[index as usize].generation,
        }
    }

    /// Register the waiter whose key is in `key`: if it is waiting, refresh its waker (see
    /// [`refresh`](Self::refresh)); if it is granted, leave it as it is (it should claim);
    /// if it has no key or a stale one, add it at the back with `value()` and store its key.
    /// Returns its status afterwards (`Waiting` or `Granted`).
    pub(crate) fn register(
        &mut self,
        key: &mut Option<Key>,
        waker: &Waker,
        value: impl FnOnce() -> T,
        out: &mut Deferred,
    ) -> Status {
        if let Some(k) = *key {
            match self.status(k) {
                Status::Waiting => {
                    self.refresh(k, waker, out);
                    return Status::Waiting;
                }
                Status::Granted => return Status::Granted,
                Status::Gone => {}
            }
        }
        *key = Some(self.push_back(waker, value()));
        Status::Waiting
    }

    /// Store `waker` for a waiting entry, keeping its place: cloned only when it is not the
    /// waker the stored one was cloned from, nor one the stored one would wake the same task
    /// as (the old one goes to `out`, dropped after the lock). False if `key` is not waiting.
    ///
    /// The first check is the one that holds under tokio's `block_on` (a current-thread
    /// runtime, `#[tokio::main]`): its waker's clones carry another vtable than the waker
    /// itself, so `will_wake` against the stored clone is false on every poll, and each poll
    /// of a waiter still waiting would clone the waker under the lock and drop the old one.
    #[inline]
    pub(crate) fn refresh(&mut self, key: Key, waker: &Waker, out: &mut Deferred) -> bool {
        match self.entry_mut(key) {
            Some(Slot::Waiting { waker: w, from, .. }) => {
                if *from != WakerId::of(waker) && !w.will_wake(waker) {
                    let (clone, id) = WakerId::store(waker);
                    *from = id;
                    out.discard(std::mem::replace(w, clone));
                }
                true
            }
            _ => false,
        }
    }

    /// Wake a waiting entry (a clone of its waker goes to `out`) and leave it where it is.
    /// False if `key` is not waiting.
    #[inline]
    pub(crate) fn notify(&self, key: Key, out: &mut Deferred) -> bool {
        match self.entry(key) {
            Some(Slot::Waiting { waker, .. }) => {
                out.wake(waker.clone());
                true
            }
            _ => false,
        }
    }

    /// Grant a waiting entry: take it out of the list, keep its value, wake it (its waker
    /// goes to `out`). False if `key` is not waiting.
    pub(crate) fn grant(&mut self, key: Key, out: &mut Deferred) -> bool {
        if self.status(key) != Status::Waiting {
            return false;
        }
        self.unlink(key.index);
        let e = &mut self.entries[key.index as usize];
        let Slot::Waiting { waker, value, .. } =
            std::mem::replace(&mut e.slot, Slot::Free { next: NIL })
        else {
            unreachable!("checked waiting")
        };
        e.slot = Slot::Granted { value };
        self.granted += 1;
        out.wake(waker);
        true
    }

    /// Grant the first waiter (see [`grant`](Self::grant)), if any.
    pub(crate) fn grant_front(&mut self, out: &mut Deferred) -> Option<Key> {
        let key = self.front()?;
        self.grant(key, out);
        Some(key)
    }

    /// Claim a granted entry: free it and return its value. `None` if it is not granted.
    pub(crate) fn claim(&mut self, key: Key) -> Option<T> {
        if self.status(key) != Status::Granted {
            return None;
        }
        self.granted -= 1;
        match self.release(key.index) {
            Slot::Granted { value } => Some(value),
            _ => unreachable!("checked granted"),
        }
    }

    /// Take the first waiter out and free it (its key goes stale), waking it (through
    /// `out`); its key and value.
    #[inline]
    pub(crate) fn wake_front(&mut self, out: &mut Deferred) -> Option<(Key, T)> {
        let key = self.front()?;
        Some((key, self.take_waking(key.index, out)))
    }

    /// Take a waiting entry out of the list and free it (its key goes stale), waking it
    /// (through `out`); its value. `None` if `key` is not waiting. For a user that tells the
    /// waiter what it was woken for by other means than a granted entry (the bulkhead's
    /// verdicts), so that the waiter need not take the lock again to claim it.
    pub(crate) fn wake(&mut self, key: Key, out: &mut Deferred) -> Option<T> {
        (self.status(key) == Status::Waiting).then(|| self.take_waking(key.index, out))
    }

    /// Unlink and free the waiting entry `index`, waking it (through `out`); its value.
    #[inline]
    fn take_waking(&mut self, index: u32, out: &mut Deferred) -> T {
        self.unlink(index);
        match self.release(index) {
            Slot::Waiting { waker, value, .. } => {
                out.wake(waker);
                value
            }
            _ => unreachable!("only waiting entries are linked"),
        }
    }

    /// Pop and wake every waiter (through `out`); granted entries stay granted.
    pub(crate) fn wake_all(&mut self, out: &mut Deferred) {
        while self.wake_front(out).is_some() {}
    }

    /// Remove `key` whatever its state, freeing its slot (a waiting entry's waker goes to
    /// `out`, to be dropped after the lock), and say what it was.
    pub(crate) fn cancel(&mut self, key: Key, out: &mut Deferred) -> Cancelled<T> {
        match self.status(key) {
            Status::Gone => Cancelled::Gone,
            Status::Granted => {
                self.granted -= 1;
                match self.release(key.index) {
                    Slot::Granted { value } => Cancelled::Granted(value),
                    _ => unreachable!("checked granted"),
                }
            }
            Status::Waiting => {
                self.unlink(key.index);
                match self.release(key.index) {
                    Slot::Waiting { waker, value, .. } => {
                        out.discard(waker);
                        Cancelled::Waiting(value)
                    }
                    _ => unreachable!("checked waiting"),
                }
            }
        }
    }

    /// [`cancel`](Self::cancel), and if the entry had been granted (woken) but not claimed,
    /// grant the next waiter in its place, so the wake is not lost. Also returns the key of
    /// the waiter granted in its place: `None` with `Cancelled::Granted` means nobody was
    /// waiting, and what was granted is the caller's to put back.
    /// (No primitive needs it: each passes a given-up grant on through its own count. The
    /// unit tests and the loom models of the list use it.)
    #[cfg(any(test, flowgate_loom))]
    pub(crate) fn cancel_passing_on(
        &mut self,
        key: Key,
        out: &mut Deferred,
    ) -> (Cancelled<T>, Option<Key>) {
        let cancelled = self.cancel(key, out);
        let next = match cancelled {
            Cancelled::Granted(_) => self.grant_front(out),
            _ => None,
        };
        (cancelled, next)
    }
}

#[cfg(test)]
mod tests;

/// The list against a model (a `VecDeque` of the waiting values and the state of every key
/// ever handed out): FIFO order, statuses of live and stale keys after slots are reused,
/// the granted count, and exactly one wake per grant, pop and notify.
#[cfg(test)]
mod model_tests;
