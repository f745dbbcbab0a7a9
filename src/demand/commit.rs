//! `CommitTracker`: commit only the contiguous prefix of finished offsets.

use std::collections::VecDeque;
use std::fmt;
use std::sync::PoisonError;

use crate::demand::error::DemandError;
use crate::sync::{Arc, Mutex, MutexGuard};

#[derive(Debug, Default)]
struct State {
    /// Tracked offsets not yet committable, in order, with their done flags.
    pending: VecDeque<(u64, bool)>,
    last_tracked: Option<u64>,
    committable: Option<u64>,
}

/// Tracks the offsets of one partition and says which may be committed: the highest offset
/// whose predecessors (every offset tracked before it) are all done. It never reports an
/// offset past a gap, so a crash redelivers whatever was not finished (at-least-once).
///
/// Offsets must be tracked in increasing order (gaps in numbering are fine). Tokens complete
/// in any order, from any task. Memory is one entry per tracked offset not yet committable.
///
/// Kafka commits the *next* offset to read: commit `committable() + 1`.
///
/// # Examples
///
/// ```
/// use flowgate::demand::CommitTracker;
///
/// let tracker = CommitTracker::new();
/// let a = tracker.track(10)?;
/// let b = tracker.track(11)?;
/// let c = tracker.track(15)?;
/// c.done();
/// assert_eq!(tracker.committable(), None); // 10 and 11 are not done
/// a.done();
/// assert_eq!(tracker.committable(), Some(10));
/// b.done();
/// assert_eq!(tracker.committable(), Some(15));
/// # Ok::<(), flowgate::demand::DemandError>(())
/// ```
#[derive(Clone, Default)]
pub struct CommitTracker {
    state: Arc<Mutex<State>>,
}

impl CommitTracker {
    /// An empty tracker.
    pub fn new() -> CommitTracker {
        CommitTracker::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Start tracking `offset`; finish it with [`CommitToken::done`].
    ///
    /// # Errors
    ///
    /// [`DemandError::OffsetOutOfOrder`] if `offset` is not above the last tracked offset.
    pub fn track(&self, offset: u64) -> Result<CommitToken, DemandError> {
        let mut st = self.lock();
        if let Some(last) = st.last_tracked
            && offset <= last
        {
            return Err(DemandError::OffsetOutOfOrder { offset, last });
        }
        st.last_tracked = Some(offset);
        st.pending.push_back((offset, false));
        Ok(CommitToken {
            tracker: self.clone(),
            offset,
            finished: false,
        })
    }

    /// The highest offset that may be committed, if any.
    pub fn committable(&self) -> Option<u64> {
        self.lock().committable
    }

    /// Tracked offsets not yet committable (in flight, or done behind a gap).
    pub fn pending(&self) -> usize {
        self.lock().pending.len()
    }

    fn finish(&self, offset: u64) {
        let mut st = self.lock();
        // Offsets are sorted: find it by binary search.
        if let Ok(at) = st.pending.binary_search_by_key(&offset, |&(o, _)| o) {
            st.pending[at].1 = true;
        }
        while let Some(&(o, true)) = st.pending.front() {
            st.committable = Some(o);
            st.pending.pop_front();
        }
    }
}

impl fmt::Debug for CommitTracker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.lock();
        f.debug_struct("CommitTracker")
            .field("committable", &st.committable)
            .field("pending", &st.pending.len())
            .finish()
    }
}

/// One tracked offset. Call [`done`](CommitToken::done) when its work is finished.
///
/// Dropping it without `done` leaves the offset unfinished: nothing at or after it becomes
/// committable in this process, so it is redelivered after a restart. That is the
/// at-least-once guarantee for work that failed or was abandoned.
#[must_use = "an offset is committable only after its token is marked done"]
pub struct CommitToken {
    tracker: CommitTracker,
    offset: u64,
    finished: bool,
}

impl CommitToken {
    /// The offset.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Mark the offset done.
    pub fn done(mut self) {
        self.finished = true;
        self.tracker.finish(self.offset);
    }
}

impl fmt::Debug for CommitToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CommitToken")
            .field("offset", &self.offset)
            .field("finished", &self.finished)
            .finish()
    }
}
