"""Helpers a solution may use: CUDA extension builds with a cache, and symmetric memory.

Build::

    from pkb.kernels import load_cuda
    ext = load_cuda("my_allreduce", cuda_src, functions=["allreduce"])   # built once per source

Symmetric memory (the same calls in ``cuda`` and ``shared-gpu`` modes)::

    from pkb.kernels import symmetric_buffer
    buf = symmetric_buffer((n,), torch.bfloat16)     # collective: every rank calls it with the same args
    buf.local.copy_(x); buf.barrier()                # device-side barrier on the current stream
    ptrs = buf.buffer_ptrs_dev                       # device array of W pointers, for a kernel
    peer = buf.peer(1)                               # rank 1's buffer as a tensor

``compile_cuda_extension`` is the upstream benchmark's helper, also importable as
``utils.cuda_helpers`` inside rank processes so upstream solution files load unchanged.
"""

from pkb.kernels.build import BuildError, compile_cuda_extension, cuda_arch_list, load_cuda
from pkb.kernels.symm import SymmetricBuffer, symmetric_buffer

__all__ = ["BuildError", "compile_cuda_extension", "cuda_arch_list", "load_cuda", "SymmetricBuffer",
           "symmetric_buffer"]
