//! loom models of [`WaiterList`](crate::sync::WaiterList), run from `tests/loom/waiters.rs`
//! (the list is crate-private, so the models live here and the test binary calls them).
//!
//! The models build the smallest user of the list, a semaphore: permits are granted to
//! waiters in FIFO order under the mutex, wakers are woken after it is released, and a
//! waiter that gives up after being granted passes the permit on.

use std::future::Future;
use std::pin::{Pin, pin};
use std::task::{Context, Poll};

use futures::poll;
use loom::future::block_on;
use loom::thread;

use crate::sync::{Arc, Cancelled, Deferred, Key, Mutex, Status, WaiterList};

struct Sem {
    st: Mutex<(usize, WaiterList<()>)>,
    /// The ids of the acquisitions, in the order they joined the list, and in the order they
    /// got their permit (for the FIFO model).
    log: Mutex<(Vec<usize>, Vec<usize>)>,
}

impl Sem {
    fn new(permits: usize) -> Arc<Sem> {
        Arc::new(Sem {
            st: Mutex::new((permits, WaiterList::new())),
            log: Mutex::new((Vec::new(), Vec::new())),
        })
    }

    fn acquire(&self) -> Acquire<'_> {
        self.acquire_as(0)
    }

    /// An acquisition logged under `id`.
    fn acquire_as(&self, id: usize) -> Acquire<'_> {
        Acquire {
            sem: self,
            key: None,
            id,
        }
    }

    fn release(&self) {
        let mut out = Deferred::default();
        let mut st = self.st.lock().unwrap();
        if st.1.grant_front(&mut out).is_none() {
            st.0 += 1;
        }
    }

    /// Permits free and entries still in the list (waiting or granted).
    fn settled(&self) -> (usize, usize, usize) {
        let st = self.st.lock().unwrap();
        (st.0, st.1.len(), st.1.granted())
    }
}

struct Acquire<'a> {
    sem: &'a Sem,
    key: Option<Key>,
    id: usize,
}

impl Future for Acquire<'_> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut out = Deferred::default();
        let mut guard = self.sem.st.lock().unwrap();
        let (permits, list) = &mut *guard;
        if let Some(key) = self.key {
            return match list.register(&mut self.key, cx.waker(), || (), &mut out) {
                Status::Granted => {
                    list.claim(key).expect("granted");
                    self.key = None;
                    // Logged under the lock the permit was claimed under, so the log has
                    // the order in which the permit went round.
                    self.sem.log.lock().unwrap().1.push(self.id);
                    Poll::Ready(())
                }
                _ => Poll::Pending,
            };
        }
        if *permits > 0 && list.is_empty() {
            *permits -= 1;
            self.sem.log.lock().unwrap().1.push(self.id);
            return Poll::Ready(());
        }
        self.key = Some(list.push_back(cx.waker(), ()));
        self.sem.log.lock().unwrap().0.push(self.id);
        Poll::Pending
    }
}

impl Drop for Acquire<'_> {
    fn drop(&mut self) {
        let Some(key) = self.key.take() else { return };
        let mut out = Deferred::default();
        let mut st = self.sem.st.lock().unwrap();
        if let (Cancelled::Granted(()), None) = st.1.cancel_passing_on(key, &mut out) {
            st.0 += 1;
        }
    }
}

/// One permit, held; a waiter that waits it out, one that polls once and gives up, and the
/// holder releasing: the permit ends free, the list empty, nobody hangs (a lost wake would
/// leave the first waiter parked forever, which loom reports).
pub fn grant_races_cancel() {
    loom::model(|| {
        let sem = Sem::new(0);
        let (s1, s2) = (sem.clone(), sem.clone());
        let waiter = thread::spawn(move || {
            block_on(s1.acquire());
            s1.release();
        });
        let quitter = thread::spawn(move || {
            let got = block_on(async {
                let mut acquire = pin!(s2.acquire());
                poll!(acquire.as_mut()).is_ready()
            });
            if got {
                s2.release();
            }
        });
        sem.release();
        waiter.join().unwrap();
        quitter.join().unwrap();
        assert_eq!(sem.settled(), (1, 0, 0));
    });
}

/// Two waiters for one permit that the main thread releases, both waiting it out: the
/// permit goes to them in the order they joined the list, whatever the interleaving (a
/// waiter that came while the permit was free and nobody waited took it at once), and
/// comes back.
pub fn two_waiters_share_one_permit() {
    loom::model(|| {
        let sem = Sem::new(0);
        let handles: Vec<_> = (1..=2)
            .map(|id| {
                let s = sem.clone();
                thread::spawn(move || {
                    block_on(s.acquire_as(id));
                    s.release();
                })
            })
            .collect();
        sem.release();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(sem.settled(), (1, 0, 0));
        let (queued, served) = sem.log.lock().unwrap().clone();
        // Those that joined the list were served in its order.
        assert_eq!(served.len(), 2);
        let served_queued: Vec<usize> = served
            .into_iter()
            .filter(|id| queued.contains(id))
            .collect();
        assert_eq!(served_queued, queued, "served out of FIFO order");
    });
}
