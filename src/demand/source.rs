//! `BatchSource`: a source that fetches up to `max` items per call; `IterSource` and
//! `StreamSource`, the in-memory ones.

use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Stream;
use pin_project::pin_project;

/// What one poll of a [`BatchSource`] returns: a batch, an error, or `None` at the end.
pub type Fetched<T, E> = Poll<Option<Result<Vec<T>, E>>>;

/// A source that fetches items in batches of a size the caller chooses: a Kafka poll,
/// `XREADGROUP COUNT n`, a paged HTTP API.
///
/// `poll_fetch` is poll-based like `Stream::poll_next`: once a call returns `Pending`, the
/// caller polls again with the same `max` until it completes. A fetch returns at most `max`
/// items (possibly none), an error, or `None` at the end of the source. A source that does
/// return more (one taken out of a [`Prefetch`](crate::demand::Prefetch) with `into_inner`
/// mid-fetch finishes that fetch with the `max` it started with) loses nothing: `prefetch`
/// buffers the whole batch, above its `high` until it drains.
///
/// [`prefetch`](crate::demand::prefetch()) yields a fetch error as an `Err` item. A source
/// that cannot fail says so with `Error = `[`Infallible`](std::convert::Infallible), as
/// [`IterSource`] and [`StreamSource`] do; its prefetch stream then yields plain items
/// through [`Prefetch::items`](crate::demand::Prefetch::items).
pub trait BatchSource {
    /// What is fetched.
    type Item;
    /// What a failed fetch reports; [`Infallible`](std::convert::Infallible) for a source
    /// that cannot fail.
    type Error;

    /// Fetch at most `max` items (`max >= 1`: [`prefetch`](crate::demand::prefetch())
    /// never asks for 0). Asked for 0 all the same, a fetch must not answer `None` unless
    /// the source ended: the sources of this crate answer an empty batch, taking nothing.
    fn poll_fetch(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        max: usize,
    ) -> Fetched<Self::Item, Self::Error>;

    /// Bounds on the items the source has yet to give, as [`Stream::size_hint`]: a
    /// [`Prefetch`](crate::demand::Prefetch) adds its buffer to them, and an upper bound of
    /// 0 lets what is built on it (`with_demand`, `watermarks`, which poll an upstream
    /// without credit or room only for its end) see the end without one more unit. The
    /// default, `(0, None)`, knows nothing.
    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, None)
    }
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

    fn size_hint(&self) -> (usize, Option<usize>) {
        S::size_hint(&**self)
    }
}

/// The most items one fetch of an in-memory source takes, whatever `max` is: each poll of a
/// [`prefetch`](crate::demand::prefetch()) over an always-ready source does bounded work (with
/// `high` of `usize::MAX` and an endless source, one unbounded fetch would never return).
const ONE_FETCH: usize = 1024;

/// Any [`Stream`] as a [`BatchSource`] (for tests and simple sources): a fetch takes up to
/// `max` items that are ready, and at most 1024, waiting only for the first. Once the
/// stream returns `None` it is not polled again (a stream need not be fused).
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
        let max = max.min(ONE_FETCH);
        let mut batch = Vec::with_capacity(max);
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
        // A short batch (fewer items were ready than asked for) gives back the room it did
        // not use: a prefetch keeps each batch whole until it is drained, and up to `low + 1`
        // of them at once, so room for `max` in each would hold up to `(low + 1) · max` slots
        // for its `high` items.
        if batch.len() < batch.capacity() / 2 {
            batch.shrink_to_fit();
        }
        Poll::Ready(Some(Ok(batch)))
    }

    /// The stream's own, until it ended.
    fn size_hint(&self) -> (usize, Option<usize>) {
        if self.ended {
            (0, Some(0))
        } else {
            self.stream.size_hint()
        }
    }
}

/// Any [`Iterator`] as a [`BatchSource`]: an in-memory source (a `Vec` of jobs, a range of
/// offsets, a decoder over bytes already read). A fetch takes up to `max` items at once, and
/// at most 1024 (so that one poll does bounded work, however large `max` is; asked for 0,
/// it answers an empty batch and takes nothing); the source is
/// always ready, never fails, and ends the first time the iterator returns `None`
/// (it is not called again). `next` runs inside `poll`, so it must not block: an iterator
/// that does I/O belongs behind a real source.
///
/// # Examples
///
/// ```
/// use flowgate::demand::{prefetch, IterSource, Levels};
/// use futures::StreamExt;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let jobs = vec!["a", "b", "c"];
/// // The source cannot fail: `items()` yields the jobs themselves, not `Result`s.
/// let done: Vec<&str> = prefetch(IterSource::new(jobs), Levels::new(2, 0)?)
///     .items()
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
        if max == 0 {
            // Not the end: nothing was asked for, and nothing is taken.
            return Poll::Ready(Some(Ok(Vec::new())));
        }
        let max = max.min(ONE_FETCH);
        let batch: Vec<I::Item> = this.iter.by_ref().take(max).collect();
        // Fewer than asked: the iterator returned `None`.
        *this.ended = batch.len() < max;
        if batch.is_empty() {
            Poll::Ready(None)
        } else {
            Poll::Ready(Some(Ok(batch)))
        }
    }

    /// The iterator's own, until it ended.
    fn size_hint(&self) -> (usize, Option<usize>) {
        if self.ended {
            (0, Some(0))
        } else {
            self.iter.size_hint()
        }
    }
}
