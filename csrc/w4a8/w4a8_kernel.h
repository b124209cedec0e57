// W4A8 GEMM: y[M, N] = (x_fp8[M, K] * x_scale[M]) @ W[N, K]^T, W in MXFP4 (jax_mila/quant/mxfp4.py:
// e2m1 codes packed in kernel order, e8m0 block exponents, a per-channel reference exponent).
// FP8 tensor cores with float32 accumulation; the weights stay 4-bit in memory and become e4m3
// in registers right before the MMA. Three kernels:
//   wgmma (sm_90a): the converted weight tile is the register A operand of wgmma.m64n128k32
//     (the FP8 weights never touch shared memory, only the packed ones), the activations the
//     shared-memory B operand; computes y^T tiles and transposes them through shared memory in
//     the epilogue. Partial sums are promoted to fp32 registers every 128 of K (Hopper's FP8
//     wgmma accumulates at ~14 bits).
//   wgmma_ws (sm_90a, w4a8_sm90_ws.cu): the same math, warp-specialized (TMA producer
//     warpgroup, mbarrier ring, two consumer warpgroups, persistent tile scheduler).
//   mma.sync (sm_89+): m16n8k32 FP8 mma. Native on sm_89/sm_120; on sm_90 ptxas lowers FP8
//     mma.sync to F2FP + two HMMA.16816 (fp16 rate), so Hopper uses the wgmma kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mila {

// Size limits (the Python wrapper checks the same): K is walked in tiles of 128 (one kernel-order
// group of the weight), output rows are written in 8-column groups; M is free (rows past M are
// masked).
constexpr int kW4A8KMultiple = 128;
constexpr int kW4A8NMultiple = 8;
// Minimum compute capability (10 * major + minor) of the FP8 mma.
constexpr int kW4A8MinComputeCapability = 89;
// wgmma_ws's stream-K workspace (jax_mila/ffi/w4a8.py sizes it): flags of up to 512 CTAs, then
// per CTA one float32 partial of its 128 x 256 output tile.
constexpr int64_t kW4A8FlagBytes = 4096;
constexpr int64_t kW4A8SlotBytes = 128 * 256 * 4;

struct W4A8Args {
  const uint8_t* x;            // float8_e4m3fn [M, K]
  const float* x_scale;        // [M]
  const uint8_t* packed;       // [N, K / 2], e2m1 codes in kernel order
  const uint8_t* scales;       // [N, K / 32], e8m0
  const uint8_t* channel_exp;  // [N], max over blocks of scales
  void* out;                   // [M, N], bfloat16 or float32 (out_f32)
  // Scratch of the stream-K schedule (wgmma_ws only): kW4A8FlagBytes of flags, then one
  // kW4A8SlotBytes partial tile per stream-K CTA. Fewer slots than SMs only narrow the schedule.
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  bool out_f32;
  int64_t m;
  int n;
  int k;
};

// Which kernel runs: kAuto picks wgmma_ws_cluster on compute capability 9.0 (wgmma_ws with
// JAX_MILA_W4A8_CLUSTER=1), mma.sync otherwise.
// kWgmmaWs: the warp-specialized sm_90a kernel (TMA producer, persistent, stream-K for the tiles
// of the last wave; w4a8_sm90_ws.cu); kWgmmaWsDp: the same kernel on whole tiles only (the
// data-parallel schedule, for comparison); kWgmmaWsCluster: the same kernel on 2-CTA clusters
// that share each activation tile through TMA multicast.
enum class W4A8Variant : int {
  kAuto = 0,
  kMmaSync = 1,
  kWgmma = 2,
  kWgmmaWs = 3,
  kWgmmaWsDp = 4,
  kWgmmaWsCluster = 5,
};

// Requires k % 128 == 0, n % 8 == 0, 16-byte aligned pointers for x, packed and out, and
// compute capability >= 8.9 (`cc`, 10 * major + minor); the wgmma variants require cc == 90 and
// a build for sm_90a (kAuto picks them only then). Kernels compiled for older archs are empty:
// W4A8CodeProblem says when the build would launch one.
cudaError_t LaunchW4A8Matmul(const W4A8Args& args, W4A8Variant variant, int cc,
                             cudaStream_t stream);

// Why this build cannot run `variant` on a device of compute capability `cc`, or nullptr. The
// mma.sync kernel needs code compiled for compute_89 or newer, the wgmma kernels sm_90a code: a
// build whose architectures lack them would give such a device an empty kernel (its PTX of an
// older arch, JIT-compiled) that returns without writing the output. `compiled_for` receives the
// PTX version (10 * major + minor) of the mma.sync code the device loads, 0 if it has none.
const char* W4A8CodeProblem(W4A8Variant variant, int cc, int* compiled_for);

// The kWgmmaWs kernel (w4a8_sm90_ws.cu); LaunchW4A8Matmul's checks apply, and cc must be 90.
// stream_k: split the last wave's tiles along K over all SMs (needs args.workspace); cluster:
// 1, or 2 for the multicast instance.
cudaError_t LaunchW4A8WgmmaWs(const W4A8Args& args, bool stream_k, int cluster,
                              cudaStream_t stream);

}  // namespace mila
