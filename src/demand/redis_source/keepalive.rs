//! The source's background task: sends queued acks, keeps held entries from going idle.

use std::time::Duration;

use redis::RedisResult;
use redis::aio::ConnectionLike;
use tokio::time::Instant;

use super::ack::AckQueue;
use super::builder::Config;
use crate::sync::Arc;

/// `lua/stream_keepalive.lua`: resets the idle time of entries this consumer still owns.
const KEEPALIVE: &str = include_str!("../../../lua/stream_keepalive.lua");

/// Ids per keep-alive script call, so one call never blocks Redis for long.
const KEEPALIVE_CHUNK: usize = 500;

/// The source's background task, on the tokio runtime it was built on:
///
/// - sends the queued acks `ack_interval` after the first one since the last send, or
///   sooner when the keep-alive is due;
/// - every `min_idle / 3`, resets the idle time of the entries the application still holds
///   (`lua/stream_keepalive.lua`), so other consumers claim only entries of consumers that
///   stopped, or entries dropped without an ack;
///
/// until the source and every [`Ack`](super::Ack) are gone and nothing is left to send. A
/// failed send is retried after the next interval while any handle is alive and the group
/// it was meant for is not lost; after that, the entries stay pending and are redelivered
/// (at-least-once). While the group is missing, `XACK` answers 0 (those acks count as
/// stale, not acked) and the keep-alive script fails: both are harmless, and the fetch path
/// re-creates the group.
pub(super) async fn keep_in_background<C: ConnectionLike>(
    queue: Arc<AckQueue>,
    mut conn: C,
    cfg: Arc<Config>,
) {
    let keepalive = redis::Script::new(KEEPALIVE);
    let every = (cfg.min_idle / 3).max(Duration::from_millis(1));
    let mut next_touch = Instant::now() + every;
    loop {
        let (idle, gone) = {
            let st = queue.lock();
            (st.ids.is_empty(), st.handles == 0)
        };
        if idle && gone {
            return;
        }
        if idle {
            // `notify_one` keeps a permit: a wake between the check and here is not lost.
            tokio::select! {
                () = queue.wake.notified() => {}
                () = tokio::time::sleep_until(next_touch) => {}
            }
        } else {
            // Not later than the keep-alive: an entry acknowledged but not sent is no longer
            // touched, and must not go idle and be claimed by another consumer; nor may the
            // wait hold up the keep-alive of the entries still held.
            tokio::time::sleep_until((Instant::now() + cfg.ack_interval).min(next_touch)).await;
            // Failed, the ids are queued again: retried after the next interval, unless
            // no handle is left to wait for.
            if queue.send(&mut conn, &cfg).await.is_err() && queue.lock().handles == 0 {
                return;
            }
        }
        if Instant::now() >= next_touch {
            let held: Vec<String> = queue.lock().held.iter().cloned().collect();
            touch(&keepalive, &mut conn, &cfg, &held).await;
            next_touch = Instant::now() + every;
        }
    }
}

/// Resets the idle time of the `held` entries this consumer still owns, in one round trip:
/// the calls of every chunk go in one pipeline, so a read the source sends meanwhile on the
/// same connection holds up the whole keep-alive once (up to `block`), never once per chunk
/// (which let the entries of the later chunks go idle past `min_idle` while held).
///
/// A failed keep-alive is harmless: the next one comes `min_idle / 3` later, and at worst
/// an entry is claimed by another consumer (at-least-once).
async fn touch<C: ConnectionLike>(
    keepalive: &redis::Script,
    conn: &mut C,
    cfg: &Config,
    held: &[String],
) {
    if held.is_empty() {
        return;
    }
    let mut pipe = redis::pipe();
    // A pipelined call does not load a script Redis lacks (restarted, `SCRIPT FLUSH`): it
    // is loaded first, in the same round trip.
    pipe.cmd("SCRIPT").arg("LOAD").arg(KEEPALIVE).ignore();
    for ids in held.chunks(KEEPALIVE_CHUNK) {
        let mut call = keepalive.key(&cfg.key);
        call.arg(&cfg.group).arg(&cfg.consumer).arg(ids);
        pipe.invoke_script(&call).ignore();
    }
    let _: RedisResult<()> = pipe.query_async(conn).await;
}
