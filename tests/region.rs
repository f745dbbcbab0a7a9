//! One quota across regions: the lease protocol (model and Lua), and regions against real
//! `redis-server` processes from the harness, cross-region latency injected by a TCP delay
//! proxy.
#![cfg(feature = "redis")]

mod support;

#[path = "region/config.rs"]
mod config;
#[path = "region/deploy.rs"]
mod deploy;
#[path = "region/e2e.rs"]
mod e2e;
#[path = "region/fleet.rs"]
mod fleet;
#[path = "region/handover.rs"]
mod handover;
#[path = "region/history.rs"]
mod history;
#[cfg(all(feature = "http", feature = "metrics"))]
#[path = "region/http_edge.rs"]
mod http_edge;
#[path = "region/journeys.rs"]
mod journeys;
#[path = "region/model.rs"]
mod model;
#[cfg(feature = "metrics")]
#[path = "region/refresher.rs"]
mod refresher;
#[path = "region/shutdown.rs"]
mod shutdown;
#[path = "region/status.rs"]
mod status;
