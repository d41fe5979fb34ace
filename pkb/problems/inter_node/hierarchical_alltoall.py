"""Hierarchical (2-D) Ulysses all-to-all across nodes: DeepSpeed-Ulysses sequence parallelism spanning several
nodes, done as the two-level all-to-all of hierarchical context parallelism (Megatron-LM / TransformerEngine
``hierarchical_context_parallel_sizes`` with ``cp_comm_type="a2a+p2p"``, whose a2a level runs inside a node; the
2-D all-to-all of NCCL's PXN and DeepSpeed's hierarchical all-to-all).

The Ulysses re-layout of a query (or key, value, or any [seq, heads, dim] activation) before attention: from
sequence-sharded to head-sharded. Global q is [S, H, D]; rank r holds tokens [r*S/W, (r+1)*S/W) of every head
and ends with heads [r*H/W, (r+1)*H/W) of every token. The result is exactly that of DeepSpeed's flat
``_SeqAllToAll`` (scatter heads, gather sequence) over the W ranks, bit for bit.

Per rank: q [S/W, H, D] in the run's precision (bf16 by default), intra_group (the G ranks of its node),
inter_group (the N ranks of its local rank, one per node)  ->  [S, H/W, D] in q's dtype; q is left unchanged.
H and S must divide by W (Ulysses asserts that the heads split over the sequence-parallel ranks).

The reference goes inside the node first, then between nodes. Rank (n, g) = n*G + g sends the head chunks of
every destination (m, h) to its node peer (n, h) over NVLink (an all-to-all over intra_group, N head chunks
per peer); after it, each rank holds exactly the bytes bound for the ranks of its own local rank on every node,
so the network step is an all-to-all over inter_group: rail-aligned (each NIC talks only to the same-rail NIC
of the other nodes, as NCCL's PXN arranges), N-1 messages of S/N bytes instead of W-G messages of S/W, and it
delivers the chunks already in global token order (node, then local rank), with no copy after it. Going
between nodes first gives the same result but needs a permute at the end.

Cost per rank, with S_b = S/W * H * D * b the bytes of q (and of the output), G GPUs per node and N nodes:
- network: the (N-1)/N of q bound for ranks on other nodes must leave the node, and as much arrives; spread
  evenly over the node's G NICs that is (N-1)/N * S_b per rank per direction, whatever the algorithm.
- NVLink: the (G-1)/G of q bound for ranks of another local rank changes GPU inside a node once, before
  (as here) or after the network step: (G-1)/G * S_b on a rail-aligned network (nccl-tests all-to-all count
  over G ranks). A flat exchange over a full-bisection network could move only (G-1)/W * S_b over NVLink,
  at the price of W-G small network messages per rank.
- HBM: read S_b, write S_b.

Tests (H = heads_per_rank * W, S = seq_per_rank * W): one head per rank, odd sizes, a single token per rank,
more heads than tokens per rank, and q as a non-contiguous view (the query heads of a fused qkv output).
Benchmarks (Llama 3 config.json: 64 query / 8 KV heads for 70B, 128 / 8 for 405B, head_dim 128): the query
of Llama-3-70B at 32k and 128k tokens and of Llama-3-405B at 64k and 128k, and the KV-head tensor of
Llama-3-70B at 128k (8 heads: one or two per rank), the long-context shapes of Llama 3's context extension.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance, randn
from pkb.problems.inter_node._common import NODES, WORLD_SIZES, dtype_of, node_groups, ring_share, topology_of


def dims(case, world_size):
    """(S, H, D): the global sequence, heads and head_dim, given either globally or per rank."""
    seq = case["seq"] if "seq" in case.params else case["seq_per_rank"] * world_size
    heads = case["heads"] if "heads" in case.params else case["heads_per_rank"] * world_size
    return seq, heads, case["head_dim"]


def make_inputs(case, rank, world_size, gen):
    seq, heads, head_dim = dims(case, world_size)
    intra_group, inter_group = node_groups(case, world_size)
    if case.get("qkv_view"):  # the query heads of a fused qkv projection's output: a strided view
        q = randn(gen, seq // world_size, 3 * heads, head_dim, dtype=dtype_of(case))[:, :heads]
    else:
        q = randn(gen, seq // world_size, heads, head_dim, dtype=dtype_of(case))
    return q, intra_group, inter_group


def reference(q, intra_group, inter_group):
    local_size, num_nodes = dist.get_world_size(intra_group), dist.get_world_size(inter_group)
    world = local_size * num_nodes
    seq_local, heads, head_dim = q.shape
    assert heads % world == 0, f"{heads} heads do not split over {world} ranks"
    heads_local = heads // world
    # heads of destination rank (m, h) = m*G + h: q viewed [s, N (m), G (h), H/W, D]
    blocks = q.reshape(seq_local, num_nodes, local_size, heads_local, head_dim)
    # step 1, NVLink: to node peer h, the chunks of every (m, h): send [G (h), s, N (m), H/W, D]
    send = blocks.permute(2, 0, 1, 3, 4).contiguous()
    staged = torch.empty_like(send)  # [G (source g), s, N (m), H/W, D]
    dist.all_to_all_single(staged, send, group=intra_group)
    # step 2, network: to node m's rank of this local rank, [N (m), G (g), s, H/W, D]
    send = staged.permute(2, 0, 1, 3, 4).contiguous()
    out = torch.empty_like(send)  # [N (source node n), G (source g), s, H/W, D]: source rank n*G + g, token order
    dist.all_to_all_single(out, send, group=inter_group)
    return out.view(world * seq_local, heads_local, head_dim)


def cost(case, world_size):
    topology = topology_of(case, world_size)
    seq, heads, head_dim = dims(case, world_size)
    size = seq // world_size * heads * head_dim * dtype_of(case).itemsize
    return Cost(link_bytes=ring_share(topology.gpus_per_node) * size,
                network_bytes=ring_share(topology.num_nodes) * size,
                hbm_bytes=2 * size, pattern="hierarchical_all_to_all")


TESTS = (
    Case("one_head_per_rank", {"seq_per_rank": 3, "heads_per_rank": 1, "head_dim": 5}, tags=("odd_sizes", "tiny")),
    Case("odd", {"seq_per_rank": 5, "heads_per_rank": 3, "head_dim": 7}, tags=("odd_sizes",)),
    Case("one_token_per_rank", {"seq_per_rank": 1, "heads_per_rank": 2, "head_dim": 64}, tags=("tiny",)),
    Case("many_heads_per_rank", {"seq_per_rank": 2, "heads_per_rank": 8, "head_dim": 128}, tags=("shape_regime",),
         note="more heads per rank than tokens per rank, at the real head_dim"),
    Case("qkv_view", {"seq_per_rank": 3, "heads_per_rank": 2, "head_dim": 6, "qkv_view": True},
         tags=("layout", "odd_sizes"), note="q a non-contiguous view: the first H heads of a fused [S/W, 3H, D] qkv"),
)

BENCHMARKS = (
    Case("llama3_70b_q_32k", {"seq": 32768, "heads": 64, "head_dim": 128},
         note="Llama-3-70B query, 64 heads x 128, 32k tokens"),
    Case("llama3_70b_q_128k", {"seq": 131072, "heads": 64, "head_dim": 128},
         note="Llama-3-70B query, 64 heads x 128, 128k tokens"),
    Case("llama3_70b_kv_128k", {"seq": 131072, "heads": 8, "head_dim": 128},
         note="Llama-3-70B key or value, 8 KV heads x 128, 128k tokens"),
    Case("llama3_405b_q_64k", {"seq": 65536, "heads": 128, "head_dim": 128},
         note="Llama-3-405B query, 128 heads x 128, 64k tokens"),
    Case("llama3_405b_q_128k", {"seq": 131072, "heads": 128, "head_dim": 128},
         note="Llama-3-405B query, 128 heads x 128, 128k tokens"),
)

PROBLEM = Problem(
    name="hierarchical_alltoall", version=1, upstream_id=None, category="inter_node",
    source="DeepSpeed-Ulysses _SeqAllToAll across nodes as a 2-D all-to-all (Megatron-LM / TransformerEngine "
           "hierarchical context parallel a2a+p2p, NCCL PXN)",
    world_sizes=WORLD_SIZES, nodes=NODES, tests=TESTS, benchmarks=BENCHMARKS, tolerance=Tolerance.exact(),
    reference=reference, make_inputs=make_inputs, cost=cost,
)
