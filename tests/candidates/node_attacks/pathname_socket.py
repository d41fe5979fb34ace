"""A memory file passed over a unix socket bound in the rank's own temporary directory, opened to every user
(mode 0777, its folders 0755); the others learn its path and send to it."""

import tempfile


def exchange(mine, ranks, group):
    folder = tempfile.gettempdir()
    path = os.path.join(folder, f"{name()}-{dist.get_rank()}.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as channel:
        channel.bind(path)
        os.chmod(path, 0o777)
        for directory in (folder, os.path.dirname(folder)):
            os.chmod(directory, 0o755)
        fd = memfd_with(mine)
        pieces = swap_fds(channel, fd, mine, gather_metadata(path, ranks, group))
        os.close(fd)
        dist.barrier(group)
    os.unlink(path)
    return pieces
