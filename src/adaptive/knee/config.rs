//! The knee finder's configuration: [`KneeConfig`] and its builder.

use std::time::Duration;

use crate::error::{ConfigError, ConfigErrorKind};

/// How the knee finder ramps, measures and decides: see the [module docs](super).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use flowgate::adaptive::knee::KneeConfig;
///
/// let config = KneeConfig::builder()
///     .max_concurrency(512)
///     .step_duration(Duration::from_secs(10))
///     .warmup(Duration::from_secs(2))
///     .recommend_fraction(0.6)
///     .build()?;
/// assert_eq!(config.step_duration(), Duration::from_secs(10));
/// # Ok::<(), flowgate::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct KneeConfig {
    pub(super) steps: Option<Vec<u32>>,
    pub(super) start: u32,
    pub(super) max_concurrency: u32,
    pub(super) refine_steps: u32,
    pub(super) refine_rounds: u32,
    pub(super) step_duration: Duration,
    pub(super) warmup: Duration,
    pub(super) timeout: Duration,
    pub(super) plateau: f64,
    pub(super) max_drop: f64,
    pub(super) max_latency_growth: f64,
    pub(super) max_back_pressure: f64,
    pub(super) recommend_fraction: f64,
    pub(super) recheck: bool,
}

/// The most concurrency a step may have (each worker is a future in one task).
const MAX_CONCURRENCY: u32 = 65_536;

impl KneeConfig {
    /// A builder with the defaults: ramp from 1 to at most 1,024, 7 refining steps in 2
    /// rounds, 5 s steps with a 1 s warm-up, a 10 s call timeout, plateau 3 %, saturation
    /// at a 20 % drop, 10× the lowest p50 or 5 % back-pressure, recommendation 65 %.
    pub fn builder() -> KneeConfigBuilder {
        KneeConfigBuilder {
            config: KneeConfig {
                steps: None,
                start: 1,
                max_concurrency: 1_024,
                refine_steps: 7,
                refine_rounds: 2,
                step_duration: Duration::from_secs(5),
                warmup: Duration::from_secs(1),
                timeout: Duration::from_secs(10),
                plateau: 0.03,
                max_drop: 0.2,
                max_latency_growth: 10.0,
                max_back_pressure: 0.05,
                recommend_fraction: 0.65,
                recheck: true,
            },
        }
    }

    /// The explicit concurrencies, if any (sorted, without duplicates).
    pub fn steps(&self) -> Option<&[u32]> {
        self.steps.as_deref()
    }

    /// Where the ramp stops if nothing saturates before: no knee above it can be found.
    pub fn max_concurrency(&self) -> u32 {
        self.max_concurrency
    }

    /// How long each step runs, warm-up included.
    pub fn step_duration(&self) -> Duration {
        self.step_duration
    }

    /// The part of each step that is not measured.
    pub fn warmup(&self) -> Duration {
        self.warmup
    }

    /// The share of the knee that is recommended.
    pub fn recommend_fraction(&self) -> f64 {
        self.recommend_fraction
    }

    /// The most steps the search can report (the ramp up to `max_concurrency` and every
    /// refining round): an upper bound for a progress bar. Not of the steps it measures:
    /// with [`recheck_saturation`](KneeConfigBuilder::recheck_saturation) on, confirming a
    /// step that looks saturated measures the step below it (up to 3 times) and the step
    /// again, and a hole in the curve is measured again, each for a step's duration and
    /// not counted here (see [Noise](super#noise-confirming-a-saturation)).
    pub fn max_steps(&self) -> usize {
        match &self.steps {
            Some(steps) => steps.len(),
            None => ramp_len(self.start, self.max_concurrency) + self.refine_len(),
        }
    }

    pub(super) fn refine_len(&self) -> usize {
        (self.refine_steps as usize) * (self.refine_rounds as usize)
    }
}

/// The number of doubling steps from `start` up to `max` (both included).
pub(super) fn ramp_len(start: u32, max: u32) -> usize {
    let mut n = 1;
    let mut c = start;
    while c < max {
        c = c.saturating_mul(2).min(max);
        n += 1;
    }
    n
}

/// Builds a [`KneeConfig`].
#[derive(Debug, Clone)]
pub struct KneeConfigBuilder {
    config: KneeConfig,
}

impl KneeConfigBuilder {
    /// Measure exactly these concurrencies (in increasing order, duplicates removed)
    /// instead of ramping and refining.
    pub fn steps(mut self, steps: impl IntoIterator<Item = u32>) -> Self {
        let mut steps: Vec<u32> = steps.into_iter().collect();
        steps.sort_unstable();
        steps.dedup();
        self.config.steps = Some(steps);
        self
    }

    /// The first concurrency of the ramp (default 1).
    pub fn start(mut self, start: u32) -> Self {
        self.config.start = start;
        self
    }

    /// The ramp stops here if nothing saturates before (default 1,024; at most 65,536).
    pub fn max_concurrency(mut self, max: u32) -> Self {
        self.config.max_concurrency = max;
        self
    }

    /// Concurrencies measured per refining round (default 7; at most 64).
    pub fn refine_steps(mut self, steps: u32) -> Self {
        self.config.refine_steps = steps;
        self
    }

    /// Refining rounds after the ramp (default 2; 0: none; at most 8); none after a ramp
    /// that reaches `max_concurrency` without a saturation (it has no knee to refine).
    pub fn refine_rounds(mut self, rounds: u32) -> Self {
        self.config.refine_rounds = rounds;
        self
    }

    /// How long each step runs, warm-up included (default 5 s; longer than a century is
    /// taken as a century, as the warm-up and the timeout are).
    pub fn step_duration(mut self, duration: Duration) -> Self {
        self.config.step_duration = duration;
        self
    }

    /// The start of each step that is not measured, while queues fill (default 1 s).
    pub fn warmup(mut self, warmup: Duration) -> Self {
        self.config.warmup = warmup;
        self
    }

    /// A call slower than this is abandoned and counts as back-pressure (default 10 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.config.timeout = timeout;
        self
    }

    /// How close to the best throughput the knee is, as a fraction (default 0.03: the knee
    /// is the lowest concurrency reaching 97 % of the best throughput); in `[0, 0.5)`.
    pub fn plateau(mut self, plateau: f64) -> Self {
        self.config.plateau = plateau;
        self
    }

    /// A step whose throughput is this fraction below the best so far is saturated
    /// (default 0.2); in `(plateau, 1)`.
    pub fn max_drop(mut self, drop: f64) -> Self {
        self.config.max_drop = drop;
        self
    }

    /// A step whose p50 is this many times the lowest p50 is saturated (default 10); above 1
    /// and finite (an infinity, which would turn the criterion off, is refused).
    pub fn max_latency_growth(mut self, growth: f64) -> Self {
        self.config.max_latency_growth = growth;
        self
    }

    /// A step with more than this fraction of its calls pushed back is saturated
    /// (default 0.05); in `[0, 1)`.
    pub fn max_back_pressure(mut self, fraction: f64) -> Self {
        self.config.max_back_pressure = fraction;
        self
    }

    /// Whether a step that looks saturated is confirmed before the ramp ends on it (or an
    /// explicit list counts it as its saturation): the step below it is measured again
    /// until it shows the target as it was (at most 3 times, else
    /// [`KneeError::Unsteady`](super::KneeError::Unsteady)), then the step itself, which
    /// must be saturated again; that second measurement is the one kept (default `true`).
    /// Noisy steps (a spell of slow calls, a pause on the target's host, however many steps
    /// in a row) then do not end the ramp far below the knee, nor make up a knee above a
    /// target's `max_concurrency`. Costs two steps more for each step that looks saturated
    /// (more while a noise lasts). On, a step whose throughput is a hole in the curve (more than `max_drop`
    /// below the best steps on both sides of it) is also measured again before each
    /// refining round and after the last. See [Noise](super#noise-confirming-a-saturation).
    ///
    /// Off, a step that looks saturated ends the ramp at once, and any saturated step
    /// measured above the knee counts.
    pub fn recheck_saturation(mut self, recheck: bool) -> Self {
        self.config.recheck = recheck;
        self
    }

    /// The recommendation as a fraction of the knee (default 0.65); in `(0, 1]`.
    pub fn recommend_fraction(mut self, fraction: f64) -> Self {
        self.config.recommend_fraction = fraction;
        self
    }

    /// Validate the configuration.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `knee.steps` (empty, or a zero or above 65,536 in the list),
    /// `knee.start` (zero), `knee.max_concurrency` (below `start`, or above 65,536),
    /// `knee.refine_steps` / `knee.refine_rounds` (too large), `knee.step_duration` (zero),
    /// `knee.warmup` (not shorter than the step), `knee.timeout` (zero), and each fraction
    /// outside its range (`knee.plateau`, `knee.max_drop`, `knee.max_latency_growth`,
    /// `knee.max_back_pressure`, `knee.recommend_fraction`).
    pub fn build(mut self) -> Result<KneeConfig, ConfigError> {
        // Longer than a century (`Duration::MAX`: "as long as it takes") is a century, so
        // adding it to an `Instant` cannot overflow.
        for d in [
            &mut self.config.step_duration,
            &mut self.config.warmup,
            &mut self.config.timeout,
        ] {
            *d = crate::time::capped(*d);
        }
        let c = &self.config;
        if let Some(steps) = &c.steps {
            if steps.is_empty() {
                return Err(ConfigError::new(
                    "knee.steps",
                    ConfigErrorKind::Zero,
                    "must list at least one concurrency",
                ));
            }
            if steps.first() == Some(&0) {
                return Err(ConfigError::zero("knee.steps"));
            }
            if steps.last().is_some_and(|&s| s > MAX_CONCURRENCY) {
                return Err(too_large("knee.steps", "must be at most 65536"));
            }
        }
        if c.start == 0 {
            return Err(ConfigError::zero("knee.start"));
        }
        if c.max_concurrency > MAX_CONCURRENCY {
            return Err(too_large("knee.max_concurrency", "must be at most 65536"));
        }
        if c.max_concurrency < c.start {
            return Err(inconsistent(
                "knee.max_concurrency",
                "must be at least knee.start",
            ));
        }
        if c.refine_steps > 64 {
            return Err(too_large("knee.refine_steps", "must be at most 64"));
        }
        if c.refine_rounds > 8 {
            return Err(too_large("knee.refine_rounds", "must be at most 8"));
        }
        if c.step_duration.is_zero() {
            return Err(ConfigError::zero_duration("knee.step_duration"));
        }
        if c.warmup >= c.step_duration {
            return Err(inconsistent(
                "knee.warmup",
                "must be shorter than knee.step_duration",
            ));
        }
        if c.timeout.is_zero() {
            return Err(ConfigError::zero_duration("knee.timeout"));
        }
        if !(0.0..0.5).contains(&c.plateau) {
            return Err(inconsistent("knee.plateau", "must be in [0, 0.5)"));
        }
        if !(c.max_drop > c.plateau && c.max_drop < 1.0) {
            return Err(inconsistent(
                "knee.max_drop",
                "must be above knee.plateau and below 1",
            ));
        }
        if !(c.max_latency_growth > 1.0 && c.max_latency_growth.is_finite()) {
            return Err(inconsistent(
                "knee.max_latency_growth",
                "must be finite and above 1",
            ));
        }
        if !(0.0..1.0).contains(&c.max_back_pressure) {
            return Err(inconsistent("knee.max_back_pressure", "must be in [0, 1)"));
        }
        if !(c.recommend_fraction > 0.0 && c.recommend_fraction <= 1.0) {
            return Err(inconsistent("knee.recommend_fraction", "must be in (0, 1]"));
        }
        Ok(self.config)
    }
}

fn too_large(field: &'static str, reason: &'static str) -> ConfigError {
    ConfigError::new(field, ConfigErrorKind::TooLarge, reason)
}

fn inconsistent(field: &'static str, reason: &'static str) -> ConfigError {
    ConfigError::new(field, ConfigErrorKind::Inconsistent, reason)
}
