// What the sm_90a micro benchmarks ask of the device before they launch: compute capability 9.0
// (they are built for sm_90a only) and its SM count (one CTA per SM).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>

namespace mila::bench {

// The current device's SM count, or 0 after printing why the benchmark cannot run here.
inline int Sm90MultiprocessorCount() {
  int device = 0, sms = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    std::printf("no CUDA device\n");
    return 0;
  }
  if (major != 9 || minor != 0) {
    std::printf("needs compute capability 9.0 (sm_90a), found %d.%d\n", major, minor);
    return 0;
  }
  return sms;
}

// What a timed loop writes: one float per thread that keeps its results alive (`sink`) and
// block 0's SM cycles and nanoseconds (`clocks`). Freed with the object.
struct LoopOutputs {
  float* sink = nullptr;
  unsigned long long* clocks = nullptr;

  LoopOutputs() = default;
  LoopOutputs(const LoopOutputs&) = delete;
  LoopOutputs& operator=(const LoopOutputs&) = delete;
  ~LoopOutputs() {
    cudaFree(sink);
    cudaFree(clocks);
  }
  // For `sms` CTAs of `threads` threads; false (after printing why) if an allocation failed.
  bool Allocate(int sms, int threads) {
    if (cudaMalloc(&sink, sizeof(float) * sms * threads) != cudaSuccess ||
        cudaMalloc(&clocks, 2 * sizeof(unsigned long long)) != cudaSuccess) {
      std::printf("cudaMalloc of the loop outputs failed\n");
      return false;
    }
    return true;
  }
};

}  // namespace mila::bench
