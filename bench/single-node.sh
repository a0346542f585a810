#!/usr/bin/env bash
# Single-node benchmark: the same fio jobs against a plain directory on the
# disk ("raw") and against a converged mount whose data dir is on that same
# disk, in one run, printing each figure with its ratio to raw.
#
#   sudo bench/single-node.sh
#   sudo SIZE=256m NFILES=2000 RUNTIME=10 bench/single-node.sh
#   sudo SAVE=1 bench/single-node.sh        # also write bench/results/single-node-<date>.txt
#
# Environment (defaults in brackets):
#   BENCH_DIR   work directory, on the disk under test [/var/tmp/converged-bench]
#   SIZE        size of the sequential file, fio syntax (g = GiB) [2g]
#   NFILES      files created, stat-ed and unlinked [10000]
#   RUNTIME     seconds of 4 KiB random reads [20]
#   STAT_LOOPS  stat passes over the NFILES files [10]
#   CONVERGED   converged binary [<repo>/target/release/converged; built if missing]
#   SAVE        1: also save the table under bench/results/ [0]
#
# Needs root (drop_caches, FUSE mounts), fio and python3. See bench/README.md.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
FIO_DIR=$SCRIPT_DIR/fio

BENCH_DIR=${BENCH_DIR:-/var/tmp/converged-bench}
SIZE=${SIZE:-2g}
NFILES=${NFILES:-10000}
RUNTIME=${RUNTIME:-20}
STAT_LOOPS=${STAT_LOOPS:-10}
DEFAULT_CONVERGED=$REPO/target/release/converged
CONVERGED=${CONVERGED:-$DEFAULT_CONVERGED}
SAVE=${SAVE:-0}

die() { echo "single-node: $*" >&2; exit 1; }
log() { echo "== $*" >&2; }

[[ $(id -u) -eq 0 ]] || die "run as root (drop_caches and FUSE mounts need it): sudo $0"
command -v fio >/dev/null || die "fio not found (apt-get install fio)"
command -v python3 >/dev/null || die "python3 not found"
[[ $SIZE =~ ^[0-9]+[kKmMgGtT]?$ ]] || die "SIZE=$SIZE: expected a number with an optional k/m/g/t suffix"
for v in NFILES RUNTIME STAT_LOOPS; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "$v=${!v}: expected a positive integer"
done
case $BENCH_DIR in
    /*) ;;
    *) die "BENCH_DIR must be an absolute path" ;;
esac
[[ $BENCH_DIR != *[[:space:]]* ]] || die "BENCH_DIR must not contain white space"
[[ $BENCH_DIR != / ]] || die "BENCH_DIR must not be /"

if [[ ! -x $CONVERGED ]]; then
    [[ $CONVERGED == "$DEFAULT_CONVERGED" ]] || die "CONVERGED=$CONVERGED is not an executable"
    log "building converged (cargo build --release -p converged-fs)"
    (cd "$REPO" && cargo build --release -p converged-fs) || die "build failed"
fi

RAW=$BENCH_DIR/raw
DATA=$BENCH_DIR/data
MNT=$BENCH_DIR/mnt
JSON=$BENCH_DIR/json

# True when a mount sits exactly at $1 (read from the mount table, not by
# stat-ing the path, which hangs or fails on a dead FUSE mount).
is_mounted() { awk -v m="$1" '$2 == m { f = 1 } END { exit !f }' /proc/self/mounts; }

mkdir -p "$BENCH_DIR"
BENCH_DIR=$(cd "$BENCH_DIR" && pwd -P)
RAW=$BENCH_DIR/raw DATA=$BENCH_DIR/data MNT=$BENCH_DIR/mnt JSON=$BENCH_DIR/json
is_mounted "$MNT" && die "$MNT is already mounted (left from an earlier run?); unmount it first: $CONVERGED umount $MNT"

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    set +e
    if is_mounted "$MNT"; then
        log "unmounting $MNT"
        local i
        for i in 1 2 3 4 5 6 7 8 9 10; do
            "$CONVERGED" umount "$MNT" 2>/dev/null && break
            sleep 1
        done
        if is_mounted "$MNT"; then
            echo "single-node: $MNT still busy; detaching it lazily" >&2
            umount -l "$MNT"
        fi
    fi
    # The big files go; the fio JSON and the daemon log (small) stay in $JSON.
    [[ -f $DATA/converged.log ]] && cp "$DATA/converged.log" "$JSON/" 2>/dev/null
    rm -rf "$RAW" "$DATA"
    rmdir "$MNT" 2>/dev/null
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

rm -rf "$RAW" "$DATA" "$JSON"
mkdir -p "$RAW" "$DATA" "$MNT" "$JSON"
[[ $(stat -c %d "$RAW") == $(stat -c %d "$DATA") ]] || die "$RAW and $DATA are on different filesystems"

drop_caches() {
    sync
    echo 3 > /proc/sys/vm/drop_caches
}

mount_converged() { # extra mount options...
    if ! "$CONVERGED" mount "$MNT" --data-dir "$DATA" "$@"; then
        echo "--- tail of $DATA/converged.log" >&2
        tail -n 20 "$DATA/converged.log" >&2 || true
        die "mount failed"
    fi
    # The first access waits for the kernel's FUSE INIT, whose handling logs
    # whether passthrough is on.
    stat "$MNT" >/dev/null
}

umount_converged() {
    "$CONVERGED" umount "$MNT"
}

# run_fio JOB TAG DIR: run bench/fio/JOB.fio against DIR, JSON to $JSON/TAG.json.
run_fio() {
    local job=$1 tag=$2 dir=$3
    log "$tag: fio $job.fio in $dir"
    DIR=$dir SIZE=$SIZE RUNTIME=$RUNTIME NFILES=$NFILES STAT_LOOPS=$STAT_LOOPS \
        fio --output-format=json --output="$JSON/$tag.json" "$FIO_DIR/$job.fio" \
        || die "fio $job.fio failed against $dir (see $JSON/$tag.json)"
}

log "raw: $RAW   converged: $MNT (data dir $DATA)   SIZE=$SIZE NFILES=$NFILES RUNTIME=${RUNTIME}s"
mount_converged
PASSTHROUGH=$(grep -o 'passthrough=[a-z]*' "$DATA/converged.log" | tail -n 1 | cut -d= -f2 || true)
[[ $PASSTHROUGH == true ]] || log "WARNING: the converged mount runs without kernel passthrough (log says '${PASSTHROUGH:-nothing}')"

# Each test runs on raw and then at once on converged, so slow drifts of a
# shared machine hit both sides alike.
for side in raw conv; do
    if [[ $side == raw ]]; then d=$RAW; else d=$MNT; fi
    drop_caches
    run_fio seqwrite "seqwrite-$side" "$d"
done
for side in raw conv; do
    if [[ $side == raw ]]; then d=$RAW; else d=$MNT; fi
    drop_caches
    run_fio seqread "seqread-$side" "$d"
done
for side in raw conv; do
    if [[ $side == raw ]]; then d=$RAW; else d=$MNT; fi
    drop_caches
    run_fio randread "randread-$side" "$d"
done
mkdir "$RAW/meta" "$MNT/meta"
for job in create stat unlink; do
    for side in raw conv; do
        if [[ $side == raw ]]; then d=$RAW/meta; else d=$MNT/meta; fi
        drop_caches
        run_fio "$job" "$job-$side" "$d"
    done
done
rmdir "$RAW/meta" "$MNT/meta"
REFUSED=$(grep -c 'passthrough refused' "$DATA/converged.log" || true)
[[ $REFUSED != 0 ]] || REFUSED=

# The same cold read with every read through the daemon, checksums verified.
umount_converged
mount_converged --verify-reads
drop_caches
run_fio seqread "seqread-verify" "$MNT"
umount_converged

REPORT=$JSON/table.txt
{
    echo "converged single-node benchmark, $(date '+%Y-%m-%d %H:%M:%S %z')"
    echo "host $(hostname), kernel $(uname -r), $(nproc) CPUs, $(fio --version)"
    echo "converged $("$CONVERGED" --version 2>/dev/null | awk '{print $2}') ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$REPO" diff --quiet HEAD 2>/dev/null || echo ', dirty')), passthrough: ${PASSTHROUGH:-unknown}${REFUSED:+, refused on $REFUSED opens}"
    echo "disk: $(df -P "$BENCH_DIR" | awk 'NR == 2 {print $1}') ($(stat -f -c %T "$BENCH_DIR")) under $BENCH_DIR"
    echo "SIZE=$SIZE NFILES=$NFILES RUNTIME=${RUNTIME}s STAT_LOOPS=$STAT_LOOPS"
    echo
    python3 - "$JSON" "$SIZE" "$NFILES" <<'PY'
import json, sys

jdir, size, nfiles = sys.argv[1], sys.argv[2], int(sys.argv[3])

def load(tag):
    with open(f"{jdir}/{tag}.json") as f:
        text = f.read()
    # fio may put notes ahead of the JSON document.
    return json.loads(text[text.index("{"):])

def figure(tag, kind):
    """bw in bytes/s, or operations per second."""
    job = load(tag)["jobs"][0]  # every job file uses group_reporting
    if job.get("error"):
        sys.exit(f"fio job {tag} reported error {job['error']}")
    ddir = max(("read", "write"), key=lambda d: job[d]["total_ios"])
    st = job[ddir]
    if st["runtime"] <= 0:
        sys.exit(f"fio job {tag}: no runtime recorded")
    if kind == "bw":
        return st["io_bytes"] * 1000.0 / st["runtime"]
    return st["total_ios"] * 1000.0 / st["runtime"]

def fmt(v, kind):
    if kind == "bw":
        return f"{v / 1e9:.2f} GB/s" if v >= 1e9 else f"{v / 1e6:.0f} MB/s"
    unit = "IOPS" if kind == "iops" else "ops/s"
    return f"{v:,.0f} {unit}"

# label, kind, raw tag, converged tag, target (ratio or absolute ops/s)
rows = [
    (f"seq write {size} + fsync", "bw", "seqwrite-raw", "seqwrite-conv", ("ratio", 0.7)),
    ("cold seq read", "bw", "seqread-raw", "seqread-conv", ("ratio", 0.9)),
    ("4k random read", "iops", "randread-raw", "randread-conv", None),
    (f"create ({nfiles} files)", "ops", "create-raw", "create-conv", ("abs", 5000)),
    ("stat", "ops", "stat-raw", "stat-conv", ("abs", 50000)),
    ("unlink", "ops", "unlink-raw", "unlink-conv", None),
    ("cold seq read (verify-reads)", "bw", "seqread-raw", "seqread-verify", None),
]
w = (30, 16, 16, 8)
print(f"{'test':<{w[0]}}{'raw':<{w[1]}}{'converged':<{w[2]}}{'ratio':<{w[3]}}target")
for label, kind, rtag, ctag, target in rows:
    r, c = figure(rtag, kind), figure(ctag, kind)
    ratio = c / r if r > 0 else float("nan")
    t = ""
    if target and target[0] == "ratio":
        t = f">= {target[1]:.2f}x " + ("met" if ratio >= target[1] else "MISSED")
    elif target:
        t = f">= {target[1]:,} ops/s " + ("met" if c >= target[1] else "MISSED")
    line = f"{label:<{w[0]}}{fmt(r, kind):<{w[1]}}{fmt(c, kind):<{w[2]}}{f'{ratio:.2f}x':<{w[3]}}{t}"
    print(line.rstrip())
PY
} > "$REPORT"
echo
cat "$REPORT"
if [[ $SAVE == 1 ]]; then
    mkdir -p "$SCRIPT_DIR/results"
    out=$SCRIPT_DIR/results/single-node-$(date +%Y-%m-%d-%H%M%S).txt
    cp "$REPORT" "$out"
    echo "saved to $out"
fi
