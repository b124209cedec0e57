// How much shared-memory bandwidth is left beside FP8 wgmmas at the full tensor rate? A W4A8
// design that converts the weights in separate warps must write the e4m3 tile to shared memory
// and read it back (as the A operand of a shared-memory wgmma, or with ld.shared into the
// register fragments), on top of the TMA fills and the wgmmas' own reads of B: ~144-160 bytes
// per SM cycle at the full rate, against the 128 that 32 four-byte banks deliver, if the tensor
// cores' operand reads share those banks. This measures it instead of assuming it.
//
// One CTA per SM, two warpgroups. Warpgroup 0 issues batches of 8 wgmma.m64n128k32 (e4m3, fp32,
// one chained accumulator: 512 tensor cycles per batch at the full rate) with up to two batches
// in flight, A from registers (`rs`: the wgmmas read 4 KiB of B per 64 cycles, 64 B/cycle) or
// from shared memory (`ss`: + 2 KiB of A, 96 B/cycle). Warpgroup 1 issues no wgmma: until
// warpgroup 0 is done, it streams 16-byte ld.shared / st.shared over its own 16 KiB buffer
// (conflict-free: consecutive lanes, consecutive 16 bytes), `pad` dependent integer
// instructions per access throttling it. Reported: warpgroup 0's tensor share (FLOP per SM
// cycle / 8192) and warpgroup 1's bytes per SM cycle; their sum with the wgmmas' operand
// bytes is the shared-memory traffic the SM sustained.
//
//   nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -DMILA_HAS_SM90A -I csrc \
//        benchmarks/micro/wgmma_smem_traffic.cu -o /tmp/wgmma_smem_traffic && /tmp/wgmma_smem_traffic
// (benchmarks/wgmma_loop.py --micro smem_traffic builds and runs it.)

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "common/ptx.cuh"
#include "fp8_wgmma_batches.cuh"
#include "sm90_device.h"

namespace mila::bench {

// Warpgroup 1's accesses: none, loads only, stores only, or one load and two stores per step
// (a converter's ratio: 8 KiB of packed weights in, 16 KiB of e4m3 out per K tile).
enum class Traffic : int { kNone, kLoads, kStores, kConvert };

constexpr int kThreads = 256;
constexpr int kBufBytes = 16 * 1024;  // warpgroup 1's buffer
constexpr int kBufOffset = kBatchBBytes + kBatchABytes;
constexpr int kFlagOffset = kBufOffset + kBufBytes;
constexpr int kSmemBytes = kFlagOffset + 16 + 1024;

// `pad` dependent integer steps on x (the throttle).
__device__ __forceinline__ void spin(int pad, uint32_t& x) {
#pragma unroll 1
  for (int i = 0; i < pad; ++i) x = x * 1664525u + 1013904223u;
}

template <AOperand kA, Traffic kTraffic>
__global__ void __launch_bounds__(kThreads, 1)
    traffic_loop(int batches, int pad, float* sink, unsigned long long* stats) {
#if defined(__CUDA_ARCH__) && defined(MILA_HAS_SM90A)
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = ptx::smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw);
  fill_e4m3_ones(smem, kFlagOffset, kThreads);
  volatile uint32_t* done = reinterpret_cast<volatile uint32_t*>(smem + kFlagOffset);
  if (threadIdx.x == 0) *done = 0;
  ptx::sm90::fence_proxy_async_shared();
  __syncthreads();

  if (threadIdx.x >= 128) {  // warpgroup 1: shared-memory traffic until warpgroup 0 is done
    const int t = threadIdx.x - 128;
    uint4* buf = reinterpret_cast<uint4*>(smem + kBufOffset);
    constexpr int kVecs = kBufBytes / 16;
    uint32_t x = t;
    long long steps = 0;
    const long long cycle0 = clock64();
    if constexpr (kTraffic != Traffic::kNone) {
#pragma unroll 1
      while (*done == 0) {
#pragma unroll
        for (int i = 0; i < 8; ++i, ++steps) {
          const int v = (static_cast<int>(steps % (kVecs / 128)) * 128 + t);
          if constexpr (kTraffic == Traffic::kLoads || kTraffic == Traffic::kConvert) {
            const uint4 r = buf[v];
            x ^= r.x + r.y + r.z + r.w;
          }
          if constexpr (kTraffic == Traffic::kStores || kTraffic == Traffic::kConvert) {
            buf[(v + 128) % kVecs] = make_uint4(x, x + 1, x + 2, x + 3);
            if constexpr (kTraffic == Traffic::kConvert)
              buf[(v + 256) % kVecs] = make_uint4(x + 4, x, x + 5, x + 6);
          }
          spin(pad, x);
        }
      }
    }
    const long long cycles = clock64() - cycle0;
    sink[blockIdx.x * kThreads + threadIdx.x] = static_cast<float>(x);
    if (blockIdx.x == 0 && t == 0) {
      constexpr int kBytesPerStep = kTraffic == Traffic::kConvert ? 48 : 16;
      stats[1] = static_cast<unsigned long long>(steps) * 128 * kBytesPerStep;
      stats[2] = static_cast<unsigned long long>(cycles);
    }
    return;
  }

  float acc[64];
  const long long cycles = time_wgmma_batches<kA>(batches, base, acc, [] {});
  if (threadIdx.x == 0) *done = 1;
  sink[blockIdx.x * kThreads + threadIdx.x] = accumulator_sum(acc, 0.f);
  if (blockIdx.x == 0 && threadIdx.x == 0) stats[0] = static_cast<unsigned long long>(cycles);
#endif
}

struct Row {
  const char* name;
  int pad;
  double tensor_share, traffic_bytes_per_cycle;
  double operand_bytes_per_cycle;  // the wgmmas' shared-memory reads at the measured share
};

template <AOperand kA, Traffic kTraffic>
Row run(const char* name, int pad, int sms, int batches, float* sink,
        unsigned long long* stats) {
  auto kernel = traffic_loop<kA, kTraffic>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  // Shared-memory bytes the wgmmas read per tensor cycle at the full rate: B's 4 KiB per 64
  // cycles, plus A's 2 KiB for ss.
  constexpr double kOperandBytes = kA == AOperand::kShared ? 96.0 : 64.0;
  Row best{name, pad, 0.0, 0.0, 0.0};
  for (int rep = 0; rep < 4; ++rep) {  // the first is a warm-up
    cudaMemset(stats, 0, 3 * sizeof(unsigned long long));
    kernel<<<sms, kThreads, kSmemBytes>>>(batches, pad, sink, stats);
    if (cudaDeviceSynchronize() != cudaSuccess) {
      std::printf("%s: CUDA error: %s\n", name, cudaGetErrorString(cudaGetLastError()));
      std::exit(1);
    }
    unsigned long long s[3] = {};
    cudaMemcpy(s, stats, sizeof(s), cudaMemcpyDeviceToHost);
    const double share = tensor_share(batches, s[0]);
    const double traffic = s[2] > 0 ? static_cast<double>(s[1]) / static_cast<double>(s[2]) : 0.0;
    if (rep > 0 && share > best.tensor_share)
      best = {name, pad, share, traffic, kOperandBytes * share};
  }
  return best;
}

}  // namespace mila::bench

int main(int argc, char** argv) {
  using namespace mila::bench;
  const int batches = argc > 1 ? std::atoi(argv[1]) : 20000;
  const int sms = Sm90MultiprocessorCount();
  if (sms == 0 || batches < 1) return 2;
  // LoopOutputs holds two counters; the statistics need three of their own.
  LoopOutputs out;
  unsigned long long* stats = nullptr;
  if (!out.Allocate(sms, kThreads) ||
      cudaMalloc(&stats, 3 * sizeof(unsigned long long)) != cudaSuccess)
    return 2;
  float* const sink = out.sink;
  using A = AOperand;
  using T = Traffic;
  const Row rows[] = {
      run<A::kRegisters, T::kNone>("rs", 0, sms, batches, sink, stats),
      run<A::kRegisters, T::kLoads>("rs, loads", 0, sms, batches, sink, stats),
      run<A::kRegisters, T::kStores>("rs, stores", 0, sms, batches, sink, stats),
      run<A::kRegisters, T::kConvert>("rs, 1 load + 2 stores", 0, sms, batches, sink, stats),
      run<A::kRegisters, T::kConvert>("rs, 1 load + 2 stores", 8, sms, batches, sink, stats),
      run<A::kRegisters, T::kConvert>("rs, 1 load + 2 stores", 24, sms, batches, sink, stats),
      run<A::kShared, T::kNone>("ss", 0, sms, batches, sink, stats),
      run<A::kShared, T::kLoads>("ss, loads", 0, sms, batches, sink, stats),
      run<A::kShared, T::kStores>("ss, stores", 0, sms, batches, sink, stats),
      run<A::kShared, T::kConvert>("ss, 1 load + 2 stores", 0, sms, batches, sink, stats),
      run<A::kShared, T::kConvert>("ss, 1 load + 2 stores", 8, sms, batches, sink, stats),
      run<A::kShared, T::kConvert>("ss, 1 load + 2 stores", 24, sms, batches, sink, stats),
  };
  std::printf("| A operand, other warpgroup's accesses | pad | tensor share | wgmma operand B/cycle "
              "| other B/cycle | sum B/cycle |\n|---|---|---|---|---|---|\n");
  for (const Row& r : rows)
    std::printf("| %s | %d | %.1f%% | %.1f | %.1f | %.1f |\n", r.name, r.pad,
                100 * r.tensor_share, r.operand_bytes_per_cycle, r.traffic_bytes_per_cycle,
                r.operand_bytes_per_cycle + r.traffic_bytes_per_cycle);
  cudaFree(stats);
  return 0;
}
