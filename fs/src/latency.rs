//! Latency histograms of the daemon: FUSE operations, peer requests,
//! metadata transactions and object-store calls, by operation.
//!
//! Each histogram is a row of atomic bucket counters with fixed bounds, so
//! recording is a few relaxed atomic adds on the hot path. `/metrics`
//! encodes them as Prometheus histograms (`converged_fuse_op_seconds` …);
//! `converged stats` reads a compact snapshot of the same counters through
//! the `user.converged.stats` attribute of the mount's root and shows rates
//! and percentiles over each interval.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use dashmap::DashMap;

/// Upper bounds of the buckets, in seconds (a last, unbounded one follows).
pub const BOUNDS: [f64; 18] = [
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0,
    10.0, 30.0,
];
const SLOTS: usize = BOUNDS.len() + 1;

/// What a latency is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Area {
    /// A FUSE request, from the kernel's call to this daemon's reply.
    Fuse,
    /// A request to a peer node, as this node waited for it.
    Peer,
    /// A metadata transaction, conflict retries included.
    Meta,
    /// A call to the object store.
    Object,
}

impl Area {
    pub const ALL: [Area; 4] = [Area::Fuse, Area::Peer, Area::Meta, Area::Object];

    pub fn name(self) -> &'static str {
        match self {
            Area::Fuse => "fuse",
            Area::Peer => "peer",
            Area::Meta => "meta",
            Area::Object => "object",
        }
    }

    fn parse(s: &str) -> Option<Area> {
        Area::ALL.into_iter().find(|a| a.name() == s)
    }

    /// Metric name (under the `converged_` prefix), help, and the label of the operation.
    fn metric(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Area::Fuse => ("fuse_op_seconds", "Time to answer a FUSE request, by operation", "op"),
            Area::Peer => ("peer_request_seconds", "Time a request to a peer node took, by request", "request"),
            Area::Meta => ("meta_txn_seconds", "Time of a metadata transaction (retries included), by kind", "kind"),
            Area::Object => ("object_store_seconds", "Time of an object-store call, by call", "call"),
        }
    }
}

#[derive(Default)]
struct Hist {
    slots: [AtomicU64; SLOTS],
    sum_ns: AtomicU64,
}

impl Hist {
    fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let slot = BOUNDS.iter().position(|b| secs <= *b).unwrap_or(BOUNDS.len());
        self.slots[slot].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }

    fn counts(&self) -> [u64; SLOTS] {
        std::array::from_fn(|i| self.slots[i].load(Ordering::Relaxed))
    }
}

static HISTS: LazyLock<DashMap<(Area, &'static str), Hist>> = LazyLock::new(DashMap::new);

/// Record that operation `op` of `area` took `d`.
pub fn observe(area: Area, op: &'static str, d: Duration) {
    // The common case, a histogram that exists, takes a shard's read lock only.
    if let Some(h) = HISTS.get(&(area, op)) {
        h.observe(d);
        return;
    }
    HISTS.entry((area, op)).or_default().observe(d);
}

/// Metadata round trips (etcd requests) each FUSE operation made on the
/// thread that answered it, and how many of that operation were answered:
/// their ratio is the operation's cost in round trips.
static FUSE_ROUND_TRIPS: LazyLock<DashMap<&'static str, (AtomicU64, AtomicU64)>> = LazyLock::new(DashMap::new);

fn charge_round_trips(op: &'static str, trips: u64) {
    let add = |e: &(AtomicU64, AtomicU64)| {
        e.0.fetch_add(trips, Ordering::Relaxed);
        e.1.fetch_add(1, Ordering::Relaxed);
    };
    if let Some(e) = FUSE_ROUND_TRIPS.get(op) {
        add(&e);
        return;
    }
    add(&FUSE_ROUND_TRIPS.entry(op).or_default());
}

/// `(op, round trips, operations)` per FUSE operation so far, by name.
pub fn fuse_round_trips() -> Vec<(&'static str, u64, u64)> {
    let mut rows: Vec<_> = FUSE_ROUND_TRIPS
        .iter()
        .map(|e| (*e.key(), e.value().0.load(Ordering::Relaxed), e.value().1.load(Ordering::Relaxed)))
        .collect();
    rows.sort();
    rows
}

/// Times what follows until it is dropped; a FUSE operation's timer also
/// charges it the metadata round trips its thread made meanwhile.
pub struct Timer {
    area: Area,
    op: &'static str,
    start: Instant,
    round_trips: u64,
}

impl Drop for Timer {
    fn drop(&mut self) {
        observe(self.area, self.op, self.start.elapsed());
        if self.area == Area::Fuse {
            charge_round_trips(self.op, converged_metadata::round_trips::on_this_thread() - self.round_trips);
        }
    }
}

pub fn timer(area: Area, op: &'static str) -> Timer {
    Timer { area, op, start: Instant::now(), round_trips: converged_metadata::round_trips::on_this_thread() }
}

/// Time `f` as operation `op` of `area`.
pub fn time<T>(area: Area, op: &'static str, f: impl FnOnce() -> T) -> T {
    let _t = timer(area, op);
    f()
}

/// Time future `f` as operation `op` of `area`.
pub async fn time_async<T>(area: Area, op: &'static str, f: impl std::future::Future<Output = T>) -> T {
    let _t = timer(area, op);
    f.await
}

fn sorted() -> Vec<((Area, &'static str), [u64; SLOTS], u64)> {
    let mut rows: Vec<_> =
        HISTS.iter().map(|e| (*e.key(), e.value().counts(), e.value().sum_ns.load(Ordering::Relaxed))).collect();
    rows.sort_by_key(|r| r.0);
    rows
}

/// Encode every histogram for `/metrics`.
pub fn encode(encoder: &mut prometheus_client::encoding::DescriptorEncoder) -> Result<(), std::fmt::Error> {
    use prometheus_client::metrics::MetricType;
    let rows = sorted();
    for area in Area::ALL {
        let (name, help, label) = area.metric();
        let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Histogram)?;
        for ((_, op), counts, sum_ns) in rows.iter().filter(|r| r.0 .0 == area) {
            // Per-bucket counts: the encoder makes them cumulative.
            let buckets: Vec<(f64, u64)> =
                counts.iter().enumerate().map(|(i, c)| (BOUNDS.get(i).copied().unwrap_or(f64::MAX), *c)).collect();
            let total = counts.iter().sum();
            let labels = [(label, *op)];
            let mut family = metric.encode_family(&labels)?;
            family.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                *sum_ns as f64 / 1e9,
                total,
                &buckets,
                None,
            )?;
        }
    }
    encode_round_trips(encoder)
}

fn encode_round_trips(encoder: &mut prometheus_client::encoding::DescriptorEncoder) -> Result<(), std::fmt::Error> {
    use converged_metadata::round_trips::{self, RoundTrip};
    let kinds: Vec<(&str, u64)> = RoundTrip::ALL.iter().map(|k| (k.name(), round_trips::total(*k))).collect();
    let help = "Requests to the metadata service (etcd), by kind; the embedded engine makes none";
    counter_family(encoder, "meta_round_trips", help, "kind", &kinds)?;
    let rows = fuse_round_trips();
    let trips: Vec<(&str, u64)> = rows.iter().map(|(op, trips, _)| (*op, *trips)).collect();
    let help = "Requests to the metadata service made while answering FUSE operations, by operation";
    counter_family(encoder, "fuse_meta_round_trips", help, "op", &trips)?;
    let ops: Vec<(&str, u64)> = rows.iter().map(|(op, _, ops)| (*op, *ops)).collect();
    let help = "FUSE operations answered, by operation (the divisor of fuse_meta_round_trips)";
    counter_family(encoder, "fuse_ops", help, "op", &ops)
}

/// One counter family: a value per label.
fn counter_family(
    encoder: &mut prometheus_client::encoding::DescriptorEncoder,
    name: &str,
    help: &str,
    label: &str,
    values: &[(&str, u64)],
) -> Result<(), std::fmt::Error> {
    use prometheus_client::encoding::EncodeMetric;
    use prometheus_client::metrics::counter::ConstCounter;
    let mut metric = encoder.encode_descriptor(name, help, None, prometheus_client::metrics::MetricType::Counter)?;
    for (value_of, v) in values {
        ConstCounter::new(*v).encode(metric.encode_family(&[(label, *value_of)])?)?;
    }
    Ok(())
}

/// The compact snapshot `converged stats` reads: one line per histogram,
/// `<area> <op> <sum_ns> <count per bucket…>`, after a line of counters
/// `bytes <read through the daemon> <written through the daemon>`, and a
/// line `trips <op> <metadata round trips>` per FUSE operation.
pub fn snapshot(read_bytes: u64, written_bytes: u64) -> String {
    let mut out = format!("bytes {read_bytes} {written_bytes}\n");
    for ((area, op), counts, sum_ns) in sorted() {
        out.push_str(&format!("{} {op} {sum_ns}", area.name()));
        for c in counts {
            out.push_str(&format!(" {c}"));
        }
        out.push('\n');
    }
    for (op, trips, _) in fuse_round_trips() {
        out.push_str(&format!("trips {op} {trips}\n"));
    }
    out
}

/// One histogram of a parsed snapshot.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub area: Area,
    pub op: String,
    pub sum_ns: u64,
    pub counts: Vec<u64>,
    /// Metadata round trips made answering these operations (FUSE rows).
    pub round_trips: u64,
}

impl Row {
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// What happened between `before` and this row (a later snapshot).
    pub fn since(&self, before: Option<&Row>) -> Row {
        let Some(b) = before else { return self.clone() };
        Row {
            area: self.area,
            op: self.op.clone(),
            sum_ns: self.sum_ns.saturating_sub(b.sum_ns),
            round_trips: self.round_trips.saturating_sub(b.round_trips),
            counts: self
                .counts
                .iter()
                .zip(b.counts.iter().chain(std::iter::repeat(&0)))
                .map(|(a, b)| a.saturating_sub(*b))
                .collect(),
        }
    }

    /// The `q` quantile (0..1), as the upper bound of the bucket it falls in.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        let rank = (q * total as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(BOUNDS.get(i).copied().unwrap_or(f64::INFINITY));
            }
        }
        None
    }
}

/// A parsed snapshot: bytes read and written through the daemon, and the rows.
pub fn parse(text: &str) -> Result<((u64, u64), Vec<Row>), String> {
    let mut bytes = (0, 0);
    let mut rows = Vec::new();
    let mut trips = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let num = |s: &str| s.parse::<u64>().map_err(|_| format!("bad number {s:?} in {line:?}"));
        if f[0] == "bytes" && f.len() == 3 {
            bytes = (num(f[1])?, num(f[2])?);
            continue;
        }
        if f[0] == "trips" && f.len() == 3 {
            trips.push((f[1].to_string(), num(f[2])?));
            continue;
        }
        let area = Area::parse(f[0]).ok_or_else(|| format!("unknown area in {line:?}"))?;
        if f.len() < 4 {
            return Err(format!("short line {line:?}"));
        }
        let counts = f[3..].iter().map(|s| num(s)).collect::<Result<Vec<_>, _>>()?;
        rows.push(Row { area, op: f[1].to_string(), sum_ns: num(f[2])?, counts, round_trips: 0 });
    }
    for (op, n) in trips {
        if let Some(r) = rows.iter_mut().find(|r| r.area == Area::Fuse && r.op == op) {
            r.round_trips = n;
        }
    }
    Ok((bytes, rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_parse_back_and_give_quantiles_of_an_interval() {
        observe(Area::Object, "test_get", Duration::from_micros(30));
        observe(Area::Object, "test_get", Duration::from_millis(3));
        let (_, before) = parse(&snapshot(0, 0)).unwrap();
        for _ in 0..99 {
            observe(Area::Object, "test_get", Duration::from_micros(700));
        }
        observe(Area::Object, "test_get", Duration::from_millis(40));
        let ((r, w), after) = parse(&snapshot(5, 7)).unwrap();
        assert_eq!((r, w), (5, 7));
        let find = |rows: &[Row]| rows.iter().find(|r| r.op == "test_get").cloned();
        let now = find(&after).unwrap();
        let d = now.since(find(&before).as_ref());
        assert_eq!(d.count(), 100);
        assert_eq!(d.quantile(0.5), Some(1e-3));
        assert_eq!(d.quantile(0.99), Some(1e-3));
        assert_eq!(d.quantile(1.0), Some(50e-3));
        assert_eq!(now.count(), 102);
    }
}
