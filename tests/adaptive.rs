//! Adaptive concurrency limits: the algorithms on the simulated downstream through an
//! adaptive bulkhead, and the regressions the anchors shipped. Paused time throughout, but
//! for the journey against a real downstream on loopback (`adaptive/journey.rs`).

#[path = "adaptive/journey.rs"]
mod journey;
#[path = "adaptive/support.rs"]
mod support;

#[cfg(feature = "metrics")]
#[allow(dead_code)]
#[path = "support/recorder.rs"]
mod recorder;

#[allow(dead_code)]
#[path = "support/wakers.rs"]
mod wakers;

use std::time::Duration;

use std::sync::{Arc, Mutex};

use flowgate::FlowStreamExt;
use flowgate::adaptive::sim::{Downstream, Scenario};
use flowgate::adaptive::{AdaptiveLimit, Aimd, Gradient2, Outcome, Probe, Sample, Vegas};
use flowgate::bulkhead::Bulkhead;
use futures::StreamExt;

fn bulkhead<A: AdaptiveLimit + Clone>(limit: A) -> Bulkhead {
    Bulkhead::builder(1000).adaptive(limit).build().unwrap()
}

/// Every algorithm with its defaults (the downstream's timeout is 1 s, so the algorithms
/// that take one are told).
fn algorithms() -> Vec<Box<dyn Fn() -> Bulkhead>> {
    let t = Duration::from_secs(1);
    vec![
        Box::new(move || bulkhead(Probe::builder().timeout(t).build().unwrap())),
        Box::new(move || bulkhead(Aimd::builder().timeout(t).build().unwrap())),
        Box::new(move || bulkhead(Gradient2::builder().timeout(t).build().unwrap())),
        Box::new(|| bulkhead(Vegas::builder().build().unwrap())),
    ]
}

/// The documented band of each algorithm's mean limit (20 s to the end) around a knee of
/// 40 on the shallow and steep scenarios: probe within ±10 % of the knee; gradient2 and
/// vegas between half the knee and 1.25 × (both settle below the knee when latency grows
/// with load); aimd, which ignores latency, between the knee and 1.5 × the capacity (the
/// downstream refuses above 80).
fn band(algorithm: &str) -> (f64, f64) {
    match algorithm {
        "probe" => (36.0, 44.0),
        "aimd" => (40.0, 120.0),
        _ => (20.0, 50.0),
    }
}

#[tokio::test(start_paused = true)]
async fn each_algorithm_settles_on_shallow_and_steep_knees() {
    for scenario in [Scenario::shallow_knee(), Scenario::steep_knee()] {
        for make in algorithms() {
            let b = make();
            let algorithm = b.adaptive_stats().unwrap().algorithm;
            let run = support::drive(&scenario.downstream(), &b, 200, 60).await;
            let mean = run.mean_limit(20, 60);
            let (lo, hi) = band(algorithm);
            println!(
                "{} {algorithm}: mean limit {mean:.1}, max {}",
                scenario.name(),
                run.max_limit(20, 60)
            );
            assert!(
                (lo..=hi).contains(&mean),
                "{} {algorithm}: mean limit {mean:.1} outside [{lo}, {hi}]",
                scenario.name()
            );
            if algorithm == "probe" {
                // Gradient2 and AIMD move per sample and spike; probe holds a level and
                // tries one step (here 1) at a time: never more than a few above the knee.
                assert!(
                    run.max_limit(20, 60) <= 44,
                    "{algorithm} overshoots: {}",
                    run.max_limit(20, 60)
                );
                // At the knee, 40 calls of about 27 to 35 ms: above 1,100 calls/s.
                let throughput = run.throughput(20, 60);
                assert!(throughput > 1_100.0, "{algorithm}: {throughput:.0}/s");
            }
        }
    }
}

#[tokio::test(start_paused = true)]
async fn each_algorithm_follows_a_capacity_drop_and_recovers() {
    // The knee is 60, 30 from t = 30 s, 60 again from t = 60 s.
    let scenario = Scenario::capacity_drop();
    for make in algorithms() {
        let b = make();
        let algorithm = b.adaptive_stats().unwrap().algorithm;
        let run = support::drive(&scenario.downstream(), &b, 200, 120).await;
        let before = run.mean_limit(10, 30);
        // AIMD ignores latency: it follows the downstream's capacity (twice the knee).
        let target = if algorithm == "aimd" { 66 } else { 37 };
        let below = run.first_at_most(30, target).unwrap_or(Duration::MAX);
        let after = run.mean_limit(90, 120);
        println!(
            "{algorithm}: before {before:.1}, at most {target} at {below:?}, during {:.1}, after {after:.1}",
            run.mean_limit(40, 60)
        );
        // Within 25 % of the new knee (30; AIMD: 10 % of the new capacity, 60) within 10 s
        // of the drop.
        assert!(
            below <= Duration::from_secs(40),
            "{algorithm}: at most {target} only at {below:?}"
        );
        // Back within 20 % of where it was before the drop, 30 s after the knee came back.
        assert!(
            after >= 0.8 * before,
            "{algorithm}: {after:.1} after, {before:.1} before"
        );
        if algorithm == "probe" {
            probe_follows_the_knee(&run);
        }
    }
}

#[tokio::test(start_paused = true)]
async fn probe_follows_a_capacity_drop_on_other_seeds() {
    for seed in [1, 2] {
        let scenario = Scenario::capacity_drop().with_seed(seed);
        let b = algorithms().remove(0)();
        assert_eq!(b.adaptive_stats().unwrap().algorithm, "probe");
        let run = support::drive(&scenario.downstream(), &b, 200, 120).await;
        probe_follows_the_knee(&run);
    }
}

/// Probe's stated bounds on the capacity drop: before it, within 10 % of the knee (60);
/// at most the new knee (30) within 3 s of the drop, and within 10 % of it (never above
/// 36) from 10 s after the drop until the knee comes back; back to 80 % of the old knee
/// (48) within 10 s of its return, and within 10 % of it from 30 s on.
fn probe_follows_the_knee(run: &support::Run) {
    let before = run.mean_limit(10, 30);
    assert!(
        (54.0..=66.0).contains(&before),
        "probe before the drop: {before:.1}"
    );
    let below = run.first_at_most(30, 30).unwrap_or(Duration::MAX);
    println!(
        "probe: at most 30 at {below:?}, during {:.1} (max {}), after {:.1}",
        run.mean_limit(40, 60),
        run.max_limit(40, 60),
        run.mean_limit(90, 120)
    );
    assert!(
        below <= Duration::from_secs(33),
        "probe at most 30 only at {below:?}"
    );
    let during = run.mean_limit(40, 60);
    assert!(
        (27.0..=33.0).contains(&during),
        "probe during the drop: {during:.1}"
    );
    assert!(
        run.max_limit(40, 60) <= 36,
        "probe: {} during the drop",
        run.max_limit(40, 60)
    );
    let back = run
        .limits
        .iter()
        .find(|&&(t, l)| t >= Duration::from_secs(60) && l >= 48)
        .map_or(Duration::MAX, |&(t, _)| t);
    assert!(
        back <= Duration::from_secs(70),
        "probe at 48 only at {back:?}"
    );
    let after = run.mean_limit(90, 120);
    assert!(
        (54.0..=66.0).contains(&after),
        "probe after the drop: {after:.1}"
    );
}

/// An algorithm that records every sample and keeps its limit.
#[derive(Debug, Clone)]
struct Recorder {
    limit: u32,
    samples: Arc<Mutex<Vec<Sample>>>,
}

impl Recorder {
    fn new(limit: u32) -> Recorder {
        Recorder {
            limit,
            samples: Arc::default(),
        }
    }

    fn samples(&self) -> Vec<Sample> {
        self.samples.lock().unwrap().clone()
    }
}

impl AdaptiveLimit for Recorder {
    fn limit(&self) -> u32 {
        self.limit
    }

    fn update(&mut self, sample: &Sample) -> u32 {
        self.samples.lock().unwrap().push(*sample);
        self.limit
    }

    fn name(&self) -> &'static str {
        "recorder"
    }
}

const MS: Duration = Duration::from_millis(1);

#[tokio::test(start_paused = true)]
async fn permit_wait_time_is_not_rtt() {
    let recorder = Recorder::new(1);
    let b = Bulkhead::builder(1)
        .adaptive(recorder.clone())
        .build()
        .unwrap();
    let first = b.acquire_owned().await.unwrap();
    let waiter = {
        let b = b.clone();
        tokio::spawn(async move {
            let permit = b.acquire().await.unwrap(); // waits 100 ms for `first`
            tokio::time::sleep(10 * MS).await;
            permit.record(Outcome::Ok);
        })
    };
    tokio::time::sleep(100 * MS).await;
    first.record(Outcome::Ok);
    waiter.await.unwrap();
    let samples = recorder.samples();
    assert_eq!(samples.len(), 2);
    assert_eq!(samples[0].rtt, 100 * MS);
    assert_eq!(samples[1].rtt, 10 * MS, "the 100 ms wait is not counted");
    assert_eq!(samples[1].in_flight, 1);
    assert_eq!(samples[1].now, 110 * MS);
    assert!(samples.iter().all(|s| s.outcome == Outcome::Ok));
}

#[tokio::test(start_paused = true)]
async fn dropped_and_cancelled_calls_are_ignored() {
    // Through the bulkhead: permits dropped at once (near-zero round trips), a cancelled run.
    for make in algorithms() {
        let b = make();
        let before = b.max_in_flight();
        for _ in 0..1_000 {
            let permit = b.acquire().await.unwrap();
            drop(permit);
        }
        let cancelled = tokio::time::timeout(MS, b.run(tokio::time::sleep(Duration::from_secs(1))));
        assert!(cancelled.await.is_err());
        let stats = b.adaptive_stats().unwrap();
        assert_eq!(stats.ignored, 1_001, "{}", stats.algorithm);
        assert_eq!((stats.ok, stats.back_pressure), (0, 0));
        assert_eq!(b.max_in_flight(), before, "{}", stats.algorithm);
        assert_eq!(
            stats.rtt.min, None,
            "{}: an ignored rtt is no estimate",
            stats.algorithm
        );
    }
    // The algorithms themselves: `Ignored` samples with zero round trips change nothing.
    let mut algorithms: Vec<Box<dyn AdaptiveLimit>> = vec![
        Box::new(Probe::default()),
        Box::new(Aimd::builder().build().unwrap()),
        Box::new(Gradient2::builder().build().unwrap()),
        Box::new(Vegas::builder().build().unwrap()),
    ];
    for a in &mut algorithms {
        let before = a.limit();
        for i in 0..10_000u64 {
            let s = Sample {
                rtt: Duration::ZERO,
                in_flight: before,
                outcome: Outcome::Ignored,
                now: Duration::from_micros(i),
            };
            assert_eq!(a.update(&s), before, "{}", a.name());
        }
    }
}

#[tokio::test(start_paused = true)]
async fn constant_timeouts_do_not_grow_the_limit() {
    // Every call takes longer than the downstream's 1 s timeout.
    for make in algorithms() {
        let b = make();
        let initial = b.max_in_flight();
        let downstream = Downstream::builder()
            .base(Duration::from_secs(2))
            .timeout(Duration::from_secs(1))
            .build()
            .unwrap();
        let run = support::drive(&downstream, &b, 200, 60).await;
        let stats = b.adaptive_stats().unwrap();
        assert!(stats.back_pressure > 0);
        assert!(
            run.max_limit(0, 60) <= initial,
            "{}: grew to {}",
            stats.algorithm,
            run.max_limit(0, 60)
        );
        assert!(
            b.max_in_flight() < initial,
            "{}: never cut",
            stats.algorithm
        );
    }
    // A caller that reports timeouts as `Ok` with the timeout as round trip (Netflix 137):
    // the algorithms with a `timeout` treat them as back-pressure.
    let t = Duration::from_secs(1);
    let mut algorithms: Vec<Box<dyn AdaptiveLimit>> = vec![
        Box::new(Probe::builder().timeout(t).build().unwrap()),
        Box::new(Aimd::builder().timeout(t).build().unwrap()),
        Box::new(Gradient2::builder().timeout(t).build().unwrap()),
    ];
    for a in &mut algorithms {
        let initial = a.limit();
        for i in 1..=1_000u64 {
            let limit = a.limit();
            let s = Sample {
                rtt: t,
                in_flight: limit,
                outcome: Outcome::Ok,
                now: Duration::from_millis(10 * i) + t,
            };
            assert!(a.update(&s) <= initial, "{}", a.name());
        }
        assert!(a.limit() < initial, "{}: never cut", a.name());
        assert_eq!(
            a.rtt_estimates().min,
            None,
            "{}: a timeout is no rtt",
            a.name()
        );
    }
}

#[tokio::test(start_paused = true)]
async fn an_app_limited_caller_does_not_inflate_the_limit() {
    // Four calls in flight at most, a fast flat downstream, for a minute.
    for make in algorithms() {
        let b = make();
        let initial = b.max_in_flight();
        let downstream = Downstream::builder()
            .base(Duration::from_millis(10))
            .build()
            .unwrap();
        let run = support::drive(&downstream, &b, 4, 60).await;
        let stats = b.adaptive_stats().unwrap();
        assert!(stats.ok > 20_000, "{}: {} calls", stats.algorithm, stats.ok);
        assert!(
            run.max_limit(0, 60) <= initial,
            "{}: grew to {} with 4 in flight",
            stats.algorithm,
            run.max_limit(0, 60)
        );
    }
}

#[tokio::test(start_paused = true)]
async fn stream_adapters_and_run_record_ok() {
    let recorder = Recorder::new(4);
    let b = Bulkhead::builder(4)
        .adaptive(recorder.clone())
        .build()
        .unwrap();
    let work = |_| async {
        tokio::time::sleep(5 * MS).await;
    };
    let n = futures::stream::iter(0..10)
        .bulkhead_map(b.clone(), work)
        .count()
        .await;
    let m = futures::stream::iter(0..10)
        .bulkhead_map_unordered(b.clone(), work)
        .count()
        .await;
    let k = futures::stream::iter(0..10)
        .bulkhead_spawn_map(b.clone(), work)
        .count()
        .await;
    b.run(tokio::time::sleep(7 * MS)).await.unwrap();
    assert_eq!((n, m, k), (10, 10, 10));
    let samples = recorder.samples();
    assert_eq!(samples.len(), 31);
    assert!(samples.iter().all(|s| s.outcome == Outcome::Ok));
    assert!(samples[..30].iter().all(|s| s.rtt == 5 * MS), "{samples:?}");
    assert_eq!(samples[30].rtt, 7 * MS);
    assert!(samples.iter().all(|s| (1..=4).contains(&s.in_flight)));
    let stats = b.adaptive_stats().unwrap();
    assert_eq!((stats.ok, stats.ignored), (31, 0));
    // Dropped before completing: ignored.
    let mut s = Box::pin(futures::stream::iter(0..10).bulkhead_map(b.clone(), work));
    let _ = futures::poll!(s.next());
    drop(s);
    assert_eq!(b.adaptive_stats().unwrap().ignored, 4);
    assert_eq!(b.in_flight(), 0);
}

/// What the `adaptive` module docs say of the stream adapters' round trips: the in-poll
/// adapters see a call finish at the poll that finds its future done, so a consumer busy
/// for 50 ms per item adds that time to calls of 5 ms in flight meanwhile;
/// `bulkhead_spawn_map` runs each call on its own task and measures the call alone.
#[tokio::test(start_paused = true)]
async fn in_poll_adapters_count_the_consumers_time_in_the_round_trip_spawn_map_does_not() {
    let work = |_| async {
        tokio::time::sleep(5 * MS).await;
    };
    let busy = |_| async {
        tokio::time::sleep(50 * MS).await;
    };
    let adaptive = |recorder: &Recorder| {
        Bulkhead::builder(2)
            .adaptive(recorder.clone())
            .build()
            .unwrap()
    };
    let (ordered, unordered, spawned) = (Recorder::new(2), Recorder::new(2), Recorder::new(2));
    let items = || futures::stream::iter(0..6);
    let n = items()
        .bulkhead_map(adaptive(&ordered), work)
        .then(busy)
        .count()
        .await;
    let m = items()
        .bulkhead_map_unordered(adaptive(&unordered), work)
        .then(busy)
        .count()
        .await;
    let k = items()
        .bulkhead_spawn_map(adaptive(&spawned), work)
        .then(busy)
        .count()
        .await;
    assert_eq!((n, m, k), (6, 6, 6));
    for (adapter, recorder) in [("bulkhead_map", &ordered), ("unordered", &unordered)] {
        let rtts: Vec<Duration> = recorder.samples().iter().map(|s| s.rtt).collect();
        assert_eq!(rtts.len(), 6, "{adapter}");
        assert!(
            rtts.iter().any(|&rtt| rtt >= 50 * MS),
            "{adapter}: {rtts:?}"
        );
    }
    let rtts: Vec<Duration> = spawned.samples().iter().map(|s| s.rtt).collect();
    assert_eq!(rtts, [5 * MS; 6]);
}

/// Calls an adapter had in flight when it was dropped were cancelled: each is an ignored
/// sample, whichever adapter ran it (as a permit dropped without `record` is).
#[tokio::test(start_paused = true)]
async fn every_adapter_dropped_mid_flight_counts_its_calls_as_ignored() {
    let b = Bulkhead::builder(4)
        .adaptive(Recorder::new(4))
        .build()
        .unwrap();
    let work = |_| tokio::time::sleep(5 * MS);
    let mut ordered = Box::pin(futures::stream::iter(0..10).bulkhead_map(b.clone(), work));
    assert!(futures::poll!(ordered.next()).is_pending());
    drop(ordered);
    assert_eq!(b.adaptive_stats().unwrap().ignored, 4, "bulkhead_map");
    let mut unordered =
        Box::pin(futures::stream::iter(0..10).bulkhead_map_unordered(b.clone(), work));
    assert!(futures::poll!(unordered.next()).is_pending());
    drop(unordered);
    assert_eq!(b.in_flight(), 0);
    assert_eq!(
        b.adaptive_stats().unwrap().ignored,
        8,
        "bulkhead_map_unordered"
    );
    let mut spawned = Box::pin(futures::stream::iter(0..10).bulkhead_spawn_map(b.clone(), work));
    assert!(futures::poll!(spawned.next()).is_pending());
    drop(spawned);
    // The aborted tasks drop their permits when the runtime next runs them.
    tokio::task::yield_now().await;
    assert_eq!(b.in_flight(), 0);
    assert_eq!(
        b.adaptive_stats().unwrap().ignored,
        12,
        "bulkhead_spawn_map"
    );
    assert_eq!(b.adaptive_stats().unwrap().ok, 0);
}

/// An algorithm that keeps its limit and panics on its first `Ok` sample: user code, as a
/// metrics recorder is.
#[derive(Debug, Clone)]
struct PanicsOnFirstOk {
    armed: Arc<std::sync::atomic::AtomicBool>,
}

impl AdaptiveLimit for PanicsOnFirstOk {
    fn limit(&self) -> u32 {
        4
    }

    fn update(&mut self, sample: &Sample) -> u32 {
        let first = sample.outcome == Outcome::Ok
            && self.armed.swap(false, std::sync::atomic::Ordering::SeqCst);
        assert!(!first, "the algorithm panics");
        4
    }

    fn name(&self) -> &'static str {
        "panics"
    }
}

/// Each bulkhead stream adapter learns from a finished future with its output in hand (the
/// unordered one as it yields, the ordered one as its future completes, the spawning one in
/// its task): a panic there (a custom algorithm's, a metrics recorder's) is resumed by the
/// next poll, as one of the upstream or `f` is, and the output is yielded all the same. It
/// was lost with the panic: of three items, two came out.
#[tokio::test(start_paused = true)]
async fn a_panic_learning_from_a_finished_call_keeps_its_output_in_every_adapter() {
    use futures::FutureExt;

    fn work(sleeps: bool) -> impl FnMut(u64) -> futures::future::BoxFuture<'static, u64> {
        move |x| {
            async move {
                if sleeps {
                    tokio::time::sleep(MS * (x + 1) as u32).await;
                }
                x
            }
            .boxed()
        }
    }
    for adapter in ADAPTERS {
        for sleeps in [false, true] {
            let armed = Arc::new(std::sync::atomic::AtomicBool::new(true));
            let b = Bulkhead::builder(4)
                .adaptive(PanicsOnFirstOk { armed })
                .build()
                .unwrap();
            let (mut got, panics) =
                outputs_and_panics(adapter_over(adapter, b.clone(), work(sleeps))).await;
            got.sort_unstable();
            let case = format!("{adapter}, sleeps: {sleeps}");
            assert_eq!((got, panics), (vec![0, 1, 2], 1), "{case}");
            assert_eq!(b.in_flight(), 0, "{case}");
            assert_eq!(b.adaptive_stats().unwrap().ok, 3, "{case}");
        }
    }
}

/// The bulkhead stream adapters, by name.
const ADAPTERS: [&str; 3] = [
    "bulkhead_map_unordered",
    "bulkhead_map",
    "bulkhead_spawn_map",
];

/// The adapter `name` over the items 0, 1 and 2, mapped by `work`.
fn adapter_over<Fut>(
    name: &str,
    b: Bulkhead,
    work: impl FnMut(u64) -> Fut + Send + 'static,
) -> futures::stream::BoxStream<'static, u64>
where
    Fut: std::future::Future<Output = u64> + Send + 'static,
{
    let items = futures::stream::iter(0..3u64);
    match name {
        "bulkhead_map_unordered" => items.bulkhead_map_unordered(b, work).boxed(),
        "bulkhead_map" => items.bulkhead_map(b, work).boxed(),
        _ => items.bulkhead_spawn_map(b, work).boxed(),
    }
}

/// Polls `out` to its end, catching the panics of its polls: its outputs, and how many of
/// its polls panicked.
async fn outputs_and_panics(mut out: futures::stream::BoxStream<'_, u64>) -> (Vec<u64>, usize) {
    use futures::FutureExt;
    let (mut got, mut panics) = (Vec::new(), 0);
    loop {
        match std::panic::AssertUnwindSafe(out.next())
            .catch_unwind()
            .await
        {
            Ok(Some(x)) => got.push(x),
            Ok(None) => return (got, panics),
            Err(_) => panics += 1,
        }
    }
}

/// A closure that panics on an item (user code) ends the call its permit was taken for
/// before the call started: an ignored sample, as a permit dropped without `record` is,
/// whichever adapter runs it, and whether the permit was taken for that item (item 0) or
/// passed to it straight from the finished call before it (item 1, in the unordered
/// adapter). The unordered adapter returned that permit without a sample: the bulkhead
/// saw two calls end where three permits were granted.
#[tokio::test(start_paused = true)]
async fn a_closure_panicking_on_an_item_is_an_ignored_sample_in_every_adapter() {
    fn work(panics_on: u64) -> impl FnMut(u64) -> futures::future::Ready<u64> {
        move |x| {
            assert_ne!(x, panics_on, "the closure panics");
            futures::future::ready(x)
        }
    }
    for adapter in ADAPTERS {
        for panics_on in [0, 1] {
            let b = Bulkhead::builder(1)
                .adaptive(Recorder::new(1))
                .build()
                .unwrap();
            let (got, panics) =
                outputs_and_panics(adapter_over(adapter, b.clone(), work(panics_on))).await;
            let case = format!("{adapter}, panics on {panics_on}");
            assert_eq!((got.len(), panics), (2, 1), "{case}");
            assert_eq!(b.in_flight(), 0, "{case}");
            let stats = b.adaptive_stats().unwrap();
            assert_eq!((stats.ok, stats.ignored), (2, 1), "{case}");
        }
    }
}

/// AIMD's app-limited rule, as its docs say: the limit grows while a call sees at least half
/// of it in flight, so up to one more than twice the calls in flight, and no further.
#[test]
fn aimd_grows_up_to_twice_the_calls_in_flight() {
    let mut aimd = Aimd::builder().initial(10).build().unwrap();
    let mut limit = 0;
    for i in 0..1_000 {
        limit = aimd.update(&Sample {
            rtt: Duration::from_millis(5),
            in_flight: 24,
            outcome: Outcome::Ok,
            now: Duration::from_millis(i),
        });
    }
    assert_eq!(limit, 49);
}

#[tokio::test]
async fn a_fixed_bulkhead_has_no_adaptive_state() {
    let b = Bulkhead::new(3).unwrap();
    assert!(b.adaptive_stats().is_none());
    let permit = b.acquire().await.unwrap();
    permit.record(Outcome::BackPressure); // returns the permit, nothing else
    assert_eq!((b.in_flight(), b.max_in_flight()), (0, 3));
}

#[tokio::test]
async fn the_bulkhead_keeps_the_algorithm_within_its_bounds() {
    // Ceiling 8 (the builder's max_in_flight), floor 3 (critical_reserve 2 + 1).
    let b = Bulkhead::builder(8)
        .critical_reserve(2)
        .adaptive(Aimd::builder().initial(20).build().unwrap())
        .build()
        .unwrap();
    assert_eq!(b.max_in_flight(), 8);
    for _ in 0..50 {
        b.acquire().await.unwrap().record(Outcome::BackPressure);
        tokio::task::yield_now().await;
    }
    assert_eq!(b.max_in_flight(), 3);
    // Each bulkhead built from one builder gets its own copy of the algorithm.
    let builder = Bulkhead::builder(100).adaptive(Aimd::builder().build().unwrap());
    let (x, y) = (builder.clone().build().unwrap(), builder.build().unwrap());
    x.acquire().await.unwrap().record(Outcome::BackPressure);
    assert_eq!((x.max_in_flight(), y.max_in_flight()), (18, 20));
}

/// The algorithm's limit lives within the bulkhead's bounds: above the ceiling it would not
/// be one the bulkhead can use, and back-pressure would have to cut it down through the
/// ceiling before `max_in_flight` moved. A bulkhead of 10 over each algorithm starting at 20
/// (Aimd's, Vegas' and Gradient2's default), and over Aimd grown by calls that used all 10:
/// one back-pressure sample lowers `max_in_flight` at once.
#[tokio::test(start_paused = true)]
async fn back_pressure_lowers_max_in_flight_at_once_below_the_ceiling() {
    let built = [
        Bulkhead::builder(10).adaptive(Aimd::builder().build().unwrap()),
        Bulkhead::builder(10).adaptive(Vegas::builder().build().unwrap()),
        Bulkhead::builder(10).adaptive(Gradient2::builder().build().unwrap()),
        Bulkhead::builder(10).adaptive(Probe::builder().initial(20).build().unwrap()),
    ];
    for builder in built {
        let b = builder.build().unwrap();
        let algorithm = b.adaptive_stats().unwrap().algorithm;
        assert_eq!(b.max_in_flight(), 10, "{algorithm}");
        tokio::time::sleep(10 * MS).await;
        b.acquire().await.unwrap().record(Outcome::BackPressure);
        assert!(b.max_in_flight() < 10, "{algorithm}: {}", b.max_in_flight());
    }
    // Aimd from 5, grown by calls that each saw all 10 permits in flight.
    let b = Bulkhead::builder(10)
        .adaptive(Aimd::builder().initial(5).build().unwrap())
        .build()
        .unwrap();
    for _ in 0..30 {
        let permits: Vec<_> = (0..b.max_in_flight())
            .map(|_| b.try_acquire().unwrap())
            .collect();
        tokio::time::sleep(10 * MS).await;
        for p in permits {
            p.record(Outcome::Ok);
        }
    }
    assert_eq!(b.max_in_flight(), 10);
    tokio::time::sleep(10 * MS).await;
    b.acquire().await.unwrap().record(Outcome::BackPressure);
    assert_eq!(b.max_in_flight(), 9, "10 × 0.9");
}

/// An `initial` left at its default starts within the bounds given: a `min_limit` above
/// the default (20, Probe's 10) or a `max_limit` below it is not a reason to refuse a
/// setting the caller never made.
#[test]
fn a_default_initial_is_brought_within_the_bounds_given() {
    // Where Aimd, Vegas, Gradient2 and Probe start with only these bounds given.
    let starts = |min: Option<u32>, max: Option<u32>| {
        macro_rules! start {
            ($builder:expr) => {{
                let mut builder = $builder;
                if let Some(n) = min {
                    builder = builder.min_limit(n);
                }
                if let Some(n) = max {
                    builder = builder.max_limit(n);
                }
                builder.build().unwrap().limit()
            }};
        }
        [
            start!(Aimd::builder()),
            start!(Vegas::builder()),
            start!(Gradient2::builder()),
            start!(Probe::builder()),
        ]
    };
    assert_eq!(starts(Some(50), Some(100)), [50; 4]);
    assert_eq!(starts(None, Some(8)), [8; 4]);
    // A default max rises to a min given above it, and the initial with it.
    assert_eq!(starts(Some(2000), None), [2000; 4]);
    // An initial given outside the bounds is still refused, naming it.
    let refused = Aimd::builder()
        .min_limit(50)
        .initial(20)
        .build()
        .unwrap_err();
    assert_eq!(refused.field(), "aimd.initial");
}

#[test]
fn bad_config_is_an_error() {
    let field = |r: Result<(), flowgate::ConfigError>| r.unwrap_err().field();
    assert_eq!(
        field(Probe::builder().min_limit(0).build().map(drop)),
        "probe.min_limit"
    );
    assert_eq!(
        field(
            Probe::builder()
                .min_limit(50)
                .max_limit(10)
                .build()
                .map(drop)
        ),
        "probe.min_limit"
    );
    assert_eq!(
        field(
            Probe::builder()
                .max_limit(1000)
                .initial(5000)
                .build()
                .map(drop)
        ),
        "probe.initial"
    );
    // Past the largest limit, with no max given: the initial is named, not the max.
    assert_eq!(
        field(Probe::builder().initial(u32::MAX).build().map(drop)),
        "probe.initial"
    );
    assert_eq!(
        field(Probe::builder().max_limit(u32::MAX).build().map(drop)),
        "probe.max_limit"
    );
    assert_eq!(
        field(Probe::builder().backoff_ratio(1.0).build().map(drop)),
        "probe.backoff_ratio"
    );
    assert_eq!(
        field(Probe::builder().max_rtt_ratio(0.5).build().map(drop)),
        "probe.max_rtt_ratio"
    );
    assert_eq!(
        field(Probe::builder().timeout(Duration::ZERO).build().map(drop)),
        "probe.timeout"
    );
    assert_eq!(
        field(Aimd::builder().backoff_ratio(f64::NAN).build().map(drop)),
        "aimd.backoff_ratio"
    );
    assert_eq!(
        field(Aimd::builder().initial(0).build().map(drop)),
        "aimd.initial"
    );
    assert_eq!(
        field(Gradient2::builder().tolerance(0.9).build().map(drop)),
        "gradient2.tolerance"
    );
    assert_eq!(
        field(Gradient2::builder().smoothing(0.0).build().map(drop)),
        "gradient2.smoothing"
    );
    assert_eq!(
        field(Gradient2::builder().long_window(0).build().map(drop)),
        "gradient2.long_window"
    );
    assert_eq!(
        field(Vegas::builder().alpha(4.0).beta(3.0).build().map(drop)),
        "vegas.beta"
    );
    assert_eq!(
        field(Vegas::builder().probe_multiplier(0).build().map(drop)),
        "vegas.probe_multiplier"
    );
}

/// Gradient2 under a steady latency above `tolerance²` × the minimum settles at
/// `1 / (1 − g)²`, `g = tolerance² × min / short` (its docs): bounded, from above and
/// from below.
#[test]
fn gradient2_settles_where_its_docs_say_under_steady_overload() {
    let settle = |initial: u32, short_us: u64| {
        let mut g = Gradient2::builder()
            .initial(initial)
            .max_limit(10_000)
            .build()
            .unwrap();
        let mut now = Duration::ZERO;
        let mut step = |g: &mut Gradient2, rtt: Duration| {
            now += Duration::from_millis(1);
            let in_flight = g.limit();
            g.update(&Sample {
                rtt,
                in_flight,
                outcome: Outcome::Ok,
                now,
            })
        };
        // The minimum: 10 ms (a few samples; the limit moves a little meanwhile).
        for _ in 0..5 {
            step(&mut g, Duration::from_millis(10));
        }
        let mut limit = 0;
        for _ in 0..20_000 {
            limit = step(&mut g, Duration::from_micros(short_us));
        }
        limit
    };
    // tolerance² × min = 22.5 ms. At 45 ms, g = 0.5: L = 4. At 24.75 ms, g = 1 / 1.1: L = 121.
    // (The limit reported is whole, the bound approached: one below it is in reach.)
    for initial in [2, 20, 500] {
        let l = settle(initial, 45_000);
        assert!((3..=4).contains(&l), "from {initial}: {l}");
        let l = settle(initial, 24_750);
        assert!((118..=124).contains(&l), "from {initial}: {l}");
    }
}

/// Normal work cannot take the critical reserve, so it can reach `max_in_flight −
/// critical_reserve` only; an algorithm that grows the limit only when calls reach it
/// (Probe's slow start and trials) must be able to see normal work reach it. 300 callers
/// of normal work, 10 ms each, over a bulkhead of at most 1000 with a reserve of 10: the
/// limit grows from Probe's 10 (11 with the reserve) to let them through.
#[tokio::test(start_paused = true)]
async fn normal_work_grows_an_adaptive_limit_with_a_critical_reserve() {
    let b = Bulkhead::builder(1000)
        .critical_reserve(10)
        .adaptive(Probe::default())
        .build()
        .unwrap();
    let callers: Vec<_> = (0..300)
        .map(|_| {
            let b = b.clone();
            tokio::spawn(async move {
                loop {
                    let permit = b.acquire().await.unwrap();
                    tokio::time::sleep(10 * MS).await;
                    permit.record(Outcome::Ok);
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (max, in_flight) = (b.max_in_flight(), b.in_flight());
    for c in callers {
        c.abort();
    }
    assert!(max >= 300, "max_in_flight {max}");
    assert!(in_flight >= 290, "{in_flight} in flight");
}

/// Every algorithm with its defaults, on its own.
fn defaults() -> Vec<Box<dyn AdaptiveLimit>> {
    vec![
        Box::new(Aimd::builder().build().unwrap()),
        Box::new(Vegas::builder().build().unwrap()),
        Box::new(Gradient2::builder().build().unwrap()),
        Box::new(Probe::default()),
    ]
}

/// `AdaptiveLimit::bound` is public: bounds that are empty or start at 0 are taken as the
/// nearest sensible ones, never a panic (a reversed range would panic in `u32::clamp`).
#[test]
fn bad_bounds_given_to_an_algorithm_do_not_panic() {
    let ok = Sample {
        rtt: 10 * MS,
        in_flight: 5,
        outcome: Outcome::Ok,
        now: Duration::from_secs(1),
    };
    for limit in &mut defaults() {
        limit.bound(10, 5);
        assert_eq!(limit.limit(), 10, "{}", limit.name());
        limit.bound(0, 0); // [1, 1]
        assert_eq!(limit.limit(), 1, "{}", limit.name());
        limit.update(&ok);
        assert_eq!(limit.limit(), 1, "{}", limit.name());
    }
}

/// A bulkhead of 10 000 bounds its algorithm to 10 000: an algorithm whose `max_limit` was
/// left at its default (1000, for one used on its own) grows up to the bulkhead's bound,
/// not to 1000; one given a `max_limit` keeps it. `Bulkhead::builder(10_000)
/// .adaptive(Aimd::default())` never went above 1000 in flight.
#[test]
fn a_default_max_limit_gives_way_to_the_bulkheads_bound() {
    let busy = Sample {
        rtt: 10 * MS,
        in_flight: 10_000,
        outcome: Outcome::Ok,
        now: Duration::from_secs(1),
    };
    let grown = |mut limit: Aimd| {
        limit.bound(1, 10_000);
        for _ in 0..2_000 {
            limit.update(&busy);
        }
        limit.limit()
    };
    // From 20, one more for each of 2 000 busy successes.
    assert_eq!(grown(Aimd::builder().build().unwrap()), 2_020);
    assert_eq!(grown(Aimd::builder().max_limit(500).build().unwrap()), 500);
    // Through a bulkhead: the same bound, `max_in_flight` follows.
    let bulkhead = Bulkhead::builder(10_000)
        .adaptive(Aimd::builder().initial(999).build().unwrap())
        .build()
        .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        for _ in 0..10 {
            let permits: Vec<_> = futures::future::join_all(
                (0..bulkhead.max_in_flight()).map(|_| bulkhead.acquire()),
            )
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
            for permit in permits {
                permit.record(Outcome::Ok);
            }
        }
    });
    assert!(
        bulkhead.max_in_flight() > 1_000,
        "max_in_flight {}",
        bulkhead.max_in_flight()
    );
}

/// `AdaptiveLimit::bound` keeps the limit within the bounds given "from now on", as well
/// as within the algorithm's own: new bounds replace the last ones. Each call narrowed
/// the bounds the last one had left, so bounded to `[20, 30]` and then to `[1, 1000]` an
/// algorithm never went below 20 again (its own `min_limit` is 1), nor `Aimd` above 30.
#[test]
fn new_bounds_replace_the_last_ones() {
    for limit in &mut defaults() {
        limit.bound(20, 30);
        limit.bound(1, 1_000);
        for s in 1..=200 {
            limit.update(&Sample {
                rtt: 10 * MS,
                in_flight: 30,
                outcome: Outcome::BackPressure,
                now: Duration::from_secs(s),
            });
        }
        assert_eq!(limit.limit(), 1, "{}: its own min_limit", limit.name());
    }
    let mut aimd = Aimd::builder().build().unwrap();
    aimd.bound(20, 30);
    aimd.bound(1, 1_000);
    for _ in 0..100 {
        aimd.update(&Sample {
            rtt: 10 * MS,
            in_flight: 1_000,
            outcome: Outcome::Ok,
            now: Duration::from_secs(1),
        });
    }
    assert_eq!(
        aimd.limit(),
        120,
        "from 20, one more for each of 100 busy calls"
    );
}

/// `probe_interval(u32::MAX)` (hold a level, next to never try another) is a valid setting.
/// A cut schedules a trial below for the next window (the hold starts `probe_interval`
/// windows in); counting that window went past `u32::MAX` and panicked.
#[test]
fn probe_with_the_largest_probe_interval_tries_lower_after_a_cut() {
    let mut probe = Probe::builder()
        .initial(10)
        .max_limit(10) // holding from the start: no slow start
        .probe_interval(u32::MAX)
        .build()
        .unwrap();
    let at = |ms: u64, outcome| Sample {
        rtt: 10 * MS,
        in_flight: 10,
        outcome,
        now: Duration::from_millis(ms),
    };
    assert_eq!(probe.update(&at(10, Outcome::BackPressure)), 9, "10 × 0.9");
    // Four calls started after the cut: the window closes and decides.
    for _ in 0..4 {
        probe.update(&at(30, Outcome::Ok));
    }
    assert_eq!(probe.limit(), 8, "one step below the held 9");
}

/// A call answered from a cache, under a coarse clock or in paused time can take zero
/// time. Zero is no measurement of Probe's minimum (`min` in its docs): taken as one, every
/// window counted as "far above the minimum" and closed once it had `max(4, L/4)` calls,
/// before the noise rule's count. Here calls of 8 and 12 ms in turn at a held 16: each
/// window needs about 115 to 152 calls (821 calls to the first trial, after 8 windows);
/// with one zero-RTT call among them, the trial came after 31.
#[test]
fn a_zero_rtt_call_does_not_shorten_probes_windows() {
    let mut probe = Probe::builder()
        .initial(16)
        .max_limit(16) // holding from the start: no slow start
        .build()
        .unwrap();
    let mut now = Duration::ZERO;
    let mut calls = 0;
    while probe.limit() == 16 && calls < 2_000 {
        // Each call starts after the last one ended: every call is in the open window.
        now += 12 * MS;
        if calls == 8 {
            probe.update(&Sample {
                rtt: Duration::ZERO,
                in_flight: 16,
                outcome: Outcome::Ok,
                now,
            });
        }
        let rtt = if calls % 2 == 0 { 8 * MS } else { 12 * MS };
        probe.update(&Sample {
            rtt,
            in_flight: 16,
            outcome: Outcome::Ok,
            now,
        });
        calls += 1;
    }
    assert!(calls > 600, "the trial came after {calls} calls");
    assert_eq!(probe.limit(), 15, "the first trial goes one step lower");
    assert_eq!(probe.rtt_estimates().min, Some(8 * MS));
}

/// The `max_rtt_ratio × min` guard still holds after a zero-RTT call: a window at 3 × the
/// 10 ms minimum cuts the held 16 by `backoff_ratio` (to 14), as its docs say. With the
/// zero taken as the minimum the guard was off for one to two `probe_window`s, and the
/// window only counted as queueing (a trial one step lower, 15).
#[test]
fn probes_latency_guard_holds_after_a_zero_rtt_call() {
    let mut probe = Probe::builder().initial(16).max_limit(16).build().unwrap();
    let at = |rtt: Duration, ms: u64| Sample {
        rtt,
        in_flight: 16,
        outcome: Outcome::Ok,
        now: Duration::from_millis(ms),
    };
    // One window: three calls of 10 ms and one answered at once.
    for _ in 0..3 {
        probe.update(&at(10 * MS, 20));
    }
    probe.update(&at(Duration::ZERO, 20));
    // The next window: four calls of 30 ms, started after it opened.
    for _ in 0..4 {
        probe.update(&at(30 * MS, 60));
    }
    assert_eq!(probe.limit(), 14, "16 × 0.9, rounded down");
    assert_eq!(probe.rtt_estimates().min, Some(10 * MS));
}

/// Vegas' probe forgets the no-load time and measures it again from the next call; that
/// call is compared with nothing (its queue estimate against itself is 0 by construction)
/// and must not move the limit, or every probe adds `beta × f(L)`. Here a limit of 100
/// held by calls of 11 ms over a no-load time of 10 ms (a queue estimate of 10, within
/// `[alpha, beta] × f(L)` = [6, 12]), and the calls that measure the no-load time (the
/// first, and the first after each probe, every `probe_multiplier × L` = 100 calls) take
/// 10 ms: the limit stays 100 through 10 probes. It was 112 after the first call, 124,
/// 136 and 143 after the first probes, and from then on each probe pushed it about 13
/// above the level where the queue estimate passes `beta × f(L)` and the limit shrinks.
#[test]
fn vegas_probes_do_not_move_its_limit() {
    let mut vegas = Vegas::builder()
        .initial(100)
        .probe_multiplier(1)
        .build()
        .unwrap();
    let mut now = Duration::ZERO;
    let mut since_probe = 0;
    let mut call = |vegas: &mut Vegas, rtt: Duration| {
        now += MS;
        vegas.update(&Sample {
            rtt,
            in_flight: 100,
            outcome: Outcome::Ok,
            now,
        })
    };
    let first = call(&mut vegas, 10 * MS);
    since_probe += 1;
    let mut after_probes = Vec::new();
    while after_probes.len() < 10 {
        // The documented schedule: a probe every `probe_multiplier × L` calls.
        since_probe += 1;
        let probe = since_probe >= vegas.limit();
        let limit = call(&mut vegas, if probe { 10 * MS } else { 11 * MS });
        if probe {
            since_probe = 0;
            after_probes.push(limit);
        }
    }
    assert_eq!(after_probes, [100; 10], "the limit after each probe");
    assert_eq!(first, 100, "the first call");
}

/// Calls refused at once (zero round trip, as in paused time or under a clock coarser than
/// the refusal) that were all in flight together cut the limit once, as the congestion
/// epoch promises: five permits granted at one instant and answered back-pressure at that
/// instant lower each algorithm from 20 to 18 and no further. A call that started at the
/// very instant of the cut counted as started after it, so each of the five cut again
/// (Aimd, Gradient2 and Probe went to 10, Vegas to 13).
#[tokio::test(start_paused = true)]
async fn calls_refused_at_once_cut_the_limit_once() {
    let built = [
        Bulkhead::builder(1000).adaptive(Aimd::builder().build().unwrap()),
        Bulkhead::builder(1000).adaptive(Vegas::builder().build().unwrap()),
        Bulkhead::builder(1000).adaptive(Gradient2::builder().build().unwrap()),
        Bulkhead::builder(1000).adaptive(Probe::builder().initial(20).build().unwrap()),
    ];
    let mut after = Vec::new();
    for builder in built {
        let b = builder.build().unwrap();
        let algorithm = b.adaptive_stats().unwrap().algorithm;
        tokio::time::sleep(10 * MS).await;
        let permits: Vec<_> = (0..5).map(|_| b.try_acquire().unwrap()).collect();
        for p in permits {
            p.record(Outcome::BackPressure);
        }
        after.push((algorithm, b.max_in_flight()));
    }
    let once = [
        ("aimd", 18),
        ("vegas", 18),
        ("gradient2", 18),
        ("probe", 18),
    ];
    assert_eq!(after, once, "one cut from 20 each");
}

/// A metrics recorder is user code, so it runs after the algorithm's lock is released: here
/// one that reads the bulkhead's stats whenever a gauge moves (an exporter snapshotting it,
/// say), which takes that lock. The gauges were moved under it, so the first cut deadlocked.
#[cfg(feature = "metrics")]
#[test]
fn the_gauges_are_moved_outside_the_algorithms_lock() {
    use std::sync::mpsc::RecvTimeoutError;

    let recorder = recorder::TestRecorder::default();
    let b = metrics::with_local_recorder(&recorder, || {
        Bulkhead::builder(10)
            .adaptive(Aimd::builder().build().unwrap())
            .name("snapshots")
            .build()
            .unwrap()
    });
    let exporter = b.clone();
    recorder.on_gauge(move || {
        let _ = exporter.adaptive_stats();
    });
    // On a thread of its own, so a deadlock fails the test instead of hanging it.
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        b.try_acquire().unwrap().record(Outcome::BackPressure);
        let _ = done.send(b.max_in_flight());
    });
    match finished.recv_timeout(Duration::from_secs(10)) {
        Ok(max) => assert_eq!(max, 9, "10 × 0.9"),
        Err(RecvTimeoutError::Timeout) => {
            panic!("deadlocked: a gauge moved under the algorithm's lock")
        }
        Err(RecvTimeoutError::Disconnected) => panic!("the sample's thread panicked"),
    }
    let gauge = recorder.gauge("flowgate_bulkhead_max_in_flight{name=snapshots}");
    assert_eq!(gauge, Some(9.0));
}

/// A metrics recorder is user code, so a panic of its own costs the sample nothing: the
/// algorithm learns from it and the bulkhead applies the `max_in_flight` it answers before
/// the sample is counted and the gauges moved. The sample's count used to come first (a
/// panic there kept the sample from the algorithm: no cut), and the gauges before the
/// bulkhead applied the answer (a panic there left the bulkhead at its old
/// `max_in_flight`, though `adaptive_stats` showed the cut).
#[cfg(feature = "metrics")]
#[test]
fn a_panicking_recorder_does_not_keep_a_sample_from_the_bulkhead() {
    use std::panic::{AssertUnwindSafe, catch_unwind};

    for metric in [
        "flowgate_bulkhead_samples_total{name=panicky,outcome=back_pressure}",
        "flowgate_bulkhead_max_in_flight{name=panicky}",
    ] {
        let recorder = recorder::TestRecorder::default();
        let b = aimd_bulkhead(&recorder, "panicky");
        assert_eq!(b.max_in_flight(), 20);
        recorder.panic_on(metric, true);
        let permit = b.try_acquire().unwrap();
        let recorded = catch_unwind(AssertUnwindSafe(|| {
            permit.record(Outcome::BackPressure);
        }));
        assert!(recorded.is_err(), "{metric}: the recorder panicked");
        recorder.panic_on(metric, false);
        let stats = b.adaptive_stats().unwrap();
        assert_eq!(stats.back_pressure, 1, "{metric}");
        assert_eq!(
            (b.max_in_flight(), stats.max_in_flight),
            (18, 18),
            "{metric}: cut once, 20 × 0.9, and applied"
        );
        assert_eq!(b.in_flight(), 0, "{metric}: the permit came back");
    }
}

/// A metrics recorder panicking as an adaptive bulkhead counts a sample must not keep the
/// sample's change from its gauges: the change is worked out against what they were last
/// moved to, so one lost leaves `flowgate_bulkhead_max_in_flight` off by it for good. The
/// count came first and its panic skipped the gauges: after a cut from 20 to 18, the gauge
/// stayed at 20, and at 19 after the next sample raised the limit to 19.
#[cfg(feature = "metrics")]
#[test]
fn a_panicking_sample_counter_leaves_the_bulkhead_gauges_at_the_applied_limit() {
    use std::panic::{AssertUnwindSafe, catch_unwind};

    let recorder = recorder::TestRecorder::default();
    let b = aimd_bulkhead(&recorder, "counted");
    let gauge = || recorder.gauge("flowgate_bulkhead_max_in_flight{name=counted}");
    assert_eq!(gauge(), Some(20.0));
    let counter = "flowgate_bulkhead_samples_total{name=counted,outcome=back_pressure}";
    recorder.panic_on(counter, true);
    let permit = b.try_acquire().unwrap();
    let recorded = catch_unwind(AssertUnwindSafe(|| permit.record(Outcome::BackPressure)));
    assert!(recorded.is_err(), "the recorder panicked");
    recorder.panic_on(counter, false);
    assert_eq!(b.max_in_flight(), 18);
    assert_eq!(gauge(), Some(18.0), "the gauge shows the applied limit");
    // Granted with half the limit in flight, a success raises it by one.
    let mut permits: Vec<_> = (0..9).map(|_| b.try_acquire().unwrap()).collect();
    permits.pop().unwrap().record(Outcome::Ok);
    assert_eq!(b.max_in_flight(), 19);
    assert_eq!(gauge(), Some(19.0), "and goes on showing it");
}

/// A waker panicking as an adaptive bulkhead applies a sample's answer (the raised limit
/// grants a waiter, and its waker panics) must not keep the sample's change from the
/// gauges: it was recorded only after the answer was applied, and the panic skipped it, so
/// `flowgate_bulkhead_max_in_flight` stayed at 20 for good while the bulkhead let 21 in.
#[cfg(feature = "metrics")]
#[test]
fn a_panicking_waker_leaves_the_bulkhead_gauges_at_the_applied_limit() {
    use std::future::Future;
    use std::panic::{AssertUnwindSafe, catch_unwind};
    use std::task::Context;

    let recorder = recorder::TestRecorder::default();
    let b = aimd_bulkhead(&recorder, "woken");
    let gauge = || recorder.gauge("flowgate_bulkhead_max_in_flight{name=woken}");
    let mut permits: Vec<_> = (0..20).map(|_| b.try_acquire().unwrap()).collect();
    let waker = wakers::panicking_waker();
    let mut waiter = Box::pin(b.acquire());
    assert!(
        waiter
            .as_mut()
            .poll(&mut Context::from_waker(&waker))
            .is_pending()
    );
    let last = permits.pop().unwrap();
    let recorded = catch_unwind(AssertUnwindSafe(|| last.record(Outcome::Ok)));
    assert!(recorded.is_err(), "the waker panicked");
    assert_eq!(b.max_in_flight(), 21);
    assert_eq!(gauge(), Some(21.0), "the gauge shows the applied limit");
    drop(waiter);
}

/// A permit dropped without `record` is an `Ignored` sample, fed after the permit is
/// returned: a return that panics (it grants a waiter whose waker panics) must not keep the
/// sample from the algorithm's counts and `flowgate_bulkhead_samples_total`, for the
/// borrowed permit and the owned one alike. (The panic skipped the sample: `ignored` stayed
/// 0 while the permit was gone.)
#[cfg(feature = "metrics")]
#[test]
fn a_permit_whose_return_panics_still_feeds_its_ignored_sample() {
    use std::future::Future;
    use std::panic::{AssertUnwindSafe, catch_unwind};
    use std::task::{Context, Waker};

    let recorder = recorder::TestRecorder::default();
    let b = aimd_bulkhead(&recorder, "returned");
    let ignored = "flowgate_bulkhead_samples_total{name=returned,outcome=ignored}";
    let waker = wakers::panicking_waker();
    let mut permits: Vec<_> = (0..19).map(|_| b.try_acquire().unwrap()).collect();
    let owned = b.try_acquire_owned().unwrap();
    assert_eq!(b.in_flight(), b.max_in_flight(), "every permit taken");
    let mut granted = Vec::new();
    for (round, drop_one) in [
        Box::new(|| drop(permits.pop().unwrap())) as Box<dyn FnOnce()>,
        Box::new(|| drop(owned)),
    ]
    .into_iter()
    .enumerate()
    {
        let mut waiter = Box::pin(b.acquire_owned());
        let mut cx = Context::from_waker(&waker);
        assert!(waiter.as_mut().poll(&mut cx).is_pending());
        let dropped = catch_unwind(AssertUnwindSafe(drop_one));
        assert!(dropped.is_err(), "round {round}: the waker panicked");
        let n = round as u64 + 1;
        assert_eq!(b.adaptive_stats().unwrap().ignored, n, "round {round}");
        assert_eq!(recorder.counter(ignored), n, "round {round}");
        // The waiter has the permit the drop returned (kept: the next round waits too).
        let mut cx = Context::from_waker(Waker::noop());
        match waiter.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(Ok(permit)) => granted.push(permit),
            other => panic!("round {round}: {other:?}"),
        }
        assert_eq!(b.in_flight(), b.max_in_flight(), "round {round}");
    }
}

/// An algorithm (user code) panicking on a sample must not keep the sample from
/// `flowgate_bulkhead_samples_total`: `adaptive_stats` counts it before the algorithm
/// runs, and the metric, recorded only after, missed it, so the two disagreed for good.
/// The permit comes back.
#[cfg(feature = "metrics")]
#[test]
fn a_panicking_algorithm_keeps_its_sample_counted() {
    use std::panic::{AssertUnwindSafe, catch_unwind};

    /// Panics on every sample.
    #[derive(Debug, Clone)]
    struct Panicky;
    impl AdaptiveLimit for Panicky {
        fn limit(&self) -> u32 {
            10
        }
        fn update(&mut self, _: &Sample) -> u32 {
            panic!("the algorithm panics");
        }
        fn name(&self) -> &'static str {
            "panicky"
        }
    }

    let recorder = recorder::TestRecorder::default();
    let b = metrics::with_local_recorder(&recorder, || {
        Bulkhead::builder(100)
            .adaptive(Panicky)
            .name("algorithm")
            .build()
            .unwrap()
    });
    let permit = b.try_acquire().unwrap();
    let recorded = catch_unwind(AssertUnwindSafe(|| permit.record(Outcome::Ok)));
    assert!(recorded.is_err(), "the algorithm panicked");
    assert_eq!(b.adaptive_stats().unwrap().ok, 1);
    assert_eq!(
        recorder.counter("flowgate_bulkhead_samples_total{name=algorithm,outcome=ok}"),
        1
    );
    assert_eq!(b.in_flight(), 0, "the permit came back");
    assert_eq!(b.max_in_flight(), 10);
}

/// Drive `probe` in a closed loop on the pure algorithm until `end`: each round trip, the
/// caller's calls (`limit`, or `caller` if fewer) start together and take `base` ms ×
/// (1 + (n − knee) / 2) above the knee, `(knee, base)` being the downstream's at that time.
/// Answers the limit after each round trip.
fn closed_loop(
    mut probe: Probe,
    caller: u32,
    downstream: impl Fn(Duration) -> (u32, f64),
    end: Duration,
) -> Vec<(Duration, u32)> {
    let mut now = Duration::ZERO;
    let mut limits = Vec::new();
    while now < end {
        let n = probe.limit().min(caller);
        let (knee, base) = downstream(now);
        let rtt =
            Duration::from_secs_f64(base * (1.0 + 0.5 * f64::from(n.saturating_sub(knee))) / 1e3);
        now += rtt;
        for _ in 0..n {
            probe.update(&Sample {
                rtt,
                in_flight: n,
                outcome: Outcome::Ok,
                now,
            });
        }
        limits.push((now, probe.limit()));
    }
    limits
}

/// The lowest and highest limit over `[from, to)` seconds.
fn limit_range(limits: &[(Duration, u32)], from: u64, to: u64) -> (u32, u32) {
    let (from, to) = (Duration::from_secs(from), Duration::from_secs(to));
    let within = || {
        limits
            .iter()
            .filter(move |(t, _)| *t >= from && *t < to)
            .map(|&(_, l)| l)
    };
    (within().min().unwrap(), within().max().unwrap())
}

/// A downstream that gets slower for good, at every load (a deploy, a failover to a farther
/// region), is not a queue the limit builds: cutting cannot bring its latency back under
/// `max_rtt_ratio` × the old minimum. Probe's docs say such a downstream is learnt again at
/// the current limit, never pinned low to measure it; it cut once per window down to
/// `min_limit` and held 1 until the old minimum aged out (some 30 s here), a fortieth of
/// the throughput. A knee at 40, every latency ×2.5 from 30 s on.
#[test]
fn probe_is_not_pinned_low_when_the_downstream_gets_slower_at_every_load() {
    let slower = |now: Duration| {
        (
            40,
            if now >= Duration::from_secs(30) {
                25.0
            } else {
                10.0
            },
        )
    };
    let limits = closed_loop(Probe::default(), u32::MAX, slower, Duration::from_secs(90));
    assert_eq!(
        limit_range(&limits, 10, 30),
        (39, 41),
        "settled at the knee"
    );
    let (lowest, _) = limit_range(&limits, 30, 90);
    assert!(lowest >= 30, "after the shift the limit fell to {lowest}");
    assert_eq!(limit_range(&limits, 60, 90), (39, 41), "back at the knee");
}

/// The other side of the test above: a caller that uses 30 of a limit of 60 when the
/// downstream's knee drops to 15 builds the queue itself, though the first cuts (to 54, 48,
/// ...) stay above its calls and cannot move the latency yet. They are no sign of a slower
/// downstream: Probe cuts on until the limit binds and the queue drains, as it did before
/// it learnt to tell the two apart.
#[test]
fn probe_cuts_an_app_limited_caller_down_to_a_lower_knee() {
    let drop = |now: Duration| {
        (
            if now >= Duration::from_secs(30) {
                15
            } else {
                40
            },
            10.0,
        )
    };
    let probe = Probe::builder().initial(60).max_limit(60).build().unwrap();
    let limits = closed_loop(probe, 30, drop, Duration::from_secs(60));
    assert_eq!(limit_range(&limits, 10, 30), (60, 60), "unused, kept");
    let (_, highest) = limit_range(&limits, 40, 60);
    assert!(
        highest <= 17,
        "a limit of {highest} after the knee dropped to 15"
    );
}

/// `Sample::now` comes from the caller's clock when an algorithm is driven directly, and a
/// clock can step back (a wall clock corrected after it jumped an hour ahead). One
/// back-pressure sample stamped an hour ahead made its instant the last cut, so no later
/// back-pressure sample (all of them "started before" it) cut again until the clock caught
/// up: each algorithm ignored an overload for an hour.
#[test]
fn back_pressure_cuts_again_after_the_clock_stepped_back() {
    let algorithms: Vec<Box<dyn AdaptiveLimit>> = vec![
        Box::new(Aimd::builder().build().unwrap()),
        Box::new(Vegas::builder().build().unwrap()),
        Box::new(Gradient2::builder().build().unwrap()),
        Box::new(Probe::builder().initial(20).build().unwrap()),
    ];
    let mut after = Vec::new();
    for mut algorithm in algorithms {
        let busy = |now: Duration| Sample {
            rtt: 10 * MS,
            in_flight: 20,
            outcome: Outcome::BackPressure,
            now,
        };
        algorithm.update(&busy(Duration::from_secs(3_600)));
        let cut_once = algorithm.limit();
        // Back on time: five overloads a second apart, each call started after the last cut.
        for s in 1..=5 {
            algorithm.update(&busy(Duration::from_secs(s)));
        }
        after.push((algorithm.name(), cut_once > algorithm.limit()));
    }
    let cut = [
        ("aimd", true),
        ("vegas", true),
        ("gradient2", true),
        ("probe", true),
    ];
    assert_eq!(after, cut, "each cuts again once the clock is back");
}

/// Probe's window opened at the instant of the sample that closed the last one: with that
/// instant an hour ahead (a clock that then stepped back), every later call "started before
/// the window opened" and was ignored, so the limit froze for an hour. Here in slow start:
/// 4 → 8 on the window the stray sample closes, then it stayed 8 under calls that reach it.
#[test]
fn probe_learns_again_after_the_clock_stepped_back() {
    let mut probe = Probe::builder().initial(4).build().unwrap();
    let call = |in_flight: u32, now: Duration| Sample {
        rtt: 10 * MS,
        in_flight,
        outcome: Outcome::Ok,
        now,
    };
    for _ in 0..3 {
        probe.update(&call(4, 10 * MS));
    }
    probe.update(&call(4, Duration::from_secs(3_600)));
    assert_eq!(probe.limit(), 8, "slow start doubles");
    // Back on time: calls that reach the limit, one window of them after another.
    let mut now = 10 * MS;
    for _ in 0..200 {
        now += 10 * MS;
        let limit = probe.limit();
        for _ in 0..limit {
            probe.update(&call(limit, now));
        }
    }
    assert!(probe.limit() >= 64, "still {} after 2 s", probe.limit());
}

/// A `max_limit` left at its default (1000) gives way to a bulkhead's bound, and so to an
/// `initial` or `min_limit` set above it: `Aimd::builder().initial(2_000)` for a bulkhead
/// of 10 000 was refused at build ("outside [min_limit, max_limit]") unless a max was named
/// too. One given explicitly is still checked against them.
#[test]
fn a_default_max_limit_gives_way_to_initial_and_min_limit() {
    fn started(limit: Result<impl AdaptiveLimit, flowgate::ConfigError>) -> u32 {
        limit.unwrap().limit()
    }
    assert_eq!(started(Aimd::builder().initial(2_000).build()), 2_000);
    assert_eq!(started(Gradient2::builder().initial(2_000).build()), 2_000);
    assert_eq!(started(Vegas::builder().initial(2_000).build()), 2_000);
    assert_eq!(started(Probe::builder().initial(2_000).build()), 2_000);
    assert_eq!(
        started(Aimd::builder().min_limit(1_500).initial(1_500).build()),
        1_500
    );
    let err = Aimd::builder()
        .max_limit(1_000)
        .initial(2_000)
        .build()
        .unwrap_err();
    assert_eq!(err.field(), "aimd.initial");

    let bulkhead = Bulkhead::builder(10_000)
        .adaptive(Aimd::builder().initial(2_000).build().unwrap())
        .build()
        .unwrap();
    assert_eq!(bulkhead.max_in_flight(), 2_000);
}

/// A `Probe` whose `initial` is at its default `max_limit` (1000, or an `initial` above
/// it, which the default max rises to) holds from the start: there is no room to double.
/// Its adaptive bulkhead then raises that max to its own bound, and the room is there: it
/// slow-starts from `initial`, as one started one lower does. It held at its `initial`
/// instead, and grew one trial step (a 32nd) at a time, every ninth window at best:
/// `Bulkhead::builder(10_000).adaptive(Probe::builder().initial(1_000).build()?)` was at
/// 1000 after four windows of calls that reached it, where an `initial` of 999 was at
/// 10 000.
#[tokio::test(start_paused = true)]
async fn probe_slow_starts_from_its_default_max_once_a_bulkhead_raises_it() {
    let after_four_windows = |initial: u32| {
        let mut probe = Probe::builder().initial(initial).build().unwrap();
        probe.bound(1, 10_000);
        let mut now = Duration::ZERO;
        for _ in 0..4 {
            // A window of calls that reached the limit, none queued: one round trip, a
            // quarter of the limit and one more calls, each 10 ms.
            let limit = probe.limit();
            now += 10 * MS;
            for _ in 0..=limit / 4 {
                probe.update(&Sample {
                    rtt: 10 * MS,
                    in_flight: limit,
                    outcome: Outcome::Ok,
                    now,
                });
            }
        }
        (probe.limit(), probe.in_slow_start())
    };
    for initial in [999, 1_000, 2_000] {
        let reached = after_four_windows(initial);
        assert_eq!(
            reached,
            (10_000, false),
            "doubled from {initial} to the bound"
        );
    }
    // A max given explicitly is kept: no room, no slow start.
    let mut given = Probe::builder()
        .initial(1_000)
        .max_limit(1_000)
        .build()
        .unwrap();
    given.bound(1, 10_000);
    assert!(!given.in_slow_start());
    // Through a bulkhead: the first window of calls that reach 1000 doubles it.
    let bulkhead = Bulkhead::builder(10_000)
        .adaptive(Probe::builder().initial(1_000).build().unwrap())
        .build()
        .unwrap();
    let permits: Vec<_> = futures::future::join_all((0..1_000).map(|_| bulkhead.acquire()))
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    tokio::time::advance(10 * MS).await;
    // The last granted first: the window's first call saw 1000 in flight.
    for permit in permits.into_iter().rev() {
        permit.record(Outcome::Ok);
    }
    assert_eq!(bulkhead.max_in_flight(), 2_000);
}

/// What an operator reads from an adaptive bulkhead's metrics agrees with
/// [`Bulkhead::adaptive_stats`]: each sample counted once under its outcome (a permit
/// dropped without an outcome is `ignored`), `max_in_flight` and the RTT estimates as the
/// algorithm set them; and every gauge goes back to 0 once the bulkhead and its clones are
/// dropped. (Coverage: these metrics had no test.)
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn the_adaptive_metrics_agree_with_adaptive_stats_and_end_at_zero() {
    let recorder = recorder::TestRecorder::default();
    let b = metrics::with_local_recorder(&recorder, || {
        Bulkhead::builder(10)
            .adaptive(Vegas::builder().build().unwrap())
            .name("adaptive-metrics")
            .build()
            .unwrap()
    });
    let clone = b.clone();
    for i in 0..20u64 {
        let permit = clone.acquire().await.unwrap();
        tokio::time::advance(Duration::from_millis(10 + i)).await;
        match i % 4 {
            0 | 3 => permit.record(Outcome::Ok),
            1 => permit.record(Outcome::BackPressure),
            _ => drop(permit),
        }
    }
    let id =
        |m: &str, label: &str| format!("flowgate_bulkhead_{m}{{{label}name=adaptive-metrics}}");
    let samples = |o: &str| {
        recorder.counter(&format!(
            "flowgate_bulkhead_samples_total{{name=adaptive-metrics,outcome={o}}}"
        ))
    };
    let stats = b.adaptive_stats().unwrap();
    assert_eq!((stats.ok, stats.back_pressure, stats.ignored), (10, 5, 5));
    assert_eq!(
        (samples("ok"), samples("back_pressure"), samples("ignored")),
        (stats.ok, stats.back_pressure, stats.ignored)
    );
    assert_eq!(
        recorder.gauge(&id("max_in_flight", "")),
        Some(stats.max_in_flight as f64)
    );
    let min = stats.rtt.min.expect("vegas keeps its no-load RTT");
    assert_eq!(
        recorder.gauge(&id("rtt_seconds", "kind=min,")),
        Some(min.as_secs_f64())
    );
    drop((b, clone));
    for gauge in [
        id("max_in_flight", ""),
        id("rtt_seconds", "kind=min,"),
        id("rtt_seconds", "kind=smoothed,"),
        id("in_flight", ""),
        id("waiting", ""),
    ] {
        assert_eq!(recorder.gauge(&gauge), Some(0.0), "{gauge}");
    }
}

/// An adaptive bulkhead through 3 000 calls whose round trips wander from 1 to 60 ms: after
/// each, `flowgate_bulkhead_rtt_seconds{kind}` reads the estimates
/// [`adaptive_stats`](Bulkhead::adaptive_stats) gives, not a sum of rounded changes drifting
/// away from them.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn the_rtt_gauges_read_the_estimates_through_a_long_run() {
    let recorder = recorder::TestRecorder::default();
    let b = metrics::with_local_recorder(&recorder, || {
        Bulkhead::builder(10)
            .adaptive(Vegas::builder().build().unwrap())
            .name("rtt-drift")
            .build()
            .unwrap()
    });
    let gauge = |kind: &str| {
        recorder.gauge(&format!(
            "flowgate_bulkhead_rtt_seconds{{kind={kind},name=rtt-drift}}"
        ))
    };
    let secs = |d: Option<Duration>| d.map(|d| d.as_secs_f64());
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut wrong = Vec::new();
    for call in 0..3_000u32 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let permit = b.acquire().await.unwrap();
        tokio::time::advance(Duration::from_micros(1_000 + seed % 59_000)).await;
        permit.record(Outcome::Ok);
        let rtt = b.adaptive_stats().unwrap().rtt;
        let (shown, expected) = (
            (gauge("min"), gauge("smoothed")),
            (secs(rtt.min), secs(rtt.smoothed)),
        );
        if shown.0.or(Some(0.0)) != expected.0.or(Some(0.0))
            || shown.1.or(Some(0.0)) != expected.1.or(Some(0.0))
        {
            wrong.push((call, expected, shown));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of 3 000 calls left a gauge off the estimates; the first and last (call, \
         estimates, shown): {:?} {:?}",
        wrong.len(),
        wrong.first(),
        wrong.last()
    );
}

/// One step of a random history: a finished call, or new bounds from a bulkhead.
#[derive(Debug, Clone)]
enum Step {
    /// A call of this round trip, calls in flight and outcome, ending when `Clock` says.
    Call(Duration, u32, Outcome, Clock),
    Bound(u32, u32),
}

/// When a call ends.
#[derive(Debug, Clone, Copy)]
enum Clock {
    /// This long after the last one.
    Forwards(Duration),
    /// At this time, whatever the last one was (a clock that stepped back, or ahead).
    At(Duration),
}

fn any_step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    let rtt = prop_oneof![
        3 => Just(Duration::ZERO),
        10 => (1u64..2_000_000_000).prop_map(Duration::from_nanos),
        1 => Just(Duration::from_secs(3_600)),
        1 => Just(Duration::MAX),
    ];
    let in_flight = prop_oneof![8 => 0u32..200, 1 => Just(u32::MAX)];
    let outcome = prop_oneof![
        6 => Just(Outcome::Ok),
        2 => Just(Outcome::BackPressure),
        2 => Just(Outcome::Ignored),
    ];
    let clock = prop_oneof![
        12 => (0u64..2_000).prop_map(|ms| Clock::Forwards(Duration::from_millis(ms))),
        1 => (0u64..600_000).prop_map(|ms| Clock::At(Duration::from_millis(ms))),
        1 => Just(Clock::At(Duration::MAX)),
    ];
    prop_oneof![
        30 => (rtt, in_flight, outcome, clock).prop_map(|(r, n, o, c)| Step::Call(r, n, o, c)),
        1 => (0u32..2_000, 0u32..2_000).prop_map(|(a, b)| Step::Bound(a, b)),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

    /// Whatever calls end and however the clock moves (zero and century-long round trips,
    /// no call or `u32::MAX` in flight, a clock that steps back or jumps to the end of
    /// time), every algorithm answers a limit of at least 1, within the last bounds it was
    /// given, without panicking; a zero round trip is never its minimum; and a call that
    /// says nothing about capacity (`Ignored`: cancelled, dropped, a client error) changes
    /// nothing in its state.
    #[test]
    fn the_algorithms_stay_within_their_bounds_and_ignore_ignored_calls(
        steps in proptest::collection::vec(any_step(), 1..200),
    ) {
        let algorithms: Vec<Box<dyn AdaptiveLimit>> = vec![
            Box::new(Aimd::builder().build().unwrap()),
            Box::new(Vegas::builder().build().unwrap()),
            Box::new(Gradient2::builder().build().unwrap()),
            Box::new(Probe::default()),
            Box::new(Probe::builder().initial(1).max_limit(4).build().unwrap()),
        ];
        for mut algorithm in algorithms {
            let (mut lo, mut hi) = (1, (1u32 << 31) - 1);
            let mut now = Duration::ZERO;
            for step in &steps {
                match *step {
                    Step::Bound(min, max) => {
                        algorithm.bound(min, max);
                        lo = min.max(1);
                        hi = max.max(lo);
                    }
                    Step::Call(rtt, in_flight, outcome, clock) => {
                        now = match clock {
                            Clock::Forwards(d) => now.saturating_add(d),
                            Clock::At(at) => at,
                        };
                        let sample = Sample { rtt, in_flight, outcome, now };
                        let before = format!("{algorithm:?}");
                        let limit = algorithm.update(&sample);
                        proptest::prop_assert_eq!(limit, algorithm.limit());
                        if outcome == Outcome::Ignored {
                            proptest::prop_assert_eq!(before, format!("{algorithm:?}"));
                        }
                    }
                }
                let limit = algorithm.limit();
                proptest::prop_assert!(
                    (lo..=hi).contains(&limit),
                    "{}: {} outside [{}, {}]",
                    algorithm.name(),
                    limit,
                    lo,
                    hi
                );
                proptest::prop_assert_ne!(algorithm.rtt_estimates().min, Some(Duration::ZERO));
            }
        }
    }
}

/// A metrics recorder panicking as the `AdaptivePacer` sets its rate gauge must not leave
/// the pacer at a stale rate. Two feedback calls may hand their rates to the pacer in the
/// opposite order to the one they set them in; the one that hands over last checks
/// afterwards that the pacer has the latest rate. Here a cut is handed over after a lower
/// cap of the server's policy (its pause wakes a waiter, whose waker lets the policy in
/// first), and the rate gauge's recorder panics on the cut's rate: the check was skipped,
/// and the pacer kept pacing at the cut's 70/s, above the 10/s the controller had set.
#[cfg(feature = "metrics")]
#[test]
fn a_panicking_rate_gauge_leaves_the_adaptive_pacer_at_the_latest_rate() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc;
    use std::task::{Wake, Waker};

    /// Wakes once into `woken`, then waits for `go`: the interleaving a preempted thread
    /// would give, made certain.
    struct Stall {
        armed: AtomicBool,
        woken: Mutex<mpsc::Sender<()>>,
        go: Mutex<mpsc::Receiver<()>>,
    }
    impl Wake for Stall {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            if self.armed.swap(false, Ordering::SeqCst) {
                self.woken.lock().unwrap().send(()).unwrap();
                self.go.lock().unwrap().recv().unwrap();
            }
        }
    }

    let (recorder, panics, adaptive) = panicky_pacer("race");
    let gauge = || recorder.gauge("flowgate_pace_adaptive_rate{name=race}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _entered = rt.enter();

    // A waiter in line (the burst taken first), its waker the stall.
    let (woken_tx, woken) = mpsc::channel();
    let (go, go_rx) = mpsc::channel();
    let stall = Arc::new(Stall {
        armed: AtomicBool::new(false),
        woken: Mutex::new(woken_tx),
        go: Mutex::new(go_rx),
    });
    let waker = Waker::from(stall.clone());
    let waiter = in_line(&adaptive, &waker);
    stall.armed.store(true, Ordering::SeqCst);

    // The cut (to 70/s) applied, its pause waking the waiter before it hands the rate over.
    let cutting = adaptive.clone();
    let cut = std::thread::spawn(move || {
        cutting.on_back_pressure(Some(Duration::from_secs(1)));
    });
    woken.recv().unwrap();
    // Meanwhile, the server's policy caps the rate at 10/s, handed over in full.
    adaptive.on_policy(10, Duration::from_secs(1));
    assert_eq!(adaptive.status().rate_per_second, 10.0);
    assert_eq!(adaptive.rate().per_second_f64(), 10.0);
    // The cut's hand-over goes on, and the recorder panics on its rate.
    panics.store(true, Ordering::SeqCst);
    go.send(()).unwrap();
    assert!(cut.join().is_err(), "the recorder panicked");
    assert!(!panics.load(Ordering::SeqCst), "on the cut's rate");

    assert_eq!(adaptive.status().rate_per_second, 10.0);
    assert_eq!(
        adaptive.rate().per_second_f64(),
        10.0,
        "the pacer paces at the latest rate"
    );
    assert_eq!(gauge(), Some(10.0), "and the gauge shows it");
    drop(waiter);
}

/// A metrics recorder panicking as an `AdaptivePacer` sets its rate gauge on back-pressure
/// must not keep the pause and the cut from their counters: they are the pacer's by then
/// (the status counts them), and the gauge was set before they were counted, so its panic
/// skipped both.
#[cfg(feature = "metrics")]
#[test]
fn a_panicking_rate_gauge_keeps_the_adaptive_pacer_cut_counted() {
    use std::panic::{AssertUnwindSafe, catch_unwind};
    use std::sync::atomic::Ordering;

    let (recorder, panics, adaptive) = panicky_pacer("counted");
    panics.store(true, Ordering::SeqCst);
    let cut = catch_unwind(AssertUnwindSafe(|| {
        adaptive.on_back_pressure(Some(Duration::from_secs(1)));
    }));
    assert!(cut.is_err(), "the recorder panicked");
    assert!(!panics.load(Ordering::SeqCst), "on the cut's rate");
    let status = adaptive.status();
    assert_eq!((status.pauses, status.cuts), (1, 1));
    assert_eq!(adaptive.rate().per_second_f64(), 70.0);
    assert_eq!(
        recorder.counter("flowgate_pace_adaptive_pauses_total{name=counted}"),
        1
    );
    assert_eq!(
        recorder.counter("flowgate_pace_adaptive_cuts_total{name=counted}"),
        1
    );
}

/// A waiter's waker panicking as an `AdaptivePacer` pauses on back-pressure (the pause
/// wakes the waiters to recompute their due time) must not keep the cut from the pacer:
/// the pause came first and its panic skipped the hand-over, so the pacer went on at
/// 100/s, the controller at 70/s, and no later call handed the cut over (a rate within
/// 0.1 % of the one last applied is not).
#[cfg(feature = "metrics")]
#[test]
fn a_panicking_waker_keeps_no_cut_from_the_adaptive_pacer() {
    use std::panic::{AssertUnwindSafe, catch_unwind};

    let (recorder, _, adaptive) = panicky_pacer("paused");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _entered = rt.enter();
    let waker = wakers::panicking_waker();
    let waiter = in_line(&adaptive, &waker);
    let cut = catch_unwind(AssertUnwindSafe(|| {
        adaptive.on_back_pressure(Some(Duration::from_secs(1)));
    }));
    assert!(cut.is_err(), "the waker panicked");
    assert_eq!(adaptive.status().rate_per_second, 70.0);
    assert_eq!(
        adaptive.rate().per_second_f64(),
        70.0,
        "the pacer has the cut"
    );
    assert_eq!(
        recorder.gauge("flowgate_pace_adaptive_rate{name=paused}"),
        Some(70.0)
    );
    assert_eq!(
        recorder.counter("flowgate_pace_adaptive_cuts_total{name=paused}"),
        1
    );
    drop(waiter);
}

/// An `AdaptivePacer` of 100/s named `name`, its recorder, and a flag that makes the
/// recorder panic once, on the next move of a gauge.
#[cfg(feature = "metrics")]
fn panicky_pacer(
    name: &str,
) -> (
    recorder::TestRecorder,
    Arc<std::sync::atomic::AtomicBool>,
    flowgate::pace::AdaptivePacer,
) {
    use std::sync::atomic::{AtomicBool, Ordering};

    let recorder = recorder::TestRecorder::default();
    let panics = Arc::new(AtomicBool::new(false));
    let armed = panics.clone();
    recorder.on_gauge(move || {
        if armed.swap(false, Ordering::SeqCst) {
            panic!("the recorder panics");
        }
    });
    let adaptive = metrics::with_local_recorder(&recorder, || {
        flowgate::pace::AdaptivePacer::builder(flowgate::Rate::per_second(100).unwrap())
            .name(name)
            .build()
            .unwrap()
    });
    (recorder, panics, adaptive)
}

/// An adaptive bulkhead of at most 100, `Aimd` with its defaults, named `name`, recording
/// to `recorder`.
#[cfg(feature = "metrics")]
fn aimd_bulkhead(recorder: &recorder::TestRecorder, name: &str) -> Bulkhead {
    metrics::with_local_recorder(recorder, || {
        Bulkhead::builder(100)
            .adaptive(Aimd::builder().build().unwrap())
            .name(name)
            .build()
            .unwrap()
    })
}

/// A wait for one unit of `adaptive` in line (the burst taken first), polled with `waker`.
#[cfg(feature = "metrics")]
fn in_line(
    adaptive: &flowgate::pace::AdaptivePacer,
    waker: &std::task::Waker,
) -> std::pin::Pin<Box<flowgate::pace::UntilReady>> {
    use std::future::Future;

    loop {
        let mut wait = Box::pin(adaptive.until_ready(1));
        let polled = wait
            .as_mut()
            .poll(&mut std::task::Context::from_waker(waker));
        if polled.is_pending() {
            return wait;
        }
    }
}
