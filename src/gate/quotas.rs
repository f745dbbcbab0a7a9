//! The quotas registered on a gate by what is built over it (a
//! [`RateLimitLayer`](crate::http::RateLimitLayer)), so that layers sharing one
//! [`MemoryGate`] are refused when built past the distinct quotas
//! it decides together, not answered with `KeyspaceFull` on their requests; and so that the
//! buckets of a quota no layer uses any more give their room back to the layers built after
//! (the gate marks them released, and each shard evicts them at its next sweep).

use std::fmt;
use std::sync::PoisonError;

use crate::error::{ConfigError, ConfigErrorKind};
use crate::gate::memory::MemoryGate;
use crate::gate::multi::MAX_QUOTAS;
use crate::rate::Quota;
use crate::sync::Mutex;

/// The quotas registered on one gate, each with the number of registrations holding it: at
/// most [`MAX_QUOTAS`] entries.
#[derive(Debug, Default)]
pub(crate) struct QuotaRegistry {
    held: Mutex<Vec<(Quota, usize)>>,
}

impl QuotaRegistry {
    /// Register `quotas` (each distinct one once); returns the distinct ones, to give to
    /// [`release`](QuotaRegistry::release) when the registration ends. `added` is called,
    /// under the registry's lock, with each quota that no registration held before.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `gate.quotas` (`TooLarge`) when the quotas registered and these
    /// together are more than [`MAX_QUOTAS`] distinct ones; nothing is registered then.
    pub(crate) fn register(
        &self,
        quotas: &[Quota],
        mut added: impl FnMut(Quota),
    ) -> Result<Vec<Quota>, ConfigError> {
        let distinct: Vec<Quota> = quotas
            .iter()
            .enumerate()
            .filter(|&(i, q)| !quotas[..i].contains(q))
            .map(|(_, &q)| q)
            .collect();
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let new = distinct
            .iter()
            .filter(|q| !held.iter().any(|(h, _)| h == *q))
            .count();
        let together = held.len() + new;
        if together > MAX_QUOTAS {
            return Err(ConfigError::new(
                "gate.quotas",
                ConfigErrorKind::TooLarge,
                format!(
                    "{together} distinct quotas with those of the layers built on this gate \
                     ({} of them): a MemoryGate decides at most {MAX_QUOTAS} together",
                    held.len()
                ),
            ));
        }
        for &q in &distinct {
            match held.iter_mut().find(|(h, _)| *h == q) {
                Some((_, n)) => *n += 1,
                None => {
                    held.push((q, 1));
                    added(q);
                }
            }
        }
        Ok(distinct)
    }

    /// Let go of one registration of each of `quotas` (distinct, registered). `released` is
    /// called, under the registry's lock, with each quota no registration holds any more.
    pub(crate) fn release(&self, quotas: &[Quota], mut released: impl FnMut(Quota)) {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.retain_mut(|(h, n)| {
            if quotas.contains(h) {
                *n -= 1;
                if *n == 0 {
                    released(*h);
                }
            }
            *n > 0
        });
    }

    /// The distinct quotas registered now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// Quotas registered on a gate by what is built over it, from `Gate::register_quotas`:
/// they stay registered until this is dropped; then the buckets of those that no other
/// registration holds are evicted at the next sweep of the gate's shards. One from a gate
/// that registers nothing holds nothing.
pub struct Registration {
    /// The gate registered on, and the distinct quotas registered.
    held: Option<(MemoryGate, Vec<Quota>)>,
}

impl Registration {
    /// A registration of nothing (a gate with no limit on its quotas together).
    pub(crate) fn none() -> Registration {
        Registration { held: None }
    }

    /// `quotas` (distinct), registered on `gate` until this is dropped.
    pub(crate) fn on(gate: MemoryGate, quotas: Vec<Quota>) -> Registration {
        Registration {
            held: Some((gate, quotas)),
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some((gate, quotas)) = self.held.take() {
            gate.release_quotas(&quotas);
        }
    }
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration")
            .field("quotas", &self.held.as_ref().map_or(&[][..], |(_, q)| q))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quotas(range: std::ops::Range<u32>) -> Vec<Quota> {
        range.map(|i| Quota::per_second(i + 1).unwrap()).collect()
    }

    #[test]
    fn registered_quotas_are_counted_once_and_released_with_the_last_registration() {
        let registry = QuotaRegistry::default();
        // The quotas no registration held before, and those none holds any more.
        let mut added = Vec::new();
        let mut released = Vec::new();
        let a = registry.register(&quotas(0..9), |q| added.push(q)).unwrap();
        assert_eq!(added, quotas(0..9));
        let e = registry
            .register(&quotas(9..18), |q| added.push(q))
            .unwrap_err();
        assert_eq!(e.field(), "gate.quotas");
        assert!(e.reason().starts_with("18 distinct quotas"), "{e}");
        // Refused: nothing of it registered.
        assert_eq!(registry.len(), 9);
        assert_eq!(added.len(), 9);
        // A quota listed twice, or registered already, counts once.
        let mut repeated = quotas(0..2);
        repeated.extend(quotas(0..2));
        let b = registry.register(&repeated, |q| added.push(q)).unwrap();
        assert_eq!(b, quotas(0..2));
        assert_eq!(added.len(), 9, "quotas 0 and 1 were held already");
        let c = registry
            .register(&quotas(9..16), |q| added.push(q))
            .unwrap();
        assert_eq!(registry.len(), 16);
        assert!(registry.register(&quotas(16..17), |_| {}).is_err());
        registry.release(&a, |q| released.push(q));
        // `b` still holds quotas 0 and 1.
        assert_eq!(registry.len(), 9);
        assert_eq!(released, quotas(2..9));
        registry.release(&b, |q| released.push(q));
        registry.release(&c, |q| released.push(q));
        assert_eq!(registry.len(), 0);
        assert_eq!(released.len(), 16);
        for _ in 0..100 {
            let d = registry.register(&quotas(20..36), |_| {}).unwrap();
            registry.release(&d, |_| {});
        }
        assert_eq!(registry.len(), 0);
        assert!(format!("{:?}", Registration::none()).contains("[]"));
    }
}
