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
//! Each metric is documented with its component.
//!
//! The recorder is user code: a panic in it reaches the caller, as user code's does, except
//! while the thread already unwinds from another panic (a permit or token dropped by that
//! unwinding records its change): there it is caught and dropped, since a second panic in a
//! destructor would abort the process.
//!
//! # Install the recorder first
//!
//! A primitive registers its metrics with the recorder in place when it is built (the
//! global one, or the one of a [`metrics::with_local_recorder`](https://docs.rs/metrics/0.24/metrics/fn.with_local_recorder.html)
//! around the build) and records into those handles for its whole life. One built before
//! any recorder was installed records nothing, ever, not even after a recorder is
//! installed: its series never appear. Install the exporter at the start of `main`, before
//! building the channels, bulkheads, pacers, gates and layers it should see (a primitive
//! in a `static` or `LazyLock` is built when first used: after the install, if the install
//! comes first).
//!
//! # Unnamed primitives
//!
//! Primitives not given a name share the label `name="default"`. Their counters and
//! histograms add up there, and so do their gauges: every gauge handle records its own
//! instance's value as a contribution (changes are sent as increments and decrements, and
//! what is left is taken back when the primitive is dropped), so two unnamed channels
//! report the sum of their depths rather than overwriting each other. Name a primitive to
//! see it on its own.

#[cfg(feature = "metrics")]
use std::sync::Arc;
#[cfg(feature = "metrics")]
use std::sync::atomic::{AtomicU64, Ordering};

/// The label every metric carries: the primitive's name.
pub const NAME_LABEL: &str = "name";

/// The name used when a primitive was not given one.
pub const DEFAULT_NAME: &str = "default";

/// Make one call into the recorder, which is user code. Its panic goes on to the caller,
/// as user code's does, except while the thread already unwinds from another panic: the
/// call then comes from a drop (a permit, a token, a primitive dropped by that unwinding),
/// where a second panic would abort the process, so it is caught and dropped and the first
/// panic goes on.
#[cfg(feature = "metrics")]
#[inline]
fn recording(call: impl FnOnce()) {
    if std::thread::panicking() {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(call));
    } else {
        call();
    }
}

/// A counter handle (monotonic).
#[derive(Clone, Debug, Default)]
pub(crate) struct Counter {
    #[cfg(feature = "metrics")]
    inner: Option<metrics::Counter>,
}

/// A gauge handle (goes up and down): one primitive instance's contribution to its gauge.
/// Clones share the contribution; when the last clone is dropped, the contribution is taken
/// back, so gauges sharing a label (unnamed primitives) always show the sum of the live
/// instances' values. A [`set`](Gauge::set) is sent as the change from what the recorder was
/// sent before, rounded as the recorder adds it, so rounding errors never add up: a gauge
/// alone on its labels reads the value set, and 0 once dropped.
#[derive(Clone, Debug, Default)]
pub(crate) struct Gauge {
    #[cfg(feature = "metrics")]
    inner: Option<Arc<Share>>,
}

/// A gauge and what this instance has added to it.
#[cfg(feature = "metrics")]
struct Share {
    gauge: metrics::Gauge,
    /// This instance's value as the recorder was sent it (the sum of its changes, rounded
    /// as the recorder adds them), as `f64` bits: what is taken back when it is dropped.
    value: AtomicU64,
}

#[cfg(feature = "metrics")]
impl std::fmt::Debug for Share {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Share")
            .field("value", &f64::from_bits(self.value.load(Ordering::Relaxed)))
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "metrics")]
impl Drop for Share {
    fn drop(&mut self) {
        let left = f64::from_bits(*self.value.get_mut());
        if left != 0.0 {
            recording(|| self.gauge.decrement(left));
        }
    }
}

/// A gauge moved only by changes, whose owner keeps the value itself (a count it needs
/// anyway, like a bulkhead's permits in flight) and takes back what is left when it is
/// dropped ([`Tally::add`] with the negated remainder). Unlike [`Gauge`] it keeps no share of
/// its own, so a change is one call into the recorder, and nothing with no recorder
/// installed: no atomic operation on the owner's hot path. Changes commute, as
/// [`Gauge::add`]'s do.
#[derive(Clone, Debug, Default)]
pub(crate) struct Tally {
    #[cfg(feature = "metrics")]
    inner: Option<metrics::Gauge>,
}

/// A histogram handle.
#[derive(Clone, Debug, Default)]
pub(crate) struct Histogram {
    #[cfg(feature = "metrics")]
    inner: Option<metrics::Histogram>,
}

// A metric handle only records (atomic adds on the recorder's side); a panic elsewhere
// cannot leave it half-updated in a way a later caller would observe. Declaring it unwind
// safe lets every primitive that holds handles be unwind safe, as tokio's handles are.
impl std::panic::UnwindSafe for Counter {}
impl std::panic::RefUnwindSafe for Counter {}
impl std::panic::UnwindSafe for Gauge {}
impl std::panic::RefUnwindSafe for Gauge {}
impl std::panic::UnwindSafe for Tally {}
impl std::panic::RefUnwindSafe for Tally {}
impl std::panic::UnwindSafe for Histogram {}
impl std::panic::RefUnwindSafe for Histogram {}

/// The labels of one primitive: its name plus fixed extra labels.
#[derive(Clone, Debug)]
pub(crate) struct Labels {
    #[cfg(feature = "metrics")]
    name: Arc<str>,
    /// Labels of bounded, configured values (a region of an allocator), on every metric.
    #[cfg(feature = "metrics")]
    fixed: Vec<(&'static str, Arc<str>)>,
}

#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
impl Labels {
    /// Labels for a primitive called `name` (or [`DEFAULT_NAME`]).
    pub(crate) fn new(name: Option<&str>) -> Labels {
        Labels {
            #[cfg(feature = "metrics")]
            name: Arc::from(name.unwrap_or(DEFAULT_NAME)),
            #[cfg(feature = "metrics")]
            fixed: Vec::new(),
        }
    }

    /// These labels plus `key = value` on every metric. Only for values from configuration
    /// (a bounded set), never for user keys.
    #[cfg(feature = "redis")]
    pub(crate) fn with(self, key: &'static str, value: &str) -> Labels {
        #[cfg(feature = "metrics")]
        let mut labels = self;
        #[cfg(feature = "metrics")]
        labels.fixed.push((key, Arc::from(value)));
        #[cfg(not(feature = "metrics"))]
        let labels = self;
        labels
    }

    #[cfg(feature = "metrics")]
    fn all(&self, extra: &[(&'static str, &'static str)]) -> Vec<metrics::Label> {
        let mut labels = vec![metrics::Label::new(NAME_LABEL, self.name.to_string())];
        labels.extend(
            self.fixed
                .iter()
                .map(|(k, v)| metrics::Label::new(*k, v.to_string())),
        );
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
            inner: Some(Arc::new(Share {
                gauge: metrics::gauge!(metric, self.all(extra)),
                value: AtomicU64::new(0f64.to_bits()),
            })),
        }
    }

    /// Register a tally (see [`Tally`]).
    pub(crate) fn tally(
        &self,
        metric: &'static str,
        extra: &[(&'static str, &'static str)],
    ) -> Tally {
        Tally {
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
            recording(|| c.increment(n));
        }
    }
}

#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
impl Gauge {
    /// Set this instance's value: the gauge moves by the difference.
    #[inline]
    pub(crate) fn set(&self, value: f64) {
        #[cfg(feature = "metrics")]
        if let Some(share) = &self.inner {
            // Worked out from what was sent, not from the value set before: the recorder
            // adds up the changes, rounded, and a change from the previous value would
            // leave its rounding there for good (10 - 9.9 + 9.8 - … drifts off the tokens
            // of a retry budget, and a dropped one's gauge off 0).
            let mut moves = (0.0, 0.0);
            let _ = share
                .value
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |bits| {
                    let shown = f64::from_bits(bits);
                    moves = changes(shown, value);
                    Some((shown + moves.0 + moves.1).to_bits())
                });
            for delta in [moves.0, moves.1] {
                if delta != 0.0 {
                    recording(|| share.gauge.increment(delta));
                }
            }
        }
    }
}

/// The changes that move a gauge from `shown` to `value`: `value - shown`, and, if that
/// change, rounded, lands off `value` (0.3 + (1.3 - 0.3) is not 1.3 in `f64`), what it
/// missed by (exact: the two are that close), else 0.
/// A primitive that works out its gauges' changes itself (to add them with no lock held)
/// moves them with these too.
#[inline]
pub(crate) fn changes(shown: f64, value: f64) -> (f64, f64) {
    let first = value - shown;
    (first, value - (shown + first))
}

#[cfg(all(test, feature = "metrics"))]
impl Gauge {
    /// This instance's value, for unit tests of the primitives that set it.
    pub(crate) fn value(&self) -> f64 {
        self.inner.as_ref().map_or(0.0, |share| {
            f64::from_bits(share.value.load(Ordering::Acquire))
        })
    }
}

#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
impl Gauge {
    /// Move this instance's value by `delta`. Unlike [`set`](Gauge::set), changes commute:
    /// a primitive may read a change under its lock and record it after releasing the lock,
    /// in any order with other threads' changes, and the gauge still ends at the sum.
    #[inline]
    pub(crate) fn add(&self, delta: f64) {
        #[cfg(feature = "metrics")]
        if let Some(share) = &self.inner
            && delta != 0.0
        {
            // `f` never refuses, so this is always `Ok`.
            let _ = share
                .value
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |bits| {
                    Some((f64::from_bits(bits) + delta).to_bits())
                });
            recording(|| share.gauge.increment(delta));
        }
    }
}

#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
impl Tally {
    /// Move the gauge by `delta`.
    #[inline]
    pub(crate) fn add(&self, delta: f64) {
        #[cfg(feature = "metrics")]
        if let Some(gauge) = &self.inner
            && delta != 0.0
        {
            recording(|| gauge.increment(delta));
        }
    }
}

#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
impl Histogram {
    #[inline]
    pub(crate) fn record(&self, value: f64) {
        #[cfg(feature = "metrics")]
        if let Some(h) = &self.inner {
            recording(|| h.record(value));
        }
    }
}

#[cfg(all(test, feature = "metrics"))]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    use metrics::{
        Counter as MCounter, CounterFn, Gauge as MGauge, GaugeFn, Histogram as MHistogram, Key,
        KeyName, Metadata, Recorder, SharedString, Unit,
    };

    use super::*;

    /// Records every registration and the value of every counter.
    #[derive(Default)]
    struct TestRecorder {
        counters: Mutex<Vec<(Key, Arc<AtomicCounter>)>>,
        gauges: Mutex<Vec<(Key, Arc<AtomicGauge>)>>,
    }

    /// An `f64` as bits.
    #[derive(Default)]
    struct AtomicGauge(AtomicU64);

    impl AtomicGauge {
        fn get(&self) -> f64 {
            f64::from_bits(self.0.load(Ordering::Relaxed))
        }
        fn update(&self, f: impl Fn(f64) -> f64) {
            let _ = self
                .0
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                    Some(f(f64::from_bits(b)).to_bits())
                });
        }
    }

    impl GaugeFn for AtomicGauge {
        fn increment(&self, value: f64) {
            self.update(|v| v + value);
        }
        fn decrement(&self, value: f64) {
            self.update(|v| v - value);
        }
        fn set(&self, value: f64) {
            self.update(|_| value);
        }
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
        fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> MGauge {
            // One gauge per key, as a real recorder keeps it.
            let mut gauges = self.gauges.lock().unwrap();
            if let Some((_, g)) = gauges.iter().find(|(k, _)| k == key) {
                return MGauge::from_arc(g.clone());
            }
            let g = Arc::new(AtomicGauge::default());
            gauges.push((key.clone(), g.clone()));
            MGauge::from_arc(g)
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

    #[test]
    fn unnamed_gauges_add_up_and_a_dropped_one_takes_its_share_back() {
        let recorder = TestRecorder::default();
        let (a, b) = metrics::with_local_recorder(&recorder, || {
            let labels = Labels::new(None);
            (
                labels.gauge("flowgate_test_depth", &[]),
                labels.gauge("flowgate_test_depth", &[]),
            )
        });
        let total = recorder.gauges.lock().unwrap()[0].1.clone();
        a.set(3.0);
        b.set(4.0);
        assert_eq!(
            total.get(),
            7.0,
            "two unnamed instances: the sum, not the last set"
        );
        a.set(1.0);
        assert_eq!(total.get(), 5.0);
        let a2 = a.clone();
        drop(a);
        assert_eq!(total.get(), 5.0, "a clone still holds the share");
        drop(a2);
        assert_eq!(
            total.get(),
            4.0,
            "the dropped instance's share is taken back"
        );
        drop(b);
        assert_eq!(total.get(), 0.0);
    }

    #[test]
    fn a_set_gauge_reads_each_value_set_and_0_once_dropped() {
        let recorder = TestRecorder::default();
        let gauge = metrics::with_local_recorder(&recorder, || {
            Labels::new(Some("alone")).gauge("flowgate_test_depth", &[])
        });
        let total = recorder.gauges.lock().unwrap()[0].1.clone();
        // Jumps whose changes round (1.3 - 0.3, 0.2 - 1.2), tiny and huge values.
        for value in [
            0.1,
            1.3,
            0.3,
            1.2,
            0.2,
            9.9,
            1e-9,
            1e6 + 0.1,
            0.7,
            1e300,
            3.3,
        ] {
            gauge.set(value);
            assert_eq!(total.get(), value);
        }
        drop(gauge);
        assert_eq!(total.get(), 0.0);
    }
}
