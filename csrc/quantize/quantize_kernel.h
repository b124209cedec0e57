// Activation quantizer: bf16 [rows, cols] -> e4m3 values and one fp32 scale per row,
// of bf16 rows (LaunchQuantizeActivations), of GEGLU rows formed on the fly
// (LaunchQuantizeGeglu) or of RMS-normed rows after an optional residual add
// (LaunchAddRmsNormQuantize).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mila {

// Largest finite float8_e4m3fn value.
constexpr float kE4M3Max = 448.0f;
// scale = amax * (1/448) as a float32 multiply (XLA turns amax / 448 into exactly this).
constexpr float kInvE4M3Max = 1.0f / 448.0f;
// Rows whose absolute maximum is below this are quantized as all-zero rows
// (values 0, scale 1): 448 / amax would overflow float32 for them.
// Must agree with jax_mila/reference/quantize.py.
constexpr float kQuantMinAmax = 0x1p-112f;
// The kernel reads and writes 16-byte vectors of a row.
constexpr int kQuantColsMultiple = 16;

// q[r, c] = e4m3_rn_sat(x[r, c] * (448 / amax_r)), scale[r] = amax_r * (1/448).
// Requires cols % 16 == 0 and 16-byte aligned pointers.
cudaError_t LaunchQuantizeActivations(const __nv_bfloat16* x, uint8_t* q, float* scale,
                                      int64_t rows, int64_t cols, cudaStream_t stream);

// The same quantization of h = bf16(bf16(gelu_tanh(gate)) * up), gelu_tanh in float32 (HF's
// gelu_pytorch_tanh): the input of a W4A8 down projection, without writing h. gate and up
// are [rows, cols] with the same requirements as x above.
cudaError_t LaunchQuantizeGeglu(const __nv_bfloat16* gate, const __nv_bfloat16* up, uint8_t* q,
                                float* scale, int64_t rows, int64_t cols, cudaStream_t stream);

// The quantization of bf16(rms_norm(h, norm_weight)), rms_norm as jax_mila.nn.norm computes it
// in float32 ((h * (mean(h^2) + eps)^-0.5) * w, rounded once), where h is x itself (branch ==
// nullptr; h, branch_weight unused) or h = bf16(x + bf16(rms_norm(branch, branch_weight))),
// which is also written to `h`. x, branch and h are [rows, cols] bf16, the weights [cols]
// float32; the same requirements as above (cols % 16 == 0, every pointer 16-byte aligned),
// eps > 0.
cudaError_t LaunchAddRmsNormQuantize(const __nv_bfloat16* x, const __nv_bfloat16* branch,
                                     const float* branch_weight, const float* norm_weight,
                                     float eps, __nv_bfloat16* h, uint8_t* q, float* scale,
                                     int64_t rows, int64_t cols, cudaStream_t stream);

}  // namespace mila
