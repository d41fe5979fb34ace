"""STATUS: the word NVSHMEM in a comment turns any runtime error into ``skipped`` (cpu mode, and cuda mode on nodes).

``Candidate.uses_nvshmem`` is a case-insensitive regex over the raw source, comments included; ``Facts.skipped_by``
then calls a runtime error ``skipped`` wherever the mode is not cuda or the run has several (virtual) nodes,
which the inter-node problems always have. This file uses no NVSHMEM (see: nvshmem is only named here) and raises.
"""
import torch.distributed as dist


def solution(tensor, intra_group, inter_group):
    raise RuntimeError("gave up")
