"""How fast a rank's reply reaches the parent (``pkb.runtime.channel``), each way it can travel: as a sealed
memory file the rank passes (Linux), through the socket into a memory file of the parent's (Linux, a reply
past the rank's file-size limit) and through the socket into a stream (elsewhere). Prints measured numbers;
asserts nothing.

A forked rank sends the same reply (8 fp32 tensors of ``--mib`` in all) ``--repeats`` times per way, each when
the parent asks: the wall time from the ask to the decoded reply, the rank's CPU time in ``send_reply`` and
the parent's in ``recv_reply`` are the medians over the repeats.

    python benchmarks/reply_channel.py [--mib 1 64 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch

from pkb.runtime import channel

# name: (the rank passes a sealed memory file, the parent reads a stream into a memory file)
WAYS = {"sealed file": (True, True), "socket, parent's file": (False, True), "socket, stream": (False, False)}


def rank(conn, mib: int, count: int, sealed: bool) -> None:
    channel._MEMORY_FILES = sealed
    reply = {"status": "ok", "outputs": [torch.randn(mib * (1 << 20) // 4 // 8) for _ in range(8)]}
    cpus = []
    for _ in range(count):
        conn.recv_bytes()
        began = time.process_time()
        channel.send_reply(conn, reply)
        cpus.append(time.process_time() - began)
    conn.send_bytes(repr(cpus).encode())


def measure(mib: int, repeats: int, sealed: bool, parent_file: bool) -> tuple[float, float, float]:
    parent, end = multiprocessing.Pipe()
    sender = multiprocessing.get_context("fork").Process(target=rank, args=(end, mib, repeats, sealed))
    sender.start()
    walls, cpus = [], []
    saved, channel._MEMORY_FILES = channel._MEMORY_FILES, parent_file
    try:
        for _ in range(repeats):
            began, began_cpu = time.perf_counter(), time.process_time()
            parent.send_bytes(b"go")
            reply = channel.recv_reply(parent)
            walls.append(time.perf_counter() - began)
            cpus.append(time.process_time() - began_cpu)
            del reply
        rank_cpus = eval(parent.recv_bytes().decode())  # noqa: S307 (a list of floats from our own child)
    finally:
        channel._MEMORY_FILES = saved
        sender.join()
    return statistics.median(walls), statistics.median(rank_cpus), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[1, 64, 256], help="reply sizes in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ways = {name: way for name, way in WAYS.items() if channel._MEMORY_FILES or not any(way)}
    print(f"{'reply':>8}  " + "  ".join(f"{name + ': wall / rank CPU / parent CPU':>44}" for name in ways))
    for mib in args.mib:
        cells = []
        for sealed, parent_file in ways.values():
            wall, rank_cpu, parent_cpu = measure(mib, args.repeats, sealed, parent_file)
            cells.append(f"{wall * 1e3:8.1f} / {rank_cpu * 1e3:7.1f} / {parent_cpu * 1e3:7.1f} ms")
        print(f"{mib:>4} MiB  " + "  ".join(f"{cell:>44}" for cell in cells))


if __name__ == "__main__":
    main()
