"""The rank side of the timing protocol (pkb.runtime.timed_loop.TimedLoop) in a real two-process group."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pkb.runtime.timed_loop import CPU_CACHE_BYTES, TimedLoop


def _scatter_like_rank(rank: int, folder: str) -> None:
    """Rank 0 holds W buffers, rank 1 one: their inputs differ in size, so would their copy counts."""
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), 2), rank=rank, world_size=2)
    numel = CPU_CACHE_BYTES // 4 // 8  # 4 MiB of fp32 per buffer

    def make_inputs(seeds):
        gen = torch.Generator().manual_seed(seeds[0])
        return (torch.randn(2 if rank == 0 else 1, numel, generator=gen),)

    def all_reduce_first(x):
        out = x[0].clone()
        dist.all_reduce(out)
        return out

    loop = TimedLoop(all_reduce_first, make_inputs, [(rank, k) for k in range(64)], torch.device("cpu"))
    prepared = loop.prepare(num_warmup=2, warmup_s=0.0, min_repeat_s=0.001, min_iters=2, max_iters=4)
    loop.repeat()
    Path(folder, f"rank{rank}.json").write_text(json.dumps({"copies": len(loop.copies), **prepared}))
    dist.destroy_process_group()


def test_ranks_with_inputs_of_different_sizes_keep_the_same_number_of_copies(tmp_path):
    context = mp.start_processes(_scatter_like_rank, args=(str(tmp_path),), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 60
    try:
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, "the ranks did not finish within 60 s: they disagree on the number of calls"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    replies = [json.loads(Path(tmp_path, f"rank{rank}.json").read_text()) for rank in range(2)]
    # alone, rank 0 (8 MiB) would keep 12 copies and rank 1 (4 MiB) 24, for 3x the 32 MiB cache
    assert replies[0]["copies"] == replies[1]["copies"] == 24, replies
    assert replies[0]["num_iters"] == replies[1]["num_iters"]
