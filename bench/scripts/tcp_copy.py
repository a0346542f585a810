#!/usr/bin/env python3
"""A plain TCP copy of a file over loopback, as the yardstick for the peer
transport: a sender thread pushes the file with sendfile(2), the receiver
reads it into a 1 MiB buffer and throws it away. Prints JSON: bytes, seconds.

    tcp_copy.py FILE
"""
import json
import os
import socket
import sys
import threading
import time


def main() -> None:
    path = sys.argv[1]
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            off = 0
            while off < size:
                off += os.sendfile(conn.fileno(), f.fileno(), off, size - off)
        conn.close()

    sender = threading.Thread(target=serve)
    sender.start()
    client = socket.create_connection(srv.getsockname())
    buf = memoryview(bytearray(1 << 20))
    n = 0
    t0 = time.monotonic()
    while True:
        r = client.recv_into(buf)
        if r == 0:
            break
        n += r
    seconds = time.monotonic() - t0
    sender.join()
    print(json.dumps({"bytes": n, "seconds": seconds}))


if __name__ == "__main__":
    main()
