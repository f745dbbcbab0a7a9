//! Token leases: tokens taken from Redis in advance and spent locally.

use std::collections::{HashMap, VecDeque};
use std::sync::PoisonError;
use std::time::{Duration, Instant};

use crate::decision::Decision;
use crate::sync::Mutex;

/// The tokens leased for one key: one part per lease call (concurrent calls each take one),
/// oldest first, each with its own expiry.
#[derive(Debug, Clone)]
struct Lease {
    parts: VecDeque<(u32, Instant)>,
    limit: u64,
}

impl Lease {
    /// Forget expired parts; the tokens left.
    fn live(&mut self, now: Instant) -> u64 {
        self.parts.retain(|&(_, expires)| now < expires);
        self.parts.iter().map(|&(n, _)| u64::from(n)).sum()
    }

    /// Take `cost` (known to be there), oldest tokens first.
    fn take(&mut self, mut cost: u32) {
        while cost > 0 {
            let Some((n, _)) = self.parts.front_mut() else {
                return;
            };
            let used = cost.min(*n);
            *n -= used;
            cost -= used;
            if *n == 0 {
                self.parts.pop_front();
            }
        }
    }
}

/// Tokens already debited in Redis, per key, waiting to be spent here.
///
/// Never over-admits: every token served from a lease was taken from the global bucket
/// first. The cost is under-admission: tokens held here are unavailable to other instances,
/// and tokens not spent before the lease expires are lost (at most `size − 1` per key per
/// instance and lease call in flight for it at any moment, and at most that many per `ttl`
/// lost).
#[derive(Debug)]
pub(crate) struct Leases {
    leases: Mutex<HashMap<String, Lease>>,
    pub(crate) size: u32,
    pub(crate) ttl: Duration,
    capacity: usize,
}

impl Leases {
    pub(crate) fn new(size: u32, ttl: Duration, capacity: usize) -> Leases {
        Leases {
            leases: Mutex::new(HashMap::new()),
            size,
            ttl,
            capacity,
        }
    }

    /// Spend `cost` from the lease of `key`, if it holds enough unexpired tokens.
    pub(crate) fn spend(&self, key: &str, cost: u32, now: Instant) -> Option<Decision> {
        let mut leases = self.leases.lock().unwrap_or_else(PoisonError::into_inner);
        let lease = leases.get_mut(key)?;
        let held = lease.live(now);
        if held < u64::from(cost) {
            if held == 0 {
                leases.remove(key);
            }
            return None;
        }
        lease.take(cost);
        let (left, limit) = (held - u64::from(cost), lease.limit);
        if left == 0 {
            leases.remove(key);
        }
        Some(Decision::allow(limit, left, Duration::ZERO))
    }

    /// Keep `tokens` granted for `key` at `now`, until `now + ttl`. Leases taken by
    /// concurrent calls add up, each keeping its own expiry: none replaces another.
    pub(crate) fn keep(&self, key: &str, tokens: u32, limit: u64, now: Instant) {
        if tokens == 0 {
            return;
        }
        let mut leases = self.leases.lock().unwrap_or_else(PoisonError::into_inner);
        if leases.len() >= self.capacity && !leases.contains_key(key) {
            leases.retain(|_, l| l.live(now) > 0);
            if leases.len() >= self.capacity {
                return;
            }
        }
        let lease = leases.entry(key.to_owned()).or_insert_with(|| Lease {
            parts: VecDeque::new(),
            limit,
        });
        lease.limit = limit;
        lease.parts.push_back((tokens, now + self.ttl));
    }
}
