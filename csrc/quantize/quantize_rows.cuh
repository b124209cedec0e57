// Device code of the row quantizer, shared by its kernels: bf16 rows as they are
// (quantize_kernel.cu) and rows computed on the fly from GEGLU inputs
// (quantize_geglu_kernel.cu). Both must quantize a given bf16 row to the same bits, so
// the amax reduction, zero-row rule, scale formula and e4m3 rounding live here once.
//
// One block per row. The row is read from HBM once: each thread keeps its 16-byte
// chunks (8 bf16 values) in registers between the amax reduction and the conversion
// (rows longer than the register cache are produced twice, the second time from L2 in
// practice). The block size, the cache size and the blocks per SM that ptxas must leave room
// for are template parameters; launch() is the plain quantizer's choice of them, a kernel with
// a costlier row source picks its own (quantize_geglu_kernel.cu).
//
// A kernel is parameterised by its row source, a copyable struct with
//   Raw                                    what one chunk's global loads return
//   __device__ Raw load(int64_t i) const   the loads of chunk i of the [rows, chunks] input
//   __device__ static uint4 make(Raw)      the chunk's 8 bf16 row values; make(Raw{}) must be
//                                          the zero chunk (the padding past a row's end)
// Loads and arithmetic are separate steps, and the arithmetic runs on the padding too: with
// the arithmetic inside the row-end check, nvcc branches around each chunk and its loads go
// out one chunk at a time, after the previous chunk's arithmetic.
// A cached row's chunks are loaded and made once, an uncached row's twice.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/ptx.cuh"
#include "quantize/quantize_kernel.h"

namespace mila::quantize_rows {

constexpr int kThreads = 256;     // launch()'s block size
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

// Called once per block (its shared array is not reused).
template <int kBlock>
__device__ __forceinline__ float block_max(float v) {
  __shared__ float warp_max[kBlock / 32];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = v;
  __syncthreads();
  v = warp_max[0];
#pragma unroll
  for (int w = 1; w < kBlock / 32; ++w) v = fmaxf(v, warp_max[w]);
  return v;
}

// kBlock threads per row. kCached > 0: each thread caches up to kCached chunks (the row fits
// the cache). kCached == 0: the row is produced twice. kMinBlocks: blocks per SM that ptxas
// must leave registers for (65536 / (kBlock * kMinBlocks) per thread at most).
template <int kBlock, int kCached, int kMinBlocks, typename Source>
__global__ void __launch_bounds__(kBlock, kMinBlocks)
quantize_rows_kernel(const Source src, uint2* __restrict__ q, float* __restrict__ scale,
                     int64_t chunks_per_row) {
  const int64_t row = blockIdx.x;
  const int64_t base = row * chunks_per_row;
  uint2* qr = q + base;

  uint4 cache[kCached > 0 ? kCached : 1];
  float amax = 0.f;
  if constexpr (kCached > 0) {
    // A cached row has fewer than 2^31 chunks: 32-bit column arithmetic.
    const int chunks = static_cast<int>(chunks_per_row);
    typename Source::Raw raw[kCached];
#pragma unroll
    for (int i = 0; i < kCached; ++i) {
      const int c = threadIdx.x + i * kBlock;
      raw[i] = c < chunks ? src.load(base + c) : typename Source::Raw{};
    }
#pragma unroll
    for (int i = 0; i < kCached; ++i) cache[i] = Source::make(raw[i]);
#pragma unroll
    for (int i = 0; i < kCached; ++i) amax = fmaxf(amax, chunk_amax(cache[i]));
  } else {
    for (int64_t c = threadIdx.x; c < chunks_per_row; c += kBlock)
      amax = fmaxf(amax, chunk_amax(Source::make(src.load(base + c))));
  }
  amax = block_max<kBlock>(amax);

  const bool zero_row = amax < kQuantMinAmax;
  const float inv_scale = zero_row ? 0.f : kE4M3Max / amax;
  if (threadIdx.x == 0) scale[row] = zero_row ? 1.f : amax * kInvE4M3Max;

  if constexpr (kCached > 0) {
    const int chunks = static_cast<int>(chunks_per_row);
#pragma unroll
    for (int i = 0; i < kCached; ++i) {
      const int c = threadIdx.x + i * kBlock;
      if (c < chunks) qr[c] = chunk_to_e4m3(cache[i], inv_scale);
    }
  } else {
    for (int64_t c = threadIdx.x; c < chunks_per_row; c += kBlock)
      qr[c] = chunk_to_e4m3(Source::make(src.load(base + c)), inv_scale);
  }
}

template <int kBlock, int kCached, int kMinBlocks, typename Source>
void launch_rows(const Source& src, uint2* q, float* scale, int64_t rows, int64_t chunks,
                 cudaStream_t stream) {
  quantize_rows_kernel<kBlock, kCached, kMinBlocks>
      <<<dim3(static_cast<unsigned>(rows)), dim3(kBlock), 0, stream>>>(src, q, scale, chunks);
}

// Picks the smallest register cache that holds a row of `cols` values (cols % 8 == 0), with
// 256-thread blocks.
template <typename Source>
cudaError_t launch(const Source& src, uint8_t* q, float* scale, int64_t rows, int64_t cols,
                   cudaStream_t stream) {
  const int64_t chunks = cols / kBf16PerChunk;
  auto* qv = reinterpret_cast<uint2*>(q);
  if (chunks <= 1 * kThreads) {
    launch_rows<kThreads, 1, 0>(src, qv, scale, rows, chunks, stream);
  } else if (chunks <= 2 * kThreads) {
    launch_rows<kThreads, 2, 0>(src, qv, scale, rows, chunks, stream);
  } else if (chunks <= 4 * kThreads) {
    launch_rows<kThreads, 4, 0>(src, qv, scale, rows, chunks, stream);
  } else if (chunks <= 8 * kThreads) {
    launch_rows<kThreads, 8, 0>(src, qv, scale, rows, chunks, stream);
  } else if (chunks <= 16 * kThreads) {
    launch_rows<kThreads, 16, 0>(src, qv, scale, rows, chunks, stream);
  } else {
    launch_rows<kThreads, 0, 0>(src, qv, scale, rows, chunks, stream);
  }
  return cudaGetLastError();
}

}  // namespace mila::quantize_rows
