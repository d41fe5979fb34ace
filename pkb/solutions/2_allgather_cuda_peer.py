"""All-gather over peer memory: one CUDA kernel copies every peer's shard into the output.

Per rank: tensor [*shape] -> [W, *shape], slice r = rank r's tensor (bit-exact). Steps: copy the
input into this rank's symmetric buffer; barrier; the kernel reads each peer's buffer through a
device array of addresses (16 bytes per load where the shard allows) and writes slice r; barrier
(no rank overwrites its buffer while a peer still reads it). Each rank reads (W-1) * S bytes.
"""

import torch
import torch.distributed as dist

from pkb.kernels import load_cuda
from pkb.solutions._cuda_common import staging_buffer

REQUIRES = ("cuda",)

CUDA_SRC = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cstdint>

// Copy `bytes` bytes of every peer's buffer into out + r * bytes; blockIdx.y picks the peer.
__global__ void gather_peers(const uint64_t* __restrict__ ptrs, char* __restrict__ out, int64_t bytes) {
  const char* src = reinterpret_cast<const char*>(ptrs[blockIdx.y]);
  char* dst = out + (int64_t)blockIdx.y * bytes;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t start = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (bytes % 16 == 0) {
    for (int64_t v = start; v < bytes / 16; v += stride)
      reinterpret_cast<uint4*>(dst)[v] = reinterpret_cast<const uint4*>(src)[v];
  } else {
    for (int64_t i = start; i < bytes; i += stride) dst[i] = src[i];
  }
}

void allgather_peers(int64_t ptrs_dev, int64_t world_size, torch::Tensor out, int64_t bytes) {
  const int threads = 512;
  const int blocks = (int)std::min<int64_t>((bytes / 16 + threads - 1) / threads + 1, 132 * 2);
  auto stream = c10::cuda::getCurrentCUDAStream();
  gather_peers<<<dim3(blocks, (unsigned)world_size), threads, 0, stream>>>(
      reinterpret_cast<const uint64_t*>(ptrs_dev), reinterpret_cast<char*>(out.data_ptr()), bytes);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""

_ext = load_cuda("pkb_allgather_peer", CUDA_SRC, cpp_sources="void allgather_peers(int64_t, int64_t, torch::Tensor, int64_t);",
                 functions=["allgather_peers"])


def solution(tensor):
    world_size = dist.get_world_size()
    numel = tensor.numel()
    buffer = staging_buffer(numel, tensor.dtype)
    buffer.local[:numel].copy_(tensor.reshape(-1))
    buffer.barrier()
    out = torch.empty((world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    _ext.allgather_peers(buffer.buffer_ptrs_dev, world_size, out, numel * tensor.element_size())
    buffer.barrier()
    return out
