//! A raw HTTP/1.1 server on 127.0.0.1:0 for the outbound tests: it acts a script on each
//! request (answer with any fields, reset, stall a body, never answer), over plain TCP so
//! that it can misbehave as no HTTP server library would; it records what it read and
//! counts the connections it accepted; and hyper's pooled client with a backoff to call
//! it through a `RetryLayer`. Shared by `tests/http/downstreams.rs` and
//! `tests/retry/journey.rs` (each includes it with `#[path]`).

#![allow(dead_code)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use flowgate::retry::{Backoff, Jitter};
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

/// What the server does with one request.
#[derive(Debug, Clone)]
pub enum Act {
    /// Answer `status` with these fields and `body` (keep-alive).
    Answer {
        status: u16,
        fields: Vec<(&'static str, String)>,
        body: &'static str,
    },
    /// Send the head of `status` with a `Content-Length` of 1 000, ten bytes of the body,
    /// then reset the connection.
    ResetMidBody { status: u16 },
    /// Send the head of `status` with these fields and a `Content-Length` of 1 000, ten
    /// bytes of the body, then nothing more (the connection stays open).
    StallBody {
        status: u16,
        fields: Vec<(&'static str, String)>,
    },
    /// Reset the connection without answering.
    Reset,
    /// Never answer (the connection stays open).
    Hang,
}

/// A `200` with the body `ok`.
pub fn ok() -> Act {
    Act::Answer {
        status: 200,
        fields: Vec::new(),
        body: "ok",
    }
}

/// `status` with these fields and the body `busy`.
pub fn answer(status: u16, fields: &[(&'static str, &str)]) -> Act {
    Act::Answer {
        status,
        fields: fields.iter().map(|&(k, v)| (k, v.to_owned())).collect(),
        body: "busy",
    }
}

/// One request as the server read it: its method and when it came.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub at: Instant,
}

type Script = Arc<dyn Fn(u32) -> Act + Send + Sync>;

/// A raw HTTP/1.1 server on 127.0.0.1:0 acting `script(n)` on its n-th request (from 1);
/// stopped when dropped (its connections with it).
pub struct RawServer {
    addr: std::net::SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    connections: Arc<AtomicU32>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for RawServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RawServer {
    pub async fn start(script: impl Fn(u32) -> Act + Send + Sync + 'static) -> RawServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let connections = Arc::new(AtomicU32::new(0));
        let calls = Arc::new(AtomicU32::new(0));
        let script: Script = Arc::new(script);
        let task = {
            let (seen, connections) = (seen.clone(), connections.clone());
            tokio::spawn(async move {
                let mut open = tokio::task::JoinSet::new();
                loop {
                    let (stream, _) = listener.accept().await.unwrap();
                    connections.fetch_add(1, Ordering::SeqCst);
                    let (seen, calls, script) = (seen.clone(), calls.clone(), script.clone());
                    open.spawn(serve(stream, seen, calls, script));
                }
            })
        };
        RawServer {
            addr,
            seen,
            connections,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }

    /// Every request read, in order.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// The requests read.
    pub fn calls(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    /// The connections accepted.
    pub fn connections(&self) -> u32 {
        self.connections.load(Ordering::SeqCst)
    }

    /// The time between the arrivals of the `i`-th and the next request (from 0).
    pub fn gap(&self, i: usize) -> Duration {
        let seen = self.seen();
        seen[i + 1].at - seen[i].at
    }
}

/// The head of a response of `status` with `fields` and a `Content-Length` of `length`.
fn head(status: u16, fields: &[(&str, String)], length: usize) -> String {
    let reason = StatusCode::from_u16(status)
        .unwrap()
        .canonical_reason()
        .unwrap_or("Whatever");
    let mut out = format!("HTTP/1.1 {status} {reason}\r\ncontent-length: {length}\r\n");
    for (k, v) in fields {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    out
}

/// One connection: read each request (head, and a body of its `Content-Length`), act.
async fn serve(
    mut stream: TcpStream,
    seen: Arc<Mutex<Vec<Seen>>>,
    calls: Arc<AtomicU32>,
    script: Script,
) {
    let mut buf = Vec::new();
    loop {
        // The head.
        let end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let text = String::from_utf8_lossy(&buf[..end]).into_owned();
        let method = text.split(' ').next().unwrap_or_default().to_owned();
        let length = text
            .lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.trim().parse::<usize>().ok())
            .unwrap_or(0);
        while buf.len() < end + length {
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        buf.drain(..end + length);
        seen.lock().unwrap().push(Seen {
            method,
            at: Instant::now(),
        });
        let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
        match script(n) {
            Act::Answer {
                status,
                fields,
                body,
            } => {
                let out = head(status, &fields, body.len()) + body;
                if stream.write_all(out.as_bytes()).await.is_err() {
                    return;
                }
            }
            Act::ResetMidBody { status } => {
                let out = head(status, &[], 1_000) + "0123456789";
                let _ = stream.write_all(out.as_bytes()).await;
                let _ = stream.flush().await;
                // Let the client read the head before the reset.
                tokio::time::sleep(Duration::from_millis(50)).await;
                let _ = stream.set_zero_linger();
                return;
            }
            Act::StallBody { status, fields } => {
                let out = head(status, &fields, 1_000) + "0123456789";
                let _ = stream.write_all(out.as_bytes()).await;
                let _ = stream.flush().await;
                std::future::pending::<()>().await;
            }
            Act::Reset => {
                let _ = stream.set_zero_linger();
                return;
            }
            Act::Hang => {
                std::future::pending::<()>().await;
            }
        }
    }
}

/// Hyper's pooled HTTP/1.1 client.
pub type Hyper = Client<HttpConnector, Full<Bytes>>;

pub fn hyper() -> Hyper {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A request of `method` to `url`, with a small body.
pub fn request(method: Method, url: &str) -> Request<Full<Bytes>> {
    Request::builder()
        .method(method)
        .uri(url)
        .body(Full::new(Bytes::from_static(b"payload")))
        .unwrap()
}

/// A backoff without jitter (100 ms, 200 ms, ...), `attempts` at most, hints up to 60 s.
pub fn backoff(attempts: u32) -> Backoff {
    Backoff::builder()
        .jitter(Jitter::None)
        .max_attempts(attempts)
        .seed(1)
        .build()
        .unwrap()
}
