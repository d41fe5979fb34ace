"""An honest KV-cache transfer that sends each sequence on its own, for kv_cache_transfer: every prefill TP rank
posts one isend per sequence (its heads of that sequence's tokens, to the decode rank of the sequence's
instance that holds them), every decode rank one irecv per sequence and prefill rank, tagged by sequence, and
writes each sequence's blocks as it lands. All its traffic crosses nodes (prefill on node 0, decode on the
others): torch.distributed point to point is the network leg, and the file passes --policy forbid-collectives.
"""

import torch
import torch.distributed as dist


def places(table, length, block, device):
    position = torch.arange(length, device=device)
    return table.long()[position // block], position % block


def solution(kv_cache, seq_lens, prefill_block_table, decode_instance, decode_block_table, prefill_tp, decode_tp):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ratio = prefill_tp // decode_tp
    lens, routed = seq_lens.tolist(), decode_instance.tolist()
    if rank < prefill_tp:
        works, payloads = [], []
        for s, length in enumerate(lens):
            blocks, slots = places(prefill_block_table[s], length, kv_cache.shape[3], kv_cache.device)
            payload = kv_cache[:, blocks, :, slots].permute(1, 2, 0, 3, 4).contiguous()  # [L, 2, T_s, hp, D]
            payloads.append(payload)
            works.append(dist.isend(payload, dst=prefill_tp + routed[s] * decode_tp + rank // ratio, tag=s))
        for work in works:
            work.wait()
        return kv_cache
    instance, tp_rank = divmod(rank - prefill_tp, decode_tp)
    layers, _, _, heads, block, head_dim = kv_cache.shape
    pending = []
    for s, length in enumerate(lens):
        if routed[s] != instance:
            continue
        parts = [torch.empty(layers, 2, length, heads // ratio, head_dim, dtype=kv_cache.dtype, device=kv_cache.device)
                 for _ in range(ratio)]
        works = [dist.irecv(part, src=tp_rank * ratio + j, tag=s) for j, part in enumerate(parts)]
        pending.append((s, length, parts, works))
    for s, length, parts, works in pending:
        for work in works:
            work.wait()
        blocks, slots = places(decode_block_table[s], length, block, kv_cache.device)
        kv_cache[:, :, blocks, :, slots] = torch.cat(parts, dim=3).permute(2, 0, 1, 3, 4)  # [T_s, L, 2, hd, D]
    return kv_cache
