//! Finding the knee: measure a downstream at rising concurrency and recommend a fixed
//! `max_in_flight` for its [`Bulkhead`](crate::bulkhead::Bulkhead).
//!
//! "Set limits from measured capacity, not guesses": [`find_knee`] runs a small load test
//! against a [`KneeTarget`] (the [simulator](super::sim)'s [`Downstream`],
//! an HTTP endpoint, anything that answers calls), finds the concurrency where throughput
//! stops growing, and recommends 65 % of it (configurable).
//!
//! # How a step is measured
//!
//! A step runs `concurrency` closed-loop workers for [`step_duration`](KneeConfigBuilder::step_duration)
//! in one task: each worker calls the target, waits for the answer and calls again at once
//! (no think time), so exactly `concurrency` calls are in flight the whole time (a call
//! that answers within its first poll, never waiting, yields to the runtime before the
//! next, so the workers take turns and the runtime's other tasks run). The first
//! [`warmup`](KneeConfigBuilder::warmup) of the step is not measured. Then:
//!
//! - **throughput** = `Ok` answers that arrive within the measured window, per second;
//! - **p50 / p99** = the round-trip times of the `Ok` calls started within the window
//!   (nearest rank), calls that end after the window included, to 3 significant figures
//!   (below);
//! - a call slower than the [`timeout`](KneeConfigBuilder::timeout) is abandoned and counts as
//!   [`BackPressure`](Outcome::BackPressure), like a `429` or `503` the target answers.
//!
//! The round-trip times go into one histogram per step, shared by its workers
//! ([HdrHistogram](hdrhistogram), 3 significant figures from 1 ns to `u64::MAX` ns, 584
//! years: longer than any timeout, which is at most a century). So p50 and p99 are exact
//! below 2,048 ns and above it rounded up to the top of their bucket, by less than 0.1 %
//! (1/1,024), never above the longest call; a round trip beyond the range would count as
//! its top. A step takes 440 KiB for them (56,320 counters of 8 bytes), allocated when it
//! starts and freed when it ends, however long it runs, however many calls it keeps in
//! flight and however fast the target answers.
//!
//! The step waits for its last calls to end before the next one starts, so steps never
//! overlap. Everything uses tokio's clock: against the simulator under paused time a whole
//! search takes about a tenth of a second optimised (a second unoptimised) and gives the
//! same answer every time.
//!
//! # The ramp
//!
//! 1. **Ramp**: concurrency 1, 2, 4, ... (doubling from [`start`](KneeConfigBuilder::start)),
//!    until a step is *saturated* (below), or [`max_concurrency`](KneeConfigBuilder::max_concurrency).
//! 2. **Refine**, [`refine_rounds`](KneeConfigBuilder::refine_rounds) times: measure
//!    [`refine_steps`](KneeConfigBuilder::refine_steps) evenly spaced concurrencies between
//!    the step below the knee found so far and the first step on the plateau (below),
//!    so the knee is seen up close. When that first step is the best throughput, up to the
//!    step above it, so a peak that fell between two coarse steps is seen up close too. A
//!    plateau of several steps is not refined: its best step is wherever the noise puts
//!    it. A round with no new concurrency to measure ends the search. A ramp that reaches
//!    `max_concurrency` without a (confirmed) saturation is not refined: it found no knee
//!    to refine (see [the knee rule](self#the-knee-rule)).
//!
//! With an explicit list of concurrencies ([`steps`](KneeConfigBuilder::steps)) exactly
//! those are measured, in increasing order, and nothing is refined.
//!
//! A step is **saturated** when its throughput has fallen more than
//! [`max_drop`](KneeConfigBuilder::max_drop) (default 20 %) below the best seen so far, its
//! p50 is [`max_latency_growth`](KneeConfigBuilder::max_latency_growth) times (default 10×)
//! the lowest p50 seen, or more than [`max_back_pressure`](KneeConfigBuilder::max_back_pressure)
//! (default 5 %) of its calls were pushed back.
//!
//! # Noise: confirming a saturation
//!
//! A step can look saturated only because something else slowed the target while it was
//! measured (a spell of slow calls, a garbage-collection pause, a loaded machine), and the
//! spell can last several steps. So a step that looks saturated (in the ramp, the ramp's
//! last step included, or the first one of an explicit list) is *confirmed*
//! ([`recheck_saturation`](KneeConfigBuilder::recheck_saturation), on by default):
//!
//! 1. the step below it is measured again, the **control**: if it is saturated compared
//!    with the steps measured at or below it, its own first measurement included (slower
//!    than the target was), the noise is still on, and the control is measured again, up
//!    to 3 times; three disturbed controls in a row end the search with
//!    [`KneeError::Unsteady`]: it could not tell a saturation from noise;
//! 2. once a control shows the target as it was, the step is measured again, and only if
//!    it is saturated again does it end the ramp (or count as the list's saturation).
//!    This second measurement is the one reported, saturated or not.
//!
//! A spell that slows every call by the same factor and lasts from one measurement of a
//! step to the other slows the control between them too, and a factor that makes a step
//! whose throughput rose look saturated makes the control look disturbed (it takes more
//! than 20 % off both; the other sign, a p50 10× the lowest at the step and not at the
//! control, needs a step queueing 8× already). So however many steps in a row it lasts, a
//! spell neither ends the ramp below the knee nor makes up a saturation: the search goes on
//! as without it, or ends with `Unsteady`. A spell on the refining steps can still move the
//! knee within their spacing. What it cannot tell: two separate spells, one on each
//! measurement of the step and none on the control between them. A confirmation costs two
//! steps (more while the noise lasts), and the controls are not reported. The knee counts
//! as found only on a confirmed saturation: a refining step that looks saturated is none.
//!
//! Noise that slows a step without making it look saturated bends the curve instead: a
//! spell over the ramp's step at the knee hides the peak, and the knee read against a lower
//! best comes out low (1.5× slower calls on the step at 32 of a target whose knee is 32: a
//! knee of 27). So before each refining round and after the last, a step whose throughput
//! is more than [`max_drop`](KneeConfigBuilder::max_drop) below both the best step below it
//! and the best above it (a hole: a throughput curve rises to its peak, then falls) is
//! measured again, and the new measurement replaces it. A noise that takes less than
//! `max_drop` off a step can still move the knee by about that share.
//!
//! # The knee rule
//!
//! The **knee** is the lowest concurrency whose throughput reaches the plateau: at least
//! `1 − `[`plateau`](KneeConfigBuilder::plateau) (default 97 %) of the best throughput
//! measured, linearly interpolated between the two steps around that level. Below it, each
//! added call in flight still buys throughput; above it, it buys only queueing (by Little's
//! law, latency grows in proportion to the concurrency once the throughput is flat, and
//! faster when the throughput falls). The rule finds the same point on a downstream whose
//! throughput peaks and falls (a queue that collapses) and on one whose throughput stays
//! flat (a queue that only grows).
//!
//! The lowest step measured reaching the plateau is the knee only at a concurrency of 1:
//! a ramp started higher ([`start`](KneeConfigBuilder::start), or a list of
//! [`steps`](KneeConfigBuilder::steps)) whose first step is already on the plateau has the
//! knee at or below it, and ends with [`KneeError::PlateauAtStart`].
//!
//! The knee counts as found only if the step that ended the ramp (or the first saturated
//! step of a list) is above it and its saturation was confirmed (see
//! [Noise](self#noise-confirming-a-saturation); with
//! [`recheck_saturation`](KneeConfigBuilder::recheck_saturation) off, any saturated step
//! measured above it counts): a ramp that reaches `max_concurrency` before a step saturates
//! finds no knee ([`KneeReport::knee`] is `None`). That is a target whose throughput still grows, and also one whose throughput is
//! flat but whose latency has not grown enough yet: on a queue that only grows (`N` workers,
//! the rest wait) nothing is pushed back and the throughput does not fall, so the first
//! saturated step is the one whose p50 reaches
//! [`max_latency_growth`](KneeConfigBuilder::max_latency_growth) times the lowest, at about
//! that many times the knee in flight (10× by default: a server of 200 threads needs a
//! `max_concurrency` of 2,048, or a lower `max_latency_growth`). When the last steps'
//! throughput is flat and the knee is `None`, raise one or lower the other.
//!
//! The **recommendation** is `⌊knee × `[`recommend_fraction`](KneeConfigBuilder::recommend_fraction)`⌋`
//! (default 0.65), at least 1: headroom for a slower day, a noisy neighbour, a deploy.
//! Use it as a fixed `max_in_flight`, or as the initial limit of an adaptive bulkhead.
//!
//! # Examples
//!
//! ```
//! use std::time::Duration;
//! use flowgate::adaptive::knee::{KneeConfig, find_knee};
//! use flowgate::adaptive::sim::Downstream;
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let downstream = Downstream::builder().knee(40).steepness(1.3).build()?;
//! let config = KneeConfig::builder().step_duration(Duration::from_secs(2)).build()?;
//! let report = find_knee(&downstream, &config).await?;
//! let knee = report.knee.expect("the simulator has a knee");
//! assert!((36..=44).contains(&knee), "knee {knee}");
//! assert_eq!(report.recommended, Some(knee * 65 / 100));
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::time::Instant;

use super::sample::Outcome;
use super::sim::Downstream;

mod config;
mod measure;
mod saturation;

use config::ramp_len;
pub use config::{KneeConfig, KneeConfigBuilder};
use measure::measure;
use saturation::{confirm, fill_holes, is_saturated};

/// Something the knee finder can load: it answers one call at a time, many concurrently.
///
/// Implemented for the simulator's [`Downstream`]; implement it for an HTTP client, a
/// database pool, a gRPC stub. `call` makes one call and says how it ended: `Ok` when it was
/// served, [`BackPressure`](Outcome::BackPressure) for a `429`, a `503`, a refused
/// connection, [`Ignored`](Outcome::Ignored) for anything else that says nothing about
/// capacity (counted, otherwise ignored). The finder measures the round-trip time itself.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use futures::future::BoxFuture;
/// use flowgate::adaptive::Outcome;
/// use flowgate::adaptive::knee::{KneeConfig, KneeTarget, find_knee};
///
/// /// Answers every call after 5 ms, however many are in flight.
/// #[derive(Debug)]
/// struct Echo;
///
/// impl KneeTarget for Echo {
///     fn call(&self) -> BoxFuture<'_, Outcome> {
///         Box::pin(async {
///             tokio::time::sleep(Duration::from_millis(5)).await;
///             Outcome::Ok
///         })
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let config = KneeConfig::builder().steps([1, 10]).build()?;
/// let report = find_knee(&Echo, &config).await?;
/// // 4 measured seconds: 200 calls per second per call in flight.
/// assert_eq!(report.steps[1].throughput, 2_000.0);
/// assert_eq!(report.knee, None); // it never saturates
/// # Ok(())
/// # }
/// ```
pub trait KneeTarget: Send + Sync {
    /// Make one call; answer how it ended.
    fn call(&self) -> BoxFuture<'_, Outcome>;
}

impl<T: KneeTarget + ?Sized> KneeTarget for &T {
    fn call(&self) -> BoxFuture<'_, Outcome> {
        (**self).call()
    }
}

impl<T: KneeTarget + ?Sized> KneeTarget for Arc<T> {
    fn call(&self) -> BoxFuture<'_, Outcome> {
        (**self).call()
    }
}

impl<T: KneeTarget + ?Sized> KneeTarget for Box<T> {
    fn call(&self) -> BoxFuture<'_, Outcome> {
        (**self).call()
    }
}

/// One call to the simulator: `Ok`, or back-pressure when it was refused above the capacity
/// or timed out.
impl KneeTarget for Downstream {
    fn call(&self) -> BoxFuture<'_, Outcome> {
        let call = Downstream::call(self);
        Box::pin(async move { call.await.status.outcome() })
    }
}

/// What one step measured.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct KneeStep {
    /// Calls kept in flight.
    pub concurrency: u32,
    /// `Ok` answers per second within the measured window.
    pub throughput: f64,
    /// Median round-trip time of the `Ok` calls started in the window (zero if none), to 3
    /// significant figures (see [How a step is measured](self#how-a-step-is-measured)).
    pub p50: Duration,
    /// 99th percentile round-trip time of those calls (zero if none), to 3 significant
    /// figures.
    pub p99: Duration,
    /// `Ok` calls started in the window.
    pub ok: u64,
    /// Calls started in the window that were pushed back or timed out.
    pub back_pressure: u64,
    /// Calls started in the window whose outcome was ignored.
    pub ignored: u64,
}

impl KneeStep {
    /// The share of the calls started in the window and not ignored that were pushed back:
    /// `back_pressure / (ok + back_pressure)` (0 when there were none).
    pub fn back_pressure_ratio(&self) -> f64 {
        let total = self.ok + self.back_pressure;
        if total == 0 {
            0.0
        } else {
            self.back_pressure as f64 / total as f64
        }
    }
}

/// Which part of the search a step belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KneePhase {
    /// The doubling ramp.
    Ramp,
    /// A refining round around the knee (numbered from 1).
    Refine(u32),
    /// An explicit list of concurrencies.
    List,
}

/// Passed to the progress callback after each step.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct KneeProgress<'a> {
    /// The part of the search.
    pub phase: KneePhase,
    /// The step just measured.
    pub step: &'a KneeStep,
    /// Steps measured so far, this one included.
    pub done: usize,
    /// An upper bound of the steps the search will report (it shrinks as the search
    /// learns; never below `done`). The steps measured again to confirm a saturation or
    /// fill a hole are not counted (see [Noise](self#noise-confirming-a-saturation)).
    pub planned: usize,
}

/// What [`find_knee`] found.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct KneeReport {
    /// Every step measured, by increasing concurrency, one per concurrency: a step measured
    /// again (to confirm a saturation, or a hole in the curve) by its last measurement;
    /// the controls measured to confirm a saturation are not here (nor in the progress
    /// callback's `done`), though [`elapsed`](KneeReport::elapsed) includes them. See
    /// [Noise](self#noise-confirming-a-saturation).
    pub steps: Vec<KneeStep>,
    /// The knee (see the [rule](self#the-knee-rule)), rounded to the nearest call; `None`
    /// when no step above it saturated (with a confirmed saturation: see
    /// [Noise](self#noise-confirming-a-saturation)).
    pub knee: Option<u32>,
    /// The recommended `max_in_flight`: `⌊knee × recommend_fraction⌋`, at least 1.
    pub recommended: Option<u32>,
    /// The fraction used for the recommendation.
    pub recommend_fraction: f64,
    /// How long the search took, on tokio's clock.
    pub elapsed: Duration,
}

impl KneeReport {
    /// The step with the best throughput.
    pub fn peak(&self) -> Option<&KneeStep> {
        self.steps
            .iter()
            .max_by(|a, b| a.throughput.total_cmp(&b.throughput))
    }
}

/// The target failed in a way that leaves nothing to measure.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum KneeError {
    /// No call succeeded at the lowest concurrency, and some were pushed back or timed out:
    /// the target is down, refuses all, or is slower than the
    /// [`timeout`](KneeConfigBuilder::timeout).
    NoSuccess {
        /// The lowest concurrency measured.
        concurrency: u32,
    },
    /// Nothing at the lowest concurrency measured the target's capacity, and nothing says
    /// it refuses: every call started after the warm-up ended
    /// [`Ignored`](Outcome::Ignored) (its answers say nothing about capacity: a wrong path
    /// answering `404`, a request the target cannot serve), or none of them ended within
    /// the step (calls longer than the step's measured part; without a
    /// [`warmup`](KneeConfigBuilder::warmup), a first call started in it and ended past
    /// it).
    NothingMeasured {
        /// The lowest concurrency measured.
        concurrency: u32,
        /// Its calls started after the warm-up that ended `Ignored`.
        ignored: u64,
    },
    /// The lowest concurrency measured is already saturated (pushed back beyond
    /// `max_back_pressure`): the knee is below it. At a concurrency of 1 there is nothing
    /// below: a target that pushes back calls sent one at a time limits its rate, not its
    /// concurrency (or is overloaded), and wants pacing ([`pace`](crate::pace)), not a
    /// concurrency limit.
    SaturatedAtStart {
        /// The lowest concurrency measured.
        concurrency: u32,
        /// The share of its calls pushed back.
        back_pressure_ratio: f64,
    },
    /// The lowest concurrency measured, above 1, already reaches the plateau (its
    /// throughput is within [`plateau`](KneeConfigBuilder::plateau) of the best) and a step
    /// above it is saturated: the knee is at or below it, and nothing below was measured to
    /// tell where.
    PlateauAtStart {
        /// The lowest concurrency measured.
        concurrency: u32,
    },
    /// The target did not hold still long enough to tell a saturation from noise: a step
    /// looked saturated, and the step below it, measured again to confirm it, showed the
    /// target slower than it had been each of the `attempts` times (a spell of slow calls,
    /// another load on the target or on this machine). No knee is reported rather than one
    /// read from a curve the noise bent.
    Unsteady {
        /// The concurrency that looked saturated.
        concurrency: u32,
        /// The step below it, measured again as the control.
        control: u32,
        /// How many times the control was measured, each time slower than before.
        attempts: u32,
    },
}

impl fmt::Display for KneeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KneeError::NoSuccess { concurrency } => write!(
                f,
                "no call succeeded at concurrency {concurrency}: every call was pushed back or ran past the timeout; the target is down, refuses every call, or answers slower than the timeout (raise KneeConfigBuilder::timeout, and KneeConfigBuilder::step_duration with it, if its calls take that long)"
            ),
            KneeError::NothingMeasured {
                concurrency,
                ignored: 0,
            } => write!(
                f,
                "no call started at concurrency {concurrency} after the warm-up and ended within the step: the calls take longer than step_duration minus warmup; lengthen KneeConfigBuilder::step_duration (and KneeConfigBuilder::timeout, if they take longer than it)"
            ),
            KneeError::NothingMeasured {
                concurrency,
                ignored,
            } => write!(
                f,
                "every call measured at concurrency {concurrency} ended Ignored ({ignored} calls): the target's answers say nothing about its capacity; check what the calls send (the URL, the request) and how KneeTarget::call classifies the answers"
            ),
            KneeError::SaturatedAtStart {
                concurrency: 1,
                back_pressure_ratio,
            } => write!(
                f,
                "the target pushes back {:.1} % of calls sent one at a time: it limits its rate, not its concurrency (or is overloaded now), so there is no concurrency knee to find; pace the calls to its rate (flowgate::pace), or measure again once it serves one call at a time",
                back_pressure_ratio * 100.0
            ),
            KneeError::SaturatedAtStart {
                concurrency,
                back_pressure_ratio,
            } => write!(
                f,
                "the target is saturated at concurrency {concurrency} already ({:.1} % of calls pushed back): the knee is lower; start the ramp lower (KneeConfigBuilder::start) or list lower concurrencies (KneeConfigBuilder::steps)",
                back_pressure_ratio * 100.0
            ),
            KneeError::PlateauAtStart { concurrency } => write!(
                f,
                "the throughput at concurrency {concurrency}, the lowest measured, is already the plateau's: the knee is at or below it; start the ramp lower (KneeConfigBuilder::start) or list lower concurrencies (KneeConfigBuilder::steps)"
            ),
            KneeError::Unsteady {
                concurrency,
                control,
                attempts,
            } => write!(
                f,
                "the measurements could not tell a saturation from noise: concurrency {concurrency} looked saturated, and concurrency {control}, measured again {attempts} times to confirm it, was slower than before each time (another load on the target or on this machine); measure again when both are quiet, or with longer steps (KneeConfigBuilder::step_duration)"
            ),
        }
    }
}

impl std::error::Error for KneeError {}

/// Ramp concurrency against `target`, find the knee and recommend a `max_in_flight`: see
/// the [module docs](self) for the steps and the rule.
///
/// # Errors
///
/// [`KneeError::NoSuccess`] when no call succeeds at the lowest concurrency,
/// [`KneeError::NothingMeasured`] when none of its calls said anything about capacity,
/// [`KneeError::SaturatedAtStart`] when it is saturated already,
/// [`KneeError::PlateauAtStart`] when it is above 1 and already on the plateau (the knee
/// is at or below it), [`KneeError::Unsteady`] when a saturation could not be confirmed
/// because the target kept getting slower (see
/// [Noise](self#noise-confirming-a-saturation)).
///
/// # Cancel safety
///
/// Dropping the future stops the search and drops the calls in flight; nothing is
/// reported.
///
/// # Panics
///
/// Outside a tokio runtime with timers enabled.
///
/// # Examples
///
/// See the [module docs](self).
pub async fn find_knee<T: KneeTarget + ?Sized>(
    target: &T,
    config: &KneeConfig,
) -> Result<KneeReport, KneeError> {
    find_knee_with_progress(target, config, |_| {}).await
}

/// [`find_knee`], calling `progress` after each step (for a progress bar, a log line).
///
/// # Errors
///
/// As [`find_knee`].
///
/// # Cancel safety
///
/// As [`find_knee`].
///
/// # Panics
///
/// Outside a tokio runtime with timers enabled.
///
/// # Examples
///
/// ```
/// use flowgate::adaptive::knee::{KneeConfig, find_knee_with_progress};
/// use flowgate::adaptive::sim::Downstream;
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let downstream = Downstream::builder().knee(8).steepness(1.5).build()?;
/// let config = KneeConfig::builder().steps([1, 4, 8, 16]).build()?;
/// let mut seen = Vec::new();
/// let report = find_knee_with_progress(&downstream, &config, |p| {
///     seen.push((p.step.concurrency, p.done, p.planned));
/// })
/// .await?;
/// assert_eq!(seen, [(1, 1, 4), (4, 2, 4), (8, 3, 4), (16, 4, 4)]);
/// assert_eq!(report.knee, Some(8));
/// # Ok(())
/// # }
/// ```
pub async fn find_knee_with_progress<T, F>(
    target: &T,
    config: &KneeConfig,
    mut progress: F,
) -> Result<KneeReport, KneeError>
where
    T: KneeTarget + ?Sized,
    F: FnMut(&KneeProgress<'_>) + Send,
{
    let started = Instant::now();
    let mut search = Search {
        steps: Vec::new(),
        progress: &mut progress,
    };

    // The step whose saturation the knee stands on: confirmed when `recheck` is on.
    let mut saturated_at = None;
    if let Some(list) = &config.steps {
        for (i, &c) in list.iter().enumerate() {
            let mut step = measure(target, c, config).await;
            if i == 0 {
                check_first(&step, config)?;
            }
            if config.recheck
                && saturated_at.is_none()
                && is_saturated(&step, &search.steps, config)
            {
                let (kept, saturated) = confirm(target, c, &search.steps, config).await?;
                step = kept;
                if saturated {
                    saturated_at = Some(c);
                }
            }
            search.record(KneePhase::List, step, list.len());
        }
    } else {
        // The ramp: double until a step saturates or the maximum is reached.
        let mut c = config.start;
        loop {
            let mut step = measure(target, c, config).await;
            if search.steps.is_empty() {
                check_first(&step, config)?;
            }
            let mut ends = c >= config.max_concurrency;
            if is_saturated(&step, &search.steps, config) {
                // A step that looks saturated ends the ramp only once confirmed (the step
                // at `max_concurrency` too: else one noisy measurement of it is the
                // saturation that makes a knee).
                let (kept, saturated) = if config.recheck {
                    confirm(target, c, &search.steps, config).await?
                } else {
                    (step, true)
                };
                step = kept;
                if saturated {
                    ends = true;
                    saturated_at = Some(c);
                }
            }
            // This step, the doubling steps after it, every refining round (none after a
            // ramp that ends without a saturation).
            let (left, refine) = match (ends, saturated_at) {
                (false, _) => (ramp_len(c, config.max_concurrency), config.refine_len()),
                (true, Some(_)) => (1, config.refine_len()),
                (true, None) => (1, 0),
            };
            let planned = search.steps.len() + left + refine;
            search.record(KneePhase::Ramp, step, planned);
            if ends {
                break;
            }
            c = c.saturating_mul(2).min(config.max_concurrency);
        }
        // Refining rounds: between the step below the knee and the step above the peak,
        // each on a curve without holes (a hidden peak would misplace the round). A ramp
        // that ended without a saturation found no knee to refine (with `recheck`, none
        // can be found without one).
        let rounds = if saturated_at.is_some() {
            config.refine_rounds
        } else {
            0
        };
        for round in 1..=rounds {
            if config.recheck {
                fill_holes(target, &mut search.steps, config).await;
            }
            let between = refine_points(&search.sorted(), config);
            if between.is_empty() {
                break;
            }
            let rounds_left = (config.refine_rounds - round) as usize;
            let planned =
                search.steps.len() + between.len() + rounds_left * config.refine_steps as usize;
            for c in between {
                let step = measure(target, c, config).await;
                search.record(KneePhase::Refine(round), step, planned);
            }
        }
        if config.recheck && rounds > 0 {
            fill_holes(target, &mut search.steps, config).await;
        }
    }

    let steps = search.sorted();
    if !config.recheck {
        // Unconfirmed, any saturated step counts: the highest.
        saturated_at = steps
            .iter()
            .enumerate()
            .filter(|(i, s)| is_saturated(s, &steps[..*i], config))
            .map(|(_, s)| s.concurrency)
            .max();
    }
    let knee = knee_of(&steps, saturated_at, config);
    // A knee at the lowest step measured is the knee only at 1: above, it is at or below.
    if let (Some(k), Some(first)) = (knee, steps.first())
        && first.concurrency > 1
        && k <= f64::from(first.concurrency)
    {
        return Err(KneeError::PlateauAtStart {
            concurrency: first.concurrency,
        });
    }
    // Rounded first: the recommendation is the fraction of the knee reported.
    let knee = knee.map(|k| k.round() as u32);
    let recommended =
        knee.map(|k| ((f64::from(k) * config.recommend_fraction).floor() as u32).max(1));
    Ok(KneeReport {
        knee,
        recommended,
        recommend_fraction: config.recommend_fraction,
        steps,
        elapsed: started.elapsed(),
    })
}

/// The steps measured so far, in the order measured, and the progress callback.
struct Search<'f, F> {
    steps: Vec<KneeStep>,
    progress: &'f mut F,
}

impl<F: FnMut(&KneeProgress<'_>)> Search<'_, F> {
    fn record(&mut self, phase: KneePhase, step: KneeStep, planned: usize) {
        let done = self.steps.len() + 1;
        (self.progress)(&KneeProgress {
            phase,
            step: &step,
            done,
            planned: planned.max(done),
        });
        self.steps.push(step);
    }

    fn sorted(&self) -> Vec<KneeStep> {
        let mut steps = self.steps.clone();
        steps.sort_by_key(|s| s.concurrency);
        steps
    }
}

fn check_first(step: &KneeStep, config: &KneeConfig) -> Result<(), KneeError> {
    // No `Ok` answer arrived within the window, and none of the calls started in it said
    // anything else: calls longer than the window (without a warm-up, a worker's first
    // call starts in it), whose every step would measure a throughput of 0.
    let none_arrived = step.throughput == 0.0 && step.ignored == 0;
    if (step.ok == 0 || none_arrived) && step.back_pressure == 0 {
        return Err(KneeError::NothingMeasured {
            concurrency: step.concurrency,
            ignored: step.ignored,
        });
    }
    if step.ok == 0 {
        return Err(KneeError::NoSuccess {
            concurrency: step.concurrency,
        });
    }
    if step.back_pressure_ratio() > config.max_back_pressure {
        return Err(KneeError::SaturatedAtStart {
            concurrency: step.concurrency,
            back_pressure_ratio: step.back_pressure_ratio(),
        });
    }
    Ok(())
}

/// The concurrencies of the next refining round: evenly spaced strictly between the step
/// below the knee found so far and the first step on the plateau, without those measured
/// already. When that first step is also the best, the round reaches up to the step above
/// it, where a higher peak may lie. On a plateau of several steps the best is wherever the
/// noise puts it, and measuring around it would only measure more plateau.
fn refine_points(steps: &[KneeStep], config: &KneeConfig) -> Vec<u32> {
    let Some((peak, _)) = steps
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.throughput.total_cmp(&b.1.throughput))
    else {
        return Vec::new();
    };
    let level = steps[peak].throughput * (1.0 - config.plateau);
    let first = steps
        .iter()
        .position(|s| s.throughput >= level)
        .unwrap_or(0);
    let lo = steps[first.saturating_sub(1)].concurrency;
    let top = if first == peak {
        (peak + 1).min(steps.len() - 1)
    } else {
        first
    };
    let hi = steps[top].concurrency;
    let n = u64::from(config.refine_steps);
    let mut points: Vec<u32> = (1..=n)
        .map(|i| {
            let span = u64::from(hi.saturating_sub(lo));
            // Rounded to the nearest integer, in u64 so nothing overflows.
            lo + u32::try_from((span * i * 2 + n + 1) / (2 * (n + 1))).unwrap_or(0)
        })
        .filter(|&c| c > lo && c < hi)
        .filter(|&c| steps.iter().all(|s| s.concurrency != c))
        .collect();
    points.dedup();
    points
}

/// The knee as a fractional concurrency, or `None` if the saturated step (`saturated_at`)
/// is not above it, or there is none.
fn knee_of(steps: &[KneeStep], saturated_at: Option<u32>, config: &KneeConfig) -> Option<f64> {
    let best = steps.iter().map(|s| s.throughput).fold(0.0_f64, f64::max);
    if best <= 0.0 {
        return None;
    }
    let level = best * (1.0 - config.plateau);
    let j = steps.iter().position(|s| s.throughput >= level)?;
    let knee = if j == 0 {
        f64::from(steps[0].concurrency)
    } else {
        let (a, b) = (&steps[j - 1], &steps[j]);
        let (ca, cb) = (f64::from(a.concurrency), f64::from(b.concurrency));
        let rise = b.throughput - a.throughput;
        if rise > 0.0 {
            ca + (cb - ca) * (level - a.throughput) / rise
        } else {
            cb
        }
    };
    saturated_at
        .is_some_and(|c| f64::from(c) > knee)
        .then_some(knee)
}
