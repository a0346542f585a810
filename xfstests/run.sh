#!/usr/bin/env bash
# Run xfstests against single-node converged mounts.
#
#   xfstests/run.sh XFSTESTS_DIR [GROUP|TEST...]      (as root)
#
# XFSTESTS_DIR is an xfstests checkout (see xfstests/README.md); it is built
# here if it has not been. With no selection the `quick` group runs. A GROUP
# is a word (`quick`, `auto`, `acl`); a TEST is a name such as generic/013.
# Only the generic tests apply to a FUSE filesystem.
#
# Environment:
#   CONVERGED_BIN_DIR   where the `converged` and `mount-converged` binaries are
#                       (default: built here with `cargo build --release`)
#   XFSTESTS_WORK       data dirs, mount points and results
#                       (default /var/tmp/converged-xfstests; emptied first)
#   XFSTESTS_TIME_LIMIT seconds one test may run before it is killed and
#                       counted as failed (default 900)
#   XFSTESTS_DISK_SIZE  size of each of the two loop-mounted ext4 images the
#                       test and scratch data dirs live on (default 6G; sparse),
#                       so that tests that fill their filesystem fill those,
#                       not the host's disk
#
# Each test runs as its own `./check` under a time limit, so a hang costs
# one test, not the run: its mounts are torn down and the next one starts
# on fresh mounts. Tests in xfstests/excludes are not run (each line there
# says why). At the end the pass / fail / not-run counts and the failing
# tests are printed, and kept in $XFSTESTS_WORK/summary.txt.
set -euo pipefail

usage() {
	# The comment block at the top of this file.
	awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
	exit "${1:-1}"
}
[ $# -ge 1 ] || usage 1
case "$1" in -h | --help) usage 0 ;; esac
[ "$(id -u)" = 0 ] || { echo "run.sh: xfstests mounts filesystems and adds users: run it as root" >&2; exit 1; }

XFS=$(cd "$1" 2>/dev/null && pwd) || { echo "run.sh: $1 is not a directory" >&2; exit 1; }
shift
[ -f "$XFS/check" ] && [ -d "$XFS/tests/generic" ] || {
	echo "run.sh: $XFS is not an xfstests checkout (no check script, no tests/generic)" >&2
	exit 1
}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(dirname "$HERE")
WORK=${XFSTESTS_WORK:-/var/tmp/converged-xfstests}
LIMIT=${XFSTESTS_TIME_LIMIT:-900}
DISK_SIZE=${XFSTESTS_DISK_SIZE:-6G}

missing=()
for tool in make autoconf libtoolize xfs_io fio setfacl attr bc mkfs.ext4; do
	command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
	echo "run.sh: missing ${missing[*]}; on Debian install:" >&2
	echo "  apt-get install $(grep -o 'apt-get install .*' "$HERE/README.md" | head -1 | cut -d' ' -f3-)" >&2
	exit 1
fi

# Build xfstests once.
if [ ! -x "$XFS/ltp/fsstress" ] || [ ! -f "$XFS/tests/generic/group.list" ]; then
	echo "== building xfstests in $XFS"
	make -C "$XFS" -j"$(nproc)" >"${TMPDIR:-/tmp}/xfstests-build.log" 2>&1 || {
		tail -30 "${TMPDIR:-/tmp}/xfstests-build.log" >&2
		echo "run.sh: building xfstests failed (log: ${TMPDIR:-/tmp}/xfstests-build.log)" >&2
		exit 1
	}
fi

# The binaries under test, copied so that a rebuild during the run changes nothing.
if [ -z "${CONVERGED_BIN_DIR:-}" ]; then
	echo "== building converged (release)"
	(cd "$REPO" && cargo build --release -p converged-fs -p converged-mount-helper)
	CONVERGED_BIN_DIR="$REPO/target/release"
fi

# Stop whatever a previous run left mounted.
teardown() {
	for m in "$WORK/mnt/test" "$WORK/mnt/scratch"; do
		if findmnt -rn "$m" >/dev/null 2>&1; then
			umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
		fi
	done
	pkill -9 -f -- "--data-dir $WORK/" 2>/dev/null || true
	for _ in $(seq 50); do pgrep -f -- "--data-dir $WORK/" >/dev/null || break; sleep 0.1; done
}
# The data dirs' own disks, unmounted at the end.
unmount_disks() {
	for d in test scratch; do
		if findmnt -rn "$WORK/$d" >/dev/null 2>&1; then umount "$WORK/$d" || umount -l "$WORK/$d"; fi
	done
}
mkdir -p "$WORK"
teardown
unmount_disks
rm -rf "${WORK:?}"/{bin,wrap,test,scratch,test.img,scratch.img,mnt,results,logs,summary.txt,local.config}
mkdir -p "$WORK"/{bin,wrap,test,scratch,mnt/test,mnt/scratch,results,logs}
for d in test scratch; do
	truncate -s "$DISK_SIZE" "$WORK/$d.img"
	mkfs.ext4 -q -F "$WORK/$d.img"
	mount -o loop "$WORK/$d.img" "$WORK/$d"
done
cp "$CONVERGED_BIN_DIR/converged" "$CONVERGED_BIN_DIR/mount-converged" "$WORK/bin/"
# What the summary names: the tree as it was when the binaries were taken.
tree=$(git -C "$REPO" describe --always --dirty 2>/dev/null || echo '?')
# The helpers mount(8) finds, put back as they were when the run ends.
declare -A had_helper
for h in /sbin/mount.converged /sbin/mount.fuse.converged; do
	if [ -L "$h" ]; then
		had_helper[$h]="link:$(readlink "$h")"
	elif [ -e "$h" ]; then
		mv "$h" "$WORK/saved-${h##*/}"
		had_helper[$h]="file:$WORK/saved-${h##*/}"
	else
		had_helper[$h]=""
	fi
	ln -sf "$WORK/bin/mount-converged" "$h"
done
restore_helpers() {
	for h in "${!had_helper[@]}"; do
		case "${had_helper[$h]}" in
		link:*) ln -sf "${had_helper[$h]#link:}" "$h" ;;
		file:*) mv -f "${had_helper[$h]#file:}" "$h" ;;
		*) rm -f "$h" ;;
		esac
	done
}
trap restore_helpers EXIT
trap 'exit 130' INT TERM

# The users the tests switch to.
getent group fsgqa >/dev/null || groupadd fsgqa
getent passwd fsgqa >/dev/null || useradd -m -g fsgqa fsgqa
getent group fsgqa2 >/dev/null || groupadd fsgqa2
getent passwd fsgqa2 >/dev/null || useradd -m -g fsgqa -G fsgqa2 fsgqa2
getent passwd 123456-fsgqa >/dev/null || useradd --badname -m -g fsgqa 123456-fsgqa

# xfstests compares the type `df -T` shows with $FSTYP: show `fuse` for
# `fuse.converged`, without touching the checkout.
cat >"$WORK/wrap/df" <<EOF
#!/bin/bash
set -o pipefail
$(command -v df) "\$@" | sed -e 's/ fuse\.converged / fuse /'
EOF
chmod +x "$WORK/wrap/df"

# Label both data dirs (a mount through the helper needs an identity).
for d in test scratch; do
	"$WORK/bin/converged" mount "$WORK/mnt/$d" --data-dir "$WORK/$d" >/dev/null
	"$WORK/bin/converged" umount "$WORK/mnt/$d"
done

# xfstests expects a local filesystem's defaults: device files and set-ID
# bits honoured (converged mounts nosuid,nodev unless told; mount(8) drops
# `dev` and `suid` before it calls the helper, hence the allow_ names).
cat >"$WORK/local.config" <<EOF
export FSTYP=fuse
export FUSE_SUBTYP=.converged
export TEST_DEV=converged:xfstests-test
export TEST_DIR=$WORK/mnt/test
export TEST_FS_MOUNT_OPTS="-o data_dir=$WORK/test,allow_dev,allow_suid"
export SCRATCH_DEV=converged:xfstests-scratch
export SCRATCH_MNT=$WORK/mnt/scratch
export MOUNT_OPTIONS="-o data_dir=$WORK/scratch,allow_dev,allow_suid"
export RESULT_BASE=$WORK/results
EOF

# The selection, less the excludes.
groups=()
tests=()
for a in "$@"; do
	case "$a" in
	*/*) tests+=("$a") ;;
	*) groups+=("$a") ;;
	esac
done
[ $# -gt 0 ] || groups=(quick)
list=$(
	{
		printf '%s\n' "${tests[@]+"${tests[@]}"}"
		for g in "${groups[@]+"${groups[@]}"}"; do
			awk -v g="$g" '{ for (i = 2; i <= NF; i++) if ($i == g) { print "generic/" $1; break } }' \
				"$XFS/tests/generic/group.list"
		done
	} | grep -v '^$' | sort -u
)
declare -A excluded
while read -r name _; do
	case "$name" in "" | \#*) continue ;; esac
	excluded[$name]=1
done <"$HERE/excludes"

pass=()
fail=()
notrun=()
skipped=()
total=$(wc -w <<<"$list")
started=$(date +%s)
n=0
for t in $list; do
	n=$((n + 1))
	if [ -n "${excluded[$t]:-}" ]; then
		skipped+=("$t")
		continue
	fi
	log="$WORK/logs/${t//\//_}.log"
	rc=0
	(
		cd "$XFS"
		PATH="$WORK/wrap:$PATH" HOST_OPTIONS="$WORK/local.config" \
			timeout -k 30 "$LIMIT" ./check "$t"
	) >"$log" 2>&1 </dev/null || rc=$?
	if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
		fail+=("$t (timed out after ${LIMIT}s)")
		teardown
		verdict=fail
	elif grep -q '^Not run:' "$log"; then
		notrun+=("$t")
		verdict=notrun
	elif grep -q '^Passed all' "$log"; then
		pass+=("$t")
		verdict=pass
	else
		why=$(grep -m1 -E '\[failed|output mismatch|_check_|not mounted|mismatch' "$log" | sed -e 's/^generic\/[0-9]* *//' -e 's/ *(see .*//' | cut -c1-100 || true)
		fail+=("$t${why:+ ($why)}")
		verdict=fail
	fi
	printf '[%d/%d] %-14s %s\n' "$n" "$total" "$t" "$verdict"
done
teardown
unmount_disks
elapsed=$(($(date +%s) - started))

{
	echo "xfstests $(git -C "$XFS" describe --always 2>/dev/null || echo '?') on converged $tree (binaries from $CONVERGED_BIN_DIR), $(uname -r)"
	echo "selection: ${groups[*]+-g ${groups[*]}} ${tests[*]+${tests[*]}}"
	echo "pass ${#pass[@]}, fail ${#fail[@]}, not run ${#notrun[@]}, excluded ${#skipped[@]}, of $total; $((elapsed / 60)) min $((elapsed % 60)) s"
	[ ${#fail[@]} -eq 0 ] || printf 'failed: %s\n' "${fail[@]}"
	echo "logs: $WORK/logs, results: $WORK/results"
} | tee "$WORK/summary.txt"
[ ${#fail[@]} -eq 0 ]
