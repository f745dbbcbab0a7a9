//! Errors of the demand module.

use std::fmt;

/// A demand or commit call that was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DemandError {
    /// `request(0)`: a request must be for at least one item.
    ZeroRequest,
    /// `track(offset)` with an offset not above the last tracked one.
    OffsetOutOfOrder {
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
}

impl fmt::Display for DemandError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DemandError::ZeroRequest => f.write_str("request(0): demand must be at least 1"),
            DemandError::OffsetOutOfOrder { offset, last } => write!(
                f,
                "offset {offset} tracked after offset {last}: offsets must increase"
            ),
            DemandError::PendingFull {
                offset,
                oldest,
                max_pending,
            } => write!(
                f,
                "offset {offset} not tracked: {max_pending} offsets are pending behind \
                 unfinished offset {oldest}"
            ),
        }
    }
}

impl std::error::Error for DemandError {}
