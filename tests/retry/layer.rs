//! `RetryLayer` with a metrics recorder that panics: what the budget and the pacer hear of
//! an attempt does not depend on a recorder's panic, as in `retry()` (`call.rs`).

use std::convert::Infallible;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use flowgate::Rate;
use flowgate::pace::AdaptivePacer;
use flowgate::retry::{Backoff, RetryBudget, RetryLayer, RetryPolicy};
use futures::FutureExt;
use http::{Request, Response};
use tower::{Layer, Service, ServiceExt, service_fn};

use crate::support::TestRecorder;

/// A budget, an adaptive pacer at 100/s and a policy over them (attempts time out after
/// 1 s), all named `name`, whose metrics `recorder` records.
fn recorded(recorder: &TestRecorder, name: &str) -> (RetryBudget, AdaptivePacer, RetryPolicy) {
    metrics::with_local_recorder(recorder, || {
        let budget = RetryBudget::builder().name(name).build().unwrap();
        let pacer = AdaptivePacer::builder(Rate::per_second(100).unwrap())
            .name(name)
            .build()
            .unwrap();
        let policy = RetryPolicy::builder(Backoff::builder().seed(1).build().unwrap())
            .name(name)
            .budget(budget.clone())
            .pacer(pacer.clone())
            .attempt_timeout(Duration::from_secs(1))
            .build()
            .unwrap();
        (budget, pacer, policy)
    })
}

/// Send `req` through a `RetryLayer` of `policy` around `svc`: whether it panicked.
async fn panics<S>(policy: RetryPolicy, svc: S, req: Request<String>) -> bool
where
    S: Service<Request<String>, Response = Response<String>, Error = Infallible> + Clone,
{
    let client = RetryLayer::new(policy).layer(svc);
    AssertUnwindSafe(client.oneshot(req))
        .catch_unwind()
        .await
        .is_err()
}

/// A `POST` whose attempt timed out is not sent again, and the budget hears of the failure
/// before the outcome is reported: a recorder panicking on the budget's tokens gauge there
/// must not keep the back-pressure from the pacer. (Its panic skipped the report: the
/// pacer neither cut its rate nor heard of the attempt.)
#[tokio::test(start_paused = true)]
async fn a_budget_recorder_panicking_on_a_request_not_sent_again_still_tells_the_pacer() {
    let recorder = TestRecorder::default();
    let (budget, pacer, policy) = recorded(&recorder, "posted");
    recorder.panic_on("flowgate_retry_budget_tokens{name=posted}", true);
    let silent = service_fn(|_: Request<String>| {
        std::future::pending::<Result<Response<String>, Infallible>>()
    });
    let post = Request::post("/").body(String::new()).unwrap();
    assert!(panics(policy, silent, post).await, "the recorder panicked");
    recorder.panic_on("flowgate_retry_budget_tokens{name=posted}", false);
    assert_eq!(budget.tokens(), 9.0, "the failure took its token");
    assert_eq!(
        pacer.status().cuts,
        1,
        "the pacer heard of the back-pressure"
    );
}

/// The server's fields go to the pacer before the outcome is reported (policy, then
/// allowance): a recorder panicking as the pacer takes the policy's rate (its rate gauge)
/// must keep neither the allowance from the pacer nor the success from the budget. (Its
/// panic skipped both: the remaining unknown to the pacer, the token ratio not given back.)
#[tokio::test(start_paused = true)]
async fn a_pacer_recorder_panicking_on_the_servers_fields_still_reports_the_outcome() {
    let recorder = TestRecorder::default();
    let (budget, pacer, policy) = recorded(&recorder, "hinted");
    recorder.panic_on("flowgate_pace_adaptive_rate{name=hinted}", true);
    budget.on_failure();
    let limited = service_fn(|_: Request<String>| async {
        let mut res = Response::new(String::new());
        let headers = res.headers_mut();
        headers.insert("ratelimit-policy", r#""p";q=10;w=1"#.parse().unwrap());
        headers.insert("ratelimit", r#""p";r=5;t=1"#.parse().unwrap());
        Ok::<_, Infallible>(res)
    });
    let get = Request::get("/").body(String::new()).unwrap();
    assert!(panics(policy, limited, get).await, "the recorder panicked");
    recorder.panic_on("flowgate_pace_adaptive_rate{name=hinted}", false);
    let status = pacer.status();
    assert_eq!(status.server_policy, Some((10, Duration::from_secs(1))));
    assert_eq!(status.server_remaining, Some(5), "{status:?}");
    assert_eq!(budget.tokens(), 9.1, "the success gave back 0.1");
}
