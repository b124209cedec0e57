// The activation quantizer on GEGLU rows: h = bf16(bf16(gelu_tanh(gate)) * up) is formed
// chunk by chunk in registers and quantized like any bf16 row (quantize_rows.cuh), so the
// bf16 h that XLA's elementwise fusion would write and the quantizer read back never
// touches HBM.
#include "quantize/quantize_kernel.h"

#include "quantize/quantize_rows.cuh"

namespace mila {
namespace {

// HF's gelu_pytorch_tanh in float32, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in the
// operation order of jax.nn.gelu(approximate=True) (x * (0.5 * (1 + tanh(...)))). The _rn
// intrinsics keep nvcc from contracting the products and sums into FMAs, so every step rounds
// as the written float32 expression does.
//
// tanhf is CUDA's accurate one (a few ulp), not tanh.approx (~2^-11 relative: it would move
// a large share of the results by a bf16 step). It still differs from XLA's float32 tanh
// (its own approximation) by an ulp or a few. Where tanh is near -1 (x below about -3),
// 1 + tanh cancels and such an ulp becomes a visible relative change, so a share of those
// gelu values lands one bf16 step from XLA's; they are tiny next to the row's amax, and
// after the e4m3 quantization only rare codes differ, by one e4m3 step
// (tests/test_quantize.py bounds how many).
__device__ __forceinline__ float gelu_tanh(float x) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  constexpr float kCubic = 0.044715f;
  const float x3 = __fmul_rn(__fmul_rn(x, x), x);
  const float inner = __fmul_rn(kSqrt2OverPi, __fadd_rn(x, __fmul_rn(kCubic, x3)));
  return __fmul_rn(x, __fmul_rn(0.5f, __fadd_rn(1.0f, tanhf(inner))));
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

cudaError_t LaunchQuantizeGeglu(const __nv_bfloat16* gate, const __nv_bfloat16* up, uint8_t* q,
                                float* scale, int64_t rows, int64_t cols, cudaStream_t stream) {
  const GegluRows src{reinterpret_cast<const uint4*>(gate), reinterpret_cast<const uint4*>(up)};
  return quantize_rows::launch(src, q, scale, rows, cols, stream);
}

}  // namespace mila
