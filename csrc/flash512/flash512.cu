// FlashAttention prefill for head dim 512 (Gemma 4 global layers), the portable mma.sync path
// (sm_80 / sm_89 / sm_90a) and the oracle of the Hopper kernels (flash512_sm90/).
//
// Geometry. At D=512 a row-split (FA-2) kernel would hold a 16x512 fp32 output tile per warp
// (256 registers a thread for O alone), so the head dimension is split across warps instead.
// One block of 8 warps (256 threads) owns an M tile of 64 packed rows and sweeps the keys in
// tiles of BN (64 where a block may have 227 KB of shared memory, 32 on the A100's 163 KB):
//   * Rows are packed query heads x positions: packed row r = t * G + g for the G query heads
//     of one KV head, so a 16:1 layer reads each K/V tile once for all 16 heads (64 rows =
//     4 positions x 16 heads), not 16 times.
//   * Q (64 x 512 bf16, 64 KB) stays in shared memory for the whole sweep; K and V tiles
//     (BN x 512) have one buffer each: V_j is copied (cp.async) while S_j is computed, K_{j+1}
//     while P_j V_j is.
//   * PV: warp w owns the output columns [64w, 64w+64) of all 64 rows: 64x64 fp32 = 128
//     accumulator registers a thread; every warp reads the full P tile (bf16, through shared
//     memory) and its own 64 V columns.
//   * S = Q K^T: warps form a 2 (rows) x 2 (keys) x 2 (D halves) grid: warp (wm, wn, ks)
//     computes the 32 x BN/2 block of rows 32wm.., keys (BN/2)wn.. over D[256ks, 256ks+256).
//     The two D halves are reduced through shared memory in halves: each warp of a pair sends
//     the 16 rows the other one owns, so after the exchange every warp holds 16 rows x BN/2
//     keys of the full S and all 8 warps run the softmax. A row spans two warps (wn = 0, 1):
//     their partial row maxima meet through shared memory behind a two-warp named barrier.
//   Why this split (shared-memory bytes read per 64x64 key tile, ldmatrix only):
//     - split keys only (warp w: S[:, 8w:8w+8] over all D): every warp reads all of Q,
//       8 x 64 KB + 64 KB = 576 KB;
//     - 2 (rows) x 4 (keys), full D: 8 x (32 KB Q + 16 KB K) = 384 KB;
//     - split D only (warp w: all of S over D[64w..]): 128 KB of Q and K, but a 64x64 fp32
//       partial per warp (128 more registers, on top of O's 128) and an 8-way reduction of
//       128 KB through shared memory;
//     - 2 x 2 x 2 (this kernel): 8 x (16 KB Q + 16 KB K) = 256 KB + a 2-way reduction of
//       16 KB written and read, 32 fp32 S registers a thread.
//   P V reads 64 KB of P and 64 KB of V per tile in every variant, and the cp.async copies
//   write 128 KB; shared memory bandwidth (128 B/clk/SM) is the limit of a mma.sync kernel at
//   this head dim, so the S phase takes the cheapest split.
// Shared memory rows are padded by 16 bytes (1040 B for 512 bf16, 144 B for a P row) so that
// ldmatrix's eight 16-byte row reads and the fragment stores fall in distinct banks.
//
// Masking and scheduling: a block's key tiles come from the device-side offsets
// (common/key_tiles.cuh; never read on the host); tiles outside them are skipped, only tiles
// that cross the causal diagonal, the window's far edge or their segment's end are masked
// element-wise. Rows without a visible key end with l = 0 and write o = 0, lse = -inf.
// blockIdx.x is reversed so that, in a causal sweep, the M tiles with the most key tiles
// start first and the short ones fill the tail. Memory is O(1) beyond the operands.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/attention_params.h"
#include "common/key_tiles.cuh"
#include "common/ptx.cuh"

namespace mila {
namespace {

namespace px = ::mila::ptx;

constexpr int kD = 512;
constexpr int kBlockM = 64;
constexpr int kThreads = 256;
constexpr int kRowBytes = kD * 2 + 16;  // padded smem row of Q, K, V (1040 B)
constexpr int kChunksPerRow = kD / 8;   // 16-byte chunks in a row of 512 bf16
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <int BN>
struct Flash512Config {
  static_assert(BN == 32 || BN == 64, "key tile of 32 or 64");
  static constexpr int kWarpKeys = BN / 2;    // keys of one warp in the S phase
  static constexpr int kNT = kWarpKeys / 8;   // its 8-wide n-tiles
  static constexpr int kPRowBytes = BN * 2 + 16;
  static constexpr int kOffQ = 0;
  static constexpr int kOffK = kOffQ + kBlockM * kRowBytes;
  static constexpr int kOffV = kOffK + BN * kRowBytes;
  static constexpr int kOffP = kOffV + BN * kRowBytes;
  static constexpr int kOffRed = kOffP + kBlockM * kPRowBytes;  // float4 [4 pairs][2][kNT][32]
  static constexpr int kOffMax = kOffRed + 4 * 2 * kNT * 32 * 16;  // float [2][64]
  static constexpr int kOffAlpha = kOffMax + 2 * kBlockM * 4;      // float [64]
  static constexpr int kOffL = kOffAlpha + kBlockM * 4;            // float [2][64]
  static constexpr int kOffM = kOffL + 2 * kBlockM * 4;            // float [64]
  static constexpr int kOffInv = kOffM + kBlockM * 4;              // float [64]
  static constexpr int kSmemBytes = kOffInv + kBlockM * 4;
};

__device__ __forceinline__ float NegInf() { return __int_as_float(0xff800000); }

// BN rows of K or V (keys n0..n0+BN) into a padded smem tile; keys >= s are zeros.
// `thread_src` is this thread's first element (row tid / 64, chunk tid % 64 of key 0);
// `base` (key 0, chunk 0) stands in as the never-read source of a zero-filled chunk.
template <int BN>
__device__ __forceinline__ void LoadKvTile(uint32_t dst, const __nv_bfloat16* base,
                                           const __nv_bfloat16* thread_src, int key_stride,
                                           int n0, int s, int tid) {
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;  // 4
  const int row0 = tid / kChunksPerRow, ch = tid % kChunksPerRow;
#pragma unroll
  for (int i = 0; i < BN / kRowsPerPass; ++i) {
    const bool valid = row0 + i * kRowsPerPass < s - n0;  // key < s, with no key past int32
    const __nv_bfloat16* src =
        valid ? thread_src + static_cast<size_t>(n0 + i * kRowsPerPass) * key_stride : base;
    px::cp_async_16(dst + (row0 + i * kRowsPerPass) * kRowBytes + ch * 16, src, valid);
  }
}

// kSUnroll / kPvUnroll: unroll factors of the S (16 steps) and PV (BN/16 steps) loops;
// at 255 registers they decide how far ptxas may hoist ldmatrix ahead of the MMAs.
//
// K and V reach shared memory through whole-tile copies by all 256 threads: V_j is issued at
// the top of tile j and must land before P_j V_j; K_{j+1} is issued after the S reduction.
template <int BN, int kSUnroll, int kPvUnroll>
__global__ void __launch_bounds__(kThreads, 1)
    Flash512Kernel(const AttentionParams p, const int num_m_blocks) {
  using C = Flash512Config<BN>;
  constexpr int kNT = C::kNT;
  constexpr int kWarpKeys = C::kWarpKeys;
  extern __shared__ __align__(128) unsigned char smem[];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int ks = warp & 1, wn = (warp >> 1) & 1, wm = warp >> 2;  // S-phase warp grid

  const int m_block = num_m_blocks - 1 - static_cast<int>(blockIdx.x);  // longest first
  const int h = blockIdx.y, b = blockIdx.z;
  const int G = p.hq / p.hkv;
  // Packed rows fit in int32: the FFI handler rejects T * Hq / Hkv > INT32_MAX.
  // Positions (offset + index) do not: they are formed in int64 only.
  const int rows_total = p.t * G;
  const int m0 = m_block * kBlockM;
  const int q_off = *p.q_offset;

  // Keys any row of this block can see: tiles of each key segment (common/key_tiles.cuh).
  const int t_min = m0 / G;
  const int t_max = min(p.t - 1, (m0 + kBlockM - 1) / G);
  const int64_t qpos_min = static_cast<int64_t>(q_off) + t_min;
  const int64_t qpos_max = static_cast<int64_t>(q_off) + t_max;
  KeyTileCursor<BN> tile(p, qpos_min, qpos_max);
  const bool any_tile = tile.valid();

  const uint32_t sQ = px::smem_addr(smem + C::kOffQ);
  const uint32_t sK = px::smem_addr(smem + C::kOffK);
  const uint32_t sV = px::smem_addr(smem + C::kOffV);
  const uint32_t sP = px::smem_addr(smem + C::kOffP);
  float4* red = reinterpret_cast<float4*>(smem + C::kOffRed) + (warp >> 1) * (2 * kNT * 32);
  float* s_max = reinterpret_cast<float*>(smem + C::kOffMax);
  float* s_alpha = reinterpret_cast<float*>(smem + C::kOffAlpha);
  float* s_l = reinterpret_cast<float*>(smem + C::kOffL);
  float* s_m = reinterpret_cast<float*>(smem + C::kOffM);
  float* s_inv = reinterpret_cast<float*>(smem + C::kOffInv);

  const int key_stride = p.hkv * kD;
  const size_t kv_head = (static_cast<size_t>(b) * p.s * p.hkv + h) * kD;
  const __nv_bfloat16* k_base = p.k + kv_head;
  const __nv_bfloat16* v_base = p.v + kv_head;
  const size_t thread_off =
      static_cast<size_t>(tid / kChunksPerRow) * key_stride + (tid % kChunksPerRow) * 8;
  const __nv_bfloat16* k_thread = k_base + thread_off;
  const __nv_bfloat16* v_thread = v_base + thread_off;

  // The two softmax rows of this thread (after the S reduction): rows sr[0], sr[1], at
  // query positions q_off + tq[r] (formed in int64 where used).
  int sr[2], tq[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    sr[r] = 16 * (2 * wm + ks) + g + 8 * r;
    const int pr = m0 + sr[r];
    tq[r] = pr < rows_total ? pr / G : p.t - 1;
  }

  float o[4][8][4];
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][nt][e] = 0.f;
  float m_run[2] = {NegInf(), NegInf()};
  float l_run[2] = {0.f, 0.f};
  const float scale_log2 = p.scale * kLog2e;

  if (any_tile) {
    // Q tile: 64 packed rows (position t, head h*G + gq), zeros past the last row.
#pragma unroll 4
    for (int i = 0; i < kBlockM * kChunksPerRow / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int row = c / kChunksPerRow, ch = c % kChunksPerRow;
      const int pr = m0 + row;
      const bool valid = pr < rows_total;
      const int tq = valid ? pr / G : 0;
      const int gq = valid ? pr % G : 0;
      const __nv_bfloat16* src =
          p.q + ((static_cast<size_t>(b) * p.t + tq) * p.hq + h * G + gq) * kD + ch * 8;
      px::cp_async_16(sQ + row * kRowBytes + ch * 16, src, valid);
    }
    LoadKvTile<BN>(sK, k_base, k_thread, key_stride, tile.n0(), p.s, tid);
  }
  px::cp_async_commit();

  // Per-lane ldmatrix addresses (byte offsets added per step are compile-time).
  const uint32_t a_addr = sQ + (32 * wm + (lane & 15)) * kRowBytes + (ks * 32 + (lane >> 4)) * 16;
  const uint32_t b_addr = sK + (kWarpKeys * wn + (lane & 7) + ((lane >> 4) << 3)) * kRowBytes +
                          (ks * 32 + ((lane >> 3) & 1)) * 16;
  const uint32_t pa_addr = sP + (lane & 15) * C::kPRowBytes + (lane >> 4) * 16;
  const uint32_t vb_addr = sV + ((lane & 7) + ((lane >> 3) & 1) * 8) * kRowBytes +
                           (8 * warp + (lane >> 4)) * 16;

  while (tile.valid()) {
    const int n0 = tile.n0();
    const int64_t kpos0 = tile.kpos0();  // position of key n0
    const int keys_left = tile.keys_left();
    tile.Advance();  // from here on, `tile` is the next tile (valid() if there is one)
    px::cp_async_wait<0>();
    __syncthreads();  // K_j (and Q) landed; every warp is done with V_{j-1} and P_{j-1}
    LoadKvTile<BN>(sV, v_base, v_thread, key_stride, n0, p.s, tid);
    px::cp_async_commit();

    // ---- S partial: rows 32wm.., keys kWarpKeys*wn.., D half ks.
    float acc[2][kNT][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int n = 0; n < kNT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][n][e] = 0.f;
#pragma unroll kSUnroll
    for (int kk = 0; kk < 16; ++kk) {
      uint32_t a[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) px::ldmatrix_x4(a[mt], a_addr + mt * 16 * kRowBytes + kk * 32);
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t bb[4];
        px::ldmatrix_x4(bb, b_addr + np * 16 * kRowBytes + kk * 32);
        const uint32_t b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          px::mma_bf16_16816(acc[mt][2 * np], a[mt], b0);
          px::mma_bf16_16816(acc[mt][2 * np + 1], a[mt], b1);
        }
      }
    }

    // ---- Reduce the D halves: warp ks keeps m-tile ks, sends m-tile 1-ks to its partner.
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
      float4 send;
      send.x = ks ? acc[0][n][0] : acc[1][n][0];
      send.y = ks ? acc[0][n][1] : acc[1][n][1];
      send.z = ks ? acc[0][n][2] : acc[1][n][2];
      send.w = ks ? acc[0][n][3] : acc[1][n][3];
      red[((1 - ks) * kNT + n) * 32 + lane] = send;
    }
    __syncthreads();  // partials visible; every warp is done reading K_j
    if (tile.valid()) LoadKvTile<BN>(sK, k_base, k_thread, key_stride, tile.n0(), p.s, tid);
    px::cp_async_commit();  // possibly empty: keeps the wait_group arithmetic uniform

    float s[kNT][4];
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
      const float4 recv = red[(ks * kNT + n) * 32 + lane];
      s[n][0] = (ks ? acc[1][n][0] : acc[0][n][0]) + recv.x;
      s[n][1] = (ks ? acc[1][n][1] : acc[0][n][1]) + recv.y;
      s[n][2] = (ks ? acc[1][n][2] : acc[0][n][2]) + recv.z;
      s[n][3] = (ks ? acc[1][n][3] : acc[0][n][3]) + recv.w;
    }

    // ---- Online softmax on rows sr[0], sr[1], keys n0 + kWarpKeys*wn + 8n + 2t4 + {0,1}.
    const bool need_mask = (keys_left < BN) || (p.causal && kpos0 + BN - 1 > qpos_min) ||
                           (p.window > 0 && kpos0 + p.window <= qpos_max);
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] *= scale_log2;
    if (need_mask) {
#pragma unroll
      for (int n = 0; n < kNT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int kofs = kWarpKeys * wn + 8 * n + 2 * t4 + (e & 1);  // key - n0
          // delta = q_pos - k_pos; visible iff the key is in the tile's segment (and < s),
          // delta >= 0 (causal), delta < window.
          const int64_t delta = static_cast<int64_t>(q_off) + tq[e >> 1] - kpos0 - kofs;
          const bool visible = kofs < keys_left && (!p.causal || delta >= 0) &&
                               (p.window <= 0 || delta < p.window);
          if (!visible) s[n][e] = NegInf();
        }
    }
    float mx[2] = {NegInf(), NegInf()};
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
      mx[0] = fmaxf(mx[0], fmaxf(s[n][0], s[n][1]));
      mx[1] = fmaxf(mx[1], fmaxf(s[n][2], s[n][3]));
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
    if (t4 == 0) {
      s_max[wn * kBlockM + sr[0]] = mx[0];
      s_max[wn * kBlockM + sr[1]] = mx[1];
    }
    // The two warps (wn = 0, 1) that share these 16 rows.
    px::named_barrier_sync(1 + 2 * wm + ks, 64);
    float base[2], alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(m_run[r], fmaxf(mx[r], s_max[(1 - wn) * kBlockM + sr[r]]));
      base[r] = m_new == NegInf() ? 0.f : m_new;  // all masked so far: exp2(-inf) = 0
      alpha[r] = px::exp2_approx(m_run[r] - base[r]);
      m_run[r] = m_new;
    }
    float rowsum[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = px::exp2_approx(s[n][e] - base[e >> 1]);
        rowsum[e >> 1] += s[n][e];
      }
      const uint32_t col_bytes = (kWarpKeys * wn + 8 * n + 2 * t4) * 2;
      *reinterpret_cast<uint32_t*>(smem + C::kOffP + sr[0] * C::kPRowBytes + col_bytes) =
          px::pack_bf16x2(s[n][0], s[n][1]);
      *reinterpret_cast<uint32_t*>(smem + C::kOffP + sr[1] * C::kPRowBytes + col_bytes) =
          px::pack_bf16x2(s[n][2], s[n][3]);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + rowsum[r];
    if (wn == 0 && t4 == 0) {
      s_alpha[sr[0]] = alpha[0];
      s_alpha[sr[1]] = alpha[1];
    }
    px::cp_async_wait<1>();  // V_j landed (K_{j+1} may still fly)
    // P_j, alpha_j and V_j visible to every warp; and whether any row's max moved (once the
    // running maxima settle, usually none has: the O rescale is skipped).
    const int any_rescale = __syncthreads_or(alpha[0] != 1.f || alpha[1] != 1.f);

    // ---- O[:, 64w:64w+64] = alpha * O + P V.
    if (any_rescale) {
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        const float a0 = s_alpha[mt * 16 + g], a1 = s_alpha[mt * 16 + g + 8];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          o[mt][nt][0] *= a0;
          o[mt][nt][1] *= a0;
          o[mt][nt][2] *= a1;
          o[mt][nt][3] *= a1;
        }
      }
    }
#pragma unroll kPvUnroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t pa[4][4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
        px::ldmatrix_x4(pa[mt], pa_addr + mt * 16 * C::kPRowBytes + kk * 32);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t vb[4];
        px::ldmatrix_x4_trans(vb, vb_addr + kk * 16 * kRowBytes + np * 32);
        const uint32_t b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          px::mma_bf16_16816(o[mt][2 * np], pa[mt], b0);
          px::mma_bf16_16816(o[mt][2 * np + 1], pa[mt], b1);
        }
      }
    }
  }
  px::cp_async_wait<0>();

  // ---- Epilogue: row sums over the quad and the two key halves, lse, 1/l.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
  if (t4 == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      s_l[wn * kBlockM + sr[r]] = l_run[r];
      if (wn == 0) s_m[sr[r]] = m_run[r];
    }
  }
  __syncthreads();
  if (tid < kBlockM) {
    const float l = s_l[tid] + s_l[kBlockM + tid];
    s_inv[tid] = l > 0.f ? 1.f / l : 0.f;
    const int pr = m0 + tid;
    if (pr < rows_total && p.lse != nullptr) {
      const int tq = pr / G, gq = pr % G;
      p.lse[(static_cast<size_t>(b) * p.hq + h * G + gq) * p.t + tq] =
          l > 0.f ? (s_m[tid] + log2f(l)) * kLn2 : NegInf();
    }
  }
  __syncthreads();
  // O / l in bf16, staged in the (dead) Q tile for 16-byte coalesced stores.
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
    const int r0 = mt * 16 + g;
    const float i0 = s_inv[r0], i1 = s_inv[r0 + 8];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int col_bytes = (64 * warp + 8 * nt + 2 * t4) * 2;
      *reinterpret_cast<uint32_t*>(smem + C::kOffQ + r0 * kRowBytes + col_bytes) =
          px::pack_bf16x2(o[mt][nt][0] * i0, o[mt][nt][1] * i0);
      *reinterpret_cast<uint32_t*>(smem + C::kOffQ + (r0 + 8) * kRowBytes + col_bytes) =
          px::pack_bf16x2(o[mt][nt][2] * i1, o[mt][nt][3] * i1);
    }
  }
  __syncthreads();
#pragma unroll 4
  for (int i = 0; i < kBlockM * kChunksPerRow / kThreads; ++i) {
    const int c = tid + i * kThreads;
    const int row = c / kChunksPerRow, ch = c % kChunksPerRow;
    const int pr = m0 + row;
    if (pr < rows_total) {
      const int tq = pr / G, gq = pr % G;
      const uint4 val = *reinterpret_cast<const uint4*>(smem + C::kOffQ + row * kRowBytes + ch * 16);
      *reinterpret_cast<uint4*>(p.o + ((static_cast<size_t>(b) * p.t + tq) * p.hq + h * G + gq) * kD +
                                ch * 8) = val;
    }
  }
}

template <int BN, int kSUnroll, int kPvUnroll>
cudaError_t LaunchWithKeyTile(const AttentionParams& p, cudaStream_t stream) {
  constexpr int kSmem = Flash512Config<BN>::kSmemBytes;
  cudaError_t err = cudaFuncSetAttribute(Flash512Kernel<BN, kSUnroll, kPvUnroll>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  const int64_t rows = static_cast<int64_t>(p.t) * (p.hq / p.hkv);
  const int64_t num_m_blocks = (rows + kBlockM - 1) / kBlockM;
  if (num_m_blocks > INT32_MAX) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(num_m_blocks), static_cast<unsigned>(p.hkv),
                  static_cast<unsigned>(p.batch));
  Flash512Kernel<BN, kSUnroll, kPvUnroll>
      <<<grid, kThreads, kSmem, stream>>>(p, static_cast<int>(num_m_blocks));
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchFlashAttentionD512(const AttentionParams& p, cudaStream_t stream) {
  int device = 0, max_smem = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  err = cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  // Hopper (227 KB): key tile 64. A100 (163 KB): key tile 32. Parts with ~99 KB per
  // block (sm_86 / sm_89) cannot hold the resident 64 KB Q tile plus K and V tiles.
  if (max_smem >= Flash512Config<64>::kSmemBytes) {
    // S loop fully unrolled, PV loop rolled: 254 registers, no spills.
    return LaunchWithKeyTile<64, 16, 1>(p, stream);
  }
  if (max_smem >= Flash512Config<32>::kSmemBytes) return LaunchWithKeyTile<32, 16, 2>(p, stream);
  return cudaErrorInvalidConfiguration;
}

}  // namespace mila
