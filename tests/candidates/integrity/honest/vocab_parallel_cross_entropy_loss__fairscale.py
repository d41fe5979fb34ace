"""Honest (real library code, installed for the test only: pip install --no-deps fairscale): fairscale's
model_parallel vocab_parallel_cross_entropy (the Megatron-LM port) on a model-parallel group spanning the world.
It shifts the logits in place by the global max, as Megatron does, and computes the loss in the logits' dtype."""

import torch
import torch.distributed as dist
from fairscale.nn.model_parallel import initialize as fs_init
from fairscale.nn.model_parallel.cross_entropy import vocab_parallel_cross_entropy


def solution(vocab_parallel_logits, target, group=None):
    if not fs_init.model_parallel_is_initialized():
        fs_init.initialize_model_parallel(dist.get_world_size())
    with torch.no_grad():
        return vocab_parallel_cross_entropy(vocab_parallel_logits, target)
