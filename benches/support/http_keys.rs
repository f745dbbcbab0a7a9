//! The key both HTTP benches limit by, the `x-api-key` header, for flowgate and for
//! tower_governor (included with `#[path]` by `benches/http.rs` and `benches/http_layer.rs`).

use flowgate::http::RequestInfo;
use http::{HeaderValue, Request};
use tower_governor::GovernorError;

/// flowgate's key: the `x-api-key` header, written into the layer's reused key buffer.
pub fn api_key(req: &RequestInfo<'_>, key: &mut String) -> bool {
    match req.headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
        Some(v) => {
            key.push_str(v);
            true
        }
        None => false,
    }
}

/// tower_governor's key: the same header (its `HeaderValue`, cloned: a reference count, no
/// allocation; the cheapest key the crate allows).
#[derive(Debug, Clone, Copy)]
pub struct ApiKey;

impl tower_governor::key_extractor::KeyExtractor for ApiKey {
    type Key = HeaderValue;

    fn extract<T>(&self, req: &Request<T>) -> Result<HeaderValue, GovernorError> {
        req.headers()
            .get("x-api-key")
            .cloned()
            .ok_or(GovernorError::UnableToExtractKey)
    }
}
