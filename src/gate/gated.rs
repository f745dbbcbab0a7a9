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
///   the rate the gate allows; a transient backend error waits 100 ms and asks again.
/// - `gated_drop` (policing): a rejected item is dropped at once.
///
/// Items that are dropped — rejected under `gated_drop`, or refused for good (an invalid
/// key, or an error under `gated_drop`) — go to the [`on_drop`](Gated::on_drop) hook with
/// the reason, and are counted in [`dropped`](Gated::dropped).
#[pin_project]
#[must_use = "streams do nothing unless polled"]
pub struct Gated<S: Stream, G, K> {
    #[pin]
    stream: Fuse<S>,
    gate: G,
    key: K,
    shaping: bool,
    item: Option<(S::Item, String)>,
    state: State,
    on_drop: Option<OnDrop<S::Item>>,
    dropped: u64,
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
            item: None,
            state: State::Idle,
            on_drop: None,
            dropped: 0,
        }
    }

    /// Call `hook` with every dropped item and why it was dropped.
    pub fn on_drop(mut self, hook: impl FnMut(S::Item, &Dropped) + Send + 'static) -> Self {
        self.on_drop = Some(Box::new(hook));
        self
    }

    /// Items dropped so far.
    pub fn dropped(&self) -> u64 {
        self.dropped
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

    /// The inner stream; an item waiting at the gate is dropped.
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
                    *this.item = Some((item, key));
                }
                State::Deciding(decide) => {
                    let outcome = ready!(decide.as_mut().poll(cx));
                    let wait = match outcome {
                        Ok(d) if d.allowed => None,
                        Ok(d) if *this.shaping => Some(d.retry_after),
                        Err(e) if *this.shaping && e.is_transient() => Some(ERROR_BACKOFF),
                        Ok(d) => {
                            drop_item(this.item, this.on_drop, this.dropped, Dropped::Rejected(d));
                            *this.state = State::Idle;
                            continue;
                        }
                        Err(e) => {
                            drop_item(this.item, this.on_drop, this.dropped, Dropped::Error(e));
                            *this.state = State::Idle;
                            continue;
                        }
                    };
                    match wait {
                        None => {
                            *this.state = State::Idle;
                            return Poll::Ready(this.item.take().map(|(item, _)| item));
                        }
                        Some(d) => {
                            *this.state = State::Waiting(Box::pin(tokio::time::sleep(d)));
                        }
                    }
                }
                State::Waiting(sleep) => {
                    ready!(sleep.as_mut().poll(cx));
                    let key = &this.item.as_ref().expect("an item waits").1;
                    *this.state = State::Deciding(ask(this.gate, key));
                }
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        // Shaping passes every item; policing may drop any.
        let held = usize::from(self.item.is_some());
        let (lo, hi) = self.stream.size_hint();
        let hi = hi.and_then(|h| h.checked_add(held));
        if self.shaping {
            (lo.saturating_add(held), hi)
        } else {
            (0, hi)
        }
    }
}

fn drop_item<T>(
    item: &mut Option<(T, String)>,
    on_drop: &mut Option<OnDrop<T>>,
    dropped: &mut u64,
    why: Dropped,
) {
    if let Some((item, _)) = item.take() {
        *dropped += 1;
        if let Some(hook) = on_drop {
            hook(item, &why);
        }
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
        self.item.is_none() && self.stream.is_done()
    }
}

impl<S: Stream + fmt::Debug, G: fmt::Debug, K> fmt::Debug for Gated<S, G, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gated")
            .field("stream", &self.stream)
            .field("gate", &self.gate)
            .field("shaping", &self.shaping)
            .field("holding", &self.item.is_some())
            .field("dropped", &self.dropped)
            .finish_non_exhaustive()
    }
}
