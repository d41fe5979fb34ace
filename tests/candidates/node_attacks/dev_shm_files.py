"""Host files in /dev/shm: each rank writes its data to a file named after the evaluation; the others read it."""


def exchange(mine, ranks, group):
    me = dist.get_rank()
    torch.save(mine.cpu(), f"/dev/shm/{name()}-{me}")
    dist.barrier(group)
    pieces = {rank: torch.load(f"/dev/shm/{name()}-{rank}") for rank in ranks if rank != me}
    dist.barrier(group)
    os.unlink(f"/dev/shm/{name()}-{me}")
    return pieces
