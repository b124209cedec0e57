// Device helpers shared by the W4A8 kernels (w4a8.cu: mma.sync; w4a8_sm90_ws.cu: warp-specialized
// wgmma; w4a8_expand.cu): K-tile constants, the e2m1 -> e4m3 conversion of one weight word (see
// w4a8.cu's header comment for why it is exact), the channel scale of the epilogue, the tile
// raster of dense calls and the tile list of grouped ones. Internal linkage: each kernel file
// gets its own copy.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "w4a8/w4a8_kernel.h"

// Archs below a kernel's minimum compile its body away and leave these unused.
#pragma nv_diag_suppress 177

namespace mila {
namespace {

constexpr int kBK = 128;                 // K tile = one kernel-order group
constexpr int kKBlocks = kBK / 32;       // MXFP4 blocks per K tile
constexpr int kPackedTile = kBK / 2;     // packed bytes per weight row and K tile

// e4m3 bytes of the e2m1 magnitudes code * 2^6 (code 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6):
// 0, 32, 64, 96 and 128, 192, 256, 384. The block offset d enters as 8 d added to the
// exponent field of the nonzero entries (byte 0, code 0, stays 0).
constexpr uint32_t kLutLo = 0x6C686000u;
constexpr uint32_t kLutHi = 0x7C787470u;
constexpr uint32_t kLutLoStep = 0x08080800u;
constexpr uint32_t kLutHiStep = 0x08080808u;
constexpr int kChannelExpShift = 127 + 6;  // weight = e4m3 * 2^(channel_exp - 133)

// Table constants of one weight row: table = block_exp * step + c (c folds -R * step in).
struct RowLut {
  uint32_t lo, hi;
};
__device__ __forceinline__ RowLut row_lut(uint32_t channel_exp) {
  return {kLutLo - channel_exp * kLutLoStep, kLutHi - channel_exp * kLutHiStep};
}

// 8 codes of one word (sign-swizzled, jax_mila.quant.mxfp4 format version 2) -> the two e4m3
// registers (k 4q..4q+3 and k 16+4q..16+4q+3).
__device__ __forceinline__ void word_to_e4m3(uint32_t word, uint32_t block_exp, RowLut c,
                                             uint32_t& lo, uint32_t& hi) {
  ptx::w4a8::e2m1x8_to_e4m3x8(word, block_exp * kLutLoStep + c.lo, block_exp * kLutHiStep + c.hi,
                              lo, hi);
}

__device__ __forceinline__ float channel_scale(const uint8_t* channel_exp, int n, int N) {
  return n < N ? ldexpf(1.f, static_cast<int>(channel_exp[n]) - kChannelExpShift) : 0.f;
}

// float32 epilogue of the wgmma kernels (y^T tiles: a warpgroup's m64 accumulator over kRows
// activation rows). acc[4j + e] = y^T[weight row n0 + col (+8 if e >= 2)][activation row
// m0 + 8j + 2q (+1 if e odd)] for this thread's quad q; scaled by the channel and row scales
// and stored directly (the 8 lanes of a quad column write 32 contiguous bytes, a sector).
// Rows >= M (the tile's row end) and columns >= N are not stored.
template <int kRows>
__device__ __forceinline__ void store_f32_tile(const float (&acc)[kRows / 2], float* out,
                                               const float* x_scale, int64_t m0, int64_t M, int n0,
                                               int col, int N, float ws0, float ws1, int q) {
#pragma unroll
  for (int j = 0; j < kRows / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int64_t r = m0 + 8 * j + 2 * q + e;
      if (r >= M) continue;
      const float xs = x_scale[r];
      if (n0 + col < N) out[r * N + n0 + col] = acc[4 * j + e] * ws0 * xs;
      if (n0 + col + 8 < N) out[r * N + n0 + col + 8] = acc[4 * j + 2 + e] * ws1 * xs;
    }
  }
}

// One output tile: activation rows [m0, m_end) (m_end: M, or the end of the tile's expert
// group), weight rows n0 .. n0 + 127 of the expert's N, which start at row w_row0 of the
// [E x N, Kp] weight arrays.
struct Tile {
  int64_t m0, m_end, w_row0;
  int n0;
};
__device__ __forceinline__ Tile dense_tile(const W4A8Args& args, int tm, int tn, int bm, int bn) {
  return {static_cast<int64_t>(tm) * bm, args.m, static_cast<int64_t>(tn) * bn, tn * bn};
}
// Grouped calls: the number of M tiles in the list w4a8_groups.cu wrote into the workspace, and
// output tile (entry mt, weight tile tn).
__device__ __forceinline__ int group_tile_count(const W4A8Args& args) {
  return *static_cast<const int32_t*>(args.workspace);
}
__device__ __forceinline__ Tile group_tile(const W4A8Args& args, int mt, int tn, int bn) {
  const int4 e = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(args.workspace) +
                                               kW4A8GroupHeaderBytes)[mt];
  const int n0 = tn * bn;
  return {e.y, e.z, static_cast<int64_t>(e.x) * args.n + n0, n0};
}

// Grouped raster: consecutive CTAs walk `group_m` M tiles for one N tile, so the weight tile
// and the group's activation tiles stay in L2.
__device__ __forceinline__ void tile_coords(int pid, int tiles_m, int tiles_n, int group_m,
                                            int& tm, int& tn) {
  const int group = group_m * tiles_n;
  const int first_m = (pid / group) * group_m;
  const int gm = min(tiles_m - first_m, group_m);
  tm = first_m + (pid % group) % gm;
  tn = (pid % group) / gm;
}

// One n128 half of a promotion chain (sm_90a): a wgmma.m64n128k32 per converted weight block of
// the chain's kChain K tiles, into `part`, the first overwriting it (scale-d 0); desc(c, kb) is
// the shared-memory descriptor of block kb of tile c's activations.
template <int kChain, typename Desc>
__device__ __forceinline__ void wgmma_chain_half(float (&part)[64],
                                                 const uint32_t (&a)[kChain][kKBlocks][4],
                                                 Desc desc) {
#pragma unroll
  for (int c = 0; c < kChain; ++c)
#pragma unroll
    for (int kb = 0; kb < kKBlocks; ++kb) {
      if (c == 0 && kb == 0)
        ptx::w4a8::wgmma_m64n128k32_e4m3_rs<false>(part, a[c][kb], desc(c, kb));
      else
        ptx::w4a8::wgmma_m64n128k32_e4m3_rs<true>(part, a[c][kb], desc(c, kb));
    }
}

}  // namespace
}  // namespace mila
