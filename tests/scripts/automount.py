#!/usr/bin/env python3
"""What systemd does for an `x-systemd.automount` fstab line, with the kernel's
autofs: put a direct autofs trigger on MOUNTPOINT and, when a process first
looks inside, run `mount -T FSTAB MOUNTPOINT` in the automounter's own
process group (as systemd runs mount units: the kernel holds every other
process at the trigger until the mount is ready), then tell the kernel the
mount is ready (or failed). Prints "armed" once the trigger is in place; SIGTERM removes it.

usage: automount.py FSTAB MOUNTPOINT
"""
import ctypes
import fcntl
import os
import signal
import struct
import subprocess
import sys

AUTOFS_IOC_READY = 0x9360
AUTOFS_IOC_FAIL = 0x9361
AUTOFS_IOC_CATATONIC = 0x9362
PACKET_MISSING_DIRECT = 5  # autofs_ptype_missing_direct (protocol 5)
PACKET_SIZE = 304  # sizeof(struct autofs_v5_packet) on x86_64 and arm64

libc = ctypes.CDLL(None, use_errno=True)


def main():
    fstab, mountpoint = sys.argv[1], sys.argv[2]
    os.setpgid(0, 0)  # the kernel never blocks this process group on the trigger
    r, w = os.pipe()
    opts = f"fd={w},pgrp={os.getpgrp()},minproto=5,maxproto=5,direct".encode()
    if libc.mount(b"systemd-1", mountpoint.encode(), b"autofs", 0, opts) != 0:
        e = ctypes.get_errno()
        sys.exit(f"mount autofs on {mountpoint}: {os.strerror(e)}")
    os.close(w)
    ioctl_fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY)

    def stop(*_):
        fcntl.ioctl(ioctl_fd, AUTOFS_IOC_CATATONIC, 0)
        os.close(ioctl_fd)
        libc.umount2(mountpoint.encode(), 2)  # MNT_DETACH
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    print("armed", flush=True)
    while True:
        pkt = os.read(r, PACKET_SIZE)
        if len(pkt) < 16:
            continue
        _proto, kind, token = struct.unpack_from("iiI", pkt)
        if kind != PACKET_MISSING_DIRECT:
            fcntl.ioctl(ioctl_fd, AUTOFS_IOC_FAIL, token)
            continue
        done = subprocess.run(["mount", "-T", fstab, mountpoint])
        print(f"automount: mount exited {done.returncode}", file=sys.stderr, flush=True)
        fcntl.ioctl(ioctl_fd, AUTOFS_IOC_READY if done.returncode == 0 else AUTOFS_IOC_FAIL, token)


main()
