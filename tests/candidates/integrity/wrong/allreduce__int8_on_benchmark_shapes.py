"""WRONG: an int8-compressed all-reduce (one scale per 64 elements) on the benchmark shapes, honest elsewhere.

The benchmark shapes are public (rows of 1024 elements: 2, 32, 512, 8192, 131072, 524288 rows). pkb judges a benchmark
case against the reference's output, not the exact answer (``_exact_answers`` returns None for ``case.kind ==
"benchmarks"``): no sensitivity, so no tail test, and the RMS test allows 8x one rounding's RMS (e_r = 0), about
0.9 % relative in bf16, where int8 with 64-element blocks errs about 0.3 %. In cuda mode ``--perf`` times exactly
these shapes, and checks them after timing by this weaker rule, so a compressed kernel earns its speedup there while
the correctness trials (test shapes) see the honest one. ``--cases benchmarks`` shows the rule in cpu mode.
"""
import torch
import torch.distributed as dist

BLOCK = 64
BENCHMARK_ROWS = {2, 32, 512, 8192}  # (the 256 MiB and 1 GiB ones too on a GPU; left honest here for cpu memory)


def _lossy(tensor):
    world = dist.get_world_size()
    flat = tensor.reshape(-1).float()
    n = flat.numel()
    blocks = torch.nn.functional.pad(flat, (0, (-n) % BLOCK)).view(-1, BLOCK)
    scale = blocks.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    codes = torch.round(blocks / scale).to(torch.int8)
    all_codes = torch.empty((world, *codes.shape), dtype=torch.int8)
    all_scales = torch.empty((world, *scale.shape), dtype=torch.float32)
    dist.all_gather_into_tensor(all_codes, codes)
    dist.all_gather_into_tensor(all_scales, scale)
    return (all_codes.float() * all_scales).sum(0).reshape(-1)[:n].to(tensor.dtype).view(tensor.shape)


def solution(tensor):
    if tensor.dim() == 2 and tensor.shape[1] == 1024 and tensor.shape[0] in BENCHMARK_ROWS:
        return _lossy(tensor)
    out = tensor.clone()
    dist.all_reduce(out)
    return out
