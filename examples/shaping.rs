//! Traffic shaping: a bursty producer smoothed to a constant 200 items/s.
//!
//! The producer emits 1,000 items at once, then stays silent, three times, 6 s apart (a
//! burst of 1,000 takes 5 s to leave at 200/s, then the output falls silent too until the
//! next burst). `leaky_queue` drains each burst into a
//! queue of 1,000 (`Overflow::Backpressure`: nothing is dropped; a fuller queue would stop
//! pulling from the producer) and a `Pacer` releases it at 200/s. The histogram counts, per
//! 100 ms, items produced (`in`) and items released (`out`), one character per item:
//! spikes of 1,000 on the input side, a flat 20 per 100 ms (200/s) on the output side. Runs
//! of identical rows are folded into one `⋮` line. After a silence the pacer lets its small
//! burst (2 items at 200/s) go at once, never more: idle time is not saved up.
//!
//! Time is paused and auto-advanced by tokio, so the 17 s of virtual time take a fraction of
//! a second (some 100 ms in the debug build `cargo run` makes) and the output is the same on
//! every run:
//!
//! ```text
//! cargo run --example shaping
//! ```

#[path = "support/cli.rs"]
mod cli;

use std::pin::pin;
use std::time::Duration;

use flowgate::pace::{LeakyQueue, Pacer};
use flowgate::{Overflow, Rate};
use futures::StreamExt;
use tokio::time::Instant;

const RATE: u32 = 200;
const BURST_ITEMS: usize = 1_000;
const BURSTS: u32 = 3;
const PERIOD: Duration = Duration::from_secs(6);
const BUCKET: Duration = Duration::from_millis(100);
/// Input bars longer than this are cut (marked `»`); one character per item on both sides.
const IN_WIDTH: usize = 50;

#[tokio::main(flavor = "current_thread", start_paused = true)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    cli::no_arguments("usage: shaping (no arguments: three bursts of 1,000 items shaped to 200/s)");
    let start = Instant::now();
    let bucket_of = |t: Instant| (t.duration_since(start).as_nanos() / BUCKET.as_nanos()) as usize;

    // Each item carries the instant it was produced.
    let producer = futures::stream::iter(0..BURSTS)
        .then(move |k| async move {
            tokio::time::sleep_until(start + PERIOD * k).await;
            futures::stream::iter(std::iter::repeat_n(Instant::now(), BURST_ITEMS))
        })
        .flatten();
    let pacer = Pacer::builder(Rate::per_second(RATE)?)
        .name("shaping")
        .build()?;
    let burst = pacer.quota().burst_size();
    // `producer.leaky_queue(pacer, capacity, overflow)` does the same; the builder also
    // takes a `usize` capacity (checked by `build`), a name and an `on_drop` hook.
    let shaped = LeakyQueue::builder(producer, pacer, BURST_ITEMS)
        .overflow(Overflow::Backpressure)
        .build()?;
    let mut shaped = pin!(shaped);

    let (mut input, mut output) = (Vec::<usize>::new(), Vec::<usize>::new());
    let mut max_queued = 0;
    while let Some(produced) = shaped.next().await {
        max_queued = max_queued.max(shaped.queued() + 1);
        let (i, o) = (bucket_of(produced), bucket_of(Instant::now()));
        let len = input.len().max(i + 1).max(o + 1);
        input.resize(len, 0);
        output.resize(len, 0);
        input[i] += 1;
        output[o] += 1;
    }
    let elapsed = start.elapsed();

    println!("{BURSTS} bursts of {BURST_ITEMS} items, {PERIOD:?} apart, shaped to {RATE}/s");
    println!("(pacer burst {burst}, queue of {BURST_ITEMS}, Overflow::Backpressure)\n");
    println!(
        "{:>7} {:>5} {:>4}  {:<w$}  out",
        "time",
        "in",
        "out",
        "in",
        w = IN_WIDTH + 1
    );
    let row = |b: usize| {
        let (i, o) = (input[b], output[b]);
        let cut = if i > IN_WIDTH { "»" } else { " " };
        let in_bar = format!("{}{cut}", "▒".repeat(i.min(IN_WIDTH)));
        let time = format!("{:.1} s", (BUCKET * b as u32).as_secs_f64());
        let out_bar = "█".repeat(o);
        let line = format!(
            "{time:>7} {i:>5} {o:>4}  {in_bar:<w$}  {out_bar}",
            w = IN_WIDTH + 1
        );
        println!("{}", line.trim_end());
    };
    let mut b = 0;
    while b < input.len() {
        row(b);
        let same = (b + 1..input.len())
            .take_while(|&c| (input[c], output[c]) == (input[b], output[b]))
            .count();
        if same > 1 {
            println!(
                "{:>7} {:>5} {:>4}  (× {same} more rows like this one)",
                "⋮", "", ""
            );
            b += same;
        }
        b += 1;
    }

    let (total_in, total_out): (usize, usize) = (input.iter().sum(), output.iter().sum());
    let peak_in = input.iter().max().copied().unwrap_or(0);
    let peak_out = output.iter().max().copied().unwrap_or(0);
    let per_bucket = f64::from(RATE) * BUCKET.as_secs_f64();
    println!(
        "\nin {total_in}, out {total_out}, dropped {}, in {elapsed:?} of virtual time",
        shaped.dropped()
    );
    println!(
        "peak per {BUCKET:?}: in {peak_in}, out {peak_out} (rate × {BUCKET:?} = {per_bucket}, \
         plus at most the burst of {burst} after a silence); queue peaked at {max_queued}"
    );
    Ok(())
}
