//! The limiters across the end of the `u64`-nanosecond timeline (~584 years, where they
//! leave 64-bit arithmetic for 128-bit) and at the end of `Duration`: a trace moved there
//! is decided exactly as at the origin.

use super::backwards::wobbly;
use super::*;

/// `ns` nanoseconds (below 2^94) as a `Duration`.
fn wide(ns: u128) -> Duration {
    let secs = u64::try_from(ns / 1_000_000_000).unwrap();
    Duration::new(secs, (ns % 1_000_000_000) as u32)
}

/// The last nanosecond a `Duration` holds.
fn last_ns() -> u128 {
    Duration::MAX.as_nanos()
}

/// `trace` decided from the origin and moved by `offset` ns: the same decisions, every field,
/// and the same errors.
fn moved_decides_alike<A: Algorithm + Clone>(
    algorithm: A,
    trace: &[(u64, u32)],
    offset: u128,
) -> Result<(), TestCaseError> {
    let (mut here, mut there) = (Limiter::new(algorithm.clone()), Limiter::new(algorithm));
    for &(t, cost) in trace {
        let at = wide(offset + u128::from(t));
        prop_assert_eq!(
            there.check(at, cost),
            here.check(ns(t), cost),
            "{} ns moved by {} ns, cost {}",
            t,
            offset,
            cost
        );
    }
    Ok(())
}

/// The largest multiple of `step` at or below `n`.
fn down_to(n: u128, step: u64) -> u128 {
    n - n % u128::from(step)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Moved to straddle 2^64 ns, and to end just before the last `Duration`: by a
    /// multiple of the window for the windows (aligned alike), by any amount for the
    /// bucket (it has no phase).
    #[test]
    fn a_trace_moved_past_584_years_is_decided_alike(
        r in rate(),
        burst in 1u32..=20,
        tr in wobbly(2_000_000, 3_000_000, 22),
        shift in 0u64..1_000_000,
    ) {
        let span = u128::from(tr.iter().map(|s| s.0).max().unwrap_or(0));
        let window = r.period_nanos();
        // Room after the trace for the waits the decisions count (two windows, a burst).
        let room = span + 4 * u128::from(window) + 1_000_000_000;
        let straddle = (1u128 << 64) - span / 2 - u128::from(shift);
        let end = last_ns() - room;
        for offset in [straddle, end] {
            let aligned = down_to(offset, window);
            moved_decides_alike(TokenBucket::new(Quota::new(r, burst).unwrap()), &tr, offset)?;
            moved_decides_alike(FixedWindow::new(r), &tr, aligned)?;
            moved_decides_alike(SlidingWindow::new(r), &tr, aligned)?;
            moved_decides_alike(SlidingLog::new(r), &tr, offset)?;
        }
    }
}
