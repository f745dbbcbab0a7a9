//! When a step is saturated, and how a saturation is confirmed against noise: see
//! [Noise](super#noise-confirming-a-saturation).

use super::measure::measure;
use super::{KneeConfig, KneeError, KneeStep, KneeTarget};

/// Saturated compared with the steps measured below it (see the module docs).
pub(super) fn is_saturated(step: &KneeStep, below: &[KneeStep], config: &KneeConfig) -> bool {
    saturated_against(
        step,
        below.iter().filter(|s| s.concurrency < step.concurrency),
        config,
    )
}

/// A control (a step measured again) that shows the target slower than it was: saturated
/// compared with every step measured at its concurrency or below, its first measurement
/// included.
fn is_disturbed(control: &KneeStep, measured: &[KneeStep], config: &KneeConfig) -> bool {
    saturated_against(
        control,
        measured
            .iter()
            .filter(|s| s.concurrency <= control.concurrency),
        config,
    )
}

/// Saturated compared with `refs`: pushed back beyond `max_back_pressure`, no `Ok` call,
/// a throughput more than `max_drop` below the best of `refs`, or a p50
/// `max_latency_growth` times their lowest.
fn saturated_against<'a>(
    step: &KneeStep,
    refs: impl Iterator<Item = &'a KneeStep> + Clone,
    config: &KneeConfig,
) -> bool {
    if step.back_pressure_ratio() > config.max_back_pressure || step.ok == 0 {
        return true;
    }
    let best = refs.clone().map(|s| s.throughput).fold(0.0_f64, f64::max);
    let min_p50 = refs.filter(|s| s.ok > 0).map(|s| s.p50).min();
    let dropped = step.throughput < best * (1.0 - config.max_drop);
    let slow = min_p50.is_some_and(|min| {
        !min.is_zero() && step.p50.as_secs_f64() >= min.as_secs_f64() * config.max_latency_growth
    });
    dropped || slow
}

/// Measure again, once each, the steps whose throughput is more than `max_drop` below both
/// the best step measured below them and the best measured above: a throughput curve rises
/// to its peak and then falls, so such a hole is noise (a spell of slow calls hid the step,
/// perhaps the peak, and the knee would be read against a lower best). The new measurement
/// replaces the old one.
pub(super) async fn fill_holes<T: KneeTarget + ?Sized>(
    target: &T,
    steps: &mut [KneeStep],
    config: &KneeConfig,
) {
    let holes: Vec<u32> = {
        let mut sorted: Vec<&KneeStep> = steps.iter().collect();
        sorted.sort_by_key(|s| s.concurrency);
        let best = |steps: &[&KneeStep]| steps.iter().map(|s| s.throughput).fold(0.0, f64::max);
        (1..sorted.len().saturating_sub(1))
            .filter(|&i| {
                let around = best(&sorted[..i]).min(best(&sorted[i + 1..]));
                sorted[i].throughput < around * (1.0 - config.max_drop)
            })
            .map(|i| sorted[i].concurrency)
            .collect()
    };
    for c in holes {
        let again = measure(target, c, config).await;
        if let Some(step) = steps.iter_mut().find(|s| s.concurrency == c) {
            *step = again;
        }
    }
}

/// How many times [`confirm`] measures the step below before it gives up
/// ([`KneeError::Unsteady`]).
const MAX_CONTROLS: u32 = 3;

/// Confirm the step at `c`, which looks saturated: measure the step below it again (the control)
/// until it shows the target as it was, at most [`MAX_CONTROLS`] times, then the step
/// itself again. Answers that second measurement of the step (the one kept) and whether it
/// is saturated too. A noise that slowed the target during the first measurement and lasts
/// into the second slows the control between them too, so only a target that stayed as it
/// was confirms a saturation.
pub(super) async fn confirm<T: KneeTarget + ?Sized>(
    target: &T,
    c: u32,
    below: &[KneeStep],
    config: &KneeConfig,
) -> Result<(KneeStep, bool), KneeError> {
    let control = below.iter().map(|s| s.concurrency).filter(|&b| b < c).max();
    if let Some(control) = control {
        let mut attempts = 0;
        loop {
            let measured = measure(target, control, config).await;
            if !is_disturbed(&measured, below, config) {
                break;
            }
            attempts += 1;
            if attempts >= MAX_CONTROLS {
                return Err(KneeError::Unsteady {
                    concurrency: c,
                    control,
                    attempts,
                });
            }
        }
    }
    let again = measure(target, c, config).await;
    let saturated = is_saturated(&again, below, config);
    Ok((again, saturated))
}
