"""symm_mem.rendezvous through the ``__wrapped__`` a decorator leaves on its wrapper (where there is one)."""

import torch.distributed._symmetric_memory as symm_mem


def exchange(mine, ranks, group):
    rendezvous = getattr(symm_mem.rendezvous, "__wrapped__", symm_mem.rendezvous)
    attempt(lambda: rendezvous(symmetric(16, mine.device), group.group_name))
    return through_dist(mine, ranks, group)
