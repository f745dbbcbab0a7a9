//! A region's buckets against an exact token bucket along the region's share history: the
//! lease record (`lua/region_lease.lua`, written by the share script's `apply`) and the
//! bucket script (`lua/region_bucket.lua`) on explicit time, against one real Redis.
//!
//! The exact bucket of a key has existed since ever: it followed the shares the region held
//! (a lease's share from its apply until it expires, then the safe share; the region's first
//! lease since ever), refilled at each one's share and capped at each one's bucket, a
//! segment of no length included, and it pays for what the script admitted. The script may
//! hold less (the record keeps six past segments, older ones merged at the lower share),
//! never more.

use flowgate::gate::lua::{REGION_BUCKET, REGION_SHARE};

use crate::support::RedisServer;

/// The quota's period (µs): a token is this many units, at any share.
const PERIOD: u64 = 1_000_000;
/// The global rate the shares are parts of (tokens per period).
const CAPACITY: u64 = 20;
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

/// The lease the record holds.
#[derive(Clone, Copy, Debug)]
struct Lease {
    seq: u64,
    share: u64,
    tau: u64,
    expires: u64,
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
