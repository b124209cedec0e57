// The activation quantizer on GEGLU rows: h = bf16(bf16(gelu_tanh(gate)) * up) is formed
// chunk by chunk in registers and quantized like any bf16 row (quantize_rows.cuh), so the
// bf16 h that XLA's elementwise fusion would write and the quantizer read back never
// touches HBM.
#include "quantize/quantize_kernel.h"

#include "quantize/quantize_rows.cuh"

namespace mila {
namespace {

// HF's gelu_pytorch_tanh in float32, 0.5 x (1 + tanh(y)) with y = sqrt(2/pi) (x + 0.044715 x^3),
// written as x / (1 + 2^z), z = x (1 + 0.044715 x^2) k, k = -2 sqrt(2/pi) log2(e) (the identity
// 0.5 (1 + tanh(y)) = 1 / (1 + e^(-2y))): one ex2.approx, one rcp.approx and a Newton step,
// 11 instructions where tanhf took ~20 more and set the kernel's pace.
// Accuracy, as jax_mila.reference.bounds' GEGLU oracle counts it (the implied tanh, 2 / (1 + 2^z) - 1,
// against the exact tanh(y); the oracle admits 2^-20): z's 4 roundings move it by < 2^-25;
// ex2.approx (2 ulp) by < 2^-22; the reciprocal after its Newton step is within ~1 ulp, an
// error of the final product rather than of tanh. Emulated over every finite bf16 x with
// ex2.approx and rcp.approx both 4 ulp off: < 2^-21.4, inside the oracle's intervals
// (tests/test_quantize.py::GegluOracleTest). Near tanh = -1 (x below about -3) this form is
// more accurate than 1 + tanhf, which cancels.
// Limits: z is clamped to 64 (2^z finite, so the Newton step never sees inf * 0): x below
// about -9 gives x * 2^-64 (~0, the oracle admits it). z below -126 flushes 2^z to 0: x. x = 0
// gives 0, so the zero padding stays zero.
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float gelu_tanh(float x) {
  constexpr float kCubic = 0.044715f;
  constexpr float kMinus2Sqrt2OverPiLog2e = -2.302208198144325f;  // -2 sqrt(2/pi) / ln(2)
  const float p = fmaf(kCubic, x * x, 1.0f);
  const float z = fminf((x * kMinus2Sqrt2OverPiLog2e) * p, 64.0f);
  const float d = 1.0f + ex2_approx(z);
  float r = rcp_approx(d);
  r = fmaf(r, fmaf(-d, r, 1.0f), r);
  return x * r;
}

// bf16(bf16(gelu_tanh(g)) * u) for the 8 values of a chunk: the product of two bf16 values is
// exact in float32, so this rounds like a bf16 multiply.
__device__ __forceinline__ uint4 geglu_chunk(const uint4& g, const uint4& u) {
  const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&g);
  const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&u);
  uint32_t h[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 gf = __bfloat1622float2(g2[i]);
    const float2 uf = __bfloat1622float2(u2[i]);
    const float2 a = __bfloat1622float2(__floats2bfloat162_rn(gelu_tanh(gf.x), gelu_tanh(gf.y)));
    h[i] = ptx::pack_bf16x2(a.x * uf.x, a.y * uf.y);
  }
  return make_uint4(h[0], h[1], h[2], h[3]);
}

struct GegluRows {
  struct Raw {
    uint4 gate, up;
  };
  const uint4* gate;
  const uint4* up;
  __device__ __forceinline__ Raw load(int64_t i) const { return {__ldg(gate + i), __ldg(up + i)}; }
  // gelu_tanh(0) * 0 = 0: the padding stays zero.
  __device__ __forceinline__ static uint4 make(const Raw& r) { return geglu_chunk(r.gate, r.up); }
};

}  // namespace

// A GEGLU chunk's loads are twice a plain one's (gate and up), and ptxas issues a cached row's
// loads before their arithmetic: 16 cached chunks at 256 threads took 176 registers on sm_90a,
// one block per SM, no overlap of one row's loads with another's reduction and stores (1.5x
// slower than XLA plus the plain quantizer at K = 21504). Rows past 2048 chunks (K > 16384)
// therefore take 512 threads, at most 8 chunks each, with registers for two blocks per SM.
cudaError_t LaunchQuantizeGeglu(const __nv_bfloat16* gate, const __nv_bfloat16* up, uint8_t* q,
                                float* scale, int64_t rows, int64_t cols, cudaStream_t stream) {
  using quantize_rows::launch_rows;
  const GegluRows src{reinterpret_cast<const uint4*>(gate), reinterpret_cast<const uint4*>(up)};
  const int64_t chunks = cols / quantize_rows::kBf16PerChunk;
  auto* qv = reinterpret_cast<uint2*>(q);
  if (chunks <= 256) {
    launch_rows<256, 1, 1>(src, qv, scale, rows, chunks, stream);
  } else if (chunks <= 512) {
    launch_rows<256, 2, 1>(src, qv, scale, rows, chunks, stream);
  } else if (chunks <= 1024) {
    launch_rows<256, 4, 3>(src, qv, scale, rows, chunks, stream);
  } else if (chunks <= 2048) {  // the 12B's K = 15360
    launch_rows<256, 8, 3>(src, qv, scale, rows, chunks, stream);
  } else if (chunks <= 3072) {  // the 31B's K = 21504
    launch_rows<512, 6, 2>(src, qv, scale, rows, chunks, stream);
  } else if (chunks <= 4096) {
    launch_rows<512, 8, 1>(src, qv, scale, rows, chunks, stream);
  } else {
    launch_rows<512, 0, 2>(src, qv, scale, rows, chunks, stream);
  }
  return cudaGetLastError();
}

}  // namespace mila
