// Does integer work slow FP8 wgmmas that are in flight beside it, and does it matter whether
// their A operand comes from registers (the W4A8 kernels: converted weights) or from shared
// memory? Every reordering of the W4A8 consumers that converted weights while their own
// wgmmas ran lost (interleaved, convert-ahead, overlapped: docs/performance.md), while ncu
// puts the convert-first kernel's tensor pipe at 80% against cuBLASLt's 93%.
//
// One CTA per SM, two warpgroups. Warpgroup 0 issues batches of 8 wgmma.m64n128k32 (e4m3,
// fp32, one chained accumulator: 512 tensor cycles per batch at the full rate) with up to two
// batches in flight (commit, then wait_group 1), A from registers (`rs`) or from a shared 64 x
// 128 B tile (`ss`); B is a shared 256 x 128 B tile in the 128-byte swizzle. The integer work
// is the W4A8 conversion of one weight word (mask, two prmt, sign merges: word_to_e4m3's
// instructions) on words that change every time, `words` of them per batch, run either by
// warpgroup 0 itself between its commit and its wait (`own`) or by warpgroup 1, which issues
// no wgmma (`other`). Warpgroup 0's thread 0 counts the SM cycles of its loop; the table
// gives the tensor pipe's share of them (FLOP per SM cycle / 8192).
//
//   nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -DMILA_HAS_SM90A -I csrc \
//        benchmarks/micro/wgmma_alu_overlap.cu -o /tmp/wgmma_alu_overlap && /tmp/wgmma_alu_overlap
// (benchmarks/wgmma_loop.py --micro alu_overlap builds and runs it.)

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "common/ptx.cuh"
#include "fp8_wgmma_batches.cuh"
#include "sm90_device.h"

namespace mila::bench {

enum class AluSide : int { kNone, kOwn, kOther };

constexpr int kThreads = 256;
constexpr int kSmemBytes = kBatchBBytes + kBatchABytes + 1024;

// `words` conversions of weight words that change each time (an LCG step per word), four
// streams for the instruction-level parallelism the kernels' conversion has; folded into x.
__device__ __forceinline__ void convert_words(int words, uint32_t (&w)[4], uint32_t& x) {
#pragma unroll 1
  for (int i = 0; i < words; i += 4) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      uint32_t lo, hi;
      ptx::w4a8::e2m1x8_to_e4m3x8(w[s], 0x6C686000u, 0x7C787470u, lo, hi);
      x ^= lo + hi;
      w[s] = w[s] * 1664525u + 1013904223u;
    }
  }
}

template <AOperand kA, AluSide kAlu>
__global__ void __launch_bounds__(kThreads, 1)
    overlap_loop(int batches, int words, uint32_t seed, float* sink, unsigned long long* clocks) {
#if defined(__CUDA_ARCH__) && defined(MILA_HAS_SM90A)
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = ptx::smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw);
  fill_e4m3_ones(smem, kBatchBBytes + kBatchABytes, kThreads);
  ptx::sm90::fence_proxy_async_shared();
  __syncthreads();

  uint32_t w[4] = {seed ^ threadIdx.x, seed + 3u * threadIdx.x, ~seed, seed * 7u}, x = 0;
  if (threadIdx.x >= 128) {  // warpgroup 1: the integer work of `other`, no wgmma
    if constexpr (kAlu == AluSide::kOther) {
#pragma unroll 1
      for (int b = 0; b < batches; ++b) convert_words(words, w, x);
    }
    sink[blockIdx.x * kThreads + threadIdx.x] = static_cast<float>(x);
    return;
  }

  float acc[64];
  const long long cycles = time_wgmma_batches<kA>(batches, base, acc, [&] {
    if constexpr (kAlu == AluSide::kOwn) convert_words(words, w, x);
  });
  sink[blockIdx.x * kThreads + threadIdx.x] = accumulator_sum(acc, static_cast<float>(x));
  if (blockIdx.x == 0 && threadIdx.x == 0) clocks[0] = static_cast<unsigned long long>(cycles);
#endif
}

struct Row {
  const char* name;
  int words;
  double ms, tensor_share;
};

template <AOperand kA, AluSide kAlu>
Row run(const char* name, int words, int sms, int batches, float* sink,
        unsigned long long* clocks) {
  auto kernel = overlap_loop<kA, kAlu>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  Row best{name, words, 1e30, 0.0};
  for (int rep = 0; rep < 4; ++rep) {  // the first is a warm-up
    cudaEventRecord(start);
    kernel<<<sms, kThreads, kSmemBytes>>>(batches, words, 0x9E3779B9u + rep, sink, clocks);
    cudaEventRecord(stop);
    if (cudaEventSynchronize(stop) != cudaSuccess) {
      std::printf("%s: CUDA error: %s\n", name, cudaGetErrorString(cudaGetLastError()));
      std::exit(1);
    }
    float ms = 0.f;
    cudaEventElapsedTime(&ms, start, stop);
    unsigned long long cycles = 0;
    cudaMemcpy(&cycles, clocks, sizeof(cycles), cudaMemcpyDeviceToHost);
    if (rep > 0 && ms < best.ms)
      best = {name, words, ms, tensor_share(batches, cycles)};
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best;
}

}  // namespace mila::bench

int main(int argc, char** argv) {
  using namespace mila::bench;
  const int batches = argc > 1 ? std::atoi(argv[1]) : 20000;
  const int sms = Sm90MultiprocessorCount();
  if (sms == 0 || batches < 1) return 2;
  LoopOutputs out;
  if (!out.Allocate(sms, kThreads)) return 2;
  float* const sink = out.sink;
  unsigned long long* const clocks = out.clocks;
  // 8 words per batch is the W4A8 consumers' share (16 per chain of two 8-wgmma batches).
  const Row rows[] = {
      run<AOperand::kRegisters, AluSide::kNone>("rs", 0, sms, batches, sink, clocks),
      run<AOperand::kRegisters, AluSide::kOwn>("rs, own", 8, sms, batches, sink, clocks),
      run<AOperand::kRegisters, AluSide::kOwn>("rs, own", 16, sms, batches, sink, clocks),
      run<AOperand::kRegisters, AluSide::kOwn>("rs, own", 32, sms, batches, sink, clocks),
      run<AOperand::kRegisters, AluSide::kOther>("rs, other", 8, sms, batches, sink, clocks),
      run<AOperand::kRegisters, AluSide::kOther>("rs, other", 32, sms, batches, sink, clocks),
      run<AOperand::kShared, AluSide::kNone>("ss", 0, sms, batches, sink, clocks),
      run<AOperand::kShared, AluSide::kOwn>("ss, own", 8, sms, batches, sink, clocks),
      run<AOperand::kShared, AluSide::kOwn>("ss, own", 16, sms, batches, sink, clocks),
      run<AOperand::kShared, AluSide::kOwn>("ss, own", 32, sms, batches, sink, clocks),
      run<AOperand::kShared, AluSide::kOther>("ss, other", 8, sms, batches, sink, clocks),
      run<AOperand::kShared, AluSide::kOther>("ss, other", 32, sms, batches, sink, clocks),
      run<AOperand::kRegisters, AluSide::kNone>("rs (again)", 0, sms, batches, sink, clocks),
  };
  std::printf("| A operand, integer work | words per batch | ms | tensor share of SM cycles |\n"
              "|---|---|---|---|\n");
  for (const Row& r : rows)
    std::printf("| %s | %d | %.3f | %.1f%% |\n", r.name, r.words, r.ms, 100 * r.tensor_share);
  return 0;
}
