// What the two Hopper D=512 kernels share (flash512_sm90.cu, and flash512_sm90_seesaw.cu for
// rotary keys): the tile geometry, and the host setup of a launch (the device check, the
// q / k / v tensor maps, the number of M tiles, the kernel attributes).
#pragma once

#include <cuda.h>  // CUtensorMap (types only)
#include <cuda_runtime.h>

#include <cstdint>

#include "common/attention_params.h"
#include "common/tensor_map.h"

namespace mila::flash512_sm90 {

constexpr int kD = 512;
// Packed query rows per M tile (positions x the query heads of one KV head).
constexpr int kBlockM = 64;
constexpr int kBlockN = 64;    // keys per K/V tile
constexpr int kThreads = 384;  // a producer warpgroup and two consumers
constexpr int kColBlockBytes = 64 * 64 * 2;          // one TMA box: 64 rows x 128 bytes
constexpr uint32_t kTileBytes = 8 * kColBlockBytes;  // 64 x 512 bf16
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct LaunchSetup {
  CUtensorMap tm_q, tm_k, tm_v;
  int num_m_blocks;
};

// Fills *out, or says why the call cannot run here: not compute capability 9.0, a query-head
// group that does not divide the 64-row tile, no tensor-map encoder in the driver, a map the
// driver refuses, or more M tiles than a grid holds.
//   q: {512, Hq, T, B} with box {64, G, 64 / G, 1}: a box's rows come out in packed-row order.
//   k, v: {512, Hkv, S, B} with box {64, 1, 64, 1}; rows past the end read as zeros.
inline cudaError_t PrepareLaunch(const AttentionParams& p, LaunchSetup* out) {
  int device = 0, major = 0, minor = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if ((err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device)) !=
      cudaSuccess) {
    return err;
  }
  if ((err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device)) !=
      cudaSuccess) {
    return err;
  }
  if (major != 9 || minor != 0) return cudaErrorInvalidDeviceFunction;
  const int G = p.hq / p.hkv;
  if (G <= 0 || kBlockM % G != 0) return cudaErrorInvalidConfiguration;
  const tma::EncodeTiledFn encode = tma::Encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  if (!tma::EncodeBf16Swizzled(encode, &out->tm_q, p.q, kD, p.hq, p.t, p.batch, G,
                               kBlockM / G) ||
      !tma::EncodeBf16Swizzled(encode, &out->tm_k, p.k, kD, p.hkv, p.s, p.batch, 1, kBlockN) ||
      !tma::EncodeBf16Swizzled(encode, &out->tm_v, p.v, kD, p.hkv, p.s, p.batch, 1, kBlockN)) {
    return cudaErrorInvalidValue;
  }
  const int64_t rows = static_cast<int64_t>(p.t) * G;
  const int64_t num_m_blocks = (rows + kBlockM - 1) / kBlockM;
  if (num_m_blocks > INT32_MAX - 1) return cudaErrorInvalidValue;
  out->num_m_blocks = static_cast<int>(num_m_blocks);
  return cudaSuccess;
}

// Opts the kernel into smem_bytes of dynamic shared memory and checks its register split:
// setmaxnreg only moves registers within the CTA, so the consumers' increase must be covered by
// what the producer warpgroup releases, which holds only if ptxas allocated enough registers a
// thread (its choice under __launch_bounds__(384, 1)). Fewer would leave setmaxnreg.inc waiting
// forever: such a kernel is refused instead of launched.
template <class Kernel>
cudaError_t PrepareKernel(Kernel* kernel, int smem_bytes, int threads, int producer_regs,
                          int consumer_regs) {
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) return err;
  cudaFuncAttributes attr{};
  if ((err = cudaFuncGetAttributes(&attr, kernel)) != cudaSuccess) return err;
  const int needed = 128 * producer_regs + (threads - 128) * consumer_regs;
  return attr.numRegs * threads < needed ? cudaErrorInvalidConfiguration : cudaSuccess;
}

}  // namespace mila::flash512_sm90
