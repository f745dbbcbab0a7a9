//! The Lua scripts, one per algorithm, compiled in.

use std::time::Duration;

use crate::decision::Decision;
use crate::error::ConfigError;
use crate::gate::backend::{Backend, CallError, Latency, key_failure};
use crate::gate::error::GateError;
use crate::gate::limit::Limit;

/// Every script is `lua/prelude.lua` (the clock, TTLs under logical time, the batch loop)
/// followed by the script; the token bucket ones also get `lua/bucket_state.lua`, the region
/// ones `lua/region_lease.lua` (the lease record and its history).
macro_rules! script {
    ($($file:literal),+) => {
        concat!(include_str!("../../lua/prelude.lua"), $(include_str!(concat!("../../lua/", $file))),+)
    };
}

/// `lua/token_bucket.lua`: GCRA. One integer per request; read it with
/// [`token_bucket_reply`].
pub const TOKEN_BUCKET: &str = script!("bucket_state.lua", "token_bucket.lua");
/// `lua/fixed_window.lua`.
pub const FIXED_WINDOW: &str = script!("fixed_window.lua");
/// `lua/sliding_log.lua`.
pub const SLIDING_LOG: &str = script!("sliding_log.lua");
/// `lua/token_bucket_all.lua`: all-or-nothing across several token buckets.
pub const TOKEN_BUCKET_ALL: &str = script!("bucket_state.lua", "token_bucket_all.lua");
/// `lua/token_bucket_lease.lua`: take up to n tokens at once.
pub const TOKEN_BUCKET_LEASE: &str = script!("bucket_state.lua", "token_bucket_lease.lua");
/// `lua/sliding_window.lua`.
pub const SLIDING_WINDOW: &str = script!("sliding_window.lua");
/// `lua/region_home.lua`: the leases of a global quota in the home Redis.
pub const REGION_HOME: &str = script!("region_home.lua");
/// `lua/region_share.lua`: a region's lease record and demand counters, in its local Redis.
pub const REGION_SHARE: &str = script!("region_lease.lua", "region_share.lua");
/// `lua/region_bucket.lua`: a token bucket at the region's current share.
pub const REGION_BUCKET: &str = script!("region_lease.lua", "region_bucket.lua");

/// One of the crate's scripts: its source and its SHA1, hashed once. A call of it
/// ([`Script::call`]) carries it, so a Redis that lacks it can be sent its source (see
/// `backend::query`).
#[derive(Debug)]
pub(crate) struct Script {
    compiled: redis::Script,
    source: &'static str,
}

impl Script {
    fn new(source: &'static str) -> Script {
        Script {
            compiled: redis::Script::new(source),
            source,
        }
    }

    /// Its SHA1, as `EVALSHA` and `SCRIPT LOAD` name it.
    pub(crate) fn hash(&self) -> &str {
        self.compiled.get_hash()
    }

    /// `SCRIPT LOAD` it on `conn`.
    pub(crate) async fn load<C: redis::aio::ConnectionLike>(
        &self,
        conn: &mut C,
    ) -> redis::RedisResult<String> {
        self.compiled.load_async(conn).await
    }

    /// `EVALSHA <its sha1> <keys>`, to be followed by the keys and the arguments.
    pub(crate) fn call(&'static self, keys: usize) -> ScriptCall {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.hash()).arg(keys);
        ScriptCall { script: self, cmd }
    }
}

/// A call of one of the crate's scripts: `EVALSHA <sha1> <keys> <key>.. <arg>..`, built as
/// one [`redis::Cmd`] (one buffer for every argument, unlike `ScriptInvocation`, which
/// allocates each key and argument on its own and copies them again into a command). Only
/// keys and arguments are added to it, so it can be sent as `EVAL <source> ..` as well
/// ([`with_source`](ScriptCall::with_source)).
#[derive(Debug, Clone)]
pub(crate) struct ScriptCall {
    script: &'static Script,
    cmd: redis::Cmd,
}

impl ScriptCall {
    /// Add a key or an argument.
    pub(crate) fn arg<T: redis::ToRedisArgs>(&mut self, arg: T) -> &mut ScriptCall {
        self.cmd.arg(arg);
        self
    }

    /// The script it calls.
    pub(crate) fn script(&self) -> &'static Script {
        self.script
    }

    /// The call, by the script's SHA1.
    pub(crate) fn cmd(&self) -> &redis::Cmd {
        &self.cmd
    }

    /// The call with the script's source: `EVAL <source> <keys> ..`.
    pub(crate) fn with_source(&self) -> redis::Cmd {
        let mut eval = redis::cmd("EVAL");
        eval.arg(self.script.source);
        // After `EVALSHA <sha1>`; every argument is `Arg::Simple`, as `arg` adds them.
        for arg in self.cmd.args_iter().skip(2) {
            if let redis::Arg::Simple(arg) = arg {
                eval.arg(arg);
            }
        }
        eval
    }
}

/// `pub(crate) fn $name() -> &'static Script`: `$source`, hashed once.
macro_rules! compiled_once {
    ($($(#[$doc:meta])* $name:ident = $source:expr;)+) => {$(
        $(#[$doc])*
        pub(crate) fn $name() -> &'static Script {
            static SCRIPT: std::sync::OnceLock<Script> = std::sync::OnceLock::new();
            SCRIPT.get_or_init(|| Script::new($source))
        }
    )+};
}

compiled_once! {
    /// [`TOKEN_BUCKET`], compiled once.
    token_bucket = TOKEN_BUCKET;
    /// [`FIXED_WINDOW`], compiled once.
    fixed_window = FIXED_WINDOW;
    /// [`SLIDING_LOG`], compiled once.
    sliding_log = SLIDING_LOG;
    /// [`SLIDING_WINDOW`], compiled once.
    sliding_window = SLIDING_WINDOW;
    /// [`TOKEN_BUCKET_ALL`], compiled once.
    token_bucket_all = TOKEN_BUCKET_ALL;
    /// [`TOKEN_BUCKET_LEASE`], compiled once.
    token_bucket_lease = TOKEN_BUCKET_LEASE;
    /// [`REGION_HOME`], compiled once.
    region_home = REGION_HOME;
    /// [`REGION_SHARE`], compiled once.
    region_share = REGION_SHARE;
    /// [`REGION_BUCKET`], compiled once.
    region_bucket = REGION_BUCKET;
}

/// The script of `limit`.
fn script(limit: &Limit) -> &'static Script {
    match limit {
        Limit::TokenBucket(_) => token_bucket(),
        Limit::FixedWindow(_) => fixed_window(),
        Limit::SlidingLog(_) => sliding_log(),
        Limit::SlidingWindow(_) => sliding_window(),
    }
}

/// The script of one limit, with the limit's parameters as Redis gets them.
#[derive(Clone, Debug)]
pub(crate) struct LimitScript {
    pub(crate) script: &'static Script,
    pub(crate) limit: Limit,
    pub(crate) count: u64,
    pub(crate) period_us: u64,
}

impl LimitScript {
    /// # Errors
    ///
    /// [`ConfigError`] when `limit` cannot be computed exactly in Redis.
    pub(crate) fn new(limit: Limit) -> Result<LimitScript, ConfigError> {
        let (count, period_us) = limit.redis_params()?;
        Ok(LimitScript {
            script: script(&limit),
            limit,
            count,
            period_us,
        })
    }

    /// Add the arguments of a call to `cmd` (after its keys): the limit's parameters, an
    /// empty `now` (Redis `TIME` decides), then one cost per key.
    pub(crate) fn add_args(&self, cmd: &mut ScriptCall, costs: impl IntoIterator<Item = u32>) {
        cmd.arg(self.count).arg(self.period_us);
        if let Limit::TokenBucket(q) = self.limit {
            cmd.arg(q.burst_size());
        }
        cmd.arg("");
        for cost in costs {
            cmd.arg(cost);
        }
    }

    /// Decide `requests` (key, cost) in one `EVALSHA` through `backend`, within `within`.
    /// Each request gets its decision, or its key's own error; with the count of the
    /// backend's resets when the call was sent, and the call's latency, recorded when it is
    /// dropped (see [`Backend::eval_seen`]).
    pub(crate) async fn decide<'a, 'b, C, R>(
        &self,
        backend: &'b Backend<C>,
        requests: R,
        within: Duration,
    ) -> Result<(Vec<Result<Decision, GateError>>, u64, Latency<'b>), CallError>
    where
        C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
        R: Iterator<Item = (&'a str, u32)> + Clone,
    {
        let n = requests.clone().count();
        let mut cmd = self.script.call(n);
        for (key, _) in requests.clone() {
            cmd.arg(key);
        }
        self.add_args(&mut cmd, requests.clone().map(|(_, cost)| cost));
        let width = reply_width(&self.limit);
        let (v, seen, latency) = backend.eval_seen(&cmd, width * n, within).await?;
        let decided = requests
            .zip(v.chunks_exact(width))
            .map(|((_, cost), r)| match key_failure(r[0]) {
                Some(e) => Err(e),
                None => Ok(decode(&self.limit, self.count, self.period_us, cost, r)),
            })
            .collect();
        Ok((decided, seen, latency))
    }
}

/// How many integers the script of `limit` returns per request.
fn reply_width(limit: &Limit) -> usize {
    match limit {
        Limit::TokenBucket(_) => 1,
        _ => 5,
    }
}

/// One request's decision from its part of the script's reply (`reply_width` integers).
fn decode(limit: &Limit, count: u64, period_us: u64, cost: u32, r: &[i64]) -> Decision {
    match limit {
        Limit::TokenBucket(q) => token_bucket_reply(count, period_us, q.burst_size(), cost, r[0]),
        _ => decision_from(r),
    }
}

/// A reply of 5 integers (allowed, limit, remaining, retry_after_us, reset_after_us) as a
/// decision.
pub(crate) fn decision_from(r: &[i64]) -> Decision {
    let n = |i: usize| u64::try_from(r[i]).unwrap_or(0);
    let us = |i: usize| Duration::from_micros(n(i));
    if r[0] == 1 {
        Decision::allow(n(1), n(2), us(4))
    } else {
        Decision::reject(n(1), n(2), us(3), us(4))
    }
}

/// Read one request's reply of [`TOKEN_BUCKET`]: `value` is the bucket's fill after the
/// request if it was admitted (`>= 0`), or `-1 - fill` before it if it was rejected; `count`,
/// `period_us`, `burst` and `cost` are what the script was called with. Fill is measured in
/// units of 1/`count` µs, one token being `period_us` units; the arithmetic here is exact.
pub fn token_bucket_reply(
    count: u64,
    period_us: u64,
    burst: u32,
    cost: u32,
    value: i64,
) -> Decision {
    let count = u128::from(count.max(1));
    let period = u128::from(period_us.max(1));
    let tau = u128::from(burst) * period;
    let limit = u64::from(burst);
    let tokens = |units: u128| u64::try_from(units / period).unwrap_or(u64::MAX);
    let ceil_us = |units: u128| {
        Duration::from_micros(u64::try_from(units.div_ceil(count)).unwrap_or(u64::MAX))
    };
    match u128::try_from(value) {
        Ok(used_after) => Decision::allow(
            limit,
            tokens(tau.saturating_sub(used_after)),
            ceil_us(used_after),
        ),
        Err(_) => {
            let used = u128::from((-1 - value).unsigned_abs());
            let used_after = used + u128::from(cost) * period;
            // `used` exceeds `tau` only if the clock stepped back or a gate of a larger
            // burst wrote the state (a rolling deploy that lowered it): the bucket is full
            // again when all of it has passed, not after one full bucket.
            Decision::reject(
                limit,
                tokens(tau - used.min(tau)),
                ceil_us(used_after.saturating_sub(tau)),
                ceil_us(used),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(cmd: &redis::Cmd) -> Vec<Vec<u8>> {
        cmd.args_iter()
            .map(|arg| match arg {
                redis::Arg::Simple(arg) => arg.to_vec(),
                _ => b"<not simple>".to_vec(),
            })
            .collect()
    }

    /// The call with its source names the same keys and arguments, after `EVAL <source>`.
    #[test]
    fn a_call_with_its_source_keeps_its_keys_and_arguments() {
        let mut call = token_bucket_lease().call(1);
        call.arg("key")
            .arg(7_u64)
            .arg("")
            .arg(b"\xffbytes".as_slice());
        let by_hash = args(call.cmd());
        let by_source = args(&call.with_source());
        assert_eq!(
            by_hash[..2],
            [b"EVALSHA".to_vec(), token_bucket_lease().hash().into()]
        );
        assert_eq!(
            by_source[..2],
            [b"EVAL".to_vec(), TOKEN_BUCKET_LEASE.into()]
        );
        assert_eq!(by_hash[2..], by_source[2..]);
        assert_eq!(
            by_source[2..],
            [
                b"1".to_vec(),
                b"key".to_vec(),
                b"7".to_vec(),
                vec![],
                b"\xffbytes".to_vec()
            ]
        );
    }

    /// Each script of the registry is hashed from its own source.
    #[test]
    fn each_compiled_script_is_its_source() {
        for (script, source) in [
            (token_bucket(), TOKEN_BUCKET),
            (fixed_window(), FIXED_WINDOW),
            (sliding_log(), SLIDING_LOG),
            (sliding_window(), SLIDING_WINDOW),
            (token_bucket_all(), TOKEN_BUCKET_ALL),
            (token_bucket_lease(), TOKEN_BUCKET_LEASE),
            (region_home(), REGION_HOME),
            (region_share(), REGION_SHARE),
            (region_bucket(), REGION_BUCKET),
        ] {
            assert_eq!(script.source, source);
            assert_eq!(script.hash(), redis::Script::new(source).get_hash());
        }
    }
}
