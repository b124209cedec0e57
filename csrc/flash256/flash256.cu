// FlashAttention-2 forward for head dim 256 (Gemma 4 local layers: Hq=16, Hkv=8, W=1024).
//
// Row split: a CTA owns kBM = 16 * kWarps query rows of one (batch, head); each warp owns 16
// rows and keeps their 16 x 256 fp32 output in registers (128 per thread). Per 64-key tile:
// S = Q K^T (mma.sync m16n8k16 bf16, fp32 accumulate; Q and K from shared memory through
// ldmatrix), online softmax in base 2 with the scale folded into the logits, P (bf16, kept in
// registers as the A operand) times V (ldmatrix.trans). K/V tiles stream through cp.async in
// kStages buffers; every 512-byte smem row is XOR-swizzled in 16-byte chunks so ldmatrix and
// cp.async are bank-conflict free.
//
// Masking: key j is visible to query i when j < S and, if causal, 0 <= d < W (or just d >= 0
// without a window) for d = (q_offset + i) - (kv_offset + j). The offsets are read from
// device memory here, so one compiled call serves every chunk. A CTA visits only the key
// tiles its rows can see (O(T * W) with a window; tiles past the diagonal are never loaded);
// inside that range a warp skips tiles none of its 16 rows can see and masks element-wise
// only tiles that straddle a boundary. Rows that see no key write zeros and lse = -inf.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common/attention_params.h"
#include "common/ptx.cuh"

namespace mila {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kD = 256;
constexpr int kBN = 64;                  // keys per tile
constexpr int kChunks = kD / 8;          // 16-byte chunks per smem row
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <int kWarps, int kStages>
struct Config {
  static constexpr int kBM = 16 * kWarps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kTileElems = kBN * kD;
  static constexpr size_t kSmemBytes = sizeof(bf16) * (size_t(kBM) * kD + 2u * kStages * kTileElems);
};

__device__ __forceinline__ int64_t Min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t Max64(int64_t a, int64_t b) { return a > b ? a : b; }

// Byte offset of 16-byte chunk `chunk` of smem row `row` (rows of kD bf16, swizzled).
__device__ __forceinline__ uint32_t Swizzle(int row, int chunk) {
  return static_cast<uint32_t>(row * (kD * 2) + ((chunk ^ (row & 7)) << 4));
}

// cp.async of kRows rows (row stride `stride` elements in global memory) into a swizzled smem
// tile; rows >= n_valid are zero-filled without reading global memory. Warp w copies rows
// w, w + kWarps, ... with lane = 16-byte chunk, so a warp moves one 512-byte row per step and
// the swizzle key (row & 7) takes at most 8 / kWarps distinct values per thread.
template <int kRows, int kWarps>
__device__ __forceinline__ void LoadTile(uint32_t smem, const bf16* __restrict__ g, int64_t stride,
                                         int n_valid, int warp, int lane) {
  static_assert(kChunks == 32 && kRows % kWarps == 0, "one lane per chunk, whole rows per warp");
  const bf16* src = g + warp * stride + lane * 8;
  const int64_t step = kWarps * stride;  // advanced, not recomputed: keeps registers free
  smem += warp * (kD * 2);
#pragma unroll
  for (int i = 0; i < kRows / kWarps; ++i) {
    const bool ok = warp + i * kWarps < n_valid;
    const uint32_t key = uint32_t(lane ^ (warp & 7) ^ ((i * kWarps) & 7));
    ptx::cp_async_16(smem + i * kWarps * (kD * 2) + (key << 4), ok ? src : g, ok);
    src += step;
  }
}

template <int kWarps, int kStages>
__global__ void __launch_bounds__(kWarps * 32, 1) FlashAttentionD256Kernel(const AttentionParams p) {
  using C = Config<kWarps, kStages>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t sQ = ptx::smem_addr(smem_raw);
  const uint32_t sK = sQ + C::kBM * kD * 2;
  const uint32_t sV = sK + kStages * C::kTileElems * 2;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int b = blockIdx.x / p.hq, h = blockIdx.x % p.hq;
  const int hk = h / (p.hq / p.hkv);
  const int m0 = (gridDim.y - 1 - blockIdx.y) * C::kBM;  // longest (latest) rows first
  const int64_t off = int64_t(*p.q_offset) - int64_t(*p.kv_offset);  // q_pos - k_pos = off + i - j
  const int64_t win = p.window;

  // Keys any row of this CTA can see: [lo, hi].
  const int m_last = min(m0 + C::kBM, p.t) - 1;
  int64_t lo = 0, hi = p.s - 1;
  if (p.causal) {
    hi = Min64(hi, m_last + off);
    if (win > 0) lo = Max64(0, m0 + off - win + 1);
  }
  const int n_begin = hi >= lo ? int(lo / kBN) : 0;
  const int n_end = hi >= lo ? int(hi / kBN) + 1 : 0;

  const int64_t q_stride = int64_t(p.hq) * kD, kv_stride = int64_t(p.hkv) * kD;
  const bf16* q_g = p.q + (int64_t(b) * p.t + m0) * q_stride + h * kD;
  const bf16* k_g = p.k + int64_t(b) * p.s * kv_stride + hk * kD;
  const bf16* v_g = p.v + int64_t(b) * p.s * kv_stride + hk * kD;
  auto load_kv = [&](int n, int stage) {
    const int64_t j0 = int64_t(n) * kBN;
    LoadTile<kBN, kWarps>(sK + stage * C::kTileElems * 2, k_g + j0 * kv_stride, kv_stride,
                          p.s - int(j0), warp, lane);
    LoadTile<kBN, kWarps>(sV + stage * C::kTileElems * 2, v_g + j0 * kv_stride, kv_stride,
                          p.s - int(j0), warp, lane);
  };

  LoadTile<C::kBM, kWarps>(sQ, q_g, q_stride, p.t - m0, warp, lane);
#pragma unroll
  for (int st = 0; st < kStages; ++st) {
    if (n_begin + st < n_end) load_kv(n_begin + st, st);
    ptx::cp_async_commit();
  }

  // This warp's rows [r0, r_hi] and this thread's two rows g and g + 8 of them.
  const int r0 = m0 + warp * 16;
  const int r_hi = min(r0 + 15, p.t - 1);
  const bool warp_active = r0 < p.t;
  const int g = lane >> 2, t4 = lane & 3;
  // Visible keys of a row at index i: [KeyLo(i), KeyHi(i)], clamped to [-1, S] so they fit int.
  auto key_hi = [&](int i) -> int {
    return int(p.causal ? Max64(Min64(int64_t(i) + off, p.s - 1), -1) : p.s - 1);
  };
  auto key_lo = [&](int i) -> int {
    return int(p.causal && win > 0 ? Min64(Max64(int64_t(i) + off - win + 1, 0), p.s) : 0);
  };
  const int jmin[2] = {key_lo(r0 + g), key_lo(r0 + g + 8)};
  const int jmax[2] = {key_hi(r0 + g), key_hi(r0 + g + 8)};
  // Per warp: keys some row sees [w_lo, w_hi] (skip tiles outside) and keys every row sees
  // [w_all_lo, w_all_hi] (no element mask inside). Rows >= T do not count.
  const int w_lo = key_lo(r0), w_hi = warp_active ? key_hi(r_hi) : -1;
  const int w_all_lo = key_lo(r_hi), w_all_hi = key_hi(r0);

  const float scale_log2 = p.scale * kLog2e;
  float o[kD / 8][4];
#pragma unroll
  for (int i = 0; i < kD / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};  // running max of the log2-scaled logits
  float l_run[2] = {0.f, 0.f};               // this thread's part of the running row sums

  // ldmatrix lane addressing. A 16-column step kk reads chunk 2*kk + c of row r, swizzled to
  // chunk (2*kk + c) ^ (r & 7) = 8*(kk/4) + ((2*(kk%4) + c) ^ (r & 7)): a row base, an
  // immediate and one of four per-thread offsets (xq/xk/xv), so no address is recomputed.
  const int q_r = warp * 16 + (lane & 15), q_c = lane >> 4;
  const int k_r = (lane & 7) + ((lane >> 4) << 3), k_c = (lane >> 3) & 1;
  const int v_r = (lane & 7) + (((lane >> 3) & 1) << 3), v_c = lane >> 4;
  const uint32_t q_base = sQ + q_r * (kD * 2);
  uint32_t xq[4], xk[4], xv[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    xq[i] = uint32_t(((2 * i + q_c) ^ (q_r & 7)) << 4);
    xk[i] = uint32_t(((2 * i + k_c) ^ (k_r & 7)) << 4) + k_r * (kD * 2);
    xv[i] = uint32_t(((2 * i + v_c) ^ (v_r & 7)) << 4) + v_r * (kD * 2);
  }

  for (int n = n_begin, it = 0; n < n_end; ++n, ++it) {
    ptx::cp_async_wait<kStages - 1>();
    __syncthreads();
    const int stage = it % kStages;
    const int j0 = n * kBN;
    const bool skip = j0 > w_hi || j0 + kBN - 1 < w_lo;
    const bool need_mask = j0 + kBN - 1 > w_all_hi || j0 < w_all_lo;
    if (!skip) {
      const uint32_t k_s = sK + stage * C::kTileElems * 2;
      const uint32_t v_s = sV + stage * C::kTileElems * 2;
      // ---- S = Q K^T (16 x 64 per warp) ----
      float s[kBN / 8][4];
#pragma unroll
      for (int i = 0; i < kBN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        uint32_t a[4];
        ptx::ldmatrix_x4(a, q_base + xq[kk % 4] + (kk / 4) * 128);
#pragma unroll
        for (int nn = 0; nn < kBN / 16; ++nn) {
          uint32_t kb[4];
          ptx::ldmatrix_x4(kb, k_s + xk[kk % 4] + (kk / 4) * 128 + nn * 16 * (kD * 2));
          const uint32_t b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
          ptx::mma_bf16_16816(s[2 * nn], a, b0);
          ptx::mma_bf16_16816(s[2 * nn + 1], a, b1);
        }
      }
      // ---- scale to log2 units, mask, online softmax ----
      float mx[2] = {m_run[0], m_run[1]};
#pragma unroll
      for (int i = 0; i < kBN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[i][e] * scale_log2;
          if (need_mask) {
            const int j = j0 + i * 8 + 2 * t4 + (e & 1);
            const int r = e >> 1;
            if (j < jmin[r] || j > jmax[r]) x = -INFINITY;
          }
          s[i][e] = x;
          mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
      }
      float msub[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        msub[r] = mx[r] == -INFINITY ? 0.f : mx[r];  // no visible key yet: keep exp2 finite
        const float alpha = ptx::exp2_approx(m_run[r] - msub[r]);  // 0 when m_run = -inf
        m_run[r] = mx[r];
        l_run[r] *= alpha;
#pragma unroll
        for (int i = 0; i < kD / 8; ++i) {
          o[i][2 * r] *= alpha;
          o[i][2 * r + 1] *= alpha;
        }
      }
      uint32_t pa[kBN / 16][4];  // P as the A operand of P V, one 16-key step per entry
#pragma unroll
      for (int i = 0; i < kBN / 8; ++i) {
        const float p0 = ptx::exp2_approx(s[i][0] - msub[0]);
        const float p1 = ptx::exp2_approx(s[i][1] - msub[0]);
        const float p2 = ptx::exp2_approx(s[i][2] - msub[1]);
        const float p3 = ptx::exp2_approx(s[i][3] - msub[1]);
        l_run[0] += p0 + p1;
        l_run[1] += p2 + p3;
        pa[i / 2][(i & 1) * 2 + 0] = ptx::pack_bf16x2(p0, p1);
        pa[i / 2][(i & 1) * 2 + 1] = ptx::pack_bf16x2(p2, p3);
      }
      // ---- O += P V ----
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) {
#pragma unroll
        for (int dn = 0; dn < kD / 16; ++dn) {
          uint32_t vb[4];
          ptx::ldmatrix_x4_trans(vb, v_s + xv[dn % 4] + (dn / 4) * 128 + kk * 16 * (kD * 2));
          const uint32_t b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
          ptx::mma_bf16_16816(o[2 * dn], pa[kk], b0);
          ptx::mma_bf16_16816(o[2 * dn + 1], pa[kk], b1);
        }
      }
    }
    __syncthreads();  // everyone is done with this stage before it is refilled
    if (n + kStages < n_end) load_kv(n + kStages, stage);
    ptx::cp_async_commit();
  }
  // The Q rows are reused below to stage the output. Every warp copied some of them, so wait
  // for all copies (the loop may have run zero times) before any warp overwrites them.
  ptx::cp_async_wait<0>();
  __syncthreads();
  if (!warp_active) return;

  // ---- epilogue: normalise, write lse, stage O (bf16) in this warp's Q rows, store ----
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[r] = l > 0.f ? 1.f / l : 0.f;
    const int row = r0 + g + 8 * r;
    if (p.lse != nullptr && t4 == 0 && row < p.t) {
      p.lse[(int64_t(b) * p.hq + h) * p.t + row] = l > 0.f ? (m_run[r] + __log2f(l)) * kLn2 : -INFINITY;
    }
  }
  unsigned char* sQ_ptr = smem_raw;
#pragma unroll
  for (int i = 0; i < kD / 8; ++i) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp * 16 + g + 8 * r;
      const uint32_t byte = Swizzle(row, i) + t4 * 4;
      *reinterpret_cast<uint32_t*>(sQ_ptr + byte) =
          ptx::pack_bf16x2(o[i][2 * r] * inv[r], o[i][2 * r + 1] * inv[r]);
    }
  }
  __syncwarp();
  bf16* o_g = p.o + (int64_t(b) * p.t + r0) * q_stride + h * kD;
#pragma unroll 4
  for (int i = 0; i < 16; ++i) {
    if (r0 + i >= p.t) break;
    const uint4 val = *reinterpret_cast<const uint4*>(sQ_ptr + Swizzle(warp * 16 + i, lane));
    *reinterpret_cast<uint4*>(o_g + i * q_stride + lane * 8) = val;
  }
}

template <int kWarps, int kStages>
cudaError_t Launch(const AttentionParams& p, cudaStream_t stream) {
  using C = Config<kWarps, kStages>;
  auto kernel = FlashAttentionD256Kernel<kWarps, kStages>;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(C::kSmemBytes));
      e != cudaSuccess) {
    return e;
  }
  const int64_t m_blocks = (int64_t(p.t) + C::kBM - 1) / C::kBM;
  if (m_blocks > 65535 || int64_t(p.batch) * p.hq > INT32_MAX) return cudaErrorInvalidConfiguration;
  const dim3 grid(unsigned(p.batch * p.hq), unsigned(m_blocks));
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

// Picks the largest configuration whose shared memory fits the device: 128 query rows with
// double-buffered K/V (192 KiB: sm_90), 64 rows double-buffered (160 KiB: sm_80), 64 rows
// single-buffered (96 KiB: sm_86/sm_89).
cudaError_t LaunchFlashAttentionD256(const AttentionParams& p, cudaStream_t stream) {
  int device = 0, smem_optin = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (cudaError_t e = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                             device);
      e != cudaSuccess) {
    return e;
  }
  if (size_t(smem_optin) >= Config<8, 2>::kSmemBytes) return Launch<8, 2>(p, stream);
  if (size_t(smem_optin) >= Config<4, 2>::kSmemBytes) return Launch<4, 2>(p, stream);
  return Launch<4, 1>(p, stream);
}

}  // namespace mila
