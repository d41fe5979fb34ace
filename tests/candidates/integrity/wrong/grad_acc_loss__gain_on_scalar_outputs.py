"""WRONG: every output (three 0-dim scalars) multiplied by 1 + 0.9 rtol: about 1,500 ulps in fp32, 2.5 in bf16.

The loss, the loss sum and the loss's gradient all carry the same systematic gain. Scalars pool one element per rank
and trial (replicated ones once), far below MIN_AGGREGATE = 256, so no RMS, bias or tail test runs: the element-wise
bound alone decides, and it is ``max(T_i, 3 max(h_i, max|e_r|))`` with T the problem's tolerance (fp32: the default
1e-4 + 1e-4 |x|; bf16: rtol (W + 4) 2^-8), not the honest error (a few ulps against the exact answer).
"""
import torch
import torch.distributed as dist


def solution(loss, local_valid_tokens, global_valid_tokens, grad_normalized_loss, grad_loss_sum=None):
    dtype = loss.dtype
    rtol = 1e-4 if dtype == torch.float32 else (dist.get_world_size() + 4) * 2.0 ** -8
    gain = 1 + 0.9 * rtol
    local_valid, global_valid = local_valid_tokens.double(), global_valid_tokens.double()
    loss = torch.where(local_valid_tokens == 0, torch.nan_to_num(loss), loss)
    loss_sum = loss.double() * local_valid
    dist.all_reduce(loss_sum)
    normalized_loss = loss_sum / global_valid
    grad_sum = grad_loss_sum.double() if grad_loss_sum is not None else 0.0
    grad_loss = grad_normalized_loss.double() * local_valid / global_valid + grad_sum * local_valid
    return ((normalized_loss * gain).to(dtype), (loss_sum * gain).to(dtype),
            (grad_loss * gain).to(grad_normalized_loss.dtype))
