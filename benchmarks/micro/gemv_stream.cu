// What a decode GEMV launch costs before any arithmetic: the floor of a launch of its grid
// (plain and as thread-block clusters), and the time to stream its MXFP4 bytes with the GEMV's
// access pattern against the same bytes read coalesced and a device-to-device copy. The decode
// GEMV (csrc/w4a8/w4a8_gemv.cu) runs ~6 us above its bytes at the copy's rate on every launch
// of the 12B's decode (docs/performance.md); this tells launch, access pattern and arithmetic
// apart.
//
// Per 12B launch at one activation row (its N x K and the split the plan takes on 132 SMs),
// each row of the table times, as a CUDA graph of `launches` back-to-back launches replayed
// after a warm-up (cudaEvent time / launches), every launch reading another slice of a 1 GiB
// buffer so that L2 holds none of it:
//   empty          a kernel that returns at once, tiles x splits CTAs of 256 threads
//   empty cluster  the same as clusters of `splits` CTAs (the GEMV's Hopper split-K)
//   pattern        the GEMV's loads: lane (g, q) of warp w reads 16 bytes at q * 16 of each
//                  64-byte group of rows 16w + g and 16w + g + 8, 4 groups a batch, the next
//                  batch in flight while the current one is folded into a register
//   coalesced      the same bytes of each CTA, each warp reading 512 contiguous bytes of a row
//                  an instruction, batches of the same size
//   memcpy         cudaMemcpyAsync of the weights' bytes (device to device)
//
//   nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -I csrc \
//        benchmarks/micro/gemv_stream.cu -o /tmp/gemv_stream && /tmp/gemv_stream 50
// (benchmarks/wgmma_loop.py --micro gemv_stream builds and runs it.)

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "common/cluster_launch.h"
#include "sm90_device.h"

namespace mila::bench {

constexpr int kThreads = 256;
constexpr int kRows = 128;       // weight rows a CTA streams (16 a warp)
constexpr int kGroupBytes = 64;  // packed bytes of a row per 128 values of K
constexpr int kBatch = 4;        // groups a lane has in flight at once, as the GEMV
constexpr size_t kPool = size_t{1} << 30;

__global__ void __launch_bounds__(kThreads, 2) empty_kernel() {}

__device__ __forceinline__ uint4 ld_stream(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t fold(const uint4& v) { return v.x ^ v.y ^ v.z ^ v.w; }

// blockIdx.x = tile * splits + split; a CTA streams rows [tile * 128, +128) over groups
// [split * kc, +kc) of rows of `row_bytes`. Results folded into sink[blockIdx.x] so that the
// loads are not dead.
__global__ void __launch_bounds__(kThreads, 2)
    pattern_kernel(const uint8_t* w, int64_t row_bytes, int splits, int kc, uint32_t* sink) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;
  const int64_t tile = blockIdx.x / splits;
  const int j0 = (blockIdx.x % splits) * kc;
  const int64_t r0 = tile * kRows + warp * 16 + g;
  const uint8_t* p0 = w + r0 * row_bytes + j0 * kGroupBytes + q * 16;
  const uint8_t* p1 = p0 + 8 * row_bytes;
  uint4 cur[2][kBatch], next[2][kBatch];
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    cur[0][u] = u < kc ? ld_stream(p0 + u * kGroupBytes) : uint4{};
    cur[1][u] = u < kc ? ld_stream(p1 + u * kGroupBytes) : uint4{};
  }
  uint32_t acc = 0;
  for (int jb = 0; jb < kc; jb += kBatch) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int j = jb + kBatch + u;  // groups past this CTA's range are not read
      next[0][u] = j < kc ? ld_stream(p0 + j * kGroupBytes) : uint4{};
      next[1][u] = j < kc ? ld_stream(p1 + j * kGroupBytes) : uint4{};
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) acc ^= fold(cur[0][u]) ^ fold(cur[1][u]);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) cur[0][u] = next[0][u], cur[1][u] = next[1][u];
  }
  if (acc == 0x9E3779B9u) sink[blockIdx.x] = acc;  // practically never: keeps the loads
}

// The same bytes per CTA, read coalesced: warp w takes rows 16w .. 16w + 15 of the tile one
// after another, its lanes 512 contiguous bytes of the row's span an instruction; batches of
// 2 x kBatch loads a lane as the pattern kernel.
__global__ void __launch_bounds__(kThreads, 2)
    coalesced_kernel(const uint8_t* w, int64_t row_bytes, int splits, int kc, uint32_t* sink) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t tile = blockIdx.x / splits;
  const int j0 = (blockIdx.x % splits) * kc;
  const int64_t span = int64_t{kc} * kGroupBytes;  // bytes of a row this CTA reads
  const int64_t chunks = span;  // 16-byte chunks of the warp's 16 rows (16 x span bytes)
  const uint8_t* base = w + (tile * kRows + warp * 16) * row_bytes + j0 * kGroupBytes;
  auto at = [&](int64_t c) {  // chunk c of the warp's rows, row-major over its spans
    const int64_t row = c / (span / 16), col = c % (span / 16);
    return base + row * row_bytes + col * 16;
  };
  constexpr int kLoads = 2 * kBatch;
  uint32_t acc = 0;
  uint4 cur[kLoads], next[kLoads];
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int64_t c = lane + 32 * i;
    cur[i] = c < chunks ? ld_stream(at(c)) : uint4{};
  }
  for (int64_t c0 = 0; c0 < chunks; c0 += 32 * kLoads) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int64_t c = c0 + 32 * kLoads + lane + 32 * i;
      next[i] = c < chunks ? ld_stream(at(c)) : uint4{};
    }
#pragma unroll
    for (int i = 0; i < kLoads; ++i) acc ^= fold(cur[i]), cur[i] = next[i];
  }
  if (acc == 0x9E3779B9u) sink[blockIdx.x] = acc;
}

struct Shape {
  const char* name;
  int64_t n, k;
  int splits;  // the plan's at one row on 132 SMs (clusters where the device fits them)
};

// The 12B's decode launches (q/k/v and gate/up as one launch each, as the model makes them).
constexpr Shape kShapes[] = {
    {"q/k/v sliding", 8192, 3840, 3}, {"q/k global", 8704, 3840, 3},
    {"o sliding", 3840, 4096, 8},     {"o global", 3840, 8192, 8},
    {"gate + up", 30720, 3840, 1},    {"down", 3840, 15360, 8},
};

#define CHECK(call)                                                                   \
  do {                                                                                \
    cudaError_t e_ = (call);                                                          \
    if (e_ != cudaSuccess) {                                                          \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

// Microseconds per launch of `launches` calls of launch(i) captured in one graph, replayed.
template <typename F>
float TimeGraph(int launches, F launch) {
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < launches; ++i) launch(i, s);
  CHECK(cudaStreamEndCapture(s, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  float best = 1e30f;
  for (int rep = 0; rep < 7; ++rep) {  // the first replays warm up; the fastest of the rest
    CHECK(cudaEventRecord(a, s));
    CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    if (rep >= 2 && ms < best) best = ms;
  }
  CHECK(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
  return best * 1e3f / launches;
}

int Run(int launches) {
  if (Sm90MultiprocessorCount() == 0) return 1;
  uint8_t *pool = nullptr, *dst = nullptr;
  uint32_t* sink = nullptr;
  CHECK(cudaMalloc(&pool, kPool));
  CHECK(cudaMalloc(&dst, size_t{64} << 20));
  CHECK(cudaMalloc(&sink, 1 << 20));
  CHECK(cudaMemset(pool, 0x5A, kPool));
  std::printf("| launch (N x K, splits) | MB | empty us | empty cluster us | pattern us (GB/s) | "
              "coalesced us (GB/s) | memcpy us (GB/s) |\n|---|---|---|---|---|---|---|\n");
  for (const Shape& sh : kShapes) {
    const int64_t row_bytes = sh.k / 2, bytes = sh.n * row_bytes;
    const int64_t tiles = sh.n / kRows, groups = sh.k / 128;
    const int kc = static_cast<int>((groups + sh.splits - 1) / sh.splits);
    const unsigned grid = static_cast<unsigned>(tiles * sh.splits);
    // Launch i reads its own slice of the pool (256-byte aligned), L2 sees none twice.
    const int64_t slices = static_cast<int64_t>(kPool) / bytes;
    auto slice = [&](int i) { return pool + (i % slices) * (bytes / 256 * 256); };
    const float empty = TimeGraph(launches, [&](int, cudaStream_t s) {
      empty_kernel<<<grid, kThreads, 0, s>>>();
    });
    const float empty_cluster = TimeGraph(launches, [&](int, cudaStream_t s) {
      ClusterLaunchConfig cfg(dim3(grid), dim3(kThreads), 0, s, static_cast<unsigned>(sh.splits));
      CHECK(cudaLaunchKernelEx(&cfg.cfg, empty_kernel));
    });
    const float pattern = TimeGraph(launches, [&](int i, cudaStream_t s) {
      pattern_kernel<<<grid, kThreads, 0, s>>>(slice(i), row_bytes, sh.splits, kc, sink);
    });
    const float coalesced = TimeGraph(launches, [&](int i, cudaStream_t s) {
      coalesced_kernel<<<grid, kThreads, 0, s>>>(slice(i), row_bytes, sh.splits, kc, sink);
    });
    const float copy = TimeGraph(launches, [&](int i, cudaStream_t s) {
      CHECK(cudaMemcpyAsync(dst, slice(i), static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice,
                            s));
    });
    auto gbps = [&](float us) { return bytes / (us * 1e3); };
    std::printf("| %s %lld x %lld, %d | %.1f | %.1f | %.1f | %.1f (%.0f) | %.1f (%.0f) | "
                "%.1f (%.0f) |\n",
                sh.name, static_cast<long long>(sh.n), static_cast<long long>(sh.k), sh.splits,
                bytes / 1e6, empty, sh.splits > 1 ? empty_cluster : empty, pattern,
                gbps(pattern), coalesced, gbps(coalesced), copy, gbps(copy));
  }
  std::printf("(GB/s: the weights' bytes read a second; memcpy also writes them)\n");
  cudaFree(pool);
  cudaFree(dst);
  cudaFree(sink);
  return 0;
}

}  // namespace mila::bench

int main(int argc, char** argv) {
  const int launches = argc > 1 ? std::atoi(argv[1]) : 50;
  if (launches < 1) {
    std::printf("usage: gemv_stream [launches a graph, >= 1; default 50]\n");
    return 2;
  }
  return mila::bench::Run(launches);
}
