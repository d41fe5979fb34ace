"""Pipeline-parallel activations and gradients across nodes, one 1F1B steady-state exchange (Megatron-LM's
megatron/core/pipeline_parallel/p2p_communication.py: ``send_forward_recv_backward`` and
``send_backward_recv_forward`` issued together, i.e. ``_communicate(tensor_send_next, tensor_send_prev,
recv_prev=True, recv_next=True)`` as ``send_forward_backward_recv_forward_backward`` does), with the
pipeline stages on different nodes and tensor + sequence parallelism inside a node.

Topology (pkb.topology: W ranks on N nodes of G = W/N GPUs): pipeline stage s = node s (N stages), each
stage tensor parallel over its node's G ranks, TP rank = local rank. Megatron's rank order with
pp outermost: rank r is stage r // G, TP rank r % G, and its pipeline group (``pp_group``, the
inter-node group of pkb.kernels.topology) holds the ranks of TP rank r % G on every node, in stage
order. Activations are sequence parallel: a TP rank holds its 1/G of the sequence, tensor_shape =
(S/G, B, E) in Megatron's [s, b, h] layout (S % G == 0, as Megatron requires under sequence parallelism).

Per rank, in the run's precision (tensor_shape = (S/G, B, E)):
  output_tensor [S/G, B, E]: this stage's forward output shard, sent to the same TP rank of stage s+1
      (None on the last stage, whose output is the loss: Megatron sends nothing forward there)
  input_tensor_grad [S/G, B, E]: the gradient of this stage's input shard, sent to the same TP rank of
      stage s-1 (None on the first stage, whose input is the embedding: nothing to send back)
  tensor_shape (tuple of ints), pp_group (the rank's pipeline group)
-> (input_tensor, output_tensor_grad): the activation shard received from stage s-1 (the next
   microbatch's input; None on the first stage) and the gradient of this stage's output shard received
   from stage s+1 (None on the last stage), each [S/G, B, E] in the inputs' dtype: the structure
   Megatron returns. The inputs are left unchanged. Exact (deterministic). On 2 nodes stage 0 sends an
   activation and receives a gradient, stage 1 the other way round; on 4 nodes stages 1 and 2 do both.

The reference posts the four point-to-point operations in Megatron's deadlock-free ``_p2p_ops`` order
(even stages send before they receive, odd stages receive first), as isend/irecv on the world group.

Cost per rank, A = (S/G) B E b bytes (one shard, b bytes per element). Every shard must cross the network
(the peer is on another node); a middle stage sends two shards (activation forward, gradient back) and
receives two, an end stage one each way: network_bytes = A (2 nodes) or 2A (3 or more: the busiest, a
middle stage), per direction. The same TP rank on both sides holds the same 1/G of the sequence, so
nothing crosses NVLink: link_bytes = 0. HBM: read what it sends, write what it receives, 2 network_bytes.

Benchmarks (micro-batch 1, bf16): Llama-3-70B (E = 8192) at 8k tokens, Llama-3-405B (E = 16384) at 8k,
DeepSeek-V3 (E = 7168) at its 4k pretraining length, GPT-3 175B (E = 12288) at 2k.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance
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
    _, pp_group = node_groups(case, world_size)
    shape = shard_shape(case, world_size)
    output_tensor = buffer(case, gen, *shape) if stage < stages - 1 else None
    input_tensor_grad = buffer(case, gen, *shape) if stage > 0 else None
    return output_tensor, input_tensor_grad, shape, pp_group


def wait_all(works) -> None:
    """Wait for point-to-point requests (``isend``/``irecv`` answer None for a rank outside the group)."""
    for work in works:
        if work is not None:
            work.wait()


def reference(output_tensor, input_tensor_grad, tensor_shape, pp_group):
    stage, stages = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    first, last = stage == 0, stage == stages - 1
    like = output_tensor if output_tensor is not None else input_tensor_grad
    send_next = None if last else output_tensor
    send_prev = None if first else input_tensor_grad
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
    return recv_prev, recv_next


def cost(case, world_size):
    shape = shard_shape(case, world_size)
    shard = shape[0] * shape[1] * shape[2] * dtype_of(case).itemsize
    network = shard * (2 if topology_of(case, world_size).num_nodes > 2 else 1)
    return Cost(link_bytes=0.0, network_bytes=float(network), hbm_bytes=2.0 * network,
                pattern="point_to_point (pipeline neighbours, same TP rank, across nodes)")


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
    name="pipeline_internode", version=1, upstream_id=None, category="inter_node",
    source="Megatron-LM p2p_communication send_forward_recv_backward / send_backward_recv_forward (1F1B steady "
           "state), pipeline stages on separate nodes, TP + sequence parallelism inside a node",
    world_sizes=WORLD_SIZES, nodes=NODES, tests=TESTS, benchmarks=BENCHMARKS, tolerance=Tolerance.exact(),
    deterministic=True, reference=reference, make_inputs=make_inputs, cost=cost,
)
