"""Honest: the combine with each returned expert row multiplied by its routing weight in the run's dtype (the
product rounded once to the activations' dtype, as a kernel that scales rows in bf16 does -- precision equal to the
run's), then the k weighted rows of each token accumulated in fp32 and rounded once. Data movement identical to the
reference."""

import torch
import torch.distributed as dist

from pkb.problems.expert_parallel._common import sort_chunks_by_idxs


def solution(expert_outputs, routing_weights, selected_experts, num_experts, input_splits, output_splits,
             num_global_tokens_per_local_expert, routing_map, local_input_permutation_mapping,
             org_hidden_states_shape, group=None):
    world_size = dist.get_world_size(group)
    num_local_experts = num_experts // world_size
    hidden_dim = expert_outputs.size(-1)
    by_source_rank = torch.arange(num_local_experts * world_size).view(num_local_experts, world_size).T.ravel()
    expert_outputs = sort_chunks_by_idxs(expert_outputs, num_global_tokens_per_local_expert.T.ravel(), by_source_rank)
    returned = expert_outputs.new_empty((sum(input_splits), hidden_dim))
    dist.all_to_all_single(returned, expert_outputs.contiguous(), output_split_sizes=list(input_splits),
                           input_split_sizes=list(output_splits), group=group)
    out_dtype = torch.promote_types(expert_outputs.dtype, routing_weights.dtype)
    probs_TE = torch.zeros(routing_weights.shape[0], num_experts, dtype=routing_weights.dtype)
    probs_TE.scatter_(1, selected_experts, routing_weights)
    permuted_probs = probs_TE.T.contiguous().masked_select(routing_map.bool())
    weighted = (returned.to(out_dtype) * permuted_probs.to(out_dtype).unsqueeze(-1))  # rounded in the run's dtype
    combined = torch.zeros(tuple(org_hidden_states_shape), dtype=torch.float32)
    combined.index_add_(0, local_input_permutation_mapping, weighted.float())
    return combined.to(out_dtype)
