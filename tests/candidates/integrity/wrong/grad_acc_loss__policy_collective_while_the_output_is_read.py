"""POLICY: the stock all-reduce runs while the harness reads the outputs, after the call's window has closed.

``solution`` returns a tuple subclass that holds nothing yet; its ``__iter__`` (what the rank's ``to_plain`` does to
a tuple, outside ``Worker.call``'s window) computes the reference's answer with ``dist.all_reduce``. The recorder
named calls only inside the call's window, and the world group's sequence number, which the call moved, is the one
group it does not compare between windows (the harness's own barrier moves it there): ``ok`` with
``collectives_used`` empty. Expected under ``--policy forbid-collectives``: ``forbidden`` (the outputs are read
inside a window of their own).
"""
import torch
import torch.distributed as dist


def _answer(loss, local_valid_tokens, global_valid_tokens, grad_normalized_loss, grad_loss_sum=None):
    local_valid, global_valid = local_valid_tokens.float(), global_valid_tokens.float()
    loss = torch.where(local_valid_tokens == 0, torch.nan_to_num(loss), loss)
    loss_sum = loss.float() * local_valid
    dist.all_reduce(loss_sum)
    normalized_loss = loss_sum / global_valid
    grad_sum = grad_loss_sum.float() if grad_loss_sum is not None else 0.0
    grad_loss = grad_normalized_loss.float() * local_valid / global_valid + grad_sum * local_valid
    return normalized_loss.to(loss.dtype), loss_sum.to(loss.dtype), grad_loss.to(grad_normalized_loss.dtype)


class _Later(tuple):
    def __iter__(self):
        return iter(_answer(*self.arguments))


def solution(loss, local_valid_tokens, global_valid_tokens, grad_normalized_loss, grad_loss_sum=None):
    later = _Later((None, None, None))
    later.arguments = (loss, local_valid_tokens, global_valid_tokens, grad_normalized_loss, grad_loss_sum)
    return later
