//! The client packages (`clients/python`, `clients/node`), each running its own test
//! suite against live gateways started from this build's binary, on a database of its own.

pub mod node;
mod python;
