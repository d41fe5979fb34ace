"""Distributed multi-hop neighbour sampling (PyG ``torch_geometric.distributed.DistNeighborSampler``):
the graph's nodes are partitioned over the ranks, each rank holds the adjacency of its own nodes,
and every rank samples a subgraph around its own seed nodes by asking the owners of the frontier
nodes for sampled neighbours, hop by hop.

Per rank: seed_nodes [S_r] int64 (distinct; S_r differs per rank, may be 0), fanouts (list of ints,
one per hop), local_adj_row_ptr [n_r + 1] int64 and local_adj_col [e_r] int64 (CSR of this rank's
nodes, in increasing global id, neighbours as global ids), node_to_rank [N] int64 (the partition,
the same on every rank), group=None, replace=False
  ->  (node [n] int64, row [m] int64, col [m] int64, edge_ids [m] int64), PyG's SamplerOutput layout:
      node = the seeds, then every newly reached node in order of first appearance; for each sampled
      edge, row = the label (index in node) of the neighbour, col = the label of the frontier node it
      was sampled for; edge_ids = global edge id. Edges are ordered by hop, then frontier node (in node
      order), then CSR position. Hop h samples the nodes first reached in hop h-1 (hop 0: the seeds).

Deterministic sampling (upstream took the first k neighbours; pkb draws a fixed pseudo-random sample
so every honest kernel can match it exactly):
  global edge id of rank r's local edge j = (e_0 + ... + e_{r-1}) + j;
  key(edge, hop) = (edge_id * 48271 + hop * 12345 + 1) mod (2^31 - 1) (distinct for distinct edges);
  replace=False: a node with degree <= k keeps all its edges, otherwise the k with the smallest keys,
  listed in CSR order; replace=True: draw d (d = 0..k-1, in that order) takes the neighbour at CSR
  position ((node * 48271 + d * 69621 + hop * 12345 + 1) mod (2^31 - 1)) mod degree.

Cost (an upper bound: no deduplication, every node has at least k neighbours): hop h has
F_h = S * prod(fanouts[:h]) frontier nodes; each request is 8 bytes out and 8 + 16*k_h back (count,
neighbour ids and edge ids), (W-1)/W of them to other ranks: link = sum_h (W-1)/W * F_h * (16 + 16*k_h).
HBM: reading the frontier's adjacency (mean degree d, 8-byte ids) and writing the samples:
sum_h F_h * (16*d + 32*k_h).

Benchmarks: ogbn-products (2,449,029 nodes, 61,859,140 undirected edges = 123.7M directed, mean degree
~50.5) with GraphSAGE's fanouts (15, 10, 5) and 1024 seeds per rank; ogbn-papers100M sampled down to
20M nodes with its mean degree (~14.5 directed) and fanouts (15, 10), 1024 seeds per rank.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem
from pkb.problems.beyond_llm._common import all_gather_sizes, all_to_all_rows, exchange_counts, skewed_counts

_PRIME = 2147483647


def make_inputs(case, rank, world_size, gen):
    num_nodes, mean_degree = case["num_nodes"], case["mean_degree"]
    shared = gen.shared
    uniform = torch.rand(num_nodes, generator=shared, device=gen.device).clamp_min(1e-12)
    degree = torch.floor(-torch.log(uniform) * mean_degree).to(torch.int64)  # exponential: hubs and isolated nodes
    row_ptr = torch.zeros(num_nodes + 1, dtype=torch.int64, device=gen.device)
    row_ptr[1:] = degree.cumsum(0)
    col = torch.randint(0, num_nodes, (int(row_ptr[-1]),), generator=shared, device=gen.device)
    weights = torch.rand(world_size, generator=shared, device=gen.device) + 0.2  # uneven partition sizes
    node_to_rank = torch.multinomial(weights, num_nodes, replacement=True, generator=shared)
    owned = (node_to_rank == rank).nonzero().squeeze(1)
    local_degree = degree[owned]
    local_adj_row_ptr = torch.zeros(owned.numel() + 1, dtype=torch.int64, device=gen.device)
    local_adj_row_ptr[1:] = local_degree.cumsum(0)
    starts = row_ptr[owned].repeat_interleave(local_degree)
    within = torch.arange(int(local_adj_row_ptr[-1]), device=gen.device) - \
        local_adj_row_ptr[:-1].repeat_interleave(local_degree)
    local_adj_col = col[starts + within]
    num_seeds = skewed_counts(shared, world_size, case["seeds_per_rank"] * world_size, case.get("num_empty", 0))[rank]
    seed_nodes = torch.randperm(num_nodes, generator=gen, device=gen.device)[:num_seeds]
    return (seed_nodes, list(case["fanouts"]), local_adj_row_ptr, local_adj_col, node_to_rank, None,
            case.get("replace", False))


def _sample_owned(requested, fanout, hop, row_ptr, adj_col, local_row_of, edge_base, replace):
    """For each requested node (owned here): (count per request, neighbour ids, edge ids), request-major."""
    device = requested.device
    num_local = row_ptr.numel() - 1
    rows = local_row_of[requested].clamp(0, max(num_local - 1, 0))  # the clamp only guards a broken exchange
    start = row_ptr[rows] if num_local else torch.zeros_like(requested)
    degree = (row_ptr[rows + 1] - start) if num_local else torch.zeros_like(requested)
    if replace:
        counts = torch.where(degree > 0, fanout, 0)
        request_of = torch.arange(requested.numel(), device=device).repeat_interleave(counts)
        draw = torch.arange(int(counts.sum()), device=device) - (counts.cumsum(0) - counts).repeat_interleave(counts)
        key = (requested[request_of] * 48271 + draw * 69621 + hop * 12345 + 1) % _PRIME
        position = start[request_of] + key % degree[request_of]
    else:
        request_of = torch.arange(requested.numel(), device=device).repeat_interleave(degree)
        position = start[request_of] + torch.arange(int(degree.sum()), device=device) - \
            (degree.cumsum(0) - degree).repeat_interleave(degree)
        key = ((edge_base + position) * 48271 + hop * 12345 + 1) % _PRIME
        by_key = torch.argsort(request_of * _PRIME + key)  # within each request, smallest key first
        first_of_request = (degree.cumsum(0) - degree).repeat_interleave(degree)
        rank_in_request = torch.empty_like(by_key)
        rank_in_request[by_key] = torch.arange(by_key.numel(), device=device) - first_of_request
        keep = rank_in_request < fanout  # positions stay in CSR order
        request_of, position = request_of[keep], position[keep]
        counts = torch.clamp(degree, max=fanout)
    return counts, adj_col[position], edge_base + position


def reference(seed_nodes, fanouts, local_adj_row_ptr, local_adj_col, node_to_rank, group=None, replace=False):
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    device = seed_nodes.device
    edge_base = sum(all_gather_sizes(local_adj_col.numel(), device, group)[:rank])
    local_row_of = torch.cumsum(node_to_rank == rank, 0) - 1
    nodes, frontier_start = seed_nodes, 0
    rows, cols, edge_ids = [], [], []
    for hop, fanout in enumerate(fanouts):
        frontier = nodes[frontier_start:]
        owner = node_to_rank[frontier]
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=world_size).tolist()
        recv_counts = exchange_counts(send_counts, device, group)
        requested = all_to_all_rows(frontier[order], send_counts, recv_counts, group)
        counts, neighbours, edges = _sample_owned(requested, fanout, hop, local_adj_row_ptr, local_adj_col,
                                                  local_row_of, edge_base, replace)
        # Answers go back in request order: counts first, then (neighbour, edge id) pairs.
        got_counts = all_to_all_rows(counts, recv_counts, send_counts, group)
        answer_sizes = torch.zeros(world_size, dtype=torch.int64, device=device).index_add_(
            0, torch.arange(world_size, device=device).repeat_interleave(torch.tensor(recv_counts, device=device)),
            counts).tolist()
        got_sizes = torch.zeros(world_size, dtype=torch.int64, device=device).index_add_(
            0, torch.arange(world_size, device=device).repeat_interleave(torch.tensor(send_counts, device=device)),
            got_counts).tolist()
        got = all_to_all_rows(torch.stack([neighbours, edges], dim=1), answer_sizes, got_sizes, group)
        # Back to frontier order (a stable sort of the answers by the frontier position they belong to).
        frontier_of = order.repeat_interleave(got_counts)
        back = torch.argsort(frontier_of, stable=True)
        frontier_of, got = frontier_of[back], got[back]
        # Relabel: existing nodes keep their labels, new ones are numbered by first appearance.
        combined = torch.cat([nodes, got[:, 0]])
        unique, inverse = torch.unique(combined, return_inverse=True)
        first = torch.full((unique.numel(),), combined.numel(), dtype=torch.int64, device=device).scatter_reduce_(
            0, inverse, torch.arange(combined.numel(), device=device), reduce="amin")
        by_first = torch.argsort(first)
        label = torch.empty_like(by_first)
        label[by_first] = torch.arange(by_first.numel(), device=device)
        rows.append(label[inverse[nodes.numel():]])
        cols.append(frontier_start + frontier_of)
        edge_ids.append(got[:, 1])
        frontier_start = nodes.numel()
        nodes = unique[by_first]
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return nodes, torch.cat(rows or [empty]), torch.cat(cols or [empty]), torch.cat(edge_ids or [empty])


def cost(case, world_size):
    frontier, link, hbm = float(case["seeds_per_rank"]), 0.0, 0.0
    for fanout in case["fanouts"]:
        link += (world_size - 1) / world_size * frontier * (16 + 16 * fanout)
        hbm += frontier * (16 * case["mean_degree"] + 32 * fanout)
        frontier *= fanout
    return Cost(link_bytes=link, hbm_bytes=hbm, pattern="all_to_all")


def _case(name, num_nodes, mean_degree, seeds_per_rank, fanouts, **extra):
    note = extra.pop("note", "")
    return Case(name, {"num_nodes": num_nodes, "mean_degree": mean_degree, "seeds_per_rank": seeds_per_rank,
                       "fanouts": fanouts, **extra}, note=note)


PROBLEM = Problem(
    name="gnn_neighbor_sampling", version=1, upstream_id=64, category="beyond_llm",
    source="PyG torch_geometric.distributed DistNeighborSampler (multi-hop, partitioned graph)",
    world_sizes=(2, 4, 8),
    tests=[
        _case("two_hops_one_empty", 90, 5.0, 4, (3, 2), num_empty=1,
              note="hubs, isolated nodes, a rank without seeds"),
        _case("three_hops_replace", 70, 3.0, 3, (2, 2, 2), replace=True),
        _case("fanout_above_degree", 50, 2.0, 5, (6,), note="most nodes have fewer neighbours than the fanout"),
    ],
    benchmarks=[
        _case("ogbn_products_sage_15_10_5", 2_449_029, 50.5, 1024, (15, 10, 5)),
        _case("ogbn_papers100m_20m_nodes_15_10", 20_000_000, 14.5, 1024, (15, 10)),
    ],
    reference=reference, make_inputs=make_inputs, cost=cost,
)
