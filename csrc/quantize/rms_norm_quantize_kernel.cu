// The norms around a Gemma 4 decoder layer's W4A8 projections, fused with the activation
// quantizer (jax_mila.ffi.add_rms_norm_quantize; the definition is
// jax_mila.reference.add_rms_norm_quantize):
//   with a branch:  n = bf16(rms_norm(branch, wb)), h = bf16(x + n), written;
//                   (q, scale) = quantize(bf16(rms_norm(h, wn)))
//   without:        (q, scale) = quantize(bf16(rms_norm(x, wn)))
// rms_norm(v, w) = bf16((v * r) * w), r = (sum(v^2) / K + eps)^-0.5, all float32 (Gemma 4: the
// weight itself is the multiplier, jax_mila/nn/norm.py).
//
// One block per row at a time. The row stays in registers from its loads to its stores, so x and
// branch are read from HBM once and h and the normed row never go back to it; between the loads
// and the stores are three block reductions (the branch's sum of squares, h's, the normed row's
// amax). The grid holds as many blocks as fit on the GPU and each block strides over the rows:
// its threads keep their columns' weights (float32) in registers for every row, and the loads of
// the block's next row are issued before the current row's reductions, so they overlap.
// Rows past 8192 values take a kernel that re-reads the row (from L2 in practice) per pass.
//
// Where the float32 results may differ from XLA's: the sum of squares is summed in another
// order (each thread's values in sequence, then a butterfly over the warp, then the warps in
// order); r is __frsqrt_rn (correctly rounded, as XLA's CPU pow is to 0.5 ulp). Both are
// inside jax_mila.testing.add_rms_norm_quantization_problem's intervals. The products are
// __fmul_rn in rms_norm's order, (v * r) * w, and every rounding to bf16 is the one the
// reference does.
#include "quantize/quantize_kernel.h"

#include <map>
#include <mutex>
#include <tuple>

#include "quantize/quantize_rows.cuh"

namespace mila {
namespace {

using quantize_rows::chunk_amax;
using quantize_rows::chunk_to_e4m3;
using quantize_rows::kBf16PerChunk;

constexpr int kMaxThreads = 512;
constexpr int kMaxWarps = kMaxThreads / 32;
// A thread caches this many chunks of a row at most; longer rows take the uncached kernel.
constexpr int kMaxCachedChunks = 2;
constexpr int64_t kMaxCachedRowChunks = int64_t{kMaxCachedChunks} * kMaxThreads;  // K <= 8192

struct Params {
  const uint4* x;        // [rows, chunks], 8 bf16 per chunk
  const uint4* branch;   // the same, or null (no branch)
  const float4* branch_weight;  // [chunks * 2]: 8 floats per chunk (null without a branch)
  const float4* norm_weight;
  uint4* h;              // [rows, chunks] (null without a branch)
  uint2* q;              // [rows, chunks], 8 e4m3 per chunk
  float* scale;          // [rows]
  int64_t rows;
  int chunks;
  float cols;            // K as a float, the divisor of the mean
  float eps;
};

// A chunk's 8 weights.
struct Weights8 {
  float4 lo, hi;
};

__device__ __forceinline__ Weights8 load_weights(const float4* w, int c) {
  return {__ldg(w + 2 * c), __ldg(w + 2 * c + 1)};
}

__device__ __forceinline__ float chunk_sum_of_squares(const uint4& v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    s = fmaf(f.x, f.x, s);  // the square of a bf16 value is exact: an addition
    s = fmaf(f.y, f.y, s);
  }
  return s;
}

// rms_norm's (mean(v^2) + eps)^-0.5 from the row's sum of squares: the mean a float32 division
// (jnp.mean), eps one float32 addition, the power correctly rounded.
__device__ __forceinline__ float inverse_rms(float sum_of_squares, float cols, float eps) {
  return __frsqrt_rn(__fadd_rn(__fdiv_rn(sum_of_squares, cols), eps));
}

// bf16((v * r) * w) for the chunk's 8 values.
__device__ __forceinline__ uint4 norm_chunk(const uint4& v, float r, const Weights8& w) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
  const float wf[8] = {w.lo.x, w.lo.y, w.lo.z, w.lo.w, w.hi.x, w.hi.y, w.hi.z, w.hi.w};
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out[i] = ptx::pack_bf16x2(__fmul_rn(__fmul_rn(f.x, r), wf[2 * i]),
                              __fmul_rn(__fmul_rn(f.y, r), wf[2 * i + 1]));
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// bf16(x + n) of two bf16 chunks: the float32 sum, rounded once (a correctly rounded bf16 add:
// the float32 sum of two bf16 values is exact whenever the bf16 rounding depends on its bits).
__device__ __forceinline__ uint4 add_chunk(const uint4& x, const uint4& n) {
  const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&x);
  const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&n);
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 fa = __bfloat1622float2(a[i]);
    const float2 fb = __bfloat1622float2(b[i]);
    out[i] = ptx::pack_bf16x2(__fadd_rn(fa.x, fb.x), __fadd_rn(fa.y, fb.y));
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// Sum (kMax false) or max over the block; every thread returns the same value (the butterfly
// gives every lane the same sum, commutativity, and each thread adds the warps' in order).
// `buf` must not be read by another reduction between this call's write and the next
// __syncthreads after its read: the kernels give each reduction of a row its own buffer.
template <bool kMax>
__device__ __forceinline__ float block_reduce(float v, float* buf, int warps) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float o = __shfl_xor_sync(0xffffffffu, v, off);
    v = kMax ? fmaxf(v, o) : __fadd_rn(v, o);
  }
  if (threadIdx.x % 32 == 0) buf[threadIdx.x / 32] = v;
  __syncthreads();
  v = buf[0];
  for (int w = 1; w < warps; ++w) v = kMax ? fmaxf(v, buf[w]) : __fadd_rn(v, buf[w]);
  return v;
}

// The quantizer's scale and reciprocal from the normed row's amax (quantize_rows.cuh's rule).
struct RowScale {
  float inv;
  float scale;
};

__device__ __forceinline__ RowScale row_scale(float amax) {
  const bool zero_row = amax < kQuantMinAmax;
  return {zero_row ? 0.f : kE4M3Max / amax, zero_row ? 1.f : amax * kInvE4M3Max};
}

// One row's global loads: x and (with a branch) the branch, zero past the row's end.
template <int kChunks, bool kBranch>
struct RowData {
  uint4 x[kChunks];
  uint4 b[kBranch ? kChunks : 1];
};

template <int kChunks, bool kBranch>
__device__ __forceinline__ RowData<kChunks, kBranch> load_row(const Params& p, int64_t row) {
  RowData<kChunks, kBranch> d;
  const int64_t base = row * p.chunks;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = threadIdx.x + i * blockDim.x;
    const bool valid = c < p.chunks;
    d.x[i] = valid ? __ldg(p.x + base + c) : make_uint4(0, 0, 0, 0);
    if constexpr (kBranch) d.b[i] = valid ? __ldg(p.branch + base + c) : make_uint4(0, 0, 0, 0);
  }
  return d;
}

// Rows of at most kChunks * blockDim.x chunks. Padding chunks (past the row's end) hold zero
// values and zero weights, so they add nothing to the sums and the amax.
template <int kChunks, bool kBranch>
__global__ void __launch_bounds__(kMaxThreads)
rms_norm_quantize_cached(const Params p) {
  __shared__ float reduce_buf[3][kMaxWarps];
  const int warps = blockDim.x / 32;

  Weights8 wn[kChunks];
  Weights8 wb[kBranch ? kChunks : 1];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = threadIdx.x + i * blockDim.x;
    const bool valid = c < p.chunks;
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    wn[i] = valid ? load_weights(p.norm_weight, c) : Weights8{zero, zero};
    if constexpr (kBranch) wb[i] = valid ? load_weights(p.branch_weight, c) : Weights8{zero, zero};
  }

  int64_t row = blockIdx.x;
  if (row >= p.rows) return;
  RowData<kChunks, kBranch> next = load_row<kChunks, kBranch>(p, row);
  for (; row < p.rows; row += gridDim.x) {
    const RowData<kChunks, kBranch> cur = next;
    if (row + gridDim.x < p.rows) next = load_row<kChunks, kBranch>(p, row + gridDim.x);
    const int64_t base = row * p.chunks;

    uint4 v[kChunks];  // h, then the normed row
    if constexpr (kBranch) {
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < kChunks; ++i) ss += chunk_sum_of_squares(cur.b[i]);
      const float rb = inverse_rms(block_reduce<false>(ss, reduce_buf[0], warps), p.cols, p.eps);
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        v[i] = add_chunk(cur.x[i], norm_chunk(cur.b[i], rb, wb[i]));
        const int c = threadIdx.x + i * blockDim.x;
        if (c < p.chunks) p.h[base + c] = v[i];
      }
    } else {
#pragma unroll
      for (int i = 0; i < kChunks; ++i) v[i] = cur.x[i];
    }

    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) ss += chunk_sum_of_squares(v[i]);
    const float r = inverse_rms(block_reduce<false>(ss, reduce_buf[1], warps), p.cols, p.eps);
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      v[i] = norm_chunk(v[i], r, wn[i]);
      amax = fmaxf(amax, chunk_amax(v[i]));
    }
    const RowScale s = row_scale(block_reduce<true>(amax, reduce_buf[2], warps));
    if (threadIdx.x == 0) p.scale[row] = s.scale;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = threadIdx.x + i * blockDim.x;
      if (c < p.chunks) p.q[base + c] = chunk_to_e4m3(v[i], s.inv);
    }
  }
}

// Rows longer than the register cache: one block per row, every pass re-reads the row and
// recomputes h and the normed values from it (the same operations, so the same bits).
template <bool kBranch>
__device__ __forceinline__ uint4 h_chunk(const Params& p, int64_t i, int c, float rb) {
  const uint4 x = __ldg(p.x + i);
  if constexpr (kBranch) {
    return add_chunk(x, norm_chunk(__ldg(p.branch + i), rb, load_weights(p.branch_weight, c)));
  } else {
    return x;
  }
}

template <bool kBranch>
__global__ void __launch_bounds__(kMaxThreads)
rms_norm_quantize_uncached(const Params p) {
  __shared__ float reduce_buf[3][kMaxWarps];
  const int warps = blockDim.x / 32;
  const int64_t row = blockIdx.x;
  const int64_t base = row * p.chunks;

  float rb = 0.f;
  if constexpr (kBranch) {
    float ss = 0.f;
    for (int c = threadIdx.x; c < p.chunks; c += blockDim.x)
      ss += chunk_sum_of_squares(__ldg(p.branch + base + c));
    rb = inverse_rms(block_reduce<false>(ss, reduce_buf[0], warps), p.cols, p.eps);
  }
  float ss = 0.f;
  for (int c = threadIdx.x; c < p.chunks; c += blockDim.x) {
    const uint4 h = h_chunk<kBranch>(p, base + c, c, rb);
    if constexpr (kBranch) p.h[base + c] = h;
    ss += chunk_sum_of_squares(h);
  }
  const float r = inverse_rms(block_reduce<false>(ss, reduce_buf[1], warps), p.cols, p.eps);
  float amax = 0.f;
  for (int c = threadIdx.x; c < p.chunks; c += blockDim.x) {
    const uint4 y = norm_chunk(h_chunk<kBranch>(p, base + c, c, rb), r,
                               load_weights(p.norm_weight, c));
    amax = fmaxf(amax, chunk_amax(y));
  }
  const RowScale s = row_scale(block_reduce<true>(amax, reduce_buf[2], warps));
  if (threadIdx.x == 0) p.scale[row] = s.scale;
  for (int c = threadIdx.x; c < p.chunks; c += blockDim.x) {
    const uint4 y = norm_chunk(h_chunk<kBranch>(p, base + c, c, rb), r,
                               load_weights(p.norm_weight, c));
    p.q[base + c] = chunk_to_e4m3(y, s.inv);
  }
}

// Blocks of `threads` that fit on the current device at once (SMs x blocks per SM), cached per
// (device, kernel, block size): the strided kernels' grid.
template <typename Kernel>
int64_t resident_blocks(Kernel kernel, int threads) {
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, int>, int64_t> cache;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  const auto key = std::make_tuple(device, reinterpret_cast<const void*>(kernel), threads);
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = cache.find(key); it != cache.end()) return it->second;
  }
  int sms = 0, per_sm = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0) != cudaSuccess) {
    return 0;
  }
  const int64_t blocks = int64_t{sms} * per_sm;
  std::lock_guard<std::mutex> lock(mutex);
  cache[key] = blocks;
  return blocks;
}

int round_up_warps(int64_t threads) { return static_cast<int>((threads + 31) / 32 * 32); }

template <int kChunks, bool kBranch>
cudaError_t launch_cached(const Params& p, cudaStream_t stream) {
  const int threads = round_up_warps((p.chunks + kChunks - 1) / kChunks);
  auto kernel = rms_norm_quantize_cached<kChunks, kBranch>;
  // Any grid gives the same result; without the occupancy (a failed query, reported by the
  // launch check), one block per row.
  const int64_t resident = resident_blocks(kernel, threads);
  const int64_t grid = resident > 0 && resident < p.rows ? resident : p.rows;
  kernel<<<dim3(static_cast<unsigned>(grid)), dim3(threads), 0, stream>>>(p);
  return cudaGetLastError();
}

template <bool kBranch>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  // One chunk per thread up to 512 chunks (K <= 4096: the 12B's 3840 takes 480 threads), two
  // up to 1024 (K <= 8192: the 31B's 5376 takes 352 threads), beyond that the uncached kernel.
  if (p.chunks <= kMaxThreads) return launch_cached<1, kBranch>(p, stream);
  if (p.chunks <= kMaxCachedRowChunks) return launch_cached<kMaxCachedChunks, kBranch>(p, stream);
  rms_norm_quantize_uncached<kBranch>
      <<<dim3(static_cast<unsigned>(p.rows)), dim3(kMaxThreads), 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchAddRmsNormQuantize(const __nv_bfloat16* x, const __nv_bfloat16* branch,
                                     const float* branch_weight, const float* norm_weight,
                                     float eps, __nv_bfloat16* h, uint8_t* q, float* scale,
                                     int64_t rows, int64_t cols, cudaStream_t stream) {
  Params p;
  p.x = reinterpret_cast<const uint4*>(x);
  p.branch = reinterpret_cast<const uint4*>(branch);
  p.branch_weight = reinterpret_cast<const float4*>(branch_weight);
  p.norm_weight = reinterpret_cast<const float4*>(norm_weight);
  p.h = reinterpret_cast<uint4*>(h);
  p.q = reinterpret_cast<uint2*>(q);
  p.scale = scale;
  p.rows = rows;
  p.chunks = static_cast<int>(cols / kBf16PerChunk);
  p.cols = static_cast<float>(cols);
  p.eps = eps;
  return branch != nullptr ? launch<true>(p, stream) : launch<false>(p, stream);
}

}  // namespace mila
