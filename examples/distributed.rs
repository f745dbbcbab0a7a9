//! Several processes sharing one limit through Redis: admitted counts against the bound.
//!
//! Run with a Redis server at `REDIS_URL` (default `redis://127.0.0.1:6379/`):
//!
//! ```text
//! redis-server --save "" --appendonly no &      # if none is running
//! cargo run --example distributed
//! REDIS_URL=redis://10.0.0.5:6379/ cargo run --example distributed
//! ```
//!
//! The parent spawns 4 copies of itself (`distributed worker <prefix> <start_ms>`); each runs
//! 8 tasks hammering one shared key for 3 s through a `RedisGate` (token bucket 200/s,
//! burst 50) and prints its admitted count and the wall-clock span of its admissions. The
//! parent adds them up: however many processes ask, together they get at most
//! `burst + rate × span` (the span is measured on this machine's clock, so with Redis on
//! another host allow for the clock difference). An in-memory limiter in each process would
//! have let each of them through up to that much on its own. (Most rejections never reach
//! Redis: the gate's local rejection cache answers them until the `retry_after` Redis gave.)
//!
//! A decision that fails (Redis went away, or answered slower than the gate's 1 s timeout)
//! admits nothing: the task waits before asking again (10 ms, doubling up to 1 s, until a
//! decision succeeds) and the run goes on; each worker reports its errors and one of
//! them.

#[path = "support/cli.rs"]
mod cli;
#[path = "support/redis_url.rs"]
mod redis_url;

use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use flowgate::Quota;
use flowgate::gate::{Limit, RedisGate};

const WORKERS: usize = 4;
const TASKS: usize = 8;
const RATE: u32 = 200;
const BURST: u32 = 50;
const RUN: Duration = Duration::from_secs(3);
const KEY: &str = "shared";
/// The first and the longest wait of a task after a failed decision.
const PAUSE: (Duration, Duration) = (Duration::from_millis(10), Duration::from_secs(1));

fn epoch_us() -> u64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    since.as_micros() as u64
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // `worker PREFIX START_MS` is how the parent starts its copies: not for users.
    let mut cli =
        cli::Cli::new("usage: distributed (no arguments; REDIS_URL names the Redis to share)");
    let worker_of = match cli.next_flag() {
        None => None,
        Some(mode) if mode == "worker" => {
            let prefix = cli.value("worker");
            let start_ms = cli.parsed("worker PREFIX", |v| {
                v.parse::<u64>()
                    .map_err(|e| format!("worker start {v:?}: {e}"))
            });
            Some((prefix, start_ms))
        }
        Some(other) => cli.unknown(&other),
    };
    cli.finish();
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    let con = redis_url::client(&url)
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| no_redis(&url, &e));
    if let Some((prefix, start_ms)) = worker_of {
        return worker(con, &prefix, start_ms).await;
    }

    // A fresh prefix: earlier runs (or other users of this Redis) do not interfere.
    let prefix = format!("flowgate-example:{}-{}:", std::process::id(), epoch_us());
    let start_ms = epoch_us() / 1_000 + 1_000; // time for the workers to start
    println!(
        "{WORKERS} processes x {TASKS} tasks, one key, token bucket {RATE}/s burst {BURST}, {RUN:?}, via {url}"
    );
    let children = (0..WORKERS)
        .map(|_| {
            Command::new(std::env::current_exe()?)
                .args(["worker", &prefix, &start_ms.to_string()])
                .env("REDIS_URL", &url)
                .stdout(Stdio::piped())
                .spawn()
        })
        .collect::<Result<Vec<_>, _>>()?;
    let (mut total, mut first, mut last, mut failed) = (0, u64::MAX, 0, 0);
    for (i, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let Some(line) = text.lines().find_map(|l| l.strip_prefix("ADMITTED ")) else {
            return Err(format!("worker {i} printed no count ({}): {text}", out.status).into());
        };
        let first_error = text.lines().find_map(|l| l.strip_prefix("FIRST_ERROR "));
        let fields: Vec<u64> = line
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()?;
        let Ok([pid, n, decisions, errors, f, l]) = <[u64; 6]>::try_from(fields) else {
            return Err(format!("worker {i}: unexpected line {line:?}").into());
        };
        println!(
            "  worker {i} (pid {pid}): admitted {n:>4} of {decisions:>6} decisions, {errors} errors{}",
            first_error.map_or(String::new(), |e| format!(" (one of them: {e})"))
        );
        (total, first, last, failed) = (total + n, first.min(f), last.max(l), failed + errors);
    }
    if failed > 0 {
        println!("{failed} decisions failed (Redis away, or slower than 1 s): none admitted");
    }
    let span_us = last.saturating_sub(first);
    let bound = u64::from(BURST) + (u64::from(RATE) * span_us).div_ceil(1_000_000);
    println!("total admitted: {total} in {:.3} s", span_us as f64 / 1e6);
    println!(
        "bound: burst + rate x span = {BURST} + {RATE}/s x {:.3} s = {bound} ({})",
        span_us as f64 / 1e6,
        if total <= bound { "held" } else { "EXCEEDED" }
    );
    println!(
        "an in-memory limiter per process would have allowed up to {WORKERS} x {bound} = {}",
        WORKERS as u64 * bound
    );
    Ok(()) // the key expires by itself once the bucket is full again
}

fn no_redis(url: &str, e: &redis::RedisError) -> ! {
    eprintln!("cannot connect to Redis at {url}: {e}");
    eprintln!("start one: `redis-server --save \"\" --appendonly no &`, or set REDIS_URL");
    std::process::exit(1);
}

/// One fleet member: `TASKS` tasks on one key until the common deadline.
async fn worker(
    con: redis::aio::MultiplexedConnection,
    prefix: &str,
    start_ms: u64,
) -> Result<(), Box<dyn std::error::Error>> {
    let limit = Limit::TokenBucket(Quota::per_second(RATE)?.burst(BURST)?);
    let gate = RedisGate::builder(con, limit)
        .prefix(prefix)
        .timeout(Duration::from_secs(1))
        .build()
        .await?;
    tokio::time::sleep(Duration::from_millis(
        start_ms.saturating_sub(epoch_us() / 1_000),
    ))
    .await;
    let deadline = tokio::time::Instant::now() + RUN;
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let gate = gate.clone();
            tokio::spawn(async move {
                // Admitted, decisions, errors, and the wall-clock span holding the admissions.
                let (mut n, mut decisions, mut errors, mut first, mut last) =
                    (0, 0, 0, u64::MAX, 0);
                let (mut pause, mut first_error) = (Duration::ZERO, None);
                while tokio::time::Instant::now() < deadline {
                    let before = epoch_us();
                    decisions += 1;
                    match gate.check(KEY, 1).await {
                        Ok(d) => {
                            pause = Duration::ZERO;
                            if d.allowed {
                                (n, first, last) = (n + 1, first.min(before), epoch_us());
                            } else {
                                // Rejections the gate answers from its local cache complete
                                // at once: yield.
                                tokio::task::yield_now().await;
                            }
                        }
                        // Redis is away: its failures come at once (the gate answers them
                        // itself until it probes Redis again), so asking again at once would
                        // spin. Wait, longer each time.
                        Err(e) => {
                            errors += 1;
                            first_error.get_or_insert(e.to_string());
                            pause = (pause * 2).clamp(PAUSE.0, PAUSE.1);
                            let until = deadline.min(tokio::time::Instant::now() + pause);
                            tokio::time::sleep_until(until).await;
                        }
                    }
                }
                (n, decisions, errors, first, last, first_error)
            })
        })
        .collect();
    let (mut sum, mut first_error) = ((0u64, 0u64, 0u64, u64::MAX, 0u64), None);
    for task in tasks {
        let (n, d, e, f, l, error) = task.await?;
        sum = (sum.0 + n, sum.1 + d, sum.2 + e, sum.3.min(f), sum.4.max(l));
        first_error = first_error.or(error);
    }
    let (n, d, e, f, l) = sum;
    if let Some(error) = first_error {
        println!("FIRST_ERROR {error}");
    }
    println!("ADMITTED {} {n} {d} {e} {f} {l}", std::process::id());
    Ok(())
}
