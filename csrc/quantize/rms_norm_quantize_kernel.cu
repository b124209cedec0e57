// The norms around a Gemma 4 decoder layer's W4A8 projections, fused with the activation
// quantizer (jax_mila.ffi.add_rms_norm_quantize; the definition is
// jax_mila.reference.add_rms_norm_quantize):
//   with a branch:  n = bf16(rms_norm(branch, wb)), h = bf16(x + n), written;
//                   (q, scale) = quantize(bf16(rms_norm(h, wn)))
//   without:        (q, scale) = quantize(bf16(rms_norm(x, wn)))
// rms_norm(v, w) = bf16((v * r) * w), r = (sum(v^2) / K + eps)^-0.5, all float32 (Gemma 4: the
// weight itself is the multiplier, jax_mila/nn/norm.py).
//
// Many rows in flight per SM, warp-level reductions. A row is held in registers by one warp (or,
// for longer rows and for rows with a branch past 256 chunks, a pair of warps) from its loads to
// its stores, so x and branch are read from HBM once and h and the normed row never go back to
// it. Lane t of the row's group holds chunks t, t + 32 G, ... (16-byte chunks of 8 bf16; G the
// warps of the group): every load and store instruction of a warp covers 32 consecutive chunks
// (x, branch, h: 512 bytes; q: 256). The three reductions of a row (the branch's sum of squares,
// h's, the normed row's amax) are warp butterflies, plus one shared-memory exchange and
// __syncthreads of the 64-thread block for a two-warp group. 64-thread blocks (two one-warp rows
// or one two-warp row), a grid of as many as fit on the GPU at once; the groups stride over the
// rows. The float32 weights are read per row through L1 (ld.global.nc; x and the branch are
// loaded with L1::no_allocate so that they do not evict them), after the reduction that precedes
// their use. Occupancy is set per configuration by __launch_bounds__ (cached_min_blocks): at
// K = 3840, 20 warps per SM (20 rows in flight, 96 registers) without a branch, 20 warps (10
// two-warp rows, 96 registers) with one. Rows past 8192 values take a kernel that re-reads the
// row (from L2 in practice) per pass.
//
// Where the float32 results may differ from XLA's: the sum of squares is summed in another
// order (each thread's values in sequence, then a butterfly over the warp, then the warps in
// order); r is __frsqrt_rn (correctly rounded, as XLA's CPU pow is to 0.5 ulp). Both are
// inside jax_mila.reference.bounds.add_rms_norm_quantization_problem's intervals. The products are
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

// The uncached kernel's block (one row per block).
constexpr int kMaxThreads = 512;
constexpr int kMaxWarps = kMaxThreads / 32;
// The cached kernels: a row's chunks held in registers by one warp or by a pair of warps, up to
// 1024 chunks (K <= 8192); longer rows take the uncached kernel.
constexpr int kMaxCachedRowChunks = 64 * 16;
// Both kinds of cached kernel run 64-thread blocks: two independent one-warp rows, or one
// two-warp row (a small block makes the occupancy bound below fine-grained).
constexpr int kCachedThreads = 64;

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
  uint32_t zero;         // 0 (refresh())
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

// A 16-byte chunk of a streamed input (x, branch: each read once), or zero where !valid. Not
// allocated in L1, which keeps the weights (read by every row) there.
__device__ __forceinline__ uint4 load_stream(const uint4* ptr, bool valid) {
  return ptx::ld_nc_v4_or_zero<true>(ptr, valid);
}

// 4 weights through L1 (ld.global.nc), zeros where !valid.
__device__ __forceinline__ float4 load_weight4(const float4* ptr, bool valid) {
  const uint4 v = ptx::ld_nc_v4_or_zero<false>(ptr, valid);
  return make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z),
                     __uint_as_float(v.w));
}

// A chunk's 8 weights, or zeros where !valid (the padding past a row's end).
__device__ __forceinline__ Weights8 load_weights_or_zero(const float4* w, int c, bool valid) {
  return {load_weight4(w + 2 * c, valid), load_weight4(w + 2 * c + 1, valid)};
}

// The weights `w` as an address that depends on the row's reduction result `r`: w itself
// (Params::zero is 0), but the compilers cannot know that. The weights are the same for every
// row, so without the dependency NVVM hoists their loads out of the row loop (every weight of the
// lane in registers: 8 a chunk and norm) and ptxas hoists them above the reduction (the same
// registers while the row waits for it); with it they are loaded from L1 after the reduction,
// just before their use.
__device__ __forceinline__ const float4* after(const float4* w, float r, uint32_t zero) {
  return w + (__float_as_uint(r) & zero);
}

// v ^ zero, where zero is Params::zero (always 0, unknown to the compiler): applied to every
// chunk of the row after each of its reductions. The compilers (NVVM and ptxas) otherwise convert
// each bf16 pair to float32 once for the uses on both sides of a reduction and keep the floats
// (8 registers a chunk instead of 4) live across it: about twice the registers, spills under the
// occupancy bound. One LOP per word and reduction; the chunk is converted again after it.
__device__ __forceinline__ void refresh(uint4& v, uint32_t zero) {
  v.x ^= zero;
  v.y ^= zero;
  v.z ^= zero;
  v.w ^= zero;
}

// Sum (kMax false) or max over a row's group of kWarps warps; every thread of the group returns
// the same value (the butterfly gives every lane the same value by commutativity, and each
// thread combines the warps' in order). kWarps > 1: the block is the group; `buf` [kWarps] must
// not be written by another reduction between this call's __syncthreads and its reads: the
// kernel gives each reduction of a row its own buffer (a warp cannot reach the next row's use of
// a buffer before every warp has passed the following reduction's barrier, i.e. done its reads).
template <int kWarps, bool kMax>
__device__ __forceinline__ float group_reduce(float v, float* buf) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float o = __shfl_xor_sync(0xffffffffu, v, off);
    v = kMax ? fmaxf(v, o) : __fadd_rn(v, o);
  }
  if constexpr (kWarps > 1) {
    if (threadIdx.x % 32 == 0) buf[threadIdx.x / 32] = v;
    __syncthreads();
    v = buf[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) v = kMax ? fmaxf(v, buf[w]) : __fadd_rn(v, buf[w]);
  }
  return v;
}

// 64-thread blocks per SM that ptxas must leave registers for (65536 / (64 x blocks) registers a
// thread at most), per configuration: the largest count for which ptxas spills nothing on sm_80,
// sm_89 and sm_90a (nvcc 13.0; a search over 4..32), at most 16 (32 warps). Without a bound
// ptxas takes up to 255 registers (it issues the weight loads of every chunk at once), with a
// tighter one than these it spills.
template <int kWarps, int kChunks, bool kBranch>
constexpr int cached_min_blocks() {
  if constexpr (kChunks <= 4) return 16;                 // <= 64 registers
  if constexpr (!kBranch) {
    if constexpr (kWarps == 1 && kChunks == 15) return 10;  // 96 registers, 20 warps
    if constexpr (kWarps == 2 && kChunks == 16) return 10;
    return 14;                                           // 72 registers, 28 warps
  } else {
    if constexpr (kChunks == 8) return 10;               // 96 registers, 20 warps
    if constexpr (kChunks == 12) return 6;               // 168 registers, 12 warps
    return 4;                                            // 255 registers, 8 warps
  }
}

// Rows of at most 32 * kWarps * kChunks chunks, each held in registers by a group of kWarps
// warps from its loads to its stores: lane t of the group (t = 0 .. 32 kWarps - 1) holds chunks
// t, t + 32 kWarps, ... (each load and store instruction of a warp covers 32 consecutive chunks).
// kWarps == 1: 64-thread blocks of 2 independent warps, no barrier; kWarps == 2: the block is
// the group (one __syncthreads per reduction). The groups stride over the rows (the grid is what fits on the GPU at once, or fewer
// blocks than that for few rows). Padding chunks (past the row's end) hold zero values and zero
// weights, so they add nothing to the sums and the amax, and are not stored.
template <int kWarps, int kChunks, bool kBranch, int kMinBlocks>
__global__ void __launch_bounds__(kCachedThreads, kMinBlocks)
rms_norm_quantize_cached(const Params p) {
  constexpr int kGroupThreads = 32 * kWarps;
  constexpr int kRowsPerBlock = kCachedThreads / kGroupThreads;
  __shared__ float reduce_buf[3][kWarps];
  const int t = kWarps == 1 ? threadIdx.x % 32 : threadIdx.x;  // the thread in its group
  const int64_t row_step = int64_t{gridDim.x} * kRowsPerBlock;
  for (int64_t row = int64_t{blockIdx.x} * kRowsPerBlock + threadIdx.x / kGroupThreads;
       row < p.rows; row += row_step) {
    const int64_t base = row * p.chunks;
    // Every load of the row first (loads and arithmetic as separate steps: quantize_rows.cuh).
    uint4 v[kChunks];  // x, then h, then the normed row
    uint4 b[kBranch ? kChunks : 1];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = t + i * kGroupThreads;
      v[i] = load_stream(p.x + base + c, c < p.chunks);
      if constexpr (kBranch) b[i] = load_stream(p.branch + base + c, c < p.chunks);
    }

    if constexpr (kBranch) {
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < kChunks; ++i) ss += chunk_sum_of_squares(b[i]);
      const float rb =
          inverse_rms(group_reduce<kWarps, false>(ss, reduce_buf[0]), p.cols, p.eps);
#pragma unroll
      for (int i = 0; i < kChunks; ++i) refresh(b[i], p.zero);
      const float4* wb = after(p.branch_weight, rb, p.zero);
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const int c = t + i * kGroupThreads;
        const bool valid = c < p.chunks;
        v[i] = add_chunk(v[i], norm_chunk(b[i], rb, load_weights_or_zero(wb, c, valid)));
        if (valid) p.h[base + c] = v[i];
      }
    }

    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) ss += chunk_sum_of_squares(v[i]);
    const float r = inverse_rms(group_reduce<kWarps, false>(ss, reduce_buf[1]), p.cols, p.eps);
#pragma unroll
    for (int i = 0; i < kChunks; ++i) refresh(v[i], p.zero);
    const float4* wn = after(p.norm_weight, r, p.zero);
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = t + i * kGroupThreads;
      v[i] = norm_chunk(v[i], r, load_weights_or_zero(wn, c, c < p.chunks));
      amax = fmaxf(amax, chunk_amax(v[i]));
    }
    const RowScale s = row_scale(group_reduce<kWarps, true>(amax, reduce_buf[2]));
    if (t == 0) p.scale[row] = s.scale;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) refresh(v[i], p.zero);
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = t + i * kGroupThreads;
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
// (device, kernel, block size): the strided kernels' grid. Only attribute and occupancy queries,
// no stream work, so it is valid while the stream is being captured into a CUDA graph.
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

template <int kWarps, int kChunks, bool kBranch>
cudaError_t launch_cached(const Params& p, cudaStream_t stream) {
  constexpr int kThreads = kCachedThreads;
  constexpr int kRowsPerBlock = kThreads / (32 * kWarps);
  auto kernel = rms_norm_quantize_cached<kWarps, kChunks, kBranch,
                                         cached_min_blocks<kWarps, kChunks, kBranch>()>;
  // Any grid gives the same result; without the occupancy (a failed query, reported by the
  // launch check), one group per row.
  const int64_t needed = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t resident = resident_blocks(kernel, kThreads);
  const int64_t grid = resident > 0 && resident < needed ? resident : needed;
  kernel<<<dim3(static_cast<unsigned>(grid)), dim3(kThreads), 0, stream>>>(p);
  return cudaGetLastError();
}

template <bool kBranch>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  // The fewest chunks a lane that hold the row, at most 15 (no branch) or 8 (with a branch: x and
  // the branch held, 2 x 4 registers a chunk) a lane of one warp, then two warps per row up to
  // 1024 chunks (K <= 8192). At K = 3840 (480 chunks): 1 warp x 15 chunks without a branch, 2
  // warps x 8 with one; the 31B's 5376 (672 chunks): 2 warps x 12. Beyond: the uncached kernel.
  const int n = p.chunks;
  if (n <= 32 * 1) return launch_cached<1, 1, kBranch>(p, stream);
  if (n <= 32 * 2) return launch_cached<1, 2, kBranch>(p, stream);
  if (n <= 32 * 4) return launch_cached<1, 4, kBranch>(p, stream);
  if (n <= 32 * 8) return launch_cached<1, 8, kBranch>(p, stream);
  if constexpr (!kBranch) {
    if (n <= 32 * 12) return launch_cached<1, 12, kBranch>(p, stream);
    if (n <= 32 * 15) return launch_cached<1, 15, kBranch>(p, stream);
  }
  if (n <= 64 * 8) return launch_cached<2, 8, kBranch>(p, stream);
  if (n <= 64 * 12) return launch_cached<2, 12, kBranch>(p, stream);
  if (n <= kMaxCachedRowChunks) return launch_cached<2, 16, kBranch>(p, stream);
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
  p.zero = 0;
  return branch != nullptr ? launch<true>(p, stream) : launch<false>(p, stream);
}

}  // namespace mila
