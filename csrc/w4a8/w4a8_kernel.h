// W4A8 GEMM: y[M, N] = (x_fp8[M, K] * x_scale[M]) @ W[N, K]^T, W in MXFP4 (jax_mila/quant/mxfp4.py:
// e2m1 codes packed in kernel order, e8m0 block exponents, a per-channel reference exponent).
// FP8 tensor cores with float32 accumulation; the weights stay 4-bit in memory and become e4m3
// in registers right before the MMA, or (the e4m3 variants, which "auto" picks on Hopper from
// jax_mila.ffi.w4a8.EXPAND_MIN_ROWS activation rows up) in a scratch buffer for the call's
// duration. Three kernels:
//   wgmma (sm_90a): the converted weight tile is the register A operand of wgmma.m64n128k32
//     (the FP8 weights never touch shared memory, only the packed ones), the activations the
//     shared-memory B operand; computes y^T tiles and transposes them through shared memory in
//     the epilogue. Partial sums are promoted to fp32 registers every 128 of K (Hopper's FP8
//     wgmma accumulates at ~14 bits).
//   wgmma_ws (sm_90a, w4a8_sm90_ws.cu): the same math, warp-specialized (TMA producer
//     warpgroup, mbarrier ring, two consumer warpgroups, persistent tile scheduler); its e4m3
//     instance takes weights that w4a8_expand.cu wrote as e4m3 first, as a shared-memory operand.
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
// The e4m3 variants also expand the weights into the workspace's last N x K bytes (from a
// 256-byte aligned address; the stream-K scratch is what lies before), so the workspace holds
// N x K + kW4A8ExpandAlign bytes more.
constexpr int64_t kW4A8ExpandAlign = 256;

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
// JAX_MILA_W4A8_CLUSTER=1), mma.sync otherwise; kAutoExpanded the same but for their e4m3
// variants on 9.0, where the caller gave the workspace room for the expanded weights (the
// Python wrapper sends it from EXPAND_MIN_ROWS activation rows up).
// kWgmmaWs: the warp-specialized sm_90a kernel (TMA producer, persistent, stream-K for the tiles
// of the last wave; w4a8_sm90_ws.cu); kWgmmaWsDp: the same kernel on whole tiles only (the
// data-parallel schedule, for comparison); kWgmmaWsCluster: the same kernel on 2-CTA clusters
// that share each activation tile through TMA multicast. kWgmmaWsE4m3 / kWgmmaWsE4m3Cluster:
// the weights are first expanded to e4m3 in the workspace (LaunchW4A8ExpandWeights), and the
// kWgmmaWs / kWgmmaWsCluster kernel takes them through TMA as its shared-memory A operand: no
// conversion in the GEMM, each weight converted once per call instead of once per activation
// tile (M / 256 times).
enum class W4A8Variant : int {
  kAuto = 0,
  kMmaSync = 1,
  kWgmma = 2,
  kWgmmaWs = 3,
  kWgmmaWsDp = 4,
  kWgmmaWsCluster = 5,
  kWgmmaWsE4m3 = 6,
  kWgmmaWsE4m3Cluster = 7,
  kAutoExpanded = 8,
};
constexpr int64_t kW4A8LastVariant = static_cast<int64_t>(W4A8Variant::kAutoExpanded);

// What kAuto and kAutoExpanded run on a device of compute capability `cc` (10 * major +
// minor); any other variant as it is.
W4A8Variant ResolveW4A8Variant(W4A8Variant variant, int cc);

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
// 1, or 2 for the multicast instance; e4m3: expand the weights into the workspace first and
// run the shared-memory-A instance on them (cudaErrorInvalidValue if the workspace lacks
// W4A8ExpandBytes).
cudaError_t LaunchW4A8WgmmaWs(const W4A8Args& args, bool stream_k, int cluster, bool e4m3,
                              cudaStream_t stream);

// The least workspace the e4m3 variants take: the expanded weights and their alignment. The
// stream-K scratch goes before them (the Python wrapper adds one slot per SM); with less room
// there, fewer of the last wave's tiles are split, with none, whole tiles only.
inline int64_t W4A8ExpandBytes(int n, int k) {
  return static_cast<int64_t>(n) * k + kW4A8ExpandAlign;
}

// MXFP4 weights (args.packed, scales, channel_exp; args.n x args.k) -> e4m3 [N, K] at `out`
// (16-byte aligned), K in natural order: the bytes the wgmma kernels convert each word into
// (w4a8_expand.cu). Any compute capability.
cudaError_t LaunchW4A8ExpandWeights(const W4A8Args& args, uint8_t* out, cudaStream_t stream);

}  // namespace mila
