//! The key both HTTP benches limit by, the `x-api-key` header, for flowgate and for
//! tower_governor (included with `#[path]` by `benches/http.rs` and `benches/http_layer.rs`).
//! Both sides look the header up by a `HeaderName` made once, as a user's code would: a
//! lookup by `&str` parses the name again on every request (a few hundred instructions).

use flowgate::http::Header;
use http::{HeaderName, HeaderValue, Request};
use tower_governor::GovernorError;

/// The header both sides read.
pub const X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");

/// flowgate's key: the built-in [`Header`] extractor over the same name.
pub fn api_key() -> Header {
    Header::from(X_API_KEY)
}

/// tower_governor's key: the same header (its `HeaderValue`, cloned: a reference count, no
/// allocation; the cheapest key the crate allows).
#[derive(Debug, Clone, Copy)]
pub struct ApiKey;

impl tower_governor::key_extractor::KeyExtractor for ApiKey {
    type Key = HeaderValue;

    fn extract<T>(&self, req: &Request<T>) -> Result<HeaderValue, GovernorError> {
        req.headers()
            .get(&X_API_KEY)
            .cloned()
            .ok_or(GovernorError::UnableToExtractKey)
    }
}
