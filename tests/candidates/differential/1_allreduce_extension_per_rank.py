"""One extension per rank: each rank builds its own (``..._r{rank}``: W builds of different sources at
once, eight at W = 8). pkb's build broker once refused the third ("more than 2 extensions of different
sources built at once by one evaluation"); builds beyond what the machine runs at once must wait."""

import torch.distributed as dist

from pkb.kernels import load_cuda

EXPECTED = {"cpu": "ok", "shared-gpu": "ok", "cuda": "ok"}
SOURCE = "torch::Tensor copy_of(torch::Tensor x) {{ return x.clone(); }}  // built by rank {rank}"
_extension = None


def solution(tensor):
    global _extension
    if _extension is None:
        rank = dist.get_rank()
        _extension = load_cuda(f"differential_copy_r{rank}", [], cpp_sources=SOURCE.format(rank=rank),
                               functions=["copy_of"], with_cuda=False)
    out = _extension.copy_of(tensor)
    dist.all_reduce(out)
    return out
