"""KeyedJaggedTensor all-to-all (torchrec ``KJTAllToAll``, the input dist of table-wise sharded
embeddings): every rank holds a batch of sparse features for all keys; keys are owned by ranks in
contiguous blocks (``key_splits``), and each rank receives its keys' jagged data from every rank's
batch, then recats it key-major.

Per rank (F keys, key_splits[d] keys for rank d, this rank's batch size B_r; batch sizes differ per
rank, may be 0; a rank may own no keys):
  lengths [sum_f stride_f] int64, key-major (key 0's B_r lengths, then key 1's, ...),
  values [sum(lengths)] int64, key_splits (list of W ints), batch_size = B_r, pg=None,
  weights [sum(lengths)] fp32 or None, stride_per_key (per-key batch sizes, variable-batch KJTs; None
  means B_r for every key), stagger=1. Like upstream's factory, make_inputs passes the first five; the
  cases that use weights, variable batches or a stagger pass all eight.
  ->  dict (k = key_splits[rank]), bit-exact:
      "lengths" [sum over sources of k*B_s] int64, "values" int64, "weights" fp32 (only when weights
      are given), and
      - fixed batch (stride_per_key None): "stride" [] int64 = sum of the sources' batch sizes,
        "stride_per_rank" [W] int64 = each source's batch size B_s;
      - variable batch: "stride_per_key_per_rank" [k, W] int64, key i's batch size on each source,
        the sources in feature_order (below).

Output order (torchrec's recat): for each local key i, for each source j in
feature_order = [x + (W // stagger) * y for x in range(W // stagger) for y in range(stagger)],
source j's segment of key i; values (and weights) follow their lengths.

Cost: each rank sends the (W-1)/W of its lengths and values that belong to other ranks' keys:
link = (W-1)/W * (F*B*8 + B*F*L*(8 + 4 if weighted)) with L the mean values per entry (pooling
factor). HBM: the send and the recat read and write the data twice: 4x the same bytes.

Benchmarks: DLRM-v2 (MLPerf, Criteo 1TB multi-hot): 26 sparse features with pooling factors
3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,100,27,10,3,1,1 (mean 7.9), 8192 samples per rank,
table-wise sharded; ``dlrm_v2_criteo_weighted`` adds per-value weights (id-score lists).
The ``upstream`` case is the upstream factory's: key_splits[d] = 1 + d % 3, 512 samples per rank,
5 to 20 values per entry, no weights.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance, randn
from pkb.problems.beyond_llm._common import all_to_all_rows, exchange_counts

DLRM_V2_POOLING = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)


def key_splits_for(case, world_size):
    if case.get("key_layout") == "mod3":  # the upstream factory's: 1 + d % 3 keys on rank d
        return [1 + d % 3 for d in range(world_size)]
    num_keys = len(case["pooling"])
    if case.get("skew_keys", False):  # all but a few keys on rank 1, none on rank 0
        splits = [0] + [1] * (world_size - 1)
        splits[1] += num_keys - sum(splits)
        return splits
    return [num_keys // world_size + (1 if d < num_keys % world_size else 0) for d in range(world_size)]


def mean_values_per_entry(case, num_keys):
    """The mean pooling factor: (lo + hi - 1) / 2 for lengths drawn in [lo, hi), else the keys' mean."""
    if "length_range" in case.params:
        low, high = case["length_range"]
        return (low + high - 1) / 2
    return sum(case["pooling"]) / num_keys


def make_inputs(case, rank, world_size, gen):
    batch_sizes = case["batch_sizes"]
    batch_size = batch_sizes[rank % len(batch_sizes)]
    num_keys = sum(key_splits_for(case, world_size))
    stride_per_key = None
    strides = torch.full((num_keys,), batch_size, device=gen.device)
    if case.get("variable_batch", False):
        strides = torch.randint(0, batch_size + 1, (num_keys,), generator=gen, device=gen.device)
        stride_per_key = strides.tolist()
    if "length_range" in case.params:
        low, high = case["length_range"]
        lengths = torch.randint(low, high, (int(strides.sum()),), generator=gen, device=gen.device)
    else:
        max_len = (2 * torch.tensor(case["pooling"], device=gen.device) + 1).repeat_interleave(strides)
        lengths = (torch.rand(int(strides.sum()), generator=gen, device=gen.device) * max_len).to(torch.int64)
    num_values = int(lengths.sum())
    values = torch.randint(0, 1 << 40, (num_values,), generator=gen, device=gen.device)
    weights = randn(gen, num_values) if case.get("weighted", False) else None
    args = (lengths, values, key_splits_for(case, world_size), batch_size, None)
    if weights is None and stride_per_key is None and case.get("stagger", 1) == 1:
        return args  # upstream's argument list
    return (*args, weights, stride_per_key, case.get("stagger", 1))


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's (after its seed): lengths uniform in ``length_range`` [keys, batch] key-major, then values
    uniform in [0, 1e6) (pkb's make_inputs draws ids below 2^40)."""
    key_splits, batch_size = key_splits_for(case, world_size), case["batch_sizes"][rank % len(case["batch_sizes"])]
    low, high = case["length_range"]
    lengths = torch.randint(low, high, (sum(key_splits), batch_size), dtype=torch.long, device=device).reshape(-1)
    values = torch.randint(0, 1_000_000, (int(lengths.sum().item()),), dtype=torch.long, device=device)
    return lengths.contiguous(), values, key_splits, batch_size, None


def reference(lengths, values, key_splits, batch_size, pg=None, weights=None, stride_per_key=None, stagger=1):
    world_size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    device = lengths.device
    num_keys, local_keys = sum(key_splits), key_splits[rank]
    variable = stride_per_key is not None
    strides = torch.tensor(stride_per_key if variable else [batch_size] * num_keys, dtype=torch.int64,
                           device=device)
    # Metadata: every owner learns the batch size of each of its keys on every source ([W * k],
    # source-major): sent per key for variable batches, else each source's one batch size.
    if variable:
        recv_strides = all_to_all_rows(strides, key_splits, [local_keys] * world_size, pg)
    else:
        stride_per_rank = exchange_counts([batch_size] * world_size, device, pg)
        recv_strides = torch.tensor(stride_per_rank, dtype=torch.int64, device=device).repeat_interleave(local_keys)
    # Lengths, then values (and weights), in key blocks per destination; a source's value count is
    # the sum of the lengths it sent.
    key_of_entry = torch.arange(num_keys, device=device).repeat_interleave(strides)
    owner_of_key = torch.arange(world_size, device=device).repeat_interleave(torch.tensor(key_splits, device=device))
    owner_of_entry = owner_of_key[key_of_entry]
    length_counts = torch.bincount(owner_of_entry, minlength=world_size).tolist()
    value_counts = torch.zeros(world_size, dtype=torch.int64, device=device).index_add_(
        0, owner_of_entry, lengths).tolist()
    recv_length_counts = recv_strides.view(world_size, local_keys).sum(dim=1)
    recv_lengths = all_to_all_rows(lengths, length_counts, recv_length_counts.tolist(), pg)
    source_of_entry = torch.arange(world_size, device=device).repeat_interleave(recv_length_counts)
    recv_value_counts = torch.zeros(world_size, dtype=torch.int64, device=device).index_add_(
        0, source_of_entry, recv_lengths).tolist()
    recv_values = all_to_all_rows(values, value_counts, recv_value_counts, pg)
    recv_weights = all_to_all_rows(weights, value_counts, recv_value_counts, pg) if weights is not None else None
    # Recat: segments arrive source-major (source s, key i); reorder them key-major in feature_order.
    groups = world_size // stagger
    feature_order = torch.tensor([x + groups * y for x in range(groups) for y in range(stagger)], device=device)
    position_of_source = torch.empty(world_size, dtype=torch.int64, device=device)
    position_of_source[feature_order] = torch.arange(world_size, device=device)
    segment = torch.arange(world_size * local_keys, device=device)
    segment_key = (segment % local_keys) * world_size + position_of_source[segment // local_keys] \
        if local_keys else segment
    entry_key = segment_key.repeat_interleave(recv_strides)
    length_order = torch.argsort(entry_key, stable=True)
    value_order = torch.argsort(entry_key.repeat_interleave(recv_lengths), stable=True)
    out = {"lengths": recv_lengths[length_order], "values": recv_values[value_order]}
    if variable:
        out["stride_per_key_per_rank"] = recv_strides.view(world_size, local_keys).T[:, feature_order].contiguous()
    else:
        out["stride"] = torch.tensor(sum(stride_per_rank), dtype=torch.int64, device=device)
        out["stride_per_rank"] = torch.tensor(stride_per_rank, dtype=torch.int64, device=device)
    if recv_weights is not None:
        out["weights"] = recv_weights[value_order]
    return out


def cost(case, world_size):
    num_keys = sum(key_splits_for(case, world_size))
    batch = sum(case["batch_sizes"]) / len(case["batch_sizes"])
    value_bytes = 8 + (4 if case.get("weighted", False) else 0)
    sent = num_keys * batch * 8 + batch * num_keys * mean_values_per_entry(case, num_keys) * value_bytes
    return Cost(link_bytes=(world_size - 1) / world_size * sent, hbm_bytes=4 * sent, pattern="all_to_all")


def _case(name, pooling, batch_sizes, **extra):
    note, tags = extra.pop("note", ""), extra.pop("tags", ())
    return Case(name, {"pooling": pooling, "batch_sizes": batch_sizes, **extra}, note=note, tags=tags)


PROBLEM = Problem(
    name="torchrec_kjt_all2all", version=3, upstream_id=70, category="beyond_llm",
    source="torchrec KJTAllToAll (KeyedJaggedTensor input dist for table-wise sharding, with recat)",
    world_sizes=(2, 4, 8),
    upstream=[
        Case("upstream", {"key_layout": "mod3", "batch_sizes": (512,), "length_range": (5, 21)},
             note="key_splits[d] = 1 + d % 3, 512 samples per rank, 5 to 20 values per entry"),
    ],
    tests=[
        _case("uneven_batches", (1, 3, 2, 5, 1, 2, 4, 1, 2, 3, 1), (3, 0, 5, 2),
              note="11 keys; one rank's batch is empty; upstream's five arguments",
              tags=("uneven_sizes", "empty_rank", "odd_sizes")),
        _case("weighted_uneven_batches", (1, 3, 2, 5, 1, 2, 4, 1, 2, 3, 1), (3, 0, 5, 2), weighted=True,
              note="11 keys; one rank's batch is empty", tags=("argument_value", "uneven_sizes", "empty_rank")),
        _case("skewed_keys_stagger2", (2, 1, 4, 1, 3, 2, 2, 1, 1), (4, 1), skew_keys=True, stagger=2, weighted=True,
              note="rank 0 owns no keys, rank 1 most of them", tags=("argument_value", "skewed", "empty_rank")),
        _case("variable_batch_unweighted", (2, 2, 1, 3, 1, 2, 1, 1, 3, 2), (3, 4, 2), variable_batch=True,
              tags=("argument_value", "uneven_sizes")),
        _case("variable_batch_stagger2_weighted", (1, 2, 3, 1, 2, 1, 2, 3, 1, 1, 2), (5, 2, 3), variable_batch=True,
              stagger=2, weighted=True, note="stride_per_key_per_rank columns in feature_order",
              tags=("argument_value", "uneven_sizes")),
    ],
    benchmarks=[
        _case("dlrm_v2_criteo", DLRM_V2_POOLING, (8192,)),
        _case("dlrm_v2_criteo_weighted", DLRM_V2_POOLING, (8192,), weighted=True),
    ],
    tolerance=Tolerance.exact(), reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs,
    cost=cost,
)
