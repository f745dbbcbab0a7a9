//! Outbound strategies against one rate-limited server: goodput, 429 ratio and p99 job
//! completion time, side by side.
//!
//! A simulation, not a wall-clock benchmark: the server (`tests/support/outbound_sim.rs`)
//! enforces a token bucket of 100/s (burst 100) on one key shared by 8 clients, 20 ms round
//! trip plus up to 2 ms of seeded jitter each way, and answers 429 with `Retry-After` in
//! whole seconds (and, where said, the IETF `RateLimit` fields) as flowgate's
//! `RateLimitLayer` does. Time is tokio's paused clock, so a 60 s run takes well under a
//! second and every figure is deterministic (seeded). Each client has 32 worker tasks and
//! an endless queue of jobs; a job is done when a request for it is admitted, and its
//! completion time runs from its first attempt to that success. Every client starts at
//! 1 000/s (the baselines keep a fixed pacer at that rate; their backoff does the rest).
//!
//! Strategies:
//! - `naive`: exponential backoff, base 100 ms, cap 10 s, no jitter, `Retry-After` ignored.
//! - `full jitter`: AWS full jitter (uniform in `[0, min(cap, base·2^n)]`), a
//!   `Retry-After` replacing the computed delay.
//! - `adaptive (fields)`: flowgate's `AdaptivePacer`, fed `Retry-After` and the IETF fields.
//! - `adaptive (Retry-After)`: the same, the server sending no `RateLimit` fields.
//!
//! Figures cover `[2 s, 60 s)`. The Must of issue 18: the adaptive client has the lowest
//! 429 ratio and at least the goodput of the best other strategy.
//!
//! Run: `cargo bench --bench outbound`.

#[path = "../tests/support/outbound_sim.rs"]
mod sim;

use std::time::Duration;

use sim::{Clients, Server, SimConfig, Strategy};

const FROM: Duration = Duration::from_secs(2);
const UNTIL: Duration = Duration::from_secs(60);

struct Row {
    name: &'static str,
    goodput: f64,
    reject_ratio: f64,
    p99: Duration,
    attempts_per_job: f64,
}

async fn measure(name: &'static str, strategy: Strategy, fields: bool) -> Row {
    let server = Server::new(SimConfig {
        fields,
        ..SimConfig::default()
    });
    let run = sim::run(&server, strategy, &Clients::default(), UNTIL).await;
    let window = server.window(FROM, UNTIL);
    let done: Vec<_> = run
        .jobs
        .iter()
        .filter(|j| j.done >= FROM && j.done < UNTIL)
        .collect();
    let attempts: u64 = done.iter().map(|j| u64::from(j.attempts)).sum();
    Row {
        name,
        goodput: window.goodput(),
        reject_ratio: window.reject_ratio(),
        p99: sim::completion_quantile(&run.jobs, FROM, UNTIL, 0.99),
        attempts_per_job: attempts as f64 / done.len().max(1) as f64,
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a runtime");
    let rows = rt.block_on(async {
        vec![
            measure("naive exponential", Strategy::Naive, true).await,
            measure("full jitter + Retry-After", Strategy::FullJitter, true).await,
            measure("flowgate adaptive (fields)", Strategy::Adaptive, true).await,
            measure("flowgate adaptive (Retry-After)", Strategy::Adaptive, false).await,
        ]
    });
    println!(
        "outbound: 8 clients x 32 workers vs one shared 100/s bucket (burst 100), 20 ms RTT, \
         simulated (paused time), figures over [2 s, 60 s)"
    );
    println!(
        "{:<34} {:>10} {:>9} {:>10} {:>9}",
        "strategy", "goodput/s", "429 %", "p99", "att/job"
    );
    for r in &rows {
        println!(
            "{:<34} {:>10.1} {:>9.2} {:>10.2?} {:>9.2}",
            r.name,
            r.goodput,
            100.0 * r.reject_ratio,
            r.p99,
            r.attempts_per_job
        );
    }
    let others = &rows[..2];
    let best_goodput = others.iter().map(|r| r.goodput).fold(0.0, f64::max);
    let lowest_429 = others.iter().map(|r| r.reject_ratio).fold(1.0, f64::min);
    for adaptive in &rows[2..] {
        println!(
            "{}: goodput {:.3}x the best other, 429 ratio {:.3}x the lowest other, p99 {:.3}x",
            adaptive.name,
            adaptive.goodput / best_goodput,
            adaptive.reject_ratio / lowest_429.max(f64::MIN_POSITIVE),
            adaptive.p99.as_secs_f64()
                / others
                    .iter()
                    .map(|r| r.p99.as_secs_f64())
                    .fold(f64::INFINITY, f64::min),
        );
        let pass = adaptive.reject_ratio < lowest_429 && adaptive.goodput >= best_goodput;
        println!(
            "{} Must (lowest 429 ratio, goodput >= best other) for {}",
            if pass { "PASS" } else { "FAIL" },
            adaptive.name
        );
    }
}
