//! Errors of the demand module, one per verb: [`RequestError`] for
//! [`DemandHandle::request`](super::DemandHandle::request), [`TrackError`] for
//! [`CommitTracker::track`](super::CommitTracker::track).

use std::fmt;

/// A [`request`](super::DemandHandle::request) that was refused; no credit was added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RequestError {
    /// `request(0)`: a request must be for at least one item (Reactive Streams rule 3.9).
    Zero,
}

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestError::Zero => f.write_str("request(0): demand must be at least 1"),
        }
    }
}

impl std::error::Error for RequestError {}

/// A [`track`](super::CommitTracker::track) that was refused; nothing was tracked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TrackError {
    /// `track(offset)` with an offset not above the last tracked one.
    OutOfOrder {
        /// The offset passed.
        offset: u64,
        /// The last offset tracked.
        last: u64,
    },
    /// `track(offset)` while the tracker holds its
    /// [`max_pending`](crate::demand::CommitTracker::max_pending) offsets: nothing was
    /// tracked. Commits wait for `oldest`; track `offset` again once there is room.
    PendingFull {
        /// The offset passed.
        offset: u64,
        /// The oldest pending offset: the one every later commit waits for.
        oldest: u64,
        /// The bound that was reached.
        max_pending: usize,
    },
    /// `track(u64::MAX)`: the offset has no next one, so the commit that would follow it,
    /// `committable() + 1` (Kafka commits the next offset to read), cannot be written. The
    /// largest offset a tracker takes is `u64::MAX - 1`.
    NoNextOffset {
        /// The offset passed (`u64::MAX`).
        offset: u64,
    },
}

impl fmt::Display for TrackError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TrackError::OutOfOrder { offset, last } => write!(
                f,
                "offset {offset} tracked after offset {last}: offsets must increase"
            ),
            TrackError::PendingFull {
                offset,
                oldest,
                max_pending,
            } => write!(
                f,
                "offset {offset} not tracked: the tracker holds its {max_pending} pending \
                 offsets, from unfinished offset {oldest} on"
            ),
            TrackError::NoNextOffset { offset } => write!(
                f,
                "offset {offset} not tracked: it has no next offset to commit \
                 (committable() + 1); offsets go up to {}",
                u64::MAX - 1
            ),
        }
    }
}

impl std::error::Error for TrackError {}
