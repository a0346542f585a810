#!/usr/bin/env bash
# The control plane of N nodes against one etcd (metadata/examples/control_sim.rs):
# each agent has its own etcd client, membership registration and heartbeat,
# and the node cache's watch on the volume, as a daemon does, without FUSE
# and data planes. For each N, a fresh one-member etcd of this script's own;
# prints etcd's own counts (requests, bytes, watch events a second) at rest,
# and while a tenth of the agents create files; then, with CHUNKS synthetic
# chunk records loaded, the repair wave after one agent dies and a drain of
# another (requests, wall time, index entries read).
#
#   bench/control-plane.sh
#   AGENTS="50 100 200" REST=30 BUSY=10 CHUNKS=1000000 SAVE=1 bench/control-plane.sh
#
# Environment (defaults in brackets):
#   AGENTS  agent counts, space separated [50 100 200]
#   REST    seconds measured at rest [20]
#   BUSY    seconds measured while a tenth create [10]
#   CHUNKS  synthetic chunk records for the repair wave and the drain (0: skip them) [1000000]
#   ETCD    the etcd server binary [/usr/bin/etcd]
#   SAVE    1: also save the output under bench/results/ [0]
set -euo pipefail
SCRIPT_DIR=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
AGENTS=${AGENTS:-50 100 200}
REST=${REST:-20}
BUSY=${BUSY:-10}
CHUNKS=${CHUNKS:-1000000}
ETCD=${ETCD:-/usr/bin/etcd}
SAVE=${SAVE:-0}
[[ -x $ETCD ]] || { echo "control-plane: no etcd at $ETCD (Debian: apt-get install etcd-server)" >&2; exit 1; }
WORK=$(mktemp -d /var/tmp/converged-control-plane.XXXXXX)
# shellcheck source=scripts/etcd.sh
. "$SCRIPT_DIR/scripts/etcd.sh"
trap 'stop_etcd; rm -rf "$WORK"' EXIT
(cd "$REPO" && cargo build --release -q -p converged-metadata --example control_sim)
ulimit -n 65536 2>/dev/null || true
OUT=$WORK/out.txt
{
    echo "converged control plane against one etcd, $(date '+%Y-%m-%d %H:%M:%S %z')"
    echo "host $(hostname), $(nproc) CPUs, $("$ETCD" --version | head -1), converged $(cd "$REPO" && git rev-parse --short HEAD)"
    for n in $AGENTS; do
        start_etcd "$WORK/etcd"
        echo
        "$REPO/target/release/examples/control_sim" "$ETCD_CLIENT" "$n" "$REST" "$BUSY" "$CHUNKS"
        stop_etcd
    done
} | tee "$OUT"
if [[ $SAVE == 1 ]]; then
    # shellcheck source=scripts/results.sh
    source "$SCRIPT_DIR/scripts/results.sh"
    save_result control-plane "$OUT"
fi
