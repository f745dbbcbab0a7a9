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
}

impl fmt::Display for DemandError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DemandError::ZeroRequest => f.write_str("request(0): demand must be at least 1"),
            DemandError::OffsetOutOfOrder { offset, last } => write!(
                f,
                "offset {offset} tracked after offset {last}: offsets must increase"
            ),
        }
    }
}

impl std::error::Error for DemandError {}
