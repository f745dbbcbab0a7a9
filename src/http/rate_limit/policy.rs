//! `Policy`: one quota, counted per key.

use std::fmt;

use crate::Quota;
use crate::http::key::{KeyExtractor, MissingKey};
use crate::sync::Arc;

/// One rate-limit policy of a [`RateLimitLayer`](crate::http::RateLimitLayer): a name, a
/// quota (a token bucket) and what each request is counted under (its
/// [`KeyExtractor`]).
///
/// The name is what clients see in the `RateLimit-Policy` / `RateLimit` fields and the
/// problem body's `violated-policies`: printable ASCII (an sf-String), without `:`, unique
/// in its layer (checked by [`RateLimitLayerBuilder::build`](crate::http::RateLimitLayerBuilder::build)).
/// A request's key in the gate is `<key prefix><policy name>:<key>` (see
/// [`RateLimitLayerBuilder::key_prefix`](crate::http::RateLimitLayerBuilder::key_prefix)).
///
/// # Examples
///
/// ```
/// use flowgate::http::{MissingKey, Policy, RequestInfo};
/// use flowgate::Quota;
///
/// // Per API key, 100 per minute; requests without one are not limited by this policy.
/// // (The key is kept, logged and sent to the gate as it is: for keys that are secrets,
/// // push a digest instead, see `Header`.)
/// let per_key = Policy::new("per-key", Quota::per_minute(100)?, |req: &RequestInfo<'_>, key: &mut String| {
///     match req.headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
///         Some(k) => { key.push_str(k); true }
///         None => false,
///     }
/// })
/// .missing_key(MissingKey::Skip);
/// assert_eq!(per_key.name(), "per-key");
/// # Ok::<(), flowgate::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct Policy {
    pub(crate) name: String,
    pub(crate) quota: Quota,
    pub(crate) key: Arc<dyn KeyExtractor>,
    pub(crate) missing: MissingKey,
}

impl Policy {
    /// A policy called `name` allowing `quota` per key, the key taken by `key`.
    /// Requests without a key share one bucket ([`MissingKey::Shared`]`("-")`) unless told
    /// otherwise with [`missing_key`](Policy::missing_key).
    pub fn new(name: impl Into<String>, quota: Quota, key: impl KeyExtractor) -> Policy {
        Policy {
            name: name.into(),
            quota,
            key: Arc::new(key),
            missing: MissingKey::default(),
        }
    }

    /// What a request without a key gets from this policy: share one bucket
    /// ([`MissingKey::Shared`], the default), not be limited by it ([`MissingKey::Skip`]),
    /// or be refused with `400 Bad Request` ([`MissingKey::Refuse`]).
    #[must_use]
    pub fn missing_key(mut self, missing: MissingKey) -> Policy {
        self.missing = missing;
        self
    }

    /// The policy's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The quota allowed per key.
    pub fn quota(&self) -> Quota {
        self.quota
    }
}

impl fmt::Debug for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Policy")
            .field("name", &self.name)
            .field("quota", &self.quota)
            .field("missing", &self.missing)
            .finish_non_exhaustive()
    }
}
