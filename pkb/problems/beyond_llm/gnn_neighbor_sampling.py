"""Distributed multi-hop neighbour sampling (PyG ``torch_geometric.distributed.DistNeighborSampler``):
the graph's nodes are partitioned over the ranks, and every rank samples a subgraph around its own
seed nodes by sending each frontier node to its owner, which samples the node's neighbours and
answers, hop by hop.

Per rank: seed_nodes [S_r] int64 (distinct; S_r >= 1 differs per rank), fanouts (list of ints, one per
hop), local_adj_row_ptr [N + 1] int64 and local_adj_col [E] int64 (the graph in CSC form indexed by
global node id, the upstream layout; only the entries of the nodes this rank owns are this rank's
graph: the entries of other nodes hold other values on every rank, so sampling must happen at the
owner), node_to_rank [N] int64 (the partition, the same on every rank), group=None, replace=False
  ->  (node [n] int64, row [m] int64, col [m] int64, edge_ids [m] int64), PyG's SamplerOutput layout:
      node = the seeds, then every newly reached node in order of first appearance; for each sampled
      edge, row = the label (index in node) of the neighbour, col = the label of the frontier node it
      was sampled for; edge_ids = the edge's position in local_adj_col. Edges are ordered by hop, then
      frontier node (in node order), then CSC position. Hop h samples the nodes first reached in hop
      h-1 (hop 0: the seeds).

Sampling is deterministic, as upstream: a node keeps its first min(k, degree) neighbours in CSC order.
``replace`` is accepted and, as upstream, does not change the sample.

Domain: the upstream reference stops sampling on a rank whose frontier is empty, without the other
ranks (they then wait forever), so on the random graphs make_inputs draws the seeds (from ``gen.shared``,
every rank's set known to all) again until every rank has a non-empty frontier in every hop.

Cost (an upper bound: no deduplication, every node has at least k neighbours): hop h has
F_h = S * prod(fanouts[:h]) frontier nodes; each request is 8 bytes out and 8 + 16*k_h back (count,
neighbour ids and edge ids), (W-1)/W of them to other ranks: link = sum_h (W-1)/W * F_h * (16 + 16*k_h).
HBM: the owner reads the two CSC offsets and k neighbour ids of each request and the outputs (row, col,
edge id) are written: sum_h F_h * (16 + 32*k_h).

Cases: ``upstream`` is the upstream benchmark's input (10,000 nodes of degree 16, fanouts (10, 5), 512
seeds per rank) on a graph of upstream's kind: a ring (node i linked to i + o mod N for 16 random
offsets; upstream's are 1..16), owners i % W, every rank's seeds a window of consecutive ids starting at
a multiple of W, so that, as upstream, every rank's frontier has the same size in every hop and the
same number of nodes on each owner. Benchmarks: ogbn-products (2,449,029 nodes, 61,859,140 undirected edges = 123.7M
directed, mean degree ~50.5) with GraphSAGE's fanouts (15, 10, 5) and 1024 seeds per rank;
ogbn-papers100M sampled down to 20M nodes with its mean degree (~14.5 directed) and fanouts (15, 10),
1024 seeds per rank.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, upstream_seed
from pkb.problems.beyond_llm._common import all_to_all_rows, exchange_counts, skewed_counts

_SEED_DRAWS = 50


def _ring_graph(case, world_size, gen):
    """The upstream graph's kind: node i links to i + o (mod N) for ``degree`` distinct offsets o in
    [1, 2*degree] (drawn from ``gen.shared``; upstream's are 1..degree), owners round robin (i % W)."""
    num_nodes, degree, device = case["num_nodes"], case["degree"], gen.device
    offsets = torch.randperm(2 * degree, generator=gen.shared, device=device)[:degree] + 1
    colptr = torch.arange(num_nodes + 1, device=device) * degree
    row = ((torch.arange(num_nodes, device=device).view(-1, 1) + offsets.view(1, -1)) % num_nodes).reshape(-1)
    return colptr, row, torch.arange(num_nodes, device=device) % world_size


def _graph(case, world_size, gen):
    """(colptr [N + 1], row [E], node_to_rank [N]) of the whole graph, from ``gen.shared``."""
    num_nodes, shared = case["num_nodes"], gen.shared
    if "degree" in case.params:
        return _ring_graph(case, world_size, gen)
    # exponential degrees: hubs and isolated nodes
    uniform = torch.rand(num_nodes, generator=shared, device=gen.device).clamp_min(1e-12)
    degree = torch.floor(-torch.log(uniform) * case["mean_degree"]).to(torch.int64)
    colptr = torch.zeros(num_nodes + 1, dtype=torch.int64, device=gen.device)
    colptr[1:] = degree.cumsum(0)
    row = torch.randint(0, num_nodes, (int(colptr[-1]),), generator=shared, device=gen.device)
    weights = torch.rand(world_size, generator=shared, device=gen.device) + 0.2  # uneven partition sizes
    node_to_rank = torch.multinomial(weights, num_nodes, replacement=True, generator=shared)
    return colptr, row, node_to_rank


def _sample(frontier, fanout, colptr, row):
    """First-k sampling: (frontier index [m], neighbour [m], edge id [m]) of every sampled edge, in
    frontier order, then CSC order."""
    start = colptr[frontier]
    take = torch.clamp(colptr[frontier + 1] - start, max=fanout)
    which = torch.arange(frontier.numel(), device=frontier.device).repeat_interleave(take)
    within = torch.arange(which.numel(), device=frontier.device) - (take.cumsum(0) - take)[which]
    edge_ids = start[which] + within
    return which, row[edge_ids], edge_ids


def _append_new(nodes, reached):
    """(nodes followed by the members of ``reached`` not yet in it, in order of first appearance;
    the label (index in the new node list) of every element of ``reached``)."""
    combined = torch.cat([nodes, reached])
    unique, inverse = torch.unique(combined, return_inverse=True)
    first = torch.full((unique.numel(),), combined.numel(), dtype=torch.int64, device=nodes.device).scatter_reduce_(
        0, inverse, torch.arange(combined.numel(), device=nodes.device), reduce="amin")
    by_first = torch.argsort(first)
    label = torch.empty_like(by_first)
    label[by_first] = torch.arange(by_first.numel(), device=nodes.device)
    return unique[by_first], label[inverse[nodes.numel():]]


def _every_frontier_busy(seeds_per_rank, fanouts, colptr, row):
    """Whether every rank's frontier is non-empty in every hop (sampling on the whole graph locally)."""
    for seeds in seeds_per_rank:
        nodes, frontier_start = seeds, 0
        for fanout in fanouts:
            if nodes.numel() == frontier_start:
                return False
            _, neighbours, _ = _sample(nodes[frontier_start:], fanout, colptr, row)
            frontier_start, (nodes, _) = nodes.numel(), _append_new(nodes, neighbours)
    return True


def _window_seeds(case, world_size, gen):
    """Upstream's seeds: ``seeds_per_rank`` consecutive ids (mod N) from a start that is a multiple of W,
    here a random one per rank. On the ring graph every rank's frontier then has the same size in every
    hop, with the same number of nodes on each owner (as upstream's start of rank * seeds_per_rank)."""
    start = world_size * torch.randint(0, case["num_nodes"] // world_size, (), generator=gen, device=gen.device)
    return (start + torch.arange(case["seeds_per_rank"], device=gen.device)) % case["num_nodes"]


def _drawn_seeds(case, rank, world_size, gen, colptr, row):
    """Skewed seed counts; the seeds of every rank drawn from ``gen.shared`` until every frontier is busy."""
    counts = [max(1, c) for c in skewed_counts(gen.shared, world_size, case["seeds_per_rank"] * world_size)]
    for _ in range(_SEED_DRAWS):
        seeds = [torch.randperm(case["num_nodes"], generator=gen.shared, device=gen.device)[:c] for c in counts]
        if _every_frontier_busy(seeds, case["fanouts"], colptr, row):
            return seeds[rank]
    raise ValueError(f"case {case.name!r}: no seed draw keeps every rank's frontier non-empty")


def make_inputs(case, rank, world_size, gen):
    colptr, row, node_to_rank = _graph(case, world_size, gen)
    if "degree" in case.params:
        seeds = _window_seeds(case, world_size, gen)
    else:
        seeds = _drawn_seeds(case, rank, world_size, gen, colptr, row)
    # Entries of the nodes other ranks own: this rank's own random values, not the graph.
    foreign = (node_to_rank != rank).repeat_interleave(colptr[1:] - colptr[:-1])
    others = torch.randint(0, case["num_nodes"], row.shape, generator=gen, device=gen.device)
    local_adj_col = torch.where(foreign, others, row)
    return seeds, list(case["fanouts"]), colptr, local_adj_col, node_to_rank, None, case.get("replace", False)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's (no random values; it seeds as rank 0): the ring graph with offsets 1..degree, owners i % W,
    every rank's column array the whole graph's, and rank r's seeds r*S .. r*S + S - 1 (mod N)."""
    upstream_seed(PROBLEM.upstream_id, 0, trial)
    num_nodes, degree, seeds_per_rank = case["num_nodes"], case["degree"], case["seeds_per_rank"]
    node_to_rank = torch.arange(num_nodes, device=device) % world_size
    colptr = torch.arange(num_nodes + 1, device=device) * degree
    offsets = torch.arange(1, degree + 1, device=device)
    row = ((torch.arange(num_nodes, device=device).view(-1, 1) + offsets.view(1, -1)) % num_nodes).reshape(-1)
    seed_nodes = (torch.arange(seeds_per_rank, device=device) + rank * seeds_per_rank) % num_nodes
    return seed_nodes, list(case["fanouts"]), colptr, row, node_to_rank, None, False


def _segment_sums(values, segment_sizes, world_size):
    """Sum of ``values`` over consecutive segments of the given sizes (one per rank)."""
    sizes = torch.tensor(segment_sizes, device=values.device)
    segment = torch.arange(world_size, device=values.device).repeat_interleave(sizes)
    return torch.zeros(world_size, dtype=values.dtype, device=values.device).index_add_(0, segment, values).tolist()


def reference(seed_nodes, fanouts, local_adj_row_ptr, local_adj_col, node_to_rank, group=None, replace=False):
    world_size = dist.get_world_size(group)
    device = seed_nodes.device
    nodes, frontier_start = seed_nodes, 0
    rows, cols, edge_ids = [], [], []
    for fanout in fanouts:
        frontier = nodes[frontier_start:]
        # Requests: each frontier node goes to its owner, grouped by owner.
        owner = node_to_rank[frontier]
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=world_size).tolist()
        recv_counts = exchange_counts(send_counts, device, group)
        requested = all_to_all_rows(frontier[order], send_counts, recv_counts, group)
        # The owner samples; answers go back in request order: counts first, then (neighbour, edge id).
        which, neighbours, edges = _sample(requested, fanout, local_adj_row_ptr, local_adj_col)
        counts = torch.bincount(which, minlength=requested.numel())
        got_counts = all_to_all_rows(counts, recv_counts, send_counts, group)
        answer_sizes = _segment_sums(counts, recv_counts, world_size)
        got_sizes = _segment_sums(got_counts, send_counts, world_size)
        got = all_to_all_rows(torch.stack([neighbours, edges], dim=1), answer_sizes, got_sizes, group)
        # Back to frontier order (a stable sort of the answers by the frontier position they belong to).
        frontier_of = order.repeat_interleave(got_counts)
        back = torch.argsort(frontier_of, stable=True)
        frontier_of, got = frontier_of[back], got[back]
        cols.append(frontier_start + frontier_of)
        frontier_start = nodes.numel()
        nodes, labels = _append_new(nodes, got[:, 0])
        rows.append(labels)
        edge_ids.append(got[:, 1])
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return nodes, torch.cat(rows or [empty]), torch.cat(cols or [empty]), torch.cat(edge_ids or [empty])


def cost(case, world_size):
    frontier, link, hbm = float(case["seeds_per_rank"]), 0.0, 0.0
    for fanout in case["fanouts"]:
        link += (world_size - 1) / world_size * frontier * (16 + 16 * fanout)
        hbm += frontier * (16 + 32 * fanout)
        frontier *= fanout
    return Cost(link_bytes=link, hbm_bytes=hbm, pattern="all_to_all")


def _case(name, num_nodes, degree, seeds_per_rank, fanouts, **extra):
    """``degree``: an int (the ring graph, every node that degree, seeds in windows) or a float (the mean of
    exponential degrees, skewed seed counts)."""
    note, tags = extra.pop("note", ""), extra.pop("tags", ())
    key = "degree" if isinstance(degree, int) else "mean_degree"
    return Case(name, {"num_nodes": num_nodes, key: degree, "seeds_per_rank": seeds_per_rank,
                       "fanouts": fanouts, **extra}, note=note, tags=tags)


PROBLEM = Problem(
    name="gnn_neighbor_sampling", version=3, upstream_id=64, category="beyond_llm",
    source="PyG torch_geometric.distributed DistNeighborSampler (multi-hop, partitioned graph)",
    world_sizes=(2, 4, 8),
    upstream=[_case("upstream", 10_000, 16, 512, (10, 5))],
    tests=[
        _case("two_hops_skewed_seeds", 90, 5.0, 4, (3, 2), note="hubs, isolated nodes, uneven seed counts",
              tags=("uneven_sizes", "skewed")),
        _case("three_hops_replace", 200, 4.0, 4, (2, 2, 2), replace=True,
              note="replace=True samples the same first neighbours", tags=("argument_value", "uneven_sizes", "skewed")),
        _case("fanout_above_degree", 60, 2.0, 5, (6,), note="most nodes have fewer neighbours than the fanout",
              tags=("argument_value", "uneven_sizes", "skewed")),
    ],
    benchmarks=[
        _case("ogbn_products_sage_15_10_5", 2_449_029, 50.5, 1024, (15, 10, 5)),
        _case("ogbn_papers100m_20m_nodes_15_10", 20_000_000, 14.5, 1024, (15, 10)),
    ],
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
