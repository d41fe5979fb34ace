"""How fast the parent reads a rank's reply (``pkb.runtime.channel.recv_reply``), both ways it can: into a
mapped memory file (Linux) and into a stream (elsewhere). Prints measured numbers; asserts nothing.

A forked sender writes the same ``torch.save``d reply (a list of fp32 tensors) ``--repeats`` times per way;
the parent's wall time and CPU time per reply are the median over the repeats. The sender's own time
(serialising, writing) is the same in both ways and is not in the numbers.

    python benchmarks/reply_channel.py [--mib 1 64 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import statistics
import time

import torch

from pkb.runtime import channel

WAYS = {"memory file": True, "stream": False}


def send(conn, mib: int, count: int) -> None:
    tensors = [torch.randn(mib * (1 << 20) // 4 // 8) for _ in range(8)]
    buffer = io.BytesIO()
    torch.save({"status": "ok", "outputs": tensors}, buffer)
    for _ in range(count):
        conn.send_bytes(buffer.getbuffer())


def measure(mib: int, repeats: int, memory_file: bool) -> tuple[float, float]:
    parent, rank = multiprocessing.Pipe()
    sender = multiprocessing.get_context("fork").Process(target=send, args=(rank, mib, repeats))
    sender.start()
    walls, cpus = [], []
    saved, channel._MEMORY_FILES = channel._MEMORY_FILES, memory_file
    try:
        for _ in range(repeats):
            began, began_cpu = time.perf_counter(), time.process_time()
            reply = channel.recv_reply(parent)
            walls.append(time.perf_counter() - began)
            cpus.append(time.process_time() - began_cpu)
            del reply
    finally:
        channel._MEMORY_FILES = saved
        sender.join()
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[1, 64, 256], help="reply sizes in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ways = {name: on for name, on in WAYS.items() if channel._MEMORY_FILES or not on}
    print(f"{'reply':>8}  " + "  ".join(f"{name + ': wall / parent CPU':>34}" for name in ways))
    for mib in args.mib:
        cells = []
        for on in ways.values():
            wall, cpu = measure(mib, args.repeats, on)
            cells.append(f"{wall * 1e3:9.1f} ms / {cpu * 1e3:7.1f} ms ({mib / 1024 / wall:4.2f} GiB/s)")
        print(f"{mib:>4} MiB  " + "  ".join(f"{cell:>34}" for cell in cells))


if __name__ == "__main__":
    main()
