//! The promises of the retry docs, checked at their edge values: the jitters' ranges at
//! the smallest delays (a few nanoseconds), where rounding to whole nanoseconds shows.

use std::collections::BTreeSet;
use std::time::Duration;

use flowgate::retry::{Backoff, Jitter};

/// The delays drawn by the first retry of `n` schedules of a backoff whose base and cap
/// are both `exp_ns`.
fn first_delays(exp_ns: u64, jitter: Jitter, n: usize) -> BTreeSet<u64> {
    let b = Backoff::builder()
        .base(Duration::from_nanos(exp_ns))
        .cap(Duration::from_nanos(exp_ns))
        .jitter(jitter)
        .seed(17)
        .build()
        .unwrap();
    (0..n)
        .map(|_| b.start().next_delay(None).unwrap().as_nanos() as u64)
        .collect()
}

/// `Jitter::Equal` draws in `[exp/2, exp]`, "in whole nanoseconds, inclusive at both ends":
/// never below half of `exp`, and `exp` itself can come, odd `exp` included. (A base of
/// 1 ns drew 0 every time, and an odd `exp` never reached `exp`.)
#[test]
fn equal_jitter_covers_half_exp_to_exp_at_odd_nanoseconds() {
    assert_eq!(first_delays(1, Jitter::Equal, 50), BTreeSet::from([1]));
    assert_eq!(first_delays(3, Jitter::Equal, 200), BTreeSet::from([2, 3]));
    assert_eq!(
        first_delays(4, Jitter::Equal, 200),
        BTreeSet::from([2, 3, 4])
    );
    // The other jitters at the same edge: `[0, exp]`, and `[base, cap]`.
    assert_eq!(first_delays(1, Jitter::Full, 200), BTreeSet::from([0, 1]));
    assert_eq!(first_delays(3, Jitter::None, 5), BTreeSet::from([3]));
    assert_eq!(
        first_delays(3, Jitter::Decorrelated, 50),
        BTreeSet::from([3])
    );
}
