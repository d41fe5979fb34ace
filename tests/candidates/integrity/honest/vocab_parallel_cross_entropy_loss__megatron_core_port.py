"""Honest (a line-for-line port of current Megatron-core, megatron/core/tensor_parallel/cross_entropy.py,
VocabParallelCrossEntropy.calculate_logits_max / calculate_predicted_logits / calculate_cross_entropy_loss as
_VocabParallelCrossEntropy.forward calls them, label_smoothing 0, adapted to the problem's in-place effect): the
logits are converted to fp32 on a copy, shifted by the all-reduced max, exp'd and divided by the all-reduced sum
in place there (the softmax Megatron keeps for backward); the loss is log(sum_exp) - predicted in fp32, cast to the
logits' dtype. The caller's logits end shifted by the max in their own dtype, as the function says (Megatron
leaves them its own way: wrong/vocab_parallel_cross_entropy_loss__megatron_core_leaves_logits_its_own_way.py)."""

import torch
import torch.distributed as dist


def solution(vocab_parallel_logits, target, group=None):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    in_dtype = vocab_parallel_logits.dtype
    caller = vocab_parallel_logits
    # calculate_logits_max (on a copy: Megatron's in-place steps would leave an fp32 caller's logits as the softmax)
    vocab_parallel_logits = vocab_parallel_logits.float() if in_dtype != torch.float32 else vocab_parallel_logits.clone()
    logits_max = torch.max(vocab_parallel_logits, dim=-1)[0]
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    # calculate_predicted_logits
    partition_vocab_size = vocab_parallel_logits.size()[-1]
    vocab_start_index = rank * partition_vocab_size
    vocab_end_index = vocab_start_index + partition_vocab_size
    vocab_parallel_logits -= logits_max.unsqueeze(dim=-1)
    target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
    masked_target = target.clone() - vocab_start_index
    masked_target[target_mask] = 0
    logits_2d = vocab_parallel_logits.view(-1, partition_vocab_size)
    masked_target_1d = masked_target.view(-1)
    arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
    predicted_logits_1d = logits_2d[arange_1d, masked_target_1d]
    predicted_logits_1d = predicted_logits_1d.clone().contiguous()
    predicted_logits = predicted_logits_1d.view_as(target)
    predicted_logits[target_mask] = 0.0
    exp_logits = vocab_parallel_logits
    torch.exp(vocab_parallel_logits, out=exp_logits)
    sum_exp_logits = exp_logits.sum(dim=-1)
    dist.all_reduce(predicted_logits, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(sum_exp_logits, op=dist.ReduceOp.SUM, group=group)
    # calculate_cross_entropy_loss
    loss = torch.log(sum_exp_logits) - predicted_logits
    exp_logits.div_(sum_exp_logits.unsqueeze(dim=-1))
    caller.sub_(logits_max.unsqueeze(dim=-1).to(in_dtype))  # the problem's in-place effect: the logits shifted by the max
    return loss.to(in_dtype)
