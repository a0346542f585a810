#!/usr/bin/env bash
# What FUSE over io_uring would give a daemon on this host, measured with
# libfuse's own reference daemon (example/passthrough_hp of libfuse 3.18 or
# later, built by the user: this project vendors no libfuse), since fuser,
# which converged is built on, has no io_uring transport. The same
# passthrough_hp over a tmpfs (so that the backing filesystem costs next to
# nothing) is mounted in turn through /dev/fuse and through io_uring
# (`-o io_uring`), ROUNDS times each, alternated; each mount gets one
# process's creates, first stats and unlinks (scripts/meta_ops.py) and an
# untar of TREE small files, with the daemon's CPU and context switches a
# file from /proc. The tmpfs directory itself is measured first, as the
# ceiling. Prints each figure and io_uring's ratio to /dev/fuse (medians).
#
#   sudo LIBFUSE_BUILD=~/libfuse/build bench/fuse-uring.sh
#   sudo LIBFUSE_BUILD=... ROUNDS=5 NFILES=10000 SAVE=1 bench/fuse-uring.sh
#
# libfuse: git clone https://github.com/libfuse/libfuse; cd libfuse;
# git checkout fuse-3.18.2; apt-get install meson ninja-build liburing-dev
# libnuma-dev pkg-config g++; meson setup build -Dexamples=true; ninja -C build
# (meson's summary must say "io_uring support: True").
#
# Environment (defaults in brackets):
#   LIBFUSE_BUILD  a libfuse build directory holding example/passthrough_hp [required]
#   BENCH_DIR      work directory: the mount point and the tar archive [/var/tmp/converged-uring-bench]
#   NFILES         files created, stat-ed and unlinked a round [5000]
#   TREE           files in the untar, in 10 directories [2000]
#   ROUNDS         mounts of each transport, alternated [4]
#   SAVE           1: also save the table as bench/results/fuse-uring-<date>.txt [0]
#
# The kernel's /sys/module/fuse/parameters/enable_uring is set to Y for the
# run and put back as it was at the end. Needs root.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BENCH_DIR=${BENCH_DIR:-/var/tmp/converged-uring-bench}
NFILES=${NFILES:-5000}
TREE=${TREE:-2000}
ROUNDS=${ROUNDS:-4}
SAVE=${SAVE:-0}
URING_PARAM=/sys/module/fuse/parameters/enable_uring

die() { echo "fuse-uring: $*" >&2; exit 1; }
log() { echo "== $*" >&2; }
# shellcheck source=scripts/mounts.sh
. "$SCRIPT_DIR/scripts/mounts.sh"

[[ $(id -u) -eq 0 ]] || die "run as root (FUSE mounts and $URING_PARAM need it): sudo $0"
[[ -n ${LIBFUSE_BUILD:-} ]] || die "LIBFUSE_BUILD is not set: name a libfuse (3.18 or later) build directory"
PH=$LIBFUSE_BUILD/example/passthrough_hp
PH_RE=$(printf '%s' "$PH" | sed 's/[][\.*^$+?(){}|]/\\&/g') # as pgrep -f matches it
[[ -x $PH ]] || die "$PH not found: build libfuse with -Dexamples=true (see the top of $0)"
"$PH" --help 2>&1 | grep -q -- "-o io_uring" || die "$PH has no -o io_uring: libfuse 3.18 or later, built with liburing"
[[ -w $URING_PARAM ]] || die "$URING_PARAM is missing or read-only: this kernel has no FUSE over io_uring (Linux 6.14+)"
command -v fusermount3 >/dev/null || die "fusermount3 not found (apt-get install fuse3)"
for v in NFILES TREE ROUNDS; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "$v=${!v}: expected a positive integer"
done
[[ $SAVE == 0 || $SAVE == 1 ]] || die "SAVE=$SAVE: expected 0 or 1"

SRC=$(mktemp -d /dev/shm/converged-uring-src.XXXXXX)
MNT=$BENCH_DIR/mnt
OUT=$BENCH_DIR/out
mkdir -p "$MNT" "$OUT"
rm -f "$OUT"/*.json
WAS=$(cat "$URING_PARAM")
cleanup() {
    fusermount3 -u "$MNT" 2>/dev/null || true
    echo "$WAS" > "$URING_PARAM" || true
    rm -rf "$SRC"
}
trap cleanup EXIT
echo Y > "$URING_PARAM"
python3 "$SCRIPT_DIR/scripts/make_tree.py" "$OUT/tree.tar" "$TREE" 10

# One round: DIR is where the files go; PATTERN (or empty) the daemon
# serving it, as `pgrep -f` finds it. scripts/profile_run.py times each
# phase and reads the daemon's CPU and context switches around it.
measure() { # NAME DIR PATTERN
    local name=$1 dir=$2 pattern=$3 proc=()
    [[ -n $pattern ]] && proc=(--proc "daemon=$pattern")
    python3 "$SCRIPT_DIR/scripts/profile_run.py" "$OUT/$name.meta-profile.json" "${proc[@]}" -- \
        python3 "$SCRIPT_DIR/scripts/meta_ops.py" "$dir/meta" "$NFILES" 1 > "$OUT/$name.meta.json"
    mkdir "$dir/tree"
    sync
    python3 "$SCRIPT_DIR/scripts/profile_run.py" "$OUT/$name.tree-profile.json" "${proc[@]}" -- \
        tar -xf "$OUT/tree.tar" -C "$dir/tree"
    python3 - "$OUT" "$name" "$TREE" "$NFILES" <<'PY'
import json, sys
out, name, tree, nfiles = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
r = {k: v["ops_s"] for k, v in json.load(open(f"{out}/{name}.meta.json")).items()}
meta, untar = (json.load(open(f"{out}/{name}.{p}-profile.json")) for p in ("meta", "tree"))
r["untar_s"] = untar["wall"]
if "daemon" in untar["cpu"]:
    # The meta phase makes, stats and removes NFILES files.
    r["meta_cpu_us"] = 1e6 * meta["cpu"]["daemon"] / nfiles
    r["untar_cpu_us"] = 1e6 * untar["cpu"]["daemon"] / tree
    r["untar_switches"] = untar["switches"]["daemon"] / tree
json.dump(r, open(f"{out}/{name}.json", "w"))
PY
    rm -rf "${dir:?}/meta" "${dir:?}/tree"
}

mount_ph() { # extra options...: mounts passthrough_hp over SRC at MNT, prints its pid
    rm -rf "${SRC:?}"/*
    setsid "$PH" --foreground "$@" "$SRC" "$MNT" > "$OUT/passthrough_hp.log" 2>&1 &
    local pid=$!
    wait_mounted "$MNT" "$pid" "$OUT/passthrough_hp.log" "passthrough_hp $*"
    echo "$pid"
}

log "tmpfs itself"
mkdir -p "$SRC/raw"
measure raw "$SRC/raw" ""
rm -rf "${SRC:?}/raw"
for r in $(seq "$ROUNDS"); do
    for t in dev-fuse io-uring; do
        opts=()
        [[ $t == io-uring ]] && opts=(-o io_uring)
        log "round $r: passthrough_hp through $t"
        pid=$(mount_ph "${opts[@]}")
        # A daemon that registered its rings holds io_uring instances; one
        # that fell back to /dev/fuse holds none, and would be measured twice.
        rings=$(find "/proc/$pid/fd" -lname 'anon_inode:\[io_uring\]' | wc -l)
        [[ $t == dev-fuse || $rings -gt 0 ]] || die "passthrough_hp -o io_uring holds no io_uring: it serves /dev/fuse"
        measure "$t-$r" "$MNT" "^$PH_RE --foreground"
        fusermount3 -u "$MNT"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    done
done

REPORT=$OUT/table.txt
{
    echo "FUSE over io_uring against /dev/fuse, $(date '+%Y-%m-%d %H:%M:%S %z')"
    echo "host $(hostname), kernel $(uname -r), $(nproc) CPUs; libfuse $(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["version"])' \
        "$LIBFUSE_BUILD/meson-info/intro-projectinfo.json" 2>/dev/null || echo '?')"
    echo "passthrough_hp over a tmpfs; NFILES=$NFILES TREE=$TREE ROUNDS=$ROUNDS (medians of the rounds)"
    echo
    python3 - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
raw = json.load(open(f"{out}/raw.json"))
runs = {t: [json.load(open(f"{out}/{t}-{r}.json")) for r in range(1, rounds + 1)] for t in ("dev-fuse", "io-uring")}
rows = [("create, 1 process, /s", "create"), ("first stat after create, /s", "first_stat"),
        ("cached stat, /s", "cached_stat"), ("unlink, 1 process, /s", "unlink"),
        (f"untar, s", "untar_s"), ("daemon CPU, us a create+stat+unlink", "meta_cpu_us"),
        ("daemon CPU, us a file untarred", "untar_cpu_us"), ("daemon switches a file untarred", "untar_switches")]
print(f"{'':<38}{'tmpfs':>12}{'/dev/fuse':>12}{'io_uring':>12}{'io_uring/dev':>14}")
for label, key in rows:
    med = {t: statistics.median(r[key] for r in runs[t]) for t in runs}
    base = f"{raw[key]:>12,.2f}" if key in raw and key == "untar_s" else (f"{raw[key]:>12,.0f}" if key in raw else f"{'-':>12}")
    fmt = (lambda v: f"{v:>12,.2f}") if key in ("untar_s", "untar_switches") else (lambda v: f"{v:>12,.0f}")
    print(f"{label:<38}{base}{fmt(med['dev-fuse'])}{fmt(med['io-uring'])}{med['io-uring'] / med['dev-fuse']:>13.2f}x")
for t in runs:
    print(f"{t} rounds: creates " + ", ".join(f"{r['create']:,.0f}" for r in runs[t])
          + "; unlinks " + ", ".join(f"{r['unlink']:,.0f}" for r in runs[t]))
PY
} > "$REPORT"
echo
cat "$REPORT"
if [[ $SAVE == 1 ]]; then
    # shellcheck source=scripts/results.sh
    source "$SCRIPT_DIR/scripts/results.sh"
    save_result fuse-uring "$REPORT"
fi
