//! The steady-state groups of the channel bench: 10^6 items per round, hand-timed, consumers
//! as tasks or in `block_on` (see the bench's docs in `channel.rs`).

use std::time::{Duration, Instant};

use tokio::runtime::Runtime;

use super::{
    AsyncChannel, CAPACITIES, Chan, Flowgate, Flume, ITEMS, Kanal, OURS, Placement, SCENARIOS,
    Scenario, TokioMpsc, runtime, support, transfer,
};

/// Items moved per round.
const STEADY_ITEMS: u64 = 1_000_000;
/// Timed rounds per channel (the median is reported; `CHANNEL_ROUNDS` overrides).
const STEADY_ROUNDS: usize = 5;

/// One steady-state case: a scenario, a capacity and where the consumers run.
#[derive(Clone, Copy)]
struct Case {
    s: Scenario,
    cap: usize,
    at: Placement,
}

impl Case {
    fn name(self) -> String {
        format!("steady_{}_cap{}_{}", self.s.name, self.cap, self.at.label())
    }

    /// The channels this case runs: tokio mpsc only with a single consumer; with
    /// `CHANNEL_ONLY` (ids separated by commas), only those (flowgate always).
    fn impls(self) -> Vec<(&'static str, Round)> {
        let only = std::env::var("CHANNEL_ONLY").ok();
        STEADY_IMPLS
            .into_iter()
            .filter(|(id, _)| self.s.consumers == 1 || *id != TokioMpsc::ID)
            .filter(|(id, _)| {
                *id == OURS
                    || only
                        .as_deref()
                        .is_none_or(|o| o.split(',').any(|x| x == *id))
            })
            .collect()
    }
}

/// Every steady-state case, in the order they run.
fn cases() -> Vec<Case> {
    let mut all = Vec::new();
    for at in [Placement::Task, Placement::BlockOn] {
        for s in SCENARIOS {
            for cap in CAPACITIES {
                all.push(Case { s, cap, at });
            }
        }
    }
    all
}

/// One timed round: `items` through a fresh channel, on `rt`, wall time of the whole
/// transfer (channel creation, spawns and joins included: microseconds against 10^6 items).
type Round = fn(&Runtime, Case, u64) -> Duration;

fn round<C: Chan>(rt: &Runtime, case: Case, items: u64) -> Duration {
    let start = Instant::now();
    rt.block_on(transfer::<C>(case.cap, case.s, items, case.at));
    start.elapsed()
}

/// flowgate run a second time as if it were a peer: the A/A control. Its paired ratio to
/// flowgate is this bench's own noise in the case (1.0 on a quiet machine).
const AA: &str = "flowgate_aa";

const STEADY_IMPLS: [(&str, Round); 6] = [
    (Flowgate::ID, round::<Flowgate>),
    (AA, round::<Flowgate>),
    (TokioMpsc::ID, round::<TokioMpsc>),
    (Flume::ID, round::<Flume>),
    (AsyncChannel::ID, round::<AsyncChannel>),
    (Kanal::ID, round::<Kanal>),
];

/// The peers flowgate must match in every steady-state case (tokio where it applies).
const MUST_PEERS: [&str; 3] = [TokioMpsc::ID, AsyncChannel::ID, Flume::ID];
/// The aim in SPSC: flowgate's throughput at least `1 / KANAL_AIM` of kanal's.
const KANAL_AIM: f64 = 1.5;

/// The measured rounds of one channel in one case.
struct Measured {
    id: &'static str,
    rounds: Vec<Duration>,
}

impl Measured {
    fn median(&self) -> Duration {
        let mut sorted = self.rounds.clone();
        sorted.sort_unstable();
        sorted[sorted.len() / 2]
    }

    /// Million items per second of a round that took `d`.
    fn mitems(items: u64, d: Duration) -> f64 {
        items as f64 / d.as_secs_f64() / 1e6
    }
}

/// Run one case: a warm-up round per channel, then `rounds` rounds in which the channels take
/// turns (round 1 of each, round 2 of each, ...), so a change in the machine's load hits
/// every channel alike instead of the one that happened to run then.
fn steady_case(case: Case, items: u64, rounds: usize) -> Vec<Measured> {
    let rt = runtime();
    let impls = case.impls();
    for (_, run) in &impls {
        run(&rt, case, (items / 10).max(1_000));
    }
    let mut measured: Vec<Measured> = impls
        .iter()
        .map(|(id, _)| Measured {
            id,
            rounds: Vec::with_capacity(rounds),
        })
        .collect();
    // The order rotates by one each round: whatever one channel leaves behind (kanal's
    // spinning consumers, a scheduler's bookkeeping) does not always hit the same next one.
    for r in 0..rounds {
        for k in 0..impls.len() {
            let i = (k + r) % impls.len();
            measured[i].rounds.push((impls[i].1)(&rt, case, items));
        }
    }
    measured
}

/// Print one case's table: median throughput, the spread over the rounds and flowgate /
/// peer throughput ratios (above 1.0: flowgate faster).
fn print_steady(case: Case, items: u64, measured: &[Measured]) {
    println!(
        "\n== {}: {items} u64 per round, median of {} rounds [slowest..fastest round]; \
         ratio = flowgate / peer throughput (>= 1.0: flowgate at or faster)",
        case.name(),
        measured.first().map_or(0, |m| m.rounds.len())
    );
    let ours = measured.iter().find(|m| m.id == OURS).map(Measured::median);
    for m in measured {
        let median = m.median();
        let (lo, hi) = (
            m.rounds.iter().max().copied().unwrap_or_default(),
            m.rounds.iter().min().copied().unwrap_or_default(),
        );
        let ratio = match ours {
            Some(o) if m.id != OURS => {
                format!("ratio {:.3}", median.as_secs_f64() / o.as_secs_f64())
            }
            _ => String::new(),
        };
        println!(
            "  {:<14} {:>8.2} ns/item {:>8.2} Mitem/s [{:>6.2}..{:>6.2}]   {ratio}",
            m.id,
            median.as_nanos() as f64 / items as f64,
            Measured::mitems(items, median),
            Measured::mitems(items, lo),
            Measured::mitems(items, hi),
        );
    }
}

/// flowgate / `peer` throughput in each round (both ran in it, a few turns apart at most), and their
/// median: a drift of the machine's speed between rounds cancels out of it.
fn paired(measured: &[Measured], peer: &str) -> Option<(f64, f64, f64)> {
    let ours = measured.iter().find(|m| m.id == OURS)?;
    let peer = measured.iter().find(|m| m.id == peer)?;
    let ratios: Vec<f64> = ours
        .rounds
        .iter()
        .zip(&peer.rounds)
        .map(|(o, p)| p.as_secs_f64() / o.as_secs_f64())
        .collect();
    Some(support::median_spread(&ratios))
}

/// The Must for one case (flowgate's throughput at least each of [`MUST_PEERS`]'),
/// read from the median of the rounds' paired ratios ([`paired`]), printed as a PASS/FAIL
/// line with the ratio of the medians beside it; and in SPSC the aim against kanal.
fn steady_must(case: Case, measured: &[Measured]) -> Option<bool> {
    let median = |id: &str| measured.iter().find(|m| m.id == id).map(Measured::median);
    let ours = median(OURS)?;
    let ratio = |id: &str| median(id).map(|p| p.as_secs_f64() / ours.as_secs_f64());
    let mut pass = true;
    let mut parts = Vec::new();
    for peer in MUST_PEERS {
        if let Some((r, lo, hi)) = paired(measured, peer) {
            pass &= r >= 1.0;
            let tie = if (r - 1.0).abs() < 0.05 {
                ", tie within 5%"
            } else {
                ""
            };
            let of_medians = ratio(peer).unwrap_or(f64::NAN);
            parts.push(format!(
                "{peer} x{r:.3} (rounds {lo:.2}..{hi:.2}, of medians x{of_medians:.3}{tie})"
            ));
        }
    }
    println!(
        "{} {}: flowgate >= {}",
        support::pass_fail(pass),
        case.name(),
        parts.join(", ")
    );
    if let Some((r, lo, hi)) = paired(measured, AA) {
        println!(
            "     A/A {}: flowgate / flowgate x{r:.3} (rounds {lo:.2}..{hi:.2}): the noise the ratios above carry",
            case.name()
        );
    }
    if case.s.producers == 1
        && case.s.consumers == 1
        && let Some((r, _, _)) = paired(measured, Kanal::ID)
    {
        println!(
            "     aim {}: flowgate within {KANAL_AIM}x of kanal: x{r:.3} ({})",
            case.name(),
            if r * KANAL_AIM >= 1.0 {
                "met"
            } else {
                "not met"
            }
        );
    }
    Some(pass)
}

/// The steady-state groups, hand-timed (see the file's docs); `filter` as criterion's.
pub(crate) fn run(filter: Option<&str>, bench_mode: bool) {
    let (items, rounds) = if bench_mode {
        let rounds = std::env::var("CHANNEL_ROUNDS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or(STEADY_ROUNDS);
        (STEADY_ITEMS, rounds)
    } else {
        (ITEMS, 1)
    };
    let cases: Vec<Case> = cases()
        .into_iter()
        .filter(|c| filter.is_none_or(|f| c.name().contains(f)))
        .collect();
    if cases.is_empty() {
        return;
    }
    println!(
        "\nsteady state: tokio multi-thread runtime, {} workers; {} CPUs; load average at \
         start: {} (a shared, noisy machine: other builds may run)",
        super::workers(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        support::load_average()
    );
    if !bench_mode {
        println!("  (no --bench: smoke run, {items} items, 1 round, no verdicts)");
    }
    let results: Vec<(Case, Vec<Measured>)> = cases
        .into_iter()
        .map(|case| {
            let measured = steady_case(case, items, rounds);
            print_steady(case, items, &measured);
            (case, measured)
        })
        .collect();
    println!("\nload average at end: {}", support::load_average());
    if !bench_mode {
        return;
    }
    println!();
    let checks: Vec<Option<bool>> = results
        .iter()
        .map(|(case, measured)| steady_must(*case, measured))
        .collect();
    support::summary("issue 20 steady-state channel Musts", checks);
}
