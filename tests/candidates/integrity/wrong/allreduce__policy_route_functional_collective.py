"""POLICY route: ``torch.distributed._functional_collectives.all_reduce`` (the traceable functional collective, as
``torch.compile`` and DTensor issue it). Expected under ``--policy forbid-collectives``: ``forbidden``
(``functional.all_reduce``, and the operator it calls, ``functional_op.all_reduce``)."""
import torch.distributed as dist
import torch.distributed._functional_collectives as functional


def solution(tensor):
    return functional.wait_tensor(functional.all_reduce(tensor, "sum", dist.group.WORLD))
