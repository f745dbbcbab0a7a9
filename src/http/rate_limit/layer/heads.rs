//! The heads of gate keys (`<key prefix><policy name>:`) held by the layers alive over a
//! gate whose key is one bucket whatever the quota: [`HeadClaim`].

use std::sync::PoisonError;

use crate::error::{ConfigError, ConfigErrorKind};
use crate::rate::Quota;

/// One head of gate keys (`<key prefix><policy name>:`) of the layers alive over a gate
/// whose key is one bucket whatever the quota ([`Gate::key_space`](crate::gate::Gate::key_space)): the quota they count
/// it with, and how many layers hold it.
struct Head {
    space: usize,
    head: String,
    quota: Quota,
    layers: usize,
}

/// Every [`Head`] held, in the process.
static HEADS: std::sync::Mutex<Vec<Head>> = std::sync::Mutex::new(Vec::new());

/// The heads of one layer's gate keys in [`HEADS`], given back when it is dropped.
pub(crate) struct HeadClaim {
    space: usize,
    heads: Vec<String>,
}

impl HeadClaim {
    /// Hold `heads` (each with its quota and its policy's name) in the gate keys `space`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `rate_limit.policies` when a layer alive over `space` holds one
    /// of the heads with another quota; nothing is held then.
    pub(crate) fn new<'a>(
        space: usize,
        heads: impl Iterator<Item = (String, Quota, &'a str)>,
    ) -> Result<HeadClaim, ConfigError> {
        let heads: Vec<(String, Quota, &str)> = heads.collect();
        let mut held = HEADS.lock().unwrap_or_else(PoisonError::into_inner);
        for (head, quota, name) in &heads {
            if let Some(other) = held
                .iter()
                .find(|h| h.space == space && h.head == *head && h.quota != *quota)
            {
                return Err(ConfigError::new(
                    "rate_limit.policies",
                    ConfigErrorKind::Inconsistent,
                    format!(
                        "policy {name:?} ({quota}) counts under the gate keys {head:?}<key> \
                         that a layer alive on this gate counts with another quota \
                         ({}): one key holds one bucket on this gate; give one of the \
                         layers a key_prefix, or the policy another name (to change a \
                         policy's quota at run time, drop every layer, service and \
                         response future of the old one first)",
                        other.quota
                    ),
                ));
            }
        }
        for (head, quota, _) in &heads {
            match held
                .iter_mut()
                .find(|h| h.space == space && h.head == *head)
            {
                Some(h) => h.layers += 1,
                None => held.push(Head {
                    space,
                    head: head.clone(),
                    quota: *quota,
                    layers: 1,
                }),
            }
        }
        Ok(HeadClaim {
            space,
            heads: heads.into_iter().map(|(head, _, _)| head).collect(),
        })
    }
}

impl Drop for HeadClaim {
    fn drop(&mut self) {
        let mut held = HEADS.lock().unwrap_or_else(PoisonError::into_inner);
        held.retain_mut(|h| {
            if h.space == self.space && self.heads.contains(&h.head) {
                h.layers -= 1;
            }
            h.layers > 0
        });
    }
}
