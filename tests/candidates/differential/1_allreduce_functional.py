"""Functional collectives: ``torch.distributed._functional_collectives`` imports ``torch._dynamo``, which
imports Triton where it is installed. pkb's scratch directory once held a folder named ``triton`` on the
candidate's import path: where Triton is absent, ``import triton`` found it and ``torch._dynamo`` failed."""

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

EXPECTED = {"cpu": "ok", "shared-gpu": "ok", "cuda": "ok"}


def solution(tensor):
    return funcol.wait_tensor(funcol.all_reduce(tensor, "sum", dist.group.WORLD))
