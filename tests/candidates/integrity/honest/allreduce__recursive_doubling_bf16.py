"""Honest: recursive-doubling all-reduce (the classic MPI algorithm for small messages): at step k every rank
exchanges its whole buffer with rank ^ 2^k and adds, in the buffer's dtype. Floating addition is commutative, so
the two partners compute the same bits at every step and every rank ends with the same bits: a tree order
((a+b)+(c+d)) instead of the ring's."""

import torch
import torch.distributed as dist


def solution(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    out = tensor.clone()
    step = 1
    while step < world:
        partner = rank ^ step
        buf = torch.empty_like(out)
        ops = [dist.P2POp(dist.isend, out.contiguous(), partner), dist.P2POp(dist.irecv, buf, partner)]
        for r in dist.batch_isend_irecv(ops):
            r.wait()
        # lower rank's partial first, so both partners add the same operands in the same order
        out = (out + buf) if rank < partner else (buf + out)
        step *= 2
    return out
