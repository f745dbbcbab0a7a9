//! The adaptive limits, the simulator and the knee config with any float, bound and
//! sample.

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

fn adaptive_error(e: &ConfigError) {
    sane_config_error(e);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn aimd_takes_any_numbers(
        (min, max, initial) in (any_u32(), any_u32(), any_u32()),
        ratio in any_f64(),
        timeout in any_duration(),
        samples in prop::collection::vec(any_sample(), 0..30),
        bound in (any_u32(), any_u32()),
    ) {
        match Aimd::builder()
            .min_limit(min)
            .max_limit(max)
            .initial(initial)
            .backoff_ratio(ratio)
            .timeout(timeout)
            .build()
        {
            Ok(a) => drive_limit(a, &samples, bound),
            Err(e) => adaptive_error(&e),
        }
    }

    #[test]
    fn probe_takes_any_numbers(
        (min, initial) in (any_u32(), any_u32()),
        (ratio, scale, tolerance, rtt_ratio, gain) in
            (any_f64(), any_f64(), any_f64(), any_f64(), any_f64()),
        interval in any_u32(),
        (window, timeout) in (any_duration(), any_duration()),
        samples in prop::collection::vec(any_sample(), 0..30),
        bound in (any_u32(), any_u32()),
    ) {
        match Probe::builder()
            .min_limit(min)
            .initial(initial)
            .backoff_ratio(ratio)
            .deviation_scale(scale)
            .tolerance(tolerance)
            .max_rtt_ratio(rtt_ratio)
            .min_gain(gain)
            .probe_interval(interval)
            .probe_window(window)
            .timeout(timeout)
            .build()
        {
            Ok(p) => drive_limit(p, &samples, bound),
            Err(e) => adaptive_error(&e),
        }
    }

    #[test]
    fn vegas_takes_any_numbers(
        (max, initial) in (any_u32(), any_u32()),
        (alpha, beta, smoothing) in (any_f64(), any_f64(), any_f64()),
        multiplier in any_u32(),
        samples in prop::collection::vec(any_sample(), 0..30),
        bound in (any_u32(), any_u32()),
    ) {
        match Vegas::builder()
            .max_limit(max)
            .initial(initial)
            .alpha(alpha)
            .beta(beta)
            .smoothing(smoothing)
            .probe_multiplier(multiplier)
            .build()
        {
            Ok(v) => drive_limit(v, &samples, bound),
            Err(e) => adaptive_error(&e),
        }
    }

    #[test]
    fn gradient2_takes_any_numbers(
        (min, max) in (any_u32(), any_u32()),
        (tolerance, smoothing) in (any_f64(), any_f64()),
        long_window in any_u32(),
        (window, timeout) in (any_duration(), any_duration()),
        samples in prop::collection::vec(any_sample(), 0..30),
        bound in (any_u32(), any_u32()),
    ) {
        match Gradient2::builder()
            .min_limit(min)
            .max_limit(max)
            .tolerance(tolerance)
            .smoothing(smoothing)
            .long_window(long_window)
            .probe_window(window)
            .timeout(timeout)
            .build()
        {
            Ok(g) => drive_limit(g, &samples, bound),
            Err(e) => adaptive_error(&e),
        }
    }

    #[test]
    fn simulated_downstream_takes_any_numbers(
        base in any_duration(),
        (slope, steepness, jitter) in (any_f64(), any_f64(), any_f64()),
        (knee, capacity) in (any_u32(), any_u32()),
        timeout in any_duration(),
        changes in prop::collection::vec((any_duration(), any_u32()), 0..3),
        ns in prop::collection::vec(any_u32(), 1..10),
    ) {
        let mut builder = Downstream::builder()
            .base(base)
            .slope(slope)
            .steepness(steepness)
            .jitter(jitter)
            .knee(knee)
            .capacity(capacity)
            .timeout(timeout);
        for (at, k) in changes {
            builder = builder.knee_at(at, k);
        }
        match builder.build() {
            Ok(d) => {
                for n in ns {
                    let _ = d.latency(n);
                    let _ = d.knee_at(Duration::MAX);
                }
            }
            Err(e) => sane_config_error(&e),
        }
    }

    #[test]
    fn knee_config_takes_any_numbers(
        steps in prop::option::of(prop::collection::vec(any_u32(), 0..5)),
        (start, max, refine, rounds) in (any_u32(), any_u32(), any_u32(), any_u32()),
        (step, warmup, timeout) in (any_duration(), any_duration(), any_duration()),
        (plateau, drop, growth, back_pressure, fraction) in
            (any_f64(), any_f64(), any_f64(), any_f64(), any_f64()),
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
        if let Some(steps) = steps {
            builder = builder.steps(steps);
        }
        match builder.build() {
            Ok(c) => {
                let _ = (c.max_steps(), c.step_duration(), c.warmup());
                prop_assert!(c.recommend_fraction().is_finite());
            }
            Err(e) => sane_config_error(&e),
        }
    }
}
