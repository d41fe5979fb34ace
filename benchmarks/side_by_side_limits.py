"""What this machine itself allows side by side, without pkb: N processes starting CUDA at once, and N
CUDA extensions built at once. Prints measured numbers; asserts nothing.

``pkb run --parallel N`` cannot go faster than these: every evaluation starts fresh rank processes
(one CUDA context each) and a compile-bound folder is as fast as the machine builds extensions.

    python benchmarks/side_by_side_limits.py [--contexts 1,8,16] [--builds 1,7]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

START_CUDA = "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"
BUILD = """
import sys, torch
from torch.utils.cpp_extension import load_inline
cuda = '''
#include <torch/extension.h>
__global__ void add_one_kernel(float* x, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] += 1.0f; }
void add_one(torch::Tensor x) { add_one_kernel<<<(x.numel() + 255) / 256, 256>>>(x.data_ptr<float>(), x.numel()); }
// SALT
'''.replace("SALT", sys.argv[1])
load_inline(f"limits_{sys.argv[1]}", cpp_sources="void add_one(torch::Tensor x);", cuda_sources=cuda,
            functions=["add_one"], extra_cuda_cflags=["-O3"], extra_cflags=["-O3"])
"""


def at_once(commands: list[list[str]], env: dict) -> tuple[float, int]:
    """Wall seconds for ``commands`` started together, and how many failed."""
    began = time.monotonic()
    processes = [subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for c in commands]
    failed = sum(p.wait() != 0 for p in processes)
    return time.monotonic() - began, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="1,8,16")
    parser.add_argument("--builds", default="1,7")
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores", flush=True)
    for count in map(int, args.contexts.split(",")):
        wall, failed = at_once([[sys.executable, "-c", START_CUDA]] * count, dict(os.environ))
        print(f"{count} processes starting CUDA at once: {wall:.1f} s wall ({failed} failed)", flush=True)
    for count in map(int, args.builds.split(",")):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCH_EXTENSIONS_DIR": cache}
            salt = f"{os.getpid()}_{count}"
            wall, failed = at_once([[sys.executable, "-c", BUILD, f"{salt}_{i}"] for i in range(count)], env)
        print(f"{count} CUDA extensions built at once (cold): {wall:.1f} s wall ({failed} failed)", flush=True)


if __name__ == "__main__":
    main()
