//! What a fetch yields: [`StreamEntry`] and its [`Origin`].

use std::collections::HashMap;

use redis::{FromRedisValue, RedisResult, Value};

use super::ack::Ack;

/// One stream entry, with its acknowledgement handle.
#[derive(Debug)]
#[non_exhaustive]
pub struct StreamEntry {
    /// The entry id, e.g. `1700000000000-0`.
    pub id: String,
    /// The entry's fields (empty if the entry was deleted while pending).
    pub fields: HashMap<String, Value>,
    /// How this entry reached this consumer.
    pub origin: Origin,
    /// Acknowledge it when done.
    pub ack: Ack,
}

impl StreamEntry {
    /// A field, converted.
    ///
    /// # Errors
    ///
    /// A Redis type error if the field is missing or does not convert.
    pub fn get<T: FromRedisValue>(&self, field: &str) -> RedisResult<T> {
        let value = self.fields.get(field).cloned().unwrap_or(Value::Nil);
        Ok(T::from_redis_value(value)?)
    }
}

/// How an entry reached this consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Origin {
    /// Delivered to this consumer earlier and never acknowledged (recovered at start).
    OwnPending,
    /// A new entry (`>`).
    New,
    /// Claimed after it was idle longer than `min_idle`: from a dead consumer, or one this
    /// consumer received and dropped without acknowledging.
    Claimed,
}
