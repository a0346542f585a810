# A one-member etcd for a benchmark, on free loopback ports (sourced by
# etcd-size.sh and control-plane.sh).
#   start_etcd DATA_DIR   starts it, waits until it answers; sets ETCD_CLIENT (host:port) and ETCD_PID
#   stop_etcd             stops it (nothing when none runs)
# Needs ETCD (the server binary) set.

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

start_etcd() {
    local dir=$1 client peer
    client=$(free_port)
    peer=$(free_port)
    rm -rf "$dir"
    "$ETCD" --data-dir "$dir" --listen-client-urls "http://127.0.0.1:$client" \
        --advertise-client-urls "http://127.0.0.1:$client" --listen-peer-urls "http://127.0.0.1:$peer" \
        --initial-advertise-peer-urls "http://127.0.0.1:$peer" --initial-cluster "default=http://127.0.0.1:$peer" \
        > "$dir.log" 2>&1 &
    ETCD_PID=$!
    ETCD_CLIENT=127.0.0.1:$client
    for _ in $(seq 50); do
        curl -sf "http://$ETCD_CLIENT/health" > /dev/null && return 0
        sleep 0.2
    done
    echo "etcd did not answer at $ETCD_CLIENT; its log: $dir.log" >&2
    return 1
}

stop_etcd() {
    if [[ -n ${ETCD_PID:-} ]]; then
        kill "$ETCD_PID" 2>/dev/null || true
        wait "$ETCD_PID" 2>/dev/null || true
    fi
    ETCD_PID=
}
