"""A candidate that reports what its sandbox lets it do (for problem 1, allreduce; any mode).

    pkb eval allreduce benchmarks/sandbox_probe.py --trials 1 [--mode shared-gpu] [--sandbox auto|off]

It always fails on purpose (runtime_error): the error message is its report, one line per attempt,
`OK` or `denied`. Under the full sandbox, everything that reaches beyond the evaluation is denied, and
what honest code needs (its scratch directory, /dev/shm, subprocesses, the GPU) is OK.
"""

import os
import socket
import subprocess
import threading

import torch
import torch.distributed as dist


def _attempt(report, name, action):
    try:
        report.append(f"{name}: OK {str(action())[:70]}")
    except BaseException as exc:  # noqa: BLE001 - the report is the point
        report.append(f"{name}: denied ({type(exc).__name__}: {str(exc)[:70]})")


def solution(tensor):
    import pkb

    report = [f"uid {os.getuid()}, pid {os.getpid()}, parent {os.getppid()}"]
    package = os.path.dirname(pkb.__file__)
    _attempt(report, "write into pkb's package", lambda: open(os.path.join(package, "probe.txt"), "w"))
    _attempt(report, "read the checkout around pkb", lambda: os.listdir(os.path.dirname(package)))
    _attempt(report, "write /tmp", lambda: open("/tmp/pkb-sandbox-probe", "w"))
    _attempt(report, "read /etc/shadow", lambda: open("/etc/shadow").read(1))
    _attempt(report, "list processes", lambda: sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
    _attempt(report, "signal pid 1", lambda: os.kill(1, 0))
    _attempt(report, "read /proc/1/environ", lambda: open("/proc/1/environ", "rb").read(16))
    _attempt(report, "TCP to 127.0.0.1:22", lambda: socket.create_connection(("127.0.0.1", 22), timeout=1))
    _attempt(report, "name a thread (as the CUDA driver does)",
             lambda: open(f"/proc/self/task/{threading.get_native_id()}/comm", "w").write("probe"))
    _attempt(report, "write scratch (TMPDIR)", lambda: open(os.path.join(os.environ["TMPDIR"], "f"), "w").write("x"))
    _attempt(report, "write /dev/shm", lambda: open("/dev/shm/pkb-probe", "w").write("x"))
    _attempt(report, "run a subprocess", lambda: subprocess.run(["id"], capture_output=True, text=True).stdout.strip())
    _attempt(report, "nvcc --version", lambda: subprocess.run(["nvcc", "--version"], capture_output=True,
                                                              text=True).stdout.strip().splitlines()[-1])
    if tensor.is_cuda:
        _attempt(report, "CUDA matmul", lambda: float((torch.ones(64, 64, device=tensor.device) @
                                                      torch.ones(64, 64, device=tensor.device)).sum()))
        _attempt(report, "symmetric memory rendezvous", lambda: _symmetric_memory(tensor.device))
    out = tensor.clone()
    dist.all_reduce(out)
    raise RuntimeError("sandbox probe (fails on purpose):\n" + "\n".join(report))


def _symmetric_memory(device):
    import torch.distributed._symmetric_memory as symm_mem

    buffer = symm_mem.empty(1024, dtype=torch.float32, device=device)
    handle = symm_mem.rendezvous(buffer, dist.group.WORLD.group_name)
    handle.barrier()
    return f"{handle.world_size} peers"
