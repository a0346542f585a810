#!/usr/bin/env bash
# Single-node benchmark: the same fio jobs against a plain directory on the
# disk ("raw") and against a converged mount whose data dir is on that same
# disk, in one run, printing each figure with its ratio to raw.
#
#   sudo bench/single-node.sh
#   sudo SIZE=256m NFILES=2000 bench/single-node.sh
#   sudo SAVE=1 bench/single-node.sh        # also write bench/results/single-node-<date>.txt
#
# Environment (defaults in brackets):
#   BENCH_DIR   work directory, on the disk under test [/var/tmp/converged-bench]
#   SIZE        size of the sequential file, fio syntax (k/m/g/t = KiB/MiB/GiB/TiB) [2g]
#   NFILES      files created, stat-ed and unlinked [10000]
#   RAND_PCT    percent of the file's 4 KiB blocks read by the random-read test [25]
#   STAT_LOOPS  stat passes over the NFILES files [10]
#   CONVERGED   converged binary [<repo>/target/release/converged; built if missing]
#   SAVE        1: also save the table under bench/results/ [0]
#   META        1: also run bench/metadata.sh (TARGETS="raw floor one uring", uring
#               where the kernel has FUSE over io_uring) and append its
#               table: creates, stats, unlinks, the untar of TREE files [1]
#   TREE        files in the metadata untar test [20000]
#
# Needs root (drop_caches, FUSE mounts), fio and python3. See bench/README.md.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
FIO_DIR=$SCRIPT_DIR/fio

BENCH_DIR=${BENCH_DIR:-/var/tmp/converged-bench}
SIZE=${SIZE:-2g}
NFILES=${NFILES:-10000}
RAND_PCT=${RAND_PCT:-25}
STAT_LOOPS=${STAT_LOOPS:-10}
DEFAULT_CONVERGED=$REPO/target/release/converged
CONVERGED=${CONVERGED:-$DEFAULT_CONVERGED}
SAVE=${SAVE:-0}
META=${META:-1}
TREE=${TREE:-20000}

die() { echo "single-node: $*" >&2; exit 1; }
log() { echo "== $*" >&2; }
# shellcheck source=scripts/disk.sh
. "$SCRIPT_DIR/scripts/disk.sh"

[[ $(id -u) -eq 0 ]] || die "run as root (drop_caches and FUSE mounts need it): sudo $0"
command -v fio >/dev/null || die "fio not found (apt-get install fio)"
command -v python3 >/dev/null || die "python3 not found"
[[ $SIZE =~ ^([1-9][0-9]*)([kKmMgGtT]?)$ ]] || die "SIZE=$SIZE: expected a number with an optional k/m/g/t suffix"
case ${BASH_REMATCH[2],,} in
    '') SIZE_BYTES=${BASH_REMATCH[1]} ;;
    k) SIZE_BYTES=$((BASH_REMATCH[1] << 10)) ;;
    m) SIZE_BYTES=$((BASH_REMATCH[1] << 20)) ;;
    g) SIZE_BYTES=$((BASH_REMATCH[1] << 30)) ;;
    t) SIZE_BYTES=$((BASH_REMATCH[1] << 40)) ;;
esac
for v in NFILES STAT_LOOPS RAND_PCT TREE; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "$v=${!v}: expected a positive integer"
done
[[ $META == 0 || $META == 1 ]] || die "META=$META: expected 0 or 1"
((RAND_PCT <= 100)) || die "RAND_PCT=$RAND_PCT: at most 100"
# Reads per random-read thread: each of the 4 threads reads RAND_PCT% of the
# 4 KiB blocks of its quarter of the file.
RAND_IOS=$((SIZE_BYTES / 4096 / 4 * RAND_PCT / 100))
((RAND_IOS >= 1)) || die "SIZE=$SIZE is too small for the random-read test"
case $BENCH_DIR in
    /*) ;;
    *) die "BENCH_DIR must be an absolute path" ;;
esac
[[ $BENCH_DIR != *[[:space:]]* ]] || die "BENCH_DIR must not contain white space"

if [[ ! -x $CONVERGED ]]; then
    [[ $CONVERGED == "$DEFAULT_CONVERGED" ]] || die "CONVERGED=$CONVERGED is not an executable"
    log "building converged (cargo build --release -p converged-fs)"
    (cd "$REPO" && cargo build --release -p converged-fs) || die "build failed"
fi

mkdir -p "$BENCH_DIR"
BENCH_DIR=$(cd "$BENCH_DIR" && pwd -P)
[[ $BENCH_DIR != / ]] || die "BENCH_DIR must not be /"
RAW=$BENCH_DIR/raw     # plain directory on the disk
DATA=$BENCH_DIR/data   # converged data dir, same disk
MNT=$BENCH_DIR/mnt     # converged mount point
JSON=$BENCH_DIR/json   # fio output, daemon log and the table (small; kept)

# True when a mount sits exactly at $1. Reads the mount table rather than
# stat-ing the path, which fails or hangs on a dead FUSE mount.
is_mounted() { awk -v m="$1" '$2 == m { f = 1 } END { exit !f }' /proc/self/mounts; }

is_mounted "$MNT" && die "$MNT is already mounted (left from an earlier run?); unmount it first: $CONVERGED umount $MNT"

cleanup() {
    local rc=$? i
    trap - EXIT INT TERM
    set +e
    if is_mounted "$MNT"; then
        log "unmounting $MNT"
        for i in 1 2 3 4 5 6 7 8 9 10; do
            "$CONVERGED" umount "$MNT" 2>/dev/null && break
            sleep 1
        done
        if is_mounted "$MNT"; then
            echo "single-node: $MNT still busy; detaching it lazily" >&2
            umount -l "$MNT"
        fi
    fi
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

# The block device under BENCH_DIR, for its read counters in /proc/diskstats
# (best effort: empty when it cannot be found, e.g. on tmpfs or overlay).
DISK_SRC=$(df -P "$BENCH_DIR" | awk 'NR == 2 { print $1 }')
DISK=
if [[ $DISK_SRC == /dev/* ]]; then
    DISK=$(basename "$(readlink -f "$DISK_SRC")")
    awk -v d="$DISK" '$3 == d { f = 1 } END { exit !f }' /proc/diskstats || DISK=
fi
# Sectors (512 bytes) read from DISK so far.
disk_sectors_read() {
    if [[ -n $DISK ]]; then awk -v d="$DISK" '$3 == d { print $6 }' /proc/diskstats; else echo 0; fi
}

# Drop the page cache, dentries and inodes, then bring fio's own program
# back in, so the disk counters of the timed run see the test's reads only.
drop_caches() {
    sync
    echo 3 > /proc/sys/vm/drop_caches
    fio --name=warm --ioengine=null --size=1m --output=/dev/null >/dev/null
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

# run_fio JOB TAG DIR [FIO OPTION...]: run bench/fio/JOB.fio against DIR;
# fio's JSON goes to $JSON/TAG.json and the bytes read from the disk meanwhile
# to $JSON/TAG.disk. The job files read DIR, SIZE, ... from the environment.
run_fio() {
    local job=$1 tag=$2 dir=$3 before after
    shift 3
    [[ -d $dir ]] || die "$tag: no directory $dir"
    log "$tag: fio $job.fio in $dir"
    before=$(disk_sectors_read)
    DIR=$dir SIZE=$SIZE NFILES=$NFILES STAT_LOOPS=$STAT_LOOPS RAND_IOS=$RAND_IOS \
        fio --output-format=json --output="$JSON/$tag.json" "$@" "$FIO_DIR/$job.fio" \
        || die "fio $job.fio failed against $dir (see $JSON/$tag.json)"
    after=$(disk_sectors_read)
    echo $(((after - before) * 512)) > "$JSON/$tag.disk"
}

log "raw: $RAW   converged: $MNT (data dir $DATA)"
log "SIZE=$SIZE NFILES=$NFILES RAND_PCT=$RAND_PCT ($RAND_IOS reads x 4 threads) STAT_LOOPS=$STAT_LOOPS"
mount_converged
PASSTHROUGH=$(grep -o 'passthrough=[a-z]*' "$DATA/converged.log" | tail -n 1 | cut -d= -f2 || true)
[[ $PASSTHROUGH == true ]] || log "WARNING: the converged mount runs without kernel passthrough (log says '${PASSTHROUGH:-nothing}')"

# Each test runs on raw and then at once on converged, so slow drifts of a
# shared machine hit both sides alike. Caches are dropped before every run.
side_dir() { if [[ $1 == raw ]]; then echo "$RAW${2:-}"; else echo "$MNT${2:-}"; fi; }
for job in seqwrite seqread randread; do
    for side in raw conv; do
        drop_caches
        run_fio "$job" "$job-$side" "$(side_dir "$side")"
    done
done
mkdir "$RAW/meta" "$MNT/meta"
for side in raw conv; do
    drop_caches
    run_fio create "create-$side" "$(side_dir "$side" /meta)"
done
for side in raw conv; do
    # Untimed: fio extends the empty files to 4 KiB (its layout phase only).
    run_fio stat "layout-$side" "$(side_dir "$side" /meta)" --create_only=1
done
for side in raw conv; do
    # fio's setup stats every file before the timed phase, so the timed stats
    # find the kernel's dentries and attributes cached (within converged's
    # 10 s attr timeout the daemon is not asked), whatever is dropped first.
    drop_caches
    run_fio stat "stat-$side" "$(side_dir "$side" /meta)"
done
# The same stats with nothing cached by the kernel: --attr-timeout 0 makes
# every stat ask the daemon (LOOKUP, GETATTR).
umount_converged
mount_converged --attr-timeout 0
drop_caches
run_fio stat stat-daemon "$MNT/meta"
umount_converged
# Back to the default mount; the caches are dropped before each run anyway.
mount_converged
for side in raw conv; do
    drop_caches
    run_fio unlink "unlink-$side" "$(side_dir "$side" /meta)"
done
rmdir "$RAW/meta" "$MNT/meta"
REFUSED=$(grep -c 'passthrough refused' "$DATA/converged.log" || true)

# The same cold read with every read through the daemon, checksums verified.
umount_converged
mount_converged --verify-reads
drop_caches
run_fio seqread seqread-verify "$MNT"
umount_converged

REPORT=$JSON/table.txt
{
    echo "converged single-node benchmark, $(date '+%Y-%m-%d %H:%M:%S %z')"
    echo "host $(hostname), kernel $(uname -r), $(nproc) CPUs, $(free -g | awk '/^Mem:/ { print $2 }') GiB RAM, $(fio --version)"
    rev=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')
    git -C "$REPO" diff --quiet HEAD 2>/dev/null || rev="$rev, modified"
    refused=
    [[ ${REFUSED:-0} == 0 ]] || refused=" (refused for $REFUSED opens)"
    echo "converged $("$CONVERGED" --version 2>/dev/null | awk '{ print $2 }') ($rev), passthrough: ${PASSTHROUGH:-unknown}$refused"
    echo "disk: $(describe_fs "$BENCH_DIR")"
    echo "SIZE=$SIZE NFILES=$NFILES RAND_PCT=$RAND_PCT STAT_LOOPS=$STAT_LOOPS"
    echo
    python3 - "$JSON" "$SIZE" "$NFILES" "$RAND_PCT" "${DISK:-}" <<'PY'
import json, sys

jdir, size, nfiles, rand_pct, disk = sys.argv[1:6]
nfiles = int(nfiles)

def load(tag):
    with open(f"{jdir}/{tag}.json") as f:
        text = f.read()
    # fio may put notes ahead of the JSON document.
    return json.loads(text[text.index("{"):])

def stats(tag):
    job = load(tag)["jobs"][0]  # every job file uses group_reporting
    if job.get("error"):
        sys.exit(f"fio job {tag} reported error {job['error']}")
    st = job[max(("read", "write"), key=lambda d: job[d]["total_ios"])]
    if st["runtime"] <= 0 or st["total_ios"] <= 0:
        sys.exit(f"fio job {tag}: no I/O or no runtime recorded")
    return st

def figure(tag, kind):
    """Bytes per second for kind "bw", else operations per second. fio's
    runtime (ms) covers the whole timed phase, the final fsync included."""
    st = stats(tag)
    n = st["io_bytes"] if kind == "bw" else st["total_ios"]
    return n * 1000.0 / st["runtime"]

def fmt(v, kind):
    if kind == "bw":
        return f"{v / 1e9:.2f} GB/s" if v >= 1e9 else f"{v / 1e6:.0f} MB/s"
    return f"{v:,.0f} " + ("IOPS" if kind == "iops" else "ops/s")

# label, kind, raw tag, converged tag, target: ("ratio", x) or ("ops", n)
rows = [
    (f"seq write {size} + fsync", "bw", "seqwrite-raw", "seqwrite-conv", ("ratio", 0.7)),
    ("cold seq read", "bw", "seqread-raw", "seqread-conv", ("ratio", 0.9)),
    ("4k random read", "iops", "randread-raw", "randread-conv", None),
    (f"create ({nfiles} files)", "ops", "create-raw", "create-conv", ("ops", 5000)),
    ("stat", "ops", "stat-raw", "stat-conv", ("ops", 50000)),
    ("stat (attr-timeout 0)", "ops", "stat-raw", "stat-daemon", ("ops", 50000)),
    ("unlink", "ops", "unlink-raw", "unlink-conv", None),
    ("cold seq read (verify-reads)", "bw", "seqread-raw", "seqread-verify", None),
]
w = (30, 16, 16, 8)
print(f"{'test':<{w[0]}}{'raw':<{w[1]}}{'converged':<{w[2]}}{'ratio':<{w[3]}}target")
for label, kind, rtag, ctag, target in rows:
    r, c = figure(rtag, kind), figure(ctag, kind)
    ratio = c / r
    t = ""
    if target and target[0] == "ratio":
        t = f">= {target[1]:.2f}x " + ("met" if ratio >= target[1] else "MISSED")
    elif target:
        t = f">= {target[1]:,} ops/s " + ("met" if c >= target[1] else "MISSED")
    print(f"{label:<{w[0]}}{fmt(r, kind):<{w[1]}}{fmt(c, kind):<{w[2]}}{f'{ratio:.2f}x':<{w[3]}}{t}".rstrip())

if disk:
    # Read amplification: what each read test asked for against what the
    # disk delivered meanwhile (a whole-disk counter: other readers count too).
    print()
    print(f"bytes read: asked by fio / read from {disk}")
    for label, rtag, ctag in [
        ("cold seq read", "seqread-raw", "seqread-conv"),
        (f"4k random read ({rand_pct}%)", "randread-raw", "randread-conv"),
        ("cold seq read (verify-reads)", None, "seqread-verify"),
    ]:
        cells = []
        for tag in (rtag, ctag):
            if tag is None:
                cells.append("")
                continue
            with open(f"{jdir}/{tag}.disk") as f:
                d = int(f.read())
            cells.append(f"{stats(tag)['io_bytes'] / 1e6:.0f} / {d / 1e6:.0f} MB")
        print(f"{label:<{w[0]}}{cells[0]:<{w[1]}}{cells[1]}".rstrip())
PY
} > "$REPORT"

# The metadata figures (bench/metadata.sh, its table appended to this one):
# creates, first, cached and later stats and unlinks from 1 and 16
# processes, etcd's own ceiling where etcd is used, and the untar, ls -lR
# and rm -rf of TREE small files, on ext4 and one node.
if [[ $META == 1 ]]; then
    meta_targets="raw floor one"
    [[ -e /sys/module/fuse/parameters/enable_uring ]] && meta_targets+=" uring"
    log "metadata: bench/metadata.sh with TARGETS=\"$meta_targets\""
    BENCH_DIR=$BENCH_DIR/meta TARGETS="$meta_targets" NFILES=$NFILES TREE=$TREE CONVERGED=$CONVERGED SAVE=0 APPEND_TO=$REPORT \
        "$SCRIPT_DIR/metadata.sh" > "$JSON/metadata.txt" || die "bench/metadata.sh failed"
fi
echo
cat "$REPORT"
if [[ $SAVE == 1 ]]; then
    mkdir -p "$SCRIPT_DIR/results"
    out=$SCRIPT_DIR/results/single-node-$(date +%Y-%m-%d-%H%M%S).txt
    cp "$REPORT" "$out"
    echo "saved to $out"
fi
