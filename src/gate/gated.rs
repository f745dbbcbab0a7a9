//! `gated` and `gated_drop`: a stream through a token gate.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use futures::Stream;
use futures::stream::{Fuse, FusedStream, StreamExt};
use pin_project::pin_project;
use tokio::time::{Instant, Sleep};

use crate::decision::Decision;
use crate::dropped::{Dropped, OnDrop};
use crate::error::ConfigError;
use crate::gate::api::Gate;
use crate::gate::error::GateError;
use crate::metrics::{Counter, Labels};
use crate::sync::{POLL_BUDGET, Panics};

/// How long `gated` waits before asking again after a transient backend error.
const ERROR_BACKOFF: Duration = Duration::from_millis(100);

/// How long `gated` waits before asking again after a rejection with a `retry_after` of
/// zero (a gate of one's own that says "ask again now"): a timer's tick. Asked again at
/// once, it would be asked in a loop inside one poll for as long as it answers so.
const NO_WAIT_BACKOFF: Duration = Duration::from_millis(1);

/// The name of the adapter's metric.
pub(crate) mod names {
    pub(crate) const DROPPED: &str = "flowgate_gated_dropped_total";
}

/// The key function of [`Gated`]: the gate key of an item.
///
/// Implemented for every `FnMut(&T) -> Key` where `Key: AsRef<str> + Send + 'static`: a
/// `&'static str`, a `String`, an `Arc<str>`, or a type of your own. flowgate allocates
/// nothing for the key: it holds what the function returns while the item is at the gate.
/// You do not implement this trait; pass a closure.
pub trait KeyFn<T> {
    /// What the function returns. (The adapters also need it to be `'static`; that bound is
    /// on them, not here, so that a task holding the stream can be spawned.)
    type Key: AsRef<str> + Send;

    /// The key of `item`.
    fn key(&mut self, item: &T) -> Self::Key;
}

impl<T, F, Key> KeyFn<T> for F
where
    F: FnMut(&T) -> Key,
    Key: AsRef<str> + Send,
{
    type Key = Key;

    #[inline]
    fn key(&mut self, item: &T) -> Key {
        self(item)
    }
}

/// The cost function of [`gated`](crate::FlowStreamExt::gated) and
/// [`gated_drop`](crate::FlowStreamExt::gated_drop): every item costs 1.
type UnitCost<T> = fn(&T) -> u32;

fn unit_cost<T>(_: &T) -> u32 {
    1
}

/// A decision being made by a gate that needs I/O; it hands the key and cost back.
type Deciding<Key> = Pin<Box<dyn Future<Output = Asked<Key>> + Send>>;

/// A gate's answer for the item at the gate, with its key and cost.
type Asked<Key> = (Result<Decision, GateError>, Key, u32);

enum State<Key> {
    /// No item at the gate.
    Idle,
    /// The gate is deciding (it needs I/O).
    Deciding(Deciding<Key>),
    /// Rejected or a transient error: waiting on the sleep to ask again.
    Waiting(Key, u32),
    /// Admitted, and the poll that asked panicked (the gate's metrics recorder, as it
    /// counted the admission): the item passes on the next poll, without asking again.
    Admitted,
}

/// Stream of [`gated`](crate::FlowStreamExt::gated) and
/// [`gated_drop`](crate::FlowStreamExt::gated_drop), or built with [`Gated::builder`].
///
/// Each item is checked at the gate under its key, for its cost (1 unless the builder's
/// [`cost`](GatedBuilder::cost) says otherwise).
/// - `gated` (shaping): a rejected item waits `retry_after` and asks again, so items leave at
///   the rate the gate allows (a rejection with a `retry_after` of zero, which flowgate's
///   gates never give, waits 1 ms, a timer's tick, rather than being asked again in a loop);
///   a transient error (backend, or a full in-memory keyspace) waits 100 ms and asks again.
/// - `gated_drop` (policing, or [`drop_rejected`](GatedBuilder::drop_rejected)): a rejected
///   item is dropped at once.
///
/// Shaping waits on tokio's timers, which end on their next 1 ms tick, so a wait ends up to
/// 1 ms late; the key's bucket banks that time only up to its burst. With a burst of at
/// least an item's cost plus `rate × 1 ms` the rate holds; below that, what the lateness
/// would have refilled is lost wait after wait, as for a [`Pacer`](crate::pace::Pacer) of
/// `burst(1)`: a burst of 1 passes at most one item a tick (1M/s runs at about 1 000/s),
/// and runs up to 10 % slow at 100/s. Give such a quota a larger burst, or, for spacing
/// within one process, pace the stream with [`leaky`](crate::FlowStreamExt::leaky) (its
/// default burst absorbs a timer's lateness).
///
/// One item is at the gate at a time, so items keep their order. A gate that decides
/// without I/O ([`Gate::check_local`], such as a [`MemoryGate`](crate::gate::MemoryGate))
/// is asked in place: nothing is allocated per item. Otherwise each decision is a boxed
/// future holding a clone of the gate.
///
/// Items that are dropped go to the `on_drop` hook ([`OnDrop`]) with a [`Dropped`] reason,
/// and are counted in [`dropped`](Gated::dropped):
/// - [`Dropped::Rejected`]: rejected under `gated_drop`;
/// - [`Dropped::GateError`]: refused for good (a cost of zero or above the capacity, an
///   invalid key, a key Redis holds a value under that the gate cannot read:
///   [`GateError::UnreadableKey`]), or any error under `gated_drop`;
/// - [`Dropped::Discarded`]: waiting at the gate when the stream was dropped or taken apart.
///
/// # Metrics
///
/// Labelled by `name`: `flowgate_gated_dropped_total` by `reason` (`rejected`,
/// `gate_error`, `discarded`).
///
/// # Panics
///
/// When it has to wait (shaping) outside a tokio runtime with its time driver enabled.
///
/// A key or cost function that panics panics the poll, and so does a gate whose decision
/// panics. The item stays at the gate: the next poll calls the functions again and asks the
/// gate again, and a stream dropped instead reports it as [`Dropped::Discarded`]. A gate
/// whose metrics recorder panics as it counts a decision has decided by then. One that
/// decides in place (a [`MemoryGate`](crate::gate::MemoryGate); a
/// [`RedisGate`](crate::gate::RedisGate) spending a leased token or answering a cached
/// rejection) hands the decision over with the panic, and the stream acts on it before
/// the panic goes on: an admitted item passes on the next poll without being asked again
/// (or, the stream dropped first, is reported as discarded), a rejected one waits its
/// `retry_after` (shaping) or is dropped (policing). Through a future (a Redis round trip)
/// the decision is lost with the panic: what it admitted stays charged, and the item asked
/// again is charged again. So is one of a gate of your own that decides in place through
/// another ([`Gate::check_local`]): only flowgate's gates can hand the panic over.
#[pin_project]
#[must_use = "streams do nothing unless polled"]
pub struct Gated<S: Stream, G, K: KeyFn<S::Item>, C = UnitCost<<S as Stream>::Item>> {
    #[pin]
    stream: Fuse<S>,
    gate: G,
    key: K,
    cost: C,
    shaping: bool,
    held: Held<S::Item>,
    state: State<K::Key>,
    /// Created on the first wait, reset for every later one.
    sleep: Option<Pin<Box<Sleep>>>,
    name: Option<String>,
}

/// The item at the gate, and the accounting of drops. Dropped itself (the stream dropped or
/// taken apart), it reports the item at the gate as [`Dropped::Discarded`].
struct Held<T> {
    item: Option<T>,
    on_drop: Option<OnDrop<T>>,
    dropped: u64,
    rejected: Counter,
    gate_error: Counter,
    discarded: Counter,
}

impl<T> Held<T> {
    /// Drop the item at the gate, if any, for `why`.
    fn drop_item(&mut self, why: Dropped) {
        if let Some(item) = self.item.take() {
            self.dropped += 1;
            let counter = match why {
                Dropped::Rejected(_) => &self.rejected,
                Dropped::GateError(_) => &self.gate_error,
                _ => &self.discarded,
            };
            // Counted, then to the hook, even if the recorder panics as it is counted.
            crate::dropped::recorded_then(
                || counter.increment(1),
                || {
                    if let Some(hook) = &self.on_drop {
                        hook.call(item, &why);
                    }
                },
            );
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
pub type GatedDrop<S, G, K, C = UnitCost<<S as Stream>::Item>> = Gated<S, G, K, C>;

impl<S, G, K> Gated<S, G, K>
where
    S: Stream,
    G: Gate + Clone + 'static,
    K: KeyFn<S::Item>,
    K::Key: 'static,
{
    /// A builder for a stream passing each item of `stream` through `gate` under the key
    /// `key(&item)`; by default it shapes (waits when rejected), each item costs 1, and
    /// nothing is named or hooked.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use flowgate::gate::{Gated, Limit, MemoryGate};
    /// use flowgate::{Dropped, Quota};
    /// use futures::StreamExt;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// struct Upload { tenant: &'static str, megabytes: u32 }
    ///
    /// let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(10)?));
    /// let rejected = Arc::new(AtomicU64::new(0));
    /// let seen = rejected.clone();
    /// let uploads = futures::stream::iter([
    ///     Upload { tenant: "a", megabytes: 6 },
    ///     Upload { tenant: "a", megabytes: 6 }, // 4 left: rejected, dropped
    ///     Upload { tenant: "b", megabytes: 10 },
    /// ]);
    /// let mut passed = Gated::builder(uploads, gate, |u: &Upload| u.tenant)
    ///     .cost(|u: &Upload| u.megabytes)
    ///     .drop_rejected(true)
    ///     .on_drop(move |_, why| {
    ///         assert!(matches!(why, Dropped::Rejected(_)));
    ///         seen.fetch_add(1, Ordering::Relaxed);
    ///     })
    ///     .name("uploads")
    ///     .build()?;
    /// let mut megabytes = 0;
    /// while let Some(upload) = passed.next().await {
    ///     megabytes += upload.megabytes;
    /// }
    /// assert_eq!(megabytes, 16);
    /// assert_eq!((passed.dropped(), rejected.load(Ordering::Relaxed)), (1, 1));
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(stream: S, gate: G, key: K) -> GatedBuilder<S, G, K> {
        GatedBuilder {
            stream,
            gate,
            key,
            cost: unit_cost::<S::Item>,
            shaping: true,
            on_drop: None,
            name: None,
        }
    }
}

impl<S, G, K, C> Gated<S, G, K, C>
where
    S: Stream,
    G: Gate + Clone + 'static,
    K: KeyFn<S::Item>,
    K::Key: 'static,
    C: FnMut(&S::Item) -> u32,
{
    pub(crate) fn new(
        stream: S,
        gate: G,
        key: K,
        cost: C,
        shaping: bool,
        on_drop: Option<OnDrop<S::Item>>,
        name: Option<String>,
    ) -> Self {
        let labels = Labels::new(name.as_deref());
        let dropped = |reason| labels.counter(names::DROPPED, &[("reason", reason)]);
        Gated {
            stream: stream.fuse(),
            gate,
            key,
            cost,
            shaping,
            held: Held {
                item: None,
                on_drop,
                dropped: 0,
                rejected: dropped("rejected"),
                gate_error: dropped("gate_error"),
                discarded: dropped("discarded"),
            },
            state: State::Idle,
            sleep: None,
            name,
        }
    }
}

impl<S: Stream, G, K: KeyFn<S::Item>, C> Gated<S, G, K, C> {
    /// Items dropped so far.
    pub fn dropped(&self) -> u64 {
        self.held.dropped
    }

    /// The `name` label of this stream's metrics, if it was given one.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The gate.
    pub fn gate(&self) -> &G {
        &self.gate
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

/// Ask `gate` about the item at the gate: in place when the gate decides without I/O (with
/// the panic of its metrics recorder held), otherwise start a boxed decision in `state` and
/// return `None`.
fn ask<G, Key>(
    gate: &G,
    key: Key,
    cost: u32,
    state: &mut State<Key>,
) -> Option<(Asked<Key>, Panics)>
where
    G: Gate + Clone + 'static,
    Key: AsRef<str> + Send + 'static,
{
    if let Some((outcome, panic)) = gate.check_local_held(key.as_ref(), cost) {
        return Some(((outcome, key, cost), panic));
    }
    let gate = gate.clone();
    *state = State::Deciding(Box::pin(async move {
        let outcome = gate.check(key.as_ref(), cost).await;
        (outcome, key, cost)
    }));
    None
}

impl<S, G, K, C> Stream for Gated<S, G, K, C>
where
    S: Stream,
    G: Gate + Clone + 'static,
    K: KeyFn<S::Item>,
    K::Key: 'static,
    C: FnMut(&S::Item) -> u32,
{
    type Item = S::Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        let mut this = self.project();
        // An item dropped at the gate is followed at once by the next: within the budget.
        let mut budget = POLL_BUDGET;
        loop {
            let ((outcome, key, cost), held_panic) = match this.state {
                State::Idle => {
                    // The item is held before the key and cost functions see it: if one
                    // panics, the item stays at the gate (asked again on the next poll,
                    // reported as discarded if the stream is dropped), never lost.
                    if this.held.item.is_none() {
                        let Some(item) = ready!(this.stream.as_mut().poll_next(cx)) else {
                            return Poll::Ready(None);
                        };
                        this.held.item = Some(item);
                    }
                    let item = this.held.item.as_ref().expect("held above");
                    let key = this.key.key(item);
                    let cost = (this.cost)(item);
                    match ask(this.gate, key, cost, this.state) {
                        Some(asked) => asked,
                        None => continue,
                    }
                }
                State::Deciding(decide) => {
                    // A decision that panics is spent: the item stays at the gate, asked
                    // again on the next poll, as when the key or cost function panics.
                    let polled =
                        std::panic::catch_unwind(AssertUnwindSafe(|| decide.as_mut().poll(cx)));
                    let asked = match polled {
                        Ok(polled) => ready!(polled),
                        Err(panic) => {
                            *this.state = State::Idle;
                            std::panic::resume_unwind(panic);
                        }
                    };
                    *this.state = State::Idle;
                    (asked, Panics::new())
                }
                State::Waiting(..) => {
                    let sleep = this.sleep.as_mut().expect("a wait has a sleep");
                    ready!(sleep.as_mut().poll(cx));
                    let State::Waiting(key, cost) = std::mem::replace(this.state, State::Idle)
                    else {
                        unreachable!("matched above")
                    };
                    match ask(this.gate, key, cost, this.state) {
                        Some(asked) => asked,
                        None => continue,
                    }
                }
                State::Admitted => {
                    *this.state = State::Idle;
                    return Poll::Ready(this.held.item.take());
                }
            };
            let wait = match outcome {
                Ok(d) if d.allowed => {
                    // Charged: if the recorder panicked, the item passes on the next poll,
                    // not asked again.
                    *this.state = State::Admitted;
                    held_panic.resume();
                    *this.state = State::Idle;
                    return Poll::Ready(this.held.item.take());
                }
                Ok(d) if *this.shaping && d.retry_after.is_zero() => NO_WAIT_BACKOFF,
                Ok(d) if *this.shaping => d.retry_after,
                Err(e) if *this.shaping && e.is_transient() => ERROR_BACKOFF,
                outcome => {
                    this.held.drop_item(match outcome {
                        Ok(d) => Dropped::Rejected(d),
                        Err(e) => Dropped::GateError(e),
                    });
                    held_panic.resume();
                    budget -= 1;
                    if budget == 0 {
                        // More may be ready: come back after the executor has run others.
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                    continue;
                }
            };
            let deadline = Instant::now() + crate::time::capped(wait);
            match this.sleep {
                Some(sleep) => sleep.as_mut().reset(deadline),
                None => *this.sleep = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
            *this.state = State::Waiting(key, cost);
            held_panic.resume();
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        // Any item may be dropped (policing: rejected; both: an invalid key or cost, or a
        // permanent error), so no lower bound; at most the item at the gate and the rest.
        let held = usize::from(self.held.item.is_some());
        let (_, hi) = self.stream.size_hint();
        (0, hi.and_then(|h| h.checked_add(held)))
    }
}

/// The inner stream's write half, untouched (only reading is gated).
impl<S, G, K, C, Item> futures::Sink<Item> for Gated<S, G, K, C>
where
    S: Stream + futures::Sink<Item>,
    K: KeyFn<S::Item>,
{
    type Error = S::Error;
    crate::ext::delegate_sink!(stream, Item);
}

impl<S, G, K, C> FusedStream for Gated<S, G, K, C>
where
    S: Stream,
    G: Gate + Clone + 'static,
    K: KeyFn<S::Item>,
    K::Key: 'static,
    C: FnMut(&S::Item) -> u32,
{
    fn is_terminated(&self) -> bool {
        self.held.item.is_none() && self.stream.is_done()
    }
}

impl<S, G, K, C> fmt::Debug for Gated<S, G, K, C>
where
    S: Stream + fmt::Debug,
    G: fmt::Debug,
    K: KeyFn<S::Item>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gated")
            .field("stream", &self.stream)
            .field("gate", &self.gate)
            .field("name", &self.name)
            .field("shaping", &self.shaping)
            .field("holding", &self.held.item.is_some())
            .field("dropped", &self.held.dropped)
            .finish_non_exhaustive()
    }
}

/// Builds a [`Gated`] stream; from [`Gated::builder`].
#[must_use = "a builder does nothing until it is built"]
pub struct GatedBuilder<S: Stream, G, K, C = UnitCost<<S as Stream>::Item>> {
    stream: S,
    gate: G,
    key: K,
    cost: C,
    shaping: bool,
    on_drop: Option<OnDrop<S::Item>>,
    name: Option<String>,
}

impl<S, G, K, C> GatedBuilder<S, G, K, C>
where
    S: Stream,
    G: Gate + Clone + 'static,
    K: KeyFn<S::Item>,
    K::Key: 'static,
{
    /// Each item costs `cost(&item)` units (default 1). A cost of zero, or one above the
    /// gate's capacity, can never pass: such an item is dropped as [`Dropped::GateError`]
    /// with [`GateError::Cost`].
    pub fn cost<C2>(self, cost: C2) -> GatedBuilder<S, G, K, C2>
    where
        C2: FnMut(&S::Item) -> u32,
    {
        GatedBuilder {
            stream: self.stream,
            gate: self.gate,
            key: self.key,
            cost,
            shaping: self.shaping,
            on_drop: self.on_drop,
            name: self.name,
        }
    }

    /// `true`: drop a rejected item at once (policing, as
    /// [`gated_drop`](crate::FlowStreamExt::gated_drop)). `false` (the default): wait
    /// `retry_after` and ask again (shaping, as [`gated`](crate::FlowStreamExt::gated)).
    pub fn drop_rejected(mut self, drop: bool) -> Self {
        self.shaping = !drop;
        self
    }

    /// Call `hook` with every dropped item and why it was dropped (see [`Gated`]), from
    /// the task polling the stream.
    pub fn on_drop(mut self, hook: impl Fn(S::Item, &Dropped) + Send + Sync + 'static) -> Self {
        self.on_drop = Some(OnDrop::new(hook));
        self
    }

    /// The `name` label of the stream's metrics.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The stream, from an extension method (nothing to validate).
    pub(crate) fn into_gated(self) -> Gated<S, G, K, C>
    where
        C: FnMut(&S::Item) -> u32,
    {
        Gated::new(
            self.stream,
            self.gate,
            self.key,
            self.cost,
            self.shaping,
            self.on_drop,
            self.name,
        )
    }

    /// Build the stream.
    ///
    /// # Errors
    ///
    /// None today: every setting is valid by its type. `Result` like every builder, so a
    /// setting that needs checking can be added without breaking callers.
    pub fn build(self) -> Result<Gated<S, G, K, C>, ConfigError>
    where
        C: FnMut(&S::Item) -> u32,
    {
        Ok(self.into_gated())
    }
}

impl<S, G, K, C> fmt::Debug for GatedBuilder<S, G, K, C>
where
    S: Stream + fmt::Debug,
    G: fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GatedBuilder")
            .field("stream", &self.stream)
            .field("gate", &self.gate)
            .field("name", &self.name)
            .field("shaping", &self.shaping)
            .field("on_drop", &self.on_drop)
            .finish_non_exhaustive()
    }
}
