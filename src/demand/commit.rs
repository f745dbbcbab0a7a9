//! `CommitTracker`: commit only the contiguous prefix of finished offsets.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::PoisonError;
use std::task::{Context, Poll};

use crate::demand::error::TrackError;
use crate::error::ConfigError;
use crate::metrics::{Counter, Gauge, Labels};
use crate::sync::{Arc, Deferred, Key, Mutex, MutexGuard, Panics, WaiterList};

/// The bound on pending offsets of [`CommitTracker::new`].
pub const DEFAULT_MAX_PENDING: usize = 65_536;

/// Where a tracked offset stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mark {
    /// Its token is alive.
    InFlight,
    /// [`CommitToken::done`].
    Done,
    /// [`CommitToken::abandon`]: given up, committed past like a done offset.
    Abandoned,
    /// The token was dropped unfinished: commits stop before it in this process.
    Dropped,
}

impl Mark {
    /// Whether commits may move past an offset so marked.
    fn is_finished(self) -> bool {
        matches!(self, Mark::Done | Mark::Abandoned)
    }
}

#[derive(Debug, Default)]
struct State {
    /// Tracked offsets not yet committable, in order, with their marks.
    pending: VecDeque<(u64, Mark)>,
    last_tracked: Option<u64>,
    committable: Option<u64>,
    abandoned: u64,
    dropped: u64,
    /// Tasks in [`CommitTracker::until_ready`], all woken when `pending` falls below
    /// `max_pending` again (after the lock, each even if another's waker panics).
    room: WaiterList<()>,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    max_pending: usize,
    name: Option<String>,
    pending_gauge: Gauge,
    abandoned_total: Counter,
    dropped_total: Counter,
}

/// Tracks the offsets of one partition and says which may be committed: the highest offset
/// whose predecessors (every offset tracked before it) are all finished. It never reports an
/// offset past an unfinished one, so a crash redelivers whatever was not finished
/// (at-least-once).
///
/// Offsets must be tracked in increasing order (gaps in numbering are fine). A gap is not
/// waited for: the tracker knows only the offsets it tracked, so a record fetched but never
/// tracked (dropped by a filter or a failed decode before [`track`], discarded by a
/// [`Prefetch`](crate::demand::Prefetch) whose source then goes on) is committed past once
/// a later offset is finished. Track each record as it leaves the source, before anything
/// can drop it, and finish the ones skipped with `done` or `abandon`. Tokens finish in any
/// order, from any task, in one of three ways:
///
/// - Processed: [`CommitToken::done`].
/// - Given up (skip / dead-letter): [`CommitToken::abandon`]. Commits move past it as past a
///   done offset, so it is **not** redelivered: hand the record to a dead-letter queue (or
///   log it) before abandoning it. Counted in [`abandoned`](CommitTracker::abandoned) and
///   `flowgate_demand_commit_abandoned_total`.
/// - Dropped without either (a panicking worker, a cancelled task, a shutdown): the offset
///   **holds** the commit. Nothing at or after it becomes committable in this process, so it
///   is redelivered after a restart or rebalance. Counted in
///   [`dropped`](CommitTracker::dropped) and `flowgate_demand_commit_dropped_total`. The
///   commits of this tracker stay at that offset for good, so a consumer that goes on
///   running should finish every token with `done` or `abandon`.
///
/// # Bound
///
/// Memory is one entry per tracked offset not yet committable ([`pending`]), and `pending`
/// never exceeds [`max_pending`] ([`DEFAULT_MAX_PENDING`] unless set with
/// [`CommitTracker::builder`]). When it is full, [`track`] refuses the offset with
/// [`TrackError::PendingFull`] (nothing is tracked; track it again later) and
/// [`until_ready`] waits for room: backpressure for the loop that pulls records. The
/// tracker fills up when one offset stays unfinished while later ones finish — a slow item,
/// or a token dropped unfinished (which then stops the consumer instead of growing memory
/// without end). `flowgate_demand_commit_pending` shows how close it is.
///
/// Kafka commits the *next* offset to read: commit `committable() + 1`. It never
/// overflows: offsets go up to `u64::MAX - 1` ([`track`] refuses `u64::MAX` with
/// [`TrackError::NoNextOffset`]).
///
/// [`pending`]: CommitTracker::pending
/// [`max_pending`]: CommitTracker::max_pending
/// [`track`]: CommitTracker::track
/// [`until_ready`]: CommitTracker::until_ready
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
/// assert_eq!(tracker.committable(), None); // 10 and 11 are not finished
/// a.done();
/// assert_eq!(tracker.committable(), Some(10));
/// b.abandon(); // e.g. sent to a dead-letter topic after its last retry
/// assert_eq!(tracker.committable(), Some(15));
/// assert_eq!(tracker.abandoned(), 1);
/// # Ok::<(), flowgate::demand::TrackError>(())
/// ```
#[derive(Clone)]
pub struct CommitTracker {
    shared: Arc<Shared>,
}

impl Default for CommitTracker {
    fn default() -> Self {
        CommitTracker::with(DEFAULT_MAX_PENDING, None)
    }
}

impl CommitTracker {
    /// An empty, unnamed tracker of at most [`DEFAULT_MAX_PENDING`] pending offsets.
    pub fn new() -> CommitTracker {
        CommitTracker::default()
    }

    /// A builder, to set the bound on pending offsets and the metrics name.
    pub fn builder() -> CommitTrackerBuilder {
        CommitTrackerBuilder {
            max_pending: DEFAULT_MAX_PENDING,
            name: None,
        }
    }

    fn with(max_pending: usize, name: Option<String>) -> CommitTracker {
        let labels = Labels::new(name.as_deref());
        CommitTracker {
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                max_pending,
                pending_gauge: labels.gauge(names::PENDING, &[]),
                abandoned_total: labels.counter(names::ABANDONED, &[]),
                dropped_total: labels.counter(names::DROPPED, &[]),
                name,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Start tracking `offset`; finish it with [`CommitToken::done`] or
    /// [`CommitToken::abandon`].
    ///
    /// # Errors
    ///
    /// - [`TrackError::NoNextOffset`] if `offset` is `u64::MAX`: it has no next offset,
    ///   so its commit, `committable() + 1`, could not be written.
    /// - [`TrackError::OutOfOrder`] if `offset` is not above the last tracked offset.
    /// - [`TrackError::PendingFull`] if [`max_pending`](CommitTracker::max_pending) offsets
    ///   are pending; `offset` is not tracked (track it again once there is room, see
    ///   [`until_ready`](CommitTracker::until_ready)).
    pub fn track(&self, offset: u64) -> Result<CommitToken, TrackError> {
        if offset == u64::MAX {
            return Err(TrackError::NoNextOffset { offset });
        }
        let mut st = self.lock();
        if let Some(last) = st.last_tracked
            && offset <= last
        {
            return Err(TrackError::OutOfOrder { offset, last });
        }
        if st.pending.len() >= self.shared.max_pending {
            let oldest = st.pending.front().map_or(offset, |&(o, _)| o);
            return Err(TrackError::PendingFull {
                offset,
                oldest,
                max_pending: self.shared.max_pending,
            });
        }
        st.last_tracked = Some(offset);
        st.pending.push_back((offset, Mark::InFlight));
        drop(st);
        let token = CommitToken {
            tracker: self.clone(),
            offset,
            finished: false,
        };
        // The metrics recorder is user code: after the lock (see `finish`). If it panics,
        // the token is dropped unfinished on the way out, and so the offset is finished as
        // any such token's is (it holds the commits, counted in `dropped`).
        self.shared.pending_gauge.add(1.0);
        Ok(token)
    }

    /// Wait until [`track`](CommitTracker::track) has room: fewer than
    /// [`max_pending`](CommitTracker::max_pending) offsets pending. Await it before tracking
    /// the next record to pause the source while the tracker is full. (Room is not reserved:
    /// with several tasks tracking into one tracker, `track` may still find it full.)
    ///
    /// It waits for ever if the offset that holds the commit never finishes (its token was
    /// dropped unfinished): give up records with [`CommitToken::abandon`] instead.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future loses nothing.
    pub async fn until_ready(&self) {
        UntilReady {
            tracker: self,
            key: None,
        }
        .await
    }

    /// The highest offset that may be committed, if any.
    pub fn committable(&self) -> Option<u64> {
        self.lock().committable
    }

    /// Tracked offsets not yet committable (in flight, or finished behind an unfinished one);
    /// at most [`max_pending`](CommitTracker::max_pending).
    pub fn pending(&self) -> usize {
        self.lock().pending.len()
    }

    /// The most offsets that may be pending at once.
    pub fn max_pending(&self) -> usize {
        self.shared.max_pending
    }

    /// Offsets given up with [`CommitToken::abandon`] so far.
    pub fn abandoned(&self) -> u64 {
        self.lock().abandoned
    }

    /// Tokens dropped without `done` or `abandon` so far; each holds the commit.
    pub fn dropped(&self) -> u64 {
        self.lock().dropped
    }

    /// The `name` label of this tracker's metrics, if it was given one.
    pub fn name(&self) -> Option<&str> {
        self.shared.name.as_deref()
    }

    /// Mark `offset` finished and commit past the finished prefix. The state is settled
    /// under the lock; waiters are woken and the metrics recorded after it is released (both
    /// run user code, wakers and the recorder), waiters first, each step even if one before
    /// it panics, so neither a panicking waker or recorder nor a slow one holds the lock,
    /// leaves a waiter unwoken or skips a count. The pending gauge
    /// moves by the change seen under the lock (`Gauge::add` commutes), so it stays exact
    /// whatever order concurrent calls record in.
    fn finish(&self, offset: u64, mark: Mark) {
        let mut woken = Deferred::default();
        let mut st = self.lock();
        let before = st.pending.len();
        // Offsets are sorted: find it by binary search.
        if let Ok(at) = st.pending.binary_search_by_key(&offset, |&(o, _)| o) {
            st.pending[at].1 = mark;
        }
        match mark {
            Mark::Abandoned => st.abandoned += 1,
            Mark::Dropped => st.dropped += 1,
            Mark::InFlight | Mark::Done => {}
        }
        while let Some(&(o, m)) = st.pending.front()
            && m.is_finished()
        {
            st.committable = Some(o);
            st.pending.pop_front();
        }
        let after = st.pending.len();
        if before >= self.shared.max_pending && after < self.shared.max_pending {
            st.room.wake_all(&mut woken);
        }
        drop(st);
        // Each step even if one before it panics (a waker, the recorder): a skipped one
        // would leave a count or the gauge wrong for good.
        let mut panics = Panics::new();
        panics.run(|| drop(woken));
        match mark {
            Mark::Abandoned => panics.run(|| self.shared.abandoned_total.increment(1)),
            Mark::Dropped => panics.run(|| self.shared.dropped_total.increment(1)),
            Mark::InFlight | Mark::Done => {}
        }
        panics.run(|| self.shared.pending_gauge.add(after as f64 - before as f64));
        panics.resume();
    }
}

impl fmt::Debug for CommitTracker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.lock();
        f.debug_struct("CommitTracker")
            .field("name", &self.shared.name)
            .field("committable", &st.committable)
            .field("pending", &st.pending.len())
            .field("max_pending", &self.shared.max_pending)
            .field("abandoned", &st.abandoned)
            .field("dropped", &st.dropped)
            .finish()
    }
}

/// The future of [`CommitTracker::until_ready`]: it waits in the tracker's list of tasks
/// waiting for room, which the finish that makes room wakes after its lock, each task even
/// if another's waker panics. Dropped, it leaves the list (nothing else is lost).
struct UntilReady<'a> {
    tracker: &'a CommitTracker,
    /// Its place in `State::room`, once it waited.
    key: Option<Key>,
}

impl Future for UntilReady<'_> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        // Declared before the lock: the wakers given up are dropped after it is released.
        let mut out = Deferred::default();
        let this = &mut *self;
        let mut st = this.tracker.lock();
        if st.pending.len() < this.tracker.shared.max_pending {
            if let Some(key) = this.key.take() {
                st.room.cancel(key, &mut out);
            }
            return Poll::Ready(());
        }
        // Registered under the lock that room is made under: no wake is missed.
        st.room.register(&mut this.key, cx.waker(), || (), &mut out);
        Poll::Pending
    }
}

impl Drop for UntilReady<'_> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            let mut out = Deferred::default();
            self.tracker.lock().room.cancel(key, &mut out);
        }
    }
}

/// Names of the commit metrics.
pub(crate) mod names {
    pub(crate) const PENDING: &str = "flowgate_demand_commit_pending";
    pub(crate) const ABANDONED: &str = "flowgate_demand_commit_abandoned_total";
    pub(crate) const DROPPED: &str = "flowgate_demand_commit_dropped_total";
}

/// Builds a [`CommitTracker`]; from [`CommitTracker::builder`].
///
/// # Examples
///
/// ```
/// use flowgate::demand::{CommitTracker, TrackError};
///
/// let tracker = CommitTracker::builder().max_pending(2).name("orders-p0").build()?;
/// let a = tracker.track(1)?;
/// let _b = tracker.track(2)?;
/// assert!(matches!(tracker.track(3), Err(TrackError::PendingFull { oldest: 1, .. })));
/// a.done();
/// let _c = tracker.track(3)?; // room again
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct CommitTrackerBuilder {
    max_pending: usize,
    name: Option<String>,
}

impl CommitTrackerBuilder {
    /// The most offsets pending at once (default [`DEFAULT_MAX_PENDING`]); see
    /// [`CommitTracker`]'s bound.
    pub fn max_pending(mut self, max_pending: usize) -> Self {
        self.max_pending = max_pending;
        self
    }

    /// The `name` label of this tracker's metrics.
    ///
    /// Trackers given the same name (or none: `name="default"`) report into one series:
    /// their counters add up, and `flowgate_demand_commit_pending` shows the sum of their
    /// pending offsets (each tracker's share is taken back when it is dropped), not one
    /// tracker's. Give each partition's tracker a name of its own to see it alone.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Build the tracker.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `commit.max_pending` if it is zero.
    pub fn build(self) -> Result<CommitTracker, ConfigError> {
        if self.max_pending == 0 {
            return Err(ConfigError::zero("commit.max_pending"));
        }
        Ok(CommitTracker::with(self.max_pending, self.name))
    }
}

/// One tracked offset. Finish it with [`done`](CommitToken::done) or
/// [`abandon`](CommitToken::abandon).
///
/// Dropping it without either leaves the offset unfinished: nothing at or after it becomes
/// committable in this process, so it is redelivered after a restart. That is the
/// at-least-once guarantee for work that crashed or was cancelled; it is counted in
/// [`CommitTracker::dropped`], and the offsets finished behind it stay pending until the
/// tracker is full (see [`CommitTracker`]'s bound).
#[must_use = "an offset is committable only after its token is marked done or abandoned"]
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

    /// Mark the offset done: processed.
    pub fn done(mut self) {
        self.finished = true;
        self.tracker.finish(self.offset, Mark::Done);
    }

    /// Give the offset up (skip / dead-letter): commits move past it as past a done offset,
    /// so it is not redelivered. Counted in [`CommitTracker::abandoned`]. Hand the record to
    /// a dead-letter queue, or log it, before calling this if it must not be lost.
    pub fn abandon(mut self) {
        self.finished = true;
        self.tracker.finish(self.offset, Mark::Abandoned);
    }
}

impl Drop for CommitToken {
    fn drop(&mut self) {
        if !self.finished {
            self.tracker.finish(self.offset, Mark::Dropped);
        }
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
