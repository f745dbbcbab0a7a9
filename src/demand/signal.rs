//! `PauseSignal`: the pause state of a [`Watermarks`](crate::demand::Watermarks) stream,
//! as a value to read and a change to await.

use std::future::Future;
use std::pin::Pin;
use std::sync::PoisonError;
use std::task::{Context, Poll};

use crate::demand::Flow;
use crate::sync::{Arc, Deferred, Key, Mutex, MutexGuard, WaiterList};

/// What the [`PauseSignal`]s follow: the state published last, its version, and the tasks
/// waiting in [`PauseSignal::changed`]. (Not a `tokio::sync::watch`: its send stops waking
/// at the first waker that panics, and the tasks behind it would wait for ever. Here the
/// wakers run after the lock, each even if another panics.)
#[derive(Debug)]
pub(crate) struct Signal {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    flow: Flow,
    /// Bumped by every change published.
    version: u64,
    /// No change can come: the wrapper and every ticket are gone.
    closed: bool,
    /// The tasks in [`PauseSignal::changed`].
    waiters: WaiterList<()>,
}

impl Signal {
    /// A signal at [`Flow::Resumed`].
    pub(crate) fn new() -> Signal {
        Signal {
            state: Mutex::new(State {
                flow: Flow::Resumed,
                version: 0,
                closed: false,
                waiters: WaiterList::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Publish the state `flow()` reads under the lock, if it is a change (so of two sends,
    /// the one the lock takes last reads last), and wake the waiting tasks after the lock:
    /// each is woken even if another's waker panics, and the first panic goes on once all
    /// were.
    pub(crate) fn send_with(&self, flow: impl FnOnce() -> Flow) {
        let mut woken = Deferred::default();
        let mut st = self.lock();
        let flow = flow();
        if st.flow != flow {
            st.flow = flow;
            st.version += 1;
            st.waiters.wake_all(&mut woken);
        }
    }

    /// No change can come any more: wake the waiting tasks (as [`send_with`](Self::send_with)) to
    /// return `None`.
    pub(crate) fn close(&self) {
        let mut woken = Deferred::default();
        let mut st = self.lock();
        st.closed = true;
        st.waiters.wake_all(&mut woken);
    }

    /// A signal that has seen the state `signal` published so far. (Not a method on
    /// `self: &Arc<Self>`: loom's `Arc` cannot be a receiver.)
    pub(crate) fn subscribe(signal: &Arc<Signal>) -> PauseSignal {
        PauseSignal {
            seen: signal.lock().version,
            signal: Arc::clone(signal),
        }
    }
}

/// Whether the source should be paused: a watch a consumer loop can await, to call
/// `consumer.pause()` / `resume()` on its source.
#[derive(Debug, Clone)]
pub struct PauseSignal {
    signal: Arc<Signal>,
    /// The version of the state this signal returned last (or saw when it was made).
    seen: u64,
}

impl PauseSignal {
    /// The current state.
    pub fn get(&self) -> Flow {
        self.signal.lock().flow
    }

    /// Whether the source should be paused now.
    pub fn is_paused(&self) -> bool {
        self.get() == Flow::Paused
    }

    /// Wait for the next change and return the new state. `None` once no change can come:
    /// the wrapper and every [`Ticket`](crate::demand::Ticket) it handed out are gone.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: a change that happens while the future is dropped is not lost; the next
    /// call returns at once with the state then (as `tokio::sync::watch::Receiver::changed`).
    pub async fn changed(&mut self) -> Option<Flow> {
        Changed {
            pause: self,
            key: None,
        }
        .await
    }
}

/// The future of [`PauseSignal::changed`]. Dropped, it leaves the list of waiting tasks
/// (nothing else is lost: the change is still unseen by its signal).
struct Changed<'a> {
    pause: &'a mut PauseSignal,
    /// Its place in the signal's list of waiting tasks, once it waited.
    key: Option<Key>,
}

impl Future for Changed<'_> {
    type Output = Option<Flow>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Flow>> {
        // Declared before the lock: the wakers given up are dropped after it is released.
        let mut out = Deferred::default();
        let this = &mut *self;
        let mut st = this.pause.signal.lock();
        let ready = if st.version != this.pause.seen {
            this.pause.seen = st.version;
            Some(Some(st.flow))
        } else if st.closed {
            Some(None)
        } else {
            None
        };
        if let Some(changed) = ready {
            if let Some(key) = this.key.take() {
                st.waiters.cancel(key, &mut out);
            }
            return Poll::Ready(changed);
        }
        // Registered under the lock that changes are published under: none is missed.
        st.waiters
            .register(&mut this.key, cx.waker(), || (), &mut out);
        Poll::Pending
    }
}

impl Drop for Changed<'_> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            let mut out = Deferred::default();
            self.pause.signal.lock().waiters.cancel(key, &mut out);
        }
    }
}
