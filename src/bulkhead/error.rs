//! Why an acquisition got no permit, and the priority of an acquisition.

use std::fmt;

/// Why a [`Bulkhead`](crate::bulkhead::Bulkhead) gave no permit: the error of `acquire`,
/// `try_acquire` and `run`.
///
/// Apart from [`Closed`](AcquireError::Closed), each variant is a way the bulkhead *sheds*
/// work because it is saturated: the waiting room is full, the wait took too long, no permit
/// is free for a `try_acquire`, or a critical acquisition pushed this waiter out. Shedding is
/// cheap and early, and takes nothing from the dependency behind the bulkhead.
///
/// # Examples
///
/// ```
/// use flowgate::bulkhead::{AcquireError, Bulkhead};
///
/// let db = Bulkhead::new(1)?;
/// let _held = db.try_acquire()?;
/// let err = db.try_acquire().unwrap_err();
/// assert_eq!(err, AcquireError::NoPermit);
/// assert_eq!(err.to_string(), "bulkhead saturated: no permit free");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AcquireError {
    /// Shed: every permit is taken and the waiting room is full, or this waiter was shed
    /// from the waiting room to make room for critical work.
    WaitingRoomFull,
    /// Shed: the wait for a permit exceeded the bulkhead's `wait_timeout`.
    TimedOut,
    /// The bulkhead was closed.
    Closed,
    /// Shed: `try_acquire` found no permit free (it never waits).
    NoPermit,
}

impl AcquireError {
    /// A stable lowercase name, used as the `reason` label of the
    /// `flowgate_bulkhead_rejected_total` metric.
    pub const fn as_str(self) -> &'static str {
        match self {
            AcquireError::WaitingRoomFull => "waiting_room_full",
            AcquireError::TimedOut => "timed_out",
            AcquireError::Closed => "closed",
            AcquireError::NoPermit => "no_permit",
        }
    }
}

impl fmt::Display for AcquireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AcquireError::WaitingRoomFull => "bulkhead saturated: waiting room full",
            AcquireError::TimedOut => "bulkhead saturated: timed out waiting for a permit",
            AcquireError::Closed => "bulkhead closed",
            AcquireError::NoPermit => "bulkhead saturated: no permit free",
        })
    }
}

impl std::error::Error for AcquireError {}

/// The priority of an acquisition.
///
/// Critical work may use the bulkhead's reserved permits, is served before normal work when
/// permits free up, and when the waiting room is full it sheds the newest normal waiter
/// there instead of being refused. A room with no normal waiter in it (every waiter
/// critical, or a room of size zero) refuses critical work too, with
/// [`AcquireError::WaitingRoomFull`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub enum Priority {
    /// Ordinary work: cannot take the critical reserve.
    #[default]
    Normal,
    /// Work that must get through when the dependency is saturated.
    Critical,
}
