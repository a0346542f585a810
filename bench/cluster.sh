#!/usr/bin/env bash
# Cluster benchmark on one machine: `converged dev-cluster --nodes 2` (a
# one-member etcd and two nodes on loopback, data dirs on the disk under
# test), against the raw disk and a plain TCP copy measured in the same run.
#
#   sudo bench/cluster.sh
#   sudo SIZE=512m NFILES=2000 bench/cluster.sh      # quick check
#   sudo SAVE=1 bench/cluster.sh                     # also write bench/results/cluster-<date>.txt
#
# What it prints, each with its ratio:
#   replicated write   fio seq write + fsync on n1 (replicas=2: n2 holds a copy
#                      on stable storage before fsync returns) / the same on raw,
#                      and / the one-disk limit of two copies (0.5x raw: both
#                      nodes write to this one disk)
#   device bytes       bytes the disk under test wrote (/proc/diskstats, after
#                      a sync and the settler's passes) per byte fio wrote
#   checkpoint         the torch.save pattern with SIZE bytes (write NAME.tmp,
#                      fsync, rename, fsync the directory; bench/scripts/
#                      checkpoint.py) on a single-node mount and on the
#                      2-node cluster (replicas=2), split into its steps;
#                      CKPT_ROUNDS rounds (raw, 1 node, 2 nodes in turn), the
#                      round of median total shown; and against the disk's
#                      floor: the bytes each side must put on this one disk
#                      (1 or 2 copies) at the raw write rate
#   remote seq read    cold fio seq read on n2 of a file whose chunks are on n1
#                      only (replicas=1) / a plain TCP copy of the same bytes
#                      over loopback (bench/scripts/tcp_copy.py, sendfile)
#   4k random read     cold, of that file, on n1 (local) and on n2 (remote):
#                      QD1 mean latency and QD16 IOPS
#   create, stat       fio create and cached stat on the etcd-backed mount,
#                      against the raw directory and the issue's floors
#
# Environment (defaults in brackets):
#   BENCH_DIR   work directory, on the disk under test [/var/tmp/converged-cluster-bench]
#   SIZE        size of the sequential file, fio syntax [2g]
#   NFILES      files created and stat-ed [5000]
#   STAT_LOOPS  stat passes over the NFILES files [10]
#   MOUNT_OPTS  extra options for every node's mount, space separated (e.g. "--threads=32") []
#   JOBS        processes creating NFILES/JOBS files each, for the parallel create [16]
#   CONVERGED   converged binary [<repo>/target/release/converged; built if missing]
#   CKPT_ROUNDS checkpoint rounds [3]
#   SAVE        1: also save the table under bench/results/ [0]
#   META        1: also run bench/metadata.sh (TARGETS="raw cluster nowsync") and append its
#               table: creates, stats, unlinks, the untar of TREE files [1]
#   TREE        files in the metadata untar test [20000]
#   PEERS       1: also run the replicated write and the checkpoint on MooseFS
#               (goal 2) and GlusterFS (replica 2) started from ../shared/peers [0]
#
# Needs root, fio, python3 and etcd (/usr/bin/etcd, Debian etcd-server).
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
FIO_DIR=$SCRIPT_DIR/fio

BENCH_DIR=${BENCH_DIR:-/var/tmp/converged-cluster-bench}
SIZE=${SIZE:-2g}
NFILES=${NFILES:-5000}
CKPT_ROUNDS=${CKPT_ROUNDS:-3}
STAT_LOOPS=${STAT_LOOPS:-10}
JOBS=${JOBS:-16}
MOUNT_OPTS=${MOUNT_OPTS:-}
DEFAULT_CONVERGED=$REPO/target/release/converged
CONVERGED=${CONVERGED:-$DEFAULT_CONVERGED}
SAVE=${SAVE:-0}
META=${META:-1}
TREE=${TREE:-20000}
PEERS=${PEERS:-0}
PEERS_DIR=$REPO/../shared/peers
PEERS_UP=()

die() { echo "cluster-bench: $*" >&2; exit 1; }
log() { echo "== $*" >&2; }
# shellcheck source=scripts/disk.sh
. "$SCRIPT_DIR/scripts/disk.sh"

[[ $(id -u) -eq 0 ]] || die "run as root (drop_caches and FUSE mounts need it): sudo $0"
command -v fio >/dev/null || die "fio not found (apt-get install fio)"
command -v python3 >/dev/null || die "python3 not found"
[[ -x /usr/bin/etcd ]] || die "/usr/bin/etcd not found (apt-get install etcd-server)"
[[ $SIZE =~ ^[1-9][0-9]*[kKmMgGtT]?$ ]] || die "SIZE=$SIZE: expected a number with an optional k/m/g/t suffix"
for v in NFILES STAT_LOOPS JOBS TREE; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "$v=${!v}: expected a positive integer"
done
[[ $META == 0 || $META == 1 ]] || die "META=$META: expected 0 or 1"
case $BENCH_DIR in /*) ;; *) die "BENCH_DIR must be an absolute path" ;; esac
[[ $BENCH_DIR != *[[:space:]]* ]] || die "BENCH_DIR must not contain white space"

if [[ ! -x $CONVERGED ]]; then
    [[ $CONVERGED == "$DEFAULT_CONVERGED" ]] || die "CONVERGED=$CONVERGED is not an executable"
    log "building converged (cargo build --release -p converged-fs)"
    (cd "$REPO" && cargo build --release -p converged-fs) || die "build failed"
fi

mkdir -p "$BENCH_DIR"
BENCH_DIR=$(cd "$BENCH_DIR" && pwd -P)
[[ $BENCH_DIR != / ]] || die "BENCH_DIR must not be /"
RAW=$BENCH_DIR/raw
DEV=$BENCH_DIR/dev
JSON=$BENCH_DIR/json
N1=$DEV/n1/mnt
N2=$DEV/n2/mnt
SOLO=$BENCH_DIR/solo   # a single-node mount (embedded metadata), for the checkpoint
SIZE_BYTES=$(numfmt --from=iec "${SIZE^^}")

# The block device holding BENCH_DIR, for its written-sector count.
DISK=$(findmnt -no SOURCE -T "$BENCH_DIR" 2>/dev/null || true)
DISK_STAT=
[[ $DISK == /dev/* ]] && DISK_STAT=/sys/class/block/$(basename "$(readlink -f "$DISK")")/stat
[[ -n $DISK_STAT && -r $DISK_STAT ]] || DISK_STAT=
# Bytes the disk under test has written since boot (0 when unknown).
disk_written() {
    [[ -n $DISK_STAT ]] || { echo 0; return; }
    awk '{ printf "%.0f\n", $7 * 512 }' "$DISK_STAT"
}

DEV_PID=
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    set +e
    if [[ -n $DEV_PID ]] && kill -0 "$DEV_PID" 2>/dev/null; then
        log "stopping dev-cluster"
        kill -TERM "$DEV_PID"
        wait "$DEV_PID"
    fi
    for n in n1 n2; do
        [[ -f $DEV/$n/data/converged.log ]] && cp "$DEV/$n/data/converged.log" "$JSON/$n.log"
    done
    if grep -qs " $SOLO/mnt fuse" /proc/mounts; then
        "$CONVERGED" umount "$SOLO/mnt" 2>/dev/null || umount -l "$SOLO/mnt"
    fi
    for p in "${PEERS_UP[@]}"; do "$PEERS_DIR/peer_$p.sh" stop >/dev/null 2>&1; done
    rm -rf "$RAW" "$DEV" "$SOLO"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

rm -rf "$RAW" "$DEV" "$JSON" "$SOLO"
mkdir -p "$RAW" "$JSON"

drop_caches() {
    sync
    echo 3 > /proc/sys/vm/drop_caches
    fio --name=warm --ioengine=null --size=1m --output=/dev/null >/dev/null
}

run_fio() { # JOB TAG DIR [FIO OPTION...]
    local job=$1 tag=$2 dir=$3
    shift 3
    log "$tag: fio $job.fio in $dir"
    DIR=$dir SIZE=$SIZE NFILES=$NFILES STAT_LOOPS=$STAT_LOOPS RAND_IOS=${RAND_IOS:-1} JOBS=$JOBS \
        NFILES_PER_JOB=$((NFILES / JOBS)) NUMJOBS=${NUMJOBS:-1} SHARE=${SHARE:-100%} \
        fio --output-format=json --output="$JSON/$tag.json" "$@" "$FIO_DIR/$job.fio" \
        || die "fio $job.fio failed against $dir (see $JSON/$tag.json)"
}

# Device bytes written while a write test ran, through a sync and a few
# seconds for the nodes' background work on what it wrote (settling
# replica versions): recorded as TAG.disk.
run_counted() { # TAG COMMAND...
    local tag=$1
    shift
    sync
    local before
    before=$(disk_written)
    "$@"
    sync
    sleep 3
    sync
    echo $(($(disk_written) - before)) > "$JSON/$tag.disk"
}

checkpoint() { # TAG DIR [ROUND]
    log "$1: checkpoint of $SIZE in $2"
    python3 "$SCRIPT_DIR/scripts/checkpoint.py" "$2" "$SIZE_BYTES" > "$JSON/$1.ckpt${3:+.$3}" || die "checkpoint in $2 failed"
}

log "starting dev-cluster (2 nodes) in $DEV"
mkfifo "$JSON/dev.out"
DEV_ARGS=()
for o in $MOUNT_OPTS; do DEV_ARGS+=("--mount-opt=$o"); done
"$CONVERGED" dev-cluster --nodes 2 --dir "$DEV" "${DEV_ARGS[@]}" > "$JSON/dev.out" 2>"$JSON/dev.err" &
DEV_PID=$!
exec 3<"$JSON/dev.out"
while IFS= read -r -u 3 line; do
    echo "   $line" >&2
    [[ $line == "dev-cluster ready"* ]] && break
done
kill -0 "$DEV_PID" 2>/dev/null || die "dev-cluster failed: $(cat "$JSON/dev.err")"
# Keep draining its output so it never blocks on a full pipe.
cat <&3 >/dev/null &

# Replicated write: replicas=2 (the cluster default) against raw, with the
# device bytes each wrote.
mkdir "$N1/rep"
for side in raw conv; do
    drop_caches
    if [[ $side == raw ]]; then
        run_counted write-raw run_fio seqwrite write-raw "$RAW"
    else
        run_counted write-rep run_fio seqwrite write-rep "$N1/rep"
    fi
done
rm -f "$N1/rep/seqfile"

# Checkpoints: raw, one node (its own mount, embedded metadata, same disk),
# two nodes (replicas=2).
# Rounds in turn: one run each is at the mercy of this shared host (a
# first write into memory the host took back runs at a fraction of speed).
mkdir -p "$RAW/ckpt" "$SOLO/mnt" "$SOLO/data" "$N1/ckpt"
log "starting a single-node mount in $SOLO"
"$CONVERGED" mount "$SOLO/mnt" --data-dir "$SOLO/data" || die "single-node mount failed"
for round in $(seq "$CKPT_ROUNDS"); do
    for side in raw one two; do
        case $side in
            raw) d=$RAW/ckpt ;;
            one) d=$SOLO/mnt ;;
            two) d=$N1/ckpt ;;
        esac
        drop_caches
        checkpoint "ckpt-$side" "$d" "$round"
    done
done
"$CONVERGED" umount "$SOLO/mnt"
rm -rf "$SOLO"
rm -rf "$RAW/ckpt" "$N1/ckpt"

# The same write and checkpoint on MooseFS (goal 2) and GlusterFS (replica 2).
if [[ $PEERS == 1 ]]; then
    for p in moosefs gluster; do
        if [[ -x $PEERS_DIR/peer_$p.sh ]] && "$PEERS_DIR/peer_$p.sh" start >"$JSON/$p.log" 2>&1; then
            PEERS_UP+=("$p")
            d=/tmp/peers/mfs/mnt; [[ $p == gluster ]] && d=/tmp/peers/gluster/mnt
            mkdir -p "$d/bench-w" "$d/bench-ckpt"
            drop_caches
            run_counted "write-$p" run_fio seqwrite "write-$p" "$d/bench-w"
            drop_caches
            checkpoint "ckpt-$p" "$d/bench-ckpt"
            rm -rf "$d/bench-w" "$d/bench-ckpt"
            "$PEERS_DIR/peer_$p.sh" stop >/dev/null 2>&1
        else
            log "$p: not started (see $JSON/$p.log)"
        fi
    done
fi
echo "${PEERS_UP[*]}" > "$JSON/peers.txt"

# Remote read: a file with one copy, on n1, read cold on n2; then the plain
# TCP copy of the raw file (same size, same disk), cold too.
mkdir "$N1/solo"
setfattr -n user.converged.replicas -v 1 "$N1/solo" 2>/dev/null \
    || python3 -c "import os,sys; os.setxattr(sys.argv[1], 'user.converged.replicas', b'1')" "$N1/solo"
run_fio seqwrite write-solo "$N1/solo"
drop_caches
run_fio seqread read-remote "$N2/solo"
drop_caches
log "tcp: plain TCP copy of $RAW/seqfile over loopback"
python3 "$SCRIPT_DIR/scripts/tcp_copy.py" "$RAW/seqfile" > "$JSON/tcp.json"
drop_caches
run_fio seqread read-raw "$RAW"

# 4 KiB random reads of the one-copy file: on n1, which holds it, and on
# n2, which reads it from n1; QD1 and QD16, cold.
RAND_QD1=${RAND_QD1:-2000}
RAND_QD16=${RAND_QD16:-500}
for where in local remote; do
    d=$N1/solo; [[ $where == remote ]] && d=$N2/solo
    drop_caches
    RAND_IOS=$RAND_QD1 NUMJOBS=1 SHARE=100% run_fio randread-qd "rand1-$where" "$d"
    drop_caches
    RAND_IOS=$RAND_QD16 NUMJOBS=16 SHARE=$((SIZE_BYTES / 16)) run_fio randread-qd "rand16-$where" "$d"
done

# Metadata on etcd: create, then cached stat (the kernel answers within the
# attr timeout; the etcd watch evicts what other nodes change).
mkdir "$RAW/meta" "$N1/meta"
for side in raw conv; do
    d=$RAW/meta; [[ $side == conv ]] && d=$N1/meta
    drop_caches
    run_fio create "create-$side" "$d"
    run_fio stat "layout-$side" "$d" --create_only=1
    drop_caches
    run_fio stat "stat-$side" "$d"
done
mkdir "$RAW/pmeta" "$N1/pmeta"
for side in raw conv; do
    d=$RAW/pmeta; [[ $side == conv ]] && d=$N1/pmeta
    for ((j = 0; j < JOBS; j++)); do mkdir -p "$d/j$j"; done
    drop_caches
    run_fio create-parallel "pcreate-$side" "$d"
done

REPORT=$JSON/table.txt
{
    echo "converged cluster benchmark (dev-cluster, 2 nodes on loopback), $(date '+%Y-%m-%d %H:%M:%S %z')"
    echo "host $(hostname), kernel $(uname -r), $(nproc) CPUs, $(free -g | awk '/^Mem:/ { print $2 }') GiB RAM, $(fio --version), $(/usr/bin/etcd --version | head -n 1)"
    rev=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')
    git -C "$REPO" diff --quiet HEAD 2>/dev/null || rev="$rev, modified"
    echo "converged $("$CONVERGED" --version | awk '{ print $2 }') ($rev); disk: $(describe_fs "$BENCH_DIR")"
    echo "SIZE=$SIZE NFILES=$NFILES STAT_LOOPS=$STAT_LOOPS JOBS=$JOBS"
    echo
    python3 - "$JSON" "$SIZE" "$NFILES" "$JOBS" "$SIZE_BYTES" <<'PY'
import json, os, sys

jdir, size, nfiles, jobs, size_bytes = sys.argv[1:6]
size_bytes = int(size_bytes)

def stats(tag):
    with open(f"{jdir}/{tag}.json") as f:
        text = f.read()
    job = json.loads(text[text.index("{"):])["jobs"][0]
    if job.get("error"):
        sys.exit(f"fio job {tag} reported error {job['error']}")
    return job[max(("read", "write"), key=lambda d: job[d]["total_ios"])]

def bw(tag):
    st = stats(tag)
    return st["io_bytes"] * 1000.0 / st["runtime"]

def ops(tag):
    st = stats(tag)
    return st["total_ios"] * 1000.0 / st["runtime"]

with open(f"{jdir}/tcp.json") as f:
    tcp = json.load(f)
tcp_bw = tcp["bytes"] / tcp["seconds"]

gb = lambda v: f"{v / 1e9:.2f} GB/s"
op = lambda v: f"{v:,.0f} ops/s"
rows = [
    (f"replicated write {size} + fsync", "raw disk", bw("write-raw"), bw("write-rep"), gb, "", None),
    ("remote seq read (n1 -> n2)", "TCP copy", tcp_bw, bw("read-remote"), gb, ">= 0.80x", 0.8),
    ("remote seq read (n1 -> n2)", "raw disk", bw("read-raw"), bw("read-remote"), gb, "", None),
    (f"create ({nfiles} files, etcd)", "raw dir", ops("create-raw"), ops("create-conv"), op, ">= 2,000 ops/s", 2000),
    (f"create, {jobs} at once (etcd)", "raw dir", ops("pcreate-raw"), ops("pcreate-conv"), op, ">= 2,000 ops/s", 2000),
    ("stat, cached (etcd)", "raw dir", ops("stat-raw"), ops("stat-conv"), op, ">= 50,000 ops/s", 50000),
]
print(f"{'test':<34}{'against':<10}{'baseline':<16}{'converged':<16}{'ratio':<8}target")
for label, against, base, conv, f, target, floor in rows:
    ratio = conv / base
    met = ""
    if floor is not None:
        ok = ratio >= floor if floor < 10 else conv >= floor
        met = f"{target} " + ("met" if ok else "MISSED")
    print(f"{label:<34}{against:<10}{f(base):<16}{f(conv):<16}{f'{ratio:.2f}x':<8}{met}".rstrip())

limit = bw("write-raw") / 2
ratio = bw("write-rep") / limit
print(f"{'replicated write, of 2-copy limit':<34}{'raw / 2':<10}{gb(limit):<16}{gb(bw('write-rep')):<16}{f'{ratio:.2f}x':<8}"
      f">= 0.90x {'met' if ratio >= 0.9 else 'MISSED'}")

def disk(tag):
    with open(f"{jdir}/{tag}.disk") as f:
        return int(f.read())

print()
if disk("write-raw") > 0:
    raw_d, rep_d = disk("write-raw") / size_bytes, disk("write-rep") / size_bytes
    print(f"device bytes per app byte (seq write {size} + fsync): raw {raw_d:.2f}, "
          f"replicated {rep_d:.2f} (target <= 2.20 at 2 copies: {'met' if rep_d <= 2.2 else 'MISSED'})")
else:
    print("device bytes per app byte: not measured (no block device found under the bench dir)")

def ckpt(tag):
    """The run of median total among a side's rounds (or its one run)."""
    runs = []
    for name in sorted(os.listdir(jdir)):
        if name == f"{tag}.ckpt" or name.startswith(f"{tag}.ckpt."):
            with open(f"{jdir}/{name}") as f:
                runs.append(json.load(f))
    runs.sort(key=lambda r: r["total"])
    return runs[(len(runs) - 1) // 2]

print()
rounds = len([n for n in os.listdir(jdir) if n.startswith("ckpt-two.ckpt")])
print(f"checkpoint {size} (write NAME.tmp, fsync, rename + dir fsync), seconds, median of {rounds}:")
print(f"  {'':<10}{'write':>8}{'fsync':>8}{'rename':>8}{'total':>8}")
for tag, label in (("ckpt-raw", "raw"), ("ckpt-one", "1 node"), ("ckpt-two", "2 nodes")):
    c = ckpt(tag)
    print(f"  {label:<10}{c['write']:>8.2f}{c['fsync']:>8.2f}{c['rename']:>8.2f}{c['total']:>8.2f}")
two_one = ckpt("ckpt-two")["total"] / ckpt("ckpt-one")["total"]
print(f"  2 nodes / 1 node: {two_one:.2f}x (target <= 1.30x: {'met' if two_one <= 1.3 else 'MISSED'})")
# What the one disk allows: each copy written once at the raw write rate.
floor = lambda copies: copies * size_bytes / bw("write-raw")
print(f"  against the disk's floor (copies x {size} at {gb(bw('write-raw'))}): "
      f"1 node {ckpt('ckpt-one')['total'] / floor(1):.2f}x ({floor(1):.2f} s), "
      f"2 nodes {ckpt('ckpt-two')['total'] / floor(2):.2f}x ({floor(2):.2f} s)")

peers = open(f"{jdir}/peers.txt").read().split()
if peers:
    print()
    print("beside the peers (same jobs, same disk; MooseFS chunkservers do not fsync by default):")
    print(f"  {'':<12}{'write + fsync':>14}{'/ raw':>8}{'dev bytes':>11}{'checkpoint':>12}{'fsync':>8}")
    rows = [("converged", "write-rep", "ckpt-two")] + [(p, f"write-{p}", f"ckpt-{p}") for p in peers]
    for name, w, c in rows:
        dev = disk(w) / size_bytes if disk("write-raw") > 0 else float("nan")
        print(f"  {name:<12}{gb(bw(w)):>14}{bw(w) / bw('write-raw'):>7.2f}x{dev:>11.2f}{ckpt(c)['total']:>11.2f}s{ckpt(c)['fsync']:>7.2f}s")

def lat_us(tag):
    st = stats(tag)
    return st["clat_ns"]["mean"] / 1000.0

print()
print("4k random read, cold (one-copy file on n1): QD1 mean latency, QD16 IOPS")
print(f"  local (n1)   {lat_us('rand1-local'):>9.0f} us {ops('rand16-local'):>10,.0f} IOPS")
print(f"  remote (n2)  {lat_us('rand1-remote'):>9.0f} us {ops('rand16-remote'):>10,.0f} IOPS")
PY
} > "$REPORT"

# The metadata figures (bench/metadata.sh, its table appended to this one):
# creates, first, cached and later stats and unlinks from 1 and 16
# processes, etcd's own ceiling where etcd is used, and the untar, ls -lR
# and rm -rf of TREE small files, on ext4 and 2 nodes on etcd, default and --nowsync.
if [[ $META == 1 ]]; then
    # Its clusters get the host to themselves.
    if [[ -n $DEV_PID ]] && kill -0 "$DEV_PID" 2>/dev/null; then
        kill -TERM "$DEV_PID"
        wait "$DEV_PID" || true
    fi
    DEV_PID=
    log "metadata: bench/metadata.sh with TARGETS=\"raw cluster nowsync\""
    BENCH_DIR=$BENCH_DIR/meta TARGETS="raw cluster nowsync" NFILES=$NFILES TREE=$TREE CONVERGED=$CONVERGED SAVE=0 PEERS=$PEERS APPEND_TO=$REPORT \
        "$SCRIPT_DIR/metadata.sh" > "$JSON/metadata.txt" || die "bench/metadata.sh failed"
fi
echo
cat "$REPORT"
if [[ $SAVE == 1 ]]; then
    mkdir -p "$SCRIPT_DIR/results"
    out=$SCRIPT_DIR/results/cluster-$(date +%Y-%m-%d-%H%M%S).txt
    cp "$REPORT" "$out"
    echo "saved to $out"
fi
