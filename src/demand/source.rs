//! `BatchSource`: a source that fetches up to `max` items per call, and `prefetch`.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Stream;
use futures::stream::FusedStream;
use pin_project::pin_project;

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
/// `max` items that are ready, waiting only for the first.
#[pin_project]
#[derive(Debug)]
pub struct StreamSource<S> {
    #[pin]
    stream: S,
}

impl<S> StreamSource<S> {
    /// Wrap `stream`.
    pub fn new(stream: S) -> Self {
        StreamSource { stream }
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
        let mut stream = self.project().stream;
        let mut batch = Vec::with_capacity(max.min(1024));
        while batch.len() < max {
            match stream.as_mut().poll_next(cx) {
                Poll::Ready(Some(item)) => batch.push(item),
                Poll::Ready(None) if batch.is_empty() => return Poll::Ready(None),
                Poll::Ready(None) => break,
                Poll::Pending if batch.is_empty() => return Poll::Pending,
                Poll::Pending => break,
            }
        }
        Poll::Ready(Some(Ok(batch)))
    }
}

/// Stream of [`prefetch`](crate::demand::prefetch): fetches from a [`BatchSource`] exactly
/// what the buffer has room for.
///
/// At most `high` items are fetched but not yet consumed. When the buffer falls to `low`,
/// the next fetch asks for exactly `high − buffered` items — never more — so memory stays
/// bounded and nothing is fetched that downstream has no room for. A fetch error is yielded
/// as an `Err` item (after the items buffered before it); the stream ends when the source
/// does and the buffer is empty.
#[pin_project]
#[must_use = "streams do nothing unless polled"]
pub struct Prefetch<S: BatchSource> {
    #[pin]
    source: S,
    buffer: VecDeque<S::Item>,
    high: usize,
    low: usize,
    /// The `max` of a fetch in progress.
    fetching: Option<usize>,
    error: Option<S::Error>,
    done: bool,
    buffered: Gauge,
}

/// Fetch from `source` by demand: keep at most `high` items buffered, refill when the buffer
/// falls to `low`, asking for exactly `high − buffered`.
///
/// # Errors
///
/// [`ConfigError`] on `prefetch.high` if it is zero, on `prefetch.low` if it is not below
/// `high`.
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
    pub(crate) fn new(
        source: S,
        high: usize,
        low: usize,
        name: Option<&str>,
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
            buffer: VecDeque::with_capacity(high.min(4096)),
            high,
            low,
            fetching: None,
            error: None,
            done: false,
            buffered: Labels::new(name).gauge(names::BUFFERED, &[]),
        })
    }

    /// Items fetched and not yet consumed.
    pub fn buffered(&self) -> usize {
        self.buffer.len()
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

    /// The source; buffered items are dropped.
    pub fn into_inner(self) -> S {
        self.source
    }
}

/// Names of the prefetch metrics.
pub(crate) mod names {
    pub(crate) const BUFFERED: &str = "flowgate_demand_buffered";
}

impl<S: BatchSource> Stream for Prefetch<S> {
    type Item = Result<S::Item, S::Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let mut this = self.project();
        {
            let refill = this.fetching.is_some()
                || (this.buffer.len() <= *this.low && !*this.done && this.error.is_none());
            if refill {
                let max = *this.fetching.get_or_insert(*this.high - this.buffer.len());
                match this.source.as_mut().poll_fetch(cx, max) {
                    Poll::Ready(result) => {
                        *this.fetching = None;
                        match result {
                            Some(Ok(batch)) => {
                                let empty = batch.is_empty();
                                debug_assert!(batch.len() <= max, "source returned more than max");
                                this.buffer.extend(batch);
                                this.buffered.set(this.buffer.len() as f64);
                                // An empty batch with nothing buffered: fetch again, after
                                // yielding to the executor (a source that is always ready
                                // and always empty must not spin inside one poll).
                                if empty && this.buffer.is_empty() {
                                    cx.waker().wake_by_ref();
                                    return Poll::Pending;
                                }
                            }
                            Some(Err(e)) => *this.error = Some(e),
                            None => *this.done = true,
                        }
                    }
                    Poll::Pending => {}
                }
            }
            // The gauge is updated when a batch lands, not per item (cheap hot path).
            if let Some(item) = this.buffer.pop_front() {
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

    fn size_hint(&self) -> (usize, Option<usize>) {
        // The buffer is certain; the source's size is unknown.
        let lo = self.buffer.len();
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

impl<S: BatchSource> FusedStream for Prefetch<S> {
    fn is_terminated(&self) -> bool {
        self.done && self.buffer.is_empty() && self.error.is_none()
    }
}

impl<S: BatchSource + fmt::Debug> fmt::Debug for Prefetch<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Prefetch")
            .field("source", &self.source)
            .field("buffered", &self.buffer.len())
            .field("high", &self.high)
            .field("low", &self.low)
            .field("fetching", &self.fetching)
            .finish()
    }
}
