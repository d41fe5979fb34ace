"""Many processes: on its first call each rank starts eight Python processes at once and waits for
them (the sandbox's process limit, pid namespace and scratch directory; side by side, the machine's)."""

import subprocess
import sys

import torch.distributed as dist

EXPECTED = {"cpu": "ok", "shared-gpu": "ok", "cuda": "ok"}
_checked = []


def _helpers_answer() -> None:
    helpers = [subprocess.Popen([sys.executable, "-S", "-c", f"print({index} * {index})"], stdout=subprocess.PIPE,
                                text=True) for index in range(8)]
    answers = [int(helper.communicate(timeout=120)[0]) for helper in helpers]
    if answers != [index * index for index in range(8)]:
        raise RuntimeError(f"the helper processes answered {answers}")


def solution(tensor):
    if not _checked:
        _helpers_answer()
        _checked.append(True)
    out = tensor.clone()
    dist.all_reduce(out)
    return out
