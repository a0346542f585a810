#!/usr/bin/env bash
# What a cluster asks of etcd after its nodes restart over the copies they
# hold: a 2-node `converged dev-cluster` is filled with TREE small files
# (1-4 KiB, 100 directories, untarred on n1: n2 holds the replicas), stopped,
# and started again on the same data dirs and etcd; then, window by window,
# etcd's requests a second by kind and the CPU of etcd and of each node's
# daemon while nothing uses the mounts. The first minute is the work a
# mount does (settling received copies, the scrub's first chunks, the
# sweep's pass over what changed while the node was down); after it, what
# runs while the node idles (the sweep's safety pass, 50 files a second).
#
#   sudo bench/restart-idle.sh
#   sudo TREE=5000 WINDOWS=6 bench/restart-idle.sh          # quick check
#   sudo SAVE=1 bench/restart-idle.sh                       # also save bench/results/restart-idle-<date>.txt
#
# Environment (defaults in brackets):
#   BENCH_DIR  work directory, on the disk under test [/var/tmp/converged-restart-bench]
#   TREE       small files written before the restart [20000]
#   WINDOW     seconds a window [15]
#   WINDOWS    windows measured after the restart [12]
#   NOWSYNC    1: mount with --nowsync [0]
#   CONVERGED  converged binary [<repo>/target/release/converged; built if missing]
#   SAVE       1: also save the table under bench/results/ [0]
set -euo pipefail
SCRIPT_DIR=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
BENCH_DIR=${BENCH_DIR:-/var/tmp/converged-restart-bench}
TREE=${TREE:-20000}
WINDOW=${WINDOW:-15}
WINDOWS=${WINDOWS:-12}
NOWSYNC=${NOWSYNC:-0}
SAVE=${SAVE:-0}
CONVERGED=${CONVERGED:-$REPO/target/release/converged}
die() {
    echo "restart-idle: $*" >&2
    exit 1
}
for v in TREE WINDOW WINDOWS; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "$v must be a positive whole number, not '${!v}'"
done
[[ $NOWSYNC == 0 || $NOWSYNC == 1 ]] || die "NOWSYNC must be 0 or 1, not '$NOWSYNC'"
[[ $(id -u) == 0 ]] || die "run as root (it mounts FUSE)"
command -v curl > /dev/null || die "curl is needed (apt-get install curl)"
if [[ ! -x $CONVERGED ]]; then
    (cd "$REPO" && cargo build --release -q -p converged-fs)
fi
opts=()
[[ $NOWSYNC == 1 ]] && opts+=(--mount-opt=--nowsync)
rm -rf "$BENCH_DIR"
mkdir -p "$BENCH_DIR"
OUT=$BENCH_DIR/out
mkdir -p "$OUT"
PID=
stop() {
    if [[ -n $PID ]] && kill -0 "$PID" 2> /dev/null; then
        kill -INT "$PID"
        wait "$PID" 2> /dev/null || true
    fi
    PID=
}
trap 'stop; rm -rf "$BENCH_DIR/cluster"' EXIT

start() { # LOG: starts the dev-cluster, sets PID and EP once it is ready
    "$CONVERGED" dev-cluster --nodes 2 --dir "$BENCH_DIR/cluster" "${opts[@]}" > "$1" 2>&1 &
    PID=$!
    for _ in $(seq 1 120); do
        grep -q "dev-cluster ready" "$1" && break
        kill -0 "$PID" 2> /dev/null || die "dev-cluster failed: $(tail -5 "$1")"
        sleep 1
    done
    grep -q "dev-cluster ready" "$1" || die "dev-cluster not ready after 120 s"
    EP=$(grep -o 'etcd://[^/]*' "$1" | head -1 | sed 's#etcd://##')
}

daemon() { # NODE: pid of the node's serving daemon
    pgrep -f "mount $BENCH_DIR/cluster/$1/mnt " | tail -1
}

counts() { # etcd's requests served so far, by method, and CPU ticks of etcd, n1, n2
    curl -s "http://$EP/metrics" |
        awk -F'[{}]' '/^grpc_server_handled_total/ { split($2, l, ","); m = ""; for (i in l) if (l[i] ~ /^grpc_method=/) m = l[i]; gsub(/grpc_method=|"/, "", m); split($3, v, " "); n[m] += v[1] } END { for (m in n) print m, n[m] }'
    for p in "$(pgrep -x etcd | tail -1)" "$(daemon n1)" "$(daemon n2)"; do
        awk '{ print "cpu", $14 + $15 }' "/proc/$p/stat"
    done
}

echo "restart-idle: filling the cluster with $TREE files" >&2
start "$OUT/first.log"
python3 "$SCRIPT_DIR/scripts/make_tree.py" "$OUT/tree.tar" "$TREE" 100
tar -xf "$OUT/tree.tar" -C "$BENCH_DIR/cluster/n1/mnt"
sync
sleep 5
stop
echo "restart-idle: restarting on the same data dirs" >&2
start "$OUT/second.log"
TICK=$(getconf CLK_TCK)
{
    echo "converged after a restart, idle, $(date '+%Y-%m-%d %H:%M:%S %z')"
    echo "host $(hostname), $(nproc) CPUs, converged $(cd "$REPO" && git rev-parse --short HEAD), $TREE files held, nowsync=$NOWSYNC"
    echo "per window of $WINDOW s, from the dev-cluster's ready line: etcd requests a second by method,"
    echo "CPU in % of one core (etcd, n1's daemon, n2's daemon)"
    printf '%8s %10s %10s %10s %10s %8s %8s %8s\n' "from s" Range Txn Put other etcd n1 n2
    counts > "$OUT/c0"
    for w in $(seq 1 "$WINDOWS"); do
        sleep "$WINDOW"
        counts > "$OUT/c1"
        python3 - "$OUT/c0" "$OUT/c1" "$WINDOW" "$TICK" "$(((w - 1) * WINDOW))" << 'EOF'
import sys
def read(p):
    req, cpu = {}, []
    for line in open(p):
        k, v = line.split()
        if k == "cpu":
            cpu.append(float(v))
        else:
            req[k] = float(v)
    return req, cpu
(r0, c0), (r1, c1) = read(sys.argv[1]), read(sys.argv[2])
t, tick, start = float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
rate = {m: (r1.get(m, 0) - r0.get(m, 0)) / t for m in r1}
main = ("Range", "Txn", "Put")
other = sum(v for m, v in rate.items() if m not in main and m not in ("LeaseKeepAlive", "Watch"))
cpu = [(b - a) / tick / t * 100 for a, b in zip(c0, c1)]
print(f"{start:>8} " + " ".join(f"{rate.get(m, 0):10.1f}" for m in main) + f" {other:10.1f} " + " ".join(f"{c:8.1f}" for c in cpu))
EOF
        mv "$OUT/c1" "$OUT/c0"
    done
    echo "(lease keepalives and the watch streams are left out; 'other' is every other request)"
} | tee "$OUT/table.txt"
if [[ $SAVE == 1 ]]; then
    # shellcheck source=scripts/results.sh
    source "$SCRIPT_DIR/scripts/results.sh"
    save_result restart-idle "$OUT/table.txt"
fi
