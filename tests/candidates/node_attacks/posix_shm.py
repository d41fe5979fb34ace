"""A POSIX shared-memory segment per rank (shm_open, as multiprocessing.shared_memory): the others map it by name."""

import mmap

import _posixshmem


def exchange(mine, ranks, group):
    me = dist.get_rank()
    data = mine.cpu().numpy().tobytes()
    fd = _posixshmem.shm_open(f"/{name()}-{me}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)
    os.fchmod(fd, 0o666)
    os.ftruncate(fd, len(data))
    with mmap.mmap(fd, len(data)) as segment:
        segment[:] = data
    os.close(fd)
    dist.barrier(group)
    pieces = {}
    for rank in ranks:
        if rank != me:
            peer = _posixshmem.shm_open(f"/{name()}-{rank}", os.O_RDONLY, 0)
            with mmap.mmap(peer, len(data), prot=mmap.PROT_READ) as segment:
                pieces[rank] = torch.frombuffer(bytearray(segment[:]), dtype=mine.dtype)
            os.close(peer)
    dist.barrier(group)
    _posixshmem.shm_unlink(f"/{name()}-{me}")
    return pieces
