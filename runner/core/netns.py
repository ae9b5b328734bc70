"""A private network for this process and its children: a new network namespace, loopback only.

`python -m runner.launch` starts its workers from such a process. TensorFlow's gRPC server
listens on every interface whatever address TF_CONFIG gives (seen with `ss -ltnp`: `*:<port>`),
and its distributed runtime has no authentication (tensorflow/tensorflow#11689: "designed to
run on private networks"): anyone who reaches the machine could send those servers graph
operations, file reads and writes among them. In a namespace of their own the workers still
reach each other on 127.0.0.1, and nothing outside it reaches them.

An unprivileged user may create a network namespace inside a user namespace of its own
(`unshare -rn` does the same). The user namespace maps the user's uid and gid to themselves,
so files the workers write keep their owner. It maps no other id (that takes CAP_SETUID in
the parent namespace, which a process gives up by entering the new one): run as root, the
workers lose root's rights over files owned by other users. Python 3.11 has no os.unshare:
libc's is called through ctypes. TensorFlow-free, and nothing but the standard library.
"""

import ctypes
import errno
import fcntl
import os
import socket
import struct
import sys

# linux/sched.h, linux/sockios.h, net/if.h
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
IFREQ = "16sH22x"  # struct ifreq on 64-bit Linux: the name, then a union of 24 bytes


class IsolationError(Exception):
    """This process could not be moved into a private network namespace; the message says why."""


def _threads() -> int:
    """This process's threads, the C ones too (threading.active_count sees Python's only)."""
    return len(os.listdir("/proc/self/task"))


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _loopback_up() -> None:
    """Bring `lo` up: a new namespace's loopback exists but is down. This process holds
    CAP_NET_ADMIN in its new namespace until it execs (user_namespaces(7))."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack(IFREQ, b"lo", 0)
        flags = struct.unpack(IFREQ, fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack(IFREQ, b"lo", flags | IFF_UP))


def enter_private_network() -> None:
    """Move this process into a new user and network namespace whose only interface is
    loopback, up; every process it starts afterwards inherits them. Raise IsolationError (one
    line) where the system does not allow it. Call it before any thread starts: the kernel
    refuses a new user namespace to a process with several threads (unshare(2): EINVAL)."""
    if sys.platform != "linux":
        raise IsolationError(f"network namespaces are Linux's; this is {sys.platform}")
    threads = _threads()
    if threads > 1:
        raise IsolationError(f"this process already runs {threads} threads (unshare needs one)")
    uid, gid = os.getuid(), os.getgid()  # read before: unmapped, they read as 65534 after
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        why = {
            errno.EPERM: "user namespaces are disabled for unprivileged users here",
            errno.ENOSPC: "the system allows no more user namespaces (user.max_user_namespaces)",
            errno.EINVAL: "the kernel refused it (no user or network namespaces built in?)",
        }.get(code, os.strerror(code))
        raise IsolationError(f"unshare(CLONE_NEWUSER | CLONE_NEWNET) failed: {why}")
    try:
        # An unprivileged process must give up setgroups before it may write a gid_map.
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
        _loopback_up()
    except OSError as err:
        raise IsolationError(f"setting up the new namespace failed: {err}") from None
