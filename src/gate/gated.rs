//! `gated` and `gated_drop`: a stream through a token gate.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use futures::Stream;
use futures::stream::{Fuse, FusedStream, StreamExt};
use pin_project::pin_project;
use tokio::time::Sleep;

use crate::decision::Decision;
use crate::gate::api::Gate;
use crate::gate::error::GateError;

/// How long `gated` waits before asking again after a transient backend error.
const ERROR_BACKOFF: Duration = Duration::from_millis(100);

type Deciding = Pin<Box<dyn Future<Output = Result<Decision, GateError>> + Send>>;
type OnDrop<T> = Box<dyn FnMut(T, &Dropped) + Send>;

/// Why an item did not pass a gate.
#[derive(Debug)]
#[non_exhaustive]
pub enum Dropped {
    /// The gate rejected it (`gated_drop` only).
    Rejected(Decision),
    /// The gate could not decide it: a permanent error (cost or key), or, for
    /// `gated_drop`, any error.
    Error(GateError),
    /// It was waiting at the gate when the stream was dropped or taken apart
    /// ([`into_inner`](Gated::into_inner)).
    Discarded,
}

enum State {
    Idle,
    Deciding(Deciding),
    Waiting(Pin<Box<Sleep>>),
}

/// Stream of [`gated`](crate::FlowStreamExt::gated) and
/// [`gated_drop`](crate::FlowStreamExt::gated_drop).
///
/// Each item's key is asked of the gate with cost 1.
/// - `gated` (shaping): a rejected item waits `retry_after` and asks again, so items leave at
///   the rate the gate allows; a transient error (backend, or a full in-memory keyspace)
///   waits 100 ms and asks again.
/// - `gated_drop` (policing): a rejected item is dropped at once.
///
/// Items that are dropped — rejected under `gated_drop`, refused for good (an invalid key,
/// or an error under `gated_drop`), or waiting at the gate when the stream is dropped — go
/// to the [`on_drop`](Gated::on_drop) hook with the reason, and are counted in
/// [`dropped`](Gated::dropped).
#[pin_project]
#[must_use = "streams do nothing unless polled"]
pub struct Gated<S: Stream, G, K> {
    #[pin]
    stream: Fuse<S>,
    gate: G,
    key: K,
    shaping: bool,
    held: Held<S::Item>,
    state: State,
}

/// The item waiting at the gate, and the accounting of drops. Dropped itself (the stream
/// dropped or taken apart), it reports the waiting item as [`Dropped::Discarded`].
struct Held<T> {
    item: Option<(T, String)>,
    on_drop: Option<OnDrop<T>>,
    dropped: u64,
}

impl<T> Held<T> {
    /// Drop the waiting item, if any, for `why`.
    fn drop_item(&mut self, why: Dropped) {
        if let Some((item, _)) = self.item.take() {
            self.dropped += 1;
            if let Some(hook) = self.on_drop.as_mut() {
                hook(item, &why);
            }
        }
    }
}

impl<T> Drop for Held<T> {
    fn drop(&mut self) {
        self.drop_item(Dropped::Discarded);
    }
}

/// Stream of [`gated_drop`](crate::FlowStreamExt::gated_drop): the same adapter as
/// [`Gated`], in policing mode.
pub type GatedDrop<S, G, K> = Gated<S, G, K>;

impl<S, G, K, Key> Gated<S, G, K>
where
    S: Stream,
    G: Gate + Clone + 'static,
    K: FnMut(&S::Item) -> Key,
    Key: Into<String>,
{
    pub(crate) fn new(stream: S, gate: G, key: K, shaping: bool) -> Self {
        Gated {
            stream: stream.fuse(),
            gate,
            key,
            shaping,
            held: Held {
                item: None,
                on_drop: None,
                dropped: 0,
            },
            state: State::Idle,
        }
    }

    /// Call `hook` with every dropped item and why it was dropped.
    pub fn on_drop(mut self, hook: impl FnMut(S::Item, &Dropped) + Send + 'static) -> Self {
        self.held.on_drop = Some(Box::new(hook));
        self
    }

    /// Items dropped so far.
    pub fn dropped(&self) -> u64 {
        self.held.dropped
    }

    /// The inner stream.
    pub fn get_ref(&self) -> &S {
        self.stream.get_ref()
    }

    /// The inner stream, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        self.stream.get_mut()
    }

    /// The inner stream, pinned.
    pub fn get_pin_mut(self: Pin<&mut Self>) -> Pin<&mut S> {
        self.project().stream.get_pin_mut()
    }

    /// The inner stream; an item waiting at the gate is dropped (to the hook, as
    /// [`Dropped::Discarded`]).
    pub fn into_inner(self) -> S {
        self.stream.into_inner()
    }
}

fn ask<G: Gate + Clone + 'static>(gate: &G, key: &str) -> Deciding {
    let (gate, key) = (gate.clone(), key.to_owned());
    Box::pin(async move { gate.acquire(&key, 1).await })
}

impl<S, G, K, Key> Stream for Gated<S, G, K>
where
    S: Stream,
    G: Gate + Clone + 'static,
    K: FnMut(&S::Item) -> Key,
    Key: Into<String>,
{
    type Item = S::Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        let mut this = self.project();
        loop {
            match this.state {
                State::Idle => {
                    let Some(item) = ready!(this.stream.as_mut().poll_next(cx)) else {
                        return Poll::Ready(None);
                    };
                    let key: String = (this.key)(&item).into();
                    *this.state = State::Deciding(ask(this.gate, &key));
                    this.held.item = Some((item, key));
                }
                State::Deciding(decide) => {
                    let outcome = ready!(decide.as_mut().poll(cx));
                    let wait = match outcome {
                        Ok(d) if d.allowed => None,
                        Ok(d) if *this.shaping => Some(d.retry_after),
                        Err(e) if *this.shaping && e.is_transient() => Some(ERROR_BACKOFF),
                        Ok(d) => {
                            this.held.drop_item(Dropped::Rejected(d));
                            *this.state = State::Idle;
                            continue;
                        }
                        Err(e) => {
                            this.held.drop_item(Dropped::Error(e));
                            *this.state = State::Idle;
                            continue;
                        }
                    };
                    match wait {
                        None => {
                            *this.state = State::Idle;
                            return Poll::Ready(this.held.item.take().map(|(item, _)| item));
                        }
                        Some(d) => {
                            *this.state = State::Waiting(Box::pin(tokio::time::sleep(d)));
                        }
                    }
                }
                State::Waiting(sleep) => {
                    ready!(sleep.as_mut().poll(cx));
                    let key = &this.held.item.as_ref().expect("an item waits").1;
                    *this.state = State::Deciding(ask(this.gate, key));
                }
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        // Any item may be dropped (policing: rejected; both: an invalid key or a permanent
        // error), so no lower bound.
        let held = usize::from(self.held.item.is_some());
        let (_, hi) = self.stream.size_hint();
        (0, hi.and_then(|h| h.checked_add(held)))
    }
}

impl<S, G, K, Key> FusedStream for Gated<S, G, K>
where
    S: Stream,
    G: Gate + Clone + 'static,
    K: FnMut(&S::Item) -> Key,
    Key: Into<String>,
{
    fn is_terminated(&self) -> bool {
        self.held.item.is_none() && self.stream.is_done()
    }
}

impl<S: Stream + fmt::Debug, G: fmt::Debug, K> fmt::Debug for Gated<S, G, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gated")
            .field("stream", &self.stream)
            .field("gate", &self.gate)
            .field("shaping", &self.shaping)
            .field("holding", &self.held.item.is_some())
            .field("dropped", &self.held.dropped)
            .finish_non_exhaustive()
    }
}
