//! converged node daemon: the FUSE adapter, the filesystem core, the local
//! chunk store and the command line.

pub mod admin;
pub mod blocks;
pub mod chunkstore;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod control;
pub mod core;
mod daemon;
pub mod devcluster;
pub mod error;
mod fuse;
mod identity;
pub mod kernel_handles;
pub mod latency;
pub mod metrics;
#[cfg(any(test, feature = "test-util"))]
pub mod object_faults;
pub mod objects;
pub mod placement;
#[cfg(any(test, feature = "test-util"))]
pub mod refmodel;
mod remote;
pub mod remount;
pub mod supervise;
pub mod tier;
pub mod volume;
pub mod workers;
