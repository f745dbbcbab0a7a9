//! `RateLimitLayerBuilder`: the policies, cost, fields, shadow mode and names of a
//! [`RateLimitLayer`], checked when it is built.

use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::AtomicU64;

use http::StatusCode;

use crate::clock::Clock;
use crate::error::{ConfigError, ConfigErrorKind};
use crate::gate::{Gate, MAX_KEY_LEN};
use crate::http::body::{InnerBody, WrapBody};
use crate::http::fields::{self, HeaderStyles, PolicyParts};
use crate::http::key::{MissingKey, RequestInfo, SHARED_ESCAPE};
use crate::http::problem::{self, QUOTA_EXCEEDED, TEMPORARY_REDUCED_CAPACITY};
use crate::http::rate_limit::layer::{
    CostFn, DECISIONS, Entry, HeadClaim, MAX_POLICIES, Outcome, RateLimitLayer, Shared,
};
use crate::http::rate_limit::policy::Policy;
use crate::http::striped::Striped;
use crate::http::topn::TopRejected;
use crate::metrics::Labels;
use crate::rate::Quota;
use crate::sync::Arc;

impl<G: Gate + 'static> RateLimitLayer<G> {
    /// A builder for a layer deciding on `gate`, by the quotas of the policies added to it
    /// (at least one): the gate's own [`Limit`](crate::gate::Limit) is not used (see
    /// "Deciding" in [`RateLimitLayer`]'s docs).
    pub fn builder(gate: G) -> RateLimitLayerBuilder<G> {
        RateLimitLayerBuilder {
            gate,
            policies: Vec::new(),
            cost: None,
            styles: HeaderStyles::IETF,
            shadow: false,
            top_rejected: TopRejected::DEFAULT_CAPACITY,
            name: None,
            prefix: String::new(),
            body: PhantomData,
        }
    }
}

/// Builds a [`RateLimitLayer`]; from [`RateLimitLayer::builder`].
#[must_use = "a builder does nothing until it is built"]
pub struct RateLimitLayerBuilder<G, K = WrapBody> {
    gate: G,
    policies: Vec<Policy>,
    cost: Option<Arc<CostFn>>,
    styles: HeaderStyles,
    shadow: bool,
    top_rejected: usize,
    name: Option<String>,
    prefix: String,
    body: PhantomData<fn() -> K>,
}

impl<G: fmt::Debug, K> fmt::Debug for RateLimitLayerBuilder<G, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .field("gate", &self.gate)
            .field("policies", &self.policies)
            .field("cost", &self.cost.as_ref().map(|_| "Fn"))
            .field("styles", &self.styles)
            .field("shadow", &self.shadow)
            .field("top_rejected", &self.top_rejected)
            .field("name", &self.name)
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl<G: Gate + 'static> RateLimitLayerBuilder<G> {
    /// Responses keep the inner service's body type `B` instead of a
    /// [`ResponseBody<B>`](crate::http::ResponseBody) (see [`InnerBody`]); the layer's own
    /// `429` / `400` / `503` bodies are `B::from(bytes)`, so the service needs
    /// `B: From<Bytes>`. Under axum, whose `Body` qualifies, this saves boxing every
    /// response body a second time: choose it there.
    pub fn inner_body(self) -> RateLimitLayerBuilder<G, InnerBody> {
        RateLimitLayerBuilder {
            gate: self.gate,
            policies: self.policies,
            cost: self.cost,
            styles: self.styles,
            shadow: self.shadow,
            top_rejected: self.top_rejected,
            name: self.name,
            prefix: self.prefix,
            body: PhantomData,
        }
    }
}

impl<G: Gate + 'static, K> RateLimitLayerBuilder<G, K> {
    /// Add a policy; a request must have room in every policy that applies to it.
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policies.push(policy);
        self
    }

    /// The cost of a request (default 1), e.g. a route's weight. A cost of zero is free
    /// (passed without a decision); a cost above a policy's burst can never be admitted:
    /// such a request gets `400 Bad Request` (see the layer's docs). The keys come first: a
    /// request without a key for a [`MissingKey::Refuse`] policy gets its `400` whatever
    /// its cost, and a request no policy applies to passes without the closure being called.
    /// The fields count units, not requests: a client pacing by them one request per unit
    /// (flowgate's `RetryLayer` does) sends up to the cost times the quota's rate.
    pub fn cost<F>(mut self, cost: F) -> Self
    where
        F: Fn(&RequestInfo<'_>) -> u32 + Send + Sync + 'static,
    {
        self.cost = Some(Arc::new(cost));
        self
    }

    /// Which header fields to write (default [`HeaderStyles::IETF`]).
    pub fn header_styles(mut self, styles: HeaderStyles) -> Self {
        self.styles = styles;
        self
    }

    /// Shadow mode: decide, count and write the fields, but never refuse (default off).
    pub fn shadow(mut self, shadow: bool) -> Self {
        self.shadow = shadow;
        self
    }

    /// How many of the most rejected keys to keep (default 64; see [`TopRejected`]).
    pub fn top_rejected(mut self, k: usize) -> Self {
        self.top_rejected = k;
        self
    }

    /// The `name` label of the layer's metrics, and its name in the logs.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// A prefix for every gate key of this layer (default none): keys are
    /// `<prefix><policy name>:<key>`, the prefix and the name joined as they are. Layers
    /// sharing a gate keep their keys apart when they have the same prefix and distinct
    /// policy names, or prefixes of which neither begins the other (`"a:"` and `"b:"`), and
    /// not otherwise: prefix `"a"` with policy `"bc"` and prefix `"ab"` with policy `"c"`
    /// both count under `abc:<key>`; a layer without a prefix (which begins every prefix)
    /// with policy `"a"` counts a client whose key is `"b:k"` under `a:b:k`, where a layer
    /// with prefix `"a:"` counts key `"k"` of its policy `"b"`. Layers whose keys meet share
    /// buckets when their quotas are the same. On a [`MemoryGate`](crate::gate::MemoryGate)
    /// each quota has buckets of its own, and nothing is refused: keep the layers sharing
    /// one apart yourself. On a [`RedisGate`](crate::gate::RedisGate) a key is one bucket,
    /// so `build` refuses a policy whose `<prefix><policy name>:` a layer alive on the same
    /// gate (or a clone of it) counts with another quota (a `/login` layer and an `/api`
    /// layer both with a policy `"per-ip"`: give them prefixes such as `"login:"` and
    /// `"api:"`), and one whose keys meet a live layer's in another way, whatever the
    /// quotas: its `<prefix><policy name>:` begins the other's or is begun by it (the layer
    /// without a prefix and the one with `"a:"` above: a client keyed `"b:k"` would spend
    /// the other's bucket of `"k"`), or is the other's from another policy name (`"a"` with
    /// `"bc"` and `"ab"` with `"c"`). The same holds for a layer rebuilt with a new quota while
    /// the old one is alive (a configuration reload): drop the old layer, its services and
    /// their response futures first, or build the new one under another prefix (its
    /// buckets start full). On Redis Cluster, a prefix
    /// with a hash tag (`"{rl}"`) puts all the keys of the layer in one slot, which an
    /// all-or-nothing call over several policies needs: without one (nor in the gate's
    /// prefix), `build` refuses several policies, unless every one of them may skip a
    /// request ([`MissingKey::Skip`]: a request that two of them apply to is then answered
    /// `503`, a gate error).
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Build the layer.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `rate_limit.key_prefix` when it leaves no room for a policy name
    /// and a key in a gate key (`<prefix><policy name>:<key>`, at most 512 bytes; longer,
    /// the gate refuses it), or when the gate cannot decide the policies' keys together: on
    /// Redis Cluster, two policies or more, one of them applying to every request (not
    /// [`MissingKey::Skip`]), whose keys carry no hash tag of one slot (in the gate's
    /// prefix, the key prefix or the names: see [`key_prefix`](Self::key_prefix)); on `rate_limit.policies` when there is no policy, more than
    /// 32, a name that is empty, not printable ASCII or contains `:`, or leaves no room for
    /// a key after the prefix, a [`MissingKey::Shared`] key that makes a gate key longer
    /// than that, two policies with one name, a policy whose gate keys a layer alive on
    /// the same [`RedisGate`](crate::gate::RedisGate) counts with another quota, or meet
    /// the keys of a policy of such a layer in another way (see
    /// [`key_prefix`](Self::key_prefix)), or quotas the gate cannot decide ([`Gate::validate_quotas`]: on a
    /// [`RedisGate`](crate::gate::RedisGate) a quota too large for exact arithmetic in
    /// Redis, on a [`MemoryGate`](crate::gate::MemoryGate), or a `RedisGate` whose failure
    /// policy falls back to one, more than 16 distinct quotas, this layer's alone or with
    /// those of the other layers alive on that gate, see below);
    /// on `rate_limit.header_styles` for both `X_RATELIMIT` and
    /// `X_RATELIMIT_EPOCH`; on `top_rejected.capacity` for 0 or above
    /// [`TopRejected::MAX_CAPACITY`].
    ///
    /// Layers that share one `MemoryGate` (clones of it, or a `RedisGate` falling back to
    /// it) share its 16 quotas: each layer registers its quotas on the gate for as long as
    /// it, a clone of it or a service made from it lives (released when the last of them
    /// is dropped, so layers built over and over do not use the gate up), and a layer
    /// whose quotas would take the registered ones past 16 distinct quotas is refused
    /// with a `ConfigError` naming the count. Direct callers of
    /// [`check_all`](crate::gate::MemoryGate::check_all) register nothing: keep their
    /// quotas and the layers' within 16 distinct ones together, or give the layers a gate
    /// of their own; past that, a request whose new quota finds no room gets a `503`
    /// (`KeyspaceFull`). The same for a quota a dropped layer released: its buckets keep
    /// their place in the gate until they are full again (at most the time the quota takes
    /// to refill its burst), so a layer built then with other quotas may see such `503`s
    /// for that long.
    ///
    /// The layer's `RateLimit-Policy` value is kept for the life of the process, shared by
    /// every layer built with the same policies (so each response copies it instead of
    /// counting a reference); past 1 024 distinct values per process (layers built over
    /// and over from new policy names) a new layer keeps its own, counted, value instead.
    pub fn build(self) -> Result<RateLimitLayer<G, K>, ConfigError> {
        if self.policies.is_empty() {
            return Err(ConfigError::zero("rate_limit.policies"));
        }
        if self.policies.len() > MAX_POLICIES {
            return Err(ConfigError::new(
                "rate_limit.policies",
                ConfigErrorKind::TooLarge,
                format!("at most {MAX_POLICIES} policies (one all-or-nothing call)"),
            ));
        }
        // A gate key is `<prefix><policy name>:<key>` and a gate refuses one longer than
        // `MAX_KEY_LEN` bytes: with no room left for a key, every request would be a 400.
        let room = |taken: usize| taken.saturating_add(2) <= MAX_KEY_LEN;
        let too_long = |field, what: String| {
            Err(ConfigError::new(
                field,
                ConfigErrorKind::TooLarge,
                format!("{what} (<prefix><policy name>:<key>, at most {MAX_KEY_LEN} bytes)"),
            ))
        };
        if !room(self.prefix.len().saturating_add(1)) {
            return too_long(
                "rate_limit.key_prefix",
                format!(
                    "{} bytes leave no room for a policy name and a key in a gate key",
                    self.prefix.len()
                ),
            );
        }
        for (i, p) in self.policies.iter().enumerate() {
            if !room(self.prefix.len().saturating_add(p.name.len())) {
                return too_long(
                    "rate_limit.policies",
                    format!(
                        "policy name {:?} ({} bytes) after the key prefix ({} bytes) leaves \
                         no room for a key in a gate key",
                        p.name,
                        p.name.len(),
                        self.prefix.len()
                    ),
                );
            }
            if let MissingKey::Shared(shared) = &p.missing {
                let len = (self.prefix.len() + p.name.len() + 1).saturating_add(shared.len());
                if len > MAX_KEY_LEN {
                    return too_long(
                        "rate_limit.policies",
                        format!(
                            "the shared key of policy {:?} for requests without one ({} \
                             bytes) makes a gate key of {len} bytes",
                            p.name,
                            shared.len()
                        ),
                    );
                }
                if shared.starts_with(SHARED_ESCAPE) {
                    return Err(ConfigError::new(
                        "rate_limit.policies",
                        ConfigErrorKind::Inconsistent,
                        format!(
                            "the shared key of policy {:?} for requests without one, {shared:?}, \
                             begins with {SHARED_ESCAPE:?}, which the layer writes before a \
                             request's key equal to the shared key: choose one that does not",
                            p.name
                        ),
                    ));
                }
            }
            if !fields::valid_name(&p.name) || p.name.contains(':') {
                return Err(ConfigError::new(
                    "rate_limit.policies",
                    ConfigErrorKind::Inconsistent,
                    format!(
                        "policy name {:?} must be non-empty printable ASCII without ':'",
                        p.name
                    ),
                ));
            }
            if self.policies[..i].iter().any(|q| q.name == p.name) {
                return Err(ConfigError::new(
                    "rate_limit.policies",
                    ConfigErrorKind::Inconsistent,
                    format!("two policies are called {:?}", p.name),
                ));
            }
        }
        if self.styles.contains(HeaderStyles::X_RATELIMIT)
            && self.styles.contains(HeaderStyles::X_RATELIMIT_EPOCH)
        {
            return Err(ConfigError::new(
                "rate_limit.header_styles",
                ConfigErrorKind::Inconsistent,
                "X_RATELIMIT and X_RATELIMIT_EPOCH both write X-RateLimit-Reset: choose one",
            ));
        }
        // Keys the gate cannot decide together (Redis Cluster: two hash slots): refused now,
        // not with a 503 on every request two policies apply to. Once a policy applies to
        // every request (it does not skip one without a key), each other policy that finds
        // a key applies with it; only policies that may all skip are left to the requests.
        let always = self.policies.iter().any(|p| p.missing != MissingKey::Skip);
        if always && self.policies.len() > 1 {
            let heads: Vec<String> = self
                .policies
                .iter()
                .map(|p| format!("{}{}:", self.prefix, p.name))
                .collect();
            let heads: Vec<&str> = heads.iter().map(String::as_str).collect();
            if let Err(e) = self.gate.validate_key_heads(&heads) {
                return Err(ConfigError::new(
                    "rate_limit.key_prefix",
                    e.kind(),
                    format!(
                        "the policies' keys cannot be decided together: {}; give the layer a \
                         key_prefix with a hash tag, such as \"{{rl}}\" (all its keys in one \
                         hash slot), or each policy a layer of its own",
                        e.reason()
                    ),
                ));
            }
        }
        // Quotas the gate can never decide: refused now, not with a 503 on every request.
        // Asked of all the policies together, and registered on the gate for as long as
        // the layer lives, so that the layers sharing a gate are refused past what it
        // decides together; when refused, the first policy refused alone is named (none is
        // when only their number is too many, alone or with the other layers').
        let quotas: Vec<Quota> = self.policies.iter().map(|p| p.quota).collect();
        let registration = match self.gate.register_quotas(&quotas) {
            Ok(registration) => registration,
            Err(all) => {
                let (which, e) = self
                    .policies
                    .iter()
                    .find_map(|p| {
                        let e = self.gate.validate_quotas(&[p.quota]).err()?;
                        Some((format!("{:?}", p.name), e))
                    })
                    .unwrap_or_else(|| ("the policies".to_string(), all));
                return Err(ConfigError::new(
                    "rate_limit.policies",
                    e.kind(),
                    format!("the gate cannot decide {which}: {}", e.reason()),
                ));
            }
        };
        // One gate key is one bucket on a gate such as Redis: a policy counting under the
        // keys another live layer counts with another quota would share its buckets.
        let heads = match self.gate.key_space() {
            Some(space) => Some(HeadClaim::new(
                space,
                self.policies
                    .iter()
                    .map(|p| (format!("{}{}:", self.prefix, p.name), p.quota, &*p.name)),
            )?),
            None => None,
        };
        let top = TopRejected::new(self.top_rejected)?;
        let policies: Box<[Entry]> = self
            .policies
            .into_iter()
            .map(|p| {
                let (q, w) = fields::policy_params(&crate::gate::Limit::TokenBucket(p.quota));
                let parts = PolicyParts::new(&p.name, q, w).expect("a valid name, checked above");
                let quota_exceeded = problem::document(
                    QUOTA_EXCEEDED,
                    StatusCode::TOO_MANY_REQUESTS,
                    &[p.name.as_str()],
                );
                Entry {
                    head: format!("{}{}:", self.prefix, p.name),
                    parts,
                    quota_exceeded,
                    policy: p,
                }
            })
            .collect();
        let all_policy = fields::policy_field(policies.iter().map(|e| e.member(0, None)))
            .map(|v| fields::static_value(&v));
        let labels = Labels::new(self.name.as_deref());
        let counter = |outcome| labels.counter(DECISIONS, &[("outcome", outcome)]);
        let counters = Outcome::ALL.map(|o| counter(o.as_str()));
        let gate_error_body = problem::document(
            TEMPORARY_REDUCED_CAPACITY,
            StatusCode::SERVICE_UNAVAILABLE,
            &[],
        );
        Ok(RateLimitLayer {
            shared: Arc::new(Shared {
                _heads: heads,
                gate: self.gate,
                policies,
                cost: self.cost,
                styles: self.styles,
                shadow: self.shadow,
                prefix: self.prefix,
                all_policy,
                gate_error_body,
                top,
                counts: Striped::new(),
                counters,
                name: self.name,
                log_clock: Clock::counter(),
                next_log_ms: AtomicU64::new(0),
                since_log: AtomicU64::new(0),
                _quotas: registration,
            }),
            body: PhantomData,
        })
    }
}
