// Head-dim-512 flash attention on Hopper with rotary keys (target *_d512_sm90_rotary_keys,
// jax_mila.ffi.flash_attention(..., rotary_keys_only=64)): the scores read K only in its
// RoPE-rotated column blocks 0 and 4 ([0:64] and [256:320]) and V in the other six, which is
// exact for Gemma 4's K=V layers once k_norm's weight is folded into q there. Same contract,
// masking, M tiles and roles as flash512_sm90.cu; the consumers alternate tiles (FlashMLA's
// "seesaw"). Design: docs/design/attention_sm90.md ("D = 512 with rotary keys: seesaw").
//
// Consumer c owns the tiles i with i % 2 == c (stage c of the two K/V stages): it computes S
// and the softmax of its tile over all 512 dims, hands P and the row maxima to the other
// consumer through shared memory (hand[c]), and both add every tile's P V into their own O
// half, in tile order. A stage is two half groups h = 0, 1 (V's column blocks 4h..4h+3 and K's
// block 4h), filled under full[s][h] and released under empty[s][h] by consumer h alone, so
// each half returns to the producer as soon as its consumer is done with it.
//
// Consumer c, own tile i:
//   1. wait full[c][c], issue S_i over D half c;
//   2. the other's tile i - 1: wait hand[1 - c], take its row maxima and P, rescale O, issue
//      P V_{i-1};
//   3. wait full[c][1 - c], issue S_i over the other D half; once the first half and
//      P V_{i-1} retired, release this consumer's group of tile i - 1;
//   4. when S_i retired: softmax (lazy row maximum, sf::OnlineSoftmaxLazy), P_i to registers
//      and into the handoff (the other consumer's K block of the stage, read by S_i already),
//      m_i; arrive on hand[c];
//   5. rescale O, issue P_i V_i, wait, release this consumer's group of tile i.
// A tile of the other consumer that is the CTA's last is added after the loop. Every wait
// depends on an earlier tile only, so the order cannot deadlock. Each consumer sums l over its
// own tiles (rescaled by every tile's alpha); the sums are added at the end. (No watchdog on
// the waits: a trap in the consumers' wait loops made ptxas spill their registers.)
#include <cuda.h>
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
  static constexpr int kStages = 2;
  static constexpr uint32_t kKrBytes = 2 * kColBlockBytes;  // K column blocks 0 and 4 of a tile
  // Shared memory from the 1024-byte aligned base; the tiles' offsets are multiples of 1024.
  struct SharedStorage {
    unsigned char q[kTileBytes];  // resident
    unsigned char v[kStages][kTileBytes];
    // K's rotated blocks of a stage: block h of half group h; once S read it, the P handoff to
    // consumer h (uint4 [4][128]).
    unsigned char k_rot[kStages][kKrBytes];
    float hand_m[kStages][64];  // the row maxima handed over with P
    float l[2][64];             // row sums at the end, per consumer
    uint64_t q_full;
    uint64_t full[kStages][2], empty[kStages][2], hand[kStages];
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage) + kSmemAlign;
  static_assert(kSmemBytes <= kMaxSmemBytes, "shared memory");
  static_assert(4 * 128 * 16 <= kColBlockBytes, "a P handoff fits a K block");
};
using T = KernelTraits;
using Smem = T::SharedStorage;
static_assert(offsetof(Smem, v) % T::kSmemAlign == 0 && offsetof(Smem, k_rot) % T::kSmemAlign == 0,
              "TMA boxes and wgmma operands of the 128-byte swizzle are 1024-byte aligned");
constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN;

__global__ void __launch_bounds__(T::kThreads, 1)
    Flash512Sm90SeesawKernel(const __grid_constant__ CUtensorMap tm_q,
                             const __grid_constant__ CUtensorMap tm_k,
                             const __grid_constant__ CUtensorMap tm_v, const AttentionParams p,
                             const int num_m_blocks) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
  extern __shared__ unsigned char smem_raw[];
  const att::AlignedSmem smem = att::AlignSmem(smem_raw);
  Smem& ss = *reinterpret_cast<Smem*>(smem.ptr);
  const uint32_t sQ = smem.base + offsetof(Smem, q), sV = smem.base + offsetof(Smem, v);
  const uint32_t sKr = smem.base + offsetof(Smem, k_rot);
  const uint32_t bar_q = smem.base + offsetof(Smem, q_full);
  // Half-tile group (s, h): full[s][h] at bar_full + 8 (2 s + h), empty[s][h] likewise.
  const uint32_t bar_full = smem.base + offsetof(Smem, full);
  const uint32_t bar_empty = smem.base + offsetof(Smem, empty);
  const uint32_t bar_hand = smem.base + offsetof(Smem, hand);  // hand[s] at + 8 s

  const int tid = threadIdx.x;
  // Warp-uniform to the compiler (CUTLASS's canonical_warp_group_idx): the consumers branch on
  // their index around wgmmas, and a branch ptxas must assume divergent serializes every wgmma
  // of the kernel (C7518: a wait after each one).
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);
  const int h = blockIdx.y, b = blockIdx.z;
  const int G = p.hq / p.hkv;
  const int rows_total = p.t * G;  // fits int32: the FFI handler checks it
  const int q_off = *p.q_offset;
  const int m_block = num_m_blocks - 1 - static_cast<int>(blockIdx.x);  // longest first
  const int m0 = m_block * kBlockM;
  const int64_t qpos_min = static_cast<int64_t>(q_off) + min(p.t - 1, m0 / G);
  const int64_t qpos_max = static_cast<int64_t>(q_off) + min(p.t - 1, (m0 + kBlockM - 1) / G);
  const KeyTileCursor<kBlockN> first_tile(p, qpos_min, qpos_max);

  if (tid == 0) {
    hx::mbar_init(bar_q, 1);
    for (int s = 0; s < T::kStages; ++s) {
      for (int hh = 0; hh < 2; ++hh) {
        hx::mbar_init(bar_full + 16 * s + 8 * hh, 1);
        hx::mbar_init(bar_empty + 16 * s + 8 * hh, 4);  // consumer hh's 4 warps
      }
      hx::mbar_init(bar_hand + 8 * s, 128);  // every thread of the owning consumer
    }
    hx::mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    // ---------------- producer: Q once, then V and the two K blocks of every tile ----------
    hx::setmaxnreg_dec<T::kProducerRegs>();
    if (tid == 0 && first_tile.valid()) {
      hx::tma_prefetch_desc(&tm_q);
      hx::tma_prefetch_desc(&tm_k);
      hx::tma_prefetch_desc(&tm_v);
      hx::mbar_arrive_expect_tx(bar_q, T::kTileBytes);
      att::LoadColumnBlocks<T::kColBlocks>(sQ, &tm_q, bar_q, 0, h * G, m0 / G, b);
      int i = 0;
      for (KeyTileCursor<kBlockN> tile = first_tile; tile.valid(); tile.Advance(), ++i) {
        const uint32_t st = i & 1;
        // The owner's half first: its consumer released it after its own P V two tiles back;
        // the other half waits for the other consumer's P V of that tile.
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const uint32_t hh = st ^ k, full = bar_full + 16 * st + 8 * hh;
          if (i >= 2) hx::mbar_wait(bar_empty + 16 * st + 8 * hh, ((i >> 1) - 1) & 1);
          hx::mbar_arrive_expect_tx(full, 5 * kColBlockBytes);
          // V's column blocks 4hh..4hh+3, then K's rotated column block 4hh.
          att::LoadColumnBlocks<4>(sV + st * T::kTileBytes + 4 * hh * kColBlockBytes, &tm_v, full,
                                   256 * hh, h, tile.n0(), b);
          att::LoadColumnBlocks<1>(sKr + st * T::kKrBytes + hh * kColBlockBytes, &tm_k, full,
                                   256 * hh, h, tile.n0(), b);
        }
      }
    }
    return;
  }

  // ---------------- consumers ----------------
  hx::setmaxnreg_inc<T::kConsumerRegs>();
  const int c = wg - 1;  // O columns [256c, 256c + 256); owns the tiles i % 2 == c
  const att::FragmentThread ft(tid - 128 * wg);
  const int ct = ft.ct, t4 = ft.t4, row = ft.row();
  int tq[2];  // query indices of this thread's rows, row and row + 8
#pragma unroll
  for (int r = 0; r < 2; ++r) tq[r] = att::QueryIndex(m0 + row + 8 * r, rows_total, G, p.t);
  const MaskedTiles<kBlockN> masked(qpos_min, qpos_max, p.causal, p.window);
  // This consumer's half group of the tile is done with.
  auto release = [&](int tile) { att::ReleaseByWarp(bar_empty + 16 * (tile & 1) + 8 * c, ft.lane); };

  float o[128];
#pragma unroll
  for (int e = 0; e < 128; ++e) o[e] = 0.f;
  float m_run[2] = {NegInf(), NegInf()};
  float l_run[2] = {0.f, 0.f};  // this consumer's tiles only, rescaled by every tile's alpha
  const float scale_log2 = p.scale * T::kLog2e;

  if (first_tile.valid()) {
    float s[32];
#pragma unroll
    for (int e = 0; e < 32; ++e) s[e] = 0.f;
    uint32_t pa[4][4];  // P of the next P V, as wgmma A fragments
    hx::mbar_wait(bar_q, 0);

    auto fence_pv_operands = [&] {
      hx::fence_operands(o);
      hx::fence_operands(pa);
    };
    // O_c = O_c P V_tile[:, 256c : 256c + 256] with P in pa (O already rescaled): issued and
    // committed.
    auto issue_pv = [&](int tile) {
      uint32_t vh = sV + (tile & 1) * T::kTileBytes + 4 * c * kColBlockBytes;
      asm volatile("" : "+r"(vh));
      fence_pv_operands();
      hx::wgmma_fence();
      const hx::DescSw128 dv(vh, kColBlockBytes, 1024);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) hx::wgmma_m64n256k16_rs_tb(o, pa[kk], dv.at(kk * 16 * 128));
      hx::wgmma_commit();
    };
    // The other consumer's tile: its row maxima and P from the handoff; O rescaled to the new
    // maxima (alpha from the same bits the owner used; skipped where the owner moved no row
    // maximum of this warp) and l with it.
    auto take_handoff = [&](int tile) {
      hx::mbar_wait(bar_hand + 8 * (tile & 1), (tile >> 1) & 1);
      const float* hm = ss.hand_m[tile & 1];
      float alpha[2];
      bool moved = false;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float m_new = hm[row + 8 * r];
        const float base_r = m_new == NegInf() ? 0.f : m_new;
        const bool up = m_new != m_run[r];
        alpha[r] = up ? px::exp2_approx(m_run[r] - base_r) : 1.f;
        moved |= up;
        m_run[r] = m_new;
        l_run[r] *= alpha[r];
      }
      // In the stage's K block c (this consumer's half group; the owner's S read it before).
      const uint4* hp =
          reinterpret_cast<const uint4*>(ss.k_rot[tile & 1] + c * kColBlockBytes);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint4 v = hp[kk * 128 + ct];
        pa[kk][0] = v.x;
        pa[kk][1] = v.y;
        pa[kk][2] = v.z;
        pa[kk][3] = v.w;
      }
      if (__any_sync(0xffffffffu, moved)) sf::RescaleRows(o, alpha);
    };

    // Own tile i (stage c) at positions kpos0.., keys_left of them in its segment. kPending
    // (compile time: a wgmma under a branch ptxas cannot prove uniform serializes every wgmma
    // of the kernel, C7518): whether the other consumer's tile i - 1 is added in between; true
    // for every own tile but consumer 0's first.
    auto own_tile = [&](int i, int64_t kpos0, int keys_left, auto with_pending) {
      constexpr bool kPending = decltype(with_pending)::value;
      const uint32_t st = i & 1;  // == c
      // S_i over D half hh (group (c, hh)) into s; `first`: its first wgmma ignores s.
      auto issue_s_half = [&](int hh, auto first) {
        uint32_t qb = sQ + 4 * hh * kColBlockBytes;
        uint32_t vb = sV + st * T::kTileBytes + 4 * hh * kColBlockBytes;
        uint32_t kb = sKr + st * T::kKrBytes + hh * kColBlockBytes;
        asm volatile("" : "+r"(qb), "+r"(vb), "+r"(kb));
        const hx::DescSw128 dq(qb, 16, 1024), dvb(vb, 16, 1024), dkb(kb, 16, 1024);
        hx::mbar_wait(bar_full + 16 * st + 8 * hh, (i >> 1) & 1);
        hx::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 16; ++kk) {
          const uint32_t off = (kk >> 2) * kColBlockBytes + (kk & 3) * 32;
          // Column block 4hh is K's rotated block (the group's K block); the others are V's.
          const uint64_t da = dq.at(off), db = kk < 4 ? dkb.at((kk & 3) * 32) : dvb.at(off);
          if (decltype(first)::value && kk == 0) {
            hx::wgmma_m64n64k16_ss<false>(s, da, db);
          } else {
            hx::wgmma_m64n64k16_ss<true>(s, da, db);
          }
        }
        hx::wgmma_commit();
      };
      hx::fence_operands(s);
      // 1. S_i over this consumer's half of D (group (c, c), released by its own P V two tiles
      // back: usually loaded).
      issue_s_half(c, std::true_type{});
      // 2. The other consumer's tile i - 1, as soon as its P is handed over.
      if constexpr (kPending) {
        take_handoff(i - 1);
        issue_pv(i - 1);
      }
      // 3. S_i over the other half of D (group (c, 1 - c): released by the other consumer's P V
      // two tiles back).
      issue_s_half(1 - c, std::false_type{});
      if constexpr (kPending) {
        // The first half of S and P V_{i-1} retired: this consumer's group of tile i - 1 (its V
        // half and the handoff it read) goes back to the producer, for tile i + 1.
        hx::wgmma_wait<1>();
        fence_pv_operands();
        release(i - 1);
      }
      hx::wgmma_wait<0>();
      hx::fence_operands(s);
      // 4. Softmax of S_i; P_i and m_i handed over.
#pragma unroll
      for (int e = 0; e < 32; ++e) s[e] *= scale_log2;
      if (masked(kpos0, keys_left)) {
        const int64_t dist[2] = {static_cast<int64_t>(q_off) + tq[0] - kpos0,
                                 static_cast<int64_t>(q_off) + tq[1] - kpos0};
        MaskTile(s, t4, dist, keys_left, p.causal, p.window);
      }
      float alpha[2];
      const bool rescale = sf::OnlineSoftmaxLazy(s, m_run, l_run, alpha);
      // The handoff goes into the other consumer's K block of this stage (its half group: read
      // by S_i's second half, retired).
      uint4* hp = reinterpret_cast<uint4*>(ss.k_rot[st] + (1 - c) * kColBlockBytes);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        sf::PackPFragment(s, kk, pa[kk]);
        hp[kk * 128 + ct] = make_uint4(pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3]);
      }
      if (t4 == 0) {
        ss.hand_m[st][row] = m_run[0];
        ss.hand_m[st][row + 8] = m_run[1];
      }
      // TMA refills these bytes (tile i + 2's K blocks) once the stage is released.
      hx::fence_proxy_async_shared();
      hx::mbar_arrive(bar_hand + 8 * st);
      // 5. P_i V_i.
      if (rescale) sf::RescaleRows(o, alpha);
      issue_pv(i);
      hx::wgmma_wait<0>();
      fence_pv_operands();
      release(i);
    };

    KeyTileCursor<kBlockN> tile = first_tile;
    int i = 0;
    if (c == 0) {  // tile 0: nothing before it
      own_tile(0, tile.kpos0(), tile.keys_left(), std::false_type{});
      tile.Advance();
      i = 1;
    }
    bool pending = false;  // the other consumer's latest tile, not yet added
    for (; tile.valid(); tile.Advance(), ++i) {
      if ((i & 1) != c) {
        pending = true;
        continue;
      }
      own_tile(i, tile.kpos0(), tile.keys_left(), std::true_type{});
      pending = false;
    }
    const int pending_tile = i - 1;  // the last tile
    if (pending) {  // the CTA's last tile is the other consumer's
      take_handoff(pending_tile);
      issue_pv(pending_tile);
      hx::wgmma_wait<0>();
      fence_pv_operands();
      release(pending_tile);
    }
  }

  // ---- Epilogue: row sums over the quad and both consumers, then O / l, and lse from
  // consumer 0.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
  if (t4 == 0) {
    ss.l[c][row] = l_run[0];
    ss.l[c][row + 8] = l_run[1];
  }
  px::named_barrier_sync(BarrierId(NamedBarrier::kConsumers), T::kConsumerThreads);
  l_run[0] += ss.l[1 - c][row];  // the same sum in both: fp32 + commutes
  l_run[1] += ss.l[1 - c][row + 8];
  att::StoreOutputRows<T::kD>(p, o, m_run, l_run, m0 + row, 256 * c, c == 0, t4, G, rows_total,
                              h, b);
#else
  __trap();  // built for sm_90a only; the launcher checks the device
#endif
}

}  // namespace

cudaError_t LaunchFlashAttentionD512Sm90RotaryKeys(const AttentionParams& p, cudaStream_t stream) {
  att::LaunchSetup l;
  if (const cudaError_t err = att::PrepareLaunch<T>(p, &l); err != cudaSuccess) return err;
  if (const cudaError_t err = att::PrepareKernel<T>(Flash512Sm90SeesawKernel, T::kSmemBytes);
      err != cudaSuccess) {
    return err;
  }
  const dim3 grid(static_cast<unsigned>(l.num_m_blocks), static_cast<unsigned>(p.hkv),
                  static_cast<unsigned>(p.batch));
  Flash512Sm90SeesawKernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(l.tm_q, l.tm_k, l.tm_v,
                                                                         p, l.num_m_blocks);
  return cudaGetLastError();
}

}  // namespace mila
