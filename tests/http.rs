//! The HTTP layers against real servers on 127.0.0.1:0 and a real HTTP client (hyper's):
//! statuses, the IETF fields as a Structured Fields parser reads them, trusted proxies,
//! shadow mode, shedding, Redis failures and tower's keep-alive / clone-after-ready rules.

mod support;

#[path = "../benches/support/alloc.rs"]
mod alloc;

/// Counts each thread's allocations, for the tests that assert a path allocates nothing
/// (or a bounded number of times).
#[global_allocator]
static GLOBAL: alloc::CountingAlloc = alloc::CountingAlloc;

#[path = "http/harness.rs"]
mod harness;

#[path = "http/shed.rs"]
mod shed;

#[path = "http/rate_limit.rs"]
mod rate_limit;

#[path = "http/outbound.rs"]
mod outbound;

#[path = "http/client_ip.rs"]
mod client_ip;
#[path = "http/contract.rs"]
mod contract;

#[path = "http/h2.rs"]
mod h2;

#[path = "support/raw_http.rs"]
mod raw_http;

#[path = "http/downstreams.rs"]
mod downstreams;

#[path = "http/why.rs"]
mod why;

#[path = "http/journey.rs"]
mod journey;

#[path = "http/meet.rs"]
mod meet;

#[path = "http/overload.rs"]
mod overload;

#[path = "http/keys.rs"]
mod keys;

#[path = "http/outage.rs"]
mod outage;

#[path = "http/interop.rs"]
mod interop;

#[path = "http/graceful.rs"]
mod graceful;

#[path = "http/rollout.rs"]
mod rollout;
