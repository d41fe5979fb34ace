"""What every candidate in this folder shares. tests/integration/test_node_isolation.py (and
benchmarks/node_isolation/run.py on a GPU) writes a candidate file as this prelude, with SCOPE filled in,
followed by one channel's file, which defines ``exchange``.

A candidate is a solution of ``hierarchical_allreduce`` (tensor, intra_group, inter_group -> the sum over all
ranks) that moves the ranks' data through one channel other than torch.distributed: host files, shared
memory, unix sockets, another process's file descriptors or memory, CUDA IPC handles, symmetric memory
reached around pkb's fence. With SCOPE = "world" every rank reaches every other rank that way, across the
virtual nodes too: it is right only if the channel crosses nodes, which on real nodes it cannot. With
SCOPE = "node" it reaches only the ranks of its own node that way, and adds the nodes' sums over
``inter_group`` with torch.distributed: the same channel inside one node must still work.

``exchange(mine, ranks, group) -> {rank: tensor}``: each rank of ``ranks`` (global ranks, in ``group``) gets
every other rank's ``mine`` (flat, fp32, on the rank's device); ``group`` serves for barriers and for
metadata (a name, a path, a pid: never the data).
"""

import array
import os
import secrets
import socket

import torch
import torch.distributed as dist

SCOPE = "world"  # "world": the channel crosses nodes; "node": it stays inside one
_state = {"calls": 0, "token": None}


def name() -> str:
    """A name every rank agrees on, new for each evaluation and each call (for files, segments, sockets)."""
    return f"pkbn{_state['token']}c{_state['calls']}"


def solution(tensor, intra_group, inter_group):
    if _state["token"] is None:
        box = [secrets.token_hex(4)]
        dist.broadcast_object_list(box, src=0)  # setup: one name for the evaluation
        _state["token"] = box[0]
    _state["calls"] += 1
    group = dist.group.WORLD if SCOPE == "world" else intra_group
    ranks = dist.get_process_group_ranks(group)
    mine = tensor.detach().reshape(-1).float().contiguous()
    pieces = exchange(mine, ranks, group)
    total = torch.zeros_like(mine)
    for rank in sorted(ranks):  # the same order on every rank: the replicas agree bit for bit, as pkb asks
        total += mine if rank == dist.get_rank() else pieces[rank].to(mine.device).reshape(-1)
    if SCOPE == "node":
        dist.all_reduce(total, group=inter_group)
    return total.to(tensor.dtype).view_as(tensor)


def gather_metadata(value, ranks, group) -> dict:
    """{rank: value} of every rank of ``group`` (plain metadata, through torch.distributed)."""
    values = [None] * len(ranks)
    dist.all_gather_object(values, value, group=group)
    return dict(zip(ranks, values))


def memfd_with(mine: torch.Tensor) -> int:
    """A memory file holding ``mine``'s bytes."""
    fd = os.memfd_create("pkb-node-attack")
    os.write(fd, mine.cpu().numpy().tobytes())
    return fd


def tensor_from_fd(fd: int, like: torch.Tensor) -> torch.Tensor:
    data = os.pread(fd, like.numel() * like.element_size(), 0)  # pread: the file's offset is shared with its owner
    return torch.frombuffer(bytearray(data), dtype=like.dtype).clone()


def from_peers_fds(mine: torch.Tensor, ranks, group, take) -> dict:
    """Each rank puts its data in a memory file and tells the others (pid, fd number); ``take(pid, fd)`` makes a
    peer's into a descriptor of this process's, which is read and closed."""
    fd = memfd_with(mine)
    where = gather_metadata((os.getpid(), fd), ranks, group)
    pieces = {}
    for rank in ranks:
        if rank != dist.get_rank():
            local = take(*where[rank])
            pieces[rank] = tensor_from_fd(local, mine)
            os.close(local)
    dist.barrier(group)  # every peer has taken this rank's file
    os.close(fd)
    return pieces


def swap_fds(channel, fd: int, like: torch.Tensor, addresses: dict) -> dict:
    """Send ``fd`` over the datagram socket ``channel`` to every peer's address (``addresses``: rank -> address),
    then receive theirs: {rank: its data}."""
    me = dist.get_rank()
    for rank, address in addresses.items():
        if rank != me:
            send_fd(channel, fd, me, address)
    pieces = {}
    for _ in range(len(addresses) - 1):
        sender, fds, _, _ = socket.recv_fds(channel, 16, 1)
        pieces[int(sender)] = tensor_from_fd(fds[0], like)
        os.close(fds[0])
    return pieces


def through_dist(mine: torch.Tensor, ranks, group) -> dict:
    """The honest exchange: an all-gather over ``group`` (what the fence candidates fall back to)."""
    gathered = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(gathered, mine, group=group)
    return dict(zip(ranks, gathered))


def symmetric(numel: int, device) -> torch.Tensor:
    """A symmetric-memory tensor where torch can make one (a GPU), else a plain one: the fence must see the call
    either way."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        return symm_mem.empty(numel, device=device)
    except Exception:
        return torch.empty(numel, device=device)


def send_fd(channel, fd: int, me: int, address) -> None:
    """``fd`` over the unix datagram socket ``channel`` to ``address`` (SCM_RIGHTS), with this rank's number."""
    channel.sendmsg([str(me).encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))], 0, address)


def attempt(call) -> None:
    """Make a peer-memory call and carry on whatever it raises (on the CPU, symmetric memory raises anyway): the
    verdict must still say that it was asked for."""
    try:
        call()
    except Exception:
        pass
