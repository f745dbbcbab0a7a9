//! The quotas registered on a gate by what is built over it (a
//! [`RateLimitLayer`](crate::http::RateLimitLayer)), so that layers sharing one
//! [`MemoryGate`](crate::gate::MemoryGate) are refused when built past the distinct quotas
//! it decides together, not answered with `KeyspaceFull` on their requests.

use std::fmt;
use std::sync::PoisonError;

use crate::error::{ConfigError, ConfigErrorKind};
use crate::gate::multi::MAX_QUOTAS;
use crate::rate::Quota;
use crate::sync::{Arc, Mutex};

/// The quotas registered on one gate, each with the number of registrations holding it: at
/// most [`MAX_QUOTAS`] entries.
#[derive(Debug, Default)]
pub(crate) struct QuotaRegistry {
    held: Mutex<Vec<(Quota, usize)>>,
}

impl QuotaRegistry {
    /// Register `quotas` (each distinct one once) until the registration returned is
    /// dropped.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `gate.quotas` (`TooLarge`) when the quotas registered and these
    /// together are more than [`MAX_QUOTAS`] distinct ones; nothing is registered then.
    // An associated function (`this`, not `self: &Arc<Self>`): `crate::sync::Arc` is loom's
    // under the loom models, and cannot be a receiver there.
    pub(crate) fn register(
        this: &Arc<Self>,
        quotas: &[Quota],
    ) -> Result<Registration, ConfigError> {
        let distinct: Vec<Quota> = quotas
            .iter()
            .enumerate()
            .filter(|&(i, q)| !quotas[..i].contains(q))
            .map(|(_, &q)| q)
            .collect();
        let mut held = this.held.lock().unwrap_or_else(PoisonError::into_inner);
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
                None => held.push((q, 1)),
            }
        }
        drop(held);
        Ok(Registration {
            held: Some((Arc::clone(this), distinct)),
        })
    }

    /// Let go of one registration of each of `quotas` (distinct, registered).
    fn release(&self, quotas: &[Quota]) {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.retain_mut(|(h, n)| {
            if quotas.contains(h) {
                *n -= 1;
            }
            *n > 0
        });
    }

    /// The distinct quotas registered now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// Quotas registered on a gate by what is built over it, from `Gate::register_quotas`:
/// they stay registered until this is dropped. One from a gate that registers nothing
/// holds nothing.
pub struct Registration {
    held: Option<(Arc<QuotaRegistry>, Vec<Quota>)>,
}

impl Registration {
    /// A registration of nothing (a gate with no limit on its quotas together).
    pub(crate) fn none() -> Registration {
        Registration { held: None }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some((registry, quotas)) = self.held.take() {
            registry.release(&quotas);
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
        let registry = Arc::new(QuotaRegistry::default());
        let a = QuotaRegistry::register(&registry, &quotas(0..9)).unwrap();
        let e = QuotaRegistry::register(&registry, &quotas(9..18)).unwrap_err();
        assert_eq!(e.field(), "gate.quotas");
        assert!(e.reason().starts_with("18 distinct quotas"), "{e}");
        // Refused: nothing of it registered.
        assert_eq!(registry.len(), 9);
        // A quota listed twice, or registered already, counts once.
        let mut repeated = quotas(0..2);
        repeated.extend(quotas(0..2));
        let b = QuotaRegistry::register(&registry, &repeated).unwrap();
        let c = QuotaRegistry::register(&registry, &quotas(9..16)).unwrap();
        assert_eq!(registry.len(), 16);
        assert!(QuotaRegistry::register(&registry, &quotas(16..17)).is_err());
        drop(a);
        // `b` still holds quotas 0 and 1.
        assert_eq!(registry.len(), 9);
        drop((b, c));
        assert_eq!(registry.len(), 0);
        for _ in 0..100 {
            assert!(QuotaRegistry::register(&registry, &quotas(20..36)).is_ok());
        }
        assert_eq!(registry.len(), 0);
        assert!(format!("{:?}", Registration::none()).contains("[]"));
    }
}
