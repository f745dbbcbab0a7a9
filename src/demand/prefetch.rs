//! `prefetch`: a stream that fetches from a `BatchSource` exactly what its buffer has room for.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::fmt;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use std::vec;

use futures::Stream;
use futures::stream::FusedStream;
use pin_project::pin_project;
use tokio::time::Sleep;

use crate::demand::{BatchSource, Levels};
use crate::dropped::{Dropped, OnDrop, recorded_then};
use crate::error::{ConfigError, ConfigErrorKind};
use crate::metrics::{Counter, Gauge, Labels};

/// Stream of [`prefetch`](crate::demand::prefetch()): fetches from a [`BatchSource`] exactly
/// what the buffer has room for.
///
/// At most `high` items are fetched but not yet consumed. When the buffer falls to `low`,
/// the next fetch asks for exactly `high − buffered` items — never more — so memory stays
/// bounded and nothing is fetched that downstream has no room for. (A batch larger than
/// asked for, from a source that breaks that contract, is kept whole: the buffer is above
/// `high` until it drains, and no item is cut off.) A fetch error is yielded as an `Err`
/// item (after the items buffered before it), and the next fetch waits (10 ms, doubling up
/// to 1 s while fetches keep failing; see [`retry_backoff`](PrefetchBuilder::retry_backoff)),
/// so a loop that logs errors and goes on does not hammer a source that is down; an empty
/// batch the source answered without waiting backs off the same way, so an idle
/// non-blocking source is not polled in a loop. The stream ends when the source does and
/// the buffer is empty.
///
/// `Y` is what the stream yields: [`Results`] (the default), `Result<S::Item, S::Error>`;
/// or [`Items`], plain `S::Item`s, for a source that cannot fail (`Error =`
/// [`Infallible`]), such as [`IterSource`](crate::demand::IterSource) and
/// [`StreamSource`](crate::demand::StreamSource): see [`items`](Prefetch::items).
///
/// # Dropping
///
/// Items still buffered when the stream is dropped (or taken apart with
/// [`into_inner`](Prefetch::into_inner)) are discarded: all of them are counted in
/// `flowgate_demand_discarded_total` (under the stream's `name`), then each goes to the
/// [`on_drop`](PrefetchBuilder::on_drop) hook, if one is set, in the order the stream would
/// have yielded them, as [`Dropped::Discarded`]; the stream's share of
/// `flowgate_demand_buffered` is taken back. ([`queued`](Prefetch::queued) says how
/// many there are, before; there is no count to read on the stream, which drops nothing
/// while it lives.) A fetch error not yet yielded is dropped with them. A source whose
/// items are settled only when the application finishes them loses nothing: a
/// `RedisStreamSource` entry (feature `redis`) dropped without its `ack` stays pending and
/// is delivered again. An offset never tracked by a
/// [`CommitTracker`](crate::demand::CommitTracker) is delivered again after a restart
/// only while no later offset is finished in that tracker: it does not wait for offsets it
/// never saw, so a consumer that goes on reading the same source after dropping (or taking
/// apart) the stream first seeks it back to the first offset discarded (or to
/// `committable() + 1`, which delivers again what is in flight too), or the commits pass
/// over the discarded ones. The items of an
/// [`IterSource`](crate::demand::IterSource) or a
/// [`StreamSource`](crate::demand::StreamSource) are gone, unless the hook keeps them.
/// Items a source holds in a fetch still in progress are the source's (see its docs).
///
/// # Panics
///
/// Polling panics after a failed fetch, or an empty batch the source answered at once with
/// nothing buffered, inside a tokio runtime whose time driver is disabled (unless the retry
/// backoff is zero); see [`retry_backoff`](PrefetchBuilder::retry_backoff).
/// Dropping the stream, or `into_inner`, panics when the `on_drop` hook does.
#[pin_project]
#[must_use = "streams do nothing unless polled"]
pub struct Prefetch<S: BatchSource, Y = Results> {
    #[pin]
    source: S,
    /// Fetched items not yet handed out; what is left when the stream goes is discarded.
    buffer: Buffer<S::Item>,
    /// How many items of `buffer.current` the hot path may hand out unchecked: those the
    /// slow path would hand out without starting or polling a fetch (set by `unchecked`).
    fast: usize,
    levels: Levels,
    /// The `max` of a fetch in progress.
    fetching: Option<usize>,
    /// The fetch in progress returned `Pending` at least once: the source waited (a
    /// blocking poll), so an empty answer needs no backoff.
    waited: bool,
    error: Option<S::Error>,
    done: bool,
    /// After a failed fetch the next one waits `retry_next`: `retry_min`, doubling after each
    /// further failure up to `retry_max`.
    retry_min: Duration,
    retry_max: Duration,
    retry_next: Duration,
    /// Boxed only when a fetch failed, so the stream stays `Unpin` when its source is.
    pause: Option<Pin<Box<Sleep>>>,
    /// A fetch failed and no pause follows it (a zero backoff, or no tokio runtime): the
    /// next fetch comes after yielding to the executor once, never inside one poll.
    yield_first: bool,
    name: Option<String>,
    /// What the stream yields; `fn() -> Y` so `Y` does not change the auto traits.
    yields: PhantomData<fn() -> Y>,
}

/// What a [`Prefetch`] yields by default: `Result<S::Item, S::Error>`, a fetch error as an
/// `Err` item.
#[derive(Debug)]
pub enum Results {}

/// What a [`Prefetch`] over a source that cannot fail yields after
/// [`items`](Prefetch::items): plain `S::Item`s.
#[derive(Debug)]
pub enum Items {}

/// Fetch from `source` by demand: keep at most `levels.high()` items buffered, refill when
/// the buffer falls to `levels.low()`, asking for exactly `high − buffered`. Unnamed and
/// without a drop hook: to set the `name` label of its metrics, the retry backoff or the
/// [`on_drop`](PrefetchBuilder::on_drop) hook, use [`Prefetch::builder`].
///
/// The stream yields `Result<S::Item, S::Error>`; over a source that cannot fail
/// (`Error =` [`Infallible`]), [`.items()`](Prefetch::items) makes it yield plain items.
///
/// # Panics
///
/// Polling the stream panics after a failed fetch, or an empty batch the source answered at
/// once with nothing buffered, if it runs inside a tokio runtime whose time driver is
/// disabled (the pause before the next fetch is a tokio timer). Outside any tokio runtime it
/// does not pause, and does not panic.
///
/// # Examples
///
/// ```
/// use std::pin::Pin;
/// use std::task::{Context, Poll};
/// use flowgate::demand::{prefetch, BatchSource, Fetched, Levels, StreamSource};
/// use futures::StreamExt;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let levels = Levels::new(4, 1)?;
///
/// // A source that cannot fail: plain items.
/// let source = StreamSource::new(futures::stream::iter(0..10));
/// let items: Vec<u32> = prefetch(source, levels).items().collect().await;
/// assert_eq!(items, (0..10).collect::<Vec<_>>());
///
/// // A source that can: `Result`s, the error after the items fetched before it.
/// struct Flaky(u32);
/// impl BatchSource for Flaky {
///     type Item = u32;
///     type Error = &'static str;
///     fn poll_fetch(mut self: Pin<&mut Self>, _: &mut Context<'_>, max: usize) -> Fetched<u32, &'static str> {
///         self.0 += 1;
///         Poll::Ready(match self.0 {
///             1 => Some(Ok(vec![7; max])),
///             2 => Some(Err("broker down")),
///             _ => None,
///         })
///     }
/// }
/// let out: Vec<Result<u32, &str>> = prefetch(Flaky(0), levels).collect().await;
/// assert_eq!(out, [Ok(7), Ok(7), Ok(7), Ok(7), Err("broker down")]);
/// # Ok(())
/// # }
/// ```
pub fn prefetch<S: BatchSource>(source: S, levels: Levels) -> Prefetch<S> {
    Prefetch::new(source, levels, None, None)
}

impl<S: BatchSource> Prefetch<S> {
    /// A builder, to give the stream a name, a retry backoff and a hook for the items it
    /// discards: `Prefetch::builder(source, levels)` is [`prefetch`] with options.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use flowgate::demand::{IterSource, Levels, Prefetch};
    /// use futures::StreamExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let stream = Prefetch::builder(IterSource::new(0..10), Levels::new(4, 1)?)
    ///     .name("orders")
    ///     .retry_backoff(Duration::from_millis(50), Duration::from_secs(5))
    ///     .build()?
    ///     .items();
    /// assert_eq!(stream.name(), Some("orders"));
    /// assert_eq!(stream.count().await, 10);
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(source: S, levels: Levels) -> PrefetchBuilder<S> {
        PrefetchBuilder {
            source,
            levels,
            retry_backoff: (DEFAULT_RETRY_MIN, DEFAULT_RETRY_MAX),
            name: None,
            on_drop: None,
        }
    }

    pub(crate) fn new(
        source: S,
        levels: Levels,
        name: Option<String>,
        on_drop: Option<OnDrop<S::Item>>,
    ) -> Self {
        let labels = Labels::new(name.as_deref());
        Prefetch {
            source,
            buffer: Buffer {
                current: Vec::new().into_iter(),
                queued: VecDeque::new(),
                queued_items: 0,
                gauge: labels.gauge(names::BUFFERED, &[]),
                on_drop,
                discarded: labels.counter(names::DISCARDED, &[]),
            },
            fast: 0,
            levels,
            fetching: None,
            waited: false,
            error: None,
            done: false,
            retry_min: DEFAULT_RETRY_MIN,
            retry_max: DEFAULT_RETRY_MAX,
            retry_next: DEFAULT_RETRY_MIN,
            pause: None,
            yield_first: false,
            name,
            yields: PhantomData,
        }
    }
}

impl<S: BatchSource<Error = Infallible>> Prefetch<S> {
    /// The same stream, yielding plain items instead of `Result`s: for a source that cannot
    /// fail (`Error =` [`Infallible`]), such as [`IterSource`](crate::demand::IterSource),
    /// [`StreamSource`](crate::demand::StreamSource) or a source of your own. Nothing else
    /// changes (buffer, levels, name, metrics).
    ///
    /// # Examples
    ///
    /// ```
    /// use flowgate::demand::{prefetch, IterSource, Levels};
    /// use futures::StreamExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let mut offsets = prefetch(IterSource::new(100..103u64), Levels::new(2, 0)?).items();
    /// assert_eq!(offsets.next().await, Some(100));
    /// assert_eq!(offsets.collect::<Vec<u64>>().await, [101, 102]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn items(self) -> Prefetch<S, Items> {
        let Prefetch {
            source,
            buffer,
            fast,
            levels,
            fetching,
            waited,
            error,
            done,
            retry_min,
            retry_max,
            retry_next,
            pause,
            yield_first,
            name,
            yields: _,
        } = self;
        Prefetch {
            source,
            buffer,
            fast,
            levels,
            fetching,
            waited,
            error,
            done,
            retry_min,
            retry_max,
            retry_next,
            pause,
            yield_first,
            name,
            yields: PhantomData,
        }
    }
}

impl<S: BatchSource, Y> Prefetch<S, Y> {
    /// The `name` label of this stream's metrics, if it was given one.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// Items fetched and not yet consumed.
    ///
    /// (Named as [`LeakyQueue::queued`](crate::pace::LeakyQueue::queued) is. The former name,
    /// `buffered`, is shadowed by `StreamExt::buffered` with `futures::StreamExt` in scope:
    /// `stream.buffered()` does not compile there.)
    pub fn queued(&self) -> usize {
        self.buffer.len()
    }

    /// Items fetched and not yet consumed: the former name of [`queued`](Self::queued).
    #[deprecated(
        since = "0.2.0",
        note = "shadowed by `StreamExt::buffered` with `futures::StreamExt` in scope; use `queued`"
    )]
    pub fn buffered(&self) -> usize {
        self.queued()
    }

    /// The levels: at most `high` items buffered, a fetch when the buffer falls to `low`.
    pub fn levels(&self) -> Levels {
        self.levels
    }

    /// The source.
    pub fn get_ref(&self) -> &S {
        &self.source
    }

    /// The source, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.source
    }

    /// The source, pinned.
    pub fn get_pin_mut(self: Pin<&mut Self>) -> Pin<&mut S> {
        self.project().source
    }

    /// The source. The items still buffered are discarded: counted in
    /// `flowgate_demand_discarded_total`, then passed to the
    /// [`on_drop`](PrefetchBuilder::on_drop) hook, if one is set, in the order the stream
    /// would have yielded them, as [`Dropped::Discarded`]. A fetch error not yet yielded is
    /// dropped with them (it is not an item).
    ///
    /// A fetch in progress stays in progress in the source: a source that keeps it across
    /// polls (as `RedisStreamSource` does) finishes it on its next
    /// [`poll_fetch`](BatchSource::poll_fetch), with up to the `max` it was started with.
    /// Another `Prefetch` over it keeps such a batch whole, even above its `high`.
    ///
    /// # Panics
    ///
    /// When the hook panics (after every item was counted; the items after the one it
    /// panicked on are dropped without the hook).
    pub fn into_inner(self) -> S {
        self.source
    }
}

/// The fetched items not yet handed out, batch by batch as the fetches returned them (no
/// copy), and the accounting of what the stream lets go of. Dropped itself (the stream
/// dropped or taken apart with `into_inner`), it discards every item left: all are counted
/// and the gauge is set to 0 first, then each goes to the hook, in order, as
/// [`Dropped::Discarded`] — so a hook that panics leaves the metrics right.
struct Buffer<T> {
    /// The batch being handed out.
    current: vec::IntoIter<T>,
    /// The batches behind it, with their item count.
    queued: VecDeque<vec::IntoIter<T>>,
    queued_items: usize,
    /// `flowgate_demand_buffered`: set when a batch lands and when the buffer is empty, not
    /// per item (cheap hot path).
    gauge: Gauge,
    on_drop: Option<OnDrop<T>>,
    /// `flowgate_demand_discarded_total`.
    discarded: Counter,
}

impl<T> Buffer<T> {
    fn len(&self) -> usize {
        self.current.len() + self.queued_items
    }

    /// The next buffered item.
    #[inline]
    fn pop(&mut self) -> Option<T> {
        if let Some(item) = self.current.next() {
            return Some(item);
        }
        let mut next = self.queued.pop_front()?;
        self.queued_items -= next.len();
        let item = next.next();
        self.current = next;
        item
    }

    /// A fetched batch lands behind the items buffered.
    fn push(&mut self, batch: Vec<T>) {
        if self.current.len() == 0 && self.queued.is_empty() {
            self.current = batch.into_iter();
        } else if !batch.is_empty() {
            self.queued_items += batch.len();
            self.queued.push_back(batch.into_iter());
        }
    }
}

impl<T> Drop for Buffer<T> {
    fn drop(&mut self) {
        let left = self.len();
        if left == 0 {
            return;
        }
        self.queued_items = 0;
        // Every item to the hook, even if the recorder panics as they are counted (the
        // panic goes on after: see `recorded_then`).
        recorded_then(
            || {
                self.discarded.increment(left as u64);
                self.gauge.set(0.0);
            },
            || {
                if let Some(hook) = &self.on_drop {
                    for item in self.current.by_ref().chain(self.queued.drain(..).flatten()) {
                        hook.call(item, &Dropped::Discarded);
                    }
                }
            },
        );
    }
}

/// Builds a [`Prefetch`] stream; from [`Prefetch::builder`].
#[must_use = "a builder does nothing until `build` is called"]
pub struct PrefetchBuilder<S: BatchSource> {
    source: S,
    levels: Levels,
    /// `(min, max)`, checked by `build`.
    retry_backoff: (Duration, Duration),
    name: Option<String>,
    on_drop: Option<OnDrop<S::Item>>,
}

impl<S: BatchSource + fmt::Debug> fmt::Debug for PrefetchBuilder<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrefetchBuilder")
            .field("source", &self.source)
            .field("levels", &self.levels)
            .field("retry_backoff", &self.retry_backoff)
            .field("name", &self.name)
            .field("on_drop", &self.on_drop.is_some())
            .finish()
    }
}

impl<S: BatchSource> PrefetchBuilder<S> {
    /// The `name` label of the stream's metrics (`flowgate_demand_buffered`,
    /// `flowgate_demand_discarded_total`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Call `hook` with each item still buffered when the stream is dropped or taken apart
    /// with [`into_inner`](Prefetch::into_inner) ([`Dropped::Discarded`]), in the order the
    /// stream would have yielded them. It runs in the task that drops the stream, under no
    /// lock, after every one of those items was counted in
    /// `flowgate_demand_discarded_total` (which counts them with or without a hook). A
    /// hook that panics panics that drop; the items after the one it panicked on are
    /// dropped without the hook, counted all the same.
    ///
    /// A source whose items are settled only when the application finishes them (a
    /// `RedisStreamSource` entry without its `ack`, an offset never committed) delivers them
    /// again (an offset: after a restart, or a seek back, see [`Prefetch`]'s dropping); the
    /// hook is where the items of any other source can be kept, logged or handed back.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use flowgate::demand::{IterSource, Levels, Prefetch};
    /// use flowgate::Dropped;
    /// use futures::StreamExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let lost = Arc::new(Mutex::new(Vec::new()));
    /// let log = lost.clone();
    /// let mut jobs = Prefetch::builder(IterSource::new(0..10u32), Levels::new(4, 1)?)
    ///     .on_drop(move |job: u32, why: &Dropped| log.lock().unwrap().push((job, why.as_str())))
    ///     .build()?
    ///     .items();
    /// assert_eq!(jobs.next().await, Some(0)); // 0..4 were fetched
    /// drop(jobs);
    /// assert_eq!(
    ///     *lost.lock().unwrap(),
    ///     [(1, "discarded"), (2, "discarded"), (3, "discarded")]
    /// );
    /// # Ok(())
    /// # }
    /// ```
    pub fn on_drop(mut self, hook: impl Fn(S::Item, &Dropped) + Send + Sync + 'static) -> Self {
        self.on_drop = Some(OnDrop::new(hook));
        self
    }

    /// How long the fetch after a failed one waits: `min`, doubling after each further failure
    /// up to `max`; a successful fetch starts over at `min`. The default is 10 ms to 1 s. With
    /// `min` zero (or outside a tokio runtime) a failed fetch is retried at once, after the
    /// stream has returned `Pending` once (waking itself): a consumer that goes on after
    /// errors still lets its runtime run other tasks. An empty batch the source answered at
    /// once (it did not wait: a non-blocking poll with nothing new), with nothing buffered,
    /// waits the same way, so an idle source is not polled in a loop; a batch with items, or
    /// an empty one after the source waited (a blocking poll that timed out), starts over
    /// at `min`, and after the latter the next fetch starts at once. A source that ends its
    /// idle periods sooner than `max` allows wants a smaller `max` (or a blocking poll). The
    /// pause is a tokio timer: inside a tokio runtime that runtime must have time enabled (as
    /// for every timed part of flowgate); polled outside any tokio runtime, the stream does
    /// not pause.
    ///
    /// `min` above `max` is refused by [`build`](PrefetchBuilder::build) (`ConfigError` on
    /// `prefetch.retry_backoff`).
    ///
    /// # Panics
    ///
    /// With `min` above zero, polling the built stream panics after a failed fetch, or an
    /// empty batch answered at once with nothing buffered, inside a tokio runtime whose time
    /// driver is disabled.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use flowgate::demand::{IterSource, Levels, Prefetch};
    ///
    /// let source = || IterSource::new(0..10);
    /// let levels = Levels::new(4, 1)?;
    /// let backoff = |min, max| Prefetch::builder(source(), levels).retry_backoff(min, max).build();
    /// assert!(backoff(Duration::ZERO, Duration::from_secs(1)).is_ok());
    /// let e = backoff(Duration::from_secs(2), Duration::from_secs(1)).unwrap_err();
    /// assert_eq!(e.field(), "prefetch.retry_backoff");
    /// # Ok::<(), flowgate::ConfigError>(())
    /// ```
    pub fn retry_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.retry_backoff = (min, max);
        self
    }

    /// Build the stream. It yields `Result`s; over a source that cannot fail, call
    /// [`items`](Prefetch::items) on it for plain items.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `prefetch.retry_backoff` if its `min` is above its `max` (the
    /// levels were checked by [`Levels::new`]).
    pub fn build(self) -> Result<Prefetch<S>, ConfigError> {
        let (min, max) = self.retry_backoff;
        if min > max {
            return Err(ConfigError::new(
                "prefetch.retry_backoff",
                ConfigErrorKind::Inconsistent,
                format!("min {min:?} is above max {max:?}"),
            ));
        }
        let mut prefetch = Prefetch::new(self.source, self.levels, self.name, self.on_drop);
        prefetch.retry_min = min;
        prefetch.retry_max = max;
        prefetch.retry_next = min;
        Ok(prefetch)
    }
}

/// The pause before the next fetch (after a failed one, or an empty one answered at once):
/// `retry_next`, which doubles up to `retry_max`. None with a zero backoff, or outside a
/// tokio runtime (nothing to sleep on: the next fetch is not delayed).
fn backoff(retry_next: &mut Duration, retry_max: Duration) -> Option<Pin<Box<Sleep>>> {
    let wait = *retry_next;
    if wait.is_zero() || tokio::runtime::Handle::try_current().is_err() {
        return None;
    }
    *retry_next = wait.saturating_mul(2).min(retry_max);
    Some(Box::pin(tokio::time::sleep(wait)))
}

const DEFAULT_RETRY_MIN: Duration = Duration::from_millis(10);
const DEFAULT_RETRY_MAX: Duration = Duration::from_secs(1);

/// Names of the prefetch metrics.
pub(crate) mod names {
    pub(crate) const BUFFERED: &str = "flowgate_demand_buffered";
    pub(crate) const DISCARDED: &str = "flowgate_demand_discarded_total";
}

impl<S: BatchSource> Stream for Prefetch<S, Results> {
    type Item = Result<S::Item, S::Error>;

    #[inline]
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.poll_result(cx)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.hint()
    }
}

impl<S: BatchSource<Error = Infallible>> Stream for Prefetch<S, Items> {
    type Item = S::Item;

    #[inline]
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        self.poll_result(cx).map(|next| {
            next.map(|item| match item {
                Ok(item) => item,
                Err(never) => match never {},
            })
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        // The source cannot fail, so `hint` never counts an error item.
        self.hint()
    }
}

impl<S: BatchSource, Y> Prefetch<S, Y> {
    /// `poll_next`, with a fetch error as an `Err` item.
    #[inline]
    fn poll_result(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<S::Item, S::Error>>> {
        // The hot path, small enough to inline into the consumer: above `low`, no fetch in
        // progress, and the current batch not used up.
        let this = self.as_mut().project();
        if *this.fast != 0 {
            *this.fast -= 1;
            if let Some(item) = this.buffer.current.next() {
                return Poll::Ready(Some(Ok(item)));
            }
        }
        self.poll_slow(cx)
    }

    /// `size_hint` of either stream.
    fn hint(&self) -> (usize, Option<usize>) {
        // The buffer is certain; the source says at most how many more it may give (an
        // upper bound of 0 shows the end before the fetch that would find it).
        let lo = self.queued();
        let known = lo + usize::from(self.error.is_some());
        let more = if self.done {
            Some(0)
        } else {
            self.source.size_hint().1
        };
        (lo, more.and_then(|more| known.checked_add(more)))
    }

    /// Sets `fast`: the items `poll_next` may take from `current` before `poll_fetching` has
    /// to look again. A fetch in progress is polled on every poll: none. If no fetch can start
    /// (the source ended, or an error waits to be yielded after the buffered items): all of
    /// `current`. Otherwise the slow path starts a fetch once the buffer is at `low`, so the
    /// hot path stops there.
    fn unchecked(self: Pin<&mut Self>) {
        let this = self.project();
        let current = this.buffer.current.len();
        *this.fast = if this.fetching.is_some() {
            0
        } else if *this.done || this.error.is_some() {
            current
        } else {
            current.min(this.buffer.len().saturating_sub(this.levels.low()))
        };
    }

    /// `poll_next` when a fetch may be due or the current batch is used up.
    #[inline(never)]
    fn poll_slow(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<S::Item, S::Error>>> {
        let next = self.as_mut().poll_fetching(cx);
        self.unchecked();
        next
    }

    /// Polls a fetch that is due or in progress, then hands out the next buffered item.
    fn poll_fetching(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<S::Item, S::Error>>> {
        let mut this = self.project();
        let buffered = this.buffer.len();
        let mut refill = this.fetching.is_some()
            || (buffered <= this.levels.low() && !*this.done && this.error.is_none());
        // Pausing after a failed fetch?
        if refill && let Some(pause) = this.pause.as_mut() {
            if pause.as_mut().poll(cx).is_pending() {
                refill = false;
            } else {
                *this.pause = None;
            }
        }
        // A failed fetch with no pause after it: retried at once, but on the next poll, after
        // yielding to the executor (a consumer that goes on after errors lets the runtime's
        // other tasks run, such as one that brings the source back).
        if refill && std::mem::take(this.yield_first) {
            cx.waker().wake_by_ref();
            refill = false;
        }
        if refill {
            let max = *this.fetching.get_or_insert(this.levels.high() - buffered);
            if let Poll::Ready(result) = this.source.as_mut().poll_fetch(cx, max) {
                *this.fetching = None;
                let waited = std::mem::take(this.waited);
                match result {
                    Some(Ok(batch)) => {
                        // A batch above `max` (a source that finished a fetch started with
                        // a larger one) is kept whole: the buffer is above `high` until it
                        // drains to `low`, and no item is cut off.
                        let fetched = batch.len();
                        if fetched > 0 || waited {
                            *this.retry_next = *this.retry_min;
                        }
                        this.buffer.push(batch);
                        this.buffer.gauge.set((buffered + fetched) as f64);
                        // An empty batch with nothing buffered. Answered at once (a
                        // non-blocking source with nothing new): the next fetch waits the
                        // backoff, so an idle source is not polled in a loop (nor keeps
                        // paused time from moving). After a wait (a blocking poll that
                        // timed out: the source paced itself), or with no backoff: fetch
                        // again at once, after yielding to the executor (never inside one
                        // poll).
                        if buffered + fetched == 0 {
                            if !waited
                                && let Some(mut pause) = backoff(this.retry_next, *this.retry_max)
                                && pause.as_mut().poll(cx).is_pending()
                            {
                                // Polled once: this task is woken when it ends.
                                *this.pause = Some(pause);
                                return Poll::Pending;
                            }
                            cx.waker().wake_by_ref();
                            return Poll::Pending;
                        }
                    }
                    Some(Err(e)) => {
                        *this.error = Some(e);
                        *this.pause = backoff(this.retry_next, *this.retry_max);
                        *this.yield_first = this.pause.is_none();
                    }
                    None => *this.done = true,
                }
            } else {
                *this.waited = true;
            }
        }
        // The gauge is set when a batch lands and when the buffer is empty, not per item
        // (cheap hot path).
        if let Some(item) = this.buffer.pop() {
            return Poll::Ready(Some(Ok(item)));
        }
        // Nothing is buffered when the stream yields an error, waits or ends: the gauge must
        // not keep showing the batch that landed last.
        this.buffer.gauge.set(0.0);
        if let Some(e) = this.error.take() {
            return Poll::Ready(Some(Err(e)));
        }
        if *this.done {
            Poll::Ready(None)
        } else {
            Poll::Pending
        }
    }
}

impl<S: BatchSource, Y> FusedStream for Prefetch<S, Y>
where
    Prefetch<S, Y>: Stream,
{
    fn is_terminated(&self) -> bool {
        self.done && self.queued() == 0 && self.error.is_none()
    }
}

impl<S: BatchSource + fmt::Debug, Y> fmt::Debug for Prefetch<S, Y> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Prefetch")
            .field("source", &self.source)
            .field("name", &self.name)
            .field("queued", &self.queued())
            .field("levels", &self.levels)
            .field("fetching", &self.fetching)
            .field("retry_backoff", &(self.retry_min, self.retry_max))
            .field("on_drop", &self.buffer.on_drop.is_some())
            .finish()
    }
}
