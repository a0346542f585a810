//! converged node daemon: the FUSE adapter, the filesystem core, the local
//! chunk store and the command line.

pub mod chunkstore;
pub mod cli;
pub mod cluster;
pub mod core;
pub mod devcluster;
pub mod error;
mod fuse;
pub mod placement;
mod remote;
