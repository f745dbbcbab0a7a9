//! The stream adapters over a gate (`gated`, `gated_drop`, `Gated::builder`), the in-memory
//! gate's builder and metrics, and `Gate::check_local`: deciding without I/O where a gate can.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flowgate::gate::{Gate, GateError, GateFuture, Gated, Limit, MemoryGate, RedisGate};
use flowgate::{CostError, Decision, Dropped, FlowStreamExt, Quota};
use futures::StreamExt;

use crate::support::RedisServer;

/// A gate that forwards to a `MemoryGate` and counts how it was asked. With `local`, it
/// decides in `check_local` as the memory gate does; without, it has only the async path
/// (the default `check_local`), as a remote gate would.
#[derive(Debug, Clone)]
struct Counted {
    inner: MemoryGate,
    local: bool,
    futures: Arc<AtomicU64>,
}

impl Counted {
    fn new(limit: Limit, local: bool) -> Counted {
        Counted {
            inner: MemoryGate::new(limit),
            local,
            futures: Arc::default(),
        }
    }
}

impl Gate for Counted {
    fn check<'a>(&'a self, key: &'a str, cost: u32) -> GateFuture<'a> {
        self.futures.fetch_add(1, Ordering::Relaxed);
        Gate::check(&self.inner, key, cost)
    }

    fn check_local(&self, key: &str, cost: u32) -> Option<Result<Decision, GateError>> {
        if self.local {
            self.inner.check_local(key, cost)
        } else {
            None
        }
    }

    fn limit(&self) -> Limit {
        self.inner.limit()
    }
}

/// A gate without a `check_all` refuses every list of quotas by default, so what is built
/// over it (an HTTP layer's policies) is refused when built, not on every request.
#[test]
fn a_gate_without_check_all_refuses_quotas() {
    let gate = Counted::new(per_minute(1), true);
    let e = gate
        .validate_quotas(&[Quota::per_minute(1).unwrap()])
        .unwrap_err();
    assert_eq!(e.field(), "gate.check_all");
}

fn per_minute(n: u32) -> Limit {
    Limit::TokenBucket(Quota::per_minute(n).unwrap())
}

/// The items a hook saw, with why they were dropped.
type Seen = Arc<Mutex<Vec<(u32, String)>>>;

/// The reasons seen by a hook, and the hook.
fn recording() -> (Seen, impl Fn(u32, &Dropped) + Send + Sync + 'static) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let hook = seen.clone();
    (seen, move |item: u32, why: &Dropped| {
        let why = match why {
            Dropped::GateError(GateError::Cost(e)) => format!("cost: {e}"),
            why => why.as_str().to_owned(),
        };
        hook.lock().unwrap().push((item, why));
    })
}

#[tokio::test(start_paused = true)]
async fn a_gate_that_decides_locally_is_never_asked_for_a_future() {
    // Shaping, with rejections: 3 pass at once, the other 3 wait 20 s each.
    for local in [true, false] {
        let gate = Counted::new(per_minute(3), local);
        let start = tokio::time::Instant::now();
        let out: Vec<u32> = futures::stream::iter(0..6)
            .gated(gate.clone(), |_: &u32| "k")
            .collect()
            .await;
        assert_eq!(
            out,
            [0, 1, 2, 3, 4, 5],
            "local {local}: in order, nothing lost"
        );
        assert_eq!(start.elapsed(), Duration::from_secs(60), "local {local}");
        // 6 admissions and 3 rejections: 9 decisions, each through a boxed future only
        // when the gate cannot decide locally.
        let futures = gate.futures.load(Ordering::Relaxed);
        assert_eq!(futures, if local { 0 } else { 9 }, "local {local}");
    }
}

#[tokio::test(start_paused = true)]
async fn gated_cost_charges_each_item_its_cost_and_drops_what_can_never_pass() {
    for local in [true, false] {
        // 10 per minute, bursts of 10: one unit every 6 s.
        let gate = Counted::new(per_minute(10), local);
        let (seen, hook) = recording();
        let costs = [4, 4, 0, 11, 2, 1];
        let mut stream = Gated::builder(futures::stream::iter(0..6u32), gate, |_: &u32| "k")
            .cost(move |i: &u32| costs[*i as usize])
            .on_drop(hook)
            .build()
            .unwrap();
        let start = tokio::time::Instant::now();
        let mut passed = Vec::new();
        while let Some(i) = stream.next().await {
            passed.push((i, start.elapsed().as_secs()));
        }
        // 4 + 4 + 2 use the burst; the last unit comes 6 s later.
        assert_eq!(passed, [(0, 0), (1, 0), (4, 0), (5, 6)], "local {local}");
        assert_eq!(stream.dropped(), 2);
        assert_eq!(
            *seen.lock().unwrap(),
            [
                (2, "cost: cost must be at least 1".to_owned()),
                (
                    3,
                    "cost: cost 11 exceeds the capacity 10: it could never be admitted".to_owned()
                ),
            ],
            "local {local}"
        );
    }
}

#[tokio::test]
async fn gated_drop_reports_each_rejection_with_its_decision() {
    let gate = MemoryGate::new(per_minute(2));
    let rejections = Arc::new(Mutex::new(Vec::new()));
    let hook = rejections.clone();
    let mut stream = Gated::builder(futures::stream::iter(0..5u32), gate.clone(), |_: &u32| {
        String::from("k")
    })
    .drop_rejected(true)
    .on_drop(move |i, why| match why {
        Dropped::Rejected(d) => hook.lock().unwrap().push((i, d.allowed, d.retry_after)),
        other => panic!("{i}: {other}"),
    })
    .name("police")
    .build()
    .unwrap();
    assert_eq!(stream.name(), Some("police"));
    assert_eq!(stream.gate().limit(), per_minute(2));
    let passed: Vec<u32> = stream.by_ref().collect().await;
    assert_eq!(passed, [0, 1]);
    assert_eq!(stream.dropped(), 3);
    let rejections = rejections.lock().unwrap().clone();
    assert_eq!(
        rejections.iter().map(|r| r.0).collect::<Vec<_>>(),
        [2, 3, 4]
    );
    assert!(
        rejections
            .iter()
            .all(|&(_, allowed, retry)| !allowed && retry > Duration::from_secs(29)),
        "{rejections:?}"
    );
    // The extension method polices the same way, counting what it drops.
    let mut quick = futures::stream::iter(0..5u32).gated_drop(gate, |_: &u32| "k2");
    assert_eq!(quick.by_ref().count().await, 2);
    assert_eq!((quick.dropped(), quick.name()), (3, None));
}

#[tokio::test]
async fn a_gated_stream_can_be_spawned_with_any_owned_key() {
    static KEYS: [&str; 2] = ["even", "odd"];
    let keys: &'static [&'static str] = &KEYS;
    let limit = Limit::TokenBucket(Quota::per_second(1_000).unwrap());
    let gate = MemoryGate::new(limit);
    // A key borrowed for 'static, captured by reference.
    let a = tokio::spawn(
        futures::stream::iter(0..10u32)
            .gated(gate.clone(), move |i: &u32| keys[(*i % 2) as usize])
            .count(),
    );
    // A key the closure allocates, and a shared one.
    let b = tokio::spawn(
        futures::stream::iter(0..10u32)
            .gated(gate.clone(), |i: &u32| format!("n{i}"))
            .count(),
    );
    let tenant: Arc<str> = Arc::from("tenant");
    let c = tokio::spawn(
        futures::stream::iter(0..10u32)
            .gated_drop(Arc::new(gate), move |_: &u32| tenant.clone())
            .count(),
    );
    assert_eq!(
        (a.await.unwrap(), b.await.unwrap(), c.await.unwrap()),
        (10, 10, 10)
    );
}

#[test]
fn the_memory_gate_builder_validates_and_names() {
    let limit = per_minute(5);
    let err = MemoryGate::builder(limit).max_keys(0).build().unwrap_err();
    assert_eq!(err.field(), "keyed.max_keys");
    let gate = MemoryGate::builder(limit)
        .max_keys(1_000)
        .name("tenants")
        .build()
        .unwrap();
    assert_eq!(
        (gate.name(), gate.max_keys(), gate.limit()),
        (Some("tenants"), 1_008, limit),
        "rounded up to 16 shards of 63"
    );
    let plain = MemoryGate::new(limit);
    assert_eq!((plain.name(), plain.max_keys()), (None, 100_000));
    assert!(format!("{gate:?}").contains("tenants"));
    // As a `Gate`, it always decides locally, with the same effect as `check`.
    for _ in 0..5 {
        assert!(gate.check_local("k", 1).unwrap().unwrap().allowed);
    }
    assert!(!gate.check("k", 1).unwrap().allowed);
    assert!(matches!(
        gate.check_local("k", 0),
        Some(Err(GateError::Cost(CostError::Zero)))
    ));
}

/// `max_keys` is rounded up to a multiple of 16: a figure too large to round (such as
/// `usize::MAX`, a natural way to say "no limit") is a `ConfigError`, not an overflow panic.
#[test]
fn a_max_keys_too_large_to_round_up_is_a_config_error() {
    let built = std::panic::catch_unwind(|| {
        MemoryGate::builder(per_minute(5))
            .max_keys(usize::MAX)
            .build()
            .map(|gate| gate.max_keys())
    });
    let err = built
        .expect("build panicked")
        .expect_err("usize::MAX keys cannot be rounded up to 16 shards");
    assert_eq!(err.field(), "keyed.max_keys");
    assert_eq!(err.kind(), flowgate::ConfigErrorKind::TooLarge);
}

#[cfg(feature = "metrics")]
#[tokio::test]
async fn the_memory_gate_and_the_adapter_count_under_their_names() {
    let recorder = crate::support::TestRecorder::default();
    let q = Quota::per_minute(2).unwrap();
    let (gate, stream) = metrics::with_local_recorder(&recorder, || {
        let gate = MemoryGate::builder(Limit::TokenBucket(q))
            .name("api")
            .build()
            .unwrap();
        let stream = Gated::builder(futures::stream::iter(0..5u32), gate.clone(), |_: &u32| "k")
            .drop_rejected(true)
            .name("ingest")
            .build()
            .unwrap();
        (gate, stream)
    });
    assert_eq!(stream.count().await, 2);
    assert!(gate.check_all(&[("a", q), ("b", q)], 1).unwrap()[0].allowed);
    let decisions = |outcome: &str| {
        recorder.counter(&format!(
            "flowgate_gate_decisions_total{{name=api,outcome={outcome}}}"
        ))
    };
    assert_eq!((decisions("allowed"), decisions("rejected")), (3, 3));
    let dropped = |reason: &str| {
        recorder.counter(&format!(
            "flowgate_gated_dropped_total{{name=ingest,reason={reason}}}"
        ))
    };
    assert_eq!(
        (
            dropped("rejected"),
            dropped("gate_error"),
            dropped("discarded")
        ),
        (3, 0, 0)
    );
}

#[tokio::test]
async fn the_redis_gate_decides_locally_only_what_needs_no_redis() {
    let server = RedisServer::start();
    let gate = RedisGate::builder(server.connect().await, per_minute(1))
        .build()
        .await
        .unwrap();
    assert_eq!(gate.name(), None);
    // Malformed requests: answered here.
    assert!(matches!(
        gate.check_local("k", 2),
        Some(Err(GateError::Cost(CostError::ExceedsCapacity {
            cost: 2,
            capacity: 1
        })))
    ));
    assert!(matches!(
        gate.check_local("", 1),
        Some(Err(GateError::InvalidKey(_)))
    ));
    // A fresh key needs Redis; nothing was consumed by asking.
    assert!(gate.check_local("k", 1).is_none());
    assert!(gate.check("k", 1).await.unwrap().allowed);
    // Rejected by Redis: the cached rejection is answered here until its retry_after.
    assert!(!gate.check("k", 1).await.unwrap().allowed);
    let cached = gate.check_local("k", 1).expect("cached").unwrap();
    assert!(!cached.allowed && cached.retry_after > Duration::ZERO);
    // Through the adapter, over Redis: the first item passes, the rest are dropped.
    let named = RedisGate::builder(server.connect().await, per_minute(1))
        .prefix("other:")
        .name("fleet")
        .build()
        .await
        .unwrap();
    assert_eq!(named.name(), Some("fleet"));
    let mut stream = futures::stream::iter(0..3u32).gated_drop(named, |_: &u32| "k");
    assert_eq!(stream.by_ref().count().await, 1);
    assert_eq!(stream.dropped(), 2);
}

/// A waker that records that it was woken.
#[derive(Default)]
struct Woken(std::sync::atomic::AtomicBool);

impl std::task::Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Over an upstream that is always ready, an item dropped at the gate (rejected under
/// policing, or refused for good under shaping: here a cost of 0) is followed at once by the
/// next. `poll_next` must hand the executor back after a bounded number of drops, waking
/// itself to go on, as `leaky_queue` does; otherwise it drains the whole upstream inside one
/// poll, and over an endless upstream it never returns.
#[tokio::test]
async fn dropping_from_an_always_ready_upstream_yields_to_the_executor() {
    const UPSTREAM: u64 = 100_000;
    for drop_rejected in [true, false] {
        let pulled = Arc::new(AtomicU64::new(0));
        let count = pulled.clone();
        let upstream = futures::stream::iter(0..UPSTREAM as u32).inspect(move |_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        // One per minute: after item 0, every item is rejected (policing); under shaping,
        // every item after 0 costs 0 and can never pass.
        let gate = MemoryGate::new(per_minute(1));
        let mut stream = Gated::builder(upstream, gate, |_: &u32| "k")
            .cost(move |i: &u32| u32::from(drop_rejected || *i == 0))
            .drop_rejected(drop_rejected)
            .build()
            .unwrap();
        assert_eq!(stream.next().await, Some(0));
        let woken = Arc::new(Woken::default());
        let waker = std::task::Waker::from(woken.clone());
        let polled = futures::Stream::poll_next(
            std::pin::Pin::new(&mut stream),
            &mut std::task::Context::from_waker(&waker),
        );
        let pulled = pulled.load(Ordering::Relaxed);
        assert!(
            polled.is_pending() && pulled < 10_000,
            "drop_rejected {drop_rejected}: one poll pulled {pulled} of {UPSTREAM} items \
             and returned {polled:?}"
        );
        assert!(
            woken.0.load(Ordering::SeqCst),
            "drop_rejected {drop_rejected}: it wakes itself to go on"
        );
        assert_eq!(
            stream.dropped(),
            pulled - 1,
            "drop_rejected {drop_rejected}"
        );
        // Polled on, it drops the rest and ends.
        assert_eq!(stream.next().await, None);
        assert_eq!(
            stream.dropped(),
            UPSTREAM - 1,
            "drop_rejected {drop_rejected}"
        );
    }
}

/// A drop hook that panics panics the poll (or the drop) that dropped the item, with the
/// adapter consistent: the item is counted first, nothing is left at the gate, and the
/// stream goes on. (A regression test: this held before the review.)
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn a_panicking_drop_hook_leaves_the_gated_stream_counted_and_usable() {
    use futures::FutureExt;
    let recorder = crate::support::TestRecorder::default();
    let calls = Arc::new(AtomicU64::new(0));
    let panicking = |calls: Arc<AtomicU64>| {
        move |i: u32, _: &Dropped| {
            if calls.fetch_add(1, Ordering::Relaxed) == 0 {
                panic!("hook panics on {i}");
            }
        }
    };
    let gate = MemoryGate::new(per_minute(2));
    let (mut policing, shaping) = metrics::with_local_recorder(&recorder, || {
        let policing = Gated::builder(futures::stream::iter(0..5u32), gate.clone(), |_: &u32| "p")
            .drop_rejected(true)
            .on_drop(panicking(calls.clone()))
            .name("policing")
            .build()
            .unwrap();
        let shaping = Gated::builder(futures::stream::iter(0..5u32), gate, |_: &u32| "s")
            .on_drop(panicking(Arc::new(AtomicU64::new(0))))
            .name("shaping")
            .build()
            .unwrap();
        (policing, shaping)
    });
    let dropped = |name: &str, reason: &str| {
        recorder.counter(&format!(
            "flowgate_gated_dropped_total{{name={name},reason={reason}}}"
        ))
    };
    assert_eq!(policing.next().await, Some(0));
    assert_eq!(policing.next().await, Some(1));
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        policing.next().now_or_never()
    }));
    assert!(unwound.is_err(), "the hook's panic reached the poll");
    assert_eq!(
        (policing.dropped(), dropped("policing", "rejected")),
        (1, 1)
    );
    assert_eq!(policing.next().await, None, "3 and 4 are rejected too");
    assert_eq!(
        (policing.dropped(), dropped("policing", "rejected")),
        (3, 3)
    );
    assert_eq!(calls.load(Ordering::Relaxed), 3);
    // Shaping: the third item waits at the gate; the stream dropped, the hook panics on it.
    let mut shaping = Box::pin(shaping);
    assert_eq!(shaping.next().await, Some(0));
    assert_eq!(shaping.next().await, Some(1));
    assert!(
        shaping.next().now_or_never().is_none(),
        "2 waits at the gate"
    );
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(shaping)));
    assert!(unwound.is_err(), "the hook's panic reached the drop");
    assert_eq!(dropped("shaping", "discarded"), 1);
}

/// Polls `stream` for 0, then for 1, whose key or cost function panics: the panic reaches
/// the poll, and is caught here.
async fn pass_0_then_panic_on_1(stream: &mut (impl futures::Stream<Item = u32> + Unpin)) {
    use futures::FutureExt;
    assert_eq!(stream.next().await, Some(0));
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        stream.next().now_or_never()
    }));
    assert!(unwound.is_err(), "the panic reached the poll");
}

/// A key or cost function that panics on an item does not lose it: the item stays at the
/// gate, asked again on the next poll if the caller caught the panic, and reported as
/// discarded if the stream is dropped instead.
#[tokio::test(start_paused = true)]
async fn an_item_whose_key_or_cost_function_panics_is_kept_at_the_gate() {
    for in_cost in [false, true] {
        // Panics the first time it sees 1.
        let seen_one = Arc::new(AtomicU64::new(0));
        let once = move |i: &u32| {
            if *i == 1 && seen_one.fetch_add(1, Ordering::Relaxed) == 0 {
                panic!("panics on 1");
            }
        };
        let (seen, hook) = recording();
        let (key_once, cost_once) = (once.clone(), once);
        let mut stream = Gated::builder(
            futures::stream::iter(0..3u32),
            MemoryGate::new(per_minute(10)),
            move |i: &u32| {
                if !in_cost {
                    key_once(i);
                }
                "k"
            },
        )
        .cost(move |i: &u32| {
            if in_cost {
                cost_once(i);
            }
            1
        })
        .on_drop(hook)
        .build()
        .unwrap();
        pass_0_then_panic_on_1(&mut stream).await;
        let rest: Vec<u32> = (&mut stream).collect().await;
        assert_eq!(rest, [1, 2], "cost {in_cost}: 1 is asked again, not lost");
        assert_eq!(stream.dropped(), 0);
        assert!(seen.lock().unwrap().is_empty());
    }
    // Dropped after the panic: the item is reported.
    let (seen, hook) = recording();
    let mut stream = Gated::builder(
        futures::stream::iter(0..3u32),
        MemoryGate::new(per_minute(10)),
        |i: &u32| {
            assert_ne!(*i, 1, "panics on 1");
            "k"
        },
    )
    .on_drop(hook)
    .build()
    .unwrap();
    pass_0_then_panic_on_1(&mut stream).await;
    drop(stream);
    assert_eq!(*seen.lock().unwrap(), [(1, "discarded".to_owned())]);
}

/// A gate whose decision (its future) panics on its first ask, as a metrics recorder that
/// panics while a `RedisGate` counts a decision makes it, then decides as a `MemoryGate`.
#[derive(Debug, Clone)]
struct PanicsOnce {
    inner: MemoryGate,
    asked: Arc<AtomicU64>,
}

impl Gate for PanicsOnce {
    fn check<'a>(&'a self, key: &'a str, cost: u32) -> GateFuture<'a> {
        let first = self.asked.fetch_add(1, Ordering::Relaxed) == 0;
        Box::pin(async move {
            assert!(!first, "the gate panics");
            Gate::check(&self.inner, key, cost).await
        })
    }

    fn limit(&self) -> Limit {
        self.inner.limit()
    }
}

/// A gate whose decision panics leaves the stream usable, as a key or cost function that
/// panics does: the item stays at the gate and is asked again on the next poll (if the
/// caller caught the panic), or reported as discarded if the stream is dropped. The
/// decision that panicked was polled again instead, and every later poll panicked
/// (`async fn` resumed after panicking): the item never passed, nothing after it either.
#[tokio::test(start_paused = true)]
async fn an_item_whose_gate_decision_panics_is_kept_at_the_gate() {
    use futures::FutureExt;
    let (seen, hook) = recording();
    let gate = PanicsOnce {
        inner: MemoryGate::new(per_minute(10)),
        asked: Arc::default(),
    };
    let mut stream = Gated::builder(futures::stream::iter(0..3u32), gate.clone(), |_: &u32| "k")
        .on_drop(hook)
        .build()
        .unwrap();
    let unwound = std::panic::AssertUnwindSafe(stream.next())
        .catch_unwind()
        .await;
    assert!(unwound.is_err(), "the panic reached the poll");
    let rest = std::panic::AssertUnwindSafe((&mut stream).collect::<Vec<u32>>())
        .catch_unwind()
        .await;
    assert_eq!(rest.ok(), Some(vec![0, 1, 2]), "0 is asked again, not lost");
    assert_eq!(gate.asked.load(Ordering::Relaxed), 4);
    assert_eq!(stream.dropped(), 0);
    assert!(seen.lock().unwrap().is_empty());
    // Dropped after the panic: the item is reported.
    let (seen, hook) = recording();
    let gate = PanicsOnce {
        inner: MemoryGate::new(per_minute(10)),
        asked: Arc::default(),
    };
    let mut stream = Gated::builder(futures::stream::iter(0..3u32), gate, |_: &u32| "k")
        .on_drop(hook)
        .build()
        .unwrap();
    let unwound = std::panic::AssertUnwindSafe(stream.next())
        .catch_unwind()
        .await;
    assert!(unwound.is_err(), "the panic reached the poll");
    drop(stream);
    assert_eq!(*seen.lock().unwrap(), [(0, "discarded".to_owned())]);
}

/// A gate of one's own that rejects with a `retry_after` of zero (ask again now:
/// `Decision::fail_closed(Duration::ZERO)`), then admits on its `admit_on`-th ask.
#[derive(Debug, Clone)]
struct RetryNow {
    asked: Arc<AtomicU64>,
    admit_on: u64,
}

impl Gate for RetryNow {
    fn check<'a>(&'a self, _key: &'a str, _cost: u32) -> GateFuture<'a> {
        let n = self.asked.fetch_add(1, Ordering::Relaxed) + 1;
        let decision = if n >= self.admit_on {
            Decision::fail_open()
        } else {
            Decision::fail_closed(Duration::ZERO)
        };
        Box::pin(std::future::ready(Ok(decision)))
    }

    fn limit(&self) -> Limit {
        per_minute(1)
    }
}

/// A rejection that says to wait nothing is asked again after a timer tick (1 ms), not in
/// a loop inside one poll: a gate that kept answering so (a breaker of one's own failing
/// closed with no wait) spun `gated` for ever without returning, and under paused time no
/// timeout could fire. Here the gate admits on its 5th ask, so the old loop shows as a first
/// poll that asked 5 times and passed at once (fails: Ready after 5 asks) rather than as a
/// hang.
#[tokio::test(start_paused = true)]
async fn a_rejection_without_a_wait_is_asked_again_a_tick_later() {
    let asked = Arc::new(AtomicU64::new(0));
    let gate = RetryNow {
        asked: asked.clone(),
        admit_on: 5,
    };
    let start = tokio::time::Instant::now();
    let mut stream = futures::stream::iter([7]).gated(gate, |_: &i32| "k");
    let first = futures::poll!(stream.next());
    assert!(
        first.is_pending(),
        "{first:?} after {} asks",
        asked.load(Ordering::Relaxed)
    );
    assert_eq!(asked.load(Ordering::Relaxed), 1);
    assert_eq!(stream.next().await, Some(7));
    assert_eq!(asked.load(Ordering::Relaxed), 5);
    assert_eq!(start.elapsed(), Duration::from_millis(4));
}

/// Shaping waits on tokio's timers, which end on a 1 ms tick, and a key's bucket banks the
/// time a wait runs late only up to its burst (as `Gated` documents): at a million a
/// second, a burst of a tick's worth (1 000) keeps the rate, 10 000 items in 9 ms; a burst
/// of 1 passes one item a tick, 100 items in 99 ms: a thousand a second.
#[tokio::test(start_paused = true)]
async fn a_shaping_stream_passes_at_most_a_burst_a_timer_tick() {
    let million = |burst| {
        let quota = Quota::per_second(1_000_000).unwrap().burst(burst).unwrap();
        MemoryGate::new(Limit::TokenBucket(quota))
    };
    for (burst, items, took) in [(1_000, 10_000, 9), (1, 100, 99)] {
        let start = tokio::time::Instant::now();
        let passed = futures::stream::iter(0..items)
            .gated(million(burst), |_: &u32| "k")
            .count()
            .await;
        assert_eq!(passed, items as usize);
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(took),
            "burst {burst}"
        );
    }
}

/// An item dropped while the metrics recorder panics counting the drop still reaches the
/// hook, and is counted in `dropped`.
#[cfg(feature = "metrics")]
#[test]
fn a_dropped_item_reaches_the_hook_when_the_recorder_panics() {
    let hourly = Quota::new(flowgate::Rate::per_hour(1).unwrap(), 1).unwrap();
    let gate = MemoryGate::new(Limit::TokenBucket(hourly));
    let got = Arc::new(Mutex::new(Vec::new()));
    let sink = got.clone();
    let recorder = crate::support::TestRecorder::default();
    let mut gated = metrics::with_local_recorder(&recorder, || {
        Gated::builder(futures::stream::iter([1u32, 2]), gate, |_: &u32| "k")
            .name("panicky")
            .drop_rejected(true)
            .on_drop(move |item, _| sink.lock().unwrap().push(item))
            .build()
            .unwrap()
    });
    let mut next = || futures::executor::block_on(gated.next());
    assert_eq!(next(), Some(1));
    let id = "flowgate_gated_dropped_total{name=panicky,reason=rejected}";
    recorder.panic_on(id, true);
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(&mut next));
    recorder.panic_on(id, false);
    assert!(unwound.is_err(), "the recorder's panic reaches the caller");
    assert_eq!(next(), None);
    assert_eq!(gated.dropped(), 1);
    assert_eq!(*got.lock().unwrap(), [2], "the item was lost");
}

/// A metrics recorder that panics as a `MemoryGate` counts its admission of an item panics
/// the poll, and the item passes on the next poll without being asked again: charged once,
/// on the gate and through a pointer to it. It was asked again, and charged again (the
/// second of two tokens an hour), so the next item found the bucket empty and was dropped.
#[cfg(feature = "metrics")]
#[test]
fn an_item_admitted_as_the_recorder_panics_is_charged_once() {
    admitted_once("once", |gate| gate);
    admitted_once("once-dyn", |gate| Arc::new(gate) as Arc<dyn Gate>);
}

/// Items 1, 2, 3 through `wrap(gate)` of two tokens an hour, the recorder panicking as the
/// first admission is counted: 1 and 2 pass, 3 is dropped.
#[cfg(feature = "metrics")]
fn admitted_once<G: Gate + Clone + 'static>(name: &str, wrap: impl FnOnce(MemoryGate) -> G) {
    let two_an_hour = Quota::new(flowgate::Rate::per_hour(2).unwrap(), 2).unwrap();
    let recorder = crate::support::TestRecorder::default();
    let mut gated = metrics::with_local_recorder(&recorder, || {
        let gate = MemoryGate::builder(Limit::TokenBucket(two_an_hour))
            .name(name)
            .build()
            .unwrap();
        futures::stream::iter([1u32, 2, 3]).gated_drop(wrap(gate), |_: &u32| "k")
    });
    let allowed = format!("flowgate_gate_decisions_total{{name={name},outcome=allowed}}");
    recorder.panic_on(&allowed, true);
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        futures::executor::block_on(gated.next())
    }));
    recorder.panic_on(&allowed, false);
    assert!(
        unwound.is_err(),
        "{name}: the recorder's panic reaches the poll"
    );
    let rest: Vec<u32> = futures::executor::block_on((&mut gated).collect());
    assert_eq!(
        rest,
        [1, 2],
        "{name}: 1 was charged twice, 2 found the bucket empty"
    );
    assert_eq!(gated.dropped(), 1, "{name}");
    // The admission whose count panicked is not recorded; the second is.
    assert_eq!(recorder.counter(&allowed), 1, "{name}");
}

/// A metrics recorder that panics as a `RedisGate` counts a leased token spent (a decision
/// made in place, without Redis) panics the poll, and the item passes on the next poll
/// without being asked again: charged once. It was asked again and spent a second leased
/// token, so the next item found the bucket empty and was dropped.
#[cfg(feature = "metrics")]
#[tokio::test]
async fn an_item_admitted_from_a_lease_as_the_recorder_panics_is_charged_once() {
    use futures::FutureExt;
    let recorder = crate::support::TestRecorder::default();
    // Current-thread runtime: the gate registers its metrics with this thread's recorder.
    let _local = metrics::set_default_local_recorder(&recorder);
    let server = RedisServer::start();
    let three_an_hour = Limit::TokenBucket(Quota::per_hour(3).unwrap());
    let gate = RedisGate::builder(server.connect().await, three_an_hour)
        .name("leased")
        .lease(10)
        .lease_ttl(Duration::from_secs(600))
        .build()
        .await
        .unwrap();
    let mut gated = futures::stream::iter([1u32, 2, 3, 4]).gated_drop(gate.clone(), |_: &u32| "k");
    // 1 decided by Redis, which leases the other two tokens of the bucket here.
    assert_eq!(gated.next().await, Some(1));
    assert_eq!(gate.leased_keys(), 1);
    let allowed = "flowgate_gate_decisions_total{name=leased,outcome=allowed}";
    recorder.panic_once_on(allowed);
    let unwound = std::panic::AssertUnwindSafe(gated.next())
        .catch_unwind()
        .await;
    assert!(
        unwound.is_err() && recorder.panicked_once(allowed),
        "the recorder's panic reaches the poll"
    );
    let rest: Vec<u32> = (&mut gated).collect().await;
    assert_eq!(
        rest,
        [2, 3],
        "2 was charged twice, 3 found the bucket empty"
    );
    assert_eq!(gated.dropped(), 1);
    // The spending whose count panicked is not recorded; 1 and 3 are.
    assert_eq!(recorder.counter(allowed), 2);
}

/// After a poll that admitted an item as the recorder panicked counting it: the stream
/// dropped before the item passed reports it once, as discarded; and under policing, an
/// item rejected as the recorder panics is dropped once, as rejected, not asked again.
#[cfg(feature = "metrics")]
#[test]
fn a_decision_held_with_a_recorder_panic_is_acted_on_once() {
    let seen: Arc<Mutex<Vec<(u32, &'static str)>>> = Arc::default();
    let hook = |seen: &Arc<Mutex<Vec<(u32, &'static str)>>>| {
        let seen = seen.clone();
        move |item, why: &Dropped| {
            let why = match why {
                Dropped::Rejected(_) => "rejected",
                Dropped::Discarded => "discarded",
                _ => "other",
            };
            seen.lock().unwrap().push((item, why));
        }
    };
    let one_an_hour = Limit::TokenBucket(Quota::per_hour(1).unwrap());
    let recorder = crate::support::TestRecorder::default();
    let gate = metrics::with_local_recorder(&recorder, || {
        MemoryGate::builder(one_an_hour)
            .name("held")
            .build()
            .unwrap()
    });
    let decisions =
        |outcome| format!("flowgate_gate_decisions_total{{name=held,outcome={outcome}}}");
    let poll_panicking = |gated: &mut (dyn futures::Stream<Item = u32> + Unpin), outcome| {
        recorder.panic_once_on(&decisions(outcome));
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            futures::executor::block_on(gated.next())
        }));
        assert!(unwound.is_err() && recorder.panicked_once(&decisions(outcome)));
    };
    // Admitted, then dropped before it passed.
    let mut gated = Gated::builder(futures::stream::iter([1u32]), gate.clone(), |_: &u32| "a")
        .drop_rejected(true)
        .on_drop(hook(&seen))
        .build()
        .unwrap();
    poll_panicking(&mut gated, "allowed");
    drop(gated);
    assert_eq!(*seen.lock().unwrap(), [(1, "discarded")]);
    assert!(!gate.check("a", 1).unwrap().allowed, "charged");
    seen.lock().unwrap().clear();
    // Policing: 2 rejected as the recorder panics, dropped once; 3 then asked, not 2 again.
    let mut gated = Gated::builder(
        futures::stream::iter([2u32, 3]),
        gate.clone(),
        |_: &u32| "a",
    )
    .drop_rejected(true)
    .on_drop(hook(&seen))
    .build()
    .unwrap();
    poll_panicking(&mut gated, "rejected");
    assert_eq!(*seen.lock().unwrap(), [(2, "rejected")]);
    assert_eq!(futures::executor::block_on(gated.next()), None);
    assert_eq!(*seen.lock().unwrap(), [(2, "rejected"), (3, "rejected")]);
    assert_eq!(gated.dropped(), 2);
}

/// Shaping: a rejection whose count panics (the recorder) sends the item to wait its
/// `retry_after`, as a counted one does, and the gate is asked once more, after the wait.
#[cfg(feature = "metrics")]
#[tokio::test(start_paused = true)]
async fn an_item_rejected_as_the_recorder_panics_waits_its_retry_after() {
    use futures::FutureExt;
    let recorder = crate::support::TestRecorder::default();
    let mut gated = metrics::with_local_recorder(&recorder, || {
        let gate = MemoryGate::builder(per_minute(1))
            .name("wait")
            .build()
            .unwrap();
        futures::stream::iter([1u32, 2]).gated(gate, |_: &u32| "k")
    });
    assert_eq!(gated.next().await, Some(1));
    let rejected = "flowgate_gate_decisions_total{name=wait,outcome=rejected}";
    recorder.panic_on(rejected, true);
    let unwound = std::panic::AssertUnwindSafe(gated.next())
        .catch_unwind()
        .await;
    recorder.panic_on(rejected, false);
    assert!(unwound.is_err(), "the recorder's panic reaches the poll");
    let start = tokio::time::Instant::now();
    assert_eq!(gated.next().await, Some(2));
    assert_eq!(start.elapsed(), Duration::from_secs(60));
    assert_eq!(recorder.counter(rejected), 0, "asked again before the wait");
    assert_eq!(gated.dropped(), 0);
}

/// At the edges of time and rates: a gate whose clock has run for 700 years (past `u64`
/// nanoseconds) decides, sweeps and decides all-or-nothing as on its first day, and a
/// shaping stream told to wait centuries (a token every 584 years) waits without an
/// `Instant` overflow and passes the item when the wait is over.
#[tokio::test(start_paused = true)]
async fn a_gate_and_a_stream_at_the_edges_of_time() {
    let centuries = Quota::new(
        flowgate::Rate::per(1, Duration::from_nanos(u64::MAX)).unwrap(),
        1,
    )
    .unwrap();
    let gate = MemoryGate::new(Limit::TokenBucket(centuries));
    tokio::time::advance(Duration::from_secs(700 * 365 * 24 * 3_600)).await;
    assert!(gate.check("k", 1).unwrap().allowed);
    let d = gate.check("k", 1).unwrap();
    assert!(!d.allowed && d.retry_after > Duration::from_secs(584 * 365 * 24 * 3_600));
    assert_eq!(gate.sweep(), 0, "a busy key stays");
    let limits = [("a", centuries), ("b", centuries)];
    assert!(gate.check_all(&limits, 1).unwrap()[0].allowed);
    let d = gate.check_all(&limits, 1).unwrap();
    assert!(d.iter().all(|d| !d.allowed && !d.retry_after.is_zero()));
    // The stream waits (a century at a time, `retry_after` capped), then passes.
    let admitted_at = tokio::time::Instant::now();
    let mut stream = futures::stream::iter([1u32]).gated(gate.clone(), |_: &u32| "k");
    assert!(futures::poll!(stream.next()).is_pending());
    tokio::time::advance(Duration::from_secs(200 * 365 * 24 * 3_600)).await;
    assert!(futures::poll!(stream.next()).is_pending());
    assert_eq!(stream.next().await, Some(1));
    assert!(admitted_at.elapsed() >= Duration::from_nanos(u64::MAX));
}
