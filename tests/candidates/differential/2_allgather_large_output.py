"""Big outputs: an all-gather's output is W times its input (16 MiB per rank at W = 8 on the upstream
case, sampled on the way back), and each call also writes 4 MiB to the rank's log and 64 MiB to a
temporary file (the scratch directory's size, the logs' size, and side by side the machine's disk)."""

import os
import sys

import torch
import torch.distributed as dist

EXPECTED = {"cpu": "ok", "shared-gpu": "ok", "cuda": "ok"}


def solution(tensor):
    sys.stdout.write(("." * 1023 + "\n") * 4096)
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"differential-{os.getpid()}.bin")
    with open(path, "wb") as handle:
        handle.write(bytes(64 << 20))
    os.remove(path)
    out = tensor.new_empty((dist.get_world_size(),) + tuple(tensor.shape))
    dist.all_gather_into_tensor(out, tensor.contiguous())
    return out
