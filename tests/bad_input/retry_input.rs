//! Backoff and retry budget with any duration and float.

use super::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn backoff_takes_any_durations_and_hints(
        base in any_duration(),
        cap in any_duration(),
        jitter in crate::support::jitters(),
        max_attempts in any_u32(),
        deadline in prop::option::of(any_duration()),
        max_retry_after in any_duration(),
        retry_after_jitter in any_duration(),
        seed in any::<u64>(),
        hints in prop::collection::vec(prop::option::of(any_duration()), 1..80),
    ) {
        let mut builder = Backoff::builder()
            .base(base)
            .cap(cap)
            .jitter(jitter)
            .max_attempts(max_attempts)
            .max_retry_after(max_retry_after)
            .retry_after_jitter(retry_after_jitter)
            .seed(seed);
        if let Some(d) = deadline {
            builder = builder.deadline(d);
        }
        let backoff = match builder.build() {
            Ok(b) => b,
            Err(e) => {
                sane_config_error(&e);
                prop_assert!([
                    "backoff.base",
                    "backoff.cap",
                    "backoff.max_attempts",
                    "backoff.retry_after_jitter",
                    "backoff.deadline"
                ]
                .contains(&e.field()));
                return Ok(());
            }
        };
        let mut schedule = backoff.start();
        for hint in hints {
            match schedule.next_delay(hint) {
                Ok(d) => match hint {
                    None => prop_assert!(d <= backoff.cap(), "{d:?} above the cap"),
                    Some(h) => prop_assert!(d >= h),
                },
                Err(GiveUp::Attempts { attempts }) => {
                    prop_assert_eq!(attempts, max_attempts);
                    break;
                }
                Err(GiveUp::HintTooLong { hint: h, max }) => {
                    prop_assert!(h > max);
                }
                Err(GiveUp::Deadline { .. }) => {}
                Err(e) => panic!("undocumented give-up {e:?}"),
            }
            let _ = schedule.remaining();
        }
    }

    #[test]
    fn retry_budget_refuses_bad_numbers(max_tokens in any_u32(), ratio in any_f64()) {
        match RetryBudget::new(max_tokens, ratio) {
            Ok(b) => {
                prop_assert!((3..=1000).contains(&max_tokens));
                prop_assert!(ratio.is_finite() && ratio > 0.0);
                let r = b.token_ratio();
                prop_assert!(r.is_finite() && r > 0.0 && r <= f64::from(max_tokens));
                for _ in 0..3 {
                    let _ = b.try_retry();
                    b.on_failure();
                    b.on_success();
                }
                prop_assert!(b.tokens() <= f64::from(max_tokens));
            }
            Err(e) => {
                sane_config_error(&e);
                prop_assert!(["retry_budget.max_tokens", "retry_budget.token_ratio"]
                    .contains(&e.field()));
            }
        }
    }
}
