//! converged metadata: the namespace (inodes, dentries, symlinks, hard links,
//! xattrs, file layouts) over a transactional key-value engine.
//!
//! The engine is chosen by URI ([`open_engine`]): `redb:///path` (embedded, the
//! default) or `memory:` (tests). Every namespace operation is one transaction.

pub mod error;
pub mod kv;
pub mod kv_cache;
pub mod kv_etcd;
pub mod kv_fault;
pub mod kv_mem;
pub mod kv_redb;
pub mod membership;
mod namespace;
pub mod ops;
pub mod schema;
pub mod types;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use error::{MetaError, MetaResult};
pub use kv::{ChangeFeed, Durability, KvEngine, KvError};
pub use kv_cache::CachedKv;
pub use kv_etcd::EtcdKv;
pub use kv_mem::MemKv;
pub use kv_redb::RedbKv;
pub use namespace::{Namespace, LINK_MAX};
pub use ops::layout::{next_version, Seal, CREATE_LEASE};
pub use ops::nodes::{NodeAdmin, Rebalance};
pub use ops::tier::{ImportEntry, UploadEnd, UploadStart};
pub use ops::xattr::{XATTR_NAME_MAX, XATTR_SIZE_MAX};
pub use ops::Unlinked;
pub use types::{ChunkRecord, ROOT_INO as ROOT};

/// A metadata URI, parsed but not yet opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetaUri {
    /// `redb:///absolute/path/meta.redb`
    Redb(PathBuf),
    /// `memory:` — nothing persists; for tests.
    Memory,
    /// `etcd://host1:2379,host2:2379/volume` — a shared etcd cluster.
    Etcd { endpoints: Vec<String>, volume: String },
}

#[derive(Debug, thiserror::Error)]
pub enum UriError {
    #[error("metadata URI {0:?} has no scheme; expected redb:///path or memory:")]
    NoScheme(String),
    #[error("metadata URI {uri:?}: unknown scheme {scheme:?}; supported: redb, etcd, memory")]
    UnknownScheme { uri: String, scheme: String },
    #[error("metadata URI {0:?}: redb needs an absolute path, as in redb:///nvme/converged/meta.redb")]
    RedbPath(String),
    #[error("metadata URI {0:?}: etcd needs endpoints and a volume name, as in etcd://m1:2379,m2:2379/vol1")]
    EtcdForm(String),
}

impl std::str::FromStr for MetaUri {
    type Err = UriError;
    fn from_str(uri: &str) -> Result<Self, UriError> {
        let Some((scheme, rest)) = uri.split_once(':') else {
            return Err(UriError::NoScheme(uri.into()));
        };
        match scheme {
            "redb" => {
                let path = rest.strip_prefix("//").unwrap_or(rest);
                if !path.starts_with('/') || path.len() < 2 || path.ends_with('/') {
                    return Err(UriError::RedbPath(uri.into()));
                }
                Ok(MetaUri::Redb(PathBuf::from(path)))
            }
            "memory" if rest.is_empty() || rest == "//" => Ok(MetaUri::Memory),
            "etcd" => {
                let bad = || UriError::EtcdForm(uri.into());
                let rest = rest.strip_prefix("//").ok_or_else(bad)?;
                let (hosts, volume) = rest.split_once('/').ok_or_else(bad)?;
                let endpoints: Vec<String> = hosts.split(',').map(str::to_string).collect();
                let host_ok = |h: &String| {
                    h.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
                };
                let volume_ok = !volume.is_empty()
                    && volume.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
                if endpoints.iter().all(host_ok) && volume_ok {
                    Ok(MetaUri::Etcd { endpoints, volume: volume.into() })
                } else {
                    Err(bad())
                }
            }
            _ => Err(UriError::UnknownScheme { uri: uri.into(), scheme: scheme.into() }),
        }
    }
}

/// Open the engine a URI names.
pub fn open_engine(uri: &MetaUri) -> Result<Arc<dyn KvEngine>, KvError> {
    Ok(match uri {
        MetaUri::Redb(path) => Arc::new(RedbKv::open(path, Duration::from_secs(10))?),
        MetaUri::Memory => Arc::new(MemKv::new()),
        MetaUri::Etcd { endpoints, volume } => Arc::new(EtcdKv::connect(endpoints, volume, Duration::from_secs(5))?),
    })
}
