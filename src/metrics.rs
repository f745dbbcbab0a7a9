//! Metric names, and the one internal path every component records through.
//!
//! Every primitive can be given a `name`; it becomes the `name` label of its metrics. Metric
//! names follow `flowgate_<component>_<measure>`. Handles are registered once, when the
//! primitive is built, so the hot path is one atomic operation; with the `metrics` feature
//! off, the handles are empty and every call compiles to nothing. Keys of keyed limiters are
//! never used as labels (their number is unbounded).
//!
//! Metrics are emitted through the [`metrics`](https://docs.rs/metrics) facade: install any
//! recorder (Prometheus, StatsD, …) to collect them.
//!
//! The names below are listed as components land; each is documented with its component.

// Histograms are used by components still to land.
#![allow(dead_code)]

#[cfg(feature = "metrics")]
use std::sync::Arc;

/// The label every metric carries: the primitive's name.
pub const NAME_LABEL: &str = "name";

/// The name used when a primitive was not given one.
pub const DEFAULT_NAME: &str = "default";

/// A counter handle (monotonic).
#[derive(Clone, Debug, Default)]
pub(crate) struct Counter {
    #[cfg(feature = "metrics")]
    inner: Option<metrics::Counter>,
}

/// A gauge handle (goes up and down).
#[derive(Clone, Debug, Default)]
pub(crate) struct Gauge {
    #[cfg(feature = "metrics")]
    inner: Option<metrics::Gauge>,
}

/// A histogram handle.
#[derive(Clone, Debug, Default)]
pub(crate) struct Histogram {
    #[cfg(feature = "metrics")]
    inner: Option<metrics::Histogram>,
}

/// The labels of one primitive: its name plus fixed extra labels.
#[derive(Clone, Debug)]
pub(crate) struct Labels {
    #[cfg(feature = "metrics")]
    name: Arc<str>,
}

#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
impl Labels {
    /// Labels for a primitive called `name` (or [`DEFAULT_NAME`]).
    pub(crate) fn new(name: Option<&str>) -> Labels {
        Labels {
            #[cfg(feature = "metrics")]
            name: Arc::from(name.unwrap_or(DEFAULT_NAME)),
        }
    }

    #[cfg(feature = "metrics")]
    fn all(&self, extra: &[(&'static str, &'static str)]) -> Vec<metrics::Label> {
        let mut labels = vec![metrics::Label::new(NAME_LABEL, self.name.to_string())];
        labels.extend(extra.iter().map(|&(k, v)| metrics::Label::new(k, v)));
        labels
    }

    /// Register a counter.
    pub(crate) fn counter(
        &self,
        metric: &'static str,
        extra: &[(&'static str, &'static str)],
    ) -> Counter {
        Counter {
            #[cfg(feature = "metrics")]
            inner: Some(metrics::counter!(metric, self.all(extra))),
        }
    }

    /// Register a gauge.
    pub(crate) fn gauge(
        &self,
        metric: &'static str,
        extra: &[(&'static str, &'static str)],
    ) -> Gauge {
        Gauge {
            #[cfg(feature = "metrics")]
            inner: Some(metrics::gauge!(metric, self.all(extra))),
        }
    }

    /// Register a histogram.
    pub(crate) fn histogram(
        &self,
        metric: &'static str,
        extra: &[(&'static str, &'static str)],
    ) -> Histogram {
        Histogram {
            #[cfg(feature = "metrics")]
            inner: Some(metrics::histogram!(metric, self.all(extra))),
        }
    }
}

#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
impl Counter {
    #[inline]
    pub(crate) fn increment(&self, n: u64) {
        #[cfg(feature = "metrics")]
        if let Some(c) = &self.inner {
            c.increment(n);
        }
    }
}

#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
impl Gauge {
    #[inline]
    pub(crate) fn set(&self, value: f64) {
        #[cfg(feature = "metrics")]
        if let Some(g) = &self.inner {
            g.set(value);
        }
    }

    #[inline]
    pub(crate) fn increment(&self, n: f64) {
        #[cfg(feature = "metrics")]
        if let Some(g) = &self.inner {
            g.increment(n);
        }
    }

    #[inline]
    pub(crate) fn decrement(&self, n: f64) {
        #[cfg(feature = "metrics")]
        if let Some(g) = &self.inner {
            g.decrement(n);
        }
    }
}

#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
impl Histogram {
    #[inline]
    pub(crate) fn record(&self, value: f64) {
        #[cfg(feature = "metrics")]
        if let Some(h) = &self.inner {
            h.record(value);
        }
    }
}

#[cfg(all(test, feature = "metrics"))]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    use metrics::{
        Counter as MCounter, CounterFn, Gauge as MGauge, Histogram as MHistogram, Key, KeyName,
        Metadata, Recorder, SharedString, Unit,
    };

    use super::*;

    /// Records every registration and the value of every counter.
    #[derive(Default)]
    struct TestRecorder {
        counters: Mutex<Vec<(Key, Arc<AtomicCounter>)>>,
    }

    #[derive(Default)]
    struct AtomicCounter(AtomicU64);

    impl CounterFn for AtomicCounter {
        fn increment(&self, value: u64) {
            self.0.fetch_add(value, Ordering::Relaxed);
        }
        fn absolute(&self, value: u64) {
            self.0.store(value, Ordering::Relaxed);
        }
    }

    impl Recorder for TestRecorder {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> MCounter {
            let c = Arc::new(AtomicCounter::default());
            self.counters.lock().unwrap().push((key.clone(), c.clone()));
            MCounter::from_arc(c)
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> MGauge {
            MGauge::noop()
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> MHistogram {
            MHistogram::noop()
        }
    }

    #[test]
    fn counter_is_registered_once_with_name_and_extra_labels() {
        let recorder = TestRecorder::default();
        let counter = metrics::with_local_recorder(&recorder, || {
            Labels::new(Some("stage-a")).counter("flowgate_test_dropped", &[("policy", "reject")])
        });
        counter.increment(2);
        counter.increment(3);
        let counters = recorder.counters.lock().unwrap();
        assert_eq!(counters.len(), 1);
        let (key, value) = &counters[0];
        assert_eq!(key.name(), "flowgate_test_dropped");
        let labels: Vec<_> = key.labels().map(|l| (l.key(), l.value())).collect();
        assert_eq!(labels, [("name", "stage-a"), ("policy", "reject")]);
        assert_eq!(value.0.load(Ordering::Relaxed), 5);
    }

    #[test]
    fn unnamed_primitives_use_the_default_name() {
        let recorder = TestRecorder::default();
        metrics::with_local_recorder(&recorder, || Labels::new(None).counter("flowgate_x", &[]));
        let counters = recorder.counters.lock().unwrap();
        assert_eq!(counters[0].0.labels().next().unwrap().value(), DEFAULT_NAME);
    }
}
