// The tile list of a grouped W4A8 GEMM, built on the device from the group sizes (so routing
// changes neither recompile nor sync with the host, and the launch is CUDA-graph safe): expert e
// owns rows [offset_e, offset_e + size_e) clamped to [0, M), cut into M tiles of `rows` rows;
// list entry t = (expert, first row, end row). Block 0 writes the list; every block zero-fills
// its share of the output rows past the last group (none when the sizes add up to M).
#include <cstdint>

#include "w4a8/w4a8_kernel.h"

namespace mila {
namespace {

constexpr int kThreads = 256;
constexpr int kZeroBlocks = 64;

// Exclusive prefix sums of the clamped sizes and of the M tiles per expert, in shared memory;
// returns the rows the groups cover.
__device__ int64_t scan_groups(const int32_t* sizes, int experts, int64_t m, int rows,
                               int64_t* s_rows, int* s_tiles) {
  __shared__ int64_t total_rows;
  if (threadIdx.x == 0) {
    // Sequential over at most kW4A8MaxExperts entries: a few microseconds, once per call.
    int64_t offset = 0;
    int tiles = 0;
    for (int e = 0; e < experts; ++e) {
      const int64_t size = max(0, sizes[e]);
      const int64_t begin = min(offset, m), end = min(offset + size, m);
      s_rows[e] = begin;
      s_tiles[e] = tiles;
      tiles += static_cast<int>((end - begin + rows - 1) / rows);
      offset += size;
    }
    s_rows[experts] = min(offset, m);
    s_tiles[experts] = tiles;
    total_rows = min(offset, m);
  }
  __syncthreads();
  return total_rows;
}

__global__ void __launch_bounds__(kThreads)
    w4a8_group_tiles_kernel(const int32_t* __restrict__ sizes, int experts, int64_t m, int rows,
                            W4A8GroupTile* __restrict__ tiles, int32_t* __restrict__ count,
                            void* __restrict__ out, int64_t row_bytes) {
  __shared__ int64_t s_rows[kW4A8MaxExperts + 1];
  __shared__ int s_tiles[kW4A8MaxExperts + 1];
  const int64_t covered = scan_groups(sizes, experts, m, rows, s_rows, s_tiles);
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) *count = s_tiles[experts];
    for (int e = threadIdx.x; e < experts; e += kThreads) {
      const int64_t begin = s_rows[e], end = s_rows[e + 1];
      for (int t = s_tiles[e]; t < s_tiles[e + 1]; ++t) {
        const int64_t row0 = begin + static_cast<int64_t>(t - s_tiles[e]) * rows;
        tiles[t] = W4A8GroupTile{e, static_cast<int32_t>(row0),
                                 static_cast<int32_t>(min(row0 + rows, end)), 0};
      }
    }
  }
  // Rows [covered, m): zeros, in 16-byte words (rows are whole words: N % 8 == 0).
  const int64_t words = (m - covered) * row_bytes / 16;
  uint4* dst = reinterpret_cast<uint4*>(static_cast<uint8_t*>(out) + covered * row_bytes);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < words;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    dst[i] = make_uint4(0, 0, 0, 0);
}

}  // namespace

cudaError_t LaunchW4A8GroupTiles(const W4A8Args& args, int rows, cudaStream_t stream) {
  if (args.experts < 1 || args.experts > kW4A8MaxExperts || rows < 1) return cudaErrorInvalidValue;
  if (args.workspace_bytes < W4A8GroupListBytes(args.m, args.experts, rows))
    return cudaErrorInvalidValue;
  auto* base = static_cast<uint8_t*>(args.workspace);
  const int64_t row_bytes = static_cast<int64_t>(args.n) * (args.out_f32 ? 4 : 2);
  w4a8_group_tiles_kernel<<<kZeroBlocks, kThreads, 0, stream>>>(
      args.group_sizes, args.experts, args.m, rows,
      reinterpret_cast<W4A8GroupTile*>(base + kW4A8GroupHeaderBytes),
      reinterpret_cast<int32_t*>(base), args.out, row_bytes);
  return cudaGetLastError();
}

}  // namespace mila
