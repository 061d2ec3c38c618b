"""A network namespace of the test session's own whose loopback has a 16 KiB MTU (tests/conftest.py enters it).

Why: the multi-process tests join their processes with gloo over 127.0.0.1, and Linux's loopback (MTU 64 KiB) moves
gloo's messages one 64 KiB segment at a time, each waiting for the receiver's 40 ms delayed ACK: a train step of
2 processes x 2 devices of the tiny model took 24 s, not ~1 s. With lo's MTU at 16384 several segments are in flight
and the step took 1.2 s, with identical losses (measured 2026-12, jax 0.10.2, the 2-core CI machine). Everything
the tests talk to is on loopback (the processes they start, the coordinator, the local S3 server); nothing in the
tests needs the outside network, which the private namespace does not have.

Entering needs CAP_SYS_ADMIN (root in CI); where it is not permitted the session stays in the machine's namespace,
slower but with the same results."""

import ctypes
import fcntl
import os
import socket
import struct

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, SIOCSIFMTU = 0x8913, 0x8914, 0x8922
IFF_UP = 0x1
MTU = 16384


def enter(mtu: int = MTU) -> bool:
    """Moves this process (and every thread and process it starts later) into a new network namespace with lo up at
    `mtu`; True where it did. Call before any thread starts: a namespace change applies to the calling thread only.
    Any failure leaves the process in the namespace it had."""
    if os.environ.get("CLIP_JAX_TESTS_PRIVATE_LOOPBACK") == "0" or _threads() != 1:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        original = os.open("/proc/self/ns/net", os.O_RDONLY)
    except OSError:
        return False
    try:
        if libc.unshare(CLONE_NEWNET) != 0:
            return False  # not permitted (no CAP_SYS_ADMIN, a seccomp filter): keep the machine's namespace
        try:
            _loopback_up(mtu)
            _check_loopback()
        except OSError:
            if libc.setns(original, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "cannot return to the original network namespace")
            return False
        return True
    finally:
        os.close(original)


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _loopback_up(mtu: int):
    """`ip link set lo up mtu MTU`, as ioctls (no dependency on iproute2)."""
    name = b"lo".ljust(16, b"\0")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        (flags,) = struct.unpack_from("h", fcntl.ioctl(s, SIOCGIFFLAGS, name + bytes(24)), 16)
        fcntl.ioctl(s, SIOCSIFFLAGS, name + struct.pack("h", flags | IFF_UP) + bytes(22))
        fcntl.ioctl(s, SIOCSIFMTU, name + struct.pack("i", mtu) + bytes(20))


def _check_loopback():
    """A TCP connection to 127.0.0.1 carries bytes, or OSError."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname(), timeout=5) as client:
            peer, _ = server.accept()
            with peer:
                client.sendall(b"ping")
                if peer.recv(4) != b"ping":
                    raise OSError("loopback carried no data")
