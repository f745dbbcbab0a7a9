//! The layer's rejection log, read from the inside (its first log comes with the first
//! rejection, the next a minute of real time later: the sketch is filled directly here).

use std::sync::{Arc, Mutex};

use http::{Request, Response, StatusCode};
use tower::{Layer, Service, ServiceExt};

use crate::Quota;
use crate::gate::{Limit, MemoryGate};
use crate::http::{Policy, RateLimitLayer, RequestInfo};

/// The `top` field of every warning logged.
#[derive(Clone, Default)]
struct TopLogs(Arc<Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for TopLogs {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Top(Option<String>);
        impl tracing::field::Visit for Top {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "top" {
                    self.0 = Some(format!("{value:?}"));
                }
            }
        }
        if *event.metadata().level() == tracing::Level::WARN {
            let mut top = Top(None);
            event.record(&mut top);
            if let Some(top) = top.0 {
                self.0.lock().unwrap().push(top);
            }
        }
    }
}

fn by_client(req: &RequestInfo<'_>, key: &mut String) -> bool {
    match req.headers.get("x-client").and_then(|v| v.to_str().ok()) {
        Some(c) => {
            key.push_str(c);
            true
        }
        None => false,
    }
}

/// Keys that rotate push one another out of the sketch, each newcomer counted from the
/// smallest count it displaced: a key rejected once can show a count of thousands. The log
/// says so, as `top_rejected` does (each key's error bound), or it blames a key that may
/// never have been rejected more than once.
#[tokio::test]
async fn the_rejection_log_gives_each_keys_error_bound() {
    use tracing_subscriber::layer::SubscriberExt;
    let logs = TopLogs::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(logs.clone()));
    let gate = MemoryGate::new(Limit::TokenBucket(Quota::per_second(1).unwrap()));
    let layer = RateLimitLayer::builder(gate)
        .policy(Policy::new(
            "per-client",
            Quota::per_minute(1).unwrap(),
            by_client,
        ))
        .top_rejected(2)
        .build()
        .unwrap();
    // Before the first rejection the layer logs: keys that each came once, rotating.
    for i in 0..1000 {
        layer.shared.top.record(&format!("per-client:rotating-{i}"));
    }
    let mut svc = layer.layer(tower::service_fn(|_req: Request<()>| async {
        Ok::<_, std::convert::Infallible>(Response::new(()))
    }));
    let mut statuses = Vec::new();
    for _ in 0..2 {
        let req = Request::builder().header("x-client", "z").body(()).unwrap();
        statuses.push(svc.ready().await.unwrap().call(req).await.unwrap().status());
    }
    assert_eq!(statuses, [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS]);
    let logged = logs.0.lock().unwrap().clone();
    let top = layer.top_rejected(5);
    assert!(
        top.iter().all(|k| k.count > 100 && k.lower_bound() <= 1),
        "every key kept has a large count that is nearly all error: {top:?}"
    );
    assert_eq!(
        logged,
        [format!("{top:?}")],
        "the log shows what top_rejected does, error bounds included"
    );
}
