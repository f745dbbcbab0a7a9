//! `BatchSource`: a source that fetches up to `max` items per call, and `prefetch`.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use std::vec;

use futures::Stream;
use futures::stream::FusedStream;
use pin_project::pin_project;
use tokio::time::Sleep;

use crate::error::{ConfigError, ConfigErrorKind};
use crate::metrics::{Gauge, Labels};

/// What one poll of a [`BatchSource`] returns: a batch, an error, or `None` at the end.
pub type Fetched<T, E> = Poll<Option<Result<Vec<T>, E>>>;

/// A source that fetches items in batches of a size the caller chooses: a Kafka poll,
/// `XREADGROUP COUNT n`, a paged HTTP API.
///
/// `poll_fetch` is poll-based like `Stream::poll_next`: once a call returns `Pending`, the
/// caller polls again with the same `max` until it completes. A fetch returns at most `max`
/// items (possibly none), an error, or `None` at the end of the source.
pub trait BatchSource {
    /// What is fetched.
    type Item;
    /// What a failed fetch reports.
    type Error;

    /// Fetch at most `max` items (`max >= 1`).
    fn poll_fetch(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        max: usize,
    ) -> Fetched<Self::Item, Self::Error>;
}

impl<S: BatchSource + Unpin + ?Sized> BatchSource for &mut S {
    type Item = S::Item;
    type Error = S::Error;

    fn poll_fetch(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        max: usize,
    ) -> Fetched<S::Item, S::Error> {
        S::poll_fetch(Pin::new(&mut **self), cx, max)
    }
}

/// Any [`Stream`] as a [`BatchSource`] (for tests and simple sources): a fetch takes up to
/// `max` items that are ready, waiting only for the first. Once the stream returns `None` it
/// is not polled again (a stream need not be fused).
#[pin_project]
#[derive(Debug)]
pub struct StreamSource<S> {
    #[pin]
    stream: S,
    /// The stream returned `None`: it is not polled again.
    ended: bool,
}

impl<S> StreamSource<S> {
    /// Wrap `stream`.
    pub fn new(stream: S) -> Self {
        StreamSource {
            stream,
            ended: false,
        }
    }

    /// The inner stream.
    pub fn into_inner(self) -> S {
        self.stream
    }
}

impl<S: Stream> BatchSource for StreamSource<S> {
    type Item = S::Item;
    type Error = std::convert::Infallible;

    fn poll_fetch(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        max: usize,
    ) -> Fetched<S::Item, Self::Error> {
        let this = self.project();
        if *this.ended {
            return Poll::Ready(None);
        }
        let mut stream = this.stream;
        let mut batch = Vec::with_capacity(max.min(1024));
        while batch.len() < max {
            match stream.as_mut().poll_next(cx) {
                Poll::Ready(Some(item)) => batch.push(item),
                Poll::Ready(None) => {
                    *this.ended = true;
                    if batch.is_empty() {
                        return Poll::Ready(None);
                    }
                    break;
                }
                Poll::Pending if batch.is_empty() => return Poll::Pending,
                Poll::Pending => break,
            }
        }
        Poll::Ready(Some(Ok(batch)))
    }
}

/// Any [`Iterator`] as a [`BatchSource`]: an in-memory source (a `Vec` of jobs, a range of
/// offsets, a decoder over bytes already read). A fetch takes up to `max` items at once; the
/// source is always ready, never fails, and ends the first time the iterator returns `None`
/// (it is not called again). `next` runs inside `poll`, so it must not block: an iterator
/// that does I/O belongs behind a real source.
///
/// # Examples
///
/// ```
/// use flowgate::demand::{prefetch, IterSource};
/// use futures::StreamExt;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let jobs = vec!["a", "b", "c"];
/// let done: Vec<&str> = prefetch(IterSource::new(jobs), 2, 0)?
///     .map(|r| r.unwrap())
///     .collect()
///     .await;
/// assert_eq!(done, ["a", "b", "c"]);
/// # Ok(())
/// # }
/// ```
#[pin_project]
#[derive(Debug, Clone)]
pub struct IterSource<I> {
    iter: I,
    ended: bool,
}

impl<I: Iterator> IterSource<I> {
    /// Wrap `iter` (anything that turns into an iterator).
    pub fn new(iter: impl IntoIterator<IntoIter = I>) -> Self {
        IterSource {
            iter: iter.into_iter(),
            ended: false,
        }
    }

    /// The inner iterator, with the items not fetched yet.
    pub fn into_inner(self) -> I {
        self.iter
    }
}

impl<I: Iterator> BatchSource for IterSource<I> {
    type Item = I::Item;
    type Error = std::convert::Infallible;

    fn poll_fetch(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        max: usize,
    ) -> Fetched<I::Item, Self::Error> {
        let this = self.project();
        if *this.ended {
            return Poll::Ready(None);
        }
        let batch: Vec<I::Item> = this.iter.by_ref().take(max).collect();
        // Fewer than `max`: the iterator returned `None`.
        *this.ended = batch.len() < max;
        if batch.is_empty() {
            Poll::Ready(None)
        } else {
            Poll::Ready(Some(Ok(batch)))
        }
    }
}

/// Stream of [`prefetch`](crate::demand::prefetch): fetches from a [`BatchSource`] exactly
/// what the buffer has room for.
///
/// At most `high` items are fetched but not yet consumed. When the buffer falls to `low`,
/// the next fetch asks for exactly `high − buffered` items — never more — so memory stays
/// bounded and nothing is fetched that downstream has no room for. A fetch error is yielded
/// as an `Err` item (after the items buffered before it), and the next fetch waits (10 ms,
/// doubling up to 1 s while fetches keep failing; see
/// [`retry_backoff`](PrefetchBuilder::retry_backoff)), so a loop that logs errors and goes
/// on does not hammer a source that is down. The stream ends when the source does and the
/// buffer is empty.
///
/// # Panics
///
/// Polling panics after a failed fetch inside a tokio runtime whose time driver is disabled
/// (unless the retry backoff is zero); see [`retry_backoff`](PrefetchBuilder::retry_backoff).
#[pin_project]
#[must_use = "streams do nothing unless polled"]
pub struct Prefetch<S: BatchSource> {
    #[pin]
    source: S,
    /// Fetched items, batch by batch, as the fetches returned them (no copy): the batch
    /// being handed out, and the ones behind it with their item count.
    current: vec::IntoIter<S::Item>,
    /// How many items of `current` the hot path may hand out unchecked: those the slow path
    /// would hand out without starting or polling a fetch (set by `unchecked`).
    fast: usize,
    queued: VecDeque<vec::IntoIter<S::Item>>,
    queued_items: usize,
    high: usize,
    low: usize,
    /// The `max` of a fetch in progress.
    fetching: Option<usize>,
    error: Option<S::Error>,
    done: bool,
    buffered: Gauge,
    /// After a failed fetch the next one waits `retry_next`: `retry_min`, doubling after each
    /// further failure up to `retry_max`.
    retry_min: Duration,
    retry_max: Duration,
    retry_next: Duration,
    /// Boxed only when a fetch failed, so the stream stays `Unpin` when its source is.
    pause: Option<Pin<Box<Sleep>>>,
    name: Option<String>,
}

/// Fetch from `source` by demand: keep at most `high` items buffered, refill when the buffer
/// falls to `low`, asking for exactly `high − buffered`. Unnamed: to set the `name` label of
/// its metrics, use [`Prefetch::builder`].
///
/// # Errors
///
/// [`ConfigError`] on `prefetch.high` if it is zero, on `prefetch.low` if it is not below
/// `high`.
///
/// # Panics
///
/// Polling the stream panics after a failed fetch if it runs inside a tokio runtime whose
/// time driver is disabled (the pause before the next fetch is a tokio timer). Outside any
/// tokio runtime it does not pause, and does not panic.
///
/// # Examples
///
/// ```
/// use flowgate::demand::{prefetch, StreamSource};
/// use futures::StreamExt;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let source = StreamSource::new(futures::stream::iter(0..10));
/// let items: Vec<u32> = prefetch(source, 4, 1)?.map(|r| r.unwrap()).collect().await;
/// assert_eq!(items, (0..10).collect::<Vec<_>>());
/// # Ok(())
/// # }
/// ```
pub fn prefetch<S: BatchSource>(
    source: S,
    high: usize,
    low: usize,
) -> Result<Prefetch<S>, ConfigError> {
    Prefetch::new(source, high, low, None)
}

impl<S: BatchSource> Prefetch<S> {
    /// A builder, to give the stream a name and a retry backoff:
    /// `Prefetch::builder(source, high, low)` is [`prefetch`] with options.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use flowgate::demand::{IterSource, Prefetch};
    /// use futures::StreamExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let stream = Prefetch::builder(IterSource::new(0..10), 4, 1)
    ///     .name("orders")
    ///     .retry_backoff(Duration::from_millis(50), Duration::from_secs(5))
    ///     .build()?;
    /// assert_eq!(stream.name(), Some("orders"));
    /// assert_eq!(stream.map(|r| r.unwrap()).count().await, 10);
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(source: S, high: usize, low: usize) -> PrefetchBuilder<S> {
        PrefetchBuilder {
            source,
            high,
            low,
            retry_backoff: (DEFAULT_RETRY_MIN, DEFAULT_RETRY_MAX),
            name: None,
        }
    }

    pub(crate) fn new(
        source: S,
        high: usize,
        low: usize,
        name: Option<String>,
    ) -> Result<Self, ConfigError> {
        if high == 0 {
            return Err(ConfigError::zero("prefetch.high"));
        }
        if low >= high {
            return Err(ConfigError::new(
                "prefetch.low",
                ConfigErrorKind::Inconsistent,
                format!("{low} must be below high ({high})"),
            ));
        }
        Ok(Prefetch {
            source,
            current: Vec::new().into_iter(),
            fast: 0,
            queued: VecDeque::new(),
            queued_items: 0,
            high,
            low,
            fetching: None,
            error: None,
            done: false,
            buffered: Labels::new(name.as_deref()).gauge(names::BUFFERED, &[]),
            retry_min: DEFAULT_RETRY_MIN,
            retry_max: DEFAULT_RETRY_MAX,
            retry_next: DEFAULT_RETRY_MIN,
            pause: None,
            name,
        })
    }

    /// The `name` label of this stream's metrics, if it was given one.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// Items fetched and not yet consumed.
    pub fn buffered(&self) -> usize {
        self.current.len() + self.queued_items
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

    /// The next buffered item.
    #[inline]
    fn pop(
        current: &mut vec::IntoIter<S::Item>,
        queued: &mut VecDeque<vec::IntoIter<S::Item>>,
        queued_items: &mut usize,
    ) -> Option<S::Item> {
        if let Some(item) = current.next() {
            return Some(item);
        }
        let mut next = queued.pop_front()?;
        *queued_items -= next.len();
        let item = next.next();
        *current = next;
        item
    }

    /// The source; buffered items are dropped.
    pub fn into_inner(self) -> S {
        self.source
    }
}

/// Builds a [`Prefetch`] stream; from [`Prefetch::builder`].
#[derive(Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct PrefetchBuilder<S> {
    source: S,
    high: usize,
    low: usize,
    /// `(min, max)`, checked by `build`.
    retry_backoff: (Duration, Duration),
    name: Option<String>,
}

impl<S: BatchSource> PrefetchBuilder<S> {
    /// The `name` label of the stream's metrics (`flowgate_demand_buffered`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// How long the fetch after a failed one waits: `min`, doubling after each further failure
    /// up to `max`; a successful fetch starts over at `min`. The default is 10 ms to 1 s. With
    /// `min` zero a failed fetch is retried at once. The pause is a tokio timer: inside a tokio
    /// runtime that runtime must have time enabled (as for every timed part of flowgate);
    /// polled outside any tokio runtime, the stream does not pause.
    ///
    /// `min` above `max` is refused by [`build`](PrefetchBuilder::build) (`ConfigError` on
    /// `prefetch.retry_backoff`).
    ///
    /// # Panics
    ///
    /// With `min` above zero, polling the built stream panics after a failed fetch inside a
    /// tokio runtime whose time driver is disabled.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use flowgate::demand::{IterSource, Prefetch};
    ///
    /// let source = || IterSource::new(0..10);
    /// let backoff = |min, max| Prefetch::builder(source(), 4, 1).retry_backoff(min, max).build();
    /// assert!(backoff(Duration::ZERO, Duration::from_secs(1)).is_ok());
    /// let e = backoff(Duration::from_secs(2), Duration::from_secs(1)).unwrap_err();
    /// assert_eq!(e.field(), "prefetch.retry_backoff");
    /// ```
    pub fn retry_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.retry_backoff = (min, max);
        self
    }

    /// Build the stream.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `prefetch.high` if it is zero, on `prefetch.low` if it is not below
    /// `high`, on `prefetch.retry_backoff` if its `min` is above its `max`.
    pub fn build(self) -> Result<Prefetch<S>, ConfigError> {
        let (min, max) = self.retry_backoff;
        let mut prefetch = Prefetch::new(self.source, self.high, self.low, self.name)?;
        if min > max {
            return Err(ConfigError::new(
                "prefetch.retry_backoff",
                ConfigErrorKind::Inconsistent,
                format!("min {min:?} is above max {max:?}"),
            ));
        }
        prefetch.retry_min = min;
        prefetch.retry_max = max;
        prefetch.retry_next = min;
        Ok(prefetch)
    }
}

const DEFAULT_RETRY_MIN: Duration = Duration::from_millis(10);
const DEFAULT_RETRY_MAX: Duration = Duration::from_secs(1);

/// Names of the prefetch metrics.
pub(crate) mod names {
    pub(crate) const BUFFERED: &str = "flowgate_demand_buffered";
}

impl<S: BatchSource> Stream for Prefetch<S> {
    type Item = Result<S::Item, S::Error>;

    #[inline]
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        // The hot path, small enough to inline into the consumer: above `low`, no fetch in
        // progress, and the current batch not used up.
        let this = self.as_mut().project();
        if *this.fast != 0 {
            *this.fast -= 1;
            if let Some(item) = this.current.next() {
                return Poll::Ready(Some(Ok(item)));
            }
        }
        self.poll_slow(cx)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        // The buffer is certain; the source's size is unknown.
        let lo = self.buffered();
        (
            lo,
            if self.done {
                Some(lo + usize::from(self.error.is_some()))
            } else {
                None
            },
        )
    }
}

impl<S: BatchSource> Prefetch<S> {
    /// Sets `fast`: the items `poll_next` may take from `current` before `poll_fetching` has
    /// to look again. A fetch in progress is polled on every poll: none. If no fetch can start
    /// (the source ended, or an error waits to be yielded after the buffered items): all of
    /// `current`. Otherwise the slow path starts a fetch once the buffer is at `low`, so the
    /// hot path stops there.
    fn unchecked(self: Pin<&mut Self>) {
        let this = self.project();
        let current = this.current.len();
        *this.fast = if this.fetching.is_some() {
            0
        } else if *this.done || this.error.is_some() {
            current
        } else {
            current.min((current + *this.queued_items).saturating_sub(*this.low))
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
        let buffered = this.current.len() + *this.queued_items;
        let mut refill = this.fetching.is_some()
            || (buffered <= *this.low && !*this.done && this.error.is_none());
        // Pausing after a failed fetch?
        if refill && let Some(pause) = this.pause.as_mut() {
            if pause.as_mut().poll(cx).is_pending() {
                refill = false;
            } else {
                *this.pause = None;
            }
        }
        if refill {
            let max = *this.fetching.get_or_insert(*this.high - buffered);
            if let Poll::Ready(result) = this.source.as_mut().poll_fetch(cx, max) {
                *this.fetching = None;
                match result {
                    Some(Ok(batch)) => {
                        debug_assert!(batch.len() <= max, "source returned more than max");
                        *this.retry_next = *this.retry_min;
                        let fetched = batch.len();
                        if this.current.len() == 0 && this.queued.is_empty() {
                            *this.current = batch.into_iter();
                        } else if fetched > 0 {
                            this.queued.push_back(batch.into_iter());
                            *this.queued_items += fetched;
                        }
                        this.buffered.set((buffered + fetched) as f64);
                        // An empty batch with nothing buffered: fetch again, after yielding
                        // to the executor (a source that is always ready and always empty
                        // must not spin inside one poll).
                        if buffered + fetched == 0 {
                            cx.waker().wake_by_ref();
                            return Poll::Pending;
                        }
                    }
                    Some(Err(e)) => {
                        *this.error = Some(e);
                        let wait = *this.retry_next;
                        if !wait.is_zero() && tokio::runtime::Handle::try_current().is_ok() {
                            *this.pause = Some(Box::pin(tokio::time::sleep(wait)));
                            *this.retry_next = wait.saturating_mul(2).min(*this.retry_max);
                        }
                    }
                    None => *this.done = true,
                }
            }
        }
        // The gauge is updated when a batch lands, not per item (cheap hot path).
        if let Some(item) = Self::pop(this.current, this.queued, this.queued_items) {
            return Poll::Ready(Some(Ok(item)));
        }
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

impl<S: BatchSource> FusedStream for Prefetch<S> {
    fn is_terminated(&self) -> bool {
        self.done && self.buffered() == 0 && self.error.is_none()
    }
}

impl<S: BatchSource + fmt::Debug> fmt::Debug for Prefetch<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Prefetch")
            .field("source", &self.source)
            .field("name", &self.name)
            .field("buffered", &self.buffered())
            .field("high", &self.high)
            .field("low", &self.low)
            .field("fetching", &self.fetching)
            .field("retry_backoff", &(self.retry_min, self.retry_max))
            .finish()
    }
}
