//! Shared bench helpers: read criterion's medians back and print ratios against peers.
#![allow(dead_code)]

use std::path::PathBuf;

pub mod alloc;
pub mod redis_server;

/// How a requirement line starts.
pub fn pass_fail(pass: bool) -> &'static str {
    if pass { "PASS" } else { "FAIL" }
}

/// One line: how many of the measured checks (`None`: not measured) pass.
pub fn summary(what: &str, results: impl IntoIterator<Item = Option<bool>>) {
    let measured: Vec<bool> = results.into_iter().flatten().collect();
    let failed = measured.iter().filter(|pass| !**pass).count();
    println!(
        "verdict: {} of {} measured {what} pass{}",
        measured.len() - failed,
        measured.len(),
        if failed == 0 { "" } else { " (see FAIL lines)" }
    );
}

/// The median of `values` (the mean of the middle two for an even count; NaN values are
/// left out); NaN when there is none.
pub fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|v| !v.is_nan()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The median of `values` with their lowest and highest (the spread of a set of rounds).
pub fn median_spread(values: &[f64]) -> (f64, f64, f64) {
    let (lo, hi) = values
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    (median(values), lo, hi)
}

/// The machine's load averages over 1, 5 and 15 minutes, as `/proc/loadavg` gives them.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "n/a".into())
}

/// Criterion's output folder (it follows `CARGO_TARGET_DIR`).
fn criterion_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target"));
    target.join("criterion")
}

/// The median estimate (ns per iteration) of `group/bench`, if criterion measured it this run.
pub fn median_ns(group: &str, bench: &str) -> Option<f64> {
    let path = criterion_dir()
        .join(sanitize(group))
        .join(sanitize(bench))
        .join("new")
        .join("estimates.json");
    let json = std::fs::read_to_string(path).ok()?;
    let at = json.find("\"median\"")?;
    let rest = &json[at..];
    let key = "\"point_estimate\":";
    let start = rest.find(key)? + key.len();
    let end = rest[start..].find([',', '}'])? + start;
    rest[start..end].trim().parse().ok()
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| match c {
            '/' | '\\' | '?' | '"' | '<' | '>' | '|' | '*' | ':' => '_',
            c => c,
        })
        .collect()
}

/// Print `ours` against each peer of a group: medians and `ours / peer` time ratios
/// (below 1.0 means flowgate is faster).
pub fn print_ratios(group: &str, ours: &str, peers: &[&str]) {
    let Some(base) = median_ns(group, ours) else {
        println!("{group}: no measurement for {ours} (filtered out?)");
        return;
    };
    println!(
        "\n== {group}: median time per op, ratio = flowgate / peer (<= 1.0: flowgate at or faster)"
    );
    println!("  {ours:<28} {base:>10.2} ns");
    for peer in peers {
        match median_ns(group, peer) {
            Some(p) => println!("  {peer:<28} {p:>10.2} ns   ratio {:.3}", base / p),
            None => println!("  {peer:<28} (not measured)"),
        }
    }
}

/// Print each bench of a group as throughput, from its median: ns per element and
/// million elements per second (`elements` per iteration, as given to
/// `Throughput::Elements`). Benches without a measurement print "n/a".
pub fn print_throughput(group: &str, elements: u64, benches: &[&str]) {
    println!("\n== {group}: median throughput ({elements} elements per iteration)");
    for bench in benches {
        match median_ns(group, bench) {
            Some(ns) => println!(
                "  {bench:<28} {:>10.2} ns/elem {:>10.2} Melem/s",
                ns / elements as f64,
                elements as f64 * 1e3 / ns
            ),
            None => println!("  {bench:<28} n/a"),
        }
    }
}

/// As [`median_ns`], but only if criterion wrote the estimate at or after `since` (e.g. the
/// start of this run), so a bench filtered out of this run does not report an old median.
pub fn median_ns_since(group: &str, bench: &str, since: std::time::SystemTime) -> Option<f64> {
    let path = criterion_dir()
        .join(sanitize(group))
        .join(sanitize(bench))
        .join("new")
        .join("estimates.json");
    let modified = std::fs::metadata(path).ok()?.modified().ok()?;
    if modified < since {
        return None;
    }
    median_ns(group, bench)
}

/// The bench filter criterion was given (its first positional argument), so the
/// hand-timed groups honour it too; `--bench` (a real run, not `cargo test --benches`).
pub fn filter_and_mode() -> (Option<String>, bool) {
    // Criterion's options that take a value as the next argument.
    const WITH_VALUE: [&str; 16] = [
        "--save-baseline",
        "-s",
        "--baseline",
        "-b",
        "--baseline-lenient",
        "--load-baseline",
        "--sample-size",
        "--warm-up-time",
        "--measurement-time",
        "--nresamples",
        "--noise-threshold",
        "--confidence-level",
        "--significance-level",
        "--profile-time",
        "--color",
        "--output-format",
    ];
    let args: Vec<String> = std::env::args().skip(1).collect();
    let bench_mode = args.iter().any(|a| a == "--bench");
    let mut filter = None;
    let mut skip_next = false;
    for a in &args {
        if std::mem::take(&mut skip_next) {
            continue;
        }
        if a.starts_with('-') {
            skip_next = WITH_VALUE.contains(&a.as_str());
        } else {
            filter = Some(a.clone());
            break;
        }
    }
    (filter, bench_mode)
}
