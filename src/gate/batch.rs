//! Natural batching: concurrent decisions share one script call.

use std::panic::AssertUnwindSafe;
use std::sync::PoisonError;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Instant, SystemTime};

use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use redis::aio::ConnectionLike;
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{mpsc, oneshot};

use crate::decision::Decision;
use crate::gate::backend::{Backend, CallError, Probe, Resets};
use crate::gate::error::GateError;
use crate::gate::reject_cache::RejectCache;
use crate::gate::scripts::LimitScript;
use crate::metrics::{Counter, Histogram};
use crate::sync::{Arc, Mutex, Panics};

/// How many batch calls may be in flight at once.
const MAX_IN_FLIGHT: usize = 4;

/// One decision waiting for its batch.
pub(crate) struct Request {
    /// The key in Redis: the gate's prefix, then the caller's key.
    pub(crate) key: String,
    pub(crate) cost: u32,
    /// When the caller asked: a rejection is cached from then.
    pub(crate) started: Instant,
    /// When the caller's timeout ends: the driver answers by then. The caller's own timer,
    /// started a little later, is only the backstop for a driver that is not polled.
    pub(crate) deadline: Instant,
    pub(crate) reply: oneshot::Sender<Answer>,
    /// The probe of a degraded gate this request is: sent with its batch, given back if
    /// the request is dropped before (its caller gave up first).
    pub(crate) probe: Option<Probe>,
}

/// What follows from what Redis decides, shared by the gate and its batch driver: the
/// counts, and the rejection cache.
#[derive(Debug)]
pub(crate) struct Outcomes {
    pub(crate) allowed: Counter,
    pub(crate) rejected: Counter,
    /// Requests sent to Redis whose answer nothing was left to read (see [`Unread`]).
    pub(crate) abandoned: Counter,
    pub(crate) cache: RejectCache,
    /// The length of the gate's key prefix: a [`Request`]'s key without it is the caller's.
    pub(crate) prefix: usize,
    /// The backend's resets: a rejection is cached only if none came since its request was
    /// sent.
    pub(crate) resets: Resets,
}

impl Outcomes {
    /// Redis decided `decision` for `cost` on the caller's `key`, in a call sent at `sent`
    /// when the backend's count of resets was `seen`: counted, and a rejection cached
    /// unless the gate let go of what Redis may have lost since (the rejection may be one
    /// of them). Done where the answer is read, by the caller or by what is left of its
    /// call when it has given up.
    pub(crate) fn decided(
        &self,
        key: &str,
        cost: u32,
        (sent, seen): (Instant, u64),
        decision: &Decision,
    ) {
        self.count(decision);
        if !decision.allowed {
            let now = (Instant::now(), SystemTime::now());
            let fresh = || self.resets.none_since(seen);
            self.cache.rejected(key, cost, sent, decision, now, fresh);
        }
    }

    /// Count `decision` by its outcome.
    pub(crate) fn count(&self, decision: &Decision) {
        if decision.allowed {
            self.allowed.increment(1);
        } else {
            self.rejected.increment(1);
        }
    }

    /// `n` requests going to Redis now, unread until their call ends.
    pub(crate) fn unread(&self, n: usize) -> Unread<'_> {
        Unread {
            abandoned: &self.abandoned,
            n: n as u64,
        }
    }
}

/// Requests on their way to Redis, held by their call until it ends (with an answer or an
/// error). Dropped before that, the call was dropped with nothing left to finish it: its
/// runtime shut down, or its caller gave up outside any runtime. Redis may have decided
/// (and charged) them all the same, but nobody will know what it decided: they are counted
/// as `abandoned`.
#[derive(Debug)]
pub(crate) struct Unread<'a> {
    abandoned: &'a Counter,
    n: u64,
}

impl Unread<'_> {
    /// The call ended: its answer, or its failure, is in hand.
    pub(crate) fn read(mut self) {
        self.n = 0;
    }
}

impl Drop for Unread<'_> {
    fn drop(&mut self) {
        if self.n > 0 {
            self.abandoned.increment(self.n);
        }
    }
}

/// A batch on its way to Redis, until its answer is in hand. Dropped before (the driver's
/// runtime shut down mid-call, or user code it ran panicked: a metrics recorder), it answers the callers still waiting with a failure, for
/// their gate's failure policy to decide: Redis may have charged them, so asking it again
/// would charge them twice. (Requests dropped while queued, never sent, are asked again.)
struct Sent<'a> {
    batch: Vec<Request>,
    outcomes: &'a Arc<Outcomes>,
}

impl Drop for Sent<'_> {
    fn drop(&mut self) {
        if self.batch.is_empty() {
            return;
        }
        let error = GateError::backend(crate::gate::error::BackendMessage(
            "the batch driver gave this request up in flight (its runtime shut down, or a \
             metrics recorder panicked in it): redis may have charged it"
                .into(),
        ));
        let failed = CallError::Backend {
            error: Some(error),
            until_probe: std::time::Duration::ZERO,
        };
        let batch = std::mem::take(&mut self.batch);
        Answering::new(
            batch.into_iter().map(|r| (r, Err(failed.clone()))),
            0,
            self.outcomes,
        )
        .all();
    }
}

/// The callers of a batch Redis answered (or failed), each to be sent its answer, in order.
/// A caller's waker runs as its answer is sent (user code): one that panics must not leave
/// the callers after it unanswered, or each would ask Redis again alone and be charged
/// twice. So those left when this is dropped by that panic are answered as it unwinds, each
/// under [`Panics`] (one more waker panicking there is dropped: the first goes on).
struct Answering<'a, I: Iterator<Item = (Request, Result<Decision, CallError>)>> {
    rest: I,
    /// The backend's count of resets when the call was sent.
    seen: u64,
    outcomes: &'a Arc<Outcomes>,
    /// The answers of callers gone: their decisions are counted (by the metrics recorder,
    /// user code) when these are dropped, once every caller is answered.
    unread: Vec<Answer>,
    /// Every caller was answered by [`all`](Answering::all).
    done: bool,
}

impl<'a, I: Iterator<Item = (Request, Result<Decision, CallError>)>> Answering<'a, I> {
    fn new(rest: I, seen: u64, outcomes: &'a Arc<Outcomes>) -> Self {
        Answering {
            rest,
            seen,
            outcomes,
            unread: Vec::new(),
            done: false,
        }
    }

    /// Answer every caller left, then count the decisions of those gone.
    fn all(mut self) {
        self.answer_rest();
        self.done = true;
        drop(std::mem::take(&mut self.unread));
    }

    fn answer_rest(&mut self) {
        for (r, result) in self.rest.by_ref() {
            self.unread
                .extend(r.answer((result, self.seen), self.outcomes));
        }
    }
}

impl<I: Iterator<Item = (Request, Result<Decision, CallError>)>> Drop for Answering<'_, I> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // A waker's panic cut `all` short: a pass per panic over the callers left (each
        // pass consumes the caller whose waker panicked).
        let mut panics = Panics::new();
        let mut answered = false;
        while !answered {
            panics.run(|| {
                self.answer_rest();
                answered = true;
            });
        }
        let unread = std::mem::take(&mut self.unread);
        panics.run(|| drop(unread));
        panics.resume();
    }
}

/// The driver's answer to one request. A decision its caller never reads (it gave up after
/// the batch was sent, so Redis charged it all the same) is [`decided`](Outcomes::decided)
/// when the answer is dropped (counted, a rejection cached): whether the send found the
/// caller gone or the caller went away with the answer waiting for it.
pub(crate) struct Answer {
    result: Option<Result<Decision, CallError>>,
    /// For a decision: where it is decided if it is not read, and the request it answers
    /// (its Redis key, cost and start).
    unread: Option<(Arc<Outcomes>, String, u32, Instant)>,
    /// The backend's count of resets when the call was sent.
    seen: u64,
}

impl Answer {
    /// The answer `result` to `request`'s key, cost and start; a decision in it is
    /// [`decided`](Outcomes::decided) in `outcomes` unless it is read.
    fn new(
        (result, seen): (Result<Decision, CallError>, u64),
        (key, cost, started): (String, u32, Instant),
        outcomes: &Arc<Outcomes>,
    ) -> Answer {
        let unread = result
            .is_ok()
            .then(|| (outcomes.clone(), key, cost, started));
        Answer {
            result: Some(result),
            unread,
            seen,
        }
    }

    /// The result, for the caller, which decides it itself; with the backend's count of
    /// resets when the call was sent.
    pub(crate) fn read(mut self) -> (Result<Decision, CallError>, u64) {
        self.unread = None;
        let result = self.result.take().expect("an answer is read once");
        (result, self.seen)
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        if let (Some((outcomes, key, cost, started)), Some(Ok(decision))) =
            (&self.unread, &self.result)
        {
            let key = key.get(outcomes.prefix..).unwrap_or(key);
            outcomes.decided(key, *cost, (*started, self.seen), decision);
        }
    }
}

impl Request {
    /// Answer this request with `result` (of a call sent when the backend's count of resets
    /// was `.1`); the answer comes back if its caller is gone. Its decision is then
    /// [`decided`](Outcomes::decided) when it is dropped, which runs the metrics recorder
    /// (user code): drop it once every other caller is answered.
    fn answer(
        self,
        result: (Result<Decision, CallError>, u64),
        outcomes: &Arc<Outcomes>,
    ) -> Option<Answer> {
        let answer = Answer::new(result, (self.key, self.cost, self.started), outcomes);
        self.reply.send(answer).err()
    }

    /// Answer this request with `error` (which keeps nothing on Redis's word).
    fn fail(self, error: CallError, outcomes: &Arc<Outcomes>) {
        self.answer((Err(error), 0), outcomes);
    }
}

/// The gate's side of the batch driver: its bounded queue, the script calls in flight (the
/// driver's and those callers make directly when nothing is in flight), and what it takes to
/// start the driver again when the runtime it ran on has shut down.
pub(crate) struct Batcher<C> {
    /// The queue of the driver started with the gate: the hot path, with no lock.
    first: mpsc::Sender<Request>,
    /// Set once that driver has stopped: then `queue` holds the current one.
    moved: AtomicBool,
    queue: Mutex<mpsc::Sender<Request>>,
    pub(crate) calls: Arc<AtomicUsize>,
    driver: Driver<C>,
    restarts: Counter,
}

impl<C> std::fmt::Debug for Batcher<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher")
            .field("calls", &self.calls.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl<C> Batcher<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Start a driver for `driver` on the current runtime.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime.
    pub(crate) fn start(driver: Driver<C>, restarts: Counter) -> Batcher<C> {
        let queue = driver.spawn();
        Batcher {
            first: queue.clone(),
            moved: AtomicBool::new(false),
            queue: Mutex::new(queue),
            calls: driver.calls.clone(),
            driver,
            restarts,
        }
    }

    /// Queue `request` for the next batch, waiting for room in the queue until its
    /// deadline. A driver that stopped because its runtime shut down is started again on
    /// the caller's runtime (counted, logged), and the request goes to it. If the driver the
    /// caller started stops too (the caller's own runtime is shutting down), the request,
    /// never sent, is answered by the failure policy, as a driver's runtime that shuts down
    /// under a batch in flight answers its callers.
    pub(crate) async fn submit(&self, request: Request) -> Result<(), CallError> {
        let mut request = request;
        if !self.moved.load(Ordering::Acquire) {
            request = match self.first.try_send(request) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Full(r) | TrySendError::Closed(r)) => r,
            };
        }
        let deadline = request.deadline;
        // Whether this caller started a driver: one closed after it (the caller's own
        // runtime is shutting down) leaves the request to the failure policy.
        let mut started = false;
        // A driver another caller started may have stopped too: tried, then one of this
        // caller's own.
        for _ in 0..3 {
            let queue = self
                .queue
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            request = match queue.try_send(request) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Full(r)) => {
                    let wait = queue.reserve();
                    match self.driver.backend.until(deadline, wait).await {
                        Some(Ok(permit)) => {
                            permit.send(r);
                            return Ok(());
                        }
                        Some(Err(_)) => r,
                        // The queue stayed full for the whole timeout: Redis is too slow.
                        None => {
                            let backend = &self.driver.backend;
                            return Err(backend.fail(GateError::Timeout(backend.timeout())));
                        }
                    }
                }
                Err(TrySendError::Closed(r)) => r,
            };
            if started {
                break;
            }
            started = self.restart(&queue);
        }
        // Never sent: decided by the policy, as for callers whose batch was in flight when
        // the driver's runtime shut down (the gate does not degrade).
        Err(CallError::Backend {
            error: Some(GateError::backend(crate::gate::error::BackendMessage(
                "the batch driver stopped again as soon as it was started (the caller's \
                 runtime is shutting down)"
                    .into(),
            ))),
            until_probe: std::time::Duration::ZERO,
        })
    }

    /// Start a new driver, unless another caller already replaced the stopped `queue`;
    /// returns whether it started one.
    fn restart(&self, stopped: &mpsc::Sender<Request>) -> bool {
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        if !queue.same_channel(stopped) {
            return false;
        }
        *queue = self.driver.spawn();
        self.moved.store(true, Ordering::Release);
        drop(queue);
        self.restarts.increment(1);
        tracing::warn!(
            gate = self
                .driver
                .backend
                .name()
                .unwrap_or(crate::metrics::DEFAULT_NAME),
            "the gate's batch driver stopped (the tokio runtime the gate was built on shut \
             down): started it again on the caller's runtime"
        );
        true
    }

    /// A claim on the connection for one direct call, if no call is in flight. It owns its
    /// count, so a direct call finished without its caller holds it to the end.
    pub(crate) fn idle_call(&self) -> Option<Call> {
        // Under load calls are in flight: a plain load then spares the shared line a write.
        if self.calls.load(Ordering::Relaxed) != 0 {
            return None;
        }
        self.calls
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| Call(self.calls.clone()))
    }
}

/// One script call in flight, counted until dropped.
#[derive(Debug)]
pub(crate) struct Call(Arc<AtomicUsize>);

impl Call {
    fn start(calls: &Arc<AtomicUsize>) -> Call {
        calls.fetch_add(1, Ordering::AcqRel);
        Call(calls.clone())
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What the driver needs to call Redis (no handle on the gate itself, so dropping the last
/// gate handle ends the driver).
pub(crate) struct Driver<C> {
    pub(crate) calls: Arc<AtomicUsize>,
    pub(crate) backend: Arc<Backend<C>>,
    pub(crate) eval: LimitScript,
    pub(crate) max_batch: usize,
    pub(crate) batch_size: Histogram,
    /// Where the decisions of callers that gave up are counted.
    pub(crate) outcomes: Arc<Outcomes>,
    /// Redis Cluster: one script call per key of the batch (see [`Driver::dispatch`]).
    pub(crate) cluster: bool,
}

impl<C> Clone for Driver<C> {
    fn clone(&self) -> Self {
        Driver {
            calls: self.calls.clone(),
            backend: self.backend.clone(),
            eval: self.eval.clone(),
            max_batch: self.max_batch,
            batch_size: self.batch_size.clone(),
            outcomes: self.outcomes.clone(),
            cluster: self.cluster,
        }
    }
}

impl<C> Driver<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Start a copy of this driver on the current runtime; returns its queue, which holds
    /// up to [`MAX_IN_FLIGHT`] batches (at most the most a tokio channel can hold, which
    /// would panic beyond, for a `batch_size` near `usize::MAX`).
    fn spawn(&self) -> mpsc::Sender<Request> {
        let room = self.max_batch.saturating_mul(MAX_IN_FLIGHT);
        let (tx, rx) = mpsc::channel(room.clamp(1, tokio::sync::Semaphore::MAX_PERMITS));
        tokio::spawn(self.clone().run(rx));
        tx
    }

    /// Decide `batch` in one script call and answer every request.
    async fn call(&self, batch: Vec<Request>) {
        // A request whose deadline passed while it was queued times out now. The call gets
        // the time the last of the others has left: each caller's own timer bounds its wait,
        // so one that joined late is not failed by the deadline of one that came early.
        let now = Instant::now();
        let mut batch = batch;
        // Redis was too slow for them: one failure, however many waited.
        let mut timed_out = None;
        for r in batch.extract_if(.., |r| r.deadline <= now) {
            let error = timed_out.get_or_insert_with(|| {
                self.backend
                    .fail(GateError::Timeout(self.backend.timeout()))
            });
            r.fail(error.clone(), &self.outcomes);
        }
        let Some(deadline) = batch.iter().map(|r| r.deadline).max() else {
            return;
        };
        for probe in batch.iter_mut().filter_map(|r| r.probe.take()) {
            probe.sent();
        }
        let unread = self.outcomes.unread(batch.len());
        let mut sent = Sent {
            batch,
            outcomes: &self.outcomes,
        };
        let requests = sent.batch.iter().map(|r| (r.key.as_str(), r.cost));
        let decided = self
            .eval
            .decide(&self.backend, requests, deadline - now)
            .await;
        unread.read();
        let batch = std::mem::take(&mut sent.batch);
        // A caller that gave up meanwhile was charged all the same: the answer it leaves
        // behind counts its decision.
        match decided {
            Ok((decisions, seen, latency)) => {
                // Every caller is answered before the decisions of those gone are counted: a
                // recorder that panics there must not leave the callers after them
                // unanswered (each would ask Redis again alone, and be charged twice); nor
                // must a caller's waker that panics as it is answered (see `Answering`).
                let answers = batch
                    .into_iter()
                    .zip(decisions)
                    .map(|(r, decision)| (r, decision.map_err(CallError::Request)));
                Answering::new(answers, seen, &self.outcomes).all();
                // Last: a recorder that panics as it records the round trip takes no
                // answer from a caller.
                drop(latency);
            }
            Err(error) => {
                let failed = batch.into_iter().map(|r| (r, Err(error.clone())));
                Answering::new(failed, 0, &self.outcomes).all();
            }
        }
    }

    /// Take whatever is queued (up to `max_batch`), decide it in one script call, answer
    /// everyone, repeat. While a call is in flight the next batch fills: no added latency
    /// at low load, large batches at high load.
    pub(crate) async fn run(self, mut rx: mpsc::Receiver<Request>) {
        // Up to MAX_IN_FLIGHT calls overlap (pipelined on the connection), so the client's
        // work on one batch overlaps Redis's work on another.
        let mut in_flight = FuturesUnordered::new();
        loop {
            tokio::select! {
                biased;
                Some(()) = in_flight.next(), if !in_flight.is_empty() => {}
                first = rx.recv(), if in_flight.len() < MAX_IN_FLIGHT => {
                    let Some(first) = first else { break };
                    let mut batch = vec![first];
                    while batch.len() < self.max_batch {
                        match rx.try_recv() {
                            Ok(r) => batch.push(r),
                            Err(_) => break,
                        }
                    }
                    // A caller that gave up does not need its tokens.
                    batch.retain(|r| !r.reply.is_closed());
                    if batch.is_empty() {
                        continue;
                    }
                    // A panic in a batch (from a metrics recorder: user code) ends that batch,
                    // not the driver with every other batch in flight.
                    let batch = self.dispatch(batch, Call::start(&self.calls));
                    in_flight.push(AssertUnwindSafe(batch).catch_unwind().map(drop));
                }
                else => break,
            }
        }
        while in_flight.next().await.is_some() {}
    }

    /// One batch: a single call, or one call per key on a cluster.
    ///
    /// Per key, not per hash slot: while a slot moves between two nodes (its keys migrated
    /// one by one), a script over keys of that slot that lie on both is refused by either
    /// (`TRYAGAIN`), and redis-rs sends it again until the gate's timeout, so every caller
    /// of the call failed; a script on one key is sent on to the node that holds it (`ASK`).
    /// Keys under one hash tag share a slot, so this is when a tenant's keys move.
    async fn dispatch(&self, mut batch: Vec<Request>, _call: Call) {
        // Recorded here, where a recorder that panics costs this batch alone (never sent:
        // its callers ask Redis again alone).
        self.batch_size.record(batch.len() as f64);
        if self.cluster && batch.len() > 1 {
            // Stable: each key's requests stay in arrival order.
            batch.sort_by(|a, b| a.key.cmp(&b.key));
            let mut groups: Vec<Vec<Request>> = Vec::new();
            for r in batch.drain(..) {
                match groups.last_mut() {
                    Some(group) if group[0].key == r.key => group.push(r),
                    _ => groups.push(vec![r]),
                }
            }
            // Each key's call is a batch of its own: a panic in one (a metrics recorder)
            // ends it alone, and the others go on to answer their callers.
            let calls = groups
                .into_iter()
                .map(|group| AssertUnwindSafe(self.call(group)).catch_unwind());
            futures::future::join_all(calls).await;
        } else {
            self.call(batch).await;
        }
    }
}
