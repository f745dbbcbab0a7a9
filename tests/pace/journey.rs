//! The journey of a team pacing its calls to a fragile downstream: a bursty producer
//! (bursts of up to 20 items, idle spells of up to three hours) behind `leaky_with`, over
//! hours of paused time, at 1/s, 7/s, 3 per 7 s and 1 000/s, with the default burst and
//! odd ones, and with the quota changed at run time. Every release is checked against an
//! exact GCRA model on the timer's 1 ms tick (no drift, no burst beyond the configured one
//! after an idle spell, no unit lost to rounding), and every window against guarantee (a).

use super::*;

/// A small deterministic generator (an LCG's high bits).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }
}

/// When each of `n` items is produced (ns, on whole milliseconds): bursts of 1 to 20 at
/// once, apart by nothing, by up to `max_gap_ms`, or (one gap in ten) by up to three hours.
fn arrivals(seed: u64, n: usize, max_gap_ms: u64) -> Vec<u64> {
    let mut r = Lcg(seed);
    let (mut t, mut out) = (0u64, Vec::with_capacity(n));
    while out.len() < n {
        let gap_ms = match r.next() % 10 {
            0 => r.next() % (3 * 3_600_000),
            1..=3 => 0,
            _ => r.next() % max_gap_ms,
        };
        t += gap_ms * 1_000_000;
        out.extend(std::iter::repeat_n(t, 1 + (r.next() % 20) as usize));
    }
    out.truncate(n);
    out
}

/// A quota's GCRA in the pacer's exact units (`1 / scale` ns; a token is `unit` of them).
#[derive(Clone, Copy)]
struct Model {
    scale: i128,
    unit: i128,
    tau: i128,
}

impl Model {
    fn of(quota: Quota) -> Model {
        let (n, p) = (
            i128::from(quota.rate().count()),
            i128::from(quota.rate().period_nanos()),
        );
        let g = (1..=n.min(p))
            .rev()
            .find(|&d| n % d == 0 && p % d == 0)
            .unwrap_or(1);
        let (scale, unit) = (n / g, p / g);
        Model {
            scale,
            unit,
            tau: i128::from(quota.burst_size()) * unit,
        }
    }
}

/// When each item leaves a `leaky_with` stream fed at `arrivals` through a pacer of
/// `quotas[0]`, the pacer given `quotas[q]` right after item `k` leaves for each `(k, q)`
/// of `changes`: (what it did, what the model says).
async fn walk(
    quotas: &[Quota],
    changes: &[(usize, usize)],
    arrivals: &[u64],
) -> (Vec<u64>, Vec<u64>) {
    let q0 = quotas[0];
    let pacer = Pacer::builder(q0.rate())
        .burst(q0.burst_size())
        .build()
        .unwrap();
    let start = Instant::now();
    let (tx, rx) = futures::channel::mpsc::unbounded::<u64>();
    let at = arrivals.to_vec();
    let producer = tokio::spawn(async move {
        for a in at {
            tokio::time::sleep_until(start + Duration::from_nanos(a)).await;
            tx.unbounded_send(a).unwrap();
        }
    });
    let shared = pacer.clone();
    let mut k = 0;
    let got: Vec<u64> = rx
        .leaky_with(pacer)
        .map(|_| {
            let t = start.elapsed().as_nanos() as u64;
            for &(_, q) in changes.iter().filter(|&&(at, _)| at == k) {
                shared.set_quota(quotas[q]);
            }
            k += 1;
            t
        })
        .collect()
        .await;
    producer.await.unwrap();

    // The model: an item polled at `t` passes if the bucket holds a unit, else on the
    // first tick at or after its due time; a change carries the next unit's due time.
    let (mut m, mut tat, mut prev) = (Model::of(q0), 0i128, 0u64);
    let mut want = Vec::with_capacity(arrivals.len());
    for (k, &a) in arrivals.iter().enumerate() {
        let t = a.max(prev);
        let now = i128::from(t) * m.scale;
        let after = tat.max(now) + m.unit;
        let left = if after - now <= m.tau {
            t
        } else {
            let due_ns = (after - m.tau).div_euclid(m.scale)
                + i128::from((after - m.tau).rem_euclid(m.scale) != 0);
            u64::try_from(due_ns.div_ceil_tick()).unwrap()
        };
        tat = tat.max(i128::from(left) * m.scale) + m.unit;
        want.push(left);
        prev = left;
        for &(_, q) in changes.iter().filter(|&&(at, _)| at == k) {
            let new = Model::of(quotas[q]);
            let next = (tat - (m.tau - m.unit)) * new.scale;
            let at = next.div_euclid(m.scale) + i128::from(next.rem_euclid(m.scale) != 0);
            tat = (at + new.tau - new.unit).max(0);
            m = new;
        }
    }
    (got, want)
}

trait Tick {
    fn div_ceil_tick(self) -> i128;
}

impl Tick for i128 {
    /// Rounded up to the timer's 1 ms tick.
    fn div_ceil_tick(self) -> i128 {
        (self + 999_999).div_euclid(1_000_000) * 1_000_000
    }
}

/// Guarantee (a), exactly: in every window `[t_i, t_j]`, `j − i + 1 ≤ burst + rate·w`.
/// With `f(k) = k·p − n·t_k`, the worst window ending at `j` starts at the `i` of least
/// `f(i)`: one pass.
fn bound_holds(quota: Quota, released: &[u64]) -> Result<(), String> {
    let (n, p) = (
        i128::from(quota.rate().count()),
        i128::from(quota.rate().period_nanos()),
    );
    let b = i128::from(quota.burst_size());
    let mut least = i128::MAX;
    for (j, &t) in released.iter().enumerate() {
        let f = j as i128 * p - n * i128::from(t);
        least = least.min(f);
        if f - least + p > b * p {
            return Err(format!(
                "a window ending with item {j} at {t} ns passes the bound"
            ));
        }
    }
    Ok(())
}

async fn exact(quota: Quota, seed: u64, n: usize, max_gap_ms: u64) {
    let arrivals = arrivals(seed, n, max_gap_ms);
    let (got, want) = walk(&[quota], &[], &arrivals).await;
    assert_eq!(got.len(), n, "{quota:?}: every item leaves");
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "{quota:?}: item {k}, produced at {} ns", arrivals[k]);
    }
    bound_holds(quota, &got).unwrap_or_else(|e| panic!("{quota:?}: {e}"));
    let span = Duration::from_nanos(*got.last().unwrap());
    assert!(
        span > Duration::from_secs(3_600),
        "{quota:?}: hours walked, {span:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn every_release_is_on_the_model_at_the_default_burst() {
    let default = |rate| Pacer::default_quota(rate);
    exact(default(Rate::per_second(1).unwrap()), 1, 3_000, 3_000).await;
    exact(default(Rate::per_second(7).unwrap()), 2, 20_000, 500).await;
    let three_per_seven = Rate::per(3, Duration::from_secs(7)).unwrap();
    exact(default(three_per_seven), 3, 3_000, 10_000).await;
    exact(default(Rate::per_second(1_000).unwrap()), 4, 30_000, 30).await;
}

#[tokio::test(start_paused = true)]
async fn every_release_is_on_the_model_at_odd_bursts() {
    let three_per_seven = Rate::per(3, Duration::from_secs(7)).unwrap();
    for (i, burst) in [1u32, 2, 3, 17].into_iter().enumerate() {
        let seed = 10 + 2 * i as u64;
        let seven = Quota::per_second(7).unwrap().burst(burst).unwrap();
        exact(seven, seed, 3_000, 700).await;
        let slow = Quota::new(three_per_seven, burst).unwrap();
        exact(slow, seed + 1, 500, 5_000).await;
    }
}

/// The quota changed 1 time in 40 after a release, among six (rates that do and do not
/// divide a nanosecond, bursts of 1 to 6): every release is where the model, which carries
/// the next unit's due time over each change, says.
#[tokio::test(start_paused = true)]
async fn every_release_is_on_the_model_across_quota_changes() {
    let quotas = [
        Pacer::default_quota(Rate::per_second(7).unwrap()),
        Pacer::default_quota(Rate::per(3, Duration::from_secs(7)).unwrap()),
        Pacer::default_quota(Rate::per_second(1_000).unwrap()),
        Quota::per_second(1).unwrap().burst(5).unwrap(),
        Pacer::default_quota(Rate::per_second(997).unwrap()),
        Quota::per_second(13).unwrap().burst(1).unwrap(),
    ];
    let arrivals = arrivals(77, 4_000, 400);
    let mut r = Lcg(99);
    let changes: Vec<(usize, usize)> = (0..arrivals.len())
        .map(|k| (k, (r.next() % 40) as usize))
        .filter(|&(_, q)| q < quotas.len())
        .collect();
    assert!(changes.len() > 100);
    let (got, want) = walk(&quotas, &changes, &arrivals).await;
    assert_eq!(got, want);
}
