"""Pipeline-parallel stage boundaries across nodes with tensor + sequence parallelism inside each node: one
1F1B steady-state exchange of Megatron-LM (megatron/core/pipeline_parallel/p2p_communication.py,
``send_forward_backward_recv_forward_backward``: ``_communicate(tensor_send_next, tensor_send_prev,
recv_prev=True, recv_next=True)``) together with the sequence-parallel collectives at the two ends of the
stage (megatron/core/tensor_parallel/mappings.py): the all-gather of the sequence its first layer's
column-parallel linear needs (``gather_from_sequence_parallel_region``) and the reduce-scatter of that input's
gradient (``reduce_scatter_to_sequence_parallel_region``, its backward), and the same all-gather of the output's
gradient its last layer's row-parallel linear needs in its backward. On the wire between stages go sequence
shards; inside a stage the node's GPUs gather them (NVLink).

Topology (pkb.topology: W ranks on N nodes of G = W/N GPUs): pipeline stage s = node s (N stages), each stage
tensor and sequence parallel over its node's G ranks, TP rank = local rank (Megatron's order with pp
outermost: rank r is stage r // G, TP rank r % G). ``pp_group`` holds the ranks of TP rank r % G on every node in
stage order (the inter-node group), ``tp_group`` the stage's G ranks (the intra-node group). A sequence shard is
(S/G, B, E) in Megatron's [s, b, h] layout (S % G == 0, as sequence parallelism requires): TP rank t holds
tokens [t S/G, (t+1) S/G).

Per rank, in the run's precision:
  output_tensor [S/G, B, E]: this stage's output shard (its last layer's row-parallel linear reduce-scatters
      into sequence shards), sent to the same TP rank of stage s+1 (None on the last stage: the loss)
  input_tensor_grad [S, B, E]: this TP rank's part of the gradient of the stage's input, a partial sum over the
      TP ranks (its first layer's column-parallel dX = dY W_t^T), reduce-scattered (sum) over tp_group into
      this rank's shard, which goes to the same TP rank of stage s-1 (None on the first stage)
  tensor_shape (S/G, B, E), pp_group, tp_group
-> (input_tensor, output_tensor_grad), each [S, B, E] in the inputs' dtype: the stage's next input, the shards
   its G ranks received from stage s-1 gathered in TP-rank order (None on the first stage), and the gradient
   of its output, the shards received from stage s+1 gathered likewise (None on the last stage). The inputs are
   left unchanged. On 2 nodes stage 0 sends an activation shard and gets an output gradient, stage 1 the other
   way round; on 4 nodes stages 1 and 2 do both.

The reference reduce-scatters the input gradient (in fp32, rounded once), posts the four point-to-point
operations in Megatron's deadlock-free ``_p2p_ops`` order (even stages send before they receive, odd stages
receive first) as isend/irecv on the world group, then all-gathers what arrived: the network and NVLink one
after the other, where a kernel can overlap them (gather each piece inside the node as it arrives, reduce the
gradient while the activation is in flight).
Tolerance: output_tensor_grad holds sums of G partial gradients (``reduction_tolerance`` of G terms);
input_tensor holds copies, far inside that (a shard moved wrong is off by whole values).

Cost per rank (the busiest stage), A = (S/G) B E b bytes (one shard, b bytes per element):
- network: every shard crosses to the neighbouring stage's same TP rank once: an end stage sends one shard and
  receives one, a middle stage two of each: A (2 nodes) or 2A (3 or more) per direction.
- NVLink: each all-gather of G shards moves (G-1) A per rank, the reduce-scatter of the [S, B, E] partial
  gradient (G-1)/G of it, (G-1) A (nccl-tests' counts): the last stage 2 (G-1) A (input gather, gradient
  reduce-scatter), a middle stage 3 (G-1) A, the first (G-1) A; the busiest 2 (G-1) A on 2 nodes, 3 (G-1) A on
  more.
- HBM: read what it sends or reduces, write what it gathers: the last stage 2 G A, a middle stage 3 G A + A.

Benchmarks (micro-batch 1, bf16): Llama-3-70B (E = 8192) at 8k tokens, Llama-3-405B (E = 16384) at 8k,
DeepSeek-V3 (E = 7168) at its 4k pretraining length, GPT-3 175B (E = 12288) at 2k.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, reduction_tolerance
from pkb.problems.inter_node._common import NODES, WORLD_SIZES, buffer, dtype_of, node_groups, topology_of


def shard_shape(case, world_size) -> tuple[int, int, int]:
    """(S/G, B, E): a TP rank's sequence-parallel activation shard in Megatron's [s, b, h] layout."""
    gpus = topology_of(case, world_size).gpus_per_node
    if case["seq"] % gpus:
        raise ValueError(f"sequence {case['seq']} does not split over {gpus} TP ranks (sequence parallelism)")
    return case["seq"] // gpus, case["batch"], case["hidden"]


def make_inputs(case, rank, world_size, gen):
    topology = topology_of(case, world_size)
    stage, stages = topology.node_of(rank), topology.num_nodes
    tp_group, pp_group = node_groups(case, world_size)
    shape = shard_shape(case, world_size)
    output_tensor = buffer(case, gen, *shape) if stage < stages - 1 else None
    input_tensor_grad = buffer(case, gen, case["seq"], *shape[1:]) if stage > 0 else None
    return output_tensor, input_tensor_grad, shape, pp_group, tp_group


def wait_all(works) -> None:
    """Wait for point-to-point requests (``isend``/``irecv`` answer None for a rank outside the group)."""
    for work in works:
        if work is not None:
            work.wait()


def gather_sequence(shard, tp_group):
    """[S/G, B, E] shards of the G TP ranks -> [S, B, E] in TP-rank order (gather_from_sequence_parallel_region)."""
    if shard is None:
        return None
    gathered = shard.new_empty(shard.shape[0] * dist.get_world_size(tp_group), *shard.shape[1:])
    dist.all_gather_into_tensor(gathered, shard, group=tp_group)
    return gathered


def reference(output_tensor, input_tensor_grad, tensor_shape, pp_group, tp_group):
    stage, stages = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    first, last = stage == 0, stage == stages - 1
    like = output_tensor if output_tensor is not None else input_tensor_grad
    send_prev = None
    if not first:  # reduce_scatter_to_sequence_parallel_region, summed in fp32 (or finer)
        accumulate = torch.promote_types(input_tensor_grad.dtype, torch.float32)
        send_prev = input_tensor_grad.new_empty(tensor_shape, dtype=accumulate)
        dist.reduce_scatter_tensor(send_prev, input_tensor_grad.to(accumulate), group=tp_group)
        send_prev = send_prev.to(like.dtype)
    send_next = None if last else output_tensor
    recv_prev = None if first else torch.empty(tensor_shape, dtype=like.dtype, device=like.device)
    recv_next = None if last else torch.empty(tensor_shape, dtype=like.dtype, device=like.device)
    prev_rank = None if first else dist.get_global_rank(pp_group, stage - 1)
    next_rank = None if last else dist.get_global_rank(pp_group, stage + 1)
    # Megatron's _p2p_ops order: even stages send first, odd stages receive first, so that on NCCL each pair
    # of neighbours posts its two transfers in the same order (activation forward, then gradient back).
    if stage % 2 == 0:
        order = (("send", send_next, next_rank), ("recv", recv_prev, prev_rank),
                 ("send", send_prev, prev_rank), ("recv", recv_next, next_rank))
    else:
        order = (("recv", recv_prev, prev_rank), ("send", send_next, next_rank),
                 ("recv", recv_next, next_rank), ("send", send_prev, prev_rank))
    works = []
    for kind, tensor, peer in order:
        if tensor is not None:
            works.append(dist.isend(tensor, dst=peer) if kind == "send" else dist.irecv(tensor, src=peer))
    wait_all(works)
    return gather_sequence(recv_prev, tp_group), gather_sequence(recv_next, tp_group)


def cost(case, world_size):
    topology = topology_of(case, world_size)
    shape = shard_shape(case, world_size)
    shard = shape[0] * shape[1] * shape[2] * dtype_of(case).itemsize
    gpus, middle = topology.gpus_per_node, topology.num_nodes > 2
    return Cost(link_bytes=float((3 if middle else 2) * (gpus - 1) * shard),
                network_bytes=float(shard * (2 if middle else 1)),
                hbm_bytes=float((3 * gpus + 1) * shard if middle else 2 * gpus * shard),
                pattern="reduce_scatter(intra)+point_to_point(inter)+all_gather(intra)")


def tolerance(case, world_size, dtype):
    return reduction_tolerance(dtype, topology_of(case, world_size).gpus_per_node)


TESTS = (
    Case("odd", {"seq": 12, "batch": 3, "hidden": 37}, tags=("odd_sizes",),
         note="3 or 6 tokens per TP rank, a micro-batch of 3, hidden 37"),
    Case("one_token", {"seq": 4, "batch": 1, "hidden": 3}, tags=("tiny",),
         note="one or two tokens per TP rank, hidden 3"),
    Case("long_thin", {"seq": 1028, "batch": 1, "hidden": 5}, tags=("shape_regime", "odd_sizes"),
         note="257 or 514 tokens per TP rank, hidden 5"),
    Case("mb4", {"seq": 20, "batch": 4, "hidden": 64}, tags=("shape_regime",),
         note="a micro-batch of 4 sequences of 20 tokens"),
)

BENCHMARKS = (
    Case("llama3_70b_s8k", {"seq": 8192, "batch": 1, "hidden": 8192},
         note="Llama-3-70B, hidden 8192, micro-batch 1 x 8k tokens: 128 MiB of bf16 activation per stage"),
    Case("llama3_405b_s8k", {"seq": 8192, "batch": 1, "hidden": 16384},
         note="Llama-3-405B, hidden 16384, micro-batch 1 x 8k tokens"),
    Case("deepseek_v3_s4k", {"seq": 4096, "batch": 1, "hidden": 7168},
         note="DeepSeek-V3, hidden 7168, micro-batch 1 x 4k tokens (its pretraining length)"),
    Case("gpt3_175b_s2k", {"seq": 2048, "batch": 1, "hidden": 12288},
         note="GPT-3 175B, hidden 12288, micro-batch 1 x 2k tokens"),
)

PROBLEM = Problem(
    name="pipeline_internode", version=2, upstream_id=None, category="inter_node",
    source="Megatron-LM p2p_communication send_forward_backward_recv_forward_backward (1F1B steady state) with the "
           "sequence-parallel all-gather and reduce-scatter at the stage's ends (tensor_parallel.mappings), pipeline "
           "stages on separate nodes, TP + sequence parallelism inside a node",
    world_sizes=WORLD_SIZES, nodes=NODES, tests=TESTS, benchmarks=BENCHMARKS, tolerance=tolerance,
    reference=reference, make_inputs=make_inputs, cost=cost,
)
