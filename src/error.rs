//! The configuration error shared by every constructor.

use std::borrow::Cow;
use std::fmt;

/// What is wrong with a configuration value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ConfigErrorKind {
    /// The value is zero where at least one is needed.
    Zero,
    /// The value is larger than the component can represent or handle.
    TooLarge,
    /// The value contradicts another setting.
    Inconsistent,
}

/// A configuration value was rejected: zero, too large, or inconsistent with another.
///
/// Every fallible constructor in flowgate returns this error instead of panicking. It names
/// the offending field and says why it was rejected, so the message can be shown to an
/// operator as is.
///
/// # Examples
///
/// ```
/// use flowgate::{ConfigErrorKind, Rate};
///
/// let err = Rate::per_second(0).unwrap_err();
/// assert_eq!(err.field(), "rate.count");
/// assert_eq!(err.kind(), ConfigErrorKind::Zero);
/// assert_eq!(err.to_string(), "invalid rate.count: must be at least 1");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    field: &'static str,
    kind: ConfigErrorKind,
    reason: Cow<'static, str>,
}

impl ConfigError {
    pub(crate) fn new(
        field: &'static str,
        kind: ConfigErrorKind,
        reason: impl Into<Cow<'static, str>>,
    ) -> Self {
        Self {
            field,
            kind,
            reason: reason.into(),
        }
    }

    pub(crate) fn zero(field: &'static str) -> Self {
        Self::new(field, ConfigErrorKind::Zero, "must be at least 1")
    }

    /// The configuration field that was rejected, e.g. `"quota.burst"`.
    pub fn field(&self) -> &'static str {
        self.field
    }

    /// The class of problem.
    pub fn kind(&self) -> ConfigErrorKind {
        self.kind
    }

    /// Why the value was rejected, in words.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid {}: {}", self.field, self.reason)
    }
}

impl std::error::Error for ConfigError {}
