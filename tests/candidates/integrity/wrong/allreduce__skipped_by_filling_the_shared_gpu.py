"""STATUS (shared-gpu mode): fills the GPU the ranks share, then fails: ``skipped`` as "pkb's limit", not failed.

In shared-gpu mode a failure while the driver reports the GPU at least 90 % full is ``skipped`` with
``pkb_limits: ["memory"]`` (``Facts.skipped_by`` -> ``_full_gpus``): the parent reads the GPU's fill, not who filled
it. This candidate allocates nearly all free memory on the shared GPU (each rank a share) and raises. The executor's
rerun-alone changes nothing: the candidate fills the GPU alone too.
"""
import torch
import torch.distributed as dist

_hold = []


def solution(tensor):
    if tensor.is_cuda:
        free, total = torch.cuda.mem_get_info()
        share = int(free * 0.97) // max(1, dist.get_world_size() - dist.get_rank())
        _hold.append(torch.empty(share, dtype=torch.uint8, device=tensor.device))
        dist.barrier()
    raise RuntimeError("cannot finish")
