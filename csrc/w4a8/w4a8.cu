// W4A8 GEMM kernels (see w4a8_kernel.h). Shared by both:
//   * the weight's kernel order gives each lane, from one 16-byte load per weight row and
//     128-wide K tile, the 32-bit words (8 e2m1 codes) of that row for the tile's 4 blocks;
//   * a word becomes two e4m3 fragment registers through an 8-entry byte table per
//     (row, block): e4m3(code * 2^(6 + d)), d = block exponent - channel exponent in [-11, 0],
//     built with two IMADs. Exact: code * 2^6 spans [2^5, 1.5 * 2^8] and 2^(5 - 11) is e4m3's
//     smallest normal; the quantizer guarantees d >= -11 for every nonzero block;
//   * the epilogue multiplies by 2^(channel_exp - 133) (exact) and x_scale[m], rounds to bf16
//     once.
#include <cmath>
#include <type_traits>

#include "common/ptx.cuh"
#include "w4a8/w4a8_kernel.h"

// Builds for archs below a kernel's minimum compile its body away, which leaves these helpers
// unused there ("declared but never referenced").
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

// 8 codes of one word -> the two e4m3 registers (k 4q..4q+3 and k 16+4q..16+4q+3).
__device__ __forceinline__ void word_to_e4m3(uint32_t word, uint32_t block_exp, RowLut c,
                                             uint32_t& lo, uint32_t& hi) {
  const uint32_t lut_lo = block_exp * kLutLoStep + c.lo;
  const uint32_t lut_hi = block_exp * kLutHiStep + c.hi;
  lo = ptx::w4a8::e2m1x4_to_e4m3x4(word, lut_lo, lut_hi);
  hi = ptx::w4a8::e2m1x4_to_e4m3x4(word >> 16, lut_lo, lut_hi);
}

__device__ __forceinline__ float channel_scale(const uint8_t* channel_exp, int n, int N) {
  return n < N ? ldexpf(1.f, static_cast<int>(channel_exp[n]) - kChannelExpShift) : 0.f;
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

// ============================================================================================
// mma.sync kernel: block tile 128 (M) x 128 (N) x 128 (K), 8 warps of 64 x 32, 4-stage
// cp.async pipeline for activations (128-byte rows, 16-byte chunks XOR-swizzled by row for
// conflict-free ldmatrix), packed weights (64-byte rows, natural order: a quarter-warp's 16-byte
// loads cover 128 contiguous bytes) and block exponents.
// ============================================================================================
namespace mma {

constexpr int kBM = 128, kBN = 128;
constexpr int kStages = 4;
constexpr int kThreads = 256;
constexpr int kWarpsN = 4;
constexpr int kWM = 64, kWN = 32;
constexpr int kMT = kWM / 16, kNT = kWN / 8;  // 4 x 4 mma tiles per warp
constexpr int kASize = kBM * kBK;
constexpr int kBSize = kBN * kPackedTile;
constexpr int kSSize = kBN * kKBlocks;
constexpr int kStageBytes = kASize + kBSize + kSSize;
constexpr int kSmemBytes = kStages * kStageBytes;
constexpr int kGroupM = 16;

template <typename OutT>
__global__ void __launch_bounds__(kThreads, 1) w4a8_mma_kernel(const W4A8Args args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp / kWarpsN, wn = warp % kWarpsN;
  const int g = lane / 4, q = lane % 4;
  const int K = args.k, N = args.n;
  const int64_t M = args.m;

  int tm, tn;
  tile_coords(blockIdx.x, static_cast<int>((M + kBM - 1) / kBM), (N + kBN - 1) / kBN, kGroupM,
              tm, tn);
  const int64_t m0 = static_cast<int64_t>(tm) * kBM;
  const int n0 = tn * kBN;
  const int kt_count = K / kBK;
  const int64_t packed_row = K / 2, scale_row = K / 32;
  const uint32_t smem_base = ptx::smem_addr(smem);

  auto load_stage = [&](int stage, int kt) {
    const uint32_t sa = smem_base + stage * kStageBytes;
    const uint32_t sb = sa + kASize;
    const uint32_t ss = sb + kBSize;
#pragma unroll
    for (int i = 0; i < kASize / 16 / kThreads; ++i) {
      const int c = tid + i * kThreads, row = c / 8, chunk = c % 8;
      const bool valid = m0 + row < M;
      const uint8_t* src = args.x + (valid ? (m0 + row) * K : 0) + kt * kBK + chunk * 16;
      ptx::cp_async_16(sa + row * kBK + ((chunk ^ (row & 7)) * 16), src, valid);
    }
#pragma unroll
    for (int i = 0; i < kBSize / 16 / kThreads; ++i) {
      const int c = tid + i * kThreads, row = c / 4, chunk = c % 4;
      const bool valid = n0 + row < N;
      const uint8_t* src =
          args.packed + (valid ? (n0 + row) * packed_row : 0) + kt * kPackedTile + chunk * 16;
      ptx::cp_async_16(sb + row * kPackedTile + chunk * 16, src, valid);
    }
    if (tid < kBN) {
      const int row = tid;
      const bool valid = n0 + row < N;
      const uint8_t* src = args.scales + (valid ? (n0 + row) * scale_row : 0) + kt * kKBlocks;
      ptx::w4a8::cp_async_4(ss + row * kKBlocks, src, valid);
    }
  };

  RowLut lut_c[kNT];
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
    const int n = n0 + wn * kWN + j * 8 + g;
    lut_c[j] = row_lut(n < N ? args.channel_exp[n] : 0u);
  }

  float acc[kMT][kNT][4];
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < kt_count) load_stage(s, s);
    ptx::cp_async_commit();
  }

  const int a_row = wm * kWM + (lane % 16);  // + 16 i; (a_row + 16 i) & 7 == lane & 7
  const int a_half = lane / 16;

  for (int kt = 0; kt < kt_count; ++kt) {
    ptx::cp_async_wait<kStages - 2>();
    __syncthreads();
    {
      const int next = kt + kStages - 1;
      if (next < kt_count) load_stage(next % kStages, next);
      ptx::cp_async_commit();
    }
    const int stage = kt % kStages;
    const uint32_t sa = smem_base + stage * kStageBytes;
    const uint8_t* sb = smem + stage * kStageBytes + kASize;
    const uint8_t* ss = sb + kBSize;

    uint4 bw[kNT];     // this lane's words of its weight rows, all 4 blocks
    uint32_t sc[kNT];  // their 4 block exponents
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      const int row = wn * kWN + j * 8 + g;
      bw[j] = *reinterpret_cast<const uint4*>(sb + row * kPackedTile + q * 16);
      sc[j] = *reinterpret_cast<const uint32_t*>(ss + row * kKBlocks);
    }

#pragma unroll
    for (int kb = 0; kb < kKBlocks; ++kb) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int i = 0; i < kMT; ++i) {
        const int chunk = kb * 2 + a_half;
        ptx::ldmatrix_x4(a[i], sa + (a_row + i * 16) * kBK + ((chunk ^ (lane & 7)) * 16));
      }
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        const uint32_t word = kb == 0 ? bw[j].x : kb == 1 ? bw[j].y : kb == 2 ? bw[j].z : bw[j].w;
        uint32_t b[2];
        word_to_e4m3(word, (sc[j] >> (8 * kb)) & 0xFFu, lut_c[j], b[0], b[1]);
#pragma unroll
        for (int i = 0; i < kMT; ++i) ptx::mma_e4m3_16832(acc[i][j], a[i], b);
      }
    }
  }
  ptx::cp_async_wait<0>();

  float wscale[kNT][2];
#pragma unroll
  for (int j = 0; j < kNT; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e)
      wscale[j][e] = channel_scale(args.channel_exp, n0 + wn * kWN + j * 8 + 2 * q + e, N);
  // Direct stores of column pairs: 4 lanes write 16 (bf16) or 32 (f32) contiguous bytes of a
  // row; output traffic is ~1/K of the work, so staging it through smem is not worth a barrier.
#pragma unroll
  for (int i = 0; i < kMT; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = m0 + wm * kWM + i * 16 + h * 8 + g;
      if (row >= M) continue;
      const float xs = args.x_scale[row];
      OutT* out_row = static_cast<OutT*>(args.out) + row * N;
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        const int col = n0 + wn * kWN + j * 8 + 2 * q;
        if (col >= N) continue;
        const float v0 = acc[i][j][2 * h] * wscale[j][0] * xs;
        const float v1 = acc[i][j][2 * h + 1] * wscale[j][1] * xs;
        if constexpr (std::is_same_v<OutT, float>) {
          *reinterpret_cast<float2*>(out_row + col) = make_float2(v0, v1);
        } else {
          *reinterpret_cast<uint32_t*>(out_row + col) = ptx::pack_bf16x2(v0, v1);
        }
      }
    }
  }
#endif  // older archs compile an empty kernel that the launcher never starts
}

}  // namespace mma

// ============================================================================================
// wgmma kernel (sm_90a): block tile 128 weight rows x 256 activation rows x 128 (K); two
// warpgroups, each computing y^T[64 weight rows, 256 activation rows] with 4 wgmma.m64n256k32
// per K tile. The activation tile is the shared-memory B operand (128-byte rows, 128B swizzle,
// 4-stage cp.async pipeline, prefetch distance 2 so a stage is refilled only after the wgmma
// batch that read it has retired). The weight tile is the register A operand: each thread loads
// its two rows' words straight from global memory one K tile ahead and converts them while the
// previous wgmma batch runs. One wgmma batch stays in flight across iterations.
// ============================================================================================
namespace wg {

constexpr int kBN = 128;  // weight rows (2 warpgroups x 64)
constexpr int kBM = 256;  // activation rows (wgmma N)
constexpr int kStages = 4;
constexpr int kPrefetch = kStages - 2;
constexpr int kThreads = 256;
constexpr int kXStage = kBM * kBK;           // 32 KiB, 1024-byte aligned
constexpr int kSmemBytes = kStages * kXStage + 1024;  // + alignment slack
constexpr int kOutPitch = kBN + 8;           // bf16 per staged output row (conflict-free)
constexpr int kGroupM = 8;
static_assert(kBM * kOutPitch * 2 <= kStages * kXStage, "output staging must fit");

struct WeightRegs {
  uint4 words[2];     // rows g and g + 8: word q of blocks 0..3
  uint32_t exps[2];   // their 4 block exponents
};

template <typename OutT>
__global__ void __launch_bounds__(kThreads, 1) w4a8_wgmma_kernel(const W4A8Args args) {
#if defined(__CUDA_ARCH__) && defined(MILA_W4A8_HAS_WGMMA)
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_base = ptx::smem_addr(smem_raw);
  const uint32_t smem_base = (raw_base + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (smem_base - raw_base);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wgi = warp / 4, wwarp = warp % 4;
  const int g = lane / 4, q = lane % 4;
  const int K = args.k, N = args.n;
  const int64_t M = args.m;

  int tm, tn;
  tile_coords(blockIdx.x, static_cast<int>((M + kBM - 1) / kBM), (N + kBN - 1) / kBN, kGroupM,
              tm, tn);
  const int64_t m0 = static_cast<int64_t>(tm) * kBM;
  const int n0 = tn * kBN;
  const int kt_count = K / kBK;

  // Activation rows of this thread: tid / 8 + 32 i, 16-byte chunk tid % 8 (so row & 7 is
  // (tid / 8) & 7 for every i). Rows past M (last M tile only) re-read row M - 1 instead of
  // being zero-filled: their results are never stored, and the copies stay unpredicated.
  constexpr int kXCopies = kXStage / 16 / kThreads;
  const int x_row0 = tid / 8, x_chunk = tid % 8;
  const bool x_full_tile = m0 + kBM <= M;
  const uint8_t* x_src0 = args.x + (m0 + x_row0) * K + x_chunk * 16;  // used when x_full_tile
  const int64_t x_src_step = 32 * static_cast<int64_t>(K);
  const uint32_t x_dst0 = x_row0 * kBK + ((x_chunk ^ (x_row0 & 7)) * 16);
  auto load_x = [&](int stage, int kt) {
    const uint32_t sx = smem_base + stage * kXStage + x_dst0;
    if (x_full_tile) {
      const uint8_t* src = x_src0 + kt * kBK;
#pragma unroll
      for (int i = 0; i < kXCopies; ++i) ptx::cp_async_16(sx + i * 32 * kBK, src + i * x_src_step);
    } else {
#pragma unroll
      for (int i = 0; i < kXCopies; ++i) {
        const int64_t row = min(m0 + x_row0 + 32 * i, M - 1);
        ptx::cp_async_16(sx + i * 32 * kBK, args.x + row * K + kt * kBK + x_chunk * 16);
      }
    }
  };

  // This thread's weight rows: A-fragment rows g and g + 8 of its warp's 16.
  int wrow[2];
  RowLut lut_c[2];
  const uint8_t* wptr[2];
  const uint8_t* sptr[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    wrow[h] = n0 + wgi * 64 + wwarp * 16 + g + 8 * h;
    const bool valid = wrow[h] < N;
    lut_c[h] = row_lut(valid ? args.channel_exp[wrow[h]] : 0u);
    wptr[h] = args.packed + static_cast<int64_t>(valid ? wrow[h] : 0) * (K / 2) + q * 16;
    sptr[h] = args.scales + static_cast<int64_t>(valid ? wrow[h] : 0) * (K / 32);
  }
  auto load_w = [&](int kt, WeightRegs& w) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (wrow[h] < N) {
        w.words[h] = __ldg(reinterpret_cast<const uint4*>(wptr[h] + kt * kPackedTile));
        w.exps[h] = __ldg(reinterpret_cast<const uint32_t*>(sptr[h] + kt * kKBlocks));
      } else {
        w.words[h] = make_uint4(0, 0, 0, 0);
        w.exps[h] = 0;
      }
    }
  };
  // A fragment of block kb: {row g k 4q.., row g+8 k 4q.., row g k 16+4q.., row g+8 k 16+4q..}.
  auto convert = [&](const WeightRegs& w, uint32_t (&a)[kKBlocks][4]) {
#pragma unroll
    for (int kb = 0; kb < kKBlocks; ++kb)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4& v = w.words[h];
        const uint32_t word = kb == 0 ? v.x : kb == 1 ? v.y : kb == 2 ? v.z : v.w;
        word_to_e4m3(word, (w.exps[h] >> (8 * kb)) & 0xFFu, lut_c[h], a[kb][h], a[kb][2 + h]);
      }
  };

  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;

#pragma unroll
  for (int s = 0; s < kPrefetch; ++s) {
    if (s < kt_count) load_x(s, s);
    ptx::cp_async_commit();
  }
  uint32_t a[2][kKBlocks][4];
  WeightRegs wnext;
  load_w(0, wnext);
  convert(wnext, a[0]);
  if (kt_count > 1) load_w(1, wnext);

  // One K tile; `buf` (compile-time) selects the A registers of this tile.
  auto step = [&](auto buf, int kt) {
    constexpr int cur = decltype(buf)::value;
    ptx::cp_async_wait<kPrefetch - 1>();
    ptx::w4a8::fence_proxy_async_shared();
    __syncthreads();  // tile kt visible; every warpgroup has retired the batch of kt - 2
    const uint32_t sx = smem_base + (kt % kStages) * kXStage;
    ptx::w4a8::wgmma_fence();
#pragma unroll
    for (int kb = 0; kb < kKBlocks; ++kb)
      ptx::w4a8::wgmma_m64n256k32_e4m3_rs(acc, a[cur][kb],
                                          ptx::w4a8::wgmma_desc_k128b(sx + kb * 32));
    ptx::w4a8::wgmma_commit();
    {
      // Refill the stage of tile kt - 2 (retired) while the tensor cores work.
      const int next = kt + kPrefetch;
      if (next < kt_count) load_x(next % kStages, next);
      ptx::cp_async_commit();
    }
    ptx::w4a8::wgmma_wait<1>();  // the batch of kt - 1 (which read a[cur ^ 1]) has retired
#pragma unroll
    for (int kb = 0; kb < kKBlocks; ++kb)
#pragma unroll
      for (int e = 0; e < 4; ++e) ptx::w4a8::fence_operand(a[cur ^ 1][kb][e]);
    if (kt + 1 < kt_count) convert(wnext, a[cur ^ 1]);
    if (kt + 2 < kt_count) load_w(kt + 2, wnext);
  };
  for (int kt = 0; kt < kt_count; kt += 2) {
    step(std::integral_constant<int, 0>{}, kt);
    if (kt + 1 < kt_count) step(std::integral_constant<int, 1>{}, kt + 1);
  }
  ptx::w4a8::wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < 128; ++i) ptx::w4a8::fence_operand(acc[i]);
  ptx::cp_async_wait<0>();
  __syncthreads();  // every warpgroup is done reading the stages: reuse them for the output

  // Epilogue: acc[4j + e] = y^T[weight row g (+8 if e >= 2)][activation row 8j + 2q (+1 if e
  // odd)] of this warp's 16 rows.
  const int col0 = wgi * 64 + wwarp * 16 + g;  // tile-local weight column (+8)
  const float ws0 = channel_scale(args.channel_exp, n0 + col0, N);
  const float ws1 = channel_scale(args.channel_exp, n0 + col0 + 8, N);
  if constexpr (std::is_same_v<OutT, float>) {
    // float32: direct stores; the 8 lanes of a quad column write 32 contiguous bytes (a sector).
    float* out = static_cast<float*>(args.out);
#pragma unroll
    for (int j = 0; j < kBM / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t r = m0 + 8 * j + 2 * q + e;
        if (r >= M) continue;
        const float xs = args.x_scale[r];
        if (n0 + col0 < N) out[r * N + n0 + col0] = acc[4 * j + e] * ws0 * xs;
        if (n0 + col0 + 8 < N) out[r * N + n0 + col0 + 8] = acc[4 * j + 2 + e] * ws1 * xs;
      }
    }
    return;
  }
  // bfloat16: scale, round, stage y[act row][weight col] in shared memory, then write 16-byte
  // chunks of whole rows.
  __nv_bfloat16* so = reinterpret_cast<__nv_bfloat16*>(smem);
#pragma unroll
  for (int j = 0; j < kBM / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = 8 * j + 2 * q + e;
      const float xs = m0 + r < M ? args.x_scale[m0 + r] : 0.f;
      so[r * kOutPitch + col0] = __float2bfloat16_rn(acc[4 * j + e] * ws0 * xs);
      so[r * kOutPitch + col0 + 8] = __float2bfloat16_rn(acc[4 * j + 2 + e] * ws1 * xs);
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kBM * kBN / 8 / kThreads; ++i) {
    const int c = tid + i * kThreads, r = c / (kBN / 8), ch = c % (kBN / 8);
    const int col = n0 + ch * 8;
    if (m0 + r < M && col < N) {
      const uint4 v = *reinterpret_cast<const uint4*>(so + r * kOutPitch + ch * 8);
      *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(args.out) + (m0 + r) * N + col) = v;
    }
  }
#endif  // other archs compile an empty kernel that the launcher never starts
}

}  // namespace wg

template <typename Kernel>
cudaError_t Launch(Kernel kernel, int64_t tiles, int threads, int smem, const W4A8Args& args,
                   cudaStream_t stream) {
  if (tiles > INT32_MAX) return cudaErrorInvalidConfiguration;
  // Not a stream operation, so it is allowed while a CUDA graph is being captured.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(tiles), threads, smem, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchW4A8Matmul(const W4A8Args& args, W4A8Variant variant, int cc,
                             cudaStream_t stream) {
  if (cc < kW4A8MinComputeCapability) return cudaErrorNoKernelImageForDevice;
  if (variant == W4A8Variant::kAuto) {
    // The wgmma kernel accumulates FP8 products at the tensor core's reduced FP8 accumulation
    // precision (measured rel. error 1.6e-3 at K=15360 on the H200, against < 1e-5 for the
    // mma.sync kernel); until it promotes partial sums to fp32 it is opt-in only.
    variant = W4A8Variant::kMmaSync;
  }
  if (variant == W4A8Variant::kWgmma) {
    if (cc != 90) return cudaErrorNoKernelImageForDevice;
    const int64_t tiles = ((args.m + wg::kBM - 1) / wg::kBM) * ((args.n + wg::kBN - 1) / wg::kBN);
    return args.out_f32 ? Launch(wg::w4a8_wgmma_kernel<float>, tiles, wg::kThreads,
                                 wg::kSmemBytes, args, stream)
                        : Launch(wg::w4a8_wgmma_kernel<__nv_bfloat16>, tiles, wg::kThreads,
                                 wg::kSmemBytes, args, stream);
  }
  const int64_t tiles = ((args.m + mma::kBM - 1) / mma::kBM) * ((args.n + mma::kBN - 1) / mma::kBN);
  return args.out_f32 ? Launch(mma::w4a8_mma_kernel<float>, tiles, mma::kThreads,
                               mma::kSmemBytes, args, stream)
                      : Launch(mma::w4a8_mma_kernel<__nv_bfloat16>, tiles, mma::kThreads,
                               mma::kSmemBytes, args, stream);
}

}  // namespace mila
