//! Durations from builders, and waits computed from limits (a pacer's at a rate of one per
//! `u64::MAX` ns, a gate's `retry_after`): anything longer than [`FOREVER`] (such as
//! `Duration::MAX`, the natural way to say "never") is taken as `FOREVER`, so adding it to
//! an `Instant` cannot overflow and panic.

use std::time::Duration;

/// About a century: longer than any process lives, short enough to add to any `Instant`.
pub(crate) const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// `d`, at most [`FOREVER`].
pub(crate) fn capped(d: Duration) -> Duration {
    d.min(FOREVER)
}
