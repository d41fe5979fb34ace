"""Two peer-memory kernels most collectives are made of, for solution writers (pkb's shipped 3-6, 8).

Every pull-style collective over peer memory follows the same five steps::

    buffer = staging_buffer(numel, tensor.dtype)           # (_cuda_common) the same numel on every rank (collective on growth)
    buffer.local[:numel].copy_(tensor.reshape(-1))         # stage this rank's data
    buffer.barrier()                                       # every peer's data is in place
    copy_from_peers(buffer, out, [(rank, buffer_offset, out_offset), ...], count)   # or sum_from_peers
    buffer.barrier()                                       # no rank overwrites its buffer while a peer still reads it

``copy_from_peers`` moves bytes (bit-exact, any dtype: fp8, ints and bool too) in one kernel launch;
``sum_from_peers`` sums every rank's buffer element-wise (fp32, fp16, bf16; accumulated in fp32 in
rank order, so every rank that calls it gets bit-identical results). Both run on the current CUDA
stream and need no host synchronisation. Call ``peer_kernels()`` at import time: it builds the
extension once (tens of seconds the first time, a cache hit afterwards), before anything is timed.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pkb.kernels import load_cuda
from pkb.solutions._cuda_common import CUDA_CONVERSIONS, SUM_PEERS_KERNEL


# copy_pieces: blockIdx.y picks a piece (a source rank, a byte offset into its buffer, a byte offset
# into out); the x blocks stride over its bytes. sum_peers: out[i] = sum over ranks r of buffer_r[i].
PEER_KERNELS_SRC = CUDA_CONVERSIONS + SUM_PEERS_KERNEL + r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <algorithm>
#include <vector>

constexpr int kMaxPieces = 16;  // pieces per launch (passed by value); more pieces take more launches
constexpr int kThreads = 512;

static int64_t multiprocessor_count() {  // of this process's GPU (one per rank), asked once
  static int count = 0;
  if (count == 0) {
    int device = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  }
  return count;
}

struct Pieces {
  int64_t src_offset[kMaxPieces];  // bytes into the source rank's buffer
  int64_t dst_offset[kMaxPieces];  // bytes into out
  int32_t rank[kMaxPieces];        // the source rank
};

__global__ void copy_pieces_kernel(const uint64_t* __restrict__ ptrs, const Pieces pieces,
                                   char* __restrict__ out, int64_t bytes) {
  const int p = blockIdx.y;
  const char* src = reinterpret_cast<const char*>(ptrs[pieces.rank[p]]) + pieces.src_offset[p];
  char* dst = out + pieces.dst_offset[p];
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t start = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const uintptr_t alignment = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | (uintptr_t)bytes;
  if (alignment % 16 == 0) {
    const uint4* src16 = reinterpret_cast<const uint4*>(src);
    uint4* dst16 = reinterpret_cast<uint4*>(dst);
    for (int64_t v = start; v < bytes / 16; v += stride) dst16[v] = src16[v];
  } else {
    for (int64_t i = start; i < bytes; i += stride) dst[i] = src[i];
  }
}

void copy_pieces(int64_t ptrs_dev, torch::Tensor out, std::vector<int64_t> ranks, std::vector<int64_t> src_offsets,
                 std::vector<int64_t> dst_offsets, int64_t bytes) {
  TORCH_CHECK(out.is_cuda() && out.is_contiguous(), "copy_pieces: out must be a contiguous CUDA tensor");
  TORCH_CHECK(ranks.size() == src_offsets.size() && ranks.size() == dst_offsets.size(),
              "copy_pieces: one rank, source offset and destination offset per piece");
  const int64_t num_pieces = (int64_t)ranks.size();
  if (bytes <= 0 || num_pieces == 0) return;
  const int64_t sms = multiprocessor_count();
  const int64_t loads = (bytes + 15) / 16;  // per piece, on the 16-byte path
  auto stream = c10::cuda::getCurrentCUDAStream();
  char* out_bytes = reinterpret_cast<char*>(out.data_ptr());
  for (int64_t first = 0; first < num_pieces; first += kMaxPieces) {
    const int count = (int)std::min<int64_t>(kMaxPieces, num_pieces - first);
    Pieces pieces{};
    for (int p = 0; p < count; ++p) {
      pieces.rank[p] = (int32_t)ranks[first + p];
      pieces.src_offset[p] = src_offsets[first + p];
      pieces.dst_offset[p] = dst_offsets[first + p];
    }
    const int64_t most = std::max<int64_t>(1, 4 * sms / count);
    const int blocks = (int)std::min<int64_t>((loads + kThreads - 1) / kThreads, most);
    copy_pieces_kernel<<<dim3(blocks, count), kThreads, 0, stream>>>(
        reinterpret_cast<const uint64_t*>(ptrs_dev), pieces, out_bytes, bytes);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void sum_peers(int64_t ptrs_dev, int64_t world_size, torch::Tensor out) {
  TORCH_CHECK(out.is_cuda() && out.is_contiguous(), "sum_peers: out must be a contiguous CUDA tensor");
  const int64_t n = out.numel();
  if (n == 0) return;
  const int64_t vec = 16 / out.element_size();
  // 16-byte loads when out is 16-byte aligned (the peers' buffers are: they start at offset 0).
  const int64_t num_vec = reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0 ? n / vec : 0;
  const int64_t sms = multiprocessor_count();
  const int blocks = (int)std::min<int64_t>(std::max<int64_t>(1, (num_vec + (n - num_vec * vec) + kThreads - 1) / kThreads),
                                            4 * sms);
  auto stream = c10::cuda::getCurrentCUDAStream();
  DISPATCH_FLOAT_TYPES(out.scalar_type(),
    sum_peers_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        reinterpret_cast<const uint64_t*>(ptrs_dev), (int)world_size,
        reinterpret_cast<scalar_t*>(out.data_ptr()), n, num_vec));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""

_PEER_KERNELS_DECLARATIONS = (
    "#include <vector>\n"
    "void copy_pieces(int64_t, torch::Tensor, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, int64_t);\n"
    "void sum_peers(int64_t, int64_t, torch::Tensor);\n"
)
_PEER_KERNELS = []  # the loaded extension, once built


def peer_kernels():
    """The extension holding ``copy_pieces`` and ``sum_peers`` (built on the first call, then cached).

    Call it at module level in a solution file, so the build happens at import, before any timing.
    """
    if not _PEER_KERNELS:
        _PEER_KERNELS.append(load_cuda("pkb_peer_kernels", PEER_KERNELS_SRC, cpp_sources=_PEER_KERNELS_DECLARATIONS,
                                       functions=["copy_pieces", "sum_peers"]))
    return _PEER_KERNELS[0]


def copy_from_peers(buffer, out: torch.Tensor, pieces: Sequence[tuple[int, int, int]], count: int) -> None:
    """Copy ``count`` elements per piece out of the ranks' symmetric buffers into ``out``, in one kernel.

    buffer: a ``staging_buffer`` (a ``pkb.kernels.SymmetricBuffer``).  out: a contiguous CUDA tensor of
    the buffer's dtype, any shape (addressed flat).  pieces: ``(rank, buffer_offset, out_offset)``,
    offsets in elements: each piece copies ``buffer.peer(rank)[buffer_offset : buffer_offset + count]``
    to ``out.view(-1)[out_offset : out_offset + count]``; ``rank`` may be this rank (a local copy).
    Bit-exact. 16-byte loads and stores where a piece's addresses and length allow, else bytes.
    Example, an all-gather of ``n`` elements per rank into ``out`` [W, n]:
    ``copy_from_peers(buffer, out, [(r, 0, r * n) for r in range(W)], n)``.
    """
    size = buffer.local.numel()
    if out.dtype != buffer.local.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous with the buffer's dtype {buffer.local.dtype}, got {out.dtype}")
    for rank, buffer_offset, out_offset in pieces:
        if not (0 <= rank < buffer.world_size and 0 <= buffer_offset and buffer_offset + count <= size
                and 0 <= out_offset and out_offset + count <= out.numel()):
            raise ValueError(f"piece (rank {rank}, buffer offset {buffer_offset}, out offset {out_offset}) of {count} "
                             f"elements is outside {buffer.world_size} ranks' buffers of {size} or out of {out.numel()}")
    element = out.element_size()
    peer_kernels().copy_pieces(buffer.buffer_ptrs_dev, out, [p[0] for p in pieces], [p[1] * element for p in pieces],
                               [p[2] * element for p in pieces], count * element)


def sum_from_peers(buffer, out: torch.Tensor) -> None:
    """``out`` = the element-wise sum over every rank of its buffer's first ``out.numel()`` elements.

    buffer: a ``staging_buffer``; out: a contiguous CUDA tensor of the buffer's dtype (fp32, fp16 or
    bf16), any shape. Accumulated in fp32 in rank order 0..W-1 and rounded once, so every rank that
    calls it computes bit-identical sums. Each rank that calls it reads (W-1) * out's bytes over NVLink.
    """
    if out.dtype != buffer.local.dtype or not out.is_contiguous() or out.numel() > buffer.local.numel():
        raise ValueError(f"out ({out.dtype}, {out.numel()} elements) must be contiguous, with the buffer's dtype "
                         f"{buffer.local.dtype} and at most its {buffer.local.numel()} elements")
    peer_kernels().sum_peers(buffer.buffer_ptrs_dev, buffer.world_size, out)
