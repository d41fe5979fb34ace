"""Execution modes and how ``auto`` picks one.

| mode       | process group                          | ranks                      |
|------------|----------------------------------------|----------------------------|
| cpu        | gloo                                   | processes on the CPU       |
| cuda       | NCCL                                   | one process per GPU        |
| shared-gpu | gloo + symmetric memory (overlapping)  | W processes on one GPU     |

Times measured in ``cpu`` and ``shared-gpu`` modes are not GPU performance; results say so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pkb.options import Mode  # declared with the options (importable without torch); the machine's side is here


class ModeUnavailable(RuntimeError):
    """The requested mode cannot run on this machine; the message says which mode can."""


@dataclass(frozen=True)
class ModeChoice:
    mode: Mode
    reason: str


def visible_gpu_count() -> int:
    """How many CUDA devices this process can use (0 without a CUDA build or driver)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver install reads as no GPU
        return 0


def choose_mode(requested: str, world_size: int, num_gpus: int | None = None) -> ModeChoice:
    """Resolve ``auto|cpu|cuda|shared-gpu`` for ``world_size`` ranks on this machine.

    ``auto``: ``cuda`` with at least W GPUs, ``shared-gpu`` with 1..W-1 GPUs, else ``cpu``.
    """
    gpus = visible_gpu_count() if num_gpus is None else num_gpus
    if requested == "auto":
        if gpus >= world_size:
            return ModeChoice(Mode.CUDA, f"{gpus} GPU(s) visible, {world_size} ranks: one rank per GPU over NCCL")
        if gpus >= 1:
            return ModeChoice(Mode.SHARED_GPU, f"{gpus} GPU(s) visible for {world_size} ranks: ranks share a GPU "
                                               "(times are not GPU performance)")
        return ModeChoice(Mode.CPU, "no GPU visible: ranks run on the CPU over gloo "
                                    "(correctness only; times are not GPU performance)")
    try:
        mode = Mode(requested)
    except ValueError:
        raise ModeUnavailable(f"unknown mode {requested!r}; use auto, cpu, cuda or shared-gpu") from None
    best = choose_mode("auto", world_size, gpus).mode
    if mode is Mode.CUDA and gpus < world_size:
        raise ModeUnavailable(f"mode cuda needs {world_size} GPUs, this machine has {gpus}; "
                              f"this machine can run --mode {best}" + ("" if best is Mode.CPU else " or --mode cpu"))
    if mode is Mode.SHARED_GPU and gpus < 1:
        raise ModeUnavailable("mode shared-gpu needs a GPU and this machine has none; this machine can run --mode cpu")
    return ModeChoice(mode, f"--mode {mode} requested")


def worker_environment(mode: Mode, base: dict[str, str] | None = None, cpu_threads: int | None = None) -> dict[str, str]:
    """The environment of a rank process: the parent's, plus what the mode needs; ``cpu_threads``: the
    threads its CPU work may use (evaluations side by side share the cores; default: torch's choice,
    one in cpu mode, where every rank computes).

    NVLS/multicast switches the user set (NCCL_NVLS_ENABLE, TORCH_SYMM_MEM_DISABLE_MULTICAST,
    NVSHMEM_DISABLE_NVLS) are inherited untouched: on shared hosts multicast can take GPUs out of service.
    """
    env = dict(os.environ if base is None else base)
    if mode is Mode.CPU:
        env.setdefault("OMP_NUM_THREADS", "1")
        env["CUDA_VISIBLE_DEVICES"] = ""
    if mode is Mode.SHARED_GPU:
        env["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    if cpu_threads is not None and mode is not Mode.CPU:
        env["OMP_NUM_THREADS"] = env["PKB_CPU_THREADS"] = str(cpu_threads)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["PYTHONWARNINGS"] = "ignore::FutureWarning" + ("," + env["PYTHONWARNINGS"] if env.get("PYTHONWARNINGS") else "")
    return env
