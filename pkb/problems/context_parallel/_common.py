"""Helpers shared by the context-parallel problems: sub-group meshes, replica generators, the
Ulysses all-to-all, the ring shift, fp32 block attention with log-sum-exp, and the delta rule.

Communication here is c10d collectives only (``all_to_all_single``, ``all_gather_into_tensor``),
so every reference runs on gloo and NCCL alike; a point-to-point ring step is an
``all_to_all_single`` whose only non-empty split goes to the next rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pkb.problem import DEFAULT_PRECISION, PRECISIONS, Case, Cost

# The sequence-gather / head-scatter re-shard of Ulysses attention, and its inverse, at long context.
ULYSSES_RESHARD_BENCHMARKS = (
    Case("llama3_8b_128k", {"batch": 1, "seq": 131072, "heads": 32, "head_dim": 128},
         note="Llama-3-8B, 32 heads, 128k tokens"),
    Case("llama3_70b_64k", {"batch": 1, "seq": 65536, "heads": 64, "head_dim": 128},
         note="Llama-3-70B, 64 heads, 64k tokens"),
)

# Scores of one attention block are materialised at most this many fp32 elements at a time, so the
# references fit in device memory at 128k-token shapes (queries are processed in slices).
ATTENTION_SCORE_ELEMENTS = 1 << 28


def dtype_of(case: Case) -> torch.dtype:
    """The run's precision, which the harness sets on every case (``case["dtype"]``); bf16 on a bare case."""
    return getattr(torch, case["dtype"]) if "dtype" in case.params else PRECISIONS[DEFAULT_PRECISION]


# -- process-group meshes ---------------------------------------------------------------------------

_MESHES: dict[tuple[int, int, bool], tuple[list, list]] = {}


def mesh(inner_size: int, rank: int, world_size: int, outer_first: bool = False):
    """A 2-D mesh with ``inner_size`` consecutive ranks per inner group (Megatron's rank order).

    Returns (inner_group, outer_group, inner_index, outer_index) for ``rank``: the inner group holds
    ranks ``outer_index * inner_size + [0, inner_size)``, the outer group ranks ``inner_index + k *
    inner_size``. Every group is created once per process, by all ranks in the same order: the inner
    groups, then the outer ones; with ``outer_first`` a group of the whole world, the outer groups, then
    the inner ones (the order of upstream's ``_build_cp_dp_groups``). Outside a process group (the suite
    builds inputs in its own process to inspect them) the groups are None.
    """
    inner_index, outer_index = rank % inner_size, rank // inner_size
    if not dist.is_initialized():
        return None, None, inner_index, outer_index
    key = (inner_size, world_size, outer_first)
    if key not in _MESHES:
        outer_size = world_size // inner_size
        inner_ranks = [[o * inner_size + i for i in range(inner_size)] for o in range(outer_size)]
        outer_ranks = [[o * inner_size + i for o in range(outer_size)] for i in range(inner_size)]
        if outer_first:
            dist.new_group(list(range(world_size)))
            outer = [dist.new_group(ranks) for ranks in outer_ranks]
            inner = [dist.new_group(ranks) for ranks in inner_ranks]
        else:
            inner = [dist.new_group(ranks) for ranks in inner_ranks]
            outer = [dist.new_group(ranks) for ranks in outer_ranks]
        _MESHES[key] = (inner, outer)
    inner, outer = _MESHES[key]
    return inner[outer_index], outer[inner_index], inner_index, outer_index


def replica_generator(gen: torch.Generator, key: int) -> torch.Generator:
    """A generator that ranks passing the same ``key`` share (replicated data), seeded from ``gen.shared``.

    Every rank must call it the same number of times in the same order (each call draws once from
    ``gen.shared``); ranks with different keys get independent streams.
    """
    draw = int(torch.randint(0, 2**62, (1,), generator=gen.shared, device=gen.device))
    sub = torch.Generator(device=gen.device)
    sub.manual_seed((draw * 1_000_003 + 7919 * (key + 1)) % 2**63)
    return sub


def rand_normal(gen: torch.Generator, *shape: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    values = torch.randn(*shape, generator=gen, device=gen.device, dtype=torch.float32)
    return (values * scale).to(dtype)


def upstream_randn(case: Case, *shape: int, device) -> torch.Tensor:
    """One draw of upstream's factory: N(0, 1) drawn in the run's dtype on ``device`` from the global generator
    (seeded as upstream seeds it), ``torch.randn(shape, dtype=dtype, device=dev)``."""
    return torch.randn(shape, dtype=dtype_of(case), device=device)


def upstream_attention_layer(case: Case, s_local: int, local_heads: int, hidden_seed: int, weight_seed: int,
                             device) -> tuple:
    """Upstream's draws for a ring-attention layer (problems 55, 56): hidden [B, s_local, E] after seeding
    ``hidden_seed``, then w_qkv [3 * local_heads * D, E] and w_o [E, local_heads * D], N(0, 1) * 0.02 in
    the run's dtype, after seeding ``weight_seed``."""
    E = case["hidden"]
    local_width = local_heads * (E // case["heads"])
    torch.manual_seed(hidden_seed)
    hidden = upstream_randn(case, case["batch"], s_local, E, device=device)
    torch.manual_seed(weight_seed)
    w_qkv = upstream_randn(case, 3 * local_width, E, device=device) * 0.02
    w_o = upstream_randn(case, E, local_width, device=device) * 0.02
    return hidden, w_qkv, w_o


# -- communication ----------------------------------------------------------------------------------


def group_size(group) -> int:
    return dist.get_world_size(group)


def group_rank(group) -> int:
    return dist.get_rank(group)


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group=None) -> torch.Tensor:
    """Ulysses all-to-all: split ``x`` into W equal chunks on ``scatter_dim``, send chunk d to rank d,
    and concatenate what arrives from ranks 0..W-1 on ``gather_dim``."""
    world = group_size(group)
    if world == 1:
        return x.contiguous()
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    if x.shape[scatter_dim] % world:
        raise ValueError(f"dim {scatter_dim} of size {x.shape[scatter_dim]} does not split over {world} ranks")
    chunks = torch.stack(torch.tensor_split(x, world, dim=scatter_dim)).contiguous()  # [W, *chunk]
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received, chunks, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim).contiguous()


def all_to_all_cost(local_shape, dtype: torch.dtype, world_size: int) -> Cost:
    """One all-to-all of a rank's local tensor (S bytes), nccl-tests' count: it keeps its own 1/W and
    sends and receives the rest, link bytes (W-1)/W * S; HBM: read S, write S."""
    size = math.prod(local_shape) * dtype.itemsize
    return Cost(link_bytes=(world_size - 1) / world_size * size, hbm_bytes=2.0 * size, pattern="all_to_all")


def cut_padding(out: torch.Tensor, seq_dim: int, local_seq: int, unpadded_dim_size) -> torch.Tensor:
    """A gathered sequence (W local shards of ``local_seq``) cut back to ``unpadded_dim_size`` when that
    is given and not a multiple of W, as VeOmni does: the padding sits at the end."""
    world = out.shape[seq_dim] // local_seq
    if unpadded_dim_size and unpadded_dim_size % world != 0:
        out = out.narrow(seq_dim, 0, unpadded_dim_size).contiguous()
    return out


def all_gather(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """All ranks' ``x`` (equal shapes) concatenated on ``dim`` in rank order."""
    world = group_size(group)
    if world == 1:
        return x.contiguous()
    flat = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(flat, x.contiguous().view(-1), group=group)
    return torch.cat(flat.view(world, *x.shape).unbind(0), dim=dim)


def ring_shift(x: torch.Tensor, group=None) -> torch.Tensor:
    """Send ``x`` to the next rank of the group and return what the previous rank sent (one ring step)."""
    world = group_size(group)
    if world == 1:
        return x
    me = group_rank(group)
    n = x.numel()
    send_splits = [n if d == (me + 1) % world else 0 for d in range(world)]
    recv_splits = [n if s == (me - 1) % world else 0 for s in range(world)]
    received = torch.zeros(n, dtype=x.dtype, device=x.device)
    dist.all_to_all_single(received, x.contiguous().view(-1), recv_splits, send_splits, group=group)
    return received.view(x.shape)


# -- attention --------------------------------------------------------------------------------------

# Whole attention layers (projections + attention) at long context, shared by the layer problems.
ATTENTION_LAYER_BENCHMARKS = (
    Case("llama2_7b_32k_causal", {"batch": 1, "seq": 32768, "hidden": 4096, "heads": 32, "causal": True},
         note="Llama-2-7B layer, 32k tokens"),
    Case("h64_e8192_16k_causal", {"batch": 1, "seq": 16384, "hidden": 8192, "heads": 64, "causal": True},
         note="64 heads x 128, 16k tokens"),
)



def block_attention(q, k, v, scale: float, causal: bool = False, q_start: int = 0, k_start: int = 0):
    """Softmax attention of one (query block, key block) pair, with its log-sum-exp.

    q [B, Sq, Hq, D]; k, v [B, Sk, Hkv, D] with Hq % Hkv == 0 (GQA: query head h reads kv head
    h // (Hq / Hkv)). ``causal``: the query at global position q_start + i sees keys at
    k_start + j <= q_start + i. Returns out [B, Sq, Hq, Dv] and lse [B, Hq, Sq], both fp32; a query
    that sees no key gets out 0 and lse -inf.

    Where the mask is none or the plain causal one (the blocks Ulysses uses), this
    is torch's flash attention in the input dtype with fp32 softmax statistics, as the sources run
    it (flash-attn); other masks take the exact fp32 path (``attention_fp32``).
    """
    Sq, Sk = q.shape[1], k.shape[1]
    sees_all = not causal or k_start + Sk - 1 <= q_start
    plain_causal = causal and q_start == k_start and Sq == Sk
    if Sq and Sk and (sees_all or plain_causal) and q.dtype == k.dtype == v.dtype and q.shape[-1] == v.shape[-1]:
        return _flash_attention(q, k, v, scale, causal=plain_causal and not sees_all)
    return attention_fp32(q, k, v, scale, causal, q_start, k_start)


def _flash_attention(q, k, v, scale: float, causal: bool):
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
    if group > 1:
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, causal, False, scale=scale)[:2]
    elif not q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qh, kh, vh, 0.0, causal, scale=scale)
    else:
        return attention_fp32(q, k, v, scale, causal)
    return out.transpose(1, 2).float(), lse.float()


def attention_fp32(q, k, v, scale: float, causal: bool = False, q_start: int = 0, k_start: int = 0):
    """``block_attention`` computed exactly in fp32 (any mask offsets), chunked over queries."""
    B, Sq, Hq, _ = q.shape
    Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = Hq // Hkv
    kf = k.float().permute(0, 2, 3, 1).repeat_interleave(group, dim=1)  # [B, Hq, D, Sk]
    vf = v.float().permute(0, 2, 1, 3).repeat_interleave(group, dim=1)  # [B, Hq, Sk, Dv]
    out = torch.zeros(B, Sq, Hq, Dv, dtype=torch.float32, device=q.device)
    lse = torch.full((B, Hq, Sq), float("-inf"), dtype=torch.float32, device=q.device)
    if Sq == 0 or Sk == 0:
        return out, lse
    step = max(1, ATTENTION_SCORE_ELEMENTS // max(1, B * Hq * Sk))
    key_pos = k_start + torch.arange(Sk, device=q.device)
    for lo in range(0, Sq, step):
        hi = min(Sq, lo + step)
        qf = q[:, lo:hi].float().permute(0, 2, 1, 3)  # [B, Hq, s, D]
        scores = torch.matmul(qf, kf).mul_(scale)  # [B, Hq, s, Sk]
        if causal:
            query_pos = q_start + torch.arange(lo, hi, device=q.device)
            scores.masked_fill_(key_pos[None, :] > query_pos[:, None], float("-inf"))
        block_lse = torch.logsumexp(scores, dim=-1)  # [B, Hq, s]
        safe = torch.where(torch.isinf(block_lse), torch.zeros_like(block_lse), block_lse)
        probs = torch.exp(scores.sub_(safe.unsqueeze(-1)))
        out[:, lo:hi] = torch.matmul(probs, vf).permute(0, 2, 1, 3)
        lse[:, :, lo:hi] = block_lse
    return out, lse


def merge_attention(out, lse, block_out, block_lse):
    """Combine two partial softmax results over disjoint key sets (ring-flash-attn's LSE merge)."""
    new_lse = torch.logaddexp(lse, block_lse)
    finite = torch.isfinite(new_lse)
    w_old = torch.where(finite, torch.exp(lse - new_lse), torch.zeros_like(lse))
    w_new = torch.where(finite, torch.exp(block_lse - new_lse), torch.zeros_like(lse))
    to_out = lambda w: w.permute(0, 2, 1).unsqueeze(-1)  # noqa: E731  [B, H, S] -> [B, S, H, 1]
    return out * to_out(w_old) + block_out * to_out(w_new), new_lse


def ring_attention_fp32(q, k, v, scale: float, causal: bool, group=None):
    """Ring attention over ``group`` with the contiguous layout (rank i holds tokens [i*S, (i+1)*S)).

    Step s computes this rank's queries against the key/value block of rank (i - s) mod W, then
    passes the block on; with ``causal`` a block from a later rank is skipped and the diagonal block
    is causal (ring_flash_attn_func). Every block is exact fp32 attention (``attention_fp32``), as the
    upstream benchmark's reference computes it. Returns out [B, S, Hq, Dv] fp32 and lse [B, Hq, S] fp32.
    """
    world, me = group_size(group), group_rank(group)
    S = q.shape[1]
    out = lse = None
    kv = torch.cat([k, v], dim=-1)
    head_dim = k.shape[-1]
    for step in range(world):
        source = (me - step) % world
        if not causal or source <= me:
            block_out, block_lse = attention_fp32(q, kv[..., :head_dim], kv[..., head_dim:], scale, causal=causal,
                                                 q_start=me * S, k_start=source * S)
            out, lse = (block_out, block_lse) if out is None else merge_attention(out, lse, block_out, block_lse)
        if step + 1 < world:
            kv = ring_shift(kv, group)
    return out, lse


def attention_flops(pairs: float, num_heads: int, head_dim: int, value_dim=None) -> float:
    """QK^T and PV over ``pairs`` (query, key) pairs: 2*pairs*(D + Dv) per head."""
    value_dim = head_dim if value_dim is None else value_dim
    return 2.0 * pairs * num_heads * (head_dim + value_dim)


def project_qkv(hidden, w_qkv, num_heads: int):
    """q, k, v [B, S, num_heads, D] from hidden [B, S, E] @ w_qkv^T ([3*num_heads*D, E], rows q | k | v).

    A GEMM in the input dtype, as the source's bf16 linear layer runs it (fp32 accumulation inside
    the GEMM library, rounded once).
    """
    qkv = torch.matmul(hidden, w_qkv.t())
    B, S, _ = qkv.shape
    return qkv.view(B, S, 3, num_heads, -1).unbind(2)


def causal_pairs(n: int) -> int:
    """(query, key) pairs a causal mask keeps in a diagonal block of n tokens: n(n+1)/2."""
    return n * (n + 1) // 2


def attention_backward_fp32(dout, q, k, v, delta, lse, scale: float, causal: bool = False, q_start: int = 0,
                            k_start: int = 0):
    """Gradients of one (query block, key block) pair given the global lse and delta = rowsum(dout*out).

    Shapes as ``attention_fp32``; delta and lse [B, Hq, Sq] fp32. P = exp(scale*QK^T - lse);
    dV = P^T dO; dS = P * (dO V^T - delta); dQ = scale * dS K; dK = scale * dS^T Q (GQA: summed over
    the query heads of a kv head). Returns dq [B, Sq, Hq, D], dk, dv [B, Sk, Hkv, D] in fp32.
    """
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    kf = k.float().permute(0, 2, 1, 3).repeat_interleave(group, dim=1)  # [B, Hq, Sk, D]
    vf = v.float().permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    dq = torch.zeros(B, Hq, Sq, D, dtype=torch.float32, device=q.device)
    dk = torch.zeros(B, Hq, Sk, D, dtype=torch.float32, device=q.device)
    dv = torch.zeros(B, Hq, Sk, v.shape[3], dtype=torch.float32, device=q.device)
    step = max(1, ATTENTION_SCORE_ELEMENTS // max(1, B * Hq * Sk))
    key_pos = k_start + torch.arange(Sk, device=q.device)
    for lo in range(0, Sq, step):
        hi = min(Sq, lo + step)
        qf = q[:, lo:hi].float().permute(0, 2, 1, 3)  # [B, Hq, s, D]
        dof = dout[:, lo:hi].float().permute(0, 2, 1, 3)
        scores = torch.matmul(qf, kf.transpose(-1, -2)).mul_(scale)
        if causal:
            query_pos = q_start + torch.arange(lo, hi, device=q.device)
            scores.masked_fill_(key_pos[None, :] > query_pos[:, None], float("-inf"))
        probs = torch.exp(scores - lse[:, :, lo:hi].unsqueeze(-1))
        dv += torch.matmul(probs.transpose(-1, -2), dof)
        dscores = probs * (torch.matmul(dof, vf.transpose(-1, -2)) - delta[:, :, lo:hi].unsqueeze(-1))
        dq[:, :, lo:hi] = torch.matmul(dscores, kf) * scale
        dk += torch.matmul(dscores.transpose(-1, -2), qf) * scale
    fold = lambda g: g.view(B, Hkv, group, Sk, -1).sum(2).permute(0, 2, 1, 3)  # noqa: E731
    return dq.permute(0, 2, 1, 3), fold(dk), fold(dv)


# -- delta rule (Gated DeltaNet, Kimi Delta Attention) -------------------------------------------------


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's l2norm: x / sqrt(sum(x^2) + eps) over the last dimension, in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def delta_rule_chunked(q, k, v, log_decay, beta, scale: float, chunk_size: int = 64):
    """The gated delta rule in fp32, evaluated chunk by chunk (exact, the WY form FLA's kernels use).

    q, k [B, T, H, K]; v [B, T, H, V]; log_decay [B, T, H, K] (<= 0; a scalar gate is expanded over
    K); beta [B, T, H]. With state S [K, V] starting at 0, token by token:
        S = diag(exp(g_t)) S;  S = S + beta_t * k_t (v_t - S^T k_t)^T;  o_t = scale * S^T q_t.
    Returns o [B, T, H, V] fp32. ``delta_rule_recurrent`` is the same recurrence one token at a time.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))  # [B, H, T, *]
    gf = log_decay.float().transpose(1, 2)
    bf = beta.float().transpose(1, 2)  # [B, H, T]
    state = torch.zeros(B, H, K, V, dtype=torch.float32, device=q.device)
    out = torch.empty(B, H, T, V, dtype=torch.float32, device=q.device)
    for lo in range(0, T, chunk_size):
        hi = min(T, lo + chunk_size)
        C = hi - lo
        qc, kc, vc, bc = qf[:, :, lo:hi] * scale, kf[:, :, lo:hi], vf[:, :, lo:hi], bf[:, :, lo:hi]
        G = gf[:, :, lo:hi].cumsum(dim=2)  # [B, H, C, K]: decay from the chunk start through token t
        lower_eq = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        diff = G.unsqueeze(3) - G.unsqueeze(2)  # [B, H, C(t), C(s), K]: G_t - G_s
        decay = torch.exp(diff.masked_fill(~lower_eq[:, :, None], float("-inf")))
        kk = torch.einsum("bhtk,bhsk,bhtsk->bhts", kc, kc, decay).tril(-1)
        qk = torch.einsum("bhtk,bhsk,bhtsk->bhts", qc, kc, decay)
        k_decayed = kc * torch.exp(G)
        rhs = bc.unsqueeze(-1) * (vc - k_decayed @ state)
        system = torch.eye(C, device=q.device) + bc.unsqueeze(-1) * kk
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out[:, :, lo:hi] = (qc * torch.exp(G)) @ state + qk @ u
        G_end = G[:, :, -1:]  # [B, H, 1, K]
        state = torch.exp(G_end).transpose(2, 3) * state + (kc * torch.exp(G_end - G)).transpose(2, 3) @ u
    return out.transpose(1, 2)


def delta_rule_recurrent(q, k, v, log_decay, beta, scale: float):
    """The same recurrence as ``delta_rule_chunked``, one token at a time (FLA's naive reference)."""
    B, T, H, K = q.shape
    state = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float32, device=q.device)
    outs = []
    for t in range(T):
        state = state * torch.exp(log_decay[:, t].float()).unsqueeze(-1)
        kt, vt = k[:, t].float(), v[:, t].float()
        delta = beta[:, t].float().unsqueeze(-1) * (vt - torch.einsum("bhkv,bhk->bhv", state, kt))
        state = state + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t].float() * scale))
    return torch.stack(outs, dim=1)


def delta_rule_flops(tokens: int, heads: int, key_dim: int, value_dim: int, chunk_size: int = 64) -> float:
    """Chunked delta rule per head and token: state read/update (3 K x V products: S^T k, S^T q, k u^T)
    plus the intra-chunk products (C x K for k k^T and q k^T, C x V for the two C-wide mixes)."""
    per_token = 2.0 * (3 * key_dim * value_dim + chunk_size * (2 * key_dim + 2 * value_dim))
    return per_token * tokens * heads


def softplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x.float())


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
