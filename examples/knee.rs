//! Find the knee of a downstream and the `max_in_flight` to give its bulkhead.
//!
//! ```text
//! cargo run --example knee                                  # the simulator (knee 48)
//! cargo run --example knee -- --knee 120                    # another simulated knee
//! cargo run --example knee -- --knee 1500 --max-concurrency 2048  # above the default top, 1,024
//! cargo run --example knee -- --url http://127.0.0.1:3000/report  # an HTTP server on loopback
//! cargo run --example knee -- --out docs/knee.svg           # where the plot goes
//! ```
//!
//! It ramps the concurrency (1, 2, 4, ... then finer steps around the knee), shows a
//! progress bar, prints a table (concurrency, throughput, p50, p99), the knee and the
//! recommendation, and writes an SVG plot of throughput and p99 against concurrency with
//! the knee and the recommendation marked: to `--out` (relative to the current directory),
//! by default to `knee.svg` in the target directory cargo builds the example in (`target/`
//! of this crate unless `CARGO_TARGET_DIR` says otherwise), wherever cargo runs from. It
//! prints where, and checks that it can write there before the search starts. The ramp
//! stops at `--max-concurrency` (1,024 unless given, at most 65,536) if nothing saturates
//! before: a simulated `--knee` above it is refused, as the search could not find it. Nor
//! does it find one at or just below it (`--knee 44 --max-concurrency 48`): a knee counts
//! only once a step above it saturates, so such a run ends with "no knee found", telling
//! to raise `--max-concurrency`.
//!
//! The simulator answers a call in 25 ms alone, some 24 % slower at its knee whatever the
//! knee (a linear rise, the cost of sharing: `0.24 × (knee − 1) / knee`, so less for a knee
//! of a few, none for 1), and exponentially slower above it (a queue: steepness 1.1 from a
//! knee of 48 up, steeper below it, see `flowgate::adaptive::sim`), with ±10 % jitter. Its
//! throughput peaks at the knee; the knee the search reports is where the throughput
//! reaches 97 % of its best (see `flowgate::adaptive::knee`), a little lower: 46 for 48,
//! 963 for 1,000, 4 for 4.
//!
//! Against the simulator the search runs under paused tokio time: its hundred-odd seconds
//! of simulated load take about a second of CPU in the debug build `cargo run` makes (it
//! prints how long they took), and the answer is the same every time. Against a URL it
//! runs in real time (5 s per step, up to some 20 steps): try it on the `/report` route of
//! `cargo run --example http_server --features http`, run in another terminal (a 1 s
//! handler behind a bulkhead of 8 with 2 reserved for `/health`: the knee is 6 in flight;
//! its `/` admits 100 requests a minute per client: a rate limit, not a concurrency one, so
//! the search stops at its first step with an error that says so, and finds no knee). Only
//! loopback addresses are accepted: the search overloads its target on purpose.
//!
//! A bad argument exits with code 2 before anything runs; a failed run (nothing listens at
//! `--url`, a search that ends with an error) with 1.

#[path = "support/cli.rs"]
mod cli;
#[path = "../tests/support/knee_http.rs"]
mod knee_http;
#[path = "support/plot_file.rs"]
mod plot_file;

use std::error::Error;
use std::path::{Path, PathBuf};
use std::time::Duration;

use flowgate::adaptive::knee::{
    KneeConfig, KneePhase, KneeReport, KneeTarget, find_knee_with_progress,
};
use flowgate::adaptive::sim::Downstream;
use indicatif::{ProgressBar, ProgressStyle};
use plotters::prelude::*;

/// The simulated server's knee without `--knee`.
const SIMULATED_KNEE: u32 = 48;

struct Args {
    url: Option<String>,
    /// The simulated server's knee, when given (only without `--url`).
    knee: Option<u32>,
    /// Where the ramp stops if nothing saturates before (the finder's default unless given).
    max_concurrency: Option<u32>,
    out: PathBuf,
}

/// How much slower than alone the simulated downstream answers at its knee, whatever the
/// knee: the slope per call in flight is this divided by the knee (0.005 at the default 48).
/// A slope of its own per call would make a large knee's downstream queue long before its
/// knee (6× slower than alone at a knee of 1,000 with 0.005), its throughput flat from far
/// below it, and the knee found there (792 for 1,000).
const SLOPE_TO_KNEE: f64 = 0.24;

/// How much slower each call above the knee makes the simulated downstream, at the default
/// knee (48) and above. A smaller knee gets a steeper queue, `1.1^(48 / knee)`, so that its
/// throughput peaks at its knee too: a downstream's throughput peaks at its knee only where
/// `knee · ln k > 1 − slope` (`flowgate::adaptive::sim`), with 1.1 from a knee of about 10
/// on; below, it rose well past the knee, and `--knee 4` was found at 7. Against
/// `n / knee`, every knee up to 48 now has the default's curve.
const STEEPNESS: f64 = 1.1;

/// The simulated downstream's steepness for `knee` (see [`STEEPNESS`]).
fn steepness(knee: u32) -> f64 {
    STEEPNESS
        .powf(f64::from(SIMULATED_KNEE) / f64::from(knee))
        .max(STEEPNESS)
}

const USAGE: &str = "usage: knee [--url http://127.0.0.1:PORT/ | --knee N (simulated, default 48)] [--max-concurrency N (default 1024, at most 65536)] [--out FILE.svg]";

/// A count of calls in flight: 1 or more.
fn in_flight(flag: &str, v: &str) -> Result<u32, String> {
    match v.parse() {
        Ok(n @ 1..) => Ok(n),
        _ => Err(format!("{flag} {v:?}: give calls in flight, 1 or more")),
    }
}

/// Where the plot goes without `--out`: `knee.svg` in the target directory cargo built
/// this example in (`<target>/<profile>/examples/knee`; `target/` of the crate unless
/// `CARGO_TARGET_DIR` or `--target-dir` says otherwise), or in the current directory for a
/// binary run from elsewhere.
fn default_out() -> PathBuf {
    let exe = std::env::current_exe().ok();
    let target = exe.as_deref().and_then(|exe| {
        let examples = exe.parent()?;
        let profile = examples.parent()?;
        (examples.file_name()? == "examples").then_some(profile.parent()?)
    });
    target.map_or_else(|| PathBuf::from("knee.svg"), |t| t.join("knee.svg"))
}

/// The command line; a bad argument is refused (exit code 2).
fn args() -> Args {
    let mut args = Args {
        url: None,
        knee: None,
        max_concurrency: None,
        out: default_out(),
    };
    let mut cli = cli::Cli::new(USAGE);
    while let Some(flag) = cli.next_flag() {
        match flag.as_str() {
            "--url" => {
                // Refused now, naming the flag, before anything is printed.
                let url = cli.parsed(&flag, |v| match knee_http::loopback_uri(v) {
                    Ok(_) => Ok(v.to_owned()),
                    Err(e) => Err(format!("--url {v:?}: {e}")),
                });
                args.url = Some(url);
            }
            "--knee" => args.knee = Some(cli.parsed(&flag, |v| in_flight("--knee", v))),
            "--max-concurrency" => {
                args.max_concurrency = Some(cli.parsed(&flag, |v| in_flight(&flag, v)));
            }
            "--out" => args.out = PathBuf::from(cli.value(&flag)),
            other => cli.unknown(other),
        }
    }
    args
}

/// What was wrong: the command line (exit code 2) or the run (exit code 1).
enum Failure {
    Argument(String),
    Run(Box<dyn Error>),
}

impl<E: Into<Box<dyn Error>>> From<E> for Failure {
    fn from(e: E) -> Failure {
        Failure::Run(e.into())
    }
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(Failure::Argument(e)) => cli::Cli::new(USAGE).refuse(e),
        Err(Failure::Run(e)) => {
            eprintln!("error: {e}");
            std::process::ExitCode::from(1)
        }
    }
}

fn run() -> Result<(), Failure> {
    let args = args();
    let mut config = KneeConfig::builder();
    if let Some(max) = args.max_concurrency {
        config = config.max_concurrency(max);
    }
    // Every other setting is the default: only the top can be refused.
    let config = config
        .build()
        .map_err(|e| Failure::Argument(format!("--max-concurrency: {e}")))?;
    // The ramp stops at `max_concurrency`: a simulated knee above it cannot be found.
    let max = config.max_concurrency();
    if args.url.is_some() && args.knee.is_some() {
        return Err(Failure::Argument(
            "--knee sets the simulated server's knee; with --url the server's own is measured: give one or the other".to_owned(),
        ));
    }
    let knee = args.knee.unwrap_or(SIMULATED_KNEE);
    if args.url.is_none() && knee > max {
        let fix = if knee <= 65_536 {
            format!("give --max-concurrency {knee} or more")
        } else {
            "the search goes up to 65536 at most".to_owned()
        };
        return Err(Failure::Argument(format!(
            "--knee {knee} is above --max-concurrency {max}, where the search stops: it cannot find it ({fix})"
        )));
    }
    let out = plot_file::writable(&args.out, "--out").map_err(Failure::Argument)?;
    println!("the plot goes to {}", out.display());
    let (report, what) = match &args.url {
        Some(url) => {
            let target = knee_http::HttpTarget::new(url)?;
            let runtime = tokio::runtime::Runtime::new()?;
            // A closed port refuses every call at once: say so now, not after a first step
            // of 5 s spent calling it back to back.
            let uri = target.uri();
            let host = uri.host().unwrap_or_default().trim_matches(['[', ']']);
            let port = uri.port_u16().unwrap_or(80);
            if let Err(e) = runtime.block_on(tokio::net::TcpStream::connect((host, port))) {
                return Err(format!("nothing listens at {uri}: {e} (start it first)").into());
            }
            let what = format!("GET {} (real time)", target.uri());
            println!("measuring {what}");
            (runtime.block_on(search(&target, &config))?, what)
        }
        None => {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .start_paused(true)
                .build()?;
            let target = runtime.block_on(async {
                Downstream::builder()
                    .knee(knee)
                    .steepness(steepness(knee))
                    .slope(SLOPE_TO_KNEE / f64::from(knee))
                    .jitter(0.1)
                    .capacity(knee.saturating_mul(2))
                    .timeout(Duration::from_secs(1))
                    .build()
            })?;
            let what = format!("the simulator (true knee {knee}, paused tokio time)");
            println!("measuring {what}");
            let started = std::time::Instant::now();
            let report = runtime.block_on(search(&target, &config))?;
            println!(
                "{:.0} s of simulated load in {} ms of real time",
                report.elapsed.as_secs_f64(),
                started.elapsed().as_millis()
            );
            (report, what)
        }
    };

    print_table(&report);
    match (report.knee, report.recommended) {
        (Some(knee), Some(recommended)) => println!(
            "\nknee: {knee} in flight; recommended max_in_flight: {recommended} ({:.0} % of the knee)",
            report.recommend_fraction * 100.0
        ),
        _ => {
            let top = report.steps.last();
            let up_to = top.map_or(0, |s| s.concurrency);
            // Flat: half the calls in flight already brought (nearly) the same throughput
            // as the top step. No step saturated all the same: a queue that only grows
            // saturates at 10x the lowest p50, about 10x the knee in flight.
            let flat = top.is_some_and(|top| {
                report.steps.iter().any(|s| {
                    s.concurrency * 2 <= top.concurrency && s.throughput >= top.throughput * 0.97
                })
            });
            if flat {
                println!(
                    "\nno knee found up to {up_to} in flight: the throughput is flat, but no step saturated yet (p50 below 10x the lowest); raise --max-concurrency (to about 10x where the throughput flattens; or, in code, lower max_latency_growth)"
                )
            } else {
                println!(
                    "\nno knee found up to {up_to} in flight: the target still scales; raise --max-concurrency"
                )
            }
        }
    }
    plot(&report, &what, &out).map_err(|e| format!("cannot write {}: {e}", out.display()))?;
    println!("plot written to {}", out.display());
    Ok(())
}

async fn search<T: KneeTarget + ?Sized>(
    target: &T,
    config: &KneeConfig,
) -> Result<KneeReport, Box<dyn Error>> {
    let bar = ProgressBar::new(config.max_steps() as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{bar:30}] {pos}/{len} steps  {msg}")?
            .progress_chars("=> "),
    );
    let result = find_knee_with_progress(target, config, |p| {
        let phase = match p.phase {
            KneePhase::Ramp => "ramp".to_owned(),
            KneePhase::Refine(round) => format!("refine {round}"),
            _ => "list".to_owned(),
        };
        bar.set_length(p.planned as u64);
        bar.set_position(p.done as u64);
        bar.set_message(format!(
            "{phase}: {} in flight, {:.0}/s, p99 {:.1} ms",
            p.step.concurrency,
            p.step.throughput,
            ms(p.step.p99)
        ));
    })
    .await;
    bar.finish_and_clear();
    Ok(result?)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1_000.0
}

fn print_table(report: &KneeReport) {
    println!(
        "\n{:>11} {:>12} {:>9} {:>9} {:>13}",
        "concurrency", "throughput/s", "p50 ms", "p99 ms", "back-pressure"
    );
    for s in &report.steps {
        let marks = match (report.knee, report.recommended) {
            (Some(k), _) if k == s.concurrency => "  <- knee",
            (_, Some(r)) if r == s.concurrency => "  <- recommended",
            _ => "",
        };
        println!(
            "{:>11} {:>12.1} {:>9.1} {:>9.1} {:>12.1}%{marks}",
            s.concurrency,
            s.throughput,
            ms(s.p50),
            ms(s.p99),
            s.back_pressure_ratio() * 100.0
        );
    }
}

/// Throughput (left axis) and p99 (right axis) against concurrency, the knee and the
/// recommendation as vertical lines.
fn plot(report: &KneeReport, what: &str, out: &Path) -> Result<(), Box<dyn Error>> {
    let steps: Vec<_> = report.steps.iter().filter(|s| s.ok > 0).collect();
    let max_c = report.steps.last().map_or(1, |s| s.concurrency) as f64;
    let max_x = steps.iter().map(|s| s.throughput).fold(1.0, f64::max) * 1.1;
    let max_p99 = steps.iter().map(|s| ms(s.p99)).fold(1.0, f64::max) * 1.1;

    let root = SVGBackend::new(out, (900, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("knee finder: {what}"), ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .right_y_label_area_size(70)
        .build_cartesian_2d(0.0..max_c, 0.0..max_x)?
        .set_secondary_coord(0.0..max_c, 0.0..max_p99);
    chart
        .configure_mesh()
        .x_desc("calls in flight (concurrency)")
        .y_desc("throughput (ok/s)")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .light_line_style(WHITE.mix(0.0))
        .draw()?;
    chart
        .configure_secondary_axes()
        .y_desc("p99 latency (ms)")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()?;

    let blue = RGBColor(31, 119, 180);
    let orange = RGBColor(214, 39, 40);
    let xy = |f: fn(&&flowgate::adaptive::knee::KneeStep) -> f64| {
        steps
            .iter()
            .map(move |s| (f64::from(s.concurrency), f(s)))
            .collect::<Vec<_>>()
    };
    let throughput = xy(|s| s.throughput);
    let p99 = xy(|s| ms(s.p99));
    chart
        .draw_series(LineSeries::new(throughput.clone(), blue.stroke_width(2)))?
        .label("throughput")
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], blue.stroke_width(2)));
    chart.draw_series(throughput.iter().map(|&p| Circle::new(p, 3, blue.filled())))?;
    chart
        .draw_secondary_series(LineSeries::new(p99.clone(), orange.stroke_width(2)))?
        .label("p99 latency")
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], orange.stroke_width(2)));
    chart.draw_secondary_series(p99.iter().map(|&p| Circle::new(p, 3, orange.filled())))?;

    let marks = [
        (report.knee, "knee", BLACK),
        (report.recommended, "recommended", RGBColor(44, 160, 44)),
    ];
    for (at, name, color) in marks {
        let Some(at) = at else { continue };
        let x = f64::from(at);
        chart
            .draw_series(DashedLineSeries::new(
                [(x, 0.0), (x, max_x)],
                6,
                4,
                color.stroke_width(2),
            ))?
            .label(format!("{name}: {at}"))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series([Text::new(
            format!("{name} {at}"),
            (x + max_c * 0.006, max_x * 0.97),
            ("sans-serif", 14).into_font().color(&color),
        )])?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .draw()?;
    root.present()?;
    Ok(())
}
