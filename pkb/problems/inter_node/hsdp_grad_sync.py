"""FSDP with hybrid sharding (HSDP) across nodes: PyTorch FSDP2 ``fully_shard`` on a 2-D DeviceMesh
("replicate", "shard") as torchtitan builds it with ``data_parallel_replicate_degree`` = N (nodes) and
``data_parallel_shard_degree`` = G (GPUs per node): parameters sharded inside a node, replicated across nodes.
One call does one FSDP unit's (one ``fully_shard``-ed module's) communication of a step: the parameter
all-gather of the forward (``foreach_all_gather``, inside the node only) and the gradient reduction of the
backward (``foreach_reduce``: reduce-scatter inside the node, then all-reduce of the shard across nodes).

Sharding (FSDP2's ``Shard(0)``): parameter i of shape [rows_i, *rest_i] is split on dim 0 with
``torch.chunk`` semantics over the G ranks of a node: local rank g holds rows [g*c_i, min((g+1)*c_i, rows_i)),
c_i = ceil(rows_i / G) (the last local ranks may hold fewer rows, or none). Ranks of equal local rank on every
node hold the same shard (replicated).

Per rank, with the run's precision p (bf16 by default) as torchtitan's MixedPrecisionPolicy(param_dtype=p,
reduce_dtype=float32) and fp32 sharded parameters:
  unsharded_grads: list of [rows_i, *rest_i] in p, this rank's gradients of the whole unit (distinct per rank);
  param_shards: list of [local rows of parameter i, *rest_i] fp32, this local rank's shards (the same on every node);
  shard_group: the G ranks of its node (the mesh's "shard" dim); replicate_group: the N ranks of its local
  rank, one per node (the "replicate" dim).
->  (unsharded_params, sharded_grads):
  unsharded_params: list of [rows_i, *rest_i] in p: the shards cast to p and all-gathered over shard_group
  (exact);
  sharded_grads: list of [local rows of parameter i, *rest_i] fp32: this local rank's rows of the mean of
  the W ranks' gradients (FSDP2 divides by the data-parallel size, replicate x shard), reduced in fp32: the
  gradients cast to fp32, reduce-scattered over shard_group, all-reduced over replicate_group.
The inputs are left unchanged.
Tolerance: exact for the parameters (in an fp32 run, where they share the gradients' dtype, the fp32
tolerance below, a few 1e-7); for the gradients a sum of W terms of magnitude 1/W in fp32
(``reduction_tolerance``): any order of fp32 sums passes, a bf16 reduction or a missing node does not.

Cost per rank, P = sum_i numel_i elements, b the bytes of p, G GPUs per node, N nodes:
- NVLink: the all-gather, nccl-tests' (G-1)/G * P*b; the reduce-scatter, (G-1)/G * P*b: the gradients are
  p-valued, so a one-shot reduce-scatter that sends each rank its chunks in p and accumulates them in fp32 on
  arrival reduces in fp32 as FSDP2 does (FSDP2 itself moves fp32, twice that). link_bytes = 2 (G-1)/G * P*b.
- network: the all-reduce of the fp32 shard (P/G elements, node partial sums that p cannot hold) over the N
  nodes, 2 (N-1)/N * 4P/G per rank per direction. The all-gather crosses no node.
- HBM: read the grads P*b and the shards 4P/G; write the parameters P*b and the grad shards 4P/G.
(Row padding to c_i * G is left out of the counts: it is what FSDP2 moves, not what must move.)

Tests: uneven rows (the last local rank short), a local rank with no rows of a parameter, 1-D parameters
(norms), a parameter of rank 3, a tiny grouped-query attention unit. Benchmarks (Llama 3 config.json), FSDP
units of 17-42M parameters:
Llama-3-8B's attention (wq, wo [4096, 4096], wk, wv [1024, 4096], attention_norm [4096]: 41.9M), Llama-3-405B's
K/V projections and norms (wk, wv [1024, 16384], attention_norm, ffn_norm [16384]: 33.6M), Llama-3-70B's
(wk, wv [1024, 8192], norms [8192]: 16.8M).
"""

import math

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance, randn, reduction_tolerance
from pkb.problems.inter_node._common import NODES, WORLD_SIZES, dtype_of, node_groups, ring_share, topology_of


def chunk_rows(rows: int, index: int, parts: int) -> tuple[int, int]:
    """(start, length) of chunk ``index`` of ``rows`` split as torch.chunk splits (ceil-sized chunks)."""
    size = -(-rows // parts)
    start = min(index * size, rows)
    return start, min(size, rows - start)


def make_inputs(case, rank, world_size, gen):
    topology, dtype = topology_of(case, world_size), dtype_of(case)
    shard_group, replicate_group = node_groups(case, world_size)
    local_rank, local_size = topology.local_rank(rank), topology.gpus_per_node
    grads = [randn(gen, *shape, dtype=dtype) for shape in case["shapes"]]
    shards = []
    for shape in case["shapes"]:  # the full fp32 parameters, the same on every rank: this local rank's rows
        start, length = chunk_rows(shape[0], local_rank, local_size)
        shards.append(randn(gen.shared, *shape)[start:start + length].clone())
    return grads, shards, shard_group, replicate_group


def reference(unsharded_grads, param_shards, shard_group, replicate_group):
    local_size = dist.get_world_size(shard_group)
    world = local_size * dist.get_world_size(replicate_group)
    param_dtype = unsharded_grads[0].dtype
    shapes = [grad.shape for grad in unsharded_grads]
    chunk = [-(-shape[0] // local_size) for shape in shapes]  # padded rows per rank
    row = [math.prod(shape[1:]) for shape in shapes]
    padded = [c * r for c, r in zip(chunk, row)]  # elements of each padded shard

    # foreach_all_gather: pad each shard to c_i rows, cast to param_dtype, one all-gather of the flat shards
    send = torch.zeros(sum(padded), dtype=param_dtype, device=unsharded_grads[0].device)
    for shard, offset in zip(param_shards, _offsets(padded)):
        send[offset:offset + shard.numel()] = shard.reshape(-1)
    gathered = send.new_empty(local_size, sum(padded))
    dist.all_gather_into_tensor(gathered, send, group=shard_group)
    params = []
    for shape, offset, size, c in zip(shapes, _offsets(padded), padded, chunk):
        full = gathered[:, offset:offset + size].reshape(local_size * c, *shape[1:])
        params.append(full[:shape[0]].clone())

    # foreach_reduce: reduce_scatter_input [G, sum padded] in fp32, rank-major: rank g's padded chunks in order
    scatter = torch.zeros(local_size, sum(padded), dtype=torch.float32, device=send.device)
    for grad, offset, size, c in zip(unsharded_grads, _offsets(padded), padded, chunk):
        padded_grad = scatter[:, offset:offset + size].view(local_size, c, *grad.shape[1:])
        for g, piece in enumerate(torch.chunk(grad, local_size) if grad.shape[0] else ()):
            padded_grad[g, :piece.shape[0]] = piece
    reduced = scatter.new_empty(sum(padded))
    dist.reduce_scatter_tensor(reduced, scatter.view(-1), group=shard_group)
    dist.all_reduce(reduced, group=replicate_group)
    reduced /= world
    local_rank = dist.get_rank(shard_group)
    grads = []
    for shape, offset, c in zip(shapes, _offsets(padded), chunk):
        length = chunk_rows(shape[0], local_rank, local_size)[1]
        grads.append(reduced[offset:offset + c * math.prod(shape[1:])].view(c, *shape[1:])[:length].clone())
    return params, grads


def _offsets(sizes):
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += size
    return offsets


def cost(case, world_size):
    topology = topology_of(case, world_size)
    gpus, nodes = topology.gpus_per_node, topology.num_nodes
    numel = sum(math.prod(shape) for shape in case["shapes"])
    size = numel * dtype_of(case).itemsize
    shard_fp32 = 4 * numel / gpus
    return Cost(link_bytes=2 * ring_share(gpus) * size, network_bytes=2 * ring_share(nodes) * shard_fp32,
                hbm_bytes=2 * size + 2 * shard_fp32,
                pattern="all_gather(intra)+reduce_scatter(intra)+all_reduce(inter)")


def tolerance(case, world_size, dtype):
    if dtype != torch.float32:  # the gathered parameters (in a bf16 or fp16 run)
        return Tolerance.exact()
    return reduction_tolerance(torch.float32, world_size, 1.0 / world_size)


TESTS = (
    Case("uneven_rows", {"shapes": ((7, 5), (3, 5), (11,))}, tags=("uneven_sizes", "odd_sizes")),
    Case("empty_local_rank", {"shapes": ((3, 6), (2,), (9, 1))}, tags=("empty_rank", "uneven_sizes", "tiny"),
         note="at 4 GPUs per node a local rank holds no rows of the first two parameters"),
    Case("one_param", {"shapes": ((13,),)}, tags=("odd_sizes", "tiny")),
    Case("tiny_gqa_block", {"shapes": ((12, 12), (3, 12), (3, 12), (12, 12), (12,))},
         tags=("uneven_sizes", "empty_rank"),
         note="an attention unit (wq, wk, wv, wo, norm), 12 wide, 3 KV dims: at 4 GPUs per node a rank holds no K/V"),
    Case("rank3_param", {"shapes": ((5, 3, 4), (6,))}, tags=("layout", "odd_sizes", "uneven_sizes")),
)

BENCHMARKS = (
    Case("llama3_8b_attention", {"shapes": ((4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (4096,))},
         note="Llama-3-8B attention unit: wq, wk, wv, wo, attention_norm (41.9M parameters)"),
    Case("llama3_405b_kv_norms", {"shapes": ((1024, 16384), (1024, 16384), (16384,), (16384,))},
         note="Llama-3-405B wk, wv and the two norms (33.6M parameters)"),
    Case("llama3_70b_kv_norms", {"shapes": ((1024, 8192), (1024, 8192), (8192,), (8192,))},
         note="Llama-3-70B wk, wv and the two norms (16.8M parameters)"),
)

PROBLEM = Problem(
    name="hsdp_grad_sync", version=1, upstream_id=None, category="inter_node",
    source="PyTorch FSDP2 fully_shard on a 2-D (replicate, shard) DeviceMesh (HSDP; torchtitan "
           "data_parallel_replicate_degree): foreach_all_gather and foreach_reduce",
    world_sizes=WORLD_SIZES, nodes=NODES, tests=TESTS, benchmarks=BENCHMARKS, tolerance=tolerance,
    reference=reference, make_inputs=make_inputs, cost=cost,
)
