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
    /// The name of the policy counting under it (the rest of `head` is the key prefix).
    name: String,
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
    /// of the heads with another quota or for another policy name (another split of one
    /// head into a key prefix and a name), or a head that begins one of them or that one
    /// of them begins (their keys meet: `a:` + `b:k` is `a:b:` + `k`); nothing is held
    /// then.
    pub(crate) fn new<'a>(
        space: usize,
        heads: impl Iterator<Item = (String, Quota, &'a str)>,
    ) -> Result<HeadClaim, ConfigError> {
        let heads: Vec<(String, Quota, &str)> = heads.collect();
        let mut held = HEADS.lock().unwrap_or_else(PoisonError::into_inner);
        for (head, quota, name) in &heads {
            let conflict = held.iter().filter(|h| h.space == space).find_map(|other| {
                if other.head == *head && other.name != *name {
                    Some(format!(
                        "policy {name:?} counts under the gate keys {head:?}<key>, as the \
                         policy {:?} of a layer alive on this gate does (another key prefix \
                         before another name): the two would share their buckets; give the \
                         layers key prefixes of which neither begins the other, such as \
                         \"login:\" and \"api:\"",
                        other.name
                    ))
                } else if other.head == *head && other.quota != *quota {
                    Some(format!(
                        "policy {name:?} ({quota}) counts under the gate keys {head:?}<key> \
                         that a layer alive on this gate counts with another quota \
                         ({}): one key holds one bucket on this gate; give one of the \
                         layers a key_prefix, or the policy another name (to change a \
                         policy's quota at run time, drop every layer, service and \
                         response future of the old one first)",
                        other.quota
                    ))
                } else if other.head != *head
                    && (other.head.starts_with(head.as_str()) || head.starts_with(&other.head))
                {
                    // Keys of a head that begins another are keys of that one too: a client
                    // whose key is the rest of the longer head, and then any key, spends
                    // the other's buckets.
                    let (short, long) = if other.head.len() < head.len() {
                        (other.head.as_str(), head.as_str())
                    } else {
                        (head.as_str(), other.head.as_str())
                    };
                    Some(format!(
                        "policy {name:?} counts under the gate keys {head:?}<key>, and the \
                         policy {:?} of a layer alive on this gate under {:?}<key>: a key \
                         of one can be a key of the other (a client keyed {:?}<key> under \
                         {short:?} spends the bucket of <key> under {long:?}); give the \
                         layers key prefixes of which neither begins the other, such as \
                         \"login:\" and \"api:\"",
                        other.name,
                        other.head,
                        &long[short.len()..],
                    ))
                } else {
                    None
                }
            });
            if let Some(reason) = conflict {
                return Err(ConfigError::new(
                    "rate_limit.policies",
                    ConfigErrorKind::Inconsistent,
                    reason,
                ));
            }
        }
        for (head, quota, name) in &heads {
            match held
                .iter_mut()
                .find(|h| h.space == space && h.head == *head)
            {
                Some(h) => h.layers += 1,
                None => held.push(Head {
                    space,
                    head: head.clone(),
                    quota: *quota,
                    name: (*name).to_owned(),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(
        space: usize,
        head: &str,
        per_minute: u32,
        name: &str,
    ) -> Result<HeadClaim, ConfigError> {
        let quota = Quota::per_minute(per_minute).unwrap();
        HeadClaim::new(space, std::iter::once((head.to_owned(), quota, name)))
    }

    /// Heads of which one begins the other hold the same keys: a layer without a prefix with
    /// a policy "a" counts the client whose key is "b:k" under `a:b:k`, where a layer with
    /// the prefix "a:" counts key "k" of its policy "b". On a gate whose key is one bucket,
    /// the client spends the other layer's bucket of "k" (whatever the two quotas: both
    /// count on one Redis key). Before, only a head held exactly, with another quota, was
    /// refused; now heads that meet are refused too, and so is one head reached from
    /// another prefix and policy name (prefix "a" with "bc", prefix "ab" with "c").
    #[test]
    fn heads_that_begin_one_another_are_refused() {
        // Spaces no gate has (a gate's is the address of its state): the test's own.
        let space = 1;
        let outer = claim(space, "a:", 3, "a").unwrap();
        for (head, per_minute, name) in [("a:b:", 100, "b"), ("a:b:", 3, "b")] {
            let e = claim(space, head, per_minute, name).err().expect(head);
            assert_eq!(e.field(), "rate_limit.policies");
            assert!(
                e.reason().contains("\"a:\"") && e.reason().contains("\"a:b:\""),
                "{e}"
            );
        }
        assert!(
            claim(space, "ab:", 100, "ab").is_ok(),
            "neither begins the other"
        );
        assert!(
            claim(space, "a:", 3, "a").is_ok(),
            "the same head, name and quota"
        );
        assert!(claim(2, "a:b:", 100, "b").is_ok(), "another gate's keys");
        drop(outer);
        let inner = claim(space, "a:b:", 100, "b").unwrap();
        assert!(claim(space, "a:", 3, "a").is_err(), "the other way round");
        drop(inner);

        let space = 3;
        let _bc = claim(space, "abc:", 3, "bc").unwrap();
        let e = claim(space, "abc:", 3, "c")
            .err()
            .expect("another policy, one head");
        assert!(
            e.reason().contains("\"bc\"") && e.reason().contains("\"c\""),
            "{e}"
        );
    }
}
