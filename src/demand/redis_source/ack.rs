//! The acknowledgement side: [`Ack`] handles and the queue they share with the source.

use std::collections::HashSet;
use std::fmt;
use std::ops::Deref;
use std::sync::PoisonError;
use std::sync::atomic::{AtomicBool, Ordering};

use redis::aio::ConnectionLike;
use redis::{Cmd, RedisResult};
use tokio::sync::Notify;

use super::builder::Config;
use crate::metrics::Counter;
use crate::sync::{Arc, Mutex, MutexGuard};

/// What the source and its [`Ack`] handles share: the ids acknowledged and not sent yet,
/// the ids handed out and not yet acknowledged or dropped, and the generation of the group
/// they belong to.
#[derive(Debug)]
pub(super) struct AckQueue {
    state: Mutex<AckState>,
    /// Wakes the background task: an ack, or a handle gone.
    pub(super) wake: Notify,
    /// Held by whoever is sending queued acks (the background task, `flush_acks`), so that
    /// `flush_acks` returns only once acks the task took before it are in Redis too.
    sending: tokio::sync::Mutex<()>,
    /// Sends the queued acks over the source's own connection (see [`flush`](Self::flush)).
    flusher: std::sync::OnceLock<Flusher>,
    /// Told when a send lets go of `sending` (see [`new_group`](Self::new_group)).
    released: Notify,
    /// The last `XACK` answered with an error (refused: an ACL without `XACK`; or the
    /// connection failed): the next fetch sends the queued acks alone first and reads only
    /// if they go through (see [`refused`](Self::refused)). Cleared by an `XACK` that goes
    /// through.
    failing: AtomicBool,
    /// Acks Redis acknowledged: the count each `XACK` answers.
    acked: Counter,
    /// Acks of entries of a group that was lost (see [`new_group`](Self::new_group)), and
    /// those an `XACK` sent but Redis did not acknowledge (see [`sent`](Self::sent)).
    stale: Counter,
    /// Acks still queued when the queue goes (see its `Drop`): never sent.
    unsent: Counter,
}

#[derive(Debug)]
pub(super) struct AckState {
    /// Acknowledged by the application, waiting to be sent in one `XACK`.
    pub(super) ids: Vec<String>,
    /// Delivered by this source and still held by the application (their `Ack` is alive):
    /// this consumer's own `XAUTOCLAIM` returns them too once idle, and must not deliver
    /// them a second time.
    pub(super) held: HashSet<String>,
    /// The source plus its live `Ack`s; the background task stops once all are gone and
    /// every ack is sent.
    pub(super) handles: usize,
    /// Bumped each time a fetch of the source finds its group lost (before it creates the
    /// group again): `ids` and `held` belong to this generation; an `Ack` of an older one
    /// is stale.
    pub(super) generation: u64,
}

impl AckQueue {
    pub(super) fn new(acked: Counter, stale: Counter, unsent: Counter) -> Self {
        AckQueue {
            state: Mutex::new(AckState {
                ids: Vec::new(),
                held: HashSet::new(),
                handles: 1,
                generation: 0,
            }),
            wake: Notify::new(),
            sending: tokio::sync::Mutex::new(()),
            flusher: std::sync::OnceLock::new(),
            released: Notify::new(),
            failing: AtomicBool::new(false),
            acked,
            stale,
            unsent,
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, AckState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Gives the queue the connection and settings of its source, for [`flush`](Self::flush).
    pub(super) fn set_flusher<C>(self: &Arc<Self>, conn: C, cfg: Arc<Config>)
    where
        C: ConnectionLike + Clone + Send + Sync + 'static,
    {
        // Weak: the queue owns the flusher.
        let queue = Arc::downgrade(self);
        let flusher = Flusher(Box::new(move || {
            let (queue, mut conn, cfg) = (queue.clone(), conn.clone(), cfg.clone());
            Box::pin(async move {
                if let Some(queue) = queue.upgrade() {
                    let _ = queue.send(&mut conn, &cfg).await;
                }
            })
        }));
        let _ = self.flusher.set(flusher);
    }

    /// Sends the queued acks now, over the source's own connection, after a send in
    /// progress; on a failure they stay queued.
    pub(super) async fn flush(&self) {
        if let Some(flush) = self.flusher.get() {
            (flush.0)().await;
        }
    }

    /// The queued acks, and the generation they belong to.
    fn take(&self) -> (Vec<String>, u64) {
        let mut st = self.lock();
        (std::mem::take(&mut st.ids), st.generation)
    }

    /// Sends the queued acks in one `XACK`, once a send in progress (the background task's,
    /// `flush_acks`) is done; returns how many Redis acknowledged, 0 if none were queued.
    ///
    /// On an error the ids are queued again ([`requeue`](Self::requeue)), and so they are
    /// when it is dropped while its `XACK` is on its way (before the `sending` lock is let
    /// go of): an `XACK` that had reached Redis already is then answered 0 for them, counted
    /// as stale.
    pub(super) async fn send<C: ConnectionLike>(
        &self,
        conn: &mut C,
        cfg: &Config,
    ) -> RedisResult<usize> {
        let _sending = Sending {
            guard: Some(self.sending.lock().await),
            released: &self.released,
        };
        let carried = Carried::take(self);
        if carried.ids().is_empty() {
            return Ok(0);
        }
        carried.send(conn, cfg).await
    }

    /// One `XACK` of `ids` ids went through and Redis answered `n`: `n` are counted as
    /// acked, the rest as stale. Redis counts only the ids pending in the group, and answers
    /// 0 when the group is missing: acks sent before the source noticed the loss reached no
    /// group.
    pub(super) fn sent(&self, ids: usize, n: usize) {
        self.failing.store(false, Ordering::Release);
        self.acked.increment(n as u64);
        self.stale.increment(ids.saturating_sub(n) as u64);
    }

    /// An `XACK` of `ids` answered with an error: they are queued again
    /// ([`requeue`](Self::requeue)), and until an `XACK` goes through
    /// ([`failing`](Self::failing)) the fetches send the queued acks alone before they read.
    /// So an `XACK` refused for good (an ACL without it) while reads are allowed stops the
    /// reads with its error, instead of queueing the acks of every entry read after it.
    pub(super) fn refused(&self, ids: Vec<String>, generation: u64) {
        self.failing.store(true, Ordering::Release);
        self.requeue(ids, generation);
    }

    /// Whether the last `XACK` answered with an error (see [`refused`](Self::refused)).
    pub(super) fn failing(&self) -> bool {
        self.failing.load(Ordering::Acquire)
    }

    /// Ids whose send failed go back in the queue, unless their group was lost meanwhile;
    /// the background task is told, so they leave within `ack_interval` even if no fetch
    /// comes.
    pub(super) fn requeue(&self, ids: Vec<String>, generation: u64) {
        let mut st = self.lock();
        let stale = if st.generation == generation {
            st.ids.extend(ids);
            0
        } else {
            ids.len()
        };
        drop(st);
        self.wake.notify_one();
        self.count_stale(stale);
    }

    /// Counts `n` stale acks; after the lock and after the background task was told (the
    /// recorder is user code: one that panics must leave the queue settled).
    fn count_stale(&self, n: usize) {
        if n > 0 {
            self.stale.increment(n as u64);
        }
    }

    /// The group was lost (and is about to be created again): the queued acks and the held
    /// ids belong to the lost one, whose pending list is gone. They are not sent (not to
    /// the new group either, where an id may be pending for another delivery); the queued
    /// ones are counted as stale now, the held ones when their `Ack` is used.
    ///
    /// Waits for a send in progress first: its `XACK`, of acks taken before the loss, then
    /// reaches no group, never the group created again after this returns (a send after it
    /// takes only ids of the new group). The wait holds nothing: the fetch that waits may
    /// not be polled again for long (the application works on what it holds), and a send
    /// (`flush_acks`, the background task) must not wait for it meanwhile.
    ///
    /// Dropped while it waits (the source dropped mid-fetch), it forgets the lost group at
    /// once all the same: no fetch of this source creates the group again then, but
    /// another consumer may, and an ack made afterwards must not go to that group.
    pub(super) async fn new_group(&self) {
        let mut unfinished = ForgetOnDrop(Some(self));
        let no_send = self.no_send().await;
        unfinished.0 = None;
        let queued = self.forget_group();
        drop(no_send);
        self.count_stale(queued);
    }

    /// Waits until no send (the background task's, `flush_acks`) is in progress, and
    /// returns the `sending` lock, taken once it is free, for the caller to let go of at
    /// once: while it holds it, every ack not sent is in the queue. The wait holds nothing
    /// (a fetch that waits may not be polled again for long, and a send must not wait for
    /// it meanwhile).
    async fn no_send(&self) -> tokio::sync::MutexGuard<'_, ()> {
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            // Told of a send ending from here on: none is missed between the check and
            // the wait.
            released.as_mut().enable();
            if let Ok(no_send) = self.sending.try_lock() {
                return no_send;
            }
            released.await;
        }
    }

    /// For a fetch after an `XACK` that failed ([`failing`](Self::failing)): once no send
    /// is in progress (one may hold the acks refused), the queued acks, taken out while no
    /// send can take them first.
    pub(super) async fn take_unsent(queue: &Arc<Self>) -> Carried {
        let no_send = queue.no_send().await;
        let carried = Carried::take(queue.clone());
        drop(no_send);
        carried
    }

    /// Forgets the lost group: a new generation, its queued acks and held ids dropped.
    /// Returns how many acks were queued, for the caller to count as stale once it lets go
    /// of what it holds.
    fn forget_group(&self) -> usize {
        // The acks an `XACK` refused, if any, are dropped with the others.
        self.failing.store(false, Ordering::Release);
        let mut st = self.lock();
        st.generation += 1;
        let queued = std::mem::take(&mut st.ids).len();
        st.held.clear();
        queued
    }

    /// A handle (the source or an `Ack`) is gone; `acked`: its id is done.
    fn release(&self, id: Option<(String, u64)>, acked: bool) {
        let mut st = self.lock();
        let mut stale = 0;
        if let Some((id, generation)) = id {
            if generation != st.generation {
                stale = usize::from(acked);
            } else {
                st.held.remove(&id);
                if acked {
                    st.ids.push(id);
                }
            }
        }
        st.handles -= 1;
        drop(st);
        self.wake.notify_one();
        self.count_stale(stale);
    }

    /// The source is gone.
    pub(super) fn release_source(&self) {
        self.release(None, false);
    }
}

impl Drop for AckQueue {
    /// The source, its `Ack`s and its background task are all gone: acks still queued are
    /// never sent (the task gave up after an `XACK` that failed with no handle left; it
    /// ended with its runtime; there was no runtime). Counted as unsent, and logged: their
    /// entries stay pending, delivered again (at-least-once).
    fn drop(&mut self) {
        let unsent = self.lock().ids.len();
        if unsent > 0 {
            tracing::warn!(
                unsent,
                "redis stream acks never sent (the XACK failed, or no task was left to send \
                 them): their entries stay pending and are delivered again"
            );
            self.unsent.increment(unsent as u64);
        }
    }
}

/// A [`new_group`](AckQueue::new_group) that has not forgotten the lost group yet: dropped
/// so, it forgets it without waiting for the send in progress.
struct ForgetOnDrop<'a>(Option<&'a AckQueue>);

impl Drop for ForgetOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(queue) = self.0.take() {
            let queued = queue.forget_group();
            queue.count_stale(queued);
        }
    }
}

/// What [`AckQueue::flush`] runs.
struct Flusher(
    Box<dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send + Sync>,
);

impl fmt::Debug for Flusher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Flusher")
    }
}

/// The stream key, group and consumer name of a source: who Redis knows it as.
type Name = (String, String, String);

/// The queues of the sources built in this process, by [`Name`]: a source built again under
/// a name sends what the one before it left queued (see [`previous`]).
static BUILT: std::sync::Mutex<Vec<(Name, std::sync::Weak<AckQueue>)>> =
    std::sync::Mutex::new(Vec::new());

/// Whether `name` is the name `cfg` gives its source.
fn named(name: &Name, cfg: &Config) -> bool {
    name.0 == cfg.key && name.1 == cfg.group && name.2 == cfg.consumer
}

/// Remembers `queue` as the queue of the source named by `cfg` (forgetting the one before
/// it, and those whose source and acks are all gone).
pub(super) fn register(cfg: &Config, queue: &Arc<AckQueue>) {
    let mut built = BUILT.lock().unwrap_or_else(PoisonError::into_inner);
    built.retain(|(name, q)| q.strong_count() > 0 && !named(name, cfg));
    built.push((
        (cfg.key.clone(), cfg.group.clone(), cfg.consumer.clone()),
        Arc::downgrade(queue),
    ));
}

/// The queue of the last source built in this process under the name of `cfg`, if it (or
/// one of its [`Ack`]s, or its background task) is still there.
pub(super) fn previous(cfg: &Config) -> Option<Arc<AckQueue>> {
    let built = BUILT.lock().unwrap_or_else(PoisonError::into_inner);
    built
        .iter()
        .find(|(name, _)| named(name, cfg))
        .and_then(|(_, q)| q.upgrade())
}

/// The `sending` lock of a send: once let go of, also by a send dropped on the way, a fetch
/// waiting to forget its lost group ([`AckQueue::new_group`]) is told.
struct Sending<'a> {
    guard: Option<tokio::sync::MutexGuard<'a, ()>>,
    released: &'a Notify,
}

impl Drop for Sending<'_> {
    fn drop(&mut self) {
        // Let go of first: the fetch told tries the lock at once.
        drop(self.guard.take());
        self.released.notify_waiters();
    }
}

/// The acks a send takes out of the queue: those a fetch takes along in its pipeline
/// (`Q` an `Arc`, the fetch being `'static`), or those of an `XACK` of their own
/// ([`AckQueue::send`]). Dropped before Redis answered (the source dropped mid-fetch, at
/// shutdown; `flush_acks` given up), it queues them again, so the background task (or the
/// next send) sends them; an `XACK` that had gone out already is then answered 0 for those
/// ids, which count as stale.
pub(super) struct Carried<Q: Deref<Target = AckQueue> = Arc<AckQueue>> {
    queue: Q,
    ids: Vec<String>,
    generation: u64,
}

impl<Q: Deref<Target = AckQueue>> Carried<Q> {
    /// Takes the queued acks out of `queue`.
    pub(super) fn take(queue: Q) -> Self {
        let (ids, generation) = queue.take();
        Carried {
            queue,
            ids,
            generation,
        }
    }

    /// The ids carried.
    pub(super) fn ids(&self) -> &[String] {
        &self.ids
    }

    /// Redis answered (or the call failed): the ids and their generation, for the caller to
    /// count or queue again.
    pub(super) fn landed(mut self) -> (Vec<String>, u64) {
        (std::mem::take(&mut self.ids), self.generation)
    }

    /// Sends the ids carried (at least one) in one `XACK` of their own: counted by what
    /// Redis answers ([`AckQueue::sent`]), or queued again on an error
    /// ([`AckQueue::refused`]), which is returned.
    pub(super) async fn send<C: ConnectionLike>(
        mut self,
        conn: &mut C,
        cfg: &Config,
    ) -> RedisResult<usize> {
        let reply = xack_cmd(cfg, self.ids()).query_async(conn).await;
        // Taken: dropped now, `self` queues nothing again.
        let ids = std::mem::take(&mut self.ids);
        match reply {
            Ok(n) => {
                self.queue.sent(ids.len(), n);
                Ok(n)
            }
            Err(e) => {
                self.queue.refused(ids, self.generation);
                Err(e)
            }
        }
    }
}

impl<Q: Deref<Target = AckQueue>> Drop for Carried<Q> {
    fn drop(&mut self) {
        if !self.ids.is_empty() {
            self.queue
                .requeue(std::mem::take(&mut self.ids), self.generation);
        }
    }
}

/// The acknowledgement handle of one entry. Call [`ack`](Ack::ack) once the entry's work is
/// done; acks are batched into one `XACK`, sent with the next fetch or by the source's
/// background task within
/// [`ack_interval`](super::RedisStreamSourceBuilder::ack_interval) — also after the source
/// itself was dropped.
///
/// Dropping it without `ack` leaves the entry pending: it is redelivered to this consumer
/// after a restart, or claimed (by this consumer or another) once idle longer than
/// `min_idle` (at-least-once).
///
/// If the group was lost and re-created since the entry was delivered, `ack` sends nothing
/// (the lost group's pending list is gone) and counts the ack in
/// `flowgate_demand_stale_acks_total`; see the [module docs](crate::demand) and
/// [`RedisStreamSource`](super::RedisStreamSource).
#[must_use = "an entry stays pending until it is acknowledged"]
pub struct Ack {
    /// The id and its group generation; `None` once acknowledged (then dropped).
    id: Option<(String, u64)>,
    queue: Arc<AckQueue>,
}

impl Ack {
    pub(super) fn new(id: String, generation: u64, queue: Arc<AckQueue>) -> Self {
        Ack {
            id: Some((id, generation)),
            queue,
        }
    }

    /// The entry is done: acknowledge it.
    pub fn ack(mut self) {
        self.queue.release(self.id.take(), true);
    }

    /// The entry id.
    pub fn id(&self) -> &str {
        self.id
            .as_ref()
            .map(|(id, _)| id.as_str())
            .unwrap_or_default()
    }
}

impl Drop for Ack {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            self.queue.release(Some(id), false);
        }
    }
}

impl fmt::Debug for Ack {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ack").field("id", &self.id()).finish()
    }
}

/// `XACK key group ids…`: it answers how many of `ids` were pending in the group, and 0
/// (not an error) when the key or group is missing.
pub(super) fn xack_cmd(cfg: &Config, ids: &[String]) -> Cmd {
    let mut cmd = redis::cmd("XACK");
    cmd.arg(&cfg.key).arg(&cfg.group).arg(ids);
    cmd
}
