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

}  // namespace mila::bench
