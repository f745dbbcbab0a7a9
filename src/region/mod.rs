//! One limit across regions: a global quota divided among regions (or instance groups)
//! that each decide against their **local** Redis, with the shares held as leases in one
//! **home** Redis.
//!
//! A limit that must hold across continents cannot ask one Redis per request (a cross-region
//! round trip is 100–200 ms). Here each region admits at its *share* of the global rate with
//! a [`RegionGate`] against its own Redis, at local latency; a background refresher in each
//! region reports the region's demand to the home and gets the region's next share as a
//! lease. The home Redis is the single writer (atomic Lua, its own clock): no extra server,
//! no election.
//!
//! ```text
//!            home Redis (one hash: every region's leases, demands; lua/region_home.lua)
//!              ▲  refresh every `refresh_every`: report demand, get a lease (share, TTL)
//!     ┌────────┼─────────────────┬──────────────────────┐
//!   region us (local Redis)    region eu              region ap
//!   lease record ◄── refresher  lease record            lease record
//!   buckets at the share ◄── RegionGate::check (local latency, every process of the region)
//! ```
//!
//! # Policies
//!
//! [`Allocation::Static`] splits by weight (50 % / 30 % / 20 %). [`Allocation::FairShare`]
//! (the default) and [`Allocation::ProportionalShare`] follow demand — what each region
//! admitted plus what it rejected, smoothed over refreshes — as Doorman does: with capacity
//! 120 and wants 1000 / 50 / 10, fair share gives 60 / 50 / 10.
//!
//! # The invariant, and the protocol that keeps it
//!
//! **At every instant, the shares the regions may admit at add up to at most the global
//! rate.** Shares are whole units of the quota's period, so this is exact. The home keeps,
//! per region, the largest rate the region may be admitting at — its safe share, or a lease
//! it may still be using — and grants a region at most what the others do not hold:
//!
//! 1. **Leases end early locally.** A refresh first reads the local Redis clock (`t0`), then
//!    asks the home. The home grants `(seq, share)` until `now_home + ttl`; the region writes
//!    the lease to expire at `t0 + ttl − margin` on its own clock. `t0` was read before the
//!    home ran the script, so the lease ends locally before it ends at the home, however late
//!    the reply arrives (the margin covers clock rate drift; Redis clocks may disagree in
//!    absolute time).
//! 2. **A share only grows after what it takes has stopped being used.** When the home
//!    shrinks region A, it keeps counting A's old lease until A proves it no longer uses it:
//!    A's next report names the lease it holds, and its local record takes only leases with a
//!    larger `seq`, so every older lease is dead for good. (A region whose share shrank tells
//!    the home at once, so the capacity moves within one refresh.) Otherwise the old lease
//!    counts until it expires. At most two leases per region are ever live: a region that has
//!    not reported holding its last lease gets that same lease again.
//! 3. **Safe shares are reserved.** A region whose lease expires falls to its
//!    [`SafeShare`] without asking anyone, so the home never grants a region's safe share to
//!    another. [`SafeShare::Closed`] (the default) reserves nothing.
//! 4. **A home that lost its state learns.** A home without state (first start, or a restart
//!    without persistence) cannot know the leases it granted before. For one lease length it
//!    grants each region at most what that region reports admitting at, and the region takes
//!    at most what it admits at when the grant lands (its report may predate a shrink the
//!    old home already gave away); by then every lease from before has expired, and the home
//!    knows every live lease again.
//!    [`QuotaAllocator::init_home`] skips this on a first deployment.
//!
//! [`model::Home`] is this protocol as pure math; `tests/region/model.rs` checks the invariant
//! over random interleavings of refreshes, lost and late replies, crashes, expiries and home
//! restarts, and runs the same traces through the Lua script.
//!
//! # Failures
//!
//! | what fails | what happens |
//! |---|---|
//! | the home Redis is unreachable | every region keeps its lease until it ends, then admits at its safe share |
//! | a region dies | its lease ends at its TTL; the others get its share (all but its safe share) |
//! | the home restarts empty | one lease length of learning: regions keep what they hold, nothing grows |
//! | no process of any region refreshes for a week (an allocator no longer in use) | the home's state expires, and so do each region's lease record and demand counters in its local Redis (a week, four lease lengths, or as long as the region's buckets are kept, whichever is longest, after the region's last refresh, or after the decision that made the counters again if its local Redis lost them since); a fleet that comes back after that learns for one lease length, as after a restart |
//! | the local Redis fails | the gate's [`FailurePolicy`](crate::gate::FailurePolicy) (`Error` by default; `Open` and `Fallback` admit outside the global bound) |
//! | the local Redis is full (`maxmemory` under `noeviction`) | it refuses every write, a new key's as a known one's: the gate's failure policy, as when it fails (under `Error`, a [`GateError::Backend`](crate::gate::GateError::Backend) with Redis's `OOM` first, then [`GateError::Degraded`](crate::gate::GateError::Degraded) until the next probe), counted under `policy`; every key is decided again at the first probe (within a refresh interval) after room frees. The refresher cannot write either: the region keeps its lease until it ends, then admits at its safe share |
//! | a region's refreshing process stops | it gives its lock up as it [leaves](Region::leave) the region (or in the background as its last handle drops, unless its runtime shuts down first); another process of the region refreshes at its next tick |
//! | a region's refreshing process dies, or cannot reach the home | another process takes over within three refresh intervals plus the home timeout (the lock lapses, at the latest a refresh interval and a home timeout before the lease in force ends, or is given up after two failed home calls), before the lease ends |
//! | a local Redis restarts empty (run without persistence) | the region admits at its safe share until its refresher writes the lease again, at its next refresh (the home grants the lease the region held, or a new one), with no restart of its processes; a key not used meanwhile starts with a full bucket, as on a first deployment: the region's part of the burst once more |
//! | a local Redis loses writes (restart without persistence, failover to a replica behind) | a reply in flight is not written over the older record; but a record that went back to a live older lease breaks the bound until that lease ends: run local Redis without persistence and without failover to lagging replicas, or with an append-only file synced on every write |
//!
//! The global burst is divided like the rate (each region's bucket holds its part of the
//! burst, at least one request), so over any window of length `w` the regions together
//! admit at most `rate × w + burst + regions` requests. A region never gains tokens by a
//! change of its share: its lease record keeps the shares it held before (six past
//! segments; past that, the two adjacent ones closest in share merged at the lower), and a bucket left untouched across a
//! change is refilled along them: a share that dipped in between (to 0, or the lease ran
//! out to a safe share of 0) empties it, and a key first seen after a share grew starts from
//! the smaller bucket, not a full new one. A region's first lease counts as held since ever
//! (a fresh deployment starts with full buckets: the `+ burst` of the bound).
//!
//! Requirements the bound rests on:
//!
//! - **Persistence**: run the home and the local Redis servers without persistence or with
//!   an append-only file synced on every write. A snapshot restored from the past holds old
//!   leases as if they were current (the home would not start a learning phase; a local
//!   record would admit at a lease the home has given away).
//! - **Memory**: give each local Redis room for a bucket per key in use (a bucket is kept
//!   a lease length plus `burst / rate` after it is full again), and keep its
//!   `maxmemory-policy` at `noeviction`. An evicting policy takes keys away instead of
//!   refusing writes: a bucket it evicts comes back full (admitting past the share), and
//!   a lease record it evicts drops the region to its safe share.
//! - **Clocks**: Redis `TIME` must not step (keep NTP slewing, not stepping): a home clock
//!   that jumps forward forgets leases early, a local clock that jumps back keeps them
//!   late. Rate drift is covered by a margin of 1 % of the lease.
//! - **One configuration**: every process lists the same regions (but while one is added
//!   or removed, below), capacity, safe shares and lease length. A lease length may change in a rolling deploy while the home keeps its
//!   state (the proptest runs processes on a shorter lease); a home that restarts meanwhile
//!   learns for the lease length of the first process that calls it.
//! - **Changing the global quota**: shares are whole units of the quota's period, so keep
//!   the period and change the count (per second 300 to per second 200): while processes
//!   of both run, each grants at most its own capacity less what the others hold, so the
//!   regions admit at most the larger of the two, and the new one once the leases granted
//!   under the old have ended. The home keeps the period its shares are in and refuses a
//!   process whose quota has another (the same 300/s written as 18 000 per minute: it would
//!   read 300 per second as 300 per minute and grant the rest again), a failed refresh, until
//!   no region holds a grant of the other period. A rolling deploy that changes the period
//!   therefore leaves the deployed regions at their safe shares until the last process of
//!   the old period has stopped and its leases have ended; and the processes of one region
//!   share its lease record, whose share each reads in its own period: stop a region's old
//!   processes before its new ones start.
//! - **Adding or removing a region**: the home counts the live leases of every region in
//!   its state, whether the calling process lists it or not (a deploy runs processes with
//!   both lists; a region no process lists is forgotten once its leases have ended and its
//!   demand is stale), but it reserves the safe shares of the regions the calling process
//!   lists and no others. A region with a safe share of 0 ([`SafeShare::Closed`], the
//!   default) is therefore added or removed in one rolling deploy, provided the other
//!   regions' safe shares stay as they are (a [`SafeShare::StaticWeight`] changes with the
//!   total weight). A region with a safe share changes in steps, as a process that does not
//!   list it may grant what the region admits at without a lease: to add one, list it in
//!   every process first (a region no process has joined holds nothing), wait a lease
//!   length (a lease granted before may still hold the safe share it reserves), then start
//!   its processes. To remove one, stop its processes first, then take it off every list (a
//!   process of it still running, cut off from the home even, admits at its safe share,
//!   which only the processes that list the region keep reserved).
//! - **Changing a safe share** (or the weights under [`SafeShare::StaticWeight`], which
//!   move the safe shares with them): each process reserves the safe shares it was built
//!   with, and a region falls to its own without asking. To raise a region's, deploy the
//!   processes of the other regions first, wait a lease length (a lease they granted before
//!   may still hold what the larger one reserves), then the region's own; to lower one,
//!   the region's own processes first, then the others.
//!
//! # Shutdown
//!
//! [`QuotaAllocator::join`] spawns the region's refresher on the current runtime; it runs
//! while any handle of the [`Region`] lives (a clone, a [`RegionGate`], a gate's call
//! finishing in the background), and is aborted when the last one drops. A process on its
//! way out calls [`Region::leave`]: it stops the refresher and gives the refresher lock up
//! before it returns, so another process of the region refreshes at its next tick. Dropping
//! the last handle gives the lock up too, but on a task of its own, which a runtime shut
//! down right after cancels (dropped outside any runtime, it cannot give it up at all):
//! the lock then lapses, within two refresh intervals and the home timeout, before the
//! lease ends. The lease record and buckets stay in the local Redis for the region's other
//! processes (the record a week at least, as the **Failures** table says; a bucket as the
//! **Memory** requirement above says); a process that joins again (a restart, the same
//! region joined again in this process) follows the one refreshing, or takes the lock
//! once it is free.
//!
//! # Metrics
//!
//! Labelled by `name` (the allocator) and `region`: `flowgate_region_share`,
//! `flowgate_region_demand` (units per period), `flowgate_region_utilisation` (admitted ÷
//! share over the last interval), `flowgate_region_lease_age_seconds` (age of the lease in
//! use, in every process of the region, refreshing or not; grows while the home is
//! unreachable), `flowgate_region_refreshes_total` by
//! `outcome` (`granted`, `failed`, `follower`); the gate's decisions and the Redis calls
//! as the [`gate`](crate::gate) module's.
//!
//! # Logs
//!
//! A failed refresh is a warning (fields `allocator`, `region`, `failures` — in a row —,
//! `redis` — `home` or `local`, the one that failed — and `error`) at the 1st, 2nd, 4th,
//! 8th … failure in a row, so an outage logs a few lines per process, not one per
//! interval; the first refresh that works after them says so at info (`failed`: how many
//! in a row it ends). A process that gave the refresher lock up and finds another holding
//! it counts on: its refreshes work again once the lease in use is fresh (the refreshing
//! process got a lease within a refresh interval and the home timeout).

mod config;
mod gate;
mod member;
pub mod model;
mod policy;
mod status;

pub use config::{QuotaAllocator, QuotaAllocatorBuilder, RegionSpec, SafeShare};
pub use gate::RegionGate;
pub use member::Region;
pub use policy::Allocation;
pub use status::{AllocatorStatus, HomeError, HomeRegion, RegionStatus};
