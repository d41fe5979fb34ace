"""Pieces the shipped CUDA solutions share: dtype conversions for kernels, and a symmetric-buffer cache."""

import torch

from pkb.kernels import symmetric_buffer

# fp32 <-> storage type conversions, for kernels templated on the element type.
CUDA_CONVERSIONS = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

#define DISPATCH_FLOAT_TYPES(dtype, ...)                                              \
  switch (dtype) {                                                                    \
    case at::kFloat: { using scalar_t = float; __VA_ARGS__; break; }                  \
    case at::kHalf: { using scalar_t = __half; __VA_ARGS__; break; }                  \
    case at::kBFloat16: { using scalar_t = __nv_bfloat16; __VA_ARGS__; break; }       \
    default: TORCH_CHECK(false, "unsupported dtype ", dtype);                         \
  }
"""

# out[i] = the sum over ranks r of rank r's buffer[i] (ptrs: a device array of the W buffers' addresses),
# accumulated in fp32 in rank order and rounded once, so every rank computes bit-identical sums;
# 16-byte loads for the first num_vec * (16 / sizeof(T)) elements, then one element at a time.
SUM_PEERS_KERNEL = r"""
template <typename T>
__global__ void sum_peers_kernel(const uint64_t* __restrict__ ptrs, int world_size, T* __restrict__ out,
                                 int64_t n, int64_t num_vec) {
  constexpr int VEC = 16 / sizeof(T);
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; v < num_vec; v += stride) {
    float acc[VEC] = {0.f};
    for (int r = 0; r < world_size; ++r) {
      uint4 raw = reinterpret_cast<const uint4*>(ptrs[r])[v];
      const T* vals = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] += to_float(vals[j]);
    }
    uint4 packed;
    T* outs = reinterpret_cast<T*>(&packed);
#pragma unroll
    for (int j = 0; j < VEC; ++j) outs[j] = from_float<T>(acc[j]);
    reinterpret_cast<uint4*>(out)[v] = packed;
  }
  for (int64_t i = num_vec * VEC + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    float acc = 0.f;
    for (int r = 0; r < world_size; ++r) acc += to_float(reinterpret_cast<const T*>(ptrs[r])[i]);
    out[i] = from_float<T>(acc);
  }
}
"""

_BUFFERS = {}


def staging_buffer(numel: int, dtype: torch.dtype):
    """A symmetric buffer of at least ``numel`` elements (collective on first use and on growth).

    Every rank calls this with the same arguments (they run the same case), so the allocations and
    rendezvous line up across ranks.
    """
    buffer = _BUFFERS.get(dtype)
    if buffer is None or buffer.local.numel() < numel:
        buffer = symmetric_buffer((max(numel, 1),), dtype)
        _BUFFERS[dtype] = buffer
    return buffer
