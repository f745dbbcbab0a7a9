//! Channel, bulkhead and demand bounds.

use super::*;

/// The largest `max_in_flight` a bulkhead takes, as its docs say: 2³¹ − 1.
const MAX_IN_FLIGHT: usize = (1 << 31) - 1;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn channel_refuses_zero_and_huge_capacities(capacity in any_usize(), overflow in any_overflow()) {
        match channel::builder::<u32>(capacity).overflow(overflow).build() {
            Ok((tx, mut rx)) => {
                prop_assert!(capacity > 0 && capacity <= usize::MAX >> 2);
                prop_assert_eq!(tx.capacity(), capacity);
                for i in 0..3 {
                    let _ = tx.try_send(i);
                }
                prop_assert!(tx.len() <= capacity);
                prop_assert!(rx.try_recv().is_ok());
            }
            Err(e) => {
                sane_config_error(&e);
                prop_assert_eq!(e.field(), "channel.capacity");
                prop_assert!(capacity == 0 || capacity > usize::MAX >> 2);
            }
        }
    }

    #[test]
    fn bulkhead_refuses_bad_bounds(
        max_in_flight in any_usize(),
        max_waiting in any_usize(),
        reserve in any_usize(),
        timeout in prop::option::of(any_duration()),
        resize in any_usize(),
    ) {
        paused().block_on(async {
            let mut builder = Bulkhead::builder(max_in_flight)
                .max_waiting(max_waiting)
                .critical_reserve(reserve);
            if let Some(t) = timeout {
                builder = builder.wait_timeout(t);
            }
            // What `build` documents it refuses: each refusal names the field at fault, and
            // anything else builds, with the bounds as given.
            let max_ok = (1..=MAX_IN_FLIGHT).contains(&max_in_flight);
            let bulkhead = match builder.build() {
                Ok(b) => b,
                Err(e) => {
                    sane_config_error(&e);
                    match e.field() {
                        "bulkhead.max_in_flight" => assert!(!max_ok, "{e}"),
                        "bulkhead.wait_timeout" => {
                            assert!(max_ok && timeout == Some(Duration::ZERO), "{e}")
                        }
                        "bulkhead.critical_reserve" => {
                            assert!(max_ok && reserve >= max_in_flight, "{e}")
                        }
                        other => panic!("refused on {other}: {e}"),
                    }
                    return;
                }
            };
            assert!(max_ok && timeout != Some(Duration::ZERO) && reserve < max_in_flight);
            assert_eq!(bulkhead.max_in_flight(), max_in_flight);
            assert_eq!(bulkhead.max_waiting(), max_waiting);
            let held: Vec<_> = (0..3).filter_map(|_| bulkhead.try_acquire().ok()).collect();
            assert!(held.len() <= bulkhead.max_in_flight());
            // A wait of any length is a timer, not an overflow.
            let waited =
                tokio::time::timeout(Duration::from_secs(1), bulkhead.acquire()).await;
            if let Ok(Err(e)) = &waited {
                assert!(matches!(
                    e,
                    AcquireError::TimedOut | AcquireError::WaitingRoomFull
                ), "{e:?}");
            }
            drop(waited);
            match bulkhead.set_max_in_flight(resize) {
                Ok(()) => assert_eq!(bulkhead.max_in_flight(), resize),
                Err(e) => {
                    sane_config_error(&e);
                    // The value given is at fault: out of range, or not above the reserve.
                    assert_eq!(e.field(), "bulkhead.max_in_flight", "{e}");
                    assert!(!(1..=MAX_IN_FLIGHT).contains(&resize) || reserve >= resize, "{e}");
                }
            }
            drop(held);
            assert!(bulkhead.in_flight() <= bulkhead.max_in_flight());
        });
    }

    #[test]
    fn demand_refuses_bad_levels_and_counts(
        (high, low) in (any_usize(), any_usize()),
        initial in any_u64(),
        requests in prop::collection::vec(any_u64(), 0..5),
        max_pending in any_usize(),
        offsets in prop::collection::vec(any_u64(), 0..10),
        (min, max) in (any_duration(), any_duration()),
    ) {
        match Levels::new(high, low) {
            Ok(l) => prop_assert!(l.high() > l.low()),
            Err(e) => {
                sane_config_error(&e);
                prop_assert!(high == 0 || low >= high);
            }
        }
        let (_stream, handle) = Demanded::builder(futures::stream::iter(0..3), initial)
            .build()
            .unwrap();
        for n in requests {
            let before = handle.outstanding();
            match handle.request(n) {
                Ok(()) => prop_assert!(handle.outstanding() >= before),
                Err(_) => prop_assert_eq!(n, 0),
            }
        }
        match CommitTracker::builder().max_pending(max_pending).build() {
            Ok(tracker) => {
                let mut last = None;
                let mut tokens = Vec::new();
                for o in offsets {
                    match tracker.track(o) {
                        Ok(t) => {
                            prop_assert!(last.is_none_or(|l| o > l));
                            last = Some(o);
                            tokens.push(t);
                        }
                        Err(TrackError::OutOfOrder { .. }) => {
                            prop_assert!(last.is_some_and(|l| o <= l))
                        }
                        Err(TrackError::PendingFull { .. }) => {
                            prop_assert!(tracker.pending() >= max_pending)
                        }
                        Err(TrackError::NoNextOffset { offset }) => {
                            prop_assert_eq!(offset, o);
                            prop_assert_eq!(o, u64::MAX)
                        }
                        Err(e) => panic!("undocumented error {e:?}"),
                    }
                    prop_assert!(tracker.pending() <= max_pending);
                }
                for t in tokens {
                    t.done();
                }
                prop_assert_eq!(tracker.committable(), last);
            }
            Err(e) => {
                sane_config_error(&e);
                prop_assert_eq!(max_pending, 0);
            }
        }
        let levels = Levels::new(4, 1).unwrap();
        let built = Prefetch::builder(IterSource::new(0..10), levels)
            .retry_backoff(min, max)
            .build();
        match built {
            Ok(p) => {
                prop_assert!(min <= max);
                let items: Vec<_> = paused().block_on(p.items().collect());
                prop_assert_eq!(items, (0..10).collect::<Vec<_>>());
            }
            Err(e) => {
                sane_config_error(&e);
                prop_assert!(min > max);
            }
        }
    }
}

/// The kinds of `ConfigError` are the three documented ones.
#[test]
fn config_error_kinds_are_the_documented_ones() {
    let kinds = [
        Rate::per_second(0).unwrap_err().kind(),
        Rate::per(1, Duration::MAX).unwrap_err().kind(),
        Levels::new(2, 2).unwrap_err().kind(),
    ];
    assert_eq!(
        kinds,
        [
            ConfigErrorKind::Zero,
            ConfigErrorKind::TooLarge,
            ConfigErrorKind::Inconsistent
        ]
    );
    let _ = Decision::fail_closed(Duration::MAX).ratelimit_header("p");
    assert_eq!(
        Decision::fail_closed(Duration::MAX).retry_after_secs(),
        Some(u64::MAX)
    );
}

/// An adaptive limit of the user's own that ignores its bounds and answers anything.
#[derive(Debug, Clone)]
struct Wild {
    answers: Vec<u32>,
    at: usize,
}

impl AdaptiveLimit for Wild {
    fn limit(&self) -> u32 {
        self.answers[self.at % self.answers.len()]
    }

    fn update(&mut self, _sample: &Sample) -> u32 {
        self.at += 1;
        self.limit()
    }

    fn name(&self) -> &'static str {
        "wild"
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// A bulkhead driven by an algorithm that answers 0, `u32::MAX` or anything keeps its
    /// cap within `[reserve + 1, max_in_flight]`, and permits keep flowing.
    #[test]
    fn an_adaptive_bulkhead_bounds_any_answer(
        max_in_flight in prop_oneof![1..10usize, Just(i32::MAX as usize)],
        reserve in 0..3usize,
        answers in prop::collection::vec(any_u32(), 1..6),
    ) {
        let built = Bulkhead::builder(max_in_flight)
            .critical_reserve(reserve)
            .adaptive(Wild { answers, at: 0 })
            .build();
        let Ok(bulkhead) = built else {
            prop_assert!(reserve >= max_in_flight);
            return Ok(());
        };
        paused().block_on(async {
            for _ in 0..8 {
                let cap = bulkhead.max_in_flight();
                assert!((reserve + 1..=max_in_flight).contains(&cap), "{cap}");
                let permit = tokio::time::timeout(Duration::from_secs(1), bulkhead.acquire())
                    .await
                    .expect("a permit of a bulkhead with none in flight")
                    .unwrap();
                permit.record(Outcome::Ok);
            }
        });
    }
}
