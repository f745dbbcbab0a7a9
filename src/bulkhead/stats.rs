//! `BulkheadStats`: how a bulkhead's acquisitions ended, and what it holds now.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::bulkhead::error::AcquireError;

/// How the acquisitions of a [`Bulkhead`](crate::bulkhead::Bulkhead) ended since it was
/// built, and what it holds now; from [`Bulkhead::stats`](crate::bulkhead::Bulkhead::stats)
/// (shared by every clone).
///
/// An *acquisition* is one [`try_acquire`](crate::bulkhead::Bulkhead::try_acquire) call (any
/// of its forms), one [`acquire`](crate::bulkhead::Bulkhead::acquire) future (any of its
/// forms, and [`run`](crate::bulkhead::Bulkhead::run)) once it was first polled, and each
/// permit a stream adapter asks for its next item. Each one is counted once, as it ends, in
/// exactly one of `admitted`, the refusals by reason (`waiting_room_full`, `timed_out`,
/// `no_permit`: shed, see [`shed`](BulkheadStats::shed); `closed`) and `cancelled`:
/// [`acquisitions`](BulkheadStats::acquisitions) is their sum. Not counted: an `acquire`
/// future dropped before its first poll (it asked for nothing), one still waiting (it is in
/// `waiting`), and a permit a stream adapter passes straight from a finished item to its
/// next one (no new acquisition: it never went back to the bulkhead).
///
/// The refusals are those of `flowgate_bulkhead_rejected_total{reason}`, counted at the same
/// place; `in_flight` and `waiting` are what the `flowgate_bulkhead_in_flight` and
/// `flowgate_bulkhead_waiting` gauges show; `waited` counts the waits whose lengths
/// `flowgate_bulkhead_wait_seconds` records, one sample each: the waits in the queue that
/// ended with a permit, the stream adapters' included. The counts are read one after the
/// other: under concurrent use each is exact, but they need not all be of one instant.
///
/// # Examples
///
/// ```
/// use flowgate::bulkhead::{AcquireError, Bulkhead, Priority};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let db = Bulkhead::builder(2).critical_reserve(1).max_waiting(0).build()?;
/// let normal = db.acquire().await?;
/// assert_eq!(db.try_acquire().unwrap_err(), AcquireError::NoPermit);
/// assert_eq!(db.acquire().await.unwrap_err(), AcquireError::WaitingRoomFull);
/// let critical = db.acquire_with(Priority::Critical).await?; // the reserve
/// let stats = db.stats();
/// assert_eq!((stats.in_flight, stats.reserve_in_flight), (2, 1));
/// assert_eq!((stats.admitted, stats.admitted_from_reserve), (2, 1));
/// assert_eq!((stats.no_permit, stats.waiting_room_full, stats.shed()), (1, 1, 2));
/// assert_eq!(stats.acquisitions(), 4);
/// drop((normal, critical));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct BulkheadStats {
    /// Permits in flight now ([`in_flight`](crate::bulkhead::Bulkhead::in_flight)).
    pub in_flight: usize,
    /// Acquisitions waiting for a permit now ([`waiting`](crate::bulkhead::Bulkhead::waiting):
    /// those in the waiting room and the stream adapters').
    pub waiting: usize,
    /// Permits of the critical reserve in flight now: the permits in flight beyond the share
    /// normal work may take (`max_in_flight` minus the reserve), at most the reserve. Always
    /// 0 without a [`critical_reserve`](crate::bulkhead::BulkheadBuilder::critical_reserve).
    /// Worked out from the counts, not from who holds the permits: after `max_in_flight` is
    /// lowered below the permits out, those of normal work beyond the new share count here
    /// too (4 permits with a reserve of 1, 3 normal ones out, lowered to 2: 1), until they
    /// come back.
    pub reserve_in_flight: usize,
    /// Acquisitions that got a permit, at once or after waiting.
    pub admitted: u64,
    /// Of `admitted`, those that waited in the queue for their permit (the others found one
    /// free at once): as many as `flowgate_bulkhead_wait_seconds` has samples. A stream
    /// adapter that waits for its own work to return a permit does so outside the queue
    /// (the permit it then finds free is admitted at once).
    pub waited: u64,
    /// Of `admitted`, the critical ones that took a permit of the critical reserve: one that
    /// normal work could not have taken then.
    pub admitted_from_reserve: u64,
    /// Shed with [`AcquireError::WaitingRoomFull`]: at once, because the waiting room was
    /// full, or later, pushed out of it by critical work.
    pub waiting_room_full: u64,
    /// Shed with [`AcquireError::TimedOut`]: waited longer than the `wait_timeout`.
    pub timed_out: u64,
    /// Shed with [`AcquireError::NoPermit`]: a `try_acquire` found no permit free.
    pub no_permit: u64,
    /// Refused with [`AcquireError::Closed`]: the bulkhead was closed (when it was asked, or
    /// while the acquisition waited).
    pub closed: u64,
    /// Given up while waiting: an `acquire` future (or a stream adapter) dropped in the
    /// queue, before it got a permit or a refusal. A permit granted to it as it was dropped
    /// went back to the bulkhead: it counts here, not in `admitted`.
    pub cancelled: u64,
}

impl BulkheadStats {
    /// The acquisitions refused for `reason`: the count of
    /// `flowgate_bulkhead_rejected_total{reason}`.
    pub fn refused(&self, reason: AcquireError) -> u64 {
        match reason {
            AcquireError::WaitingRoomFull => self.waiting_room_full,
            AcquireError::TimedOut => self.timed_out,
            AcquireError::Closed => self.closed,
            AcquireError::NoPermit => self.no_permit,
        }
    }

    /// Acquisitions shed because the bulkhead was saturated, every reason together:
    /// `waiting_room_full + timed_out + no_permit` (a refusal by the close is not shedding).
    pub fn shed(&self) -> u64 {
        self.waiting_room_full + self.timed_out + self.no_permit
    }

    /// Every acquisition that ended: `admitted + shed() + closed + cancelled`.
    pub fn acquisitions(&self) -> u64 {
        self.admitted + self.shed() + self.closed + self.cancelled
    }
}

/// Where each count is in [`Counts`]: the refusals first, at their [`AcquireError`]'s index
/// (as in the metrics), then these.
const AT_ONCE: usize = 4;
const WAITED: usize = 5;
const FROM_RESERVE: usize = 6;
const CANCELLED: usize = 7;

/// The counters behind [`BulkheadStats`]: relaxed atomic adds, no lock. Each way an
/// acquisition ends adds to one of them (a permit of the reserve to `FROM_RESERVE` too).
#[derive(Debug, Default)]
pub(crate) struct Counts([AtomicU64; 8]);

impl Counts {
    #[inline]
    fn add(&self, i: usize) {
        self.0[i].fetch_add(1, Ordering::Relaxed);
    }

    fn get(&self, i: usize) -> u64 {
        self.0[i].load(Ordering::Relaxed)
    }

    /// An acquisition got a permit without waiting (`reserve`: one of the critical reserve).
    #[inline]
    pub(crate) fn at_once(&self, reserve: bool) {
        self.add(AT_ONCE);
        if reserve {
            self.add(FROM_RESERVE);
        }
    }

    /// An acquisition got the permit it waited for (`reserve`: one of the critical reserve).
    pub(crate) fn waited(&self, reserve: bool) {
        self.add(WAITED);
        if reserve {
            self.add(FROM_RESERVE);
        }
    }

    /// An acquisition was refused.
    pub(crate) fn refused(&self, why: AcquireError) {
        self.add(why as usize);
    }

    /// An acquisition gave up while it waited.
    pub(crate) fn cancelled(&self) {
        self.add(CANCELLED);
    }

    /// The counts, with what the bulkhead holds now.
    pub(crate) fn stats(
        &self,
        in_flight: usize,
        waiting: usize,
        reserve_in_flight: usize,
    ) -> BulkheadStats {
        let at_once = self.get(AT_ONCE);
        let waited = self.get(WAITED);
        BulkheadStats {
            in_flight,
            waiting,
            reserve_in_flight,
            admitted: at_once + waited,
            waited,
            admitted_from_reserve: self.get(FROM_RESERVE),
            waiting_room_full: self.get(AcquireError::WaitingRoomFull as usize),
            timed_out: self.get(AcquireError::TimedOut as usize),
            no_permit: self.get(AcquireError::NoPermit as usize),
            closed: self.get(AcquireError::Closed as usize),
            cancelled: self.get(CANCELLED),
        }
    }
}
