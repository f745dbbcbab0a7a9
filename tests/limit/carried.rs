//! A state checked by an algorithm of another configuration than the one that made it: a
//! limit lowered on a reload that keeps the states (as the Redis scripts read a key written
//! by a gate of another configuration in a rolling deploy).

use flowgate::limit::{FixedWindowState, SlidingLogState, SlidingWindowState, TokenBucketState};

use super::*;

/// States filled under a limit of 10 a second, then checked under 5: nothing more is
/// admitted until what they hold has gone below 5, with the decision's fields what the
/// lower limit says (no panic, no count wrapped round into an admission).
#[test]
fn a_state_holding_more_than_a_lowered_limit_admits_nothing_past_it() {
    let ms = Duration::from_millis;
    let (high, low) = (Rate::per_second(10).unwrap(), Rate::per_second(5).unwrap());

    let mut state = FixedWindowState::default();
    assert!(
        FixedWindow::new(high)
            .check(&mut state, ms(100), 8)
            .unwrap()
            .allowed
    );
    let d = FixedWindow::new(low).check(&mut state, ms(200), 1).unwrap();
    assert_eq!(
        parts(&d),
        (false, 0, ms(800), ms(800)),
        "fixed window: {d:?}"
    );
    let d = FixedWindow::new(low)
        .check(&mut state, ms(1_000), 5)
        .unwrap();
    assert!(
        d.allowed && d.remaining == 0,
        "fixed window, next window: {d:?}"
    );

    let mut state = SlidingLogState::default();
    let log = SlidingLog::new(high);
    assert!(log.check(&mut state, ms(0), 4).unwrap().allowed);
    assert!(log.check(&mut state, ms(500), 4).unwrap().allowed);
    let d = SlidingLog::new(low).check(&mut state, ms(600), 1).unwrap();
    // 8 held, 5 allowed: the 4 from 0 ms must go (at 1 000 ms) before 1 more fits.
    assert_eq!(
        parts(&d),
        (false, 0, ms(400), ms(900)),
        "sliding log: {d:?}"
    );
    let d = SlidingLog::new(low)
        .check(&mut state, ms(1_000), 1)
        .unwrap();
    assert!(d.allowed && d.remaining == 0, "sliding log, 4 gone: {d:?}");

    // The sliding window and the token bucket (a lower burst) already reject.
    let mut state = SlidingWindowState::default();
    assert!(
        SlidingWindow::new(high)
            .check(&mut state, ms(100), 8)
            .unwrap()
            .allowed
    );
    let d = SlidingWindow::new(low)
        .check(&mut state, ms(200), 1)
        .unwrap();
    assert!(!d.allowed && d.remaining == 0, "sliding window: {d:?}");
    let mut state = TokenBucketState::default();
    let burst = |n| TokenBucket::new(Quota::new(low, n).unwrap());
    assert!(burst(10).check(&mut state, ms(100), 8).unwrap().allowed);
    let d = burst(5).check(&mut state, ms(200), 1).unwrap();
    assert!(!d.allowed && d.remaining == 0, "token bucket: {d:?}");
}
