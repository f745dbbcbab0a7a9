//! A deterministic simulated downstream and a load driver, for tests, benches and the knee
//! finder.
//!
//! Nothing here talks to a network: a [`Downstream`] answers each call after a latency that
//! grows with the number of calls it has in flight, and [`drive`] runs many client tasks
//! against it through a [`Bulkhead`]. Everything runs on tokio's clock, so under paused
//! time (`#[tokio::test(start_paused = true)]`, or a current-thread runtime built with
//! `start_paused(true)`) a two-minute scenario (100 000-odd calls) takes about half a second
//! of real time optimised (ten times that unoptimised) and, with the same seed, answers
//! exactly the same every time.
//!
//! # The latency model
//!
//! A call that starts while `n` calls are in flight (itself included) takes
//!
//! ```text
//! latency(n) = base × (1 + slope·(n − 1) + max(0, k^(n − knee) − 1)) × (1 + jitter·u)
//! ```
//!
//! where `u` is drawn uniformly from `[−1, 1]` by a seeded generator. Below the knee the
//! latency grows linearly and gently (`slope`, the cost of sharing); from the knee on the
//! exponential term (`k`, the [`steepness`](DownstreamBuilder::steepness)) takes over, as a
//! queue builds up. The exponential term counts only at and above the knee (for `n < knee`
//! it would be negative), so without jitter the latency is never below `base`. Its
//! throughput, `n / latency(n)` for a saturated closed loop, peaks at the knee whenever
//! `knee · ln k > 1 − slope` (true for every scenario below).
//!
//! Two failure modes on top:
//! - **capacity**: a call that would make more than `capacity` calls in flight is
//!   [`Overloaded`](Status::Overloaded), answered after `base` (a fast `503`); refused at
//!   the door, it never counts as in flight.
//! - **timeout**: a call whose latency would exceed `timeout` is
//!   [`TimedOut`](Status::TimedOut) after exactly `timeout`.
//!
//! The knee can change over time ([`knee_at`](DownstreamBuilder::knee_at)): from a given
//! time since the downstream was built, the knee is a new value and the capacity is scaled
//! by the same ratio. A latency is fixed when its call starts. [`Reply::rtt`] is the model's
//! latency; the call sleeps it on tokio's timer, which rounds deadlines up to the next
//! millisecond.
//!
//! # The driver
//!
//! [`drive`] runs `clients` closed-loop tasks for a [`Load`]'s duration: each acquires a
//! permit from the bulkhead, calls the downstream, records the reply, gives the permit back,
//! waits its think time (zero by default) and starts over. An acquisition the bulkhead sheds
//! (its waiting room full, its wait timed out) makes no call and records nothing: the client
//! waits its think time (at least a millisecond) and starts over. A closed bulkhead ends the
//! clients. With more clients than the
//! downstream's knee the offered load is above capacity and the bulkhead's limit decides
//! the concurrency. A ticker records the bulkhead's `max_in_flight` every
//! [`tick`](Load::tick). Each call ends with its outcome recorded on the permit, so an
//! adaptive bulkhead learns from it ([`drive_adaptive`] builds one around an
//! [`AdaptiveLimit`]). At the end of the duration every task is aborted: calls still in
//! flight are dropped (an adaptive bulkhead sees them as ignored) and not recorded.
//!
//! # Examples
//!
//! ```
//! use std::time::Duration;
//! use flowgate::adaptive::sim::{self, Load, Scenario};
//! use flowgate::bulkhead::Bulkhead;
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let scenario = Scenario::steep_knee();
//! let downstream = scenario.downstream();
//! let load = Load::new(200, Duration::from_secs(10));
//! let report = sim::drive(&downstream, &Bulkhead::new(40)?, &load).await;
//! let throughput = report.throughput(Duration::from_secs(2), Duration::from_secs(10));
//! assert!(throughput > 1_000.0, "{throughput}/s");
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::{Instant, sleep};

use crate::adaptive::sample::{AdaptiveLimit, Outcome};
use crate::bulkhead::{AcquireError, Bulkhead};
use crate::error::{ConfigError, ConfigErrorKind};

mod report;

pub use report::{CallRecord, Report};

/// The longest latency the model answers (an hour); beyond it the exponential term is cut.
const MAX_LATENCY: Duration = Duration::from_secs(3_600);

/// How the downstream answered one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Status {
    /// Served.
    Ok,
    /// Refused at once: more than `capacity` calls were in flight (a `503`).
    Overloaded,
    /// The latency exceeded the timeout; the caller gave up after the timeout.
    TimedOut,
}

impl Status {
    /// What an adaptive limit learns from it: `Ok`, or back-pressure for both failures.
    pub fn outcome(self) -> Outcome {
        match self {
            Status::Ok => Outcome::Ok,
            Status::Overloaded | Status::TimedOut => Outcome::BackPressure,
        }
    }
}

/// One answered call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reply {
    /// How it ended.
    pub status: Status,
    /// How long it took.
    pub rtt: Duration,
    /// Calls in flight when it started, itself included.
    pub in_flight: u32,
}

/// A simulated downstream: see the [module docs](self) for the latency model.
///
/// Cloning is cheap and shares the downstream (its in-flight count, its generator, its
/// clock).
#[derive(Clone)]
pub struct Downstream {
    inner: Arc<Inner>,
}

struct Inner {
    model: Model,
    start: Instant,
    state: Mutex<State>,
}

#[derive(Debug, Clone)]
struct Model {
    base: Duration,
    slope: f64,
    steepness: f64,
    knee: u32,
    capacity: Option<u32>,
    timeout: Option<Duration>,
    jitter: f64,
    seed: u64,
    /// `(from, knee)`, sorted by time.
    changes: Vec<(Duration, u32)>,
}

struct State {
    in_flight: u32,
    rng: fastrand::Rng,
}

impl Downstream {
    /// A builder with the defaults: base 25 ms, slope 0.01, steepness 1.1, knee 40, no
    /// capacity, no timeout, no jitter, seed 0.
    pub fn builder() -> DownstreamBuilder {
        DownstreamBuilder {
            model: Model {
                base: Duration::from_millis(25),
                slope: 0.01,
                steepness: 1.1,
                knee: 40,
                capacity: None,
                timeout: None,
                jitter: 0.0,
                seed: 0,
                changes: Vec::new(),
            },
        }
    }

    fn from_model(model: Model) -> Downstream {
        let rng = fastrand::Rng::with_seed(model.seed);
        Downstream {
            inner: Arc::new(Inner {
                model,
                start: Instant::now(),
                state: Mutex::new(State { in_flight: 0, rng }),
            }),
        }
    }

    /// Call the downstream: the future counts itself in flight at once (when created, not
    /// when first polled), sleeps the call's latency on tokio's clock, and answers.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future ends the call: it leaves the in-flight count and answers nothing.
    ///
    /// # Panics
    ///
    /// When polled outside a tokio runtime with timers enabled.
    pub fn call(&self) -> impl Future<Output = Reply> + Send + 'static {
        let (status, latency, in_flight) = self.start_call();
        let guard = (status != Status::Overloaded).then(|| InFlight(self.inner.clone()));
        async move {
            sleep(latency).await;
            drop(guard);
            Reply {
                status,
                rtt: latency,
                in_flight,
            }
        }
    }

    fn start_call(&self) -> (Status, Duration, u32) {
        let elapsed = self.elapsed();
        let model = &self.inner.model;
        let mut state = self.state();
        let n = state.in_flight.saturating_add(1);
        let knee = model.knee_at(elapsed);
        if model.capacity_at(elapsed).is_some_and(|cap| n > cap) {
            // Refused at the door: it never counts as in flight. Answered after `base`, at
            // most an hour, as every latency.
            return (Status::Overloaded, model.base.min(MAX_LATENCY), n);
        }
        state.in_flight = n;
        let u = state.rng.f64() * 2.0 - 1.0;
        drop(state);
        let factor = model.factor(n, knee) * (1.0 + model.jitter * u);
        let latency = Duration::try_from_secs_f64(model.base.as_secs_f64() * factor)
            .unwrap_or(MAX_LATENCY)
            .min(MAX_LATENCY);
        match model.timeout {
            Some(timeout) if latency > timeout => (Status::TimedOut, timeout, n),
            _ => (Status::Ok, latency, n),
        }
    }

    /// The model's latency, without jitter, for a call starting with `n` in flight (itself
    /// included) under the knee in force now, at most an hour. Capacity and timeout do not
    /// apply.
    pub fn latency(&self, n: u32) -> Duration {
        let model = &self.inner.model;
        let factor = model.factor(n.max(1), model.knee_at(self.elapsed()));
        Duration::try_from_secs_f64(model.base.as_secs_f64() * factor)
            .unwrap_or(MAX_LATENCY)
            .min(MAX_LATENCY)
    }

    /// The knee in force now.
    pub fn knee(&self) -> u32 {
        self.inner.model.knee_at(self.elapsed())
    }

    /// The knee in force at `elapsed` since the downstream was built.
    pub fn knee_at(&self, elapsed: Duration) -> u32 {
        self.inner.model.knee_at(elapsed)
    }

    /// The capacity in force now (`None`: no capacity).
    pub fn capacity(&self) -> Option<u32> {
        self.inner.model.capacity_at(self.elapsed())
    }

    /// Calls in flight now.
    pub fn in_flight(&self) -> u32 {
        self.state().in_flight
    }

    /// Time since the downstream was built, on tokio's clock.
    pub fn elapsed(&self) -> Duration {
        self.inner.start.elapsed()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl fmt::Debug for Downstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Downstream")
            .field("model", &self.inner.model)
            .field("in_flight", &self.in_flight())
            .field("elapsed", &self.elapsed())
            .finish()
    }
}

/// Leaves the in-flight count when the call ends or is dropped.
struct InFlight(Arc<Inner>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut state = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        state.in_flight = state.in_flight.saturating_sub(1);
    }
}

impl Model {
    /// `1 + slope·(n − 1) + max(0, k^(n − knee) − 1)`.
    fn factor(&self, n: u32, knee: u32) -> f64 {
        let linear = self.slope * f64::from(n.saturating_sub(1));
        let over = f64::from(n) - f64::from(knee);
        let queue = if over > 0.0 {
            self.steepness.powf(over) - 1.0
        } else {
            0.0
        };
        1.0 + linear + queue
    }

    fn knee_at(&self, elapsed: Duration) -> u32 {
        self.changes
            .iter()
            .rev()
            .find(|(from, _)| *from <= elapsed)
            .map_or(self.knee, |&(_, knee)| knee)
    }

    fn capacity_at(&self, elapsed: Duration) -> Option<u32> {
        let knee = self.knee_at(elapsed);
        self.capacity.map(|cap| {
            let scaled = u64::from(cap) * u64::from(knee) / u64::from(self.knee);
            u32::try_from(scaled).unwrap_or(u32::MAX).max(1)
        })
    }
}

/// Builds a [`Downstream`].
#[derive(Debug, Clone)]
pub struct DownstreamBuilder {
    model: Model,
}

impl DownstreamBuilder {
    /// The latency of a lone call (default 25 ms), and of a call refused above the
    /// capacity. The model answers no latency above an hour: a `base` longer than that has
    /// these calls take an hour.
    pub fn base(mut self, base: Duration) -> Self {
        self.model.base = base;
        self
    }

    /// The linear growth per extra call in flight, as a fraction of `base` (default 0.01).
    pub fn slope(mut self, slope: f64) -> Self {
        self.model.slope = slope;
        self
    }

    /// `k`, the growth factor per call above the knee (default 1.1): 1.03 is a shallow
    /// knee, 1.3 a steep one.
    pub fn steepness(mut self, k: f64) -> Self {
        self.model.steepness = k;
        self
    }

    /// The knee at the start (default 40).
    pub fn knee(mut self, knee: u32) -> Self {
        self.model.knee = knee;
        self
    }

    /// More calls in flight than this are refused at once (default: none). Scaled with the
    /// knee when it changes.
    pub fn capacity(mut self, capacity: u32) -> Self {
        self.model.capacity = Some(capacity);
        self
    }

    /// A call slower than this times out after it (default: none).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.model.timeout = Some(timeout);
        self
    }

    /// The relative jitter of every latency, in `[0, 1)` (default 0: none): 0.1 draws the
    /// factor uniformly from `[0.9, 1.1]`.
    pub fn jitter(mut self, jitter: f64) -> Self {
        self.model.jitter = jitter;
        self
    }

    /// The generator's seed (default 0).
    pub fn seed(mut self, seed: u64) -> Self {
        self.model.seed = seed;
        self
    }

    /// From `at` after the downstream is built, the knee is `knee` (and the capacity scaled
    /// by `knee / initial knee`). May be called several times.
    pub fn knee_at(mut self, at: Duration, knee: u32) -> Self {
        self.model.changes.push((at, knee));
        self
    }

    /// Build the downstream; its clock starts now.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `sim.base` if zero, `sim.knee` if a knee is zero, `sim.capacity`
    /// if zero, `sim.timeout` if zero, `sim.slope` if negative or not finite,
    /// `sim.steepness` if below 1 or not finite, `sim.jitter` outside `[0, 1)`.
    pub fn build(self) -> Result<Downstream, ConfigError> {
        let m = &self.model;
        if m.base.is_zero() {
            return Err(ConfigError::zero_duration("sim.base"));
        }
        if m.knee == 0 || m.changes.iter().any(|&(_, k)| k == 0) {
            return Err(ConfigError::zero("sim.knee"));
        }
        if m.capacity == Some(0) {
            return Err(ConfigError::zero("sim.capacity"));
        }
        if m.timeout.is_some_and(|t| t.is_zero()) {
            return Err(ConfigError::zero_duration("sim.timeout"));
        }
        if !(m.slope.is_finite() && m.slope >= 0.0) {
            return Err(ConfigError::new(
                "sim.slope",
                ConfigErrorKind::Inconsistent,
                "must be finite and at least 0",
            ));
        }
        if !(m.steepness.is_finite() && m.steepness >= 1.0) {
            return Err(ConfigError::new(
                "sim.steepness",
                ConfigErrorKind::Inconsistent,
                "must be finite and at least 1",
            ));
        }
        if !(0.0..1.0).contains(&m.jitter) {
            return Err(ConfigError::new(
                "sim.jitter",
                ConfigErrorKind::Inconsistent,
                "must be in [0, 1)",
            ));
        }
        let mut model = self.model;
        model.changes.sort_by_key(|&(at, _)| at);
        Ok(Downstream::from_model(model))
    }
}

/// A named downstream and how long to run it: the scenarios of the adaptive bench.
///
/// Every scenario: base latency 25 ms, timeout 1 s, and a capacity (calls refused above
/// it) at twice the knee.
#[derive(Debug, Clone)]
pub struct Scenario {
    name: &'static str,
    model: Model,
    duration: Duration,
}

impl Scenario {
    fn new(name: &'static str, duration: Duration, model: Model) -> Scenario {
        Scenario {
            name,
            model,
            duration,
        }
    }

    fn model(knee: u32, slope: f64, steepness: f64, jitter: f64) -> Model {
        Model {
            base: Duration::from_millis(25),
            slope,
            steepness,
            knee,
            capacity: Some(knee * 2),
            timeout: Some(Duration::from_secs(1)),
            jitter,
            seed: 19,
            changes: Vec::new(),
        }
    }

    /// Knee 40, slope 0.01, steepness 1.05, jitter ±5 %, 60 s: latency 1.39× base at the
    /// knee, 2.1× ten calls above it, 3.2× twenty above.
    pub fn shallow_knee() -> Scenario {
        Scenario::new(
            "shallow knee",
            Duration::from_secs(60),
            Scenario::model(40, 0.01, 1.05, 0.05),
        )
    }

    /// Knee 40, slope 0.002, steepness 1.3, jitter ±5 %, 60 s: nearly flat up to the knee
    /// (1.08× base), then a cliff: 13.9× base ten calls above it.
    pub fn steep_knee() -> Scenario {
        Scenario::new(
            "steep knee",
            Duration::from_secs(60),
            Scenario::model(40, 0.002, 1.3, 0.05),
        )
    }

    /// Knee 40, slope 0.005, steepness 1.1, jitter ±40 %, 60 s: the RTT noise is larger
    /// than the signal below the knee.
    pub fn noisy() -> Scenario {
        Scenario::new(
            "noisy",
            Duration::from_secs(60),
            Scenario::model(40, 0.005, 1.1, 0.4),
        )
    }

    /// Knee 60, slope 0.005, steepness 1.1, jitter ±5 %, 120 s; the knee (and the
    /// capacity) halves to 30 at t = 30 s and comes back to 60 at t = 60 s.
    pub fn capacity_drop() -> Scenario {
        let mut model = Scenario::model(60, 0.005, 1.1, 0.05);
        model.changes = vec![(Duration::from_secs(30), 30), (Duration::from_secs(60), 60)];
        Scenario::new("capacity drop", Duration::from_secs(120), model)
    }

    /// The four scenarios, in the order above.
    pub fn all() -> Vec<Scenario> {
        vec![
            Scenario::shallow_knee(),
            Scenario::steep_knee(),
            Scenario::noisy(),
            Scenario::capacity_drop(),
        ]
    }

    /// The same scenario with another seed for its jitter.
    pub fn with_seed(mut self, seed: u64) -> Scenario {
        self.model.seed = seed;
        self
    }

    /// The scenario's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// How long the scenario runs.
    pub fn duration(&self) -> Duration {
        self.duration
    }

    /// The knee in force at `elapsed`.
    pub fn knee_at(&self, elapsed: Duration) -> u32 {
        self.model.knee_at(elapsed)
    }

    /// The times at which the knee changes (empty for a constant knee).
    pub fn changes(&self) -> Vec<Duration> {
        self.model.changes.iter().map(|&(at, _)| at).collect()
    }

    /// A fresh downstream for this scenario; its clock starts now.
    pub fn downstream(&self) -> Downstream {
        Downstream::from_model(self.model.clone())
    }

    /// The load the bench drives it with: 200 closed-loop clients (more than three times
    /// every knee, so the limit decides the concurrency), no think time, for the
    /// scenario's duration.
    pub fn load(&self) -> Load {
        Load::new(200, self.duration)
    }
}

/// How [`drive`] loads the downstream: closed-loop clients for a duration.
#[derive(Debug, Clone)]
pub struct Load {
    clients: u32,
    duration: Duration,
    think_time: Duration,
    tick: Duration,
}

impl Load {
    /// `clients` closed-loop tasks (at least one) for `duration` (longer than a century: a
    /// century), no think time, the limit recorded every 100 ms.
    pub fn new(clients: u32, duration: Duration) -> Load {
        Load {
            clients: clients.max(1),
            duration: crate::time::capped(duration),
            think_time: Duration::ZERO,
            tick: Duration::from_millis(100),
        }
    }

    /// How long each client waits between the end of a call and its next acquisition.
    pub fn think_time(mut self, think_time: Duration) -> Self {
        self.think_time = crate::time::capped(think_time);
        self
    }

    /// How often the bulkhead's limit is recorded (at least 1 ms, at most a century).
    pub fn tick(mut self, tick: Duration) -> Self {
        self.tick = crate::time::capped(tick.max(Duration::from_millis(1)));
        self
    }

    /// The run's duration.
    pub fn duration(&self) -> Duration {
        self.duration
    }
}

/// Run `load` against `downstream` through `bulkhead` and report.
///
/// Each call ends with [`OwnedBulkheadPermit::record`](crate::bulkhead::OwnedBulkheadPermit::record)
/// of its [`Status::outcome`], so an adaptive bulkhead learns from every call (its RTT
/// runs from the permit's grant); a fixed one ignores it.
///
/// # Panics
///
/// Outside a tokio runtime with timers enabled (it spawns tasks and sleeps).
pub async fn drive(downstream: &Downstream, bulkhead: &Bulkhead, load: &Load) -> Report {
    run(downstream, bulkhead, load).await
}

/// [`drive`] through a fresh adaptive bulkhead driven by `limit`
/// ([`BulkheadBuilder::adaptive`](crate::bulkhead::BulkheadBuilder::adaptive), no ceiling
/// below the largest `max_in_flight`, no waiting-room bound, no critical reserve).
///
/// # Panics
///
/// Outside a tokio runtime with timers enabled (it spawns tasks and sleeps).
pub async fn drive_adaptive<A: AdaptiveLimit + Clone>(
    downstream: &Downstream,
    limit: A,
    load: &Load,
) -> Report {
    let bulkhead = Bulkhead::builder(i32::MAX as usize)
        .adaptive(limit)
        .build()
        .expect("2³¹ − 1 permits, no reserve: a valid bulkhead");
    run(downstream, &bulkhead, load).await
}

#[derive(Default)]
struct Records {
    calls: Vec<CallRecord>,
    limits: Vec<(Duration, u32)>,
}

async fn run(downstream: &Downstream, bulkhead: &Bulkhead, load: &Load) -> Report {
    let start = Instant::now();
    let records = Arc::new(Mutex::new(Records::default()));
    let mut tasks = JoinSet::new();
    {
        let (bulkhead, records, tick) = (bulkhead.clone(), records.clone(), load.tick);
        tasks.spawn(async move {
            let mut next = start;
            loop {
                let limit = u32::try_from(bulkhead.max_in_flight()).unwrap_or(u32::MAX);
                lock(&records).limits.push((next - start, limit));
                next += tick;
                tokio::time::sleep_until(next).await;
            }
        });
    }
    for _ in 0..load.clients {
        let (bulkhead, downstream, records) =
            (bulkhead.clone(), downstream.clone(), records.clone());
        let think_time = load.think_time;
        tasks.spawn(async move {
            loop {
                let permit = match bulkhead.acquire_owned().await {
                    Ok(permit) => permit,
                    Err(AcquireError::Closed) => return,
                    // Shed: no call was made. The client starts over after its think time
                    // (a millisecond at least: a client shed at once must not keep the
                    // runtime to itself).
                    Err(_) => {
                        sleep(think_time.max(Duration::from_millis(1))).await;
                        continue;
                    }
                };
                let reply = downstream.call().await;
                let end = start.elapsed();
                permit.record(reply.status.outcome());
                lock(&records).calls.push(CallRecord { end, reply });
                if !think_time.is_zero() {
                    sleep(think_time).await;
                }
            }
        });
    }
    tokio::time::sleep_until(start + load.duration).await;
    tasks.shutdown().await;
    let records = std::mem::take(&mut *lock(&records));
    Report::new(records.calls, records.limits, load.duration)
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
