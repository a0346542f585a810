#!/usr/bin/env bash
# Metadata benchmark: what unpacking, writing and listing a dataset is made
# of, on the raw disk (ext4), the FUSE floor (fs/examples/fuse_floor.rs: a
# filesystem in memory, mounted as converged mounts, that does nothing else:
# the ceiling of any FUSE daemon on this host), a single-node converged mount (embedded redb)
# and a 2-node converged cluster on etcd (`converged dev-cluster --nodes 2`),
# in one run, the cluster also with --nowsync (creates acknowledged before
# they commit, in directories the node made); with PEERS=1 also on MooseFS and GlusterFS started from
# ../shared/peers (when that directory and its packages are there).
#
#   sudo bench/metadata.sh
#   sudo NFILES=2000 TREE=5000 bench/metadata.sh       # quick check
#   sudo SAVE=1 bench/metadata.sh                      # also save bench/results/metadata-<date>.txt
#   sudo TARGETS="raw floor one" bench/metadata.sh     # ext4, FUSE itself and the single node only
#   sudo FS=ext4 SAVE=1 bench/metadata.sh              # all of it on a fresh ext4 with a journal
#                                                      # (bench/results/metadata-on-ext4-<date>.txt)
#
# bench/single-node.sh runs it with TARGETS="raw floor one" and bench/cluster.sh
# with TARGETS="raw cluster nowsync", with APPEND_TO naming their table.
#
# What it prints (bench/scripts/meta_ops.py, one directory unless "spread"):
#   create        open(O_CREAT|O_EXCL) + close of an empty file
#   first stat    stat(2) of each file just created (no cache dropped)
#   cached stat   the same names again
#   stat 11 s later   the same names once the kernel's attributes expired
#                 (1 process): the daemon's own cache, or etcd
#   stat, attr-timeout 0   first stat on a single-node mount with --attr-timeout 0
#   unlink        unlink(2) of each
#   each from 1 process, from 16 processes in one directory (the kernel
#   serialises a directory's creates on one mount) and from 16 processes in
#   16 directories; with the etcd round trips each file cost (the daemon's
#   own count, charged to the FUSE operations that made them)
#   the FUSE floor's rates: what the kernel's FUSE transport and fuser cost
#   for the same requests (a create is a lookup, a getattr of the
#   directory, the create and a release), the single node's ceiling
#   etcd's own ceiling on this host: one-put transactions, and transactions
#   the shape of a create (3 compares, 4 puts), from 1 and 16 clients, and
#   from 1 client while 2 others watch the prefix (as 2 nodes' feeds do)
#   untar of TREE small files (1-4 KiB) in 100 directories, the same followed
#   by an fsync of the directory it went into (what makes an untar durable
#   under --nowsync; on ext4 it syncs only that directory), `ls -lR` of it
#   from the other node, and `rm -rf` of it: wall seconds
#   where the untar's time goes on converged (bench/scripts/profile_run.py),
#   per file: FUSE requests by operation and the mean time of one, the
#   node's etcd transactions and the mean time of one, what etcd served
#   meanwhile to every client (transactions, reads) and the watch events it
#   sent to every node's change feed, the keys etcd
#   committed meanwhile by record kind (`I put`, `U delete`, ...; schema.rs
#   names the kinds; replayed from etcd's history after the run), CPU milliseconds of
#   tar, of the node's daemon, of the other node's and of etcd, and
#   context switches
#
# Environment (defaults in brackets):
#   BENCH_DIR   work directory, on the disk under test [/var/tmp/converged-meta-bench]
#   NFILES      files per create/stat/unlink test [10000]
#   TREE        files in the untar test [20000]
#   PAUSE_US    microseconds etcd's one-client probe also pauses between
#               commits, as a mount's creates from one process do, and the
#               disk's sync probe (scripts/sync_latency.py) before a sync [500]
#   CONVERGED   converged binary [<repo>/target/release/converged; built if missing]
#   PEERS       1: also run on MooseFS and GlusterFS (../shared/peers) [0]
#   SAVE        1: also save the table under bench/results/ [0]
#   TARGETS     what to measure, space separated, from: raw (ext4), floor
#               (the FUSE floor: creates, stats and unlinks only), one (a
#               single-node mount through /dev/fuse, --no-fuse-uring: what
#               the default mount is on a kernel that does not offer FUSE
#               over io_uring; and one with --attr-timeout 0), cluster
#               (2 nodes on etcd), nowsync (the same with --nowsync), uring
#               (the default single-node mount, supervisor included, with
#               the fuse module's enable_uring set while it mounts and put
#               back once it serves: FUSE over io_uring; later mounts follow
#               the host's setting) [raw floor one cluster nowsync]
#   CLUSTER_URING  1: start the clusters (cluster, nowsync) with enable_uring
#               set, so that their default mounts serve FUSE over io_uring
#               (what they are on a host that sets it; the table's header
#               says so); 0: with the host's setting [0]
#   FS          ext4 or xfs: run every target (ext4 included: "raw" is then
#               this filesystem) on a filesystem of that kind made fresh for
#               the run, in a sparse image under BENCH_DIR on the disk under
#               test, through a loop device with direct I/O (no second page
#               cache), removed at the end. mkfs's defaults: ext4 with a
#               journal. A data dir on the disk's own filesystem is what runs
#               without FS; this host's root ext4 has no journal, and ext4
#               without one walks past every inode it freed in the last
#               minutes when it allocates one, so creates after mass
#               deletions (another target's) follow what was deleted [unset]
#   APPEND_TO   a file to append the table to as well, under a line naming
#               TARGETS, NFILES and TREE (another bench's table) []
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
BENCH_DIR=${BENCH_DIR:-/var/tmp/converged-meta-bench}
NFILES=${NFILES:-10000}
TREE=${TREE:-20000}
PAUSE_US=${PAUSE_US:-500}
PEERS=${PEERS:-0}
SAVE=${SAVE:-0}
CLUSTER_URING=${CLUSTER_URING:-0}
read -r -a TARGETS <<<"${TARGETS:-raw floor one cluster nowsync}"
ASKED="${TARGETS[*]}"
DEFAULT_CONVERGED=$REPO/target/release/converged
CONVERGED=${CONVERGED:-$DEFAULT_CONVERGED}
RATE=$REPO/target/release/examples/etcd_rate
FLOOR=$REPO/target/release/examples/fuse_floor
PEERS_DIR=$REPO/../shared/peers

die() { echo "metadata-bench: $*" >&2; exit 1; }
log() { echo "== $*" >&2; }
# shellcheck source=scripts/disk.sh
. "$SCRIPT_DIR/scripts/disk.sh"
# shellcheck source=scripts/mounts.sh
. "$SCRIPT_DIR/scripts/mounts.sh"
# shellcheck source=scripts/uring.sh
. "$SCRIPT_DIR/scripts/uring.sh"

[[ $(id -u) -eq 0 ]] || die "run as root (FUSE mounts and drop_caches need it): sudo $0"
command -v python3 >/dev/null || die "python3 not found"
wants() { [[ " ${TARGETS[*]} " == *" $1 "* ]]; }
((${#TARGETS[@]} > 0)) || die "TARGETS is empty: name at least one of raw floor one cluster nowsync uring"
for t in "${TARGETS[@]}"; do
    case $t in raw | floor | one | cluster | nowsync | uring) ;;
        *) die "TARGETS: unknown target '$t' (raw, floor, one, cluster, nowsync, uring)" ;;
    esac
done
CLUSTERED=0
if wants cluster || wants nowsync; then CLUSTERED=1; fi
[[ $CLUSTERED == 0 || -x /usr/bin/etcd ]] || die "/usr/bin/etcd not found (apt-get install etcd-server)"
[[ $CLUSTER_URING == 0 || $CLUSTER_URING == 1 ]] || die "CLUSTER_URING=$CLUSTER_URING: expected 0 or 1"
for v in NFILES TREE PAUSE_US; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "$v=${!v}: expected a positive integer"
done
case $BENCH_DIR in /*) ;; *) die "BENCH_DIR must be an absolute path" ;; esac
[[ $BENCH_DIR != *[[:space:]]* ]] || die "BENCH_DIR must not contain white space"
FS=${FS:-}
case $FS in
    "") ;;
    ext4 | xfs)
        pkg=xfsprogs
        [[ $FS == ext4 ]] && pkg=e2fsprogs
        command -v "mkfs.$FS" >/dev/null || die "FS=$FS: mkfs.$FS not found (apt-get install $pkg)"
        # MooseFS and GlusterFS keep their data where ../shared/peers puts it.
        [[ $PEERS != 1 ]] || die "FS=$FS with PEERS=1: the peers' data would not be on the image; run them without FS"
        ;;
    *) die "FS=$FS: expected ext4 or xfs (unset: the disk's own filesystem)" ;;
esac

if [[ ! -x $CONVERGED ]]; then
    [[ $CONVERGED == "$DEFAULT_CONVERGED" ]] || die "CONVERGED=$CONVERGED is not an executable"
    log "building converged (cargo build --release -p converged-fs)"
    (cd "$REPO" && cargo build --release -p converged-fs) || die "build failed"
fi
if wants floor && [[ ! -x $FLOOR ]]; then
    log "building the FUSE floor (cargo build --release -p converged-fs --example fuse_floor)"
    (cd "$REPO" && cargo build --release -p converged-fs --example fuse_floor) || die "build failed"
fi
# Built every time (a no-op when current): a stale probe prints lines the
# table does not read.
if [[ $CLUSTERED == 1 ]]; then
    log "building the etcd rate probe (cargo build --release -p converged-metadata --example etcd_rate)"
    (cd "$REPO" && cargo build --release -p converged-metadata --example etcd_rate) || die "build failed"
fi

mkdir -p "$BENCH_DIR"
BENCH_DIR=$(cd "$BENCH_DIR" && pwd -P)
[[ $BENCH_DIR != / ]] || die "BENCH_DIR must not be /"
OUT=$BENCH_DIR/out
# Where the targets work: BENCH_DIR, or with FS the filesystem made for the run.
WORK=$BENCH_DIR
IMAGE='' LOOP=''
if [[ -n $FS ]]; then
    WORK=$BENCH_DIR/on-$FS
    IMAGE=$BENCH_DIR/$FS.img
fi
RAW=$WORK/raw
ONE=$WORK/one
ZERO=$WORK/zero
URING=$WORK/uring
FLOOR_MNT=$WORK/floor
DEV=$WORK/dev
NW=$WORK/nowsync
N1=$DEV/n1/mnt
N2=$DEV/n2/mnt

DEV_PID=
NW_PID=
FLOOR_PID=
PEERS_UP=()
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    set +e
    for m in "$ONE/mnt" "$ZERO/mnt" "$URING/mnt"; do
        grep -q " $m " /proc/mounts && "$CONVERGED" umount "$m"
    done
    if [[ -n $FLOOR_PID ]]; then
        grep -q " $FLOOR_MNT " /proc/mounts && umount "$FLOOR_MNT"
        wait "$FLOOR_PID"
    fi
    for pid in $DEV_PID $NW_PID; do
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid"
            wait "$pid"
        fi
    done
    for p in "${PEERS_UP[@]}"; do "$PEERS_DIR/peer_$p.sh" stop >/dev/null 2>&1; done
    uring_back
    rm -rf "$RAW" "$ONE" "$ZERO" "$URING" "$DEV" "$NW" "$FLOOR_MNT"
    if [[ -n $LOOP ]]; then
        grep -q " $WORK " /proc/mounts && umount "$WORK"
        losetup -d "$LOOP"
        rm -f "$IMAGE"
        rmdir "$WORK" 2>/dev/null
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [[ -n $FS ]]; then
    if grep -q " $WORK " /proc/mounts; then umount "$WORK" || die "$WORK is mounted and does not unmount"; fi
    rm -f "$IMAGE"
    truncate -s 64G "$IMAGE"
    LOOP=$(losetup --find --show --direct-io=on "$IMAGE") || die "losetup of $IMAGE failed"
    if [[ $FS == ext4 ]]; then mkfs.ext4 -q -F "$LOOP"; else mkfs.xfs -q -f "$LOOP"; fi ||
        die "mkfs.$FS on $LOOP failed"
    mkdir -p "$WORK"
    mount "$LOOP" "$WORK" || die "mount $LOOP on $WORK failed"
    log "FS=$FS: a fresh $FS on $LOOP (direct I/O over $IMAGE), mounted on $WORK"
fi

rm -rf "$RAW" "$ONE" "$ZERO" "$URING" "$DEV" "$NW" "$FLOOR_MNT" "$OUT"
mkdir -p "$RAW" "$ONE/data" "$ONE/mnt" "$ZERO/data" "$ZERO/mnt" "$URING/data" "$URING/mnt" "$FLOOR_MNT" "$OUT"

if wants floor; then
    log "the FUSE floor (fuse_floor: names in memory, nothing else)"
    "$FLOOR" "$FLOOR_MNT" 2>"$OUT/floor.err" &
    FLOOR_PID=$!
    wait_mounted "$FLOOR_MNT" "$FLOOR_PID" "$OUT/floor.err" fuse_floor
fi

if wants one; then
    log "single-node mounts (embedded metadata): default, and --attr-timeout 0"
    "$CONVERGED" mount "$ONE/mnt" --data-dir "$ONE/data" --no-fuse-uring
    "$CONVERGED" mount "$ZERO/mnt" --data-dir "$ZERO/data" --attr-timeout 0 --no-fuse-uring
fi

if wants uring; then
    uring_on TARGETS=uring
    log "single-node mount, default options, over FUSE io_uring (enable_uring=Y)"
    "$CONVERGED" mount "$URING/mnt" --data-dir "$URING/data"
    serves_uring "$URING/data" TARGETS=uring
    uring_back
fi

start_cluster() { # DIR NAME [mount options...]: sets STARTED_PID and STARTED_ENDPOINT
    local dir=$1 name=$2
    shift 2
    local opts=()
    for o in "$@"; do opts+=("--mount-opt=$o"); done
    log "dev-cluster $name (2 nodes, one etcd member) in $dir"
    mkfifo "$OUT/$name.out"
    "$CONVERGED" dev-cluster --nodes 2 --dir "$dir" "${opts[@]}" > "$OUT/$name.out" 2>"$OUT/$name.err" &
    local pid=$! endpoint=
    STARTED_PID=$pid
    exec 3<"$OUT/$name.out"
    while IFS= read -r -u 3 line; do
        echo "   $line" >&2
        [[ $line == metadata:* ]] && endpoint=$(sed -E 's#.*etcd://([^/]+)/.*#\1#' <<<"$line")
        [[ $line == "dev-cluster ready"* ]] && break
    done
    kill -0 "$pid" 2>/dev/null || die "dev-cluster $name failed: $(cat "$OUT/$name.err")"
    [[ -n $endpoint ]] || die "dev-cluster $name did not name its etcd endpoint"
    cat <&3 >/dev/null &
    exec 3<&-
    STARTED_ENDPOINT=$endpoint
}
ENDPOINT=
[[ $CLUSTER_URING == 0 || $CLUSTERED == 0 ]] || uring_on CLUSTER_URING=1
if wants cluster; then
    start_cluster "$DEV" dev
    DEV_PID=$STARTED_PID ENDPOINT=$STARTED_ENDPOINT DEV_ENDPOINT=$STARTED_ENDPOINT
    [[ $CLUSTER_URING == 0 ]] || { serves_uring "$DEV/n1/data" CLUSTER_URING=1; serves_uring "$DEV/n2/data" CLUSTER_URING=1; }
fi
if wants nowsync; then
    start_cluster "$NW" nowsync --nowsync
    NW_PID=$STARTED_PID NW_ENDPOINT=$STARTED_ENDPOINT
    [[ -n $ENDPOINT ]] || ENDPOINT=$STARTED_ENDPOINT
    [[ $CLUSTER_URING == 0 ]] || { serves_uring "$NW/n1/data" CLUSTER_URING=1; serves_uring "$NW/n2/data" CLUSTER_URING=1; }
fi
uring_back

declare -A DIR=([raw]=$RAW [floor]=$FLOOR_MNT [one]=$ONE/mnt [cluster]=$N1 [nowsync]=$NW/n1/mnt [uring]=$URING/mnt)
declare -A STATS=([raw]="" [floor]="" [one]=$ONE/mnt [cluster]=$N1 [nowsync]=$NW/n1/mnt [uring]=$URING/mnt)
if [[ $PEERS == 1 ]]; then
    for p in moosefs gluster; do
        if [[ -x $PEERS_DIR/peer_$p.sh ]] && "$PEERS_DIR/peer_$p.sh" start >"$OUT/$p.log" 2>&1; then
            PEERS_UP+=("$p")
            case $p in moosefs) DIR[moosefs]=/tmp/peers/mfs/mnt ;; gluster) DIR[gluster]=/tmp/peers/gluster/mnt ;; esac
            STATS[$p]=""
            TARGETS+=("$p")
        else
            log "$p: not started (see $OUT/$p.log)"
        fi
    done
fi

if [[ -n $ENDPOINT ]]; then
    log "etcd's own ceiling at $ENDPOINT"
    for t in 1 16; do "$RATE" "$ENDPOINT" "$t" 3000 > "$OUT/etcd-$t.txt"; done
    # The same with two clients watching, as the two nodes' change feeds do:
    # etcd sends each transaction to both.
    "$RATE" "$ENDPOINT" 1 3000 --mode alone --shape put,create --watchers 2 > "$OUT/etcd-1-watched.txt"
    # And pausing between commits, as a mount's creates from one process
    # do (the FUSE requests of a create besides its commit): etcd answers a
    # commit after a pause more slowly than one sent back to back.
    "$RATE" "$ENDPOINT" 1 2000 --mode alone --shape put,create --watchers 2 --think-us "$PAUSE_US" \
        > "$OUT/etcd-1-paused.txt"
    # What one small write + fdatasync takes on the disk etcd and the nodes
    # write to, back to back and after the same pause: etcd's log ends each
    # commit in one.
    python3 "$SCRIPT_DIR/scripts/sync_latency.py" "$WORK" "$PAUSE_US" > "$OUT/sync.json"
fi

# Before each create phase and each untar, every target starts from the
# same disk: ext4 passes over the inodes it freed in the last minutes while
# their inode-table blocks are cached (for 6 minutes once a create dirties
# the block again), so creates right after a mass unlink (the previous
# target's) ran at a fifth of their rate on this host's disk, for ext4
# itself as for the daemons writing to it. Dirty blocks are written and
# clean ones dropped; then the programs under test are read back, so that
# no target's first requests wait for its code to come from the disk.
PROGRAMS=("$CONVERGED" "$FLOOR" /usr/bin/etcd "$(command -v python3)" /usr/sbin/mfsmaster
    /usr/sbin/mfschunkserver /usr/bin/mfsmount /usr/sbin/glusterfsd /usr/sbin/glusterd)
settle() {
    sync
    echo 1 > /proc/sys/vm/drop_caches
    for p in "${PROGRAMS[@]}"; do
        [[ -f $p ]] && cat "$p" > /dev/null
    done
    return 0
}

ops() { # TARGET TAG [--spread] PROCS DIR
    local target=$1 tag=$2
    shift 2
    settle
    log "$target: meta_ops $*"
    python3 "$SCRIPT_DIR/scripts/meta_ops.py" "$@" ${STATS[$target]:+"${STATS[$target]}"} > "$OUT/$target-$tag.json"
}

for t in "${TARGETS[@]}"; do
    d=${DIR[$t]}/bench-meta
    ops "$t" p1 "$d/p1" "$NFILES" 1
    ops "$t" p16 "$d/p16" "$NFILES" 16
    ops "$t" spread --spread "$d/spread" "$NFILES" 16
done
if wants one; then
    STATS[zero]=""
    ops zero p1 "$ZERO/mnt/bench-meta" "$NFILES" 1
fi

log "tree of $TREE small files in 100 directories"
python3 "$SCRIPT_DIR/scripts/make_tree.py" "$OUT/tree.tar" "$TREE" 100
for t in "${TARGETS[@]}"; do
    [[ $t == floor ]] && continue # it keeps no data
    d=${DIR[$t]}/bench-tree
    mkdir -p "$d"
    settle
    cat "$OUT/tree.tar" > /dev/null # tar reads its archive from memory
    log "$t: untar, ls -lR, rm -rf"
    # Where the untar's time goes on converged: the daemons' counters, and
    # the CPU and context switches of every process serving it.
    profile=()
    case $t in
        one) profile=(--stats "$ONE/mnt" --proc "node=mount $ONE/mnt --data-dir") ;;
        uring) profile=(--stats "$URING/mnt" --proc "node=mount $URING/mnt --data-dir") ;;
        cluster | nowsync)
            if [[ $t == nowsync ]]; then c=$NW e=$NW_ENDPOINT; else c=$DEV e=$DEV_ENDPOINT; fi
            profile=(--stats "$c/n1/mnt" --etcd "http://$e" --proc "node=mount $c/n1/mnt --data-dir"
                --proc "other=mount $c/n2/mnt --data-dir" --proc "etcd=etcd --name dev --data-dir $c/etcd") ;;
    esac
    s=$(date +%s.%N)
    if ((${#profile[@]})); then
        python3 "$SCRIPT_DIR/scripts/profile_run.py" "$OUT/$t-untar-profile.json" "${profile[@]}" -- tar -xf "$OUT/tree.tar" -C "$d"
    else
        tar -xf "$OUT/tree.tar" -C "$d"
    fi
    e=$(date +%s.%N)
    python3 -c 'import os, sys; os.fsync(os.open(sys.argv[1], os.O_RDONLY))' "$d"; f=$(date +%s.%N)
    if ((${#profile[@]})); then
        # tar's own wall time, without the profiler's start-up
        s=$(python3 -c 'import json, sys; print(float(sys.argv[2]) - json.load(open(sys.argv[1]))["wall"])' \
            "$OUT/$t-untar-profile.json" "$e")
    fi
    echo "untar $(awk "BEGIN { print $e - $s }")" > "$OUT/$t-tree.txt"
    echo "untar_fsync $(awk "BEGIN { print $f - $s }")" >> "$OUT/$t-tree.txt"
    listing=$d
    [[ $t == cluster ]] && listing=$N2/bench-tree
    [[ $t == nowsync ]] && listing=$NW/n2/mnt/bench-tree
    s=$(date +%s.%N); ls -lR "$listing" > /dev/null; e=$(date +%s.%N)
    echo "ls $(awk "BEGIN { print $e - $s }")" >> "$OUT/$t-tree.txt"
    s=$(date +%s.%N); rm -rf "$d"; e=$(date +%s.%N)
    echo "rm $(awk "BEGIN { print $e - $s }")" >> "$OUT/$t-tree.txt"
    # What etcd wrote while tar ran, by record kind: replayed from its
    # history now, outside every timed step.
    if [[ $t == cluster || $t == nowsync ]]; then
        python3 "$SCRIPT_DIR/scripts/profile_run.py" --writes "$OUT/$t-untar-profile.json" dev/ ||
            log "$t: etcd's writes not counted"
    fi
done

REPORT=$OUT/table.txt
{
    echo "converged metadata benchmark, $(date '+%Y-%m-%d %H:%M:%S %z')"
    etcd_version=
    if [[ $CLUSTERED == 1 ]]; then etcd_version=", $(/usr/bin/etcd --version | sed -n 1p)"; fi
    echo "host $(hostname), kernel $(uname -r), $(nproc) CPUs$etcd_version"
    rev=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')
    git -C "$REPO" diff --quiet HEAD 2>/dev/null || rev="$rev, modified"
    echo "converged ($rev); disk: $(describe_fs "$WORK"); NFILES=$NFILES TREE=$TREE"
    if [[ $CLUSTER_URING == 1 && $CLUSTERED == 1 ]]; then
        echo "CLUSTER_URING=1: every node of the clusters serves FUSE over io_uring (enable_uring set while they started)"
    fi
    echo
    TREE=$TREE PAUSE_US=$PAUSE_US python3 - "$OUT" "${TARGETS[*]}" <<'PY'
import json, os, re, sys

out, targets = sys.argv[1], sys.argv[2].split()
names = {"raw": "ext4", "floor": "FUSE floor", "one": "1 node", "cluster": "2 nodes/etcd", "nowsync": "etcd+nowsync", "uring": "1 node, uring",
         "moosefs": "MooseFS", "gluster": "GlusterFS"}

def load(t, tag):
    try:
        with open(f"{out}/{t}-{tag}.json") as f:
            return json.load(f)
    except FileNotFoundError:
        return None

def etcd(threads, suffix=""):
    rates = {}
    if not os.path.exists(f"{out}/etcd-{threads}{suffix}.txt"):
        return None
    with open(f"{out}/etcd-{threads}{suffix}.txt") as f:
        for line in f:
            m = re.match(r"\d+ threads, (alone|grouped), (\d+) reads \+ (\d+) compares \+ (\d+) puts per txn(?:, \d+ watching)?: (\d+) txn/s", line)
            if m:
                rates[(m[1], int(m[2]), int(m[3]), int(m[4]))] = int(m[5])
    return rates

e1, e16 = etcd(1), etcd(16)
if e1 and e16:
    print("etcd on this host, txn/s:  1 client: %d (one put), %d (a create's shape: 3 compares + 4 puts);"
          "  16 clients: %d, %d" % (e1[("alone", 0, 0, 1)], e1[("alone", 0, 3, 4)], e16[("alone", 0, 0, 1)],
                                    e16[("alone", 0, 3, 4)]))
    print("the same through a node's group commit, 16 threads: %d (one put), %d (a create's shape)"
          % (e16[("grouped", 0, 0, 1)], e16[("grouped", 0, 3, 4)]))
    watched = etcd(1, "-watched")
    if watched and ("alone", 0, 0, 1) in watched and ("alone", 0, 3, 4) in watched:
        print("1 client while 2 others watch (as the 2 nodes' change feeds do): %d (one put), %d (a create's shape)"
              % (watched[("alone", 0, 0, 1)], watched[("alone", 0, 3, 4)]))
    paused = {}
    if os.path.exists(f"{out}/etcd-1-paused.txt"):
        with open(f"{out}/etcd-1-paused.txt") as f:
            for line in f:
                m = re.match(r"1 threads, alone, 0 reads \+ (\d+) compares \+ (\d+) puts per txn.*between commits: "
                             r"(\d+) txn/s, (\d+) µs a commit", line)
                if m:
                    paused[(int(m[1]), int(m[2]))] = (int(m[3]), int(m[4]))
    if (0, 1) in paused and (3, 4) in paused:
        print("1 client pausing %s us between commits, 2 watching: %d (one put, %d us a commit), %d (a create's shape, "
              "%d us a commit)" % (os.environ["PAUSE_US"], *paused[(0, 1)], *paused[(3, 4)]))
    if os.path.exists(f"{out}/sync.json"):
        with open(f"{out}/sync.json") as f:
            sync = json.load(f)
        print("the disk: a 4 KiB write + fdatasync %d us back to back, %d us after a %d us pause (etcd's log syncs "
              "each commit)" % (sync["back_to_back_us"], sync["paused_us"], sync["pause_us"]))
    print()
cols = "".join(f"{names[t]:>15}" for t in targets)
print(f"{'ops/s (etcd round trips per op)':<34}{cols}")
rows = [("create, 1 process", "p1", "create"), ("create, 16 in one dir", "p16", "create"),
        ("create, 16 in 16 dirs", "spread", "create"), ("first stat after create", "p1", "first_stat"),
        ("first stat, 16 processes", "p16", "first_stat"), ("cached stat", "p1", "cached_stat"),
        ("stat 11 s later", "p1", "late_stat"),
        ("unlink, 1 process", "p1", "unlink"), ("unlink, 16 in one dir", "p16", "unlink"),
        ("unlink, 16 in 16 dirs", "spread", "unlink")]
for label, tag, phase in rows:
    line = f"{label:<34}"
    for t in targets:
        r = load(t, tag)
        if r is None or phase not in r:
            line += f"{'-':>15}"
            continue
        v = f"{r[phase]['ops_s']:,.0f}"
        if "trips_per_op" in r[phase]:
            v += f" ({r[phase]['trips_per_op']:.2f})"
        line += f"{v:>15}"
    print(line)
z = load("zero", "p1")
if z:
    at = targets.index("one") if "one" in targets else 0  # under the 1-node column
    print(f"{'stat, attr-timeout 0 (1 node)':<34}" + f"{'':>15}" * at + f"{z['first_stat']['ops_s']:>15,.0f}")
print()
def met(ok):
    return "met" if ok else "MISSED"

fl = load("floor", "p1")
for target, label in (("one", "1 node"), ("uring", "1 node over FUSE io_uring")):
    o = load(target, "p1")
    if not o:
        continue
    print(f"{label} against its targets (1 process)" + (", and against the FUSE floor:" if fl else ":"))
    for phase, what, floor in (("create", "create", 10_000), ("unlink", "unlink", 20_000),
                               ("first_stat", "first stat after create", 200_000)):
        v = o[phase]["ops_s"]
        of = ""
        if fl:
            f = fl[phase]["ops_s"]
            of = f"; the floor {f:,.0f}/s, {label} {v / f:.2f}x of it"
        print(f"  {what:<25}{v:>10,.0f}/s   (target >= {floor:,}/s: {met(v >= floor)}{of})")
    print()
for target, label in (("cluster", "2 nodes on etcd"), ("nowsync", "2 nodes on etcd with --nowsync")):
    c1, c16 = load(target, "p1"), load(target, "spread")
    if c1 and c16 and e1 and e16:
        print(f"{label} against etcd's ceiling (one-put transactions):")
        for what, r, e in (("create, 1 process", c1["create"], e1), ("create, 16 processes", c16["create"], e16),
                           ("unlink, 1 process", c1["unlink"], e1)):
            x = r["ops_s"] / e[("alone", 0, 0, 1)]
            print(f"  {what:<25}{x:>10.2f}x   (target >= 0.8x: {met(x >= 0.8)})")
        if fl and target == "cluster":
            # A create or unlink that waits for one etcd commit pays the
            # FUSE floor's requests and etcd's transaction one after the
            # other: its ceiling, even with a daemon that costs nothing.
            put = e1[("alone", 0, 0, 1)]
            for what, phase in (("create", "create"), ("unlink", "unlink")):
                ceiling = 1 / (1 / fl[phase]["ops_s"] + 1 / put)
                print(f"  {what + ', FUSE floor + etcd':<25}{ceiling / put:>10.2f}x   "
                      f"(the floor's {what} and one etcd commit in series: {ceiling:,.0f}/s; "
                      f"2 nodes {c1[phase]['ops_s'] / ceiling:.2f}x of it)")
            # The same with etcd as a cluster has it: a create's transaction
            # (3 compares + 4 puts), while the nodes' change feeds watch
            # (`watched`: read with etcd's other rates above).
            if watched and ("alone", 0, 3, 4) in watched:
                shaped = watched[("alone", 0, 3, 4)]
                ceiling = 1 / (1 / fl["create"]["ops_s"] + 1 / shaped)
                print(f"  {'create, floor + watched':<25}{ceiling / put:>10.2f}x   "
                      f"(the floor's create and one create-shaped commit while 2 watch: {ceiling:,.0f}/s; "
                      f"2 nodes {c1['create']['ops_s'] / ceiling:.2f}x of it)")
        v = c1["first_stat"]["ops_s"]
        print(f"  {'first stat after create':<25}{v:>10,.0f}/s   (target >= 50,000/s: {met(v >= 50_000)})")
        if target == "nowsync":
            v = c1["create"]["ops_s"]
            print(f"  {'create, 1 process':<25}{v:>10,.0f}/s   (target >= 5,000/s: {met(v >= 5_000)})")
        print()
targets = [t for t in targets if t != "floor"]  # no tree on the floor: it keeps no data
trees = {t: {k: float(v) for k, v in (l.split() for l in open(f"{out}/{t}-tree.txt"))} for t in targets}
print(f"{'tree of small files, seconds':<34}" + "".join(f"{names[t]:>15}" for t in targets))
for what, label in (("untar", "untar"), ("untar_fsync", "untar, then fsync(dir)"), ("ls", "ls -lR (clusters: other node)"),
                    ("rm", "rm -rf")):
    line = f"{label:<34}"
    for t in targets:
        line += f"{trees[t][what]:>15.2f}"
    print(line)
profiles = {}
for t in targets:
    try:
        with open(f"{out}/{t}-untar-profile.json") as f:
            profiles[t] = json.load(f)
    except FileNotFoundError:
        pass
if profiles:
    n = int(os.environ["TREE"])
    shown = [t for t in targets if t in profiles]
    print()
    print(f"{'the untar, per file':<34}" + "".join(f"{names[t]:>15}" for t in shown))
    def row(label, value):
        cells = []
        for t in shown:
            v = value(profiles[t])
            cells.append(f"{'-':>15}" if v is None else f"{v:>15.2f}")
        print(f"{label:<34}" + "".join(cells))
    row("wall, ms", lambda p: 1000 * p["wall"] / n)
    row("FUSE requests", lambda p: sum(c for c, _ in p["fuse"].values()) / n)
    ops = sorted({op for t in shown for op, (c, _) in profiles[t]["fuse"].items() if c >= n / 20},
                 key=lambda op: -max(profiles[t]["fuse"].get(op, [0])[0] for t in shown))
    for op in ops:
        cells = []
        for t in shown:
            c, secs = profiles[t]["fuse"].get(op, (0, 0))
            cells.append(f"{'-':>15}" if not c else f"{f'{c / n:.2f} x {1000 * secs / c:.3f}':>15}")
        print(f"{'  ' + op + ' (per file x ms)':<34}" + "".join(cells))
    row("etcd transactions", lambda p: p["etcd_txn"][0] / n if p["etcd_txn"][0] else None)
    row("  ms each", lambda p: 1000 * p["etcd_txn"][1] / p["etcd_txn"][0] if p["etcd_txn"][0] else None)
    # What etcd itself served meanwhile, to both nodes and in the background
    # too (a read-only transaction of many gets is one Txn).
    for method in ("Txn", "Range"):
        row(f"etcd served, {method}", lambda p: p["etcd_served"].get(method, 0) / n if "etcd_served" in p else None)
    # Each committed key in the watched range goes to every node's change
    # feed: the fan-out that grows with the cluster (docs/scale.md).
    row("etcd sent, watch events",
        lambda p: p["etcd_served"].get("watch events", 0) / n if "etcd_served" in p else None)
    # Every key etcd committed while tar ran, from both nodes and their
    # background work, by record kind (metadata/src/schema.rs): the writes
    # a file costs the store.
    written = [t for t in shown if "etcd_writes" in profiles[t]]
    if written:
        row("etcd writes (keys)", lambda p: sum(p["etcd_writes"].values()) / n if "etcd_writes" in p else None)
        kinds = sorted({k for t in written for k in profiles[t]["etcd_writes"]},
                       key=lambda k: -max(profiles[t]["etcd_writes"].get(k, 0) for t in written))
        for k in kinds:
            if max(profiles[t]["etcd_writes"].get(k, 0) for t in written) >= n / 20:
                row(f"  {k}", lambda p: p["etcd_writes"].get(k, 0) / n if "etcd_writes" in p else None)
    for who, label in (("cmd", "tar"), ("node", "this node's daemon"), ("other", "the other node's daemon"),
                       ("etcd", "etcd")):
        row(f"CPU ms, {label}", lambda p: 1000 * p["cpu"][who] / n if who in p["cpu"] else None)
        if who in ("node", "other"):
            # A daemon's CPU by thread (the FUSE threads, the transport's
            # workers, the change feed...): those that spent 0.02 ms a file.
            by_thread = {t: profiles[t].get("threads", {}).get(who, {}) for t in shown}
            spent = {th for t in shown for th, (c, _) in by_thread[t].items() if 1000 * c / n >= 0.02}
            for th in sorted(spent, key=lambda th: -max(by_thread[t].get(th, [0])[0] for t in shown)):
                row(f"  {th} threads", lambda p: 1000 * p["threads"][who].get(th, [0])[0] / n
                    if who in p.get("threads", {}) else None)
    row("context switches, all of them", lambda p: sum(p["switches"].values()) / n)
    print("(an operation's FUSE requests per file x the mean ms of one; CPU summed over each process's threads)")
untar = {t: trees[t]["untar"] for t in targets}
for t, limit in (("cluster", 20.0), ("nowsync", 5.0)):
    if t in untar and int(os.environ["TREE"]) != 20_000:
        print(f"untar on {names[t]}: {untar[t]:.2f} s (its target, <= {limit:.0f} s, is for TREE=20000)")
    elif t in untar:
        ahead = f", ahead of MooseFS ({untar['moosefs']:.2f} s): {met(untar[t] < untar['moosefs'])}" if "moosefs" in untar else ""
        print(f"untar on {names[t]}: {untar[t]:.2f} s (target <= {limit:.0f} s: {met(untar[t] <= limit)}{ahead})")
PY
} > "$REPORT"
echo
cat "$REPORT"
if [[ $SAVE == 1 ]]; then
    mkdir -p "$SCRIPT_DIR/results"
    dest=$SCRIPT_DIR/results/metadata${FS:+-on-$FS}-$(date +%Y-%m-%d-%H%M%S).txt
    cp "$REPORT" "$dest"
    echo "saved to $dest"
fi
if [[ -n ${APPEND_TO:-} ]]; then
    {
        echo
        echo "metadata (bench/metadata.sh, TARGETS=\"$ASKED\" NFILES=$NFILES TREE=$TREE):"
        cat "$REPORT"
    } >> "$APPEND_TO"
fi
