"""Data-parallel gradient reduce-scatter across nodes with tensor parallelism inside each node: Megatron-LM's
distributed optimizer (``megatron.core.distributed.DistributedDataParallel`` with
``use_distributed_optimizer=True``, ``_ParamAndGradBucketGroup.start_grad_sync``), TP = G inside a node,
DP = N across nodes.

The G ranks of a node are one tensor-parallel group: each holds a different shard of every weight, so their
gradients have nothing to add up. The ranks of one TP rank on the N nodes are a data-parallel group (the
inter-node group): they hold the same parameters and their gradients are summed. Each rank holds the full main-grad
bucket of its TP shard; the bucket is scaled by ``gradient_scaling_factor`` and reduce-scattered (sum) over
the DP group, so DP rank n keeps the n-th 1/N of it (``shard_buffer(grad_data, dp_size)[dp_rank]``), the part
its optimizer shard updates.

Per rank: grad_bucket [P] (distinct per rank), gradient_scaling_factor (float: 1/N, Megatron's default
``1 / data_parallel_world_size``, or 1.0 with ``calculate_per_token_loss``), dp_group (the inter-node group)
->  shard [ceil(P/N)] in grad_bucket's dtype: elements [n*c, (n+1)*c) of gradient_scaling_factor * (the sum
of the N buckets of the DP group), c = ceil(P/N), for the rank on node n; grad_bucket is left unchanged.
Megatron allocates its buckets padded with zeros (``_pad_end_of_bucket_if_needed``, to a multiple of the DP
size times 128); here the bucket is padded with zeros at the end to a multiple of N only, so the last shards
end in zeros.

Dtype: the main grads are fp32 in a bf16 run (Megatron's arguments force ``accumulate_allreduce_grads_in_fp32``
for bf16: "bfloat16 requires gradient accumulation and all-reduce to be done in fp32", so the bucket and the
reduce-scatter are fp32) and in the run's precision otherwise (fp16: Megatron's default
``grad_reduce_in_fp32=False``; fp32). The reference sums in fp32 and rounds once.
Tolerance: a sum of N terms of magnitude ``gradient_scaling_factor`` in the bucket's dtype
(``reduction_tolerance``), so a ring that rounds after each addition passes; a missing node's term does not.

Cost per rank, B = P * b the bucket's bytes (b = 4 for fp32 main grads):
- network: the reduce-scatter over the N nodes, nccl-tests' count (N-1)/N * B per rank per direction. Nothing
  inside a node can shrink it: the node's G ranks hold gradients of different parameters, and each one's
  1/N shards bound for the other nodes must leave over some NIC; spread over the node's G NICs that is still
  (N-1)/N * B per NIC.
- NVLink: nothing must cross it (link_bytes 0): the TP ranks of a node share no gradient.
- HBM: read the bucket B, write the shard B/N.

Tests: odd and prime sizes (padding), a bucket of 5 elements (at N = 4 a shard of padding only), both
scaling factors. Benchmarks: Megatron's default bucket of 40,000,000 parameters (``bucket_size = max(40000000,
1000000 * dp_size)``) in fp32 main grads, and a 25M-parameter bucket; with TP = 8 a Llama-3-70B (80 layers of
855.6M parameters) rank holds about 107M parameters per layer, so about 2.7 such buckets per layer, and a
Llama-3-405B rank (126 layers of 3.19B) about 10.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, randn, reduction_tolerance
from pkb.problems.inter_node._common import NODES, WORLD_SIZES, dtype_of, node_groups, ring_share, topology_of


def grad_dtype(case) -> torch.dtype:
    """Megatron's main-grad dtype: fp32 in a bf16 run, else the run's precision."""
    dtype = dtype_of(case)
    return torch.float32 if dtype == torch.bfloat16 else dtype


def scaling_factor(case, world_size) -> float:
    """1/N (Megatron's default: the mean over the DP group) or 1.0 (calculate_per_token_loss: the sum)."""
    return 1.0 / topology_of(case, world_size).num_nodes if case["scaling"] == "mean" else 1.0


def make_inputs(case, rank, world_size, gen):
    _, dp_group = node_groups(case, world_size)
    return randn(gen, case["numel"], dtype=grad_dtype(case)), scaling_factor(case, world_size), dp_group


def reference(grad_bucket, gradient_scaling_factor, dp_group):
    dp_size = dist.get_world_size(dp_group)
    padded = grad_bucket.new_zeros(-(-grad_bucket.numel() // dp_size) * dp_size, dtype=torch.float32)
    padded[:grad_bucket.numel()] = grad_bucket  # a new buffer: the input is left unchanged
    padded *= gradient_scaling_factor
    shard = padded.new_empty(padded.numel() // dp_size)
    dist.reduce_scatter_tensor(shard, padded, group=dp_group)
    return shard.to(grad_bucket.dtype)


def cost(case, world_size):
    topology = topology_of(case, world_size)
    size = case["numel"] * grad_dtype(case).itemsize
    return Cost(link_bytes=0.0, network_bytes=ring_share(topology.num_nodes) * size,
                hbm_bytes=size + size / topology.num_nodes, pattern="reduce_scatter(inter_node)")


def tolerance(case, world_size, dtype):
    return reduction_tolerance(dtype, topology_of(case, world_size).num_nodes, scaling_factor(case, world_size))


TESTS = (
    Case("odd_mean", {"numel": 1001, "scaling": "mean"}, tags=("odd_sizes",)),
    Case("prime_sum", {"numel": 4099, "scaling": "sum"}, tags=("odd_sizes", "argument_value")),
    Case("five", {"numel": 5, "scaling": "mean"}, tags=("tiny", "odd_sizes", "uneven_sizes")),
    Case("bucket_128k_odd", {"numel": 128 * 1024 + 3, "scaling": "mean"}, tags=("odd_sizes",),
         note="a 128k bucket three past a multiple of 128"),
)

BENCHMARKS = (
    Case("megatron_bucket_40m", {"numel": 40_000_000, "scaling": "mean"},
         note="Megatron's default bucket, 40M parameters of fp32 main grads (160 MB)"),
    Case("bucket_25m", {"numel": 25_000_000, "scaling": "mean"},
         note="a 25M-parameter bucket of fp32 main grads (100 MB)"),
    Case("bucket_40m_per_token_loss", {"numel": 40_000_000, "scaling": "sum"},
         note="Megatron's default bucket with calculate_per_token_loss (gradient_scaling_factor 1.0)"),
)

PROBLEM = Problem(
    name="dp_reduce_scatter_tp", version=1, upstream_id=None, category="inter_node",
    source="Megatron-LM DistributedDataParallel(use_distributed_optimizer=True) grad reduce-scatter over the "
           "data-parallel group, TP inside a node, DP across nodes",
    world_sizes=WORLD_SIZES, nodes=NODES, tests=TESTS, benchmarks=BENCHMARKS, tolerance=tolerance,
    reference=reference, make_inputs=make_inputs, cost=cost,
)
