//! `AdaptivePacerBuilder`: the ceiling, floor, start and steps of an [`AdaptivePacer`],
//! checked when it is built.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{ConfigError, ConfigErrorKind};
use crate::metrics::Labels;
use crate::pace::Pacer;
use crate::rate::Rate;
use crate::sync::{Arc, Mutex};
use crate::time::capped;

use super::meter::Meter;
use super::rates::{faster, hundredth};
use super::*;

/// Builds an [`AdaptivePacer`]; from [`AdaptivePacer::builder`].
#[derive(Debug, Clone)]
pub struct AdaptivePacerBuilder {
    ceiling: Rate,
    floor: Option<Rate>,
    initial: Option<Rate>,
    decrease: f64,
    increase: f64,
    cooldown: Duration,
    name: Option<String>,
}

impl AdaptivePacerBuilder {
    /// The builder [`AdaptivePacer::builder`] returns: `ceiling`, and the defaults.
    pub(super) fn new(ceiling: Rate) -> AdaptivePacerBuilder {
        AdaptivePacerBuilder {
            ceiling,
            floor: None,
            initial: None,
            decrease: 0.7,
            increase: 0.05,
            cooldown: Duration::from_millis(200),
            name: None,
        }
    }

    /// The lowest rate a cut goes to. Default: 1 % of the ceiling (for a ceiling slower
    /// than one per 317 years: one per `u64::MAX` ns, the slowest [`Rate`]). A server's policy or
    /// allowance below it still caps the rate (the server is never sent more than it allows).
    pub fn floor(mut self, floor: Rate) -> Self {
        self.floor = Some(floor);
        self
    }

    /// The rate to start at. Default: the ceiling.
    pub fn initial(mut self, initial: Rate) -> Self {
        self.initial = Some(initial);
        self
    }

    /// The factor `β` a cut multiplies the rate by, in `(0, 1)`. Default: 0.7.
    pub fn decrease(mut self, beta: f64) -> Self {
        self.decrease = beta;
        self
    }

    /// How fast the rate climbs while probing: this share of the last good rate per
    /// second, a step that grows by itself every 2 s without a cut. In `(0, 10]`.
    /// Default: 0.05.
    pub fn increase(mut self, share_per_second: f64) -> Self {
        self.increase = share_per_second;
        self
    }

    /// How long a congestion epoch lasts at least: after back-pressure without a
    /// `Retry-After` (a 503 or a timeout), or with one shorter than it, more back-pressure
    /// within it does not cut again (a longer `Retry-After` makes the epoch last as long).
    /// Set it near the round-trip time. Default: 200 ms.
    pub fn cooldown(mut self, cooldown: Duration) -> Self {
        self.cooldown = capped(cooldown);
        self
    }

    /// The `name` label of the metrics (of the adaptive pacer and of its pacer).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Build the adaptive pacer.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `adaptive.floor` if the floor is above the ceiling, on
    /// `adaptive.initial` if the initial rate is outside `[floor, ceiling]`, on
    /// `adaptive.decrease` if `β` is not in `(0, 1)`, on `adaptive.increase` if it is not
    /// in `(0, 10]`.
    pub fn build(self) -> Result<AdaptivePacer, ConfigError> {
        let ceiling = self.ceiling.per_second_f64();
        let floor_rate = self.floor.unwrap_or_else(|| hundredth(self.ceiling));
        let floor = floor_rate.per_second_f64();
        if faster(floor_rate, self.ceiling) {
            return Err(ConfigError::new(
                "adaptive.floor",
                ConfigErrorKind::Inconsistent,
                "must be at most the ceiling",
            ));
        }
        let initial_rate = self.initial.unwrap_or(self.ceiling);
        if faster(initial_rate, self.ceiling) || faster(floor_rate, initial_rate) {
            return Err(ConfigError::new(
                "adaptive.initial",
                ConfigErrorKind::Inconsistent,
                "must be between the floor and the ceiling",
            ));
        }
        if !(self.decrease > 0.0 && self.decrease < 1.0) {
            return Err(ConfigError::new(
                "adaptive.decrease",
                ConfigErrorKind::Inconsistent,
                "must be above 0 and below 1",
            ));
        }
        if !(self.increase > 0.0 && self.increase <= 10.0) {
            return Err(ConfigError::new(
                "adaptive.increase",
                ConfigErrorKind::Inconsistent,
                "must be above 0 and at most 10",
            ));
        }
        let config = Config {
            ceiling,
            floor,
            ceiling_rate: self.ceiling,
            floor_rate,
            ceiling_burst: Pacer::default_quota(self.ceiling).burst_size(),
            decrease: self.decrease,
            increase: self.increase,
            cooldown: self.cooldown,
        };
        let initial = initial_rate.per_second_f64();
        let mut builder = Pacer::builder(initial_rate);
        if let Some(name) = &self.name {
            builder = builder.name(name.clone());
        }
        let pacer = builder.build()?;
        let labels = Labels::new(self.name.as_deref());
        let now = Instant::now();
        let shared = Shared {
            pacer,
            config,
            control: Mutex::new(Control {
                rate: initial,
                applied: initial,
                last_good: initial,
                last_update: now,
                last_cut: now,
                epoch_end: None,
                paused_until: None,
                policy: None,
                allowance: None,
                remaining: VecDeque::new(),
                remaining_of: None,
                successes: Meter::new(now),
                responses: Meter::new(now),
                cuts: 0,
                pauses: 0,
            }),
            rate_gauge: labels.gauge(names::RATE, &[]),
            pauses: labels.counter(names::PAUSES, &[]),
            cuts: labels.counter(names::CUTS, &[]),
        };
        shared.rate_gauge.set(initial);
        Ok(AdaptivePacer {
            inner: Arc::new(shared),
        })
    }
}
