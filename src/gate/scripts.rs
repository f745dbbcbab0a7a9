//! The Lua scripts, one per algorithm, compiled in.

use crate::gate::limit::Limit;

/// `lua/token_bucket.lua`: GCRA.
pub const TOKEN_BUCKET: &str = include_str!("../../lua/token_bucket.lua");
/// `lua/fixed_window.lua`.
pub const FIXED_WINDOW: &str = include_str!("../../lua/fixed_window.lua");
/// `lua/sliding_log.lua`.
pub const SLIDING_LOG: &str = include_str!("../../lua/sliding_log.lua");
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

/// The script arguments for `limit` and `cost`, with an empty `now` (Redis `TIME` decides).
pub(crate) fn args(limit: &Limit, count: u64, period_us: u64, cost: u32) -> Vec<u64> {
    match limit {
        Limit::TokenBucket(q) => vec![count, period_us, u64::from(q.burst_size()), u64::from(cost)],
        _ => vec![count, period_us, u64::from(cost)],
    }
}
