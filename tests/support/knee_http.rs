//! An HTTP endpoint on loopback as a knee target: `GET url` with hyper's client, shared by
//! `examples/knee.rs` (`#[path]`) and `tests/knee.rs`.
//!
//! Only loopback addresses are accepted (`127.0.0.0/8`, `::1`, `localhost`): the knee
//! finder drives a service into overload on purpose, which is fine for a server on this
//! machine and never for someone else's.

#![allow(dead_code, unreachable_pub)]

use std::fmt;
use std::future::poll_fn;
use std::net::IpAddr;
use std::pin::Pin;

use flowgate::adaptive::Outcome;
use flowgate::adaptive::knee::KneeTarget;
use futures::future::BoxFuture;
use hyper::body::Body;
use hyper::{Request, StatusCode, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Why a URL was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum UrlError {
    /// Not a URL.
    Invalid(String),
    /// A scheme other than `http` (the knee finder speaks plain HTTP/1.1 to loopback).
    Scheme(String),
    /// The host is not a loopback address.
    NotLoopback(String),
}

impl fmt::Display for UrlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UrlError::Invalid(why) => write!(f, "not a URL: {why}"),
            UrlError::Scheme(scheme) => {
                write!(f, "scheme {scheme:?} refused: only http is supported")
            }
            UrlError::NotLoopback(host) => write!(
                f,
                "host {host:?} refused: the knee finder overloads its target on purpose, so only loopback addresses are accepted"
            ),
        }
    }
}

impl std::error::Error for UrlError {}

/// Parse `url` and accept it only if it is `http://` to a loopback host.
pub fn loopback_uri(url: &str) -> Result<Uri, UrlError> {
    let uri: Uri = url
        .parse()
        .map_err(|e: hyper::http::uri::InvalidUri| UrlError::Invalid(e.to_string()))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some(other) => return Err(UrlError::Scheme(other.to_owned())),
        None => return Err(UrlError::Scheme(String::new())),
    }
    let host = uri
        .host()
        .ok_or_else(|| UrlError::Invalid("no host".to_owned()))?;
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let loopback = bare.eq_ignore_ascii_case("localhost")
        || bare.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if !loopback {
        return Err(UrlError::NotLoopback(host.to_owned()));
    }
    Ok(uri)
}

/// `GET uri`, the body read to its end: `2xx`/`3xx` is `Ok`; `429`, `503`, any other `5xx`
/// and a failed connection are back-pressure; other `4xx` are ignored.
#[derive(Debug, Clone)]
pub struct HttpTarget {
    client: Client<HttpConnector, String>,
    uri: Uri,
}

impl HttpTarget {
    /// A target for `url` (checked with [`loopback_uri`]).
    pub fn new(url: &str) -> Result<HttpTarget, UrlError> {
        let uri = loopback_uri(url)?;
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).build(connector);
        Ok(HttpTarget { client, uri })
    }

    /// The URL called.
    pub fn uri(&self) -> &Uri {
        &self.uri
    }
}

impl KneeTarget for HttpTarget {
    fn call(&self) -> BoxFuture<'_, Outcome> {
        Box::pin(async move {
            let Ok(request) = Request::get(self.uri.clone()).body(String::new()) else {
                return Outcome::Ignored;
            };
            let Ok(response) = self.client.request(request).await else {
                return Outcome::BackPressure;
            };
            let status = response.status();
            let mut body = response.into_body();
            while let Some(frame) = poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
                if frame.is_err() {
                    return Outcome::BackPressure;
                }
            }
            classify(status)
        })
    }
}

fn classify(status: StatusCode) -> Outcome {
    if status.is_success() || status.is_redirection() {
        Outcome::Ok
    } else if status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error() {
        Outcome::BackPressure
    } else {
        Outcome::Ignored
    }
}
