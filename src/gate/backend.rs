//! The one Redis backend under every path of a [`RedisGate`](super::RedisGate): the
//! connection, the timeout, health and probing, the classification of every reply and error,
//! and the latency and failure metrics.
//!
//! `check`, the batch driver, leases and `check_all` all call Redis through
//! [`Backend::eval`], so a failure means the same thing on every path, and a new path cannot
//! forget the timeout, probing or the failure policy.
//!
//! # How a failure is classified
//!
//! | what Redis answers | kind | what happens |
//! |---|---|---|
//! | no answer within the timeout | Redis failure | counted, the gate degrades, the policy decides |
//! | a transport error (refused, reset, closed) | Redis failure | as above |
//! | the connection closed under a call made while healthy (an idle `timeout`, `CLIENT KILL`) | Redis failure | as above, but the next call is the probe, at once (a reconnecting connection has a new one on the way) |
//! | `OOM`, `READONLY`, `NOREPLICAS`, `BUSY`, `LOADING`, `MASTERDOWN`, `TRYAGAIN`, `CLUSTERDOWN`, `MISCONF` (the server refuses writes or is not serving) | Redis failure | as above |
//! | any other error reply (a script error, `CROSSSLOT`, a reply of the wrong shape) | Redis failure | as above |
//! | `WRONGTYPE` on one key (it holds another type of value) | that key's error | [`GateError::UnreadableKey`] for that request only; the gate stays healthy |
//! | a key whose value is not a state the script can read (short, not numbers, NaN, infinite, out of range) | that key's error | as above |
//!
//! The scripts decide each request under `pcall` and report a key's own failure in that
//! request's reply (`KEY_WRONGTYPE`, `KEY_CORRUPT` in `lua/prelude.lua`); a failure of Redis
//! itself fails the whole call with the server's error code.

use std::fmt;
use std::sync::PoisonError;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
// Real time: probes follow Redis, whose clock never pauses.
use std::time::{Duration, Instant};

use redis::aio::ConnectionLike;

use crate::gate::error::{BackendMessage, GateError};
use crate::gate::scripts::{Script, ScriptCall};
use crate::metrics::{Counter, Gauge, Histogram, Labels};
use crate::sync::{Arc, Mutex, Panics};

/// Names of the backend's metrics.
pub(crate) mod names {
    pub(crate) const LATENCY: &str = "flowgate_gate_redis_seconds";
    pub(crate) const FAILURES: &str = "flowgate_gate_failures_total";
    pub(crate) const DEGRADED: &str = "flowgate_gate_degraded";
    pub(crate) const TRANSITIONS: &str = "flowgate_gate_transitions_total";
}

/// The first integer of a request's reply when its key holds a value of another type
/// (`KEY_WRONGTYPE` in `lua/prelude.lua`).
pub(crate) const KEY_WRONGTYPE: i64 = -(1 << 53);
/// The first integer of a request's reply when its key's value cannot be read as a state
/// (`KEY_CORRUPT` in `lua/prelude.lua`).
pub(crate) const KEY_CORRUPT: i64 = -(1 << 53) + 1;

/// The error of a request whose reply starts with `marker`, if it is a key's own failure.
pub(crate) fn key_failure(marker: i64) -> Option<GateError> {
    match marker {
        KEY_WRONGTYPE => Some(GateError::UnreadableKey(
            "it holds a value of another type (shared with a gate of another algorithm, or, \
             on a gate whose own limit is not a token bucket, by its check and its check_all, \
             which keeps token buckets: give each gate its own prefix, and the keys of \
             check_all names of their own)",
        )),
        KEY_CORRUPT => Some(GateError::UnreadableKey(
            "its value is not a state this gate can read (written by something else, or \
             corrupt); delete the key to reset it",
        )),
        _ => None,
    }
}

/// Why a call to Redis gave no reply.
#[derive(Debug, Clone)]
pub(crate) enum CallError {
    /// The request's own error (its key's value cannot be read): returned to its caller;
    /// Redis is fine and the gate stays healthy.
    Request(GateError),
    /// Redis failed (`error`: already counted), or the gate is degraded and this call was
    /// not the probe (`None`: made only if the policy returns it, see [`CallError::error`]);
    /// the failure policy decides, and the next probe is `until_probe` away.
    Backend {
        error: Option<GateError>,
        until_probe: Duration,
    },
}

impl CallError {
    /// The error to return for a call the policy does not decide: what Redis said, or, for a
    /// call that waited for the next probe, that Redis is failing.
    pub(crate) fn error(error: Option<GateError>, until_probe: Duration) -> GateError {
        error.unwrap_or(GateError::Degraded {
            next_probe_in: until_probe,
        })
    }
}

/// Whether a gate's `timeout` setting is none (`Duration::MAX`, taken as [`FOREVER`]): then
/// no timer is armed for its calls. Under tokio's paused time a timer fires as soon as the
/// runtime has nothing else to do, however far away it is, before Redis can answer.
///
/// [`FOREVER`]: crate::time::FOREVER
fn unbounded(timeout: Duration) -> bool {
    timeout >= crate::time::FOREVER
}

/// `fut`'s output, or `None` if `within` passes first; without a timer when the gate's
/// `timeout` setting is none (see [`unbounded`]).
pub(crate) async fn within_timeout<F: Future>(
    timeout: Duration,
    within: Duration,
    fut: F,
) -> Option<F::Output> {
    if unbounded(timeout) {
        return Some(fut.await);
    }
    tokio::time::timeout(within, fut).await.ok()
}

#[derive(Debug, Clone, Copy)]
enum Health {
    Healthy,
    /// Redis failed; the next call to Redis is a probe, at or after this instant.
    Degraded {
        next_probe: Instant,
    },
}

struct Metrics {
    latency: Histogram,
    failures: Counter,
    degraded: Gauge,
    to_degraded: Counter,
    to_healthy: Counter,
}

/// A connection to Redis with a timeout, a health state and one way to call it.
pub(crate) struct Backend<C> {
    conn: C,
    timeout: Duration,
    probe_interval: Duration,
    /// Shared with the [`Probe`]s taken, which give theirs back if dropped unsent.
    health: Arc<Mutex<Health>>,
    /// Whether `health` is `Degraded`: lets the healthy path skip the lock.
    degraded: AtomicBool,
    /// Whether a caller is setting the degraded gauge: see
    /// [`publish_degraded`](Backend::publish_degraded).
    publishing: AtomicBool,
    /// When Redis last answered a call: nanoseconds since `created`.
    answered: AtomicU64,
    created: Instant,
    /// For logs: the gate's name and failure policy.
    name: Option<String>,
    policy: &'static str,
    metrics: Metrics,
    /// Run when Redis may have lost its state (outside the health lock): see
    /// [`on_reset`](Backend::on_reset).
    on_reset: Option<Box<dyn Fn() + Send + Sync>>,
    /// How many times it ran (counted before it runs).
    resets: Resets,
    /// Every script the gate may call, loaded again together when Redis lacks one: see
    /// [`with_scripts`](Backend::with_scripts).
    scripts: Vec<&'static Script>,
    /// Whether that load is running (and asked for again meanwhile): one at a time.
    reloading: Arc<AtomicU8>,
}

/// How many times a backend let go of what its gate held on Redis's word (see
/// [`Backend::on_reset`]), shared with what the gate keeps on it: an answer is kept (a
/// rejection cached, a lease) only if none came since its request was sent (see
/// [`Backend::eval_seen`]). Read under the lock of what keeps it, which the reset takes
/// after it counts: either the answer sees the reset, or the reset sees what was kept.
#[derive(Debug, Clone, Default)]
pub(crate) struct Resets(Arc<AtomicU64>);

impl Resets {
    /// The count now.
    pub(crate) fn now(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }

    /// Whether none came since the count was `seen`.
    pub(crate) fn none_since(&self, seen: u64) -> bool {
        self.now() == seen
    }
}

/// A call's round trip, recorded in the latency histogram when this is dropped: the caller
/// holds it until what follows from Redis's answer is done (a lease kept, the decision
/// counted, the callers of a batch answered), so a recorder that panics as it records (user
/// code) takes none of that away; its panic goes on after.
#[derive(Debug)]
#[must_use = "the latency is recorded when this is dropped"]
pub(crate) struct Latency<'a> {
    histogram: &'a Histogram,
    seconds: f64,
}

impl Drop for Latency<'_> {
    fn drop(&mut self) {
        self.histogram.record(self.seconds);
    }
}

/// [`Backend::reloading`]: no load of the scripts is running...
const IDLE: u8 = 0;
/// ...one is...
const LOADING: u8 = 1;
/// ...and another call met `NOSCRIPT` meanwhile (Redis may have lost them again since the
/// load began): it loads them all once more when it ends.
const AGAIN: u8 = 2;

/// The running load of the scripts: [`IDLE`] again when it ends, however it ends (its
/// runtime may drop it midway).
struct Reloading {
    state: Arc<AtomicU8>,
    /// Set [`IDLE`] by [`again`](Reloading::again): a load started since is another's.
    ended: bool,
}

impl Reloading {
    /// Whether the load is to run once more (a call met `NOSCRIPT` while it ran); if not,
    /// it has ended.
    fn again(&mut self) -> bool {
        let ended = self
            .state
            .compare_exchange(LOADING, IDLE, Ordering::AcqRel, Ordering::Acquire);
        if ended.is_ok() {
            self.ended = true;
            return false;
        }
        // AGAIN: only this task sets the state back.
        self.state.store(LOADING, Ordering::Release);
        true
    }
}

impl Drop for Reloading {
    fn drop(&mut self) {
        if !self.ended {
            self.state.store(IDLE, Ordering::Release);
        }
    }
}

/// The probe of a degraded gate, taken by a call ([`Backend::admit_probe`]) whose request may
/// wait before it goes to Redis (queued for a batch). Dropped before it is
/// [`sent`](Probe::sent) (its caller gave up first), it is given back: the next call
/// probes, as if this one had not come. Spent, nothing was sent, and every call was
/// refused for one more probe interval.
pub(crate) struct Probe {
    /// `None` once sent.
    health: Option<Arc<Mutex<Health>>>,
    /// The next probe this one set...
    taken: Instant,
    /// ...and the one it took, due when it was taken.
    due: Instant,
}

impl Probe {
    /// The probe's request is on its way to Redis: its answer decides the gate's health.
    pub(crate) fn sent(mut self) {
        self.health = None;
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        let Some(health) = self.health.take() else {
            return;
        };
        let mut health = health.lock().unwrap_or_else(PoisonError::into_inner);
        // Unless the gate has moved on since (healthy again, or failed anew).
        if let Health::Degraded { next_probe } = &mut *health
            && *next_probe == self.taken
        {
            *next_probe = self.due;
        }
    }
}

impl fmt::Debug for Probe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Probe")
            .field("sent", &self.health.is_none())
            .finish_non_exhaustive()
    }
}

impl<C> fmt::Debug for Backend<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Backend")
            .field("timeout", &self.timeout)
            .field("probe_interval", &self.probe_interval)
            .field("degraded", &self.degraded.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl<C> Backend<C> {
    /// The longest a decision may take.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The gate's name, for logs.
    pub(crate) fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// `fut`'s output, or `None` if `within` passes first (no timer without a timeout: see
    /// [`within_timeout`]).
    pub(crate) async fn within<F: Future>(&self, within: Duration, fut: F) -> Option<F::Output> {
        within_timeout(self.timeout, within, fut).await
    }

    /// `fut`'s output, or `None` if `deadline` passes first (no timer without a timeout).
    pub(crate) async fn until<F: Future>(&self, deadline: Instant, fut: F) -> Option<F::Output> {
        if unbounded(self.timeout) {
            return Some(fut.await);
        }
        tokio::time::timeout_at(deadline.into(), fut).await.ok()
    }

    /// Whether the gate is deciding by its failure policy.
    pub(crate) fn is_degraded(&self) -> bool {
        self.degraded.load(Ordering::Acquire)
    }
}

impl<C> Backend<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    pub(crate) fn new(
        conn: C,
        timeout: Duration,
        probe_interval: Duration,
        name: Option<String>,
        policy: &'static str,
        labels: &Labels,
    ) -> Backend<C> {
        let transitions = |to| labels.counter(names::TRANSITIONS, &[("to", to)]);
        Backend {
            conn,
            timeout,
            probe_interval,
            health: Arc::new(Mutex::new(Health::Healthy)),
            degraded: AtomicBool::new(false),
            publishing: AtomicBool::new(false),
            answered: AtomicU64::new(0),
            created: Instant::now(),
            name,
            policy,
            metrics: Metrics {
                latency: labels.histogram(names::LATENCY, &[]),
                failures: labels.counter(names::FAILURES, &[]),
                degraded: labels.gauge(names::DEGRADED, &[]),
                to_degraded: transitions("degraded"),
                to_healthy: transitions("healthy"),
            },
            on_reset: None,
            resets: Resets::default(),
            scripts: Vec::new(),
            reloading: Arc::new(AtomicU8::new(IDLE)),
        }
    }

    /// Run `f` each time Redis may have lost its state: it answers again after a failure
    /// (it may have restarted without its data meanwhile), or it does not have a script
    /// (`NOSCRIPT`: restarted, failed over or `SCRIPT FLUSH`, perhaps with no failure seen
    /// here, as when a connection reconnects by itself).
    pub(crate) fn on_reset(mut self, f: impl Fn() + Send + Sync + 'static) -> Self {
        self.on_reset = Some(Box::new(f));
        self
    }

    /// The scripts calls through this backend may use: when Redis lacks the one a call
    /// needs (`NOSCRIPT`), all of them are loaded again with it. Loaded one at a time, on
    /// first use, each would meet `NOSCRIPT` in turn, read as Redis having lost its state
    /// again, and forget (see [`on_reset`](Backend::on_reset)) what the gate took from the
    /// server since the first.
    pub(crate) fn with_scripts(mut self, scripts: Vec<&'static Script>) -> Self {
        self.scripts = scripts;
        self
    }

    /// The count of [`on_reset`](Backend::on_reset)'s runs, for what the gate keeps on
    /// Redis's word.
    pub(crate) fn resets(&self) -> &Resets {
        &self.resets
    }

    /// Let go of what Redis may have lost; the count of resets after this one.
    fn reset(&self) -> u64 {
        let after = self.resets.0.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some(reset) = &self.on_reset {
            reset();
        }
        after
    }

    /// A call sent when the count of resets was `sent` met `NOSCRIPT`: Redis lost its
    /// scripts (and perhaps its keys) before it ran. Reset, unless a reset came since the
    /// call was sent (another call met `NOSCRIPT` from the same loss first, or a probe
    /// answered): what the gate took since then came from the server as it is now (sent
    /// after that reset, on the one connection, it ran after this call), and is kept. Then
    /// load the gate's other scripts.
    fn lost_scripts(&self, script: &Script, sent: u64) {
        let first =
            self.resets
                .0
                .compare_exchange(sent, sent + 1, Ordering::SeqCst, Ordering::SeqCst);
        if first.is_ok()
            && let Some(reset) = &self.on_reset
        {
            reset();
        }
        self.load_others(script);
    }

    /// Redis lacks `script`: load the other scripts of [`with_scripts`](Backend::with_scripts)
    /// too (gone with it), on a task of the current runtime, bounded by the timeout, while
    /// the call that found it missing loads its own and goes on (so it waits no longer than
    /// before). One such task at a time, however many calls meet `NOSCRIPT` together (all
    /// those in flight when Redis lost its scripts): one that meets it while the task runs
    /// has it load every script once more when it ends, as Redis may have lost them again
    /// since it began. Without a runtime, or if a load fails, the first call that needs a
    /// script loads it.
    fn load_others(&self, script: &Script) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.scripts.iter().all(|s| s.hash() == script.hash()) {
            return;
        }
        let started = self
            .reloading
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |state| match state {
                IDLE => Some(LOADING),
                _ => Some(AGAIN),
            });
        if started != Ok(IDLE) {
            return;
        }
        let mut reloading = Reloading {
            state: self.reloading.clone(),
            ended: false,
        };
        let mut load: Vec<&Script> = self
            .scripts
            .iter()
            .filter(|s| s.hash() != script.hash())
            .copied()
            .collect();
        let every = self.scripts.clone();
        let mut conn = self.conn.clone();
        let timeout = self.timeout;
        drop(runtime.spawn(async move {
            loop {
                let pass = async {
                    for script in &load {
                        if script.load(&mut conn).await.is_err() {
                            break;
                        }
                    }
                };
                let _ = within_timeout(timeout, timeout, pass).await;
                if !reloading.again() {
                    break;
                }
                load.clone_from(&every);
            }
        }));
    }

    /// Whether a call may go to Redis now: always while healthy; while degraded, one call
    /// per probe interval (the probe). The others get the [`CallError::Backend`] to decide
    /// by the policy with. For a call that goes to Redis at once (see
    /// [`admit_probe`](Backend::admit_probe) for one that may not).
    pub(crate) fn admit(&self, now: Instant) -> Result<(), CallError> {
        self.admit_probe(now)
            .map(|probe| probe.map_or((), Probe::sent))
    }

    /// [`admit`](Backend::admit), with the [`Probe`] taken if this call is the probe: given
    /// back if it is dropped before it is [`sent`](Probe::sent).
    pub(crate) fn admit_probe(&self, now: Instant) -> Result<Option<Probe>, CallError> {
        if !self.degraded.load(Ordering::Acquire) {
            return Ok(None);
        }
        let mut health = self.health.lock().unwrap_or_else(PoisonError::into_inner);
        let Health::Degraded { next_probe } = *health else {
            return Ok(None);
        };
        if now < next_probe {
            let until_probe = next_probe - now;
            return Err(CallError::Backend {
                error: None,
                until_probe,
            });
        }
        // This call is the probe; others keep using the policy meanwhile.
        let taken = now + self.probe_interval;
        *health = Health::Degraded { next_probe: taken };
        Ok(Some(Probe {
            health: Some(self.health.clone()),
            taken,
            due: next_probe,
        }))
    }

    /// Send `call` within `within` and read `len` integers back: the one way every path calls Redis.
    /// Records the latency; a success marks the gate healthy, a failure is classified (see
    /// the module docs), and a Redis failure is counted and degrades the gate.
    pub(crate) async fn eval(
        &self,
        call: &ScriptCall,
        len: usize,
        within: Duration,
    ) -> Result<Vec<i64>, CallError> {
        let (reply, _, _latency) = self.eval_seen(call, len, within).await?;
        Ok(reply)
    }

    /// [`eval`](Backend::eval), with the count of [`resets`](Backend::resets) when the
    /// command that answered was sent: what the gate keeps on the answer's word is kept
    /// only if no reset came since; and the call's [`Latency`], recorded when the caller
    /// drops it, once what follows from the answer is done.
    pub(crate) async fn eval_seen(
        &self,
        call: &ScriptCall,
        len: usize,
        within: Duration,
    ) -> Result<(Vec<i64>, u64, Latency<'_>), CallError> {
        let started = Instant::now();
        // Healthy at the start: not the probe of a degraded gate.
        let regular = !self.degraded.load(Ordering::Acquire);
        let mut conn = self.conn.clone();
        let mut seen = self.resets.now();
        let reply = self
            .within(
                within,
                query::<_, Vec<i64>>(&mut conn, call, || {
                    self.lost_scripts(call.script(), seen);
                    // The command is sent again after that.
                    seen = self.resets.now();
                }),
            )
            .await;
        let latency = Latency {
            histogram: &self.metrics.latency,
            seconds: started.elapsed().as_secs_f64(),
        };
        // The gate's state first, then the metrics: a recorder that panics takes the
        // answer from this caller, not from the gate's health (recorded here, after it,
        // for a failure).
        let (reply, reset) = self.settle(reply, len, regular, within)?;
        // An answer that brings the gate back is of the server as it is now: kept.
        Ok((reply, reset.unwrap_or(seen), latency))
    }

    /// What `reply` (to a call made `regular`ly, given `within`, expecting `len` values)
    /// comes to, the gate's health moved by it; with the count of resets after the one it
    /// made, if it brought the gate back. Only an answer to a call made while the gate was
    /// degraded (its probe) brings it back: one made while healthy and answered after
    /// another call failed was sent before the failure, and says nothing of Redis since.
    fn settle(
        &self,
        reply: Option<redis::RedisResult<Vec<i64>>>,
        len: usize,
        regular: bool,
        within: Duration,
    ) -> Result<(Vec<i64>, Option<u64>), CallError> {
        let error = match reply {
            Some(Ok(v)) if v.len() == len => {
                self.answered();
                return Ok((v, self.probed(regular)));
            }
            Some(Ok(v)) => GateError::backend(BackendMessage(format!(
                "unexpected reply from the gate script: {} values where {len} were expected",
                v.len()
            ))),
            Some(Err(e)) => match e.code() {
                // Only a call on one key can get this at the top level (every script
                // decides each key under pcall): that key's error.
                Some("WRONGTYPE") => {
                    self.answered();
                    self.probed(regular);
                    return Err(CallError::Request(
                        key_failure(KEY_WRONGTYPE).expect("a key failure"),
                    ));
                }
                // The connection was closed under a call made while healthy (an idle
                // `timeout`, `CLIENT KILL`, a load balancer, or Redis going down): a
                // reconnecting connection has a new one on the way, so the next call is
                // the probe, at once. If Redis is down that probe fails too, and the gate
                // waits a probe interval as after any failure.
                _ if regular && e.is_connection_dropped() => {
                    return Err(self.fail_probing(GateError::backend(e), Duration::ZERO));
                }
                _ => GateError::backend(e),
            },
            // How long it waited: the gate's timeout, or the longer wait this call was given
            // (a region's refresh waits at least 500 ms); a call given what was left of the
            // timeout names the whole timeout.
            None => GateError::Timeout(within.max(self.timeout)),
        };
        Err(self.fail(error))
    }

    /// Redis answered a call made `regular`ly (healthy at its start) or not (the probe of a
    /// degraded gate): see [`settle`](Backend::settle).
    fn probed(&self, regular: bool) -> Option<u64> {
        match regular {
            true => None,
            false => self.healthy(),
        }
    }

    fn answered(&self) {
        let since = u64::try_from(self.created.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.answered.store(since, Ordering::Relaxed);
    }

    /// Whether what the gate keeps on Redis's word (rejections cached) is to be checked
    /// there at `now`: Redis may have lost its keys (restarted empty) with no call of the
    /// gate to see it fail or miss a script. So when a healthy gate has had no answer from
    /// Redis for a probe interval, or a probe of a degraded one is due.
    pub(crate) fn silent(&self, now: Instant) -> bool {
        if self.is_degraded() {
            let health = self.health.lock().unwrap_or_else(PoisonError::into_inner);
            return match *health {
                Health::Degraded { next_probe } => now >= next_probe,
                Health::Healthy => false,
            };
        }
        let last = self
            .created
            .checked_add(Duration::from_nanos(self.answered.load(Ordering::Relaxed)))
            .unwrap_or(self.created);
        now.saturating_duration_since(last) >= self.probe_interval
    }

    /// Record a failure of Redis (`error`): counted; the gate degrades and probes every
    /// probe interval.
    pub(crate) fn fail(&self, error: GateError) -> CallError {
        self.fail_probing(error, self.probe_interval)
    }

    /// [`fail`](Backend::fail), with the next probe `until_probe` from now.
    fn fail_probing(&self, error: GateError, until_probe: Duration) -> CallError {
        let mut health = self.health.lock().unwrap_or_else(PoisonError::into_inner);
        let next_probe = Instant::now() + until_probe;
        let was_healthy = matches!(*health, Health::Healthy);
        *health = Health::Degraded { next_probe };
        self.degraded.store(true, Ordering::SeqCst);
        drop(health);
        // Recorded once the gate is degraded, after the lock, each metric even if a recorder
        // panics in one before (the first panic goes on after them): a recorder that
        // panics keeps nothing from the gate, nor a count from the others.
        let mut panics = Panics::new();
        if was_healthy {
            panics.run(|| self.publish_degraded());
        }
        panics.run(|| self.metrics.failures.increment(1));
        if was_healthy {
            panics.run(|| self.metrics.to_degraded.increment(1));
            // A dropped idle connection is probed at once: not "probing in 0ns".
            let first = match until_probe.is_zero() {
                true => "at once".to_owned(),
                false => format!("in {until_probe:?}"),
            };
            tracing::warn!(
                gate = self.name.as_deref().unwrap_or(crate::metrics::DEFAULT_NAME),
                policy = self.policy,
                %error,
                "redis failed: deciding by the failure policy, probing {first}, then every {:?}",
                self.probe_interval
            );
        }
        panics.resume();
        CallError::Backend {
            error: Some(error),
            until_probe,
        }
    }

    /// Set the degraded gauge to the gate's health, outside the health lock (the recorder
    /// is user code), in the order of the transitions: one caller sets it at a time, to the
    /// health as it is then, and a caller whose transition finds another one setting it
    /// leaves the gauge to that one, which sets it again if the health moved meanwhile. So
    /// the gauge never goes back to a state older than one it showed, and ends at the
    /// gate's health. (Set by each transition's caller after the lock, a failure's 1 could
    /// land after the 0 of the recovery that followed it, on a healthy gate.) A recorder
    /// that panics keeps no later transition from the gauge: its panic goes on after.
    fn publish_degraded(&self) {
        let mut panics = Panics::new();
        while self
            .publishing
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            let degraded = self.degraded.load(Ordering::SeqCst);
            panics.run(|| self.metrics.degraded.set(if degraded { 1.0 } else { 0.0 }));
            self.publishing.store(false, Ordering::SeqCst);
            // A transition that found the gauge taken was made before this load.
            if self.degraded.load(Ordering::SeqCst) == degraded {
                break;
            }
        }
        panics.resume();
    }

    /// Mark the gate healthy; if it was degraded, let go of what Redis may have lost, and
    /// return the count of resets after that.
    fn healthy(&self) -> Option<u64> {
        if !self.degraded.load(Ordering::Acquire) {
            return None;
        }
        let mut health = self.health.lock().unwrap_or_else(PoisonError::into_inner);
        let Health::Degraded { .. } = *health else {
            return None;
        };
        *health = Health::Healthy;
        self.degraded.store(false, Ordering::SeqCst);
        drop(health);
        // What Redis may have lost is let go of first; then the metrics, as in `fail`.
        let mut panics = Panics::new();
        let mut after = None;
        panics.run(|| after = Some(self.reset()));
        panics.run(|| self.publish_degraded());
        panics.run(|| self.metrics.to_healthy.increment(1));
        tracing::info!(
            gate = self.name.as_deref().unwrap_or(crate::metrics::DEFAULT_NAME),
            "redis answers again: the gate is back on redis"
        );
        panics.resume();
        after
    }
}

/// Send `call`; if Redis does not
/// have the script (restarted, failed over, `SCRIPT FLUSH`, or a Cluster node that joined
/// since), call `reset`, load it and send the command again; if that still meets
/// `NOSCRIPT`, send it with the script's source (`EVAL`, which leaves the script in the
/// cache of the node that runs it).
///
/// The source goes with the command, so it reaches the node that lacks the script: on a
/// Cluster, the one the command is sent on to by `ASK` or `MOVED`. `SCRIPT LOAD` goes to
/// the nodes the client knows of, which a node receiving a slot as it joins the Cluster is
/// not (nor is it if a node it goes to fails): loaded alone, the command sent again met
/// `NOSCRIPT` again, every call on that slot failed while it moved, and the gate
/// degraded. The load comes first all the same: on one connection, the other scripts the
/// gate loads meanwhile (see `Backend::load_others`) are loaded before the command's
/// answer comes back.
async fn query<C, T>(conn: &mut C, call: &ScriptCall, reset: impl FnOnce()) -> redis::RedisResult<T>
where
    C: ConnectionLike,
    T: redis::FromRedisValue,
{
    let no_script = |e: &redis::RedisError| {
        e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
    };
    match call.cmd().query_async(conn).await {
        Err(e) if no_script(&e) => {
            reset();
            let _ = call.script().load(conn).await;
            match call.cmd().query_async(conn).await {
                Err(e) if no_script(&e) => call.with_source().query_async(conn).await,
                other => other,
            }
        }
        other => other,
    }
}

#[cfg(all(test, feature = "metrics"))]
mod tests {
    use std::sync::{Arc, Mutex, OnceLock, TryLockError};

    use metrics::{
        Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata,
        Recorder, SharedString, Unit,
    };

    use super::*;

    /// A connection whose every call answers `[1]` once it takes a permit of its own.
    #[derive(Clone)]
    struct Fake(Arc<tokio::sync::Semaphore>);

    impl Fake {
        /// Its calls answer at once.
        fn answering() -> Fake {
            Fake::held(tokio::sync::Semaphore::MAX_PERMITS)
        }

        /// Its calls never answer.
        fn silent() -> Fake {
            Fake::held(0)
        }

        /// `permits` of its calls answer (more once permits are added).
        fn held(permits: usize) -> Fake {
            Fake(Arc::new(tokio::sync::Semaphore::new(permits)))
        }
    }

    impl ConnectionLike for Fake {
        fn req_packed_command<'a>(
            &'a mut self,
            _: &'a redis::Cmd,
        ) -> redis::RedisFuture<'a, redis::Value> {
            let permits = self.0.clone();
            Box::pin(async move {
                permits.acquire().await.expect("never closed").forget();
                Ok(redis::Value::Array(vec![redis::Value::Int(1)]))
            })
        }
        fn req_packed_commands<'a>(
            &'a mut self,
            _: &'a redis::Pipeline,
            _: usize,
            _: usize,
        ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
            Box::pin(std::future::pending())
        }
        fn get_db(&self) -> i64 {
            0
        }
    }

    /// `b`, with the count of its resets.
    fn counting_resets<C>(b: Backend<C>) -> (Backend<C>, Arc<AtomicU64>)
    where
        C: ConnectionLike + Clone + Send + Sync + 'static,
    {
        let resets = Arc::new(AtomicU64::new(0));
        let counted = resets.clone();
        let b = b.on_reset(move || {
            counted.fetch_add(1, Ordering::Relaxed);
        });
        (b, resets)
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// An answer to a call sent while the gate was healthy, read after another call failed
    /// (timed out: Redis slow, not gone), is not a probe: the gate stays degraded until
    /// its probe answers, and keeps what it holds on Redis's word. Taken for one, under a
    /// Redis answering about its timeout each answer of a call in flight brought the gate
    /// back (forgetting its leases and cached rejections) and the next timeout degraded it
    /// again: a transition each way, logged and counted, per batch.
    #[test]
    fn an_answer_to_a_call_sent_before_a_failure_does_not_bring_the_gate_back() {
        let conn = Fake::held(0);
        let second = Duration::from_secs(1);
        let (b, resets) = counting_resets(backend(conn.clone(), &metrics::NoopRecorder));
        let rt = runtime();
        // The connection answers `[1]` to any command.
        let call = crate::gate::scripts::token_bucket().call(0);
        rt.block_on(async {
            let mut sent = std::pin::pin!(b.eval(&call, 1, second));
            assert!(futures::poll!(sent.as_mut()).is_pending());
            let _ = b.fail(GateError::Timeout(second));
            conn.0.add_permits(1);
            assert_eq!(sent.await.unwrap(), [1], "its caller has Redis's answer");
            assert!(b.is_degraded(), "it was sent while healthy: not a probe");
            assert_eq!(resets.load(Ordering::Relaxed), 0, "nothing let go of");
            // A call made while degraded (the probe) brings the gate back.
            conn.0.add_permits(1);
            assert_eq!(b.eval(&call, 1, second).await.unwrap(), [1]);
            assert!(!b.is_degraded());
            assert_eq!(resets.load(Ordering::Relaxed), 1);
        });
    }

    type Hook = Arc<dyn Fn() + Send + Sync>;

    /// A gauge that calls its hook on every change.
    struct Hooked(Hook);

    impl GaugeFn for Hooked {
        fn increment(&self, _: f64) {
            (self.0)();
        }
        fn decrement(&self, _: f64) {
            (self.0)();
        }
        fn set(&self, _: f64) {
            (self.0)();
        }
    }

    impl CounterFn for Hooked {
        fn increment(&self, _: u64) {
            (self.0)();
        }
        fn absolute(&self, _: u64) {
            (self.0)();
        }
    }

    impl HistogramFn for Hooked {
        fn record(&self, _: f64) {
            (self.0)();
        }
    }

    /// Hooks the metric named `name`; every other metric does nothing.
    fn hook_on(hook: Hook, name: &'static str) -> KeyRecorder {
        KeyRecorder(Arc::new(move |key: &Key| {
            if key.name() == name {
                hook();
            }
        }))
    }

    /// A backend over `conn` (a timeout and a probe interval of 1 s), its metrics
    /// registered with `recorder`.
    fn backend<C>(conn: C, recorder: &dyn Recorder) -> Backend<C>
    where
        C: ConnectionLike + Clone + Send + Sync + 'static,
    {
        let second = Duration::from_secs(1);
        metrics::with_local_recorder(recorder, || {
            Backend::new(conn, second, second, None, "error", &Labels::new(None))
        })
    }

    /// Failures and recoveries racing on threads leave the degraded gauge at the gate's
    /// health: set outside the health lock, it still follows the transitions' order.
    #[test]
    fn the_degraded_gauge_ends_at_the_health_when_transitions_race() {
        let second = Duration::from_secs(1);
        let b = backend(Fake::silent(), &metrics::NoopRecorder);
        for _ in 0..200 {
            std::thread::scope(|s| {
                let fail = || {
                    let _ = b.fail(GateError::Timeout(second));
                };
                s.spawn(fail);
                s.spawn(|| {
                    let _ = b.healthy();
                });
                s.spawn(fail);
            });
            let shown = b.metrics.degraded.value();
            assert_eq!(shown, f64::from(u8::from(b.is_degraded())));
        }
    }

    /// A transition made while another caller sets the gauge (here by the recorder
    /// itself, as it shows a failure) is left to that caller, which sets the gauge again:
    /// it ends at the gate's health.
    #[test]
    fn a_transition_made_while_the_gauge_is_set_is_shown_after() {
        let slot: Slot = Arc::default();
        let changes = Arc::new(AtomicU64::new(0));
        let hook: Hook = {
            let (slot, changes) = (slot.clone(), changes.clone());
            Arc::new(move || {
                if changes.fetch_add(1, Ordering::Relaxed) == 0 {
                    slot.get().expect("built").healthy();
                }
            })
        };
        let _ = slot.set(backend(Fake::silent(), &hook_on(hook, names::DEGRADED)));
        let b = slot.get().unwrap();
        let _ = b.fail(GateError::Timeout(Duration::from_secs(1)));
        assert!(!b.is_degraded());
        assert_eq!(b.metrics.degraded.value(), 0.0);
        assert_eq!(changes.load(Ordering::Relaxed), 2, "1, then 0");
    }

    /// The degraded gauge is set outside the health lock: a metrics recorder is user code,
    /// and one that is slow, or that calls the gate back, must not hold up or deadlock
    /// every caller that takes the lock (a failure, a probe, a recovery).
    #[test]
    fn the_degraded_gauge_is_set_outside_the_health_lock() {
        let (backend, seen) = gauge_watched();
        let b = backend.get().unwrap();
        let second = Duration::from_secs(1);
        let _ = b.fail(GateError::Timeout(second));
        b.healthy();
        assert_eq!(*seen.lock().unwrap(), [(false, true), (false, false)]);
    }

    /// A backend, set once built, for the hooks its recorder calls.
    type Slot = Arc<OnceLock<Backend<Fake>>>;
    /// At each change of the degraded gauge: whether the health lock was held, and whether
    /// the gate was degraded.
    type Seen = Arc<Mutex<Vec<(bool, bool)>>>;

    /// A backend whose degraded gauge records what [`Seen`] holds.
    fn gauge_watched() -> (Slot, Seen) {
        let slot: Slot = Arc::default();
        let seen: Seen = Arc::default();
        let hook: Hook = {
            let (slot, seen) = (slot.clone(), seen.clone());
            Arc::new(move || {
                let b = slot.get().expect("built");
                let locked = matches!(b.health.try_lock(), Err(TryLockError::WouldBlock));
                seen.lock().unwrap().push((locked, b.is_degraded()));
            })
        };
        let _ = slot.set(backend(Fake::silent(), &hook_on(hook, names::DEGRADED)));
        (slot, seen)
    }

    /// Every metric op of this recorder calls its hook with the metric's key.
    struct KeyRecorder(Arc<dyn Fn(&Key) + Send + Sync>);

    impl KeyRecorder {
        fn hook(&self, key: &Key) -> Arc<Hooked> {
            let (hook, key) = (self.0.clone(), key.clone());
            Arc::new(Hooked(Arc::new(move || hook(&key))))
        }
    }

    impl Recorder for KeyRecorder {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            Counter::from_arc(self.hook(key))
        }
        fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::from_arc(self.hook(key))
        }
        fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::from_arc(self.hook(key))
        }
    }

    /// A recorder panicking as the degraded gauge moves keeps no count from the transition:
    /// the failure and each transition are counted all the same, and the panic goes on.
    #[test]
    fn a_degraded_gauge_panicking_keeps_no_count_from_a_transition() {
        let counted: Arc<Mutex<Vec<String>>> = Arc::default();
        let hook = {
            let counted = counted.clone();
            move |key: &Key| {
                if key.name() == names::DEGRADED {
                    panic!("a recorder panicking");
                }
                let to: Vec<&str> = key
                    .labels()
                    .filter(|l| l.key() == "to")
                    .map(|l| l.value())
                    .collect();
                counted
                    .lock()
                    .unwrap()
                    .push(format!("{} {to:?}", key.name()));
            }
        };
        let second = Duration::from_secs(1);
        let b = backend(Fake::silent(), &KeyRecorder(Arc::new(hook)));
        let unwound =
            |f: &dyn Fn()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err();
        assert!(unwound(&|| {
            let _ = b.fail(GateError::Timeout(second));
        }));
        assert!(b.is_degraded());
        assert!(unwound(&|| {
            let _ = b.healthy();
        }));
        assert!(!b.is_degraded());
        assert_eq!(
            *counted.lock().unwrap(),
            [
                "flowgate_gate_failures_total []",
                "flowgate_gate_transitions_total [\"degraded\"]",
                "flowgate_gate_transitions_total [\"healthy\"]",
            ]
        );
    }

    /// A metrics recorder panicking as a call's latency or a failure is recorded (after
    /// Redis answered) keeps neither a failure nor a recovery from the gate's health: the
    /// panic goes on to the caller, the gate's state is what the answer says, and a
    /// recovery lets go of what Redis may have lost.
    #[test]
    fn a_recorder_panicking_on_a_calls_metrics_keeps_the_answer_from_the_gates_health() {
        for metric in [names::LATENCY, names::FAILURES, names::DEGRADED] {
            answer_settles_despite_a_recorder_panicking_on(metric);
        }
    }

    fn answer_settles_despite_a_recorder_panicking_on(metric: &'static str) {
        let hook: Hook = Arc::new(|| panic!("a recorder panicking"));
        let second = Duration::from_secs(1);
        let (b, resets) = counting_resets(backend(Fake::answering(), &hook_on(hook, metric)));
        let rt = runtime();
        // The connection answers `[1]` to any command.
        let script = crate::gate::scripts::token_bucket().call(0);
        let call = |len| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                rt.block_on(b.eval(&script, len, second))
            }))
        };
        // An answer of one value where two were expected: a failure of Redis.
        assert!(call(2).is_err(), "{metric}: the recorder's panic goes on");
        assert!(b.is_degraded(), "{metric}: the failure degrades the gate");
        // The answer expected: the gate recovers.
        let _ = call(1);
        assert!(
            !b.is_degraded(),
            "{metric}: the answer makes the gate healthy"
        );
        let resets = resets.load(Ordering::Relaxed);
        assert_eq!(resets, 1, "{metric}: what Redis may have lost is let go of");
    }
}
