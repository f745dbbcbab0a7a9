//! [`Logs`]: the `tracing` events of a test, captured on its thread, each with its level,
//! message and fields as text.

use std::fmt;
use std::sync::{Arc, Mutex};

use tracing::Level;
use tracing::field::{Field, Visit};
use tracing::subscriber::DefaultGuard;
use tracing_subscriber::layer::{Context, SubscriberExt};

/// One event: its level, where from, its message and its other fields (strings without quotes, the
/// rest as `Debug`, `%` fields as `Display`).
#[derive(Debug, Clone)]
pub struct Logged {
    pub level: Level,
    /// The module that logged it (`flowgate::gate::batch`).
    pub target: &'static str,
    pub message: String,
    pub fields: Vec<(&'static str, String)>,
}

impl Logged {
    /// The field `name`, as text.
    pub fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The events captured so far; clones share them.
#[derive(Clone, Default)]
pub struct Logs(Arc<Mutex<Vec<Logged>>>);

impl Logs {
    /// Capture the events of this thread (every task of a current-thread runtime) until
    /// the guard drops.
    pub fn capture() -> (Logs, DefaultGuard) {
        let logs = Logs::default();
        let guard =
            tracing::subscriber::set_default(tracing_subscriber::registry().with(logs.clone()));
        (logs, guard)
    }

    /// Every event so far, in order.
    pub fn events(&self) -> Vec<Logged> {
        self.0.lock().unwrap().clone()
    }

    /// The events whose message contains `part`.
    pub fn containing(&self, part: &str) -> Vec<Logged> {
        self.events()
            .into_iter()
            .filter(|e| e.message.contains(part))
            .collect()
    }
}

struct Fields<'a>(&'a mut Logged);

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.record(field, value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.record(field, format!("{value:?}"));
    }
}

impl Fields<'_> {
    fn record(&mut self, field: &Field, value: String) {
        if field.name() == "message" {
            self.0.message = value;
        } else {
            self.0.fields.push((field.name(), value));
        }
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Logs {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut logged = Logged {
            level: *event.metadata().level(),
            target: event.metadata().target(),
            message: String::new(),
            fields: Vec::new(),
        };
        event.record(&mut Fields(&mut logged));
        self.0.lock().unwrap().push(logged);
    }
}

/// What [`Logs::global`] keeps: events of `flowgate::region::member` (the refresher) and
/// `flowgate::gate::backend` (a gate's transitions) at info or above.
struct RegionLogs(Logs);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for RegionLogs {
    fn enabled(&self, meta: &tracing::Metadata<'_>, _: Context<'_, S>) -> bool {
        matches!(
            meta.target(),
            "flowgate::region::member" | "flowgate::gate::backend"
        ) && *meta.level() <= Level::INFO
    }

    fn on_event(&self, event: &tracing::Event<'_>, cx: Context<'_, S>) {
        self.0.on_event(event, cx);
    }
}

impl Logs {
    /// The region refresher's and the gate backend's events at info or above, of every
    /// thread, captured by a subscriber installed for the whole test process on first use.
    /// A thread's own subscriber ([`capture`](Logs::capture)) missed events in test
    /// binaries whose tests share threads under `cargo test`: filter these by a field of
    /// your own (the allocator's or the gate's name).
    pub fn global() -> Logs {
        static GLOBAL: std::sync::OnceLock<Logs> = std::sync::OnceLock::new();
        GLOBAL
            .get_or_init(|| {
                let logs = Logs::default();
                tracing::subscriber::set_global_default(
                    tracing_subscriber::registry().with(RegionLogs(logs.clone())),
                )
                .expect("no other global subscriber in this test binary");
                logs
            })
            .clone()
    }
}
