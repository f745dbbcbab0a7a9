//! `RateLimitLayer`: several policies per request on any gate, decided all-or-nothing, with
//! `429`, `Retry-After`, the rate-limit header fields and a problem body.
//!
//! - [`layer`]: the policy, the layer, its builder, the shared state and the decision.
//! - [`service`]: the `Service` (poll_ready delegates; clone-after-ready).
//! - [`future`]: the response future (decides, then calls the inner service).

mod future;
mod layer;
mod policy;
mod service;

pub use future::RateLimitFuture;
pub use layer::{RateLimitLayer, RateLimitLayerBuilder, RateLimitStats};
pub use policy::Policy;
pub use service::RateLimit;
