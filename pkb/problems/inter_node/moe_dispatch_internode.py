"""MoE dispatch across nodes: DeepEP's internode ``dispatch`` (deepseek-ai/DeepEP ``Buffer.dispatch`` ->
``Buffer.internode_dispatch``, kernels ``notify_dispatch`` and ``dispatch`` in csrc/kernels/internode.cu),
the "normal" kernels DeepSeek-V3 uses for expert parallelism in training and prefill (DeepSeek-V3
technical report, section 3.2.2: tokens cross IB once per target node, to the GPU with the same in-node
index, then NVLink forwards them to the GPUs that host their experts).

W ranks on N nodes of G = W/N GPUs (rank r on node r // G as local rank r % G); E experts spread evenly,
rank r holds experts [r * E/W, (r+1) * E/W).

Per rank r (T_r tokens; the run's precision, bf16 by default):
  x [T_r, H]                     the rank's tokens
  topk_idx [T_r, k] int64        each token's k distinct experts, -1 for "no expert" (DeepEP allows it)
  topk_weights [T_r, k] fp32     the router's weights of those slots
  num_experts E (int); intra_group (the ranks of r's node), inter_group (the ranks of r's local rank on
  every node): pkb.problems.inter_node._common.node_groups
->  (recv_x [R, H]                   every token, of every rank, with an expert on r, once, ordered by
                                     source rank, then by its index on the source (DeepEP's order:
                                     recv_gbl_rank_prefix_sum, then channels of consecutive tokens)
     recv_topk_idx [R, k] int64      its topk_idx with r's experts made local (e - r * E/W) and every
                                     other slot -1 (DeepEP's rule)
     recv_topk_weights [R, k] fp32   its weights where recv_topk_idx >= 0, 0.0 elsewhere
     recv_src_idx [R] int32          its index on the source rank (DeepEP's handle: recv_src_idx)
     num_recv_tokens_per_rank [W] int32    R per source rank (the handle's rank prefix sum, undone)
     num_recv_tokens_per_expert [E/W] int32  tokens each local expert receives (DeepEP's
                                     num_recv_tokens_per_expert_list at expert_alignment 1))
All outputs are data movement and counts, checked exactly. Source ranks, token indices and expert
ids are distinct keys, so the order has no ties. The result is what a flat all-to-all of each token to
each rank holding one of its experts gives; the reference takes DeepEP's two hops instead:
  1. RDMA (the inter-node group): each token once to every node holding one of its experts, to the rank
     of the sender's local rank there (its own node's copy stays local), with its routing and index;
     a count exchange first (DeepEP's notify_dispatch);
  2. NVLink (the intra-node group): each forwarder sends every token it holds to the ranks of its node
     that hold one of its experts; received rows are put in (source rank, token) order.
DeepEP's internode kernels take 8 GPUs a node; the function is the same at 2 or 4.

Routing and tokens are drawn per rank from ``gen`` (nothing replicated; receivers learn their counts in
the reference's count exchange). Tests: a rank without tokens, a rank that receives nothing (skew:
its experts are never chosen, the last rank's are hot), top-1, -1 slots, top-k = E.

Cost per rank, with T tokens (the mean over ranks), row = H * bytes, and the probability that a token's
k distinct uniform experts (each slot kept with probability 1 - drop) hit a given group of g experts,
p(g) = 1 - sum_j C(g, j) C(E-g, k-j) / C(E, k) drop^j (a rank: g = E/W; a node: g = E/N):
  network_bytes = T (N-1) p(E/N) row: one copy per other node holding one of its experts, deduplicated
      per node, sent by each rank and (by symmetry) received by each, per direction;
  link_bytes = T N (G-1) p(E/W) row: over NVLink a forwarder delivers the tokens of each of the N source
      nodes (its own included) to each other rank of its node that holds one of their experts;
  hbm_bytes = T row (read x) + T W p(E/W) row (write recv_x) + 2 network_bytes (rows that cross the
      network land in the forwarder's memory and are read again to be forwarded).
Routing metadata (k expert ids and weights, the token index: 12k + 4 bytes a row, 0.7% of a bf16
7168-wide row at k = 8) is left out, as in the single-node MoE problems. Expected values under uniform
routing: the skewed test's real traffic differs; the benchmark's routing is uniform.

Benchmark: DeepSeek-V3 (hidden 7168, top-8 of 256 experts, 4096 tokens per rank, bf16). At W = 8 on 2
nodes: network 4096 * 0.9965 * 14336 B = 58.5 MB, NVLink 4096 * 2 * 3 * 0.6618 * 14336 B = 233.2 MB;
on 4 nodes: network 4096 * 3 * 0.9036 * 14336 B = 159.2 MB, NVLink 4096 * 4 * 0.6618 * 14336 B = 155.5 MB.
"""

import torch
import torch.distributed as dist

from pkb.problem import Cost, Problem, Tolerance, randn
from pkb.problems.inter_node._common import NODES, WORLD_SIZES, dtype_of, node_groups, topology_of
from pkb.problems.inter_node._deepep import (BENCHMARKS, TESTS, all_to_all_rows, draw_routing, exchange_counts,
                                             expected_traffic, grid, local_routing, token_in_rank, tokens_per_rank)


def make_inputs(case, rank, world_size, gen):
    intra_group, inter_group = node_groups(case, world_size)
    num_tokens = tokens_per_rank(case, world_size)[rank]
    x = randn(gen, num_tokens, case["hidden"], dtype=dtype_of(case))
    topk_idx, topk_weights = draw_routing(gen, num_tokens, case, world_size)
    return x, topk_idx, topk_weights, case["experts"], intra_group, inter_group


def reference(x, topk_idx, topk_weights, num_experts, intra_group, inter_group):
    num_nodes, gpus, node, local = grid(intra_group, inter_group)
    world_size, rank = num_nodes * gpus, node * gpus + local
    experts_per_rank, device = num_experts // world_size, x.device

    # Layout (DeepEP get_dispatch_layout): the ranks, and so the nodes, each token goes to.
    is_token_in_rank = token_in_rank(topk_idx, experts_per_rank, world_size)              # [T, W]
    is_token_in_node = is_token_in_rank.view(x.shape[0], num_nodes, gpus).any(dim=2)      # [T, N]

    # 1. RDMA: one copy per destination node, to the rank of this local rank there (node-major, token order).
    _, token = is_token_in_node.T.nonzero(as_tuple=True)
    send = is_token_in_node.sum(dim=0).tolist()
    recv = exchange_counts(send, inter_group, device)
    fwd_x, fwd_idx, fwd_weights, fwd_src_idx = (all_to_all_rows(t, send, recv, inter_group) for t in
                                                (x[token], topk_idx[token], topk_weights[token], token))
    source_ranks = torch.arange(num_nodes, device=device) * gpus + local
    fwd_src_rank = source_ranks.repeat_interleave(torch.tensor(recv, dtype=torch.int64, device=device))

    # 2. NVLink: the forwarder sends each token to the ranks of this node that hold one of its experts.
    in_local = token_in_rank(fwd_idx, experts_per_rank, world_size).view(sum(recv), num_nodes, gpus)[:, node]  # [R1, G]
    _, row = in_local.T.nonzero(as_tuple=True)
    send = in_local.sum(dim=0).tolist()
    recv = exchange_counts(send, intra_group, device)
    recv_x, recv_idx, recv_weights, recv_src_idx, recv_src_rank = (
        all_to_all_rows(t, send, recv, intra_group)
        for t in (fwd_x[row], fwd_idx[row], fwd_weights[row], fwd_src_idx[row], fwd_src_rank[row]))

    # Rows arrive by forwarder, then source node, then token: a stable sort by source rank gives
    # (source rank, token) order.
    order = torch.sort(recv_src_rank, stable=True).indices
    recv_topk_idx, recv_topk_weights = local_routing(recv_idx[order], recv_weights[order], rank, experts_per_rank)
    recv_src_rank = recv_src_rank[order]
    num_recv_tokens_per_rank = torch.bincount(recv_src_rank, minlength=world_size).int()
    num_recv_tokens_per_expert = torch.bincount(recv_topk_idx[recv_topk_idx >= 0], minlength=experts_per_rank).int()
    return (recv_x[order], recv_topk_idx, recv_topk_weights, recv_src_idx[order].int(), num_recv_tokens_per_rank,
            num_recv_tokens_per_expert)


def cost(case, world_size):
    nodes = topology_of(case, world_size).num_nodes
    traffic = expected_traffic(case, world_size, nodes)
    row = case["hidden"] * dtype_of(case).itemsize
    network = traffic["rows_network"] * row
    hbm = (traffic["tokens"] + traffic["rows_received"]) * row + 2 * network
    return Cost(link_bytes=traffic["rows_nvlink"] * row, network_bytes=network, hbm_bytes=hbm,
                pattern="two-hop all_to_all (dispatch): RDMA to the same local rank per node, then NVLink")


PROBLEM = Problem(
    name="moe_dispatch_internode", version=1, upstream_id=None, category="inter_node",
    source="DeepEP Buffer.dispatch / internode_dispatch (normal kernels; DeepSeek-V3 training and prefill)",
    world_sizes=WORLD_SIZES, nodes=NODES, tests=TESTS, benchmarks=BENCHMARKS, tolerance=Tolerance.exact(),
    deterministic=True, reference=reference, make_inputs=make_inputs, cost=cost,
)
