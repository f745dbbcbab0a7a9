//! A real server and a real client for the HTTP tests.

#![allow(dead_code)]

use std::net::SocketAddr;

use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// A server running `app` on 127.0.0.1:0, with the peer address in each request's
/// extensions (axum's `ConnectInfo<SocketAddr>`); stopped when dropped.
pub struct Server {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Server {
    pub async fn start(app: Router) -> Server {
        Server::start_on("127.0.0.1:0", app).await
    }

    /// `app` served on `bind` (a loopback address with port 0), with the peer's address in
    /// each request's `ConnectInfo`.
    pub async fn start_on(bind: &str, app: Router) -> Server {
        let listener = tokio::net::TcpListener::bind(bind).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .await
            .unwrap();
        });
        Server { addr, task }
    }

    /// `svc` (a layer around a whole router, say) served on 127.0.0.1:0 as axum serves any
    /// service, with the peer's address in each request's `ConnectInfo`.
    pub async fn start_service<S>(svc: S) -> Server
    where
        S: tower::Service<
                Request<axum::body::Body>,
                Response = axum::response::Response,
                Error = std::convert::Infallible,
            > + Clone
            + Send
            + 'static,
        S::Future: Send,
    {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(
                listener,
                axum::ServiceExt::<Request<axum::body::Body>>::into_make_service_with_connect_info::<
                    SocketAddr,
                >(svc),
            )
            .await
            .unwrap();
        });
        Server { addr, task }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }
}

/// A keep-alive HTTP/1 client (hyper-util's pooled client).
pub fn client() -> Client<HttpConnector, Empty<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// What a response said: its status, its header fields and its body.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// `GET url` with `headers`; the whole answer.
pub async fn get(
    client: &Client<HttpConnector, Empty<Bytes>>,
    url: &str,
    headers: &[(&str, &str)],
) -> Answer {
    let mut req = Request::get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let res = client
        .request(req.body(Empty::new()).unwrap())
        .await
        .unwrap();
    let (parts, body) = res.into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

/// All lines of field `name` joined as one list, as RFC 9110 combines them.
pub fn field(headers: &HeaderMap, name: &str) -> Option<String> {
    let lines: Vec<&str> = headers
        .get_all(name)
        .iter()
        .map(|v| v.to_str().unwrap())
        .collect();
    (!lines.is_empty()).then(|| lines.join(", "))
}

/// Every outcome a `RateLimitLayer` counted, added up.
pub fn outcomes(s: &flowgate::http::RateLimitStats) -> u64 {
    s.admitted
        + s.rejected
        + s.shadow_rejected
        + s.gate_error
        + s.fail_open
        + s.fail_closed
        + s.missing_key
        + s.bad_request
        + s.cancelled
}
