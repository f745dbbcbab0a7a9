//! `FlowStreamExt` and `FlowSinkExt`: every flowgate combinator, as a method.

use std::future::Future;

use futures::{Sink, Stream};

use crate::bulkhead::{Bulkhead, BulkheadMap, BulkheadMapUnordered, BulkheadSpawnMap};

/// flowgate's stream combinators, for every [`Stream`].
///
/// In the [`prelude`](crate::prelude).
pub trait FlowStreamExt: Stream {
    /// Map each item to a future and run at most the bulkhead's limit of them at once
    /// (shared with everything else using `bulkhead`); outputs in input order, like
    /// `buffered`. Waits for permits, never rejects.
    ///
    /// See the [`bulkhead`](crate::bulkhead) module for when to use which adapter.
    ///
    /// # Examples
    ///
    /// ```
    /// use flowgate::prelude::*;
    /// use flowgate::bulkhead::Bulkhead;
    /// use futures::StreamExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let db = Bulkhead::new(4)?;
    /// let out: Vec<u32> = futures::stream::iter(1..=10)
    ///     .bulkhead_map(db.clone(), |x| async move { x * 10 })
    ///     .collect()
    ///     .await;
    /// assert_eq!(out, (1..=10).map(|x| x * 10).collect::<Vec<_>>());
    /// assert_eq!(db.in_flight(), 0);
    /// # Ok(())
    /// # }
    /// ```
    fn bulkhead_map<F, Fut>(self, bulkhead: Bulkhead, f: F) -> BulkheadMap<Self, F, Fut>
    where
        Self: Sized,
        F: FnMut(Self::Item) -> Fut,
        Fut: Future,
    {
        BulkheadMap::new(self, &bulkhead, f)
    }

    /// As [`bulkhead_map`](FlowStreamExt::bulkhead_map), with outputs in completion order,
    /// like `buffer_unordered`.
    fn bulkhead_map_unordered<F, Fut>(
        self,
        bulkhead: Bulkhead,
        f: F,
    ) -> BulkheadMapUnordered<Self, F, Fut>
    where
        Self: Sized,
        F: FnMut(Self::Item) -> Fut,
        Fut: Future,
    {
        BulkheadMapUnordered::new(self, &bulkhead, f)
    }

    /// As [`bulkhead_map_unordered`](FlowStreamExt::bulkhead_map_unordered), but each mapped
    /// future runs on its own tokio task, so it keeps making progress (and returns its
    /// permit) while the consumer is busy.
    fn bulkhead_spawn_map<F, Fut>(self, bulkhead: Bulkhead, f: F) -> BulkheadSpawnMap<Self, F, Fut>
    where
        Self: Sized,
        F: FnMut(Self::Item) -> Fut,
        Fut: Future + Send + 'static,
        Fut::Output: Send + 'static,
    {
        BulkheadSpawnMap::new(self, &bulkhead, f)
    }
}

impl<S: Stream + ?Sized> FlowStreamExt for S {}

/// flowgate's sink combinators, for every [`Sink`].
///
/// In the [`prelude`](crate::prelude).
pub trait FlowSinkExt<Item>: Sink<Item> {}

impl<Item, S: Sink<Item> + ?Sized> FlowSinkExt<Item> for S {}
