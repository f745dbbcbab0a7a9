//! `Keyed`: one limiter per key, in bounded memory.

use std::borrow::Borrow;
use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::{BuildHasher, Hash};
use std::time::Duration;

use hashbrown::HashTable;

use crate::decision::Decision;
use crate::error::ConfigError;
use crate::limit::limiter::neutral_by;
use crate::limit::{Algorithm, KeyedError};

/// Per-key limits (per user, per tenant, per IP) under one algorithm, in bounded memory.
///
/// The map holds one [`Algorithm::State`] per key (16 bytes for a token bucket) and the
/// algorithm once. A key whose state is back to neutral (everything it consumed has been
/// restored) behaves exactly like a new key from then on, so it can be forgotten without
/// changing any decision made at that time or later: that is how idle keys are evicted.
/// A `now` from before a sweep that evicted (a thread that read the clock before another
/// swept) finds a key not held as a new key at the sweep's time, the latest it may have
/// been evicted at, its waits counted from the `now` given: never as a fresh state at the
/// earlier `now`, which would hand its burst out again. Kept, the key might have decided
/// that earlier `now` more strictly still (see [`Algorithm`] on time going backwards: a
/// token bucket's refill up to the sweep had not come yet).
///
/// # Memory bound and the full-map policy
///
/// At most `max_keys` keys are held. When a *new* key arrives at a full map, a neutral key
/// is evicted to make room (one noted by the last sweep, or else every neutral key in one
/// sweep, as below); if none is neutral, the request is refused with
/// [`KeyedError::KeyspaceFull`] and nothing is inserted. Existing keys are always decided
/// normally. This policy never over-admits (evicting a busy key would reset its limit). A
/// sweep that scans the map remembers when the keys it keeps go neutral: the eighth of them
/// that go soonest one by one (their hashes, 24 bytes each), the rest by the earliest time.
/// A new key at a full map then evicts the next of those that is due, one hash lookup, and
/// scans again only when none is and the rest may be; so a flood of new keys costs a lookup
/// each while every held key is busy, and when keys go neutral one at a time under a
/// steady flood of distinct keys (more than the map holds at once), one scan of the map (in
/// a [`MemoryGate`](crate::gate::MemoryGate), of the key's shard, under its lock) for
/// every eighth of it that goes. Call [`Keyed::sweep`] from a timer to release idle keys
/// early.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use flowgate::limit::{Keyed, KeyedError, TokenBucket};
/// use flowgate::Quota;
///
/// let mut per_user = Keyed::new(TokenBucket::new(Quota::per_second(1)?), 2)?;
/// let t = Duration::ZERO;
/// assert!(per_user.check("alice", t, 1)?.allowed);
/// assert!(per_user.check("bob", t, 1)?.allowed);
/// assert!(!per_user.check("alice", t, 1)?.allowed);
/// assert_eq!(per_user.check("carol", t, 1), Err(KeyedError::KeyspaceFull { max_keys: 2 }));
/// // One second later alice and bob are neutral again and make room.
/// assert!(per_user.check("carol", Duration::from_secs(1), 1)?.allowed);
/// assert_eq!(per_user.len(), 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Keyed<K, A: Algorithm, S = RandomState> {
    /// Each key with its state, placed by `hasher`'s hash of the key (so a caller that has
    /// hashed the key already does not hash it again: [`Keyed::check_hashed`]).
    map: HashTable<(K, A::State)>,
    hasher: S,
    algorithm: A,
    max_keys: usize,
    /// No key but those in `soonest` goes neutral before this time.
    next_sweep: Duration,
    /// The keys the last whole-map sweep found going neutral soonest, as (the time each
    /// goes neutral, its hash), the soonest last: a new key meeting a full map evicts the
    /// next of them that is due instead of scanning the map. At most an eighth of the keys
    /// held then (rounded up).
    soonest: Vec<(Duration, u64)>,
    /// The latest time a sweep evicted at: a key not held may have been evicted then, back
    /// to neutral then and not before, so a new key is decided no earlier.
    swept_at: Duration,
    /// How many sweeps scanned the whole map (tests).
    #[cfg(test)]
    scans: usize,
}

impl<K: Hash + Eq, A: Algorithm> Keyed<K, A> {
    /// A map of keys limited by `algorithm`, holding at most `max_keys` keys.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `keyed.max_keys` if it is zero.
    pub fn new(algorithm: A, max_keys: usize) -> Result<Self, ConfigError> {
        Self::with_hasher(algorithm, max_keys, RandomState::new())
    }
}

impl<K: Hash + Eq, A: Algorithm, S: BuildHasher> Keyed<K, A, S> {
    /// As [`Keyed::new`], with a custom hasher.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `keyed.max_keys` if it is zero.
    pub fn with_hasher(algorithm: A, max_keys: usize, hasher: S) -> Result<Self, ConfigError> {
        if max_keys == 0 {
            return Err(ConfigError::zero("keyed.max_keys"));
        }
        Ok(Keyed {
            map: HashTable::new(),
            hasher,
            algorithm,
            max_keys,
            next_sweep: Duration::ZERO,
            soonest: Vec::new(),
            swept_at: Duration::ZERO,
            #[cfg(test)]
            scans: 0,
        })
    }

    /// Decide a request of `cost` for `key` at `now`.
    ///
    /// # Errors
    ///
    /// [`KeyedError::Cost`] with the error of [`Algorithm::check`], and
    /// [`KeyedError::KeyspaceFull`] for a new key when the map is full and no key can be
    /// evicted.
    #[inline]
    pub fn check<Q>(&mut self, key: &Q, now: Duration, cost: u32) -> Result<Decision, KeyedError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let hash = self.hasher.hash_one(key);
        self.check_hashed(hash, key, now, cost)
    }

    /// [`check`](Keyed::check) with `hash`, this map's hash of `key` (its hasher's
    /// `hash_one(key)`), already computed: one hash per decision for a caller that also
    /// shards by it. Always inlined: returned through memory, the decision was read back
    /// wider than it was written (a store-forwarding stall on every call).
    #[inline(always)]
    pub(crate) fn check_hashed<Q>(
        &mut self,
        hash: u64,
        key: &Q,
        now: Duration,
        cost: u32,
    ) -> Result<Decision, KeyedError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        if let Some((_, state)) = self.map.find_mut(hash, |(k, _)| k.borrow() == key) {
            return Ok(self.algorithm.check(state, now, cost)?);
        }
        self.check_new(hash, key, now, cost)
    }

    /// The first request of a key not held: decide it on a fresh state, then make room.
    #[cold]
    #[inline(never)]
    fn check_new<Q>(
        &mut self,
        hash: u64,
        key: &Q,
        now: Duration,
        cost: u32,
    ) -> Result<Decision, KeyedError>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        // Decided no earlier than the last eviction: the key may have been one of those
        // evicted, and its own state would have decided an earlier time no more leniently
        // than the sweep's (a fresh state at that time would hand its burst out again). Its
        // waits still count from the caller's `now`.
        let late = self.swept_at.saturating_sub(now);
        let now = now.max(self.swept_at);
        let mut state = A::State::default();
        let mut decision = self.algorithm.check(&mut state, now, cost)?;
        if !late.is_zero() {
            decision.reset_after = decision.reset_after.saturating_add(late);
            if !decision.retry_after.is_zero() {
                decision.retry_after = decision.retry_after.saturating_add(late);
            }
        }
        if self.map.len() >= self.max_keys && self.make_room(now) == 0 {
            return Err(KeyedError::KeyspaceFull {
                max_keys: self.max_keys,
            });
        }
        let neutral_at = self.algorithm.neutral_at(&state);
        if !neutral_by(neutral_at, now) {
            self.next_sweep = self.next_sweep.min(neutral_at);
            let hasher = &self.hasher;
            self.map
                .insert_unique(hash, (key.to_owned(), state), |(k, _)| hasher.hash_one(k));
        }
        Ok(decision)
    }

    /// Room for one key at a full map: evict the next of the keys the last sweep found going
    /// neutral soonest that is neutral by `now`, or, when none is, sweep the whole map;
    /// returns how many keys were evicted.
    fn make_room(&mut self, now: Duration) -> usize {
        match self.evict_soonest(now) {
            0 => self.sweep(now),
            evicted => evicted,
        }
    }

    /// Evict the next of the keys the last sweep found going neutral soonest that is
    /// neutral by `now`, without a scan; returns how many keys were evicted (0 when none of
    /// them is due: a [`sweep`](Keyed::sweep) may still find others).
    pub(crate) fn evict_soonest(&mut self, now: Duration) -> usize {
        let algorithm = &self.algorithm;
        let mut evicted = 0;
        while let Some(&(at, hash)) = self.soonest.last() {
            if !neutral_by(at, now) {
                break;
            }
            self.soonest.pop();
            // Any key neutral by `now` may go: the entries the table offers for this hash
            // (its own, and some that only look alike) are all fair game.
            while let Ok(entry) = self.map.find_entry(hash, |(_, state)| {
                neutral_by(algorithm.neutral_at(state), now)
            }) {
                entry.remove();
                evicted += 1;
            }
            // What is left under this hash (busy again since) is no longer in `soonest`.
            for (_, state) in self.map.iter_hash(hash) {
                self.next_sweep = self.next_sweep.min(algorithm.neutral_at(state));
            }
            if evicted > 0 {
                self.swept_at = self.swept_at.max(now);
                return evicted;
            }
        }
        0
    }

    /// Evict every key whose limiter is neutral at `now`; returns how many were evicted.
    ///
    /// Cheap when nothing can be evicted yet: the earliest time a key becomes neutral is
    /// remembered from the previous sweep. A sweep that scans the map also notes the eighth
    /// of the keys that go neutral soonest, so that new keys meeting a full map can evict
    /// them one at a time without another scan.
    ///
    /// `now` is on the timeline of every `check`: a key created after a sweep that evicted
    /// is decided no earlier than that sweep's `now` (it may have been one of those
    /// evicted), so a sweep at a far-future time (`Duration::MAX`, say) makes every new key
    /// wait until then.
    pub fn sweep(&mut self, now: Duration) -> usize {
        let soonest = self.soonest.last().map_or(Duration::MAX, |&(at, _)| at);
        if now < self.next_sweep.min(soonest) {
            return 0;
        }
        #[cfg(test)]
        {
            self.scans += 1;
        }
        let before = self.map.len();
        let algorithm = &self.algorithm;
        let mut held = Vec::with_capacity(before);
        self.map.retain(|(_, state)| {
            let at = algorithm.neutral_at(state);
            if neutral_by(at, now) {
                false
            } else {
                held.push(at);
                true
            }
        });
        self.soonest.clear();
        self.next_sweep = self.note_soonest(held);
        let evicted = before - self.map.len();
        if evicted > 0 {
            self.swept_at = self.swept_at.max(now);
        }
        evicted
    }

    /// Fill `soonest` with the keys that go neutral before the (n/8 + 1)-th soonest time of
    /// `held` (the times of the keys held, in any order); returns that time, before which no
    /// other key goes neutral (`Duration::MAX` when none is held).
    fn note_soonest(&mut self, mut held: Vec<Duration>) -> Duration {
        let take = held.len().div_ceil(8);
        if take == 0 || take >= held.len() {
            return held.into_iter().min().unwrap_or(Duration::MAX);
        }
        let (_, &mut threshold, _) = held.select_nth_unstable(take);
        drop(held);
        let algorithm = &self.algorithm;
        let hasher = &self.hasher;
        // At most `take` keys go neutral strictly before the threshold.
        self.soonest
            .extend(self.map.iter().filter_map(|(k, state)| {
                let at = algorithm.neutral_at(state);
                (at < threshold).then(|| (at, hasher.hash_one(k)))
            }));
        self.soonest
            .sort_unstable_by_key(|&(at, _)| std::cmp::Reverse(at));
        threshold
    }

    /// Give back the room of a map left mostly empty (by a sweep, after a burst of keys):
    /// when it holds less than a quarter of its room, keep room for twice what it holds;
    /// and the same for its notes of the keys going neutral soonest (an eighth of its keys).
    /// For a caller that holds several maps under one bound on keys, so that the room each
    /// one grew to does not add up past that bound.
    pub(crate) fn shrink(&mut self) {
        let len = self.map.len();
        if len.saturating_mul(4) < self.map.capacity() {
            let hasher = &self.hasher;
            self.map
                .shrink_to(len.saturating_mul(2), |(k, _)| hasher.hash_one(k));
        }
        let noted = len.div_ceil(8).max(self.soonest.len());
        if noted.saturating_mul(4) < self.soonest.capacity() {
            self.soonest.shrink_to(noted.saturating_mul(2));
        }
    }

    /// The state of `key`, if it is held.
    pub fn get<Q>(&self, key: &Q) -> Option<&A::State>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.get_hashed(self.hasher.hash_one(key), key)
    }

    /// [`get`](Keyed::get) with `hash`, this map's hash of `key`, already computed.
    #[inline]
    pub(crate) fn get_hashed<Q>(&self, hash: u64, key: &Q) -> Option<&A::State>
    where
        K: Borrow<Q>,
        Q: Eq + ?Sized,
    {
        self.map
            .find(hash, |(k, _)| k.borrow() == key)
            .map(|(_, state)| state)
    }

    /// Put `key`, whose hash is `hash`, back to `state`, or forget it when `state` is `None`
    /// (it was not held): undoes a decision made at the same `now`.
    pub(crate) fn restore_hashed<Q>(&mut self, hash: u64, key: &Q, state: Option<A::State>)
    where
        K: Borrow<Q>,
        Q: Eq + ?Sized,
    {
        if let Ok(entry) = self.map.find_entry(hash, |(k, _)| k.borrow() == key) {
            match state {
                Some(state) => {
                    // A sweep since may have looked only at the later state.
                    self.next_sweep = self.next_sweep.min(self.algorithm.neutral_at(&state));
                    entry.into_mut().1 = state;
                }
                None => {
                    entry.remove();
                }
            }
        }
    }

    /// The latest time a sweep of this map evicted at (zero if none has).
    pub(crate) fn swept_at(&self) -> Duration {
        self.swept_at
    }

    /// Decide new keys no earlier than `at`, as if this map had evicted at `at`: for a map
    /// that replaces one whose keys were evicted then.
    pub(crate) fn swept_no_earlier_than(&mut self, at: Duration) {
        self.swept_at = self.swept_at.max(at);
    }

    /// Forget `key` (its next request starts fresh); returns its state.
    pub fn remove<Q>(&mut self, key: &Q) -> Option<A::State>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = self.hasher.hash_one(key);
        let entry = self.map.find_entry(hash, |(k, _)| k.borrow() == key).ok()?;
        Some(entry.remove().0.1)
    }
}

impl<K, A: Algorithm, S> Keyed<K, A, S> {
    /// How many keys are held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// How many keys the map has room for before it grows (tests).
    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.map.capacity()
    }

    /// How many notes of keys going neutral soonest `soonest` has room for (tests).
    #[cfg(test)]
    pub(crate) fn noted_capacity(&self) -> usize {
        self.soonest.capacity()
    }

    /// Every key held, with its state (tests).
    #[cfg(test)]
    pub(crate) fn map_iter(&self) -> impl Iterator<Item = (&K, &A::State)> {
        self.map.iter().map(|(k, s)| (k, s))
    }

    /// The most keys this map holds.
    pub fn max_keys(&self) -> usize {
        self.max_keys
    }

    /// The algorithm every key is limited by.
    pub fn algorithm(&self) -> &A {
        &self.algorithm
    }
}

impl<K, A: Algorithm + fmt::Debug, S> fmt::Debug for Keyed<K, A, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Keyed")
            .field("algorithm", &self.algorithm)
            .field("keys", &self.map.len())
            .field("max_keys", &self.max_keys)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Quota;
    use crate::limit::TokenBucket;
    use proptest::prelude::*;

    /// A steady flood of distinct keys at a full map, the keys going neutral one at a time
    /// (each took the whole of its 1 s bucket, one a millisecond): each new key finds one
    /// key neutral. Making room must not scan the whole map for each of them.
    #[test]
    fn a_flood_of_new_keys_scans_the_map_a_bounded_number_of_times() {
        let q = Quota::per_second(1).unwrap();
        let max_keys = 1_000;
        let mut keyed = Keyed::new(TokenBucket::new(q), max_keys).unwrap();
        let ms = Duration::from_millis;
        for i in 0..5_000u64 {
            let d = keyed.check(&i, ms(i), 1).unwrap();
            assert!(d.allowed, "key {i}");
            assert!(keyed.len() <= max_keys);
        }
        assert_eq!(keyed.len(), max_keys);
        // 4 000 new keys met a full map; a scan frees the keys neutral by then and finds the
        // next ones to go: at most one scan for each eighth of the map's keys, and a few.
        assert!(
            keyed.scans <= 4_000 / (max_keys / 8) + 4,
            "{} scans",
            keyed.scans
        );
    }

    /// A hasher that sends keys to a few hashes only (`key % buckets`), so that keys share
    /// their whole hash.
    #[derive(Clone, Copy)]
    struct FewHashes(u64);

    impl BuildHasher for FewHashes {
        type Hasher = FewHasher;
        fn build_hasher(&self) -> FewHasher {
            FewHasher(0, self.0)
        }
    }

    struct FewHasher(u64, u64);

    impl std::hash::Hasher for FewHasher {
        fn finish(&self) -> u64 {
            // Spread over the table's tag bits too, so equal hashes are equal everywhere.
            (self.0 % self.1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        }
        fn write(&mut self, bytes: &[u8]) {
            for &b in bytes {
                self.0 = self.0.wrapping_mul(31).wrapping_add(u64::from(b));
            }
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// A request of `cost` for a key, at the time so far less up to `behind` ms (a
        /// thread that read the clock before another's sweep).
        Check(u16, u64, u32),
        /// A charge undone after another key was decided (a `check_all` refund, after
        /// the room a later key needed was made).
        Refund(u16, u16, u64, u32),
        Sweep(u64),
        Remove(u16),
        /// Time passes (ms).
        Wait(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            8 => (0u16..64, 0u64..=100, 1u32..=3).prop_map(|(k, b, c)| Op::Check(k, b, c)),
            2 => (0u16..64, 0u16..64, 0u64..=100, 1u32..=3)
                .prop_map(|(k, o, b, c)| Op::Refund(k, o, b, c)),
            1 => (0u64..=100).prop_map(Op::Sweep),
            1 => (0u16..64).prop_map(Op::Remove),
            4 => (0u64..=200).prop_map(Op::Wait),
        ]
    }

    /// What `next_sweep` and `soonest` promise: a key goes neutral no earlier than
    /// `next_sweep`, unless `soonest` has its hash at a time no later than it goes neutral.
    fn bound_holds<A: Algorithm, S: BuildHasher>(keyed: &Keyed<u16, A, S>) -> Result<(), String> {
        for (k, state) in keyed.map.iter() {
            let at = keyed.algorithm.neutral_at(state);
            let h = keyed.hasher.hash_one(k);
            let noted = keyed.soonest.iter().any(|&(t, sh)| sh == h && t <= at);
            if at < keyed.next_sweep && !noted {
                return Err(format!(
                    "key {k} neutral at {at:?}, before next_sweep {:?}, and not noted",
                    keyed.next_sweep
                ));
            }
        }
        Ok(())
    }

    /// A `Keyed` against its promises over any interleaving of checks (times out of
    /// order), refunds, sweeps and removals, with keys that share hashes: it never evicts a
    /// busy key, refuses a new key only when no key is neutral, a sweep leaves no key
    /// neutral, and what it notes to skip scans stays a lower bound, and small.
    fn keyed_keeps_its_promises<A: Algorithm + Clone>(
        algorithm: A,
        ops: &[Op],
        max_keys: usize,
        hashes: u64,
    ) -> Result<(), TestCaseError> {
        let mut keyed = Keyed::with_hasher(algorithm.clone(), max_keys, FewHashes(hashes)).unwrap();
        let ms = |t: u64| Duration::from_millis(t);
        let mut clock = 0u64;
        for op in ops {
            let held: Vec<(u16, Duration)> = keyed
                .map
                .iter()
                .map(|(k, s)| (*k, keyed.algorithm.neutral_at(s)))
                .collect();
            // The time by which a key that went may have been neutral, and the key removed.
            let (by, removed) = match *op {
                Op::Check(key, behind, cost) => {
                    let t = ms(clock.saturating_sub(behind));
                    let by = t.max(keyed.swept_at);
                    let held_key = keyed.get(&key).is_some();
                    let got = keyed.check(&key, t, cost);
                    if let Err(KeyedError::KeyspaceFull { .. }) = got {
                        prop_assert!(!held_key);
                        prop_assert_eq!(keyed.len(), max_keys);
                        for &(k, at) in &held {
                            prop_assert!(
                                !neutral_by(at, by),
                                "key {} neutral at {:?} held, a new key refused at {:?}",
                                k,
                                at,
                                by
                            );
                        }
                    }
                    (by, None)
                }
                Op::Refund(key, other, behind, cost) => {
                    let t = ms(clock.saturating_sub(behind));
                    let hash = keyed.hasher.hash_one(key);
                    let by = t.max(keyed.swept_at);
                    let before = keyed.get(&key).cloned();
                    if keyed.check(&key, t, cost).is_ok() {
                        let _ = keyed.check(&other, t, cost);
                        keyed.restore_hashed(hash, &key, before);
                    }
                    (by.max(keyed.swept_at), None)
                }
                Op::Sweep(behind) => {
                    let t = ms(clock.saturating_sub(behind));
                    keyed.sweep(t);
                    for (k, state) in keyed.map.iter() {
                        prop_assert!(
                            !keyed.algorithm.is_neutral(state, t),
                            "key {} neutral at {:?} kept by a sweep",
                            k,
                            t
                        );
                    }
                    (t, None)
                }
                Op::Remove(key) => {
                    keyed.remove(&key);
                    (Duration::ZERO, Some(key))
                }
                Op::Wait(gap) => {
                    clock += gap;
                    (Duration::ZERO, None)
                }
            };
            prop_assert!(keyed.len() <= max_keys);
            for &(k, at) in &held {
                prop_assert!(
                    keyed.get(&k).is_some() || Some(k) == removed || neutral_by(at, by),
                    "key {} busy until {:?} evicted at {:?} ({:?})",
                    k,
                    at,
                    by,
                    op
                );
            }
            if let Err(e) = bound_holds(&keyed) {
                prop_assert!(false, "{} after {:?}", e, op);
            }
            prop_assert!(keyed.soonest.len() <= max_keys.div_ceil(8));
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn keyed_keeps_its_promises_under_any_interleaving(
            ops in prop::collection::vec(op(), 1..300),
            max_keys in 1usize..=40,
            hashes in prop_oneof![Just(1u64), Just(3), Just(1 << 40)],
        ) {
            let q = Quota::new(crate::rate::Rate::per(2, Duration::from_millis(100)).unwrap(), 3).unwrap();
            let r = crate::rate::Rate::per(3, Duration::from_millis(200)).unwrap();
            keyed_keeps_its_promises(TokenBucket::new(q), &ops, max_keys, hashes)?;
            keyed_keeps_its_promises(crate::limit::FixedWindow::new(r), &ops, max_keys, hashes)?;
            keyed_keeps_its_promises(crate::limit::SlidingWindow::new(r), &ops, max_keys, hashes)?;
            keyed_keeps_its_promises(crate::limit::SlidingLog::new(r), &ops, max_keys, hashes)?;
        }
    }
}
