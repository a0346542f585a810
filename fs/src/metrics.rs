//! Prometheus metrics of the daemon (`--metrics ADDR`, served at `/metrics`):
//! its own I/O (opens per kernel I/O mode, bytes it served, seals, bad
//! blocks), the data disk, the cluster, and the object tier's backlog and
//! traffic, read from the counters each part keeps, at each scrape.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Weak;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use crate::core::Core;

#[derive(Debug)]
struct DaemonCollector {
    core: Weak<Core>,
}

fn gauge(encoder: &mut DescriptorEncoder, name: &str, help: &str, v: i64) -> Result<(), std::fmt::Error> {
    let g = ConstGauge::new(v);
    g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)
}

fn counter(encoder: &mut DescriptorEncoder, name: &str, help: &str, v: &AtomicU64) -> Result<(), std::fmt::Error> {
    let c = ConstCounter::new(v.load(Ordering::Relaxed));
    c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)
}

impl Collector for DaemonCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(core) = self.core.upgrade() else { return Ok(()) };
        crate::latency::encode(&mut encoder)?;
        if let Some(life) = core.daemon_life() {
            let since = life.started.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
            gauge(
                &mut encoder,
                "daemon_restarts",
                "Daemons that served this mount's kernel connection before this one (crashes and upgrades)",
                life.restarts as i64,
            )?;
            gauge(&mut encoder, "daemon_start_time_seconds", "When this daemon started (Unix time)", since)?;
        }
        let s = &core.stats;
        let counters = [
            ("opens_passthrough", "Opens whose I/O the kernel passes to the backing file", &s.opens_passthrough),
            ("opens_daemon", "Opens served by the daemon through the page cache", &s.opens_cached),
            ("opens_direct", "Opens served by the daemon with direct I/O (beside passthrough ones)", &s.opens_direct),
            ("daemon_read_bytes", "Bytes read through the daemon (passthrough reads not counted)", &s.read_bytes),
            (
                "daemon_written_bytes",
                "Bytes written through the daemon (passthrough writes not counted)",
                &s.written_bytes,
            ),
            ("seals", "Files sealed: checksums and layout recorded", &s.seals),
            ("corrupt_blocks", "Local blocks that failed their checksum when read", &s.corrupt_blocks),
            ("repair_copies", "Chunk copies this node made for repair and drains", &s.repair_copies),
            ("repair_dropped_holders", "Holders this node dropped from chunk records after repair", &s.repair_dropped),
            ("scrub_bytes", "Bytes of local copies checked by scrub", &s.scrub_bytes),
            ("scrub_bad_blocks", "Blocks scrub found failing their checksum", &s.scrub_bad_blocks),
            ("scrub_repaired_blocks", "Bad blocks scrub rewrote from a good copy", &s.scrub_repaired_blocks),
        ];
        for (name, help, v) in counters {
            counter(&mut encoder, name, help, v)?;
        }
        let store = core.chunk_store();
        let w = &store.written;
        let written = [
            (
                "chunk_received_bytes",
                "Chunk bytes received from peers and written once, into version files (replication, repair, drains)",
                &w.received,
            ),
            ("chunk_kept_bytes", "Published chunk bytes kept in version files while a writer here rewrites them", &w.kept),
            (
                "chunk_installed_bytes",
                "Version file bytes copied into backing files for local passthrough reads or writers (a second write where the filesystem cannot reflink)",
                &w.installed,
            ),
        ];
        for (name, help, v) in written {
            counter(&mut encoder, name, help, v)?;
        }
        gauge(
            &mut encoder,
            "chunk_slots_ready",
            "Slots ready for durable writes of small chunk versions (empty files whose names are already on stable storage)",
            store.slots_ready() as i64,
        )?;
        gauge(&mut encoder, "open_files", "Files open on this node", core.open_files() as i64)?;
        if let Ok((avail, total)) = crate::blocks::disk_space(core.data_dir()) {
            gauge(&mut encoder, "data_disk_bytes", "Size of the data disk", total as i64)?;
            gauge(&mut encoder, "data_disk_free_bytes", "Free space of the data disk", avail as i64)?;
        }
        if let Some(c) = core.cluster() {
            let under = core.under_replicated_files() as i64;
            gauge(&mut encoder, "under_replicated_files", "Files with fewer copies than their policy", under)?;
            gauge(&mut encoder, "live_peers", "Other live nodes of the cluster", c.live_peers().len() as i64)?;
            counter(
                &mut encoder,
                "peer_read_bytes",
                "Bytes read from peers and verified (remote reads, readahead, repair, staging)",
                &c.read_bytes,
            )?;
            if let Some(p) = core.repair_report() {
                let figures = [
                    (
                        "repair_chunks_under_replicated",
                        "Chunks with fewer good copies than their policy, in what this node looked at in its last repair pass (its share)",
                        p.under,
                    ),
                    (
                        "repair_chunks_waiting",
                        "Under-replicated chunks waiting for a dead holder's repair delay",
                        p.waiting,
                    ),
                    (
                        "repair_chunks_unavailable",
                        "Chunks with no copy on a live node, in what this node looked at in its last repair pass (its share)",
                        p.unavailable,
                    ),
                ];
                for (name, help, v) in figures {
                    gauge(&mut encoder, name, help, v as i64)?;
                }
            }
        }
        let Some(t) = core.tiering() else { return Ok(()) };
        let b = t.backlog();
        let s = &t.stats;
        let gauges = [
            ("backfill_backlog_files", "Files waiting to be uploaded, re-keyed or checked", b.files as i64),
            (
                "backfill_retry_seconds",
                "Seconds until the object store is tried again (0: not backing off)",
                b.retry_in.map_or(0, |d| d.as_secs() as i64),
            ),
        ];
        for (name, help, v) in gauges {
            gauge(&mut encoder, name, help, v)?;
        }
        let counters = [
            ("backfill_uploaded_files", "Files uploaded to the object store", &s.uploaded_files),
            ("backfill_uploaded_bytes", "Bytes uploaded to the object store", &s.uploaded_bytes),
            ("backfill_failures", "Object store calls that failed (and will be retried)", &s.failures),
            ("backfill_rekeyed_files", "Objects moved to a renamed file's new key", &s.rekeyed),
            ("backfill_deleted_objects", "Objects deleted (stale keys, removed files)", &s.deleted),
            ("object_fetched_bytes", "Bytes fetched from the object store into the SSDs", &s.fetched_bytes),
            ("evicted_bytes", "Bytes of backed chunks evicted from the SSDs", &s.evicted_bytes),
        ];
        for (name, help, v) in counters {
            counter(&mut encoder, name, help, v)?;
        }
        Ok(())
    }
}

/// Serve `/metrics` on `addr` from a thread of its own.
pub fn serve(addr: SocketAddr, core: Weak<Core>) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)?;
    let bound = listener.local_addr()?;
    let mut registry = Registry::with_prefix("converged");
    registry.register_collector(Box::new(DaemonCollector { core }));
    std::thread::Builder::new().name("metrics".into()).spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(2)));
            let mut req = [0u8; 1024];
            let _ = s.read(&mut req);
            let mut body = String::new();
            let (status, body) = match prometheus_client::encoding::text::encode(&mut body, &registry) {
                Ok(()) => ("200 OK", body),
                Err(_) => ("500 Internal Server Error", String::new()),
            };
            let _ = write!(
                s,
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    })?;
    Ok(bound)
}
