# shellcheck shell=bash
# What the disk under test is, for a table's `disk:` line (sourced by
# metadata.sh, single-node.sh, cluster.sh and etcd-outage.sh).
#   describe_fs DIR   prints "DEVICE (FSTYPE[, journal | , no journal]) at DIR":
#                     whether an ext4 journals matters to how fast it makes
#                     files after deletions (see metadata.sh's FS)
# With LOOP and IMAGE set (metadata.sh's FS), also the loop device's backing.

describe_fs() {
    local dev type journal desc
    dev=$(df -P "$1" | awk 'NR == 2 { print $1 }')
    type=$(df -PT "$1" | awk 'NR == 2 { print $2 }')
    desc="$dev ($type"
    if [[ $type == ext4 ]]; then
        journal=$(cat "/sys/fs/ext4/${dev##*/}/journal_task" 2>/dev/null || true)
        if [[ $journal == "<none>" ]]; then desc+=", no journal"; elif [[ -n $journal ]]; then desc+=", journal"; fi
    fi
    if [[ -n ${LOOP:-} ]]; then
        desc+=", made for this run: a loop device with direct I/O over an image on $(LOOP='' describe_fs "$(dirname "$IMAGE")")"
    fi
    echo "$desc) at $1"
}
