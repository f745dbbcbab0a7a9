//! All-or-nothing decisions across several token buckets (layered throttling: IP + user +
//! tenant), with one meaning in both gates: the request's validation and merging, and the
//! in-memory buckets of [`MemoryGate::check_all`](crate::gate::MemoryGate::check_all).

use std::collections::HashMap;
use std::time::Duration;

use crate::decision::Decision;
use crate::error::CostError;
use crate::gate::error::{GateError, check_key};
use crate::limit::{Algorithm, Keyed, KeyedError, TokenBucket};
use crate::rate::Quota;

/// The most limits one all-or-nothing call takes.
pub(crate) const MAX_LIMITS: usize = 32;

/// The most distinct quotas the in-memory gate keeps all-or-nothing buckets for at once.
pub(crate) const MAX_QUOTAS: usize = 16;

/// A validated all-or-nothing request: each distinct key once, with the cost it is charged.
#[derive(Debug)]
pub(crate) struct Merged<'a> {
    /// The distinct keys, in order of first appearance, with their quota and total cost.
    pub(crate) buckets: Vec<(&'a str, Quota, u32)>,
    /// For each limit given, the index of its bucket.
    of: Vec<usize>,
}

impl<'a> Merged<'a> {
    /// Validate `limits` and merge repeated keys: a key listed `n` times with the same quota
    /// is one bucket charged `n × cost`.
    ///
    /// # Errors
    ///
    /// [`GateError::NoLimits`], [`GateError::TooManyLimits`], [`GateError::Cost`] (a cost of
    /// zero, or a bucket's total cost above its burst), [`GateError::InvalidKey`],
    /// [`GateError::ConflictingQuotas`] (a key with two quotas).
    pub(crate) fn new(limits: &[(&'a str, Quota)], cost: u32) -> Result<Merged<'a>, GateError> {
        if limits.is_empty() {
            return Err(GateError::NoLimits);
        }
        if limits.len() > MAX_LIMITS {
            return Err(GateError::TooManyLimits {
                given: limits.len(),
                max: MAX_LIMITS,
            });
        }
        if cost == 0 {
            return Err(CostError::Zero.into());
        }
        let mut buckets: Vec<(&'a str, Quota, u32)> = Vec::with_capacity(limits.len());
        let mut of = Vec::with_capacity(limits.len());
        for &(key, quota) in limits {
            check_key(key)?;
            match buckets.iter().position(|b| b.0 == key) {
                Some(i) if buckets[i].1 != quota => {
                    return Err(GateError::ConflictingQuotas {
                        key: key.to_owned(),
                    });
                }
                Some(i) => {
                    // Saturates: a total past u32::MAX is past every burst anyway.
                    buckets[i].2 = buckets[i].2.saturating_add(cost);
                    of.push(i);
                }
                None => {
                    of.push(buckets.len());
                    buckets.push((key, quota, cost));
                }
            }
        }
        for &(_, quota, total) in &buckets {
            CostError::check(total, u64::from(quota.burst_size()))?;
        }
        Ok(Merged { buckets, of })
    }

    /// One decision per limit given, in order, from one decision per bucket.
    pub(crate) fn expand(&self, decided: &[Decision]) -> Vec<Decision> {
        self.of.iter().map(|&i| decided[i]).collect()
    }
}

/// The in-memory token buckets of all-or-nothing calls: one bounded [`Keyed`] map per quota.
#[derive(Debug, Default)]
pub(crate) struct MemoryBuckets {
    by_quota: HashMap<Quota, Keyed<String, TokenBucket>>,
}

impl MemoryBuckets {
    /// Decide `request` at `now`, all or nothing; each quota's map holds at most
    /// `keys_per_quota` keys, and at most [`MAX_QUOTAS`] quotas are held at once.
    ///
    /// # Errors
    ///
    /// [`GateError::KeyspaceFull`] when a new key or quota finds no room (nothing is
    /// charged then).
    pub(crate) fn check_all(
        &mut self,
        request: &Merged<'_>,
        now: Duration,
        keys_per_quota: usize,
    ) -> Result<Vec<Decision>, GateError> {
        let full = || GateError::KeyspaceFull {
            max_keys: keys_per_quota * MAX_QUOTAS,
        };
        // Room first, so that the charge below cannot stop half way.
        for &(key, quota, _) in &request.buckets {
            if !self.by_quota.contains_key(&quota) {
                if self.by_quota.len() >= MAX_QUOTAS {
                    self.by_quota.retain(|_, keys| {
                        keys.sweep(now);
                        !keys.is_empty()
                    });
                }
                if self.by_quota.len() >= MAX_QUOTAS {
                    return Err(full());
                }
                let keys =
                    Keyed::new(TokenBucket::new(quota), keys_per_quota).map_err(|_| full())?;
                self.by_quota.insert(quota, keys);
            }
            let keys = self.by_quota.get_mut(&quota).expect("inserted above");
            if keys.get(key).is_none() && keys.len() >= keys.max_keys() && keys.sweep(now) == 0 {
                return Err(full());
            }
        }
        // Decide each bucket on a copy of its state: pure, so deciding again for real below
        // gives the same answer.
        let mut decided = Vec::with_capacity(request.buckets.len());
        for &(key, quota, cost) in &request.buckets {
            let keys = &self.by_quota[&quota];
            let mut state = keys.get(key).copied().unwrap_or_default();
            let remaining_before = keys.algorithm().available(&state, now);
            let reset_before = keys.algorithm().neutral_at(&state).saturating_sub(now);
            let d = keys.algorithm().check(&mut state, now, cost)?;
            decided.push((d, remaining_before, reset_before));
        }
        if decided.iter().all(|(d, _, _)| d.allowed) {
            let mut charged = Vec::with_capacity(decided.len());
            for &(key, quota, cost) in &request.buckets {
                let keys = self.by_quota.get_mut(&quota).expect("made room above");
                charged.push(keys.check(key, now, cost).map_err(|e| match e {
                    KeyedError::KeyspaceFull { .. } => full(),
                    e => e.into(),
                })?);
            }
            return Ok(request.expand(&charged));
        }
        // Not all had room: nothing is charged; the buckets that had room report a rejection
        // with no retry_after of their own, as the Redis script does.
        let rejected: Vec<Decision> = decided
            .into_iter()
            .map(|(d, remaining, reset)| {
                if d.allowed {
                    Decision::reject(d.capacity, remaining, Duration::ZERO, reset)
                } else {
                    d
                }
            })
            .collect();
        Ok(request.expand(&rejected))
    }
}
