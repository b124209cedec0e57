// FlashAttention prefill for head dim 512 on Hopper (sm_90a): target *_d512_sm90. Same contract
// and results as the portable mma.sync kernel (flash512/flash512.cu), which stays the oracle.
// Design: docs/design/attention_sm90.md ("D = 512: split D, split softmax").
//
// One CTA per M tile of 64 packed rows (longest first), one K and one V buffer of 64 keys x 512.
// Producer (warpgroup 0): Q once, then K_i and V_i of every key tile i, each after the
// consumers released tile i - 1 of that buffer. Consumer c (warpgroup 1 + c) owns O's columns
// [256c, 256c + 256) and computes S over D half c; after S it finishes the softmax of key half
// c only, in three exchanges with the other consumer through shared memory, each behind the
// 256-thread barrier NamedBarrier::kConsumers:
//   (A) the other key half of its S partial out, the other's partial of its half in;
//   (B) the row maxima of each half;
//   (C) the P fragments of each half.
// fp32 addition and fmaxf commute, so both consumers hold the same maxima and alphas. The two
// consumers run different template instances (kHalf = c indexes registers), so they meet at
// different barrier instructions: every consumer barrier is the unaligned form.
#include <cuda.h>  // CUtensorMap and its enums (the driver entry point is fetched at run time)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "common/attention_epilogue.cuh"
#include "common/attention_params.h"
#include "common/attention_sm90.cuh"
#include "common/attention_sm90_launch.h"
#include "common/key_tiles.cuh"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "common/softmax_fragments.cuh"
#include "flash512_sm90/flash512_sm90.h"

namespace mila {
namespace {

namespace px = ::mila::ptx;
namespace hx = ::mila::ptx::sm90;
namespace sf = ::mila::softmax_fragments;
namespace att = ::mila::attention_sm90;
using att::kColBlockBytes;
using att::NamedBarrier;
using sf::NegInf;

struct KernelTraits : att::Traits<512, 64> {
  // Shared memory from the 1024-byte aligned base; the tiles' offsets are multiples of 1024.
  struct SharedStorage {
    unsigned char q[kTileBytes];  // resident
    unsigned char k[kTileBytes];
    unsigned char v[kTileBytes];
    // The softmax's exchanges, per consumer c (the writer): S partials of the other's key half
    // (A), P fragments of its own key half (C); row maxima (B) and, at the end, row sums.
    float4 xs[2][4][128];
    uint4 xp[2][2][128];
    float xm[2][64];
    float xl[2][64];
    uint64_t q_full, k_full, k_empty, v_full, v_empty;
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage) + kSmemAlign;
  static_assert(kSmemBytes <= kMaxSmemBytes, "shared memory");
};
using T = KernelTraits;
using Smem = T::SharedStorage;
static_assert(offsetof(Smem, k) % T::kSmemAlign == 0 && offsetof(Smem, v) % T::kSmemAlign == 0,
              "TMA boxes and wgmma operands of the 128-byte swizzle are 1024-byte aligned");
constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN;

__global__ void __launch_bounds__(T::kThreads, 1)
    Flash512Sm90Kernel(const __grid_constant__ CUtensorMap tm_q,
                       const __grid_constant__ CUtensorMap tm_k,
                       const __grid_constant__ CUtensorMap tm_v, const AttentionParams p,
                       const int num_m_blocks) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
  extern __shared__ unsigned char smem_raw[];
  const att::AlignedSmem smem = att::AlignSmem(smem_raw);
  Smem& ss = *reinterpret_cast<Smem*>(smem.ptr);
  const uint32_t sQ = smem.base + offsetof(Smem, q), sK = smem.base + offsetof(Smem, k);
  const uint32_t sV = smem.base + offsetof(Smem, v);
  const uint32_t bar_q = smem.base + offsetof(Smem, q_full);
  const uint32_t bar_k_full = smem.base + offsetof(Smem, k_full);
  const uint32_t bar_k_empty = smem.base + offsetof(Smem, k_empty);
  const uint32_t bar_v_full = smem.base + offsetof(Smem, v_full);
  const uint32_t bar_v_empty = smem.base + offsetof(Smem, v_empty);

  const int tid = threadIdx.x, wg = tid / 128;
  const int h = blockIdx.y, b = blockIdx.z;
  const int G = p.hq / p.hkv;
  const int rows_total = p.t * G;  // fits int32: the FFI handler checks it
  const int q_off = *p.q_offset;
  const int m_block = num_m_blocks - 1 - static_cast<int>(blockIdx.x);  // longest first
  const int m0 = m_block * kBlockM;

  // Positions of this CTA's rows (int64: offsets and indices are int32 each).
  const int64_t qpos_min = static_cast<int64_t>(q_off) + min(p.t - 1, m0 / G);
  const int64_t qpos_max = static_cast<int64_t>(q_off) + min(p.t - 1, (m0 + kBlockM - 1) / G);
  // The key tiles they see, segment by segment; every role walks its own copy of this cursor,
  // so all agree on tile i.
  const KeyTileCursor<kBlockN> first_tile(p, qpos_min, qpos_max);

  if (tid == 0) {
    hx::mbar_init(bar_q, 1);
    hx::mbar_init(bar_k_full, 1);
    hx::mbar_init(bar_k_empty, 8);  // every consumer warp
    hx::mbar_init(bar_v_full, 1);
    hx::mbar_init(bar_v_empty, 8);
    hx::mbar_init_fence();
  }
  __syncthreads();  // the last CTA-wide barrier (the roles split below)

  if (wg == 0) {
    // ---------------- producer ----------------
    hx::setmaxnreg_dec<T::kProducerRegs>();
    if (tid == 0 && first_tile.valid()) {
      hx::tma_prefetch_desc(&tm_q);
      hx::tma_prefetch_desc(&tm_k);
      hx::tma_prefetch_desc(&tm_v);
      hx::mbar_arrive_expect_tx(bar_q, T::kTileBytes);
      att::LoadColumnBlocks<T::kColBlocks>(sQ, &tm_q, bar_q, 0, h * G, m0 / G, b);
      // One K or V tile: wait until the consumers released the buffer's previous tile, then
      // refill it.
      auto load_tile = [&](int i, int n0, uint32_t empty, uint32_t full, uint32_t dst,
                           const CUtensorMap* map) {
        if (i > 0) hx::mbar_wait(empty, (i - 1) & 1);
        hx::mbar_arrive_expect_tx(full, T::kTileBytes);
        att::LoadColumnBlocks<T::kColBlocks>(dst, map, full, 0, h, n0, b);
      };
      int i = 0;
      for (KeyTileCursor<kBlockN> tile = first_tile; tile.valid(); tile.Advance(), ++i) {
        load_tile(i, tile.n0(), bar_k_empty, bar_k_full, sK, &tm_k);
        load_tile(i, tile.n0(), bar_v_empty, bar_v_full, sV, &tm_v);
      }
    }
    return;
  }

  // ---------------- consumers ----------------
  hx::setmaxnreg_inc<T::kConsumerRegs>();
  const int c = wg - 1;  // output columns [256c, 256c+256), D half c of S, key half c of P
  const att::FragmentThread ft(tid - 128 * wg);
  const int ct = ft.ct, t4 = ft.t4, row = ft.row();
  int tq[2];  // query indices of this thread's rows, row and row + 8
#pragma unroll
  for (int r = 0; r < 2; ++r) tq[r] = att::QueryIndex(m0 + row + 8 * r, rows_total, G, p.t);
  const MaskedTiles<kBlockN> masked(qpos_min, qpos_max, p.causal, p.window);
  const int consumers = BarrierId(NamedBarrier::kConsumers);

  // The consumer's main loop and epilogue, for key half kHalf (= c; a compile-time index into
  // the accumulator registers).
  auto consume = [&](auto half) {
    constexpr int kHalf = decltype(half)::value;
    constexpr int kOther = 1 - kHalf;
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float m_run[2] = {NegInf(), NegInf()};
    float l_run[2] = {0.f, 0.f};  // over this consumer's key halves only
    const float scale_log2 = p.scale * T::kLog2e;

    if (first_tile.valid()) {
      const uint32_t q_half = sQ + 4 * c * kColBlockBytes;
      const uint32_t k_half = sK + 4 * c * kColBlockBytes;
      const uint32_t v_half = sV + 4 * c * kColBlockBytes;
      // S accumulators: the first wgmma of a tile ignores their value (scale-d = 0); zeroed once
      // so that no indeterminate value is ever an asm operand.
      float s[32];
#pragma unroll
      for (int e = 0; e < 32; ++e) s[e] = 0.f;
      // P of the next O += P V as wgmma A fragments: k-step kk covers keys 16kk.. = accumulator
      // n8 blocks 2kk, 2kk+1.
      uint32_t pa[4][4];
      hx::mbar_wait(bar_q, 0);

      // ---- S_c = Q[:, D half c] K[:, D half c]^T (64 x 64, fp32) of the tile in the K buffer
      // (k_full parity `parity`): issued and committed; the caller waits.
      auto issue_s = [&](uint32_t parity) {
        hx::mbar_wait(bar_k_full, parity);
        // Opaque copies of the bases, so that the 32 descriptors below are computed per tile:
        // loop-invariant, they could be hoisted out of the tile loop and hold 64 registers
        // across it.
        uint32_t qh = q_half, kh = k_half;
        asm volatile("" : "+r"(qh), "+r"(kh));
        const hx::DescSw128 dq(qh, 16, 1024), dk(kh, 16, 1024);
        hx::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 16; ++kk) {
          const uint32_t off = (kk >> 2) * kColBlockBytes + (kk & 3) * 32;
          const uint64_t da = dq.at(off), db = dk.at(off);
          if (kk == 0) {
            hx::wgmma_m64n64k16_ss<false>(s, da, db);
          } else {
            hx::wgmma_m64n64k16_ss<true>(s, da, db);
          }
        }
        hx::wgmma_commit();
      };
      // After the wait_group that retires S: no read of s may move above it.
      auto s_retired = [&] { hx::fence_operands(s); };
      // P V's register operands, O and P, pinned: no access to them moves across this point.
      auto fence_pv_operands = [&] {
        hx::fence_operands(o);
        hx::fence_operands(pa);
      };
      // ---- O_c += P V[:, 256c : 256c+256] (v_full parity `parity`), O already rescaled by the
      // tile's alpha: issued and committed; the caller waits, then calls pv_retired.
      auto issue_pv = [&](uint32_t parity) {
        hx::mbar_wait(bar_v_full, parity);
        // The rescaled O and the P fragments are written before the fence that orders these
        // register writes ahead of the wgmmas (the compiler may not sink them past it).
        fence_pv_operands();
        hx::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint64_t dv = hx::desc_sw128(v_half + kk * 16 * 128, kColBlockBytes, 1024);
          hx::wgmma_m64n256k16_rs_tb(o, pa[kk], dv);
        }
        hx::wgmma_commit();
      };
      // After the wait_group that retires P V. Until here O and P are the wgmmas' operands: the
      // operand fences keep them live and in place (the compiler may neither reuse P's
      // registers nor touch O while the wgmmas run), and V's buffer is released.
      auto pv_retired = [&] {
        fence_pv_operands();
        att::ReleaseByWarp(bar_v_empty, ft.lane);
      };

      // ---- The softmax of key half kHalf (keys 32 kHalf.., accumulator elements 16 kHalf ..
      // 16 kHalf + 15), exchanges (A), (B), (C) (see the top of the file). Every buffer is
      // rewritten one tile later only after the barrier that follows its reader's read (xs: read
      // before B; xm: before C; xp: before the next A), which this writer has passed by then,
      // so the barrier alone orders every reuse. Thread ct of both consumers holds the same rows
      // and key columns of the accumulator (and of P's A fragments), so every exchange is a
      // plain copy at index ct. It leaves P's A fragments in pa: its own half from s, the
      // other's from xp.
      auto split_softmax = [&](int64_t kpos0, int keys_left, float (&alpha)[2]) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int e = 16 * kOther + 4 * j;
          ss.xs[kHalf][j][ct] = make_float4(s[e], s[e + 1], s[e + 2], s[e + 3]);
        }
        px::named_barrier_sync_unaligned(consumers, T::kConsumerThreads);  // (A)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int e = 16 * kHalf + 4 * j;
          const float4 v = ss.xs[kOther][j][ct];
          s[e] += v.x;
          s[e + 1] += v.y;
          s[e + 2] += v.z;
          s[e + 3] += v.w;
        }
#pragma unroll
        for (int e = 16 * kHalf; e < 16 * kHalf + 16; ++e) s[e] *= scale_log2;
        if (masked(kpos0, keys_left)) {
          const int64_t dist[2] = {static_cast<int64_t>(q_off) + tq[0] - kpos0,
                                   static_cast<int64_t>(q_off) + tq[1] - kpos0};
          MaskTile<16 * kHalf, 16>(s, t4, dist, keys_left, p.causal, p.window);
        }
        float mx[2];
        sf::ThreadRowMax<4 * kHalf, 4 * kHalf + 4>(s, mx);
#pragma unroll
        for (int r = 0; r < 2; ++r) mx[r] = sf::QuadMax(mx[r]);
        if (t4 == 0) {
          ss.xm[kHalf][row] = mx[0];
          ss.xm[kHalf][row + 8] = mx[1];
        }
        px::named_barrier_sync_unaligned(consumers, T::kConsumerThreads);  // (B)
        mx[0] = fmaxf(mx[0], ss.xm[kOther][row]);
        mx[1] = fmaxf(mx[1], ss.xm[kOther][row + 8]);
        float base_r[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) base_r[r] = sf::UpdateRowMax(mx[r], m_run[r], alpha[r]);
        sf::ExpAndSum<16 * kHalf, 16 * kHalf + 16>(s, base_r, alpha, l_run);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          uint32_t f[4];
          sf::PackPFragment(s, 2 * kHalf + j, f);
          ss.xp[kHalf][j][ct] = make_uint4(f[0], f[1], f[2], f[3]);
        }
        px::named_barrier_sync_unaligned(consumers, T::kConsumerThreads);  // (C)
#pragma unroll
        for (int j = 0; j < 2; ++j) sf::PackPFragment(s, 2 * kHalf + j, pa[2 * kHalf + j]);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint4 v = ss.xp[kOther][j][ct];
          pa[2 * kOther + j][0] = v.x;
          pa[2 * kOther + j][1] = v.y;
          pa[2 * kOther + j][2] = v.z;
          pa[2 * kOther + j][3] = v.w;
        }
      };

      int i = 0;
      for (KeyTileCursor<kBlockN> tile = first_tile; tile.valid(); ++i) {
        const int64_t kpos0 = tile.kpos0();  // position of the tile's first key
        const int keys_left = tile.keys_left();
        tile.Advance();  // tile.valid(): a next tile follows
        const uint32_t parity = i & 1;
        issue_s(parity);
        hx::wgmma_wait<0>();
        s_retired();
        att::ReleaseByWarp(bar_k_empty, ft.lane);  // this warp's S wgmmas retired: done with K_i
        float alpha[2];
        split_softmax(kpos0, keys_left, alpha);
        sf::RescaleRows(o, alpha);
        issue_pv(parity);
        hx::wgmma_wait<0>();
        pv_retired();
      }
    }

    // ---- Epilogue: row sums over the quad and over both consumers' key halves (both take this
    // path, tiles or not; xl is written once, after the last (C)), then O / l, and lse from
    // consumer 0.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
    }
    if (t4 == 0) {
      ss.xl[kHalf][row] = l_run[0];
      ss.xl[kHalf][row + 8] = l_run[1];
    }
    px::named_barrier_sync_unaligned(consumers, T::kConsumerThreads);
    l_run[0] += ss.xl[kOther][row];  // the same sum in both: fp32 + commutes
    l_run[1] += ss.xl[kOther][row + 8];
    att::StoreOutputRows<T::kD>(p, o, m_run, l_run, m0 + row, 256 * c, c == 0, t4, G,
                                rows_total, h, b);
  };
  if (c == 1) {
    consume(std::integral_constant<int, 1>{});
  } else {
    consume(std::integral_constant<int, 0>{});
  }
#else
  __trap();  // built for sm_90a only; the launcher checks the device
#endif
}

}  // namespace

cudaError_t LaunchFlashAttentionD512Sm90(const AttentionParams& p, cudaStream_t stream) {
  att::LaunchSetup l;
  if (const cudaError_t err = att::PrepareLaunch<T>(p, &l); err != cudaSuccess) return err;
  if (const cudaError_t err = att::PrepareKernel<T>(Flash512Sm90Kernel, T::kSmemBytes);
      err != cudaSuccess) {
    return err;
  }
  const dim3 grid(static_cast<unsigned>(l.num_m_blocks), static_cast<unsigned>(p.hkv),
                  static_cast<unsigned>(p.batch));
  Flash512Sm90Kernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(l.tm_q, l.tm_k, l.tm_v, p,
                                                                   l.num_m_blocks);
  return cudaGetLastError();
}

}  // namespace mila
