#!/usr/bin/env bash
# Object tier benchmark on one machine: a converged mount backed by an
# S3-compatible server on 127.0.0.1 (moto), against the same S3 client used
# on its own and the raw disk, measured in the same run.
#
#   sudo bench/object-tier.sh
#   sudo SIZE=256m bench/object-tier.sh        # quick check
#   sudo SAVE=1 bench/object-tier.sh           # also write bench/results/object-tier-<date>.txt
#
# What it prints, each with its ratio:
#   backfill           a file closed on the mount until its object is complete
#                      (--backfill-delay 0) / a plain multipart upload of the same
#                      bytes with the same client (fs/examples/object_bench.rs)
#   first read         cold read of an imported object through the mount (ranged
#                      GETs, hydrating the SSD) / a direct GET of the same object,
#                      and / the same ranged GETs issued directly (what the mount
#                      asks the server for, without the mount)
#   staged read        cold read of an imported object after `converged stage`
#                      / a cold read of the same bytes from the raw disk
#
# Environment (defaults in brackets):
#   BENCH_DIR   work directory, on the disk under test [/var/tmp/converged-object-bench]
#   SIZE        file size, dd syntax with an m or g suffix [1g]
#   PORT        port for the S3 server [9400]
#   S3_SERVER   moto (in memory) or s3s-fs (file-backed, in BENCH_DIR/s3) [moto]
#   CONVERGED   converged binary [<repo>/target/release/converged; built if missing]
#   SAVE        1: also save the table under bench/results/ [0]
#
# Needs root, python3 with moto[server] and boto3 (pip install 'moto[server]' boto3).
# moto keeps objects in memory and serves them from Python: its own speed
# bounds every figure here, which is why each one is a ratio against the same
# server used directly.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
BENCH_DIR=${BENCH_DIR:-/var/tmp/converged-object-bench}
SIZE=${SIZE:-1g}
PORT=${PORT:-9400}
CONVERGED=${CONVERGED:-$REPO/target/release/converged}
OBJBENCH=$REPO/target/release/examples/object_bench
SAVE=${SAVE:-0}
S3_SERVER=${S3_SERVER:-moto}

die() { echo "object-bench: $*" >&2; exit 1; }
log() { echo "== $*" >&2; }

[[ $(id -u) -eq 0 ]] || die "run as root (drop_caches and FUSE mounts need it): sudo $0"
case $S3_SERVER in
    moto) command -v moto_server >/dev/null || die "moto_server not found (pip install 'moto[server]' boto3)" ;;
    s3s-fs) command -v s3s-fs >/dev/null || die "s3s-fs not found (cargo install s3s-fs@0.14.1 --locked --features binary)" ;;
    *) die "S3_SERVER=$S3_SERVER: expected moto or s3s-fs" ;;
esac
python3 -c "import boto3" 2>/dev/null || die "boto3 not found (pip install boto3)"
[[ $SIZE =~ ^([1-9][0-9]*)([mMgG])$ ]] || die "SIZE=$SIZE: expected a number with an m or g suffix"
MIB=${BASH_REMATCH[1]}
[[ ${BASH_REMATCH[2]} =~ [gG] ]] && MIB=$((MIB * 1024))
case $BENCH_DIR in /*) ;; *) die "BENCH_DIR must be an absolute path" ;; esac

if [[ ! -x $CONVERGED || ! -x $OBJBENCH ]]; then
    log "building release binaries"
    (cd "$REPO" && cargo build --release -p converged-fs --bin converged --example object_bench) >&2
fi

ENDPOINT=http://127.0.0.1:$PORT
export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench AWS_REGION=us-east-1
MOTO_PID=
cleanup() {
    "$CONVERGED" umount "$BENCH_DIR/mnt" 2>/dev/null || umount -l "$BENCH_DIR/mnt" 2>/dev/null || true
    [[ -n $MOTO_PID ]] && kill "$MOTO_PID" 2>/dev/null || true
    rm -rf "$BENCH_DIR/raw" "$BENCH_DIR/data" "$BENCH_DIR/s3"
}
trap cleanup EXIT

rm -rf "$BENCH_DIR" && mkdir -p "$BENCH_DIR"/{raw,data,mnt}
if [[ $S3_SERVER == moto ]]; then
    moto_server -H 127.0.0.1 -p "$PORT" >"$BENCH_DIR/s3.log" 2>&1 &
else
    mkdir -p "$BENCH_DIR/s3"
    s3s-fs --host 127.0.0.1 --port "$PORT" --access-key bench --secret-key bench "$BENCH_DIR/s3" >"$BENCH_DIR/s3.log" 2>&1 &
fi
MOTO_PID=$!
for _ in $(seq 100); do (echo >/dev/tcp/127.0.0.1/"$PORT") 2>/dev/null && break; sleep 0.1; done
S3PY=(python3 "$REPO/tests/scripts/s3.py" "$ENDPOINT")
AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench "${S3PY[@]}" mkbucket bench

now() { date +%s.%N; }
rate() { python3 -c "print(f'{$1 / $2 / 1e6:.0f}')"; }   # bytes seconds -> MB/s
ratio() { python3 -c "print(f'{$1 / $2:.2f}')"; }
drop() { sync; echo 3 >/proc/sys/vm/drop_caches; }
read_secs() { drop; local t=$(now); dd if="$1" of=/dev/null bs=4M status=none; python3 -c "print($(now) - $t)"; }
BYTES=$((MIB * 1024 * 1024))

log "writing a $SIZE file on the raw disk"
dd if=/dev/urandom of="$BENCH_DIR/raw/file" bs=1M count="$MIB" status=none
raw_read=$(read_secs "$BENCH_DIR/raw/file")

log "plain multipart upload with the same client"
put=$("$OBJBENCH" put s3://bench/plain file "$BENCH_DIR/raw/file" --s3-endpoint "$ENDPOINT" | awk '{print $2}')
log "plain GET, and the same bytes as the mount asks for them (64 MiB at a time in 8 MiB ranges)"
get=$("$OBJBENCH" get s3://bench/plain file --s3-endpoint "$ENDPOINT" | awk '{print $2}')
ranged=$("$OBJBENCH" get-ranged s3://bench/plain file --s3-endpoint "$ENDPOINT" | awk '{print $2}')

log "mounting converged with --object-store s3://bench/vol"
"$CONVERGED" mount "$BENCH_DIR/mnt" --data-dir "$BENCH_DIR/data" --object-store s3://bench/vol \
    --s3-endpoint "$ENDPOINT" --backfill-delay 0
cp "$BENCH_DIR/raw/file" "$BENCH_DIR/mnt/file"
t0=$(now)
until getfattr --only-values -n user.converged.tier "$BENCH_DIR/mnt/file" 2>/dev/null | grep -q '^state=backed'; do
    sleep 0.02
done
backfill=$(python3 -c "print($(now) - $t0)")
# The plain upload again, after: the mean of before and after evens out the
# server's disk getting fuller and the machine's noise.
put2=$("$OBJBENCH" put s3://bench/plain2 file "$BENCH_DIR/raw/file" --s3-endpoint "$ENDPOINT" | awk '{print $2}')
put=$(python3 -c "print(($put + $put2) / 2)")

log "importing the plain object and reading it cold"
"$CONVERGED" import s3://bench/plain "$BENCH_DIR/mnt/imported" --s3-endpoint "$ENDPOINT" >/dev/null
ls "$BENCH_DIR/mnt/imported" >/dev/null
first=$(read_secs "$BENCH_DIR/mnt/imported/file")

log "importing it again, staging it, and reading it cold"
"$CONVERGED" import s3://bench/plain "$BENCH_DIR/mnt/staged" --s3-endpoint "$ENDPOINT" >/dev/null
t=$(now)
"$CONVERGED" stage "$BENCH_DIR/mnt/staged" >/dev/null 2>&1
stage=$(python3 -c "print($(now) - $t)")
staged=$(read_secs "$BENCH_DIR/mnt/staged/file")

table=$(
    printf '%-16s %10s %12s %10s %8s\n' "" "MB/s" "baseline" "MB/s" "ratio"
    printf '%-16s %10s %12s %10s %8s\n' "backfill" "$(rate $BYTES "$backfill")" "multipart" "$(rate $BYTES "$put")" "$(ratio "$put" "$backfill")"
    printf '%-16s %10s %12s %10s %8s\n' "first read" "$(rate $BYTES "$first")" "direct GET" "$(rate $BYTES "$get")" "$(ratio "$get" "$first")"
    printf '%-16s %10s %12s %10s %8s\n' "first read" "$(rate $BYTES "$first")" "ranged GETs" "$(rate $BYTES "$ranged")" "$(ratio "$ranged" "$first")"
    printf '%-16s %10s %12s %10s %8s\n' "staged read" "$(rate $BYTES "$staged")" "raw read" "$(rate $BYTES "$raw_read")" "$(ratio "$raw_read" "$staged")"
    printf '%-16s %10s %12s %10s %8s\n' "stage" "$(rate $BYTES "$stage")" "direct GET" "$(rate $BYTES "$get")" "$(ratio "$get" "$stage")"
    echo "size $SIZE; S3 server: $S3_SERVER on 127.0.0.1; targets: backfill >= 0.8x multipart"
)
echo "$table"
if [[ $SAVE == 1 ]]; then
    mkdir -p "$SCRIPT_DIR/results"
    out=$SCRIPT_DIR/results/object-tier-$(date +%Y-%m-%d-%H%M%S).txt
    { echo "# bench/object-tier.sh SIZE=$SIZE on $(uname -r), $(nproc) cores"; echo "$table"; } >"$out"
    log "saved $out"
fi
