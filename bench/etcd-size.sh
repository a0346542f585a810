#!/usr/bin/env bash
# What a volume's records cost etcd's database: files of several sizes made
# and published through the namespace (metadata/examples/etcd_size.rs) on a
# one-member etcd of this script's own, its history compacted and its
# database defragmented after each size. Prints bytes and keys per file,
# and how many such files one etcd holds at its default 2 GiB quota and at
# the 8 GiB it suggests as the most.
#
#   bench/etcd-size.sh
#   FILES=5000 SAVE=1 bench/etcd-size.sh     # also write bench/results/etcd-size-<date>.txt
#
# Environment (defaults in brackets):
#   FILES   files per size [2000]
#   SIZES   bytes per file, space separated [0 110000 67108864 1073741824]
#   ETCD    the etcd server binary [/usr/bin/etcd]
#   SAVE    1: also save the output under bench/results/ [0]
set -euo pipefail
SCRIPT_DIR=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
FILES=${FILES:-2000}
SIZES=${SIZES:-0 110000 67108864 1073741824}
ETCD=${ETCD:-/usr/bin/etcd}
SAVE=${SAVE:-0}
[[ -x $ETCD ]] || { echo "etcd-size: no etcd at $ETCD (Debian: apt-get install etcd-server)" >&2; exit 1; }
WORK=$(mktemp -d /var/tmp/converged-etcd-size.XXXXXX)
# shellcheck source=scripts/etcd.sh
. "$SCRIPT_DIR/scripts/etcd.sh"
trap 'stop_etcd; rm -rf "$WORK"' EXIT
(cd "$REPO" && cargo build --release -q -p converged-metadata --example etcd_size)
start_etcd "$WORK/etcd"
OUT=$WORK/out.txt
{
    echo "converged etcd database size, $(date '+%Y-%m-%d %H:%M:%S %z')"
    echo "host $(hostname), $("$ETCD" --version | head -1), converged $(cd "$REPO" && git rev-parse --short HEAD)"
    for size in $SIZES; do
        echo
        "$REPO/target/release/examples/etcd_size" "$ETCD_CLIENT" "$FILES" "$size"
    done
} | tee "$OUT"
if [[ $SAVE == 1 ]]; then
    # shellcheck source=scripts/results.sh
    source "$SCRIPT_DIR/scripts/results.sh"
    save_result etcd-size "$OUT"
fi
