//! `Levels`: the validated `(high, low)` pair of [`prefetch`](super::prefetch()) and
//! [`watermarks`](crate::FlowStreamExt::watermarks).

use crate::error::{ConfigError, ConfigErrorKind};

/// A high and a low level, `high ≥ 1` and `low < high`: the hysteresis of demand.
///
/// The same value configures both places that take one:
///
/// - [`prefetch`](super::prefetch()): keep at most `high` items buffered, fetch again when the
///   buffer falls to `low`;
/// - [`watermarks`](crate::FlowStreamExt::watermarks): pause at `high` items in flight,
///   resume at `low`.
///
/// It is checked once, here, so the adapters that take it cannot fail.
///
/// # Examples
///
/// ```
/// use flowgate::demand::Levels;
///
/// let levels = Levels::new(256, 64)?;
/// assert_eq!((levels.high(), levels.low()), (256, 64));
/// assert_eq!(Levels::new(0, 0).unwrap_err().field(), "levels.high");
/// assert_eq!(Levels::new(4, 4).unwrap_err().field(), "levels.low");
/// # Ok::<(), flowgate::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Levels {
    high: usize,
    low: usize,
}

impl Levels {
    /// `high` and `low`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] on `levels.high` if it is zero, on `levels.low` if it is not below
    /// `high`.
    pub fn new(high: usize, low: usize) -> Result<Levels, ConfigError> {
        if high == 0 {
            return Err(ConfigError::zero("levels.high"));
        }
        if low >= high {
            return Err(ConfigError::new(
                "levels.low",
                ConfigErrorKind::Inconsistent,
                format!("{low} must be below high ({high})"),
            ));
        }
        Ok(Levels { high, low })
    }

    /// The high level (at least 1).
    pub fn high(&self) -> usize {
        self.high
    }

    /// The low level (below [`high`](Levels::high)).
    pub fn low(&self) -> usize {
        self.low
    }
}
