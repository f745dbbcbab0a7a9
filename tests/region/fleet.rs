//! A fleet for the end-to-end tests: a home `redis-server`, one local `redis-server` per
//! region, a TCP delay proxy between each region and the home (the cross-region latency),
//! several processes per region (each its own `Region`, connections and refresher), and
//! open-loop load at a per-region offered rate that a test can move.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flowgate::Quota;
use flowgate::gate::GateError;
use flowgate::region::{Allocation, QuotaAllocator, Region, RegionSpec, RegionStatus, SafeShare};
use redis::aio::ConnectionManager;
use tokio::task::JoinHandle;

use crate::support::{DelayProxy, RedisServer};

pub const REGIONS: [&str; 3] = ["us", "eu", "ap"];
pub const WEIGHTS: [u64; 3] = [50, 30, 20];
/// The global quota: 300 per second, bursts of 30.
pub const RATE: u64 = 300;
pub const BURST: u64 = 30;
/// A request sent this long after its turn was delayed by the machine, not the schedule.
pub const LATE: Duration = Duration::from_millis(10);

/// How a fleet is set up.
#[derive(Clone, Debug)]
pub struct Setup {
    pub policy: Allocation,
    pub safe: SafeShare,
    pub lease: Duration,
    pub refresh: Duration,
    /// One-way latency between each region and the home.
    pub one_way: Duration,
    pub processes: usize,
    /// Whether to start the home without its learning phase (a first deployment).
    pub init_home: bool,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            policy: Allocation::FairShare,
            safe: SafeShare::Closed,
            lease: Duration::from_secs(2),
            refresh: Duration::from_millis(400),
            one_way: Duration::from_millis(25),
            processes: 2,
            init_home: true,
        }
    }
}

/// A connection manager that gives up fast, so a dead home or local Redis fails a call
/// within the timeouts instead of hanging.
pub async fn manager(url: &str) -> ConnectionManager {
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_millis(300)))
        .set_response_timeout(Some(Duration::from_millis(300)))
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_millis(100));
    let client = redis::Client::open(url).expect("a valid url");
    ConnectionManager::new_with_config(client, config)
        .await
        .expect("connect")
}

pub fn allocator_builder(
    home: ConnectionManager,
    setup: &Setup,
) -> flowgate::region::QuotaAllocatorBuilder<ConnectionManager> {
    let quota = Quota::per_second(RATE as u32)
        .and_then(|q| q.burst(BURST as u32))
        .expect("a valid quota");
    let mut b = QuotaAllocator::builder(home, quota)
        .name("e2e")
        .policy(setup.policy)
        .safe_share(setup.safe)
        .lease(setup.lease)
        .refresh_every(setup.refresh)
        .home_timeout(setup.refresh * 3 / 4)
        // Generous: two busy cores run the servers, the proxies and the load.
        .local_timeout(Duration::from_millis(300));
    for (name, weight) in REGIONS.iter().zip(WEIGHTS) {
        b = b.region(RegionSpec::new(*name, weight));
    }
    b
}

pub struct Fleet {
    pub setup: Setup,
    pub home: RedisServer,
    pub locals: Vec<RedisServer>,
    pub proxies: Vec<DelayProxy>,
    /// Per region, per process.
    pub members: Vec<Vec<Option<Region<ConnectionManager>>>>,
    /// Offered load per region, requests per second (split over its processes).
    pub offered: Vec<Arc<AtomicU64>>,
    /// Every admitted request: when it was sent, when its decision returned, which region.
    pub admitted: Arc<Mutex<Vec<(Instant, Instant, usize)>>>,
    /// Decision latencies in µs, per region.
    pub latencies: Arc<Mutex<Vec<Vec<u64>>>>,
    /// Every request sent: when, which region.
    pub sent: Arc<Mutex<Vec<(Instant, usize)>>>,
    /// The requests sent more than [`LATE`] after their turn in the offered schedule (the
    /// load task starved of CPU; it catches up in a burst): when, which region.
    pub late: Arc<Mutex<Vec<(Instant, usize)>>>,

    /// Requests the machine's load failed, not the gate: the local Redis or its connection
    /// timed out (a starved process or server), or the gate refused while it waited for its
    /// probe after such a failure. When each was sent, which region.
    pub starved: Arc<Mutex<Vec<(Instant, usize)>>>,
    /// Every other failure.
    pub errors: Arc<AtomicU64>,
    /// The load tasks, with their region.
    load: Vec<(usize, JoinHandle<()>)>,
    pub started: Instant,
}

impl Fleet {
    pub async fn start(setup: Setup) -> Fleet {
        let home = RedisServer::start();
        let locals: Vec<RedisServer> = REGIONS.iter().map(|_| RedisServer::start()).collect();
        let home_addr = format!("127.0.0.1:{}", home.port()).parse().unwrap();
        let mut proxies = Vec::new();
        for _ in REGIONS {
            proxies.push(DelayProxy::start(home_addr, setup.one_way).await.unwrap());
        }
        if setup.init_home {
            let alloc = allocator_builder(manager(&home.url()).await, &setup)
                .build()
                .unwrap();
            assert!(alloc.init_home().await.unwrap());
        }
        let mut members = Vec::new();
        for (r, name) in REGIONS.iter().enumerate() {
            let mut procs = Vec::new();
            for _ in 0..setup.processes {
                let alloc = allocator_builder(manager(&proxies[r].url()).await, &setup)
                    .build()
                    .unwrap();
                let region = alloc
                    .join(name, manager(&locals[r].url()).await)
                    .await
                    .unwrap();
                procs.push(Some(region));
            }
            members.push(procs);
        }
        Fleet {
            setup,
            home,
            locals,
            proxies,
            members,
            offered: REGIONS
                .iter()
                .map(|_| Arc::new(AtomicU64::new(0)))
                .collect(),
            admitted: Arc::new(Mutex::new(Vec::new())),
            latencies: Arc::new(Mutex::new(vec![Vec::new(); REGIONS.len()])),
            sent: Arc::new(Mutex::new(Vec::new())),
            late: Arc::new(Mutex::new(Vec::new())),
            starved: Arc::new(Mutex::new(Vec::new())),
            errors: Arc::new(AtomicU64::new(0)),
            load: Vec::new(),
            started: Instant::now(),
        }
    }

    /// Start open-loop load: each process of region `r` sends `offered[r] / processes`
    /// requests per second (re-read every tick, so a test can move demand).
    pub fn start_load(&mut self) {
        self.started = Instant::now();
        for (r, procs) in self.members.iter().enumerate() {
            let n = procs.len() as u64;
            for member in procs.iter().flatten() {
                let gate = member.gate();
                let offered = self.offered[r].clone();
                let admitted = self.admitted.clone();
                let latencies = self.latencies.clone();
                let errors = self.errors.clone();
                let sent_log = self.sent.clone();
                let late = self.late.clone();
                let starved = self.starved.clone();
                self.load.push((
                    r,
                    tokio::spawn(async move {
                        let mut next = tokio::time::Instant::now();
                        loop {
                            let rate = offered.load(Ordering::Relaxed) / n;
                            if rate == 0 {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                                next = tokio::time::Instant::now();
                                continue;
                            }
                            next += Duration::from_nanos(1_000_000_000 / rate);
                            tokio::time::sleep_until(next).await;
                            let sent = Instant::now();
                            sent_log.lock().unwrap().push((sent, r));
                            if tokio::time::Instant::now() > next + LATE {
                                late.lock().unwrap().push((sent, r));
                            }
                            match gate.check("api", 1).await {
                                Ok(d) => {
                                    let done = Instant::now();
                                    latencies.lock().unwrap()[r]
                                        .push(done.duration_since(sent).as_micros() as u64);
                                    if d.allowed {
                                        admitted.lock().unwrap().push((sent, done, r));
                                    }
                                }
                                Err(e) if starvation(&e) => {
                                    starved.lock().unwrap().push((sent, r));
                                }
                                Err(e) => {
                                    eprintln!("region {r}: {e}");
                                    errors.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                    }),
                ));
            }
        }
    }

    pub fn offer(&self, rates: [u64; 3]) {
        for (o, r) in self.offered.iter().zip(rates) {
            o.store(r, Ordering::Relaxed);
        }
    }

    /// Stop every process of region `r`: its load (whose gates keep the region alive) and
    /// its refreshers.
    pub fn kill_region(&mut self, r: usize) {
        self.offered[r].store(0, Ordering::Relaxed);
        for (region, task) in &self.load {
            if *region == r {
                task.abort();
            }
        }
        for m in &mut self.members[r] {
            *m = None;
        }
    }

    /// Admitted requests per region in [from, to) (offsets from the start of the load).
    pub fn admitted_between(&self, from: Duration, to: Duration) -> [u64; 3] {
        let (a, b) = (self.started + from, self.started + to);
        let mut out = [0; 3];
        for &(_, t, r) in self.admitted.lock().unwrap().iter() {
            if t >= a && t < b {
                out[r] += 1;
            }
        }
        out
    }

    /// Requests sent per region in [from, to) (offsets from the start of the load).
    pub fn sent_between(&self, from: Duration, to: Duration) -> [u64; 3] {
        count_between(
            &self.sent.lock().unwrap(),
            self.started + from,
            self.started + to,
        )
    }

    /// Requests sent late (see [`Fleet::late`]) per region in [from, to).
    pub fn late_between(&self, from: Duration, to: Duration) -> [u64; 3] {
        count_between(
            &self.late.lock().unwrap(),
            self.started + from,
            self.started + to,
        )
    }

    /// Requests the machine's load failed (see [`Fleet::starved`]) per region, sent in
    /// [from, to) (offsets from the start of the load).
    pub fn starved_between(&self, from: Duration, to: Duration) -> [u64; 3] {
        count_between(
            &self.starved.lock().unwrap(),
            self.started + from,
            self.started + to,
        )
    }

    /// The most admitted (all regions together) in any window of length `w`, counting only
    /// decisions certainly made inside it (sent at or after its start, answered before its
    /// end: Redis decided between the two), and where it starts (offset from the start of
    /// the load). A stall of the client cannot make this exceed what Redis admitted.
    pub fn max_in_window(&self, w: Duration) -> (u64, Duration) {
        let mut spans: Vec<(Instant, Instant)> = self
            .admitted
            .lock()
            .unwrap()
            .iter()
            .map(|a| (a.0, a.1))
            .collect();
        spans.sort();
        let (mut best, mut at) = (0, Duration::ZERO);
        for i in 0..spans.len() {
            let (start, end) = (spans[i].0, spans[i].0 + w);
            let n = spans[i..]
                .iter()
                .take_while(|s| s.0 < end)
                .filter(|s| s.1 < end)
                .count() as u64;
            if n > best {
                best = n;
                at = start.saturating_duration_since(self.started);
            }
        }
        (best, at)
    }

    /// The bound on any window of `w`: rate × w + burst + one request per region (each
    /// region's bucket holds at least one).
    pub fn bound(w: Duration) -> u64 {
        (RATE as f64 * w.as_secs_f64()).ceil() as u64 + BURST + REGIONS.len() as u64
    }

    /// The share each region's leader last got.
    pub fn shares(&self) -> [u64; 3] {
        shares_of(&self.statuses())
    }

    /// Every process's status (`None`: a process stopped), per region.
    pub fn statuses(&self) -> Vec<Vec<Option<RegionStatus>>> {
        self.members
            .iter()
            .map(|procs| {
                procs
                    .iter()
                    .map(|m| m.as_ref().map(Region::status))
                    .collect()
            })
            .collect()
    }

    pub fn stop_load(&mut self) {
        for (_, t) in self.load.drain(..) {
            t.abort();
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.stop_load();
    }
}

/// Whether `e` is a failure of the machine's load rather than of the gate: a timeout (the
/// gate's own, or the connection's response timeout: a process or server starved of CPU),
/// or a refusal while the gate waits for its next probe after a failure. (That failure was
/// counted by itself: one that is not a timeout is in [`Fleet::errors`].)
fn starvation(e: &GateError) -> bool {
    match e {
        GateError::Timeout(_) | GateError::Degraded { .. } => true,
        GateError::Backend(b) => b
            .downcast_ref::<redis::RedisError>()
            .is_some_and(redis::RedisError::is_timeout),
        _ => false,
    }
}

/// The share each region's leader last got, in `statuses` (see [`Fleet::statuses`]).
pub fn shares_of(statuses: &[Vec<Option<RegionStatus>>]) -> [u64; 3] {
    by_leader(statuses, |s| {
        if s.lease_left > Duration::ZERO {
            s.share
        } else {
            s.safe
        }
    })
}

/// `value` of each region's leader's status in `statuses` (the largest, if more than one
/// says it leads; 0 without a leader).
pub fn by_leader(
    statuses: &[Vec<Option<RegionStatus>>],
    value: impl Fn(&RegionStatus) -> u64,
) -> [u64; 3] {
    let mut out = [0; 3];
    for (r, procs) in statuses.iter().enumerate() {
        out[r] = procs
            .iter()
            .flatten()
            .filter(|s| s.leader)
            .map(&value)
            .max()
            .unwrap_or(0);
    }
    out
}

fn count_between(log: &[(Instant, usize)], a: Instant, b: Instant) -> [u64; 3] {
    let mut out = [0; 3];
    for &(t, r) in log {
        if t >= a && t < b {
            out[r] += 1;
        }
    }
    out
}

/// The p-th percentile (0..=100) of `v`, by nearest rank.
pub fn percentile(v: &mut [u64], p: f64) -> u64 {
    if v.is_empty() {
        return 0;
    }
    v.sort_unstable();
    let rank = ((p / 100.0) * v.len() as f64).ceil().max(1.0) as usize;
    v[rank.min(v.len()) - 1]
}
