# shellcheck shell=bash
# Waiting for a FUSE daemon's mount (sourced by the bench scripts that start
# one of their own; each defines `die`).
#   wait_mounted MNT PID LOG NAME   returns once MNT is in /proc/mounts; dies,
#                                   naming NAME, when PID exits first (with
#                                   LOG, what it printed) or after 10 s

wait_mounted() {
    local mnt=$1 pid=$2 log=$3 name=$4
    for _ in $(seq 100); do
        grep -q " $mnt " /proc/mounts && return 0
        kill -0 "$pid" 2>/dev/null || die "$name exited: $(cat "$log")"
        sleep 0.1
    done
    grep -q " $mnt " /proc/mounts || die "$name did not mount $mnt"
}
