"""Honest (a port of the real library): OpenCLIP's SigLipLoss forward with world_size > 1 and bidir=True: the
own-block loss first, then the text features passed around the ring in both directions with neighbour exchange
(send/recv), adding the negative-only loss of every other rank's block; logits as a GEMM in the features' dtype
(fp32 accumulation, as under autocast), the log-sigmoid terms and the running total in fp32, the total divided by
the batch and rounded once. Same terms as the reference's all-gather, summed block by block in ring order."""

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _loss(image_features, text_features, logit_scale, logit_bias, negative_only):
    logits = logit_scale * (image_features @ text_features.T).float() + logit_bias
    labels = -torch.ones_like(logits)
    if not negative_only:
        labels = labels + 2 * torch.eye(logits.shape[0], dtype=logits.dtype)
    return -F.logsigmoid(labels * logits).sum()


def _exchange(to_rank, from_rank, tensor):
    recv = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), to_rank), dist.P2POp(dist.irecv, recv, from_rank)]
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    return recv


def _exchange_bidir(left, right, to_left, to_right):
    from_left, from_right = torch.empty_like(to_right), torch.empty_like(to_left)
    ops = [dist.P2POp(dist.isend, to_left.contiguous(), left), dist.P2POp(dist.isend, to_right.contiguous(), right),
           dist.P2POp(dist.irecv, from_left, left), dist.P2POp(dist.irecv, from_right, right)]
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    return from_right, from_left


def solution(image_features, text_features, logit_scale, logit_bias=0.0, group=None):
    world, rank = dist.get_world_size(), dist.get_rank()
    batch = image_features.shape[0]
    loss = _loss(image_features, text_features, logit_scale, logit_bias, negative_only=False)
    right, left = (rank + 1) % world, (rank - 1 + world) % world
    text_to_right = text_to_left = text_features
    num_bidir, remainder = divmod(world - 1, 2)
    for _ in range(num_bidir):
        text_from_right, text_from_left = _exchange_bidir(left, right, text_to_left, text_to_right)
        for f in (text_from_right, text_from_left):
            loss = loss + _loss(image_features, f, logit_scale, logit_bias, negative_only=True)
        text_to_left, text_to_right = text_from_right, text_from_left
    if remainder:
        text_from_left = _exchange(right, left, text_to_right)
        loss = loss + _loss(image_features, text_from_left, logit_scale, logit_bias, negative_only=True)
    return (loss / batch).to(image_features.dtype)
