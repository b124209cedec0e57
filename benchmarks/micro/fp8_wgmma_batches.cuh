// The FP8 wgmma loop that the sm_90a micro-benchmarks beside the W4A8 kernel time: warpgroup 0
// issues batches of 8 wgmma.m64n128k32 (e4m3, fp32, one chained accumulator: 512 tensor cycles
// per batch at the full rate) with up to two batches in flight (commit, then wait_group 1).
// A comes from registers (`rs`, as the W4A8 kernels: converted weights) or from a 64 x 128 B
// shared tile (`ss`); B is a 256 x 128 B shared tile in the 128-byte swizzle (two n128 halves).
#pragma once

#include <cstdint>

#include "common/ptx.cuh"

namespace mila::bench {

enum class AOperand : int { kRegisters, kShared };

constexpr int kBatchBBytes = 256 * 128;  // B at the 1024-byte aligned base
constexpr int kBatchABytes = 64 * 128;   // A (ss) right after B
constexpr double kFlopPerBatch = 8 * 2.0 * 64 * 128 * 32;
constexpr double kFlopPerSmCycle = 8192;  // dense FP8 wgmma, H100 / H200

// The tensor pipe's share of `cycles` SM cycles that ran `batches` batches.
inline double tensor_share(int batches, unsigned long long cycles) {
  return kFlopPerBatch * batches / static_cast<double>(cycles) / kFlopPerSmCycle;
}

// Every 4-byte word of smem[0, bytes) to e4m3 1.0 x 4 (the operand tiles' contents), by the
// block's `threads` threads; the caller fences and synchronizes.
__device__ __forceinline__ void fill_e4m3_ones(uint8_t* smem, int bytes, int threads) {
  for (int i = threadIdx.x; i < bytes / 4; i += threads)
    reinterpret_cast<uint32_t*>(smem)[i] = 0x38383838u;
}

// init + the sum of the retired accumulator: what a timed loop writes out to stay alive.
__device__ __forceinline__ float accumulator_sum(float (&acc)[64], float init) {
  ptx::sm90::fence_operands(acc);
  float sum = init;
#pragma unroll
  for (int i = 0; i < 64; ++i) sum += acc[i];
  return sum;
}

// `batches` batches into acc (zeroed first); `between()` runs after each batch's commit, while
// it is in flight. Returns the SM cycles of the loop, up to the last batch's retirement.
template <AOperand kA, typename Between>
__device__ __forceinline__ long long time_wgmma_batches(int batches, uint32_t base,
                                                        float (&acc)[64], Between&& between) {
#if defined(__CUDA_ARCH__) && defined(MILA_HAS_SM90A)
  uint32_t a[4][4];
#pragma unroll
  for (int kb = 0; kb < 4; ++kb)
#pragma unroll
    for (int e = 0; e < 4; ++e) a[kb][e] = 0x38383838u;  // e4m3 1.0
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;

  const long long cycle0 = clock64();
#pragma unroll 1
  for (int b = 0; b < batches; ++b) {
    ptx::sm90::wgmma_fence();
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int kb = 0; kb < 4; ++kb) {
        const uint64_t desc_b = ptx::sm90::desc_k128b(base + h * (kBatchBBytes / 2) + kb * 32);
        if constexpr (kA == AOperand::kRegisters)
          ptx::w4a8::wgmma_m64n128k32_e4m3_rs<true>(acc, a[kb], desc_b);
        else
          ptx::w4a8::wgmma_m64n128k32_e4m3_ss<true>(
              acc, ptx::sm90::desc_k128b(base + kBatchBBytes + kb * 32), desc_b);
      }
    ptx::sm90::wgmma_commit();
    between();
    ptx::sm90::wgmma_wait<1>();
  }
  ptx::sm90::wgmma_wait<0>();
  return clock64() - cycle0;
#else
  return 0;
#endif
}

}  // namespace mila::bench
