"""All-reduce in one shot over peer memory: every rank reads every peer's buffer in a CUDA kernel.

Per rank: tensor [*shape] -> [*shape], the sum over ranks, accumulated in fp32 in rank order
(so every rank computes bit-identical results). Steps: copy the input into this rank's symmetric
buffer; barrier (every peer's data is in place); the kernel sums the W buffers through a device
array of their addresses, 16 bytes per load; barrier (no rank overwrites its buffer while a peer
still reads it). Each rank reads (W-1) * S bytes over NVLink: a one-shot algorithm, best for small
and medium messages.
"""

import torch
import torch.distributed as dist

from pkb.kernels import load_cuda
from pkb.solutions._cuda_common import CUDA_CONVERSIONS, SUM_PEERS_KERNEL, staging_buffer

REQUIRES = ("cuda",)

CUDA_SRC = CUDA_CONVERSIONS + SUM_PEERS_KERNEL + r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

void allreduce_peers(int64_t ptrs_dev, int64_t world_size, torch::Tensor out) {
  const int64_t n = out.numel();
  const int threads = 512;
  const int blocks = (int)std::min<int64_t>((n / 8 + threads - 1) / threads + 1, 132 * 4);
  auto stream = c10::cuda::getCurrentCUDAStream();
  DISPATCH_FLOAT_TYPES(out.scalar_type(),
    sum_peers_kernel<scalar_t><<<blocks, threads, 0, stream>>>(
        reinterpret_cast<const uint64_t*>(ptrs_dev), (int)world_size,
        reinterpret_cast<scalar_t*>(out.data_ptr()), n, n / (16 / (int64_t)sizeof(scalar_t))));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""

_ext = load_cuda("pkb_allreduce_peer", CUDA_SRC, cpp_sources="void allreduce_peers(int64_t, int64_t, torch::Tensor);",
                 functions=["allreduce_peers"])


def solution(tensor):
    numel = tensor.numel()
    buffer = staging_buffer(numel, tensor.dtype)
    buffer.local[:numel].copy_(tensor.reshape(-1))
    buffer.barrier()
    out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    _ext.allreduce_peers(buffer.buffer_ptrs_dev, dist.get_world_size(), out)
    buffer.barrier()
    return out
