//! The items' ring: a lock-free bounded queue (`concurrent-queue`, the queue async-channel
//! is built on).
//!
//! Under `--cfg flowgate_loom` the ring is a `Mutex<VecDeque>` of loom's with the same
//! API (the queue's own atomics are not loom-aware), so the loom models explore every
//! interleaving of the channel's protocol around it.

#[cfg(flowgate_loom)]
use crate::sync::Mutex;
#[cfg(flowgate_loom)]
use std::collections::VecDeque;

/// Capacities up to this get a preallocated array; larger ones a queue of linked blocks
/// (the channel's slot count bounds it just the same).
#[cfg(not(flowgate_loom))]
const PREALLOCATED: usize = 4096;

/// A multi-producer, multi-consumer FIFO queue of items. The channel bounds it: an item is
/// pushed only into a slot claimed for it, so a push never finds the ring full for good.
pub(crate) struct Ring<T> {
    #[cfg(not(flowgate_loom))]
    queue: concurrent_queue::ConcurrentQueue<T>,
    #[cfg(flowgate_loom)]
    queue: Mutex<VecDeque<T>>,
}

impl<T> Ring<T> {
    /// A ring for at most `capacity` items.
    pub(crate) fn new(capacity: usize) -> Ring<T> {
        #[cfg(not(flowgate_loom))]
        let queue = if capacity <= PREALLOCATED {
            concurrent_queue::ConcurrentQueue::bounded(capacity)
        } else {
            concurrent_queue::ConcurrentQueue::unbounded()
        };
        #[cfg(flowgate_loom)]
        let queue = Mutex::new(VecDeque::with_capacity(capacity.min(64)));
        Ring { queue }
    }

    /// Append `item` into a slot claimed for it.
    ///
    /// The claim makes room: the items in the ring never outnumber the claimed slots. The
    /// array's cell for this push may still be in the hands of a pop that has not finished
    /// (pops of different receivers finish out of order); then the push retries until that
    /// pop is done, which takes a few instructions.
    #[cfg(not(flowgate_loom))]
    #[inline]
    pub(crate) fn push(&self, mut item: T) {
        let mut spins = 0u32;
        loop {
            match self.queue.push(item) {
                Ok(()) => return,
                Err(e) => item = e.into_inner(),
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    #[cfg(flowgate_loom)]
    pub(crate) fn push(&self, item: T) {
        self.queue.lock().unwrap().push_back(item);
    }

    /// Take the oldest item.
    #[inline]
    pub(crate) fn pop(&self) -> Option<T> {
        #[cfg(not(flowgate_loom))]
        return self.queue.pop().ok();
        #[cfg(flowgate_loom)]
        return self.queue.lock().unwrap().pop_front();
    }

    /// How many items are in the ring (pushes under way included).
    #[inline]
    pub(crate) fn len(&self) -> usize {
        #[cfg(not(flowgate_loom))]
        return self.queue.len();
        #[cfg(flowgate_loom)]
        return self.queue.lock().unwrap().len();
    }
}
