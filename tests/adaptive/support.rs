//! A closed-loop driver through an adaptive bulkhead: each client acquires a permit, calls
//! the simulated downstream and records the reply's outcome on the permit, so the
//! bulkhead's own integration (grant instant, in-flight count, `record`) feeds the algorithm.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use flowgate::adaptive::sim::{Downstream, Status};
use flowgate::bulkhead::Bulkhead;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// What a run saw: the bulkhead's `max_in_flight` every 100 ms, and each call's end and
/// status.
#[derive(Debug, Default)]
pub struct Run {
    pub limits: Vec<(Duration, usize)>,
    pub calls: Vec<(Duration, Status)>,
}

impl Run {
    /// The mean `max_in_flight` over `[from, to)`.
    pub fn mean_limit(&self, from: u64, to: u64) -> f64 {
        let (from, to) = (Duration::from_secs(from), Duration::from_secs(to));
        let xs: Vec<f64> = self
            .limits
            .iter()
            .filter(|(t, _)| *t >= from && *t < to)
            .map(|&(_, l)| l as f64)
            .collect();
        xs.iter().sum::<f64>() / xs.len().max(1) as f64
    }

    /// The largest `max_in_flight` over `[from, to)`.
    pub fn max_limit(&self, from: u64, to: u64) -> usize {
        let (from, to) = (Duration::from_secs(from), Duration::from_secs(to));
        self.limits
            .iter()
            .filter(|(t, _)| *t >= from && *t < to)
            .map(|&(_, l)| l)
            .max()
            .unwrap_or(0)
    }

    /// The first time at or after `from` when `max_in_flight` is at most `at_most`.
    pub fn first_at_most(&self, from: u64, at_most: usize) -> Option<Duration> {
        let from = Duration::from_secs(from);
        self.limits
            .iter()
            .find(|(t, l)| *t >= from && *l <= at_most)
            .map(|&(t, _)| t)
    }

    /// Calls served `Ok` per second over `[from, to)`.
    pub fn throughput(&self, from: u64, to: u64) -> f64 {
        let (f, t) = (Duration::from_secs(from), Duration::from_secs(to));
        let ok = self
            .calls
            .iter()
            .filter(|(end, s)| *end >= f && *end < t && *s == Status::Ok)
            .count();
        ok as f64 / (to - from) as f64
    }
}

/// `clients` closed-loop clients for `secs` seconds through `bulkhead`.
pub async fn drive(downstream: &Downstream, bulkhead: &Bulkhead, clients: u32, secs: u64) -> Run {
    let start = Instant::now();
    let run = Arc::new(Mutex::new(Run::default()));
    let mut tasks = JoinSet::new();
    {
        let (bulkhead, run) = (bulkhead.clone(), run.clone());
        tasks.spawn(async move {
            let mut next = start;
            loop {
                run.lock()
                    .unwrap()
                    .limits
                    .push((next - start, bulkhead.max_in_flight()));
                next += Duration::from_millis(100);
                tokio::time::sleep_until(next).await;
            }
        });
    }
    for _ in 0..clients {
        let (bulkhead, downstream, run) = (bulkhead.clone(), downstream.clone(), run.clone());
        tasks.spawn(async move {
            loop {
                let Ok(permit) = bulkhead.acquire().await else {
                    return;
                };
                let reply = downstream.call().await;
                permit.record(reply.status.outcome());
                run.lock()
                    .unwrap()
                    .calls
                    .push((start.elapsed(), reply.status));
            }
        });
    }
    tokio::time::sleep_until(start + Duration::from_secs(secs)).await;
    tasks.shutdown().await;
    std::mem::take(&mut *run.lock().unwrap())
}
