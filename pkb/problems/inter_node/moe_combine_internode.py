"""MoE combine across nodes: DeepEP's internode ``combine`` (deepseek-ai/DeepEP ``Buffer.combine`` ->
``Buffer.internode_combine``, kernel ``combine`` in csrc/kernels/internode.cu), the reverse of
moe_dispatch_internode and the "normal" kernel DeepSeek-V3 uses in training and prefill: each token's
expert outputs are reduced inside the experts' node first, at the rank with the token's local rank,
and that one row per node goes back over RDMA to the token's rank, which adds the nodes' rows.

DeepEP's combine adds rows without weights: its caller applies the router weights on the experts' side
first (Megatron-LM's DeepEP path passes each permuted row's probability into the expert computation).
That weighting is fused in here, so the result is the MoE layer's output: for each token, the weighted
sum over its top-k experts.

W ranks on N nodes of G = W/N GPUs (rank r on node r // G as local rank r % G); E experts, rank r holds
experts [r * E/W, (r+1) * E/W). Rank r received R tokens in moe_dispatch_internode (ordered by source
rank, then token index) and holds its experts' outputs for them.

Per rank r (the run's precision, bf16 by default, for the rows):
  expert_outputs [P, H]          r's experts' outputs: one row per (received token, local expert) pair,
                                 grouped by local expert (the dispatch's num_recv_tokens_per_expert
                                 rows each, the layout a grouped GEMM reads and writes), each group in
                                 received-token order; P = (recv_topk_idx >= 0).sum()
  recv_topk_idx [R, k] int64     dispatch's: local expert ids, -1 for slots on other ranks
  recv_topk_weights [R, k] fp32  dispatch's: the router weights of the local slots, 0.0 elsewhere
  recv_src_idx [R] int32         dispatch's: each received token's index on its source rank
  num_recv_tokens_per_rank [W] int32  dispatch's: R per source rank
  is_token_in_rank [T_r, W] bool r's own tokens: whether each has an expert on each rank (DeepEP's
                                 get_dispatch_layout; the combine handle's is_combined_token_in_rank)
  intra_group (the ranks of r's node), inter_group (the ranks of r's local rank on every node)
->  combined_x [T_r, H] in expert_outputs' dtype:
      combined_x[t] = sum over the slots j of token t (on r) with an expert e_j >= 0 of
                      w_j * expert_outputs(row of (t, e_j) on e_j's rank),
    computed in fp32 and rounded once (0 for a token with no expert).
The reference (DeepEP's hops, reversed):
  0. each rank sums, per received token, its local experts' outputs times their weights (fp32);
  1. NVLink (the intra-node group): each such partial row goes to the rank of its node with the token's
     local rank, which sums the node's rows per (source node, token), in intra-node rank order;
  2. RDMA (the inter-node group): one row per (node, token) back to the token's rank, which adds the
     nodes' rows in node order and rounds.
Tolerance: a sum of k terms of magnitude up to 1 (weights in (0, 1) summing to at most 1, outputs
N(0, 1)) in any order and with roundings in the run's dtype at each hop, as DeepEP's bf16 rows are:
reduction_tolerance(dtype, k).

Inputs: the routing of every rank (experts and weights, pkb.problems.inter_node._deepep.draw_routing) is
drawn from ``gen.shared``: it is the dispatch handle's knowledge, which both ends of the combine hold
(the experts' rank its received side, the tokens' rank its own routing). The expert outputs are drawn
per rank from ``gen``. Tests: a rank without tokens, a rank whose experts receive nothing (skew), top-1,
-1 slots (tokens with no expert get zeros), top-k = E.

Cost per rank, with T tokens (the mean over ranks), row = H * bytes, and p(g) the probability that a
token's k distinct uniform experts (each slot kept with probability 1 - drop) hit a given group of g
experts, p(g) = 1 - sum_j C(g, j) C(E-g, k-j) / C(E, k) drop^j (a rank: g = E/W; a node: g = E/N):
  network_bytes = T (N-1) p(E/N) row: each token gets one pre-reduced row back from every other node that
      holds one of its experts; per direction (by symmetry each rank also sends that much);
  link_bytes = T N (G-1) p(E/W) row: a rank's partial row for each token it received goes over NVLink to
      the forwarder of its node unless it is the forwarder (the dispatch's NVLink traffic, reversed);
  flops = 2 T k (1 - drop) H: a multiply and an add per element of every (token, expert) pair;
  hbm_bytes = T k (1 - drop) row (read the expert outputs) + T row (write combined_x) + 2 network_bytes
      (rows that cross the network land in memory and are read again to be added).
The k fp32 weights per row and the routing metadata are left out. Expected values under uniform
routing: the skewed test's real traffic differs; the benchmark's routing is uniform.

Benchmark: DeepSeek-V3 (hidden 7168, top-8 of 256 experts, 4096 tokens per rank, bf16): at W = 8 on 2
nodes network 58.5 MB and NVLink 233.2 MB per rank, on 4 nodes 159.2 MB and 155.5 MB (as the dispatch);
flops 2 * 4096 * 8 * 7168 = 0.47 GFLOP.
"""

import torch
import torch.distributed as dist

from pkb.problem import Cost, Problem, randn, reduction_tolerance
from pkb.problems.inter_node._common import NODES, WORLD_SIZES, dtype_of, node_groups, topology_of
from pkb.problems.inter_node._deepep import (BENCHMARKS, KEY_SHIFT, TESTS, all_to_all_rows, draw_routing,
                                             exchange_counts, expected_traffic, grid, received_layout,
                                             token_in_rank, tokens_per_rank)


def make_inputs(case, rank, world_size, gen):
    intra_group, inter_group = node_groups(case, world_size)
    routing = [draw_routing(gen.shared, num_tokens, case, world_size)
               for num_tokens in tokens_per_rank(case, world_size)]
    experts_per_rank = case["experts"] // world_size
    recv_topk_idx, recv_topk_weights, recv_src_idx, num_recv_tokens_per_rank = received_layout(
        routing, rank, experts_per_rank)
    num_pairs = int((recv_topk_idx >= 0).sum())
    expert_outputs = randn(gen, num_pairs, case["hidden"], dtype=dtype_of(case))
    is_token_in_rank = token_in_rank(routing[rank][0], experts_per_rank, world_size)
    return (expert_outputs, recv_topk_idx, recv_topk_weights, recv_src_idx, num_recv_tokens_per_rank,
            is_token_in_rank, intra_group, inter_group)


def _weighted_local_sum(expert_outputs, recv_topk_idx, recv_topk_weights):
    """[R, H] fp32: per received token, its local experts' output rows times their weights, summed in
    slot order."""
    num_recv, top_k = recv_topk_idx.shape
    device = expert_outputs.device
    valid = recv_topk_idx >= 0
    # Row of each (token, slot) pair in expert_outputs: pairs sorted by (local expert, received token).
    rows = torch.arange(num_recv, device=device).unsqueeze(1).expand(-1, top_k)
    keys = (recv_topk_idx * num_recv + rows)[valid]
    position = torch.empty_like(keys)
    position[torch.argsort(keys)] = torch.arange(keys.numel(), device=device)
    pair_row = torch.full_like(recv_topk_idx, -1)
    pair_row[valid] = position
    partial = torch.zeros(num_recv, expert_outputs.shape[1], dtype=torch.float32, device=device)
    for slot in range(top_k):
        take = valid[:, slot]
        partial[take] += recv_topk_weights[take, slot].unsqueeze(1) * expert_outputs[pair_row[take, slot]].float()
    return partial


def reference(expert_outputs, recv_topk_idx, recv_topk_weights, recv_src_idx, num_recv_tokens_per_rank,
              is_token_in_rank, intra_group, inter_group):
    num_nodes, gpus, _, _ = grid(intra_group, inter_group)
    device, hidden = expert_outputs.device, expert_outputs.shape[1]

    # 0. This rank's experts: each received token's weighted sum over its local experts.
    partial = _weighted_local_sum(expert_outputs, recv_topk_idx, recv_topk_weights)
    src_rank = torch.arange(num_nodes * gpus, device=device).repeat_interleave(num_recv_tokens_per_rank.long())

    # 1. NVLink: each partial row to the forwarder, the rank of this node with its source's local rank.
    forwarder = src_rank % gpus
    order = torch.sort(forwarder, stable=True).indices
    send = torch.bincount(forwarder, minlength=gpus).tolist()
    recv = exchange_counts(send, intra_group, device)
    rows = all_to_all_rows(partial[order], send, recv, intra_group)
    keys = ((src_rank // gpus) << KEY_SHIFT) + recv_src_idx.long()       # (source node, token)
    keys = all_to_all_rows(keys[order], send, recv, intra_group)
    # The forwarder sums its node's rows per (source node, token), in intra-node rank order.
    unique_keys, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    reduced = torch.zeros(unique_keys.numel(), hidden, dtype=torch.float32, device=device)
    for chunk_inverse, chunk_rows in zip(inverse.split(recv), rows.split(recv)):
        reduced.index_add_(0, chunk_inverse, chunk_rows)   # a key at most once per source rank: no collisions

    # 2. RDMA: one row per (node, token) back to the token's rank; it expects one row per token from each
    #    node holding one of its experts, in token order.
    send = torch.bincount(unique_keys >> KEY_SHIFT, minlength=num_nodes).tolist()
    is_token_in_node = is_token_in_rank.view(is_token_in_rank.shape[0], num_nodes, gpus).any(dim=2)  # [T, N]
    recv = is_token_in_node.sum(dim=0).tolist()
    returned = all_to_all_rows(reduced, send, recv, inter_group)
    combined = torch.zeros(is_token_in_rank.shape[0], hidden, dtype=torch.float32, device=device)
    for node, chunk in enumerate(returned.split(recv)):
        combined.index_add_(0, is_token_in_node[:, node].nonzero().view(-1), chunk)
    return combined.to(expert_outputs.dtype)


def cost(case, world_size):
    nodes = topology_of(case, world_size).num_nodes
    traffic = expected_traffic(case, world_size, nodes)
    row = case["hidden"] * dtype_of(case).itemsize
    network = traffic["rows_network"] * row
    hbm = (traffic["pairs"] + traffic["tokens"]) * row + 2 * network
    return Cost(link_bytes=traffic["rows_nvlink"] * row, network_bytes=network,
                flops=2 * traffic["pairs"] * case["hidden"], hbm_bytes=hbm,
                pattern="two-hop reduce (combine): NVLink to the same local rank, then RDMA back")


def tolerance(case, world_size):
    return reduction_tolerance(dtype_of(case), case["top_k"])


PROBLEM = Problem(
    name="moe_combine_internode", version=1, upstream_id=None, category="inter_node",
    source="DeepEP Buffer.combine / internode_combine (normal kernels; DeepSeek-V3 training and prefill), "
           "with the router weights applied on the experts' side, as Megatron-LM's DeepEP path does",
    world_sizes=WORLD_SIZES, nodes=NODES, tests=TESTS, benchmarks=BENCHMARKS, tolerance=tolerance,
    reference=reference, make_inputs=make_inputs, cost=cost,
)
