// The fused per-head RMS norm and rotary embedding of Gemma 4's attention (q_norm / k_norm, then
// RoPE), one pass over q or k instead of XLA's two (see norm_rope_kernel.h for the definition).
//
// Memory-bound: every row is read once and written once, and nothing else of size goes to HBM.
// A row of D values is held in registers by kLanes = D / 16 lanes (half a warp for D = 256, a
// warp for D = 512), lane c holding the 16-byte chunks c and c + kLanes: 8 values of the first
// half and the 8 values D/2 further on, which are exactly their rotate_half partners. So the
// rotation needs no exchange between lanes, only the sum of squares does (a butterfly over the
// row's lanes), and each of a warp's 16-byte loads and stores covers 256 or 512 contiguous bytes.
// 256-thread blocks take consecutive rows (16 of D = 256, 8 of D = 512), i.e. the heads of one
// token or two: the token's cos / sin rows, read by every one of its heads, come from L1 (or L2
// for the block holding the token's other heads), while x goes around L1 (L1::no_allocate) so
// that it does not evict them or the weights.
//
// Where the results may differ from the reference (jax_mila/reference/norm_rope.py): the squares
// are summed in another order and r is __frsqrt_rn (correctly rounded), which moves rare normed
// values by a bf16 step near a rounding tie; jax_mila.reference.bounds.norm_rope_problem states what is
// admissible. The rest is the reference's arithmetic: (x * r) * w rounded once to bf16, then
// n * cos -+ partner * sin in float32 rounded once to bf16.
#include "norm_rope/norm_rope_kernel.h"

#include "common/ptx.cuh"

namespace mila {
namespace {

constexpr int kThreads = 256;
constexpr int kBf16PerChunk = 8;  // one uint4

struct Params {
  const uint4* x;         // [rows, D / 8] chunks of 8 bf16
  const float4* weight;   // [D / 4]
  const uint4* cos;       // [tokens, D / 8]
  const uint4* sin;
  uint4* out;             // [rows, D / 8]
  uint32_t rows;
  uint32_t heads;
  uint32_t tokens;
  float eps;
};

__device__ __forceinline__ void unpack(const uint4& chunk, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&chunk);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __bfloat1622float2(h[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

__device__ __forceinline__ float sum_of_squares(const uint4& chunk) {
  float f[8];
  unpack(chunk, f);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s = fmaf(f[i], f[i], s);  // a bf16 square is exact: an addition
  return s;
}

// bf16((v * r) * w) of a chunk's 8 values, in rms_norm's order, packed (4 registers, not 8).
__device__ __forceinline__ uint4 norm_chunk(const uint4& chunk, float r, const float4& w0,
                                            const float4& w1) {
  float f[8];
  unpack(chunk, f);
  const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
  uint32_t n[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    n[i] = ptx::pack_bf16x2(__fmul_rn(__fmul_rn(f[2 * i], r), w[2 * i]),
                            __fmul_rn(__fmul_rn(f[2 * i + 1], r), w[2 * i + 1]));
  return make_uint4(n[0], n[1], n[2], n[3]);
}

__device__ __forceinline__ float2 pair(const uint4& chunk, int i) {
  const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[i]));
}

// Blocks per SM that ptxas must leave registers for: 6 x 256 threads at 40 registers a thread
// (48 warps, all that sm_89 holds), the most for which ptxas spills nothing on sm_80, sm_89 and
// sm_90a (nvcc 13.0; 8 blocks, 32 registers, spill). Unbounded it takes 48 registers, 5 blocks:
// a memory-bound kernel wants the rows in flight of the sixth.
constexpr int kMinBlocks = 6;

template <int kD>
__global__ void __launch_bounds__(kThreads, kMinBlocks) rms_norm_rope_kernel(const Params p) {
  constexpr int kLanes = kD / (2 * kBf16PerChunk);  // a row's lanes = chunks in half a row
  constexpr int kRowsPerBlock = kThreads / kLanes;
  static_assert(kLanes == 16 || kLanes == 32, "a row's lanes must be a half or whole warp");

  const int c = threadIdx.x % kLanes;
  // rows < 2^31 (the handler checks), so the block's first row plus its size fits 32 bits.
  const uint32_t row = blockIdx.x * kRowsPerBlock + threadIdx.x / kLanes;
  const bool valid = row < p.rows;
  const size_t base = size_t{row} * (2 * kLanes);
  // Every load first: the row, its token's cos / sin (a padding row past the end reads token 0,
  // which exists, and stores nothing).
  const uint4 x_lo = ptx::ld_nc_v4_or_zero<true>(p.x + base + c, valid);
  const uint4 x_hi = ptx::ld_nc_v4_or_zero<true>(p.x + base + c + kLanes, valid);
  const uint32_t t = valid ? row / p.heads % p.tokens : 0u;
  const size_t table = size_t{t} * (2 * kLanes);
  const uint4 cos_lo = __ldg(p.cos + table + c), cos_hi = __ldg(p.cos + table + c + kLanes);
  const uint4 sin_lo = __ldg(p.sin + table + c), sin_hi = __ldg(p.sin + table + c + kLanes);

  // Every lane takes part in the butterfly (padding rows sum zeros); for D = 256 the offsets
  // stay inside each half warp, i.e. inside the row.
  float ss = __fadd_rn(sum_of_squares(x_lo), sum_of_squares(x_hi));
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1)
    ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, off));
  // rms_norm's (mean(x^2) + eps)^-0.5: the mean a float32 division, eps one addition.
  const float r = __frsqrt_rn(__fadd_rn(__fdiv_rn(ss, static_cast<float>(kD)), p.eps));

  const uint4 n_lo = norm_chunk(x_lo, r, __ldg(p.weight + 2 * c), __ldg(p.weight + 2 * c + 1));
  const uint4 n_hi = norm_chunk(x_hi, r, __ldg(p.weight + 2 * (c + kLanes)),
                                __ldg(p.weight + 2 * (c + kLanes) + 1));

  // out[d] = n[d] cos[d] - n[d + D/2] sin[d] (first half), n[d] cos[d] + n[d - D/2] sin[d]
  // (second half). A product of two bf16 values is exact in float32, so the fma rounds once,
  // exactly as the reference's float32 sum of the two products does.
  uint32_t o_lo[4], o_hi[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = pair(n_lo, i), b = pair(n_hi, i);
    const float2 cl = pair(cos_lo, i), sl = pair(sin_lo, i);
    const float2 ch = pair(cos_hi, i), sh = pair(sin_hi, i);
    o_lo[i] = ptx::pack_bf16x2(fmaf(a.x, cl.x, -__fmul_rn(b.x, sl.x)),
                               fmaf(a.y, cl.y, -__fmul_rn(b.y, sl.y)));
    o_hi[i] = ptx::pack_bf16x2(fmaf(b.x, ch.x, __fmul_rn(a.x, sh.x)),
                               fmaf(b.y, ch.y, __fmul_rn(a.y, sh.y)));
  }
  if (valid) {
    p.out[base + c] = make_uint4(o_lo[0], o_lo[1], o_lo[2], o_lo[3]);
    p.out[base + c + kLanes] = make_uint4(o_hi[0], o_hi[1], o_hi[2], o_hi[3]);
  }
}

template <int kD>
cudaError_t launch(const Params& p, cudaStream_t stream) {
  constexpr int kRowsPerBlock = kThreads / (kD / (2 * kBf16PerChunk));
  const unsigned blocks = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  rms_norm_rope_kernel<kD><<<dim3(blocks), dim3(kThreads), 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchRmsNormRope(const __nv_bfloat16* x, const float* weight,
                              const __nv_bfloat16* cos, const __nv_bfloat16* sin, float eps,
                              __nv_bfloat16* out, int64_t rows, int64_t heads, int64_t tokens,
                              int64_t head_dim, cudaStream_t stream) {
  Params p;
  p.x = reinterpret_cast<const uint4*>(x);
  p.weight = reinterpret_cast<const float4*>(weight);
  p.cos = reinterpret_cast<const uint4*>(cos);
  p.sin = reinterpret_cast<const uint4*>(sin);
  p.out = reinterpret_cast<uint4*>(out);
  p.rows = static_cast<uint32_t>(rows);
  p.heads = static_cast<uint32_t>(heads);
  p.tokens = static_cast<uint32_t>(tokens);
  p.eps = eps;
  switch (head_dim) {
    case 256: return launch<256>(p, stream);
    case 512: return launch<512>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace mila
