//! The items' ring: a lock-free queue that senders push into without the lock, and
//! receivers pop from under it.
//!
//! A channel of up to [`PREALLOCATED`] items gets a [`Tickets`] ring: an array whose
//! positions senders take by `fetch_add` on the tail, a *ticket*, so a push never retries,
//! however many senders contend (a compare-and-swap loop on the tail, as in a general
//! bounded queue, retries once per sender that got there first). That works because the
//! channel's claim comes first: a sender pushes only into a slot it claimed on the channel's
//! count, so the ticket's cell is always free, or about to be (see [`Tickets::push`]). Larger
//! channels get `concurrent-queue`'s queue of linked blocks (the queue async-channel is built
//! on), so their memory follows the items queued, not the capacity.
//!
//! Under `--cfg flowgate_loom` every channel gets a [`Tickets`] ring, built on loom's atomics
//! and cells, so the channel's loom models explore the ring's interleavings too.

use std::mem::MaybeUninit;

use crate::channel::shared::Line;
use crate::sync::{AtomicUsize, Ordering};

#[cfg(flowgate_loom)]
use loom::cell::UnsafeCell;

/// Capacities up to this get a preallocated [`Tickets`] ring; larger ones a queue of linked
/// blocks (the channel's slot count bounds it just the same).
#[cfg(not(flowgate_loom))]
const PREALLOCATED: usize = 4096;

/// A multi-producer FIFO queue of items; pops are serialized by the channel's lock. The
/// channel bounds it: an item is pushed only into a slot claimed for it, so a push never
/// finds the ring full for good.
pub(crate) struct Ring<T> {
    inner: Inner<T>,
}

enum Inner<T> {
    Tickets(Tickets<T>),
    #[cfg(not(flowgate_loom))]
    Blocks(concurrent_queue::ConcurrentQueue<T>),
}

/// The right to pop from one ring: there is one per ring, it cannot be cloned, and a pop
/// takes it by `&mut`, so pops are serialized by the borrow rules (the channel keeps it in
/// its locked state). It names its ring by the address of the ring's array.
#[derive(Debug)]
pub(crate) struct Popper {
    ring: usize,
}

impl<T> Ring<T> {
    /// A ring for at most `capacity` items, and the one [`Popper`] of it.
    pub(crate) fn new(capacity: usize) -> (Ring<T>, Popper) {
        #[cfg(not(flowgate_loom))]
        if capacity > PREALLOCATED {
            let ring = Ring {
                inner: Inner::Blocks(concurrent_queue::ConcurrentQueue::unbounded()),
            };
            return (ring, Popper { ring: 0 });
        }
        let tickets = Tickets::new(capacity);
        let popper = Popper {
            ring: tickets.address(),
        };
        let ring = Ring {
            inner: Inner::Tickets(tickets),
        };
        (ring, popper)
    }

    /// Append `item` into a slot claimed for it.
    #[inline]
    pub(crate) fn push(&self, item: T) {
        match &self.inner {
            Inner::Tickets(ring) => ring.push(item),
            // Unbounded: a push always succeeds.
            #[cfg(not(flowgate_loom))]
            Inner::Blocks(queue) => drop(queue.push(item)),
        }
    }

    /// Take the oldest item; `None` when no ticket taken since the last pop is in sight yet
    /// (a push that has taken its ticket is waited for: a few instructions).
    ///
    /// # Panics
    ///
    /// If `popper` is another ring's (a bug in the channel).
    #[inline]
    pub(crate) fn pop(&self, popper: &mut Popper) -> Option<T> {
        match &self.inner {
            Inner::Tickets(ring) => {
                assert_eq!(popper.ring, ring.address(), "another ring's popper");
                // SAFETY: `popper` is this ring's one popper, borrowed exclusively: no other
                // pop runs.
                unsafe { ring.pop() }
            }
            #[cfg(not(flowgate_loom))]
            Inner::Blocks(queue) => queue.pop().ok(),
        }
    }

    /// How many items are in the ring (pushes under way included).
    #[inline]
    pub(crate) fn len(&self) -> usize {
        match &self.inner {
            Inner::Tickets(ring) => ring.len(),
            #[cfg(not(flowgate_loom))]
            Inner::Blocks(queue) => queue.len(),
        }
    }
}

/// One cell of a [`Tickets`] ring.
struct Slot<T> {
    /// The position the cell is ready for: `pos` while it waits for the push of ticket
    /// `pos`, `pos + 1` once that item is in it, `pos + len` once it is popped (free for the
    /// next lap).
    stamp: AtomicUsize,
    item: UnsafeCell<MaybeUninit<T>>,
}

/// A ring whose pushes take positions by ticket (`fetch_add` on `tail`) and whose pops,
/// serialized by the channel's lock, advance `head`. Positions index the array modulo its
/// length, a power of two of at least two cells; they wrap around `usize` safely (all their
/// arithmetic wraps, and the length divides `2^usize::BITS`).
///
/// A cell's stamp says which ticket it waits for (`k`), or holds (`k + 1`), and the two never
/// coincide because there are at least two cells: a push of ticket `k + 1` cannot mistake
/// the cell holding ticket `k` for free. So even a push without a claim (a bug in the
/// channel) could only wait, never overwrite an item.
struct Tickets<T> {
    /// The next ticket: written by every push.
    tail: Line<AtomicUsize>,
    /// The next position to pop: written by the (serialized) pops, read by `len`.
    head: Line<AtomicUsize>,
    /// The cells, on a line of their own: read by every push and pop, written by none, so
    /// no write elsewhere in the channel evicts them.
    cells: Line<Cells<T>>,
}

/// The array of a [`Tickets`] ring.
struct Cells<T> {
    slots: Box<[Slot<T>]>,
    /// `slots.len() - 1`.
    mask: usize,
}

// SAFETY: items move in and out whole, by value, from any thread; every access to a cell is
// ordered by its stamp (a push writes a cell only once its stamp says it is free for its
// ticket, a pop reads it only once its stamp says it holds that ticket; with two cells or
// more the two states never share a stamp value).
unsafe impl<T: Send> Send for Tickets<T> {}
unsafe impl<T: Send> Sync for Tickets<T> {}

impl<T> Tickets<T> {
    fn new(capacity: usize) -> Tickets<T> {
        // Two cells at least: with one, "holds ticket k" and "free for ticket k + 1" would be
        // the same stamp.
        let len = capacity.max(2).next_power_of_two();
        let slots = (0..len)
            .map(|pos| Slot {
                stamp: AtomicUsize::new(pos),
                item: UnsafeCell::new(MaybeUninit::uninit()),
            })
            .collect();
        Tickets {
            tail: Line(AtomicUsize::new(0)),
            head: Line(AtomicUsize::new(0)),
            cells: Line(Cells {
                slots,
                mask: len - 1,
            }),
        }
    }

    /// A ring whose first ticket is `start` instead of 0, as if `start` items had passed
    /// through it: for the tests of positions wrapping around `usize`.
    #[cfg(all(test, not(flowgate_loom)))]
    fn starting_at(capacity: usize, start: usize) -> Tickets<T> {
        let ring = Tickets::new(capacity);
        for k in 0..ring.cells.slots.len() {
            let pos = start.wrapping_add(k);
            ring.cell(pos).stamp.store(pos, Ordering::Relaxed);
        }
        ring.tail.store(start, Ordering::Relaxed);
        ring.head.store(start, Ordering::Relaxed);
        ring
    }

    /// The cell of position `pos`.
    #[inline]
    fn cell(&self, pos: usize) -> &Slot<T> {
        &self.cells.slots[pos & self.cells.mask]
    }

    /// The address of the array, which names the ring (it does not move with the ring).
    fn address(&self) -> usize {
        self.cells.slots.as_ptr() as usize
    }

    /// Push into the cell of the next ticket.
    ///
    /// The cell is free, or about to be: the channel's claim means at most `capacity <=
    /// slots` items are queued or on their way, this one included, so the item that had this
    /// cell a lap ago (`slots` tickets earlier) was popped before this ticket was taken. The
    /// pop's stamp may still be on its way to this core; then the push waits for it.
    #[inline]
    fn push(&self, item: T) {
        let pos = self.tail.fetch_add(1, Ordering::Relaxed);
        let slot = self.cell(pos);
        wait_for(|| slot.stamp.load(Ordering::Acquire) == pos);
        // SAFETY: the stamp says the cell is free and this ticket's alone.
        slot.item.with_mut(|cell| unsafe { (*cell).write(item) });
        slot.stamp.store(pos.wrapping_add(1), Ordering::Release);
    }

    /// Pop the item at the head, waiting for its push if the ticket is taken but the item
    /// not written yet (a sender between two instructions; the receiver would otherwise
    /// report an item it cannot hand out).
    ///
    /// # Safety
    ///
    /// Pops are serialized.
    #[inline]
    unsafe fn pop(&self) -> Option<T> {
        let head = self.head.load(Ordering::Relaxed);
        let slot = self.cell(head);
        let full = head.wrapping_add(1);
        // The cell first: when it holds the item, the tail (the line every push writes) is
        // not read at all. Otherwise the tail tells an empty ring from a push under way.
        if slot.stamp.load(Ordering::Acquire) != full {
            if self.tail.load(Ordering::Acquire) == head {
                return None;
            }
            wait_for(|| slot.stamp.load(Ordering::Acquire) == full);
        }
        // SAFETY: the stamp says the cell holds the item of ticket `head`, and only this
        // (serialized) pop takes it.
        let item = slot.item.with(|cell| unsafe { (*cell).assume_init_read() });
        slot.stamp
            .store(head.wrapping_add(self.cells.slots.len()), Ordering::Release);
        self.head.store(full, Ordering::Release);
        Some(item)
    }

    /// Tickets taken and not popped. The head is read first: a pop stores it (`Release`)
    /// only after its `Acquire` load saw the stamp the push of that ticket stored after
    /// taking the ticket, so the tail read after it is never behind it. (The pop reads the
    /// tail only when the stamp is not there yet.)
    #[inline]
    fn len(&self) -> usize {
        let head = self.head.load(Ordering::Acquire);
        self.tail.load(Ordering::Acquire).wrapping_sub(head)
    }

    /// Drop the items between head and tail, advancing the head past each before dropping
    /// it.
    ///
    /// # Safety
    ///
    /// No push or pop is under way, nor can start: only `Drop` calls this.
    unsafe fn drop_rest(&self) {
        let tail = self.tail.load(Ordering::Relaxed);
        loop {
            let pos = self.head.load(Ordering::Relaxed);
            if pos == tail {
                return;
            }
            self.head.store(pos.wrapping_add(1), Ordering::Relaxed);
            let slot = self.cell(pos);
            // SAFETY: ticket `pos` was pushed (a push cannot stop between its ticket and its
            // stamp) and not popped, and the head is past it already: it is dropped once.
            slot.item
                .with_mut(|cell| unsafe { (*cell).assume_init_drop() });
        }
    }
}

impl<T> Drop for Tickets<T> {
    fn drop(&mut self) {
        /// Drops the rest if an item's drop panics, as std's collections do (a second panic
        /// aborts).
        struct Rest<'a, T>(&'a Tickets<T>);
        impl<T> Drop for Rest<'_, T> {
            fn drop(&mut self) {
                // SAFETY: as below.
                unsafe { self.0.drop_rest() }
            }
        }
        let rest = Rest(self);
        // SAFETY: `&mut self`: nothing else reaches the ring.
        unsafe { rest.0.drop_rest() };
        std::mem::forget(rest);
    }
}

/// Wait until `ready()`: spin briefly, then yield the thread. Only a sender or receiver
/// preempted between two of its instructions makes the other side wait at all.
#[inline]
fn wait_for(ready: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !ready() {
        #[cfg(flowgate_loom)]
        loom::thread::yield_now();
        #[cfg(not(flowgate_loom))]
        if spins < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
        spins = spins.saturating_add(1);
    }
}

/// `std`'s cell with loom's closure API, so the ring is written once for both.
#[cfg(not(flowgate_loom))]
struct UnsafeCell<V>(std::cell::UnsafeCell<V>);

#[cfg(not(flowgate_loom))]
impl<V> UnsafeCell<V> {
    fn new(value: V) -> UnsafeCell<V> {
        UnsafeCell(std::cell::UnsafeCell::new(value))
    }

    #[inline]
    fn with<R>(&self, f: impl FnOnce(*const V) -> R) -> R {
        f(self.0.get())
    }

    #[inline]
    fn with_mut<R>(&self, f: impl FnOnce(*mut V) -> R) -> R {
        f(self.0.get())
    }
}

// Run under miri too (`cargo +nightly miri test --lib channel::ring`): every cell access
// and drop of the ring, with heap items, so a read of an uninitialized cell, a double drop
// or a leak fails.
#[cfg(all(test, not(flowgate_loom)))]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// Items a test pushes: more under a plain run, fewer under miri (it is slow).
    const ITEMS: usize = if cfg!(miri) { 40 } else { 20_000 };

    #[test]
    fn items_come_out_in_order_lap_after_lap() {
        // Capacity 3 rounds up to 4 cells: positions wrap many times.
        let (ring, mut popper) = Ring::<String>::new(3);
        let mut next = 0;
        for i in 0..ITEMS {
            ring.push(i.to_string());
            if ring.len() == 3 || i + 1 == ITEMS {
                while let Some(item) = ring.pop(&mut popper) {
                    assert_eq!(item, next.to_string());
                    next += 1;
                }
                assert_eq!(ring.len(), 0);
            }
        }
        assert_eq!(next, ITEMS);
    }

    /// Positions wrap around `usize`: a ring whose tickets pass `usize::MAX` (two laps on
    /// each side of it) keeps its items in order, its length right, and drops what is left
    /// once.
    #[test]
    fn tickets_wrap_around_the_end_of_usize() {
        for capacity in [1, 3, 4] {
            let ring = Tickets::<String>::starting_at(capacity, usize::MAX - 9);
            let mut next = 0;
            for i in 0..20 {
                ring.push(i.to_string());
                if ring.len() == capacity {
                    // SAFETY: one thread, pops one at a time.
                    while let Some(item) = unsafe { ring.pop() } {
                        assert_eq!(item, next.to_string());
                        next += 1;
                    }
                    assert_eq!(ring.len(), 0);
                }
            }
            assert_eq!(ring.len(), 20 - next);
            let left = Arc::new(());
            let ring = Tickets::starting_at(capacity, usize::MAX);
            for _ in 0..capacity {
                ring.push(left.clone());
            }
            assert_eq!(
                (ring.len(), Arc::strong_count(&left)),
                (capacity, capacity + 1)
            );
            drop(ring);
            assert_eq!(Arc::strong_count(&left), 1);
        }
    }

    #[test]
    fn dropping_the_ring_drops_what_is_left_once() {
        let item = Arc::new(());
        for capacity in [4, PREALLOCATED + 1] {
            let (ring, mut popper) = Ring::new(capacity);
            for _ in 0..4 {
                ring.push(item.clone());
            }
            drop(ring.pop(&mut popper));
            assert_eq!(Arc::strong_count(&item), 4);
            drop(ring);
            assert_eq!(Arc::strong_count(&item), 1);
        }
    }

    /// A ring for one item still has two cells: a second push without a pop (which the
    /// channel's claim rules out) lands in the other cell instead of overwriting the first
    /// item, whose stamp would otherwise read as free for it.
    #[test]
    fn a_ring_for_one_item_never_overwrites_it() {
        let (ring, mut popper) = Ring::<String>::new(1);
        ring.push("a".into());
        ring.push("b".into());
        assert_eq!(ring.len(), 2);
        // Before the fix the second pop waited forever for a stamp the overwrite had moved
        // past: look for it from another thread, with a deadline.
        let ring = Arc::new(ring);
        let (tx, rx) = std::sync::mpsc::channel();
        let popping = ring.clone();
        std::thread::spawn(move || {
            let got = [popping.pop(&mut popper), popping.pop(&mut popper)];
            tx.send(got).ok();
        });
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("both items pop");
        assert_eq!(got, [Some("a".to_string()), Some("b".to_string())]);
    }

    /// An item whose drop panics does not leak the items after it.
    #[test]
    fn a_panicking_item_drop_still_drops_the_rest() {
        struct Item(Arc<AtomicUsize>, bool);
        impl Drop for Item {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::Relaxed);
                if self.1 {
                    panic!("an item's drop panics");
                }
            }
        }
        let dropped = Arc::new(AtomicUsize::new(0));
        let (ring, _) = Ring::new(4);
        for panics in [true, false, false] {
            ring.push(Item(dropped.clone(), panics));
        }
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(ring)));
        assert!(unwound.is_err());
        assert_eq!(dropped.load(Ordering::Relaxed), 3);
    }

    #[test]
    #[should_panic(expected = "another ring's popper")]
    fn a_popper_pops_only_its_own_ring() {
        let (ring, _) = Ring::<u8>::new(2);
        let (_, mut other) = Ring::<u8>::new(2);
        ring.push(1);
        ring.pop(&mut other);
    }

    /// Senders that claim a slot on a count (as the channel's `state` does) before they
    /// push, and a receiver that frees the slot after its pop: every item arrives once, each
    /// sender's in order, and the count never lets a ticket find its cell taken for good.
    #[test]
    fn claimed_pushes_from_several_threads_arrive_once_in_order() {
        const SENDERS: usize = 3;
        for capacity in [1, 2, 5, PREALLOCATED + 1] {
            let (ring, popper) = Ring::<Box<(usize, usize)>>::new(capacity);
            let ring = Arc::new(ring);
            let popper = Mutex::new(popper);
            let occupied = AtomicUsize::new(0);
            std::thread::scope(|s| {
                for sender in 0..SENDERS {
                    let (ring, occupied) = (&ring, &occupied);
                    s.spawn(move || {
                        for seq in 0..ITEMS / SENDERS {
                            while occupied
                                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                                    (n < capacity).then_some(n + 1)
                                })
                                .is_err()
                            {
                                std::thread::yield_now();
                            }
                            ring.push(Box::new((sender, seq)));
                        }
                    });
                }
                let mut next = [0; SENDERS];
                let mut got = 0;
                while got < ITEMS / SENDERS * SENDERS {
                    match ring.pop(&mut popper.lock().unwrap()) {
                        Some(item) => {
                            let (sender, seq) = *item;
                            assert_eq!(seq, next[sender], "sender {sender} out of order");
                            next[sender] += 1;
                            got += 1;
                            occupied.fetch_sub(1, Ordering::AcqRel);
                        }
                        None => std::thread::yield_now(),
                    }
                }
            });
            assert_eq!(ring.len(), 0);
            assert_eq!(ring.pop(&mut popper.lock().unwrap()), None);
        }
    }
}
