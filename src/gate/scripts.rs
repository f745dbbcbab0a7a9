//! The Lua scripts, one per algorithm, compiled in.

use crate::gate::limit::Limit;

/// `lua/token_bucket.lua`: GCRA.
pub const TOKEN_BUCKET: &str = include_str!("../../lua/token_bucket.lua");
/// `lua/fixed_window.lua`.
pub const FIXED_WINDOW: &str = include_str!("../../lua/fixed_window.lua");
/// `lua/sliding_log.lua`.
pub const SLIDING_LOG: &str = include_str!("../../lua/sliding_log.lua");
/// `lua/token_bucket_all.lua`: all-or-nothing across several token buckets.
pub const TOKEN_BUCKET_ALL: &str = include_str!("../../lua/token_bucket_all.lua");
/// `lua/token_bucket_lease.lua`: take up to n tokens at once.
pub const TOKEN_BUCKET_LEASE: &str = include_str!("../../lua/token_bucket_lease.lua");
/// `lua/sliding_window.lua`.
pub const SLIDING_WINDOW: &str = include_str!("../../lua/sliding_window.lua");

/// The script source for `limit`.
pub(crate) fn source(limit: &Limit) -> &'static str {
    match limit {
        Limit::TokenBucket(_) => TOKEN_BUCKET,
        Limit::FixedWindow(_) => FIXED_WINDOW,
        Limit::SlidingLog(_) => SLIDING_LOG,
        Limit::SlidingWindow(_) => SLIDING_WINDOW,
    }
}

/// Add the arguments of a batch to `invocation`: the limit's parameters, an empty `now`
/// (Redis `TIME` decides), then one cost per key.
pub(crate) fn add_args(
    invocation: &mut redis::ScriptInvocation<'_>,
    limit: &Limit,
    count: u64,
    period_us: u64,
    costs: impl IntoIterator<Item = u32>,
) {
    invocation.arg(count).arg(period_us);
    if let Limit::TokenBucket(q) = limit {
        invocation.arg(q.burst_size());
    }
    invocation.arg("");
    for cost in costs {
        invocation.arg(cost);
    }
}
