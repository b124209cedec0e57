// One block per row. The row is read from HBM once: each thread keeps its
// 16-byte chunks in registers between the amax reduction and the conversion
// (rows longer than the register cache are re-read, from L2 in practice).
#include "quantize/quantize_kernel.h"

#include <cfloat>

#include "common/ptx.cuh"

namespace mila {
namespace {

constexpr int kThreads = 256;
constexpr int kBf16PerChunk = 8;  // one uint4

__device__ __forceinline__ float chunk_amax(const uint4& v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __bfloat1622float2(h[i]);
    m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
  }
  return m;
}

__device__ __forceinline__ uint2 chunk_to_e4m3(const uint4& v, float inv_scale) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
  uint16_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __bfloat1622float2(h[i]);
    out[i] = ptx::pack_e4m3x2(f.x * inv_scale, f.y * inv_scale);
  }
  return make_uint2(out[0] | (uint32_t(out[1]) << 16), out[2] | (uint32_t(out[3]) << 16));
}

__device__ __forceinline__ float block_max(float v) {
  __shared__ float warp_max[kThreads / 32];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = v;
  __syncthreads();
  v = warp_max[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) v = fmaxf(v, warp_max[w]);
  return v;
}

// kCached > 0: each thread caches up to kCached chunks (row fits the cache).
// kCached == 0: two passes over global memory.
template <int kCached>
__global__ void __launch_bounds__(kThreads)
quantize_rows_kernel(const uint4* __restrict__ x, uint2* __restrict__ q, float* __restrict__ scale,
                     int64_t chunks_per_row) {
  const int64_t row = blockIdx.x;
  const uint4* xr = x + row * chunks_per_row;
  uint2* qr = q + row * chunks_per_row;

  uint4 cache[kCached > 0 ? kCached : 1];
  float amax = 0.f;
  if constexpr (kCached > 0) {
#pragma unroll
    for (int i = 0; i < kCached; ++i) {
      const int64_t c = threadIdx.x + int64_t(i) * kThreads;
      cache[i] = c < chunks_per_row ? __ldg(xr + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kCached; ++i) amax = fmaxf(amax, chunk_amax(cache[i]));
  } else {
    for (int64_t c = threadIdx.x; c < chunks_per_row; c += kThreads)
      amax = fmaxf(amax, chunk_amax(__ldg(xr + c)));
  }
  amax = block_max(amax);

  const bool zero_row = amax < kQuantMinAmax;
  const float inv_scale = zero_row ? 0.f : kE4M3Max / amax;
  if (threadIdx.x == 0) scale[row] = zero_row ? 1.f : amax * kInvE4M3Max;

  if constexpr (kCached > 0) {
#pragma unroll
    for (int i = 0; i < kCached; ++i) {
      const int64_t c = threadIdx.x + int64_t(i) * kThreads;
      if (c < chunks_per_row) qr[c] = chunk_to_e4m3(cache[i], inv_scale);
    }
  } else {
    for (int64_t c = threadIdx.x; c < chunks_per_row; c += kThreads)
      qr[c] = chunk_to_e4m3(__ldg(xr + c), inv_scale);
  }
}

}  // namespace

cudaError_t LaunchQuantizeActivations(const __nv_bfloat16* x, uint8_t* q, float* scale,
                                      int64_t rows, int64_t cols, cudaStream_t stream) {
  const int64_t chunks = cols / kBf16PerChunk;
  const auto* xv = reinterpret_cast<const uint4*>(x);
  auto* qv = reinterpret_cast<uint2*>(q);
  const dim3 grid(static_cast<unsigned>(rows)), block(kThreads);
  if (chunks <= 1 * kThreads) {
    quantize_rows_kernel<1><<<grid, block, 0, stream>>>(xv, qv, scale, chunks);
  } else if (chunks <= 2 * kThreads) {
    quantize_rows_kernel<2><<<grid, block, 0, stream>>>(xv, qv, scale, chunks);
  } else if (chunks <= 4 * kThreads) {
    quantize_rows_kernel<4><<<grid, block, 0, stream>>>(xv, qv, scale, chunks);
  } else if (chunks <= 8 * kThreads) {
    quantize_rows_kernel<8><<<grid, block, 0, stream>>>(xv, qv, scale, chunks);
  } else if (chunks <= 16 * kThreads) {
    quantize_rows_kernel<16><<<grid, block, 0, stream>>>(xv, qv, scale, chunks);
  } else {
    quantize_rows_kernel<0><<<grid, block, 0, stream>>>(xv, qv, scale, chunks);
  }
  return cudaGetLastError();
}

}  // namespace mila
