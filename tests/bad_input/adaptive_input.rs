//! The adaptive limits, the simulator and the knee config with any float, bound and
//! sample.

use std::fmt;

use super::*;

fn any_sample() -> impl Strategy<Value = Sample> {
    (
        any_duration(),
        any_u32(),
        prop_oneof![
            Just(Outcome::Ok),
            Just(Outcome::BackPressure),
            Just(Outcome::Ignored)
        ],
        any_duration(),
    )
        .prop_map(|(rtt, in_flight, outcome, now)| Sample {
            rtt,
            in_flight,
            outcome,
            now,
        })
}

/// Feed `samples`, then narrow the bounds: the limit stays a whole number within them.
fn drive_limit<A: AdaptiveLimit>(mut limit: A, samples: &[Sample], bound: (u32, u32)) {
    assert!(limit.limit() >= 1);
    for s in samples {
        let l = limit.update(s);
        assert_eq!(l, limit.limit());
        assert!(l >= 1, "{} fell to 0 after {s:?}", limit.name());
    }
    let _ = limit.rtt_estimates();
    limit.bound(bound.0, bound.1);
    let (lo, hi) = (bound.0.max(1), bound.1.max(bound.0.max(1)));
    assert!(
        (lo..=hi).contains(&limit.limit()),
        "{} at {} outside [{lo}, {hi}]",
        limit.name(),
        limit.limit()
    );
    for s in samples {
        let l = limit.update(s);
        assert!(
            (lo..=hi).contains(&l),
            "{} at {l} outside [{lo}, {hi}]",
            limit.name()
        );
    }
}

/// The largest limit the adaptive builders take, as their docs say: 2³¹ − 1.
const MAX_LIMIT: u32 = (1 << 31) - 1;

/// `min_limit`, `max_limit` and `initial`, each given or left at its default.
type GivenBounds = (Option<u32>, Option<u32>, Option<u32>);

fn any_bounds() -> impl Strategy<Value = GivenBounds> {
    (
        prop::option::of(any_u32()),
        prop::option::of(any_u32()),
        prop::option::of(any_u32()),
    )
}

/// A value of `any`, or three times as often one of `good` (a setting's documented range):
/// with several settings, `any` alone would have `build` refuse nearly every config.
fn mostly<T: fmt::Debug>(
    any: impl Strategy<Value = T> + 'static,
    good: impl Strategy<Value = T> + 'static,
) -> impl Strategy<Value = T> {
    prop_oneof![1 => any, 3 => good]
}

/// Mostly a float in `good`.
fn mostly_f64(good: impl Strategy<Value = f64> + 'static) -> impl Strategy<Value = f64> {
    mostly(any_f64(), good)
}

/// Gives a builder the bounds that were given, leaving the others at their defaults.
macro_rules! with_bounds {
    ($builder:expr, $bounds:expr) => {{
        let (min, max, initial) = $bounds;
        let mut builder = $builder;
        if let Some(n) = min {
            builder = builder.min_limit(n);
        }
        if let Some(n) = max {
            builder = builder.max_limit(n);
        }
        if let Some(n) = initial {
            builder = builder.initial(n);
        }
        builder
    }};
}

/// What an algorithm's builder documents for the bounds given: `min_limit` 1 and
/// `max_limit` 1000 unless given, `initial` its builder's default brought within them, and a
/// `max_limit` left at its default rising to a `min_limit` or `initial` set above it, up to
/// 2³¹ − 1.
#[derive(Debug, Clone, Copy)]
struct Documented {
    algorithm: &'static str,
    min: u32,
    max: u32,
    initial: u32,
}

impl Documented {
    fn new(
        algorithm: &'static str,
        (min, max, initial): GivenBounds,
        default_initial: u32,
    ) -> Documented {
        let min = min.unwrap_or(1);
        let max = max.unwrap_or(
            1000.max(min)
                .max(initial.unwrap_or(default_initial))
                .min(MAX_LIMIT),
        );
        // A default initial gives way to the bounds (when they are not refused themselves).
        let initial = initial.unwrap_or(if min <= max {
            default_initial.clamp(min, max)
        } else {
            default_initial
        });
        Documented {
            algorithm,
            min,
            max,
            initial,
        }
    }

    /// [`built_as_documented`], given whether `build`'s docs refuse each of the other
    /// `settings` (named without the algorithm's prefix); the bounds are refused when
    /// `min_limit` is zero or above `max_limit`, `max_limit` above 2³¹ − 1, `initial`
    /// outside them. What was built must also start at `initial` and bear the algorithm's
    /// name.
    fn check<A: AdaptiveLimit>(
        &self,
        built: Result<A, ConfigError>,
        settings: &[(&str, bool)],
    ) -> Option<A> {
        let bounds = [
            ("min_limit", self.min == 0 || self.min > self.max),
            ("max_limit", self.max > MAX_LIMIT),
            ("initial", !(self.min..=self.max).contains(&self.initial)),
        ];
        let faults: Vec<_> = bounds
            .iter()
            .chain(settings)
            .map(|&(name, refused)| (format!("{}.{name}", self.algorithm), refused))
            .collect();
        let limit = built_as_documented(built, &faults)?;
        assert_eq!(limit.limit(), self.initial);
        assert_eq!(limit.name(), self.algorithm);
        Some(limit)
    }

    fn clamp(&self, limit: f64) -> f64 {
        limit.clamp(f64::from(self.min), f64::from(self.max))
    }
}

/// Checks `built` against `build`'s docs, given each field and whether they refuse it: a
/// refusal must name a field refused, and anything else build; what was built, if it was.
fn built_as_documented<T, F: AsRef<str> + fmt::Debug>(
    built: Result<T, ConfigError>,
    faults: &[(F, bool)],
) -> Option<T> {
    match built {
        Ok(built) => {
            let faults: Vec<_> = faults.iter().filter(|(_, refused)| *refused).collect();
            assert!(faults.is_empty(), "built with {faults:?}");
            Some(built)
        }
        Err(e) => {
            sane_config_error(&e);
            match faults.iter().find(|(field, _)| field.as_ref() == e.field()) {
                Some((_, refused)) => assert!(refused, "refused a good {}: {e}", e.field()),
                None => panic!(
                    "refused on {}, which build does not document: {e}",
                    e.field()
                ),
            }
            None
        }
    }
}

/// Whether `x` is finite and at least `min`, as a setting documented as refused "below `min`
/// or not finite" must be.
fn finite_at_least(x: f64, min: f64) -> bool {
    x.is_finite() && x >= min
}

/// The first cut of a fresh limit: back-pressure, or an `Ok` call of `timeout` or longer.
fn cut_once<A: AdaptiveLimit + Clone>(limit: &A, outcome: Outcome, rtt: Duration) -> u32 {
    limit.clone().update(&Sample {
        rtt,
        in_flight: u32::MAX,
        outcome,
        now: rtt,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn aimd_takes_any_numbers(
        bounds in any_bounds(),
        ratio in mostly_f64(f64::MIN_POSITIVE..1.0),
        timeout in any_duration(),
        samples in prop::collection::vec(any_sample(), 0..30),
        bound in (any_u32(), any_u32()),
    ) {
        let documented = Documented::new("aimd", bounds, 20);
        let settings = [
            ("backoff_ratio", !(ratio > 0.0 && ratio < 1.0)),
            ("timeout", timeout.is_zero()),
        ];
        let built = with_bounds!(Aimd::builder(), bounds)
            .backoff_ratio(ratio)
            .timeout(timeout)
            .build();
        let Some(aimd) = documented.check(built, &settings) else {
            return Ok(());
        };
        // The ratio and the timeout as given: a cut is × backoff_ratio, rounded down, on
        // back-pressure or a call of `timeout`; a quicker call adds 1.
        let initial = f64::from(documented.initial);
        let cut = documented.clamp((initial * ratio).floor()) as u32;
        assert_eq!(cut_once(&aimd, Outcome::BackPressure, Duration::from_millis(1)), cut);
        assert_eq!(cut_once(&aimd, Outcome::Ok, timeout), cut);
        if timeout <= CENTURY {
            let quicker = timeout - Duration::from_nanos(1);
            let grown = documented.clamp(initial + 1.0) as u32;
            assert_eq!(cut_once(&aimd, Outcome::Ok, quicker), grown);
        }
        drive_limit(aimd, &samples, bound);
    }

    #[test]
    fn probe_takes_any_numbers(
        bounds in any_bounds(),
        (ratio, scale, tolerance, rtt_ratio, gain) in (
            mostly_f64(f64::MIN_POSITIVE..1.0),
            mostly_f64(0.0..10.0),
            mostly_f64(0.0..1.0),
            mostly_f64(1.0..10.0),
            mostly_f64(0.0..1.0),
        ),
        interval in any_u32(),
        (window, timeout) in (any_duration(), any_duration()),
        samples in prop::collection::vec(any_sample(), 0..30),
        bound in (any_u32(), any_u32()),
    ) {
        let documented = Documented::new("probe", bounds, 10);
        let settings = [
            ("backoff_ratio", !(ratio > 0.0 && ratio < 1.0)),
            ("deviation_scale", !finite_at_least(scale, 0.0)),
            ("tolerance", !finite_at_least(tolerance, 0.0)),
            ("max_rtt_ratio", !finite_at_least(rtt_ratio, 1.0)),
            ("min_gain", !(0.0..1.0).contains(&gain)),
            ("probe_interval", interval == 0),
            ("probe_window", window.is_zero()),
            ("timeout", timeout.is_zero()),
        ];
        let built = with_bounds!(Probe::builder(), bounds)
            .backoff_ratio(ratio)
            .deviation_scale(scale)
            .tolerance(tolerance)
            .max_rtt_ratio(rtt_ratio)
            .min_gain(gain)
            .probe_interval(interval)
            .probe_window(window)
            .timeout(timeout)
            .build();
        let Some(probe) = documented.check(built, &settings) else {
            return Ok(());
        };
        // Slow start doubles from `initial` while there is room above it.
        assert_eq!(probe.in_slow_start(), documented.initial < documented.max);
        // The first cut, before any doubling: × backoff_ratio, rounded down.
        let cut = documented.clamp((f64::from(documented.initial) * ratio).floor()) as u32;
        assert_eq!(cut_once(&probe, Outcome::BackPressure, Duration::from_millis(1)), cut);
        assert_eq!(cut_once(&probe, Outcome::Ok, timeout), cut);
        drive_limit(probe, &samples, bound);
    }

    #[test]
    fn vegas_takes_any_numbers(
        bounds in any_bounds(),
        (alpha, beta, smoothing) in
            (mostly_f64(1.0..10.0), mostly_f64(1.0..20.0), mostly_f64(0.0..=1.0)),
        multiplier in any_u32(),
        samples in prop::collection::vec(any_sample(), 0..30),
        bound in (any_u32(), any_u32()),
    ) {
        let documented = Documented::new("vegas", bounds, 20);
        let settings = [
            ("alpha", !finite_at_least(alpha, 1.0)),
            ("beta", !finite_at_least(beta, alpha)),
            ("smoothing", !(smoothing > 0.0 && smoothing <= 1.0)),
            ("probe_multiplier", multiplier == 0),
        ];
        let built = with_bounds!(Vegas::builder(), bounds)
            .alpha(alpha)
            .beta(beta)
            .smoothing(smoothing)
            .probe_multiplier(multiplier)
            .build();
        let Some(vegas) = documented.check(built, &settings) else {
            return Ok(());
        };
        // Back-pressure lowers the limit by max(1, log10 L), smoothed.
        let l = f64::from(documented.initial);
        let lowered = l - l.log10().max(1.0);
        let cut = documented.clamp((1.0 - smoothing) * l + smoothing * lowered) as u32;
        assert_eq!(cut_once(&vegas, Outcome::BackPressure, Duration::from_millis(1)), cut);
        drive_limit(vegas, &samples, bound);
    }

    #[test]
    fn gradient2_takes_any_numbers(
        bounds in any_bounds(),
        (tolerance, smoothing) in (mostly_f64(1.0..10.0), mostly_f64(0.0..=1.0)),
        long_window in any_u32(),
        (window, timeout) in (any_duration(), any_duration()),
        samples in prop::collection::vec(any_sample(), 0..30),
        bound in (any_u32(), any_u32()),
    ) {
        let documented = Documented::new("gradient2", bounds, 20);
        let settings = [
            ("tolerance", !finite_at_least(tolerance, 1.0)),
            ("smoothing", !(smoothing > 0.0 && smoothing <= 1.0)),
            ("long_window", long_window == 0),
            ("probe_window", window.is_zero()),
            ("timeout", timeout.is_zero()),
        ];
        let built = with_bounds!(Gradient2::builder(), bounds)
            .tolerance(tolerance)
            .smoothing(smoothing)
            .long_window(long_window)
            .probe_window(window)
            .timeout(timeout)
            .build();
        let Some(gradient2) = documented.check(built, &settings) else {
            return Ok(());
        };
        // Back-pressure or a call of `timeout` cuts with the gradient's floor, 0.5,
        // smoothed and rounded down.
        let l = f64::from(documented.initial);
        let cut = ((1.0 - smoothing) * l + smoothing * (l * 0.5)).floor();
        let cut = documented.clamp(cut) as u32;
        assert_eq!(cut_once(&gradient2, Outcome::BackPressure, Duration::from_millis(1)), cut);
        assert_eq!(cut_once(&gradient2, Outcome::Ok, timeout), cut);
        drive_limit(gradient2, &samples, bound);
    }

    #[test]
    fn simulated_downstream_takes_any_numbers(
        base in any_duration(),
        (slope, steepness, jitter) in
            (mostly_f64(0.0..1.0), mostly_f64(1.0..2.0), mostly_f64(0.0..1.0)),
        knee in any_u32(),
        (capacity, timeout) in (prop::option::of(any_u32()), prop::option::of(any_duration())),
        changes in prop::collection::vec((any_duration(), any_u32()), 0..3),
        ns in prop::collection::vec(any_u32(), 1..10),
    ) {
        let mut builder = Downstream::builder()
            .base(base)
            .slope(slope)
            .steepness(steepness)
            .jitter(jitter)
            .knee(knee);
        if let Some(capacity) = capacity {
            builder = builder.capacity(capacity);
        }
        if let Some(timeout) = timeout {
            builder = builder.timeout(timeout);
        }
        for &(at, k) in &changes {
            builder = builder.knee_at(at, k);
        }
        // What `build` documents it refuses; each refusal names one of them, and anything
        // else builds with the settings as given.
        let faults = [
            ("sim.base", base.is_zero()),
            ("sim.knee", knee == 0 || changes.iter().any(|&(_, k)| k == 0)),
            ("sim.capacity", capacity == Some(0)),
            ("sim.timeout", timeout == Some(Duration::ZERO)),
            ("sim.slope", !finite_at_least(slope, 0.0)),
            ("sim.steepness", !finite_at_least(steepness, 1.0)),
            ("sim.jitter", !(0.0..1.0).contains(&jitter)),
        ];
        let Some(d) = built_as_documented(builder.build(), &faults) else {
            return Ok(());
        };
        // From each change's `at` its knee holds (the last one given for an instant), and
        // the first knee before them all.
        let knee_at = |t: Duration| {
            changes
                .iter()
                .filter(|&&(at, _)| at <= t)
                .max_by_key(|&&(at, _)| at)
                .map_or(knee, |&(_, k)| k)
        };
        for t in changes.iter().map(|&(at, _)| at).chain([Duration::ZERO, Duration::MAX]) {
            assert_eq!(d.knee_at(t), knee_at(t), "at {t:?}");
        }
        // A lone call takes `base`, up to an hour.
        let (lone, base) = (d.latency(1), base.min(Duration::from_secs(3_600)));
        assert!(lone.abs_diff(base) <= base / 1_000_000, "a lone call took {lone:?}");
        for n in ns {
            let _ = d.latency(n);
        }
    }

    #[test]
    fn knee_config_takes_any_numbers(
        steps in prop::option::of(prop::collection::vec(mostly(any_u32(), 1..1_000u32), 0..5)),
        (start, max, refine, rounds) in (
            mostly(any_u32(), 1..64u32),
            mostly(any_u32(), 64..=65_536u32),
            mostly(any_u32(), 0..=64u32),
            mostly(any_u32(), 0..=8u32),
        ),
        (step, warmup, timeout) in (
            mostly(any_duration(), (1..100_000u64).prop_map(Duration::from_millis)),
            mostly(any_duration(), (0..1_000u64).prop_map(Duration::from_millis)),
            any_duration(),
        ),
        (plateau, drop, growth, back_pressure, fraction) in (
            mostly_f64(0.0..0.5),
            mostly_f64(0.0..1.0),
            mostly_f64(1.0..20.0),
            mostly_f64(0.0..1.0),
            mostly_f64(0.0..=1.0),
        ),
    ) {
        let mut builder = KneeConfig::builder()
            .start(start)
            .max_concurrency(max)
            .refine_steps(refine)
            .refine_rounds(rounds)
            .step_duration(step)
            .warmup(warmup)
            .timeout(timeout)
            .plateau(plateau)
            .max_drop(drop)
            .max_latency_growth(growth)
            .max_back_pressure(back_pressure)
            .recommend_fraction(fraction);
        if let Some(steps) = &steps {
            builder = builder.steps(steps.iter().copied());
        }
        // Durations longer than a century are a century; concurrencies at most 65,536.
        let (step, warmup) = (step.min(CENTURY), warmup.min(CENTURY));
        let most = 65_536;
        let faults = [
            (
                "knee.steps",
                steps
                    .as_ref()
                    .is_some_and(|s| s.is_empty() || s.iter().any(|&c| c == 0 || c > most)),
            ),
            ("knee.start", start == 0),
            ("knee.max_concurrency", max < start || max > most),
            ("knee.refine_steps", refine > 64),
            ("knee.refine_rounds", rounds > 8),
            ("knee.step_duration", step.is_zero()),
            ("knee.warmup", warmup >= step),
            ("knee.timeout", timeout.is_zero()),
            ("knee.plateau", !(0.0..0.5).contains(&plateau)),
            ("knee.max_drop", !(drop > plateau && drop < 1.0)),
            // "Above 1 and finite".
            ("knee.max_latency_growth", !(growth > 1.0 && growth.is_finite())),
            ("knee.max_back_pressure", !(0.0..1.0).contains(&back_pressure)),
            ("knee.recommend_fraction", !(fraction > 0.0 && fraction <= 1.0)),
        ];
        let Some(c) = built_as_documented(builder.build(), &faults) else {
            return Ok(());
        };
        let mut sorted = steps;
        if let Some(s) = &mut sorted {
            s.sort_unstable();
            s.dedup();
        }
        prop_assert_eq!(c.steps(), sorted.as_deref());
        prop_assert_eq!((c.step_duration(), c.warmup()), (step, warmup));
        prop_assert_eq!(c.recommend_fraction(), fraction);
        prop_assert!(c.max_steps() >= 1);
    }
}

/// `KneeConfigBuilder::max_latency_growth` documents its bound as "above 1 and finite":
/// an infinity is refused, naming the field.
#[test]
fn knee_config_refuses_an_infinite_latency_growth() {
    let refused = KneeConfig::builder()
        .max_latency_growth(f64::INFINITY)
        .build()
        .unwrap_err();
    assert_eq!(refused.field(), "knee.max_latency_growth");
}
