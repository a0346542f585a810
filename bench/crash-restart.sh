#!/usr/bin/env bash
# The cost of a daemon crash to a training job: a 64 MiB checkpoint saved in
# a loop (write, fsync, rename, directory fsync) on the raw disk, on a
# single-node converged mount, and on the same mount while its daemon is
# killed with SIGKILL every KILL_EVERY seconds (the supervisor starts a new
# one on the live connection); in one run, each save time with its ratio to
# raw, the errors the saving loop met (there should be none), and how long
# each kill took to be replaced.
#
#   sudo bench/crash-restart.sh
#   sudo SECONDS_EACH=15 bench/crash-restart.sh     # quick check
#
# Environment (defaults in brackets):
#   BENCH_DIR     work directory, on the disk under test [/var/tmp/converged-crash-bench]
#   SECONDS_EACH  seconds each loop runs [30]
#   KILL_EVERY    seconds between kills [3]
#   CONVERGED     converged binary [<repo>/target/release/converged; built if missing]
#
# Needs root (FUSE mounts) and python3.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
BENCH_DIR=${BENCH_DIR:-/var/tmp/converged-crash-bench}
SECONDS_EACH=${SECONDS_EACH:-30}
KILL_EVERY=${KILL_EVERY:-3}
CONVERGED=${CONVERGED:-$REPO/target/release/converged}

if [ ! -x "$CONVERGED" ]; then
    (cd "$REPO" && cargo build --release -p converged-fs)
fi

MNT=$BENCH_DIR/mnt
DATA=$BENCH_DIR/data
stop_mount() {
    if [ -f "$DATA/converged.supervisor" ]; then
        local pid
        pid=$(cat "$DATA/converged.supervisor")
        kill "$pid" 2>/dev/null || true
        while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    fi
    if grep -q " $MNT " /proc/mounts; then umount -l "$MNT"; fi
}
cleanup() {
    stop_mount
    rm -rf "$BENCH_DIR/raw" "$DATA"
}
trap cleanup EXIT

stop_mount
rm -rf "$BENCH_DIR"
mkdir -p "$BENCH_DIR/raw" "$MNT" "$DATA"

echo "raw disk ..." >&2
raw=$(python3 "$SCRIPT_DIR/scripts/kill_loop.py" "$BENCH_DIR/raw" "$SECONDS_EACH")
"$CONVERGED" mount "$MNT" --data-dir "$DATA" --new-node >/dev/null
echo "converged ..." >&2
quiet=$(python3 "$SCRIPT_DIR/scripts/kill_loop.py" "$MNT/quiet" "$SECONDS_EACH")
echo "converged, kill -9 every ${KILL_EVERY}s ..." >&2
killed=$(python3 "$SCRIPT_DIR/scripts/kill_loop.py" "$MNT/killed" "$SECONDS_EACH" "$DATA" "$KILL_EVERY")

python3 - "$raw" "$quiet" "$killed" <<'PY'
import json, sys
raw, quiet, killed = (json.loads(a) for a in sys.argv[1:])
base = raw["mean_s"]
print(f"{'64 MiB checkpoint save':42} {'saves':>6} {'s/save':>8} {'x raw':>6} {'errors':>7}")
for name, r in [("raw disk", raw), ("converged", quiet), ("converged, daemon killed every few s", killed)]:
    print(f"{name:42} {r['saves']:6d} {r['mean_s']:8.3f} {r['mean_s'] / base:6.2f} {r['n_errors']:7d}")
times = sorted(killed.get("replaced_s", []))
if times:
    mid = times[len(times) // 2]
    print(f"kills: {len(times)}; a new daemon held the mount {mid * 1000:.0f} ms after a kill (median), {times[-1] * 1000:.0f} ms at most")
for r in (raw, quiet, killed):
    for e in r["errors"]:
        print("error:", e)
PY
