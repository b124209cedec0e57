// Tensor-core roofline of the D=512 seesaw kernel's two products on sm_90a
// (csrc/flash512_sm90/flash512_sm90_seesaw.cu), with no loads, barriers or softmax: does the
// shape of S (m64n64k16, Q and K both read from shared memory for every 64 keys) cap the
// kernel below the tensor cores' peak, or does its schedule? One CTA per SM, two consumer
// warpgroups as in the kernel, each looping over "tiles" of:
//   s        S of one 64-key tile over D = 512: 32 x wgmma.m64n64k16, A (Q) and B (K) from
//            shared memory (128-byte swizzle), one commit and wait per tile;
//   s_deep   the same with two tiles in flight (commit per tile, wait<1>);
//   pv       P V of one tile into one O half: 4 x wgmma.m64n256k16, P from registers, V from
//            shared memory (MN-major), one commit and wait per tile;
//   mix      what a consumer issues for two tiles of the kernel: one S (32 x m64n64k16) and two
//            P V (8 x m64n256k16), 8.4 MFLOP, one commit and wait each.
// The shared-memory tiles hold random bf16 values (the tensor cores' power depends on the data).
// Prints TFLOP/s over all SMs, the SM clock block 0 saw, and FLOP per SM cycle (the H200's
// dense bf16 peak is 4,096: 989 TFLOP/s at 1.83 GHz). Values are not checked: not a test.
//
//   nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -I csrc \
//        benchmarks/micro/wgmma_seesaw_shapes.cu -o /tmp/wgmma_seesaw_shapes
//   /tmp/wgmma_seesaw_shapes [tiles per warpgroup, default 20000]

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "common/attention_sm90.cuh"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "sm90_device.h"

namespace mila::bench {
namespace hx = ::mila::ptx::sm90;

enum Variant : int { kS = 0, kSDeep = 1, kPv = 2, kMix = 3 };
// The D=512 kernels' tiles (flash512_sm90/): 64 rows x 512 bf16 in 8 column blocks.
using Tiles = attention_sm90::Traits<512, 64>;
constexpr int kThreads = Tiles::kConsumerThreads;  // two consumer warpgroups
constexpr int kColBlockBytes = attention_sm90::kColBlockBytes;
constexpr int kTileBytes = Tiles::kTileBytes;
constexpr int kSmemBytes = 2 * kTileBytes + Tiles::kSmemAlign;  // Q and one K/V tile
constexpr double kSFlop = 2.0 * 64 * 64 * 512;      // one S tile
constexpr double kPvFlop = 2.0 * 64 * 256 * 64;     // one P V tile into one O half

__device__ __forceinline__ uint16_t random_bf16(uint32_t i) {
  uint32_t x = i * 2654435761u + 0x9e3779b9u;
  x ^= x >> 15;
  x *= 0x2c1b3c6du;
  x ^= x >> 12;
  const float f = static_cast<float>(x & 0xffffu) / 32768.f - 1.f;  // [-1, 1)
  return static_cast<uint16_t>(__float_as_uint(f) >> 16);
}

template <int kVariant>
__global__ void __launch_bounds__(kThreads, 1)
    wgmma_shapes(int tiles, float* sink, unsigned long long* clocks) {
  extern __shared__ unsigned char smem_raw[];
  const attention_sm90::AlignedSmem smem = attention_sm90::AlignSmem(smem_raw);
  const uint32_t base = smem.base;
  uint16_t* fill = reinterpret_cast<uint16_t*>(smem.ptr);
  // Q and the K/V tile: kTileBytes bf16 values in all, 64 KB each.
  for (int i = threadIdx.x; i < kTileBytes; i += kThreads) {
    fill[i] = random_bf16(i + 7919 * blockIdx.x);
  }
  __syncthreads();
  const uint32_t sQ = base, sK = base + kTileBytes;
  const int ct = threadIdx.x & 127;

  float s[32], o[128];
  for (int e = 0; e < 32; ++e) s[e] = 0.f;
  for (int e = 0; e < 128; ++e) o[e] = 0.f;
  uint32_t pa[4][4];
  for (int kk = 0; kk < 4; ++kk)
    for (int j = 0; j < 4; ++j) {
      pa[kk][j] = 0x3f803f80u ^ (ct * 0x00010001u + kk + j);  // bf16 pairs near 1.0
    }

  // No operand fences between tiles: the accumulators are read only after the loop.
  auto issue_s = [&] {
    hx::wgmma_fence();
    const hx::DescSw128 dq(sQ, 16, 1024), dk(sK, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < 32; ++kk) {
      const uint32_t off = (kk >> 2) * kColBlockBytes + (kk & 3) * 32;
      hx::wgmma_m64n64k16_ss<true>(s, dq.at(off), dk.at(off));
    }
    hx::wgmma_commit();
  };
  auto issue_pv = [&] {
    hx::wgmma_fence();
    const hx::DescSw128 dv(sK + 4 * (threadIdx.x >> 7) * kColBlockBytes, kColBlockBytes, 1024);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) hx::wgmma_m64n256k16_rs_tb(o, pa[kk], dv.at(kk * 16 * 128));
    hx::wgmma_commit();
  };

  unsigned long long c0 = 0, t0 = 0;
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    c0 = clock64();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  }
  for (int t = 0; t < tiles; ++t) {
    if constexpr (kVariant == kS) {
      issue_s();
      hx::wgmma_wait<0>();
    } else if constexpr (kVariant == kSDeep) {
      issue_s();
      hx::wgmma_wait<1>();
    } else if constexpr (kVariant == kPv) {
      issue_pv();
      hx::wgmma_wait<0>();
    } else {
      issue_s();
      hx::wgmma_wait<0>();
      issue_pv();
      hx::wgmma_wait<0>();
      issue_pv();
      hx::wgmma_wait<0>();
    }
  }
  hx::wgmma_wait<0>();
  hx::fence_operands(s);
  hx::fence_operands(o);
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    unsigned long long t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    clocks[0] = clock64() - c0;
    clocks[1] = t1 - t0;
  }
  float acc = 0.f;
  for (int e = 0; e < 32; ++e) acc += s[e];
  for (int e = 0; e < 128; ++e) acc += o[e];
  sink[blockIdx.x * kThreads + threadIdx.x] = acc;  // keeps the products alive
}

template <int kVariant>
void run(const char* name, double flop_per_tile, int sms, int tiles, float* sink,
         unsigned long long* clocks) {
  auto kernel = wgmma_shapes<kVariant>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  kernel<<<sms, kThreads, kSmemBytes>>>(tiles / 8, sink, clocks);  // warm-up
  float best_ms = 1e30f;
  unsigned long long host_clocks[2] = {0, 0};
  for (int rep = 0; rep < 5; ++rep) {
    cudaEventRecord(start);
    kernel<<<sms, kThreads, kSmemBytes>>>(tiles, sink, clocks);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, start, stop);
    if (ms < best_ms) {
      best_ms = ms;
      cudaMemcpy(host_clocks, clocks, sizeof(host_clocks), cudaMemcpyDeviceToHost);
    }
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    std::printf("%-8s failed: %s\n", name, cudaGetErrorString(err));
    std::exit(1);
  }
  const double flop = flop_per_tile * 2.0 * sms * tiles;  // two warpgroups a CTA
  const double tflops = flop / (best_ms * 1e-3) / 1e12;
  const double ghz = static_cast<double>(host_clocks[0]) / static_cast<double>(host_clocks[1]);
  std::printf("| %-8s | %8.1f | %6.0f | %6.0f |\n", name, tflops, 1e3 * ghz,
              tflops * 1e12 / (sms * ghz * 1e9));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

}  // namespace mila::bench

int main(int argc, char** argv) {
  using namespace mila::bench;
  const int tiles = argc > 1 ? std::atoi(argv[1]) : 20000;
  if (tiles < 8) {
    std::printf("tiles must be >= 8, got %d\n", tiles);
    return 2;
  }
  const int sms = Sm90MultiprocessorCount();
  if (sms == 0) return 2;
  LoopOutputs outputs;
  if (!outputs.Allocate(sms, kThreads)) return 2;
  float* const sink = outputs.sink;
  unsigned long long* const clocks = outputs.clocks;
  std::printf("| variant | TFLOP/s | SM MHz | FLOP / SM cycle |\n|---|---|---|---|\n");
  run<kS>("s", kSFlop, sms, tiles, sink, clocks);
  run<kSDeep>("s_deep", kSFlop, sms, tiles, sink, clocks);
  run<kPv>("pv", kPvFlop, sms, tiles, sink, clocks);
  run<kMix>("mix", kSFlop + 2 * kPvFlop, sms, tiles, sink, clocks);
  run<kS>("s", kSFlop, sms, tiles, sink, clocks);  // again: the clock after the others
  return 0;
}
