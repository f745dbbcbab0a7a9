//! `FailurePolicy`: what a `RedisGate` does while Redis fails.

use std::time::Duration;

use crate::decision::Decision;
use crate::gate::backend::CallError;
use crate::gate::error::GateError;
use crate::gate::memory::MemoryGate;

/// What a [`RedisGate`](super::RedisGate) does when Redis fails or does not answer within the
/// timeout.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Return the error to the caller: [`GateError::Backend`] or [`GateError::Timeout`] from
    /// the call that met the failure (or a probe's), [`GateError::Degraded`] (with the time
    /// until the next probe) from the calls made while the gate waits to probe again.
    #[default]
    Error,
    /// Admit everything (availability over the limit).
    Open,
    /// Reject everything, with `retry_after` = the time until the next probe of Redis
    /// ([`Decision::fail_closed`]: `capacity` is `u64::MAX`, as no quota stands behind it).
    Closed,
    /// Decide locally with this in-memory gate (each instance then enforces the limit on its
    /// own: the fleet may admit up to instances × limit while Redis is away).
    Fallback(MemoryGate),
}

impl FailurePolicy {
    /// The answer for `key` and `cost` while Redis is failing (`error`: what it said, if this
    /// call asked it) and the next probe is `until_probe` away.
    pub(crate) fn decide(
        &self,
        key: &str,
        cost: u32,
        until_probe: Duration,
        error: Option<GateError>,
    ) -> Result<Decision, GateError> {
        match self {
            FailurePolicy::Error => Err(CallError::error(error, until_probe)),
            FailurePolicy::Open => Ok(Decision::fail_open()),
            FailurePolicy::Closed => Ok(Decision::fail_closed(until_probe)),
            FailurePolicy::Fallback(gate) => gate.check(key, cost),
        }
    }

    pub(crate) fn as_str(&self) -> &'static str {
        match self {
            FailurePolicy::Error => "error",
            FailurePolicy::Open => "open",
            FailurePolicy::Closed => "closed",
            FailurePolicy::Fallback(_) => "fallback",
        }
    }
}
