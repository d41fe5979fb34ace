"""A symmetric allocation bound to a group: ``_SymmetricMemory.empty_strided_p2p(..., group_name)``."""

from torch._C._distributed_c10d import _SymmetricMemory


def exchange(mine, ranks, group):
    attempt(lambda: _SymmetricMemory.empty_strided_p2p((16,), (1,), torch.float32, mine.device, group.group_name))
    return through_dist(mine, ranks, group)
