"""Honest (an ordinary training-mode layer): the row-parallel linear written as a module forward with autograd on --
the weight shard is an nn.Parameter (requires_grad) and the all-reduce goes through torch's differentiable
functional collective (torch.distributed.nn.functional.all_reduce, Megatron's reduce_from_tensor_model_parallel
region equivalent) -- so the returned output is a non-leaf tensor that requires grad and carries a grad_fn, as any
layer's output in training does. Its values are the reference's GEMM + all-reduce."""

import torch
import torch.distributed.nn.functional as dnnf


def solution(A_local, B_local):
    weight = torch.nn.Parameter(B_local.t().contiguous())
    partial = torch.nn.functional.linear(A_local, weight)
    return dnnf.all_reduce(partial)
