//! Envoy's adaptive concurrency filter, gradient controller, from its published
//! documentation, as an [`AdaptiveLimit`]: a baseline for the bench, not a port of its code.
//!
//! - **minRTT**: measured in a window where the limit is pinned to `min_concurrency` (3):
//!   the p50 of `request_count` (50) samples. Again every `min_rtt_interval` (60 s; Envoy
//!   jitters the start, here it is exact so the bench is deterministic), and whenever the
//!   limit sat at `min_concurrency` for 5 consecutive update windows. The limit before the
//!   window is restored after it.
//! - **Update** every `update_interval` (100 ms): `sampleRTT` = p50 of the window's samples;
//!   `gradient = clamp((minRTT + buffer) / sampleRTT, 0.5, 2.0)` with `buffer` = 25 % of
//!   minRTT; `limit = limit × gradient`, then `+ sqrt(limit)` of headroom; clamped to
//!   `[min_concurrency, max_concurrency_limit]` (1000).
//! - Every finished call is a latency sample (Envoy does not tell back-pressure apart);
//!   ignored calls are skipped. The limit starts at `min_concurrency`, inside a minRTT
//!   window.

use std::time::Duration;

use flowgate::adaptive::{AdaptiveLimit, Outcome, Sample};

const MIN_CONCURRENCY: u32 = 3;
const MAX_LIMIT: u32 = 1000;
const REQUEST_COUNT: usize = 50;
const UPDATE_INTERVAL: Duration = Duration::from_millis(100);
const MIN_RTT_INTERVAL: Duration = Duration::from_secs(60);
const BUFFER: f64 = 0.25;
const STUCK_WINDOWS: u32 = 5;

#[derive(Debug, Clone)]
pub struct EnvoyGradient {
    limit: u32,
    /// `Some(limit to restore)` while measuring minRTT.
    measuring: Option<u32>,
    min_rtt: Duration,
    samples: Vec<Duration>,
    window_end: Duration,
    next_min_rtt: Duration,
    at_min: u32,
}

impl EnvoyGradient {
    pub fn new() -> EnvoyGradient {
        EnvoyGradient {
            limit: MIN_CONCURRENCY,
            measuring: Some(MIN_CONCURRENCY),
            min_rtt: Duration::ZERO,
            samples: Vec::new(),
            window_end: UPDATE_INTERVAL,
            next_min_rtt: MIN_RTT_INTERVAL,
            at_min: 0,
        }
    }

    fn enter_min_rtt(&mut self) {
        self.measuring = Some(self.limit);
        self.limit = MIN_CONCURRENCY;
        self.samples.clear();
        self.at_min = 0;
    }
}

fn p50(samples: &mut [Duration]) -> Duration {
    samples.sort_unstable();
    samples[(samples.len() - 1) / 2]
}

impl AdaptiveLimit for EnvoyGradient {
    fn limit(&self) -> u32 {
        self.limit
    }

    fn update(&mut self, sample: &Sample) -> u32 {
        if sample.outcome == Outcome::Ignored {
            return self.limit;
        }
        self.samples.push(sample.rtt);
        if let Some(restore) = self.measuring {
            if self.samples.len() >= REQUEST_COUNT {
                self.min_rtt = p50(&mut self.samples);
                self.samples.clear();
                self.measuring = None;
                self.limit = restore;
                self.next_min_rtt = sample.now + MIN_RTT_INTERVAL;
                self.window_end = sample.now + UPDATE_INTERVAL;
            }
            return self.limit;
        }
        if sample.now < self.window_end {
            return self.limit;
        }
        let sample_rtt = p50(&mut self.samples).as_secs_f64();
        self.samples.clear();
        self.window_end = sample.now + UPDATE_INTERVAL;
        let min_rtt = self.min_rtt.as_secs_f64();
        let gradient = if sample_rtt > 0.0 {
            ((min_rtt * (1.0 + BUFFER)) / sample_rtt).clamp(0.5, 2.0)
        } else {
            2.0
        };
        let limit = f64::from(self.limit) * gradient;
        let new = (limit + limit.sqrt()) as u32;
        self.limit = new.clamp(MIN_CONCURRENCY, MAX_LIMIT);
        if self.limit == MIN_CONCURRENCY {
            self.at_min += 1;
        } else {
            self.at_min = 0;
        }
        if sample.now >= self.next_min_rtt || self.at_min >= STUCK_WINDOWS {
            self.enter_min_rtt();
        }
        self.limit
    }

    fn name(&self) -> &'static str {
        "envoy gradient"
    }
}
