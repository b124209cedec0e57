// W4A8 main-loop roofline on sm_90a: the wgmma_ws consumers' loop (csrc/w4a8/w4a8_sm90_ws.cu)
// with the loads taken away, to tell whether its structure or its feeding bounds the kernel.
// The chain256 variant below is a copy of the kernel's consumer loop: keep the two in step.
// One CTA per SM, two consumer warpgroups; B (activations) is a fixed 32 KB shared-memory tile
// in the kernel's 128-byte swizzle, A (weights) comes from registers. Per "K tile", as in the
// kernel: 64 x 256 x 128 per warpgroup (e4m3, fp32 accumulation). Variants:
//   chained    2 halves x 4 wgmma.m64n128k32 into one fixed accumulator, one commit and
//              wait<1> per K tile (at most two batches in flight): the loop without promotion.
//   promoted   per n128 half: a fresh partial (scale-d 0), commit, wait<0>, 64 fp32 adds into
//              the masters: the kernel's promotion until 2026-11-30.
//   convert    promoted + the kernel's weight conversion per K tile (two 16-byte and two
//              4-byte shared loads and word_to_e4m3, from a fixed packed tile): the kernel's
//              consumer loop until 2026-11-30, without TMA, mbarriers or a producer.
//   pipelined  convert, then four n64 quarters (4 wgmma.m64n64k32 each) in two partial sums:
//              quarter j runs while quarter j - 1 is added (wait<1>); wait<0> at the end of
//              the K tile (tried in the kernel on 2026-11-30: no faster).
//   chain256   convert two K tiles, then per n128 half 8 wgmmas (a 256-long chain) into a
//              fresh partial, wait<0>, add: the kernel's consumer loop now, without TMA,
//              mbarriers or a producer (the tile count must be even). With the version-2
//              (sign-swizzled) weight words: 1,788 TFLOP/s against 1,678 with version 1 in
//              the same run (2026-12-01, docs/performance.md).
// Prints one line per variant: TFLOP/s over all SMs and the SM clock block 0 saw (values are
// not checked: not a test).
//
//   nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -DMILA_HAS_SM90A -I csrc \
//        benchmarks/micro/wgmma_fp8_loop.cu -o /tmp/wgmma_fp8_loop && /tmp/wgmma_fp8_loop
// (benchmarks/wgmma_loop.py builds and runs it.)

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "common/ptx.cuh"
#include "w4a8/w4a8_convert.cuh"

namespace mila::bench {

enum Variant : int { kChained = 0, kPromoted = 1, kConvert = 2, kPipelined = 3, kChain2 = 4 };
const char* const kNames[] = {"chained", "promoted", "convert", "pipelined", "chain256"};

constexpr int kThreads = 256;          // two consumer warpgroups
constexpr int kHalfBytes = 128 * 128;  // 128 activation rows x 128 K bytes: one n128 half
constexpr int kXBytes = 2 * kHalfBytes;
constexpr int kWBytes = 128 * kPackedTile;  // packed weight rows of one K tile
constexpr int kEBytes = 128 * kKBlocks;     // their block exponents
constexpr int kSmemBytes = kXBytes + kWBytes + kEBytes + 1024;  // + alignment slack
constexpr double kFlopPerTile = 2.0 * 4 * 2 * 64.0 * 128 * 32 * 2;  // 2 WG x 2 halves x 4 wgmma

// Adds a retired partial sum of N accumulator registers into the masters at acc[N * j ..]
// (the m64nN and m64n256 accumulator layouts agree column block by column block).
template <int N>
__device__ __forceinline__ void promote(float (&part)[N], float (&acc)[128], int j) {
#pragma unroll
  for (int i = 0; i < N; ++i) ptx::sm90::fence_operand(part[i]);
#pragma unroll
  for (int i = 0; i < N; ++i) acc[N * j + i] += part[i];
}

template <int kVariant>
__global__ void __launch_bounds__(kThreads, 1) wgmma_loop(int tiles, float* sink,
                                                          unsigned long long* clocks) {
#if defined(__CUDA_ARCH__) && defined(MILA_HAS_SM90A)
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = ptx::smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw);
  // e4m3 1.0 activations, packed weight codes 1 (0.5) with block exponent 127: finite values;
  // what they are does not change the tensor cores' speed.
  for (int i = threadIdx.x; i < kXBytes / 4; i += kThreads)
    reinterpret_cast<uint32_t*>(smem)[i] = 0x38383838u;
  for (int i = threadIdx.x; i < (kWBytes + kEBytes) / 4; i += kThreads)
    reinterpret_cast<uint32_t*>(smem + kXBytes)[i] = i < kWBytes / 4 ? 0x11111111u : 0x7F7F7F7Fu;
  ptx::sm90::fence_proxy_async_shared();  // generic-proxy stores, read by wgmma
  __syncthreads();

  const int cw = threadIdx.x / 128, lane = threadIdx.x % 32, wwarp = (threadIdx.x % 128) / 32;
  const int wrow0 = cw * 64 + wwarp * 16 + lane / 4, q = lane % 4;
  const RowLut lut = row_lut(127);
  uint32_t a[kKBlocks][4];
#pragma unroll
  for (int kb = 0; kb < kKBlocks; ++kb)
#pragma unroll
    for (int e = 0; e < 4; ++e) a[kb][e] = 0x38383838u;

  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;

  // The kernel's conversion of this thread's two weight rows of one K tile (fixed tile here).
  auto convert = [&](uint32_t (&frag)[kKBlocks][4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = wrow0 + 8 * h;
      const uint4 v = *reinterpret_cast<const uint4*>(smem + kXBytes + row * kPackedTile + q * 16);
      const uint32_t exps = *reinterpret_cast<const uint32_t*>(smem + kXBytes + kWBytes +
                                                               row * kKBlocks);
#pragma unroll
      for (int kb = 0; kb < kKBlocks; ++kb) {
        const uint32_t word = kb == 0 ? v.x : kb == 1 ? v.y : kb == 2 ? v.z : v.w;
        word_to_e4m3(word, (exps >> (8 * kb)) & 0xFFu, lut, frag[kb][h], frag[kb][2 + h]);
      }
    }
  };

  // SM cycles and nanoseconds of block 0's loop: the clock the tensor cores ran at, to set
  // against the real kernel's (ncu's "SM Frequency"; power draw moves it).
  const long long cycle0 = clock64();
  unsigned long long ns0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns0));

  for (int t = 0; t < tiles; ++t) {
    if constexpr (kVariant == kChain2) {
      // Two K tiles per iteration (t advances twice), each converted into its own fragments.
      uint32_t a2[2][kKBlocks][4];
      convert(a2[0]);
      convert(a2[1]);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float part[64];
        ptx::sm90::wgmma_fence();
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
          for (int kb = 0; kb < kKBlocks; ++kb) {
            const uint64_t desc = ptx::sm90::desc_k128b(base + h * kHalfBytes + kb * 32);
            if (c == 0 && kb == 0)
              ptx::w4a8::wgmma_m64n128k32_e4m3_rs<false>(part, a2[c][kb], desc);
            else
              ptx::w4a8::wgmma_m64n128k32_e4m3_rs<true>(part, a2[c][kb], desc);
          }
        ptx::sm90::wgmma_commit();
        ptx::sm90::wgmma_wait<0>();
        promote(part, acc, h);
      }
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int kb = 0; kb < kKBlocks; ++kb)
#pragma unroll
          for (int e = 0; e < 4; ++e) ptx::sm90::fence_operand(a2[c][kb][e]);
      ++t;
      continue;
    }
    if constexpr (kVariant == kConvert || kVariant == kPipelined) convert(a);
    if constexpr (kVariant == kChained) {
      // Both halves into one accumulator (the sums are meaningless; the tensor work is the
      // kernel's): two accumulators with two batches in flight made ptxas serialize the
      // wgmmas for want of registers (C7512).
      float(&chain)[64] = *reinterpret_cast<float(*)[64]>(acc);
      ptx::sm90::wgmma_fence();
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int kb = 0; kb < kKBlocks; ++kb)
          ptx::w4a8::wgmma_m64n128k32_e4m3_rs<true>(
              chain, a[kb], ptx::sm90::desc_k128b(base + h * kHalfBytes + kb * 32));
      ptx::sm90::wgmma_commit();
      ptx::sm90::wgmma_wait<1>();
    } else if constexpr (kVariant == kPipelined) {
      float part[2][32];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float(&p)[32] = part[j % 2];
        ptx::sm90::wgmma_fence();
        ptx::w4a8::wgmma_m64n64k32_e4m3_rs<false>(p, a[0], ptx::sm90::desc_k128b(base + j * 8192));
#pragma unroll
        for (int kb = 1; kb < kKBlocks; ++kb)
          ptx::w4a8::wgmma_m64n64k32_e4m3_rs<true>(
              p, a[kb], ptx::sm90::desc_k128b(base + j * 8192 + kb * 32));
        ptx::sm90::wgmma_commit();
        if (j > 0) {
          ptx::sm90::wgmma_wait<1>();
          promote(part[(j - 1) % 2], acc, j - 1);
        }
      }
      ptx::sm90::wgmma_wait<0>();
      promote(part[1], acc, 3);
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float part[64];
        ptx::sm90::wgmma_fence();
        ptx::w4a8::wgmma_m64n128k32_e4m3_rs<false>(
            part, a[0], ptx::sm90::desc_k128b(base + h * kHalfBytes));
#pragma unroll
        for (int kb = 1; kb < kKBlocks; ++kb)
          ptx::w4a8::wgmma_m64n128k32_e4m3_rs<true>(
              part, a[kb], ptx::sm90::desc_k128b(base + h * kHalfBytes + kb * 32));
        ptx::sm90::wgmma_commit();
        ptx::sm90::wgmma_wait<0>();
        promote(part, acc, h);
      }
    }
#pragma unroll
    for (int kb = 0; kb < kKBlocks; ++kb)
#pragma unroll
      for (int e = 0; e < 4; ++e) ptx::sm90::fence_operand(a[kb][e]);
  }
  ptx::sm90::wgmma_wait<0>();
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 128; ++i) sum += acc[i];
  sink[blockIdx.x * kThreads + threadIdx.x] = sum;  // keeps the loop alive
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    unsigned long long ns1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns1));
    clocks[0] = static_cast<unsigned long long>(clock64() - cycle0);
    clocks[1] = ns1 - ns0;
  }
#endif
}

struct Timing {
  float ms;    // best of 5
  double mhz;  // block 0's SM clock during that run
};

template <int kVariant>
Timing time_loop(int blocks, int tiles, float* sink, unsigned long long* clocks,
                 cudaEvent_t start, cudaEvent_t stop) {
  auto kernel = wgmma_loop<kVariant>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  kernel<<<blocks, kThreads, kSmemBytes>>>(tiles, sink, clocks);  // warm-up
  Timing best{1e30f, 0.0};
  for (int rep = 0; rep < 5; ++rep) {
    cudaEventRecord(start);
    kernel<<<blocks, kThreads, kSmemBytes>>>(tiles, sink, clocks);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, start, stop);
    if (ms < best.ms) {
      unsigned long long c[2] = {0, 1};
      cudaMemcpy(c, clocks, sizeof(c), cudaMemcpyDeviceToHost);
      best = {ms, c[1] > 0 ? 1e3 * static_cast<double>(c[0]) / static_cast<double>(c[1]) : 0.0};
    }
  }
  return best;
}

}  // namespace mila::bench

int main(int argc, char** argv) {
  using namespace mila::bench;
  const int tiles = argc > 1 ? std::atoi(argv[1]) : 4096;
  if (tiles < 2 || tiles % 2 != 0) {  // chain256 runs two K tiles per iteration
    std::printf("tiles must be an even number >= 2, got %d\n", tiles);
    return 2;
  }
  int device = 0, sms = 0, major = 0, minor = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (major != 9 || minor != 0) {
    std::printf("needs compute capability 9.0 (sm_90a), found %d.%d\n", major, minor);
    return 2;
  }
  float* sink = nullptr;
  unsigned long long* clocks = nullptr;
  cudaMalloc(&sink, sizeof(float) * sms * kThreads);
  cudaMalloc(&clocks, 2 * sizeof(unsigned long long));
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  const Timing runs[] = {time_loop<kChained>(sms, tiles, sink, clocks, start, stop),
                         time_loop<kPromoted>(sms, tiles, sink, clocks, start, stop),
                         time_loop<kConvert>(sms, tiles, sink, clocks, start, stop),
                         time_loop<kPipelined>(sms, tiles, sink, clocks, start, stop),
                         time_loop<kChain2>(sms, tiles, sink, clocks, start, stop)};
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(err));
    return 1;
  }
  std::printf("| variant | ms | TFLOP/s | SM clock MHz |\n|---|---|---|---|\n");
  for (int v = 0; v < 5; ++v)
    std::printf("| %s | %.3f | %.0f | %.0f |\n", kNames[v], runs[v].ms,
                kFlopPerTile * sms * tiles / (runs[v].ms * 1e-3) / 1e12, runs[v].mhz);
  cudaFree(sink);
  cudaFree(clocks);
  return 0;
}
