"""``torch.compile``: inductor writes its caches under the temporary directory, compiles C++ (CPU) or
Triton (GPU) code, and walks every ``torch.ops`` namespace, where pkb's call recorder once left plain
functions in place of op packets and broke it."""

import torch
import torch.distributed as dist

EXPECTED = {"cpu": "ok", "shared-gpu": "ok", "cuda": "ok"}


@torch.compile(dynamic=False)
def _copy(x):
    return (x.float() * 1.0).to(x.dtype)


def solution(tensor):
    out = _copy(tensor)
    dist.all_reduce(out)
    return out
