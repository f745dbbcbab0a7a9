//! Helpers that drive a stream or a runtime to a point and check what the docs promise on
//! the way.

use std::task::Poll;
use std::time::Duration;

use futures::{Stream, StreamExt, poll};

/// Drives `s` to its end, checking before every poll that what is still to come lies
/// within its `size_hint`; a poll that waits is followed by 1 ms of (paused) time.
pub async fn drain_checking_hints<S: Stream + Unpin>(mut s: S) -> Vec<S::Item> {
    let mut hints = Vec::new();
    let mut out = Vec::new();
    loop {
        hints.push((out.len(), s.size_hint()));
        match poll!(s.next()) {
            Poll::Ready(Some(x)) => out.push(x),
            Poll::Ready(None) => break,
            Poll::Pending => tokio::time::sleep(Duration::from_millis(1)).await,
        }
    }
    for (seen, (lo, hi)) in hints {
        let left = out.len() - seen;
        assert!(
            lo <= left,
            "after {seen} items: lower bound {lo}, {left} came"
        );
        if let Some(hi) = hi {
            assert!(
                left <= hi,
                "after {seen} items: upper bound {hi}, {left} came"
            );
        }
    }
    out
}

/// Waits (up to 10 s) until the current runtime runs `n` tasks; returns how many it runs.
pub async fn alive_until(n: usize) -> usize {
    let metrics = tokio::runtime::Handle::current().metrics();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while metrics.num_alive_tasks() != n && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    metrics.num_alive_tasks()
}
