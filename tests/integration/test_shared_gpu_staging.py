"""shared-gpu mode checks every case (issue 28, item 6): CUDA tensors in collectives are staged through
host memory by ``pkb.runtime.gloo_bridge``, so the reference runs on the GPU there (rounding as
upstream's GPU reference does).

No GPU is needed: the bridge's staging is checked in real gloo groups (spawned processes over a
FileStore) with CPU tensors standing in for CUDA ones (``gloo_bridge._stages``), and gloo itself is
watched so that no stand-in tensor reaches it. tests/integration/test_gpu.py runs the four upstream files
whose upstream cases are ``slow_on_cpu`` in shared-gpu mode on a GPU. Which cases each mode checks, and
where the reference runs: tests/unit/test_shared_gpu_cases.py.
"""

from __future__ import annotations

import multiprocessing
import traceback
from datetime import timedelta

import pytest
import torch


def _staging_checks(rank: int, world_size: int) -> list[str]:
    """Each staged collective on stand-in device tensors: the NCCL result lands in the caller's tensors
    before the call returns, and gloo sees only host copies. Returns the failures."""
    import torch.distributed as dist

    from pkb.runtime import gloo_bridge

    W, failures = world_size, []
    device_tensors: list[torch.Tensor] = []  # kept alive: their storages cannot be reused during a check

    def dev(tensor: torch.Tensor) -> torch.Tensor:
        tensor.stand_in_for_cuda = True
        device_tensors.append(tensor)
        return tensor

    def reached_gloo(name: str, original):
        def watched(*args, **kwargs):
            storages = {t.untyped_storage().data_ptr() for t in device_tensors}
            passed = gloo_bridge._tensors([*args, *kwargs.values()])
            assert not any(t.untyped_storage().data_ptr() in storages for t in passed if t.numel()), \
                f"gloo's {name} got a device tensor"
            return original(*args, **kwargs)
        return watched

    gloo_bridge._stages = lambda tensor: getattr(tensor, "stand_in_for_cuda", False)
    for name in list(gloo_bridge._original):
        gloo_bridge._original[name] = reached_gloo(name, gloo_bridge._original[name])

    def mine(*shape) -> torch.Tensor:
        return torch.arange(float(torch.Size(shape).numel())).reshape(shape) + 100 * rank

    def all_reduce_sync_and_async():
        x = dev(mine(2, 3))
        assert dist.all_reduce(x) is None
        assert torch.equal(x, sum(torch.arange(6.0).reshape(2, 3) + 100 * r for r in range(W)))
        y = dev(torch.tensor([float(rank)]))
        work = dist.all_reduce(y, op=dist.ReduceOp.MAX, async_op=True)
        assert y.item() == W - 1 and work.is_completed()  # finished before it returned, like every bridged call
        work.wait()
        assert work.result()[0] is y and work.get_future().wait()[0] is y  # the caller's tensor, as NCCL's work

    def all_gather_into_a_strided_view_and_in_place():
        out = dev(torch.zeros(3, W * 2).t())  # [W * 2, 3], not contiguous
        dist.all_gather_into_tensor(out, dev(mine(2, 3)))
        assert torch.equal(out, torch.cat([torch.arange(6.0).reshape(2, 3) + 100 * r for r in range(W)]))
        buffer = dev(torch.zeros(W * 4))
        buffer[rank * 4:(rank + 1) * 4] = rank + 1.0
        dist.all_gather_into_tensor(buffer, dev(buffer[rank * 4:(rank + 1) * 4]))  # input: a view of the output
        assert torch.equal(buffer, torch.arange(1.0, W + 1).repeat_interleave(4))

    def reduce_scatter_in_place():
        buffer = dev(torch.ones(W * 2) * (rank + 1))
        mine_part = dev(buffer[rank * 2:(rank + 1) * 2])  # output: a view of the input
        dist.reduce_scatter_tensor(mine_part, buffer)
        assert torch.equal(mine_part, torch.full((2,), float(sum(range(1, W + 1)))))

    def all_to_all_single_uneven_async():
        sizes_in = [rank + peer + 1 for peer in range(W)]
        sizes_out = [peer + rank + 1 for peer in range(W)]
        send = dev(torch.cat([torch.full((n,), float(rank)) for n in sizes_in]))
        received = dev(torch.empty(sum(sizes_out)))
        assert dist.all_to_all_single(received, send, sizes_out, sizes_in, async_op=True).result()[0] is received
        assert torch.equal(received, torch.cat([torch.full((n,), float(peer)) for peer, n in enumerate(sizes_out)]))

    def lists_broadcast_reduce_gather_scatter():
        outs = [dev(torch.empty(r + 1, 2)) for r in range(W)]
        dist.all_gather(outs, dev(torch.full((rank + 1, 2), float(rank))))
        assert all(torch.equal(o, torch.full((r + 1, 2), float(r))) for r, o in enumerate(outs))
        outs = [dev(torch.empty(peer + rank + 1)) for peer in range(W)]
        dist.all_to_all(outs, [dev(torch.full((rank + peer + 1,), float(rank))) for peer in range(W)])
        assert all(torch.equal(o, torch.full((peer + rank + 1,), float(peer))) for peer, o in enumerate(outs))
        shared = dev(torch.full((3,), float(rank)))
        dist.broadcast(shared, src=W - 1)
        assert torch.equal(shared, torch.full((3,), float(W - 1)))
        reduced = dev(mine(3))
        dist.reduce(reduced, dst=0)
        assert torch.equal(reduced, sum(torch.arange(3.0) + 100 * r for r in range(W)) if rank == 0 else mine(3))
        gathered = [dev(torch.empty(r + 1)) for r in range(W)] if rank == 0 else None
        dist.gather(dev(torch.full((rank + 1,), float(rank))), gathered, dst=0)
        if rank == 0:
            assert all(torch.equal(g, torch.full((r + 1,), float(r))) for r, g in enumerate(gathered))
        piece = dev(torch.empty(rank + 1))
        dist.scatter(piece, [dev(torch.full((r + 1,), float(-r))) for r in range(W)] if rank == 0 else None, src=0)
        assert torch.equal(piece, torch.full((rank + 1,), float(-rank)))

    def point_to_point_ring():
        received = dev(torch.empty(4))
        works = [dist.isend(dev(torch.full((4,), float(rank))), (rank + 1) % W),
                 dist.irecv(received, (rank - 1) % W)]
        for work in works:
            work.wait()
        assert torch.equal(received, torch.full((4,), float((rank - 1) % W)))
        assert works[1].result()[0] is received

    def host_tensors_are_not_staged():
        x = mine(2)  # not a stand-in: gloo gets it as it is
        dist.all_reduce(x)
        assert torch.equal(x, sum(torch.arange(2.0) + 100 * r for r in range(W)))

    for fn in (all_reduce_sync_and_async, all_gather_into_a_strided_view_and_in_place, reduce_scatter_in_place,
               all_to_all_single_uneven_async, lists_broadcast_reduce_gather_scatter, point_to_point_ring,
               host_tensors_are_not_staged):
        try:
            fn()
        except Exception:
            failures.append(f"rank {rank} {fn.__name__}: {traceback.format_exc(limit=-3)}")
        device_tensors.clear()
        dist.barrier()
    return failures


def _staged_rank(rank: int, world_size: int, store_path: str, check: str, results) -> None:
    import torch.distributed as dist

    from pkb.runtime import gloo_bridge

    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=60))  # a failed check must not leave its peers waiting long
        gloo_bridge.install(stage_cuda=True)
        if check == "staging":
            failures = _staging_checks(rank, world_size)
        else:  # every NCCL behaviour the bridge promises, with every tensor staged
            from test_compat import _bridge_checks

            gloo_bridge._stages = lambda tensor: True
            failures = _bridge_checks(rank, world_size)
        results.put((rank, failures))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, [traceback.format_exc()]))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("check", ["staging", "nccl_behaviours"])
def test_collectives_on_device_tensors_run_on_host_copies(check, world_size, tmp_path):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_staged_rank, args=(rank, world_size, str(tmp_path / "store"), check, results))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    failures = {}
    try:
        for _ in range(world_size):
            rank, failed = results.get(timeout=240)
            failures[rank] = failed
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert all(not f for f in failures.values()), "\n".join(line for f in failures.values() for line in f)
