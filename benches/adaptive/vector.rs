//! Vector's adaptive request concurrency (ARC), from its published description, as an
//! [`AdaptiveLimit`]: a baseline for the bench, not a port of its code.
//!
//! - The limit starts at 1 (no slow start) and stays in `[1, 200]`.
//! - The RTTs of served calls are averaged over one "RTT period"; at its end (a period
//!   lasts the past RTT's mean) the period's mean is compared with an EWMA of past periods
//!   (`ewma_alpha` 0.4) and its deviation:
//!   - **increase** by 1 if the limit was reached during the period (a call started with
//!     `in_flight ≥ limit`), no back-pressure was seen, and the period's mean RTT is not
//!     above the past mean;
//!   - otherwise **decrease** to `⌊limit × 0.9⌋` on back-pressure or when the period's
//!     mean RTT is at least the past mean plus `rtt_deviation_scale` (2.5) deviations.
//! - Back-pressure samples count as back-pressure only (their RTT is not averaged);
//!   ignored calls are skipped.

use std::time::Duration;

use flowgate::adaptive::{AdaptiveLimit, Outcome, Sample};

const MAX_LIMIT: u32 = 200;
const ALPHA: f64 = 0.4;
const DEVIATION_SCALE: f64 = 2.5;
const DECREASE_RATIO: f64 = 0.9;

#[derive(Debug, Clone)]
pub struct VectorArc {
    limit: u32,
    /// EWMA of past periods: `(mean, variance)`.
    past: Option<(f64, f64)>,
    /// This period: `(sum, count)` of served RTTs in seconds.
    current: (f64, u32),
    next_update: Duration,
    back_pressure: bool,
    reached_limit: bool,
}

impl VectorArc {
    pub fn new() -> VectorArc {
        VectorArc {
            limit: 1,
            past: None,
            current: (0.0, 0),
            next_update: Duration::ZERO,
            back_pressure: false,
            reached_limit: false,
        }
    }

    fn past_update(&mut self, x: f64) -> (f64, f64) {
        let next = match self.past {
            None => (x, 0.0),
            Some((mean, var)) => {
                let diff = x - mean;
                let incr = ALPHA * diff;
                (mean + incr, (1.0 - ALPHA) * (var + diff * incr))
            }
        };
        self.past = Some(next);
        next
    }
}

impl AdaptiveLimit for VectorArc {
    fn limit(&self) -> u32 {
        self.limit
    }

    fn update(&mut self, sample: &Sample) -> u32 {
        match sample.outcome {
            Outcome::Ignored => return self.limit,
            Outcome::BackPressure => self.back_pressure = true,
            _ => {
                self.current.0 += sample.rtt.as_secs_f64();
                self.current.1 += 1;
            }
        }
        if sample.in_flight >= self.limit {
            self.reached_limit = true;
        }
        let current = (self.current.1 > 0).then(|| self.current.0 / f64::from(self.current.1));
        let Some((mean, var)) = self.past else {
            if let Some(c) = current {
                self.past_update(c);
                self.next_update = sample.now + Duration::from_secs_f64(c);
            }
            return self.limit;
        };
        if sample.now < self.next_update {
            return self.limit;
        }
        let threshold = var.sqrt() * DEVIATION_SCALE;
        if self.limit < MAX_LIMIT
            && self.reached_limit
            && !self.back_pressure
            && current.is_some_and(|c| c <= mean)
        {
            self.limit += 1;
        } else if self.limit > 1
            && (self.back_pressure || current.unwrap_or(0.0) >= mean + threshold)
        {
            self.limit = ((f64::from(self.limit) * DECREASE_RATIO) as u32).max(1);
        }
        let mean = match current {
            Some(c) => self.past_update(c).0,
            None => mean,
        };
        self.next_update = sample.now + Duration::from_secs_f64(mean);
        self.current = (0.0, 0);
        self.back_pressure = false;
        self.reached_limit = false;
        self.limit
    }

    fn name(&self) -> &'static str {
        "vector arc"
    }
}
