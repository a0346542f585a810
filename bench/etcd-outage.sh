#!/usr/bin/env bash
# What a node does while etcd answers nothing (its hosts hang, or a
# partition drops its packets without a reset): a 2-node `converged
# dev-cluster`, FILES small files written and closed on n1, then etcd
# stopped with SIGSTOP (its connections stay up) and, in wall seconds:
#   - with CREATE=1, two creates on n1 during the outage (off by default:
#     each waits the mount's --meta-op-wait, 5 minutes unless WAIT says,
#     then fails with EIO): one in a directory n1 made just before, whose
#     reads n1's cache answers, so its commit is what goes unanswered, and
#     one in the root, which must read from etcd first;
#   - `converged umount` of n1: it asks etcd once, leaves what only etcd
#     can record to the next mount and the membership lease, and ends.
# etcd is let go (SIGCONT) before the cluster stops.
#
#   sudo bench/etcd-outage.sh
#   sudo CREATE=1 bench/etcd-outage.sh       # also time a create (minutes)
#   sudo CREATE=1 WAIT=30s bench/etcd-outage.sh
#   sudo SAVE=1 bench/etcd-outage.sh         # also save bench/results/etcd-outage-<date>.txt
#
# Environment (defaults in brackets):
#   BENCH_DIR  work directory [/var/tmp/converged-outage-bench]
#   FILES      small files closed on n1 just before the outage [100]
#   CREATE     1: also time a create during the outage [0]
#   WAIT       the nodes' --meta-op-wait (`30s`, `2m`) [the mount's default]
#   CONVERGED  converged binary [<repo>/target/release/converged; built if missing]
#   SAVE       1: also save the lines under bench/results/ [0]
set -euo pipefail
SCRIPT_DIR=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
BENCH_DIR=${BENCH_DIR:-/var/tmp/converged-outage-bench}
FILES=${FILES:-100}
CREATE=${CREATE:-0}
CONVERGED=${CONVERGED:-$REPO/target/release/converged}
SAVE=${SAVE:-0}
WAIT=${WAIT:-}
die() {
    echo "etcd-outage: $*" >&2
    exit 1
}
[[ $FILES =~ ^[1-9][0-9]*$ ]] || die "FILES must be a positive whole number, not '$FILES'"
[[ $CREATE == 0 || $CREATE == 1 ]] || die "CREATE must be 0 or 1, not '$CREATE'"
[[ $SAVE == 0 || $SAVE == 1 ]] || die "SAVE must be 0 or 1, not '$SAVE'"
[[ -z $WAIT || $WAIT =~ ^[0-9]+(\.[0-9]+)?(ms|s|m|h)?$ ]] || die "WAIT must be a duration such as 30s or 2m, not '$WAIT'"
[[ $(id -u) == 0 ]] || die "run as root (it mounts FUSE)"
if [[ ! -x $CONVERGED ]]; then
    (cd "$REPO" && cargo build --release -q -p converged-fs)
fi
rm -rf "$BENCH_DIR"
mkdir -p "$BENCH_DIR"
LOG=$BENCH_DIR/dev.log
PID=
ETCD=
stop() {
    [[ -n $ETCD ]] && kill -CONT "$ETCD" 2> /dev/null
    if [[ -n $PID ]] && kill -0 "$PID" 2> /dev/null; then
        kill -INT "$PID"
        wait "$PID" 2> /dev/null || true
    fi
    rm -rf "$BENCH_DIR"
}
trap stop EXIT

opts=()
[[ -z $WAIT ]] || opts=(--mount-opt="--meta-op-wait=$WAIT")
"$CONVERGED" dev-cluster --nodes 2 --dir "$BENCH_DIR/cluster" "${opts[@]}" > "$LOG" 2>&1 &
PID=$!
for _ in $(seq 1 120); do
    grep -q "dev-cluster ready" "$LOG" && break
    kill -0 "$PID" 2> /dev/null || die "dev-cluster failed: $(tail -5 "$LOG")"
    sleep 1
done
grep -q "dev-cluster ready" "$LOG" || die "dev-cluster not ready after 120 s"
ETCD=$(pgrep -f "etcd --name dev --data-dir $BENCH_DIR/cluster/etcd") || die "no etcd found"
MNT=$BENCH_DIR/cluster/n1/mnt
DATA=$BENCH_DIR/cluster/n1/data

python3 - "$MNT" "$FILES" << 'EOF'
import os, sys
mnt, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    with open(os.path.join(mnt, f"f{i}"), "wb") as f:
        f.write(os.urandom(1024 + i % 3072))
os.mkdir(os.path.join(mnt, "fresh"))
open(os.path.join(mnt, "fresh", "a"), "wb").close()
EOF
sleep 1
# shellcheck source=scripts/disk.sh
source "$SCRIPT_DIR/scripts/disk.sh"
TABLE=$(mktemp)
{
    echo "disk: $(describe_fs "$BENCH_DIR")"
    echo "$FILES files closed on n1; etcd stopped (SIGSTOP); --meta-op-wait ${WAIT:-default}"
    kill -STOP "$ETCD"
    if [[ $CREATE == 1 ]]; then
        for what in "fresh/b:in a directory n1 made just before" "in-the-root:in the root"; do
            s=$(date +%s.%N)
            # One open(O_CREAT|O_EXCL): touch(1) would try utimensat after
            # a failed open, a second operation and a second wait.
            if python3 -c 'import os, sys; os.close(os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))' \
                "$MNT/${what%%:*}" 2> "$BENCH_DIR/create.err"; then
                r=made
            else
                r="failed: $(tail -1 "$BENCH_DIR/create.err" | sed 's/.*\] //')"
            fi
            e=$(date +%s.%N)
            echo "create ${what#*:}: $(awk "BEGIN { printf \"%.1f\", $e - $s }") s ($r)"
        done
    fi
    daemon=$(pgrep -f "data-dir $DATA .*--fuse-fd" || true)
    s=$(date +%s.%N)
    if "$CONVERGED" umount "$MNT" 2> "$BENCH_DIR/umount.err"; then r=ok; else r="failed: $(cat "$BENCH_DIR/umount.err")"; fi
    e=$(date +%s.%N)
    left=none
    if [[ -n $daemon ]] && kill -0 "$daemon" 2> /dev/null; then left="pid $daemon still running"; fi
    echo "umount of n1: $(awk "BEGIN { printf \"%.1f\", $e - $s }") s ($r; daemon left: $left)"
} | tee "$TABLE"
if [[ $SAVE == 1 ]]; then
    # shellcheck source=scripts/results.sh
    source "$SCRIPT_DIR/scripts/results.sh"
    save_result etcd-outage "$TABLE"
fi
rm -f "$TABLE"
