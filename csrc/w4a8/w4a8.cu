// W4A8 GEMM kernels (see w4a8_kernel.h). Shared by both:
//   * the weight's kernel order gives each lane, from one 16-byte load per weight row and
//     128-wide K tile, the 32-bit words (8 e2m1 codes) of that row for the tile's 4 blocks;
//   * a word becomes two e4m3 fragment registers through an 8-entry byte table per
//     (row, block): e4m3(code * 2^(6 + d)), d = block exponent - channel exponent in [-11, 0],
//     built with two IMADs. Exact: code * 2^6 spans [2^5, 1.5 * 2^8] and 2^(5 - 11) is e4m3's
//     smallest normal; the quantizer guarantees d >= -11 for every nonzero block;
//   * the epilogue multiplies by 2^(channel_exp - 133) (exact) and x_scale[m], rounds to bf16
//     once.
#include <atomic>
#include <cmath>
#include <cstdlib>  // getenv (HopperAutoVariant)
#include <cstring>  // strcmp (HopperAutoVariant)
#include <type_traits>

#include "common/ptx.cuh"
#include "w4a8/w4a8_convert.cuh"
#include "w4a8/w4a8_kernel.h"

// Builds for archs below a kernel's minimum compile its body away, which leaves these helpers
// unused there ("declared but never referenced").
#pragma nv_diag_suppress 177

namespace mila {
namespace {

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
// warpgroups, each computing y^T[64 weight rows, 256 activation rows]. A 5-stage cp.async
// pipeline (prefetch distance 4) brings each K tile's activations (128-byte rows, 128B swizzle:
// the shared-memory B operand), packed weights and block exponents into shared memory. The
// weight tile is the register A operand: after a tile's last wgmma retires, each thread converts
// its two rows of the next tile from shared memory into e4m3 fragments.
//
// FP8 accumulation: Hopper's FP8 wgmma adds into its fp32 accumulator at reduced precision
// (~14 bits, truncated): a K=15360 chain drifts to 1.6e-3 relative error. So partial sums are
// promoted (DeepGEMM-style): per K tile and per activation half (n128), 4 wgmma.m64n128k32 run
// into a 64-register temporary (scale-d = 0 on the first: a fresh sum), then master += temp in
// fp32 registers. Chains are 128 long whatever K is. Master (128) + temp (64) fit next to the
// A fragments; a second full-width accumulator would not. While one warpgroup waits and adds,
// the other warpgroup's wgmma keeps the tensor cores busy.
// ============================================================================================
namespace wg {

constexpr int kBN = 128;  // weight rows (2 warpgroups x 64)
constexpr int kBM = 256;  // activation rows
constexpr int kHalfM = 128;  // activation rows per wgmma (n128) and per promotion
// Step kt refills (at its end) the stage of tile kt - 1 with tile kt + kStages - 1, which the
// barrier of step kt + kStages - 3 needs: 5 stages leave 2.5 steps for the copies.
constexpr int kStages = 5;
constexpr int kPrefetch = kStages - 1;
constexpr int kThreads = 256;
constexpr int kXStage = kBM * kBK;           // 32 KiB, 1024-byte aligned
constexpr int kXHalf = kHalfM * kBK;         // byte offset of activation row 128 (1024-aligned)
constexpr int kWStage = kBN * kPackedTile;   // 8 KiB of packed weights per stage
constexpr int kEStage = kBN * kKBlocks;      // 512 B of block exponents per stage
constexpr int kWOffset = kStages * kXStage;  // weight stages follow the activation stages
constexpr int kEOffset = kWOffset + kStages * kWStage;
constexpr int kLutOffset = kEOffset + kStages * kEStage;  // RowLut of the tile's 128 rows
constexpr int kSmemBytes = kLutOffset + kBN * 8 + 1024;     // + alignment slack
constexpr int kOutPitch = kBN + 8;           // bf16 per staged output row (conflict-free)
constexpr int kGroupM = 8;
static_assert(kBM * kOutPitch * 2 <= kStages * kXStage, "output staging must fit");

template <typename OutT>
__global__ void __launch_bounds__(kThreads, 1) w4a8_wgmma_kernel(const W4A8Args args) {
#if defined(__CUDA_ARCH__) && defined(MILA_HAS_SM90A)
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
  // Weight rows (packed and exponents) past N are zero-filled: they convert to zeros.
  constexpr int kXCopies = kXStage / 16 / kThreads;
  constexpr int kWCopies = kWStage / 16 / kThreads;
  // Few long-lived registers here: the partial sums, the master sums and the A fragments take
  // 208 of the 255, so the copy addresses are rebuilt from the kernel arguments every tile.
  // Last valid row of the activation tile: rows past M (last M tile only) re-read it.
  const int x_last = static_cast<int>(min(M - m0, static_cast<int64_t>(kBM))) - 1;
  auto load_stage = [&](int stage, int kt) {
    // The thread index read again here (volatile) keeps the compiler from hoisting per-thread
    // addresses out of the K loop into registers that would stay live across the wgmma.
    const int tid = ptx::w4a8::thread_index();
    const int x_row0 = tid / 8, x_chunk = tid % 8;
    const uint32_t sx =
        smem_base + stage * kXStage + x_row0 * kBK + ((x_chunk ^ (x_row0 & 7)) * 16);
    const uint8_t* xsrc = args.x + m0 * K + kt * kBK + x_chunk * 16;
#pragma unroll
    for (int i = 0; i < kXCopies; ++i) {
      const int row = min(x_row0 + 32 * i, x_last);
      ptx::cp_async_16(sx + i * 32 * kBK, xsrc + static_cast<int64_t>(row) * K);
    }
#pragma unroll
    for (int i = 0; i < kWCopies; ++i) {
      const int c = tid + i * kThreads, row = c / 4, chunk = c % 4;
      const bool valid = n0 + row < N;
      const uint8_t* src = args.packed + (valid ? static_cast<int64_t>(n0 + row) * (K / 2) : 0) +
                           kt * kPackedTile + chunk * 16;
      ptx::cp_async_16(smem_base + kWOffset + stage * kWStage + c * 16, src, valid);
    }
    if (tid < kBN) {
      const bool valid = n0 + tid < N;
      const uint8_t* src =
          args.scales + (valid ? static_cast<int64_t>(n0 + tid) * (K / 32) : 0) + kt * kKBlocks;
      ptx::w4a8::cp_async_4(smem_base + kEOffset + stage * kEStage + tid * kKBlocks, src, valid);
    }
  };

  // This thread's weight rows: A-fragment rows g and g + 8 of its warp's 16 (tile-local). The
  // table constants of the tile's rows live in shared memory (written before the first barrier).
  const int wrow0 = wgi * 64 + wwarp * 16 + g;
  RowLut* s_lut = reinterpret_cast<RowLut*>(smem + kLutOffset);
  if (tid < kBN) s_lut[tid] = row_lut(n0 + tid < N ? args.channel_exp[n0 + tid] : 0u);
  // A fragment of block kb: {row g k 4q.., row g+8 k 4q.., row g k 16+4q.., row g+8 k 16+4q..},
  // from the stage's packed words (row-major, 64 bytes a row: a warp reads 512 contiguous bytes).
  auto convert = [&](int stage, uint32_t (&a)[kKBlocks][4]) {
    const uint8_t* sw = smem + kWOffset + stage * kWStage;
    const uint8_t* se = smem + kEOffset + stage * kEStage;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = wrow0 + 8 * h;
      const uint4 v = *reinterpret_cast<const uint4*>(sw + row * kPackedTile + q * 16);
      const uint32_t exps = *reinterpret_cast<const uint32_t*>(se + row * kKBlocks);
      const RowLut lut = s_lut[row];
#pragma unroll
      for (int kb = 0; kb < kKBlocks; ++kb) {
        const uint32_t word = kb == 0 ? v.x : kb == 1 ? v.y : kb == 2 ? v.z : v.w;
        word_to_e4m3(word, (exps >> (8 * kb)) & 0xFFu, lut, a[kb][h], a[kb][2 + h]);
      }
    }
  };

  // acc: the fp32 master sums, in m64n256 layout (acc[64 h + i] = half h's temp[i]).
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;

#pragma unroll
  for (int s = 0; s < kPrefetch; ++s) {
    if (s < kt_count) load_stage(s, s);
    ptx::cp_async_commit();
  }
  uint32_t a[kKBlocks][4];
  ptx::cp_async_wait<kPrefetch - 2>();
  __syncthreads();  // tiles 0 and 1 and the table constants visible
  convert(0, a);

  // One K tile for one activation half: 4 chained wgmma into a fresh partial sum, committed.
  // The partial sum is left undefined on purpose (the first wgmma has scale-d = 0 and never reads
  // it), so its 64 registers are dead between promotions and free for the conversion and copies.
  auto issue_half = [&](float (&part)[64], uint32_t sx_half) {
    ptx::sm90::wgmma_fence();  // orders the register accesses before it (adds, conversion)
    ptx::w4a8::wgmma_m64n128k32_e4m3_rs<false>(part, a[0], ptx::sm90::desc_k128b(sx_half));
#pragma unroll
    for (int kb = 1; kb < kKBlocks; ++kb)
      ptx::w4a8::wgmma_m64n128k32_e4m3_rs<true>(part, a[kb],
                                                ptx::sm90::desc_k128b(sx_half + kb * 32));
    ptx::sm90::wgmma_commit();
  };
  auto promote = [&](float (&part)[64], int h) {
    ptx::sm90::wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 64; ++i) ptx::sm90::fence_operand(part[i]);
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[64 * h + i] += part[i];
  };

  // Per step, each warpgroup keeps at most one wgmma batch in flight (one partial sum fits), so
  // the tensor cores stay busy only if the two warpgroups alternate: while one waits, adds,
  // converts or copies, the other's batch runs. Hence no barrier between the end of one step and
  // the first batch of the next: the step's one barrier sits where the warpgroup waits anyway,
  // behind its second batch.
  for (int kt = 0; kt < kt_count; ++kt) {
    const uint32_t sx = smem_base + (kt % kStages) * kXStage;  // visible: barrier of step kt - 1
    {
      float part[64];
      issue_half(part, sx);
      promote(part, 0);
    }
    {
      float part[64];
      issue_half(part, sx + kXHalf);
      // Tile kt + 1 (the next step's batches and the conversion below) becomes visible. Every
      // warpgroup here has finished step kt - 1 (retired its batches of tile kt - 1, converted
      // tile kt), so the stage of tile kt - 1 may be refilled below.
      ptx::cp_async_wait<kPrefetch - 2>();
      ptx::sm90::fence_proxy_async_shared();
      __syncthreads();
      promote(part, 1);
    }
    // Both batches retired: the A registers are free for the next tile.
#pragma unroll
    for (int kb = 0; kb < kKBlocks; ++kb)
#pragma unroll
      for (int e = 0; e < 4; ++e) ptx::sm90::fence_operand(a[kb][e]);
    if (kt + 1 < kt_count) convert((kt + 1) % kStages, a);
    {
      // Refill the stage of tile kt - 1. Here rather than while a batch runs: the partial sum's
      // registers are dead now, and the copies' addresses need some.
      const int next = kt + kPrefetch;
      if (next < kt_count) load_stage(next % kStages, next);
      ptx::cp_async_commit();
    }
  }
  ptx::cp_async_wait<0>();
  __syncthreads();  // every warpgroup is done reading the stages: reuse them for the output

  // Epilogue: acc[4j + e] = y^T[weight row g (+8 if e >= 2)][activation row 8j + 2q (+1 if e
  // odd)] of this warp's 16 rows.
  const int col0 = wgi * 64 + wwarp * 16 + g;  // tile-local weight column (+8)
  const float ws0 = channel_scale(args.channel_exp, n0 + col0, N);
  const float ws1 = channel_scale(args.channel_exp, n0 + col0 + 8, N);
  if constexpr (std::is_same_v<OutT, float>) {
    store_f32_tile<kBM>(acc, static_cast<float*>(args.out), args.x_scale, m0, M, n0, col0, N,
                        ws0, ws1, q);
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
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // An sm_90 image without the sm_90a features (e.g. PTX JIT-compiled for a Hopper GPU): fail
  // loudly rather than return an unwritten output.
  __trap();
#endif  // older archs compile an empty kernel that the launcher never starts
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

// Hopper's kAuto: the 2-CTA multicast instance (kWgmmaWsCluster). End to end it took 1.7-1.9% off
// the 12B prefill's GEMM time at 32K and 64K (M = 4096 chunks, both run orders); at M = 16384
// it is -0.3% to +9.5% per shape (docs/performance.md, seventeenth round): the GEMMs run at the
// board's power limit, where reading 24 instead of 40 KiB of L2 per K tile is energy saved.
// Developer knob, read once per process: JAX_MILA_W4A8_CLUSTER=1 makes kAuto run the
// single-CTA kWgmmaWs (jax_mila.ffi.w4a8.auto_kernel reads the same variable).
W4A8Variant HopperAutoVariant() {
  static const W4A8Variant v = [] {
    const char* env = std::getenv("JAX_MILA_W4A8_CLUSTER");
    return env != nullptr && std::strcmp(env, "1") == 0 ? W4A8Variant::kWgmmaWs
                                                        : W4A8Variant::kWgmmaWsCluster;
  }();
  return v;
}

#ifdef MILA_BUILD_HAS_SM90A
constexpr bool kBuildHasSm90a = true;
#else
constexpr bool kBuildHasSm90a = false;
#endif

}  // namespace

// Hopper runs FP8 mma.sync at the fp16 rate; its native FP8 path is wgmma, fastest in the
// warp-specialized kernel on 2-CTA clusters (docs/performance.md), where the build has its sm_90a
// code; kAutoExpanded: on the weights expanded to e4m3 first (from 4096 activation rows up, +3%
// to +13% per GEMM; docs/performance.md, twenty-eighth round).
W4A8Variant ResolveW4A8Variant(W4A8Variant variant, int cc) {
  if (variant != W4A8Variant::kAuto && variant != W4A8Variant::kAutoExpanded) return variant;
  if (cc != 90 || !kBuildHasSm90a) return W4A8Variant::kMmaSync;
  const W4A8Variant v = HopperAutoVariant();
  if (variant == W4A8Variant::kAuto) return v;
  return v == W4A8Variant::kWgmmaWsCluster ? W4A8Variant::kWgmmaWsE4m3Cluster
                                           : W4A8Variant::kWgmmaWsE4m3;
}

const char* W4A8CodeProblem(W4A8Variant variant, int cc, int* compiled_for) {
  *compiled_for = 0;
  variant = ResolveW4A8Variant(variant, cc);
  if (variant != W4A8Variant::kMmaSync) {  // the device's 9.0 is the handler's own check
    return kBuildHasSm90a ? nullptr : "the wgmma kernels need sm_90a code, which this build lacks";
  }
  // Asked once per device (the answer depends on the build and the GPU); -1: no code for it.
  static std::atomic<int> ptx_version[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) {
    cudaGetLastError();
    return "cannot tell which device runs the call";
  }
  int version = ptx_version[device].load(std::memory_order_relaxed);
  if (version == 0) {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, mma::w4a8_mma_kernel<float>) == cudaSuccess) {
      version = attr.ptxVersion;
    } else {
      cudaGetLastError();  // not sticky: keep it out of the handler's launch check
      version = -1;
    }
    ptx_version[device].store(version, std::memory_order_relaxed);
  }
  if (version < 0) return "this build has no code for this device";
  *compiled_for = version;
  return version >= kW4A8MinComputeCapability
             ? nullptr
             : "FP8 mma.sync needs code compiled for compute_89 or newer";
}

cudaError_t LaunchW4A8Matmul(const W4A8Args& args, W4A8Variant variant, int cc,
                             cudaStream_t stream) {
  if (cc < kW4A8MinComputeCapability) return cudaErrorNoKernelImageForDevice;
  variant = ResolveW4A8Variant(variant, cc);
  if (variant >= W4A8Variant::kWgmmaWs) {
    if (cc != 90) return cudaErrorNoKernelImageForDevice;
    const bool e4m3 = variant == W4A8Variant::kWgmmaWsE4m3 ||
                      variant == W4A8Variant::kWgmmaWsE4m3Cluster;
    const bool cluster = variant == W4A8Variant::kWgmmaWsCluster ||
                         variant == W4A8Variant::kWgmmaWsE4m3Cluster;
    return LaunchW4A8WgmmaWs(args, variant != W4A8Variant::kWgmmaWsDp, cluster ? 2 : 1, e4m3,
                             stream);
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
