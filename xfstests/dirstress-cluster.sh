#!/usr/bin/env bash
# xfstests' dirstress, run as generic/011 runs it (1000 files; 1 process in
# 1 directory, 5 processes in 1, 5 processes in 5), ITERATIONS times on n1
# of a 2-node cluster (`converged dev-cluster --nodes 2`, etcd), while both
# mounts are busy beside it: n2 untars and removes a tree of 2,000 small
# files over and over, n1 writes and fsyncs 8 MiB files. Stops at the first
# failure and prints dirstress's output.
#
#   sudo xfstests/dirstress-cluster.sh XFSTESTS_DIR [ITERATIONS]
#
# XFSTESTS_DIR is a built xfstests checkout (its src/dirstress; see
# README.md here). ITERATIONS defaults to 50. Environment:
#   CONVERGED   converged binary [<repo>/target/release/converged]
#   WORK        work directory, emptied first [/var/tmp/converged-dirstress]
#   MOUNT_OPTS  mount options of both nodes, e.g. --nowsync [none]
set -euo pipefail

die() { echo "dirstress-cluster: $*" >&2; exit 1; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[[ $# -ge 1 && $# -le 2 ]] || die "usage: $0 XFSTESTS_DIR [ITERATIONS]"
DIRSTRESS=$1/src/dirstress
ITERATIONS=${2:-50}
CONVERGED=${CONVERGED:-$REPO/target/release/converged}
WORK=${WORK:-/var/tmp/converged-dirstress}
[[ $(id -u) -eq 0 ]] || die "run as root (FUSE mounts need it)"
[[ -x $DIRSTRESS ]] || die "$DIRSTRESS not found: build the xfstests checkout (make)"
[[ $ITERATIONS =~ ^[1-9][0-9]*$ ]] || die "ITERATIONS=$ITERATIONS: expected a positive integer"
[[ -x $CONVERGED ]] || die "$CONVERGED not found: cargo build --release"
case $WORK in /*) ;; *) die "WORK must be an absolute path" ;; esac
[[ $WORK != / ]] || die "WORK must not be /"

OPTS=()
for o in ${MOUNT_OPTS:-}; do
    [[ $o == --* ]] || die "MOUNT_OPTS=$MOUNT_OPTS: expected options such as --nowsync"
    OPTS+=("--mount-opt=$o")
done

rm -rf "$WORK"
mkdir -p "$WORK"
python3 "$REPO/bench/scripts/make_tree.py" "$WORK/tree.tar" 2000 20 >/dev/null
mkfifo "$WORK/out"
"$CONVERGED" dev-cluster --nodes 2 --dir "$WORK/dev" "${OPTS[@]}" >"$WORK/out" 2>"$WORK/dev.err" &
CLUSTER=$!
exec 3<"$WORK/out"
while IFS= read -r -u 3 line; do
    [[ $line == "dev-cluster ready"* ]] && break
done
kill -0 "$CLUSTER" 2>/dev/null || die "dev-cluster failed: $(cat "$WORK/dev.err")"
cat <&3 >/dev/null &
N1=$WORK/dev/n1/mnt
N2=$WORK/dev/n2/mnt

BUSY=()
cleanup() {
    # The busy loops and what they run (a tar or dd holding files open on
    # the mounts), then the mounts, then dev-cluster and its etcd.
    for pid in "${BUSY[@]}"; do
        kill -- "-$pid" 2>/dev/null || true
    done
    wait "${BUSY[@]}" 2>/dev/null || true
    # A killed dd may still be closing its file: try for a few seconds.
    for m in "$N1" "$N2"; do
        for _ in 1 2 3 4 5 6 7 8 9 10; do
            grep -q " $m " /proc/mounts || break
            "$CONVERGED" umount "$m" 2>/dev/null || sleep 0.5
        done
    done
    kill -TERM "$CLUSTER" 2>/dev/null || true
    wait "$CLUSTER" 2>/dev/null || true
}
trap cleanup EXIT
# Each in a process group of its own (setsid), which cleanup kills whole.
export N1 N2 WORK
setsid bash -c 'while :; do mkdir -p "$N2/busy" && tar xf "$WORK/tree.tar" -C "$N2/busy" && rm -rf "$N2/busy"; done' \
    >"$WORK/busy-n2.log" 2>&1 &
BUSY+=($!)
setsid bash -c 'i=0; while :; do i=$((i + 1)); dd if=/dev/urandom of="$N1/busy.$((i % 8))" bs=1M count=8 conv=fsync status=none; done' \
    >"$WORK/busy-n1.log" 2>&1 &
BUSY+=($!)

passed=0
for i in $(seq 1 "$ITERATIONS"); do
    out=$N1/dirstress.$i
    mkdir "$out"
    for args in "-p 1 -n 1" "-p 5 -n 1" "-p 5 -n 5"; do
        # shellcheck disable=SC2086 # the arguments are words
        if ! "$DIRSTRESS" -d "$out" -f 1000 $args >"$WORK/dirstress.out" 2>&1; then
            echo "iteration $i: dirstress -f 1000 $args failed:"
            tail -20 "$WORK/dirstress.out"
            echo "passed $passed of $ITERATIONS"
            exit 1
        fi
    done
    # dirstress skips a name its lstat does not find, so a name the mount
    # lists but does not look up shows here: rm -rf then cannot empty it.
    if ! rm -rf "$out" 2>"$WORK/rm.err"; then
        echo "iteration $i: rm -rf of dirstress's directory failed (a name listed but not found?):"
        tail -5 "$WORK/rm.err"
        ls -la "$out"/stressdir/* 2>&1 | head -20
        echo "passed $passed of $ITERATIONS"
        exit 1
    fi
    passed=$((passed + 1))
    echo "iteration $i passed ($(date +%T))"
done
echo "passed $passed of $ITERATIONS"
