#!/usr/bin/env bash
# Two converged binaries alternated on the metadata rates that the daemon's
# own CPU bounds on a small host, so that a change to the daemon is judged
# against the one before it in the same minutes (this host drifts by half
# between runs; alternating pairs is what makes a ratio mean something).
#
#   sudo bench/ab-metadata.sh OLD_BINARY NEW_BINARY [PAIRS]
#   sudo NFILES=2000 bench/ab-metadata.sh old new 1     # quick check
#
# Each run, per binary: a fresh single-node mount, NFILES creates then
# unlinks from one process (bench/scripts/meta_ops.py); a fresh
# `dev-cluster --nodes 2`, NFILES*2/5 from one process on n1 and NFILES*4/5
# shared by 16 processes in directories of their own; then an untar of
# TREE small files (1-4 KiB, in 100 directories) on n1, as files a second,
# checked whole on n2 (`tar --compare`). The page cache is dropped before
# each phase. Prints each run's rates, then for each figure the median of
# each binary and the new one's median over the old one's.
#
# Environment: BENCH_DIR [/var/tmp/converged-ab], NFILES [5000], TREE
# [NFILES/2; 0: no untar], PAIRS (or the third argument) [3], URING [0]
# (1: the kernel's `enable_uring` is set while each mount and cluster
# starts, so every daemon serves FUSE over io_uring; it is put back after).
set -euo pipefail

die() { echo "ab-metadata: $*" >&2; exit 1; }
(($# >= 2)) || die "usage: bench/ab-metadata.sh OLD_BINARY NEW_BINARY [PAIRS]"
OLD=$1 NEW=$2 PAIRS=${3:-${PAIRS:-3}}
for b in "$OLD" "$NEW"; do [[ -x $b ]] || die "$b is not an executable"; done
[[ $PAIRS =~ ^[1-9][0-9]*$ ]] || die "PAIRS must be a positive number, not '$PAIRS'"
((EUID == 0)) || die "run as root (FUSE mounts, drop_caches)"
NFILES=${NFILES:-5000}
[[ $NFILES =~ ^[1-9][0-9]*$ ]] || die "NFILES must be a positive number, not '$NFILES'"
TREE=${TREE:-$((NFILES / 2))}
[[ $TREE =~ ^[0-9]+$ ]] || die "TREE must be a number, not '$TREE'"
BENCH_DIR=${BENCH_DIR:-/var/tmp/converged-ab}
URING=${URING:-0}
[[ $URING == 0 || $URING == 1 ]] || die "URING must be 0 or 1, not '$URING'"
# shellcheck source=scripts/uring.sh
. "$(cd "$(dirname "$0")" && pwd)/scripts/uring.sh"
META_OPS=$(cd "$(dirname "$0")" && pwd)/scripts/meta_ops.py
MAKE_TREE=$(cd "$(dirname "$0")" && pwd)/scripts/make_tree.py
OUT=$(mktemp -d)
cleanup() {
    uring_back
    pkill -INT -f "dev-cluster --nodes 2 --dir $BENCH_DIR/" || true
    for m in "$BENCH_DIR"/*/one/mnt; do
        grep -q " $m " /proc/mounts && "$NEW" umount "$m"
    done
    rm -rf "$OUT"
}
trap cleanup EXIT
touch "$OUT/old" "$OUT/new"
((TREE > 0)) && python3 "$MAKE_TREE" "$OUT/tree.tar" "$TREE" 100

drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
rates() { # TAG ARGS...: "TAG-create RATE" and "TAG-unlink RATE" lines
    local tag=$1
    shift
    drop
    python3 "$META_OPS" "$@" | python3 -c '
import json, sys
d = json.load(sys.stdin)
for op in ("create", "unlink"):
    rate = d[op]["ops_s"]
    print(f"{sys.argv[1]}-{op} {rate:.0f}")' "$tag"
}

run() { # WHICH BINARY: one run, its rates appended to $OUT/WHICH
    local which=$1 bin=$2 d=$BENCH_DIR/$1
    rm -rf "$d"
    mkdir -p "$d/one/mnt" "$d/one/data"
    [[ $URING == 0 ]] || uring_on URING=1
    "$bin" mount "$d/one/mnt" --data-dir "$d/one/data" >/dev/null
    uring_back
    [[ $URING == 0 ]] || serves_uring "$d/one/data" URING=1
    rates "1-node,1-proc" "$d/one/mnt/p1" "$NFILES" 1 >> "$OUT/$which"
    "$bin" umount "$d/one/mnt"
    [[ $URING == 0 ]] || uring_on URING=1
    setsid "$bin" dev-cluster --nodes 2 --dir "$d/dc" > "$d/dc.log" 2>&1 &
    for _ in $(seq 300); do
        grep -q "dev-cluster ready" "$d/dc.log" && break
        sleep 0.1
    done
    uring_back
    grep -q "dev-cluster ready" "$d/dc.log" || die "dev-cluster did not start: $(tail -3 "$d/dc.log")"
    [[ $URING == 0 ]] || serves_uring "$d/dc/n1/data" URING=1
    rates "2-node,1-proc" "$d/dc/n1/mnt/p1" $((NFILES * 2 / 5)) 1 >> "$OUT/$which"
    rates "2-node,16-proc" --spread "$d/dc/n1/mnt/s" $((NFILES * 4 / 5)) 16 >> "$OUT/$which"
    if ((TREE > 0)); then
        mkdir "$d/dc/n1/mnt/untar"
        drop
        cat "$OUT/tree.tar" > /dev/null # tar reads its archive from memory
        local s e
        s=$(date +%s.%N)
        tar -xf "$OUT/tree.tar" -C "$d/dc/n1/mnt/untar"
        e=$(date +%s.%N)
        tar --compare -f "$OUT/tree.tar" -C "$d/dc/n2/mnt/untar" > "$OUT/compare" 2>&1 ||
            die "the untar on n1 does not read back the same on n2: $(head -3 "$OUT/compare")"
        echo "2-node,untar $(awk "BEGIN { printf \"%.0f\", $TREE / ($e - $s) }")" >> "$OUT/$which"
    fi
    pkill -INT -f "dev-cluster --nodes 2 --dir $d/dc" || true
    for _ in $(seq 100); do
        grep -q " $d/dc/" /proc/mounts || break
        sleep 0.1
    done
}

for i in $(seq "$PAIRS"); do
    for which in old new; do
        bin=$OLD
        [[ $which == new ]] && bin=$NEW
        before=$(wc -l < "$OUT/$which")
        run "$which" "$bin"
        echo "pair $i, $which: $(tail -n +$((before + 1)) "$OUT/$which" | awk '{printf "%s %s  ", $1, $2}')"
    done
done

python3 - "$OUT/old" "$OUT/new" <<'EOF'
import statistics, sys
def load(p):
    runs = {}
    for line in open(p):
        k, v = line.split()
        runs.setdefault(k, []).append(float(v))
    return runs
old, new = load(sys.argv[1]), load(sys.argv[2])
print(f"\n{'ops/s, median of the runs':32} {'old':>9} {'new':>9} {'new/old':>8}")
for k in old:
    o, n = statistics.median(old[k]), statistics.median(new[k])
    print(f"{k:32} {o:9.0f} {n:9.0f} {n / o:8.2f}")
EOF
rm -rf "$BENCH_DIR"
