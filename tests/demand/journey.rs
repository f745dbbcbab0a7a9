//! A Kafka-style consumer loop over a real Redis Streams source, shut down at every phase:
//! `prefetch` fetches from the group, `watermarks` bounds the work in flight, a
//! `CommitTracker` says what may be committed, and an entry is acknowledged only once its
//! work is done (part of the `demand` test binary).

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use flowgate::demand::{
    CommitToken, CommitTracker, Origin, PauseSignal, Prefetch, RedisStreamSource, StreamEntry,
    Ticket, Watermarks,
};
use futures::{StreamExt, poll};
use redis::aio::MultiplexedConnection;

use super::levels;
use super::support::{RedisServer, TestRecorder};

use super::redis_streams::{GROUP, KEY, offset_of, pending};

const NAME: &str = "j";
const N: u32 = 60;

type Stream = Watermarks<Prefetch<RedisStreamSource<MultiplexedConnection>>>;

/// Across runs: per entry (its field `n`), how often it was delivered and acknowledged.
#[derive(Default)]
struct Ledger {
    delivered: HashMap<u32, u32>,
    acked: HashMap<u32, u32>,
    /// Entries that came as this consumer's own pending entries (left by a run before).
    recovered: u64,
}

/// One entry in the loop's hands: its ticket (its place in flight) and its commit token.
struct Held {
    entry: StreamEntry,
    ticket: Ticket,
    token: CommitToken,
}

/// One run of the consumer (always named `c`, so a run recovers what the last one left
/// pending), with metrics of its own.
struct Run {
    stream: Stream,
    tracker: CommitTracker,
    signal: PauseSignal,
    recorder: TestRecorder,
    held: Vec<Held>,
    /// Tickets of error items still held.
    error_tickets: Vec<Ticket>,
    tracked: Vec<u64>,
    finished: BTreeSet<u64>,
    acks: u64,
    errors: u64,
    saw_new: bool,
}

fn metric(name: &str) -> String {
    format!("flowgate_demand_{name}{{name={NAME}}}")
}

impl Run {
    /// A new run; needs a multi-thread runtime (the build runs in `block_in_place`).
    fn start(server: &RedisServer) -> Run {
        let recorder = TestRecorder::default();
        let conn = tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(server.connect())
        });
        let (stream, tracker) = metrics::with_local_recorder(&recorder, || {
            let source = tokio::task::block_in_place(|| {
                tokio::runtime::Handle::current().block_on(
                    RedisStreamSource::builder(conn, KEY, GROUP, "c")
                        .block(Duration::from_millis(50))
                        // No claim within a run: what a run leaves pending, the next one
                        // recovers as its own, first, in id order.
                        .min_idle(Duration::from_secs(60))
                        .claim_every(Duration::from_secs(60))
                        .name(NAME)
                        .build(),
                )
            })
            .unwrap();
            let prefetched = Prefetch::builder(source, levels(6, 0))
                .retry_backoff(Duration::from_millis(10), Duration::from_millis(50))
                .name(NAME)
                .build()
                .unwrap();
            let stream = Watermarks::builder(prefetched, levels(4, 1))
                .name(NAME)
                .build()
                .unwrap();
            let tracker = CommitTracker::builder().name(NAME).build().unwrap();
            (stream, tracker)
        });
        Run {
            signal: stream.pause_signal(),
            stream,
            tracker,
            recorder,
            held: Vec::new(),
            error_tickets: Vec::new(),
            tracked: Vec::new(),
            finished: BTreeSet::new(),
            acks: 0,
            errors: 0,
            saw_new: false,
        }
    }

    /// Pull the next item (within 2 s): an entry is tracked and held; an error's ticket is
    /// held. Returns whether an entry came.
    async fn pull(&mut self, ledger: &mut Ledger) -> bool {
        let next = tokio::time::timeout(Duration::from_secs(2), self.stream.next())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "no item within 2 s: {} held, {} queued, recovering {}",
                    self.held.len(),
                    self.stream.get_ref().queued(),
                    self.stream.get_ref().get_ref().is_recovering()
                )
            })
            .expect("the stream does not end");
        match next {
            (Ok(entry), ticket) => {
                let n: u32 = entry.get("n").unwrap();
                assert_eq!(
                    ledger.acked.get(&n).copied().unwrap_or(0),
                    0,
                    "{n} was acknowledged, and delivered again"
                );
                assert_ne!(entry.origin, Origin::Claimed, "nothing to claim");
                if entry.origin == Origin::New {
                    self.saw_new = true;
                } else {
                    assert!(!self.saw_new, "own pending entries come first");
                }
                ledger.recovered += u64::from(entry.origin == Origin::OwnPending);
                let delivered = ledger.delivered.entry(n).or_default();
                assert!(
                    *delivered == 0 || entry.origin == Origin::OwnPending,
                    "{n} delivered again, not as this consumer's own pending entry"
                );
                *delivered += 1;
                let token = self
                    .tracker
                    .track(offset_of(&entry.id))
                    .expect("ids come in order within a run");
                self.tracked.push(token.offset());
                self.held.push(Held {
                    entry,
                    ticket,
                    token,
                });
                true
            }
            (Err(e), ticket) => {
                assert!(e.is_timeout() || e.is_io_error(), "why it failed: {e}");
                self.errors += 1;
                self.error_tickets.push(ticket);
                false
            }
        }
    }

    /// Pull entries until `n` are held (errors while the server answers fail the test).
    async fn pull_entries(&mut self, ledger: &mut Ledger, n: usize) {
        while self.held.len() < n {
            assert!(self.pull(ledger).await, "an error from a live server");
        }
    }

    /// Finish the oldest held entry: acknowledge it, mark its offset done, give its place
    /// back.
    fn finish_one(&mut self, ledger: &mut Ledger) {
        self.finish(ledger, 0);
    }

    /// Finish held entry `i`.
    fn finish(&mut self, ledger: &mut Ledger, i: usize) {
        let Held {
            entry,
            ticket,
            token,
        } = self.held.remove(i);
        let n: u32 = entry.get("n").unwrap();
        *ledger.acked.entry(n).or_default() += 1;
        entry.ack.ack();
        self.acks += 1;
        self.finished.insert(token.offset());
        token.done();
        drop(ticket);
    }

    /// Pull and finish entries until prefetch's buffer is empty and the source reads new
    /// entries (it recovered its own), so the next poll starts a read of new entries;
    /// what was held before stays held.
    async fn use_up_buffer(&mut self, ledger: &mut Ledger) {
        while self.stream.get_ref().queued() > 0 || self.stream.get_ref().get_ref().is_recovering()
        {
            let held = self.held.len();
            self.pull_entries(ledger, held + 1).await;
            self.finish(ledger, held);
        }
    }

    /// Send the acks made so far.
    async fn flush(&mut self) {
        self.stream.get_mut().get_mut().flush_acks().await.unwrap();
    }

    /// First in a run: what the last run left pending (`left` entries) comes back first,
    /// each once, as this consumer's own; finish each.
    async fn recover(&mut self, ledger: &mut Ledger, left: u64) {
        for _ in 0..left {
            self.pull_entries(ledger, 1).await;
            assert_eq!(
                self.held[0].entry.origin,
                Origin::OwnPending,
                "recovered first"
            );
            self.finish_one(ledger);
        }
    }

    /// Shut down with whatever is held: send the acks made, drop the stream, then what the
    /// loop held (unfinished: not acknowledged, tokens dropped, tickets given back). Checks
    /// the counts and metrics; returns how many entries Redis holds pending for `c`.
    /// With `stopped`, the server is stopped (the acks were flushed before): it is resumed
    /// once all is dropped.
    async fn shut_down(
        mut self,
        con: &mut MultiplexedConnection,
        stopped: Option<&RedisServer>,
    ) -> u64 {
        let in_flight = self.held.len() + self.error_tickets.len();
        assert_eq!(
            self.stream.in_flight(),
            in_flight,
            "in flight = tickets alive"
        );
        assert_eq!(
            self.recorder.gauge(&metric("in_flight")),
            Some(in_flight as f64)
        );
        let paused = self.signal.is_paused();
        assert_eq!(
            self.recorder.gauge(&metric("paused")).unwrap_or(0.0),
            if paused { 1.0 } else { 0.0 }
        );
        if stopped.is_none() {
            self.flush().await;
        }
        let buffered = self.stream.get_ref().queued() as u64;
        drop(self.stream);
        assert_eq!(
            self.recorder.counter(&metric("discarded_total")),
            buffered,
            "what prefetch held is counted as discarded"
        );
        let unfinished = self.held.len() as u64;
        drop(self.held);
        drop(self.error_tickets);
        if let Some(server) = stopped {
            server.resume();
        }
        let dropped = self.recorder.counter(&metric("commit_dropped_total"));
        assert_eq!(
            (self.tracker.dropped(), dropped),
            (unfinished, unfinished),
            "tokens dropped unfinished"
        );
        assert_eq!(
            self.recorder.gauge(&metric("commit_pending")),
            Some(self.tracker.pending() as f64)
        );
        assert_eq!(self.recorder.gauge(&metric("in_flight")), Some(0.0));
        assert!(!self.signal.is_paused(), "every ticket is back: resumed");
        assert_eq!(self.recorder.gauge(&metric("paused")).unwrap_or(0.0), 0.0);
        // The commits never pass an offset not finished.
        let committable = self.tracker.committable();
        for o in &self.tracked {
            if Some(*o) <= committable {
                assert!(self.finished.contains(o), "committed past unfinished {o}");
            }
        }
        let tracked_unfinished = self.tracked.iter().filter(|o| !self.finished.contains(o));
        if let Some(first) = tracked_unfinished.min() {
            assert!(
                committable < Some(*first),
                "the commit stops before {first}"
            );
        }
        // Every ack made reached Redis: acked (or, for an `XACK` run after the client gave
        // up on its answer and sent again, stale); none unsent.
        let acked = self.recorder.counter(&metric("acked_total"));
        let stale = self.recorder.counter(&metric("stale_acks_total"));
        assert_eq!(acked + stale, self.acks, "every ack made is acked or stale");
        // A fetch Redis ran after the source was dropped (mid-fetch) leaves its entries
        // pending too: give it a moment.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let left = pending(con).await;
        assert!(
            left >= unfinished + buffered,
            "held and buffered entries stay pending: {left} < {unfinished} + {buffered}"
        );
        left
    }
}

/// The journey: six runs of one consumer over 60 entries, each but the last shut down at
/// another phase — with tickets out (some work done, some not), paused at `high`, with a
/// fetch on its way (the server stopped under it), right after a fetch failed (the server
/// stopped), after a fetch failed and the source went on — and a last run that drains the
/// stream. Each run first recovers, once each, what the last one left pending in Redis (its
/// own pending list, before any new entry), and never sees an entry acknowledged before.
/// At the end every entry was acknowledged exactly once, each delivery after the first was
/// such a recovery (of an entry never acknowledged), and nothing is pending; at each shutdown the counts agree: in-flight =
/// tickets alive (its gauge too), the paused gauge follows the signal and is 0 once the
/// tickets are back, tokens dropped unfinished are counted, the commit never passes an
/// unfinished offset, what prefetch held is counted as discarded, every ack made reached
/// Redis (acked or stale), and Redis holds pending at least what the loop held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_loop_shut_down_at_every_phase_acks_every_entry_exactly_once() {
    let server = RedisServer::start();
    let mut con = server.connect().await;
    redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(KEY)
        .arg(GROUP)
        .arg("$")
        .arg("MKSTREAM")
        .query_async::<()>(&mut con)
        .await
        .unwrap();
    let mut pipe = redis::pipe();
    for i in 0..N {
        pipe.cmd("XADD").arg(KEY).arg("*").arg("n").arg(i).ignore();
    }
    pipe.query_async::<()>(&mut con).await.unwrap();
    let mut ledger = Ledger::default();

    // 1. With tickets out: 4 pulled (high), 2 finished: still paused above low; shut down
    // holding 2, with 2 buffered.
    let mut run = Run::start(&server);
    run.pull_entries(&mut ledger, 4).await;
    run.finish_one(&mut ledger);
    run.finish_one(&mut ledger);
    assert!(run.signal.is_paused(), "2 in flight: above low");
    assert!(poll!(run.stream.next()).is_pending(), "paused");
    let left = run.shut_down(&mut con, None).await;
    assert_eq!(
        left, 4,
        "the 2 held and the 2 buffered of the first batch of 6"
    );

    // 2. Paused at high: the wrapper takes nothing while paused; 3 finished, it resumes at
    // low, pulls to high again, and is shut down there.
    let mut run = Run::start(&server);
    run.recover(&mut ledger, left).await;
    run.pull_entries(&mut ledger, 4).await;
    assert!(run.signal.is_paused());
    let queued = run.stream.get_ref().queued();
    assert!(poll!(run.stream.next()).is_pending(), "paused at high");
    assert_eq!(
        run.stream.get_ref().queued(),
        queued,
        "nothing taken while paused"
    );
    for _ in 0..3 {
        run.finish_one(&mut ledger);
    }
    assert!(!run.signal.is_paused(), "1 in flight: low");
    run.pull_entries(&mut ledger, 4).await;
    let left = run.shut_down(&mut con, None).await;

    // 3. Mid-fetch: finish what comes until prefetch's buffer is empty, send the acks, stop
    // the server, poll once (a fetch goes out and waits), shut down, let the server answer:
    // the entries its read gave this consumer were never delivered.
    let mut run = Run::start(&server);
    run.recover(&mut ledger, left).await;
    run.use_up_buffer(&mut ledger).await;
    run.flush().await;
    server.pause();
    assert!(poll!(run.stream.next()).is_pending(), "a fetch on its way");
    // Time for the connection to write the read to the stopped server's socket.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let left = run.shut_down(&mut con, Some(&server)).await;
    assert!(left > 0, "the fetch Redis ran left entries pending");

    // 4. After the source errors: 2 entries held, the buffer empty, the server stops
    // answering, a fetch fails (its ticket held too); shut down then.
    let mut run = Run::start(&server);
    run.recover(&mut ledger, left).await;
    run.pull_entries(&mut ledger, 2).await;
    run.use_up_buffer(&mut ledger).await;
    server.pause();
    assert!(!run.pull(&mut ledger).await, "the fetch failed");
    server.resume();
    let left = run.shut_down(&mut con, None).await;

    // 5. After a failed fetch the source goes on: the next fetches deliver; shut down with
    // entries held and buffered.
    let mut run = Run::start(&server);
    run.recover(&mut ledger, left).await;
    run.use_up_buffer(&mut ledger).await;
    server.pause();
    assert!(!run.pull(&mut ledger).await, "the fetch failed");
    drop(std::mem::take(&mut run.error_tickets));
    server.resume();
    run.pull_entries(&mut ledger, 3).await;
    run.finish_one(&mut ledger);
    let left = run.shut_down(&mut con, None).await;

    // 6. Drain: finish everything.
    let mut run = Run::start(&server);
    run.recover(&mut ledger, left).await;
    while ledger.acked.len() < N as usize {
        run.pull_entries(&mut ledger, 1).await;
        run.finish_one(&mut ledger);
    }
    assert_eq!(run.tracker.committable(), run.tracked.last().copied());
    assert_eq!(
        run.shut_down(&mut con, None).await,
        0,
        "nothing left pending"
    );

    for n in 0..N {
        assert_eq!(
            ledger.acked.get(&n),
            Some(&1),
            "{n} acknowledged exactly once"
        );
    }
    // Recovered: each entry delivered again, and those whose first delivery was lost on
    // the way (read for this consumer by a fetch given up on or dropped).
    let redelivered: u32 = ledger.delivered.values().map(|d| d - 1).sum();
    assert!(u64::from(redelivered) <= ledger.recovered);
    assert!(ledger.recovered > 0);
}
