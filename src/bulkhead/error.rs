//! Why an acquisition was refused.

use std::fmt;

/// Why a [`Bulkhead`](crate::bulkhead::Bulkhead) refused a permit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Rejected {
    /// Every permit is taken and the waiting room is full (load shedding), or this waiter
    /// was shed from the waiting room to make room for critical work.
    WaitingRoomFull,
    /// The wait for a permit exceeded the bulkhead's `wait_timeout`.
    TimedOut,
    /// The bulkhead was closed.
    Closed,
    /// `try_acquire` found no permit free (it never waits).
    NoPermit,
}

impl Rejected {
    /// A stable lowercase name, used as the `reason` label of the rejection metric.
    pub const fn as_str(self) -> &'static str {
        match self {
            Rejected::WaitingRoomFull => "waiting_room_full",
            Rejected::TimedOut => "timed_out",
            Rejected::Closed => "closed",
            Rejected::NoPermit => "no_permit",
        }
    }
}

impl fmt::Display for Rejected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Rejected::WaitingRoomFull => "bulkhead saturated: waiting room full",
            Rejected::TimedOut => "bulkhead saturated: timed out waiting for a permit",
            Rejected::Closed => "bulkhead closed",
            Rejected::NoPermit => "bulkhead saturated: no permit free",
        })
    }
}

impl std::error::Error for Rejected {}

/// The priority of an acquisition.
///
/// Critical work may use the bulkhead's reserved permits, is served before normal work when
/// permits free up, and when the waiting room is full it sheds the newest normal waiter
/// instead of being refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub enum Priority {
    /// Ordinary work: cannot take the critical reserve.
    #[default]
    Normal,
    /// Work that must get through when the dependency is saturated.
    Critical,
}
