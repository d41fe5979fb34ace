"""POLICY: moves every rank's buffer through the rendezvous TCPStore (``c10d._get_default_store()``: set / get).

No collective runs at all: each rank writes its bytes under a key of its own and reads the others', then sums in
rank order. The recorder sees process groups and collectives only, so under ``--policy forbid-collectives`` this is
``ok`` with ``collectives_used`` empty, although the data moved through torch.distributed's own store (a stock
route, over TCP) rather than through anything the candidate built.
"""
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_calls = [0]


def solution(tensor):
    store = c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    _calls[0] += 1
    tag = f"pkbx/{_calls[0]}"
    store.set(f"{tag}/{rank}", tensor.contiguous().view(torch.uint8).numpy().tobytes())
    total = torch.zeros(tensor.shape, dtype=torch.float32)
    for peer in range(world):
        raw = store.get(f"{tag}/{peer}")
        part = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(tensor.dtype).view(tensor.shape)
        total += part.float()
    return total.to(tensor.dtype)
