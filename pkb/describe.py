"""How a problem's inputs and costs read to a person (``pkb show``, the prompts): shapes and dtypes of a
rank's inputs without allocating them, and byte counts in binary units."""

from __future__ import annotations


def shapes_of_inputs(problem, case, rank: int, world_size: int) -> tuple:
    """A rank's inputs without allocating them (fake tensors), so GiB-sized benchmark cases show instantly."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pkb.problem import make_generator

    gen = make_generator(0, 1)
    try:
        with FakeTensorMode():
            return tuple(problem.make_inputs(case, rank, world_size, gen))
    except Exception:
        return tuple(problem.make_inputs(case, rank, world_size, gen))


def describe(value) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(describe(v) for v in value) + "]"
    return repr(value)


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.4g} {unit}"
        count /= 1024
    return f"{count:.4g} TiB"
