//! `TopRejected`: the most rejected keys in bounded memory (a Space-Saving sketch).

use std::collections::HashMap;
use std::fmt;
use std::sync::PoisonError;

use crate::error::{ConfigError, ConfigErrorKind};
use crate::sync::Mutex;

/// The most rejected keys, counted in bounded memory: a Space-Saving sketch (Metwally,
/// Agrawal and El Abbadi, "Efficient Computation of Frequent and Top-k Elements in Data
/// Streams", 2005).
///
/// The sketch keeps at most `k` keys (the capacity, default 64), each with a `count` and an
/// `error`. A key already kept adds one to its count. A new key, when the sketch is full,
/// takes the place of the key with the smallest count `m` and starts at `count = m + 1`,
/// `error = m`: it may have been seen up to `m` times before, while it was not kept. So for
/// every key reported by [`top`](Self::top):
///
/// - `count - error <= true count <= count`: `count - error` is a guaranteed lower bound,
///   `count` an upper bound;
/// - every key whose true count is above `total / k` ([`total`](Self::total) recorded
///   rejections) is kept, so a key that causes a large share of the rejections (the "sudden
///   spike from one key" abuse looks like) is always reported.
///
/// Memory is bounded: at most `k` keys of at most [`MAX_KEY_LEN`](Self::MAX_KEY_LEN) bytes
/// each (longer keys are cut at a character boundary, so keys that differ only beyond that
/// length are counted together). A key is never a metric label: read the sketch through
/// [`top`](Self::top) instead (unbounded label cardinality is what this avoids).
///
/// [`RateLimitLayer`](crate::http::RateLimitLayer) records every rejection here as
/// `<policy>:<key>`. The sketch is behind a [`Mutex`] held for one hash
/// lookup per recorded rejection (plus a scan of the `k` entries when a new key takes the
/// place of the smallest one); admitted requests never touch it.
///
/// # Examples
///
/// ```
/// use flowgate::http::TopRejected;
///
/// let top = TopRejected::new(2)?;
/// for key in ["a", "b", "a", "c", "a"] {
///     top.record(key);
/// }
/// let first = &top.top(1)[0];
/// assert_eq!(first.key, "a");
/// assert_eq!(first.count, 3);
/// assert!(first.count - first.error <= 3); // the guaranteed lower bound
/// assert_eq!(top.total(), 5);
/// # Ok::<(), flowgate::ConfigError>(())
/// ```
pub struct TopRejected {
    capacity: usize,
    sketch: Mutex<Sketch>,
}

/// The sketch's map: a fast, randomly seeded hasher (foldhash), as the gates use; the map
/// never holds more than the sketch's capacity, so a client choosing colliding keys can
/// slow a lookup by at most that many comparisons.
type Entries = HashMap<Box<str>, Counter, foldhash::fast::RandomState>;

struct Sketch {
    entries: Entries,
    total: u64,
}

impl Sketch {
    /// Empty, with room for `capacity` keys.
    fn with_capacity(capacity: usize) -> Sketch {
        Sketch {
            entries: Entries::with_capacity_and_hasher(capacity, Default::default()),
            total: 0,
        }
    }
}

#[derive(Clone, Copy)]
struct Counter {
    count: u64,
    error: u64,
}

/// One key reported by [`TopRejected::top`]: its count and how far that count may be over.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct RejectedKey {
    /// The key (as recorded, cut to [`TopRejected::MAX_KEY_LEN`] bytes).
    pub key: String,
    /// An upper bound on the rejections recorded for the key.
    pub count: u64,
    /// How much of `count` may belong to keys this one displaced: the true count is at least
    /// `count - error`.
    pub error: u64,
}

impl RejectedKey {
    /// The guaranteed lower bound on the key's rejections: `count - error`.
    #[must_use]
    pub fn lower_bound(&self) -> u64 {
        self.count - self.error
    }
}

impl TopRejected {
    /// The default capacity `k`: 64 keys.
    pub const DEFAULT_CAPACITY: usize = 64;
    /// The largest capacity accepted: a new key scans all `k` entries under the lock.
    pub const MAX_CAPACITY: usize = 4096;
    /// The longest key kept, in bytes; longer keys are cut at a character boundary.
    pub const MAX_KEY_LEN: usize = 256;

    /// A sketch that keeps the `capacity` (`k`) most rejected keys.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] for a capacity of 0 or above [`MAX_CAPACITY`](Self::MAX_CAPACITY).
    pub fn new(capacity: usize) -> Result<TopRejected, ConfigError> {
        if capacity == 0 {
            return Err(ConfigError::zero("top_rejected.capacity"));
        }
        if capacity > Self::MAX_CAPACITY {
            return Err(ConfigError::new(
                "top_rejected.capacity",
                ConfigErrorKind::TooLarge,
                format!(
                    "must be at most {} (a new key scans every entry)",
                    Self::MAX_CAPACITY
                ),
            ));
        }
        Ok(TopRejected {
            capacity,
            sketch: Mutex::new(Sketch::with_capacity(capacity)),
        })
    }

    /// The capacity `k`: the most keys kept.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Count one rejection of `key`.
    ///
    /// Allocates only when `key` is not kept yet (the new entry's copy of the key).
    pub fn record(&self, key: &str) {
        let key = cut(key);
        let mut sketch = self.sketch.lock().unwrap_or_else(PoisonError::into_inner);
        sketch.total += 1;
        if let Some(counter) = sketch.entries.get_mut(key) {
            counter.count += 1;
            return;
        }
        if sketch.entries.len() < self.capacity {
            sketch
                .entries
                .insert(key.into(), Counter { count: 1, error: 0 });
            return;
        }
        // Full: the new key takes the place of (one of) the smallest count `m`.
        let Some(m) = sketch.entries.values().map(|c| c.count).min() else {
            return;
        };
        // Dropping the iterator after the first match keeps every other entry.
        drop(sketch.entries.extract_if(|_, c| c.count == m).next());
        sketch.entries.insert(
            key.into(),
            Counter {
                count: m + 1,
                error: m,
            },
        );
    }

    /// The `n` keys with the highest counts, highest first (ties by key).
    ///
    /// Each count is an upper bound and `count - error` a lower bound on the key's recorded
    /// rejections (see the type's docs).
    #[must_use]
    pub fn top(&self, n: usize) -> Vec<RejectedKey> {
        let mut keys: Vec<RejectedKey> = {
            let sketch = self.sketch.lock().unwrap_or_else(PoisonError::into_inner);
            sketch
                .entries
                .iter()
                .map(|(key, c)| RejectedKey {
                    key: key.to_string(),
                    count: c.count,
                    error: c.error,
                })
                .collect()
        };
        keys.sort_unstable_by(|a, b| b.count.cmp(&a.count).then_with(|| a.key.cmp(&b.key)));
        keys.truncate(n);
        keys
    }

    /// How many rejections were recorded in all.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.sketch
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .total
    }

    /// How many keys are kept now (at most [`capacity`](Self::capacity)).
    #[must_use]
    pub fn len(&self) -> usize {
        self.sketch
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entries
            .len()
    }

    /// Whether no rejection was recorded yet (or since [`clear`](Self::clear)).
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forget every key and the total.
    pub fn clear(&self) {
        let mut sketch = self.sketch.lock().unwrap_or_else(PoisonError::into_inner);
        sketch.entries.clear();
        sketch.total = 0;
    }
}

impl Default for TopRejected {
    /// A sketch of [`DEFAULT_CAPACITY`](Self::DEFAULT_CAPACITY) keys.
    fn default() -> TopRejected {
        TopRejected {
            capacity: Self::DEFAULT_CAPACITY,
            sketch: Mutex::new(Sketch::with_capacity(Self::DEFAULT_CAPACITY)),
        }
    }
}

impl fmt::Debug for TopRejected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sketch = self.sketch.lock().unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("TopRejected")
            .field("capacity", &self.capacity)
            .field("len", &sketch.entries.len())
            .field("total", &sketch.total)
            .finish()
    }
}

/// `key` cut to at most `MAX_KEY_LEN` bytes, at a character boundary.
fn cut(key: &str) -> &str {
    if key.len() <= TopRejected::MAX_KEY_LEN {
        return key;
    }
    let mut end = TopRejected::MAX_KEY_LEN;
    while !key.is_char_boundary(end) {
        end -= 1;
    }
    &key[..end]
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    /// A skewed stream: key `i` (0..keys) appears about `weight / (i + 1)` times, shuffled
    /// deterministically, with a long tail of keys seen once.
    fn skewed_stream(keys: usize, weight: usize, tail: usize) -> Vec<String> {
        let mut stream = Vec::new();
        for i in 0..keys {
            for _ in 0..weight / (i + 1) {
                stream.push(format!("hot-{i}"));
            }
        }
        for i in 0..tail {
            stream.push(format!("tail-{i}"));
        }
        // A fixed pseudo-random shuffle (xorshift), so the test is deterministic.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for i in (1..stream.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let j = usize::try_from(x % (i as u64 + 1)).unwrap();
            stream.swap(i, j);
        }
        stream
    }

    #[test]
    fn skewed_stream_reports_the_true_top_within_bounds() {
        let stream = skewed_stream(8, 2000, 5000);
        let top = TopRejected::new(32).unwrap();
        let mut truth: HashMap<&str, u64> = HashMap::new();
        for key in &stream {
            top.record(key);
            *truth.entry(key).or_default() += 1;
        }
        assert_eq!(top.total(), stream.len() as u64);
        assert_eq!(top.len(), 32, "memory stays k entries");

        let reported = top.top(5);
        let names: Vec<&str> = reported.iter().map(|r| r.key.as_str()).collect();
        assert_eq!(names, ["hot-0", "hot-1", "hot-2", "hot-3", "hot-4"]);
        for r in &top.top(32) {
            let true_count = truth[r.key.as_str()];
            assert!(r.lower_bound() <= true_count, "{r:?} vs {true_count}");
            assert!(true_count <= r.count, "{r:?} vs {true_count}");
        }
    }

    #[test]
    fn new_key_when_full_takes_the_smallest_place() {
        let top = TopRejected::new(2).unwrap();
        top.record("a");
        top.record("a");
        top.record("b");
        top.record("c"); // replaces b (count 1): c = 2, error 1
        let got = top.top(10);
        assert_eq!(got.len(), 2);
        assert_eq!(
            got[0],
            RejectedKey {
                key: "a".into(),
                count: 2,
                error: 0
            }
        );
        assert_eq!(
            got[1],
            RejectedKey {
                key: "c".into(),
                count: 2,
                error: 1
            }
        );
        assert_eq!(got[1].lower_bound(), 1);
        top.clear();
        assert!(top.is_empty());
        assert_eq!(top.total(), 0);
    }

    #[test]
    fn capacity_is_validated() {
        assert_eq!(
            TopRejected::new(0).unwrap_err().kind(),
            ConfigErrorKind::Zero
        );
        assert_eq!(
            TopRejected::new(TopRejected::MAX_CAPACITY + 1)
                .unwrap_err()
                .kind(),
            ConfigErrorKind::TooLarge
        );
        assert_eq!(TopRejected::default().capacity(), 64);
    }

    #[test]
    fn long_keys_are_cut_at_a_char_boundary() {
        let top = TopRejected::new(4).unwrap();
        let long = "é".repeat(200); // 400 bytes
        top.record(&long);
        let got = top.top(1);
        assert!(got[0].key.len() <= TopRejected::MAX_KEY_LEN);
        assert!(long.starts_with(&got[0].key));
    }

    proptest! {
        /// Against an exact count: every reported key's true count lies in
        /// [count - error, count], the table never exceeds k, and any key above total/k is kept.
        #[test]
        fn bounds_hold_for_any_stream(
            k in 1usize..8,
            stream in proptest::collection::vec(0u8..20, 0..400),
        ) {
            let top = TopRejected::new(k).unwrap();
            let mut truth: HashMap<String, u64> = HashMap::new();
            for key in &stream {
                let key = key.to_string();
                top.record(&key);
                *truth.entry(key).or_default() += 1;
            }
            let reported = top.top(usize::MAX);
            prop_assert!(reported.len() <= k);
            prop_assert_eq!(reported.iter().map(|r| r.count).sum::<u64>(), stream.len() as u64);
            for r in &reported {
                let t = truth[&r.key];
                prop_assert!(r.lower_bound() <= t && t <= r.count);
            }
            let total = stream.len() as u64;
            for (key, t) in &truth {
                if *t * k as u64 > total {
                    prop_assert!(reported.iter().any(|r| &r.key == key), "{} ({}) missing", key, t);
                }
            }
        }
    }
}
