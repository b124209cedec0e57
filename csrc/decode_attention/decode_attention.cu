// Decode attention (flash-decoding): 1-16 new queries per row against the KV cache, head dims
// 512 (global layers, the whole cache) and 256 (sliding layers, a ring read in place).
//
// Split kernel: one CTA per (piece of a row's keys, rows block, KV head, row). Its rows are the
// T * G queries of one KV head (new token t, query head g of the group: row t * G + g), so each
// K/V byte is read once for all of them. A row's visible positions [lo, hi) (lo from the window
// and the ring, hi = kv_len) are cut into `pieces` equal runs of whole 16- or 32-key tiles;
// each CTA streams its run through cp.async stages and writes an unnormalized partial output
// with its running max and sum (log2 units). Empty pieces write m = -inf, l = 0, o = 0.
// Combine kernel: per (query row, KV head, batch row), a fixed-order pass over the pieces
// (bitwise repeatable): o = sum_p 2^(m_p - m) o_p / sum_p 2^(m_p - m) l_p, zeros when l = 0.
//
// Geometry (8 warps): warp w owns the head-dim columns [w D/8, (w+1) D/8). Per key tile,
// (1) each warp multiplies its Q columns (register-resident A fragments) by its K columns
// (mma.sync m16n8k16 bf16), a partial S for all rows and keys, into shared memory;
// (2) every thread sums the 8 partials of a few (row, key) entries in fixed order, scales,
// masks and runs the online softmax of its row (the row's 256 / rows threads share it), and
// writes P (bf16) and the row's rescale factor; (3) each warp rescales its O columns and adds
// P V over its columns. Shared K/V tiles are XOR-swizzled in 16-byte chunks (chunk ^ row % 8):
// cp.async, ldmatrix and the FP8 word loads below are bank-conflict free.
//
// FP8 cache (float8_e4m3fn): tiles stay e4m3 in shared memory (half the bytes of HBM and
// shared memory) and become bf16 in registers (ptx::e4m3x2_to_bf16x2, exact). ldmatrix has no
// 8-bit transpose below sm_100, so fragments are built from 32-bit words: QK^T reads 4
// consecutive head-dim bytes of a key (the k index of the mma permuted within each 16-column
// step, Q loaded with the same permutation); PV reads 4 consecutive columns of 4 keys and
// byte-permutes them into the B fragments of 4 n8 tiles (output column 4n + i of tile i).
//
// rotary_keys_only = r: the scores read K in columns [0, r) and [D/2, D/2 + r) and V elsewhere;
// only those K chunks are loaded (r = 64 at D = 512: 1.25 instead of 2 KiB a key in bf16).
//
// Why mma.sync and not Hopper wgmma/TMA: a decode step is memory bound. A key costs
// 2 D cache bytes (bf16 K and V) and 4 D flops per query row, so the intensity is 2 flop/byte
// per row: 32 flop/B at the usual T * G <= 16 rows (64 with an FP8 cache), while H100 moves
// 3.35 TB/s and mma.sync alone sustains ~600 TFLOP/s (ridge ~180 flop/B). Only T * G = 256
// (16 new tokens of a 16-query-head group) at an FP8 cache reaches the ridge; everything else
// waits on HBM, which cp.async with 2-4 stages and two CTAs per SM keep busy.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common/ptx.cuh"
#include "decode_attention/decode_attention.h"

namespace mila {
namespace {

using bf16 = __nv_bfloat16;

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;

template <int kD, bool kFp8, int kRowsPerCta>
struct Config {
  static constexpr int kEB = kFp8 ? 1 : 2;                   // bytes per cache element
  static constexpr int kSW = kD / kWarps;                    // head-dim columns per warp
  // Keys per tile: 16 KiB of K (8 KiB for D = 256 FP8), or 16 keys at 32 rows, whose partial
  // S buffers (8 warps x rows x keys floats) would not leave sm_89's 99 KiB room for two stages.
  static constexpr int kBN = ((kD == 512 && !kFp8) || kRowsPerCta == 32) ? 16 : 32;
  static constexpr int kRowBytes = kD * kEB;
  static constexpr int kCPR = kRowBytes / 16;                // 16-byte chunks per key row
  static constexpr int kTileBytes = kBN * kRowBytes;         // one of K, V
  static constexpr int kMB = kRowsPerCta;
  static constexpr int kMT = kMB / 16;                       // m16 tiles
  static constexpr int kSStride = kBN + 8;                   // floats; padded: no bank conflicts
  static constexpr int kPStride = kBN + 8;                   // bf16
  static constexpr int kTPR = kThreads / kMB;                // softmax threads per row
  static constexpr int kKPT = kBN / kTPR;                    // keys per softmax thread
  static constexpr int kKSteps = kSW / 16;
  static constexpr int kNTiles = kBN / 8;
  static constexpr int kOTiles = kSW / 8;
  // CTAs an SM should hold: two (<= 128 registers a thread), except D = 512 with 32 rows, whose
  // 2 x 64 fp32 O columns and 2 x 16 Q fragment registers a thread need more (one CTA of a
  // deeper pipeline instead).
  static constexpr int kMinBlocks = (kD == 512 && kMB == 32) ? 1 : 2;
  static constexpr size_t kScratchBytes = sizeof(float) * kWarps * kMB * kSStride +
                                          sizeof(bf16) * kMB * kPStride + sizeof(float) * kMB;
  static constexpr size_t SmemBytes(int stages) {
    return size_t(stages) * 2 * kTileBytes + kScratchBytes;
  }
  static_assert(kCPR >= 8 && (kCPR & (kCPR - 1)) == 0, "swizzle needs >= 8 chunks per row");
  static_assert(kTPR <= 32 && kKPT >= 1 && kTPR * kKPT == kBN, "softmax threads per row");
  static_assert(!kFp8 || kSW % 32 == 0, "FP8 PV reads 32-column groups");
};

// Whether head-dim column `col` (a 16-column step's first) reads K (else V) in the scores.
template <int kD>
__device__ __forceinline__ bool ReadsK(int col, int rotary) {
  return col < rotary || (col >= kD / 2 && col < kD / 2 + rotary);
}

template <int kD, bool kFp8, int kRowsPerCta>
__global__ void __launch_bounds__(kThreads, (Config<kD, kFp8, kRowsPerCta>::kMinBlocks))
    DecodeSplitKernel(const DecodeAttentionParams p, const int stages) {
  using C = Config<kD, kFp8, kRowsPerCta>;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t s_tiles = ptx::smem_addr(smem);
  float* sS = reinterpret_cast<float*>(smem + size_t(stages) * 2 * C::kTileBytes);
  bf16* sP = reinterpret_cast<bf16*>(sS + kWarps * C::kMB * C::kSStride);
  float* sAlpha = reinterpret_cast<float*>(sP + C::kMB * C::kPStride);
  const uint32_t sP_addr = ptx::smem_addr(sP);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int row_blocks = (p.rows + C::kMB - 1) / C::kMB;
  const int piece = blockIdx.x / row_blocks, row0 = (blockIdx.x % row_blocks) * C::kMB;
  const int hk = blockIdx.y, b = blockIdx.z;

  // ---- this CTA's keys: positions [key_lo, key_hi) ----
  const int n = p.kv_len[b];
  int64_t lo = 0, hi = p.ring ? int64_t(n) : (n < p.s ? int64_t(n) : int64_t(p.s));
  if (p.ring && int64_t(n) - p.s > lo) lo = int64_t(n) - p.s;
  if (p.window > 0 && int64_t(n) - p.t - p.window + 1 > lo) lo = int64_t(n) - p.t - p.window + 1;
  const int64_t len = hi > lo ? hi - lo : 0;
  const int64_t piece_len = ((len + p.pieces - 1) / p.pieces + C::kBN - 1) / C::kBN * C::kBN;
  const int64_t p_lo = lo + int64_t(piece) * piece_len;
  const int64_t p_hi = hi < p_lo + piece_len ? hi : p_lo + piece_len;
  const int n_tiles = p_hi > p_lo ? int((p_hi - p_lo + C::kBN - 1) / C::kBN) : 0;
  // Within int32 when there are tiles: 0 <= p_lo < p_hi <= kv_len.
  const int key_lo = n_tiles > 0 ? int(p_lo) : 0, key_hi = n_tiles > 0 ? int(p_hi) : 0;

  // ---- Q: this warp's columns of the CTA's rows, as mma A fragments, loaded once ----
  uint32_t qf[C::kMT][C::kKSteps][4];
#pragma unroll
  for (int mt = 0; mt < C::kMT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row0 + mt * 16 + g + 8 * half;
      const bool valid = r < p.rows;
      const int t = valid ? r / p.groups : 0, gi = valid ? r % p.groups : 0;
      const bf16* qr = p.q + ((int64_t(b) * p.t + t) * p.hq + int64_t(hk) * p.groups + gi) * kD +
                       warp * C::kSW;
#pragma unroll
      for (int ks = 0; ks < C::kKSteps; ++ks) {
        // bf16 cache: k index 2 t4 (+1) and 2 t4 + 8 (+1) of the step (ldmatrix's layout);
        // FP8 cache: columns 4 t4 .. 4 t4 + 3 (the word loads' permutation).
        const int c_lo = ks * 16 + (kFp8 ? 4 * t4 : 2 * t4), c_hi = c_lo + (kFp8 ? 2 : 8);
        qf[mt][ks][half] = valid ? *reinterpret_cast<const uint32_t*>(qr + c_lo) : 0u;
        qf[mt][ks][2 + half] = valid ? *reinterpret_cast<const uint32_t*>(qr + c_hi) : 0u;
      }
    }
  }

  // ---- K/V tiles: key row r of tile `it` is position key_lo + it * kBN + r ----
  const int64_t slot_stride = int64_t(p.hkv) * C::kRowBytes;
  const unsigned char* k_g =
      static_cast<const unsigned char*>(p.k) + int64_t(b) * p.s * slot_stride + hk * C::kRowBytes;
  const unsigned char* v_g =
      static_cast<const unsigned char*>(p.v) + int64_t(b) * p.s * slot_stride + hk * C::kRowBytes;
  auto load_tile = [&](int it, int stage) {
    const int pos0 = key_lo + it * C::kBN;
    const int valid_rows = key_hi - pos0;
    const int slot0 = p.ring ? pos0 % p.s : pos0;
    const uint32_t k_s = s_tiles + stage * 2 * C::kTileBytes, v_s = k_s + C::kTileBytes;
#pragma unroll
    for (int i = 0; i < C::kBN * C::kCPR / kThreads; ++i) {
      const int idx = tid + i * kThreads, r = idx / C::kCPR, c = idx % C::kCPR;
      const bool ok = r < valid_rows;
      int slot = slot0 + r;
      if (slot >= p.s) slot = slot - p.s < p.s ? slot - p.s : slot % p.s;  // ring only
      const int64_t off = int64_t(slot) * slot_stride + c * 16;
      const uint32_t dst = uint32_t(r * C::kRowBytes + ((c ^ (r & 7)) << 4));
      ptx::cp_async_16(v_s + dst, ok ? v_g + off : v_g, ok);
      if (ReadsK<kD>(c * (16 / C::kEB), p.rotary)) {  // K columns the scores read
        ptx::cp_async_16(k_s + dst, ok ? k_g + off : k_g, ok);
      }
    }
  };
  static_assert(C::kBN * C::kCPR % kThreads == 0, "whole chunks per thread");

#pragma unroll 1
  for (int st = 0; st < stages - 1; ++st) {
    if (st < n_tiles) load_tile(st, st);
    ptx::cp_async_commit();
  }

  float o[C::kMT][C::kOTiles][4];
#pragma unroll
  for (int mt = 0; mt < C::kMT; ++mt) {
#pragma unroll
    for (int j = 0; j < C::kOTiles; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.f;
  }
  // The softmax role: row prow of the block, keys pk .. pk + kKPT - 1 of each tile.
  const int prow = tid / C::kTPR, pk = (tid % C::kTPR) * C::kKPT;
  const bool prow_valid = row0 + prow < p.rows;
  const int q_pos = n - p.t + (prow_valid ? (row0 + prow) / p.groups : 0);
  const float scale_log2 = p.scale * kLog2e;
  float m_run = -INFINITY, l_run = 0.f;

  // ldmatrix lane addressing (flash256.cu): K rows for QK^T, V rows (transposed) for PV.
  const int k_r = (lane & 7) + ((lane >> 4) << 3), k_c = (lane >> 3) & 1;
  const int v_r = (lane & 7) + (((lane >> 3) & 1) << 3), v_c = lane >> 4;

#pragma unroll 1
  for (int it = 0; it < n_tiles; ++it) {
    switch (stages) {  // tile `it` has landed (this thread's copies)
      case 2: ptx::cp_async_wait<0>(); break;
      case 3: ptx::cp_async_wait<1>(); break;
      default: ptx::cp_async_wait<2>(); break;
    }
    __syncthreads();  // everyone's copies landed; everyone left tile it - 1 (its stage is free)
    if (it + stages - 1 < n_tiles) load_tile(it + stages - 1, (it + stages - 1) % stages);
    ptx::cp_async_commit();
    const uint32_t k_s = s_tiles + (it % stages) * 2 * C::kTileBytes, v_s = k_s + C::kTileBytes;

    // ---- (1) partial S over this warp's columns ----
    float s[C::kMT][C::kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < C::kMT; ++mt) {
#pragma unroll
      for (int j = 0; j < C::kNTiles; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
    }
#pragma unroll
    for (int ks = 0; ks < C::kKSteps; ++ks) {
      const int col = warp * C::kSW + ks * 16;
      const uint32_t src = ReadsK<kD>(col, p.rotary) ? k_s : v_s;  // warp-uniform
      if constexpr (!kFp8) {
#pragma unroll
        for (int np = 0; np < C::kNTiles / 2; ++np) {
          const int kr = np * 16 + k_r, chunk = col / 8 + k_c;
          uint32_t kb[4];
          ptx::ldmatrix_x4(kb, src + kr * C::kRowBytes + ((chunk ^ (kr & 7)) << 4));
          const uint32_t b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
#pragma unroll
          for (int mt = 0; mt < C::kMT; ++mt) {
            ptx::mma_bf16_16816(s[mt][2 * np], qf[mt][ks], b0);
            ptx::mma_bf16_16816(s[mt][2 * np + 1], qf[mt][ks], b1);
          }
        }
      } else {
#pragma unroll
        for (int nt = 0; nt < C::kNTiles; ++nt) {
          const int kr = nt * 8 + g, chunk = col / 16;
          const uint32_t w =
              ptx::ld_shared_u32(src + kr * C::kRowBytes + ((chunk ^ (kr & 7)) << 4) + 4 * t4);
          const uint32_t bf[2] = {ptx::e4m3x2_to_bf16x2(w), ptx::e4m3x2_to_bf16x2(w >> 16)};
#pragma unroll
          for (int mt = 0; mt < C::kMT; ++mt) ptx::mma_bf16_16816(s[mt][nt], qf[mt][ks], bf);
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < C::kMT; ++mt) {
#pragma unroll
      for (int j = 0; j < C::kNTiles; ++j) {
        float* dst = sS + (warp * C::kMB + mt * 16 + g) * C::kSStride + j * 8 + 2 * t4;
        *reinterpret_cast<float2*>(dst) = make_float2(s[mt][j][0], s[mt][j][1]);
        *reinterpret_cast<float2*>(dst + 8 * C::kSStride) = make_float2(s[mt][j][2], s[mt][j][3]);
      }
    }
    __syncthreads();

    // ---- (2) softmax: sum the warps' partials (fixed order), scale, mask, online update ----
    {
      const int pos0 = key_lo + it * C::kBN;
      float x[C::kKPT];
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < C::kKPT; ++j) {
        float acc = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) acc += sS[(w * C::kMB + prow) * C::kSStride + pk + j];
        const int kj = pk + j;          // key of the tile
        const int dist = q_pos - pos0 - kj;  // q_pos - k_pos: both within int32
        const bool visible = prow_valid && kj < key_hi - pos0 && dist >= 0 &&
                             (p.window == 0 || dist < p.window);
        x[j] = visible ? acc * scale_log2 : -INFINITY;
        mx = fmaxf(mx, x[j]);
      }
#pragma unroll
      for (int off = C::kTPR / 2; off > 0; off >>= 1) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      }
      const float m_new = fmaxf(m_run, mx);
      const float base = m_new == -INFINITY ? 0.f : m_new;  // no visible key yet: exp2 stays 0
      const float alpha = ptx::exp2_approx(m_run - base);
      m_run = m_new;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < C::kKPT; ++j) {
        const float pj = ptx::exp2_approx(x[j] - base);
        sum += pj;
        sP[prow * C::kPStride + pk + j] = __float2bfloat16_rn(pj);
      }
      l_run = l_run * alpha + sum;
      if (tid % C::kTPR == 0) sAlpha[prow] = alpha;
    }
    __syncthreads();

    // ---- (3) O = alpha O + P V over this warp's columns ----
#pragma unroll
    for (int mt = 0; mt < C::kMT; ++mt) {
      const float a0 = sAlpha[mt * 16 + g], a1 = sAlpha[mt * 16 + g + 8];
#pragma unroll
      for (int j = 0; j < C::kOTiles; ++j) {
        o[mt][j][0] *= a0;
        o[mt][j][1] *= a0;
        o[mt][j][2] *= a1;
        o[mt][j][3] *= a1;
      }
    }
#pragma unroll
    for (int kk = 0; kk < C::kBN / 16; ++kk) {
      uint32_t pa[C::kMT][4];
#pragma unroll
      for (int mt = 0; mt < C::kMT; ++mt) {
        ptx::ldmatrix_x4(pa[mt], sP_addr + ((mt * 16 + (lane & 15)) * C::kPStride + kk * 16 +
                                            (lane >> 4) * 8) * 2);
      }
      if constexpr (!kFp8) {
#pragma unroll
        for (int dn = 0; dn < C::kSW / 16; ++dn) {
          const int vr = kk * 16 + v_r, chunk = (warp * C::kSW + dn * 16) / 8 + v_c;
          uint32_t vb[4];
          ptx::ldmatrix_x4_trans(vb, v_s + vr * C::kRowBytes + ((chunk ^ (vr & 7)) << 4));
          const uint32_t b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
#pragma unroll
          for (int mt = 0; mt < C::kMT; ++mt) {
            ptx::mma_bf16_16816(o[mt][2 * dn], pa[mt], b0);
            ptx::mma_bf16_16816(o[mt][2 * dn + 1], pa[mt], b1);
          }
        }
      } else {
#pragma unroll
        for (int gq = 0; gq < C::kSW / 32; ++gq) {
          // Keys 2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9 of the step, columns 4 g .. 4 g + 3 of the
          // 32-column group: byte i of each word feeds n8 tile i (column 4 g + i).
          const int chunk = (warp * C::kSW + gq * 32) / 16 + (g >> 2), inner = 4 * (g & 3);
          uint32_t w[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int kr = kk * 16 + 2 * t4 + (e & 1) + 8 * (e >> 1);
            w[e] = ptx::ld_shared_u32(v_s + kr * C::kRowBytes + ((chunk ^ (kr & 7)) << 4) + inner);
          }
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const uint32_t sel = uint32_t(i) | (uint32_t(4 + i) << 4);
            const uint32_t bv[2] = {ptx::e4m3x2_to_bf16x2(__byte_perm(w[0], w[1], sel)),
                                    ptx::e4m3x2_to_bf16x2(__byte_perm(w[2], w[3], sel))};
#pragma unroll
            for (int mt = 0; mt < C::kMT; ++mt) ptx::mma_bf16_16816(o[mt][gq * 4 + i], pa[mt], bv);
          }
        }
      }
    }
  }
  ptx::cp_async_wait<0>();  // only empty groups can be pending here; leave none behind

  // ---- epilogue: the partial (m, l) of each row and its unnormalized O columns ----
  float l = l_run;
#pragma unroll
  for (int off = C::kTPR / 2; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
  const int64_t part = ((int64_t(b) * p.hkv + hk) * p.pieces + piece) * p.rows;
  if (tid % C::kTPR == 0 && prow_valid) {
    *reinterpret_cast<float2*>(p.ml_part + (part + row0 + prow) * 2) = make_float2(m_run, l);
  }
#pragma unroll
  for (int mt = 0; mt < C::kMT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row0 + mt * 16 + g + 8 * half;
      if (r >= p.rows) continue;
      float* dst = p.o_part + (part + r) * kD + warp * C::kSW;
      if constexpr (!kFp8) {
#pragma unroll
        for (int j = 0; j < C::kOTiles; ++j) {
          *reinterpret_cast<float2*>(dst + j * 8 + 2 * t4) =
              make_float2(o[mt][j][2 * half], o[mt][j][2 * half + 1]);
        }
      } else {
#pragma unroll
        for (int gq = 0; gq < C::kSW / 32; ++gq) {
          *reinterpret_cast<float4*>(dst + gq * 32 + 8 * t4) =
              make_float4(o[mt][gq * 4 + 0][2 * half], o[mt][gq * 4 + 1][2 * half],
                          o[mt][gq * 4 + 2][2 * half], o[mt][gq * 4 + 3][2 * half]);
          *reinterpret_cast<float4*>(dst + gq * 32 + 8 * t4 + 4) =
              make_float4(o[mt][gq * 4 + 0][2 * half + 1], o[mt][gq * 4 + 1][2 * half + 1],
                          o[mt][gq * 4 + 2][2 * half + 1], o[mt][gq * 4 + 3][2 * half + 1]);
        }
      }
    }
  }
}

// One CTA per (query row, KV head, batch row); thread i owns columns kD / 128 * i and on.
template <int kD>
__global__ void __launch_bounds__(128) DecodeCombineKernel(const DecodeAttentionParams p) {
  constexpr int kCols = kD / 128;
  const int r = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int64_t first = (int64_t(b) * p.hkv + hk) * p.pieces;  // (piece 0) of this row
  const float* ml = p.ml_part;
  float m = -INFINITY;
  for (int pc = 0; pc < p.pieces; ++pc) m = fmaxf(m, ml[((first + pc) * p.rows + r) * 2]);
  float acc[kCols] = {};
  float l = 0.f;
  if (m != -INFINITY) {
    for (int pc = 0; pc < p.pieces; ++pc) {
      const int64_t at = (first + pc) * p.rows + r;
      const float mp = ml[at * 2];
      if (mp == -INFINITY) continue;  // empty piece, or no visible key of this row in it
      const float w = exp2f(mp - m);
      l += w * ml[at * 2 + 1];
      const float* op = p.o_part + at * kD + threadIdx.x * kCols;
      if constexpr (kCols == 4) {
        const float4 v = *reinterpret_cast<const float4*>(op);
        acc[0] += w * v.x;
        acc[1] += w * v.y;
        acc[2] += w * v.z;
        acc[3] += w * v.w;
      } else {
        const float2 v = *reinterpret_cast<const float2*>(op);
        acc[0] += w * v.x;
        acc[1] += w * v.y;
      }
    }
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;  // no visible key at all: zeros
  const int t = r / p.groups, h = hk * p.groups + r % p.groups;
  bf16* out = p.o + ((int64_t(b) * p.t + t) * p.hq + h) * kD + threadIdx.x * kCols;
  uint32_t packed[kCols / 2];
#pragma unroll
  for (int c = 0; c < kCols / 2; ++c) packed[c] = ptx::pack_bf16x2(acc[2 * c] * inv, acc[2 * c + 1] * inv);
  if constexpr (kCols == 4) {
    *reinterpret_cast<uint2*>(out) = make_uint2(packed[0], packed[1]);
  } else {
    *reinterpret_cast<uint32_t*>(out) = packed[0];
  }
}

template <int kD, bool kFp8, int kRowsPerCta>
cudaError_t LaunchSplit(const DecodeAttentionParams& p, cudaStream_t stream) {
  using C = Config<kD, kFp8, kRowsPerCta>;
  int device = 0, optin = 0, per_sm = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (cudaError_t e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
      e != cudaSuccess) {
    return e;
  }
  if (cudaError_t e = cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor,
                                             device);
      e != cudaSuccess) {
    return e;
  }
  // The deepest pipeline (2 to 4 stages) that keeps kMinBlocks CTAs on an SM (1 KiB reserved
  // per CTA), else the deepest that fits one.
  int stages = 0;
  for (int st = 4; st >= 2 && stages == 0; --st) {
    if (C::SmemBytes(st) <= size_t(optin) &&
        C::kMinBlocks * (C::SmemBytes(st) + 1024) <= size_t(per_sm)) {
      stages = st;
    }
  }
  for (int st = 4; st >= 2 && stages == 0; --st) {
    if (C::SmemBytes(st) <= size_t(optin)) stages = st;
  }
  if (stages == 0) return cudaErrorInvalidValue;
  const size_t smem = C::SmemBytes(stages);
  auto kernel = DecodeSplitKernel<kD, kFp8, kRowsPerCta>;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(smem));
      e != cudaSuccess) {
    return e;
  }
  const int64_t row_blocks = (p.rows + C::kMB - 1) / C::kMB;
  const dim3 grid(unsigned(int64_t(p.pieces) * row_blocks), unsigned(p.hkv), unsigned(p.batch));
  kernel<<<grid, kThreads, smem, stream>>>(p, stages);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  DecodeCombineKernel<kD><<<dim3(unsigned(p.rows), unsigned(p.hkv), unsigned(p.batch)), 128, 0,
                            stream>>>(p);
  return cudaGetLastError();
}

template <int kD, bool kFp8>
cudaError_t LaunchRows(const DecodeAttentionParams& p, cudaStream_t stream) {
  return DecodeRowsPerCta(p.rows) == kDecodeRowsSmall
             ? LaunchSplit<kD, kFp8, kDecodeRowsSmall>(p, stream)
             : LaunchSplit<kD, kFp8, kDecodeRowsLarge>(p, stream);
}

}  // namespace

cudaError_t LaunchDecodeAttention(const DecodeAttentionParams& p, cudaStream_t stream) {
  if (p.d == 512) return p.fp8 ? LaunchRows<512, true>(p, stream) : LaunchRows<512, false>(p, stream);
  if (p.d == 256) return p.fp8 ? LaunchRows<256, true>(p, stream) : LaunchRows<256, false>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace mila
