//! The simulated downstream and its driver (`flowgate::adaptive::sim`), under paused time.

use std::time::Duration;

use flowgate::ConfigErrorKind;
use flowgate::adaptive::sim::{self, Downstream, Load, Scenario, Status};
use flowgate::adaptive::{AdaptiveLimit, Outcome, Sample};
use flowgate::bulkhead::Bulkhead;

const MS: Duration = Duration::from_millis(1);

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// `base × (1 + slope·(n − 1) + max(0, k^(n − knee) − 1))`, written out by hand.
fn expected(base_ms: f64, slope: f64, k: f64, knee: u32, n: u32) -> Duration {
    let queue = if n > knee {
        k.powi((n - knee) as i32) - 1.0
    } else {
        0.0
    };
    Duration::from_secs_f64(base_ms / 1000.0 * (1.0 + slope * f64::from(n - 1) + queue))
}

fn close(a: Duration, b: Duration) -> bool {
    a.abs_diff(b) <= Duration::from_nanos(10)
}

#[tokio::test(start_paused = true)]
async fn latency_follows_the_formula_at_chosen_n() {
    let d = Downstream::builder()
        .base(20 * MS)
        .slope(0.01)
        .steepness(1.2)
        .knee(30)
        .build()
        .unwrap();
    for n in [1, 2, 10, 29, 30, 31, 35, 50] {
        let want = expected(20.0, 0.01, 1.2, 30, n);
        assert!(
            close(d.latency(n), want),
            "n = {n}: {:?} vs {want:?}",
            d.latency(n)
        );
    }
    // Never below base, even where the raw exponential term is negative.
    assert_eq!(d.latency(1), 20 * MS);
    assert!(d.latency(10) > 20 * MS);
    // Exactly at the knee the exponential term is zero.
    assert!(close(d.latency(30), expected(20.0, 0.01, 1.0, 30, 30)));
}

#[tokio::test(start_paused = true)]
async fn a_call_sleeps_its_latency_and_counts_in_flight() {
    let d = Downstream::builder()
        .base(10 * MS)
        .slope(0.5)
        .knee(100)
        .build()
        .unwrap();
    let first = d.call();
    let second = d.call();
    assert_eq!(d.in_flight(), 2);
    let t0 = tokio::time::Instant::now();
    let (a, b) = tokio::join!(first, second);
    assert_eq!((a.status, a.in_flight, a.rtt), (Status::Ok, 1, 10 * MS));
    assert_eq!((b.status, b.in_flight, b.rtt), (Status::Ok, 2, 15 * MS));
    assert_eq!(t0.elapsed(), 15 * MS);
    assert_eq!(d.in_flight(), 0);
    // A dropped call leaves the count.
    let dropped = d.call();
    assert_eq!(d.in_flight(), 1);
    drop(dropped);
    assert_eq!(d.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn above_capacity_calls_are_overloaded_and_slow_ones_time_out() {
    let d = Downstream::builder()
        .base(10 * MS)
        .slope(0.0)
        .steepness(2.0)
        .knee(2)
        .capacity(4)
        .timeout(50 * MS)
        .build()
        .unwrap();
    let calls: Vec<_> = (0..6).map(|_| d.call()).collect();
    let replies = futures::future::join_all(calls).await;
    let statuses: Vec<_> = replies.iter().map(|r| r.status).collect();
    // n = 1, 2: base; n = 3: 2× base; n = 4: 4× base = 40 ms; n = 5, 6: above capacity.
    assert_eq!(
        statuses,
        [
            Status::Ok,
            Status::Ok,
            Status::Ok,
            Status::Ok,
            Status::Overloaded,
            Status::Overloaded
        ]
    );
    assert_eq!(replies[3].rtt, 40 * MS);
    assert_eq!(replies[4].rtt, 10 * MS, "refused at once, after base");
    assert_eq!(Status::Overloaded.outcome(), Outcome::BackPressure);

    // Without capacity, the fifth call would take 8× base = 80 ms: a timeout at 50 ms.
    let d = Downstream::builder()
        .base(10 * MS)
        .slope(0.0)
        .steepness(2.0)
        .knee(2)
        .timeout(50 * MS)
        .build()
        .unwrap();
    let calls: Vec<_> = (0..5).map(|_| d.call()).collect();
    let replies = futures::future::join_all(calls).await;
    assert_eq!(replies[3].status, Status::Ok);
    assert_eq!(replies[4].status, Status::TimedOut);
    assert_eq!(replies[4].rtt, 50 * MS);
    assert_eq!(Status::TimedOut.outcome(), Outcome::BackPressure);
}

/// "The model answers no latency above an hour": nor does a call refused at the door,
/// answered after `base`. With a `base` of `Duration::MAX` it was answered after ~30 years
/// (tokio's farthest timer) with a round trip of `Duration::MAX`.
#[tokio::test(start_paused = true)]
async fn a_refused_call_takes_no_longer_than_an_hour_either() {
    let hour = Duration::from_secs(3_600);
    let d = Downstream::builder()
        .base(Duration::MAX)
        .capacity(1)
        .build()
        .unwrap();
    let start = tokio::time::Instant::now();
    let (served, refused) = futures::future::join(d.call(), d.call()).await;
    assert_eq!(
        (served.status, refused.status),
        (Status::Ok, Status::Overloaded)
    );
    assert_eq!(served.rtt, hour);
    assert_eq!(refused.rtt, hour);
    assert!(start.elapsed() <= hour + MS, "{:?}", start.elapsed());
}

#[tokio::test(start_paused = true)]
async fn the_capacity_drop_halves_the_knee_at_30s_and_restores_it_at_60s() {
    let scenario = Scenario::capacity_drop();
    let d = scenario.downstream();
    assert_eq!((d.knee(), d.capacity()), (60, Some(120)));
    let at_knee = d.latency(60);
    tokio::time::sleep(secs(30) - MS).await;
    assert_eq!(d.knee(), 60);
    tokio::time::sleep(MS).await;
    assert_eq!((d.knee(), d.capacity()), (30, Some(60)));
    assert!(
        d.latency(60) > at_knee * 5,
        "60 in flight is far past the new knee"
    );
    tokio::time::sleep(secs(30)).await;
    assert_eq!((d.knee(), d.capacity()), (60, Some(120)));
    assert_eq!(d.latency(60), at_knee);
    assert_eq!(scenario.changes(), [secs(30), secs(60)]);
    assert_eq!([5, 45, 90].map(|s| scenario.knee_at(secs(s))), [60, 30, 60]);

    // Through the driver: with a fixed limit of 70 the middle phase overloads.
    let d = scenario.downstream();
    let report = sim::drive(&d, &Bulkhead::new(70).unwrap(), &scenario.load()).await;
    let before = report.latency(secs(10), secs(30), 0.5);
    let during = report.latency(secs(35), secs(60), 0.5);
    let after = report.latency(secs(65), secs(120), 0.5);
    assert!(during > before * 5, "{during:?} vs {before:?}");
    assert!(
        after.abs_diff(before) < before / 10,
        "{after:?} vs {before:?}"
    );
    assert!(report.error_ratio(secs(35), secs(60)) > 0.0);
    assert_eq!(report.error_ratio(secs(10), secs(30)), 0.0);
}

#[tokio::test(start_paused = true)]
async fn same_seed_same_run() {
    async fn run(seed: u64) -> sim::Report {
        let scenario = Scenario::noisy().with_seed(seed);
        let load = Load::new(100, secs(5));
        sim::drive(&scenario.downstream(), &Bulkhead::new(30).unwrap(), &load).await
    }
    let (a, b, c) = (run(7).await, run(7).await, run(8).await);
    assert!(a.calls().len() > 1_000);
    assert_eq!(a.calls(), b.calls());
    assert_eq!(a.limits(), b.limits());
    assert_ne!(a.calls(), c.calls(), "another seed, another run");
}

#[tokio::test(start_paused = true)]
async fn jitter_stays_within_its_bounds() {
    let d = Downstream::builder()
        .base(100 * MS)
        .slope(0.0)
        .jitter(0.2)
        .seed(3)
        .build()
        .unwrap();
    let mut seen = Vec::new();
    for _ in 0..200 {
        seen.push(d.call().await.rtt);
    }
    assert!(seen.iter().all(|r| (80 * MS..=120 * MS).contains(r)));
    let (min, max) = (seen.iter().min().unwrap(), seen.iter().max().unwrap());
    assert!(*min < 85 * MS && *max > 115 * MS, "{min:?}..{max:?}");
}

#[tokio::test(start_paused = true)]
async fn a_fixed_limit_at_the_knee_beats_one_far_above_it() {
    let scenario = Scenario::steep_knee();
    let load = Load::new(200, secs(20));
    let at = sim::drive(&scenario.downstream(), &Bulkhead::new(40).unwrap(), &load).await;
    let above = sim::drive(&scenario.downstream(), &Bulkhead::new(60).unwrap(), &load).await;
    let window = (secs(2), secs(20));
    let (t_at, t_above) = (
        at.throughput(window.0, window.1),
        above.throughput(window.0, window.1),
    );
    // 40 / (25 ms × 1.078) ≈ 1 484/s at the knee.
    assert!((1_400.0..1_550.0).contains(&t_at), "{t_at}");
    assert!(t_above < t_at * 0.5, "{t_above} vs {t_at}");
    assert!(above.latency(window.0, window.1, 0.99) > at.latency(window.0, window.1, 0.99) * 4);
    assert!(at.limits().iter().all(|&(_, l)| l == 40));
    assert_eq!(at.limits().len(), 200, "one sample per 100 ms tick");
}

/// Halves the limit on back-pressure, +1 otherwise: enough to see the feedback loop work.
#[derive(Debug, Clone)]
struct Halve(u32);

impl AdaptiveLimit for Halve {
    fn limit(&self) -> u32 {
        self.0
    }
    fn update(&mut self, sample: &Sample) -> u32 {
        self.0 = match sample.outcome {
            Outcome::BackPressure => (self.0 / 2).max(1),
            _ => (self.0 + 1).min(1_000),
        };
        self.0
    }
    fn name(&self) -> &'static str {
        "halve"
    }
}

#[tokio::test(start_paused = true)]
async fn drive_adaptive_feeds_the_limit_and_applies_it() {
    let scenario = Scenario::shallow_knee();
    let report =
        sim::drive_adaptive(&scenario.downstream(), Halve(10), &Load::new(200, secs(10))).await;
    let limits = report.limits();
    assert_eq!(limits[0], (Duration::ZERO, 10));
    // It grows until the capacity (80) refuses calls, then halves: never far above 80.
    let peak = limits.iter().map(|&(_, l)| l).max().unwrap();
    assert!((80..200).contains(&peak), "{peak}");
    assert!(report.count(Duration::ZERO, secs(10), Status::Overloaded) > 0);
    assert!(report.oscillation(secs(2), secs(10)) > 5.0);
}

#[tokio::test(start_paused = true)]
async fn report_windows() {
    let scenario = Scenario::steep_knee();
    let report = sim::drive(
        &scenario.downstream(),
        &Bulkhead::new(20).unwrap(),
        &Load::new(50, secs(4)),
    )
    .await;
    assert_eq!(
        report.settle_time(Duration::ZERO, secs(4), 20, 0.2),
        Some(Duration::ZERO)
    );
    assert_eq!(report.settle_time(Duration::ZERO, secs(4), 40, 0.2), None);
    assert_eq!(report.oscillation(Duration::ZERO, secs(4)), 0.0);
    assert_eq!(report.mean_limit(Duration::ZERO, secs(4)), 20.0);
    assert!(report.calls().iter().all(|c| c.end < secs(4)));
    let all = report.calls().len();
    assert_eq!(report.count(Duration::ZERO, secs(4), Status::Ok), all);
    assert!(report.latency(Duration::ZERO, secs(4), 0.5) >= Duration::from_micros(23_750));
}

/// A run of `Duration::MAX` ("until I stop it") runs, here until the test stops waiting,
/// instead of panicking on `Instant + Duration::MAX`.
#[tokio::test(start_paused = true)]
async fn a_run_of_duration_max_does_not_panic() {
    let downstream = Scenario::steep_knee().downstream();
    let bulkhead = Bulkhead::new(4).unwrap();
    let load = Load::new(2, Duration::MAX).tick(Duration::MAX);
    let running = sim::drive(&downstream, &bulkhead, &load);
    let still = tokio::time::timeout(secs(1), running).await;
    assert!(still.is_err(), "a run of Duration::MAX ended");
}

/// A two-minute scenario runs on tokio's paused clock alone: the run ends when that clock
/// has moved by exactly its 120 s, every wait of the driver and the downstream a timer the
/// runtime jumps to whenever every task waits (so none of it is real time: about half a
/// second optimised, ten times that unoptimised, as the module docs say; printed, not
/// asserted, as a machine's speed is no property of the code), and it makes the 100 000-odd
/// calls the docs say, no more work than that.
#[test]
fn a_two_minute_scenario_runs_on_tokios_paused_clock() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    let scenario = Scenario::capacity_drop();
    assert_eq!(scenario.duration(), secs(120));
    let wall = std::time::Instant::now();
    let (report, simulated) = rt.block_on(async {
        let start = tokio::time::Instant::now();
        let report = sim::drive(
            &scenario.downstream(),
            &Bulkhead::new(40).unwrap(),
            &scenario.load(),
        )
        .await;
        (report, start.elapsed())
    });
    assert_eq!(simulated, secs(120));
    let calls = report.calls().len();
    assert!((100_000..200_000).contains(&calls), "{calls} calls");
    eprintln!(
        "120 s simulated in {:?} of real time, {calls} calls",
        wall.elapsed()
    );
}

#[test]
fn bad_configs_are_typed_errors() {
    let err = |b: flowgate::adaptive::sim::DownstreamBuilder| b.build().unwrap_err();
    assert_eq!(err(Downstream::builder().knee(0)).field(), "sim.knee");
    assert_eq!(
        err(Downstream::builder().knee_at(secs(1), 0)).field(),
        "sim.knee"
    );
    assert_eq!(
        err(Downstream::builder().base(Duration::ZERO)).field(),
        "sim.base"
    );
    assert_eq!(
        err(Downstream::builder().capacity(0)).kind(),
        ConfigErrorKind::Zero
    );
    assert_eq!(
        err(Downstream::builder().steepness(0.5)).field(),
        "sim.steepness"
    );
    assert_eq!(
        err(Downstream::builder().slope(f64::NAN)).field(),
        "sim.slope"
    );
    assert_eq!(err(Downstream::builder().jitter(1.0)).field(), "sim.jitter");
    assert_eq!(
        err(Downstream::builder().timeout(Duration::ZERO)).field(),
        "sim.timeout"
    );
}

#[test]
fn public_types_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Downstream>();
    check::<sim::Report>();
    check::<Scenario>();
    check::<Load>();
}

/// The scenarios' docs give their latency, as multiples of the base, at and above the knee
/// (rounded as written there).
#[tokio::test(start_paused = true)]
async fn the_scenarios_latencies_are_as_their_docs_say() {
    let times = |scenario: Scenario, n: u32| {
        let d = scenario.downstream();
        d.latency(n).as_secs_f64() / d.latency(1).as_secs_f64()
    };
    for (scenario, n, documented, decimals) in [
        (Scenario::shallow_knee(), 40, 1.39, 2),
        (Scenario::shallow_knee(), 50, 2.1, 1),
        (Scenario::shallow_knee(), 60, 3.2, 1),
        (Scenario::steep_knee(), 40, 1.08, 2),
        (Scenario::steep_knee(), 50, 13.9, 1),
    ] {
        let name = scenario.name();
        let got = times(scenario, n);
        let unit = 10f64.powi(-decimals);
        assert!(
            (got - documented).abs() <= unit / 2.0 + 1e-9,
            "{name} at {n} in flight: {got:.3}× base, the docs say {documented}×"
        );
    }
}

/// A client whose acquisition is shed (the waiting room full, the wait timed out) starts
/// over after its think time, as a closed-loop client does, so the run keeps its `clients`
/// for its whole duration. (A shed client used to end: the load shrank for good with each
/// shed call, and two clients made no more calls than one.)
#[tokio::test(start_paused = true)]
async fn a_shed_client_starts_over() {
    let shedding = [
        Bulkhead::builder(1).max_waiting(0),
        Bulkhead::builder(1).wait_timeout(Duration::from_millis(10)),
    ];
    for builder in shedding {
        let calls = async |clients| {
            let downstream = Downstream::builder().base(25 * MS).slope(0.0).build();
            let load = Load::new(clients, secs(1)).think_time(30 * MS);
            let bulkhead = builder.clone().build().unwrap();
            let report = sim::drive(&downstream.unwrap(), &bulkhead, &load).await;
            report.calls().len()
        };
        let (one, two) = (calls(1).await, calls(2).await);
        assert!(
            two as f64 >= one as f64 * 1.3,
            "{two} calls by two clients, {one} by one ({builder:?})"
        );
    }
}
