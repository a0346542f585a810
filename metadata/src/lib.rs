//! converged metadata: the namespace (inodes, dentries, symlinks, hard links,
//! xattrs, file layouts) over a transactional key-value engine.
//!
//! The engine is chosen by URI ([`open_engine`]): `redb:///path` (embedded, the
//! default) or `memory:` (tests). Every namespace operation is one transaction.

pub mod acl;
pub mod error;
mod group_commit;
pub mod held_locks;
pub mod kv;
pub mod kv_cache;
pub mod kv_deferred;
pub mod kv_etcd;
#[cfg(any(test, feature = "test-util"))]
pub mod kv_fault;
pub mod kv_mem;
pub mod kv_redb;
pub mod membership;
mod namespace;
pub mod ops;
mod record_cache;
pub mod round_trips;
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
pub use namespace::{volume_exists, Namespace, LINK_MAX};

/// Timing of metadata transactions for whoever hosts the namespace (the
/// daemon's latency histograms): set once per process; unset, nothing is timed.
static TXN_OBSERVER: std::sync::OnceLock<fn(&'static str, Duration)> = std::sync::OnceLock::new();

/// Have `f` told the kind (`read`, `write`, `write_durable`, `sync`) and
/// duration of every metadata transaction, conflict retries included.
pub fn set_txn_observer(f: fn(&'static str, Duration)) {
    let _ = TXN_OBSERVER.set(f);
}

pub(crate) fn timed<T>(kind: &'static str, f: impl FnOnce() -> T) -> T {
    match TXN_OBSERVER.get() {
        None => f(),
        Some(observe) => {
            let start = std::time::Instant::now();
            let r = f();
            observe(kind, start.elapsed());
            r
        }
    }
}
pub use ops::holders::HeldWalk;
pub use ops::layout::{
    chunk_held_by, lease_holder_of, next_version, Seal, SessionEnd, SweepFacts, CREATE_LEASE, SWEEP_FACTS_BATCH,
};
pub use ops::nodes::{NodeAdmin, Rebalance};
pub use ops::tier::{ImportEntry, UploadEnd, UploadStart};
pub use ops::xattr::{XATTR_NAME_MAX, XATTR_SIZE_MAX};
pub use ops::{AtimeRule, Unlinked};
pub use types::{ChunkRecord, ROOT_INO as ROOT};

/// A metadata URI, parsed but not yet opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetaUri {
    /// `redb:///absolute/path/meta.redb`
    Redb(PathBuf),
    /// `memory:` — nothing persists; for tests.
    Memory,
    /// `etcd://host1:2379,host2:2379/volume` — a shared etcd cluster;
    /// `etcds://…/volume?ca=…&cert=…&key=…&user=…&password_file=…` over TLS
    /// with a client certificate and an etcd user.
    Etcd { endpoints: Vec<String>, volume: String, access: EtcdAccess },
}

/// How a client reaches etcd beyond its addresses: TLS (`etcds://`), the CA
/// that signed etcd's certificate, this client's certificate and key, and
/// an etcd user whose password is read from a file (never from the URI:
/// URIs show in `ps`, mount tables and logs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdAccess {
    pub tls: bool,
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub user: Option<String>,
    pub password_file: Option<PathBuf>,
}

impl EtcdAccess {
    fn parse(uri: &str, tls: bool, query: Option<&str>) -> Result<Self, UriError> {
        let mut a = EtcdAccess { tls, ..Default::default() };
        let bad = |what: String| UriError::EtcdAccess { uri: uri.into(), what };
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let Some((k, v)) = pair.split_once('=').filter(|(_, v)| !v.is_empty()) else {
                return Err(bad(format!("{pair:?} is not key=value")));
            };
            let file = || -> Result<Option<PathBuf>, UriError> {
                if v.starts_with('/') {
                    Ok(Some(PathBuf::from(v)))
                } else {
                    Err(bad(format!("{k} must be an absolute path, got {v:?}")))
                }
            };
            match k {
                "ca" => a.ca = file()?,
                "cert" => a.cert = file()?,
                "key" => a.key = file()?,
                "password_file" => a.password_file = file()?,
                "user" => a.user = Some(v.to_string()),
                "password" => {
                    return Err(bad(
                        "a password in the URI would show in ps and the mount table; use password_file=/path".into(),
                    ))
                }
                _ => return Err(bad(format!("unknown option {k:?} (known: ca, cert, key, user, password_file)"))),
            }
        }
        if !tls && (a.ca.is_some() || a.cert.is_some() || a.key.is_some()) {
            return Err(bad("ca, cert and key are TLS options: use etcds://".into()));
        }
        if a.cert.is_some() != a.key.is_some() {
            return Err(bad("cert and key go together".into()));
        }
        if a.user.is_some() != a.password_file.is_some() {
            return Err(bad("user and password_file go together".into()));
        }
        Ok(a)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum UriError {
    #[error("metadata URI {0:?} has no scheme; expected redb:///path or memory:")]
    NoScheme(String),
    #[error("metadata URI {uri:?}: unknown scheme {scheme:?}; supported: redb, etcd, etcds, memory")]
    UnknownScheme { uri: String, scheme: String },
    #[error("metadata URI {0:?}: redb needs an absolute path, as in redb:///nvme/converged/meta.redb")]
    RedbPath(String),
    #[error("metadata URI {0:?}: etcd needs endpoints and a volume name, as in etcd://m1:2379,m2:2379/vol1")]
    EtcdForm(String),
    #[error("metadata URI {uri:?}: {what}")]
    EtcdAccess { uri: String, what: String },
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
            "etcd" | "etcds" => {
                let bad = || UriError::EtcdForm(uri.into());
                let rest = rest.strip_prefix("//").ok_or_else(bad)?;
                let (rest, query) = match rest.split_once('?') {
                    Some((r, q)) => (r, Some(q)),
                    None => (rest, None),
                };
                let access = EtcdAccess::parse(uri, scheme == "etcds", query)?;
                let (hosts, volume) = rest.split_once('/').ok_or_else(bad)?;
                let endpoints: Vec<String> = hosts.split(',').map(str::to_string).collect();
                let host_ok = |h: &String| {
                    h.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
                };
                let volume_ok = !volume.is_empty()
                    && volume.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
                if endpoints.iter().all(host_ok) && volume_ok {
                    Ok(MetaUri::Etcd { endpoints, volume: volume.into(), access })
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
        MetaUri::Etcd { endpoints, volume, access } => {
            Arc::new(EtcdKv::connect_with(endpoints, volume, access, Duration::from_secs(5))?)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etcd_uris_carry_tls_and_user_options() {
        let u: MetaUri =
            "etcds://m1:2379,m2:2379/vol1?ca=/e/ca.pem&cert=/e/n1.pem&key=/e/n1.key&user=conv&password_file=/e/pw"
                .parse()
                .unwrap();
        let MetaUri::Etcd { endpoints, volume, access } = u else { panic!("not etcd") };
        assert_eq!(endpoints, ["m1:2379", "m2:2379"]);
        assert_eq!(volume, "vol1");
        assert!(access.tls);
        assert_eq!(access.cert.as_deref(), Some(std::path::Path::new("/e/n1.pem")));
        assert_eq!(access.user.as_deref(), Some("conv"));
        let plain: MetaUri = "etcd://m1:2379/v".parse().unwrap();
        assert!(matches!(plain, MetaUri::Etcd { access, .. } if access == EtcdAccess::default()));
    }

    /// The lock rule's check itself: a namespace transaction started while
    /// a counted lock is held panics (debug and test builds), naming it.
    #[test]
    #[cfg_attr(debug_assertions, should_panic(expected = "a KV read started while this thread holds 1"))]
    fn a_kv_transaction_under_an_in_memory_lock_trips_the_lock_check() {
        let ns = Namespace::open(std::sync::Arc::new(kv_mem::MemKv::default()), 0, 0).unwrap();
        let lock = held_locks::Mutex::new(());
        ns.getattr(types::ROOT_INO).expect("no lock held: allowed");
        let _held = lock.lock();
        let _ = ns.getattr(types::ROOT_INO);
    }

    #[test]
    fn bad_etcd_access_options_say_what_is_wrong() {
        for (uri, says) in [
            ("etcd://m1:2379/v?ca=/e/ca.pem", "etcds://"),
            ("etcds://m1:2379/v?cert=/e/c.pem", "go together"),
            ("etcds://m1:2379/v?user=a", "go together"),
            ("etcds://m1:2379/v?user=a&password=hunter2", "password_file"),
            ("etcds://m1:2379/v?ca=relative.pem", "absolute"),
            ("etcds://m1:2379/v?colour=blue", "unknown option"),
        ] {
            let e = uri.parse::<MetaUri>().unwrap_err().to_string();
            assert!(e.contains(says), "{uri}: {e}");
        }
    }
}
