"""POLICY: the answer comes by the candidate's own route (files in the node's temporary directory, and barriers), but
a thread of the candidate's takes a stock route between calls: it waits until the harness's thread has left the
call (its window closed: the thread reads the harness's stack) and is still in the job (``Worker.run``: the
barrier, the outputs being read), then runs a ``dist.all_reduce`` on a group of its own. The recorder named calls
only while a window was open, and compared the groups' sequence numbers only at a window's two ends: the thread's
all-reduce was not seen (``ok``, ``collectives_used`` with barriers only), unless it happened to fall into a later
window. Expected under ``--policy forbid-collectives``: ``forbidden`` (``dist.all_reduce``: a candidate's thread is
recorded whenever it calls)."""
import os
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

_state = {"calls": 0, "group": None}


def _harness_between_windows(main: int) -> bool:
    frame, names = sys._current_frames().get(main), set()
    while frame is not None:
        names.add(frame.f_code.co_name)
        frame = frame.f_back
    return "run" in names and "call" not in names and "solution" not in names


def _later(group, main):
    deadline = time.monotonic() + 5
    while not _harness_between_windows(main) and time.monotonic() < deadline:
        time.sleep(0.0005)
    dist.all_reduce(torch.ones(1), group=group)


def solution(tensor):
    if _state["group"] is None:
        _state["group"] = dist.new_group(list(range(dist.get_world_size())))
    _state["calls"] += 1
    rank, world = dist.get_rank(), dist.get_world_size()
    path = lambda r: os.path.join(tempfile.gettempdir(), f"pkb-thread-{os.getppid()}-{_state['calls']}-{r}.pt")  # noqa: E731
    torch.save(tensor.contiguous(), path(rank) + ".part")
    os.replace(path(rank) + ".part", path(rank))
    dist.barrier()
    total = torch.stack([torch.load(path(r)) for r in range(world)]).float().sum(0).to(tensor.dtype)
    dist.barrier()
    os.remove(path(rank))
    threading.Thread(target=_later, args=(_state["group"], threading.get_ident()), daemon=True).start()
    return total
