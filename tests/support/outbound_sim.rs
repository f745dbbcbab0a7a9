//! A simulated rate-limited server and the clients that call it, under paused tokio time.
//!
//! The server enforces one token bucket ([`flowgate::limit::TokenBucket`], the crate's
//! reference math, explicit `now`) on one key shared by every client, after a fixed
//! latency with seeded jitter on each half of the round trip. It answers 200, or 429 with
//! `Retry-After` in whole seconds rounded up (as flowgate's `RateLimitLayer` does) and,
//! when asked, the IETF fields as that layer writes them for a token bucket: `q` = burst,
//! `w` = burst / rate in whole seconds rounded up, `r` = remaining, `t` = time to full when
//! admitted, time until admitted when rejected (whole seconds, rounded up). Its limit can
//! change at a given time (tokens carry over).
//!
//! The clients are closed loops: each has an endless queue of jobs and `workers` tasks; a
//! job is done when a request for it is admitted, and its completion time runs from its
//! first attempt to that success. Shared by `tests/outbound.rs` and `benches/outbound.rs`.

#![allow(dead_code)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use flowgate::limit::{Algorithm, TokenBucket, TokenBucketState};
use flowgate::pace::{AdaptivePacer, Pacer};
use flowgate::retry::{Backoff, Jitter};
use flowgate::{Quota, Rate};
use tokio::task::JoinSet;
use tokio::time::{Instant, sleep};

/// A deterministic generator (splitmix64): the simulation needs no entropy.
#[derive(Debug, Clone)]
pub struct SplitMix(u64);

impl SplitMix {
    pub fn new(seed: u64) -> SplitMix {
        SplitMix(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, max]`.
    pub fn below(&mut self, max: Duration) -> Duration {
        let nanos = max.as_nanos() as u64;
        if nanos == 0 {
            return Duration::ZERO;
        }
        Duration::from_nanos(self.next_u64() % (nanos + 1))
    }
}

/// The server's settings.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Admitted per second.
    pub limit: u32,
    /// The bucket's burst.
    pub burst: u32,
    /// The round trip without jitter.
    pub rtt: Duration,
    /// Up to this much is added to each half of the round trip (uniform, seeded).
    pub jitter: Duration,
    /// Whether responses carry the IETF `RateLimit` / `RateLimit-Policy` fields.
    pub fields: bool,
    pub seed: u64,
    /// At this time after the start, the limit becomes `(limit, burst)`.
    pub change: Option<(Duration, u32, u32)>,
}

impl Default for SimConfig {
    fn default() -> SimConfig {
        SimConfig {
            limit: 100,
            burst: 100,
            rtt: Duration::from_millis(20),
            jitter: Duration::from_millis(2),
            fields: true,
            seed: 7,
            change: None,
        }
    }
}

/// The IETF fields of one response (`RateLimit-Policy: q, w`, `RateLimit: r, t`).
#[derive(Debug, Clone, Copy)]
pub struct Fields {
    pub q: u64,
    pub w: Duration,
    pub r: u64,
    pub t: Duration,
}

/// One response.
#[derive(Debug, Clone, Copy)]
pub struct Response {
    pub admitted: bool,
    /// `Retry-After` of a 429, whole seconds.
    pub retry_after: Option<Duration>,
    pub fields: Option<Fields>,
}

struct ServerState {
    bucket: TokenBucket,
    state: TokenBucketState,
    change: Option<(Duration, u32, u32)>,
    rng: SplitMix,
    /// (time since start, admitted) of every decision.
    log: Vec<(Duration, bool)>,
}

/// The simulated server; clones share it.
#[derive(Clone)]
pub struct Server {
    start: Instant,
    config: SimConfig,
    state: Arc<Mutex<ServerState>>,
}

/// Counts over a span of the server's log.
#[derive(Debug, Clone, Copy, Default)]
pub struct Window {
    pub admitted: u64,
    pub rejected: u64,
    pub secs: f64,
}

impl Window {
    pub fn goodput(&self) -> f64 {
        self.admitted as f64 / self.secs
    }

    pub fn reject_ratio(&self) -> f64 {
        let all = self.admitted + self.rejected;
        if all == 0 {
            0.0
        } else {
            self.rejected as f64 / all as f64
        }
    }
}

fn bucket(limit: u32, burst: u32) -> TokenBucket {
    TokenBucket::new(Quota::new(Rate::per_second(limit).unwrap(), burst).unwrap())
}

/// Whole seconds, rounded up.
fn ceil_secs(d: Duration) -> Duration {
    Duration::from_secs(d.as_secs() + u64::from(d.subsec_nanos() > 0))
}

impl Server {
    /// A server whose clock starts now.
    pub fn new(config: SimConfig) -> Server {
        let state = ServerState {
            bucket: bucket(config.limit, config.burst),
            state: TokenBucketState::default(),
            change: config.change,
            rng: SplitMix::new(config.seed),
            log: Vec::new(),
        };
        Server {
            start: Instant::now(),
            config,
            state: Arc::new(Mutex::new(state)),
        }
    }

    pub fn start(&self) -> Instant {
        self.start
    }

    /// One request: half a round trip there, the decision, half a round trip back.
    pub async fn call(&self) -> Response {
        let there = self.half();
        sleep(there).await;
        let response = self.decide();
        let back = self.half();
        sleep(back).await;
        response
    }

    fn half(&self) -> Duration {
        let jitter = self.state.lock().unwrap().rng.below(self.config.jitter);
        self.config.rtt / 2 + jitter
    }

    fn decide(&self) -> Response {
        let now = self.start.elapsed();
        let mut st = self.state.lock().unwrap();
        if let Some((at, limit, burst)) = st.change
            && now >= at
        {
            // Carry the tokens over: the new bucket holds what the old one held.
            let held = st.bucket.available(&st.state, now).min(u64::from(burst));
            let missing = u64::from(burst) - held;
            let fill = Duration::from_nanos(missing * 1_000_000_000 / u64::from(limit));
            st.bucket = bucket(limit, burst);
            st.state = st.bucket.state_full_at(now + fill);
            st.change = None;
        }
        let ServerState { bucket, state, .. } = &mut *st;
        let d = bucket.check(state, now, 1).unwrap();
        let quota = bucket.quota();
        st.log.push((now, d.allowed));
        let fields = self.config.fields.then(|| {
            let burst = u128::from(quota.burst_size());
            let rate = quota.rate();
            let w_nanos = burst * u128::from(rate.period_nanos()) / u128::from(rate.count());
            let w = (w_nanos.div_ceil(1_000_000_000) as u64).max(1);
            Fields {
                q: d.capacity,
                w: Duration::from_secs(w),
                r: d.remaining,
                t: ceil_secs(if d.allowed {
                    d.reset_after
                } else {
                    d.retry_after
                }),
            }
        });
        Response {
            admitted: d.allowed,
            retry_after: (!d.allowed).then(|| ceil_secs(d.retry_after)),
            fields,
        }
    }

    /// Counts of the decisions in `[from, to)` after the start.
    pub fn window(&self, from: Duration, to: Duration) -> Window {
        let st = self.state.lock().unwrap();
        let mut w = Window {
            secs: (to - from).as_secs_f64(),
            ..Window::default()
        };
        for &(at, admitted) in &st.log {
            if at >= from && at < to {
                if admitted {
                    w.admitted += 1;
                } else {
                    w.rejected += 1;
                }
            }
        }
        w
    }
}

/// How a client retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// flowgate's `AdaptivePacer`: every attempt waits for it; responses are fed back.
    Adaptive,
    /// Exponential backoff without jitter, ignoring `Retry-After` (base 100 ms, cap 10 s).
    Naive,
    /// Full jitter (AWS: uniform in `[0, min(cap, base·2^n)]`), a `Retry-After` replacing
    /// the computed delay (base 100 ms, cap 10 s): `flowgate::retry::Backoff` with
    /// `Jitter::Full`, no attempt limit and no deadline.
    FullJitter,
}

/// One finished job: first attempt and success, since the server's start.
#[derive(Debug, Clone, Copy)]
pub struct Job {
    pub first: Duration,
    pub done: Duration,
    pub attempts: u32,
}

/// The clients' settings.
#[derive(Debug, Clone)]
pub struct Clients {
    pub count: usize,
    /// Tasks per client (the most requests a client has in flight or in backoff).
    pub workers: usize,
    /// Each client's starting rate (the fixed rate of the baselines' pacers).
    pub initial: u32,
    pub seed: u64,
}

impl Default for Clients {
    fn default() -> Clients {
        Clients {
            count: 8,
            workers: 32,
            initial: 1_000,
            seed: 11,
        }
    }
}

/// What a run gives back: every finished job, and the clients' pacers (adaptive only).
pub struct Run {
    pub jobs: Vec<Job>,
    pub pacers: Vec<AdaptivePacer>,
}

/// Base and cap of the baselines' backoff.
const BASE: Duration = Duration::from_millis(100);
const CAP: Duration = Duration::from_secs(10);

fn exp_delay(attempt: u32) -> Duration {
    BASE.saturating_mul(1u32 << attempt.min(20)).min(CAP)
}

/// Run `clients` with `strategy` against `server` for `duration` (paused time).
pub async fn run(
    server: &Server,
    strategy: Strategy,
    clients: &Clients,
    duration: Duration,
) -> Run {
    let jobs = Arc::new(Mutex::new(Vec::new()));
    let mut pacers = Vec::new();
    let mut tasks = JoinSet::new();
    let initial = Rate::per_second(clients.initial).unwrap();
    for c in 0..clients.count {
        let adaptive = AdaptivePacer::builder(initial).build().unwrap();
        // The baselines send at the clients' initial rate when nothing pushes back.
        let fixed = Pacer::new(initial);
        pacers.push(adaptive.clone());
        for w in 0..clients.workers {
            let server = server.clone();
            let jobs = jobs.clone();
            let adaptive = adaptive.clone();
            let fixed = fixed.clone();
            let backoff = Backoff::builder()
                .base(BASE)
                .cap(CAP)
                .jitter(Jitter::Full)
                .max_attempts(u32::MAX)
                .max_retry_after(Duration::from_secs(3_600))
                .seed(clients.seed ^ ((c as u64) << 32 | w as u64))
                .build()
                .unwrap();
            tasks.spawn(async move {
                loop {
                    let first = server.start().elapsed();
                    let mut schedule = backoff.start();
                    let mut attempt = 0u32;
                    loop {
                        attempt += 1;
                        match strategy {
                            Strategy::Adaptive => adaptive.until_ready(1).await.unwrap(),
                            _ => fixed.until_ready(1).await.unwrap(),
                        }
                        let resp = server.call().await;
                        if strategy == Strategy::Adaptive {
                            if let Some(f) = resp.fields {
                                adaptive.on_policy(f.q, f.w);
                                adaptive.on_allowance(f.r, f.t);
                            }
                            if resp.admitted {
                                adaptive.on_success();
                            } else {
                                adaptive.on_back_pressure(resp.retry_after);
                            }
                        }
                        if resp.admitted {
                            break;
                        }
                        let exp = exp_delay(attempt - 1);
                        match strategy {
                            Strategy::Adaptive => {}
                            Strategy::Naive => sleep(exp).await,
                            Strategy::FullJitter => {
                                // No attempt limit, no deadline: it never gives up.
                                sleep(schedule.next_delay(resp.retry_after).unwrap_or(CAP)).await
                            }
                        }
                    }
                    jobs.lock().unwrap().push(Job {
                        first,
                        done: server.start().elapsed(),
                        attempts: attempt,
                    });
                }
            });
        }
    }
    sleep_until_after(server, duration).await;
    tasks.shutdown().await;
    let jobs = std::mem::take(&mut *jobs.lock().unwrap());
    Run { jobs, pacers }
}

async fn sleep_until_after(server: &Server, duration: Duration) {
    tokio::time::sleep_until(server.start() + duration).await;
}

/// The `p`-quantile (0..=1) of the completion times of the jobs done in `[from, to)`.
pub fn completion_quantile(jobs: &[Job], from: Duration, to: Duration, p: f64) -> Duration {
    let mut times: Vec<Duration> = jobs
        .iter()
        .filter(|j| j.done >= from && j.done < to)
        .map(|j| j.done - j.first)
        .collect();
    if times.is_empty() {
        return Duration::ZERO;
    }
    times.sort();
    let at = ((times.len() as f64 * p).ceil() as usize).clamp(1, times.len()) - 1;
    times[at]
}
