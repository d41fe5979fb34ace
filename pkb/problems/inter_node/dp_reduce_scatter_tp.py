"""Data-parallel gradient reduce-scatter with tensor parallelism inside each node and data parallelism both
inside and across nodes: Megatron-LM's distributed optimizer (``megatron.core.distributed.DistributedDataParallel``
with ``use_distributed_optimizer=True``, ``_ParamAndGradBucketGroup.start_grad_sync``) at TP = G/d, d data-parallel
replicas per node, DP = d N (Megatron's rank order, TP fastest: on a node of 8 GPUs, TP 4 x DP 2, the usual
layout of a 70B model on many nodes).

Layout (pkb.topology: W ranks on N nodes of G GPUs): d = min(dp_per_node, G) (a case parameter, 2 by default;
it divides G), TP = G / d. Rank r on node n = r // G, local rank l = r % G, is TP rank t = l % TP of DP replica
j = l // TP of its node. The G ranks of a node hold d replicas of the model, each split over TP ranks: ranks of
different t hold different parameters and have nothing to add up; the d N ranks of one t (d on every node) are
its data-parallel group, DP rank k = n d + j, and their gradients are summed.

Per rank: grad_bucket [P] (distinct per rank), gradient_scaling_factor (float: 1/(d N), Megatron's default
``1 / data_parallel_world_size``, or 1.0 with ``calculate_per_token_loss``), dp_group (its d N DP ranks),
intra_dp_group (the d DP ranks of its node), inter_dp_group (the N DP ranks of its replica index j, one per node)
->  shard [c] in grad_bucket's dtype, c = ceil(P / (d N)): elements [k c, (k+1) c) of gradient_scaling_factor *
(the sum of the d N buckets of the DP group) for DP rank k; grad_bucket is left unchanged. Megatron allocates its
buckets padded with zeros (``_pad_end_of_bucket_if_needed``, to a multiple of the DP size times 128); here the
bucket is padded with zeros at the end to a multiple of d N only, so the last shards end in zeros. The two
sub-groups are pkb's: Megatron's call is one reduce-scatter over dp_group (as the reference), and a kernel
that splits it by node may use them.

Dtype: the main grads are fp32 in a bf16 run (Megatron's arguments force ``accumulate_allreduce_grads_in_fp32``
for bf16: "bfloat16 requires gradient accumulation and all-reduce to be done in fp32", so the bucket and the
reduce-scatter are fp32) and in the run's precision otherwise (fp16: Megatron's default
``grad_reduce_in_fp32=False``; fp32). The reference sums in fp32 and rounds once.
Tolerance: a sum of d N terms of magnitude ``gradient_scaling_factor`` in the bucket's dtype
(``reduction_tolerance``), so a ring that rounds after each addition passes; a missing rank's term does not.

Cost per rank, B = P b the bucket's bytes (b = 4 for fp32 main grads):
- network: every shard owned on another node ((N-1)/N of the bucket, for each of the node's TP ranks) must leave
  the node, and at the least as one partial sum of the node's d replicas: (N-1)/N B per TP rank and node,
  spread over the d NICs of its d DP ranks (or, forwarded over NVLink, over all G NICs of the node: the same per
  NIC), (N-1)/N * B/d per rank per direction. A flat ring over the d N ranks (NCCL's reduce-scatter as the
  reference calls it) sends the node's d buckets unreduced: d times that.
- NVLink: the reduction of the d replicas inside the node, a reduce-scatter over d ranks, nccl-tests' count
  (d-1)/d * B. With d = 1 (TP over the whole node) nothing crosses NVLink.
- HBM: read the bucket B, write the shard B/(d N).

Tests: odd and prime sizes (padding), a bucket of 5 elements (at d N = 8 shards of padding only), both scaling
factors, four replicas per node (TP 1 where G = 4). Benchmarks: Megatron's default bucket of 40,000,000
parameters (``bucket_size = max(40000000, 1000000 * dp_size)``) in fp32 main grads, and a 25M-parameter bucket;
at TP = 4 a Llama-3-70B rank (80 layers of 855.6M parameters) holds about 214M parameters per layer, about 5.3
such buckets per layer.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, randn, reduction_tolerance
from pkb.problems.inter_node._common import NODES, WORLD_SIZES, dtype_of, group_of, ring_share, topology_of


def grad_dtype(case) -> torch.dtype:
    """Megatron's main-grad dtype: fp32 in a bf16 run, else the run's precision."""
    dtype = dtype_of(case)
    return torch.float32 if dtype == torch.bfloat16 else dtype


def replicas_per_node(case, world_size) -> int:
    """d: the data-parallel replicas on a node (TP = G / d)."""
    gpus = topology_of(case, world_size).gpus_per_node
    replicas = min(case.get("dp_per_node", 2), gpus)
    if gpus % replicas:
        raise ValueError(f"{replicas} data-parallel replicas do not split a node of {gpus} GPUs")
    return replicas


def dp_size(case, world_size) -> int:
    return replicas_per_node(case, world_size) * topology_of(case, world_size).num_nodes


def scaling_factor(case, world_size) -> float:
    """1/(d N) (Megatron's default: the mean over the DP group) or 1.0 (calculate_per_token_loss: the sum)."""
    return 1.0 / dp_size(case, world_size) if case["scaling"] == "mean" else 1.0


def dp_groups(case, world_size) -> tuple:
    """(dp_group, intra_dp_group, inter_dp_group) of this rank, in Megatron's rank order (TP fastest)."""
    topology = topology_of(case, world_size)
    gpus, nodes, replicas = topology.gpus_per_node, topology.num_nodes, replicas_per_node(case, world_size)
    tp = gpus // replicas
    rank_of = lambda node, replica, tp_rank: node * gpus + replica * tp + tp_rank  # noqa: E731
    dp = [[rank_of(n, j, t) for n in range(nodes) for j in range(replicas)] for t in range(tp)]
    intra = [[rank_of(n, j, t) for j in range(replicas)] for n in range(nodes) for t in range(tp)]
    inter = [[rank_of(n, j, t) for n in range(nodes)] for j in range(replicas) for t in range(tp)]
    return group_of(dp), group_of(intra), group_of(inter)


def make_inputs(case, rank, world_size, gen):
    dp_group, intra_dp_group, inter_dp_group = dp_groups(case, world_size)
    return (randn(gen, case["numel"], dtype=grad_dtype(case)), scaling_factor(case, world_size), dp_group,
            intra_dp_group, inter_dp_group)


def reference(grad_bucket, gradient_scaling_factor, dp_group, intra_dp_group, inter_dp_group):
    dp_size = dist.get_world_size(dp_group)
    accumulate = torch.promote_types(grad_bucket.dtype, torch.float32)  # fp32, or finer
    padded = grad_bucket.new_zeros(-(-grad_bucket.numel() // dp_size) * dp_size, dtype=accumulate)
    padded[:grad_bucket.numel()] = grad_bucket  # a new buffer: the input is left unchanged
    padded *= gradient_scaling_factor
    shard = padded.new_empty(padded.numel() // dp_size)
    dist.reduce_scatter_tensor(shard, padded, group=dp_group)
    return shard.to(grad_bucket.dtype)


def cost(case, world_size):
    topology, replicas = topology_of(case, world_size), replicas_per_node(case, world_size)
    size = case["numel"] * grad_dtype(case).itemsize
    return Cost(link_bytes=ring_share(replicas) * size, network_bytes=ring_share(topology.num_nodes) * size / replicas,
                hbm_bytes=size + size / dp_size(case, world_size), pattern="reduce_scatter(hierarchical)")


def tolerance(case, world_size, dtype):
    return reduction_tolerance(dtype, dp_size(case, world_size), scaling_factor(case, world_size))


TESTS = (
    Case("odd_mean", {"numel": 1001, "scaling": "mean"}, tags=("odd_sizes",)),
    Case("prime_sum", {"numel": 4099, "scaling": "sum"}, tags=("odd_sizes", "argument_value")),
    Case("five", {"numel": 5, "scaling": "mean"}, tags=("tiny", "odd_sizes", "uneven_sizes")),
    Case("bucket_128k_odd", {"numel": 128 * 1024 + 3, "scaling": "mean"}, tags=("odd_sizes",),
         note="a 128k bucket three past a multiple of 128"),
    Case("four_replicas", {"numel": 777, "scaling": "mean", "dp_per_node": 4}, tags=("shape_regime", "odd_sizes"),
         note="four data-parallel replicas per node where it has four GPUs (TP 1), else as many as it has"),
)

BENCHMARKS = (
    Case("megatron_bucket_40m", {"numel": 40_000_000, "scaling": "mean"},
         note="Megatron's default bucket, 40M parameters of fp32 main grads (160 MB), two replicas per node"),
    Case("bucket_25m", {"numel": 25_000_000, "scaling": "mean"},
         note="a 25M-parameter bucket of fp32 main grads (100 MB), two replicas per node"),
    Case("bucket_40m_per_token_loss", {"numel": 40_000_000, "scaling": "sum"},
         note="Megatron's default bucket with calculate_per_token_loss (gradient_scaling_factor 1.0)"),
)

PROBLEM = Problem(
    name="dp_reduce_scatter_tp", version=2, upstream_id=None, category="inter_node",
    source="Megatron-LM DistributedDataParallel(use_distributed_optimizer=True) grad reduce-scatter over the "
           "data-parallel group: TP = G/2 inside a node, two data-parallel replicas per node, DP across nodes",
    world_sizes=WORLD_SIZES, nodes=NODES, tests=TESTS, benchmarks=BENCHMARKS, tolerance=tolerance,
    reference=reference, make_inputs=make_inputs, cost=cost,
)
