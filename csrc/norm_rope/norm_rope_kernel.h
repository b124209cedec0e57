// Per-head RMS norm fused with the rotary embedding (jax_mila.ffi.rms_norm_rope; the definition
// is jax_mila.reference.rms_norm_rope): for each row x of D values (one head of one token),
//   n   = bf16((x * (mean(x^2) + eps)^-0.5) * w)            float32, one rounding to bf16
//   out = bf16(n * cos[t] + rotate_half(n) * sin[t])       float32, one rounding to bf16
// rotate_half(n) = concat(-n[D/2:], n[:D/2]); t is the row's token.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mila {

// The head dims the kernel is instantiated for (Gemma 4's sliding and global layers).
constexpr int kNormRopeHeadDims[] = {256, 512};

// x and out: bf16 [rows, D] where row = (token, head) in row-major order over [tokens, heads]
// and token = (batch..., t) over [..., T]; cos, sin: bf16 [T, D]; weight: float32 [D].
// Requires D in kNormRopeHeadDims, rows < 2^31, every pointer 16-byte aligned, eps > 0.
cudaError_t LaunchRmsNormRope(const __nv_bfloat16* x, const float* weight,
                              const __nv_bfloat16* cos, const __nv_bfloat16* sin, float eps,
                              __nv_bfloat16* out, int64_t rows, int64_t heads, int64_t tokens,
                              int64_t head_dim, cudaStream_t stream);

}  // namespace mila
