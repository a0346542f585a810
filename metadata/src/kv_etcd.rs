//! `EtcdKv`: the cluster engine, several nodes sharing one etcd cluster.
//!
//! Transactions are optimistic: reads happen at one pinned revision and are
//! remembered with their mod revisions; commit is a single etcd `Txn` that
//! compares them all (and, for scanned ranges, that nothing in the range
//! changed since) before applying the writes, and reports
//! [`KvError::Conflict`] when another writer got there first. Every volume
//! lives under its own key prefix. Each call has a deadline.
//!
//! Two connections, two runtimes. Reads and commits go over one driven by
//! no thread of its own: the thread that waits for an answer runs the
//! connection itself (tokio's current-thread runtime, entered by each
//! caller's `block_on`), so a round trip from a lone caller costs no thread
//! switch in this process, and a thread waiting for etcd holds no other
//! thread busy. The change feed, which must be read while nobody asks
//! anything, has a connection and a thread of its own (`EtcdKv::feed`,
//! the `etcd-feed` thread), started with the first watch.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, DeleteOptions, GetOptions, PutOptions, Txn, TxnOp, WatchOptions,
};

use crate::group_commit::{self, Group, Limits, Span};
use crate::kv::{
    merge_pending, pending_deletes, ChangeFeed, Durability, KvEngine, KvError, KvRead, KvResult, KvWrite,
    PendingWrites, RevisionFeed, Versioned,
};
use crate::membership::{Heartbeat, Member, Membership, NodeInfo};
use crate::round_trips::{self, RoundTrip};
use crate::schema;

use crate::kv::Pairs;
/// A key's value (None: absent) and its mod revision (0: absent).
type Versions = (Option<Vec<u8>>, i64);

pub struct EtcdKv {
    /// Current-thread runtime of `client`, driven by the callers of `run`.
    rt: tokio::runtime::Runtime,
    client: Client,
    /// Where and how to connect again, for the change feed's connection.
    urls: Vec<String>,
    opts: ConnectOptions,
    /// The change feed's runtime, made by the first watch.
    feed: std::sync::OnceLock<tokio::runtime::Runtime>,
    prefix: Vec<u8>,
    timeout: Duration,
    /// This node's lease: id, keep-alive channel, node id. The lock is a
    /// leaf, held only to move the lease in or out, never across a round
    /// trip.
    lease: parking_lot::Mutex<LeaseSlot>,
    /// Told when a heartbeat puts the lease back (a `leave` waits for it).
    lease_back: parking_lot::Condvar,
    /// This client's own commits, so the change feed can skip them (this
    /// node already knows what it changed).
    own: Arc<OwnCommits>,
    /// Commits from this node's threads that meet share a transaction
    /// (unless `alone`).
    group: Group<Compare, TxnOp, Answer>,
    alone: bool,
}

/// A sent transaction's response, shared by the commits that went out in
/// it. The answers of its operations are copied out of the response once,
/// at the first commit that asks (etcd_client copies all of them on every
/// call), and only when one does.
struct Answer {
    resp: etcd_client::TxnResponse,
    ops: std::sync::OnceLock<Vec<etcd_client::TxnOpResponse>>,
}

impl Answer {
    fn new(resp: etcd_client::TxnResponse) -> Self {
        Answer { resp, ops: std::sync::OnceLock::new() }
    }

    /// The answer of operation `i` of the transaction.
    fn op(&self, i: usize) -> Option<&etcd_client::TxnOpResponse> {
        self.ops.get_or_init(|| self.resp.op_responses()).get(i)
    }
}

/// etcd's defaults: `--max-txn-ops` 128 (compares and operations each) and
/// `--max-request-bytes` 1.5 MiB, kept well under.
const GROUP_LIMITS: Limits = Limits { ops: 128, bytes: 1 << 20, members: 64 };
/// What a request spends per compare or operation besides its key and value.
const OP_OVERHEAD: usize = 16;

/// Own revisions remembered for the change feed.
const OWN_REVISIONS: usize = 4096;

/// How often a watch that heard nothing asks etcd to confirm it is current
/// (a progress request on the watch's own stream: one small message each
/// way, no request of its own).
const WATCH_PROBE: Duration = Duration::from_secs(1);
/// A watch that neither delivers events nor answers its probes for this
/// long is taken for broken (see `EtcdKv::watch`).
pub const WATCH_SILENCE: Duration = Duration::from_secs(4);

/// The revisions of this client's commits, and the commits still waiting
/// for their answer. On loopback the watch often delivers a commit's event
/// before the commit's own answer arrives: an event whose revision is not
/// known yet is held until every commit that was in flight when it arrived
/// has answered, so an own change is never mistaken for another node's
/// (which would evict it from the cache and from the kernel).
#[derive(Default)]
struct OwnCommits {
    state: parking_lot::Mutex<OwnState>,
    answered: tokio::sync::Notify,
}

#[derive(Default)]
struct OwnState {
    next_ticket: u64,
    in_flight: std::collections::BTreeSet<u64>,
    /// The revisions this client's recent commits took, the lowest
    /// dropped first past [`OWN_REVISIONS`] (a set: each change the feed
    /// reports is looked up here, several per commit).
    revisions: std::collections::BTreeSet<i64>,
}

/// A commit in flight; its answer (a revision, or none) is recorded on drop.
struct InFlight<'a> {
    own: &'a OwnCommits,
    ticket: u64,
    revision: Option<i64>,
}

impl OwnCommits {
    fn begin(&self) -> InFlight<'_> {
        let mut st = self.state.lock();
        let ticket = st.next_ticket;
        st.next_ticket += 1;
        st.in_flight.insert(ticket);
        InFlight { own: self, ticket, revision: None }
    }

    /// Whether the change at `revision` is this client's own: waits (up to
    /// `limit`) for the commits in flight now to answer first.
    async fn is_own(&self, revision: i64, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        let upto = self.state.lock().next_ticket;
        loop {
            let answered = self.answered.notified();
            {
                let st = self.state.lock();
                if st.revisions.contains(&revision) {
                    return true;
                }
                if st.in_flight.first().is_none_or(|t| *t >= upto) {
                    return false;
                }
            }
            if tokio::time::timeout_at(deadline, answered).await.is_err() {
                return false;
            }
        }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut st = self.own.state.lock();
        st.in_flight.remove(&self.ticket);
        if let Some(rev) = self.revision {
            st.revisions.insert(rev);
            if st.revisions.len() > OWN_REVISIONS {
                st.revisions.pop_first();
            }
        }
        drop(st);
        self.own.answered.notify_waiters();
    }
}

/// Where this node's lease is. The transitions: `register` puts one
/// `Here` (unless the node `Left`: then it revokes what it was granted);
/// `heartbeat` takes it `Out` for its round trips and puts it back
/// (`EtcdKv::put_back`); `leave` waits for a heartbeat to put it back (its
/// round trips have deadlines), takes it away and revokes it, leaving the
/// slot `Left`; if the heartbeat outlasts the wait, `leave` marks the slot
/// `Leaving` and the heartbeat revokes the lease when it puts it back.
#[derive(Default)]
enum LeaseSlot {
    /// Not registered yet.
    #[default]
    None,
    Here(Box<Lease>),
    /// A heartbeat holds it for its round trips.
    Out,
    /// Left while a heartbeat held it.
    Leaving,
    /// Left: no lease is held again.
    Left,
}

struct Lease {
    id: i64,
    ttl: Duration,
    node: String,
    keeper: etcd_client::LeaseKeeper,
    answers: etcd_client::LeaseKeepAliveStream,
    /// The record as last written, and when.
    recorded: (NodeInfo, std::time::Instant),
}

/// TLS and user options for the client, reading the files `access` names.
fn connect_options(access: &crate::EtcdAccess, timeout: Duration) -> KvResult<ConnectOptions> {
    let read = |what: &str, p: &std::path::Path| {
        std::fs::read(p)
            .map_err(|e| KvError::Backend { msg: format!("etcd {what} {}: {e}", p.display()), retryable: false })
    };
    let mut opts = ConnectOptions::new().with_connect_timeout(timeout).with_timeout(timeout);
    if access.tls {
        let mut tls = etcd_client::TlsOptions::new();
        if let Some(ca) = &access.ca {
            tls = tls.ca_certificate(etcd_client::Certificate::from_pem(read("CA file", ca)?));
        }
        if let (Some(cert), Some(key)) = (&access.cert, &access.key) {
            tls = tls.identity(etcd_client::Identity::from_pem(read("certificate", cert)?, read("key", key)?));
        }
        opts = opts.with_tls(tls);
    }
    if let (Some(user), Some(file)) = (&access.user, &access.password_file) {
        let password =
            String::from_utf8_lossy(&read("password file", file)?).trim_end_matches(['\n', '\r']).to_string();
        // Tokens expire (and a simple token is only valid on the member
        // that issued it): log in again when etcd says so.
        opts = opts.with_user(user, password).with_auto_token_refresh(true);
    }
    Ok(opts)
}

/// Whether a failed connect may succeed later by itself: etcd not up yet,
/// or not reachable. Refused credentials and bad arguments will not.
fn unreachable(e: &etcd_client::Error) -> bool {
    use etcd_client::Error as E;
    // A TLS refusal (a bad or missing certificate, an unknown CA) is named
    // somewhere in the cause chain, whatever kind the top error is.
    let chain = explain(e).to_lowercase();
    if ["certificate", "handshake", "unknownca", "unknown ca", "alert", "tls"].iter().any(|w| chain.contains(w)) {
        return false;
    }
    match e {
        E::IoError(_) | E::TransportError(_) => true,
        E::GRpcStatus(s) => {
            matches!(s.code(), tonic_code::Unavailable | tonic_code::DeadlineExceeded | tonic_code::Unknown)
        }
        _ => false,
    }
}

use tonic::Code as tonic_code;

/// Whether a request failed on its connection (reset, closed under it, not
/// made again yet) rather than being answered by etcd: a read may go again.
fn connection_failed(e: &etcd_client::Error) -> bool {
    unreachable(e) || matches!(e, etcd_client::Error::GRpcStatus(s) if s.code() == tonic_code::Cancelled)
}

/// What to check when a TLS connection fails without saying why (etcd with
/// `--client-cert-auth` closes the stream on a client with no certificate).
fn hint(access: &crate::EtcdAccess, e: &etcd_client::Error) -> &'static str {
    let transport = match e {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        etcd_client::Error::GRpcStatus(s) => matches!(
            s.code(),
            tonic_code::Unknown | tonic_code::Unavailable | tonic_code::Cancelled | tonic_code::DeadlineExceeded
        ),
        _ => false,
    };
    // Nothing listening is not a refusal: no hint about certificates then.
    let down = explain(e).to_lowercase().contains("connection refused");
    match (transport && !down, access.tls, access.cert.is_some()) {
        (true, true, false) => {
            " (no client certificate was given: an etcd started with --client-cert-auth refuses the TLS \
             connection; add cert=/path&key=/path to the URI)"
        }
        (true, false, _) => " (if this etcd serves TLS, use etcds:// with ca=, cert= and key=)",
        _ => "",
    }
}

/// The error with its causes: tonic's transport errors put the reason (a
/// refused certificate, a closed port) in their source chain.
fn explain(e: &etcd_client::Error) -> String {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        let part = s.to_string();
        if !msg.contains(&part) {
            msg.push_str(": ");
            msg.push_str(&part);
        }
        src = s.source();
    }
    if let etcd_client::Error::GRpcStatus(s) = e {
        if s.code() == tonic_code::Unauthenticated || s.code() == tonic_code::PermissionDenied {
            msg.push_str(" (check the etcd user and password_file)");
        }
    }
    msg
}

fn transient(e: impl std::fmt::Display) -> KvError {
    KvError::Backend { msg: format!("etcd: {e}"), retryable: true }
}

/// An etcd error, retryable unless etcd refused the request itself (too
/// many operations in a transaction, a request too large, no permission):
/// sending it again cannot help. (An expired token is retryable: the client
/// logs in again.) A full database is [`KvError::NoSpace`]: the caller
/// gets `ENOSPC` at once, not `EIO` after seconds of retries that cannot help.
fn from_etcd(e: etcd_client::Error) -> KvError {
    if is_quota_full(&e) {
        say_quota_full();
        return KvError::NoSpace;
    }
    let refused = matches!(
        &e,
        etcd_client::Error::GRpcStatus(s)
            if matches!(s.code(), tonic_code::InvalidArgument | tonic_code::PermissionDenied)
    );
    KvError::Backend { msg: format!("etcd: {e}"), retryable: !refused }
}

/// etcd's answer to a write while its NOSPACE alarm is raised: its
/// database reached `--quota-backend-bytes`. Until an operator compacts,
/// defragments and disarms the alarm, etcd serves reads and deletes and
/// refuses every transaction that puts a key: every namespace change does,
/// a removal's included (it updates the parent).
fn is_quota_full(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s)
        if s.code() == tonic_code::ResourceExhausted && s.message().contains("database space exceeded"))
}

/// Say, at most once a minute, that etcd's database is full and what an
/// operator does about it: every change on every node fails until then.
fn say_quota_full() {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let last = LAST.load(Relaxed);
    // One caller a minute wins the exchange and says it.
    if now >= last + 60 && LAST.compare_exchange(last, now, Relaxed, Relaxed).is_ok() {
        tracing::error!(
            "etcd's database is full (its --quota-backend-bytes; the NOSPACE alarm is raised): every namespace \
             change fails with ENOSPC until it is compacted, defragmented and the alarm disarmed \
             (etcdctl compact, etcdctl defrag, etcdctl alarm disarm)"
        );
    }
}

impl EtcdKv {
    /// Connect to `endpoints` (`host:port`) over plain TCP and use the keys under `<volume>/`.
    pub fn connect(endpoints: &[String], volume: &str, timeout: Duration) -> KvResult<Self> {
        Self::connect_with(endpoints, volume, &crate::EtcdAccess::default(), timeout)
    }

    /// Connect as `access` says (TLS, client certificate, user) and use the
    /// keys under `<volume>/`. A service that does not answer yet is a
    /// retryable error; a refused certificate or password, or an unreadable
    /// file, is not.
    pub fn connect_with(
        endpoints: &[String],
        volume: &str,
        access: &crate::EtcdAccess,
        timeout: Duration,
    ) -> KvResult<Self> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(KvError::backend)?;
        let scheme = if access.tls { "https" } else { "http" };
        let urls: Vec<String> =
            endpoints.iter().map(|e| if e.contains("://") { e.clone() } else { format!("{scheme}://{e}") }).collect();
        let opts = connect_options(access, timeout)?;
        let client = rt
            .block_on(async {
                let mut client = Client::connect(&urls, Some(opts.clone())).await?;
                // Connecting is lazy; ask once so a wrong address or a refused
                // credential fails here. The key is the volume's own: a user
                // may be allowed no other.
                client.get(format!("{volume}/"), None).await?;
                Ok::<_, etcd_client::Error>(client)
            })
            .map_err(|e| KvError::Backend {
                msg: format!("etcd at {}: {}{}", urls.join(","), explain(&e), hint(access, &e)),
                retryable: unreachable(&e),
            })?;
        Ok(Self {
            rt,
            client,
            urls,
            opts,
            feed: std::sync::OnceLock::new(),
            prefix: format!("{volume}/").into_bytes(),
            timeout,
            lease: Default::default(),
            lease_back: Default::default(),
            own: Default::default(),
            group: Group::new(GROUP_LIMITS),
            alone: false,
        })
    }

    /// Every commit in a transaction of its own (no group commit): what
    /// etcd itself gives, for `examples/etcd_rate.rs`.
    pub fn alone(mut self) -> Self {
        self.alone = true;
        self
    }

    fn key(&self, k: &[u8]) -> Vec<u8> {
        let mut out = self.prefix.clone();
        out.extend_from_slice(k);
        out
    }

    fn run<T, F: Future<Output = Result<T, etcd_client::Error>>>(&self, f: F) -> KvResult<T> {
        self.run_raw(f)?.map_err(from_etcd)
    }

    /// [`EtcdKv::run`], etcd's own error left as it is for the caller to
    /// tell apart; no answer by the deadline is an error already.
    fn run_raw<T, F: Future<Output = Result<T, etcd_client::Error>>>(
        &self,
        f: F,
    ) -> KvResult<Result<T, etcd_client::Error>> {
        self.rt.block_on(async {
            tokio::time::timeout(self.timeout, f)
                .await
                .map_err(|_| transient(format!("no answer within {:?}", self.timeout)))
        })
    }

    /// Renew `lease` (taken out of `self.lease`: no lock is held across
    /// the round trips). Whether it is alive: `false` when etcd answers
    /// that it is gone; an error when etcd cannot be asked.
    fn renew(&self, lease: &mut Lease) -> KvResult<bool> {
        round_trips::count(RoundTrip::Lease);
        let on_stream = self.run(async {
            lease.keeper.keep_alive().await?;
            lease.answers.message().await
        });
        match on_stream {
            Ok(Some(answer)) => Ok(answer.ttl() > 0),
            // The keepalive stream broke (its connection was reset, the
            // member it reached restarted): that says nothing of the lease.
            // A new stream's first keepalive renews it, or finds it gone.
            Ok(None) | Err(_) => {
                round_trips::count(RoundTrip::Lease);
                let mut client = self.client.clone();
                match self.run_raw(client.lease_keep_alive(lease.id))? {
                    Ok((keeper, answers)) => {
                        (lease.keeper, lease.answers) = (keeper, answers);
                        Ok(true)
                    }
                    // etcd answered a TTL of 0: the lease is gone (the
                    // client's only other use of this error is a send on a
                    // channel it has just made).
                    Err(etcd_client::Error::LeaseKeepAliveError(_)) => Ok(false),
                    // Unreachable: the daemon tries again, and fences its
                    // writers once the lease may have run out.
                    Err(e) => Err(from_etcd(e)),
                }
            }
        }
    }

    /// Put back the lease a heartbeat took out; false when the node left
    /// meanwhile (then it is revoked here).
    fn put_back(&self, lease: Box<Lease>) -> bool {
        let mut slot = self.lease.lock();
        if matches!(*slot, LeaseSlot::Out) {
            *slot = LeaseSlot::Here(lease);
            self.lease_back.notify_all();
            return true;
        }
        *slot = LeaseSlot::Left;
        drop(slot);
        self.revoke_leaving(&lease);
        false
    }

    /// Revoke a lease found held after the node left (a heartbeat or a
    /// registration that ended after `leave`); failing that, it runs out.
    fn revoke_leaving(&self, lease: &Lease) {
        if let Err(e) = self.revoke(lease) {
            tracing::warn!(error = %e, "could not revoke the lease on leaving; it runs out by itself");
        }
    }

    fn revoke(&self, lease: &Lease) -> KvResult<()> {
        let mut client = self.client.clone();
        round_trips::count(RoundTrip::Lease);
        match self.run_raw(client.lease_revoke(lease.id))? {
            // Gone already (it ran out while the node was cut off): left all the same.
            Err(etcd_client::Error::GRpcStatus(s)) if s.code() == tonic_code::NotFound => {}
            r => r.map(|_| ()).map_err(from_etcd)?,
        }
        tracing::info!(node = %lease.node, "left the cluster");
        Ok(())
    }

    /// [`EtcdKv::run`] for a read, which changes nothing and so may be sent
    /// again: a request whose connection broke under it (reset, the member
    /// it reached restarting, a connection not made again yet) goes again,
    /// on a new one, until the deadline. Without it such a blip failed the
    /// lookup or stat it served with `EIO`. (A commit is not sent again
    /// here: whether it applied is unknown, see `Namespace::write`.)
    fn run_read<T, Fut>(&self, mut send: impl FnMut() -> Fut) -> KvResult<T>
    where
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        self.rt.block_on(async {
            let deadline = tokio::time::Instant::now() + self.timeout;
            let mut pause = Duration::from_millis(5);
            loop {
                match tokio::time::timeout_at(deadline, send()).await {
                    Ok(Ok(r)) => return Ok(r),
                    Ok(Err(e)) if connection_failed(&e) && tokio::time::Instant::now() + pause < deadline => {
                        tracing::debug!(error = %explain(&e), "etcd read failed on its connection; sending it again");
                        tokio::time::sleep(pause).await;
                        pause = (pause * 4).min(Duration::from_millis(500));
                        round_trips::count(RoundTrip::Read);
                    }
                    Ok(Err(e)) => return Err(from_etcd(e)),
                    Err(_) => return Err(transient(format!("no answer within {:?}", self.timeout))),
                }
            }
        })
    }

    /// One range read at `rev` (0: latest). A serializable read is served
    /// by whichever member answers, without a round of consensus: right for
    /// reads a commit will validate (their mod revisions are compared) and
    /// for reads at a pinned revision. A member that has not reached `rev`
    /// yet refuses; then the read goes through the leader.
    fn get_raw(
        &self,
        key: Vec<u8>,
        mut opts: GetOptions,
        rev: i64,
        serializable: bool,
    ) -> KvResult<etcd_client::GetResponse> {
        if rev > 0 {
            opts = opts.with_revision(rev);
        }
        let get = |opts: GetOptions| {
            let key = &key;
            move || {
                let (mut c, key, opts) = (self.client.kv_client(), key.clone(), opts.clone());
                async move { c.get(key, Some(opts)).await }
            }
        };
        round_trips::count(RoundTrip::Read);
        if serializable {
            match self.run_read(get(opts.clone().with_serializable())) {
                Ok(r) => return Ok(r),
                Err(e) if rev > 0 => {
                    tracing::debug!(error = %e, "serializable read refused; reading through the leader");
                    round_trips::count(RoundTrip::Read);
                }
                Err(e) => return Err(e),
            }
        }
        self.run_read(get(opts))
    }

    /// Get one key at `rev` (0: latest). Returns (value, mod revision, revision read at).
    fn get_at(&self, key: &[u8], rev: i64, serializable: bool) -> KvResult<(Option<Vec<u8>>, i64, i64)> {
        let resp = self.get_raw(self.key(key), GetOptions::new(), rev, serializable)?;
        let at = resp.header().map_or(rev, |h| h.revision());
        Ok(match resp.kvs().first() {
            Some(kv) => (Some(kv.value().to_vec()), kv.mod_revision(), at),
            None => (None, 0, at),
        })
    }

    /// Send one commit transaction; a successful one's revision is marked
    /// as this node's own, so the watch does not evict what it wrote.
    fn send_commit(&self, compares: Vec<Compare>, ops: Vec<TxnOp>) -> KvResult<etcd_client::TxnResponse> {
        let txn = Txn::new().when(compares).and_then(ops);
        let mut c = self.client.kv_client();
        round_trips::count(RoundTrip::Commit);
        let mut in_flight = self.own.begin();
        // Timed apart from the whole `write`: what of a commit is etcd's.
        let resp = crate::timed("etcd_txn", || self.run(c.txn(txn)))?;
        if resp.succeeded() {
            in_flight.revision = resp.header().map(|h| h.revision());
        }
        Ok(resp)
    }

    /// Get each of `keys` at `rev` (0: latest), in one read-only transaction
    /// per 128 keys (`--max-txn-ops`), all at the revision the first one read at.
    /// Returns (value, mod revision) of each, and that revision.
    fn get_many_at(&self, keys: &[Vec<u8>], rev: i64) -> KvResult<(Vec<Versions>, i64)> {
        let (answers, rev) = self.read_txns(keys.len(), rev, |i, rev| {
            let opts = if rev > 0 { GetOptions::new().with_revision(rev) } else { GetOptions::new() };
            TxnOp::get(self.key(&keys[i]), Some(opts))
        })?;
        let found = answers
            .iter()
            .map(|g| match g.kvs().first() {
                Some(kv) => (Some(kv.value().to_vec()), kv.mod_revision()),
                None => (None, 0),
            })
            .collect();
        Ok((found, rev))
    }

    /// Each of `ranges` at `rev` (0: the latest), at most `limit` keys
    /// each, in one transaction of range reads per 128 ranges.
    fn scan_many_at(&self, ranges: &[(Vec<u8>, Vec<u8>)], limit: usize, rev: i64) -> KvResult<(Vec<Pairs>, i64)> {
        let (answers, rev) = self.read_txns(ranges.len(), rev, |i, rev| {
            let (start, end) = &ranges[i];
            let opts = GetOptions::new().with_range(self.key(end)).with_limit(limit.min(i64::MAX as usize) as i64);
            let opts = if rev > 0 { opts.with_revision(rev) } else { opts };
            TxnOp::get(self.key(start), Some(opts))
        })?;
        let n = self.prefix.len();
        let found =
            answers.iter().map(|g| g.kvs().iter().map(|kv| (kv.key()[n..].to_vec(), kv.value().to_vec())).collect());
        Ok((found.collect(), rev))
    }

    /// `count` reads (`op(i, rev)` makes the i-th), sent as transactions of
    /// 128 (`--max-txn-ops`), all at the revision the first one read at
    /// (`rev`, or the latest when 0). Returns the answers in order, and
    /// that revision.
    fn read_txns(
        &self,
        count: usize,
        mut rev: i64,
        op: impl Fn(usize, i64) -> TxnOp,
    ) -> KvResult<(Vec<etcd_client::GetResponse>, i64)> {
        let mut out = Vec::with_capacity(count);
        for first in (0..count).step_by(128) {
            let ops: Vec<TxnOp> = (first..count.min(first + 128)).map(|i| op(i, rev)).collect();
            let c = self.client.kv_client();
            round_trips::count(RoundTrip::Read);
            let resp = self.run_read(|| {
                let (mut c, txn) = (c.clone(), Txn::new().and_then(ops.clone()));
                async move { c.txn(txn).await }
            })?;
            if rev == 0 {
                rev = resp.header().map_or(0, |h| h.revision());
            }
            for answer in resp.op_responses() {
                let etcd_client::TxnOpResponse::Get(g) = answer else {
                    return Err(KvError::Backend {
                        msg: "etcd: a read transaction answered with a write".into(),
                        retryable: false,
                    });
                };
                out.push(g);
            }
        }
        if out.len() != count {
            return Err(KvError::Backend {
                msg: format!("etcd: {} answers to {count} reads", out.len()),
                retryable: false,
            });
        }
        Ok((out, rev))
    }

    fn scan_at(&self, start: &[u8], end: &[u8], limit: usize, rev: i64, serializable: bool) -> KvResult<(Pairs, i64)> {
        let opts = GetOptions::new().with_range(self.key(end)).with_limit(limit.min(i64::MAX as usize) as i64);
        let resp = self.get_raw(self.key(start), opts, rev, serializable)?;
        let at = resp.header().map_or(rev, |h| h.revision());
        let n = self.prefix.len();
        Ok((resp.kvs().iter().map(|kv| (kv.key()[n..].to_vec(), kv.value().to_vec())).collect(), at))
    }
}

struct EtcdRead<'a> {
    kv: &'a EtcdKv,
    rev: i64,
}

impl KvRead for EtcdRead<'_> {
    fn get(&mut self, key: &[u8]) -> KvResult<Option<Vec<u8>>> {
        let (v, _, at) = self.kv.get_at(key, self.rev, self.rev > 0)?;
        self.rev = at;
        Ok(v)
    }
    fn get_versioned(&mut self, key: &[u8]) -> KvResult<(Option<Vec<u8>>, Option<Versioned>)> {
        let (value, version, at) = self.kv.get_at(key, self.rev, self.rev > 0)?;
        self.rev = at;
        Ok((value.clone(), Some(Versioned { value, version, at })))
    }
    fn scan(&mut self, start: &[u8], end: &[u8], limit: usize) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>> {
        let (v, at) = self.kv.scan_at(start, end, limit, self.rev, self.rev > 0)?;
        self.rev = at;
        Ok(v)
    }
    fn get_many_versioned(&mut self, keys: &[Vec<u8>]) -> KvResult<Vec<crate::kv::Found>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let (found, at) = self.kv.get_many_at(keys, self.rev)?;
        self.rev = at;
        Ok(found.into_iter().map(|(value, version)| (value.clone(), Some(Versioned { value, version, at }))).collect())
    }
    fn scan_many(&mut self, ranges: &[(Vec<u8>, Vec<u8>)], limit: usize) -> KvResult<Vec<Pairs>> {
        if ranges.is_empty() {
            return Ok(Vec::new());
        }
        let (found, at) = self.kv.scan_many_at(ranges, limit, self.rev)?;
        self.rev = at;
        Ok(found)
    }
}

struct EtcdWrite<'a> {
    kv: &'a EtcdKv,
    rev: i64,
    /// Keys read, with the mod revision seen (0: absent).
    reads: BTreeMap<Vec<u8>, i64>,
    scanned: Vec<(Vec<u8>, Vec<u8>)>,
    pending: PendingWrites,
    deleted_ranges: Vec<(Vec<u8>, Vec<u8>)>,
    /// Deleted ranges whose records the caller takes: where each goes.
    taken: Vec<(Vec<u8>, Vec<u8>, crate::kv::Taken)>,
}

impl EtcdWrite<'_> {
    fn range_deleted(&self, key: &[u8]) -> bool {
        self.deleted_ranges.iter().any(|(s, e)| key >= s.as_slice() && key < e.as_slice())
    }
}

impl KvRead for EtcdWrite<'_> {
    fn get(&mut self, key: &[u8]) -> KvResult<Option<Vec<u8>>> {
        if let Some(v) = self.pending.get(key) {
            return Ok(v.clone());
        }
        if self.range_deleted(key) {
            return Ok(None);
        }
        let (v, mod_rev, at) = self.kv.get_at(key, self.rev, self.rev > 0)?;
        self.rev = at;
        self.reads.insert(key.to_vec(), mod_rev);
        Ok(v)
    }
    fn get_versioned(&mut self, key: &[u8]) -> KvResult<(Option<Vec<u8>>, Option<Versioned>)> {
        if self.pending.contains_key(key) || self.range_deleted(key) {
            // Written by this transaction: no version of the engine's.
            return Ok((self.get(key)?, None));
        }
        let (value, version, at) = self.kv.get_at(key, self.rev, self.rev > 0)?;
        self.rev = at;
        self.reads.insert(key.to_vec(), version);
        Ok((value.clone(), Some(Versioned { value, version, at })))
    }
    fn get_many_versioned(&mut self, keys: &[Vec<u8>]) -> KvResult<Vec<crate::kv::Found>> {
        // What this transaction wrote answers itself; the rest is read in
        // one request per 128 keys, each a read the commit compares.
        let written: Vec<bool> = keys.iter().map(|k| self.pending.contains_key(k) || self.range_deleted(k)).collect();
        let asked: Vec<Vec<u8>> = keys.iter().zip(&written).filter(|(_, w)| !**w).map(|(k, _)| k.clone()).collect();
        let mut found = Vec::new().into_iter();
        if !asked.is_empty() {
            let (answers, at) = self.kv.get_many_at(&asked, self.rev)?;
            self.rev = at;
            found = answers.into_iter();
        }
        let mut out = Vec::with_capacity(keys.len());
        for (key, written) in keys.iter().zip(written) {
            if written {
                out.push((self.get(key)?, None));
                continue;
            }
            let (value, version) = found.next().expect("an answer for every key asked");
            self.reads.insert(key.clone(), version);
            out.push((value.clone(), Some(Versioned { value, version, at: self.rev })));
        }
        Ok(out)
    }
    fn scan(&mut self, start: &[u8], end: &[u8], limit: usize) -> KvResult<Vec<(Vec<u8>, Vec<u8>)>> {
        let extra = pending_deletes(&self.pending, start, end);
        let want = if self.deleted_ranges.is_empty() { limit.saturating_add(extra) } else { usize::MAX >> 1 };
        let (found, at) = self.kv.scan_at(start, end, want, self.rev, self.rev > 0)?;
        self.rev = at;
        self.scanned.push((start.to_vec(), end.to_vec()));
        let base: Vec<_> = found.into_iter().filter(|(k, _)| !self.range_deleted(k)).collect();
        Ok(merge_pending(base, &self.pending, start, end, limit))
    }
}

impl KvWrite for EtcdWrite<'_> {
    fn put(&mut self, key: &[u8], value: &[u8]) {
        self.pending.insert(key.to_vec(), Some(value.to_vec()));
    }
    fn delete(&mut self, key: &[u8]) {
        self.pending.insert(key.to_vec(), None);
    }
    fn delete_range(&mut self, start: &[u8], end: &[u8]) -> KvResult<()> {
        // Writes already pending in the range are superseded by the range delete.
        let inside: Vec<Vec<u8>> = self.pending.range(start.to_vec()..end.to_vec()).map(|(k, _)| k.clone()).collect();
        for k in inside {
            self.pending.remove(&k);
        }
        self.deleted_ranges.push((start.to_vec(), end.to_vec()));
        Ok(())
    }
    fn delete_range_taking(&mut self, start: &[u8], end: &[u8], into: &crate::kv::Taken) -> KvResult<()> {
        self.delete_range(start, end)?;
        self.taken.push((start.to_vec(), end.to_vec(), into.clone()));
        Ok(())
    }
    fn assume(&mut self, key: &[u8], version: i64) -> bool {
        // A key read twice keeps the version seen first: both must hold.
        self.reads.entry(key.to_vec()).or_insert(version);
        true
    }
    fn commit(self: Box<Self>, durability: Durability) -> KvResult<()> {
        self.commit_at(durability).map(|_| ())
    }
    fn commit_at(self: Box<Self>, _durability: Durability) -> KvResult<Option<i64>> {
        let kv = self.kv;
        if self.pending.is_empty() && self.deleted_ranges.is_empty() {
            return Ok(None);
        }
        let mut compares = Vec::new();
        let mut bytes = 0;
        let mut reads = Vec::with_capacity(self.reads.len() + self.scanned.len());
        let mut writes = Vec::with_capacity(self.pending.len() + self.deleted_ranges.len());
        for (k, mod_rev) in &self.reads {
            compares.push(if *mod_rev == 0 {
                Compare::version(kv.key(k), CompareOp::Equal, 0)
            } else {
                Compare::mod_revision(kv.key(k), CompareOp::Equal, *mod_rev)
            });
            bytes += kv.prefix.len() + k.len() + OP_OVERHEAD;
            reads.push(Span::key(k));
        }
        if self.rev > 0 {
            for (s, e) in &self.scanned {
                // Nothing in a scanned range was created or changed after our snapshot.
                compares.push(Compare::mod_revision(kv.key(s), CompareOp::Less, self.rev + 1).with_range(kv.key(e)));
                bytes += 2 * kv.prefix.len() + s.len() + e.len() + OP_OVERHEAD;
            }
        }
        // A range read at no pinned revision (none is compared) still keeps
        // other commits that write in it out of this one's transaction.
        reads.extend(self.scanned.iter().map(|(s, e)| Span::range(s, e)));
        let mut ops = Vec::new();
        // Range deletes whose records come back in the response: by op index.
        let mut taking: Vec<(usize, crate::kv::Taken)> = Vec::new();
        for (s, e) in &self.deleted_ranges {
            let into = self.taken.iter().find(|(ts, te, _)| ts == s && te == e).map(|(_, _, into)| into);
            // etcd refuses a transaction whose range delete overlaps a put:
            // then delete the range's keys one by one instead.
            let overlaps = self.pending.range(s.clone()..e.clone()).next().is_some();
            if overlaps {
                // Read at this transaction's revision (the latest, through
                // the leader, when it read nothing yet: a follower may lag),
                // and compared: a key that enters the range before the
                // commit fails it, rather than outliving the delete.
                let (keys, at) = kv.scan_at(s, e, usize::MAX >> 1, self.rev, self.rev > 0)?;
                compares.push(Compare::mod_revision(kv.key(s), CompareOp::Less, at + 1).with_range(kv.key(e)));
                bytes += 2 * kv.prefix.len() + s.len() + e.len() + OP_OVERHEAD;
                if let Some(into) = into {
                    *into.lock() = keys.iter().filter(|(k, _)| !self.pending.contains_key(k)).cloned().collect();
                }
                for (k, _) in keys {
                    if !self.pending.contains_key(&k) {
                        bytes += kv.prefix.len() + k.len() + OP_OVERHEAD;
                        ops.push(TxnOp::delete(kv.key(&k), None));
                    }
                }
            } else {
                let mut opts = DeleteOptions::new().with_range(kv.key(e));
                if let Some(into) = into {
                    opts = opts.with_prev_key();
                    taking.push((ops.len(), into.clone()));
                }
                ops.push(TxnOp::delete(kv.key(s), Some(opts)));
                bytes += 2 * kv.prefix.len() + s.len() + e.len() + OP_OVERHEAD;
            }
            writes.push(Span::range(s, e));
        }
        for (k, v) in &self.pending {
            bytes += kv.prefix.len() + k.len() + v.as_ref().map_or(0, Vec::len) + OP_OVERHEAD;
            ops.push(match v {
                Some(v) => TxnOp::put(kv.key(k), v.clone(), None),
                None => TxnOp::delete(kv.key(k), None),
            });
            writes.push(Span::key(k));
        }
        let member = group_commit::Member { compares, ops, bytes, reads, writes };
        let send = |compares, ops| {
            let resp = kv.send_commit(compares, ops)?;
            Ok((resp.succeeded(), resp.header().map(|h| h.revision()), Answer::new(resp)))
        };
        let done = if kv.alone {
            match send(member.compares, member.ops)? {
                (true, revision, answer) => group_commit::Committed { revision, answer: Arc::new(answer), first_op: 0 },
                (false, ..) => return Err(KvError::Conflict),
            }
        } else {
            kv.group.commit(member, &send)?
        };
        // What this commit's range deletes removed, from its own part of
        // the answer (a shared transaction answers every commit in it).
        for (at, into) in taking {
            if let Some(etcd_client::TxnOpResponse::Delete(d)) = done.answer.op(done.first_op + at) {
                *into.lock() = d
                    .prev_kvs()
                    .iter()
                    .filter_map(|r| Some((r.key().strip_prefix(kv.prefix.as_slice())?.to_vec(), r.value().to_vec())))
                    .collect();
            }
        }
        Ok(done.revision)
    }
}

impl KvEngine for EtcdKv {
    fn name(&self) -> &'static str {
        "etcd"
    }
    /// etcd's default `--max-txn-ops`, which also bounds the compares a
    /// commit makes of what it read.
    fn txn_limit(&self) -> Option<usize> {
        Some(128)
    }
    fn read_txn(&self) -> KvResult<Box<dyn KvRead + '_>> {
        Ok(Box::new(EtcdRead { kv: self, rev: 0 }))
    }
    fn write_txn(&self) -> KvResult<Box<dyn KvWrite + '_>> {
        Ok(Box::new(EtcdWrite {
            kv: self,
            rev: 0,
            reads: BTreeMap::new(),
            scanned: Vec::new(),
            pending: BTreeMap::new(),
            deleted_ranges: Vec::new(),
            taken: Vec::new(),
        }))
    }
    /// Every etcd commit is already on a quorum's stable storage.
    fn sync(&self) -> KvResult<()> {
        Ok(())
    }
    fn membership(&self) -> Option<&dyn Membership> {
        Some(self)
    }
    /// One etcd watch over the volume's records (but the holder index),
    /// re-established when it breaks or falls silent (then subscribers hear
    /// an empty key: start over). Subscribers also hear an empty key each
    /// time the watch is (re)created, once etcd confirmed it: what they
    /// learned before may predate the first revision it covers. Its value
    /// is `Some` when the new watch starts from now (the first, or etcd
    /// compacted past where the last one stopped): changes were missed for
    /// good, not only delayed.
    fn watch(&self, on_change: ChangeFeed) -> KvResult<bool> {
        self.watch_revisions(Arc::new(move |key: &[u8], value: Option<&[u8]>, _| on_change(key, value)))
    }

    /// [`EtcdKv::watch`]; each change comes with its mod revision.
    fn watch_revisions(&self, on_change: RevisionFeed) -> KvResult<bool> {
        let feed = match self.feed.get() {
            Some(rt) => rt,
            None => {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .thread_name("etcd-feed")
                    .enable_all()
                    .build()
                    .map_err(KvError::backend)?;
                self.feed.get_or_init(|| rt)
            }
        };
        let (urls, opts) = (self.urls.clone(), self.opts.clone());
        let prefix = self.prefix.clone();
        let own = self.own.clone();
        let timeout = self.timeout;
        feed.spawn(async move {
            let mut from = 0;
            let mut client: Option<Client> = None;
            // Between tries to start the watch again: short at first (a
            // reset connection is back at once), doubling to a second
            // while etcd does not answer; back to short once one starts.
            let mut pause = WATCH_RETRY_FIRST;
            loop {
                // The feed's own connection: commits never wait behind a
                // burst of events, nor the feed behind a commit's thread.
                let c = match &client {
                    Some(c) => c.clone(),
                    None => match Client::connect(&urls, Some(opts.clone())).await {
                        Ok(c) => client.insert(c).clone(),
                        Err(e) => {
                            tracing::warn!(error = %e, "etcd watch could not connect; retrying");
                            on_change(b"", None, 0);
                            tokio::time::sleep(pause).await;
                            pause = (pause * 2).min(WATCH_RETRY_MAX);
                            continue;
                        }
                    },
                };
                // Up to the holder index, which only background work reads, fresh.
                let end = [prefix.as_slice(), schema::WATCHED_END].concat();
                let mut opts = WatchOptions::new().with_range(end);
                if from > 0 {
                    opts = opts.with_start_revision(from);
                }
                // A watch from now (the first, or after etcd compacted past
                // where the last stopped) covers nothing before it: what
                // happened meanwhile is lost to it. One from `from` is sent
                // what it missed.
                let gap = from == 0;
                let mut watch = c.watch_client();
                match watch.watch(prefix.clone(), Some(opts)).await {
                    Ok(stream) => {
                        let (mut ask, mut answers) = stream.split();
                        // The feed proves itself alive: etcd answers a
                        // progress request at once when the watch is
                        // current, and sends events otherwise. A watch
                        // that says nothing for WATCH_SILENCE (a connection
                        // hung without a reset) is started over, so a
                        // node's cache never answers from a feed that
                        // stopped (see kv_cache.rs).
                        let mut heard = tokio::time::Instant::now();
                        let mut probe = tokio::time::interval(WATCH_PROBE);
                        probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                        loop {
                            let resp = tokio::select! {
                                m = answers.message() => match m {
                                    Ok(Some(resp)) => resp,
                                    _ => break,
                                },
                                _ = probe.tick() => {
                                    if heard.elapsed() > WATCH_SILENCE {
                                        tracing::warn!(silent = ?heard.elapsed(), "etcd watch fell silent; starting it over");
                                        break;
                                    }
                                    // A watch that delivers events needs no probe.
                                    if heard.elapsed() >= WATCH_PROBE && ask.request_progress().await.is_err() {
                                        break;
                                    }
                                    continue;
                                }
                            };
                            heard = tokio::time::Instant::now();
                            // (A watch etcd refuses is created and cancelled in one answer.)
                            if resp.created() && !resp.canceled() {
                                pause = WATCH_RETRY_FIRST;
                                on_change(b"", gap.then_some(MISSED), 0);
                            }
                            if resp.canceled() {
                                // Compacted past `from`: changes were missed.
                                from = 0;
                                on_change(b"", None, 0);
                                break;
                            }
                            for ev in resp.events() {
                                let Some(kv) = ev.kv() else { continue };
                                from = from.max(kv.mod_revision() + 1);
                                if own.is_own(kv.mod_revision(), timeout).await {
                                    continue;
                                }
                                // A heartbeat rewriting a node's records (its
                                // free space, its last beat) is no news: a
                                // node that joins or dies creates or deletes
                                // them, and readers take the rest at their
                                // slow safety reads.
                                let rewrite = ev.event_type() == etcd_client::EventType::Put && kv.version() > 1;
                                if rewrite
                                    && kv.key().strip_prefix(prefix.as_slice()).is_some_and(schema::is_node_record)
                                {
                                    continue;
                                }
                                if let Some(key) = kv.key().strip_prefix(prefix.as_slice()) {
                                    let put = ev.event_type() == etcd_client::EventType::Put;
                                    on_change(key, put.then(|| kv.value()), kv.mod_revision());
                                }
                            }
                        }
                        tracing::warn!("etcd watch ended; reconnecting");
                    }
                    Err(e) => tracing::warn!(error = %e, "etcd watch failed; retrying"),
                }
                on_change(b"", None, 0);
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(WATCH_RETRY_MAX);
            }
        });
        Ok(true)
    }
}

/// The first and the longest pause between tries to start the change
/// feed's watch again.
const WATCH_RETRY_FIRST: Duration = Duration::from_millis(50);
const WATCH_RETRY_MAX: Duration = Duration::from_secs(1);

/// The value of the feed's empty key when changes were missed for good.
const MISSED: &[u8] = b"missed";

impl EtcdKv {
    fn put_records(&self, info: &NodeInfo, lease: i64) -> KvResult<()> {
        let value = postcard::to_allocvec(info).map_err(KvError::backend)?;
        let txn = Txn::new().and_then(vec![
            TxnOp::put(self.key(&schema::known_node(&info.id)), value.clone(), None),
            TxnOp::put(self.key(&schema::live_node(&info.id)), value, Some(PutOptions::new().with_lease(lease))),
        ]);
        let mut c = self.client.kv_client();
        round_trips::count(RoundTrip::Lease);
        self.run(c.txn(txn)).map(|_| ())
    }
}

impl Membership for EtcdKv {
    fn register(&self, info: &NodeInfo, ttl: Duration) -> KvResult<()> {
        let mut client = self.client.clone();
        let secs = ttl.as_secs().max(1) as i64;
        round_trips::count(RoundTrip::Lease);
        let id = self.run(client.lease_grant(secs, None))?.id();
        let (keeper, answers) = self.run(client.lease_keep_alive(id))?;
        self.put_records(info, id)?;
        let recorded = (info.clone(), std::time::Instant::now());
        let lease = Box::new(Lease { id, ttl, node: info.id.clone(), keeper, answers, recorded });
        let mut slot = self.lease.lock();
        if matches!(*slot, LeaseSlot::Left | LeaseSlot::Leaving) {
            // Left while this registration was under way (a heartbeat
            // registering again as the mount ends).
            drop(slot);
            self.revoke_leaving(&lease);
            return Err(KvError::backend("the node left the cluster while it registered"));
        }
        *slot = LeaseSlot::Here(lease);
        Ok(())
    }

    fn heartbeat(&self, info: &NodeInfo) -> KvResult<Heartbeat> {
        let mut lease = {
            let mut slot = self.lease.lock();
            match std::mem::replace(&mut *slot, LeaseSlot::Out) {
                LeaseSlot::Here(lease) => lease,
                other => {
                    *slot = other;
                    return Err(KvError::backend("heartbeat with no lease (not registered yet, or left)"));
                }
            }
        };
        let alive = self.renew(&mut lease);
        let (id, ttl) = (lease.id, lease.ttl);
        let unchanged =
            !info.worth_recording(&lease.recorded.0) && lease.recorded.1.elapsed() < crate::membership::RECORD_EVERY;
        if !self.put_back(lease) {
            return Err(KvError::backend("the node left the cluster during its heartbeat"));
        }
        match alive? {
            true if unchanged => Ok(Heartbeat::Renewed),
            true => {
                self.put_records(info, id)?;
                if let LeaseSlot::Here(lease) = &mut *self.lease.lock() {
                    if lease.id == id {
                        lease.recorded = (info.clone(), std::time::Instant::now());
                    }
                }
                Ok(Heartbeat::Renewed)
            }
            // The lease expired (cut off for longer than its TTL): come
            // back. The old lease stays until a new one is granted, so a
            // registration that fails is tried again at the next heartbeat.
            false => self.register(info, ttl).map(|()| Heartbeat::Rejoined),
        }
    }

    fn members(&self) -> KvResult<Vec<Member>> {
        let decode = |v: &[u8]| postcard::from_bytes::<NodeInfo>(v).map_err(KvError::backend);
        let range = |p: &[u8]| {
            let (s, e) = schema::prefix_range(p);
            self.scan_at(&s, &e, 100_000, 0, false).map(|(kvs, _)| kvs)
        };
        let live: BTreeMap<Vec<u8>, Vec<u8>> =
            range(schema::LIVE_NODES)?.into_iter().map(|(k, v)| (k[1..].to_vec(), v)).collect();
        let mut out = Vec::new();
        for (k, v) in range(schema::KNOWN_NODES)? {
            let id = &k[1..];
            match live.get(id) {
                Some(lv) => out.push(Member { info: decode(lv)?, alive: true }),
                None => out.push(Member { info: decode(&v)?, alive: false }),
            }
        }
        Ok(out)
    }

    fn leave(&self) -> KvResult<()> {
        let lease = {
            let mut slot = self.lease.lock();
            // A heartbeat's round trips (renewal, records) end within
            // their deadlines: wait for the lease to be put back, so it
            // is revoked before the process exits rather than left to run
            // out (other nodes would count this one live until then).
            let until = std::time::Instant::now() + 2 * self.timeout;
            while matches!(*slot, LeaseSlot::Out) {
                if self.lease_back.wait_until(&mut slot, until).timed_out() {
                    break;
                }
            }
            match std::mem::replace(&mut *slot, LeaseSlot::Left) {
                LeaseSlot::Here(lease) => lease,
                LeaseSlot::Out | LeaseSlot::Leaving => {
                    *slot = LeaseSlot::Leaving;
                    return Ok(());
                }
                LeaseSlot::None | LeaseSlot::Left => return Ok(()),
            }
        };
        self.revoke(&lease)
    }
}
