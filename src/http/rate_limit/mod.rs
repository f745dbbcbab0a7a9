//! `RateLimitLayer`: several policies per request on any gate, decided all-or-nothing, with
//! `429`, `Retry-After`, the rate-limit header fields and a problem body.
//!
//! - [`layer`]: the layer, the shared state and the decision.
//! - [`builder`]: the layer's builder, which checks the policies.
//! - [`policy`]: one policy: a name, a quota, a key.
//! - [`service`]: the `Service` (poll_ready delegates; clone-after-ready).
//! - [`future`]: the response future (decides, then calls the inner service).

mod builder;
mod future;
mod layer;
mod policy;
mod service;

pub use builder::RateLimitLayerBuilder;
pub use future::RateLimitFuture;
pub use layer::{RateLimitLayer, RateLimitStats};
pub use policy::Policy;
pub use service::RateLimit;
