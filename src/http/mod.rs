//! The HTTP edge (feature `http`): tower layers that answer 429 and 503 the way clients and
//! proxies expect.
//!
//! - [`RateLimitLayer`] decides every request against one or more policies (per IP, per API
//!   key, per tenant: each its own quota and key) on any [`Gate`](crate::gate::Gate) with
//!   a `check_all` (a `RegionGate` has none: the layer's `build` refuses it),
//!   all-or-nothing, and writes the IETF `RateLimit-Policy` / `RateLimit` fields
//!   (draft-ietf-httpapi-ratelimit-headers, -10/-11 syntax) on every response; a rejection
//!   is a `429` with `Retry-After` and an RFC 9457 problem body naming the violated policies.
//! - [`ShedLayer`] puts a [`Bulkhead`](crate::bulkhead::Bulkhead) in front of a service: a
//!   classifier marks each request critical, normal or sheddable; when the bulkhead is full
//!   the request gets a `503` with `Retry-After`, while critical routes keep their reserve;
//!   when it is closed (the server shutting down), a going-away `503` a client tells apart.
//! - Keys come from a [`KeyExtractor`]: the peer IP, the client IP behind trusted proxies
//!   only, a header, a constant, or a closure.
//! - Responses have a [`ResponseBody`] over the inner body by default; under axum, build the
//!   rate-limit layer with [`inner_body`](RateLimitLayerBuilder::inner_body) so responses keep
//!   axum's `Body` ([`BodyMode`]). [`ShedLayer`]'s responses keep a [`ResponseBody`]: its
//!   bulkhead permit travels in the body until the response is sent.
//!
//! Both layers follow tower's rules: `poll_ready` only asks the inner service, the decision
//! is made in the response future (an idle keep-alive connection holds nothing), the inner
//! service is cloned after it was ready, and clones share their state.

mod body;
mod client_ip;
pub(crate) mod fields;
mod key;
mod problem;
mod rate_limit;
mod shed;
mod striped;
mod topn;
mod warn_once;

pub use body::{BodyMode, InnerBody, ResponseBody, WrapBody};
pub use client_ip::{ClientIp, ClientIpBuilder, ForwardedHeader};
pub use fields::HeaderStyles;
pub use key::{Constant, Header, KeyExtractor, MissingKey, PeerIp, RequestInfo};
pub use rate_limit::{
    Policy, RateLimit, RateLimitFuture, RateLimitLayer, RateLimitLayerBuilder, RateLimitStats,
};
pub use shed::{Class, ClassStats, Shed, ShedFuture, ShedLayer, ShedLayerBuilder, ShedStats};
pub use topn::{RejectedKey, TopRejected};
