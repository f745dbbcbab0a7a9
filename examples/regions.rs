//! One limit across three regions: a global quota of 300 requests per second shared by
//! `us`, `eu` and `ap`, each region deciding against its own Redis at local latency while
//! the shares move, as leases from a home Redis, to where the demand is.
//!
//! ```text
//! cargo run --example regions                                  # 30 s, fair share
//! cargo run --example regions -- --secs 15                     # a shorter run
//! cargo run --example regions -- --policy static               # 50 % / 30 % / 20 %, whatever the demand
//! cargo run --example regions -- --latency-ms 100              # a farther home
//! cargo run --example regions -- --svg target/regions.svg      # and plot it
//! ```
//!
//! It starts four private `redis-server`s on free ports of 127.0.0.1 (`apt-get install -y
//! redis-server` if you have none): one local Redis per region and the home. Each region
//! reaches the home through a TCP proxy that adds 50 ms each way (the cross-region link);
//! its gates never do. Every region runs two "processes" (two `Region`s, each with its own
//! connections: one of them refreshes the lease, both admit), and open-loop load on the key
//! `partner-api`. The demand moves every third of the run: first `us` wants 400 requests per
//! second, then `eu`, then `ap`, while the two others want 60 and 40.
//!
//! Every second it prints each region's share (what its leader last got from the home) and
//! what it admitted in that second, next to the global bound; at the end, the most admitted
//! in any 1 s window against `rate × 1 s + burst + one request per region` (plus 20 ms for
//! measuring at the client), and what the home holds. With `--svg PATH` it also plots the
//! shares and admitted rates over time (it checks it can write `PATH` before it starts).
//!
//! Ctrl-C ends the run early, with the summary, and so do `SIGTERM` (`kill`) and `SIGHUP`
//! (the terminal closed); the servers are killed however the run ends, but by `SIGKILL`.

#[path = "support/cli.rs"]
mod cli;
#[path = "../tests/support/delay_proxy.rs"]
mod delay_proxy;
#[path = "support/plot_file.rs"]
mod plot_file;

use std::error::Error;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use delay_proxy::DelayProxy;
use flowgate::Quota;
use flowgate::region::{Allocation, QuotaAllocator, Region};
use plotters::prelude::*;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;

const REGIONS: [(&str, u64); 3] = [("us", 50), ("eu", 30), ("ap", 20)];
const RATE: u32 = 300;
const BURST: u32 = 30;
const PROCESSES: usize = 2;
const KEY: &str = "partner-api";
const LEASE: Duration = Duration::from_secs(3);
const REFRESH: Duration = Duration::from_millis(500);
/// Below the refresh interval (the builder insists), well above a 100 ms round trip.
const HOME_TIMEOUT: Duration = Duration::from_millis(400);
/// What the hot region wants, then the two others, rotated one region per phase.
const DEMAND: [u64; 3] = [400, 60, 40];
/// Admissions are timed when the decision returns, so a 1 s window at the client may hold
/// a little more than 1 s of the limit: the bound allows the rate × this much.
const MEASURING_SLACK: Duration = Duration::from_millis(20);

type Con = ConnectionManager;

struct Args {
    secs: u64,
    one_way: Duration,
    policy: Allocation,
    svg: Option<PathBuf>,
}

const USAGE: &str =
    "usage: regions [--secs N] [--latency-ms N] [--policy static|fair|proportional] [--svg PATH]";

/// The command line; a bad argument is refused (exit code 2).
fn parse_args() -> Args {
    let mut args = Args {
        secs: 30,
        one_way: Duration::from_millis(50),
        policy: Allocation::FairShare,
        svg: None,
    };
    let mut cli = cli::Cli::new(USAGE);
    while let Some(flag) = cli.next_flag() {
        match flag.as_str() {
            "--secs" => {
                args.secs = cli.parsed(&flag, |v| match v.parse() {
                    Ok(n @ 3..=3600) => Ok(n),
                    _ => Err(format!(
                        "--secs {v:?}: give a whole number of seconds, 3 to 3600"
                    )),
                });
            }
            "--latency-ms" => {
                args.one_way = cli.parsed(&flag, |v| match v.parse() {
                    Ok(n @ 0..=2000) => Ok(Duration::from_millis(n)),
                    _ => Err(format!(
                        "--latency-ms {v:?}: give a one-way latency in ms, 0 to 2000"
                    )),
                });
            }
            "--policy" => {
                args.policy = cli.parsed(&flag, |v| match v {
                    "static" => Ok(Allocation::Static),
                    "fair" => Ok(Allocation::FairShare),
                    "proportional" => Ok(Allocation::ProportionalShare),
                    _ => Err(format!("--policy {v:?}: one of static, fair, proportional")),
                });
            }
            // A plot that cannot be written is said now, not after the whole run.
            "--svg" => {
                args.svg = Some(cli.parsed(&flag, |v| plot_file::writable(Path::new(v), "--svg")));
            }
            other => cli.unknown(other),
        }
    }
    args
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = parse_args();
    let found = Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if found.is_err() {
        eprintln!(
            "redis-server is not on PATH: this example starts its own servers \
             (install it with `apt-get install -y redis-server`)"
        );
        return ExitCode::from(1);
    }
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

/// A private `redis-server`, killed when dropped.
struct Server {
    child: Child,
    port: u16,
}

impl Server {
    /// Start one on a free port and wait until it answers PING (a few tries, in case another
    /// process takes the port between the probe and the server's bind).
    async fn start() -> Result<Server, Box<dyn Error>> {
        let mut last = String::new();
        for _ in 0..3 {
            let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            let mut command = Command::new("redis-server");
            command
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            // Its own process group: a Ctrl-C at the terminal reaches this program only,
            // which prints its summary (the home still answering) and then kills the server.
            #[cfg(unix)]
            std::os::unix::process::CommandExt::process_group(&mut command, 0);
            let child = command.spawn()?;
            let mut server = Server { child, port };
            match server.wait_ready().await {
                Ok(()) => return Ok(server),
                Err(e) => last = e,
            }
        }
        Err(format!("redis-server did not start: {last}").into())
    }

    async fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("it exited ({status}) on port {}", self.port));
            }
            if ping(self.addr()).await {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(format!(
            "no answer to PING on port {} within 5 s",
            self.port
        ))
    }

    fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn ping(addr: SocketAddr) -> bool {
    let attempt = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream.write_all(b"PING\r\n").await?;
        let mut reply = [0u8; 7];
        stream.read_exact(&mut reply).await?;
        Ok::<bool, std::io::Error>(&reply == b"+PONG\r\n")
    };
    matches!(
        tokio::time::timeout(Duration::from_millis(500), attempt).await,
        Ok(Ok(true))
    )
}

/// A connection manager that gives up instead of hanging, over a link that adds `one_way`
/// each way: its connection and each answer may take that link's round trips on top (the
/// handshake's included), so that a slow link fails the refreshes (by the home timeout),
/// not the connection.
async fn manager(url: &str, one_way: Duration) -> Result<Con, redis::RedisError> {
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_millis(500) + one_way * 4))
        .set_response_timeout(Some(Duration::from_secs(1) + one_way * 2))
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_millis(100));
    ConnectionManager::new_with_config(redis::Client::open(url)?, config).await
}

fn allocator(home: Con, policy: Allocation) -> Result<QuotaAllocator<Con>, Box<dyn Error>> {
    let mut builder = QuotaAllocator::builder(home, Quota::per_second(RATE)?.burst(BURST)?)
        .name("demo")
        .policy(policy)
        .lease(LEASE)
        .refresh_every(REFRESH)
        .home_timeout(HOME_TIMEOUT);
    for region in REGIONS {
        builder = builder.region(region);
    }
    Ok(builder.build()?)
}

/// What the load tasks count.
#[derive(Default)]
struct Counts {
    /// Every admitted request: when its decision returned, and the region.
    admitted: Mutex<Vec<(Instant, usize)>>,
    rejected: [AtomicU64; 3],
    errors: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Open-loop load: each process of region `r` asks `offered[r] / PROCESSES` times a second
/// (re-read at every request, so the demand can move), whatever the answers.
fn start_load(
    members: &[Vec<Region<Con>>],
    offered: &[Arc<AtomicU64>; 3],
    counts: &Arc<Counts>,
) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    for (r, procs) in members.iter().enumerate() {
        for member in procs {
            let gate = member.gate();
            let offered = offered[r].clone();
            let counts = counts.clone();
            tasks.push(tokio::spawn(async move {
                let mut next = tokio::time::Instant::now();
                loop {
                    let rate = offered.load(Ordering::Relaxed) / PROCESSES as u64;
                    if rate == 0 {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        next = tokio::time::Instant::now();
                        continue;
                    }
                    next += Duration::from_nanos(1_000_000_000 / rate);
                    tokio::time::sleep_until(next).await;
                    match gate.check(KEY, 1).await {
                        Ok(d) if d.allowed => lock(&counts.admitted).push((Instant::now(), r)),
                        Ok(_) => {
                            counts.rejected[r].fetch_add(1, Ordering::Relaxed);
                        }
                        Err(_) => {
                            counts.errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
    }
    tasks
}

/// The share a region admits at now, as its leader sees it (`None` while no process of it
/// refreshes).
fn share(procs: &[Region<Con>]) -> Option<u64> {
    procs
        .iter()
        .map(Region::status)
        .filter(|s| s.leader)
        .map(|s| {
            if s.lease_left > Duration::ZERO {
                s.share
            } else {
                s.safe
            }
        })
        .max()
}

/// The demand of phase `phase`: the hot region wants 400/s, the others 60 and 40.
fn demand(phase: usize) -> [u64; 3] {
    let mut d = DEMAND;
    d.rotate_right(phase % 3);
    d
}

fn describe(d: [u64; 3]) -> String {
    REGIONS
        .iter()
        .zip(d)
        .map(|((name, _), want)| format!("{name} {want}/s"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One second of the run, for the plot.
struct Sample {
    t: u64,
    shares: [Option<u64>; 3],
    admitted: [u64; 3],
}

/// The signals that end the run early: Ctrl-C, and on Unix `SIGTERM` and `SIGHUP` too.
/// Listened to from the start, so that whichever comes, and whenever, the servers are
/// killed (by their `Drop`) rather than left running.
struct Stop {
    #[cfg(unix)]
    signals: Vec<tokio::signal::unix::Signal>,
}

impl Stop {
    fn listen() -> std::io::Result<Stop> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let kinds = [
                SignalKind::interrupt(),
                SignalKind::terminate(),
                SignalKind::hangup(),
            ];
            let signals = kinds.into_iter().map(signal).collect::<Result<_, _>>()?;
            Ok(Stop { signals })
        }
        #[cfg(not(unix))]
        Ok(Stop {})
    }

    /// Until one of the signals comes (at once if one came since `listen`).
    async fn recv(&mut self) {
        #[cfg(unix)]
        {
            let waits = self.signals.iter_mut().map(|s| Box::pin(s.recv()));
            futures::future::select_all(waits).await;
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The servers (killed when dropped), the links to the home, the allocator on the home's
/// own connection, and each region's processes.
struct Setup {
    home: Server,
    locals: Vec<Server>,
    proxies: Vec<DelayProxy>,
    direct: QuotaAllocator<Con>,
    members: Vec<Vec<Region<Con>>>,
}

async fn run(args: Args) -> Result<(), Box<dyn Error>> {
    let mut stop = Stop::listen()?;
    // A signal during the setup drops it, and the servers it started with it.
    let Setup {
        home,
        locals,
        proxies,
        direct,
        members,
    } = tokio::select! {
        setup = setup(&args) => setup?,
        () = stop.recv() => return Err("interrupted while starting".into()),
    };

    let offered: [Arc<AtomicU64>; 3] = Default::default();
    let counts = Arc::new(Counts::default());
    let set_demand = |d: [u64; 3]| {
        for (o, want) in offered.iter().zip(d) {
            o.store(want, Ordering::Relaxed);
        }
    };
    let mut phase = 0;
    set_demand(demand(phase));
    let start_shares: Vec<String> = REGIONS
        .iter()
        .zip(&members)
        .map(|((name, _), procs)| format!("{name} {}", share(procs).unwrap_or(0)))
        .collect();
    println!(
        "\nt=  0s  shares before any demand: {}; demand: {} (it moves every {:.1} s)",
        start_shares.join(", "),
        describe(demand(phase)),
        args.secs as f64 / 3.0
    );
    let load = start_load(&members, &offered, &counts);
    let started = Instant::now();
    // A little after each second, so the decisions of that second have been counted.
    let mut tick = tokio::time::interval_at(
        tokio::time::Instant::now() + Duration::from_millis(1020),
        Duration::from_secs(1),
    );
    let mut samples = Vec::new();
    for k in 0..args.secs {
        let now_phase = (k * 3 / args.secs) as usize;
        if now_phase != phase {
            phase = now_phase;
            set_demand(demand(phase));
            println!(
                "t={k:>3}s  demand moves to {}: {}",
                REGIONS[phase].0,
                describe(demand(phase))
            );
        }
        tokio::select! {
            _ = tick.tick() => {}
            () = stop.recv() => {
                println!("interrupted");
                break;
            }
        }
        let (from, to) = (
            started + Duration::from_secs(k),
            started + Duration::from_secs(k + 1),
        );
        let mut admitted = [0u64; 3];
        for &(t, r) in lock(&counts.admitted).iter() {
            if t >= from && t < to {
                admitted[r] += 1;
            }
        }
        let shares = [share(&members[0]), share(&members[1]), share(&members[2])];
        let mut line = format!("t={:>3}s  bound {RATE}/s", k + 1);
        for (((name, _), s), a) in REGIONS.iter().zip(shares).zip(admitted) {
            let s = s.map_or_else(|| "  -".to_string(), |s| format!("{s:>3}"));
            line.push_str(&format!(" | {name} share {s} admitted {a:>3}/s"));
        }
        line.push_str(&format!(" | total {}/s", admitted.iter().sum::<u64>()));
        println!("{line}");
        samples.push(Sample {
            t: k + 1,
            shares,
            admitted,
        });
    }

    let home_view = direct.status().await;
    for task in &load {
        task.abort();
    }
    for task in load {
        let _ = task.await;
    }

    let (max, at) = max_in_window(&lock(&counts.admitted), started, Duration::from_secs(1));
    let slack = (f64::from(RATE) * MEASURING_SLACK.as_secs_f64()).ceil() as u64;
    let bound = u64::from(RATE + BURST) + REGIONS.len() as u64 + slack;
    println!(
        "\nmax admitted in any 1 s window: {max} (from t={:.2}s); bound {bound} = rate {RATE} + burst \
         {BURST} + {} regions + {slack} ({} ms measuring slack){}",
        at.as_secs_f64(),
        REGIONS.len(),
        MEASURING_SLACK.as_millis(),
        if max <= bound {
            ""
        } else {
            "  ** ABOVE THE BOUND **"
        }
    );
    let total: u64 = lock(&counts.admitted).len() as u64;
    let rejected: u64 = counts
        .rejected
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .sum();
    let elapsed = started.elapsed().as_secs_f64();
    println!(
        "admitted {total} in {elapsed:.1} s ({:.0}/s), rejected {rejected}, errors {}",
        total as f64 / elapsed,
        counts.errors.load(Ordering::Relaxed)
    );
    for procs in &members {
        if let Some(leader) = procs.iter().map(Region::status).find(|s| s.leader) {
            println!("  {leader}");
        }
    }
    match home_view {
        Ok(status) => println!("home: {status}"),
        Err(e) => println!("home: status failed: {e}"),
    }

    if let Some(path) = &args.svg {
        plot(&samples, args.policy, path)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        let size = std::fs::metadata(path)?.len();
        println!("plot written to {} ({size} bytes)", path.display());
    }

    // Stop refreshing (the leases run out at the home), then the proxies and the servers.
    drop(members);
    drop(proxies);
    drop(locals);
    drop(home);
    Ok(())
}

async fn setup(args: &Args) -> Result<Setup, Box<dyn Error>> {
    let home = Server::start().await?;
    let mut locals = Vec::new();
    for _ in REGIONS {
        locals.push(Server::start().await?);
    }
    let mut proxies = Vec::new();
    for _ in REGIONS {
        proxies.push(DelayProxy::start(home.addr(), args.one_way).await?);
    }
    println!(
        "home redis on :{}; local redis us :{}, eu :{}, ap :{}; {} ms one way from each region to the home",
        home.port,
        locals[0].port,
        locals[1].port,
        locals[2].port,
        args.one_way.as_millis()
    );
    if args.one_way * 2 >= HOME_TIMEOUT {
        println!(
            "note: a {} ms round trip to the home is longer than the home timeout ({} ms): \
             every refresh fails, and the regions admit at their safe share (nothing)",
            (args.one_way * 2).as_millis(),
            HOME_TIMEOUT.as_millis()
        );
    }

    // A first deployment: no region holds a lease yet, so the home may skip learning.
    let direct = allocator(manager(&home.url(), Duration::ZERO).await?, args.policy)?;
    let fresh = direct.init_home().await?;
    println!(
        "global quota {RATE}/s (burst {BURST}), {} policy, weights us 50 / eu 30 / ap 20, \
         lease {} s, refresh every {} ms, {PROCESSES} processes per region (home initialised: {fresh})",
        args.policy,
        LEASE.as_secs(),
        REFRESH.as_millis()
    );

    let mut members: Vec<Vec<Region<Con>>> = Vec::new();
    for (r, (name, _)) in REGIONS.iter().enumerate() {
        let mut procs = Vec::new();
        for _ in 0..PROCESSES {
            // Each process builds its own allocator (its own connection to the home, through
            // the region's link) and joins with its own connection to the local Redis.
            let home = manager(&proxies[r].url(), args.one_way)
                .await
                .map_err(|e| format!("cannot connect to the home through {name}'s link: {e}"))?;
            let alloc = allocator(home, args.policy)?;
            procs.push(
                alloc
                    .join(name, manager(&locals[r].url(), Duration::ZERO).await?)
                    .await?,
            );
        }
        members.push(procs);
    }
    Ok(Setup {
        home,
        locals,
        proxies,
        direct,
        members,
    })
}

/// The most admitted in any window of length `w`, and where that window starts.
fn max_in_window(admitted: &[(Instant, usize)], started: Instant, w: Duration) -> (u64, Duration) {
    let mut times: Vec<Instant> = admitted.iter().map(|a| a.0).collect();
    times.sort_unstable();
    let (mut best, mut at, mut lo) = (0, Duration::ZERO, 0);
    for hi in 0..times.len() {
        while times[hi].duration_since(times[lo]) >= w {
            lo += 1;
        }
        let n = (hi - lo + 1) as u64;
        if n > best {
            best = n;
            at = times[lo].saturating_duration_since(started);
        }
    }
    (best, at)
}

/// Each region's share (dashed) and admitted rate (solid), the total admitted and the
/// global bound, against time.
fn plot(samples: &[Sample], policy: Allocation, out: &Path) -> Result<(), Box<dyn Error>> {
    let end = samples.last().map_or(1, |s| s.t) as f64;
    let top = f64::from(RATE) * 1.7;
    let root = SVGBackend::new(out, (960, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("one global quota of {RATE}/s across three regions ({policy})"),
            ("sans-serif", 20),
        )
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..end, 0.0..top)?;
    chart
        .configure_mesh()
        .x_desc("time (s)")
        .y_desc("requests per second")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .light_line_style(WHITE.mix(0.0))
        .draw()?;

    let bound = f64::from(RATE);
    chart
        .draw_series(LineSeries::new(
            [(0.0, bound), (end, bound)],
            BLACK.stroke_width(2),
        ))?
        .label(format!("global bound {RATE}/s"))
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK.stroke_width(2)));
    let grey = RGBColor(140, 140, 140);
    let total: Vec<(f64, f64)> = samples
        .iter()
        .map(|s| (s.t as f64, s.admitted.iter().sum::<u64>() as f64))
        .collect();
    chart
        .draw_series(LineSeries::new(total, grey.stroke_width(1)))?
        .label("total admitted")
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], grey.stroke_width(1)));

    let colors = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
    ];
    for (r, ((name, _), color)) in REGIONS.iter().zip(colors).enumerate() {
        let shares: Vec<(f64, f64)> = samples
            .iter()
            .filter_map(|s| s.shares[r].map(|v| (s.t as f64, v as f64)))
            .collect();
        chart
            .draw_series(DashedLineSeries::new(shares, 6, 4, color.stroke_width(2)))?
            .label(format!("{name} share (dashed)"))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(1)));
        let admitted: Vec<(f64, f64)> = samples
            .iter()
            .map(|s| (s.t as f64, s.admitted[r] as f64))
            .collect();
        chart
            .draw_series(LineSeries::new(admitted.clone(), color.stroke_width(2)))?
            .label(format!("{name} admitted/s"))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series(admitted.iter().map(|&p| Circle::new(p, 2, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .draw()?;
    root.present()?;
    Ok(())
}
