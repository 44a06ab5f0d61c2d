//! The integration tests, one module per area, linked into a single test binary: linking
//! two dozen binaries against the gateway took longer than running most of them.
//!
//! Each test still gets its own database and its own gateway (see `common`), so the
//! tests of every area run in parallel in this one process. Run one area with
//! `cargo test --test it delivery::`, one test with its full path.

mod common;

mod apply;
mod batches;
mod cli;
mod client;
mod clients;
mod configuration;
mod console;
mod console_browser;
mod consumption;
mod delivery;
mod deploy;
mod docs;
mod engines;
mod examples;
mod faithful;
mod filters;
mod first_run;
mod flow_control;
mod fuzz;
mod image;
mod kafka_sinks;
mod observability;
mod operations;
mod publish;
mod push;
mod readme;
mod refusals;
mod relay;
mod replicas;
mod security;
mod shaping;
mod sinks;
mod sources;
mod time_controls;
mod transactions;
mod triage;
mod upgrade;
