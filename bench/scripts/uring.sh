# shellcheck shell=bash
# The fuse module's `enable_uring`, set while the mounts that are to serve
# FUSE over io_uring start and put back as found (a mount keeps what its
# INIT settled). Sourced by the bench scripts; each defines `die`.
#   uring_on WHAT              sets it, remembering what it was; dies,
#                              naming WHAT, where the kernel has no such switch
#   uring_back                 puts back what it was (nothing if never set)
#   serves_uring DATA_DIR WHAT dies, naming WHAT, unless the daemon holding
#                              DATA_DIR holds an io_uring

ENABLE_URING=/sys/module/fuse/parameters/enable_uring
URING_WAS=

uring_on() {
    [[ -e $ENABLE_URING ]] || die "$1: $ENABLE_URING missing (FUSE over io_uring needs Linux 6.14)"
    [[ -n $URING_WAS ]] || URING_WAS=$(cat "$ENABLE_URING")
    echo Y > "$ENABLE_URING"
}

uring_back() {
    [[ -z $URING_WAS ]] || echo "$URING_WAS" > "$ENABLE_URING"
}

serves_uring() {
    local pid
    pid=$(cat "$1/converged.lock")
    # Not `ls | grep -q` under pipefail: grep's early exit fails a long listing.
    [[ $(ls -l "/proc/$pid/fd") == *'anon_inode:[io_uring]'* ]] ||
        die "$2: the daemon serves no io_uring (see $1/converged.log)"
}
