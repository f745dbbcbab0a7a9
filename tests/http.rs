//! The HTTP layers against real servers on 127.0.0.1:0 and a real HTTP client (hyper's):
//! statuses, the IETF fields as a Structured Fields parser reads them, trusted proxies,
//! shadow mode, shedding, Redis failures and tower's keep-alive / clone-after-ready rules.

mod support;

#[path = "support/alloc.rs"]
mod alloc;

#[path = "http/harness.rs"]
mod harness;

#[path = "http/shed.rs"]
mod shed;

#[path = "http/rate_limit.rs"]
mod rate_limit;

#[path = "http/outbound.rs"]
mod outbound;

#[path = "http/contract.rs"]
mod contract;
#[path = "http/client_ip.rs"]
mod client_ip;
