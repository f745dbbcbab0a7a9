//! A region's buckets against an exact token bucket along the region's share history: the
//! lease record (`lua/region_lease.lua`, written by the share script's `apply`) and the
//! bucket script (`lua/region_bucket.lua`) on explicit time, against one real Redis.
//!
//! The exact bucket of a key has existed since ever: it followed the shares the region held
//! (a lease's share from its apply until it expires, then the safe share; the region's first
//! lease since ever), refilled at each one's share and capped at each one's bucket, a
//! segment of no length included, and it pays for what the script admitted. The script may
//! hold less (the record keeps six past segments; past that, two adjacent ones merged at the
//! lower share), never more.

use proptest::prelude::*;

use flowgate::gate::lua::{REGION_BUCKET, REGION_SHARE};

use crate::support::RedisServer;

/// The quota's period (µs): a token is this many units, at any share.
const PERIOD: u64 = 1_000_000;
/// The global rate the shares are parts of (tokens per period).
const CAPACITY: u64 = 20;
/// Past segments the record keeps (`HISTORY` in `lua/region_lease.lua`).
const HISTORY: usize = 6;
/// Keys checked in a case.
const KEYS: usize = 3;
/// An `expires` that never comes.
const NEVER: u64 = 1 << 50;

/// A case's fixed settings: the global burst (tokens) and the region's safe share.
#[derive(Clone, Copy, Debug)]
struct Setup {
    burst: u64,
    safe: u64,
}

impl Setup {
    /// The region's bucket at `share` (units): its part of the burst, at least one token; 0
    /// at share 0 (as `Plan::tau`).
    fn tau(&self, share: u64) -> u64 {
        if share == 0 {
            0
        } else {
            (self.burst * PERIOD * share / CAPACITY).max(PERIOD)
        }
    }
}

/// When an applied lease ends, from its apply.
#[derive(Clone, Copy, Debug)]
enum Ends {
    /// Already over: `expires` this many µs before the apply (0: at the apply).
    Ago(u64),
    In(u64),
    Never,
}

/// Which `seq` an apply carries.
#[derive(Clone, Copy, Debug)]
enum Seq {
    Next,
    /// The record's again (a renewal, or the same reply twice).
    Same,
    /// An older one (a late reply): refused.
    Older,
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Apply {
        share: u64,
        ends: Ends,
        seq: Seq,
        learning: bool,
    },
    Check {
        key: usize,
        cost: u64,
    },
}

fn ends() -> impl Strategy<Value = Ends> {
    prop_oneof![
        2 => (0..2 * PERIOD).prop_map(Ends::Ago),
        5 => (1..3 * PERIOD).prop_map(Ends::In),
        3 => Just(Ends::Never),
    ]
}

fn seq() -> impl Strategy<Value = Seq> {
    prop_oneof![8 => Just(Seq::Next), 2 => Just(Seq::Same), 1 => Just(Seq::Older)]
}

fn apply() -> impl Strategy<Value = Op> {
    (
        prop_oneof![1 => Just(0u64), 4 => 1..=CAPACITY],
        ends(),
        seq(),
        prop::bool::weighted(0.15),
    )
        .prop_map(|(share, ends, seq, learning)| Op::Apply {
            share,
            ends,
            seq,
            learning,
        })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => apply(),
        3 => (0..KEYS, 1u64..=3).prop_map(|(key, cost)| Op::Check { key, cost }),
    ]
}

/// Time between two operations (µs): sometimes none (two at the same instant).
fn step() -> impl Strategy<Value = u64> {
    prop_oneof![1 => Just(0u64), 6 => 1..PERIOD, 2 => PERIOD..4 * PERIOD]
}

fn cases() -> impl Strategy<Value = (Setup, Op, Vec<(u64, Op)>)> {
    (
        (1u64..=60, prop_oneof![1 => Just(0u64), 1 => 1u64..=4])
            .prop_map(|(burst, safe)| Setup { burst, safe }),
        apply(),
        prop::collection::vec((step(), op()), 1..40),
    )
}

/// The lease the record holds.
#[derive(Clone, Copy, Debug)]
struct Lease {
    seq: u64,
    share: u64,
    tau: u64,
    expires: u64,
}

/// The region's share history (every change, in order; the first since ever) and the exact
/// bucket of each key along it.
#[derive(Debug, Default)]
struct Model {
    /// (from, share, tau): the first applies since ever; two at one instant are a segment
    /// of no length.
    changes: Vec<(u64, u64, u64)>,
    /// When the lease in force ends, if it has not yet.
    ends: Option<u64>,
    held: Option<Lease>,
    /// Segments the record has pushed to its history (past `HISTORY` it merges).
    pushed: usize,
    /// Per key: (units held, changes seen, at).
    buckets: [Option<(u64, usize, u64)>; KEYS],
}

impl Model {
    /// The lease ran out by `now`: the safe share since.
    fn expire(&mut self, setup: &Setup, now: u64) {
        if let Some(end) = self.ends.filter(|&e| e <= now) {
            self.changes.push((end, setup.safe, setup.tau(setup.safe)));
            self.ends = None;
        }
    }

    /// The apply of `lease` at `now`, as the share script answers it.
    fn apply(&mut self, setup: &Setup, now: u64, mut lease: Lease, learning: bool) -> Vec<i64> {
        let held_seq = self.held.map_or(0, |h| h.seq);
        if lease.seq < held_seq {
            return vec![0, 0];
        }
        let live = self.held.filter(|h| now < h.expires);
        if learning {
            let (share, tau) =
                live.map_or((setup.safe, setup.tau(setup.safe)), |h| (h.share, h.tau));
            if share < lease.share {
                (lease.share, lease.tau) = (share, tau);
            }
        }
        match (self.held, live) {
            (None, _) => {}
            (Some(_), None) => self.pushed += 2,
            (Some(h), Some(_)) => {
                if (h.share, h.tau) != (lease.share, lease.tau) {
                    self.pushed += 1;
                }
            }
        }
        self.changes.push((now, lease.share, lease.tau));
        if lease.expires > now {
            self.ends = Some(lease.expires);
        } else {
            self.ends = None;
            self.changes.push((now, setup.safe, setup.tau(setup.safe)));
        }
        self.held = Some(lease);
        vec![1, lease.share as i64]
    }

    /// What the exact bucket of `key` holds at `now` (units), and the share and bucket size
    /// in force.
    fn refill(&mut self, key: usize, now: u64) -> (u64, u64, u64) {
        let (mut held, mut seen, mut at) = self.buckets[key].unwrap_or((self.changes[0].2, 1, 0));
        let (_, mut share, mut tau) = self.changes[seen - 1];
        for &(from, s, t) in &self.changes[seen..] {
            held = tau.min(held + share * (from.max(at) - at));
            at = at.max(from);
            (share, tau) = (s, t);
            held = held.min(tau);
        }
        seen = self.changes.len();
        held = tau.min(held + share * (now.max(at) - at));
        self.buckets[key] = Some((held, seen, now.max(at)));
        (held, share, tau)
    }

    fn spend(&mut self, key: usize, units: u64) {
        let b = self.buckets[key].as_mut().expect("refilled first");
        b.0 -= units;
    }
}

/// The share script's `apply` of `lease` at `now` (µs), as a region's refresher runs it.
fn apply_cmd(setup: &Setup, now: u64, lease: &Lease, learning: bool) -> redis::Cmd {
    let mut c = redis::cmd("EVAL");
    c.arg(REGION_SHARE).arg(3);
    for key in ["lease", "demand", "lock"] {
        c.arg(format!("{{h}}:{key}"));
    }
    c.arg("apply")
        .arg(now)
        .arg(lease.seq)
        .arg(lease.share)
        .arg(lease.tau)
        .arg(lease.expires)
        .arg(if learning { "1" } else { "0" })
        .arg(setup.safe)
        .arg(setup.tau(setup.safe))
        .arg(0);
    c
}

/// The bucket script at `now` (µs) for `key` and `cost` tokens.
fn check_cmd(setup: &Setup, now: u64, key: usize, cost: u64) -> redis::Cmd {
    let mut c = redis::cmd("EVAL");
    c.arg(REGION_BUCKET)
        .arg(3)
        .arg("{h}:lease")
        .arg("{h}:demand")
        .arg(format!("{{h}}:bucket:{key}"));
    c.arg(now)
        .arg(cost)
        .arg(PERIOD)
        .arg(setup.safe)
        .arg(setup.tau(setup.safe))
        .arg(PERIOD)
        // Kept a minute of real time: the case is over long before.
        .arg(60_000);
    c
}

/// How one case went: checks, those the script rejected while the exact bucket held
/// enough, the largest difference seen (tokens), whether the record merged segments.
#[derive(Debug, Default)]
struct Outcome {
    checks: u64,
    misses: u64,
    gap: u64,
    merged: bool,
}

/// Run one case against the scripts; `Err` names the first check the script decided with
/// more tokens than the exact bucket held.
fn run(
    con: &mut redis::Connection,
    setup: &Setup,
    first: Op,
    ops: &[(u64, Op)],
) -> Result<Outcome, String> {
    let keys: Vec<String> = ["lease", "demand", "lock"]
        .iter()
        .map(|k| format!("{{h}}:{k}"))
        .chain((0..KEYS).map(|k| format!("{{h}}:bucket:{k}")))
        .collect();
    let _: () = redis::cmd("DEL").arg(&keys).query(con).unwrap();
    let mut model = Model::default();
    let mut out = Outcome::default();
    let mut now = 10 * PERIOD;
    let mut last_seq = 0u64;
    for (i, &(dt, op)) in std::iter::once(&(0, first)).chain(ops).enumerate() {
        now += dt;
        model.expire(setup, now);
        match op {
            Op::Apply {
                share,
                ends,
                seq,
                learning,
            } => {
                let seq = match seq {
                    Seq::Next => last_seq + 1,
                    Seq::Same => last_seq,
                    Seq::Older => last_seq.saturating_sub(1),
                };
                last_seq = last_seq.max(seq);
                let expires = match ends {
                    Ends::Ago(d) => now.saturating_sub(d),
                    Ends::In(d) => now + d,
                    Ends::Never => NEVER,
                };
                let lease = Lease {
                    seq,
                    share,
                    tau: setup.tau(share),
                    expires,
                };
                let v: Vec<i64> = apply_cmd(setup, now, &lease, learning).query(con).unwrap();
                let want = model.apply(setup, now, lease, learning);
                if v != want {
                    return Err(format!(
                        "op {i} at {now}: apply {lease:?} answered {v:?}, not {want:?}"
                    ));
                }
            }
            Op::Check { key, cost } => {
                let v: Vec<i64> = check_cmd(setup, now, key, cost).query(con).unwrap();
                let (held, share, tau) = model.refill(key, now);
                let need = cost * PERIOD;
                let fits = share > 0 && held >= need;
                let allowed = v[0] == 1;
                if allowed && !fits {
                    return Err(format!(
                        "op {i} at {now}: key {key} admitted {cost} with {held} units in the exact bucket (share {share}, tau {tau}): {v:?}"
                    ));
                }
                if allowed {
                    model.spend(key, need);
                }
                let exact = if allowed { held - need } else { held } / PERIOD;
                // What the script says the bucket holds, when it says it.
                let remaining = u64::try_from(v[2]).unwrap();
                if share > 0 && need <= tau {
                    if remaining > exact {
                        return Err(format!(
                            "op {i} at {now}: key {key} holds {remaining} tokens, the exact bucket {exact} (share {share}, tau {tau}): {v:?}"
                        ));
                    }
                    out.gap = out.gap.max(exact - remaining);
                }
                out.checks += 1;
                out.misses += u64::from(fits && !allowed);
            }
        }
        out.merged |= model.pushed > HISTORY;
    }
    Ok(out)
}

/// The bucket script never holds more than the exact bucket along the region's share
/// history, whatever the leases (share 0, leases that run out or come already over,
/// renewals, late and repeated replies, learning grants) and the times of the checks; and
/// as long as the record has not merged past segments, it holds exactly as much.
#[test]
fn a_region_bucket_never_holds_more_than_the_exact_bucket_along_its_shares() {
    let server = RedisServer::start();
    let con = std::cell::RefCell::new(server.client().get_connection().expect("connect"));
    let totals = std::cell::RefCell::new((0u64, 0u64, 0u64, 0u64));
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(64));
    runner
        .run(&cases(), |(setup, first, ops)| {
            let out =
                run(&mut con.borrow_mut(), &setup, first, &ops).map_err(TestCaseError::fail)?;
            if !out.merged {
                prop_assert_eq!(out.misses, 0, "conservative without a merge: {:?}", out);
                prop_assert_eq!(out.gap, 0, "conservative without a merge: {:?}", out);
            }
            let mut t = totals.borrow_mut();
            t.0 += out.checks;
            t.1 += out.misses;
            t.2 = t.2.max(out.gap);
            t.3 += u64::from(out.merged);
            Ok(())
        })
        .unwrap();
    let (checks, misses, gap, merged) = totals.into_inner();
    println!(
        "{checks} checks: {misses} rejected while the exact bucket held enough (cases with merged segments: {merged}), at most {gap} tokens below it"
    );
}

/// Run `cmds` in order on `con`, each answered by a list of integers.
fn answers(con: &mut redis::Connection, cmds: &[redis::Cmd]) -> Vec<Vec<i64>> {
    cmds.iter().map(|c| c.query(con).unwrap()).collect()
}

/// A lease `seq` at `share` (bucket `setup.tau(share)`) ending at `expires`.
fn lease(setup: &Setup, seq: u64, share: u64, expires: u64) -> Lease {
    Lease {
        seq,
        share,
        tau: setup.tau(share),
        expires,
    }
}

/// Found by this module's proptest: a renewal that is already over when it lands (its reply
/// took longer than the lease had left) ends when it lands, not at its `expires`: the lease
/// before it was in force until then. Refilled at the safe share from its `expires` on, the
/// bucket gained the safe share over time the region spent at its lease.
#[test]
fn a_lease_already_over_when_it_lands_ends_when_it_lands() {
    let server = RedisServer::start();
    let mut con = server.client().get_connection().expect("connect");
    // A bucket of `share` tokens at each share; a safe share of 5.
    let setup = Setup { burst: 20, safe: 5 };
    let v = answers(
        &mut con,
        &[
            apply_cmd(&setup, PERIOD, &lease(&setup, 1, 1, NEVER), false),
            check_cmd(&setup, PERIOD, 0, 1),
            // The renewal at the same share lands at 2 s; it ended at 1.5 s.
            apply_cmd(
                &setup,
                2 * PERIOD,
                &lease(&setup, 2, 1, PERIOD * 3 / 2),
                false,
            ),
            check_cmd(&setup, 2 * PERIOD + PERIOD / 10, 0, 2),
            check_cmd(&setup, 2 * PERIOD + PERIOD / 10, 0, 1),
        ],
    );
    assert_eq!((v[1][0], v[2].as_slice()), (1, &[1, 1][..]), "{v:?}");
    // 1 token refilled at share 1 until 2 s, 0.5 at the safe share since: not 3.5.
    assert_eq!(
        v[3][0], 0,
        "refilled at the safe share before it applied: {v:?}"
    );
    assert_eq!(v[4][0], 1, "{v:?}");
}

/// Found by this module's proptest: a share that dipped (to 0) for no time at the very instant
/// a bucket was written empties it all the same, as a check just after the dip would have.
/// The bucket, written at the share in force again after the dip, is not found as it was.
#[test]
fn a_dip_of_no_length_at_the_instant_a_bucket_was_written_empties_it() {
    let server = RedisServer::start();
    let mut con = server.client().get_connection().expect("connect");
    let setup = Setup { burst: 20, safe: 0 };
    let v = answers(
        &mut con,
        &[
            apply_cmd(&setup, PERIOD, &lease(&setup, 1, 5, NEVER), false),
            check_cmd(&setup, 2 * PERIOD, 0, 1),
            apply_cmd(&setup, 2 * PERIOD, &lease(&setup, 2, 0, NEVER), false),
            apply_cmd(&setup, 2 * PERIOD, &lease(&setup, 3, 5, NEVER), false),
            check_cmd(&setup, 2 * PERIOD + PERIOD / 10, 0, 1),
            check_cmd(&setup, 2 * PERIOD + PERIOD / 5, 0, 1),
        ],
    );
    assert_eq!(v[1][0], 1, "{v:?}");
    // Half a token refilled since the dip, not the 4 left before it.
    assert_eq!(v[4][0], 0, "the tokens outlived the dip: {v:?}");
    assert_eq!(v[5][0], 1, "refilled since the dip: {v:?}");
}

/// A record of 4 doubles, as the refresher of a version without a history writes it (in a
/// rolling deploy): `seq`, `share`, its bucket, and an `expires` that never comes.
fn old_record(setup: &Setup, seq: u64, share: u64) -> redis::Cmd {
    let record: Vec<u8> = [seq, share, setup.tau(share), NEVER]
        .iter()
        .flat_map(|&x| (x as f64).to_le_bytes())
        .collect();
    let mut c = redis::cmd("SET");
    c.arg("{h}:lease").arg(record);
    c
}

/// A record of 4 doubles does not say since when its share applies. A bucket written before
/// the share changed to it is refilled as that version did, at the lower of its own share and
/// the record's, at most its own size, until the share changes again; it does not take the
/// record's share for one held since ever (a bucket of 1 token refilled at 20 per second for
/// the whole gap).
#[test]
fn a_bucket_under_a_record_of_four_doubles_is_refilled_at_the_lower_share() {
    let server = RedisServer::start();
    let mut con = server.client().get_connection().expect("connect");
    let setup = Setup { burst: 20, safe: 0 };
    let _: () = old_record(&setup, 1, 1).query(&mut con).unwrap();
    let v = answers(
        &mut con,
        &[
            check_cmd(&setup, PERIOD, 0, 1),
            check_cmd(&setup, PERIOD, 1, 1),
        ],
    );
    assert_eq!((v[0][0], v[1][0]), (1, 1), "{v:?}");
    // Some time after 1 s (when, the record does not say): share 20, 20 tokens.
    let _: () = old_record(&setup, 2, 20).query(&mut con).unwrap();
    let v = answers(
        &mut con,
        &[
            check_cmd(&setup, 2 * PERIOD, 0, 2),
            check_cmd(&setup, 2 * PERIOD, 0, 1),
            // This version's refresher takes over: share 10 from 2.5 s.
            apply_cmd(&setup, PERIOD * 5 / 2, &lease(&setup, 3, 10, NEVER), false),
            check_cmd(&setup, PERIOD * 26 / 10, 1, 3),
            check_cmd(&setup, PERIOD * 26 / 10, 1, 2),
        ],
    );
    // The share may have changed at 1.95 s: 0.95 + 1 tokens at 2 s, not 20.
    assert_eq!(v[0][0], 0, "refilled at 20 per second since 1 s: {v:?}");
    assert_eq!(v[1][0], 1, "the token refilled at share 1: {v:?}");
    // The record's share may have come just before 2.5 s: 1 token then (as above), and 1
    // at share 10 since; not 10.
    assert_eq!(v[2], [1, 10], "{v:?}");
    assert_eq!(v[3][0], 0, "refilled at 20 per second until 2.5 s: {v:?}");
    assert_eq!(v[4][0], 1, "{v:?}");
}
