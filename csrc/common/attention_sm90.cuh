// What the Hopper (sm_90a) attention kernels share on the device: their tile traits, the named
// barriers, the shared-memory base, the TMA loads of tiles, a consumer thread's place in the
// wgmma accumulator and the release of a buffer. The kernels are flash512_sm90/flash512_sm90.cu,
// flash512_sm90/flash512_sm90_seesaw.cu and flash256_sm90/flash256_sm90.cu; their design is in
// docs/design/attention_sm90.md. The masks and tile ranges are in common/key_tiles.cuh, the
// softmax steps in common/softmax_fragments.cuh, the epilogue in common/attention_epilogue.cuh
// and the host side of a launch in common/attention_sm90_launch.h.
#pragma once

#include <cuda.h>  // CUtensorMap (types only)

#include <cstdint>

#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"

namespace mila::attention_sm90 {

// One column block of a tile, and one TMA box: 64 rows x 64 bf16 columns (128 bytes, the
// 128-byte swizzle's row).
constexpr int kColBlockBytes = 64 * 128;

// Tile sizes of a kernel for head dim kHeadDim that gives each CTA (or work item) kRowsPerCta
// packed query rows (position x query head of one KV head: packed row r = t G + g).
//   Threads: a producer warpgroup (one thread issues every TMA copy) and two consumer
//   warpgroups; setmaxnreg moves registers from the producer to the consumers, 128 x 24 +
//   256 x 240 = 384 x 168, the allocation ptxas gives a 384-thread kernel with one CTA an SM.
//   Tiles: 64 rows (keys, or a consumer's query rows) x D bf16, stored as D / 64 column blocks
//   of 64 rows x 128 bytes: one TMA box each, the 128-byte swizzle's row, 1024-byte aligned.
template <int kHeadDim, int kRowsPerCta>
struct Traits {
  static constexpr int kD = kHeadDim;
  static constexpr int kBlockM = kRowsPerCta;  // packed query rows per CTA / work item
  static constexpr int kBlockN = 64;           // keys per K/V tile
  static constexpr int kRowsPerBox = 64;       // rows of a TMA box, and of a wgmma accumulator
  static constexpr int kThreads = 384;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static constexpr int kColBlocks = kD / 64;
  static constexpr uint32_t kTileBytes = kColBlocks * kColBlockBytes;  // 64 rows x D bf16
  static constexpr int kSmemAlign = 1024;  // the 128-byte swizzle's atom: 8 rows x 128 bytes
  static constexpr int kMaxSmemBytes = 227 * 1024;  // sm_90's opt-in shared memory per block
  static_assert(128 * kProducerRegs + kConsumerThreads * kConsumerRegs <= kThreads * 168,
                "setmaxnreg moves registers within the CTA's allocation");
  static constexpr float kLog2e = 1.4426950408889634f;
};

// Every named barrier (bar.sync / bar.arrive id) of these kernels; 0 is __syncthreads.
enum class NamedBarrier : int {
  // Both consumer warpgroups (256 threads), around an exchange through shared memory:
  // flash512_sm90's S partials, row maxima, P fragments and row sums; the seesaw's row sums.
  kConsumers = 1,
  // flash256_sm90's ping-pong: consumer c issues its wgmmas between a sync on
  // kConsumerTurn0 + c and an arrival on kConsumerTurn0 + 1 - c (ConsumerTurn).
  kConsumerTurn0 = 2,
  kConsumerTurn1 = 3,
};

__device__ __forceinline__ int BarrierId(NamedBarrier id) { return static_cast<int>(id); }
// Consumer c's turn barrier (flash256_sm90's ping-pong).
__device__ __forceinline__ int ConsumerTurn(int c) {
  return BarrierId(NamedBarrier::kConsumerTurn0) + c;
}

// The dynamic shared memory from its first 1024-byte boundary on: its .shared address (for TMA,
// mbarriers and wgmma descriptors) and a pointer (for the kernel's SharedStorage). The launch
// adds kSmemAlign bytes of slack.
struct AlignedSmem {
  uint32_t base;
  unsigned char* ptr;
};
__device__ __forceinline__ AlignedSmem AlignSmem(unsigned char* raw) {
  const uint32_t raw_addr = ptx::smem_addr(raw);
  const uint32_t base = (raw_addr + 1023u) & ~1023u;
  return {base, raw + (base - raw_addr)};
}

// kBlocks column blocks of a 4-D bf16 tensor map (box {64, box1, box2, 1}, common/tensor_map.h)
// into consecutive 8 KB blocks at dst: block i holds columns col0 + 64 i; the other coordinates
// as given; completion counted in bytes on `bar`.
template <int kBlocks>
__device__ __forceinline__ void LoadColumnBlocks(uint32_t dst, const CUtensorMap* map,
                                                 uint32_t bar, int col0, int c1, int c2,
                                                 int c3) {
#pragma unroll
  for (int i = 0; i < kBlocks; ++i) {
    ptx::sm90::tma_load_4d(dst + i * kColBlockBytes, map, bar, col0 + 64 * i, c1, c2, c3);
  }
}

// A consumer thread's place in a warpgroup's m64nN wgmma accumulator (fp32): warp wq holds rows
// 16 wq .. 16 wq + 15; this thread rows row() and row() + 8, columns 8 j + 2 t4 + {0, 1}.
struct FragmentThread {
  int ct;    // thread in the warpgroup
  int lane, wq, g, t4;
  __device__ __forceinline__ explicit FragmentThread(int thread_in_warpgroup)
      : ct(thread_in_warpgroup), lane(ct & 31), wq(ct >> 5), g(lane >> 2), t4(lane & 3) {}
  __device__ __forceinline__ int row() const { return 16 * wq + g; }
};

// The query index of packed row pr (G query heads per KV head); rows past the last, which
// compute on zero-filled Q and are never written, take the last row's (their masks stay real).
__device__ __forceinline__ int QueryIndex(int pr, int rows_total, int G, int t) {
  return pr < rows_total ? pr / G : t - 1;
}

// A consumer warp's arrival on an empty barrier (count: one per warp), once every lane of the
// warp is done with the buffer.
__device__ __forceinline__ void ReleaseByWarp(uint32_t bar, int lane) {
  __syncwarp();
  if (lane == 0) ptx::sm90::mbar_arrive(bar);
}

}  // namespace mila::attention_sm90
