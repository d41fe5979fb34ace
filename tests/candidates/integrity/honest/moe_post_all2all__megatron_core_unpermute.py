"""Honest (real library code, installed for the test only: pip install --no-deps megatron-core): the combine with
Megatron-core's own moe_utils.unpermute (the non-fused path of its MoE token dispatchers) after the same chunk sort
and all-to-all as the reference: the returned rows times their routing probabilities and scatter-added back to
their tokens -- in the tokens' dtype, as Megatron-core does (bf16 products and a bf16 scatter_add in a bf16 run)."""

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import unpermute


def _sort_chunks(x, split_sizes, sorted_idxs):
    chunks = torch.split(x, split_sizes.tolist(), dim=0)
    return torch.cat([chunks[i] for i in sorted_idxs.tolist()], dim=0)


def solution(expert_outputs, routing_weights, selected_experts, num_experts, input_splits, output_splits,
             num_global_tokens_per_local_expert, routing_map, local_input_permutation_mapping,
             org_hidden_states_shape, group=None):
    world_size = dist.get_world_size(group)
    num_local_experts = num_experts // world_size
    hidden_dim = expert_outputs.size(-1)
    by_source_rank = torch.arange(num_local_experts * world_size).view(num_local_experts, world_size).T.ravel()
    expert_outputs = _sort_chunks(expert_outputs, num_global_tokens_per_local_expert.T.ravel(), by_source_rank)
    returned = expert_outputs.new_empty((sum(input_splits), hidden_dim))
    dist.all_to_all_single(returned, expert_outputs.contiguous(), output_split_sizes=list(input_splits),
                           input_split_sizes=list(output_splits), group=group)
    out_dtype = torch.promote_types(expert_outputs.dtype, routing_weights.dtype)
    probs = torch.zeros(routing_weights.shape[0], num_experts, dtype=routing_weights.dtype)
    probs.scatter_(1, selected_experts, routing_weights)
    out = unpermute(returned.to(out_dtype), local_input_permutation_mapping, torch.Size(org_hidden_states_shape),
                    probs=probs, routing_map=routing_map.T.contiguous())
    return out.to(out_dtype)
