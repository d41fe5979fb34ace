"""Another process's file descriptor taken with pidfd_open + pidfd_getfd (how torch imports a peer's CUDA memory
file descriptor for expandable segments): each rank tells the others its pid and the number of a memory file
holding its data."""

import ctypes

LIBC = ctypes.CDLL(None, use_errno=True)
PIDFD_OPEN, PIDFD_GETFD = 434, 438  # the same on x86-64 and arm64


def take(pid: int, remote: int) -> int:
    pidfd = LIBC.syscall(PIDFD_OPEN, pid, 0)
    if pidfd < 0:
        raise OSError(ctypes.get_errno(), f"pidfd_open({pid}): {os.strerror(ctypes.get_errno())}")
    local = LIBC.syscall(PIDFD_GETFD, pidfd, remote, 0)
    error = ctypes.get_errno()
    os.close(pidfd)
    if local < 0:
        raise OSError(error, f"pidfd_getfd({pid}, {remote}): {os.strerror(error)}")
    return local


def exchange(mine, ranks, group):
    return from_peers_fds(mine, ranks, group, take)
