//! The waiting path: an acquisition that found no fast permit queues, polls its verdict,
//! and leaves the queue when it gives up.

use std::task::Context;

use crate::bulkhead::error::{AcquireError, Priority};
use crate::sync::{Arc, Cancelled, Deferred, Key, Status};

use super::moves::{Moves, publish_waiting};
use super::queue::{Decided, Verdict, Waiter, Waiters};
use super::{Core, Left, Polled, Ticket, WAITERS};

impl Core {
    /// Poll an acquisition that found no fast permit: take one, queue, or refuse. Unbounded
    /// acquisitions (the stream adapters' backpressure) skip the waiting room's size.
    pub(crate) fn poll_acquire(
        &self,
        cx: &mut Context<'_>,
        priority: Priority,
        bounded: bool,
        ticket: &mut Ticket,
    ) -> Polled {
        // Decided since it last looked: no lock to take.
        if let Some(verdict) = ticket.decided() {
            return self.polled(verdict);
        }
        // Declared before the lock: the wakers go after it is released.
        let mut out = Deferred::default();
        let mut moves = Moves::new(self);
        let mut w = self.lock();
        if let Some((priority, key, _)) = ticket.0 {
            return self.poll_queued(&mut w, cx, (priority, key), ticket, &mut out, &mut moves);
        }
        // Flag first, so releasers that race us come through the lock and see the queue.
        self.set_flag(WAITERS, true);
        if let Some(r) = self.try_locked(&w, priority, &mut moves) {
            if w.len() == 0 {
                self.set_flag(WAITERS, false);
            }
            return match r {
                Ok(()) => Polled::Acquired,
                Err(why) => Polled::Refused(why),
            };
        }
        // A full room sheds its newest normal waiter for critical work, never the
        // reverse (and never an adapter's waiter: adapters wait, they are not refused).
        if bounded
            && w.room() >= self.max_waiting
            && !(priority == Priority::Critical && w.shed_newest_normal(&mut out))
        {
            if w.len() == 0 {
                self.set_flag(WAITERS, false);
            }
            return Polled::Refused(moves.refuse(AcquireError::WaitingRoomFull));
        }
        let verdict = Arc::new(Verdict::default());
        let key = w.queue(priority).push_back(
            cx.waker(),
            Waiter {
                bounded,
                verdict: verdict.clone(),
            },
        );
        if !bounded {
            w.unbounded += 1;
        }
        ticket.0 = Some((priority, key, verdict));
        publish_waiting(&mut w, &mut moves);
        Polled::Pending
    }

    fn poll_queued(
        &self,
        w: &mut Waiters,
        cx: &mut Context<'_>,
        (priority, key): (Priority, Key),
        ticket: &mut Ticket,
        out: &mut Deferred,
        moves: &mut Moves<'_>,
    ) -> Polled {
        let q = w.queue(priority);
        match q.status(key) {
            Status::Waiting if !self.is_closed() => {
                q.refresh(key, cx.waker(), out);
                return Polled::Pending;
            }
            Status::Waiting => {
                // Closed, and not taken out yet: out now, refused below.
                if let Cancelled::Waiting(waiter) = q.cancel(key, out) {
                    w.left(&waiter);
                    self.settle(w, moves);
                }
            }
            // Out of the queue: decided between the look before the lock and the lock
            // (read again below), or taken out by the close.
            Status::Granted | Status::Gone => {}
        }
        match ticket.decided() {
            // Shed between the look before the lock and the lock: the refusal's metric is
            // recorded after the lock (a recorder is user code).
            Some(Decided::Shed) => Polled::Refused(moves.refuse(AcquireError::WaitingRoomFull)),
            Some(verdict) => self.polled(verdict),
            None => {
                // Closing removes every queued waiter; its next poll is refused.
                ticket.0 = None;
                Polled::Refused(moves.refuse(AcquireError::Closed))
            }
        }
    }

    /// What a waiter's verdict means to its poll (a refusal counted now; a permit by the
    /// waiter, once it recorded its wait).
    fn polled(&self, decided: Decided) -> Polled {
        match decided {
            Decided::Permit => Polled::Granted { reserve: false },
            Decided::ReservePermit => Polled::Granted { reserve: true },
            Decided::Shed => Polled::Refused(self.refuse(AcquireError::WaitingRoomFull)),
        }
    }

    /// A waiting acquisition gave up (dropped or timed out): what the queue had decided for
    /// it, if anything, since it last looked. Under the lock, so exactly one outcome wins:
    /// this leave, or the grant, shed or close that took it out of the queue first.
    pub(crate) fn leave(&self, ticket: &mut Ticket) -> Left {
        let Some((priority, key, verdict)) = ticket.0.take() else {
            return Left::Unqueued;
        };
        let left = |decided| match decided {
            Decided::Permit => Left::Permit { reserve: false },
            Decided::ReservePermit => Left::Permit { reserve: true },
            // Shed, and gone before it polled again: still a refusal.
            Decided::Shed => Left::Shed(self.refuse(AcquireError::WaitingRoomFull)),
        };
        // Decided already: no lock to take.
        if let Some(decided) = verdict.get() {
            return left(decided);
        }
        let mut out = Deferred::default();
        let mut moves = Moves::new(self);
        let mut w = self.lock();
        if let Cancelled::Waiting(waiter) = w.queue(priority).cancel(key, &mut out) {
            w.left(&waiter);
            self.settle(&mut w, &mut moves);
            return Left::Removed;
        }
        // Out of the queue before this lock: decided since the look above, or closed. A
        // shed's refusal goes through `moves`: its metric is recorded after the lock.
        match verdict.get() {
            None => Left::Closed,
            Some(Decided::Shed) => Left::Shed(moves.refuse(AcquireError::WaitingRoomFull)),
            Some(decided) => left(decided),
        }
    }
}
