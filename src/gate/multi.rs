//! All-or-nothing decisions across several token buckets (layered throttling: IP + user +
//! tenant), with one meaning in both gates: the request's validation and merging, and the
//! in-memory buckets of [`MemoryGate::check_all`](crate::gate::MemoryGate::check_all).

use std::ops::{Deref, DerefMut};
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

/// How many items an [`Inline`] holds without allocating.
const INLINE: usize = 4;

/// A list of `Copy` items held inline up to [`INLINE`] of them (a request on a few keys is
/// validated and merged without allocating, and stays small to move), in a `Vec` beyond.
#[derive(Debug, Clone)]
pub(crate) enum Inline<T: Copy> {
    Few { len: usize, items: [T; INLINE] },
    Many(Vec<T>),
}

impl<T: Copy> Inline<T> {
    /// Empty; `fill` only initializes the unused slots.
    fn new(fill: T) -> Inline<T> {
        Inline::Few {
            len: 0,
            items: [fill; INLINE],
        }
    }

    /// Append `item`.
    fn push(&mut self, item: T) {
        match self {
            Inline::Few { len, items } if *len < INLINE => {
                items[*len] = item;
                *len += 1;
            }
            Inline::Few { items, .. } => {
                let mut many = Vec::with_capacity(MAX_LIMITS);
                many.extend_from_slice(items);
                many.push(item);
                *self = Inline::Many(many);
            }
            Inline::Many(many) => many.push(item),
        }
    }
}

impl<T: Copy> Deref for Inline<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match self {
            Inline::Few { len, items } => &items[..*len],
            Inline::Many(many) => many,
        }
    }
}

impl<T: Copy> DerefMut for Inline<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            Inline::Few { len, items } => &mut items[..*len],
            Inline::Many(many) => many,
        }
    }
}

impl<'s, T: Copy> IntoIterator for &'s Inline<T> {
    type Item = &'s T;
    type IntoIter = std::slice::Iter<'s, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// A validated all-or-nothing request: each distinct key once, with the cost it is charged.
#[derive(Debug)]
pub(crate) struct Merged<'a> {
    /// The distinct keys, in order of first appearance, with their quota and total cost.
    pub(crate) buckets: Inline<(&'a str, Quota, u32)>,
    /// For each limit given, the index of its bucket (never above the limit's own index).
    of: Inline<u8>,
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
        let Some(&(first, first_quota)) = limits.first() else {
            return Err(GateError::NoLimits);
        };
        if limits.len() > MAX_LIMITS {
            return Err(GateError::TooManyLimits {
                given: limits.len(),
                max: MAX_LIMITS,
            });
        }
        if cost == 0 {
            return Err(CostError::Zero.into());
        }
        let mut buckets = Inline::new((first, first_quota, 0u32));
        let mut of = Inline::new(0u8);
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
                    of.push(i as u8);
                }
                None => {
                    of.push(buckets.len() as u8);
                    buckets.push((key, quota, cost));
                }
            }
        }
        for &(_, quota, total) in &buckets {
            CostError::check(total, u64::from(quota.burst_size()))?;
        }
        Ok(Merged { buckets, of })
    }

    /// What [`new`](Merged::new) checks of a request on one limit (which needs no merging):
    /// the same errors, in the same order.
    ///
    /// # Errors
    ///
    /// [`GateError::Cost`], [`GateError::InvalidKey`].
    pub(crate) fn check_one(key: &str, quota: Quota, cost: u32) -> Result<(), GateError> {
        if cost == 0 {
            return Err(CostError::Zero.into());
        }
        check_key(key)?;
        CostError::check(cost, u64::from(quota.burst_size()))?;
        Ok(())
    }

    /// One decision per limit given, in order, from one decision per bucket.
    #[cfg(feature = "redis")]
    pub(crate) fn expand(&self, decided: &[Decision]) -> Vec<Decision> {
        self.of.iter().map(|&i| decided[usize::from(i)]).collect()
    }

    /// [`expand`](Merged::expand) in place: `decided` holds one decision per bucket and is
    /// left with one per limit.
    fn expand_in_place(&self, decided: &mut Vec<Decision>) {
        if self.of.len() == decided.len() {
            // No key repeated: the buckets are the limits.
            return;
        }
        let Some(&last) = decided.last() else {
            return;
        };
        decided.resize(self.of.len(), last);
        // Backwards: a limit's bucket index is never above its own, so the slots still to
        // be read are not written yet.
        for j in (0..self.of.len()).rev() {
            decided[j] = decided[usize::from(self.of[j])];
        }
    }
}

/// The all-or-nothing buckets of one quota.
#[derive(Debug)]
struct QuotaKeys {
    quota: Quota,
    keys: Keyed<String, TokenBucket>,
}

/// The in-memory token buckets of all-or-nothing calls: one bounded [`Keyed`] map per quota
/// (at most [`MAX_QUOTAS`], found by a scan: cheaper than hashing a quota).
#[derive(Debug, Default)]
pub(crate) struct MemoryBuckets {
    by_quota: Vec<QuotaKeys>,
}

impl MemoryBuckets {
    /// Decide `request` at `now`, all or nothing; each quota's map holds at most
    /// `keys_per_quota` keys, and at most [`MAX_QUOTAS`] quotas are held at once.
    ///
    /// # Errors
    ///
    /// [`GateError::KeyspaceFull`] when a new key or quota finds no room (nothing is
    /// charged then).
    #[cfg(test)]
    pub(crate) fn check_all(
        &mut self,
        request: &Merged<'_>,
        now: Duration,
        keys_per_quota: usize,
    ) -> Result<Vec<Decision>, GateError> {
        let mut out = Vec::new();
        self.check_all_into(request, now, keys_per_quota, &mut out)?;
        Ok(out)
    }

    /// The map of `quota`, made (evicting the quotas with no key left if need be) when it
    /// is not held.
    fn quota_keys(
        &mut self,
        quota: Quota,
        now: Duration,
        keys_per_quota: usize,
    ) -> Result<&mut Keyed<String, TokenBucket>, GateError> {
        let full = || GateError::KeyspaceFull {
            max_keys: keys_per_quota * MAX_QUOTAS,
        };
        let at = match self.by_quota.iter().position(|q| q.quota == quota) {
            Some(at) => at,
            None => {
                if self.by_quota.len() >= MAX_QUOTAS {
                    self.by_quota.retain_mut(|q| {
                        q.keys.sweep(now);
                        !q.keys.is_empty()
                    });
                }
                if self.by_quota.len() >= MAX_QUOTAS {
                    return Err(full());
                }
                let keys =
                    Keyed::new(TokenBucket::new(quota), keys_per_quota).map_err(|_| full())?;
                self.by_quota.push(QuotaKeys { quota, keys });
                self.by_quota.len() - 1
            }
        };
        Ok(&mut self.by_quota[at].keys)
    }

    /// A request on one bucket, validated ([`Merged::check_one`]) or merged: deciding it is
    /// all or nothing already (a rejection charges nothing; a new key at a full map is
    /// refused before it is charged). One decision pushed onto `out`.
    pub(crate) fn check_one_into(
        &mut self,
        key: &str,
        quota: Quota,
        cost: u32,
        now: Duration,
        keys_per_quota: usize,
        out: &mut Vec<Decision>,
    ) -> Result<(), GateError> {
        let keys = self.quota_keys(quota, now, keys_per_quota)?;
        let decided = keys.check(key, now, cost).map_err(|e| match e {
            KeyedError::KeyspaceFull { .. } => GateError::KeyspaceFull {
                max_keys: keys_per_quota * MAX_QUOTAS,
            },
            e => e.into(),
        })?;
        out.push(decided);
        Ok(())
    }

    /// [`check_all`](MemoryBuckets::check_all) into `out` (cleared first; unspecified on an
    /// error): one decision per limit of the request, in order. One hash lookup per key for a request on one
    /// bucket, two per key on several (decide on copies, then charge).
    pub(crate) fn check_all_into(
        &mut self,
        request: &Merged<'_>,
        now: Duration,
        keys_per_quota: usize,
        out: &mut Vec<Decision>,
    ) -> Result<(), GateError> {
        out.clear();
        let full = || GateError::KeyspaceFull {
            max_keys: keys_per_quota * MAX_QUOTAS,
        };
        let keyed_error = |e| match e {
            KeyedError::KeyspaceFull { .. } => full(),
            e => e.into(),
        };
        if let [(key, quota, cost)] = *request.buckets {
            self.check_one_into(key, quota, cost, now, keys_per_quota, out)?;
            request.expand_in_place(out);
            return Ok(());
        }
        // Room first, then each bucket decided on a copy of its state: pure, so deciding
        // again for real below gives the same answer.
        for &(key, quota, cost) in &request.buckets {
            let keys = self.quota_keys(quota, now, keys_per_quota)?;
            let state = keys.get(key).copied();
            if state.is_none() && keys.len() >= keys.max_keys() && keys.sweep(now) == 0 {
                return Err(full());
            }
            let mut state = state.unwrap_or_default();
            out.push(keys.algorithm().check(&mut state, now, cost)?);
        }
        if out.iter().all(|d| d.allowed) {
            for (d, &(key, quota, cost)) in out.iter_mut().zip(&request.buckets) {
                let keys = self.quota_keys(quota, now, keys_per_quota)?;
                *d = keys.check(key, now, cost).map_err(keyed_error)?;
            }
        } else {
            // Not all had room: nothing is charged; the buckets that had room report a
            // rejection with no retry_after of their own, as the Redis script does.
            for (d, &(key, quota, _)) in out.iter_mut().zip(&request.buckets) {
                if d.allowed {
                    let keys = self.quota_keys(quota, now, keys_per_quota)?;
                    let state = keys.get(key).copied().unwrap_or_default();
                    let remaining = keys.algorithm().available(&state, now);
                    let reset = keys.algorithm().neutral_at(&state).saturating_sub(now);
                    *d = Decision::reject(d.capacity, remaining, Duration::ZERO, reset);
                }
            }
        }
        request.expand_in_place(out);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(n: u32) -> Quota {
        Quota::per_second(n).unwrap()
    }

    #[test]
    fn repeated_keys_merge_and_expand_in_order() {
        let limits = [
            ("a", q(5)),
            ("b", q(5)),
            ("a", q(5)),
            ("c", q(9)),
            ("b", q(5)),
        ];
        let m = Merged::new(&limits, 1).unwrap();
        let keys: Vec<_> = m.buckets.iter().map(|b| (b.0, b.2)).collect();
        assert_eq!(keys, [("a", 2), ("b", 2), ("c", 1)]);
        let mut buckets = MemoryBuckets::default();
        let d = buckets.check_all(&m, Duration::ZERO, 10).unwrap();
        assert_eq!(d.len(), 5);
        let remaining: Vec<u64> = d.iter().map(|d| d.remaining).collect();
        assert_eq!(remaining, [3, 3, 3, 8, 3]);
        #[cfg(feature = "redis")]
        assert_eq!(m.expand(&d[..3]).len(), 5);
    }

    #[test]
    fn one_bucket_is_charged_only_when_admitted() {
        let limits = [("k", q(2)), ("k", q(2))];
        let m = Merged::new(&limits, 1).unwrap();
        let mut buckets = MemoryBuckets::default();
        let d = buckets.check_all(&m, Duration::ZERO, 10).unwrap();
        assert!(d.iter().all(|d| d.allowed && d.remaining == 0));
        let d = buckets.check_all(&m, Duration::ZERO, 10).unwrap();
        assert_eq!(d.len(), 2);
        assert!(d.iter().all(|d| !d.allowed && !d.retry_after.is_zero()));
    }

    #[test]
    fn limits_are_bounded() {
        let limits = vec![("k", q(100)); MAX_LIMITS + 1];
        assert!(matches!(
            Merged::new(&limits, 1),
            Err(GateError::TooManyLimits { .. })
        ));
        let keys: Vec<String> = (0..MAX_LIMITS).map(|i| format!("k{i}")).collect();
        let limits: Vec<(&str, Quota)> = keys.iter().map(|k| (k.as_str(), q(3))).collect();
        let m = Merged::new(&limits, 1).unwrap();
        let d = MemoryBuckets::default()
            .check_all(&m, Duration::ZERO, 100)
            .unwrap();
        assert_eq!(d.len(), MAX_LIMITS);
        assert!(d.iter().all(|d| d.allowed && d.remaining == 2));
    }
}
