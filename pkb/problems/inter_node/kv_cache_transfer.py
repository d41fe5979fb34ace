"""Prefill-to-decode KV-cache transfer across nodes (disaggregated serving: SGLang's PD disaggregation,
``MooncakeKVManager.send_kvcache_slice`` in sglang/srt/disaggregation/mooncake/conn.py, the heterogeneous-TP
path where several prefill TP ranks write into one decode TP rank; vLLM's ``NixlConnector``; Mooncake's
transfer engine). Between the nodes only torch.distributed moves data here, where those use RDMA writes.

Topology (pkb.topology: W ranks on N nodes of G = W/N GPUs). Node 0 is the prefill instance, tensor
parallel over its G ranks: prefill_tp = G, rank p < G is its TP rank p. Nodes 1..N-1 hold the decode
instances, with a smaller TP degree: r = min(tp_ratio, G) (tp_ratio a case parameter, 2 by default, 1 in
one test), decode_tp = G / r, so each decode node holds r instances of decode_tp consecutive ranks:
rank q >= G is TP rank t = (q - G) % decode_tp of decode instance i = (q - G) // decode_tp; there are
I = (W - G) / decode_tp = (N - 1) r instances. (W=4 on 2 nodes: prefill TP 2, two decode instances of
TP 1 on ranks 2 and 3; W=8 on 2 nodes: prefill TP 4, decode instances {4, 5} and {6, 7} of TP 2; W=8 on 4
nodes: prefill TP 2, six decode instances of TP 1 on ranks 2..7; a node of 1 GPU: r = 1, TP 1 both sides.)

Heads: H KV heads split contiguously over TP ranks: prefill rank p holds heads [p hp, (p+1) hp),
hp = H / G; decode TP rank t holds heads [t hd, (t+1) hd), hd = r hp = H / decode_tp, i.e. the heads of
prefill ranks t r .. t r + r - 1, in that order (its head j*hp + k is prefill rank t r + j's head k).

Sequences: S prompts of seq_lens[s] tokens (L layers of K and V each), all prefilled on node 0; the
router sends sequence s to decode instance decode_instance[s] (round robin s % I by default; the case
``route="first"`` sends all to instance 0). Token n of sequence s lives
  on every prefill rank at kv_cache[l, prefill_block_table[s, n // Bp], c, n % Bp, :, :]
  on every rank of its decode instance at kv_cache[l, c, decode_block_table[s, n // Bd], :, n % Bd, :]
for layer l and c = 0 (K) / 1 (V); the tables are padded with -1 past a sequence's blocks. Block ids are
distinct within the prefill pool and within each decode instance's pool, drawn at random (the same
tables on every rank: the block ids the two sides exchanged when the request was admitted).

Per rank (every rank gets the same metadata; the run's precision for caches, int32 for the tables):
  kv_cache: prefill rank [L, NBp, 2, Bp, hp, D] (FlashInfer's NHD paged layout per layer, layers stacked)
            decode rank  [L, 2, NBd, hd, Bd, D] (K/V outermost as FlashAttention's, HND blocks: head-major)
  seq_lens [S] int32, prefill_block_table [S, max_s ceil(len/Bp)] int32, decode_instance [S] int32,
  decode_block_table [S, max_s ceil(len/Bd)] int32, prefill_tp (int, = G), decode_tp (int)
-> kv_cache, the same tensor: on a decode rank written in place with the K and V of its heads of every
token of its instance's sequences at the places above; every other element (other blocks, the slots past
a sequence's end in its last block) keeps its old value. Prefill ranks return their cache unchanged.
The caches start random (a decode pool's stale contents), so a transfer that is skipped, lands in the
wrong block, slot, head or K/V plane, or touches other slots is a mismatch. Exact (deterministic).

Cost per rank, T = sum(seq_lens) tokens, b bytes per element. Every K and V element of every token must
leave node 0 exactly once: L T 2 H D b bytes out of node 0 over its G NICs, so network_bytes =
L T 2 H D b / G per direction (a prefill rank's own heads; each decode node takes in at most as much:
its instances' share of T). Nothing has to cross NVLink: each prefill rank's heads go whole to one decode
TP rank per instance, so link_bytes = 0 (a kernel may spread a busy decode NIC's inflow over its node's
other NICs and NVLink; the bound does not count that). HBM: the busiest rank, max(a prefill rank's read
L T 2 hp D b, a decode rank's write L T_i 2 hd D b for the T_i tokens of its instance).

Benchmarks (Llama-3 GQA: 8 KV heads of 128, bf16; prefill blocks of 16 tokens as vLLM's default, decode
blocks of 32): Llama-3-70B (80 layers) one 8k prompt, and a batch of 8 prompts of 2k; Llama-3-8B (32
layers) one 32k prompt with decode blocks of 64.
"""


import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance
from pkb.problems.inter_node._common import NODES, WORLD_SIZES, buffer, dtype_of, topology_of

SPARE_BLOCKS = 3  # free blocks in every pool beyond what the sequences take, so block ids are not a permutation


# -- the layout a case runs on ----------------------------------------------------------------------


def tp_degrees(case, world_size) -> tuple[int, int]:
    """(prefill_tp, decode_tp): prefill TP over node 0's G ranks, decode TP G / min(tp_ratio, G)."""
    gpus = topology_of(case, world_size).gpus_per_node
    ratio = min(case.get("tp_ratio", 2), gpus)
    if gpus % ratio:
        raise ValueError(f"tp_ratio {ratio} does not divide {gpus} GPUs per node")
    if case["kv_heads"] % gpus:
        raise ValueError(f"{case['kv_heads']} KV heads do not split over a prefill TP of {gpus}")
    return gpus, gpus // ratio


def num_instances(case, world_size) -> int:
    prefill_tp, decode_tp = tp_degrees(case, world_size)
    return (world_size - prefill_tp) // decode_tp


def routes(case, world_size) -> list[int]:
    """The decode instance of each sequence: round robin, or all to instance 0 (``route="first"``)."""
    instances = num_instances(case, world_size)
    route = case.get("route", "round_robin")
    if route == "round_robin":
        return [s % instances for s in range(len(case["seq_lens"]))]
    if route == "first":
        return [0] * len(case["seq_lens"])
    raise ValueError(f"unknown route {route!r}")


def blocks_of(length: int, block: int) -> int:
    return -(-length // block)


def pool_sizes(case, world_size) -> tuple[int, int]:
    """(NBp, NBd): blocks in the prefill pool and in every decode rank's pool."""
    lens, Bp, Bd = case["seq_lens"], case["prefill_block"], case["decode_block"]
    per_instance = [0] * num_instances(case, world_size)
    for length, instance in zip(lens, routes(case, world_size)):
        per_instance[instance] += blocks_of(length, Bd)
    return sum(blocks_of(n, Bp) for n in lens) + SPARE_BLOCKS, max(per_instance) + SPARE_BLOCKS


def block_table(gen, lens, block: int, pool: int, device) -> torch.Tensor:
    """[S, max blocks] int32: distinct random block ids of a pool of ``pool``, -1 past a sequence's blocks.
    Draws from ``gen.shared`` only (the same on every rank) and reads no tensor value (fake tensors work)."""
    counts = [blocks_of(n, block) for n in lens]
    table = torch.full((len(lens), max(counts, default=0)), -1, dtype=torch.int32, device=device)
    ids = torch.randperm(pool, generator=gen.shared, device=device).to(torch.int32)
    start = 0
    for s, count in enumerate(counts):
        table[s, :count] = ids[start:start + count]
        start += count
    return table


def make_inputs(case, rank, world_size, gen):
    prefill_tp, decode_tp = tp_degrees(case, world_size)
    lens, instances = list(case["seq_lens"]), routes(case, world_size)
    L, H, D, Bp, Bd = case["layers"], case["kv_heads"], case["head_dim"], case["prefill_block"], case["decode_block"]
    NBp, NBd = pool_sizes(case, world_size)
    device = gen.device
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    decode_instance = torch.tensor(instances, dtype=torch.int32, device=device)
    prefill_table = block_table(gen, lens, Bp, NBp, device)
    decode_table = torch.full((len(lens), max(blocks_of(n, Bd) for n in lens)), -1, dtype=torch.int32, device=device)
    for instance in range(num_instances(case, world_size)):  # each decode instance allocates from its own pool
        mine = [s for s in range(len(lens)) if instances[s] == instance]
        if mine:
            rows = block_table(gen, [lens[s] for s in mine], Bd, NBd, device)
            decode_table[mine, :rows.shape[1]] = rows
    if rank < prefill_tp:
        kv_cache = buffer(case, gen, L, NBp, 2, Bp, H // prefill_tp, D)
    else:
        kv_cache = buffer(case, gen, L, 2, NBd, H // decode_tp, Bd, D)
    return kv_cache, seq_lens, prefill_table, decode_instance, decode_table, prefill_tp, decode_tp


# -- the reference -----------------------------------------------------------------------------------


def token_places(table: torch.Tensor, lens: list[int], seqs: list[int], block: int) -> tuple[torch.Tensor, ...]:
    """(block ids, slots) of every token of ``seqs``, sequence by sequence, in token order."""
    device = table.device
    blocks, slots = [], []
    for s in seqs:
        position = torch.arange(lens[s], device=device)
        blocks.append(table[s].long()[position // block])
        slots.append(position % block)
    empty = torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat(blocks) if blocks else empty, torch.cat(slots) if slots else empty


def wait_all(works) -> None:
    """Wait for point-to-point requests (``isend``/``irecv`` answer None for a rank outside the group)."""
    for work in works:
        if work is not None:
            work.wait()


def reference(kv_cache, seq_lens, prefill_block_table, decode_instance, decode_block_table, prefill_tp, decode_tp):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ratio = prefill_tp // decode_tp
    lens, routed = seq_lens.tolist(), decode_instance.tolist()
    instances = (world_size - prefill_tp) // decode_tp
    seqs_of = [[s for s in range(len(lens)) if routed[s] == i] for i in range(instances)]
    if rank < prefill_tp:  # a prefill TP rank: its heads of each instance's tokens to that instance's TP rank
        block = kv_cache.shape[3]
        works, payloads = [], []
        for instance, seqs in enumerate(seqs_of):
            blocks, slots = token_places(prefill_block_table, lens, seqs, block)
            if not blocks.numel():
                continue
            payload = kv_cache[:, blocks, :, slots].permute(1, 2, 0, 3, 4).contiguous()  # [L, 2, T_i, hp, D]
            payloads.append(payload)
            works.append(dist.isend(payload, dst=prefill_tp + instance * decode_tp + rank // ratio))
        wait_all(works)
        return kv_cache
    instance, tp_rank = divmod(rank - prefill_tp, decode_tp)
    layers, _, _, heads, block, head_dim = kv_cache.shape
    blocks, slots = token_places(decode_block_table, lens, seqs_of[instance], block)
    if not blocks.numel():
        return kv_cache
    parts = [torch.empty(layers, 2, blocks.numel(), heads // ratio, head_dim, dtype=kv_cache.dtype,
                         device=kv_cache.device) for _ in range(ratio)]
    works = [dist.irecv(part, src=tp_rank * ratio + j) for j, part in enumerate(parts)]
    wait_all(works)
    received = torch.cat(parts, dim=3)  # [L, 2, T_i, hd, D]: prefill rank t r + j's heads at j hp
    kv_cache[:, :, blocks, :, slots] = received.permute(2, 0, 1, 3, 4)  # [T_i, L, 2, hd, D]
    return kv_cache


# -- cost --------------------------------------------------------------------------------------------


def cost(case, world_size):
    prefill_tp, decode_tp = tp_degrees(case, world_size)
    itemsize = dtype_of(case).itemsize
    L, H, D = case["layers"], case["kv_heads"], case["head_dim"]
    per_head_token = L * 2 * D * itemsize  # K and V of one head, one token, every layer
    tokens = sum(case["seq_lens"])
    per_instance = [0] * num_instances(case, world_size)
    for length, instance in zip(case["seq_lens"], routes(case, world_size)):
        per_instance[instance] += length
    prefill_rank = tokens * (H // prefill_tp) * per_head_token
    decode_rank = max(per_instance) * (H // decode_tp) * per_head_token
    return Cost(link_bytes=0.0, network_bytes=float(prefill_rank), hbm_bytes=float(max(prefill_rank, decode_rank)),
                pattern="point_to_point (prefill TP ranks -> decode TP ranks, across nodes)")


def _case(name, seq_lens, layers=2, kv_heads=4, head_dim=8, prefill_block=4, decode_block=8, **extra):
    tags, note = extra.pop("tags", ()), extra.pop("note", "")
    params = {"seq_lens": tuple(seq_lens), "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
              "prefill_block": prefill_block, "decode_block": decode_block, **extra}
    return Case(name, params, tags=tags, note=note)


TESTS = (
    _case("uneven", (5, 17, 1, 9), head_dim=12, prefill_block=4, decode_block=3, tags=("uneven_sizes", "odd_sizes"),
          note="four prompts of uneven lengths; decode blocks of 3 tokens against prefill blocks of 4"),
    _case("single_token", (1,), layers=1, prefill_block=4, decode_block=8, tags=("tiny", "empty_rank"),
          note="one prompt of one token: one partly filled block on each side; other decode instances get nothing"),
    _case("block_aligned", (8, 16, 24), head_dim=4, prefill_block=8, decode_block=16, tags=("argument_value",),
          note="prompts that end on block boundaries on both sides"),
    _case("same_tp", (7, 3, 11), layers=3, head_dim=6, prefill_block=5, decode_block=2, tp_ratio=1,
          tags=("argument_value", "odd_sizes"), note="decode TP = prefill TP: only the block size and layout change"),
    _case("all_to_one", (6, 13, 2), head_dim=8, prefill_block=4, decode_block=5, route="first",
          tags=("skewed", "empty_rank"), note="the router sends every prompt to decode instance 0"),
    _case("heads8_odd", (3, 10, 7, 1, 12), layers=1, kv_heads=8, head_dim=5, prefill_block=2, decode_block=7,
          tags=("odd_sizes", "uneven_sizes"), note="8 KV heads of 5, prefill blocks of 2 tokens, decode blocks of 7"),
)

LLAMA3 = {"kv_heads": 8, "head_dim": 128, "prefill_block": 16}
BENCHMARKS = (
    _case("llama3_70b_8k", (8192,), layers=80, decode_block=32, **LLAMA3,
          note="Llama-3-70B (80 layers, 8 KV heads x 128), one 8k-token prompt: 2.5 GiB of bf16 KV"),
    _case("llama3_70b_8x2k", (2048,) * 8, layers=80, decode_block=32, **LLAMA3,
          note="Llama-3-70B, a batch of 8 prompts of 2k tokens, round robin over the decode instances"),
    _case("llama3_8b_32k", (32768,), layers=32, decode_block=64, **LLAMA3,
          note="Llama-3-8B (32 layers, 8 KV heads x 128), one 32k-token prompt: 4 GiB of bf16 KV"),
)

PROBLEM = Problem(
    name="kv_cache_transfer", version=1, upstream_id=None, category="inter_node",
    source="SGLang PD disaggregation (MooncakeKVManager.send_kvcache_slice, heterogeneous TP); vLLM NixlConnector; "
           "Mooncake transfer engine",
    world_sizes=WORLD_SIZES, nodes=NODES, tests=TESTS, benchmarks=BENCHMARKS, tolerance=Tolerance.exact(),
    deterministic=True, reference=reference, make_inputs=make_inputs, cost=cost,
)
