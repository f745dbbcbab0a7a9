//! A `metrics` recorder for tests: remembers every counter and gauge by name and labels, and
//! can be told to panic when one of them is recorded to (a recorder is user code: a
//! primitive must stay consistent when it panics).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};

/// Run after every move of a gauge, once set ([`TestRecorder::on_gauge`]).
type Hook = Arc<OnceLock<Box<dyn Fn() + Send + Sync>>>;

/// One registered metric: its value (counters and gauges) or its samples (histograms).
#[derive(Default)]
struct Cell {
    value: AtomicU64,
    samples: Mutex<Vec<f64>>,
    /// Panic on the next change ([`TestRecorder::panic_on`]).
    panics: AtomicBool,
    /// Panic on the next change only ([`TestRecorder::panic_once_on`]).
    panics_once: AtomicBool,
    /// The recorder's: panic on every counter's and gauge's change
    /// ([`TestRecorder::armed_while`]).
    every: Arc<AtomicBool>,
    on_gauge: Hook,
}

impl Cell {
    /// Panic if told to: for this metric, or (`every`: a counter or a gauge) for all.
    fn maybe_panic(&self, every: bool) {
        if self.panics.load(Ordering::Relaxed)
            || every && self.every.load(Ordering::Relaxed)
            || self.panics_once.swap(false, Ordering::Relaxed)
        {
            panic!("the recorder panics");
        }
    }

    fn moved(&self) {
        if let Some(hook) = self.on_gauge.get() {
            hook();
        }
    }
}

impl CounterFn for Cell {
    fn increment(&self, value: u64) {
        self.maybe_panic(true);
        self.value.fetch_add(value, Ordering::Relaxed);
    }
    fn absolute(&self, value: u64) {
        self.value.store(value, Ordering::Relaxed);
    }
}

impl GaugeFn for Cell {
    fn increment(&self, value: f64) {
        self.maybe_panic(true);
        // One atomic step: threads that record at once must not lose each other's changes.
        let _ = self
            .value
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + value).to_bits())
            });
        self.moved();
    }
    fn decrement(&self, value: f64) {
        GaugeFn::increment(self, -value);
    }
    fn set(&self, value: f64) {
        self.maybe_panic(true);
        self.value.store(value.to_bits(), Ordering::Relaxed);
        self.moved();
    }
}

impl HistogramFn for Cell {
    fn record(&self, value: f64) {
        self.maybe_panic(false);
        self.samples.lock().unwrap().push(value);
    }
}

/// Collects metrics registered while it is the local recorder
/// (`metrics::with_local_recorder`).
#[derive(Default, Clone)]
pub struct TestRecorder {
    cells: Arc<Mutex<BTreeMap<String, Arc<Cell>>>>,
    every: Arc<AtomicBool>,
    on_gauge: Hook,
}

fn render(key: &Key) -> String {
    let mut labels: Vec<String> = key
        .labels()
        .map(|l| format!("{}={}", l.key(), l.value()))
        .collect();
    labels.sort();
    format!("{}{{{}}}", key.name(), labels.join(","))
}

impl TestRecorder {
    fn cell(&self, key: &Key) -> Arc<Cell> {
        self.cells
            .lock()
            .unwrap()
            .entry(render(key))
            .or_insert_with(|| self.new_cell())
            .clone()
    }

    /// A cell that runs the [`on_gauge`](Self::on_gauge) hook.
    fn new_cell(&self) -> Arc<Cell> {
        Arc::new(Cell {
            on_gauge: self.on_gauge.clone(),
            every: self.every.clone(),
            ..Cell::default()
        })
    }

    /// Run `hook` after every move of a gauge, as a recorder's own code runs (an exporter
    /// reading the primitive, say); set once.
    pub fn on_gauge(&self, hook: impl Fn() + Send + Sync + 'static) {
        assert!(
            self.on_gauge.set(Box::new(hook)).is_ok(),
            "one hook per recorder"
        );
    }

    /// A counter's value, by `name{label=value,...}` with labels sorted; 0 if never registered.
    pub fn counter(&self, id: &str) -> u64 {
        self.cells
            .lock()
            .unwrap()
            .get(id)
            .map_or(0, |c| c.value.load(Ordering::Relaxed))
    }

    /// A gauge's value, by `name{label=value,...}`; `None` if never registered.
    pub fn gauge(&self, id: &str) -> Option<f64> {
        self.cells
            .lock()
            .unwrap()
            .get(id)
            .map(|c| f64::from_bits(c.value.load(Ordering::Relaxed)))
    }

    /// A histogram's samples, by `name{label=value,...}`.
    pub fn samples(&self, id: &str) -> Vec<f64> {
        self.cells
            .lock()
            .unwrap()
            .get(id)
            .map_or_else(Vec::new, |c| c.samples.lock().unwrap().clone())
    }

    /// Make every change to the counter, gauge or histogram `id` (as in
    /// [`counter`](Self::counter)) panic (`true`) or record again (`false`). It may be set before the metric is
    /// registered.
    pub fn panic_on(&self, id: &str, panics: bool) {
        let cells = &mut *self.cells.lock().unwrap();
        let cell = cells
            .entry(id.to_string())
            .or_insert_with(|| self.new_cell());
        cell.panics.store(panics, Ordering::Relaxed);
    }

    /// Make the next change to `id` (as in [`panic_on`](Self::panic_on)) panic, and only
    /// that one: that change records nothing, later ones record again. Whether it has
    /// panicked yet: [`panicked_once`](Self::panicked_once).
    pub fn panic_once_on(&self, id: &str) {
        let cells = &mut *self.cells.lock().unwrap();
        let cell = cells
            .entry(id.to_string())
            .or_insert_with(|| self.new_cell());
        cell.panics_once.store(true, Ordering::Relaxed);
    }

    /// Whether the panic [`panic_once_on`](Self::panic_once_on) asked for on `id` came.
    pub fn panicked_once(&self, id: &str) -> bool {
        self.cells
            .lock()
            .unwrap()
            .get(id)
            .is_some_and(|c| !c.panics_once.load(Ordering::Relaxed))
    }

    /// Run `f` with every change to a counter or a gauge panicking (histograms record);
    /// whether `f` panicked.
    pub fn armed_while(&self, f: impl FnOnce()) -> bool {
        self.every.store(true, Ordering::Relaxed);
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        self.every.store(false, Ordering::Relaxed);
        unwound.is_err()
    }

    /// Every registered metric id, sorted.
    pub fn ids(&self) -> Vec<String> {
        self.cells.lock().unwrap().keys().cloned().collect()
    }

    /// A retry budget and a retry policy over `backoff` with that budget, both named
    /// `name`, whose metrics this recorder records.
    pub fn retry_policy(
        &self,
        name: &str,
        backoff: flowgate::retry::Backoff,
    ) -> (flowgate::retry::RetryBudget, flowgate::retry::RetryPolicy) {
        metrics::with_local_recorder(self, || {
            let budget = flowgate::retry::RetryBudget::builder()
                .name(name)
                .build()
                .unwrap();
            let policy = flowgate::retry::RetryPolicy::builder(backoff)
                .name(name)
                .budget(budget.clone())
                .build()
                .unwrap();
            (budget, policy)
        })
    }
}

impl Recorder for TestRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.cell(key))
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.cell(key))
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(self.cell(key))
    }
}
