//! [`BuildError`]: what [`RedisStreamSourceBuilder::build`](super::RedisStreamSourceBuilder::build)
//! reports.

use std::fmt;

use redis::RedisError;

use crate::error::ConfigError;

/// Why a [`RedisStreamSource`](super::RedisStreamSource) could not be built: a setting was
/// rejected (nothing was sent to Redis), or creating the consumer group failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum BuildError {
    /// A setting of the builder is zero, too large, or contradicts another one.
    Config(ConfigError),
    /// Redis refused to create the group (other than "it already exists"), or could not be
    /// reached.
    Redis(RedisError),
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BuildError::Config(e) => fmt::Display::fmt(e, f),
            BuildError::Redis(e) => write!(f, "cannot create the consumer group: {e}"),
        }
    }
}

impl std::error::Error for BuildError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            BuildError::Config(e) => Some(e),
            BuildError::Redis(e) => Some(e),
        }
    }
}

impl From<ConfigError> for BuildError {
    fn from(e: ConfigError) -> Self {
        BuildError::Config(e)
    }
}

impl From<RedisError> for BuildError {
    fn from(e: RedisError) -> Self {
        BuildError::Redis(e)
    }
}

impl BuildError {
    /// The rejected setting, if that is what went wrong.
    pub fn config(&self) -> Option<&ConfigError> {
        match self {
            BuildError::Config(e) => Some(e),
            BuildError::Redis(_) => None,
        }
    }
}
