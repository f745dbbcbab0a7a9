//! Token leases: tokens taken from Redis in advance and spent locally.

use std::collections::HashMap;
use std::sync::PoisonError;
use std::time::{Duration, Instant};

use crate::decision::Decision;
use crate::sync::Mutex;

#[derive(Debug, Clone, Copy)]
struct Lease {
    tokens: u32,
    expires: Instant,
    limit: u64,
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

    /// Spend `cost` from the lease of `key`, if it holds enough and has not expired.
    pub(crate) fn spend(&self, key: &str, cost: u32, now: Instant) -> Option<Decision> {
        let mut leases = self.leases.lock().unwrap_or_else(PoisonError::into_inner);
        let lease = leases.get_mut(key)?;
        if now >= lease.expires {
            leases.remove(key);
            return None;
        }
        if lease.tokens < cost {
            return None;
        }
        lease.tokens -= cost;
        let left = lease.tokens;
        let limit = lease.limit;
        if left == 0 {
            leases.remove(key);
        }
        Some(Decision::allow(limit, u64::from(left), Duration::ZERO))
    }

    /// Keep `tokens` granted for `key`. A lease still held for the key (concurrent calls
    /// each took one) absorbs them and keeps its earlier expiry: no token is lost to the
    /// other lease, and none is held longer than `ttl` after it was taken.
    pub(crate) fn keep(&self, key: &str, tokens: u32, limit: u64, now: Instant) {
        if tokens == 0 {
            return;
        }
        let mut leases = self.leases.lock().unwrap_or_else(PoisonError::into_inner);
        if leases.len() >= self.capacity && !leases.contains_key(key) {
            leases.retain(|_, l| l.expires > now);
            if leases.len() >= self.capacity {
                return;
            }
        }
        let expires = now + self.ttl;
        match leases.get_mut(key) {
            Some(held) if held.expires > now => {
                held.tokens = held.tokens.saturating_add(tokens);
                held.expires = held.expires.min(expires);
                held.limit = limit;
            }
            _ => {
                leases.insert(
                    key.to_owned(),
                    Lease {
                        tokens,
                        expires,
                        limit,
                    },
                );
            }
        }
    }
}
