//! `RetryLayer`'s error says why the retries stopped and how many attempts were made, for
//! each stop: the attempts used up, the deadline, the budget, a request that may not be
//! sent twice, a fatal error, a timeout. Paused time, `tower::service_fn` downstreams.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use flowgate::retry::{
    Backoff, GiveUp, HttpClassify, Jitter, Outcome, RetryBudget, RetryError, RetryInfo, RetryLayer,
    RetryPolicy, Stop,
};
use http::{Method, Request, Response, StatusCode};
use tower::{Layer, Service, ServiceExt, service_fn};

const MS: Duration = Duration::from_millis(1);

#[derive(Debug, PartialEq)]
struct Reset(u32);

impl std::fmt::Display for Reset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "connection reset ({})", self.0)
    }
}

impl std::error::Error for Reset {}

/// No jitter: 100 ms, 200 ms, 400 ms, ...; at most `attempts` attempts.
fn backoff(attempts: u32) -> Backoff {
    Backoff::builder()
        .base(100 * MS)
        .jitter(Jitter::None)
        .max_attempts(attempts)
        .seed(1)
        .build()
        .unwrap()
}

fn request(method: Method) -> Request<String> {
    Request::builder()
        .method(method)
        .uri("/")
        .body(String::new())
        .unwrap()
}

/// A downstream whose n-th call (from 1) resets the connection: `Reset(n)`.
fn resets() -> impl Service<
    Request<String>,
    Response = Response<String>,
    Error = Reset,
    Future = impl Future<Output = Result<Response<String>, Reset>> + Send,
> + Clone {
    let calls = Arc::new(AtomicU32::new(0));
    service_fn(move |_req: Request<String>| {
        let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
        async move { Err::<Response<String>, _>(Reset(n)) }
    })
}

/// A `GET` through `layer` to a downstream that always resets: the error.
async fn get(layer: RetryLayer, method: Method) -> RetryError<Reset> {
    layer
        .layer(resets())
        .oneshot(request(method))
        .await
        .unwrap_err()
}

#[tokio::test(start_paused = true)]
async fn attempts_used_up() {
    let err = get(
        RetryLayer::new(RetryPolicy::builder(backoff(3)).build().unwrap()),
        Method::GET,
    )
    .await;
    assert_eq!(err.stop(), Stop::GaveUp(GiveUp::Attempts { attempts: 3 }));
    assert_eq!(err.attempts(), 3);
    assert_eq!(
        err.to_string(),
        "gave up after 3 attempts: connection reset (3)"
    );
    assert_eq!(err.inner(), Some(&Reset(3)));
    // Its message is in the error's own: the source is its source (it has none).
    assert!(std::error::Error::source(&err).is_none());
    assert_eq!(err.into_inner(), Some(Reset(3)));
}

#[tokio::test(start_paused = true)]
async fn deadline_reached() {
    // Attempts at 0 and 100 ms; the next would start at 300 ms, past the deadline.
    let backoff = Backoff::builder()
        .base(100 * MS)
        .jitter(Jitter::None)
        .deadline(250 * MS)
        .seed(1)
        .build()
        .unwrap();
    let err = get(
        RetryLayer::new(RetryPolicy::builder(backoff).build().unwrap()),
        Method::GET,
    )
    .await;
    assert!(
        matches!(err.stop(), Stop::GaveUp(GiveUp::Deadline { deadline, .. }) if deadline == 250 * MS),
        "{err:?}"
    );
    assert_eq!(err.attempts(), 2);
    assert_eq!(err.into_inner(), Some(Reset(2)));
}

#[tokio::test(start_paused = true)]
async fn budget_empty() {
    // 3 tokens: the first failure leaves 2 (a retry), the second 1 (no more).
    let policy = RetryPolicy::builder(backoff(5))
        .budget(RetryBudget::new(3, 0.1).unwrap())
        .build()
        .unwrap();
    let err = get(RetryLayer::new(policy), Method::GET).await;
    assert_eq!(err.stop(), Stop::Budget);
    assert_eq!(err.attempts(), 2);
    assert_eq!(
        err.to_string(),
        "retry budget exhausted (2 attempts): connection reset (2)"
    );
    assert_eq!(err.into_inner(), Some(Reset(2)));
}

/// A reset `POST` may have been acted on: not sent again, and the error says so, not
/// "fatal" (the classifier called it retryable).
#[tokio::test(start_paused = true)]
async fn a_post_is_not_sent_twice() {
    let err = get(
        RetryLayer::new(RetryPolicy::builder(backoff(3)).build().unwrap()),
        Method::POST,
    )
    .await;
    assert_eq!(err.stop(), Stop::NotRetryable);
    assert_eq!(err.attempts(), 1);
    assert_eq!(
        err.to_string(),
        "not retried, the request may not be sent twice (1 attempt): connection reset (1)"
    );
    assert_eq!(err.into_inner(), Some(Reset(1)));

    // A `500` to a `POST`: the response, whose `RetryInfo` says the same.
    let server = service_fn(|_req: Request<String>| async {
        let mut res = Response::new(String::new());
        *res.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
        Ok::<_, Reset>(res)
    });
    let res = RetryLayer::new(RetryPolicy::builder(backoff(3)).build().unwrap())
        .layer(server)
        .oneshot(request(Method::POST))
        .await
        .unwrap();
    let info = res.extensions().get::<RetryInfo>().cloned().unwrap();
    assert_eq!((info.attempts, info.stop), (1, Stop::NotRetryable));
}

#[tokio::test(start_paused = true)]
async fn classified_fatal() {
    let layer = RetryLayer::new(RetryPolicy::builder(backoff(3)).build().unwrap()).classify(
        |r: &Result<Response<String>, Reset>| match r {
            Ok(res) => HttpClassify::new().outcome(res.status(), res.headers()),
            Err(_) => Outcome::Fatal,
        },
    );
    let err = layer
        .layer(resets())
        .oneshot(request(Method::GET))
        .await
        .unwrap_err();
    assert_eq!(err.stop(), Stop::Fatal);
    assert_eq!(err.attempts(), 1);
    assert_eq!(
        err.to_string(),
        "fatal, not retried (1 attempt): connection reset (1)"
    );
    assert_eq!(err.into_inner(), Some(Reset(1)));
}

#[tokio::test(start_paused = true)]
async fn last_attempt_timed_out() {
    let policy = RetryPolicy::builder(backoff(2))
        .attempt_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let hangs = service_fn(|_req: Request<String>| {
        std::future::pending::<Result<Response<String>, Reset>>()
    });
    let err = RetryLayer::new(policy)
        .layer(hangs)
        .oneshot(request(Method::GET))
        .await
        .unwrap_err();
    assert_eq!(err.stop(), Stop::TimedOut);
    assert_eq!(err.attempts(), 2);
    assert_eq!(err.to_string(), "the last of 2 attempts timed out");
    assert_eq!(err.into_inner(), None);
}
