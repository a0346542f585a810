# shellcheck shell=bash
# Keeping a table of record (sourced by the bench scripts that take SAVE=1).
#   save_result NAME FILE   copies FILE to bench/results/NAME-<date>.txt and
#                           says where

save_result() {
    local dir dest
    dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/results"
    mkdir -p "$dir"
    dest="$dir/$1-$(date +%Y-%m-%d-%H%M%S).txt"
    cp "$2" "$dest"
    echo "saved to $dest"
}
