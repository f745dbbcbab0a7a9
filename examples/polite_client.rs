//! A fleet of HTTP clients against a server limited to 100 requests per second: naive
//! exponential backoff versus flowgate's adaptive client.
//!
//! ```text
//! cargo run --example polite_client --features http                 # 8 clients, 10 s per run
//! cargo run --example polite_client --features http -- --secs 5 --clients 16
//! cargo run --example polite_client --features http -- --url http://127.0.0.1:3000/
//! ```
//!
//! By default the server runs in this process: an axum route behind flowgate's
//! `RateLimitLayer`, one global key, a token bucket of 100/s with bursts of 100, on
//! 127.0.0.1 (a free port). With `--url`, the clients call that server instead (such as
//! the `http_server` example, whose `GET /` allows 100 per minute per client IP).
//!
//! Each client is a closed loop of jobs on its own keep-alive hyper client (hyper-util's
//! legacy client); a job is one `GET`, retried until it succeeds or its strategy gives up.
//! Two runs, one per strategy:
//!
//! - **naive**: exponential backoff, 100 ms doubling up to 10 s, 8 attempts at most, no
//!   jitter, `Retry-After` ignored, no pacing: every client sends as fast as its answers
//!   come back.
//! - **flowgate**: `RetryLayer` with full-jitter backoff (the server's `Retry-After` wins),
//!   a `RetryBudget` (10 tokens, 0.1 per success) and an `AdaptivePacer` per client starting
//!   at 1 000/s, which pauses on `Retry-After`, cuts on `429` and follows the server's
//!   `RateLimit` fields. A job the budget ended (the server fails most attempts: down, or
//!   refusing) is followed by a pause of its client, backing off as a retry would, up to
//!   10 s; the client stops when that backoff gives up.
//!
//! Between the runs it pauses until the server's limit is full again, as the `RateLimit`
//! fields of its answer to one `GET` say (2 s for a server that sends none, at most 5
//! min: a minute for the `http_server` example's `/`), so that both runs start alike.
//!
//! Every second it prints what the server answered (2xx/s, 429/s, and other/s: any other
//! status, or no answer) and the retries of the jobs finished that second, then a table of
//! both runs side by side, and the first failure of a run that had any. It exits with an
//! error when no request succeeded (no server at `--url`): code 1; a bad argument exits
//! with code 2.

#[path = "support/cli.rs"]
mod cli;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use bytes::Bytes;
use flowgate::gate::{Limit, MemoryGate};
use flowgate::http::{Constant, Policy, RateLimitLayer};
use flowgate::pace::AdaptivePacer;
use flowgate::retry::{
    Backoff, HttpClassify, Jitter, Outcome, RetryBudget, RetryInfo, RetryLayer, RetryPolicy,
    ServerHint, Stop,
};
use flowgate::{Quota, Rate};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt, service_fn};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The command line.
struct Args {
    secs: u64,
    clients: usize,
    url: Option<String>,
}

const USAGE: &str = "usage: polite_client [--secs N] [--clients N] [--url http://host:port/path]";

/// A whole number from 1 to 1000, for `flag`.
fn one_to_1000(flag: &str, v: &str) -> Result<u64, String> {
    match v.parse() {
        Ok(n @ 1..=1000) => Ok(n),
        _ => Err(format!("{flag} {v:?}: give a whole number, 1 to 1000")),
    }
}

/// The command line; a bad argument is refused (exit code 2).
fn args() -> Args {
    let mut args = Args {
        secs: 10,
        clients: 8,
        url: None,
    };
    let mut cli = cli::Cli::new(USAGE);
    while let Some(flag) = cli.next_flag() {
        match flag.as_str() {
            "--secs" => args.secs = cli.parsed(&flag, |v| one_to_1000(&flag, v)),
            "--clients" => args.clients = cli.parsed(&flag, |v| one_to_1000(&flag, v)) as usize,
            "--url" => {
                // The clients speak plain HTTP (hyper-util's `build_http`): refuse the rest now,
                // not once per attempt during the run.
                args.url = Some(cli.parsed(&flag, |v| match v.parse::<http::Uri>() {
                    Ok(uri) if uri.scheme_str() == Some("http") && uri.host().is_some() => {
                        Ok(v.to_owned())
                    }
                    _ => Err(format!("--url {v:?}: give an http:// URL")),
                }));
            }
            other => cli.unknown(other),
        }
    }
    args
}

/// What happened in one second of a run.
#[derive(Debug, Default, Clone, Copy)]
struct Second {
    /// Attempts answered 2xx.
    ok: u64,
    /// Attempts answered 429.
    refused: u64,
    /// Attempts answered otherwise, or failed (no answer at all).
    other: u64,
    /// Retries of the jobs that finished this second.
    retries: u64,
    /// Jobs finished this second.
    jobs: u64,
}

/// The counts of one run, per second since its start, and every job's duration.
struct Tally {
    start: Instant,
    seconds: Mutex<Vec<Second>>,
    job_times: Mutex<Vec<Duration>>,
    /// The first attempt that failed or was answered other than 2xx / 429, as text.
    first_other: Mutex<Option<String>>,
    /// Jobs the retry budget ended, each followed by a pause of its client.
    budget_pauses: Mutex<u64>,
}

impl Tally {
    fn new(secs: u64) -> Tally {
        Tally {
            start: Instant::now(),
            seconds: Mutex::new(vec![Second::default(); secs as usize]),
            job_times: Mutex::new(Vec::new()),
            first_other: Mutex::new(None),
            budget_pauses: Mutex::new(0),
        }
    }

    fn with_second(&self, f: impl FnOnce(&mut Second)) {
        let i = self.start.elapsed().as_secs() as usize;
        if let Some(s) = self.seconds.lock().unwrap().get_mut(i) {
            f(s);
        }
    }

    fn attempt<E: std::error::Error>(&self, result: &Result<Response<Incoming>, E>) {
        let other = match result {
            Ok(res)
                if res.status().is_success() || res.status() == StatusCode::TOO_MANY_REQUESTS =>
            {
                None
            }
            Ok(res) => Some(format!("answered {}", res.status())),
            Err(e) => {
                // The cause is at the end of the chain ("client error (Connect)" says little).
                let mut why = e.to_string();
                let mut source = e.source();
                while let Some(cause) = source {
                    why = format!("{why}: {cause}");
                    source = cause.source();
                }
                Some(why)
            }
        };
        self.with_second(|s| match (result, &other) {
            (Ok(res), None) if res.status().is_success() => s.ok += 1,
            (_, None) => s.refused += 1,
            (_, Some(_)) => s.other += 1,
        });
        if let Some(why) = other {
            self.first_other.lock().unwrap().get_or_insert(why);
        }
    }

    /// A client pauses after a job its empty retry budget ended: said once per run.
    fn budget_pause(&self, client: usize, backoff: &Backoff) {
        let mut pauses = self.budget_pauses.lock().unwrap();
        if *pauses == 0 {
            println!(
                "  client {client}: retry budget empty (the server fails most attempts): \
                 the clients pause before their next job, up to {:?}, until one succeeds",
                backoff.cap()
            );
        }
        *pauses += 1;
    }

    fn job(&self, attempts: u32, took: Duration) {
        self.with_second(|s| {
            s.jobs += 1;
            s.retries += u64::from(attempts.saturating_sub(1));
        });
        self.job_times.lock().unwrap().push(took);
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Strategy {
    Naive,
    Flowgate,
}

impl Strategy {
    fn label(self) -> &'static str {
        match self {
            Strategy::Naive => "naive exponential backoff",
            Strategy::Flowgate => "flowgate adaptive client",
        }
    }

    /// The retry policy of one client.
    fn policy(self, client: usize) -> Result<RetryPolicy, BoxError> {
        Ok(match self {
            Strategy::Naive => {
                let backoff = Backoff::builder()
                    .jitter(Jitter::None)
                    .base(Duration::from_millis(100))
                    .cap(Duration::from_secs(10))
                    .max_attempts(8)
                    .build()?;
                RetryPolicy::builder(backoff).name("naive").build()?
            }
            Strategy::Flowgate => {
                let backoff = Backoff::builder()
                    .jitter(Jitter::Full)
                    .base(Duration::from_millis(100))
                    .cap(Duration::from_secs(10))
                    .max_attempts(10)
                    .deadline(Duration::from_secs(30))
                    .build()?;
                let pacer = AdaptivePacer::builder(Rate::per_second(1_000)?)
                    .name(format!("client-{client}"))
                    .build()?;
                RetryPolicy::builder(backoff)
                    .budget(RetryBudget::new(10, 0.1)?)
                    .pacer(pacer)
                    .attempt_timeout(Duration::from_secs(5))
                    .name("flowgate")
                    .build()?
            }
        })
    }
}

/// The naive client's classifier: `429` and `503` are plain failures, their `Retry-After`
/// unheard.
fn deaf(result: &Result<Response<Incoming>, hyper_util::client::legacy::Error>) -> Outcome {
    match result {
        Ok(res) => match HttpClassify::new().outcome(res.status(), res.headers()) {
            Outcome::BackPressure { .. } => Outcome::Retry,
            outcome => outcome,
        },
        Err(_) => Outcome::Retry,
    }
}

/// One client: jobs in a closed loop until `end`.
async fn client(
    strategy: Strategy,
    index: usize,
    url: String,
    tally: Arc<Tally>,
    end: Instant,
) -> Result<(), BoxError> {
    let hyper = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    // Every attempt, as the server answered it.
    let counted = {
        let tally = tally.clone();
        service_fn(move |req: Request<Empty<Bytes>>| {
            let (hyper, tally) = (hyper.clone(), tally.clone());
            async move {
                let res = hyper.request(req).await;
                tally.attempt(&res);
                res
            }
        })
    };
    let policy = strategy.policy(index)?;
    let backoff = policy.backoff().clone();
    let layer = RetryLayer::new(policy);
    let mut svc = match strategy {
        Strategy::Naive => tower::util::BoxCloneService::new(layer.classify(deaf).layer(counted)),
        Strategy::Flowgate => tower::util::BoxCloneService::new(layer.layer(counted)),
    };
    // The pauses between jobs the retry budget ended (see below), one schedule per streak.
    let mut pauses = backoff.start();
    while Instant::now() < end {
        let req = Request::get(url.as_str()).body(Empty::new())?;
        let started = Instant::now();
        let res = tokio::time::timeout_at(end, svc.ready().await?.call(req)).await;
        let Ok(res) = res else { break }; // the run is over
        let (attempts, stop) = match res {
            Ok(res) => {
                let info = res.extensions().get::<RetryInfo>().cloned();
                // Read the body: the connection goes back to the pool.
                let _ = res.into_body().collect().await;
                info.map_or((1, Stop::Success), |i| (i.attempts, i.stop))
            }
            Err(e) => (e.attempts(), e.stop()),
        };
        tally.job(attempts, started.elapsed());
        if stop != Stop::Budget {
            pauses = backoff.start();
            continue;
        }
        // The budget refused a retry: the server fails most attempts, and the budget stays
        // empty until one succeeds. A new job at once would hammer it all the same (a dead
        // server refuses each connection at once), so the client pauses first, as long as
        // a retry would wait, and stops when that backoff gives up.
        match pauses.next_delay(None) {
            Ok(delay) => {
                tally.budget_pause(index, &backoff);
                tokio::time::sleep_until(end.min(Instant::now() + delay)).await;
            }
            Err(_) => {
                let (jobs, over) = (pauses.attempts(), pauses.elapsed());
                println!(
                    "  client {index} stops: its retry budget ended {jobs} jobs in a row, over {over:.0?}"
                );
                break;
            }
        }
    }
    Ok(())
}

/// The figures of one run.
struct Summary {
    ok_per_sec: f64,
    refused_per_sec: f64,
    /// Attempts that failed or were answered other than 2xx / 429, and the first of them.
    other: u64,
    first_other: Option<String>,
    refused_ratio: f64,
    retries_per_sec: f64,
    p99: Duration,
    /// Jobs the retry budget ended (a pause of their client followed each).
    budget_pauses: u64,
}

async fn run(strategy: Strategy, args: &Args, url: &str) -> Result<Summary, BoxError> {
    println!(
        "\n{} ({} clients, {} s against {url})",
        strategy.label(),
        args.clients,
        args.secs
    );
    println!("  second    2xx/s    429/s  other/s  retries/s");
    let tally = Arc::new(Tally::new(args.secs));
    let end = tally.start + Duration::from_secs(args.secs);
    let tasks: Vec<_> = (0..args.clients)
        .map(|i| tokio::spawn(client(strategy, i, url.to_owned(), tally.clone(), end)))
        .collect();
    // One line per second, as each second ends.
    for second in 0..args.secs {
        tokio::time::sleep_until(tally.start + Duration::from_secs(second + 1)).await;
        let s = tally.seconds.lock().unwrap()[second as usize];
        println!(
            "  {:>6} {:>8} {:>8} {:>8} {:>10}",
            second + 1,
            s.ok,
            s.refused,
            s.other,
            s.retries
        );
    }
    for task in tasks {
        task.await??;
    }
    let seconds = tally.seconds.lock().unwrap().clone();
    let sum = |f: fn(&Second) -> u64| seconds.iter().map(f).sum::<u64>() as f64;
    let secs = args.secs as f64;
    let attempts = sum(|s| s.ok + s.refused + s.other);
    let mut times = tally.job_times.lock().unwrap().clone();
    times.sort();
    let p99 = times
        .get((times.len() * 99 / 100).min(times.len().saturating_sub(1)))
        .copied()
        .unwrap_or_default();
    Ok(Summary {
        ok_per_sec: sum(|s| s.ok) / secs,
        refused_per_sec: sum(|s| s.refused) / secs,
        other: sum(|s| s.other) as u64,
        first_other: tally.first_other.lock().unwrap().clone(),
        refused_ratio: sum(|s| s.refused) / attempts.max(1.0),
        retries_per_sec: sum(|s| s.retries) / secs,
        p99,
        budget_pauses: *tally.budget_pauses.lock().unwrap(),
    })
}

/// The pause between the runs for a server whose `RateLimit` fields do not say how long
/// its limit takes to refill.
const DEFAULT_PAUSE: Duration = Duration::from_secs(2);
/// The longest pause between the runs.
const MAX_PAUSE: Duration = Duration::from_secs(300);

/// How long until the server's limits are full again, as the `RateLimit` fields of its
/// answer to one `GET` say: for each policy, the units missing at its quota per window;
/// `None` when no policy says all three, or no answer comes within 5 s.
async fn refill_time(url: &str) -> Option<Duration> {
    let hyper = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let req = Request::get(url).body(Empty::new()).ok()?;
    let res = tokio::time::timeout(Duration::from_secs(5), hyper.request(req))
        .await
        .ok()?
        .ok()?;
    let hint = ServerHint::from_headers(res.headers(), std::time::SystemTime::now());
    hint.policies
        .iter()
        .filter_map(|p| {
            let (quota, window, remaining) = (p.quota?, p.window?, p.remaining?);
            let missing = quota.saturating_sub(remaining);
            Some(window.mul_f64(missing as f64 / quota.max(1) as f64))
        })
        .max()
}

/// The in-process server: `GET /` behind a token bucket of 100/s, bursts of 100, one key
/// for everyone.
async fn serve() -> Result<String, BoxError> {
    let quota = Quota::per_second(100)?.burst(100)?;
    let limit = RateLimitLayer::builder(MemoryGate::new(Limit::TokenBucket(quota)))
        .policy(Policy::new("global", quota, Constant::new("all")))
        .name("polite_client")
        .build()?;
    let app = Router::new()
        .route("/", get(|| async { Ok::<_, Infallible>("ok\n") }))
        .layer(limit);
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
    let url = format!("http://{}/", listener.local_addr()?);
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("server: {e}");
        }
    });
    Ok(url)
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    // A bad argument exits with 2, as in the other examples; a failed run with 1.
    match run_all(args()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::from(1)
        }
    }
}

async fn run_all(args: Args) -> Result<(), BoxError> {
    let url = match &args.url {
        Some(url) => url.clone(),
        None => {
            let url = serve().await?;
            println!("server on {url}: 100 requests/s, bursts of 100, one key for all clients");
            url
        }
    };

    let naive = run(Strategy::Naive, &args, &url).await?;
    // Let the server's limit fill up again between the runs, so that both start alike.
    let pause = refill_time(&url)
        .await
        .unwrap_or(DEFAULT_PAUSE)
        .min(MAX_PAUSE);
    println!("\npausing {pause:.1?} for the server's limit to refill");
    tokio::time::sleep(pause).await;
    let adaptive = run(Strategy::Flowgate, &args, &url).await?;

    println!("\nsummary ({} clients, {} s each)", args.clients, args.secs);
    println!(
        "  {:<26} {:>8} {:>9} {:>10} {:>10} {:>12}",
        "strategy", "2xx/s", "429/s", "429 share", "retries/s", "p99 job"
    );
    for (strategy, s) in [(Strategy::Naive, &naive), (Strategy::Flowgate, &adaptive)] {
        println!(
            "  {:<26} {:>8.1} {:>9.1} {:>9.1}% {:>10.1} {:>12}",
            strategy.label(),
            s.ok_per_sec,
            s.refused_per_sec,
            s.refused_ratio * 100.0,
            s.retries_per_sec,
            format!("{:.0?}", s.p99)
        );
    }
    for (strategy, s) in [(Strategy::Naive, &naive), (Strategy::Flowgate, &adaptive)] {
        if let Some(first) = &s.first_other {
            println!(
                "  {}: {} attempts failed or were answered other than 2xx / 429 (the first: {first})",
                strategy.label(),
                s.other
            );
        }
        if s.budget_pauses > 0 {
            println!(
                "  {}: the empty retry budget ended {} jobs; each client paused after them",
                strategy.label(),
                s.budget_pauses
            );
        }
    }
    if naive.ok_per_sec == 0.0 && adaptive.ok_per_sec == 0.0 {
        return Err(format!("no request to {url} succeeded: is the server running?").into());
    }
    if adaptive.refused_per_sec > 0.0 {
        println!(
            "\nthe naive fleet drew {:.0}x the 429s of the adaptive one; its goodput was {:.0}% of the adaptive fleet's",
            naive.refused_per_sec / adaptive.refused_per_sec,
            100.0 * naive.ok_per_sec / adaptive.ok_per_sec.max(f64::MIN_POSITIVE)
        );
    }
    Ok(())
}
