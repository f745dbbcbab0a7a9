//! Token leases: tokens taken from Redis in advance and spent locally.

use std::collections::{HashMap, VecDeque};
use std::sync::PoisonError;
use std::time::{Duration, Instant, SystemTime};

use crate::decision::Decision;
use crate::metrics::Counter;
use crate::rate::Rate;
use crate::sync::Mutex;

/// One lease call's tokens for a key.
#[derive(Debug, Clone, Copy)]
struct Part {
    tokens: u32,
    /// When the tokens may no longer be spent.
    expires: Instant,
    /// When the bucket in Redis is full again, as Redis said when it granted them (spending
    /// them here does not change it: they are already debited there). The tokens kept hold
    /// the last places of the bucket's schedule before it: the `i`-th from the end, the one
    /// from `full_at − i` emission intervals.
    full_at: Instant,
    /// No token of it can be spent from then on (a lower bound): its expiry, or one emission
    /// interval before `full_at`, when its last token lapses.
    gone_at: Instant,
}

impl Part {
    /// Drop the tokens whose place in the schedule has begun by `now`, and return whether any
    /// is left. Spent later, a token would count as admitted before it was, and the fleet
    /// could pass more than `burst + rate·span` in a span.
    fn lapse(&mut self, now: Instant, rate: Rate) -> bool {
        let left = self.full_at.saturating_duration_since(now).as_nanos();
        let places = left * u128::from(rate.count()) / u128::from(rate.period_nanos());
        self.tokens = self.tokens.min(u32::try_from(places).unwrap_or(u32::MAX));
        self.tokens > 0 && now < self.expires
    }
}

/// The tokens leased for one key: one part per lease call (concurrent calls each take one),
/// oldest first, each with its own expiry.
#[derive(Debug, Clone)]
struct Lease {
    parts: VecDeque<Part>,
    limit: u64,
}

impl Lease {
    /// Forget expired parts and lapsed tokens; the tokens left, and those forgotten (never
    /// spent).
    fn live(&mut self, now: Instant, rate: Rate) -> (u64, u64) {
        let mut unspent = 0;
        self.parts.retain_mut(|p| {
            let before = p.tokens;
            let live = p.lapse(now, rate);
            unspent += u64::from(if live { before - p.tokens } else { before });
            live
        });
        (
            self.parts.iter().map(|p| u64::from(p.tokens)).sum(),
            unspent,
        )
    }

    /// Every token held, spendable or not.
    fn held(&self) -> u64 {
        self.parts.iter().map(|p| u64::from(p.tokens)).sum()
    }

    /// Take `cost` (known to be there), oldest tokens first.
    fn take(&mut self, mut cost: u32) {
        while cost > 0 {
            let Some(part) = self.parts.front_mut() else {
                return;
            };
            let used = cost.min(part.tokens);
            part.tokens -= used;
            cost -= used;
            if part.tokens == 0 {
                self.parts.pop_front();
            }
        }
    }

    /// When the bucket in Redis is full again, as far as this instance knows.
    fn full_at(&self) -> Option<Instant> {
        self.parts.iter().map(|p| p.full_at).max()
    }
}

/// The clock leases are measured on: `Instant`, moved on by the time the host slept.
///
/// `Instant` (`CLOCK_MONOTONIC` on Linux) stops while the host sleeps (a laptop suspended,
/// a VM paused); Redis's clock does not, and refills the bucket meanwhile, so a token kept
/// across the sleep would be spent long after its place in the bucket's schedule, on top
/// of the refill. The wall clock runs on through a sleep: whatever it runs ahead of
/// `Instant`, past the most it was ahead before, is taken as slept. (A wall clock stepped
/// forward is taken as sleep too: leases then lapse early, never late. One stepped back by
/// more than [`STEP_BACK`] is a new start, from which later sleeps are measured; one
/// stepped back by less hides at most that much of a later sleep.)
#[derive(Debug, Default)]
struct Awake {
    /// The first reading of both clocks.
    origin: Option<(Instant, SystemTime)>,
    /// How far the wall clock was ahead of `Instant` (since `origin`, in nanoseconds, below
    /// zero once stepped back) when `slept` last grew, or at the last step back.
    lead: i128,
    /// The time slept since `origin`: what the wall clock's lead grew by.
    slept: Duration,
}

/// A fall of the wall clock's lead over `Instant` by more than this is a step back of the
/// wall clock, not the noise between two readings (a thread preempted between them): the
/// lead then restarts from there, so that a sleep after it is seen. Smaller than that, the
/// lead is kept, so noise never adds up to sleep.
const STEP_BACK: i128 = 1_000_000_000;

impl Awake {
    /// Both clocks (read before the lock where that costs nothing more).
    fn read() -> (Instant, SystemTime) {
        (Instant::now(), SystemTime::now())
    }

    /// `now`, read from `Instant`, on the lease clock, given both clocks' `reading`.
    fn at(&mut self, now: Instant, reading: (Instant, SystemTime)) -> Instant {
        let (mono, wall) = reading;
        let (mono0, wall0) = *self.origin.get_or_insert(reading);
        let wall_ns = match wall.duration_since(wall0) {
            Ok(d) => d.as_nanos() as i128,
            Err(back) => -(back.duration().as_nanos() as i128),
        };
        let lead = wall_ns - mono.saturating_duration_since(mono0).as_nanos() as i128;
        if lead > self.lead {
            let grew = u64::try_from(lead - self.lead).unwrap_or(u64::MAX);
            // At most a century (a wall clock flipping back and forth by hours for ever):
            // `now` plus it stays an `Instant`.
            self.slept = crate::time::capped(self.slept.saturating_add(Duration::from_nanos(grew)));
            self.lead = lead;
        } else if lead < self.lead - STEP_BACK {
            self.lead = lead;
        }
        now + self.slept
    }
}

#[derive(Debug, Default)]
struct State {
    leases: HashMap<String, Lease>,
    /// Lease calls in flight for keys without a lease: each holds a place in the map.
    reserved: usize,
    /// No lease runs out before this (`None`: no lease): a full map is not swept for room
    /// before then.
    next_sweep: Option<Instant>,
    /// Every instant here is on this clock.
    awake: Awake,
}

/// Tokens already debited in Redis, per key, waiting to be spent here.
///
/// Never over-admits: every token served from a lease was taken from the global bucket
/// first, and is spent no later than its place in the bucket's schedule begins (spent later,
/// it would pass on top of the tokens Redis has refilled since). The cost is
/// under-admission: tokens held here are unavailable to other instances (at most
/// `size − 1` per key per instance and lease call in flight for it at any moment), and
/// tokens not spent before the lease expires or they lapse are lost (at most `size − 1` per
/// lease call).
///
/// Bounded: keys holding a lease plus lease calls in flight never exceed `capacity`. A call
/// that finds the map full (after forgetting expired leases) takes no lease: it is decided
/// alone, for its own cost — so a full map never throws away tokens already debited in
/// Redis.
///
/// Counted: every token kept is spent, or counted in `unspent` when it is let go of (its
/// lease expired, it lapsed, the leases were [`clear`](Leases::clear)ed, or the map itself
/// is dropped); after the lock is released (the recorder is user code).
#[derive(Debug)]
pub(crate) struct Leases {
    state: Mutex<State>,
    /// `flowgate_gate_lease_unspent_total`.
    unspent: Counter,
    pub(crate) size: u32,
    pub(crate) ttl: Duration,
    /// The bucket's refill rate, at which kept tokens lapse.
    rate: Rate,
    capacity: usize,
    /// Passes over every lease made to find those run out (tests).
    #[cfg(test)]
    sweeps: std::sync::atomic::AtomicUsize,
}

/// A place in the lease map held for one lease call; given back when dropped (a call that
/// failed or was cancelled) or when its lease is kept.
#[derive(Debug)]
pub(crate) struct Place<'a> {
    /// `None` once given back.
    leases: Option<&'a Leases>,
    /// When the lease call started, on the lease clock.
    at: Instant,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        if let Some(leases) = self.leases.take() {
            leases.lock().reserved -= 1;
        }
    }
}

impl Leases {
    pub(crate) fn new(
        size: u32,
        ttl: Duration,
        rate: Rate,
        capacity: usize,
        unspent: Counter,
    ) -> Leases {
        Leases {
            state: Mutex::new(State::default()),
            unspent,
            size,
            ttl,
            rate,
            capacity,
            #[cfg(test)]
            sweeps: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    fn lock(&self) -> crate::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keys holding a lease now (expired ones included until they are next looked at).
    pub(crate) fn len(&self) -> usize {
        self.lock().leases.len()
    }

    /// Forget every lease: Redis may have lost the buckets they were debited from (it
    /// answers again after a failure, or lacks the gate's scripts: restarted empty, failed
    /// over), and spent then, their tokens would pass on top of a bucket the new server
    /// holds full. Lease calls in flight keep their places.
    pub(crate) fn clear(&self) {
        let mut state = self.lock();
        let unspent = state.leases.drain().map(|(_, l)| l.held()).sum();
        state.next_sweep = None;
        drop(state);
        self.count_unspent(unspent);
    }

    /// Count `n` tokens let go of unspent; call without the lock.
    fn count_unspent(&self, n: u64) {
        if n > 0 {
            self.unspent.increment(n);
        }
    }

    /// Spend `cost` from the lease of `key`, if it holds enough unexpired tokens.
    pub(crate) fn spend(&self, key: &str, cost: u32, now: Instant) -> Option<Decision> {
        let mut guard = self.lock();
        let state = &mut *guard;
        let lease = state.leases.get_mut(key)?;
        // Read only once a lease is found (under the lock): a key without one (a cached
        // rejection's, next) pays no clock reads here.
        let now = state.awake.at(now, Awake::read());
        let (held, unspent) = lease.live(now, self.rate);
        if held < u64::from(cost) {
            if held == 0 {
                state.leases.remove(key);
            }
            drop(guard);
            self.count_unspent(unspent);
            return None;
        }
        // Before the spend: spending the last token of a part does not change when the
        // bucket in Redis is full again.
        let reset_after = lease
            .full_at()
            .map_or(Duration::ZERO, |at| at.saturating_duration_since(now));
        lease.take(cost);
        let (left, limit) = (held - u64::from(cost), lease.limit);
        if left == 0 {
            state.leases.remove(key);
        }
        drop(guard);
        self.count_unspent(unspent);
        Some(Decision::allow(limit, left, reset_after))
    }

    /// Whether `key` holds at least `cost` tokens that can be spent at `now` (none spent).
    pub(crate) fn holds(&self, key: &str, cost: u32, now: Instant) -> bool {
        let mut guard = self.lock();
        let state = &mut *guard;
        let Some(lease) = state.leases.get_mut(key) else {
            return false;
        };
        let now = state.awake.at(now, Awake::read());
        let (held, unspent) = lease.live(now, self.rate);
        if held == 0 {
            state.leases.remove(key);
        }
        drop(guard);
        self.count_unspent(unspent);
        held >= u64::from(cost)
    }

    /// A place for one lease call, or `None` when the map is full: then take no lease.
    /// Every call holds one (whether or not its key has a lease), so keys with a lease plus
    /// calls in flight never exceed the capacity.
    pub(crate) fn place(&self, now: Instant) -> Option<Place<'_>> {
        let reading = Awake::read();
        let mut state = self.lock();
        let now = state.awake.at(now, reading);
        let mut unspent = 0;
        if state.leases.len() + state.reserved >= self.capacity {
            // None has run out yet: no pass over them all (under the lock every check
            // takes) to find that out again for each call.
            if state.next_sweep.is_some_and(|at| now < at) {
                return None;
            }
            #[cfg(test)]
            self.sweeps
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut next = None;
            state.leases.retain(|_, l| {
                let (held, lost) = l.live(now, self.rate);
                unspent += lost;
                if held > 0 {
                    next = next
                        .into_iter()
                        .chain(l.parts.iter().map(|p| p.gone_at))
                        .min();
                }
                held > 0
            });
            state.next_sweep = next;
            if state.leases.len() + state.reserved >= self.capacity {
                drop(state);
                self.count_unspent(unspent);
                return None;
            }
        }
        state.reserved += 1;
        drop(state);
        self.count_unspent(unspent);
        Some(Place {
            leases: Some(self),
            at: now,
        })
    }

    /// Keep `tokens` granted for `key` in the place taken for it, from when the place was
    /// taken (the lease call's start), `now`, until `now + ttl`; the bucket in Redis is full
    /// again `reset_after` after `now`. Leases taken by concurrent calls add up, each
    /// keeping its own expiry: none replaces another. Only if `fresh` (asked under the lock
    /// [`clear`](Leases::clear) takes) says that the leases were not cleared since the
    /// lease call was sent: Redis may have lost the bucket they were debited from, and
    /// they are let go of (counted unspent). A clear racing this call then either comes
    /// after it and lets go of them, or comes before it and keeps them out.
    pub(crate) fn keep(
        &self,
        mut place: Place<'_>,
        key: &str,
        tokens: u32,
        limit: u64,
        reset_after: Duration,
        fresh: impl FnOnce() -> bool,
    ) {
        if tokens == 0 {
            return;
        }
        let now = place.at;
        let mut state = self.lock();
        // The place becomes the key's entry (or goes, if the key has one already).
        state.reserved -= 1;
        place.leases = None;
        if !fresh() {
            drop(state);
            self.count_unspent(u64::from(tokens));
            return;
        }
        let lease = state.leases.entry(key.to_owned()).or_insert_with(|| Lease {
            parts: VecDeque::new(),
            limit,
        });
        lease.limit = limit;
        // Less the microsecond Redis rounded `reset_after` up by, so no place is late.
        let full_in = reset_after.saturating_sub(Duration::from_micros(1));
        // Its last token lapses once less than one emission interval (rounded up here, so
        // no later than that) is left before `full_at`.
        let gone_at = now + self.ttl.min(full_in.saturating_sub(self.rate.time_for(1)));
        lease.parts.push_back(Part {
            tokens,
            expires: now + self.ttl,
            full_at: now + full_in,
            gone_at,
        });
        state.next_sweep = Some(state.next_sweep.map_or(gone_at, |at| at.min(gone_at)));
    }
}

impl Drop for Leases {
    /// The tokens still held go with the map: counted as unspent.
    fn drop(&mut self) {
        let unspent = self.lock().leases.values().map(Lease::held).sum();
        self.count_unspent(unspent);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;

    /// A sleep after the wall clock was stepped back (an administrator, NTP after a long
    /// drift) is seen: measured from the first reading alone, the wall clock's lead over
    /// `Instant` went negative with the step, and a sleep shorter than the step never
    /// brought it back above zero, so kept tokens passed a sleep's length late.
    #[test]
    fn a_sleep_after_the_wall_clock_stepped_back_is_seen() {
        let (mono0, wall0) = Awake::read();
        let (s, hour) = (Duration::from_secs(1), Duration::from_secs(3_600));
        let mut awake = Awake::default();
        assert_eq!(awake.at(mono0, (mono0, wall0)), mono0);
        // A second on, the wall clock is stepped back an hour: nothing slept.
        let mono1 = mono0 + s;
        assert_eq!(awake.at(mono1, (mono1, wall0 + s - hour)), mono1);
        // A second on, the host sleeps half an hour: the wall clock runs on, `Instant` not.
        let mono2 = mono1 + s;
        let wall2 = wall0 + 2 * s - hour + hour / 2;
        assert_eq!(awake.at(mono2, (mono2, wall2)), mono2 + hour / 2);
        // Another half hour of sleep, then awake: an hour slept in all, no more.
        let wall3 = wall2 + hour / 2;
        assert_eq!(awake.at(mono2, (mono2, wall3)), mono2 + hour);
        let mono4 = mono2 + s;
        assert_eq!(awake.at(mono4, (mono4, wall3 + s)), mono4 + hour);
    }

    /// A full lease map whose leases are all live is not swept for each call that asks for
    /// a place (a pass over every lease, under the lock every check takes to spend from
    /// them): only once one of them can have run out, by its expiry or by its tokens
    /// lapsing. A flood of new keys at capacity made each of their calls such a pass.
    #[test]
    fn a_full_map_of_live_leases_is_not_swept_for_each_new_call() {
        let hour = Duration::from_secs(3_600);
        // One token an hour: a kept token lapses an hour before the bucket is full again.
        let leases = Leases::new(
            10,
            hour,
            Rate::per_hour(1).unwrap(),
            100,
            Counter::default(),
        );
        let now = Instant::now();
        for i in 0..100 {
            let place = leases.place(now).expect("room");
            leases.keep(place, &format!("k{i}"), 5, 10, 10 * hour, || true);
        }
        for _ in 0..1_000 {
            assert!(leases.place(now).is_none(), "full");
        }
        let sweeps = leases.sweeps.load(Ordering::Relaxed);
        assert!(sweeps <= 1, "swept {sweeps} times with nothing to evict");
        // Past the expiry of the leases (before their tokens lapse), room is made.
        assert!(leases.place(now + hour).is_some());
        // A lease whose tokens have lapsed makes room too, before its expiry.
        let leases = Leases::new(
            10,
            10 * hour,
            Rate::per_hour(1).unwrap(),
            1,
            Counter::default(),
        );
        let place = leases.place(now).expect("room");
        leases.keep(place, "k", 5, 10, 2 * hour, || true);
        assert!(leases.place(now).is_none(), "full");
        assert!(leases.place(now + hour).is_some(), "its tokens lapsed");
    }
}

#[cfg(all(test, feature = "metrics"))]
mod accounting {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use metrics::{
        Counter as MCounter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
    };
    use proptest::prelude::*;

    use super::*;
    use crate::metrics::Labels;

    /// Every counter registered is the one total.
    struct One(Arc<AtomicU64>);
    impl Recorder for One {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> MCounter {
            MCounter::from_arc(self.0.clone())
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }

    /// (op, key, n, gap ms): 0 take a place and keep n tokens, 1 spend n, 2 clear, 3 take a
    /// place and give it up.
    fn ops() -> impl Strategy<Value = Vec<(u8, u8, u32, u64)>> {
        prop::collection::vec((0u8..4, 0u8..4, 1u32..6, 0u64..400), 1..100)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

        /// Tokens kept, spent, forgotten (`clear`) and run out in any order, time moving on,
        /// places given up, a map of 1 to 3 keys often full: every token kept is spent or
        /// counted in `unspent`, at the latest when the map is dropped.
        #[test]
        fn every_kept_token_is_spent_or_counted(ops in ops(), capacity in 1usize..4) {
            let total = Arc::new(AtomicU64::new(0));
            let counter = metrics::with_local_recorder(&One(total.clone()), || {
                Labels::new(None).counter("unspent", &[])
            });
            let leases = Leases::new(5, Duration::from_secs(1), Rate::per_second(10).unwrap(), capacity, counter);
            let mut now = Instant::now();
            let (mut kept, mut spent) = (0u64, 0u64);
            for (op, key, n, gap) in ops {
                now += Duration::from_millis(gap);
                let key = format!("k{key}");
                match op {
                    0 => if let Some(place) = leases.place(now) {
                        kept += u64::from(n);
                        leases.keep(place, &key, n, 5, Duration::from_millis(100 * u64::from(n) + gap), || true);
                    },
                    1 => if leases.spend(&key, n, now).is_some() { spent += u64::from(n) },
                    2 => leases.clear(),
                    _ => drop(leases.place(now)),
                }
            }
            drop(leases);
            prop_assert_eq!(kept, spent + total.load(Ordering::Relaxed));
        }
    }
}
