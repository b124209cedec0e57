// Host side of a Hopper attention launch (flash512_sm90, flash512_sm90_seesaw, flash256_sm90):
// the device check, the q / k / v tensor maps, the number of M tiles, and the kernel's shared
// memory and register split.
#pragma once

#include <cuda.h>  // CUtensorMap (types only)
#include <cuda_runtime.h>

#include <cstdint>

#include "common/attention_params.h"
#include "common/tensor_map.h"

namespace mila::attention_sm90 {

struct LaunchSetup {
  CUtensorMap tm_q, tm_k, tm_v;
  int num_m_blocks;  // M tiles of T::kBlockM packed rows per (KV head, batch)
};

// Fills *out for a kernel with traits T (common/attention_sm90.cuh), or says why the call cannot
// run here: not compute capability 9.0 (cudaErrorInvalidDeviceFunction), a query-head group that
// does not divide a 64-row box (cudaErrorInvalidConfiguration), no tensor-map encoder in the
// driver (cudaErrorNotSupported), a map the driver refuses or more M tiles than an int holds
// (cudaErrorInvalidValue).
//   q: {D, Hq, T, B} with box {64, G, 64 / G, 1}: a box's rows come out in packed-row order.
//   k, v: {D, Hkv, S, B} with box {64, 1, 64, 1}; rows past the end read as zeros.
template <class T>
cudaError_t PrepareLaunch(const AttentionParams& p, LaunchSetup* out) {
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
  if (G <= 0 || T::kRowsPerBox % G != 0) return cudaErrorInvalidConfiguration;
  const tma::EncodeTiledFn encode = tma::Encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  if (!tma::EncodeBf16Swizzled(encode, &out->tm_q, p.q, T::kD, p.hq, p.t, p.batch, G,
                               T::kRowsPerBox / G) ||
      !tma::EncodeBf16Swizzled(encode, &out->tm_k, p.k, T::kD, p.hkv, p.s, p.batch, 1,
                               T::kBlockN) ||
      !tma::EncodeBf16Swizzled(encode, &out->tm_v, p.v, T::kD, p.hkv, p.s, p.batch, 1,
                               T::kBlockN)) {
    return cudaErrorInvalidValue;
  }
  const int64_t rows = static_cast<int64_t>(p.t) * G;
  const int64_t num_m_blocks = (rows + T::kBlockM - 1) / T::kBlockM;
  if (num_m_blocks > INT32_MAX - 1) return cudaErrorInvalidValue;
  out->num_m_blocks = static_cast<int>(num_m_blocks);
  return cudaSuccess;
}

// Opts the kernel into smem_bytes of dynamic shared memory and checks its register split:
// setmaxnreg only moves registers within the CTA, so the consumers' increase must be covered by
// what the producer warpgroup releases, which holds only if ptxas allocated enough registers a
// thread (its choice under __launch_bounds__(384, 1)). Fewer would leave setmaxnreg.inc waiting
// forever: such a kernel is refused (cudaErrorInvalidConfiguration) instead of launched.
template <class T, class Kernel>
cudaError_t PrepareKernel(Kernel* kernel, int smem_bytes) {
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) return err;
  cudaFuncAttributes attr{};
  if ((err = cudaFuncGetAttributes(&attr, kernel)) != cudaSuccess) return err;
  const int needed = 128 * T::kProducerRegs + T::kConsumerThreads * T::kConsumerRegs;
  return attr.numRegs * T::kThreads < needed ? cudaErrorInvalidConfiguration : cudaSuccess;
}

}  // namespace mila::attention_sm90
