//! The source's background task: sends queued acks, keeps held entries from going idle.

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures::FutureExt;
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
/// - every [`keepalive_every`] (`min_idle / 3`, or less when `block` is above a sixth of
///   `min_idle`), resets the idle time of the entries the application still holds, and of
///   those acknowledged but not sent yet (`lua/stream_keepalive.lua`), so other consumers
///   claim only entries of consumers that stopped, or entries dropped without an ack;
///
/// until the source and every [`Ack`](super::Ack) are gone and nothing is left to send. A
/// failed send is retried after the next interval while any handle is alive and the group
/// it was meant for is not lost (and until one goes through, the source's fetches read
/// nothing: see [`AckQueue::refused`]); after that, the entries stay pending and are
/// redelivered (at-least-once), and the acks given up are counted in
/// `flowgate_demand_unsent_acks_total` as the queue goes. While the group is missing, `XACK` answers 0 (those acks
/// count as stale, not acked) and the keep-alive script fails: both are harmless, and the
/// fetch path re-creates the group.
pub(super) async fn keep_in_background<C: ConnectionLike>(
    queue: Arc<AckQueue>,
    mut conn: C,
    cfg: Arc<Config>,
) {
    let keepalive = redis::Script::new(KEEPALIVE);
    let every = keepalive_every(cfg.min_idle, cfg.block);
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
            // Not later than the keep-alive: the wait must not hold it up.
            tokio::time::sleep_until((Instant::now() + cfg.ack_interval).min(next_touch)).await;
            // Failed, the ids are queued again: retried after the next interval, unless
            // no handle is left to wait for. A panic of user code in the send (a metrics
            // recorder counting its acks, the waker of a `flush_acks` or a fetch told that
            // it is done) ends that send, not this task: once the source is gone, no other
            // sends the acks, and none keeps the held entries alive.
            let sent = AssertUnwindSafe(queue.send(&mut conn, &cfg))
                .catch_unwind()
                .await;
            if matches!(sent, Ok(Err(_))) && queue.lock().handles == 0 {
                return;
            }
        }
        if Instant::now() >= next_touch {
            // Those acknowledged but not sent yet too: acked while a send was on its way,
            // they wait for the next, which may come a whole interval later.
            let ids: Vec<String> = {
                let st = queue.lock();
                st.held.iter().chain(&st.ids).cloned().collect()
            };
            touch(&keepalive, &mut conn, &cfg, &ids).await;
            next_touch = Instant::now() + every;
        }
    }
}

/// Resets the idle time of the entries of `ids` this consumer still owns, in one round trip:
/// the calls of every chunk go in one pipeline, so a read the source sends meanwhile on the
/// same connection holds up the whole keep-alive once (up to `block`), never once per chunk
/// (which let the entries of the later chunks go idle past `min_idle` while held).
///
/// A failed keep-alive is harmless: the next one comes [`keepalive_every`] later, and at worst
/// an entry is claimed by another consumer (at-least-once).
async fn touch<C: ConnectionLike>(
    keepalive: &redis::Script,
    conn: &mut C,
    cfg: &Config,
    ids: &[String],
) {
    if ids.is_empty() {
        return;
    }
    let mut pipe = redis::pipe();
    // A pipelined call does not load a script Redis lacks (restarted, `SCRIPT FLUSH`): it
    // is loaded first, in the same round trip.
    pipe.cmd("SCRIPT").arg("LOAD").arg(KEEPALIVE).ignore();
    for ids in ids.chunks(KEEPALIVE_CHUNK) {
        let mut call = keepalive.key(&cfg.key);
        call.arg(&cfg.group).arg(&cfg.consumer).arg(ids);
        pipe.invoke_script(&call).ignore();
    }
    let _: RedisResult<()> = pipe.query_async(conn).await;
}

/// How often the keep-alive runs: every `min_idle / 3`, or `(min_idle − 2·block) / 2` when
/// that is shorter (`block` above a sixth of `min_idle`).
///
/// Between two keep-alives of an entry there is this interval, and then up to two waits
/// behind a blocking read of the source on the same connection, each up to `block`: the
/// `XACK` of the acks queued, sent first when the keep-alive is due, and the keep-alive
/// itself. The sum stays at least `block / 2` under `min_idle` (which is at least three
/// times `block`): room for the timer's lateness and the round trips.
pub(super) fn keepalive_every(min_idle: Duration, block: Duration) -> Duration {
    (min_idle / 3)
        .min(min_idle.saturating_sub(block.saturating_mul(2)) / 2)
        .max(Duration::from_millis(1))
}
