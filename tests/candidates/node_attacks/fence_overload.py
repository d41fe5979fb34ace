"""A fused op reached through its overload, ``torch.ops.symm_mem.one_shot_all_reduce.default``, not its packet."""


def exchange(mine, ranks, group):
    attempt(lambda: torch.ops.symm_mem.one_shot_all_reduce.default(symmetric(16, mine.device), "sum",
                                                                   group.group_name))
    return through_dist(mine, ranks, group)
