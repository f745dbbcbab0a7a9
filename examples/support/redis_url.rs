//! The Redis an example was pointed at with `REDIS_URL`.

/// The client for `url` (the value of `REDIS_URL`); a value that is no Redis URL is bad
/// input, refused naming `REDIS_URL` with exit code 2 (no server would help it).
pub fn client(url: &str) -> redis::Client {
    redis::Client::open(url).unwrap_or_else(|e| {
        eprintln!(
            "REDIS_URL={url:?} is not a Redis URL ({e}): give one like redis://127.0.0.1:6379/"
        );
        std::process::exit(2);
    })
}
