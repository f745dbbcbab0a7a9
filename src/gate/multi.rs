//! All-or-nothing decisions across several token buckets (layered throttling: IP + user +
//! tenant), with one meaning in both gates: the request's validation and merging, and the
//! in-memory buckets of [`MemoryGate::check_all`](crate::gate::MemoryGate::check_all).

use std::hash::BuildHasher;
use std::sync::PoisonError;
use std::time::Duration;

use foldhash::fast::RandomState;
use smallvec::SmallVec;

use crate::decision::Decision;
use crate::error::CostError;
use crate::gate::error::{GateError, check_key};
use crate::limit::{Algorithm, Keyed, KeyedError, TokenBucket};
use crate::rate::Quota;
use crate::sync::{Mutex, MutexGuard};

/// The most limits one all-or-nothing call takes.
pub(crate) const MAX_LIMITS: usize = 32;

/// The most distinct quotas the in-memory gate keeps all-or-nothing buckets for at once.
pub(crate) const MAX_QUOTAS: usize = 16;

/// A request's buckets (or limits) held inline up to 4 of them: a request of a few limits is
/// validated and merged without allocating, and stays small to move.
type Inline<T> = SmallVec<[T; 4]>;

/// A token bucket's state.
type State = <TokenBucket as Algorithm>::State;

/// A bucket of a request: its key, its quota, the cost it is charged.
pub(crate) type Bucket<'a> = (&'a str, Quota, u32);

/// A validated all-or-nothing request: each distinct key once, with the cost it is charged.
#[derive(Debug)]
pub(crate) struct Merged<'a> {
    /// The distinct keys, in order of first appearance, with their quota and total cost.
    pub(crate) buckets: Inline<Bucket<'a>>,
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
        let mut buckets: Inline<Bucket<'_>> = Inline::new();
        let mut of: Inline<u8> = Inline::new();
        for &(key, quota) in limits {
            check_key(key)?;
            match buckets.iter().position(|b| b.0 == key) {
                Some(i) if buckets[i].1 != quota => {
                    return Err(GateError::ConflictingQuotas {
                        key: key.to_owned(),
                    });
                }
                Some(i) => {
                    // A total past u32::MAX is past every burst, u32::MAX included: refused
                    // as a cost that can never pass (reported saturated, as `u32::MAX`).
                    let past = CostError::ExceedsCapacity {
                        cost: u32::MAX,
                        capacity: u64::from(quota.burst_size()),
                    };
                    buckets[i].2 = buckets[i].2.checked_add(cost).ok_or(past)?;
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

    /// One limit validated as [`Merged::new`] validates it, as its one bucket: no merging
    /// to do, nothing to move.
    ///
    /// # Errors
    ///
    /// [`GateError::Cost`] (a cost of zero or above the quota's burst),
    /// [`GateError::InvalidKey`].
    pub(crate) fn one(key: &'a str, quota: Quota, cost: u32) -> Result<Bucket<'a>, GateError> {
        if cost == 0 {
            return Err(CostError::Zero.into());
        }
        check_key(key)?;
        CostError::check(cost, u64::from(quota.burst_size()))?;
        Ok((key, quota, cost))
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
    keys: Keyed<String, TokenBucket, RandomState>,
    /// No registration holds the quota any more (the last layer using it was dropped):
    /// its buckets are evicted at the next sweep, busy or not.
    released: bool,
}

/// One shard of the in-memory token buckets of all-or-nothing calls: one [`Keyed`] map per
/// quota (at most [`MAX_QUOTAS`], found by a scan: cheaper than hashing a quota). The
/// shard's room for keys (`max_keys`) is shared by all its quotas: one quota may use all of
/// it. A quota whose registration was released gives its place and its keys' room back at
/// the next sweep.
#[derive(Debug, Default)]
pub(crate) struct MemoryBuckets {
    by_quota: Vec<QuotaKeys>,
    /// The latest time keys were evicted from a quota's map that was dropped since: every
    /// map made afterwards decides new keys no earlier (one may be a key evicted then, its
    /// quota's map made again), as the dropped map would have.
    swept_at: Duration,
}

impl MemoryBuckets {
    /// Keys held, over every quota.
    fn len(&self) -> usize {
        self.by_quota.iter().map(|q| q.keys.len()).sum()
    }

    /// Evict the keys back to neutral in every quota, the quotas left without a key, and
    /// the released quotas with all their keys; returns how many keys were evicted.
    fn sweep(&mut self, now: Duration) -> usize {
        let mut evicted = 0;
        let mut swept_at = self.swept_at;
        self.by_quota.retain_mut(|q| {
            if q.released {
                if !q.keys.is_empty() {
                    evicted += q.keys.len();
                    swept_at = swept_at.max(now);
                }
                swept_at = swept_at.max(q.keys.swept_at());
                return false;
            }
            evicted += q.keys.sweep(now);
            if q.keys.is_empty() {
                // Its record of when it evicted goes with it: kept for the shard.
                swept_at = swept_at.max(q.keys.swept_at());
                return false;
            }
            // The shard's room is shared by its quotas: the room a burst of this quota's
            // keys took goes back, or the maps would hold the room of each one's largest
            // burst (up to 16 times the shard's).
            q.keys.shrink();
            true
        });
        self.swept_at = swept_at;
        evicted
    }

    /// Mark the buckets of `quota`, if held, as released (or held again).
    fn set_released(&mut self, quota: Quota, released: bool) {
        if let Some(q) = self.by_quota.iter_mut().find(|q| q.quota == quota) {
            q.released = released;
        }
    }

    /// The map of `quota`, made when it is not held (evicting the quotas with no key left
    /// if [`MAX_QUOTAS`] are held). Room for `key` (whose hash by the gate's hasher is
    /// `hash`) is made too: when the shard holds
    /// `room.per_shard` keys and `key` is not one of them, neutral keys are evicted first.
    ///
    /// # Errors
    ///
    /// [`GateError::KeyspaceFull`] (with the gate's figure) when there is no room for a new
    /// key or a new quota.
    fn room(
        &mut self,
        (key, hash): (&str, u64),
        quota: Quota,
        now: Duration,
        room: &Room<'_>,
    ) -> Result<&mut Keyed<String, TokenBucket, RandomState>, GateError> {
        let at = match self.by_quota.iter().position(|q| q.quota == quota) {
            Some(at) => at,
            None => {
                if self.by_quota.len() >= MAX_QUOTAS {
                    self.sweep(now);
                }
                if self.by_quota.len() >= MAX_QUOTAS {
                    return Err(room.full());
                }
                self.add(quota, room)?
            }
        };
        if self.len() >= room.per_shard && self.by_quota[at].keys.get_hashed(hash, key).is_none() {
            // A key its map found going neutral soonest, if one is due, without a scan.
            if self
                .by_quota
                .iter_mut()
                .any(|q| q.keys.evict_soonest(now) > 0)
            {
                return Ok(&mut self.by_quota[at].keys);
            }
            self.sweep(now);
            // The sweep may have dropped this quota's map (empty): find or make it again.
            let at = match self.by_quota.iter().position(|q| q.quota == quota) {
                Some(at) => at,
                None => self.add(quota, room)?,
            };
            if self.len() >= room.per_shard {
                return Err(room.full());
            }
            return Ok(&mut self.by_quota[at].keys);
        }
        Ok(&mut self.by_quota[at].keys)
    }

    /// Put `key` of `quota` back to `state` (forget it when `None`): undoes a charge.
    fn restore(&mut self, (key, hash): (&str, u64), quota: Quota, state: Option<State>) {
        if let Some(q) = self.by_quota.iter_mut().find(|q| q.quota == quota) {
            q.keys.restore_hashed(hash, key, state);
        }
    }

    /// A new, empty map for `quota`, deciding new keys no earlier than the shard's last
    /// eviction with a dropped map; its index.
    fn add(&mut self, quota: Quota, room: &Room<'_>) -> Result<usize, GateError> {
        let mut keys =
            Keyed::with_hasher(TokenBucket::new(quota), room.per_shard, room.hasher.clone())
                .map_err(|_| room.full())?;
        keys.swept_no_earlier_than(self.swept_at);
        self.by_quota.push(QuotaKeys {
            quota,
            keys,
            released: false,
        });
        Ok(self.by_quota.len() - 1)
    }
}

/// What a shard needs to make room: its size, the gate's hasher, and the gate's whole
/// figure for [`GateError::KeyspaceFull`].
struct Room<'a> {
    per_shard: usize,
    max_keys: usize,
    hasher: &'a RandomState,
}

impl Room<'_> {
    fn full(&self) -> GateError {
        GateError::KeyspaceFull {
            max_keys: self.max_keys,
        }
    }
}

/// The locks of one request's shards, by shard index (at most 32 shards).
type Guards<'a> = [Option<MutexGuard<'a, MemoryBuckets>>; 32];

/// The locked shard `i`.
fn locked<'a>(guards: &'a mut Guards<'_>, i: u8) -> &'a mut MemoryBuckets {
    guards[usize::from(i)]
        .as_deref_mut()
        .expect("every shard of the request is locked")
}

/// The in-memory token buckets of all-or-nothing calls
/// ([`MemoryGate::check_all`](crate::gate::MemoryGate::check_all)), sharded by key so
/// that requests on different keys rarely wait for each other; each shard holds at most
/// `max_keys / shards` keys over every quota. Each key of a request is hashed once, by the
/// gate's hasher: the hash picks its shard and finds it in the shard's map.
#[derive(Debug)]
pub(crate) struct ShardedBuckets {
    shards: Box<[Mutex<MemoryBuckets>]>,
    per_shard: usize,
    hasher: RandomState,
}

impl ShardedBuckets {
    /// `shards` shards (at most 32) of `per_shard` keys each, keys hashed by `hasher`.
    pub(crate) fn new(shards: usize, per_shard: usize, hasher: RandomState) -> ShardedBuckets {
        debug_assert!(shards <= 32, "a shard set is a u32 mask");
        ShardedBuckets {
            shards: (0..shards).map(|_| Mutex::default()).collect(),
            per_shard,
            hasher,
        }
    }

    fn lock(&self, i: usize) -> MutexGuard<'_, MemoryBuckets> {
        self.shards[i]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn room(&self, max_keys: usize) -> Room<'_> {
        Room {
            per_shard: self.per_shard,
            max_keys,
            hasher: &self.hasher,
        }
    }

    /// One bucket decided at `now`: deciding it is all or nothing already (a rejection
    /// charges nothing; a new key at a full shard is refused before it is charged). The
    /// caller has validated the key and the cost (as [`Merged::new`] does). `shard_of` maps
    /// a key's hash to its shard.
    ///
    /// # Errors
    ///
    /// [`GateError::KeyspaceFull`], with the gate's whole figure `max_keys`.
    #[inline(always)]
    pub(crate) fn check_one(
        &self,
        (key, quota, cost): Bucket<'_>,
        shard_of: impl Fn(u64) -> usize,
        now: Duration,
        max_keys: usize,
    ) -> Result<Decision, GateError> {
        let room = self.room(max_keys);
        let hash = self.hasher.hash_one(key);
        let mut shard = self.lock(shard_of(hash));
        let keys = shard.room((key, hash), quota, now, &room)?;
        keys.check_hashed(hash, key, now, cost)
            .map_err(|e| match e {
                KeyedError::KeyspaceFull { .. } => room.full(),
                e => e.into(),
            })
    }

    /// Decide `request` at `now`, all or nothing, into `out` (cleared first; unspecified on
    /// an error): one decision per limit of the request, in order. `shard_of` maps a key's
    /// hash to its shard. A request on one key is [`check_one`](ShardedBuckets::check_one);
    /// on several, the shards involved are locked in ascending order (no deadlock), each
    /// bucket is decided on a copy of its state, and only if all have room are they
    /// charged.
    ///
    /// # Errors
    ///
    /// [`GateError::KeyspaceFull`] when a new key or quota finds no room (nothing is
    /// charged then), with the gate's whole figure `max_keys`.
    pub(crate) fn check_all_into(
        &self,
        request: &Merged<'_>,
        shard_of: impl Fn(u64) -> usize,
        now: Duration,
        max_keys: usize,
        out: &mut Vec<Decision>,
    ) -> Result<(), GateError> {
        out.clear();
        if let [bucket] = *request.buckets {
            out.push(self.check_one(bucket, shard_of, now, max_keys)?);
            request.expand_in_place(out);
            return Ok(());
        }
        let room = self.room(max_keys);
        let keyed_error = |e| match e {
            KeyedError::KeyspaceFull { .. } => room.full(),
            e => e.into(),
        };
        // Each bucket's key hashed once, which picks its shard; the shards locked in
        // ascending order. No allocation: a request has at most `MAX_LIMITS` buckets over
        // at most 32 shards.
        let mut shard = [0u8; MAX_LIMITS];
        let mut hash = [0u64; MAX_LIMITS];
        let mut wanted = 0u32;
        for ((s, h), &(key, _, _)) in shard.iter_mut().zip(&mut hash).zip(&request.buckets) {
            *h = self.hasher.hash_one(key);
            *s = shard_of(*h) as u8;
            wanted |= 1 << *s;
        }
        let mut guards: Guards<'_> = std::array::from_fn(|_| None);
        while wanted != 0 {
            let i = wanted.trailing_zeros() as usize;
            wanted &= wanted - 1;
            guards[i] = Some(self.lock(i));
        }
        // Room first, then each bucket decided on a copy of its state: pure, so deciding
        // again for real below gives the same answer.
        let mut before: [Option<State>; MAX_LIMITS] = [None; MAX_LIMITS];
        for (((&s, &h), &(key, quota, cost)), held) in shard
            .iter()
            .zip(&hash)
            .zip(&request.buckets)
            .zip(&mut before)
        {
            let keys = locked(&mut guards, s).room((key, h), quota, now, &room)?;
            *held = keys.get_hashed(h, key).copied();
            let mut state = held.unwrap_or_default();
            out.push(keys.algorithm().check(&mut state, now, cost)?);
        }
        let buckets = shard.iter().zip(&hash).zip(&request.buckets);
        if out.iter().all(|d| d.allowed) {
            for (j, (d, ((&s, &h), &(key, quota, cost)))) in out.iter_mut().zip(buckets).enumerate()
            {
                let shard_j = locked(&mut guards, s);
                let charged = shard_j
                    .room((key, h), quota, now, &room)
                    .and_then(|keys| keys.check_hashed(h, key, now, cost).map_err(keyed_error));
                match charged {
                    Ok(decided) => *d = decided,
                    Err(e) => {
                        // No room for this key after all (new keys of this request share a
                        // shard that had room for fewer): undo the charges made so far, so
                        // nothing is charged on an error.
                        for (i, &(key, quota, _)) in request.buckets[..j].iter().enumerate() {
                            let held = (key, hash[i]);
                            locked(&mut guards, shard[i]).restore(held, quota, before[i]);
                        }
                        return Err(e);
                    }
                }
            }
        } else {
            // Not all had room: nothing is charged; the buckets that had room report a
            // rejection with no retry_after of their own, as the Redis script does.
            for (d, ((&s, &h), &(key, quota, _))) in out.iter_mut().zip(buckets) {
                if d.allowed {
                    let keys = locked(&mut guards, s).room((key, h), quota, now, &room)?;
                    let state = keys.get_hashed(h, key).copied().unwrap_or_default();
                    let remaining = keys.algorithm().available(&state, now);
                    let reset = keys.algorithm().neutral_at(&state).saturating_sub(now);
                    *d = Decision::reject(d.capacity, remaining, Duration::ZERO, reset);
                }
            }
        }
        request.expand_in_place(out);
        Ok(())
    }

    /// Mark the buckets of `quota` in every shard as released (no registration holds the
    /// quota any more: they are evicted at each shard's next sweep, busy or not), or as
    /// held again (registered before that sweep: they are kept). Called under the quota
    /// registry's lock, so marks follow registrations in order; the shards are locked one
    /// at a time.
    pub(crate) fn set_released(&self, quota: Quota, released: bool) {
        for i in 0..self.shards.len() {
            self.lock(i).set_released(quota, released);
        }
    }

    /// Keys held over every shard and quota.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        (0..self.shards.len()).map(|i| self.lock(i).len()).sum()
    }

    /// The room for keys the maps of every shard hold, used or not.
    #[cfg(test)]
    pub(crate) fn room_held(&self) -> usize {
        self.sum_over_maps(Keyed::capacity)
    }

    /// The room for notes of keys going neutral soonest the maps of every shard hold.
    #[cfg(test)]
    pub(crate) fn noted_room_held(&self) -> usize {
        self.sum_over_maps(Keyed::noted_capacity)
    }

    /// `of` each map of every shard, summed.
    #[cfg(test)]
    fn sum_over_maps(
        &self,
        of: impl Fn(&Keyed<String, TokenBucket, RandomState>) -> usize,
    ) -> usize {
        (0..self.shards.len())
            .map(|i| {
                self.lock(i)
                    .by_quota
                    .iter()
                    .map(|q| of(&q.keys))
                    .sum::<usize>()
            })
            .sum()
    }

    /// The most quotas one shard holds buckets for.
    #[cfg(test)]
    pub(crate) fn most_quotas_in_a_shard(&self) -> usize {
        (0..self.shards.len())
            .map(|i| self.lock(i).by_quota.len())
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(n: u32) -> Quota {
        Quota::per_second(n).unwrap()
    }

    /// A test shard function: four shards by hash.
    fn shard_of(hash: u64) -> usize {
        // High bits, as the gate's: the map places keys by the low ones.
        ((hash >> 40) % 4) as usize
    }

    fn sharded(shards: usize, per_shard: usize) -> ShardedBuckets {
        ShardedBuckets::new(shards, per_shard, RandomState::default())
    }

    fn check(
        buckets: &ShardedBuckets,
        m: &Merged<'_>,
        now: Duration,
    ) -> Result<Vec<Decision>, GateError> {
        let mut out = Vec::new();
        let max_keys = buckets.per_shard * buckets.shards.len();
        buckets.check_all_into(m, shard_of, now, max_keys, &mut out)?;
        Ok(out)
    }

    #[test]
    fn every_quota_may_use_the_whole_shard_and_keys_are_counted_over_all_quotas() {
        // One shard of 10 keys: one quota may hold all ten (each quota got a 16th before).
        let buckets = sharded(1, 10);
        let shard_of = |_: u64| 0;
        let keys: Vec<String> = (0..11).map(|i| format!("k{i}")).collect();
        let mut out = Vec::new();
        for k in &keys[..10] {
            let m = Merged::new(&[(k.as_str(), q(1))], 1).unwrap();
            buckets
                .check_all_into(&m, shard_of, Duration::ZERO, 10, &mut out)
                .unwrap();
        }
        assert_eq!(buckets.len(), 10);
        // The 11th key, on another quota, finds the shard full (nothing back to neutral).
        let m = Merged::new(&[(keys[10].as_str(), q(2))], 1).unwrap();
        let full = buckets.check_all_into(&m, shard_of, Duration::ZERO, 10, &mut out);
        assert!(matches!(
            full,
            Err(GateError::KeyspaceFull { max_keys: 10 })
        ));
        // A second later every key is back to neutral: room is made by evicting them.
        buckets
            .check_all_into(&m, shard_of, Duration::from_secs(1), 10, &mut out)
            .unwrap();
        assert!(out[0].allowed);
        assert_eq!(buckets.len(), 1);
    }

    #[test]
    fn a_request_that_finds_no_room_for_its_second_new_quota_charges_nothing() {
        // One shard holding 15 quotas with a key each, busy for an hour: room for one more
        // quota, and the request brings two.
        let buckets = sharded(1, 100);
        let shard_of = |_: u64| 0;
        let hourly = |n: u32| {
            let rate = crate::rate::Rate::per(n, Duration::from_secs(3_600)).unwrap();
            Quota::new(rate, 1).unwrap()
        };
        let keys: Vec<String> = (0..17).map(|i| format!("k{i}")).collect();
        let mut out = Vec::new();
        for (i, k) in keys[..15].iter().enumerate() {
            let m = Merged::new(&[(k.as_str(), hourly(i as u32 + 1))], 1).unwrap();
            buckets
                .check_all_into(&m, shard_of, Duration::ZERO, 100, &mut out)
                .unwrap();
        }
        let limits = [
            (keys[15].as_str(), hourly(16)),
            (keys[16].as_str(), hourly(17)),
        ];
        let m = Merged::new(&limits, 1).unwrap();
        let full = buckets.check_all_into(&m, shard_of, Duration::ZERO, 100, &mut out);
        assert!(matches!(full, Err(GateError::KeyspaceFull { .. })));
        assert_eq!(buckets.len(), 15, "a key of the failed request was charged");
    }

    /// A key evicted by a sweep is decided no earlier than that sweep, as `Keyed` decides a
    /// key it evicted, even when the sweep also dropped its quota's map (left with no key):
    /// a caller that read the clock before the sweep would otherwise get a fresh bucket at
    /// that earlier time, and a burst the key had not earned back yet.
    #[test]
    fn a_key_evicted_with_its_quotas_map_is_decided_no_earlier_than_that_sweep() {
        // One shard of 3 keys; 1 a second, bursts of 1.
        let buckets = sharded(1, 3);
        let shard_of = |_: u64| 0;
        let hourly = Quota::new(
            crate::rate::Rate::per(1, Duration::from_secs(3_600)).unwrap(),
            1,
        )
        .unwrap();
        let ms = Duration::from_millis;
        let mut out = Vec::new();
        let mut decide = |key: &str, quota: Quota, now: Duration| {
            let m = Merged::new(&[(key, quota)], 1).unwrap();
            buckets
                .check_all_into(&m, shard_of, now, 3, &mut out)
                .unwrap();
            out[0]
        };
        // "a" and "b" full again at 1 s; "c" busy for an hour: the shard is full.
        assert!(decide("a", q(1), ms(0)).allowed);
        assert!(decide("b", q(1), ms(0)).allowed);
        assert!(decide("c", hourly, ms(0)).allowed);
        // At 1 s a new key sweeps the shard: "a" and "b" go, and their quota's map with them.
        assert!(decide("d", hourly, ms(1_000)).allowed);
        // A caller that read the clock at 500 ms, before that sweep: "a" is decided as at
        // 1 s (its bucket then full again), so its next token comes at 2 s, not at 1.5 s.
        assert!(decide("a", q(1), ms(500)).allowed);
        let d = decide("a", q(1), ms(1_500));
        assert!(
            !d.allowed,
            "a second token within 500 ms at 1 a second, bursts of 1: {d:?}"
        );
    }

    /// A shard of 1 024 keys through which each of 16 quotas in turn sends a burst of
    /// `keys` keys and one key busy for 1 000 s (which keeps its quota's map): quota `i`'s
    /// `j`-th key (the busy one first) is charged at `at(i, j)`, for a second.
    fn a_burst_of_each_quota_in_turn(
        keys: usize,
        at: impl Fn(u32, usize) -> Duration,
    ) -> ShardedBuckets {
        const ROOM: usize = 1_024;
        let buckets = sharded(1, ROOM);
        let shard_of = |_: u64| 0;
        let mut out = Vec::new();
        for i in 0..MAX_QUOTAS as u32 {
            // 1 a second, bursts of 1 000 and more: a key charged 1 000 is busy for 1 000 s,
            // one charged 1 for a second.
            let rate = crate::rate::Rate::per_second(1).unwrap();
            let quota = Quota::new(rate, 1_000 + i).unwrap();
            let busy = format!("busy{i}");
            let keys =
                std::iter::once((busy, 1_000)).chain((0..keys).map(|j| (format!("q{i}-k{j}"), 1)));
            for (j, (key, cost)) in keys.enumerate() {
                let now = at(i, j);
                let m = Merged::new(&[(key.as_str(), quota)], cost).unwrap();
                buckets
                    .check_all_into(&m, shard_of, now, ROOM, &mut out)
                    .unwrap();
                assert!(out[0].allowed, "{key} at {now:?}");
            }
        }
        buckets
    }

    /// The room a burst of a quota's keys took in its map is given back once a sweep has
    /// evicted them: the shard's bound on keys is over every quota together, but each
    /// quota's map kept the room of its largest burst, so 16 quotas whose bursts each filled
    /// the shard in turn held room for 16 shards' worth of keys.
    #[test]
    fn the_room_a_burst_took_is_given_back_once_its_keys_are_evicted() {
        // Each burst at once.
        let buckets =
            a_burst_of_each_quota_in_turn(1_000, |i, _| Duration::from_secs(2 * u64::from(i)));
        let room = buckets.room_held();
        assert!(
            room <= 2 * 1_024,
            "room for {room} keys held, for a shard of 1 024"
        );
    }

    /// The notes a map keeps of the keys going neutral soonest (an eighth of those it held
    /// at its last scan) are given back with its room: 16 quotas whose keys each filled
    /// the shard in turn, going neutral one at a time, kept room for an eighth of the
    /// shard's keys each, two shards' worth of notes.
    #[test]
    fn the_notes_a_burst_took_are_given_back_once_its_keys_are_evicted() {
        // A key a millisecond: they go neutral one at a time.
        let buckets = a_burst_of_each_quota_in_turn(2_048, |i, j| {
            Duration::from_millis(10_000 * u64::from(i) + j as u64)
        });
        let noted = buckets.noted_room_held();
        assert!(
            noted <= 2 * 1_024 / 8,
            "room for {noted} notes held, for a shard of 1 024 keys"
        );
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
        let d = check(&sharded(4, 10), &m, Duration::ZERO).unwrap();
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
        let buckets = sharded(4, 10);
        let d = check(&buckets, &m, Duration::ZERO).unwrap();
        assert!(d.iter().all(|d| d.allowed && d.remaining == 0));
        let d = check(&buckets, &m, Duration::ZERO).unwrap();
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
        let d = check(&sharded(4, 100), &m, Duration::ZERO).unwrap();
        assert_eq!(d.len(), MAX_LIMITS);
        assert!(d.iter().all(|d| d.allowed && d.remaining == 2));
    }

    /// Every bucket a shard holds, by quota and key, with its state.
    fn snapshot(buckets: &ShardedBuckets) -> Vec<(Quota, String, State)> {
        let shard = buckets.lock(0);
        shard
            .by_quota
            .iter()
            .flat_map(|q| {
                q.keys
                    .map_iter()
                    .map(move |(k, s)| (q.quota, k.clone(), *s))
            })
            .collect()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// `check_all` on one small shard over any requests (up to 3 limits on 10 keys of
        /// 3 quotas, times out of order): a request admitted charges every bucket, one
        /// refused or rejected changes none, and no busy bucket is ever evicted (nothing is
        /// released here), whatever room the request's new keys needed.
        #[test]
        fn check_all_is_all_or_nothing_and_never_evicts_a_busy_bucket(
            steps in proptest::collection::vec(
                (
                    proptest::collection::vec((0u8..10, 0usize..3), 1..=3),
                    1u32..=2,
                    0u64..=300,
                    0u64..=100,
                ),
                1..200,
            ),
            per_shard in 1usize..=8,
        ) {
            let quotas = [
                Quota::new(crate::rate::Rate::per(2, Duration::from_millis(100)).unwrap(), 3).unwrap(),
                Quota::new(crate::rate::Rate::per(1, Duration::from_millis(300)).unwrap(), 2).unwrap(),
                Quota::new(crate::rate::Rate::per(5, Duration::from_millis(50)).unwrap(), 5).unwrap(),
            ];
            let buckets = sharded(1, per_shard);
            let mut out = Vec::new();
            let mut clock = 0u64;
            for (limits, cost, gap, behind) in steps {
                clock += gap;
                let now = Duration::from_millis(clock.saturating_sub(behind));
                let names: Vec<String> = limits.iter().map(|(k, _)| format!("k{k}")).collect();
                let limits: Vec<(&str, Quota)> = names
                    .iter()
                    .zip(&limits)
                    .map(|(n, &(k, q))| (n.as_str(), quotas[(usize::from(k) + q) % 3]))
                    .collect();
                let Ok(m) = Merged::new(&limits, cost) else { continue };
                let before = snapshot(&buckets);
                let late = {
                    let shard = buckets.lock(0);
                    shard.by_quota.iter().map(|q| q.keys.swept_at()).fold(shard.swept_at, Duration::max)
                };
                let got = buckets.check_all_into(&m, |_| 0, now, per_shard, &mut out);
                let after = snapshot(&buckets);
                proptest::prop_assert!(after.len() <= per_shard);
                let find = |set: &[(Quota, String, State)], q: Quota, k: &str| {
                    set.iter().find(|(bq, bk, _)| *bq == q && bk == k).map(|b| b.2)
                };
                let tb = |q: Quota| TokenBucket::new(q);
                let admitted = matches!(got, Ok(())) && out.iter().all(|d| d.allowed);
                if let Err(GateError::KeyspaceFull { .. }) = got {
                    // Refused only when the buckets busy at `now` that the request does not
                    // name, and all it names, are more than the shard holds.
                    let named = |q: Quota, k: &str| m.buckets.iter().any(|b| b.0 == k && b.1 == q);
                    let busy_others = before
                        .iter()
                        .filter(|(q, k, s)| !named(*q, k) && !tb(*q).is_neutral(s, now))
                        .count();
                    proptest::prop_assert!(
                        busy_others + m.buckets.len() > per_shard,
                        "refused with room: {} busy others, {} named, {} held",
                        busy_others,
                        m.buckets.len(),
                        before.len()
                    );
                }
                for &(key, quota, _) in &m.buckets {
                    let was = find(&before, quota, key);
                    let is = find(&after, quota, key);
                    if admitted {
                        let is = is.expect("an admitted bucket is held");
                        proptest::prop_assert!(
                            !tb(quota).is_neutral(&is, now),
                            "{} admitted but not charged", key
                        );
                    } else if let Some(was) = was {
                        // Unchanged, or evicted as neutral.
                        proptest::prop_assert!(
                            is == Some(was) || (is.is_none() && tb(quota).is_neutral(&was, now.max(late))),
                            "{} changed by a request refused ({:?}): {:?} to {:?}", key, got, was, is
                        );
                    } else {
                        proptest::prop_assert!(
                            is.is_none_or(|s| tb(quota).is_neutral(&s, now.max(late))),
                            "{} charged by a request refused ({:?})", key, got
                        );
                    }
                }
                for (quota, key, was) in &before {
                    if m.buckets.iter().any(|b| b.0 == key && b.1 == *quota) {
                        continue;
                    }
                    let is = find(&after, *quota, key);
                    proptest::prop_assert!(
                        is == Some(*was) || (is.is_none() && tb(*quota).is_neutral(was, now.max(late))),
                        "{} busy evicted, or changed, by a request on others", key
                    );
                }
            }
        }
    }
}
